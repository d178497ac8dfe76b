//! `absent`: a path that must not exist.

use serde_json::{Map, Value, json};

use super::Mutation;
use super::{Diff, Node, Note, StepCtx};
use super::{Kind, Written, file_disruption};
use crate::parse::{Cx, join};
use crate::{Disruption, NodePath, Owner};
use inplace_base::StepError;
use inplace_base::{ErrorKind, Existing};

/// `absent`: a path that must not exist.
#[derive(Debug, Clone, PartialEq)]
pub struct AbsentChange {
    /// Absolute path on the node.
    pub path: NodePath,
    /// Units restarted when the file is removed.
    pub restart_units: Vec<String>,
}

impl Kind for AbsentChange {
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(path, m, &["path", "restartUnits"]);
        let p = cx
            .string(path, m, "path", true)
            .and_then(|s| cx.node_path(&join(path, "path"), s));
        if let Some(p) = &p {
            cx.claim(&join(path, "path"), format!("path:{p}"), p.as_str(), index);
        }
        let restart_units = cx.restart_units(path, m);
        Some(AbsentChange {
            path: p?,
            restart_units: restart_units?,
        })
    }

    fn canonical(&self, _bodies: bool) -> Value {
        json!({"path": self.path.as_str(), "restartUnits": self.restart_units})
    }

    fn target(&self) -> String {
        self.path.to_string()
    }

    fn restart_units(&self) -> Vec<String> {
        self.restart_units.clone()
    }

    fn restart_field(&self) -> Option<&'static str> {
        Some("restartUnits")
    }

    fn fed_units(&self) -> Vec<String> {
        self.restart_units.clone()
    }

    fn run_state(&self) -> Option<(&str, super::UnitState)> {
        None
    }

    fn declared_disruption(&self) -> Option<Disruption> {
        None
    }

    fn fed_by(&self, other: &super::Change) -> bool {
        let _ = other;
        false
    }

    fn writes(&self) -> Vec<Written> {
        vec![Written {
            field: "path",
            path: self.path.clone(),
            append: false,
            removes: true,
        }]
    }

    fn packages(&self) -> Vec<&str> {
        Vec::new()
    }

    fn disruption(&self) -> Disruption {
        file_disruption(&self.path, &self.restart_units)
    }

    fn needs_services(&self) -> bool {
        false
    }

    fn batchable(&self) -> bool {
        true
    }

    fn owner(&self) -> Option<&Owner> {
        None
    }

    fn preflight(&self, _node: &dyn Node) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    fn prepare(
        &self,
        _node: &dyn Node,
        _note: &mut dyn FnMut(Note),
    ) -> Result<Option<String>, StepError> {
        Ok(None)
    }

    fn undecided(&self, _node: &dyn Node) -> Option<String> {
        None
    }

    fn diff(&self, node: &dyn Node, _ctx: StepCtx) -> Result<Diff, StepError> {
        let mutations = match node.read(&self.path)? {
            Existing::Absent => Vec::new(),
            Existing::File { .. } => vec![Mutation::Remove {
                path: self.path.clone(),
            }],
            Existing::Other { kind } => {
                return Err(StepError::new(
                    ErrorKind::Precondition,
                    format!("{} is a {kind}, not a regular file", self.path),
                ));
            }
        };
        Ok(Diff {
            mutations,
            note: None,
        })
    }

    fn resolve(
        &self,
        _node: &dyn Node,
        _timeout: std::time::Duration,
        _refresh: bool,
        _note: &mut dyn FnMut(Note),
    ) -> Result<Option<Option<String>>, StepError> {
        Ok(None)
    }

    fn resolved(&self, _value: &str) -> Option<super::Change> {
        None
    }

    fn set_members(&self) -> Vec<NodePath> {
        Vec::new()
    }
}

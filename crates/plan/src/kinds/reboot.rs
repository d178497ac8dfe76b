//! `reboot`: reboot the node and resume after it. The engine carries it out (it journals the
//! boot id and waits to be taken down); it is needed only when a change since the previous
//! reboot (or the start of the plan) changed something, or when nothing precedes it.

use serde_json::{Map, Value, json};

use super::{Diff, Node, Note, StepCtx};
use super::{Kind, Written};
use crate::parse::Cx;
use crate::{Disruption, NodePath, Owner};
use inplace_base::StepError;

/// `reboot`: reboot the node and resume after it.
#[derive(Debug, Clone, PartialEq)]
pub struct RebootChange {
    /// Why, for people and the journal.
    pub reason: String,
}

impl Kind for RebootChange {
    fn parse(cx: &mut Cx<'_>, _index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(path, m, &["reason"]);
        let reason = cx
            .string(path, m, "reason", false)
            .unwrap_or("requested by plan")
            .to_string();
        Some(RebootChange { reason })
    }

    fn canonical(&self, _bodies: bool) -> Value {
        json!({"reason": self.reason})
    }

    fn target(&self) -> String {
        self.reason.clone()
    }

    fn restart_units(&self) -> Vec<String> {
        Vec::new()
    }

    fn restart_field(&self) -> Option<&'static str> {
        None
    }

    fn fed_units(&self) -> Vec<String> {
        Vec::new()
    }

    fn run_state(&self) -> Option<(&str, super::UnitState)> {
        None
    }

    fn declared_disruption(&self) -> Option<Disruption> {
        Some(Disruption::Reboot)
    }

    fn fed_by(&self, other: &super::Change) -> bool {
        let _ = other;
        false
    }

    fn writes(&self) -> Vec<Written> {
        Vec::new()
    }

    fn packages(&self) -> Vec<&str> {
        Vec::new()
    }

    fn disruption(&self) -> Disruption {
        Disruption::Reboot
    }

    fn needs_services(&self) -> bool {
        true
    }

    fn batchable(&self) -> bool {
        false
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

    fn diff(&self, _node: &dyn Node, _ctx: StepCtx) -> Result<Diff, StepError> {
        // The engine decides whether the reboot is needed (a change since the last one
        // changed something) and carries it out; as a change it asks for nothing else.
        Ok(Diff {
            mutations: Vec::new(),
            note: Some(format!("reboot: {}", self.reason)),
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

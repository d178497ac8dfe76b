//! `exec`: the escape hatch — run a command, unless a guard command says it is not needed.
//! Disabled unless the agent's configuration allows it (`exec.allow`).

use serde_json::{Map, Value, json};

use super::{Diff, Mutation, Node, Note, StepCtx};
use super::{Kind, Written, put_opt};
use crate::parse::{Cx, join};
use crate::{Disruption, NodePath, Owner};
use inplace_base::StepError;

/// `exec`: run a command (escape hatch; disabled by default).
#[derive(Debug, Clone, PartialEq)]
pub struct ExecChange {
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Run only when this command exits non-zero (makes the command idempotent).
    pub unless: Option<Vec<String>>,
    /// Declared disruption of running it.
    pub disruption: Disruption,
}

impl Kind for ExecChange {
    fn parse(cx: &mut Cx<'_>, _index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(path, m, &["argv", "unless", "disruption"]);
        let argv = cx.string_list(path, m, "argv")?;
        if argv.is_empty() {
            cx.err(join(path, "argv"), "must name a program");
            return None;
        }
        let unless = match m.get("unless") {
            None | Some(Value::Null) => None,
            Some(_) => Some(cx.string_list(path, m, "unless")?),
        };
        let disruption = match cx.string(path, m, "disruption", false) {
            None => Disruption::Restart,
            Some("None") => Disruption::None,
            Some("DaemonReload") => Disruption::DaemonReload,
            Some("Reload") => Disruption::Reload,
            Some("Restart") => Disruption::Restart,
            Some("Reboot") => Disruption::Reboot,
            Some(other) => {
                cx.err(
                    join(path, "disruption"),
                    format!("{other:?} is not one of None, DaemonReload, Reload, Restart, Reboot"),
                );
                return None;
            }
        };
        Some(ExecChange {
            argv,
            unless,
            disruption,
        })
    }

    fn canonical(&self, _bodies: bool) -> Value {
        let mut m = Map::new();
        m.insert("argv".into(), json!(self.argv));
        put_opt(&mut m, "unless", &self.unless);
        m.insert("disruption".into(), json!(self.disruption.to_string()));
        Value::Object(m)
    }

    fn target(&self) -> String {
        self.argv.join(" ")
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
        Some(self.disruption)
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
        self.disruption
    }

    fn needs_services(&self) -> bool {
        false
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

    fn diff(&self, node: &dyn Node, ctx: StepCtx) -> Result<Diff, StepError> {
        if let Some(unless) = &self.unless {
            let argv: Vec<&str> = unless.iter().map(String::as_str).collect();
            if node.query(&argv, ctx.step_timeout).is_ok() {
                return Ok(Diff {
                    mutations: Vec::new(),
                    note: Some(format!("not needed: {} exited 0", unless.join(" "))),
                });
            }
        }
        Ok(Diff {
            mutations: vec![Mutation::Run {
                argv: self.argv.clone(),
                timeout: ctx.step_timeout,
            }],
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

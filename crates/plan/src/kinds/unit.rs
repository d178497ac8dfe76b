//! `unit`: a systemd unit file or drop-in and its desired state — written under
//! `/etc/systemd/system`, enabled/disabled and masked/unmasked through systemd, and brought
//! to `running` or `stopped` in the Restarting phase after the daemon-reload.

use serde_json::{Map, Value, json};

use super::{Diff, Mutation, Node, Note, StepCtx};
use super::{Kind, Written, put_opt};
use crate::parse::{Cx, check_unit_name, join};
use crate::{Disruption, NodePath, Owner};
use inplace_base::StepError;
use inplace_base::units::{ActiveState, ObservedUnit as Observed, UnitFileOp, UnitFileState};
use inplace_base::{ErrorKind, Existing, FileMeta};

/// Where the agent writes unit files.
pub const UNIT_DIR: &str = "/etc/systemd/system";

/// Directories systemd loads system units from: a file written or removed below one of them
/// takes a daemon-reload to take effect.
pub const UNIT_DIRS: &[&str] = &[
    "/etc/systemd/system",
    "/run/systemd/system",
    "/usr/local/lib/systemd/system",
    "/usr/lib/systemd/system",
    "/lib/systemd/system",
];

/// `unit`: a systemd unit file or drop-in and its desired state.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitChange {
    /// Unit name (`containerd.service`).
    pub name: String,
    /// Full unit file content, written to `/etc/systemd/system/<name>`.
    pub content: Option<String>,
    /// A drop-in written to `/etc/systemd/system/<name>.d/<dropIn.name>`.
    pub drop_in: Option<DropIn>,
    /// Enable or disable the unit file; `None` leaves it.
    pub enabled: Option<bool>,
    /// Running or stopped; `None` leaves it.
    pub state: Option<UnitState>,
    /// Mask or unmask; `None` leaves it.
    pub masked: Option<bool>,
}

/// A systemd drop-in file.
#[derive(Debug, Clone, PartialEq)]
pub struct DropIn {
    /// File name, ending in `.conf`.
    pub name: String,
    /// Content.
    pub content: String,
}

/// Desired run state of a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnitState {
    /// Active.
    Running,
    /// Inactive.
    Stopped,
}

/// `/etc/systemd/system/<name>`.
pub fn unit_file_path(name: &str) -> Option<NodePath> {
    NodePath::parse(&format!("{UNIT_DIR}/{name}")).ok()
}

/// `/etc/systemd/system/<name>.d/<drop_in>`.
pub fn drop_in_path(name: &str, drop_in: &str) -> Option<NodePath> {
    NodePath::parse(&format!("{UNIT_DIR}/{name}.d/{drop_in}")).ok()
}

/// True for a path systemd loads units from (a change to it needs a daemon-reload).
pub fn is_unit_path(path: &NodePath) -> bool {
    UNIT_DIRS.iter().any(|dir| {
        path.as_str()
            .strip_prefix(dir)
            .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// Why unit changes cannot run on an agent without service management.
pub fn services_off() -> StepError {
    StepError::new(
        ErrorKind::Unsupported,
        "unit changes need service management, which is off on this agent (--services off)",
    )
}

/// What the node looks like for one unit change.
#[derive(Debug, Clone)]
pub struct Observation {
    /// What is at the unit file path.
    pub file: Existing,
    /// What is at the drop-in path.
    pub drop_in: Existing,
    /// The unit file state (`None`: systemd knows no unit file of that name).
    pub file_state: Option<UnitFileState>,
    /// The unit's state, read only when the change sets `state`.
    pub unit: Option<Observed>,
}

/// True when a unit counts as running for `state: running` (active, reloading, or starting
/// — but not waiting to be restarted after a failure).
pub fn is_running(unit: &Observed) -> bool {
    unit.is_active()
        || (unit.active_state == ActiveState::Activating && unit.sub_state != "auto-restart")
}

/// True when a unit counts as stopped for `state: stopped` (inactive or failed).
pub fn is_stopped(unit: &Observed) -> bool {
    matches!(
        unit.active_state,
        ActiveState::Inactive | ActiveState::Failed
    )
}

/// The mutations a unit change needs, given what is on the node (pure). `ids` owns the files
/// the agent writes (the node's `root:root`).
pub fn unit_mutations(
    change: &UnitChange,
    seen: &Observation,
    ids: (u32, u32),
) -> Result<Vec<Mutation>, String> {
    let name = &change.name;
    let mut out = Vec::new();
    let masked_now = matches!(seen.file_state, Some(UnitFileState::Masked));
    if matches!(seen.file_state, Some(UnitFileState::MaskedRuntime)) && change.masked.is_some() {
        return Err(format!(
            "{name} is masked at runtime (in /run/systemd/system); the agent manages masks in \
             {UNIT_DIR} only"
        ));
    }
    if change.masked == Some(false) && masked_now {
        out.push(Mutation::UnitFile {
            unit: name.clone(),
            op: UnitFileOp::Unmask,
        });
    }
    let meta = FileMeta {
        mode: 0o644,
        uid: ids.0,
        gid: ids.1,
    };
    let mut write = |path: Option<NodePath>, content: &str, existing: &Existing| {
        let path = path.ok_or_else(|| format!("{name}: no valid unit file path"))?;
        let same = matches!(existing, Existing::File { content: c, meta: m }
            if c.as_slice() == content.as_bytes() && *m == meta);
        if let Existing::Other { kind } = existing {
            return Err(format!("{path} is a {kind} on the node, not a unit file"));
        }
        if !same {
            out.push(Mutation::Write {
                path,
                content: bytes::Bytes::copy_from_slice(content.as_bytes()),
                meta,
            });
        }
        Ok(())
    };
    if let Some(content) = &change.content {
        if masked_now {
            return Err(format!(
                "{name} is masked (linked to /dev/null in {UNIT_DIR}); its unit file cannot be \
                 written while it is masked: unmask it first (masked: false, in an earlier plan)"
            ));
        }
        write(unit_file_path(name), content, &seen.file)?;
    }
    if let Some(d) = &change.drop_in {
        write(drop_in_path(name, &d.name), &d.content, &seen.drop_in)?;
    }
    if let Some(want) = change.enabled {
        let enabled = matches!(seen.file_state, Some(UnitFileState::Enabled));
        if want && !enabled {
            match &seen.file_state {
                Some(
                    s @ (UnitFileState::Static
                    | UnitFileState::Indirect
                    | UnitFileState::Generated
                    | UnitFileState::Transient
                    | UnitFileState::Alias),
                ) if change.content.is_none() => {
                    return Err(format!(
                        "{name} is {s}: it has no [Install] section of its own, so it cannot be \
                         enabled"
                    ));
                }
                None if change.content.is_none() => {
                    return Err(format!(
                        "{name}: no such unit file on the node, so it cannot be enabled (give \
                         its content)"
                    ));
                }
                _ => {}
            }
            out.push(Mutation::UnitFile {
                unit: name.clone(),
                op: UnitFileOp::Enable,
            });
        } else if !want && enabled {
            out.push(Mutation::UnitFile {
                unit: name.clone(),
                op: UnitFileOp::Disable,
            });
        }
    }
    if change.masked == Some(true) && !masked_now {
        out.push(Mutation::UnitFile {
            unit: name.clone(),
            op: UnitFileOp::Mask,
        });
    }
    if let (Some(want), Some(unit)) = (change.state, &seen.unit) {
        let needed = match want {
            UnitState::Running => !is_running(unit),
            UnitState::Stopped => !is_stopped(unit),
        };
        if needed {
            out.push(Mutation::UnitRun {
                unit: name.clone(),
                state: want,
            });
        }
    }
    Ok(out)
}

impl Kind for UnitChange {
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(
            path,
            m,
            &["name", "content", "dropIn", "enabled", "state", "masked"],
        );
        let before = cx.errors.len();
        let name = cx.string(path, m, "name", true).map(str::to_string);
        if let Some(n) = &name
            && let Err(e) = check_unit_name(n)
        {
            cx.err(join(path, "name"), e);
        }
        let content = cx.string(path, m, "content", false).map(str::to_string);
        if let Some(c) = &content {
            cx.content_size(&join(path, "content"), c.len());
        }
        let drop_in = match m.get("dropIn") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let dpath = join(path, "dropIn");
                cx.object(&dpath, v).and_then(|d| {
                    cx.known_keys(&dpath, d, &["name", "content"]);
                    let dname = cx.string(&dpath, d, "name", true).map(str::to_string);
                    if let Some(dn) = &dname
                        && (!dn.ends_with(".conf")
                            || dn.contains('/')
                            || dn.len() > 255
                            || dn.starts_with('.'))
                    {
                        cx.err(
                            join(&dpath, "name"),
                            format!("{dn:?} must be a file name ending in .conf"),
                        );
                    }
                    let dcontent = cx.string(&dpath, d, "content", true).map(str::to_string);
                    if let Some(c) = &dcontent {
                        cx.content_size(&join(&dpath, "content"), c.len());
                    }
                    Some(DropIn {
                        name: dname?,
                        content: dcontent?,
                    })
                })
            }
        };
        let enabled = cx.boolean(path, m, "enabled");
        let masked = cx.boolean(path, m, "masked");
        let state = match cx.string(path, m, "state", false) {
            None => None,
            Some("running") => Some(UnitState::Running),
            Some("stopped") => Some(UnitState::Stopped),
            Some(other) => {
                cx.err(
                    join(path, "state"),
                    format!("{other:?} is not one of running, stopped"),
                );
                None
            }
        };
        if content.is_none()
            && drop_in.is_none()
            && enabled.is_none()
            && state.is_none()
            && masked.is_none()
        {
            cx.err(
                path,
                "must set at least one of content, dropIn, enabled, state, masked",
            );
        }
        if masked == Some(true) {
            if content.is_some() {
                cx.err(
                    join(path, "masked"),
                    "a masked unit cannot also have content",
                );
            }
            if state == Some(UnitState::Running) || enabled == Some(true) {
                cx.err(
                    join(path, "masked"),
                    "a masked unit cannot be enabled or running",
                );
            }
        }
        if cx.errors.len() > before {
            return None;
        }
        let name = name?;
        let unit_dir = NodePath::parse(UNIT_DIR).ok()?;
        if let Ok(file) = unit_dir.join(&name) {
            if content.is_some() || masked.is_some() {
                cx.node_path(&join(path, "name"), file.as_str())?;
                cx.claim(
                    &join(path, "name"),
                    format!("path:{file}"),
                    file.as_str(),
                    index,
                );
            }
            if let Some(d) = &drop_in
                && let Ok(dp) = unit_dir
                    .join(&format!("{name}.d"))
                    .and_then(|dir| dir.join(&d.name))
            {
                cx.node_path(&join(path, "dropIn"), dp.as_str())?;
                cx.claim(
                    &join(path, "dropIn"),
                    format!("path:{dp}"),
                    dp.as_str(),
                    index,
                );
            }
        }
        if enabled.is_some() || state.is_some() || masked.is_some() {
            cx.claim(
                path,
                format!("unit-state:{name}"),
                &format!("state of {name}"),
                index,
            );
        }
        Some(UnitChange {
            name,
            content,
            drop_in,
            enabled,
            state,
            masked,
        })
    }

    fn canonical(&self, _bodies: bool) -> Value {
        let mut m = Map::new();
        m.insert("name".into(), json!(self.name));
        put_opt(&mut m, "content", &self.content);
        if let Some(d) = &self.drop_in {
            m.insert(
                "dropIn".into(),
                json!({"name": d.name, "content": d.content}),
            );
        }
        put_opt(&mut m, "enabled", &self.enabled);
        if let Some(s) = self.state {
            let s = match s {
                UnitState::Running => "running",
                UnitState::Stopped => "stopped",
            };
            m.insert("state".into(), json!(s));
        }
        put_opt(&mut m, "masked", &self.masked);
        Value::Object(m)
    }

    fn target(&self) -> String {
        match &self.drop_in {
            Some(d) => format!("{}.d/{}", self.name, d.name),
            None => self.name.clone(),
        }
    }

    fn restart_units(&self) -> Vec<String> {
        if self.state == Some(UnitState::Stopped) {
            Vec::new()
        } else {
            vec![self.name.clone()]
        }
    }

    fn restart_field(&self) -> Option<&'static str> {
        Some("name")
    }

    fn fed_units(&self) -> Vec<String> {
        vec![self.name.clone()]
    }

    fn run_state(&self) -> Option<(&str, super::UnitState)> {
        self.state.map(|s| (self.name.as_str(), s))
    }

    fn declared_disruption(&self) -> Option<Disruption> {
        None
    }

    fn fed_by(&self, other: &super::Change) -> bool {
        let _ = other;
        false
    }

    fn writes(&self) -> Vec<Written> {
        let mut out = Vec::new();
        if self.content.is_some()
            && let Some(p) = unit_file_path(&self.name)
        {
            out.push(Written::replaces("name", p));
        }
        if let Some(d) = &self.drop_in
            && let Some(p) = drop_in_path(&self.name, &d.name)
        {
            out.push(Written::replaces("dropIn", p));
        }
        out
    }

    fn packages(&self) -> Vec<&str> {
        Vec::new()
    }

    fn disruption(&self) -> Disruption {
        if self.content.is_some() || self.drop_in.is_some() || self.state.is_some() {
            Disruption::Restart
        } else {
            Disruption::DaemonReload
        }
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

    fn diff(&self, node: &dyn Node, ctx: StepCtx) -> Result<Diff, StepError> {
        if !node.services_on() {
            return Err(services_off());
        }
        let file_state = node.unit_file_state(&self.name)?;
        let read = |path: Option<NodePath>, wanted: bool| -> Result<Existing, StepError> {
            match path {
                Some(p) if wanted && !matches!(file_state, Some(UnitFileState::Masked)) => {
                    node.read(&p)
                }
                _ => Ok(Existing::Absent),
            }
        };
        let file = read(unit_file_path(&self.name), self.content.is_some())?;
        let drop_in = read(
            self.drop_in
                .as_ref()
                .and_then(|d| drop_in_path(&self.name, &d.name)),
            self.drop_in.is_some(),
        )?;
        let unit = match self.state {
            Some(_) => Some(node.unit_state(&self.name)?),
            None => None,
        };
        let seen = Observation {
            file,
            drop_in,
            file_state,
            unit,
        };
        let mutations = unit_mutations(self, &seen, ctx.root_ids)
            .map_err(|e| StepError::new(ErrorKind::Precondition, e))?;
        let note = match (&seen.unit, self.state) {
            (Some(u), Some(_)) if mutations.is_empty() => Some(format!(
                "already in the desired state ({} {}/{})",
                self.name, u.active_state, u.sub_state
            )),
            _ => None,
        };
        Ok(Diff { mutations, note })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DropIn;
    use inplace_base::units::LoadState;

    fn change() -> UnitChange {
        UnitChange {
            name: "hello.service".into(),
            content: None,
            drop_in: None,
            enabled: None,
            state: None,
            masked: None,
        }
    }

    fn unit(active: &str, sub: &str) -> Observed {
        Observed {
            unit: "hello.service".into(),
            load_state: LoadState::Loaded,
            active_state: ActiveState::parse(active),
            sub_state: sub.into(),
            result: Some("success".into()),
            invocation_id: None,
            n_restarts: Some(0),
            status_text: None,
            main_pid: None,
            job: None,
        }
    }

    fn seen(file_state: Option<UnitFileState>, unit: Option<Observed>) -> Observation {
        Observation {
            file: Existing::Absent,
            drop_in: Existing::Absent,
            file_state,
            unit,
        }
    }

    fn describe(m: &[Mutation]) -> Vec<String> {
        m.iter().map(Mutation::describe).collect()
    }

    #[test]
    fn a_new_enabled_running_unit_is_written_enabled_then_started() {
        let mut c = change();
        c.content = Some("[Service]\nExecStart=/bin/true\n".into());
        c.enabled = Some(true);
        c.state = Some(UnitState::Running);
        let mut s = seen(None, Some(unit("inactive", "dead")));
        s.unit.as_mut().unwrap().load_state = LoadState::NotFound;
        let m = unit_mutations(&c, &s, (0, 0)).unwrap();
        assert_eq!(
            describe(&m),
            [
                "write /etc/systemd/system/hello.service (30 bytes, 0644 0:0)",
                "enable hello.service",
                "start hello.service (after the daemon-reload)",
            ]
        );
    }

    #[test]
    fn nothing_when_the_node_already_matches() {
        let mut c = change();
        c.content = Some("x".into());
        c.drop_in = Some(DropIn {
            name: "10-a.conf".into(),
            content: "y".into(),
        });
        c.enabled = Some(true);
        c.state = Some(UnitState::Running);
        let meta = FileMeta {
            mode: 0o644,
            uid: 0,
            gid: 0,
        };
        let s = Observation {
            file: Existing::File {
                content: b"x".to_vec(),
                meta,
            },
            drop_in: Existing::File {
                content: b"y".to_vec(),
                meta,
            },
            file_state: Some(UnitFileState::Enabled),
            unit: Some(unit("active", "running")),
        };
        assert!(unit_mutations(&c, &s, (0, 0)).unwrap().is_empty());
        // A different owner is a difference too.
        assert_eq!(unit_mutations(&c, &s, (0, 5)).unwrap().len(), 2);
    }

    #[test]
    fn disable_stop_mask_and_unmask() {
        let mut c = change();
        c.enabled = Some(false);
        c.state = Some(UnitState::Stopped);
        let s = seen(
            Some(UnitFileState::Enabled),
            Some(unit("active", "running")),
        );
        assert_eq!(
            describe(&unit_mutations(&c, &s, (0, 0)).unwrap()),
            [
                "disable hello.service",
                "stop hello.service (after the daemon-reload)"
            ]
        );
        // A failed unit is stopped already; a starting one is not.
        let failed = seen(
            Some(UnitFileState::Disabled),
            Some(unit("failed", "failed")),
        );
        assert!(unit_mutations(&c, &failed, (0, 0)).unwrap().is_empty());
        let starting = seen(
            Some(UnitFileState::Disabled),
            Some(unit("activating", "start")),
        );
        assert_eq!(unit_mutations(&c, &starting, (0, 0)).unwrap().len(), 1);

        let mut m = change();
        m.masked = Some(true);
        let s = seen(Some(UnitFileState::Disabled), None);
        assert_eq!(
            describe(&unit_mutations(&m, &s, (0, 0)).unwrap()),
            ["mask hello.service"]
        );
        let s = seen(Some(UnitFileState::Masked), None);
        assert!(unit_mutations(&m, &s, (0, 0)).unwrap().is_empty());
        m.masked = Some(false);
        assert_eq!(
            describe(&unit_mutations(&m, &s, (0, 0)).unwrap()),
            ["unmask hello.service"]
        );
    }

    #[test]
    fn a_unit_restarting_after_a_failure_is_not_running() {
        let mut c = change();
        c.state = Some(UnitState::Running);
        let s = seen(
            Some(UnitFileState::Enabled),
            Some(unit("activating", "auto-restart")),
        );
        assert_eq!(unit_mutations(&c, &s, (0, 0)).unwrap().len(), 1);
        let s = seen(
            Some(UnitFileState::Enabled),
            Some(unit("activating", "start")),
        );
        assert!(unit_mutations(&c, &s, (0, 0)).unwrap().is_empty());
    }

    #[test]
    fn refusals_name_the_unit_and_the_reason() {
        let mut c = change();
        c.content = Some("x".into());
        let err = unit_mutations(&c, &seen(Some(UnitFileState::Masked), None), (0, 0))
            .expect_err("masked");
        assert!(err.starts_with("hello.service is masked"), "{err}");
        let mut e = change();
        e.enabled = Some(true);
        let err = unit_mutations(&e, &seen(Some(UnitFileState::Static), None), (0, 0))
            .expect_err("static");
        assert!(err.contains("is static"), "{err}");
        let err = unit_mutations(&e, &seen(None, None), (0, 0)).expect_err("no file");
        assert!(err.contains("no such unit file"), "{err}");
        let mut m = change();
        m.masked = Some(false);
        let err = unit_mutations(&m, &seen(Some(UnitFileState::MaskedRuntime), None), (0, 0))
            .expect_err("runtime mask");
        assert!(err.contains("masked at runtime"), "{err}");
    }

    #[test]
    fn unit_paths_are_recognised() {
        for p in [
            "/etc/systemd/system/kubelet.service",
            "/etc/systemd/system/kubelet.service.d/10-kubeadm.conf",
            "/lib/systemd/system/x.service",
            "/usr/lib/systemd/system/x.socket",
        ] {
            assert!(is_unit_path(&NodePath::parse(p).unwrap()), "{p}");
        }
        for p in [
            "/etc/systemd/systemx/a.service",
            "/etc/systemd/system.conf",
            "/etc/kubernetes/kubelet.conf",
        ] {
            assert!(!is_unit_path(&NodePath::parse(p).unwrap()), "{p}");
        }
    }
}

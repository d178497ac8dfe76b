//! `inplace-agent status` without `--addr`: the local agent's status socket, rendered for a
//! person (what is running, how far, for how long, the last failure and the step that
//! failed), as JSON, or followed with `--watch`. When no agent answers on the socket it reads
//! the journal directly (read-only, without the journal's lock) and says so.

use inplace_base::time::now_ms;
use inplace_base::time::rfc3339;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::Exit;
use super::remote::{
    AgentChoice, RemoteOutput, SnapshotView, StatusArgs, describe, hook_response_json,
};
use crate::config::{
    ConfigError, DEFAULT_CONFIG_PATH, DEFAULT_STATE_SUBDIR, SettingsInput, default_status_socket,
    load_config,
};
use crate::engine::state::PlanStatus;
use crate::engine::table::Table;
use crate::status::api::{
    self, AgentStatus, Context, NodeInfo, PlanStatusDocument, PlanSummary, Source,
};
use crate::status::client::{self, ClientError};

/// How long one request to the socket may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How often `--watch` asks.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// Where the local agent and its journal are.
#[derive(Debug, Clone)]
pub struct Local {
    /// The status socket.
    pub socket: PathBuf,
    /// The state directory, whose journal is read when no agent answers.
    pub state_dir: PathBuf,
    /// The node's root.
    pub root: PathBuf,
    /// The node's name, when the flags or the configuration say.
    pub node_name: Option<String>,
    /// Where [`Local::node_name`] came from (`--node-name`, `node.name in FILE`).
    pub node_name_from: String,
    /// The configuration file's node settings with the flags over them: what a check made
    /// here (`drift` with no agent serving) uses, as the agent would.
    pub settings: SettingsInput,
}

impl Local {
    /// Flags first, then the agent's configuration file, then the defaults.
    pub fn resolve(args: &AgentChoice) -> Result<Local, ConfigError> {
        let (file, file_path) = match &args.config {
            Some(path) => (Some(load_config(path)?), path.display().to_string()),
            None if Path::new(DEFAULT_CONFIG_PATH).exists() => {
                match load_config(Path::new(DEFAULT_CONFIG_PATH)) {
                    Ok(input) => (Some(input), DEFAULT_CONFIG_PATH.to_string()),
                    Err(e) => {
                        errln!("warning: {e}; using the defaults");
                        (None, String::new())
                    }
                }
            }
            None => (None, String::new()),
        };
        let file = file.unwrap_or_default();
        let root = args
            .root
            .clone()
            .or(file.settings.root.clone())
            .unwrap_or_else(|| PathBuf::from("/"));
        let socket = args
            .socket
            .clone()
            .or(file.status_socket.clone())
            .unwrap_or_else(|| default_status_socket(&root));
        let state_dir = args
            .state_dir
            .clone()
            .or(file.settings.state_dir.clone())
            .unwrap_or_else(|| root.join(DEFAULT_STATE_SUBDIR));
        let (node_name, node_name_from) = match (&args.node_name, &file.settings.node_name) {
            (Some(name), _) => (Some(name.clone()), "--node-name".to_string()),
            (None, Some(name)) => (Some(name.clone()), format!("node.name in {file_path}")),
            (None, None) => (None, String::new()),
        };
        let settings = SettingsInput {
            root: Some(root.clone()),
            state_dir: Some(state_dir.clone()),
            node_name: node_name.clone(),
            ..file.settings
        };
        Ok(Local {
            socket,
            state_dir,
            root,
            node_name,
            node_name_from,
            settings,
        })
    }

    /// The node's name for a status read from the journal, and a note when the sources
    /// disagree: the flags or the configuration, else the newest succeeded plan's
    /// `nodeName`, else the root's `/etc/hostname`.
    fn name_from_journal(&self, table: &Table) -> (String, Option<String>) {
        let planned = table.baseline().and_then(|b| {
            let doc = b.kept.doc.to_value();
            let name = doc.get("nodeName")?.as_str()?.to_string();
            let id = table.by_run(b.kept.run).map(|s| s.id.clone())?;
            Some((name, id))
        });
        match (&self.node_name, planned) {
            (Some(name), Some((other, id))) if *name != other => (
                name.clone(),
                Some(format!(
                    "note: node name {name} is from {}; the last plan that succeeded here \
                     ({id}) names node {other}",
                    self.node_name_from
                )),
            ),
            (Some(name), _) => (name.clone(), None),
            (None, Some((name, _))) => (name, None),
            (None, None) => (
                crate::host::node::hostname(&self.root).unwrap_or_default(),
                None,
            ),
        }
    }
}

/// What was asked for.
enum Doc {
    Agent(Box<AgentStatus>),
    Plan(Box<PlanStatusDocument>),
}

/// Asks the socket; when no agent serves there, folds the journal. `Err` is the exit code
/// (the error is printed).
fn fetch(local: &Local, id: Option<&str>, quiet_fallback: bool) -> Result<Doc, Exit> {
    let target = match id {
        Some(id) => format!("/v1/plans/{}", percent_encode(id)),
        None => "/v1/status".to_string(),
    };
    match client::get(&local.socket, &target, REQUEST_TIMEOUT) {
        Ok(r) if r.status == 200 => {
            let parsed = match id {
                Some(_) => serde_json::from_slice(&r.body).map(|p| Doc::Plan(Box::new(p))),
                None => serde_json::from_slice(&r.body).map(|a| Doc::Agent(Box::new(a))),
            };
            parsed.map_err(|e| {
                errln!(
                    "error: the agent's answer on {}: {e}",
                    local.socket.display()
                );
                Exit::Failed
            })
        }
        Ok(r) => {
            let message = serde_json::from_slice::<api::ErrorDocument>(&r.body)
                .map(|d| d.message)
                .unwrap_or_else(|_| String::from_utf8_lossy(&r.body).trim().to_string());
            errln!("error: {message}");
            Err(Exit::Failed)
        }
        Err(ClientError::NotServing { .. }) => {
            if !quiet_fallback {
                errln!(
                    "no agent is serving on {}; read the journal {} directly (read-only; a \
                     plan applied by `inplace-agent apply` right now may be ahead of it)",
                    local.socket.display(),
                    crate::journal::file_path(&local.state_dir).display()
                );
            }
            from_journal(local, id)
        }
        Err(e) => {
            errln!("error: {e}");
            Err(Exit::Failed)
        }
    }
}

fn from_journal(local: &Local, id: Option<&str>) -> Result<Doc, Exit> {
    let (table, journal) = api::read_journal(&local.state_dir, usize::MAX).map_err(|e| {
        errln!("error: read the journal: {e}");
        Exit::Failed
    })?;
    match id {
        Some(id) => match table.latest(id) {
            Some(s) => Ok(Doc::Plan(Box::new(PlanStatusDocument::new(s.clone())))),
            None => {
                errln!("error: no plan with id {id:?} is in the journal");
                Err(Exit::Failed)
            }
        },
        None => {
            let (name, note) = local.name_from_journal(&table);
            if let Some(note) = note {
                errln!("{note}");
            }
            let node = NodeInfo {
                name,
                root: local.root.display().to_string(),
                ..NodeInfo::default()
            };
            let ctx = Context {
                source: Source::Journal,
                node,
                agent: None,
                services: String::new(),
                journal,
                drift: None,
            };
            Ok(Doc::Agent(Box::new(api::agent_status(
                &table,
                ctx,
                now_ms(),
            ))))
        }
    }
}

/// Percent-encodes a plan id for a URL path.
fn percent_encode(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `inplace-agent status` against the local agent.
pub fn local(args: &StatusArgs) -> Exit {
    let local = match Local::resolve(&args.agent) {
        Ok(l) => l,
        Err(e) => return super::fail(&e.into()),
    };
    if args.healthz {
        return healthz(&local);
    }
    let doc = match fetch(&local, args.id.as_deref(), false) {
        Ok(d) => d,
        Err(code) => return code,
    };
    if args.watch {
        let id = match &doc {
            Doc::Plan(p) => Some(p.status.id.clone()),
            Doc::Agent(a) => a.current.as_ref().map(|c| c.id.clone()),
        };
        match id {
            Some(id) => return watch(&local, &id, args),
            None => errln!("no plan is running; nothing to watch"),
        }
    }
    print(&local, doc, args.output)
}

/// `status --healthz`: whether the agent serves its status socket, without any fallback.
fn healthz(local: &Local) -> Exit {
    match client::get(&local.socket, "/healthz", REQUEST_TIMEOUT) {
        Ok(r) if r.status == 200 => {
            outln!("{}", String::from_utf8_lossy(&r.body).trim());
            Exit::Ok
        }
        Ok(r) => {
            errln!(
                "error: {} answered /healthz with {}",
                local.socket.display(),
                r.status
            );
            Exit::Failed
        }
        Err(e) => {
            errln!("error: {e}");
            Exit::Failed
        }
    }
}

/// Prints a document in the chosen format and returns the exit code: 1 when the plan shown
/// (or, for the agent, the current plan, else the most recent one) did not succeed.
fn print(local: &Local, doc: Doc, output: RemoteOutput) -> Exit {
    match (doc, output) {
        (Doc::Plan(p), RemoteOutput::Json) => {
            outln!("{}", serde_json::to_string_pretty(&p).unwrap_or_default());
            Exit::of_phase(p.status.phase.into())
        }
        (Doc::Plan(p), RemoteOutput::HookResponse) => {
            let hook = p.hook_response.clone().into();
            outln!(
                "{}",
                hook_response_json(&crate::rpc::replies::hook_response_to_pb(&hook))
            );
            Exit::of_phase(p.status.phase.into())
        }
        (Doc::Plan(p), RemoteOutput::Text) => {
            let status = PlanStatus::from(p.status);
            outln!("{}", describe(&status));
            Exit::of_phase(status.phase)
        }
        (Doc::Agent(a), RemoteOutput::Json) => {
            outln!("{}", serde_json::to_string_pretty(&a).unwrap_or_default());
            agent_exit(&a)
        }
        (Doc::Agent(a), RemoteOutput::HookResponse) => {
            let id = a
                .current
                .as_ref()
                .map(|c| c.id.clone())
                .or_else(|| a.recent.first().map(|r| r.id.clone()));
            let Some(id) = id else {
                errln!("error: no plan is known; nothing to answer for");
                return Exit::Failed;
            };
            match fetch(local, Some(&id), true) {
                Ok(doc) => print(local, doc, RemoteOutput::HookResponse),
                Err(code) => code,
            }
        }
        (Doc::Agent(a), RemoteOutput::Text) => {
            outln!("{}", render(&a, now_ms()));
            agent_exit(&a)
        }
    }
}

fn agent_exit(a: &AgentStatus) -> Exit {
    if a.current.is_some() {
        return Exit::Ok;
    }
    a.recent
        .first()
        .map_or(Exit::Ok, |r| Exit::of_phase(r.phase.into()))
}

/// Follows plan `id` until it ends: a progress bar on a terminal, a line per step otherwise;
/// then the plan's status. Waits for an agent that went away (restart, reboot).
fn watch(local: &Local, id: &str, args: &StatusArgs) -> Exit {
    let mut view = SnapshotView::new(args.no_progress);
    let mut lost = false;
    let mut last: Option<PlanStatus> = None;
    loop {
        let started = Instant::now();
        match client::get(
            &local.socket,
            &format!("/v1/plans/{}", percent_encode(id)),
            REQUEST_TIMEOUT,
        ) {
            Ok(r) if r.status == 200 => {
                if lost {
                    view.line("  (the agent answers again; following the plan from its status)");
                }
                lost = false;
                let doc: PlanStatusDocument = match serde_json::from_slice(&r.body) {
                    Ok(d) => d,
                    Err(e) => {
                        errln!("error: the agent's answer: {e}");
                        return Exit::Failed;
                    }
                };
                let status = PlanStatus::from(doc.status.clone());
                let done = status.phase.is_terminal();
                if last.as_ref() != Some(&status) {
                    view.show(status.clone());
                    last = Some(status);
                }
                if done {
                    return print(local, Doc::Plan(Box::new(doc)), args.output);
                }
            }
            Ok(r) => {
                errln!(
                    "error: {}",
                    serde_json::from_slice::<api::ErrorDocument>(&r.body)
                        .map(|d| d.message)
                        .unwrap_or_else(|_| format!("the agent answered {}", r.status))
                );
                return Exit::Failed;
            }
            Err(ClientError::NotServing { .. }) => {
                if !lost {
                    view.line(&format!(
                        "  (the agent stopped answering on {}; waiting for it)",
                        local.socket.display()
                    ));
                    lost = true;
                }
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
            Err(e) => {
                errln!("error: {e}");
                return Exit::Failed;
            }
        }
        std::thread::sleep(WATCH_EVERY.saturating_sub(started.elapsed()));
    }
}

/// `850ms`, `12.3s`, `4m05s`, `2h03m`.
pub fn duration(ms: u64) -> String {
    match ms {
        0..1000 => format!("{ms}ms"),
        1000..60_000 => format!("{:.1}s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{}m{:02}s", ms / 60_000, ms / 1000 % 60),
        _ => format!("{}h{:02}m", ms / 3_600_000, ms / 60_000 % 60),
    }
}

fn bytes(n: u64) -> String {
    match n {
        0..1024 => format!("{n} B"),
        1024..1_048_576 => format!("{:.1} KiB", n as f64 / 1024.0),
        _ => format!("{:.1} MiB", n as f64 / 1_048_576.0),
    }
}

fn short(digest: &str) -> &str {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    &hex[..hex.len().min(12)]
}

fn outcome(p: &PlanSummary) -> String {
    let c = p.counts;
    let mut s = format!("{} changed, {} unchanged", c.changed, c.unchanged);
    if c.rolled_back > 0 {
        s.push_str(&format!(", {} rolled back", c.rolled_back));
    }
    if let Some(e) = &p.error {
        s.push_str(&format!("; {e}"));
    }
    s
}

/// The agent's status for a person.
pub fn render(a: &AgentStatus, now: u64) -> String {
    let mut out = Vec::new();
    let node = &a.node;
    let mut about = Vec::new();
    if !node.os_pretty_name.is_empty() {
        about.push(node.os_pretty_name.clone());
    }
    if !node.kubelet_version.is_empty() {
        about.push(format!("kubelet {}", node.kubelet_version));
    }
    let name = if node.name.is_empty() {
        "(name unknown: --node-name or node.name says it)"
    } else {
        &node.name
    };
    let about = if about.is_empty() {
        String::new()
    } else {
        format!(" ({})", about.join(", "))
    };
    match (&a.agent, a.source) {
        (Some(agent), _) => out.push(format!(
            "node {name}{about}: inplace-agent {} (commit {}) pid {}, up {}, gRPC on {}",
            agent.version,
            agent.commit,
            agent.pid,
            duration(agent.uptime_seconds * 1000),
            agent.grpc_listen
        )),
        (None, _) => out.push(format!(
            "node {name}{about}: no agent running (read from the journal)"
        )),
    }
    if !a.services.is_empty() {
        out.push(format!("services: {}", a.services));
    }
    out.push(format!(
        "journal: {}, {} records, {} (last seq {})",
        a.journal.path,
        a.journal.records,
        bytes(a.journal.bytes),
        a.journal.last_seq
    ));
    out.push(String::new());
    match &a.current {
        Some(c) if a.agent.is_none() => {
            // Read from the journal: nothing runs it now.
            out.push(format!(
                "unfinished: plan {} attempt {} ({}), from {}",
                c.id,
                c.attempt,
                short(&c.digest),
                c.source
            ));
            out.push(format!(
                "  the agent is not running: the plan stopped in {}, step {}/{}",
                c.phase, c.step, c.steps
            ));
            if let Some(at) = &c.resumes_at {
                out.push(format!(
                    "  it resumes at {at} when the agent starts (systemctl start inplace-agent)"
                ));
            }
            if let Some(e) = &c.error {
                out.push(format!("  rolling back after ({}): {e}", e.kind.as_str()));
            }
            for e in &c.events {
                out.push(format!("  {}: {}", rfc3339(e.at_ms), e.message));
            }
        }
        Some(c) => {
            out.push(format!(
                "running: plan {} attempt {} ({}), from {}",
                c.id,
                c.attempt,
                short(&c.digest),
                c.source
            ));
            let pct = (c.step * 100)
                .checked_div(c.steps)
                .map(|p| format!(" ({p}%)"))
                .unwrap_or_default();
            let elapsed = c
                .elapsed_ms
                .map(|ms| format!(", for {}", duration(ms)))
                .unwrap_or_else(|| {
                    format!(
                        ", waiting for {}",
                        duration(now.saturating_sub(c.accepted_at_ms))
                    )
                });
            out.push(format!(
                "  {}, step {}/{}{pct}{elapsed}",
                c.phase, c.step, c.steps
            ));
            if let Some(ch) = &c.running_change {
                out.push(format!(
                    "  now: changes[{}] {} {}",
                    ch.index, ch.kind, ch.target
                ));
            }
            if let Some(ch) = &c.running_check {
                out.push(format!(
                    "  now: verify[{}] {} {}",
                    ch.index, ch.kind, ch.target
                ));
            }
            if !c.message.is_empty() {
                out.push(format!("  {}", c.message));
            }
            if let Some(e) = &c.error {
                out.push(format!("  rolling back after ({}): {e}", e.kind.as_str()));
            }
            for e in &c.events {
                out.push(format!(
                    "  {} ago: {}",
                    duration(now.saturating_sub(e.at_ms)),
                    e.message
                ));
            }
        }
        None => out.push("idle: no plan is running".to_string()),
    }
    if !a.recent.is_empty() {
        out.push(String::new());
        out.push("recent plans, newest first:".to_string());
        let width = a
            .recent
            .iter()
            .map(|p| p.id.len())
            .max()
            .unwrap_or(0)
            .min(40);
        for p in &a.recent {
            out.push(format!(
                "  {:<width$}  {:<10}  {:>7}  {}  {}",
                p.id,
                p.phase.to_string(),
                p.duration_ms.map(duration).unwrap_or_default(),
                p.finished_at_ms.map(rfc3339).unwrap_or_default(),
                outcome(p)
            ));
        }
    }
    if let Some(f) = &a.last_failure {
        let when = f
            .finished_at_ms
            .map(|t| format!(", finished {}", rfc3339(t)))
            .unwrap_or_default();
        let why = match &f.error {
            Some(e) => format!("{} [{}]", e, e.kind.as_str()),
            None => "no error recorded".to_string(),
        };
        out.push(String::new());
        out.push(format!(
            "last failure: plan {} attempt {} ({}{when}): {why}",
            f.id, f.attempt, f.phase
        ));
    }
    if let Some(d) = &a.drift {
        out.push(String::new());
        out.extend(render_drift(d));
    }
    out.join("\n")
}

/// The drift section for a person: a line saying whether the node matches the last
/// succeeded plan, then one line per drifted change and one per field that differs.
pub fn render_drift(d: &api::DriftStatus) -> Vec<String> {
    let view = DriftView {
        drifted: d.drifted,
        baseline: d
            .baseline
            .as_ref()
            .map(|b| (b.id.clone(), b.attempt, b.run)),
        checked_at_ms: d.checked_at_ms,
        problem: d.problem.clone(),
        changes: d
            .changes
            .iter()
            .map(|c| DriftLine {
                index: c.index,
                kind: c.kind.to_string(),
                target: c.target.clone(),
                detail: c.detail.clone(),
                differences: c
                    .differences
                    .iter()
                    .map(|f| (f.field.clone(), f.expected.clone(), f.found.clone()))
                    .collect(),
                first_seen_ms: c.first_seen_ms,
            })
            .collect(),
    };
    view.lines()
}

/// What the drift lines say, from the status document or the wire.
pub struct DriftView {
    /// Some change does not match.
    pub drifted: bool,
    /// Plan id, attempt and run of the baseline.
    pub baseline: Option<(String, u32, u64)>,
    /// When the agent last checked.
    pub checked_at_ms: Option<u64>,
    /// Why the last check could not be made.
    pub problem: Option<String>,
    /// The drifted changes.
    pub changes: Vec<DriftLine>,
}

/// One drifted change for [`DriftView`].
pub struct DriftLine {
    /// Index in `changes[]`.
    pub index: u32,
    /// Kind.
    pub kind: String,
    /// Target.
    pub target: String,
    /// In words.
    pub detail: String,
    /// Field, expected, found.
    pub differences: Vec<(String, String, String)>,
    /// First seen drifted (Unix ms).
    pub first_seen_ms: u64,
}

impl DriftView {
    /// The lines.
    pub fn lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        let of = self
            .baseline
            .as_ref()
            .map(|(id, attempt, run)| format!("plan {id} attempt {attempt} (run {run})"))
            .unwrap_or_else(|| "the last succeeded plan".to_string());
        let when = self
            .checked_at_ms
            .map(|t| format!(", checked {}", rfc3339(t)))
            .unwrap_or_else(|| ", as last journaled".to_string());
        match (self.drifted, &self.problem, self.checked_at_ms) {
            (true, _, _) => out.push(format!(
                "drift: the node no longer matches {of} in {} change(s){when}",
                self.changes.len()
            )),
            // Never "none" without a check that found none.
            (false, Some(problem), _) => {
                out.push(format!(
                    "drift: unknown, the node could not be checked against {of}{}",
                    self.checked_at_ms
                        .map(|t| format!(" (at {})", rfc3339(t)))
                        .unwrap_or_default()
                ));
                out.push(format!("  {problem}"));
            }
            (false, None, Some(_)) => out.push(format!("drift: none, the node matches {of}{when}")),
            (false, None, None) => out.push(format!(
                "drift: not checked now; the journal records no drift from {of} \
                 (inplace-agent drift checks the node)"
            )),
        }
        if let (true, Some(problem)) = (self.drifted, &self.problem) {
            out.push(format!("  the last check could not be made: {problem}"));
        }
        for c in &self.changes {
            out.push(format!(
                "  changes[{}] {} {}: since {}",
                c.index,
                c.kind,
                c.target,
                rfc3339(c.first_seen_ms)
            ));
            if c.differences.is_empty() {
                out.push(format!("    {}", c.detail));
            }
            for (field, expected, found) in &c.differences {
                out.push(format!("    {field}: expected {expected}, found {found}"));
            }
        }
        out
    }
}

/// The status of the local agent serving on `local`'s socket, for the commands that show
/// part of it (`drift`); `Ok(None)` when no agent serves there. `Err` is the exit code
/// (the error is printed).
pub fn ask_agent(local: &Local) -> Result<Option<AgentStatus>, Exit> {
    match client::get(&local.socket, "/v1/status", REQUEST_TIMEOUT) {
        Ok(r) if r.status == 200 => serde_json::from_slice(&r.body).map(Some).map_err(|e| {
            errln!(
                "error: the agent's answer on {}: {e}",
                local.socket.display()
            );
            Exit::Failed
        }),
        Ok(r) => {
            let message = serde_json::from_slice::<api::ErrorDocument>(&r.body)
                .map(|d| d.message)
                .unwrap_or_else(|_| String::from_utf8_lossy(&r.body).trim().to_string());
            errln!("error: {message}");
            Err(Exit::Failed)
        }
        Err(ClientError::NotServing { .. }) => Ok(None),
        Err(e) => {
            errln!("error: {e}");
            Err(Exit::Failed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_reads_as_what_differs_field_by_field() {
        let view = DriftView {
            drifted: true,
            baseline: Some(("default/w-0@v1".into(), 2, 7)),
            checked_at_ms: Some(0),
            problem: None,
            changes: vec![DriftLine {
                index: 1,
                kind: "kubeletConfig".into(),
                target: "/var/lib/kubelet/config.yaml".into(),
                detail: "write /var/lib/kubelet/config.yaml".into(),
                differences: vec![("maxPods".into(), "90".into(), "250".into())],
                first_seen_ms: 0,
            }],
        };
        assert_eq!(
            view.lines(),
            [
                "drift: the node no longer matches plan default/w-0@v1 attempt 2 (run 7) in 1 \
                 change(s), checked 1970-01-01T00:00:00.000Z",
                "  changes[1] kubeletConfig /var/lib/kubelet/config.yaml: since \
                 1970-01-01T00:00:00.000Z",
                "    maxPods: expected 90, found 250",
            ]
        );
        let clean = DriftView {
            drifted: false,
            checked_at_ms: None,
            changes: Vec::new(),
            ..view
        };
        assert_eq!(
            clean.lines(),
            [
                "drift: not checked now; the journal records no drift from plan default/w-0@v1 \
                 attempt 2 (run 7) (inplace-agent drift checks the node)"
            ]
        );
        let checked = DriftView {
            checked_at_ms: Some(0),
            ..clean
        };
        assert_eq!(
            checked.lines(),
            [
                "drift: none, the node matches plan default/w-0@v1 attempt 2 (run 7), checked \
                 1970-01-01T00:00:00.000Z"
            ]
        );
        let unknown = DriftView {
            problem: Some("the plan needs systemd but it is not reachable".into()),
            ..checked
        };
        assert_eq!(
            unknown.lines(),
            [
                "drift: unknown, the node could not be checked against plan default/w-0@v1 \
                 attempt 2 (run 7) (at 1970-01-01T00:00:00.000Z)",
                "  the plan needs systemd but it is not reachable",
            ]
        );
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(850), "850ms");
        assert_eq!(duration(12_340), "12.3s");
        assert_eq!(duration(245_000), "4m05s");
        assert_eq!(duration(7_380_000), "2h03m");
    }

    #[test]
    fn plan_ids_are_escaped_in_paths() {
        assert_eq!(percent_encode("kubelet-1.31"), "kubelet-1.31");
        assert_eq!(percent_encode("a/b c"), "a%2Fb%20c");
    }
}

//! `inplace-updater explain`: would a proposed change of a MachineDeployment or a
//! KubeadmControlPlane go in place, and why not — before the operator applies it (what
//! cluster-api #13863 asks of Cluster API itself).
//!
//! It does what Cluster API would: reads the object and what it owns live from the
//! management cluster (a kubeconfig), builds the hook request Cluster API would send for
//! the proposed change — `CanUpdateMachineSet` with the MachineDeployment's current
//! MachineSet and KubeadmConfigTemplate, or one `CanUpdateMachine` per Machine of the
//! KubeadmControlPlane — with the ExtensionConfig's settings, and answers it with the
//! hooks' own decision code ([`super::handlers`]): with the agents' credentials
//! (`--agent-cert`) the nodes' agents are asked as the hooks ask them; without, the answer
//! is for what a current agent can do, and says so. It writes nothing: no Event, no metric,
//! no plan.
//!
//! The desired KubeadmConfig of a control-plane Machine is KubeadmControlPlane's own
//! computation in Cluster API (`PrepareKubeadmConfigsForDiff`); here it is approximated by
//! the paths of `spec.kubeadmConfigSpec` that the proposed change moves, applied to each
//! Machine's KubeadmConfig.
//!
//! Exit codes: 0 everything would go in place, 3 not everything would (the reason is
//! printed), 1 the cluster or an agent could not be read, 2 invalid input.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use serde::Serialize;
use serde_json::{Map, Value, json};

use super::cluster::{
    Cluster, kubeadm_config_template_resource, kubeadm_control_plane_resource,
    machine_deployment_resource, machine_resource, machine_set_resource,
};
use super::edge::extension_config::{Effective, ExtensionConfigs};
use super::edge::yaml::Limits;
use super::handlers::{
    Updater, cover_machine_request, coverage_why, decide_machine_set, machine_precheck,
};
use super::hooks::{HOOKS_API_VERSION, Hook, HookRequest};
use super::settings::Defaults;
use super::translate::{MachineRole, NodeFacts, lookup};
use super::why::Why;

/// Exit code: not everything would go in place.
pub const NOT_IN_PLACE: u8 = 3;

/// The revision annotation of a MachineDeployment's MachineSets (the newest is current).
const REVISION: &str = "machinedeployment.clusters.x-k8s.io/revision";

/// `inplace-updater explain`'s arguments.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true)
    .args(["machine_deployment", "kubeadm_control_plane"])))]
pub struct ExplainArgs {
    /// The MachineDeployment (NAMESPACE/NAME)
    #[arg(long, value_name = "NAMESPACE/NAME")]
    machine_deployment: Option<String>,
    /// The KubeadmControlPlane (NAMESPACE/NAME)
    #[arg(long, value_name = "NAMESPACE/NAME")]
    kubeadm_control_plane: Option<String>,
    /// The proposed change: a YAML or JSON file of the objects as you would apply them (the
    /// MachineDeployment and/or its new KubeadmConfigTemplate, or the KubeadmControlPlane;
    /// repeat, or put several documents in one file)
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    files: Vec<PathBuf>,
    /// The proposed Kubernetes version (spec.template.spec.version, or spec.version)
    #[arg(long)]
    version: Option<String>,
    /// kubeconfig of the management cluster (default: in-cluster configuration)
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The ExtensionConfig whose settings the hooks run under
    #[arg(long = "extension-config", value_name = "NAME",
          default_value = super::edge::extension_config::DEFAULT_NAME)]
    extension_config: String,
    /// Client certificate for the agents (admin role): the nodes' agents are asked as the
    /// hooks ask them (without it: what a current agent can do)
    #[arg(long, requires_all = ["agent_key", "agent_ca"])]
    agent_cert: Option<PathBuf>,
    /// Its private key
    #[arg(long, requires = "agent_cert")]
    agent_key: Option<PathBuf>,
    /// CA bundle the agents' certificates chain to
    #[arg(long, requires = "agent_cert")]
    agent_ca: Option<PathBuf>,
    /// Port of the agents' gRPC API (the ExtensionConfig setting agentPort wins)
    #[arg(long, default_value_t = 9443)]
    agent_port: u16,
    /// Output: text for people, json for scripts
    #[arg(long, value_enum, default_value = "text")]
    output: Output,
}

/// Output format of `explain`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Output {
    Text,
    Json,
}

/// The answer for one hook request: a MachineSet's, or a Machine's.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Verdict {
    /// The MachineSet or Machine (`namespace/name`).
    pub object: String,
    /// Everything would go in place.
    pub in_place: bool,
    /// `covered`, `partial` or `not_covered`.
    pub outcome: String,
    /// The reason's class ([`super::why::Class`]), when not in place.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason_class: Option<String>,
    /// The reason, as the hooks log it and the Event says it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What `explain` answers (`--output json`: `apiVersion` and `kind`, fields only added).
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    /// `inplace-updater.inplace-agent.github.io/v1`.
    pub api_version: &'static str,
    /// `Explanation`.
    pub kind: &'static str,
    /// `MachineDeployment ns/name` or `KubeadmControlPlane ns/name`.
    pub target: String,
    /// The hook Cluster API would call.
    pub hook: &'static str,
    /// The nodes' agents were asked (`--agent-cert`); otherwise what a current agent can do.
    pub agents_asked: bool,
    /// Every answer would be everything in place.
    pub in_place: bool,
    /// One answer per hook request.
    pub verdicts: Vec<Verdict>,
}

impl Explanation {
    /// The text for people.
    pub fn text(&self) -> String {
        let mut out = format!(
            "{}: {}\n",
            self.target,
            if self.in_place {
                "in place: Cluster API would update its Machines in place"
            } else {
                "not in place: Cluster API would roll out (new Machines replace the current ones)"
            }
        );
        for v in &self.verdicts {
            match (&v.reason_class, &v.reason) {
                (Some(class), Some(reason)) => out.push_str(&format!(
                    "  {} ({}, {class}): {reason}\n",
                    v.object, v.outcome
                )),
                _ => out.push_str(&format!(
                    "  {} ({}): everything in place\n",
                    v.object, v.outcome
                )),
            }
        }
        if !self.agents_asked {
            out.push_str(
                "  the nodes' agents were not asked (no --agent-cert): answered for what a \
                 current agent can do\n",
            );
        }
        out
    }
}

/// Runs `explain`.
pub fn run(args: &ExplainArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("inplace-updater explain: start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let proposed = match read_files(&args.files) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("inplace-updater explain: {}", super::errors::chain(&e));
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(explain(args, &proposed)) {
        Ok(x) => {
            match args.output {
                Output::Text => print!("{}", x.text()),
                Output::Json => {
                    println!("{}", serde_json::to_string_pretty(&x).unwrap_or_default())
                }
            }
            if x.in_place {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(NOT_IN_PLACE)
            }
        }
        Err(e) => {
            eprintln!("inplace-updater explain: {}", super::errors::chain(&e));
            ExitCode::from(1)
        }
    }
}

/// The documents of the proposed change's files, each within the bootstrap data's limits
/// ([`super::edge::yaml`]).
fn read_files(files: &[PathBuf]) -> anyhow::Result<Vec<Value>> {
    let mut out = Vec::new();
    for path in files {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        if text.trim_start().starts_with('{') {
            let doc = super::edge::yaml::json(text.as_bytes(), &Limits::BOOTSTRAP_JSON)
                .with_context(|| format!("{}", path.display()))?;
            out.push(doc.into_value());
            continue;
        }
        for (i, part) in documents(&text).into_iter().enumerate() {
            let doc = super::edge::yaml::yaml(part, &Limits::BOOTSTRAP_YAML)
                .with_context(|| format!("{} document {}", path.display(), i + 1))?;
            let v = doc.into_value();
            if !v.is_null() {
                out.push(v);
            }
        }
    }
    for (i, v) in out.iter().enumerate() {
        if v.get("kind").and_then(Value::as_str).is_none() {
            bail!("proposed object {}: no kind", i + 1);
        }
    }
    Ok(out)
}

/// The documents of a YAML stream (split at `---` lines).
fn documents(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        if line.trim_end() == "---" || line.starts_with("--- ") {
            out.push(&text[start..at]);
            start = at + line.len();
        }
        at += line.len();
    }
    out.push(&text[start..]);
    out.retain(|d| !d.trim().is_empty());
    out
}

fn split(target: &str, what: &str) -> anyhow::Result<(String, String)> {
    match target.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns.to_owned(), name.to_owned()))
        }
        _ => bail!("--{what} {target:?}: expected NAMESPACE/NAME"),
    }
}

fn proposed_of<'a>(proposed: &'a [Value], kind: &str) -> Option<&'a Value> {
    proposed
        .iter()
        .find(|v| v.get("kind").and_then(Value::as_str) == Some(kind))
}

fn name_of(v: &Value) -> &str {
    lookup(v, &["metadata", "name"])
        .and_then(Value::as_str)
        .unwrap_or_default()
}

/// Owned by `owner` as its controller (by uid).
fn owned_by(v: &Value, owner: &Value) -> bool {
    let uid = lookup(owner, &["metadata", "uid"]).and_then(Value::as_str);
    lookup(v, &["metadata", "ownerReferences"])
        .and_then(Value::as_array)
        .is_some_and(|refs| {
            refs.iter().any(|r| {
                r.get("controller").and_then(Value::as_bool) == Some(true)
                    && r.get("uid").and_then(Value::as_str) == uid
            })
        })
}

/// The request's settings: the ExtensionConfig's, as Cluster API sends them.
async fn settings_of(cluster: &Cluster, name: &str) -> anyhow::Result<Map<String, Value>> {
    let config = cluster
        .extension_config(name)
        .await?
        .with_context(|| format!("ExtensionConfig {name} does not exist (--extension-config)"))?;
    Ok(lookup(&config, &["spec", "settings"])
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default())
}

/// The updater the hooks run, when the agents may be asked.
fn updater(
    args: &ExplainArgs,
    cluster: &Cluster,
    configs: ExtensionConfigs,
) -> anyhow::Result<Option<Arc<Updater>>> {
    let (Some(cert), Some(key), Some(ca)) = (&args.agent_cert, &args.agent_key, &args.agent_ca)
    else {
        return Ok(None);
    };
    let agents = Arc::new(
        super::agent::Agents::new(super::agent::paths(ca.clone(), cert.clone(), key.clone()))
            .context("agent client certificate")?,
    );
    Ok(Some(Arc::new(Updater {
        extension_configs: Arc::new(configs),
        cluster: cluster.clone(),
        agents: agents.clone(),
        plans: Arc::new(super::progress::Plans::new()),
        metrics: super::metrics::Metrics::new(Arc::new(|| 0)),
        recovery: Arc::new(super::recovery::Recovery::new(cluster.clone(), agents)),
        cluster_cas: Default::default(),
        waits: Default::default(),
        drains: Default::default(),
        not_in_place: Arc::new(super::events::NotInPlace::new(cluster.clone(), "explain")),
    })))
}

/// The defaults the settings are read under. `agentCA: File` needs `--agent-ca` only when
/// the agents are asked; without agent credentials the trust mode decides nothing here.
fn defaults(args: &ExplainArgs) -> Defaults {
    Defaults {
        agent_port: args.agent_port,
        agent_ca_file: args.agent_ca.is_some() || args.agent_cert.is_none(),
    }
}

/// Answers `args` for the `proposed` objects.
pub async fn explain(args: &ExplainArgs, proposed: &[Value]) -> anyhow::Result<Explanation> {
    let cluster = Cluster::connect(args.kubeconfig.as_deref()).await?;
    let configs = ExtensionConfigs::new(vec![args.extension_config.clone()], defaults(args));
    let settings = settings_of(&cluster, &args.extension_config).await?;
    let updater = updater(
        args,
        &cluster,
        ExtensionConfigs::new(vec![args.extension_config.clone()], defaults(args)),
    )?;
    if let Some(target) = &args.machine_deployment {
        let (ns, name) = split(target, "machine-deployment")?;
        let request = machine_set_request(&cluster, &ns, &name, args, proposed, &settings).await?;
        let effective = configs
            .effective(&cluster, &ns, &request.settings)
            .await
            .map_err(|r| anyhow::anyhow!(r.0))?;
        let set = request.object("current", "machineSet")?;
        let object = format!("MachineSet {}/{}", set.namespace(), set.name());
        let answer = match &updater {
            Some(u) => u.can_update_machine_set(&request, &effective).await,
            None => decide_machine_set(&request, &effective, &[]),
        }
        .map_err(|f| anyhow::anyhow!(f.0))?;
        let verdict = verdict(object, answer.outcome, answer.why.as_ref());
        return Ok(Explanation {
            api_version: "inplace-updater.inplace-agent.github.io/v1",
            kind: "Explanation",
            target: format!("MachineDeployment {ns}/{name}"),
            hook: Hook::CanUpdateMachineSet.as_str(),
            agents_asked: updater.is_some(),
            in_place: verdict.in_place,
            verdicts: vec![verdict],
        });
    }
    let target = args.kubeadm_control_plane.as_deref().unwrap_or_default();
    let (ns, name) = split(target, "kubeadm-control-plane")?;
    let requests = machine_requests(&cluster, &ns, &name, args, proposed, &settings).await?;
    let mut verdicts = Vec::new();
    for request in &requests {
        let effective = configs
            .effective(&cluster, &ns, &request.settings)
            .await
            .map_err(|r| anyhow::anyhow!(r.0))?;
        let machine = request.object("current", "machine")?;
        let object = format!("Machine {}/{}", machine.namespace(), machine.name());
        let (outcome, why) = match &updater {
            Some(u) => {
                let a = u
                    .can_update_machine(request, &effective)
                    .await
                    .map_err(|f| anyhow::anyhow!(f.0))?;
                (a.outcome, a.why)
            }
            None => assumed_machine(request, &effective)?,
        };
        verdicts.push(verdict(object, outcome, why.as_ref()));
    }
    Ok(Explanation {
        api_version: "inplace-updater.inplace-agent.github.io/v1",
        kind: "Explanation",
        target: format!("KubeadmControlPlane {ns}/{name}"),
        hook: Hook::CanUpdateMachine.as_str(),
        agents_asked: updater.is_some(),
        in_place: verdicts.iter().all(|v| v.in_place),
        verdicts,
    })
}

/// `CanUpdateMachine` without a node: the same precheck and coverage as the hook, for
/// what a current agent can do.
fn assumed_machine(
    request: &HookRequest,
    settings: &Effective,
) -> anyhow::Result<(&'static str, Option<Why>)> {
    if let Some(why) = machine_precheck(request, settings).map_err(|f| anyhow::anyhow!(f.0))? {
        return Ok(("not_covered", Some(why)));
    }
    // The request is built from the live objects here, so its current Machine's role is the
    // live one (a KubeadmControlPlane's Machines are control-plane Machines).
    let current = request.object("current", "machine")?;
    let caps = NodeFacts::assumed("").capabilities_for(MachineRole::of(&current.value));
    let (machine, bootstrap) =
        cover_machine_request(request, caps).map_err(|f| anyhow::anyhow!(f.0))?;
    let why = coverage_why(&machine, &bootstrap);
    Ok((if why.is_some() { "partial" } else { "covered" }, why))
}

fn verdict(object: String, outcome: &str, why: Option<&Why>) -> Verdict {
    Verdict {
        object,
        in_place: why.is_none() && outcome == "covered",
        outcome: outcome.to_owned(),
        reason_class: why.map(|w| w.class().as_str().to_owned()),
        reason: why.map(Why::sentence),
    }
}

/// The `CanUpdateMachineSet` request Cluster API would send for the MachineDeployment
/// `ns/name` changed as `proposed` says.
async fn machine_set_request(
    cluster: &Cluster,
    ns: &str,
    name: &str,
    args: &ExplainArgs,
    proposed: &[Value],
    settings: &Map<String, Value>,
) -> anyhow::Result<HookRequest> {
    let md = cluster
        .object(
            &machine_deployment_resource(),
            "MachineDeployment",
            ns,
            name,
        )
        .await?
        .with_context(|| format!("MachineDeployment {ns}/{name} does not exist"))?;
    let sets = cluster
        .list(
            &machine_set_resource(),
            "MachineSet",
            ns,
            &format!("cluster.x-k8s.io/deployment-name={name}"),
        )
        .await?;
    let revision = |s: &Value| {
        lookup(s, &["metadata", "annotations", REVISION])
            .and_then(Value::as_str)
            .and_then(|r| r.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let current_set = sets
        .into_iter()
        .filter(|s| owned_by(s, &md))
        .max_by_key(revision)
        .with_context(|| {
            format!("MachineDeployment {ns}/{name} has no MachineSet yet: nothing to update")
        })?;
    let template_of = |set_or_md: &Value| {
        lookup(
            set_or_md,
            &["spec", "template", "spec", "bootstrap", "configRef", "name"],
        )
        .and_then(Value::as_str)
        .map(str::to_owned)
    };
    let read_template = |name: String| async move {
        cluster
            .object(
                &kubeadm_config_template_resource(),
                "KubeadmConfigTemplate",
                ns,
                &name,
            )
            .await?
            .with_context(|| {
                format!(
                    "KubeadmConfigTemplate {ns}/{name} does not exist: pass the new one with -f"
                )
            })
    };
    let current_template = match template_of(&current_set) {
        Some(t) => Some(read_template(t).await?),
        None => None,
    };
    let mut desired_md = proposed_of(proposed, "MachineDeployment")
        .cloned()
        .unwrap_or_else(|| md.clone());
    let new_template = proposed_of(proposed, "KubeadmConfigTemplate").cloned();
    if let Some(t) = &new_template {
        super::patch::set(
            &mut desired_md,
            &["spec", "template", "spec", "bootstrap", "configRef", "name"],
            Some(json!(name_of(t))),
        );
    }
    if let Some(v) = &args.version {
        super::patch::set(
            &mut desired_md,
            &["spec", "template", "spec", "version"],
            Some(json!(v)),
        );
    }
    let desired_template = match (&new_template, template_of(&desired_md)) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(t)) if current_template.as_ref().is_some_and(|c| name_of(c) == t) => {
            current_template.clone()
        }
        (None, Some(t)) => Some(read_template(t).await?),
        (None, None) => None,
    };
    // The new MachineSet as Cluster API computes it: the current one with the
    // MachineDeployment's template.
    let mut desired_set = current_set.clone();
    let template = lookup(&desired_md, &["spec", "template"])
        .cloned()
        .context("the proposed MachineDeployment has no spec.template")?;
    super::patch::set(&mut desired_set, &["spec", "template"], Some(template));
    let strip = |mut v: Value| {
        if let Some(m) = v.as_object_mut() {
            m.remove("status");
        }
        v
    };
    let mut current = json!({"machineSet": strip(current_set)});
    let mut desired = json!({"machineSet": strip(desired_set)});
    if let Some(t) = current_template {
        current["bootstrapConfigTemplate"] = strip(t);
    }
    if let Some(t) = desired_template {
        desired["bootstrapConfigTemplate"] = strip(t);
    }
    let body = json!({
        "kind": Hook::CanUpdateMachineSet.request_kind(),
        "apiVersion": HOOKS_API_VERSION,
        "settings": settings,
        "current": current,
        "desired": desired,
    });
    Ok(HookRequest::parse(Hook::CanUpdateMachineSet, &body)?)
}

/// The `CanUpdateMachine` requests Cluster API would send for each Machine of the
/// KubeadmControlPlane `ns/name` changed as `proposed` says.
async fn machine_requests(
    cluster: &Cluster,
    ns: &str,
    name: &str,
    args: &ExplainArgs,
    proposed: &[Value],
    settings: &Map<String, Value>,
) -> anyhow::Result<Vec<HookRequest>> {
    let kcp = cluster
        .object(
            &kubeadm_control_plane_resource(),
            "KubeadmControlPlane",
            ns,
            name,
        )
        .await?
        .with_context(|| format!("KubeadmControlPlane {ns}/{name} does not exist"))?;
    let mut desired_kcp = proposed_of(proposed, "KubeadmControlPlane")
        .cloned()
        .unwrap_or_else(|| kcp.clone());
    if let Some(v) = &args.version {
        super::patch::set(&mut desired_kcp, &["spec", "version"], Some(json!(v)));
    }
    // The paths of kubeadmConfigSpec the change moves.
    const SPEC: &[&str] = &["spec", "kubeadmConfigSpec"];
    let null = Value::Null;
    let mut moves = Vec::new();
    super::patch::diff(
        "",
        lookup(&kcp, SPEC).unwrap_or(&null),
        lookup(&desired_kcp, SPEC).unwrap_or(&null),
        &mut moves,
    );
    let version = lookup(&desired_kcp, &["spec", "version"]).cloned();
    let mut machines: Vec<Value> = cluster
        .list(
            &machine_resource(),
            "Machine",
            ns,
            &format!("cluster.x-k8s.io/control-plane-name={name}"),
        )
        .await?
        .into_iter()
        .filter(|m| owned_by(m, &kcp))
        .collect();
    machines.sort_by(|a, b| name_of(a).cmp(name_of(b)));
    if machines.is_empty() {
        bail!("KubeadmControlPlane {ns}/{name} has no Machines: nothing to update");
    }
    let mut out = Vec::new();
    for machine in machines {
        let config_name = lookup(&machine, &["spec", "bootstrap", "configRef", "name"])
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let config = cluster
            .kubeadm_config(ns, &config_name)
            .await?
            .with_context(|| {
                format!(
                    "KubeadmConfig {ns}/{config_name} of Machine {ns}/{} does not exist",
                    name_of(&machine)
                )
            })?;
        let mut desired_machine = machine.clone();
        if let Some(v) = &version {
            super::patch::set(&mut desired_machine, &["spec", "version"], Some(v.clone()));
        }
        let mut desired_config = config.clone();
        if let Some(spec) = desired_config.get_mut("spec") {
            for op in &moves {
                apply(spec, op);
            }
        }
        let strip = |v: &Value| {
            let mut v = v.clone();
            if let Some(m) = v.as_object_mut() {
                m.remove("status");
            }
            v
        };
        let body = json!({
            "kind": Hook::CanUpdateMachine.request_kind(),
            "apiVersion": HOOKS_API_VERSION,
            "settings": settings,
            "current": {"machine": strip(&machine), "bootstrapConfig": strip(&config)},
            "desired": {"machine": strip(&desired_machine), "bootstrapConfig": strip(&desired_config)},
        });
        out.push(HookRequest::parse(Hook::CanUpdateMachine, &body)?);
    }
    Ok(out)
}

/// Applies one operation of [`super::patch::diff`] (`add`, `replace`, `remove`) to `doc`,
/// creating the objects on its way (a path the Machine's KubeadmConfig does not have yet).
fn apply(doc: &mut Value, op: &Value) {
    let path = op.get("path").and_then(Value::as_str).unwrap_or_default();
    let tokens: Vec<String> = path
        .split('/')
        .skip(1)
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    let Some((last, parents)) = tokens.split_last() else {
        return;
    };
    let mut cur = doc;
    for t in parents {
        cur = match cur {
            Value::Array(a) => match t.parse::<usize>().ok().and_then(|i| a.get_mut(i)) {
                Some(v) => v,
                None => return,
            },
            v => {
                if !v.is_object() {
                    *v = Value::Object(Map::new());
                }
                match v.as_object_mut() {
                    Some(m) => m
                        .entry(t.clone())
                        .or_insert_with(|| Value::Object(Map::new())),
                    None => return,
                }
            }
        };
    }
    let value = op.get("value").cloned();
    let remove = op.get("op").and_then(Value::as_str) == Some("remove");
    match cur {
        Value::Array(a) => {
            if let Some(i) = last.parse::<usize>().ok().filter(|i| *i < a.len()) {
                match (remove, value) {
                    (true, _) => {
                        a.remove(i);
                    }
                    (false, Some(v)) => a[i] = v,
                    (false, None) => {}
                }
            }
        }
        v => {
            if !v.is_object() {
                *v = Value::Object(Map::new());
            }
            if let Some(m) = v.as_object_mut() {
                match (remove, value) {
                    (true, _) => {
                        m.remove(last);
                    }
                    (false, Some(v)) => {
                        m.insert(last.clone(), v);
                    }
                    (false, None) => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_yaml_stream_is_split_into_its_documents() {
        let text = "---\nkind: A\n---\nkind: B\n--- \n\n";
        assert_eq!(documents(text), ["kind: A\n", "kind: B\n"]);
        assert_eq!(documents("kind: A\n"), ["kind: A\n"]);
    }

    #[test]
    fn the_moves_of_the_control_plane_spec_land_on_the_machines_config() {
        let from = json!({"files": [{"path": "/a", "content": "1"}], "preKubeadmCommands": ["x"]});
        let to = json!({"files": [{"path": "/a", "content": "2"}],
                        "clusterConfiguration": {"apiServer": {"extraArgs": [{"name": "v", "value": "2"}]}}});
        let mut ops = Vec::new();
        super::super::patch::diff("", &from, &to, &mut ops);
        let mut config = json!({"files": [{"path": "/a", "content": "1"}], "preKubeadmCommands": ["x"],
                                "joinConfiguration": {"nodeRegistration": {}}});
        for op in &ops {
            apply(&mut config, op);
        }
        assert_eq!(
            config,
            json!({"files": [{"path": "/a", "content": "2"}],
                   "clusterConfiguration": {"apiServer": {"extraArgs": [{"name": "v", "value": "2"}]}},
                   "joinConfiguration": {"nodeRegistration": {}}})
        );
    }
}

//! Wire plans into validated plans: a `pb::Plan` becomes the plan-file document (the
//! camelCase JSON shape of DESIGN §2) and goes through the same validator as plan files
//! ([`inplace_plan::validate_value`]), so gRPC input gets exactly the same checks, defaults
//! and digest, and errors carry plan-file field paths (which are also the proto3 JSON names
//! a Go or grpcurl user sees).
//!
//! The mapping is field for field; only two things need care: zero values mean "not set"
//! (proto3 has no presence for scalars, and the proto documents 0 / "" as the default), and
//! `FileChange.content` is bytes, which a JSON document can only hold as text. Plain
//! contents (any bytes) therefore stay out of the document: the validator takes them as
//! bodies beside it ([`validate_document_with_bodies`]), as the slices of the request they
//! were decoded as, so a plan of megabytes is never copied on its way in. Gzip bytes travel
//! in the document as base64.

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::pb;
use inplace_plan::{FieldError, InvalidPlan, Limits, Plan, validate_document_with_bodies};

/// Where validation errors of gRPC plans say they came from.
pub const REQUEST_SOURCE: &str = "request";

/// Validates a wire plan exactly as a plan file would be.
pub fn validate_plan(plan: &pb::Plan, limits: &Limits) -> Result<Plan, InvalidPlan> {
    validate_owned(plan.clone(), limits)
}

/// [`validate_plan`] consuming the wire plan: plain file contents move into the plan as the
/// slices of the request they are, so a large request is held once while it is validated.
pub fn validate_owned(plan: pb::Plan, limits: &Limits) -> Result<Plan, InvalidPlan> {
    let mut bodies = HashMap::new();
    let document = plan_document_owned(plan, &mut bodies).map_err(|error| InvalidPlan {
        source: REQUEST_SOURCE.to_owned(),
        errors: vec![error],
    })?;
    validate_document_with_bodies(document, bodies, REQUEST_SOURCE, limits)
}

/// The INVALID_ARGUMENT status for a plan that failed validation: every problem as
/// `<field path>: <problem>`, separated by `; `.
pub fn invalid_argument(invalid: &InvalidPlan) -> tonic::Status {
    tonic::Status::invalid_argument(problems(invalid))
}

fn problems(invalid: &InvalidPlan) -> String {
    let problems: Vec<String> = invalid.errors.iter().map(ToString::to_string).collect();
    problems.join("; ")
}

/// True for a validation error that reports a size limit (number of changes or checks,
/// decoded content bytes, document bytes) rather than a malformed field. The validator
/// words every limit error as "... more than the limit of N ..."; a test below keeps the two
/// in step.
pub fn is_limit_error(error: &FieldError) -> bool {
    error.message.contains("more than the limit of")
}

/// The status for a plan that failed validation: RESOURCE_EXHAUSTED when it exceeds a plan
/// limit, INVALID_ARGUMENT otherwise; the message lists every problem either way.
pub fn plan_error_status(invalid: &InvalidPlan) -> tonic::Status {
    if invalid.errors.iter().any(is_limit_error) {
        tonic::Status::resource_exhausted(problems(invalid))
    } else {
        invalid_argument(invalid)
    }
}

/// The wire form of a validated plan (what `inplace-agent submit` sends): every default
/// explicit, file content as its decoded bytes (PLAIN). The agent validates it back to an
/// equal plan with the same digest.
pub fn plan_to_pb(plan: &Plan) -> pb::Plan {
    use inplace_plan::{Change, Probe};
    use pb::change::Kind;
    let secs = |d: std::time::Duration| u32::try_from(d.as_secs()).unwrap_or(u32::MAX);
    let changes = plan
        .changes
        .iter()
        .map(|c| {
            let kind = match c {
                Change::File(f) => Kind::File(pb::FileChange {
                    path: f.path.as_str().to_owned(),
                    content: f.content.clone(),
                    encoding: pb::Encoding::Plain as i32,
                    mode: f.mode.to_string(),
                    owner: f.owner.to_string(),
                    append: f.append,
                    restart_units: f.restart_units.clone(),
                }),
                Change::Absent(a) => Kind::Absent(pb::AbsentChange {
                    path: a.path.as_str().to_owned(),
                    restart_units: a.restart_units.clone(),
                }),
                Change::KubeletConfig(k) => Kind::KubeletConfig(pb::KubeletConfigChange {
                    merge_patch: Value::Object(k.merge_patch.clone()).to_string(),
                }),
                Change::KubeletFlags(k) => Kind::KubeletFlags(pb::KubeletFlagsChange {
                    set: k.set.clone().into_iter().collect(),
                    remove: k.remove.clone(),
                }),
                Change::Sysctl(s) => Kind::Sysctl(pb::SysctlChange {
                    key: s.key.clone(),
                    value: s.value.clone(),
                }),
                Change::Package(p) => Kind::Package(pb::PackageChange {
                    name: p.name.clone(),
                    version: p.version.clone(),
                    manager: p.manager.clone().unwrap_or_default(),
                    hold: p.hold,
                }),
                Change::Artifact(a) => Kind::Artifact(pb::ArtifactChange {
                    url: a.url.clone(),
                    sha256: a.sha256.clone(),
                    path: a.path.as_str().to_owned(),
                    mode: a.mode.to_string(),
                    extract: a.extract.clone().unwrap_or_default(),
                    restart_units: a.restart_units.clone(),
                }),
                Change::Unit(u) => Kind::Unit(pb::UnitChange {
                    name: u.name.clone(),
                    content: u.content.clone(),
                    drop_in: u.drop_in.as_ref().map(|d| pb::UnitDropIn {
                        name: d.name.clone(),
                        content: d.content.clone(),
                    }),
                    enabled: u.enabled,
                    state: match u.state {
                        None => pb::UnitState::Unspecified,
                        Some(inplace_plan::UnitState::Running) => pb::UnitState::Running,
                        Some(inplace_plan::UnitState::Stopped) => pb::UnitState::Stopped,
                    } as i32,
                    masked: u.masked,
                }),
                Change::KubeadmUpgradeNode(k) => {
                    Kind::KubeadmUpgradeNode(pb::KubeadmUpgradeNodeChange {
                        extra_args: k.extra_args.clone(),
                    })
                }
                Change::Reboot(r) => Kind::Reboot(pb::RebootChange {
                    reason: r.reason.clone(),
                }),
                Change::ApiServerCertificate(a) => {
                    Kind::ApiServerCertificate(pb::ApiServerCertificateChange {
                        cert_sans: a.cert_sans.clone(),
                        previous: a.previous.clone(),
                        certificates_dir: a.certificates_dir.as_str().to_owned(),
                    })
                }
                Change::Exec(e) => Kind::Exec(pb::ExecChange {
                    argv: e.argv.clone(),
                    unless: e.unless.clone().unwrap_or_default(),
                    disruption: disruption_to_pb(e.disruption) as i32,
                }),
            };
            pb::Change { kind: Some(kind) }
        })
        .collect();
    let verify = plan
        .verify
        .iter()
        .map(|c| {
            use pb::check::Kind;
            let (timeout_seconds, period_seconds) = (secs(c.timeout), secs(c.period));
            let kind = match &c.probe {
                Probe::UnitActive { name } => Kind::UnitActive(pb::UnitActiveCheck {
                    name: name.clone(),
                    timeout_seconds,
                    period_seconds,
                }),
                Probe::HttpGet { url, expect_status } => Kind::HttpGet(pb::HttpGetCheck {
                    url: url.clone(),
                    expect_status: u32::from(*expect_status),
                    timeout_seconds,
                    period_seconds,
                }),
                Probe::KubeletVersion { version } => {
                    Kind::KubeletVersion(pb::KubeletVersionCheck {
                        version: version.clone(),
                        timeout_seconds,
                        period_seconds,
                    })
                }
                Probe::Command { argv } => Kind::Command(pb::CommandCheck {
                    argv: argv.clone(),
                    timeout_seconds,
                    period_seconds,
                }),
                Probe::ControlPlane(g) => Kind::ControlPlane(pb::ControlPlaneCheck {
                    node_name: g.node_name.clone(),
                    components: g.components.clone(),
                    etcd: g.etcd.as_str().to_owned(),
                    api_server: g.api_server.clone().unwrap_or_default(),
                    etcd_metrics: g.etcd_metrics.clone(),
                    timeout_seconds,
                    period_seconds,
                }),
            };
            pb::Check { kind: Some(kind) }
        })
        .collect();
    pb::Plan {
        id: plan.id.clone(),
        node_name: plan.node_name.clone().unwrap_or_default(),
        options: Some(pb::PlanOptions {
            rollback_on_failure: Some(plan.options.rollback_on_failure),
            timeout_seconds: secs(plan.options.timeout),
            step_timeout_seconds: secs(plan.options.step_timeout),
            prune: plan
                .options
                .prune
                .as_ref()
                .map(|set| pb::PruneOption { set: set.clone() }),
        }),
        changes,
        verify,
    }
}

/// The wire value of a disruption.
pub fn disruption_to_pb(d: inplace_plan::Disruption) -> pb::Disruption {
    use inplace_plan::Disruption as D;
    match d {
        D::None => pb::Disruption::None,
        D::DaemonReload => pb::Disruption::DaemonReload,
        D::Reload => pb::Disruption::Reload,
        D::Restart => pb::Disruption::Restart,
        D::Reboot => pb::Disruption::Reboot,
    }
}

/// The plan-file document of a wire plan; plain file contents go to `bodies` by change
/// index instead (the document says `encoding: plain` and an empty `content`). Fails only
/// where the wire form cannot be expressed as a document (a merge patch that is not JSON,
/// base64 content that is not text); everything else is left to the validator.
fn plan_document_owned(
    plan: pb::Plan,
    bodies: &mut HashMap<usize, Bytes>,
) -> Result<Value, FieldError> {
    let mut doc = Map::new();
    doc.insert("apiVersion".into(), json!(inplace_plan::API_VERSION));
    doc.insert("kind".into(), json!("Plan"));
    doc.insert("id".into(), json!(plan.id));
    put_str(&mut doc, "nodeName", &plan.node_name);
    if let Some(options) = &plan.options {
        let mut o = Map::new();
        if let Some(rollback) = options.rollback_on_failure {
            o.insert("rollbackOnFailure".into(), json!(rollback));
        }
        put_u32(&mut o, "timeoutSeconds", options.timeout_seconds);
        put_u32(&mut o, "stepTimeoutSeconds", options.step_timeout_seconds);
        if let Some(prune) = &options.prune {
            o.insert("prune".into(), json!({"set": prune.set}));
        }
        doc.insert("options".into(), Value::Object(o));
    }
    let changes = plan
        .changes
        .into_iter()
        .enumerate()
        .map(|(i, c)| change(i, c, bodies))
        .collect::<Result<Vec<_>, _>>()?;
    doc.insert("changes".into(), Value::Array(changes));
    let verify = plan.verify.iter().map(check).collect();
    doc.insert("verify".into(), Value::Array(verify));
    Ok(Value::Object(doc))
}

fn put_str(m: &mut Map<String, Value>, key: &str, value: &str) {
    if !value.is_empty() {
        m.insert(key.into(), json!(value));
    }
}

fn put_u32(m: &mut Map<String, Value>, key: &str, value: u32) {
    if value != 0 {
        m.insert(key.into(), json!(value));
    }
}

fn put_list(m: &mut Map<String, Value>, key: &str, values: &[String]) {
    if !values.is_empty() {
        m.insert(key.into(), json!(values));
    }
}

fn keyed(key: &str, body: Map<String, Value>) -> Value {
    let mut outer = Map::new();
    outer.insert(key.into(), Value::Object(body));
    Value::Object(outer)
}

/// A proto enum as the wire carries it: an `i32` that may be any number.
trait WireEnum: TryFrom<i32> + Copy {
    /// The enum's proto name, for messages.
    const PROTO_NAME: &'static str;
    /// The value's proto name (`ENCODING_BASE64`).
    fn proto_name(self) -> &'static str;
}

macro_rules! wire_enum {
    ($($ty:ty => $name:literal),* $(,)?) => {$(
        impl WireEnum for $ty {
            const PROTO_NAME: &'static str = $name;
            fn proto_name(self) -> &'static str {
                self.as_str_name()
            }
        }
    )*};
}

wire_enum! {
    pb::Encoding => "inplace.agent.v1.Encoding",
    pb::UnitState => "inplace.agent.v1.UnitState",
    pb::Disruption => "inplace.agent.v1.Disruption",
}

/// The value of an enum field, refusing a number this agent does not know. prost keeps an
/// unknown number as it came and its getter silently returns the default (`ENCODING_PLAIN`
/// for `encoding: 99`), so every enum field of a request is read through here, never through
/// the generated getter.
fn known<E: WireEnum>(raw: i32, field: impl FnOnce() -> String) -> Result<E, FieldError> {
    E::try_from(raw).map_err(|_| {
        let names: Vec<String> = (0..64)
            .filter_map(|n| {
                E::try_from(n)
                    .ok()
                    .map(|e| format!("{} ({n})", e.proto_name()))
            })
            .collect();
        FieldError::new(
            field(),
            format!(
                "{raw} is not a value of {}; expected one of {}",
                E::PROTO_NAME,
                names.join(", ")
            ),
        )
    })
}

fn disruption_name(d: pb::Disruption) -> Option<&'static str> {
    match d {
        pb::Disruption::Unspecified => None,
        pb::Disruption::None => Some("None"),
        pb::Disruption::DaemonReload => Some("DaemonReload"),
        pb::Disruption::Reload => Some("Reload"),
        pb::Disruption::Restart => Some("Restart"),
        pb::Disruption::Reboot => Some("Reboot"),
    }
}

fn change(
    index: usize,
    change: pb::Change,
    bodies: &mut HashMap<usize, Bytes>,
) -> Result<Value, FieldError> {
    use pb::change::Kind;
    let Some(kind) = change.kind else {
        // The validator names the problem: no change kind.
        return Ok(Value::Object(Map::new()));
    };
    let mut m = Map::new();
    let key = match kind {
        Kind::File(mut f) => {
            m.insert("path".into(), json!(f.path));
            put_str(&mut m, "mode", &f.mode);
            put_str(&mut m, "owner", &f.owner);
            if f.append {
                m.insert("append".into(), json!(true));
            }
            put_list(&mut m, "restartUnits", &f.restart_units);
            f.restart_units = Vec::new();
            let (encoding, content) = match file_content(index, f)? {
                Content::Plain(bytes) => {
                    bodies.insert(index, bytes);
                    ("plain", String::new())
                }
                Content::Text(encoding, text) => (encoding, text),
            };
            m.insert("encoding".into(), json!(encoding));
            m.insert("content".into(), Value::String(content));
            "file"
        }
        Kind::Absent(a) => {
            m.insert("path".into(), json!(a.path));
            put_list(&mut m, "restartUnits", &a.restart_units);
            "absent"
        }
        Kind::KubeletConfig(k) => {
            let patch: Value = serde_json::from_str(&k.merge_patch).map_err(|e| {
                FieldError::new(
                    format!("changes[{index}].kubeletConfig.mergePatch"),
                    format!("is not JSON: {e}"),
                )
            })?;
            m.insert("mergePatch".into(), patch);
            "kubeletConfig"
        }
        Kind::KubeletFlags(k) => {
            if !k.set.is_empty() {
                m.insert("set".into(), json!(k.set));
            }
            put_list(&mut m, "remove", &k.remove);
            "kubeletFlags"
        }
        Kind::Sysctl(s) => {
            m.insert("key".into(), json!(s.key));
            m.insert("value".into(), json!(s.value));
            "sysctl"
        }
        Kind::Package(p) => {
            m.insert("name".into(), json!(p.name));
            m.insert("version".into(), json!(p.version));
            put_str(&mut m, "manager", &p.manager);
            if p.hold {
                m.insert("hold".into(), json!(true));
            }
            "package"
        }
        Kind::Artifact(a) => {
            m.insert("url".into(), json!(a.url));
            m.insert("sha256".into(), json!(a.sha256));
            m.insert("path".into(), json!(a.path));
            put_str(&mut m, "mode", &a.mode);
            put_str(&mut m, "extract", &a.extract);
            put_list(&mut m, "restartUnits", &a.restart_units);
            "artifact"
        }
        Kind::Unit(u) => {
            m.insert("name".into(), json!(u.name));
            if let Some(content) = &u.content {
                m.insert("content".into(), json!(content));
            }
            if let Some(drop_in) = &u.drop_in {
                m.insert(
                    "dropIn".into(),
                    json!({"name": drop_in.name, "content": drop_in.content}),
                );
            }
            if let Some(enabled) = u.enabled {
                m.insert("enabled".into(), json!(enabled));
            }
            match known(u.state, || format!("changes[{index}].unit.state"))? {
                pb::UnitState::Unspecified => {}
                pb::UnitState::Running => {
                    m.insert("state".into(), json!("running"));
                }
                pb::UnitState::Stopped => {
                    m.insert("state".into(), json!("stopped"));
                }
            }
            if let Some(masked) = u.masked {
                m.insert("masked".into(), json!(masked));
            }
            "unit"
        }
        Kind::KubeadmUpgradeNode(k) => {
            put_list(&mut m, "extraArgs", &k.extra_args);
            "kubeadmUpgradeNode"
        }
        Kind::Reboot(r) => {
            put_str(&mut m, "reason", &r.reason);
            "reboot"
        }
        Kind::ApiServerCertificate(a) => {
            m.insert("certSANs".into(), json!(a.cert_sans));
            put_list(&mut m, "previous", &a.previous);
            put_str(&mut m, "certificatesDir", &a.certificates_dir);
            "apiServerCertificate"
        }
        Kind::Exec(e) => {
            m.insert("argv".into(), json!(e.argv));
            put_list(&mut m, "unless", &e.unless);
            let disruption = known(e.disruption, || format!("changes[{index}].exec.disruption"))?;
            if let Some(name) = disruption_name(disruption) {
                m.insert("disruption".into(), json!(name));
            }
            "exec"
        }
    };
    Ok(keyed(key, m))
}

/// A file's content as the document carries it.
enum Content {
    /// The file's bytes, kept beside the document.
    Plain(Bytes),
    /// A plan-file `encoding` and its `content` text.
    Text(&'static str, String),
}

/// How the document carries a file's content.
fn file_content(index: usize, f: pb::FileChange) -> Result<Content, FieldError> {
    let encoding = known(f.encoding, || format!("changes[{index}].file.encoding"))?;
    let content = f.content;
    let as_text = |what: &str, content: Bytes| {
        String::from_utf8(content.into()).map_err(|_| {
            FieldError::new(
                format!("changes[{index}].file.content"),
                format!("is not {what} text"),
            )
        })
    };
    Ok(match encoding {
        pb::Encoding::Unspecified | pb::Encoding::Plain => Content::Plain(content),
        pb::Encoding::Base64 => Content::Text("base64", as_text("base64", content)?),
        pb::Encoding::GzipBase64 => Content::Text("gzip+base64", as_text("base64", content)?),
        // Raw gzip bytes cannot be a JSON string; base64 them.
        pb::Encoding::Gzip => Content::Text("gzip+base64", BASE64.encode(&content)),
    })
}

fn check(check: &pb::Check) -> Value {
    use pb::check::Kind;
    let Some(kind) = &check.kind else {
        return Value::Object(Map::new());
    };
    let mut m = Map::new();
    let (key, timeout, period) = match kind {
        Kind::UnitActive(c) => {
            m.insert("name".into(), json!(c.name));
            ("unitActive", c.timeout_seconds, c.period_seconds)
        }
        Kind::HttpGet(c) => {
            m.insert("url".into(), json!(c.url));
            put_u32(&mut m, "expectStatus", c.expect_status);
            ("httpGet", c.timeout_seconds, c.period_seconds)
        }
        Kind::KubeletVersion(c) => {
            m.insert("version".into(), json!(c.version));
            ("kubeletVersion", c.timeout_seconds, c.period_seconds)
        }
        Kind::Command(c) => {
            m.insert("argv".into(), json!(c.argv));
            ("command", c.timeout_seconds, c.period_seconds)
        }
        Kind::ControlPlane(c) => {
            m.insert("nodeName".into(), json!(c.node_name));
            if !c.components.is_empty() {
                m.insert("components".into(), json!(c.components));
            }
            for (key, v) in [
                ("etcd", &c.etcd),
                ("apiServer", &c.api_server),
                ("etcdMetrics", &c.etcd_metrics),
            ] {
                if !v.is_empty() {
                    m.insert(key.into(), json!(v));
                }
            }
            ("controlPlane", c.timeout_seconds, c.period_seconds)
        }
    };
    put_u32(&mut m, "timeoutSeconds", timeout);
    put_u32(&mut m, "periodSeconds", period);
    keyed(key, m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use inplace_plan::parse_plan;
    use pb::change::Kind;

    fn change(kind: Kind) -> pb::Change {
        pb::Change { kind: Some(kind) }
    }

    fn check(kind: pb::check::Kind) -> pb::Check {
        pb::Check { kind: Some(kind) }
    }

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    /// Every change and check kind with every field set, as a plan file...
    const EVERYTHING_YAML: &str = r#"
apiVersion: inplace.agent/v1
kind: Plan
id: default/md-0@everything
nodeName: worker-1
options: {rollbackOnFailure: false, timeoutSeconds: 600, stepTimeoutSeconds: 120}
changes:
  - file: {path: /etc/kubernetes/audit.yaml, content: "rules: []\n", encoding: plain,
           mode: "0640", owner: "root:root", append: true, restartUnits: [kubelet.service]}
  - file: {path: /etc/kubernetes/b64.conf, content: "aGVsbG8=", encoding: base64}
  - absent: {path: /etc/kubernetes/old.conf, restartUnits: [kubelet.service]}
  - kubeletConfig: {mergePatch: {maxPods: 150, serializeImagePulls: false, evictionHard: null}}
  - kubeletFlags: {set: {node-labels: "tier=web"}, remove: [pod-infra-container-image]}
  - sysctl: {key: net.ipv4.ip_forward, value: "1"}
  - package: {name: kubelet, version: 1.31.2-1.1, manager: apt, hold: true}
  - artifact: {url: "https://dl.k8s.io/v1.31.2/kubernetes-node-linux-amd64.tar.gz",
               sha256: "0000000000000000000000000000000000000000000000000000000000000000",
               path: /usr/local/bin/kubectl, mode: "0750",
               extract: kubernetes/node/bin/kubectl, restartUnits: [kubelet.service]}
  - unit: {name: containerd.service, content: "[Service]\nExecStart=/bin/true\n",
           dropIn: {name: 10-limits.conf, content: "[Service]\nLimitNOFILE=1048576\n"},
           enabled: true, state: running, masked: false}
  - kubeadmUpgradeNode: {extraArgs: [--patches, /etc/kubernetes/patches]}
  - reboot: {reason: kernel arguments changed}
  - exec: {argv: [/usr/bin/true, x], unless: [/usr/bin/false], disruption: Reload}
  - apiServerCertificate: {certSANs: [api.example.com, 10.0.0.5], previous: [old.example.com]}
verify:
  - unitActive: {name: kubelet.service, timeoutSeconds: 60, periodSeconds: 5}
  - httpGet: {url: "http://127.0.0.1:10248/healthz", expectStatus: 204, timeoutSeconds: 30}
  - kubeletVersion: {version: v1.31.2, periodSeconds: 3}
  - command: {argv: [/usr/bin/true]}
  - controlPlane: {nodeName: cp-0, components: [kube-apiserver, etcd], etcd: stacked,
                   apiServer: "10.0.0.10:6443", etcdMetrics: "127.0.0.1:2381", timeoutSeconds: 300}
"#;

    /// ... and the same plan as a wire message.
    fn everything_pb() -> pb::Plan {
        use pb::check::Kind as C;
        pb::Plan {
            id: "default/md-0@everything".into(),
            node_name: "worker-1".into(),
            options: Some(pb::PlanOptions {
                prune: None,
                rollback_on_failure: Some(false),
                timeout_seconds: 600,
                step_timeout_seconds: 120,
            }),
            changes: vec![
                change(Kind::File(pb::FileChange {
                    path: "/etc/kubernetes/audit.yaml".into(),
                    content: bytes::Bytes::from_static(b"rules: []\n"),
                    encoding: pb::Encoding::Plain as i32,
                    mode: "0640".into(),
                    owner: "root:root".into(),
                    append: true,
                    restart_units: strings(&["kubelet.service"]),
                })),
                change(Kind::File(pb::FileChange {
                    path: "/etc/kubernetes/b64.conf".into(),
                    content: bytes::Bytes::from_static(b"aGVsbG8="),
                    encoding: pb::Encoding::Base64 as i32,
                    ..Default::default()
                })),
                change(Kind::Absent(pb::AbsentChange {
                    path: "/etc/kubernetes/old.conf".into(),
                    restart_units: strings(&["kubelet.service"]),
                })),
                change(Kind::KubeletConfig(pb::KubeletConfigChange {
                    merge_patch:
                        r#"{"maxPods":150,"serializeImagePulls":false,"evictionHard":null}"#.into(),
                })),
                change(Kind::KubeletFlags(pb::KubeletFlagsChange {
                    set: [("node-labels".to_string(), "tier=web".to_string())].into(),
                    remove: strings(&["pod-infra-container-image"]),
                })),
                change(Kind::Sysctl(pb::SysctlChange {
                    key: "net.ipv4.ip_forward".into(),
                    value: "1".into(),
                })),
                change(Kind::Package(pb::PackageChange {
                    name: "kubelet".into(),
                    version: "1.31.2-1.1".into(),
                    manager: "apt".into(),
                    hold: true,
                })),
                change(Kind::Artifact(pb::ArtifactChange {
                    url: "https://dl.k8s.io/v1.31.2/kubernetes-node-linux-amd64.tar.gz".into(),
                    sha256: "0".repeat(64),
                    path: "/usr/local/bin/kubectl".into(),
                    mode: "0750".into(),
                    extract: "kubernetes/node/bin/kubectl".into(),
                    restart_units: strings(&["kubelet.service"]),
                })),
                change(Kind::Unit(pb::UnitChange {
                    name: "containerd.service".into(),
                    content: Some("[Service]\nExecStart=/bin/true\n".into()),
                    drop_in: Some(pb::UnitDropIn {
                        name: "10-limits.conf".into(),
                        content: "[Service]\nLimitNOFILE=1048576\n".into(),
                    }),
                    enabled: Some(true),
                    state: pb::UnitState::Running as i32,
                    masked: Some(false),
                })),
                change(Kind::KubeadmUpgradeNode(pb::KubeadmUpgradeNodeChange {
                    extra_args: strings(&["--patches", "/etc/kubernetes/patches"]),
                })),
                change(Kind::Reboot(pb::RebootChange {
                    reason: "kernel arguments changed".into(),
                })),
                change(Kind::Exec(pb::ExecChange {
                    argv: strings(&["/usr/bin/true", "x"]),
                    unless: strings(&["/usr/bin/false"]),
                    disruption: pb::Disruption::Reload as i32,
                })),
                change(Kind::ApiServerCertificate(pb::ApiServerCertificateChange {
                    cert_sans: strings(&["api.example.com", "10.0.0.5"]),
                    previous: strings(&["old.example.com"]),
                    certificates_dir: String::new(),
                })),
            ],
            verify: vec![
                check(C::UnitActive(pb::UnitActiveCheck {
                    name: "kubelet.service".into(),
                    timeout_seconds: 60,
                    period_seconds: 5,
                })),
                check(C::HttpGet(pb::HttpGetCheck {
                    url: "http://127.0.0.1:10248/healthz".into(),
                    expect_status: 204,
                    timeout_seconds: 30,
                    period_seconds: 0,
                })),
                check(C::KubeletVersion(pb::KubeletVersionCheck {
                    version: "v1.31.2".into(),
                    timeout_seconds: 0,
                    period_seconds: 3,
                })),
                check(C::Command(pb::CommandCheck {
                    argv: strings(&["/usr/bin/true"]),
                    timeout_seconds: 0,
                    period_seconds: 0,
                })),
                check(C::ControlPlane(pb::ControlPlaneCheck {
                    node_name: "cp-0".into(),
                    components: strings(&["kube-apiserver", "etcd"]),
                    etcd: "stacked".into(),
                    api_server: "10.0.0.10:6443".into(),
                    etcd_metrics: "127.0.0.1:2381".into(),
                    timeout_seconds: 300,
                    period_seconds: 0,
                })),
            ],
        }
    }

    #[test]
    fn wire_plan_validates_to_the_same_plan_as_the_plan_file() {
        let limits = Limits::default();
        let from_file = parse_plan(EVERYTHING_YAML.as_bytes(), "everything.yaml", &limits)
            .unwrap_or_else(|e| panic!("{e}"));
        let from_wire = validate_plan(&everything_pb(), &limits).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(from_wire, from_file);
        assert_eq!(from_wire.digest(), from_file.digest());
        assert_eq!(from_wire.changes.len(), 13);
        assert_eq!(from_wire.verify.len(), 5);
    }

    #[test]
    fn the_example_plan_file_round_trips() {
        let yaml = include_str!("../../../examples/plans/kubelet-tuning.yaml");
        let from_file = parse_plan(yaml.as_bytes(), "kubelet-tuning.yaml", &Limits::default())
            .unwrap_or_else(|e| panic!("{e}"));
        // Written by hand from the YAML, as an updater would.
        let wire = pb::Plan {
            id: "default/md-0-7d9f4-abcde@kubelet-tuning".into(),
            options: Some(pb::PlanOptions {
                prune: None,
                rollback_on_failure: Some(true),
                timeout_seconds: 600,
                step_timeout_seconds: 0,
            }),
            changes: vec![
                change(Kind::KubeletConfig(pb::KubeletConfigChange {
                    merge_patch: r#"{"maxPods":150,"serializeImagePulls":false,
                        "evictionHard":{"memory.available":"200Mi","nodefs.available":"10%"}}"#
                        .into(),
                })),
                change(Kind::KubeletFlags(pb::KubeletFlagsChange {
                    set: [("node-labels".to_string(), "tier=web".to_string())].into(),
                    remove: strings(&["pod-infra-container-image"]),
                })),
                change(Kind::File(pb::FileChange {
                    path: "/etc/kubernetes/audit/policy.yaml".into(),
                    mode: "0640".into(),
                    owner: "root:root".into(),
                    restart_units: strings(&["kubelet.service"]),
                    content:
                        b"apiVersion: audit.k8s.io/v1\nkind: Policy\nrules:\n  - level: Metadata\n"
                            .to_vec()
                            .into(),
                    ..Default::default()
                })),
                change(Kind::Sysctl(pb::SysctlChange {
                    key: "net.ipv4.ip_forward".into(),
                    value: "1".into(),
                })),
                change(Kind::Absent(pb::AbsentChange {
                    path: "/etc/kubernetes/old-bootstrap.conf".into(),
                    restart_units: vec![],
                })),
            ],
            verify: vec![check(pb::check::Kind::HttpGet(pb::HttpGetCheck {
                url: "http://127.0.0.1:10248/healthz".into(),
                expect_status: 200,
                timeout_seconds: 30,
                period_seconds: 0,
            }))],
            ..Default::default()
        };
        let from_wire = validate_plan(&wire, &Limits::default()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(from_wire, from_file);
        assert_eq!(from_wire.digest(), from_file.digest());
    }

    #[test]
    fn file_content_encodings_decode_to_the_same_bytes() {
        use std::io::Write;
        let bytes: Vec<u8> = (0u8..=255).collect();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&bytes).unwrap();
        let gzipped = gz.finish().unwrap();
        let variants = [
            (pb::Encoding::Unspecified, bytes.clone()),
            (pb::Encoding::Plain, bytes.clone()),
            (pb::Encoding::Base64, BASE64.encode(&bytes).into_bytes()),
            (pb::Encoding::Gzip, gzipped.clone()),
            (
                pb::Encoding::GzipBase64,
                BASE64.encode(&gzipped).into_bytes(),
            ),
        ];
        let mut digests = Vec::new();
        for (encoding, content) in variants {
            let plan = pb::Plan {
                id: "p".into(),
                changes: vec![change(Kind::File(pb::FileChange {
                    path: "/etc/kubernetes/blob".into(),
                    content: content.into(),
                    encoding: encoding as i32,
                    ..Default::default()
                }))],
                ..Default::default()
            };
            let valid = validate_plan(&plan, &Limits::default())
                .unwrap_or_else(|e| panic!("{encoding:?}: {e}"));
            let inplace_plan::Change::File(file) = &valid.changes[0] else {
                panic!("not a file change");
            };
            assert_eq!(file.content, bytes, "{encoding:?}");
            digests.push(valid.digest());
        }
        digests.dedup();
        assert_eq!(digests.len(), 1, "one desired state, one digest");
    }

    #[test]
    fn errors_name_plan_file_paths() {
        let plan = pb::Plan {
            id: "p".into(),
            node_name: "Not_A_Node".into(),
            changes: vec![
                change(Kind::File(pb::FileChange {
                    path: "/etc/kubernetes/x".into(),
                    mode: "0999".into(),
                    ..Default::default()
                })),
                pb::Change { kind: None },
            ],
            verify: vec![check(pb::check::Kind::HttpGet(pb::HttpGetCheck {
                url: "http://127.0.0.1/".into(),
                expect_status: 42,
                ..Default::default()
            }))],
            ..Default::default()
        };
        let invalid = validate_plan(&plan, &Limits::default()).unwrap_err();
        let fields: Vec<&str> = invalid.errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "nodeName",
                "changes[0].file.mode",
                "changes[1]",
                "verify[0].httpGet.expectStatus"
            ],
            "{invalid}"
        );
        let status = invalid_argument(&invalid);
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status.message().contains("changes[0].file.mode: "),
            "{}",
            status.message()
        );
    }

    #[test]
    fn plans_go_to_the_wire_and_back_unchanged() {
        let limits = Limits::default();
        for (name, yaml) in [
            ("everything.yaml", EVERYTHING_YAML),
            (
                "kubelet-tuning.yaml",
                include_str!("../../../examples/plans/kubelet-tuning.yaml"),
            ),
            (
                "bad-kubelet-config.yaml",
                include_str!("../../../examples/plans/bad-kubelet-config.yaml"),
            ),
        ] {
            let from_file =
                parse_plan(yaml.as_bytes(), name, &limits).unwrap_or_else(|e| panic!("{e}"));
            let wire = plan_to_pb(&from_file);
            let back = validate_plan(&wire, &limits).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(back, from_file, "{name}");
            assert_eq!(back.digest(), from_file.digest(), "{name}");
        }
    }

    #[test]
    fn limit_errors_are_resource_exhausted() {
        let limits = Limits {
            max_changes: 2,
            max_checks: 1,
            max_content_bytes: 8,
            ..Limits::default()
        };
        let sysctl = || {
            change(Kind::Sysctl(pb::SysctlChange {
                key: "net.ipv4.ip_forward".into(),
                value: "1".into(),
            }))
        };
        let file = |content: &[u8], encoding: pb::Encoding| {
            change(Kind::File(pb::FileChange {
                path: "/etc/kubernetes/x".into(),
                content: bytes::Bytes::copy_from_slice(content),
                encoding: encoding as i32,
                ..Default::default()
            }))
        };
        let gate = || {
            check(pb::check::Kind::KubeletVersion(pb::KubeletVersionCheck {
                version: "v1.31.2".into(),
                ..Default::default()
            }))
        };
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut gz, &[0u8; 4096]).unwrap();
        let bomb = gz.finish().unwrap();
        let too_big = [
            ("changes", vec![sysctl(), sysctl(), sysctl()], vec![]),
            ("verify", vec![], vec![gate(), gate()]),
            (
                "changes[0].file.content",
                vec![file(b"0123456789", pb::Encoding::Plain)],
                vec![],
            ),
            (
                "changes[0].file.content",
                vec![file(&bomb, pb::Encoding::Gzip)],
                vec![],
            ),
        ];
        for (field, changes, verify) in too_big {
            let plan = pb::Plan {
                id: "p".into(),
                changes,
                verify,
                ..Default::default()
            };
            let invalid = validate_plan(&plan, &limits).unwrap_err();
            assert_eq!(invalid.errors[0].field, field, "{invalid}");
            let status = plan_error_status(&invalid);
            assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{invalid}");
            assert!(status.message().starts_with(field), "{}", status.message());
        }
        let malformed = pb::Plan {
            id: "p".into(),
            changes: vec![file(b"ok", pb::Encoding::Base64)],
            ..Default::default()
        };
        let invalid = validate_plan(&malformed, &limits).unwrap_err();
        assert_eq!(
            plan_error_status(&invalid).code(),
            tonic::Code::InvalidArgument
        );
    }

    #[test]
    fn unrepresentable_wire_values_are_field_errors() {
        let bad_patch = pb::Plan {
            id: "p".into(),
            changes: vec![change(Kind::KubeletConfig(pb::KubeletConfigChange {
                merge_patch: "{maxPods: 150}".into(),
            }))],
            ..Default::default()
        };
        let invalid = validate_plan(&bad_patch, &Limits::default()).unwrap_err();
        assert_eq!(
            invalid.errors[0].field,
            "changes[0].kubeletConfig.mergePatch"
        );
        assert!(invalid.errors[0].message.starts_with("is not JSON"));

        let bad_base64 = pb::Plan {
            id: "p".into(),
            changes: vec![change(Kind::File(pb::FileChange {
                path: "/etc/kubernetes/x".into(),
                content: bytes::Bytes::from_static(&[0xff, 0xfe]),
                encoding: pb::Encoding::Base64 as i32,
                ..Default::default()
            }))],
            ..Default::default()
        };
        let invalid = validate_plan(&bad_base64, &Limits::default()).unwrap_err();
        assert_eq!(invalid.errors[0].field, "changes[0].file.content");
    }

    /// Every enum field a client sends, found in the descriptor set from the request types of
    /// the service's methods: an unknown number in any of them is refused naming the field.
    /// A new enum field in a request fails here until it is read through `known` and listed.
    #[test]
    fn unknown_enum_values_in_requests_are_refused_naming_the_field() {
        use prost::Message;
        use prost_types::field_descriptor_proto::Type;
        let fds = prost_types::FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET)
            .expect("descriptor set decodes");
        let messages: std::collections::HashMap<String, &prost_types::DescriptorProto> = fds
            .file
            .iter()
            .flat_map(|f| {
                f.message_type
                    .iter()
                    .map(move |m| (format!(".{}.{}", f.package(), m.name()), m))
            })
            .collect();
        let service = fds
            .file
            .iter()
            .flat_map(|f| f.service.iter())
            .find(|s| s.name() == "NodeAgent")
            .expect("NodeAgent in the descriptor set");
        let mut todo: Vec<String> = service
            .method
            .iter()
            .map(|m| m.input_type().to_string())
            .collect();
        let mut seen = std::collections::BTreeSet::new();
        let mut enum_fields = std::collections::BTreeSet::new();
        while let Some(name) = todo.pop() {
            if !seen.insert(name.clone()) {
                continue;
            }
            let Some(message) = messages.get(&name) else {
                continue; // google.protobuf types
            };
            for field in &message.field {
                match field.r#type() {
                    Type::Enum => {
                        enum_fields.insert(format!("{}.{}", message.name(), field.name()));
                    }
                    Type::Message => todo.push(field.type_name().to_string()),
                    _ => {}
                }
            }
        }
        let cases: Vec<(&str, pb::Change, &str)> = vec![
            (
                "FileChange.encoding",
                change(Kind::File(pb::FileChange {
                    path: "/etc/kubernetes/a.conf".into(),
                    content: bytes::Bytes::from_static(b"x"),
                    encoding: 99,
                    ..Default::default()
                })),
                "changes[0].file.encoding",
            ),
            (
                "UnitChange.state",
                change(Kind::Unit(pb::UnitChange {
                    name: "kubelet.service".into(),
                    state: 99,
                    ..Default::default()
                })),
                "changes[0].unit.state",
            ),
            (
                "ExecChange.disruption",
                change(Kind::Exec(pb::ExecChange {
                    argv: strings(&["true"]),
                    disruption: 99,
                    ..Default::default()
                })),
                "changes[0].exec.disruption",
            ),
        ];
        let listed: std::collections::BTreeSet<String> =
            cases.iter().map(|(f, _, _)| f.to_string()).collect();
        assert_eq!(
            enum_fields, listed,
            "every request enum field has a case here"
        );
        for (name, c, field) in cases {
            let plan = pb::Plan {
                id: "ns/m@enum".into(),
                node_name: "worker-1".into(),
                changes: vec![c],
                ..Default::default()
            };
            let invalid = validate_plan(&plan, &Limits::default()).unwrap_err();
            assert_eq!(invalid.errors[0].field, field, "{name}");
            assert!(
                invalid.errors[0]
                    .message
                    .starts_with("99 is not a value of inplace.agent.v1."),
                "{name}: {}",
                invalid.errors[0]
            );
        }
    }
}

//! The ExtensionConfig's `settings`, validated when the ExtensionConfig is read
//! ([`crate::edge::extension_config`]: a request's own `settings` only point at them) and
//! layered over the updater's flags (a setting wins over its flag). docs/updater.md lists
//! every key; a test keeps the two in step ([`KEYS`]).

use serde_json::{Map, Value};

use super::hooks::RequestError;

/// Every settings key the updater reads, with its one-line meaning (docs/updater.md has the
/// same list).
pub const KEYS: &[(&str, &str)] = &[
    (
        "agentPort",
        "port of the agents' gRPC API (default: --agent-port, 9443)",
    ),
    (
        "addressTypes",
        "Machine status.addresses types to dial, in order (default InternalIP,ExternalIP)",
    ),
    (
        "kubernetesPackages",
        "packages moved to Machine.spec.version, kubeadm first (default kubeadm,kubelet,kubectl)",
    ),
    (
        "packageRepositoryPath",
        "file the package repository switch writes (default empty: no switch)",
    ),
    (
        "packageRepositoryTemplate",
        "its content; {minor} is replaced by v1.N, {version} by the full version",
    ),
    (
        "kubeletHealthzURL",
        "health gate after a kubelet restart (default http://127.0.0.1:10248/healthz; empty: none)",
    ),
    (
        "gateTimeoutSeconds",
        "how long each health gate may take (default 120)",
    ),
    (
        "planTimeoutSeconds",
        "the plan's overall timeout on the agent (default 0: the agent's, 900)",
    ),
    (
        "updateWaitSeconds",
        "how long the first UpdateMachine call of a plan waits for the node to finish it, so \
         a fast plan is done in that call (default 3, at most 8; 0: answer at once)",
    ),
    (
        "unreachableTimeoutSeconds",
        "how long UpdateMachine waits for an unreachable agent before it answers Failure \
         (default 300; 0: wait for ever)",
    ),
    (
        "agentCA",
        "which CA verifies the agents' certificates: File (the --agent-ca file, default; the \
         certificate must also name the Machine's cluster in a URI SAN) or ClusterSecret (the \
         Machine's cluster's <cluster>-ca Secret: tls.crt, proven by its key tls.key)",
    ),
    (
        "disableInPlaceUpdates",
        "\"true\": CanUpdate* cover nothing (every change rolls out)",
    ),
    (
        "drain",
        "Never, Disruptive or Always: when to cordon and drain the node before a plan (default Disruptive)",
    ),
    (
        "drainOnRestartOf",
        "units whose restart drains under Disruptive, comma-separated (default containerd)",
    ),
    (
        "drainTimeoutSeconds",
        "how long a drain may take when the Machine sets no spec.deletion.nodeDrainTimeoutSeconds \
         (default 0: no limit)",
    ),
    (
        "onDrainTimeout",
        "Fail or Proceed when the drain timed out (default Fail)",
    ),
    (
        "retryMinIntervalSeconds",
        "the least time between two retries of a Machine's failed plan asked by the retry \
         annotation (default 300; 0: none)",
    ),
];

/// `settings.drain`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainMode {
    /// Never drain.
    Never,
    /// Drain when the plan reboots, changes the Kubernetes version or restarts a unit of
    /// `drainOnRestartOf` (the default).
    Disruptive,
    /// Drain before every plan that changes the node.
    Always,
}

impl DrainMode {
    /// From the setting's value.
    pub fn parse(v: &str) -> Option<DrainMode> {
        match v {
            "Never" => Some(DrainMode::Never),
            "Disruptive" => Some(DrainMode::Disruptive),
            "Always" => Some(DrainMode::Always),
            _ => None,
        }
    }
}

/// `settings.onDrainTimeout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnTimeout {
    /// Answer Failure naming the Pods still on the node (the default).
    Fail,
    /// Go on with the plan, Pods or not.
    Proceed,
}

/// The managed set the KubeadmConfig's `files[]` belong to on the node.
pub const FILES_SET: &str = "kubeadmconfig-files";

/// Defaults from the updater's flags.
#[derive(Debug, Clone)]
pub struct Defaults {
    /// `--agent-port`.
    pub agent_port: u16,
    /// Whether `--agent-ca` was given: `agentCA: File` (the default) needs it, and settings
    /// that say `File` are refused without it.
    pub agent_ca_file: bool,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            agent_port: 9443,
            agent_ca_file: true,
        }
    }
}

/// Which CA verifies an agent's certificate (`settings.agentCA`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AgentCa {
    /// The `--agent-ca` file: one fleet CA for every agent.
    #[default]
    File,
    /// The CA of the Machine's workload cluster: its `<cluster>-ca` Secret.
    ClusterSecret,
}

/// Settings of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Port of the agents.
    pub agent_port: u16,
    /// Address types to try, in order.
    pub address_types: Vec<String>,
    /// Packages to move to the Machine's version (kubeadm first).
    pub kubernetes_packages: Vec<String>,
    /// Repository file written for the version's minor (with its template), if any.
    pub repository: Option<(String, String)>,
    /// The kubelet health gate URL, if any.
    pub kubelet_healthz_url: Option<String>,
    /// Timeout of each gate.
    pub gate_timeout_seconds: u32,
    /// Plan timeout (0: the agent's default).
    pub plan_timeout_seconds: u32,
    /// Cover nothing.
    pub disable_in_place: bool,
    /// How long the first call of a plan waits for the agent to finish it.
    pub update_wait: std::time::Duration,
    /// Which CA verifies the agents.
    pub agent_ca: AgentCa,
    /// How long `UpdateMachine` waits for an unreachable agent (zero: for ever).
    pub unreachable_timeout: std::time::Duration,
    /// When to drain.
    pub drain: DrainMode,
    /// Units whose restart drains under [`DrainMode::Disruptive`].
    pub drain_on_restart_of: Vec<String>,
    /// The drain's limit when the Machine sets none (0: none).
    pub drain_timeout_seconds: u32,
    /// What a timed-out drain does.
    pub on_drain_timeout: OnTimeout,
    /// The least time between two retries of a failed plan (the retry annotation).
    pub retry_min_interval: std::time::Duration,
}

impl Settings {
    /// The settings with nothing set.
    pub fn defaults(defaults: &Defaults) -> Settings {
        Settings {
            agent_port: defaults.agent_port,
            address_types: vec!["InternalIP".into(), "ExternalIP".into()],
            kubernetes_packages: vec!["kubeadm".into(), "kubelet".into(), "kubectl".into()],
            repository: None,
            kubelet_healthz_url: Some("http://127.0.0.1:10248/healthz".into()),
            gate_timeout_seconds: 120,
            plan_timeout_seconds: 0,
            disable_in_place: false,
            update_wait: std::time::Duration::from_secs(3),
            agent_ca: AgentCa::File,
            unreachable_timeout: std::time::Duration::from_secs(300),
            drain: DrainMode::Disruptive,
            drain_on_restart_of: vec!["containerd".into()],
            drain_timeout_seconds: 0,
            on_drain_timeout: OnTimeout::Fail,
            retry_min_interval: std::time::Duration::from_secs(300),
        }
    }

    /// Reads an ExtensionConfig's `spec.settings` over `defaults`; errors name
    /// `settings.<key>`, and a key the updater does not know is an error with a did-you-mean
    /// (a misspelt `agentCa` would otherwise fall back to the default without a word).
    pub fn from_extension_config(
        settings: &Map<String, Value>,
        defaults: &Defaults,
    ) -> Result<Settings, RequestError> {
        let known: Vec<&str> = KEYS.iter().map(|(k, _)| *k).collect();
        if let Some(key) = settings.keys().find(|k| !known.contains(&k.as_str())) {
            return Err(RequestError::new(
                format!("settings.{key}"),
                format!(
                    "is not a setting of inplace-updater{}; the settings are: {}",
                    inplace_plan::parse::suggestion(key, &known),
                    known.join(", ")
                ),
            ));
        }
        let mut s = Settings::defaults(defaults);
        let get = |key: &str| settings.get(key).and_then(Value::as_str);
        let bad =
            |key: &str, message: String| RequestError::new(format!("settings.{key}"), message);
        if let Some(v) = get("agentPort") {
            s.agent_port = v
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad("agentPort", format!("{v:?} is not a port (1-65535)")))?;
        }
        if let Some(v) = get("addressTypes") {
            let types = list(v);
            const KNOWN: [&str; 5] = [
                "InternalIP",
                "ExternalIP",
                "Hostname",
                "InternalDNS",
                "ExternalDNS",
            ];
            if let Some(t) = types.iter().find(|t| !KNOWN.contains(&t.as_str())) {
                return Err(bad(
                    "addressTypes",
                    format!(
                        "{t:?} is not a Machine address type (one of {})",
                        KNOWN.join(", ")
                    ),
                ));
            }
            if types.is_empty() {
                return Err(bad("addressTypes", "is empty".into()));
            }
            s.address_types = types;
        }
        if let Some(v) = get("kubernetesPackages") {
            s.kubernetes_packages = list(v);
        }
        match (
            get("packageRepositoryPath"),
            get("packageRepositoryTemplate"),
        ) {
            (None | Some(""), None | Some("")) => {}
            (Some(path), Some(template)) if !path.is_empty() && !template.is_empty() => {
                if !path.starts_with('/') {
                    return Err(bad(
                        "packageRepositoryPath",
                        format!("{path:?} is not an absolute path"),
                    ));
                }
                s.repository = Some((path.to_owned(), template.to_owned()));
            }
            (path, _) => {
                let missing = if path.is_none_or(str::is_empty) {
                    "packageRepositoryPath"
                } else {
                    "packageRepositoryTemplate"
                };
                return Err(bad(
                    missing,
                    "must be set together with the other packageRepository key".into(),
                ));
            }
        }
        if let Some(v) = get("kubeletHealthzURL") {
            s.kubelet_healthz_url = if v.is_empty() {
                None
            } else if v.starts_with("http://") || v.starts_with("https://") {
                Some(v.to_owned())
            } else {
                return Err(bad(
                    "kubeletHealthzURL",
                    format!("{v:?} is not an http(s) URL"),
                ));
            };
        }
        let seconds = |key: &str, max: u32| -> Result<Option<u32>, RequestError> {
            get(key)
                .map(|v| {
                    v.trim()
                        .parse::<u32>()
                        .ok()
                        .filter(|n| *n <= max)
                        .ok_or_else(|| {
                            bad(key, format!("{v:?} is not a number of seconds up to {max}"))
                        })
                })
                .transpose()
        };
        // Below Cluster API's 10 s hook timeout, with room for the rest of the call.
        if let Some(n) = seconds("updateWaitSeconds", 8)? {
            s.update_wait = std::time::Duration::from_secs(n.into());
        }
        if let Some(n) = seconds("gateTimeoutSeconds", 3600)? {
            s.gate_timeout_seconds = n.max(1);
        }
        if let Some(n) = seconds("planTimeoutSeconds", 7 * 86400)? {
            s.plan_timeout_seconds = n;
        }
        if let Some(n) = seconds("unreachableTimeoutSeconds", 7 * 86400)? {
            s.unreachable_timeout = std::time::Duration::from_secs(n.into());
        }
        if let Some(v) = get("agentCA") {
            s.agent_ca = match v.trim() {
                "File" | "" => AgentCa::File,
                "ClusterSecret" => AgentCa::ClusterSecret,
                other => {
                    return Err(bad(
                        "agentCA",
                        format!("{other:?} is not File or ClusterSecret"),
                    ));
                }
            };
        }
        if s.agent_ca == AgentCa::File && !defaults.agent_ca_file {
            return Err(bad(
                "agentCA",
                format!(
                    "is File{}, which verifies the agents against the --agent-ca file, and \
                     this updater was started without --agent-ca: start it with --agent-ca \
                     FILE, or set agentCA: ClusterSecret (docs/pki.md, \"Which CA verifies \
                     the agents\")",
                    if get("agentCA").is_none() {
                        " (the default: the settings do not set it)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        if let Some(v) = get("disableInPlaceUpdates") {
            s.disable_in_place = match v {
                "true" => true,
                "false" | "" => false,
                other => {
                    return Err(bad(
                        "disableInPlaceUpdates",
                        format!("{other:?} is not \"true\" or \"false\""),
                    ));
                }
            };
        }
        if let Some(n) = seconds("retryMinIntervalSeconds", 7 * 86400)? {
            s.retry_min_interval = std::time::Duration::from_secs(n.into());
        }
        s.read_drain(settings, seconds("drainTimeoutSeconds", 30 * 86400)?)?;
        Ok(s)
    }

    /// The drain's keys (docs/updater.md, "Drain").
    fn read_drain(
        &mut self,
        settings: &Map<String, Value>,
        timeout: Option<u32>,
    ) -> Result<(), RequestError> {
        let get = |key: &str| settings.get(key).and_then(Value::as_str);
        let bad =
            |key: &str, message: String| RequestError::new(format!("settings.{key}"), message);
        if let Some(v) = get("drain") {
            self.drain = DrainMode::parse(v)
                .ok_or_else(|| bad("drain", format!("{v:?} is not Never, Disruptive or Always")))?;
        }
        if let Some(v) = get("drainOnRestartOf") {
            self.drain_on_restart_of = list(v);
        }
        if let Some(n) = timeout {
            self.drain_timeout_seconds = n;
        }
        if let Some(v) = get("onDrainTimeout") {
            self.on_drain_timeout = match v {
                "Fail" => OnTimeout::Fail,
                "Proceed" => OnTimeout::Proceed,
                other => {
                    return Err(bad(
                        "onDrainTimeout",
                        format!("{other:?} is not Fail or Proceed"),
                    ));
                }
            };
        }
        Ok(())
    }
}

fn list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Settings, RequestError> {
        Settings::from_extension_config(v.as_object().unwrap(), &Defaults::default())
    }

    #[test]
    fn settings_win_over_flags_and_errors_name_the_key() {
        let s = parse(json!({"agentPort": "8443"})).unwrap();
        assert_eq!(s.agent_port, 8443);
        let unknown = parse(json!({"agentCa": "ClusterSecret"})).unwrap_err();
        assert_eq!(unknown.field, "settings.agentCa");
        assert!(
            unknown.message.contains("did you mean \"agentCA\"?"),
            "{unknown}"
        );
        assert_eq!(parse(json!({})).unwrap().agent_port, 9443);
        assert_eq!(
            parse(json!({"agentPort": "x"})).unwrap_err().field,
            "settings.agentPort"
        );
        assert_eq!(
            parse(json!({"addressTypes": "InternalIP,Bogus"}))
                .unwrap_err()
                .field,
            "settings.addressTypes"
        );
        assert_eq!(
            parse(json!({"packageRepositoryPath": "/etc/apt/sources.list.d/k.list"}))
                .unwrap_err()
                .field,
            "settings.packageRepositoryTemplate"
        );
        assert_eq!(parse(json!({})).unwrap().agent_ca, AgentCa::File);
        assert_eq!(
            parse(json!({"agentCA": "ClusterSecret"})).unwrap().agent_ca,
            AgentCa::ClusterSecret
        );
        assert_eq!(
            parse(json!({"agentCA": "Secret"})).unwrap_err().field,
            "settings.agentCA"
        );
        assert_eq!(
            parse(json!({"kubeletHealthzURL": ""}))
                .unwrap()
                .kubelet_healthz_url,
            None
        );
    }

    /// Without `--agent-ca`, `ClusterSecret` is served and `File` (set, or the default) is
    /// refused naming the flag and the other mode.
    #[test]
    fn agent_ca_file_is_required_only_by_the_file_mode() {
        let without = Defaults {
            agent_ca_file: false,
            ..Defaults::default()
        };
        let parse = |v: Value| Settings::from_extension_config(v.as_object().unwrap(), &without);
        assert_eq!(
            parse(json!({"agentCA": "ClusterSecret"})).unwrap().agent_ca,
            AgentCa::ClusterSecret
        );
        for (settings, default) in [(json!({}), true), (json!({"agentCA": "File"}), false)] {
            let e = parse(settings).unwrap_err();
            assert_eq!(e.field, "settings.agentCA");
            assert!(
                e.message.contains("started without --agent-ca")
                    && e.message.contains("agentCA: ClusterSecret"),
                "{e}"
            );
            assert_eq!(e.message.contains("the default"), default, "{e}");
        }
    }

    #[test]
    fn drain_settings_have_defaults_and_errors_name_the_key() {
        let d = parse(json!({})).unwrap();
        assert_eq!(d.drain, DrainMode::Disruptive);
        assert_eq!(d.drain_on_restart_of, ["containerd"]);
        assert_eq!(
            (d.drain_timeout_seconds, d.on_drain_timeout),
            (0, OnTimeout::Fail)
        );
        let s = parse(
            json!({"drain": "Always", "drainOnRestartOf": "containerd, crio.service",
            "drainTimeoutSeconds": "600", "onDrainTimeout": "Proceed"}),
        )
        .unwrap();
        assert_eq!(s.drain, DrainMode::Always);
        assert_eq!(s.drain_on_restart_of, ["containerd", "crio.service"]);
        assert_eq!(
            (s.drain_timeout_seconds, s.on_drain_timeout),
            (600, OnTimeout::Proceed)
        );
        for (key, value) in [
            ("drain", "true"),
            ("onDrainTimeout", "Wait"),
            ("drainTimeoutSeconds", "-1"),
        ] {
            assert_eq!(
                parse(json!({key: value})).unwrap_err().field,
                format!("settings.{key}")
            );
        }
    }

    #[test]
    fn every_key_is_documented() {
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/updater.md"),
        )
        .unwrap();
        for (key, _) in KEYS {
            assert!(
                doc.contains(&format!("`{key}`")),
                "docs/updater.md does not document {key}"
            );
        }
    }
}

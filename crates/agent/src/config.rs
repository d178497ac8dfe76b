//! Settings: the agent's configuration validated once into values the rest of the code can
//! use without re-checking (paths resolved, allow-list parsed, limits set).

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::engine::EngineConfig;
use crate::host::download::{DownloadConfig, check_ca_pem};
use crate::host::packages::{ManagerKind, PackageSettings, PkgOptions};
use crate::host::systemd::system_bus_address;
use crate::host::{HostSettings, ServiceSettings};
use crate::rpc::server::ServeOptions;
use crate::steps::Capabilities;
use inplace_api::authz::{AuthzRules, IdentityPattern};
use inplace_api::tls::ServerTlsPaths;
use inplace_plan::{AllowList, Limits, NodePath};

/// Where the agent keeps its state under a root when not told otherwise.
pub const DEFAULT_STATE_SUBDIR: &str = "var/lib/inplace-agent";

/// What the local commands and the daemon share: the node, the state, the policy.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The node.
    pub host: HostSettings,
    /// The engine.
    pub engine: EngineConfig,
    /// Plan validation limits and policy.
    pub limits: Limits,
}

/// Settings as given (flags, later the config file): everything optional.
#[derive(Debug, Clone, Default)]
pub struct SettingsInput {
    /// Root directory (default `/`).
    pub root: Option<PathBuf>,
    /// State directory (default `<root>/var/lib/inplace-agent`).
    pub state_dir: Option<PathBuf>,
    /// Extra allow-list directories.
    pub allow_paths: Vec<String>,
    /// Replace the default allow-list instead of extending it.
    pub replace_allow_list: bool,
    /// Node name.
    pub node_name: Option<String>,
    /// Run node commands without chroot.
    pub no_chroot: bool,
    /// Allow `exec` changes.
    pub allow_exec: bool,
    /// Hosts artifacts may be fetched from over plain http.
    pub allow_http_hosts: Vec<String>,
    /// Manage no units at all (`--services off`): restarts are journaled as skipped, unit
    /// and reboot changes and `unitActive` gates are refused. For plain directory trees.
    pub services_off: bool,
    /// The D-Bus address of the node's system bus (default
    /// `unix:path=<root>/run/dbus/system_bus_socket`).
    pub bus: Option<String>,
    /// Read the boot id here instead of `<root>/proc/sys/kernel/random/boot_id` (tests
    /// simulate a reboot by changing this file).
    pub boot_id_file: Option<PathBuf>,
    /// Use this package manager (`apt`, `dnf`) instead of detecting one.
    pub package_manager: Option<String>,
    /// Extra CA certificates (PEM files) trusted for artifact downloads.
    pub download_ca_files: Vec<PathBuf>,
    /// Plan limits and how many finished plans to remember (defaults when unset).
    pub plan_limits: PlanLimitsInput,
}

/// Plan limits as given: everything optional.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlanLimitsInput {
    /// Most entries in `changes[]` (default 10,000).
    pub max_changes: Option<NonZeroUsize>,
    /// Most entries in `verify[]` (default 100).
    pub max_checks: Option<NonZeroUsize>,
    /// Largest decoded content of one file or unit, in bytes (default 4 MiB).
    pub max_content_bytes: Option<NonZeroUsize>,
    /// Finished plans the engine remembers (default 1,000).
    pub keep_plans: Option<NonZeroUsize>,
}

impl PlanLimitsInput {
    /// `over` where it is set, `self` elsewhere.
    fn overlay(self, over: PlanLimitsInput) -> PlanLimitsInput {
        PlanLimitsInput {
            max_changes: over.max_changes.or(self.max_changes),
            max_checks: over.max_checks.or(self.max_checks),
            max_content_bytes: over.max_content_bytes.or(self.max_content_bytes),
            keep_plans: over.keep_plans.or(self.keep_plans),
        }
    }
}

impl SettingsInput {
    /// Validates into [`Settings`]; errors name the setting.
    pub fn resolve(self) -> Result<Settings, String> {
        let root = self.root.unwrap_or_else(|| PathBuf::from("/"));
        if !root.is_dir() {
            return Err(format!("root {}: not a directory", root.display()));
        }
        let state_dir = self
            .state_dir
            .unwrap_or_else(|| root.join(DEFAULT_STATE_SUBDIR));
        let mut dirs: Vec<NodePath> = if self.replace_allow_list {
            Vec::new()
        } else {
            AllowList::default().dirs().to_vec()
        };
        for p in &self.allow_paths {
            let path = NodePath::parse(p).map_err(|e| format!("allow-path {p:?}: path {e}"))?;
            if !dirs.contains(&path) {
                dirs.push(path);
            }
        }
        if dirs.is_empty() {
            return Err(
                "allow-list: replace_allow_list is set and no allow_paths are given, so \
                        plans could change nothing; add [plans] allow_paths (--allow-path DIR)"
                    .to_string(),
            );
        }
        let allow = AllowList::new(dirs);
        let mut engine = EngineConfig::new(state_dir);
        engine.node_name = self.node_name;
        engine.capabilities = Capabilities {
            exec_allowed: self.allow_exec,
            kinds: Capabilities::implemented(),
        };
        let services = match (self.services_off, self.bus) {
            (true, Some(bus)) => {
                return Err(format!(
                    "bus {bus:?}: a bus address makes no sense with service management off"
                ));
            }
            (true, None) => ServiceSettings::Off,
            (false, Some(bus)) if bus.trim().is_empty() => {
                return Err("bus: empty D-Bus address".to_string());
            }
            (false, Some(bus)) => ServiceSettings::Systemd { bus },
            (false, None) => ServiceSettings::Systemd {
                bus: system_bus_address(&root),
            },
        };
        let defaults = Limits::default();
        let plan_limits = self.plan_limits;
        if let Some(keep) = plan_limits.keep_plans {
            engine.keep_plans = keep.get();
        }
        let package_manager = match &self.package_manager {
            Some(name) => Some(
                name.parse::<ManagerKind>()
                    .map_err(|_| format!("package manager {name:?}: expected apt or dnf"))?,
            ),
            None => None,
        };
        let mut downloads = DownloadConfig::new(&engine.state_dir);
        downloads.http_allowed_hosts = self.allow_http_hosts.clone();
        for file in &self.download_ca_files {
            let pem = std::fs::read(file)
                .map_err(|e| format!("download CA file {}: {e}", file.display()))?;
            check_ca_pem(&pem).map_err(|e| format!("download CA file {}: {e}", file.display()))?;
            downloads.extra_ca_pem.push(pem);
        }
        let limits = Limits {
            allow,
            allow_http_hosts: self.allow_http_hosts,
            max_changes: plan_limits
                .max_changes
                .map_or(defaults.max_changes, NonZeroUsize::get),
            max_checks: plan_limits
                .max_checks
                .map_or(defaults.max_checks, NonZeroUsize::get),
            max_content_bytes: plan_limits
                .max_content_bytes
                .map_or(defaults.max_content_bytes, NonZeroUsize::get),
            ..defaults
        };
        Ok(Settings {
            host: HostSettings {
                root,
                allow: limits.allow.clone(),
                commands_in_root: !self.no_chroot,
                boot_id_path: self.boot_id_file,
                services,
                packages: PackageSettings {
                    manager: package_manager,
                    options: PkgOptions::default(),
                },
                downloads,
            },
            engine,
            limits,
        })
    }
}

impl Settings {
    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.host.root
    }
}

// === The daemon ===

/// A fully commented configuration file with every key at its default
/// (`inplace-agent config print-default`); keys whose default depends on the node are
/// commented out.
pub const DEFAULT_CONFIG: &str = include_str!("default-config.toml");

/// The daemon's configuration file when `--config` is not given (read only if it exists).
pub const DEFAULT_CONFIG_PATH: &str = "/etc/inplace-agent/config.toml";

/// Where the daemon listens when not told otherwise.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:9443";

/// Where the daemon's TLS files are when not told otherwise (`server.crt`, `server.key`,
/// `ca.crt`, as `pki init` writes them).
pub const DEFAULT_PKI_DIR: &str = "/etc/inplace-agent/pki";

/// Engine events the daemon's broadcast holds (see `EngineConfig::event_capacity`).
pub const DAEMON_EVENT_CAPACITY: usize = 1024;

/// What `serve` runs with: the node settings plus the listener, TLS, authorization and
/// transport limits. Validated: the node name is known and well formed, patterns parsed.
#[derive(Debug, Clone)]
pub struct DaemonSettings {
    /// Node, engine and plan settings (the engine requires plans to name this node).
    pub settings: Settings,
    /// This node's name.
    pub node_name: String,
    /// The gRPC listen address.
    pub listen: SocketAddr,
    /// Server certificate, key and client CA bundle.
    pub tls: ServerTlsPaths,
    /// Identity → role rules.
    pub rules: AuthzRules,
    /// Transport limits.
    pub serve: ServeOptions,
    /// The local status socket.
    pub status: StatusSocketSettings,
    /// Where to serve `/metrics` over plain TCP for scraping; `None`: only on the socket.
    pub metrics_listen: Option<SocketAddr>,
    /// How log lines look.
    pub log_format: LogFormat,
    /// When drift is checked and whether it is repaired.
    pub drift: DriftSettings,
}

pub use crate::status::server::StatusSocketSettings;

/// Whether drift is repaired without being asked (`drift.repair`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RepairMode {
    /// Only on request (`inplace-agent repair`, the `RepairPlan` call).
    #[default]
    Off,
    /// Re-apply the last succeeded plan when drift is found, at most once per
    /// `repair_min_interval`.
    Auto,
}

/// When drift is checked and whether it is repaired (validated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriftSettings {
    /// Check at all (at start-up, on the interval, after writes to managed directories).
    pub enabled: bool,
    /// Time between two checks when nothing is noticed.
    pub interval: Duration,
    /// How long after a write to a managed directory the check is made (later writes
    /// within it are folded into the same check).
    pub debounce: Duration,
    /// Repair without being asked.
    pub repair: RepairMode,
    /// At most one automatic repair per this long.
    pub repair_min_interval: Duration,
    /// How the daemon starts a check process (`cli::drift_probe`); `None`: checks read the
    /// node in the daemon's process. Not configured: `inplace-agent serve` sets it to
    /// itself with its own arguments.
    pub check_process: Option<CheckCommand>,
}

/// The command of a drift check process: `program` with `args`, to which `--drift-probe`
/// is added (`args` are those of an `inplace-agent serve`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckCommand {
    /// The `inplace-agent` executable.
    pub program: std::path::PathBuf,
    /// `serve` and its flags.
    pub args: Vec<std::ffi::OsString>,
    /// How long a check process may take before it is killed.
    pub time_limit: Duration,
}

/// Default time between two drift checks.
pub const DEFAULT_DRIFT_INTERVAL: Duration = Duration::from_secs(300);
/// Default delay of a check after a write is noticed.
pub const DEFAULT_DRIFT_DEBOUNCE: Duration = Duration::from_secs(2);
/// Default least time between two automatic repairs.
pub const DEFAULT_REPAIR_MIN_INTERVAL: Duration = Duration::from_secs(3600);

/// The drift settings as given (file, then flags over it).
#[derive(Debug, Clone, Default)]
pub struct DriftInput {
    /// `drift.enabled` (default true).
    pub enabled: Option<bool>,
    /// `drift.interval_seconds` (default 300).
    pub interval: Option<Duration>,
    /// `drift.debounce_ms` (default 2000).
    pub debounce: Option<Duration>,
    /// `drift.repair` (default off).
    pub repair: Option<RepairMode>,
    /// `drift.repair_min_interval_seconds` (default 3600).
    pub repair_min_interval: Option<Duration>,
}

impl DriftInput {
    fn overlay(self, over: DriftInput) -> DriftInput {
        DriftInput {
            enabled: over.enabled.or(self.enabled),
            interval: over.interval.or(self.interval),
            debounce: over.debounce.or(self.debounce),
            repair: over.repair.or(self.repair),
            repair_min_interval: over.repair_min_interval.or(self.repair_min_interval),
        }
    }

    fn resolve(self) -> Result<DriftSettings, String> {
        let interval = self.interval.unwrap_or(DEFAULT_DRIFT_INTERVAL);
        if interval < Duration::from_secs(1) {
            return Err("drift.interval_seconds: at least 1".into());
        }
        Ok(DriftSettings {
            enabled: self.enabled.unwrap_or(true),
            interval,
            debounce: self.debounce.unwrap_or(DEFAULT_DRIFT_DEBOUNCE),
            repair: self.repair.unwrap_or_default(),
            repair_min_interval: self
                .repair_min_interval
                .unwrap_or(DEFAULT_REPAIR_MIN_INTERVAL),
            check_process: None,
        })
    }
}

/// Where the status socket is when not told otherwise, for a root `/`.
pub const DEFAULT_STATUS_SOCKET: &str = "/run/inplace-agent/status.sock";

/// The group that may read the status socket when not told otherwise.
pub const DEFAULT_STATUS_GROUP: &str = "inplace-agent";

/// The status socket's permission bits when not told otherwise.
pub const DEFAULT_STATUS_MODE: u32 = 0o660;

/// The status socket for a root: `/run/inplace-agent/status.sock` on a node, the same path
/// under the root otherwise (a sandbox; `/host/run/...` in the DaemonSet, which is the node's
/// `/run/...`).
pub fn default_status_socket(root: &Path) -> PathBuf {
    root.join(DEFAULT_STATUS_SOCKET.trim_start_matches('/'))
}

/// How log lines look (`--log-format`, `log.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Lines for people and journald: no colours unless on a terminal, no timestamps and a
    /// syslog priority prefix under systemd (journald adds both).
    #[default]
    Plain,
    /// One JSON object a line, with the plan's id, digest and change index as span fields.
    Json,
}

/// Checks a group name as `groupadd` accepts it (`[a-z_][a-z0-9_-]*`, at most 32).
pub fn check_group_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    if !first_ok
        || name.len() > 32
        || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
    {
        return Err(format!(
            "{name:?} is not a valid group name (lowercase letters, digits, '_' and '-', \
             starting with a letter or '_', at most 32 characters; \"\" for none)"
        ));
    }
    Ok(())
}

/// Parses permission bits written in octal (`"0660"`); at most `0777`.
pub fn parse_mode(text: &str) -> Result<u32, String> {
    let digits = text.strip_prefix("0o").unwrap_or(text);
    match u32::from_str_radix(digits, 8) {
        Ok(mode) if !digits.is_empty() && mode <= 0o777 => Ok(mode),
        _ => Err(format!(
            "{text:?} is not a permission mode (octal, at most \"0777\", like \"0660\")"
        )),
    }
}

/// The daemon's settings as given (file, then flags over it): everything optional.
#[derive(Debug, Clone, Default)]
pub struct DaemonInput {
    /// Node, state and plan settings.
    pub settings: SettingsInput,
    /// gRPC listen address (default `0.0.0.0:9443`).
    pub listen: Option<SocketAddr>,
    /// Server certificate chain (default `/etc/inplace-agent/pki/server.crt`).
    pub tls_cert: Option<PathBuf>,
    /// Server private key (default `/etc/inplace-agent/pki/server.key`).
    pub tls_key: Option<PathBuf>,
    /// CA bundle client certificates must chain to (default `/etc/inplace-agent/pki/ca.crt`).
    pub client_ca: Option<PathBuf>,
    /// Identities with the admin role; a list given later replaces an earlier one.
    pub admin: Option<Vec<IdentityPattern>>,
    /// Identities with the reader role; a list given later replaces an earlier one.
    pub reader: Option<Vec<IdentityPattern>>,
    /// Largest gRPC message, in bytes (default 16 MiB).
    pub max_message_bytes: Option<NonZeroUsize>,
    /// Concurrent calls per connection (default 32).
    pub max_concurrent_streams: Option<NonZeroU32>,
    /// Open connections (default 256).
    pub max_connections: Option<NonZeroUsize>,
    /// Upper bound for answering a call (default 30 s).
    pub request_timeout: Option<Duration>,
    /// The status socket (default `/run/inplace-agent/status.sock` under the root).
    pub status_socket: Option<PathBuf>,
    /// The group that may read it (default `inplace-agent`; `""`: root only).
    pub status_group: Option<String>,
    /// Its permission bits (default `0660`).
    pub status_mode: Option<u32>,
    /// A TCP address to serve `/metrics` on (default: none).
    pub metrics_listen: Option<SocketAddr>,
    /// How log lines look (default plain).
    pub log_format: Option<LogFormat>,
    /// Drift checks and repair.
    pub drift: DriftInput,
}

fn join_paths(mut a: Vec<PathBuf>, b: Vec<PathBuf>) -> Vec<PathBuf> {
    for p in b {
        if !a.contains(&p) {
            a.push(p);
        }
    }
    a
}

impl DaemonInput {
    /// `over` layered on `self` (flags over the file): a value set in `over` wins, role
    /// lists given in `over` replace those of `self`, allowed paths and http hosts are
    /// joined, and switches (`no_chroot`, `allow_exec`, `replace_allow_list`) are on when
    /// either turns them on.
    pub fn overlay(self, over: DaemonInput) -> DaemonInput {
        let (base, top) = (self.settings, over.settings);
        let join = |mut a: Vec<String>, b: Vec<String>| {
            for item in b {
                if !a.contains(&item) {
                    a.push(item);
                }
            }
            a
        };
        DaemonInput {
            settings: SettingsInput {
                root: top.root.or(base.root),
                state_dir: top.state_dir.or(base.state_dir),
                allow_paths: join(base.allow_paths, top.allow_paths),
                replace_allow_list: base.replace_allow_list || top.replace_allow_list,
                node_name: top.node_name.or(base.node_name),
                no_chroot: base.no_chroot || top.no_chroot,
                allow_exec: base.allow_exec || top.allow_exec,
                allow_http_hosts: join(base.allow_http_hosts, top.allow_http_hosts),
                plan_limits: base.plan_limits.overlay(top.plan_limits),
                package_manager: top.package_manager.or(base.package_manager),
                download_ca_files: join_paths(base.download_ca_files, top.download_ca_files),
                services_off: base.services_off || top.services_off,
                bus: top.bus.or(base.bus),
                boot_id_file: top.boot_id_file.or(base.boot_id_file),
            },
            listen: over.listen.or(self.listen),
            tls_cert: over.tls_cert.or(self.tls_cert),
            tls_key: over.tls_key.or(self.tls_key),
            client_ca: over.client_ca.or(self.client_ca),
            admin: over.admin.or(self.admin),
            reader: over.reader.or(self.reader),
            max_message_bytes: over.max_message_bytes.or(self.max_message_bytes),
            max_concurrent_streams: over.max_concurrent_streams.or(self.max_concurrent_streams),
            max_connections: over.max_connections.or(self.max_connections),
            request_timeout: over.request_timeout.or(self.request_timeout),
            status_socket: over.status_socket.or(self.status_socket),
            status_group: over.status_group.or(self.status_group),
            status_mode: over.status_mode.or(self.status_mode),
            metrics_listen: over.metrics_listen.or(self.metrics_listen),
            log_format: over.log_format.or(self.log_format),
            drift: self.drift.overlay(over.drift),
        }
    }

    /// Validates into [`DaemonSettings`]. The node name defaults to the first line of the
    /// root's `/etc/hostname`; the daemon refuses to start without one. Errors name the
    /// setting; every problem found is in the error, joined by "; ".
    pub fn resolve(self) -> Result<DaemonSettings, String> {
        self.resolve_each().map_err(|u| {
            u.problems
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        })
    }

    /// [`DaemonInput::resolve`], with every problem apart and, when there is one, what could
    /// still be told of the settings (for the start-up check to go on with: the TLS files,
    /// the roles, the state directory).
    pub fn resolve_each(self) -> Result<DaemonSettings, Box<Unresolved>> {
        let mut problems = Vec::new();
        let root = self
            .settings
            .root
            .clone()
            .unwrap_or_else(|| PathBuf::from("/"));
        let node_name = match self.settings.node_name.clone() {
            Some(name) => Some((name, "node.name")),
            None => match crate::host::node::hostname(&root) {
                Some(name) => Some((name, "the first line of <root>/etc/hostname")),
                None => {
                    problems.push(SettingProblem {
                        what: format!(
                            "node name: not set (node.name, --node-name) and {} has none",
                            root.join("etc/hostname").display()
                        ),
                        fix: Some(format!(
                            "set node.name (or --node-name) to this node's Kubernetes name, or \
                             write it to {}",
                            root.join("etc/hostname").display()
                        )),
                    });
                    None
                }
            },
        };
        let node_name = match node_name {
            Some((name, _)) if inplace_plan::is_dns_subdomain(&name) => Some(name),
            Some((name, from)) => {
                problems.push(SettingProblem {
                    what: format!(
                        "node name {name:?} (from {from}): not a valid Kubernetes node name (a \
                         lowercase DNS subdomain)"
                    ),
                    fix: Some(
                        "set node.name or --node-name to the node's Kubernetes name".to_string(),
                    ),
                });
                None
            }
            None => None,
        };
        let state_dir = self
            .settings
            .state_dir
            .clone()
            .unwrap_or_else(|| root.join(DEFAULT_STATE_SUBDIR));
        let defaults = ServerTlsPaths::in_dir(Path::new(DEFAULT_PKI_DIR));
        let tls = ServerTlsPaths {
            cert: self.tls_cert.unwrap_or(defaults.cert),
            key: self.tls_key.unwrap_or(defaults.key),
            client_ca: self.client_ca.unwrap_or(defaults.client_ca),
        };
        let rules = AuthzRules::new(
            self.admin.unwrap_or_default(),
            self.reader.unwrap_or_default(),
        );
        let settings = match (SettingsInput {
            node_name: node_name.clone(),
            ..self.settings
        })
        .resolve()
        {
            Ok(mut settings) => {
                settings.engine.require_node_name = true;
                // Watchers that fall further behind recover from the engine's phase
                // history; the broadcast's slots keep their last events alive while idle,
                // so keep it small.
                settings.engine.event_capacity = DAEMON_EVENT_CAPACITY;
                Some(settings)
            }
            Err(e) => {
                problems.push(SettingProblem { what: e, fix: None });
                None
            }
        };
        let listen = match self.listen {
            Some(addr) => addr,
            None => match DEFAULT_LISTEN.parse() {
                Ok(addr) => addr,
                Err(e) => {
                    problems.push(SettingProblem {
                        what: format!("listen {DEFAULT_LISTEN}: {e}"),
                        fix: None,
                    });
                    SocketAddr::from(([0, 0, 0, 0], 9443))
                }
            },
        };
        let mut serve = ServeOptions::default();
        if let Some(n) = self.max_message_bytes {
            serve.max_message_bytes = n.get();
        }
        if let Some(n) = self.max_concurrent_streams {
            serve.max_concurrent_streams = n.get();
        }
        if let Some(n) = self.max_connections {
            serve.accept.max_connections = n.get();
        }
        if let Some(t) = self.request_timeout {
            serve.request_timeout = t;
        }
        let group = match self.status_group {
            None => Some(DEFAULT_STATUS_GROUP.to_string()),
            Some(g) if g.is_empty() => None,
            Some(g) => match check_group_name(&g) {
                Ok(()) => Some(g),
                Err(e) => {
                    problems.push(SettingProblem {
                        what: format!("status group: {e}"),
                        fix: None,
                    });
                    None
                }
            },
        };
        let mode = self.status_mode.unwrap_or(DEFAULT_STATUS_MODE);
        if mode > 0o777 {
            problems.push(SettingProblem {
                what: format!("status mode {mode:o}: at most 0777"),
                fix: None,
            });
        }
        let drift = self
            .drift
            .resolve()
            .map_err(|e| problems.push(SettingProblem { what: e, fix: None }));
        match (settings, node_name, drift) {
            (Some(settings), Some(node_name), Ok(drift)) if problems.is_empty() => {
                let status = StatusSocketSettings {
                    path: self
                        .status_socket
                        .unwrap_or_else(|| default_status_socket(settings.root())),
                    group,
                    mode,
                };
                Ok(DaemonSettings {
                    settings,
                    node_name,
                    listen,
                    tls,
                    rules,
                    serve,
                    status,
                    metrics_listen: self.metrics_listen,
                    log_format: self.log_format.unwrap_or_default(),
                    drift,
                })
            }
            (_, node_name, _) => Err(Box::new(Unresolved {
                problems,
                node_name,
                root,
                state_dir,
                tls,
                rules,
            })),
        }
    }
}

/// One setting that cannot be used: what is wrong (naming the key and flag), and how to fix
/// it when that is more than "set it right".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingProblem {
    /// What is wrong, naming the setting.
    pub what: String,
    /// How to fix it, when the message does not already say.
    pub fix: Option<String>,
}

impl std::fmt::Display for SettingProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.fix {
            Some(fix) => write!(f, "{}; {fix}", self.what),
            None => f.write_str(&self.what),
        }
    }
}

/// Daemon settings that did not validate: every problem, and what is known of the rest.
#[derive(Debug, Clone)]
pub struct Unresolved {
    /// Each setting that cannot be used (at least one).
    pub problems: Vec<SettingProblem>,
    /// The node's name, when it is known and valid.
    pub node_name: Option<String>,
    /// The node's root directory as given.
    pub root: PathBuf,
    /// The state directory as given (or its default under the root).
    pub state_dir: PathBuf,
    /// The TLS files as given (or their defaults).
    pub tls: ServerTlsPaths,
    /// The roles as given.
    pub rules: AuthzRules,
}

/// A configuration file could not be used: where, which key, what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("config {}{}{}: {message}", path.display(), line.map(|l| format!(" line {l}")).unwrap_or_default(), key.as_ref().map(|k| format!(" key {k}")).unwrap_or_default())]
pub struct ConfigError {
    /// The file.
    pub path: PathBuf,
    /// 1-based line of the problem, when known.
    pub line: Option<usize>,
    /// Dotted key (`grpc.listen`), when known.
    pub key: Option<String>,
    /// What is wrong.
    pub message: String,
}

/// Reads and parses a configuration file.
pub fn load_config(path: &Path) -> Result<DaemonInput, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        path: path.to_path_buf(),
        line: None,
        key: None,
        message: format!("read: {e}"),
    })?;
    parse_config(&text, path)
}

/// Parses configuration text (`path` only names it in errors). Unknown keys and bad values
/// are errors naming the key and its line.
pub fn parse_config(text: &str, path: &Path) -> Result<DaemonInput, ConfigError> {
    let file: file::ConfigFile = toml::from_str(text).map_err(|e| {
        let offset = e.span().map(|s| s.start);
        let line = offset.map(|o| line_of(text, o));
        let key = offset.and_then(|o| file::key_at(text, o));
        // toml's messages end in a newline and sometimes carry a trailing period.
        let mut message = e
            .message()
            .trim_end()
            .trim_end_matches('.')
            .replace('\n', "; ");
        // A key of another section (its header still commented out, say): which one.
        let unknown = message
            .strip_prefix("unknown field `")
            .and_then(|rest| rest.split_once('`'))
            .map(|(field, _)| field.to_owned());
        if let (Some(field), Some(line)) = (unknown, line) {
            let section = key
                .as_deref()
                .and_then(|k| k.rsplit_once('.'))
                .map(|(table, _)| table);
            if let Some(hint) = file::misplaced_key_hint(text, line, &field, section) {
                message = format!("{message}; {hint}");
            }
        }
        ConfigError {
            path: path.to_path_buf(),
            line,
            key,
            message,
        }
    })?;
    Ok(file.into_input())
}

/// 1-based line number of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

/// The file format (`deny_unknown_fields` everywhere, every key optional). See
/// docs/configuration.md for each key.
mod file {
    use std::net::SocketAddr;
    use std::num::{NonZeroU32, NonZeroU64, NonZeroUsize};
    use std::path::PathBuf;
    use std::time::Duration;

    use serde::Deserialize;

    use super::{
        DaemonInput, LogFormat, PlanLimitsInput, SettingsInput, check_group_name, parse_mode,
    };
    use inplace_api::authz::IdentityPattern;
    use inplace_plan::NodePath;

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub(super) struct ConfigFile {
        #[serde(default)]
        node: Node,
        #[serde(default)]
        grpc: Grpc,
        #[serde(default)]
        tls: Tls,
        #[serde(default)]
        authorization: Authorization,
        #[serde(default)]
        plans: Plans,
        #[serde(default)]
        exec: Exec,
        #[serde(default)]
        status: Status,
        #[serde(default)]
        metrics: Metrics,
        #[serde(default)]
        log: Log,
        #[serde(default)]
        drift: Drift,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Drift {
        enabled: Option<bool>,
        interval_seconds: Option<std::num::NonZeroU64>,
        debounce_ms: Option<u64>,
        repair: Option<super::RepairMode>,
        repair_min_interval_seconds: Option<u64>,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Status {
        socket: Option<PathBuf>,
        group: Option<GroupName>,
        mode: Option<Mode>,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Metrics {
        listen: Option<MetricsListen>,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Log {
        format: Option<LogFormat>,
    }

    /// A group name or `""` (none), checked as it is read.
    #[derive(Debug, Deserialize)]
    #[serde(try_from = "String")]
    struct GroupName(String);

    impl TryFrom<String> for GroupName {
        type Error = String;

        fn try_from(s: String) -> Result<Self, String> {
            if !s.is_empty() {
                check_group_name(&s)?;
            }
            Ok(GroupName(s))
        }
    }

    /// Octal permission bits.
    #[derive(Debug, Deserialize)]
    #[serde(try_from = "String")]
    struct Mode(u32);

    impl TryFrom<String> for Mode {
        type Error = String;

        fn try_from(s: String) -> Result<Self, String> {
            parse_mode(&s).map(Mode)
        }
    }

    /// `ip:port`, or `""` for none.
    #[derive(Debug, Deserialize)]
    #[serde(try_from = "String")]
    struct MetricsListen(Option<SocketAddr>);

    impl TryFrom<String> for MetricsListen {
        type Error = String;

        fn try_from(s: String) -> Result<Self, String> {
            if s.is_empty() {
                return Ok(MetricsListen(None));
            }
            s.parse()
                .map(|a| MetricsListen(Some(a)))
                .map_err(|e| format!("{s:?}: {e} (expected ip:port, or \"\" for none)"))
        }
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Node {
        name: Option<NodeName>,
        root: Option<PathBuf>,
        state_dir: Option<PathBuf>,
        chroot: Option<bool>,
        services: Option<ServicesMode>,
        bus: Option<String>,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
    #[serde(rename_all = "lowercase")]
    enum ServicesMode {
        Systemd,
        Off,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Grpc {
        listen: Option<SocketAddr>,
        max_message_bytes: Option<NonZeroUsize>,
        max_concurrent_streams: Option<NonZeroU32>,
        max_connections: Option<NonZeroUsize>,
        request_timeout_seconds: Option<NonZeroU64>,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Tls {
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        client_ca: Option<PathBuf>,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Authorization {
        admin: Option<Vec<Pattern>>,
        reader: Option<Vec<Pattern>>,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Plans {
        #[serde(default)]
        allow_paths: Vec<AllowPath>,
        #[serde(default)]
        replace_allow_list: bool,
        #[serde(default)]
        allow_http_hosts: Vec<String>,
        max_changes: Option<NonZeroUsize>,
        max_checks: Option<NonZeroUsize>,
        max_content_bytes: Option<NonZeroUsize>,
        keep_plans: Option<NonZeroUsize>,
    }

    #[derive(Debug, Default, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Exec {
        #[serde(default)]
        allow: bool,
    }

    /// A node name, checked as it is read so the error points at the value.
    #[derive(Debug, Deserialize)]
    #[serde(try_from = "String")]
    struct NodeName(String);

    impl TryFrom<String> for NodeName {
        type Error = String;

        fn try_from(s: String) -> Result<Self, String> {
            if inplace_plan::is_dns_subdomain(&s) {
                Ok(NodeName(s))
            } else {
                Err(format!(
                    "{s:?} is not a valid Kubernetes node name (a lowercase DNS subdomain)"
                ))
            }
        }
    }

    #[derive(Debug, Deserialize)]
    #[serde(try_from = "String")]
    struct Pattern(IdentityPattern);

    impl TryFrom<String> for Pattern {
        type Error = String;

        fn try_from(s: String) -> Result<Self, String> {
            s.parse().map(Pattern).map_err(|e| format!("{e}"))
        }
    }

    #[derive(Debug, Deserialize)]
    #[serde(try_from = "String")]
    struct AllowPath(String);

    impl TryFrom<String> for AllowPath {
        type Error = String;

        fn try_from(s: String) -> Result<Self, String> {
            NodePath::parse(&s)
                .map(|_| AllowPath(s.clone()))
                .map_err(|e| format!("{s:?}: path {e}"))
        }
    }

    impl ConfigFile {
        pub(super) fn into_input(self) -> DaemonInput {
            let patterns = |list: Option<Vec<Pattern>>| {
                list.map(|l| l.into_iter().map(|Pattern(p)| p).collect())
            };
            DaemonInput {
                settings: SettingsInput {
                    root: self.node.root,
                    state_dir: self.node.state_dir,
                    allow_paths: self.plans.allow_paths.into_iter().map(|p| p.0).collect(),
                    replace_allow_list: self.plans.replace_allow_list,
                    node_name: self.node.name.map(|n| n.0),
                    no_chroot: self.node.chroot == Some(false),
                    allow_exec: self.exec.allow,
                    allow_http_hosts: self.plans.allow_http_hosts,
                    plan_limits: PlanLimitsInput {
                        max_changes: self.plans.max_changes,
                        max_checks: self.plans.max_checks,
                        max_content_bytes: self.plans.max_content_bytes,
                        keep_plans: self.plans.keep_plans,
                    },
                    package_manager: None,
                    download_ca_files: Vec::new(),
                    services_off: self.node.services == Some(ServicesMode::Off),
                    bus: self.node.bus,
                    boot_id_file: None,
                },
                listen: self.grpc.listen,
                tls_cert: self.tls.cert,
                tls_key: self.tls.key,
                client_ca: self.tls.client_ca,
                admin: patterns(self.authorization.admin),
                reader: patterns(self.authorization.reader),
                max_message_bytes: self.grpc.max_message_bytes,
                max_concurrent_streams: self.grpc.max_concurrent_streams,
                max_connections: self.grpc.max_connections,
                request_timeout: self
                    .grpc
                    .request_timeout_seconds
                    .map(|s| Duration::from_secs(s.get())),
                status_socket: self.status.socket,
                status_group: self.status.group.map(|g| g.0),
                status_mode: self.status.mode.map(|m| m.0),
                metrics_listen: self.metrics.listen.and_then(|l| l.0),
                log_format: self.log.format,
                drift: super::DriftInput {
                    enabled: self.drift.enabled,
                    interval: self
                        .drift
                        .interval_seconds
                        .map(|s| Duration::from_secs(s.get())),
                    debounce: self.drift.debounce_ms.map(Duration::from_millis),
                    repair: self.drift.repair,
                    repair_min_interval: self
                        .drift
                        .repair_min_interval_seconds
                        .map(Duration::from_secs),
                },
            }
        }
    }

    // === Where a key belongs ===

    /// The names of a struct's fields as its derived `Deserialize` declares them: the
    /// configuration file's own schema, asked instead of written down a second time.
    fn field_names<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
        let mut fields: &'static [&'static str] = &[];
        let _ = T::deserialize(FieldNames(&mut fields));
        fields
    }

    /// A deserializer that only records the field names a struct asks for.
    struct FieldNames<'a>(&'a mut &'static [&'static str]);

    /// Why [`FieldNames`] stops: it has no data to give.
    #[derive(Debug)]
    struct NoData;

    impl std::fmt::Display for NoData {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("no data")
        }
    }

    impl std::error::Error for NoData {}

    impl serde::de::Error for NoData {
        fn custom<T: std::fmt::Display>(_: T) -> Self {
            NoData
        }
    }

    impl<'de> serde::Deserializer<'de> for FieldNames<'_> {
        type Error = NoData;

        fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, NoData> {
            Err(NoData)
        }

        fn deserialize_struct<V: serde::de::Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> Result<V::Value, NoData> {
            *self.0 = fields;
            Err(NoData)
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }

    /// The sections (`[authorization]`) of the file format that have a key named `key`:
    /// each section is asked, through the format itself, whether `key` is one of its fields.
    pub(super) fn sections_with(key: &str) -> Vec<&'static str> {
        let unknown = format!("unknown field `{key}`");
        field_names::<ConfigFile>()
            .iter()
            .copied()
            .filter(|section| {
                let mut inner = toml::Table::new();
                inner.insert(key.to_owned(), toml::Value::Boolean(true));
                let mut outer = toml::Table::new();
                outer.insert((*section).to_owned(), toml::Value::Table(inner));
                match ConfigFile::deserialize(toml::Value::Table(outer)) {
                    Ok(_) => true,
                    Err(e) => !e.message().contains(&unknown),
                }
            })
            .collect()
    }

    /// What to do about a key the file has in the wrong place: `key` (a bare key, as the
    /// error named it) is on 1-based line `line` of `text`, in section `in_section` (`None`:
    /// at the top, before any header). `None` when no other section has such a key.
    pub(super) fn misplaced_key_hint(
        text: &str,
        line: usize,
        key: &str,
        in_section: Option<&str>,
    ) -> Option<String> {
        let homes: Vec<&str> = sections_with(key)
            .into_iter()
            .filter(|s| Some(*s) != in_section)
            .collect();
        if homes.is_empty() {
            return None;
        }
        let lines: Vec<&str> = text.lines().collect();
        let above = &lines[..line.saturating_sub(1).min(lines.len())];
        // The nearest header above the key, commented out or not.
        let nearest = above.iter().enumerate().rev().find_map(|(i, l)| {
            let (commented, name) = header_of(l)?;
            Some((i + 1, commented, name))
        });
        let named = homes
            .iter()
            .map(|s| format!("[{s}]"))
            .collect::<Vec<_>>()
            .join(" or ");
        let here = match in_section {
            Some(s) => format!("it is read as a key of [{s}]"),
            None => "it is read as a top-level key".to_owned(),
        };
        if let Some((at, true, name)) = nearest
            && homes.contains(&name.as_str())
        {
            return Some(format!(
                "{key} is a key of [{name}], and the header \"# [{name}]\" on line {at} is still \
                 commented out, so {here}: uncomment \"[{name}]\" on line {at}"
            ));
        }
        let real = lines
            .iter()
            .enumerate()
            .find_map(|(i, l)| match header_of(l) {
                Some((false, name)) if homes.contains(&name.as_str()) => Some((i + 1, name)),
                _ => None,
            });
        Some(match real {
            Some((at, name)) => format!(
                "{key} is a key of {named} ({here}): move it under the \"[{name}]\" header on \
                 line {at}"
            ),
            None => format!(
                "{key} is a key of {named} ({here}): put \"[{}]\" on a line of its own above it",
                homes[0]
            ),
        })
    }

    /// A table header line, `[name]` or commented out (`# [name]`): (commented, name).
    fn header_of(line: &str) -> Option<(bool, String)> {
        let trimmed = line.trim();
        let (commented, rest) = match trimmed.strip_prefix('#') {
            Some(rest) => (true, rest.trim_start_matches('#').trim()),
            None => (false, trimmed),
        };
        let rest = rest.strip_prefix('[')?;
        if rest.starts_with('[') {
            return None;
        }
        let (name, after) = rest.split_once(']')?;
        let after = after.trim();
        let name = name.trim();
        let simple = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        (simple && (after.is_empty() || after.starts_with('#')))
            .then(|| (commented, name.to_owned()))
    }

    /// The dotted key whose key or value is at byte `offset`: the nearest `key = ...` at or
    /// above the offset (values may span lines, as arrays do), prefixed with the `[table]`
    /// it is in. Good for the files people write; `None` when it cannot tell.
    pub(super) fn key_at(text: &str, offset: usize) -> Option<String> {
        let offset = offset.min(text.len());
        let upto = &text[..offset];
        let line_start = upto.rfind('\n').map_or(0, |i| i + 1);
        let line_end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
        let this_line = &text[line_start..line_end];
        let mut lines = text[..line_start].lines().rev();
        let table = |lines: &mut dyn Iterator<Item = &str>| {
            lines
                .map(str::trim)
                .find(|l| l.starts_with('[') && !l.starts_with("[["))
                .map(|l| {
                    l.trim_start_matches('[')
                        .split(']')
                        .next()
                        .unwrap_or("")
                        .trim()
                        .to_owned()
                })
        };
        let key_of = |line: &str| {
            let line = line.trim();
            if line.starts_with('#') || line.starts_with('[') {
                return None;
            }
            let (key, _) = line.split_once('=')?;
            let key = key.trim().trim_matches('"');
            (!key.is_empty()
                && key
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)))
            .then(|| key.to_owned())
        };
        let trimmed = this_line.trim();
        if trimmed.starts_with('[') {
            // The error is about a table header itself: name the table.
            return table(&mut std::iter::once(trimmed));
        }
        let key = match key_of(this_line) {
            Some(k) => k,
            None => {
                // A value continued from an earlier line (a multi-line array).
                let mut found = None;
                for line in lines.by_ref() {
                    if line.trim().starts_with('[') {
                        return None;
                    }
                    if let Some(k) = key_of(line) {
                        found = Some(k);
                        break;
                    }
                }
                found?
            }
        };
        match table(&mut lines) {
            Some(t) if !t.is_empty() => Some(format!("{t}.{key}")),
            _ => Some(key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../../examples/config.toml");

    fn parse(text: &str) -> Result<DaemonInput, ConfigError> {
        parse_config(text, Path::new("/etc/inplace-agent/config.toml"))
    }

    #[test]
    fn the_example_file_sets_every_key() {
        let input = parse(EXAMPLE).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(input.settings.node_name.as_deref(), Some("worker-1"));
        assert_eq!(input.settings.root, Some(PathBuf::from("/")));
        assert!(!input.settings.no_chroot);
        assert_eq!(input.listen, Some("0.0.0.0:9443".parse().unwrap()));
        assert_eq!(input.max_concurrent_streams.map(|n| n.get()), Some(32));
        assert_eq!(input.request_timeout, Some(Duration::from_secs(30)));
        assert_eq!(
            input.client_ca,
            Some(PathBuf::from("/etc/inplace-agent/pki/ca.crt"))
        );
        assert_eq!(
            input.admin,
            Some(vec![IdentityPattern::Exact(
                "spiffe://inplace-agent/updater".into()
            )])
        );
        assert_eq!(input.settings.allow_paths, ["/etc/modprobe.d"]);
        assert_eq!(
            input.settings.plan_limits.keep_plans.map(|n| n.get()),
            Some(1000)
        );
        assert!(!input.settings.allow_exec);
        assert_eq!(
            input.status_socket,
            Some(PathBuf::from("/run/inplace-agent/status.sock"))
        );
        assert_eq!(input.status_group.as_deref(), Some("inplace-agent"));
        assert_eq!(input.status_mode, Some(0o660));
        assert_eq!(
            input.metrics_listen,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        assert_eq!(input.log_format, Some(LogFormat::Plain));
    }

    #[test]
    fn unknown_keys_are_named_with_their_line() {
        let err = parse("[grpc]\nlisten = \"127.0.0.1:1\"\nlisten_adress = \"x\"\n").unwrap_err();
        assert_eq!(err.line, Some(3), "{err}");
        assert_eq!(err.key.as_deref(), Some("grpc.listen_adress"), "{err}");
        assert!(
            err.message.contains("unknown field `listen_adress`"),
            "{err}"
        );
        assert!(
            err.to_string().starts_with(
                "config /etc/inplace-agent/config.toml line 3 key grpc.listen_adress: "
            ),
            "{err}"
        );

        let err = parse("# tables\n[grcp]\nlisten = \"127.0.0.1:1\"\n").unwrap_err();
        assert_eq!(err.line, Some(2), "{err}");
        assert!(err.message.contains("unknown field `grcp`"), "{err}");
    }

    #[test]
    fn a_key_of_another_section_says_which_and_where_its_header_is() {
        assert_eq!(file::sections_with("admin"), ["authorization"]);
        assert_eq!(file::sections_with("listen"), ["grpc", "metrics"]);
        assert!(file::sections_with("listen_adress").is_empty());
        let text = "# [node]\n# name = \"x\"\n\n# [authorization]\nadmin = []\n";
        let err = parse(text).unwrap_err();
        assert_eq!(
            (err.line, err.key.as_deref()),
            (Some(5), Some("admin")),
            "{err}"
        );
        assert!(
            err.message.ends_with(
                "; admin is a key of [authorization], and the header \"# [authorization]\" on \
                 line 4 is still commented out, so it is read as a top-level key: uncomment \
                 \"[authorization]\" on line 4"
            ),
            "{err}"
        );
        let err = parse("[tls]\nlisten = \"127.0.0.1:1\"\n").unwrap_err();
        assert!(
            err.message.ends_with(
                "; listen is a key of [grpc] or [metrics] (it is read as a key of [tls]): put \
                 \"[grpc]\" on a line of its own above it"
            ),
            "{err}"
        );
        let err = parse("[grpc]\nlisten_adress = 1\n").unwrap_err();
        assert!(!err.message.contains("is a key of"), "{err}");
    }

    #[test]
    fn bad_values_are_named_with_their_line() {
        let cases = [
            (
                "[plans]\nmax_changes = \"many\"\n",
                2,
                "plans.max_changes",
                "invalid type",
            ),
            (
                "[plans]\n\nmax_checks = 0\n",
                3,
                "plans.max_checks",
                "nonzero",
            ),
            (
                "[grpc]\nlisten = \"9443\"\n",
                2,
                "grpc.listen",
                "invalid socket address",
            ),
            (
                "[node]\nname = \"Worker_1\"\n",
                2,
                "node.name",
                "not a valid Kubernetes node name",
            ),
            (
                // An element's error points at its list (the message names the element).
                "[authorization]\nadmin = [\n  \"spiffe://a/*\",\n  \"spiffe://*/b\",\n]\n",
                2,
                "authorization.admin",
                "'*' is only allowed as the last character",
            ),
            (
                "[plans]\nallow_paths = [\"relative/dir\"]\n",
                2,
                "plans.allow_paths",
                "relative/dir",
            ),
            ("[exec]\nallow = \"yes\"\n", 2, "exec.allow", "invalid type"),
            (
                "[tls]\ncert = \"/a\"\n[authorization]\nreader = [\n  \"spiffe://a\",\n  7,\n]\n",
                6,
                "authorization.reader",
                "invalid type",
            ),
        ];
        for (text, line, key, message) in cases {
            let err = parse(text).unwrap_err();
            assert_eq!(err.line, Some(line), "{text}: {err}");
            assert_eq!(err.key.as_deref(), Some(key), "{text}: {err}");
            assert!(err.message.contains(message), "{text}: {err}");
            assert!(!err.message.ends_with('.'), "{err}");
        }
    }

    #[test]
    fn the_printed_default_parses_to_the_defaults() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("etc")).unwrap();
        std::fs::write(root.path().join("etc/hostname"), "worker-3\n").unwrap();
        let resolve = |text: &str| {
            let input = parse(text).unwrap_or_else(|e| panic!("{e}"));
            let flags = DaemonInput {
                settings: SettingsInput {
                    root: Some(root.path().to_path_buf()),
                    ..SettingsInput::default()
                },
                ..DaemonInput::default()
            };
            format!("{:?}", input.overlay(flags).resolve().unwrap())
        };
        assert_eq!(resolve(DEFAULT_CONFIG), resolve(""));
        // Every key of the file format is in it, set or commented.
        for key in [
            "name",
            "root",
            "state_dir",
            "chroot",
            "services",
            "bus",
            "listen",
            "max_message_bytes",
            "max_concurrent_streams",
            "max_connections",
            "request_timeout_seconds",
            "cert",
            "key",
            "client_ca",
            "admin",
            "reader",
            "allow_paths",
            "replace_allow_list",
            "allow_http_hosts",
            "max_changes",
            "max_checks",
            "max_content_bytes",
            "keep_plans",
            "allow",
            "socket",
            "group",
            "mode",
            "format",
        ] {
            assert!(
                DEFAULT_CONFIG
                    .lines()
                    .any(|l| l.trim_start_matches("# ").starts_with(&format!("{key} = "))),
                "{key} is missing from the default config"
            );
        }
        let daemon = parse(DEFAULT_CONFIG)
            .unwrap()
            .overlay(DaemonInput {
                settings: SettingsInput {
                    root: Some(root.path().to_path_buf()),
                    ..SettingsInput::default()
                },
                ..DaemonInput::default()
            })
            .resolve()
            .unwrap();
        assert_eq!(
            daemon.status,
            StatusSocketSettings {
                path: root.path().join("run/inplace-agent/status.sock"),
                group: Some("inplace-agent".into()),
                mode: 0o660,
            }
        );
        assert_eq!(daemon.metrics_listen, None);
        assert_eq!(daemon.log_format, LogFormat::Plain);
    }

    #[test]
    fn status_metrics_and_log_keys_are_checked() {
        let input = parse(
            "[status]\nsocket = \"/tmp/s.sock\"\ngroup = \"\"\nmode = \"0600\"\n[metrics]\nlisten = \"127.0.0.1:9464\"\n[log]\nformat = \"json\"\n",
        )
        .unwrap();
        assert_eq!(input.status_socket, Some(PathBuf::from("/tmp/s.sock")));
        assert_eq!(input.status_group.as_deref(), Some(""));
        assert_eq!(input.status_mode, Some(0o600));
        assert_eq!(
            input.metrics_listen,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        assert_eq!(input.log_format, Some(LogFormat::Json));
        let cases = [
            (
                "[status]\nmode = \"0999\"\n",
                2,
                "status.mode",
                "not a permission mode",
            ),
            ("[status]\nmode = 660\n", 2, "status.mode", "invalid type"),
            (
                "[status]\n\ngroup = \"Ops Team\"\n",
                3,
                "status.group",
                "not a valid group name",
            ),
            (
                "[status]\nsockett = \"/x\"\n",
                2,
                "status.sockett",
                "unknown field `sockett`",
            ),
            (
                "[metrics]\nlisten = \"9464\"\n",
                2,
                "metrics.listen",
                "expected ip:port",
            ),
            (
                "[log]\nformat = \"xml\"\n",
                2,
                "log.format",
                "unknown variant `xml`",
            ),
            (
                "[log]\nlevel = \"debug\"\n",
                2,
                "log.level",
                "unknown field `level`",
            ),
        ];
        for (text, line, key, message) in cases {
            let err = parse(text).unwrap_err();
            assert_eq!(err.line, Some(line), "{text}: {err}");
            assert_eq!(err.key.as_deref(), Some(key), "{text}: {err}");
            assert!(err.message.contains(message), "{text}: {err}");
        }
        assert_eq!(parse_mode("660"), Ok(0o660));
        assert!(parse_mode("").is_err());
        assert!(check_group_name("inplace-agent").is_ok());
        assert!(check_group_name("9lives").is_err());
    }

    #[test]
    fn flags_override_the_file() {
        let file = parse(EXAMPLE).unwrap();
        let flags = DaemonInput {
            settings: SettingsInput {
                node_name: Some("worker-2".into()),
                allow_paths: vec!["/opt/cni/conf".into()],
                no_chroot: true,
                ..SettingsInput::default()
            },
            listen: Some("127.0.0.1:7443".parse().unwrap()),
            admin: Some(vec![IdentityPattern::Prefix("spiffe://ops/".into())]),
            ..DaemonInput::default()
        };
        let merged = file.overlay(flags);
        assert_eq!(merged.settings.node_name.as_deref(), Some("worker-2"));
        assert_eq!(merged.listen, Some("127.0.0.1:7443".parse().unwrap()));
        assert_eq!(
            merged.admin,
            Some(vec![IdentityPattern::Prefix("spiffe://ops/".into())]),
            "a role list from the flags replaces the file's"
        );
        assert_eq!(
            merged.reader,
            Some(vec![IdentityPattern::Exact(
                "spiffe://inplace-agent/reader".into()
            )]),
            "the file's reader list stays"
        );
        assert_eq!(
            merged.settings.allow_paths,
            ["/etc/modprobe.d", "/opt/cni/conf"]
        );
        assert!(merged.settings.no_chroot);
        assert_eq!(merged.settings.root, Some(PathBuf::from("/")));
    }

    #[test]
    fn node_name_defaults_to_the_roots_hostname() {
        let root = tempfile::tempdir().unwrap();
        let input = || DaemonInput {
            settings: SettingsInput {
                root: Some(root.path().to_path_buf()),
                ..SettingsInput::default()
            },
            ..DaemonInput::default()
        };
        let err = input().resolve().unwrap_err();
        assert!(err.starts_with("node name: not set"), "{err}");
        std::fs::create_dir_all(root.path().join("etc")).unwrap();
        std::fs::write(root.path().join("etc/hostname"), "worker-9\n").unwrap();
        let daemon = input().resolve().unwrap();
        assert_eq!(daemon.node_name, "worker-9");
        assert_eq!(
            daemon.settings.engine.node_name.as_deref(),
            Some("worker-9")
        );
        assert!(daemon.settings.engine.require_node_name);
        assert_eq!(daemon.listen, DEFAULT_LISTEN.parse().unwrap());
        assert_eq!(
            daemon.tls,
            ServerTlsPaths::in_dir(Path::new(DEFAULT_PKI_DIR))
        );
        assert_eq!(daemon.settings.limits.max_changes, 10_000);
        std::fs::write(root.path().join("etc/hostname"), "Worker.Example\n").unwrap();
        let err = input().resolve().unwrap_err();
        assert!(err.contains("not a valid Kubernetes node name"), "{err}");
    }

    #[test]
    fn plan_limits_reach_the_validator_and_the_engine() {
        let input =
            parse("[plans]\nmax_changes = 5\nmax_content_bytes = 64\nkeep_plans = 7\n").unwrap();
        let root = tempfile::tempdir().unwrap();
        let settings = SettingsInput {
            root: Some(root.path().to_path_buf()),
            ..input.settings
        }
        .resolve()
        .unwrap();
        assert_eq!(settings.limits.max_changes, 5);
        assert_eq!(settings.limits.max_content_bytes, 64);
        assert_eq!(settings.limits.max_checks, 100);
        assert_eq!(settings.engine.keep_plans, 7);
    }
}

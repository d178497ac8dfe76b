//! Settings: the agent's configuration validated once into values the rest of the code can
//! use without re-checking (paths resolved, allow-list parsed, limits set).

use std::path::{Path, PathBuf};

use crate::engine::EngineConfig;
use crate::host::HostSettings;
use crate::host::download::{DownloadConfig, check_ca_pem};
use crate::host::packages::{ManagerKind, PackageSettings, PkgOptions};
use crate::plan::{AllowList, Limits, NodePath};
use crate::steps::Capabilities;

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
    /// Use this package manager (`apt`, `dnf`) instead of detecting one.
    pub package_manager: Option<String>,
    /// Extra CA certificates (PEM files) trusted for artifact downloads.
    pub download_ca_files: Vec<PathBuf>,
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
        let allow = AllowList::new(dirs);
        let mut engine = EngineConfig::new(state_dir);
        engine.allow = allow.clone();
        engine.node_name = self.node_name;
        engine.capabilities = Capabilities {
            exec_allowed: self.allow_exec,
            kinds: Capabilities::implemented(),
        };
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
            ..Limits::default()
        };
        Ok(Settings {
            host: HostSettings {
                root,
                commands_in_root: !self.no_chroot,
                boot_id_path: None,
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

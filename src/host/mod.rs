//! The node: the only module that touches files, processes and services of the machine
//! being updated. Everything here is root-relative (see `fs`).

pub mod apt;
pub mod command;
pub mod dnf;
pub mod download;
pub mod fs;
pub mod http;
pub mod locks;
pub mod packages;
pub mod pkgversion;
pub mod systemd;
pub mod users;

use std::io;
use std::path::{Path, PathBuf};

/// How the agent reaches the node.
#[derive(Debug, Clone)]
pub struct HostSettings {
    /// The node's root directory (`/`, `/host`, or a sandbox).
    pub root: PathBuf,
    /// Run node commands (verification, package managers) inside the root with chroot when
    /// the root is not `/`.
    pub commands_in_root: bool,
    /// Where the current boot id is read (default `<root>/proc/sys/kernel/random/boot_id`).
    pub boot_id_path: Option<PathBuf>,
    /// Package managers: which one, and how long their commands may take.
    pub packages: packages::PackageSettings,
    /// Artifact downloads: the cache (in the agent's state directory), trust, limits.
    pub downloads: download::DownloadConfig,
}

/// The node.
#[derive(Debug)]
pub struct Host {
    /// Its filesystem.
    pub root: fs::Root,
    settings: HostSettings,
    /// The download client, made on first use (it owns a connection pool and a thread).
    downloader: std::sync::Mutex<Option<std::sync::Arc<download::Downloader>>>,
}

impl Host {
    /// Opens the node's root.
    pub fn open(settings: HostSettings) -> io::Result<Host> {
        let root = fs::Root::open(&settings.root)?;
        Ok(Host {
            root,
            settings,
            downloader: std::sync::Mutex::new(None),
        })
    }

    /// The settings it was opened with.
    pub fn settings(&self) -> &HostSettings {
        &self.settings
    }

    /// A command that runs on the node: chrooted into the root when configured and the
    /// root is not `/`.
    pub fn command<S: Into<String>>(
        &self,
        argv: impl IntoIterator<Item = S>,
    ) -> command::CommandSpec {
        let spec = command::CommandSpec::new(argv);
        if self.settings.commands_in_root {
            spec.in_root(self.root.path())
        } else {
            spec
        }
    }

    /// The current boot id, if the node exposes one.
    pub fn boot_id(&self) -> Option<String> {
        let path = self
            .settings
            .boot_id_path
            .clone()
            .unwrap_or_else(|| self.root.path().join("proc/sys/kernel/random/boot_id"));
        std::fs::read_to_string(path)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }

    /// The root path.
    pub fn root_path(&self) -> &Path {
        self.root.path()
    }

    /// The package manager to use: `explicit` (a plan's `manager`), else the configured
    /// one, else the one detected in the root; its tools must be there.
    pub fn package_manager_kind(
        &self,
        explicit: Option<&str>,
    ) -> Result<packages::ManagerKind, packages::PkgError> {
        let kind = match explicit {
            Some(name) => name.parse()?,
            None => match self.settings.packages.manager {
                Some(kind) => kind,
                None => return packages::detect(self.root.path()),
            },
        };
        packages::check_tools(self.root.path(), kind)?;
        Ok(kind)
    }

    /// The node's package manager of `kind`, with the configured options adjusted by
    /// `adjust` (a step narrows the timeouts to its own).
    pub fn package_manager(
        &self,
        kind: packages::ManagerKind,
        adjust: impl FnOnce(&mut packages::PkgOptions),
    ) -> Box<dyn packages::PackageManager> {
        let mut options = self.settings.packages.options.clone();
        adjust(&mut options);
        match kind {
            packages::ManagerKind::Apt => Box::new(apt::Apt::new(self.root.path(), options)),
            packages::ManagerKind::Dnf => Box::new(dnf::Dnf::new(self.root.path(), options)),
        }
    }

    /// The artifact cache (no network client needed to look into it).
    pub fn artifact_cache(&self) -> download::Cache {
        download::Cache::at(&self.settings.downloads.state_dir)
    }

    /// The download client, made on first use with the configured trust and limits.
    pub fn downloader(
        &self,
    ) -> Result<std::sync::Arc<download::Downloader>, download::DownloadError> {
        let mut slot = self
            .downloader
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(d) = slot.as_ref() {
            return Ok(d.clone());
        }
        let d = std::sync::Arc::new(download::Downloader::new(self.settings.downloads.clone())?);
        *slot = Some(d.clone());
        Ok(d)
    }
}

/// The node's service manager, as the engine needs it (systemd over D-Bus on a node).
/// Errors are messages naming the unit, the result and the unit's status text.
pub trait ServiceManager: Send + Sync {
    /// Reloads unit files.
    fn daemon_reload(&self) -> Result<(), String>;
    /// Restarts a unit and waits until the job finished and the unit is active; returns
    /// what systemd reported.
    fn restart(&self, unit: &str) -> Result<String, String>;
    /// `Ok(observation)` when the unit is active, `Err(observation)` when not.
    fn is_active(&self, unit: &str) -> Result<String, String>;
}

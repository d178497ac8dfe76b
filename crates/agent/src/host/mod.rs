//! The node: the only module that touches files, processes and services of the machine
//! being updated. Everything here is root-relative (see `fs`).

pub mod apt;
pub(crate) mod command;
pub mod dnf;
pub mod download;
pub(crate) mod fs;
pub(crate) mod http;
pub(crate) mod https;
pub(crate) mod locks;
pub(crate) mod memory;
pub(crate) mod node;
pub(crate) mod package_manager;
pub mod packages;
pub(crate) mod ports;
pub mod systemd;
pub(crate) mod users;
pub mod watch;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use systemd::{
    ObservedUnit, SystemdError, UnitBefore, UnitFileChanges, UnitFileOp, UnitFileState, UnitJob,
    UnitOutcome,
};

/// How the agent reaches the node.
#[derive(Debug, Clone)]
pub struct HostSettings {
    /// The node's root directory (`/`, `/host`, or a sandbox).
    pub root: PathBuf,
    /// The directories plans may change, enforced at every file access (`fs`).
    pub allow: inplace_plan::AllowList,
    /// Run node commands (verification, package managers) inside the root with chroot when
    /// the root is not `/`.
    pub commands_in_root: bool,
    /// Where the current boot id is read (default `<root>/proc/sys/kernel/random/boot_id`).
    pub boot_id_path: Option<PathBuf>,
    /// Whether and how the agent manages units: an explicit choice, shown in every run's
    /// journal and in the status of skipped restarts.
    pub services: ServiceSettings,
    /// Package managers: which one, and how long their commands may take.
    pub packages: packages::PackageSettings,
    /// Artifact downloads: the cache (in the agent's state directory), trust, limits.
    pub downloads: download::DownloadConfig,
}

/// How the agent manages the node's units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceSettings {
    /// Through systemd over D-Bus, on the bus at this address (by default the node's system
    /// bus, `unix:path=<root>/run/dbus/system_bus_socket`).
    Systemd {
        /// The D-Bus address.
        bus: String,
    },
    /// Not at all (`--services off`, for plain directory trees): restarts are journaled as
    /// skipped, and unit and reboot changes and `unitActive` gates are refused.
    Off,
}

impl ServiceSettings {
    /// For people and the journal: `systemd on unix:path=...` or `off`.
    pub fn describe(&self) -> String {
        match self {
            ServiceSettings::Systemd { bus } => format!("systemd on {bus}"),
            ServiceSettings::Off => "off (--services off)".to_string(),
        }
    }
}

/// How long a call made for a change (a unit's state, enabling it) keeps reconnecting when
/// the bus connection is lost.
pub const STEP_BUS_WINDOW: Duration = Duration::from_secs(60);
/// The timeout of single D-Bus method calls.
pub const BUS_CALL_TIMEOUT: Duration = Duration::from_secs(25);

/// The node.
#[derive(Debug)]
pub struct Host {
    /// Its filesystem.
    pub root: fs::Root,
    settings: HostSettings,
    services: Option<Arc<dyn ServiceManager>>,
    /// The download client, made on first use (it owns a connection pool and a thread).
    downloader: std::sync::Mutex<Option<std::sync::Arc<download::Downloader>>>,
}

impl Host {
    /// Opens the node's root. With [`ServiceSettings::Systemd`] the service manager is ready
    /// to connect; it connects at its first use (and again after a lost connection).
    pub fn open(settings: HostSettings) -> io::Result<Host> {
        let root = fs::Root::open(&settings.root, settings.allow.clone())?;
        let services: Option<Arc<dyn ServiceManager>> = match &settings.services {
            ServiceSettings::Systemd { bus } => Some(Arc::new(systemd::SystemdServices::new(
                bus.clone(),
                BUS_CALL_TIMEOUT,
            ))),
            ServiceSettings::Off => None,
        };
        Ok(Host {
            root,
            settings,
            services,
            downloader: std::sync::Mutex::new(None),
        })
    }

    /// Replaces the service manager (a test double, or none).
    pub fn with_services(mut self, services: Option<Arc<dyn ServiceManager>>) -> Host {
        self.services = services;
        self
    }

    /// The service manager, or `None` when service management is off.
    pub fn services(&self) -> Option<&dyn ServiceManager> {
        self.services.as_deref()
    }

    /// How units are managed, for people and the journal.
    pub fn services_description(&self) -> String {
        match &self.services {
            Some(s) => s.describe(),
            None => self.settings.services.describe(),
        }
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

    /// The current boot id, if the node exposes one. Without `boot_id_path`, a root whose
    /// `/proc` is not mounted (`/host` in a container) falls back to the agent's own
    /// `/proc/sys/kernel/random/boot_id`: the boot id is the kernel's, the same everywhere.
    pub fn boot_id(&self) -> Option<String> {
        let read = |p: &Path| {
            std::fs::read_to_string(p)
                .ok()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        read(&self.boot_id_path()).or_else(|| {
            self.settings
                .boot_id_path
                .is_none()
                .then(|| read(Path::new("/proc/sys/kernel/random/boot_id")))
                .flatten()
        })
    }

    /// Where the boot id is read: `boot_id_path`, or `<root>/proc/sys/kernel/random/boot_id`.
    pub fn boot_id_path(&self) -> PathBuf {
        self.settings
            .boot_id_path
            .clone()
            .unwrap_or_else(|| self.root.path().join("proc/sys/kernel/random/boot_id"))
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
        packages::usable(self.root.path(), self.settings.commands_in_root)?;
        let kind = match explicit {
            Some(name) => packages::manager_kind(name)?,
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

/// One call to the service manager: until when to keep reconnecting when the bus connection
/// is lost or systemd is not on the bus, and whom to tell about each retry.
pub struct ServiceCall<'a> {
    /// Give up, returning the last error, once a retry would start after this.
    pub deadline: Instant,
    /// Told about every lost connection and the retry that follows (`None`: logged only).
    pub report: Option<&'a mut dyn FnMut(&str)>,
}

impl<'a> ServiceCall<'a> {
    /// A call that keeps trying for `window`, reporting retries to the log only.
    pub fn within(window: Duration) -> ServiceCall<'static> {
        ServiceCall {
            deadline: Instant::now() + window,
            report: None,
        }
    }

    /// A call that keeps trying until `deadline`, telling `report` about each retry.
    pub fn until(deadline: Instant, report: &'a mut dyn FnMut(&str)) -> ServiceCall<'a> {
        ServiceCall {
            deadline,
            report: Some(report),
        }
    }

    /// Says that a retry follows.
    pub fn retrying(&mut self, message: &str) {
        tracing::warn!("{message}");
        if let Some(report) = self.report.as_mut() {
            report(message);
        }
    }
}

/// The node's service manager as the engine and the steps need it: systemd over D-Bus on a
/// node ([`systemd::SystemdServices`]), a double in tests. Every call keeps reconnecting
/// (with backoff) while the connection is lost, until its [`ServiceCall::deadline`]; other
/// errors are systemd's answer and come back at once.
pub trait ServiceManager: Send + Sync {
    /// What it is, for people and the journal (`systemd on unix:path=...`).
    fn describe(&self) -> String;
    /// Connects now (if not connected) and says who answered (`systemd 252 on ...`).
    fn ping(&self) -> Result<String, SystemdError>;
    /// Reloads unit files (`daemon-reload`).
    fn daemon_reload(&self, call: &mut ServiceCall<'_>) -> Result<(), SystemdError>;
    /// A unit's current state (a unit without a unit file is `not-found` and inactive).
    fn unit_state(
        &self,
        unit: &str,
        call: &mut ServiceCall<'_>,
    ) -> Result<ObservedUnit, SystemdError>;
    /// A unit file's enablement state; `None` when there is no unit file of that name.
    fn unit_file_state(
        &self,
        unit: &str,
        call: &mut ServiceCall<'_>,
    ) -> Result<Option<UnitFileState>, SystemdError>;
    /// Enables, disables, masks or unmasks a unit file.
    fn unit_file(
        &self,
        op: UnitFileOp,
        unit: &str,
        call: &mut ServiceCall<'_>,
    ) -> Result<UnitFileChanges, SystemdError>;
    /// Starts, stops or restarts a unit and waits for the job (until the call's deadline).
    /// `before` is the unit's journaled state before the first attempt; with `maybe_queued`
    /// an earlier attempt may have queued the job already, and a restart that already
    /// happened is not done twice (see [`systemd::Systemd::run_job_once`]).
    fn job(
        &self,
        job: UnitJob,
        unit: &str,
        before: &UnitBefore,
        maybe_queued: bool,
        call: &mut ServiceCall<'_>,
    ) -> Result<UnitOutcome, SystemdError>;
    /// Clears a unit's failed state.
    fn reset_failed(&self, unit: &str, call: &mut ServiceCall<'_>) -> Result<(), SystemdError>;
    /// Asks systemd to reboot the node; returns once the request is queued.
    fn reboot(&self, call: &mut ServiceCall<'_>) -> Result<(), SystemdError>;
}

impl std::fmt::Debug for dyn ServiceManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

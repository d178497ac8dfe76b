//! systemd over its D-Bus API (`org.freedesktop.systemd1`), never by running `systemctl`.
//!
//! A [`Systemd`] is one blocking connection to a bus on which systemd's manager is reachable:
//! the node's system bus (`<root>/run/dbus/system_bus_socket`, see [`system_bus_address`]),
//! or a test sandbox's. Everything here blocks the calling thread (the engine runs steps on
//! a plain OS thread) and is bounded by a timeout:
//!
//! - method calls by the call timeout given to [`Systemd::connect`];
//! - unit jobs ([`Systemd::start`], [`Systemd::restart`], ...) by the timeout given to each
//!   call, which covers queuing the job and waiting for systemd to finish it.
//!
//! A job is followed the way `systemctl` follows it: subscribe to the manager's `JobRemoved`
//! signal *before* queuing the job (so a job that finishes at once is not missed), queue it,
//! wait for the removal of our job, then read the unit's state. A job that did not end in
//! `done`, or a unit that is not running after a start or restart, is an error that names the
//! unit, the job result, the unit's state and systemd's status text; [`SystemdError::kind`]
//! gives a bounded label for metrics.
//!
//! The pure helpers ([`validate_unit_name`], [`unit_object_path`], [`system_bus_address`])
//! are unit-tested here; the rest is exercised against a real systemd in
//! `tests/systemd_host.rs`.

use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};

use futures_lite::StreamExt;
use zbus::zvariant::{ObjectPath, OwnedObjectPath, OwnedValue, Value};

/// D-Bus interface of all units.
const UNIT_INTERFACE: &str = "org.freedesktop.systemd1.Unit";
/// D-Bus interface of service units.
const SERVICE_INTERFACE: &str = "org.freedesktop.systemd1.Service";
/// The value types of units (names, states, jobs, unit file operations) are plain data in
/// `base::units`, shared with the plan's kinds and the journal; re-exported here.
pub use inplace_base::units::*;

// === D-Bus proxies ===

/// `a(sss)`: the unit file changes systemd reports (type, file, destination).
type RawChanges = Vec<(String, String, String)>;

#[zbus::proxy(
    interface = "org.freedesktop.systemd1.Manager",
    default_service = "org.freedesktop.systemd1",
    default_path = "/org/freedesktop/systemd1",
    gen_blocking = true,
    gen_async = true
)]
trait Manager {
    fn start_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;
    fn stop_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;
    fn restart_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;
    fn reload_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;
    fn try_restart_unit(&self, name: &str, mode: &str) -> zbus::Result<OwnedObjectPath>;
    fn kill_unit(&self, name: &str, whom: &str, signal: i32) -> zbus::Result<()>;
    fn reset_failed_unit(&self, name: &str) -> zbus::Result<()>;
    fn reload(&self) -> zbus::Result<()>;
    fn enable_unit_files(
        &self,
        files: &[&str],
        runtime: bool,
        force: bool,
    ) -> zbus::Result<(bool, RawChanges)>;
    fn disable_unit_files(&self, files: &[&str], runtime: bool) -> zbus::Result<RawChanges>;
    fn mask_unit_files(
        &self,
        files: &[&str],
        runtime: bool,
        force: bool,
    ) -> zbus::Result<RawChanges>;
    fn unmask_unit_files(&self, files: &[&str], runtime: bool) -> zbus::Result<RawChanges>;
    fn get_unit_file_state(&self, file: &str) -> zbus::Result<String>;

    #[zbus(signal)]
    fn job_removed(
        &self,
        id: u32,
        job: ObjectPath<'_>,
        unit: &str,
        result: &str,
    ) -> zbus::Result<()>;
}

/// `org.freedesktop.DBus.Properties` on systemd's objects, read without any caching: the
/// state of a unit is read fresh every time.
#[zbus::proxy(
    interface = "org.freedesktop.DBus.Properties",
    default_service = "org.freedesktop.systemd1",
    gen_blocking = true,
    gen_async = false,
    blocking_name = "PropertiesProxyBlocking"
)]
trait Properties {
    fn get(&self, interface_name: &str, property_name: &str) -> zbus::Result<OwnedValue>;
    fn get_all(&self, interface_name: &str) -> zbus::Result<HashMap<String, OwnedValue>>;
}

// === Errors ===

/// What went wrong talking to systemd. Every message starts with the operation and what it
/// was applied to (`restart kubelet.service: ...`).
#[derive(Debug, thiserror::Error)]
pub enum SystemdError {
    /// The bus could not be reached, or the handshake with it failed.
    #[error("connect to system bus {address}: {detail}")]
    Connect {
        /// The bus address that was tried.
        address: String,
        /// Why it failed.
        detail: String,
    },
    /// The unit name does not follow systemd's rules; nothing was sent to systemd.
    #[error("{op}: {source}")]
    InvalidUnitName {
        /// The operation, e.g. `restart`.
        op: &'static str,
        /// What is wrong with the name.
        source: UnitNameError,
    },
    /// systemd has no unit (or unit file) of that name.
    #[error("{op}: no such unit: {detail}")]
    NoSuchUnit {
        /// The operation and its unit, e.g. `start kubelet.service`.
        op: String,
        /// systemd's own words.
        detail: String,
    },
    /// The unit is masked, so it cannot be started.
    #[error("{op}: unit is masked")]
    UnitMasked {
        /// The operation and its unit.
        op: String,
    },
    /// The job ended with a result other than `done`.
    #[error("{op}: job {job_result}; {}", StateNote(.state.as_deref()))]
    JobFailed {
        /// The operation and its unit.
        op: String,
        /// systemd's job result: `failed`, `canceled`, `timeout`, `dependency`, `skipped`...
        job_result: String,
        /// The unit's state right after the job, when it could be read.
        state: Option<Box<ObservedUnit>>,
    },
    /// The job was done but the unit is not in the state the operation asked for (a start or
    /// restart that left the unit failed or restarting).
    #[error("{op}: job done but {state}")]
    UnitFailed {
        /// The operation and its unit.
        op: String,
        /// The unit's state after the job.
        state: Box<ObservedUnit>,
    },
    /// No answer in time: a method call without reply, or a job still running at the
    /// deadline. A timed-out job is left queued in systemd.
    #[error("{op}: timed out after {:.1}s{}", .waited.as_secs_f64(), .detail)]
    Timeout {
        /// The operation and its target.
        op: String,
        /// How long we waited.
        waited: Duration,
        /// What we were waiting for, appended to the message as is.
        detail: String,
    },
    /// The connection stayed lost: every reconnection attempt until the call's deadline
    /// failed.
    #[error(
        "{op}: systemd unreachable on {address} for {:.1}s ({attempts} attempts); last error: {last}",
        .waited.as_secs_f64()
    )]
    Unreachable {
        /// The operation and its target.
        op: String,
        /// The bus address.
        address: String,
        /// How many times it was tried.
        attempts: u32,
        /// From the first attempt to giving up.
        waited: Duration,
        /// The last error.
        last: String,
    },
    /// Any other D-Bus failure (access denied, bus gone, malformed reply...).
    #[error("{op}: {detail}")]
    Dbus {
        /// The operation and its target.
        op: String,
        /// The D-Bus error name, for errors systemd returned.
        name: Option<String>,
        /// What failed.
        detail: String,
    },
}

impl SystemdError {
    /// A short, bounded label for metrics and logs: `connect`, `invalid_unit_name`,
    /// `no_such_unit`, `unit_masked`, `job_failed`, `unit_failed`, `timeout`, `unreachable`
    /// or `dbus`.
    pub fn kind(&self) -> &'static str {
        match self {
            SystemdError::Connect { .. } => "connect",
            SystemdError::InvalidUnitName { .. } => "invalid_unit_name",
            SystemdError::NoSuchUnit { .. } => "no_such_unit",
            SystemdError::UnitMasked { .. } => "unit_masked",
            SystemdError::JobFailed { .. } => "job_failed",
            SystemdError::UnitFailed { .. } => "unit_failed",
            SystemdError::Timeout { .. } => "timeout",
            SystemdError::Unreachable { .. } => "unreachable",
            SystemdError::Dbus { .. } => "dbus",
        }
    }

    /// True when the error means the bus connection is gone or systemd is not (yet) on the
    /// bus: the connection could not be made or was closed, or the bus answered that nobody
    /// owns `org.freedesktop.systemd1` (a restarted bus before systemd reconnected to it).
    /// Such calls may be retried on a new connection; everything else is systemd's answer.
    pub fn is_connection_lost(&self) -> bool {
        match self {
            SystemdError::Connect { .. } | SystemdError::Unreachable { .. } => true,
            SystemdError::Dbus { name: None, .. } => true,
            SystemdError::Dbus {
                name: Some(name), ..
            } => matches!(
                name.as_str(),
                "org.freedesktop.DBus.Error.ServiceUnknown"
                    | "org.freedesktop.DBus.Error.NameHasNoOwner"
                    | "org.freedesktop.DBus.Error.NoServer"
                    | "org.freedesktop.DBus.Error.Disconnected"
                    | "org.freedesktop.DBus.Local.Disconnected"
            ),
            _ => false,
        }
    }

    /// The unit's state as read right after the job, for job and unit failures.
    pub fn unit_state(&self) -> Option<&ObservedUnit> {
        match self {
            SystemdError::JobFailed { state, .. } => state.as_deref(),
            SystemdError::UnitFailed { state, .. } => Some(state),
            _ => None,
        }
    }
}

/// Renders an optional unit state for [`SystemdError::JobFailed`].
struct StateNote<'a>(Option<&'a ObservedUnit>);

impl fmt::Display for StateNote<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(state) => write!(f, "{state}"),
            None => f.write_str("unit state unknown"),
        }
    }
}

/// Turns a zbus error into ours, keeping systemd's error names that callers branch on.
fn dbus_error(op: String, err: zbus::Error, timeout: Option<Duration>) -> SystemdError {
    match err {
        zbus::Error::MethodError(name, detail, _) => {
            let detail = detail.unwrap_or_default();
            let detail = detail.trim_end_matches('.').to_string();
            match name.as_str() {
                "org.freedesktop.systemd1.NoSuchUnit"
                | "org.freedesktop.DBus.Error.FileNotFound" => {
                    SystemdError::NoSuchUnit { op, detail }
                }
                "org.freedesktop.systemd1.UnitMasked" => SystemdError::UnitMasked { op },
                "org.freedesktop.DBus.Error.NoReply" | "org.freedesktop.DBus.Error.Timeout" => {
                    SystemdError::Timeout {
                        op,
                        waited: timeout.unwrap_or_default(),
                        detail: format!("; {name}: {detail}"),
                    }
                }
                other => SystemdError::Dbus {
                    op,
                    name: Some(other.to_string()),
                    detail: if detail.is_empty() {
                        other.to_string()
                    } else {
                        format!("{other}: {detail}")
                    },
                },
            }
        }
        zbus::Error::InputOutput(io) if io.kind() == std::io::ErrorKind::TimedOut => {
            SystemdError::Timeout {
                op,
                waited: timeout.unwrap_or_default(),
                detail: "; no reply from systemd".to_string(),
            }
        }
        other => SystemdError::Dbus {
            op,
            name: None,
            detail: other.to_string(),
        },
    }
}

// === The connection ===

/// A blocking connection to systemd's manager over D-Bus. Cheap to share by reference
/// between threads (`Send + Sync`); one connection serves any number of calls.
#[derive(Debug)]
pub struct Systemd {
    address: String,
    conn: zbus::blocking::Connection,
    manager: ManagerProxyBlocking<'static>,
    manager_async: ManagerProxy<'static>,
    call_timeout: Duration,
    version: String,
}

impl Systemd {
    /// Connects to the bus at `address` (e.g. `unix:path=/run/dbus/system_bus_socket`, see
    /// [`system_bus_address`]) and checks that systemd answers there. `call_timeout` bounds
    /// the connection handshake and, afterwards, every method call (not the wait for a job,
    /// which each job call bounds itself).
    pub fn connect(address: &str, call_timeout: Duration) -> Result<Systemd, SystemdError> {
        let connect_error = |detail: String| SystemdError::Connect {
            address: address.to_string(),
            detail,
        };
        let build = async {
            let conn = zbus::connection::Builder::address(address)?
                .method_timeout(call_timeout)
                .build()
                .await?;
            let manager_async = ManagerProxy::new(&conn).await?;
            Ok::<_, zbus::Error>((conn, manager_async))
        };
        let (conn, manager_async) = match within(call_timeout, build) {
            Some(Ok(pair)) => pair,
            Some(Err(err)) => return Err(connect_error(err.to_string())),
            None => {
                return Err(connect_error(format!(
                    "no answer within {:.1}s",
                    call_timeout.as_secs_f64()
                )));
            }
        };
        let conn = zbus::blocking::Connection::from(conn);
        let manager = ManagerProxyBlocking::new(&conn).map_err(|e| connect_error(e.to_string()))?;
        let mut systemd = Systemd {
            address: address.to_string(),
            conn,
            manager,
            manager_async,
            call_timeout,
            version: String::new(),
        };
        let version = systemd
            .properties("/org/freedesktop/systemd1")
            .and_then(|p| p.get("org.freedesktop.systemd1.Manager", "Version"))
            .map_err(|e| connect_error(format!("systemd does not answer on this bus: {e}")))?;
        systemd.version = String::try_from(version)
            .map_err(|e| connect_error(format!("systemd version: {e}")))?;
        Ok(systemd)
    }

    /// The bus address this connection was made to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// systemd's version string as it reports it (e.g. `252.38-1~deb12u1`).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The manager's `SystemState`: `initializing`, `starting`, `running`, `degraded` (up, with
    /// failed units), `maintenance` or `stopping` — what `systemctl is-system-running` prints.
    pub fn system_state(&self) -> Result<String, SystemdError> {
        let op = || "is-system-running".to_string();
        let value = self
            .properties("/org/freedesktop/systemd1")
            .and_then(|p| p.get("org.freedesktop.systemd1.Manager", "SystemState"))
            .map_err(|e| dbus_error(op(), e, Some(self.call_timeout)))?;
        String::try_from(value).map_err(|e| SystemdError::Dbus {
            op: op(),
            name: None,
            detail: format!("SystemState: {e}"),
        })
    }

    /// Starts `unit` (job mode `replace`) and waits up to `timeout` for the job; the unit must
    /// be active afterwards (or, for a oneshot service, have run successfully).
    pub fn start(&self, unit: &str, timeout: Duration) -> Result<UnitOutcome, SystemdError> {
        self.run_job(JobKind::Start, unit, timeout)
    }

    /// Stops `unit` and waits up to `timeout` for the job.
    pub fn stop(&self, unit: &str, timeout: Duration) -> Result<UnitOutcome, SystemdError> {
        self.run_job(JobKind::Stop, unit, timeout)
    }

    /// Restarts `unit` (starting it if it was stopped) and waits up to `timeout`; the unit must
    /// be active afterwards. Its [`ObservedUnit::invocation_id`] changes.
    pub fn restart(&self, unit: &str, timeout: Duration) -> Result<UnitOutcome, SystemdError> {
        self.run_job(JobKind::Restart, unit, timeout)
    }

    /// Asks `unit` to reload its configuration (`ExecReload=`) and waits up to `timeout`; the
    /// unit must be active afterwards. Fails for units that cannot reload.
    pub fn reload(&self, unit: &str, timeout: Duration) -> Result<UnitOutcome, SystemdError> {
        self.run_job(JobKind::Reload, unit, timeout)
    }

    /// Restarts `unit` only if it is running, and waits up to `timeout`; a stopped unit stays
    /// stopped and is not an error, a failed one is.
    pub fn try_restart(&self, unit: &str, timeout: Duration) -> Result<UnitOutcome, SystemdError> {
        self.run_job(JobKind::TryRestart, unit, timeout)
    }

    /// Reloads all unit files (`systemctl daemon-reload`); returns when systemd has finished.
    pub fn daemon_reload(&self) -> Result<(), SystemdError> {
        self.manager
            .reload()
            .map_err(|e| dbus_error("daemon-reload".to_string(), e, Some(self.call_timeout)))
    }

    /// Enables unit files (creates the `[Install]` symlinks in `/etc`, not runtime, without
    /// `force`, so a conflicting symlink someone else made is an error rather than replaced).
    /// Call [`Systemd::daemon_reload`] afterwards, as `systemctl enable` does.
    pub fn enable_unit_files<S: AsRef<str>>(
        &self,
        units: &[S],
    ) -> Result<UnitFileChanges, SystemdError> {
        let names = unit_list("enable", units)?;
        let (carries, changes) = self
            .manager
            .enable_unit_files(&names, false, false)
            .map_err(|e| self.op_error("enable", &names, e))?;
        Ok(UnitFileChanges::from_dbus(Some(carries), changes))
    }

    /// Disables unit files (removes their `[Install]` symlinks from `/etc`).
    pub fn disable_unit_files<S: AsRef<str>>(
        &self,
        units: &[S],
    ) -> Result<UnitFileChanges, SystemdError> {
        let names = unit_list("disable", units)?;
        let changes = self
            .manager
            .disable_unit_files(&names, false)
            .map_err(|e| self.op_error("disable", &names, e))?;
        Ok(UnitFileChanges::from_dbus(None, changes))
    }

    /// Masks units (links them to `/dev/null` in `/etc/systemd/system`, not runtime, without
    /// `force`, so an existing unit file there is an error rather than overwritten).
    pub fn mask_unit_files<S: AsRef<str>>(
        &self,
        units: &[S],
    ) -> Result<UnitFileChanges, SystemdError> {
        let names = unit_list("mask", units)?;
        let changes = self
            .manager
            .mask_unit_files(&names, false, false)
            .map_err(|e| self.op_error("mask", &names, e))?;
        Ok(UnitFileChanges::from_dbus(None, changes))
    }

    /// Unmasks units (removes their `/dev/null` links from `/etc/systemd/system`).
    pub fn unmask_unit_files<S: AsRef<str>>(
        &self,
        units: &[S],
    ) -> Result<UnitFileChanges, SystemdError> {
        let names = unit_list("unmask", units)?;
        let changes = self
            .manager
            .unmask_unit_files(&names, false)
            .map_err(|e| self.op_error("unmask", &names, e))?;
        Ok(UnitFileChanges::from_dbus(None, changes))
    }

    /// The enablement state of a unit file (`enabled`, `disabled`, `static`, `masked`...);
    /// [`SystemdError::NoSuchUnit`] when there is no such unit file.
    pub fn unit_file_state(&self, unit: &str) -> Result<UnitFileState, SystemdError> {
        validate("is-enabled", unit)?;
        self.manager
            .get_unit_file_state(unit)
            .map(|s| UnitFileState::parse(&s))
            .map_err(|e| dbus_error(format!("is-enabled {unit}"), e, Some(self.call_timeout)))
    }

    /// Reads the unit's current state. A unit without a unit file is not an error: it
    /// comes back with [`LoadState::NotFound`] and inactive/dead.
    pub fn unit_state(&self, unit: &str) -> Result<ObservedUnit, SystemdError> {
        validate("show", unit)?;
        self.read_state(unit)
            .map_err(|e| dbus_error(format!("show {unit}"), e, Some(self.call_timeout)))
    }

    /// Sends `signal` to the unit's main process (`systemctl kill --kill-whom=main`).
    pub fn kill_main(&self, unit: &str, signal: i32) -> Result<(), SystemdError> {
        validate("kill", unit)?;
        self.manager
            .kill_unit(unit, "main", signal)
            .map_err(|e| dbus_error(format!("kill {unit}"), e, Some(self.call_timeout)))
    }

    /// Clears the unit's failed state and its start-rate counter (`systemctl reset-failed`).
    pub fn reset_failed(&self, unit: &str) -> Result<(), SystemdError> {
        validate("reset-failed", unit)?;
        self.manager
            .reset_failed_unit(unit)
            .map_err(|e| dbus_error(format!("reset-failed {unit}"), e, Some(self.call_timeout)))
    }

    /// Asks systemd to reboot the node: queues `reboot.target` with job mode
    /// `replace-irreversibly`, which is what `systemctl reboot` does. Returns once the job is
    /// queued; the node goes down shortly after (and this connection with it).
    pub fn reboot(&self) -> Result<(), SystemdError> {
        self.manager
            .start_unit("reboot.target", "replace-irreversibly")
            .map(|_job| ())
            .map_err(|e| dbus_error("reboot".to_string(), e, Some(self.call_timeout)))
    }

    /// Runs `job` on `unit` like [`Systemd::start`], [`Systemd::stop`] or
    /// [`Systemd::restart`], except that with `maybe_queued` (an earlier attempt may have
    /// queued it before the agent crashed or lost its connection) a restart is first looked
    /// for: when the unit's `InvocationID` is no longer the one in `before`, or a job is
    /// pending for it, that restart is waited for and judged instead of queuing another one.
    /// Start and stop are idempotent and simply queued again.
    pub fn run_job_once(
        &self,
        job: UnitJob,
        unit: &str,
        before: &UnitBefore,
        maybe_queued: bool,
        timeout: Duration,
    ) -> Result<UnitOutcome, SystemdError> {
        if maybe_queued && job == UnitJob::Restart {
            let started = Instant::now();
            let now = self.unit_state(unit)?;
            let invocation = now.invocation_id.map(|id| id.to_string());
            if now.job.is_some() || invocation != before.invocation_id {
                let state = self.wait_idle(unit, timeout)?;
                let op = format!("restart {unit} (queued before the connection was lost)");
                if !JobKind::Restart.state_ok(&state) {
                    return Err(SystemdError::UnitFailed {
                        op,
                        state: Box::new(state),
                    });
                }
                return Ok(UnitOutcome {
                    state,
                    elapsed: started.elapsed(),
                });
            }
        }
        self.run_job(job.kind(), unit, timeout)
    }

    /// Waits (polling every 100 ms) until no job is pending for `unit`, then returns its state.
    pub fn wait_idle(&self, unit: &str, timeout: Duration) -> Result<ObservedUnit, SystemdError> {
        let started = Instant::now();
        loop {
            let state = self.unit_state(unit)?;
            if state.job.is_none() {
                return Ok(state);
            }
            if started.elapsed() >= timeout {
                return Err(SystemdError::Timeout {
                    op: format!("wait for {unit}"),
                    waited: started.elapsed(),
                    detail: format!(" waiting for its pending job ({state})"),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    // --- internals ---

    fn op_error(&self, verb: &str, names: &[&str], err: zbus::Error) -> SystemdError {
        dbus_error(
            format!("{verb} {}", names.join(" ")),
            err,
            Some(self.call_timeout),
        )
    }

    fn properties(&self, path: &str) -> zbus::Result<PropertiesProxyBlocking<'static>> {
        PropertiesProxyBlocking::builder(&self.conn)
            .path(path.to_string())?
            .build()
    }

    /// Queues a job, waits for it, reads the unit, judges the outcome.
    fn run_job(
        &self,
        kind: JobKind,
        unit: &str,
        timeout: Duration,
    ) -> Result<UnitOutcome, SystemdError> {
        validate(kind.verb(), unit)?;
        let op = format!("{} {unit}", kind.verb());
        let started = Instant::now();
        let deadline = started + timeout;

        // Subscribe first: the job may be finished before the call that queues it returns.
        let mut removed = within(timeout, self.manager_async.receive_job_removed())
            .ok_or_else(|| SystemdError::Timeout {
                op: op.clone(),
                waited: started.elapsed(),
                detail: "; subscribing to job signals".to_string(),
            })?
            .map_err(|e| dbus_error(op.clone(), e, Some(self.call_timeout)))?;

        let queued = match kind {
            JobKind::Start => self.manager.start_unit(unit, "replace"),
            JobKind::Stop => self.manager.stop_unit(unit, "replace"),
            JobKind::Restart => self.manager.restart_unit(unit, "replace"),
            JobKind::Reload => self.manager.reload_unit(unit, "replace"),
            JobKind::TryRestart => self.manager.try_restart_unit(unit, "replace"),
        };
        let job = queued.map_err(|e| dbus_error(op.clone(), e, Some(self.call_timeout)))?;

        let waited = async {
            while let Some(signal) = removed.next().await {
                let Ok(args) = signal.args() else { continue };
                if args.job().as_str() == job.as_str() {
                    return Some(args.result().to_string());
                }
            }
            None
        };
        let job_result = match within(deadline.saturating_duration_since(Instant::now()), waited) {
            Some(Some(result)) => result,
            Some(None) => {
                return Err(SystemdError::Dbus {
                    op,
                    name: None,
                    detail: format!(
                        "connection to systemd closed while waiting for job {}",
                        job.as_str()
                    ),
                });
            }
            None => {
                let state = self
                    .read_state(unit)
                    .map(|s| format!(" ({s})"))
                    .unwrap_or_default();
                return Err(SystemdError::Timeout {
                    op,
                    waited: started.elapsed(),
                    detail: format!(
                        " waiting for job {}{state}; the job stays queued",
                        job.as_str()
                    ),
                });
            }
        };
        drop(removed);

        let state = self.read_state(unit);
        if job_result != "done" {
            return Err(SystemdError::JobFailed {
                op,
                job_result,
                state: state.ok().map(Box::new),
            });
        }
        let state = state.map_err(|e| dbus_error(op.clone(), e, Some(self.call_timeout)))?;
        if !kind.state_ok(&state) {
            return Err(SystemdError::UnitFailed {
                op,
                state: Box::new(state),
            });
        }
        Ok(UnitOutcome {
            state,
            elapsed: started.elapsed(),
        })
    }

    /// Reads the unit's properties (and the service's, for `.service` units).
    fn read_state(&self, unit: &str) -> zbus::Result<ObservedUnit> {
        let props = self.properties(&unit_object_path(unit))?;
        let unit_props = props.get_all(UNIT_INTERFACE)?;
        let service_props = if unit.ends_with(".service") {
            Some(props.get_all(SERVICE_INTERFACE)?)
        } else {
            None
        };
        let text = |map: &HashMap<String, OwnedValue>, key: &str| -> Option<String> {
            map.get(key).and_then(|v| String::try_from(&**v).ok())
        };
        let number = |map: &HashMap<String, OwnedValue>, key: &str| -> Option<u32> {
            map.get(key).and_then(|v| u32::try_from(&**v).ok())
        };
        let result = service_props
            .as_ref()
            .and_then(|m| text(m, "Result"))
            .or_else(|| self.unit_type_result(&props, unit));
        Ok(ObservedUnit {
            unit: unit.to_string(),
            load_state: LoadState::parse(&text(&unit_props, "LoadState").unwrap_or_default()),
            active_state: ActiveState::parse(&text(&unit_props, "ActiveState").unwrap_or_default()),
            sub_state: text(&unit_props, "SubState").unwrap_or_default(),
            result,
            invocation_id: unit_props.get("InvocationID").and_then(invocation_id),
            n_restarts: service_props.as_ref().and_then(|m| number(m, "NRestarts")),
            status_text: service_props
                .as_ref()
                .and_then(|m| text(m, "StatusText"))
                .filter(|s| !s.is_empty()),
            main_pid: service_props
                .as_ref()
                .and_then(|m| number(m, "MainPID"))
                .filter(|pid| *pid != 0),
            job: unit_props.get("Job").and_then(job_id),
        })
    }

    /// `Result` of non-service unit types that have one (socket, mount, timer, ...).
    fn unit_type_result(&self, props: &PropertiesProxyBlocking<'_>, unit: &str) -> Option<String> {
        let suffix = unit.rsplit('.').next()?;
        let interface = match suffix {
            "socket" => "org.freedesktop.systemd1.Socket",
            "mount" => "org.freedesktop.systemd1.Mount",
            "automount" => "org.freedesktop.systemd1.Automount",
            "swap" => "org.freedesktop.systemd1.Swap",
            "timer" => "org.freedesktop.systemd1.Timer",
            "path" => "org.freedesktop.systemd1.Path",
            _ => return None,
        };
        props
            .get(interface, "Result")
            .ok()
            .and_then(|v| String::try_from(v).ok())
    }
}

// === The service manager over systemd ===

/// First pause before reconnecting after a lost connection; doubled per attempt.
const RECONNECT_FIRST: Duration = Duration::from_millis(250);
/// Longest pause between reconnection attempts.
const RECONNECT_MAX: Duration = Duration::from_secs(8);

/// [`crate::host::ServiceManager`] over systemd's D-Bus API: one cached [`Systemd`]
/// connection, made at first use; a call that finds the connection lost (bus restarted,
/// socket gone, systemd not on the bus yet) drops it, says so through the call's report,
/// waits (250 ms, doubling up to 8 s) and tries again on a new connection until the call's
/// deadline. A restart interrupted that way is not queued twice (see
/// [`Systemd::run_job_once`]).
#[derive(Debug)]
pub struct SystemdServices {
    address: String,
    call_timeout: Duration,
    conn: std::sync::Mutex<Option<std::sync::Arc<Systemd>>>,
}

impl SystemdServices {
    /// A service manager for the bus at `address`; nothing is connected yet.
    pub fn new(address: String, call_timeout: Duration) -> SystemdServices {
        SystemdServices {
            address,
            call_timeout,
            conn: std::sync::Mutex::new(None),
        }
    }

    fn connection(&self) -> Result<std::sync::Arc<Systemd>, SystemdError> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = conn.as_ref() {
            return Ok(c.clone());
        }
        let c = std::sync::Arc::new(Systemd::connect(&self.address, self.call_timeout)?);
        *conn = Some(c.clone());
        Ok(c)
    }

    fn forget(&self) {
        *self.conn.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Runs `f` on a connection, reconnecting while the connection is lost (see the type).
    /// `f` is told whether an earlier attempt failed after it may have acted.
    fn retry<T>(
        &self,
        op: &str,
        call: &mut crate::host::ServiceCall<'_>,
        mut f: impl FnMut(&Systemd, bool) -> Result<T, SystemdError>,
    ) -> Result<T, SystemdError> {
        let started = Instant::now();
        let mut pause = RECONNECT_FIRST;
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            let result = self.connection().and_then(|sd| f(&sd, attempt > 1));
            match result {
                Ok(v) => return Ok(v),
                Err(e) if e.is_connection_lost() => {
                    self.forget();
                    if Instant::now() + pause > call.deadline {
                        return Err(SystemdError::Unreachable {
                            op: op.to_string(),
                            address: self.address.clone(),
                            attempts: attempt,
                            waited: started.elapsed(),
                            last: e.to_string(),
                        });
                    }
                    call.retrying(&format!(
                        "{op}: lost the connection to systemd ({e}); reconnecting in {:.1}s \
                         (attempt {attempt})",
                        pause.as_secs_f64()
                    ));
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(RECONNECT_MAX);
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl crate::host::ServiceManager for SystemdServices {
    fn describe(&self) -> String {
        format!("systemd on {}", self.address)
    }

    fn ping(&self) -> Result<String, SystemdError> {
        let sd = self.connection()?;
        Ok(format!("systemd {} on {}", sd.version(), self.address))
    }

    fn daemon_reload(&self, call: &mut crate::host::ServiceCall<'_>) -> Result<(), SystemdError> {
        self.retry("daemon-reload", call, |sd, _| sd.daemon_reload())
    }

    fn unit_state(
        &self,
        unit: &str,
        call: &mut crate::host::ServiceCall<'_>,
    ) -> Result<ObservedUnit, SystemdError> {
        self.retry(&format!("show {unit}"), call, |sd, _| sd.unit_state(unit))
    }

    fn unit_file_state(
        &self,
        unit: &str,
        call: &mut crate::host::ServiceCall<'_>,
    ) -> Result<Option<UnitFileState>, SystemdError> {
        self.retry(&format!("is-enabled {unit}"), call, |sd, _| {
            match sd.unit_file_state(unit) {
                Ok(s) => Ok(Some(s)),
                Err(SystemdError::NoSuchUnit { .. }) => Ok(None),
                Err(e) => Err(e),
            }
        })
    }

    fn unit_file(
        &self,
        op: UnitFileOp,
        unit: &str,
        call: &mut crate::host::ServiceCall<'_>,
    ) -> Result<UnitFileChanges, SystemdError> {
        let units = [unit];
        self.retry(&format!("{op} {unit}"), call, |sd, _| match op {
            UnitFileOp::Enable => sd.enable_unit_files(&units),
            UnitFileOp::Disable => sd.disable_unit_files(&units),
            UnitFileOp::Mask => sd.mask_unit_files(&units),
            UnitFileOp::Unmask => sd.unmask_unit_files(&units),
        })
    }

    fn job(
        &self,
        job: UnitJob,
        unit: &str,
        before: &UnitBefore,
        maybe_queued: bool,
        call: &mut crate::host::ServiceCall<'_>,
    ) -> Result<UnitOutcome, SystemdError> {
        let deadline = call.deadline;
        self.retry(&format!("{job} {unit}"), call, |sd, retried| {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1));
            sd.run_job_once(job, unit, before, maybe_queued || retried, left)
        })
    }

    fn reset_failed(
        &self,
        unit: &str,
        call: &mut crate::host::ServiceCall<'_>,
    ) -> Result<(), SystemdError> {
        self.retry(&format!("reset-failed {unit}"), call, |sd, _| {
            sd.reset_failed(unit)
        })
    }

    fn reboot(&self, call: &mut crate::host::ServiceCall<'_>) -> Result<(), SystemdError> {
        self.retry("reboot", call, |sd, _| sd.reboot())
    }
}

/// Decodes an `InvocationID` (`ay`, 16 bytes; empty when the unit has not run).
fn invocation_id(value: &OwnedValue) -> Option<InvocationId> {
    let Value::Array(array) = &**value else {
        return None;
    };
    let bytes: Vec<u8> = array
        .inner()
        .iter()
        .map(u8::try_from)
        .collect::<Result<_, _>>()
        .ok()?;
    let bytes: [u8; 16] = bytes.try_into().ok()?;
    (bytes != [0; 16]).then_some(InvocationId(bytes))
}

/// Decodes a unit's `Job` property (`(uo)`: job id and path; id 0 when no job is pending).
fn job_id(value: &OwnedValue) -> Option<u32> {
    let Value::Structure(fields) = &**value else {
        return None;
    };
    let id = fields
        .fields()
        .first()
        .and_then(|v| u32::try_from(v).ok())?;
    (id != 0).then_some(id)
}

/// Validates one unit name for operation `op`.
fn validate(op: &'static str, unit: &str) -> Result<(), SystemdError> {
    validate_unit_name(unit).map_err(|source| SystemdError::InvalidUnitName { op, source })
}

/// Validates a non-empty list of unit names for operation `op`.
fn unit_list<'a, S: AsRef<str>>(
    op: &'static str,
    units: &'a [S],
) -> Result<Vec<&'a str>, SystemdError> {
    if units.is_empty() {
        return Err(SystemdError::InvalidUnitName {
            op,
            source: UnitNameError::Empty,
        });
    }
    units
        .iter()
        .map(|u| validate(op, u.as_ref()).map(|()| u.as_ref()))
        .collect()
}

/// Runs `future` to completion on this thread, or gives up after `limit` (`None`).
fn within<F: std::future::Future>(limit: Duration, future: F) -> Option<F::Output> {
    async_io::block_on(futures_lite::future::or(
        async { Some(future.await) },
        async {
            async_io::Timer::after(limit).await;
            None
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn accepts_systemd_unit_names() {
        for name in [
            "kubelet.service",
            "containerd.service",
            "dbus.socket",
            "multi-user.target",
            "-.mount",
            "var-lib-kubelet.mount",
            "getty@tty1.service",
            "getty@.service",
            "systemd-fsck@dev-disk-by\\x2duuid-1234.service",
            "apt-daily.timer",
            "foo:bar_baz.path",
            "user-1000.slice",
            "session-1.scope",
            "a.device",
            "b.swap",
            "c.automount",
        ] {
            assert_eq!(validate_unit_name(name), Ok(()), "{name}");
        }
    }

    #[test]
    fn rejects_names_systemd_rejects() {
        let cases: &[(&str, &str)] = &[
            ("", "empty"),
            ("kubelet", "suffix"),
            ("kubelet.", "suffix"),
            ("kubelet.services", "suffix"),
            ("kubelet.Service", "suffix"),
            (".service", "prefix"),
            ("@.service", "prefix"),
            ("@tty1.service", "prefix"),
            ("../etc/passwd.service", "contains '/'"),
            ("kube let.service", "contains ' '"),
            ("kubelet\n.service", "contains '\\n'"),
            ("kübelet.service", "contains 'ü'"),
            ("a;b.service", "contains ';'"),
        ];
        for (name, want) in cases {
            let err = validate_unit_name(name).expect_err(name).to_string();
            assert!(err.contains(want), "{name:?}: {err}");
        }
    }

    #[test]
    fn unit_name_length_limit_is_255_bytes() {
        let ok = format!("{}.service", "a".repeat(UNIT_NAME_MAX - ".service".len()));
        assert_eq!(ok.len(), 255);
        assert_eq!(validate_unit_name(&ok), Ok(()));
        let long = format!("a{ok}");
        assert!(matches!(
            validate_unit_name(&long),
            Err(UnitNameError::TooLong { .. })
        ));
    }

    #[test]
    fn object_paths_are_escaped_like_sd_bus() {
        assert_eq!(
            unit_object_path("kubelet.service"),
            "/org/freedesktop/systemd1/unit/kubelet_2eservice"
        );
        assert_eq!(
            unit_object_path("-.mount"),
            "/org/freedesktop/systemd1/unit/_2d_2emount"
        );
        assert_eq!(
            unit_object_path("getty@tty1.service"),
            "/org/freedesktop/systemd1/unit/getty_40tty1_2eservice"
        );
        // A leading digit is escaped, later ones are not; `_` itself is escaped.
        assert_eq!(
            unit_object_path("1a2_b.service"),
            "/org/freedesktop/systemd1/unit/_31a2_5fb_2eservice"
        );
        assert_eq!(unit_object_path(""), "/org/freedesktop/systemd1/unit/_");
        // Every escaped path is a valid D-Bus object path.
        for name in ["kubelet.service", "-.mount", "systemd-fsck@x\\x2dy.service"] {
            assert!(
                ObjectPath::try_from(unit_object_path(name)).is_ok(),
                "{name}"
            );
        }
    }

    #[test]
    fn bus_address_escapes_the_socket_path() {
        assert_eq!(
            system_bus_address(Path::new("/")),
            "unix:path=/run/dbus/system_bus_socket"
        );
        assert_eq!(
            system_bus_address(Path::new("/proc/42/root")),
            "unix:path=/proc/42/root/run/dbus/system_bus_socket"
        );
        assert_eq!(
            unix_path_address(Path::new("/tmp/a b,c=d%/s")),
            "unix:path=/tmp/a%20b%2cc%3dd%25/s"
        );
    }

    #[test]
    fn state_names_round_trip() {
        for s in [
            "active",
            "reloading",
            "inactive",
            "failed",
            "activating",
            "deactivating",
            "maintenance",
            "refreshing",
            "something-new",
        ] {
            assert_eq!(ActiveState::parse(s).as_str(), s);
        }
        for s in [
            "loaded",
            "not-found",
            "bad-setting",
            "error",
            "masked",
            "stub",
            "merged",
            "x",
        ] {
            assert_eq!(LoadState::parse(s).as_str(), s);
        }
        for s in [
            "enabled",
            "enabled-runtime",
            "linked",
            "linked-runtime",
            "alias",
            "masked",
            "masked-runtime",
            "static",
            "disabled",
            "indirect",
            "generated",
            "transient",
            "bad",
            "y",
        ] {
            assert_eq!(UnitFileState::parse(s).as_str(), s);
        }
    }

    fn state(active: &str, sub: &str, result: Option<&str>) -> ObservedUnit {
        ObservedUnit {
            unit: "kubelet.service".into(),
            load_state: LoadState::Loaded,
            active_state: ActiveState::parse(active),
            sub_state: sub.into(),
            result: result.map(Into::into),
            invocation_id: None,
            n_restarts: Some(0),
            status_text: None,
            main_pid: None,
            job: None,
        }
    }

    #[test]
    fn judges_the_unit_after_a_done_job() {
        let running = state("active", "running", Some("success"));
        let failed = state("failed", "failed", Some("exit-code"));
        let restarting = state("activating", "auto-restart", Some("exit-code"));
        let ran_once = state("inactive", "dead", Some("success"));
        let dead_bad = state("inactive", "dead", Some("exit-code"));
        for kind in [JobKind::Start, JobKind::Restart] {
            assert!(kind.state_ok(&running));
            assert!(kind.state_ok(&ran_once));
            assert!(!kind.state_ok(&failed));
            assert!(!kind.state_ok(&restarting));
            assert!(!kind.state_ok(&dead_bad));
        }
        assert!(JobKind::Reload.state_ok(&running));
        assert!(!JobKind::Reload.state_ok(&ran_once));
        assert!(JobKind::TryRestart.state_ok(&running));
        assert!(JobKind::TryRestart.state_ok(&ran_once));
        assert!(!JobKind::TryRestart.state_ok(&failed));
        assert!(!JobKind::TryRestart.state_ok(&restarting));
        assert!(JobKind::Stop.state_ok(&failed));
    }

    #[test]
    fn errors_name_the_unit_result_and_status() {
        let mut st = state("failed", "failed", Some("exit-code"));
        st.status_text = Some("refusing to start: maxPods must be a positive integer".into());
        let err = SystemdError::JobFailed {
            op: "restart kubelet.service".into(),
            job_result: "failed".into(),
            state: Some(Box::new(st)),
        };
        assert_eq!(
            err.to_string(),
            "restart kubelet.service: job failed; unit is failed/failed (result exit-code); \
             status: \"refusing to start: maxPods must be a positive integer\""
        );
        assert_eq!(err.kind(), "job_failed");
        let err = SystemdError::JobFailed {
            op: "start x.service".into(),
            job_result: "dependency".into(),
            state: None,
        };
        assert_eq!(
            err.to_string(),
            "start x.service: job dependency; unit state unknown"
        );
        let mut nf = state("inactive", "dead", None);
        nf.load_state = LoadState::NotFound;
        assert_eq!(nf.to_string(), "unit is not-found and inactive/dead");
    }

    #[test]
    fn method_errors_map_to_bounded_kinds() {
        let timeout = SystemdError::Timeout {
            op: "daemon-reload".into(),
            waited: Duration::from_millis(1500),
            detail: "; no reply from systemd".into(),
        };
        assert_eq!(
            timeout.to_string(),
            "daemon-reload: timed out after 1.5s; no reply from systemd"
        );
        assert_eq!(timeout.kind(), "timeout");
        let io = zbus::Error::InputOutput(std::sync::Arc::new(std::io::Error::from(
            std::io::ErrorKind::TimedOut,
        )));
        assert_eq!(dbus_error("x".into(), io, None).kind(), "timeout");
        let other = zbus::Error::Failure("boom".into());
        let err = dbus_error("restart a.service".into(), other, None);
        assert_eq!(err.kind(), "dbus");
        assert!(err.to_string().starts_with("restart a.service: "), "{err}");
        let bad = validate("restart", "nope").expect_err("invalid");
        assert_eq!(bad.kind(), "invalid_unit_name");
        assert!(
            bad.to_string().starts_with("restart: unit name \"nope\""),
            "{bad}"
        );
    }

    #[test]
    fn a_connection_can_be_shared_between_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<Systemd>();
        shareable::<SystemdError>();
    }

    #[test]
    fn invocation_ids_print_as_hex() {
        let id = InvocationId([
            0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0, 1, 2, 3, 4, 5, 6, 7,
        ]);
        assert_eq!(id.to_string(), "0123456789abcdef0001020304050607");
    }
}

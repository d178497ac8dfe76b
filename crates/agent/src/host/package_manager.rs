//! The interface every package manager of a node implements ([`PackageManager`]), its
//! errors and progress events, and the runner that executes its commands inside the root
//! with timeouts and lock handling. `apt.rs` and `dnf.rs` implement it; `packages.rs`
//! detects and opens one.

use std::cmp::Ordering;
use std::fmt;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use super::command::{self, CommandError, CommandOutput, CommandSpec};
use super::locks::{LockHolder, LockSpec};
use inplace_base::pkgversion::VersionError;

pub use inplace_base::packages::{InstalledPackage, ManagerKind};

/// `apt` or `dnf` as a [`ManagerKind`], or the error package steps report.
pub fn manager_kind(name: &str) -> Result<ManagerKind, PkgError> {
    name.parse().map_err(|_| PkgError::InvalidArgument {
        what: "package manager",
        value: name.to_string(),
        reason: "expected apt or dnf".to_string(),
    })
}

/// How long package operations may take.
#[derive(Debug, Clone)]
pub struct PkgOptions {
    /// Timeout of read-only commands (`dpkg-query`, `apt-cache`, `rpm -q`, `dnf repoquery`).
    pub query_timeout: Duration,
    /// Timeout of commands that change the node (install, hold, refresh).
    pub change_timeout: Duration,
    /// Waiting for a lock another process holds.
    pub lock_wait: LockWait,
    /// Bytes of stdout and of stderr kept per command.
    pub max_output: usize,
}

impl Default for PkgOptions {
    fn default() -> PkgOptions {
        PkgOptions {
            query_timeout: Duration::from_secs(120),
            change_timeout: Duration::from_secs(900),
            lock_wait: LockWait::default(),
            max_output: 64 * 1024,
        }
    }
}

/// Which package manager the agent uses and how long its commands may take.
#[derive(Debug, Clone, Default)]
pub struct PackageSettings {
    /// Use this manager instead of detecting one (the configuration's override); a plan's
    /// own `manager` still wins.
    pub manager: Option<ManagerKind>,
    /// Timeouts, lock waiting, output bounds.
    pub options: PkgOptions,
}

/// Exponential backoff while a package manager lock is held.
#[derive(Debug, Clone, Copy)]
pub struct LockWait {
    /// First pause.
    pub first_delay: Duration,
    /// Longest pause; each pause doubles up to this.
    pub max_delay: Duration,
    /// Give up (with [`PkgError::LockTimeout`]) after waiting this long in total.
    pub give_up_after: Duration,
}

impl Default for LockWait {
    fn default() -> LockWait {
        LockWait {
            first_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(30),
            give_up_after: Duration::from_secs(600),
        }
    }
}

/// One command that ran, with what it printed, for the journal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandRecord {
    /// The command line.
    pub command: String,
    /// Its exit status and bounded output.
    pub output: CommandOutput,
}

/// The commands an operation ran, in order (empty when nothing needed doing).
pub type Transcript = Vec<CommandRecord>;

/// Progress of a package operation, for the status line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PkgEvent {
    /// A command is starting.
    Running {
        /// The command line.
        command: String,
    },
    /// Another process holds a package manager lock; we wait and try again.
    WaitingForLock {
        /// "dpkg lock", "rpm lock", "dnf lock", "apt lists lock".
        label: &'static str,
        /// The lock file, inside the root.
        path: PathBuf,
        /// Who holds it, when we could tell.
        holder: Option<LockHolder>,
        /// How long we have waited so far.
        waited: Duration,
        /// When we look again.
        retry_in: Duration,
    },
}

impl fmt::Display for PkgEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PkgEvent::Running { command } => write!(f, "running {command}"),
            PkgEvent::WaitingForLock {
                label,
                path,
                holder,
                waited,
                retry_in,
            } => {
                write!(f, "waiting for the {label} ({})", path.display())?;
                if let Some(holder) = holder {
                    write!(f, ", held by {holder}")?;
                }
                write!(
                    f,
                    "; waited {}s, next try in {}s",
                    waited.as_secs(),
                    retry_in.as_secs_f64().ceil() as u64
                )
            }
        }
    }
}

/// A lock we waited for in vain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockBlocked {
    /// Which lock ("dpkg lock").
    pub label: &'static str,
    /// The lock file inside the root.
    pub path: PathBuf,
    /// Who held it the last time we looked.
    pub holder: Option<LockHolder>,
    /// How long we waited.
    pub waited: Duration,
}

impl fmt::Display for LockBlocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "waiting {}s for the {} ({}), held by ",
            self.waited.as_secs(),
            self.label,
            self.path.display()
        )?;
        match &self.holder {
            Some(holder) => write!(f, "{holder}"),
            None => f.write_str("an unknown process"),
        }
    }
}

/// What went wrong in a package operation.
#[derive(Debug, thiserror::Error)]
pub enum PkgError {
    /// A package name, version or manager name that we refuse to pass on.
    #[error("invalid {what} '{value}': {reason}")]
    InvalidArgument {
        /// What the value was meant to be.
        what: &'static str,
        /// The value.
        value: String,
        /// Why it is refused.
        reason: String,
    },
    /// Neither dpkg+apt nor rpm+dnf was found in the root.
    #[error("no supported package manager in {root}: {detail}")]
    NoManager {
        /// The root looked at.
        root: PathBuf,
        /// What was looked for.
        detail: String,
    },
    /// The command could not be started.
    #[error("{op} in {root}: {source}")]
    Spawn {
        /// The operation, e.g. `install kubelet=1.31.2-1.1`.
        op: String,
        /// The root it ran in.
        root: PathBuf,
        /// Why it did not start.
        #[source]
        source: CommandError,
    },
    /// The command failed or timed out.
    #[error("{op} in {root}: {}", record.output.summary())]
    Failed {
        /// The operation.
        op: String,
        /// The root it ran in.
        root: PathBuf,
        /// The failed command and its output.
        record: Box<CommandRecord>,
    },
    /// The requested version is not available from the configured repositories.
    #[error("{op} in {root}: {}", record.output.summary())]
    NotAvailable {
        /// The operation.
        op: String,
        /// The root it ran in.
        root: PathBuf,
        /// The failed command and its output.
        record: Box<CommandRecord>,
    },
    /// A lock stayed held for longer than we wait.
    #[error("{op} in {root}: gave up after {blocked}")]
    LockTimeout {
        /// The operation.
        op: String,
        /// The root it ran in.
        root: PathBuf,
        /// Which lock, who held it the last time we looked, and how long we waited.
        blocked: Box<LockBlocked>,
    },
    /// A command succeeded but printed something we cannot read.
    #[error("{op} in {root}: unexpected output: {detail}")]
    UnexpectedOutput {
        /// The operation.
        op: String,
        /// The root it ran in.
        root: PathBuf,
        /// What was wrong with it.
        detail: String,
    },
    /// A command succeeded but the package database does not show the result.
    #[error("{op} in {root}: {detail}")]
    NotApplied {
        /// The operation.
        op: String,
        /// The root it ran in.
        root: PathBuf,
        /// What the database shows instead.
        detail: String,
        /// What ran.
        transcript: Transcript,
    },
    /// The node's package manager lacks the feature (e.g. the dnf versionlock plugin).
    #[error("{op} in {root}: {detail}")]
    Unsupported {
        /// The operation.
        op: String,
        /// The root it ran in.
        root: PathBuf,
        /// What is missing.
        detail: String,
    },
}

impl PkgError {
    /// A short, bounded name for metrics and for callers that branch.
    pub fn kind(&self) -> &'static str {
        match self {
            PkgError::InvalidArgument { .. } => "invalid_argument",
            PkgError::NoManager { .. } => "no_package_manager",
            PkgError::Spawn { .. } => "spawn",
            PkgError::Failed { record, .. } if record.output.timed_out => "timeout",
            PkgError::Failed { .. } => "command_failed",
            PkgError::NotAvailable { .. } => "version_not_available",
            PkgError::LockTimeout { .. } => "lock_timeout",
            PkgError::UnexpectedOutput { .. } => "unexpected_output",
            PkgError::NotApplied { .. } => "not_applied",
            PkgError::Unsupported { .. } => "unsupported",
        }
    }

    /// The failed command and its output, when a command failed.
    pub fn record(&self) -> Option<&CommandRecord> {
        match self {
            PkgError::Failed { record, .. } | PkgError::NotAvailable { record, .. } => Some(record),
            _ => None,
        }
    }
}

/// A node's package manager.
///
/// Names and versions are validated before anything runs; versions use the manager's own
/// syntax (`1.31.2-1.1` for apt, `1.31.2-150500.1.1` or `1.31.2` for dnf).
pub trait PackageManager: Send + Sync + fmt::Debug {
    /// Which manager this is.
    fn kind(&self) -> ManagerKind;

    /// The root the commands run in.
    fn root(&self) -> &Path;

    /// The installed package, or `None` when it is not installed (not an error).
    fn installed(&self, name: &str) -> Result<Option<InstalledPackage>, PkgError>;

    /// The versions of `name` the configured repositories offer, as last refreshed (empty
    /// when the package is unknown).
    fn available_versions(&self, name: &str) -> Result<Vec<String>, PkgError>;

    /// Whether `version` of `name` can still be installed from the configured repositories;
    /// rollback asks this before trying to go back to a previous version.
    fn is_available(&self, name: &str, version: &str) -> Result<bool, PkgError> {
        validate_version(self.kind(), version)?;
        Ok(self
            .available_versions(name)?
            .iter()
            .any(|have| self.version_satisfies(have, version)))
    }

    /// Whether an installed or offered version `have` is what `want` asks for.
    fn version_satisfies(&self, have: &str, want: &str) -> bool;

    /// Orders two versions with this manager's rules.
    fn compare_versions(&self, a: &str, b: &str) -> Result<Ordering, VersionError>;

    /// Installs exactly `version` of `name`, upgrading or downgrading as needed and keeping
    /// its hold state (a held package is changed and held again). Nothing runs when that
    /// version is already installed. The database is checked afterwards.
    fn install(
        &self,
        name: &str,
        version: &str,
        events: &mut dyn FnMut(&PkgEvent),
    ) -> Result<Transcript, PkgError>;

    /// Holds or releases `name`. Nothing runs when it already is in that state.
    fn set_held(
        &self,
        name: &str,
        held: bool,
        events: &mut dyn FnMut(&PkgEvent),
    ) -> Result<Transcript, PkgError>;

    /// Removes `name` and nothing else (`dpkg --remove`, `rpm -e`): refused by the manager
    /// when another installed package needs it. Nothing runs when it is not installed.
    fn remove(&self, name: &str, events: &mut dyn FnMut(&PkgEvent))
    -> Result<Transcript, PkgError>;

    /// Refreshes the repository metadata (`apt-get update`, `dnf makecache`).
    fn refresh(&self, events: &mut dyn FnMut(&PkgEvent)) -> Result<Transcript, PkgError>;
}

/// Refuses names that are not package names (so nothing is taken for an option).
pub fn validate_name(name: &str) -> Result<(), PkgError> {
    let invalid = |reason: &str| PkgError::InvalidArgument {
        what: "package name",
        value: name.to_string(),
        reason: reason.to_string(),
    };
    if name.is_empty() || name.len() > 200 {
        return Err(invalid("must be 1 to 200 characters"));
    }
    if !name.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(invalid("must start with a letter or digit"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"+-._".contains(&b))
    {
        return Err(invalid("may only contain letters, digits and + - . _"));
    }
    Ok(())
}

/// Refuses versions that are not valid for `kind` or could be taken for options or patterns.
pub fn validate_version(kind: ManagerKind, version: &str) -> Result<(), PkgError> {
    let invalid = |reason: String| PkgError::InvalidArgument {
        what: "package version",
        value: version.to_string(),
        reason,
    };
    if version.is_empty() || version.len() > 200 {
        return Err(invalid("must be 1 to 200 characters".to_string()));
    }
    if !version.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(invalid("must start with a letter or digit".to_string()));
    }
    if !version
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"+-.~:_^".contains(&b))
    {
        return Err(invalid(
            "may only contain letters, digits and + - . ~ : _ ^ (no patterns)".to_string(),
        ));
    }
    let parsed = match kind {
        ManagerKind::Apt => inplace_base::pkgversion::DebVersion::parse(version).map(drop),
        ManagerKind::Dnf => inplace_base::pkgversion::RpmVersion::parse(version).map(drop),
    };
    parsed.map_err(|e| invalid(e.reason.to_string()))
}

/// Runs a manager's commands in the root with its timeouts and lock handling.
#[derive(Debug, Clone)]
pub(crate) struct Runner {
    pub(crate) root: PathBuf,
    pub(crate) options: PkgOptions,
    /// Extra environment for every command.
    pub(crate) env: Vec<(String, String)>,
}

/// Decides whether a failed command failed because of a lock; `Some(pid)` when it did, with
/// the holder's PID when the message names it.
pub(crate) type LockFailure = fn(&CommandOutput) -> Option<Option<u32>>;

impl Runner {
    pub(crate) fn new(root: &Path, options: PkgOptions, env: &[(&str, &str)]) -> Runner {
        let mut all = vec![(
            "PATH".to_string(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        )];
        all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Runner {
            root: root.to_path_buf(),
            options,
            env: all,
        }
    }

    fn spec(&self, argv: &[&str], timeout: Duration) -> CommandSpec {
        let mut spec = CommandSpec::new(argv.iter().copied())
            .in_root(&self.root)
            .timeout(timeout);
        spec.max_output = self.options.max_output;
        spec.env = self.env.clone();
        spec
    }

    /// Runs a read-only command; the caller judges its exit status. Timeouts are errors.
    pub(crate) fn query(&self, op: &str, argv: &[&str]) -> Result<CommandRecord, PkgError> {
        let spec = self.spec(argv, self.options.query_timeout);
        let output = command::run(&spec).map_err(|source| self.spawn_error(op, source))?;
        let record = CommandRecord {
            command: spec.display(),
            output,
        };
        if record.output.timed_out {
            return Err(self.failed(op, record));
        }
        Ok(record)
    }

    /// Runs a command that changes the node, waiting while one of `locks` is held (checked
    /// before each try) and retrying when the command fails because of a lock. Every try is
    /// appended to `transcript`; the last output is returned whatever its exit status.
    pub(crate) fn change(
        &self,
        op: &str,
        argv: &[&str],
        locks: &[LockSpec],
        lock_failure: LockFailure,
        events: &mut dyn FnMut(&PkgEvent),
        transcript: &mut Transcript,
    ) -> Result<CommandOutput, PkgError> {
        let wait = self.options.lock_wait;
        let start = Instant::now();
        let mut delay = wait.first_delay;
        loop {
            let (lock, holder) = match self.held_lock(locks) {
                Some(held) => held,
                None => {
                    let spec = self.spec(argv, self.options.change_timeout);
                    events(&PkgEvent::Running {
                        command: spec.display(),
                    });
                    let output =
                        command::run(&spec).map_err(|source| self.spawn_error(op, source))?;
                    transcript.push(CommandRecord {
                        command: spec.display(),
                        output: output.clone(),
                    });
                    let lock_pid = match lock_failure(&output) {
                        Some(pid) if !output.success() && !output.timed_out => pid,
                        _ => return Ok(output),
                    };
                    match (self.held_lock(locks), locks.first()) {
                        (Some(held), _) => held,
                        (None, Some(first)) => (first.clone(), lock_pid.map(LockHolder::from_pid)),
                        (None, None) => return Ok(output),
                    }
                }
            };
            let waited = start.elapsed();
            if waited >= wait.give_up_after {
                return Err(PkgError::LockTimeout {
                    op: op.to_string(),
                    root: self.root.clone(),
                    blocked: Box::new(LockBlocked {
                        label: lock.label,
                        path: lock.path,
                        holder,
                        waited,
                    }),
                });
            }
            let retry_in = delay.min(wait.give_up_after - waited);
            events(&PkgEvent::WaitingForLock {
                label: lock.label,
                path: lock.path,
                holder,
                waited,
                retry_in,
            });
            thread::sleep(retry_in);
            delay = (delay * 2).min(wait.max_delay);
        }
    }

    /// The first of `locks` that another process holds. A lock we cannot inspect counts as
    /// free: the command itself will then report it.
    fn held_lock(&self, locks: &[LockSpec]) -> Option<(LockSpec, Option<LockHolder>)> {
        locks.iter().find_map(|lock| match lock.holder(&self.root) {
            Ok(Some(holder)) => Some((lock.clone(), Some(holder))),
            Ok(None) => None,
            Err(e) => {
                tracing::debug!(lock = %lock.path.display(), error = %e, "cannot inspect lock");
                None
            }
        })
    }

    pub(crate) fn spawn_error(&self, op: &str, source: CommandError) -> PkgError {
        PkgError::Spawn {
            op: op.to_string(),
            root: self.root.clone(),
            source,
        }
    }

    pub(crate) fn failed(&self, op: &str, record: CommandRecord) -> PkgError {
        PkgError::Failed {
            op: op.to_string(),
            root: self.root.clone(),
            record: Box::new(record),
        }
    }

    pub(crate) fn not_available(&self, op: &str, record: CommandRecord) -> PkgError {
        PkgError::NotAvailable {
            op: op.to_string(),
            root: self.root.clone(),
            record: Box::new(record),
        }
    }

    pub(crate) fn unexpected(&self, op: &str, detail: String) -> PkgError {
        PkgError::UnexpectedOutput {
            op: op.to_string(),
            root: self.root.clone(),
            detail,
        }
    }

    pub(crate) fn not_applied(&self, op: &str, detail: String, transcript: Transcript) -> PkgError {
        PkgError::NotApplied {
            op: op.to_string(),
            root: self.root.clone(),
            detail,
            transcript,
        }
    }
}

/// The last record of a transcript as an error for `op` (the command that just failed).
pub(crate) fn last_failed(runner: &Runner, op: &str, transcript: &Transcript) -> PkgError {
    match transcript.last() {
        Some(record) => runner.failed(op, record.clone()),
        None => runner.unexpected(op, "no command ran".to_string()),
    }
}

/// Finds "pid 4242" / "process 4242" style PIDs in a lock message.
pub(crate) fn pid_after(text: &str, marker: &str) -> Option<u32> {
    let at = text.find(marker)? + marker.len();
    let digits: String = text[at..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::packages::{detect, open};

    #[test]
    fn names_and_versions_are_validated() {
        assert!(validate_name("kubelet").is_ok());
        assert!(validate_name("libstdc++6").is_ok());
        assert!(validate_name("python3.11-minimal").is_ok());
        for bad in ["", "-o", "kubelet=1", "a b", "kube*", "kubelet;rm"] {
            assert_eq!(
                validate_name(bad).unwrap_err().kind(),
                "invalid_argument",
                "{bad}"
            );
        }
        assert!(validate_version(ManagerKind::Apt, "1.31.2-1.1").is_ok());
        assert!(validate_version(ManagerKind::Apt, "1:2.0~rc1+dfsg-3").is_ok());
        assert!(validate_version(ManagerKind::Dnf, "1.31.2-150500.1.1").is_ok());
        assert!(validate_version(ManagerKind::Dnf, "1.31.2").is_ok());
        for bad in ["", "-1", "1.31.*", "1.31.2 -o", "1-", "1:", "1.0-a:b"] {
            let err = validate_version(ManagerKind::Apt, bad).unwrap_err();
            assert_eq!(err.kind(), "invalid_argument", "{bad}");
        }
        let err = validate_version(ManagerKind::Apt, "1.0-").unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid package version '1.0-': revision number is empty"
        );
    }

    #[test]
    fn manager_names_parse() {
        assert_eq!("apt".parse::<ManagerKind>().unwrap(), ManagerKind::Apt);
        assert_eq!("dnf".parse::<ManagerKind>().unwrap(), ManagerKind::Dnf);
        assert!("yum".parse::<ManagerKind>().is_err());
    }

    #[test]
    fn detection_looks_at_the_databases_and_tools() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        assert_eq!(detect(r).unwrap_err().kind(), "no_package_manager");
        std::fs::create_dir_all(r.join("var/lib/rpm")).unwrap();
        std::fs::create_dir_all(r.join("usr/bin")).unwrap();
        std::fs::write(r.join("var/lib/rpm/rpmdb.sqlite"), b"x").unwrap();
        assert!(
            detect(r).is_err(),
            "an rpm database without dnf is not enough"
        );
        std::fs::write(r.join("usr/bin/dnf"), b"").unwrap();
        assert_eq!(detect(r).unwrap(), ManagerKind::Dnf);
        std::fs::create_dir_all(r.join("var/lib/dpkg")).unwrap();
        std::fs::write(r.join("var/lib/dpkg/status"), b"").unwrap();
        std::fs::write(r.join("usr/bin/apt-get"), b"").unwrap();
        assert_eq!(
            detect(r).unwrap(),
            ManagerKind::Dnf,
            "an empty dpkg database"
        );
        std::fs::write(r.join("var/lib/dpkg/status"), b"Package: base-files\n").unwrap();
        assert_eq!(detect(r).unwrap(), ManagerKind::Apt);
        let pm = open(r, Some(ManagerKind::Dnf), PkgOptions::default()).unwrap();
        assert_eq!(pm.kind(), ManagerKind::Dnf);
        assert_eq!(pm.root(), r);
    }

    #[test]
    fn lock_wait_events_read_well() {
        let event = PkgEvent::WaitingForLock {
            label: "dpkg lock",
            path: PathBuf::from("/var/lib/dpkg/lock-frontend"),
            holder: Some(LockHolder {
                pid: Some(4242),
                command: Some("apt-get".into()),
            }),
            waited: Duration::from_secs(3),
            retry_in: Duration::from_millis(3500),
        };
        assert_eq!(
            event.to_string(),
            "waiting for the dpkg lock (/var/lib/dpkg/lock-frontend), held by PID 4242 \
             (apt-get); waited 3s, next try in 4s"
        );
    }

    #[test]
    fn pids_are_found_in_lock_messages() {
        let msg = "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 6937 (python3)";
        assert_eq!(pid_after(msg, "held by process"), Some(6937));
        assert_eq!(
            pid_after("RPMDB already locked by 77", "locked by"),
            Some(77)
        );
        assert_eq!(pid_after("no number here", "held by process"), None);
    }

    #[test]
    fn lock_timeouts_give_up_and_say_who_held_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let runner = Runner::new(
            Path::new("/"),
            PkgOptions {
                lock_wait: LockWait {
                    first_delay: Duration::from_millis(10),
                    max_delay: Duration::from_millis(20),
                    // Long enough for several attempts of `sh` on a loaded machine.
                    give_up_after: Duration::from_secs(2),
                },
                ..PkgOptions::default()
            },
            &[],
        );
        // A command that always reports a lock failure, with no lock file to inspect.
        let missing = dir.path().join("no-such-lock");
        let locks = [LockSpec::fcntl("test lock", missing.to_str().unwrap())];
        fn always_locked(out: &CommandOutput) -> Option<Option<u32>> {
            pid_after(&out.stderr, "held by process").map(Some)
        }
        let mut events = Vec::new();
        let mut transcript = Vec::new();
        let err = runner
            .change(
                "test",
                &["sh", "-c", "echo 'held by process 1' >&2; exit 100"],
                &locks,
                always_locked,
                &mut |e| events.push(e.clone()),
                &mut transcript,
            )
            .unwrap_err();
        assert_eq!(err.kind(), "lock_timeout");
        assert!(
            err.to_string().contains("for the test lock") && err.to_string().contains("PID 1"),
            "{err}"
        );
        let waits = events
            .iter()
            .filter(|e| matches!(e, PkgEvent::WaitingForLock { .. }))
            .count();
        assert!(waits >= 2, "{events:?}");
        assert_eq!(transcript.len(), waits + 1);

        // A command that is not blocked runs once and its failure is returned as is.
        let mut transcript = Vec::new();
        let out = runner
            .change(
                "test",
                &["sh", "-c", "exit 3"],
                &locks,
                always_locked,
                &mut |_| {},
                &mut transcript,
            )
            .unwrap();
        assert_eq!(out.code, Some(3));
        assert_eq!(transcript.len(), 1);
    }
}

//! Units as plain data: names and their validation, load/active/file states as systemd
//! reports them, jobs, unit file operations and what a unit looked like before a change.
//! No D-Bus here (that is `host::systemd`); the plan's kinds and the journal use these types.

use std::fmt;
use std::path::Path;
use std::time::Duration;

/// Object path prefix of unit objects.
const UNIT_PATH_PREFIX: &str = "/org/freedesktop/systemd1/unit/";

/// Longest unit name systemd accepts (`UNIT_NAME_MAX` is 256 including the NUL).
pub const UNIT_NAME_MAX: usize = 255;
/// Unit type suffixes systemd knows (the part after the last `.`).
pub const UNIT_SUFFIXES: &[&str] = &[
    "service",
    "socket",
    "target",
    "device",
    "mount",
    "automount",
    "swap",
    "timer",
    "path",
    "slice",
    "scope",
];

// === Unit names and object paths ===

/// Why a string is not a valid systemd unit name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitNameError {
    /// The name is empty.
    #[error("empty unit name")]
    Empty,
    /// The name is longer than [`UNIT_NAME_MAX`] bytes.
    #[error("unit name {name:?} is longer than {UNIT_NAME_MAX} bytes")]
    TooLong {
        /// The offending name (possibly long).
        name: String,
    },
    /// No `.suffix`, or one systemd does not know.
    #[error(
        "unit name {name:?} has no known type suffix (.service, .socket, .timer, .target, ...)"
    )]
    BadSuffix {
        /// The offending name.
        name: String,
    },
    /// Nothing before the suffix, or before the `@` of a template.
    #[error("unit name {name:?} has an empty prefix")]
    EmptyPrefix {
        /// The offending name.
        name: String,
    },
    /// A character systemd does not allow in unit names.
    #[error("unit name {name:?} contains {ch:?}, which systemd does not allow")]
    BadChar {
        /// The offending name.
        name: String,
        /// The first character that is not allowed.
        ch: char,
    },
}

/// Checks `name` against systemd's unit name rules (`unit_name_is_valid()` with plain,
/// instance and template names allowed): at most [`UNIT_NAME_MAX`] bytes, a known type suffix
/// after the last `.`, a non-empty prefix, and only ASCII letters, digits, `:`, `-`, `_`,
/// `.`, `\` and `@` (the first `@` separates template and instance, as in
/// `getty@tty1.service` or `getty@.service`).
pub fn validate_unit_name(name: &str) -> Result<(), UnitNameError> {
    if name.is_empty() {
        return Err(UnitNameError::Empty);
    }
    if name.len() > UNIT_NAME_MAX {
        return Err(UnitNameError::TooLong {
            name: name.to_string(),
        });
    }
    let Some(dot) = name.rfind('.') else {
        return Err(UnitNameError::BadSuffix {
            name: name.to_string(),
        });
    };
    let (prefix, suffix) = (&name[..dot], &name[dot + 1..]);
    if !UNIT_SUFFIXES.contains(&suffix) {
        return Err(UnitNameError::BadSuffix {
            name: name.to_string(),
        });
    }
    if prefix.is_empty() || prefix.starts_with('@') {
        return Err(UnitNameError::EmptyPrefix {
            name: name.to_string(),
        });
    }
    if let Some(ch) = prefix.chars().find(|c| !is_unit_name_char(*c)) {
        return Err(UnitNameError::BadChar {
            name: name.to_string(),
            ch,
        });
    }
    Ok(())
}

/// Characters systemd allows before the type suffix (`VALID_CHARS` plus `@`).
fn is_unit_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, ':' | '-' | '_' | '.' | '\\' | '@')
}

/// The D-Bus object path of a unit, as systemd names it: `/org/freedesktop/systemd1/unit/`
/// followed by the unit name with every byte that is not an ASCII letter (or a digit after
/// the first position) written as `_xx` in lower-case hex (sd-bus `bus_label_escape`):
/// `kubelet.service` → `/org/freedesktop/systemd1/unit/kubelet_2eservice`.
pub fn unit_object_path(unit: &str) -> String {
    let mut path = String::with_capacity(UNIT_PATH_PREFIX.len() + unit.len() * 3);
    path.push_str(UNIT_PATH_PREFIX);
    if unit.is_empty() {
        path.push('_');
        return path;
    }
    for (i, b) in unit.bytes().enumerate() {
        if b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()) {
            path.push(char::from(b));
        } else {
            path.push_str(&format!("_{b:02x}"));
        }
    }
    path
}

/// The D-Bus address of the system bus of the node whose filesystem is at `root`:
/// `unix:path=<root>/run/dbus/system_bus_socket`, with the path escaped as the D-Bus
/// address syntax requires (bytes outside `[-0-9A-Za-z_/.\*]` as `%xx`).
pub fn system_bus_address(root: &Path) -> String {
    unix_path_address(&root.join("run/dbus/system_bus_socket"))
}

/// A `unix:path=` D-Bus address for a socket path, escaped as the address syntax requires.
pub fn unix_path_address(socket: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut address = String::from("unix:path=");
    for &b in socket.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'/' | b'.' | b'\\' | b'*') {
            address.push(char::from(b));
        } else {
            address.push_str(&format!("%{b:02x}"));
        }
    }
    address
}

// === Unit state ===

/// A unit's `ActiveState`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActiveState {
    /// Started, bound, plugged in, as appropriate for the unit type.
    Active,
    /// Active and reloading its configuration.
    Reloading,
    /// Stopped, and the last run did not fail (or it never ran).
    Inactive,
    /// Stopped after a failure (exit code, signal, timeout...).
    Failed,
    /// Starting, or waiting to be restarted automatically (sub-state `auto-restart`).
    Activating,
    /// Stopping.
    Deactivating,
    /// Under maintenance (e.g. cleaning) and not running.
    Maintenance,
    /// Active, with new mounts being refreshed.
    Refreshing,
    /// A state this code does not know yet.
    Other(String),
}

impl ActiveState {
    /// Parses systemd's spelling.
    pub fn parse(s: &str) -> ActiveState {
        match s {
            "active" => ActiveState::Active,
            "reloading" => ActiveState::Reloading,
            "inactive" => ActiveState::Inactive,
            "failed" => ActiveState::Failed,
            "activating" => ActiveState::Activating,
            "deactivating" => ActiveState::Deactivating,
            "maintenance" => ActiveState::Maintenance,
            "refreshing" => ActiveState::Refreshing,
            other => ActiveState::Other(other.to_string()),
        }
    }

    /// systemd's spelling.
    pub fn as_str(&self) -> &str {
        match self {
            ActiveState::Active => "active",
            ActiveState::Reloading => "reloading",
            ActiveState::Inactive => "inactive",
            ActiveState::Failed => "failed",
            ActiveState::Activating => "activating",
            ActiveState::Deactivating => "deactivating",
            ActiveState::Maintenance => "maintenance",
            ActiveState::Refreshing => "refreshing",
            ActiveState::Other(s) => s,
        }
    }
}

impl fmt::Display for ActiveState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A unit's `LoadState`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadState {
    /// The unit file was found and parsed.
    Loaded,
    /// There is no unit file of that name.
    NotFound,
    /// The unit file has a setting systemd could not parse.
    BadSetting,
    /// Loading failed for another reason.
    Error,
    /// The unit is masked (linked to `/dev/null`).
    Masked,
    /// Referenced but not loaded yet.
    Stub,
    /// Merged into another unit (an alias).
    Merged,
    /// A state this code does not know yet.
    Other(String),
}

impl LoadState {
    /// Parses systemd's spelling.
    pub fn parse(s: &str) -> LoadState {
        match s {
            "loaded" => LoadState::Loaded,
            "not-found" => LoadState::NotFound,
            "bad-setting" => LoadState::BadSetting,
            "error" => LoadState::Error,
            "masked" => LoadState::Masked,
            "stub" => LoadState::Stub,
            "merged" => LoadState::Merged,
            other => LoadState::Other(other.to_string()),
        }
    }

    /// systemd's spelling.
    pub fn as_str(&self) -> &str {
        match self {
            LoadState::Loaded => "loaded",
            LoadState::NotFound => "not-found",
            LoadState::BadSetting => "bad-setting",
            LoadState::Error => "error",
            LoadState::Masked => "masked",
            LoadState::Stub => "stub",
            LoadState::Merged => "merged",
            LoadState::Other(s) => s,
        }
    }
}

impl fmt::Display for LoadState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `InvocationID` of a unit run: 128 random bits systemd assigns each time the unit
/// is started, so a changed id proves the unit was (re)started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InvocationId(pub [u8; 16]);

impl fmt::Display for InvocationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A unit's state as systemd reports it, read in one go after a job or on request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObservedUnit {
    /// The unit name.
    pub unit: String,
    /// `LoadState`.
    pub load_state: LoadState,
    /// `ActiveState`.
    pub active_state: ActiveState,
    /// `SubState` (`running`, `dead`, `exited`, `auto-restart`, `listening`, ...).
    pub sub_state: String,
    /// `Result` of the unit's last run (`success`, `exit-code`, `signal`, `timeout`, ...);
    /// `None` for unit types without one (targets, slices...).
    pub result: Option<String>,
    /// `InvocationID`; `None` when the unit has not run in this boot.
    pub invocation_id: Option<InvocationId>,
    /// `NRestarts`: automatic restarts (by `Restart=`) since the unit was last started or
    /// restarted by hand, which resets it to 0; services only.
    pub n_restarts: Option<u32>,
    /// `StatusText` the service sent with `sd_notify(STATUS=...)`; `None` when empty.
    pub status_text: Option<String>,
    /// `MainPID` as systemd sees it (in systemd's PID namespace); `None` when no process.
    pub main_pid: Option<u32>,
    /// The id of the job queued for the unit (`Job`), `None` when no job is pending.
    pub job: Option<u32>,
}

impl ObservedUnit {
    /// True when the unit is active (or reloading or refreshing, which are active too).
    pub fn is_active(&self) -> bool {
        matches!(
            self.active_state,
            ActiveState::Active | ActiveState::Reloading | ActiveState::Refreshing
        )
    }

    /// True when the unit failed, or is waiting to be restarted after a failure.
    pub fn is_failed(&self) -> bool {
        self.active_state == ActiveState::Failed
            || (self.active_state == ActiveState::Activating && self.sub_state == "auto-restart")
    }
}

impl fmt::Display for ObservedUnit {
    /// `unit is failed/failed (result exit-code); status: "..."`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.load_state != LoadState::Loaded {
            write!(f, "unit is {} and ", self.load_state)?;
        } else {
            f.write_str("unit is ")?;
        }
        write!(f, "{}/{}", self.active_state, self.sub_state)?;
        if let Some(result) = self.result.as_deref().filter(|r| *r != "success") {
            write!(f, " (result {result})")?;
        }
        if let Some(status) = &self.status_text {
            write!(f, "; status: {status:?}")?;
        }
        Ok(())
    }
}

/// What a finished unit job left behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitOutcome {
    /// The unit's state right after the job.
    pub state: ObservedUnit,
    /// From queuing the job to reading the state.
    pub elapsed: Duration,
}

/// A unit file's enablement state (`GetUnitFileState`, what `systemctl is-enabled` prints).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UnitFileState {
    /// Enabled through symlinks in `/etc`.
    Enabled,
    /// Enabled through symlinks in `/run` (until reboot).
    EnabledRuntime,
    /// Linked into the search path from elsewhere.
    Linked,
    /// Linked from `/run`.
    LinkedRuntime,
    /// An alias of another unit.
    Alias,
    /// Masked in `/etc`.
    Masked,
    /// Masked in `/run`.
    MaskedRuntime,
    /// No `[Install]` section: cannot be enabled, pulled in by others.
    Static,
    /// Has an `[Install]` section and is not enabled.
    Disabled,
    /// Enabled indirectly (through `Also=` or a template instance).
    Indirect,
    /// Made by a generator.
    Generated,
    /// Made at runtime over D-Bus.
    Transient,
    /// The unit file is broken.
    Bad,
    /// A state this code does not know yet.
    Other(String),
}

impl UnitFileState {
    /// Parses systemd's spelling.
    pub fn parse(s: &str) -> UnitFileState {
        match s {
            "enabled" => UnitFileState::Enabled,
            "enabled-runtime" => UnitFileState::EnabledRuntime,
            "linked" => UnitFileState::Linked,
            "linked-runtime" => UnitFileState::LinkedRuntime,
            "alias" => UnitFileState::Alias,
            "masked" => UnitFileState::Masked,
            "masked-runtime" => UnitFileState::MaskedRuntime,
            "static" => UnitFileState::Static,
            "disabled" => UnitFileState::Disabled,
            "indirect" => UnitFileState::Indirect,
            "generated" => UnitFileState::Generated,
            "transient" => UnitFileState::Transient,
            "bad" => UnitFileState::Bad,
            other => UnitFileState::Other(other.to_string()),
        }
    }

    /// systemd's spelling.
    pub fn as_str(&self) -> &str {
        match self {
            UnitFileState::Enabled => "enabled",
            UnitFileState::EnabledRuntime => "enabled-runtime",
            UnitFileState::Linked => "linked",
            UnitFileState::LinkedRuntime => "linked-runtime",
            UnitFileState::Alias => "alias",
            UnitFileState::Masked => "masked",
            UnitFileState::MaskedRuntime => "masked-runtime",
            UnitFileState::Static => "static",
            UnitFileState::Disabled => "disabled",
            UnitFileState::Indirect => "indirect",
            UnitFileState::Generated => "generated",
            UnitFileState::Transient => "transient",
            UnitFileState::Bad => "bad",
            UnitFileState::Other(s) => s,
        }
    }
}

impl fmt::Display for UnitFileState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One change systemd made to the unit file symlinks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitFileChange {
    /// `symlink`, `unlink`, ...
    pub kind: String,
    /// The file that was created or removed.
    pub path: String,
    /// For symlinks, what it points to; empty otherwise.
    pub destination: String,
}

/// What an enable/disable/mask/unmask call changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitFileChanges {
    /// For [`Systemd::enable_unit_files`]: false when none of the units has an `[Install]`
    /// section, so enabling could do nothing. `None` for the other calls.
    pub carries_install_info: Option<bool>,
    /// The symlinks created and removed; empty when everything already was as asked.
    pub changes: Vec<UnitFileChange>,
}

impl UnitFileChanges {
    /// From what systemd's `EnableUnitFiles`/`DisableUnitFiles` return: whether the unit
    /// files carry install information, and the (kind, path, destination) of each change.
    pub fn from_dbus(
        carries_install_info: Option<bool>,
        raw: Vec<(String, String, String)>,
    ) -> Self {
        UnitFileChanges {
            carries_install_info,
            changes: raw
                .into_iter()
                .map(|(kind, path, destination)| UnitFileChange {
                    kind,
                    path,
                    destination,
                })
                .collect(),
        }
    }
}

/// The unit jobs the agent queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobKind {
    /// `StartUnit`.
    Start,
    /// `StopUnit`.
    Stop,
    /// `RestartUnit`.
    Restart,
    /// `ReloadUnit`.
    Reload,
    /// `TryRestartUnit`: restarts the unit only when it is running.
    TryRestart,
}

impl JobKind {
    /// The verb of messages and of systemd's method name: `start`, `try-restart`, ….
    pub fn verb(self) -> &'static str {
        match self {
            JobKind::Start => "start",
            JobKind::Stop => "stop",
            JobKind::Restart => "restart",
            JobKind::Reload => "reload",
            JobKind::TryRestart => "try-restart",
        }
    }

    /// Whether the unit's state after a `done` job is what this job asked for.
    pub fn state_ok(self, state: &ObservedUnit) -> bool {
        match self {
            JobKind::Stop => true,
            // A oneshot service without RemainAfterExit= is inactive/dead with result
            // success once it ran; that is a successful start.
            JobKind::Start | JobKind::Restart => {
                state.is_active()
                    || (state.active_state == ActiveState::Inactive
                        && state.result.as_deref().is_none_or(|r| r == "success"))
            }
            JobKind::Reload => state.is_active(),
            // try-restart leaves a stopped unit stopped; only a failure is an error.
            JobKind::TryRestart => !state.is_failed(),
        }
    }
}

// === Requests the agent journals ===

/// A unit job the agent queues and journals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum UnitJob {
    /// `StartUnit`.
    Start,
    /// `StopUnit`.
    Stop,
    /// `RestartUnit` (starts a stopped unit).
    Restart,
}

impl UnitJob {
    /// `start`, `stop`, `restart`.
    pub fn verb(self) -> &'static str {
        match self {
            UnitJob::Start => "start",
            UnitJob::Stop => "stop",
            UnitJob::Restart => "restart",
        }
    }

    /// `started`, `stopped`, `restarted`.
    pub fn past(self) -> &'static str {
        match self {
            UnitJob::Start => "started",
            UnitJob::Stop => "stopped",
            UnitJob::Restart => "restarted",
        }
    }

    /// The job that carries this out.
    pub fn kind(self) -> JobKind {
        match self {
            UnitJob::Start => JobKind::Start,
            UnitJob::Stop => JobKind::Stop,
            UnitJob::Restart => JobKind::Restart,
        }
    }
}

impl fmt::Display for UnitJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.verb())
    }
}

/// A change to a unit file's enablement or mask (symlinks in `/etc/systemd/system`, made by
/// systemd; they take effect at the next daemon-reload).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum UnitFileOp {
    /// `EnableUnitFiles`.
    Enable,
    /// `DisableUnitFiles`.
    Disable,
    /// `MaskUnitFiles`.
    Mask,
    /// `UnmaskUnitFiles`.
    Unmask,
}

impl UnitFileOp {
    /// `enable`, `disable`, `mask`, `unmask`.
    pub fn verb(self) -> &'static str {
        match self {
            UnitFileOp::Enable => "enable",
            UnitFileOp::Disable => "disable",
            UnitFileOp::Mask => "mask",
            UnitFileOp::Unmask => "unmask",
        }
    }

    /// The operation that undoes this one.
    pub fn inverse(self) -> UnitFileOp {
        match self {
            UnitFileOp::Enable => UnitFileOp::Disable,
            UnitFileOp::Disable => UnitFileOp::Enable,
            UnitFileOp::Mask => UnitFileOp::Unmask,
            UnitFileOp::Unmask => UnitFileOp::Mask,
        }
    }
}

impl fmt::Display for UnitFileOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.verb())
    }
}

/// What a unit looked like right before the agent queued a job for it: journaled first, so
/// that after a crash or a lost connection the agent can tell whether its restart already
/// happened (the unit's `InvocationID` changed, or a job is still pending) instead of
/// restarting it a second time.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UnitBefore {
    /// `ActiveState` (`active`, `inactive`, `failed`, ...).
    pub active_state: String,
    /// `SubState`.
    pub sub_state: String,
    /// `InvocationID` in hex; `None` when the unit had not run in this boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub invocation_id: Option<String>,
}

impl UnitBefore {
    /// The journaled form of a unit's state.
    pub fn of(state: &ObservedUnit) -> UnitBefore {
        UnitBefore {
            active_state: state.active_state.as_str().to_string(),
            sub_state: state.sub_state.clone(),
            invocation_id: state.invocation_id.map(|id| id.to_string()),
        }
    }

    /// True when the unit was active (or reloading, refreshing) then.
    pub fn was_active(&self) -> bool {
        matches!(
            self.active_state.as_str(),
            "active" | "reloading" | "refreshing"
        )
    }
}

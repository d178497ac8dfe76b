//! How failures are classified: a bounded kind (metric label, proto enum, journal field)
//! and the step it happened at.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A bounded classification of errors (metric label, proto enum).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The plan does not fit this node (owner unknown, path escapes, file missing).
    Precondition,
    /// A file operation failed.
    Io,
    /// The disk is full.
    DiskFull,
    /// A command exited non-zero or timed out.
    Command,
    /// A health gate failed.
    Verification,
    /// The plan or a step ran out of time.
    Timeout,
    /// systemd refused or failed a job.
    Systemd,
    /// A package operation failed.
    Package,
    /// A download failed or did not match its checksum.
    Download,
    /// The change kind is not supported on this node.
    Unsupported,
    /// Cancelled on request.
    Cancelled,
    /// A newer plan took over.
    Superseded,
    /// Rolling back failed; the node needs a person.
    RollbackFailed,
    /// A bug or an impossible state.
    Internal,
}

impl ErrorKind {
    /// The snake_case name.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Precondition => "precondition",
            ErrorKind::Io => "io",
            ErrorKind::DiskFull => "disk_full",
            ErrorKind::Command => "command",
            ErrorKind::Verification => "verification",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Systemd => "systemd",
            ErrorKind::Package => "package",
            ErrorKind::Download => "download",
            ErrorKind::Unsupported => "unsupported",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Superseded => "superseded",
            ErrorKind::RollbackFailed => "rollback_failed",
            ErrorKind::Internal => "internal",
        }
    }
}

/// Why a run failed: a bounded kind, the step, and a detail for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ErrorInfo {
    /// Classification.
    pub kind: ErrorKind,
    /// The step: `changes[3] file /etc/kubernetes/x.conf` or `verify[1] httpGet ...`.
    pub step: Option<String>,
    /// What happened, lowercase, naming what it happened to.
    pub detail: String,
}

impl fmt::Display for ErrorInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.step {
            Some(step) => write!(f, "{step}: {}", self.detail),
            None => f.write_str(&self.detail),
        }
    }
}

/// A step failure with a bounded kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct StepError {
    /// Classification.
    pub kind: ErrorKind,
    /// What failed on what.
    pub detail: String,
}

impl StepError {
    /// A new error.
    pub fn new(kind: ErrorKind, detail: impl Into<String>) -> StepError {
        StepError {
            kind,
            detail: detail.into(),
        }
    }
}

/// An error and its causes on one line, each said once: `open the journal in /var/lib/x:
/// journal /var/lib/x/journal: Permission denied (os error 13)`. Many errors here already
/// show their source in their own message, so a cause whose text is already there is not
/// repeated (what `{:#}` would do).
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = String::new();
    let mut current = Some(error);
    while let Some(e) = current {
        let text = e.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        current = e.source();
    }
    out
}

//! Packages as plain data: which manager, and what its database says of a package.

use std::fmt;
use std::str::FromStr;

/// Which package manager a node uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ManagerKind {
    /// apt over dpkg (Debian, Ubuntu).
    Apt,
    /// dnf over rpm (Fedora, RHEL and its rebuilds).
    Dnf,
}

impl ManagerKind {
    /// The name used in plans and messages: `apt` or `dnf`.
    pub fn name(self) -> &'static str {
        match self {
            ManagerKind::Apt => "apt",
            ManagerKind::Dnf => "dnf",
        }
    }
}

impl fmt::Display for ManagerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ManagerKind {
    type Err = String;

    fn from_str(s: &str) -> Result<ManagerKind, String> {
        match s {
            "apt" => Ok(ManagerKind::Apt),
            "dnf" => Ok(ManagerKind::Dnf),
            _ => Err(format!("package manager {s:?}: expected apt or dnf")),
        }
    }
}

/// A package as the package database has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstalledPackage {
    /// Package name.
    pub name: String,
    /// Installed version: dpkg's `[epoch:]upstream[-revision]`, rpm's `[epoch:]version-release`
    /// (the epoch only when it is not 0).
    pub version: String,
    /// Held (`apt-mark hold`, `dnf versionlock`): the manager will not change it on its own.
    pub held: bool,
    /// The manager's word for its state (`installed`, `half-configured`, ...).
    pub status: String,
    /// False when a previous operation left it half installed or half configured.
    pub complete: bool,
}

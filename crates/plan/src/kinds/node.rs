//! What a kind may ask of the node: observations only (and the two reads that fetch or
//! refresh without changing the node: downloading an artifact into the agent's cache and
//! refreshing package lists). Implemented by `steps` over `host`; a test implements it with
//! a map. Nothing here changes the node: changes are [`super::Mutation`]s.

use std::path::PathBuf;
use std::time::Duration;

use crate::NodePath;
use inplace_base::packages::{InstalledPackage, ManagerKind};
use inplace_base::units::{ObservedUnit as Observed, UnitFileState};
use inplace_base::{Compared, Existing, FileMeta, StepError};

use super::Note;

/// The node as the kinds see it.
pub trait Node {
    /// What is at `p` (a final symlink is an error; a path below a symlink too).
    fn read(&self, p: &NodePath) -> Result<Existing, StepError>;

    /// What is at `p` compared with `expected`: [`Node::read`] without holding the content
    /// (a file of another size is not read; one of the same size is read in pieces, up to
    /// its first difference).
    fn compare(&self, p: &NodePath, expected: &[u8]) -> Result<Compared, StepError> {
        Ok(Compared::of(&self.read(p)?, expected))
    }

    /// Mode, owner and size of the regular file at `p`, without reading it.
    fn file_meta(&self, p: &NodePath) -> Result<Option<(FileMeta, u64)>, StepError>;

    /// The sha256 (lowercase hex) of the regular file at `p`, read streaming.
    fn file_sha256(&self, p: &NodePath) -> Result<Option<String>, StepError>;

    /// A small special file (`/proc/sys/...`), read in place; `None` when absent.
    fn read_special(&self, p: &NodePath) -> Result<Option<String>, StepError>;

    /// The directory exists on the node.
    fn dir_exists(&self, p: &NodePath) -> bool;

    /// Where the node's root is, for messages (`/`, `/host`, a sandbox).
    fn root_display(&self) -> String;

    /// True when the agent manages units (systemd); false with `--services off`.
    fn services_on(&self) -> bool;

    /// The unit file state of `unit` (`None`: no unit file of that name).
    fn unit_file_state(&self, unit: &str) -> Result<Option<UnitFileState>, StepError>;

    /// The state of `unit` as systemd has it.
    fn unit_state(&self, unit: &str) -> Result<Observed, StepError>;

    /// The package manager a change uses (`manager` from the plan, else the configured or
    /// detected one), or why there is none.
    fn package_manager(&self, requested: Option<&str>) -> Result<ManagerKind, String>;

    /// Whether `version` is one `manager` can read (an exact version or a prefix).
    fn valid_version(&self, manager: ManagerKind, version: &str) -> Result<(), String>;

    /// The package database of `manager`, with commands bounded by `timeout`.
    fn packages(&self, manager: ManagerKind, timeout: Duration) -> Box<dyn Packages + '_>;

    /// The artifact with this sha256 in the agent's download cache: its path and size.
    fn cached_artifact(&self, sha256: &str) -> Option<(PathBuf, u64)>;

    /// Where the artifact with this sha256 is (or will be, once fetched) in the cache.
    fn artifact_path(&self, sha256: &str) -> PathBuf;

    /// The sha256 of `member` of the cached archive `sha256`, once it was extracted.
    fn cached_member_sha(&self, sha256: &str, member: &str) -> Option<String>;

    /// Downloads and verifies an artifact (or a member of an archive) into the cache; a
    /// cache hit makes no request. Returns what happened, for people.
    fn fetch_artifact(
        &self,
        url: &str,
        sha256: &str,
        member: Option<&str>,
        note: &mut dyn FnMut(Note),
    ) -> Result<String, StepError>;

    /// Runs a query command on the node (in its root) with a timeout: its trimmed stdout,
    /// or why it failed.
    fn query(&self, argv: &[&str], timeout: Duration) -> Result<String, String>;

    /// Runs one of the node's own programs (`kubeadm version`, `kubelet --version`) as a
    /// query: the one in the node's root, whether or not node commands run chrooted into it
    /// (a plan author's command line is [`Node::query`]). By default as [`Node::query`].
    fn query_program(&self, argv: &[&str], timeout: Duration) -> Result<String, String> {
        self.query(argv, timeout)
    }

    /// The time now, for what a change issues (a certificate's NotBefore); a test's node
    /// may fix it.
    fn now(&self) -> std::time::SystemTime {
        std::time::SystemTime::now()
    }
}

/// A package manager's database, as far as kinds ask it.
pub trait Packages {
    /// Which manager.
    fn kind(&self) -> ManagerKind;

    /// The package as installed, or `None`.
    fn installed(&self, name: &str) -> Result<Option<InstalledPackage>, StepError>;

    /// The versions the configured repositories offer.
    fn available_versions(&self, name: &str) -> Result<Vec<String>, StepError>;

    /// Whether `have` satisfies `want` by the manager's rules.
    fn satisfies(&self, have: &str, want: &str) -> bool;

    /// Orders two versions by the manager's rules.
    fn compare(&self, a: &str, b: &str) -> std::cmp::Ordering;

    /// Refreshes the package lists (a read of the repositories, not a change of the node).
    fn refresh(&self, note: &mut dyn FnMut(Note)) -> Result<(), StepError>;
}

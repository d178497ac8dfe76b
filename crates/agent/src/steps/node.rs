//! The node as the kinds see it ([`inplace_plan::kinds::Node`]), over `host`: files through
//! the root (confined to the allow-list), units through the service manager, packages
//! through the node's package manager, artifacts through the download cache, queries as
//! commands in the root.

use std::cell::RefCell;
use std::path::PathBuf;
use std::time::Duration;

use super::{Note, StepError, package};
use crate::host::fs::{DirCache, FsError};
use crate::host::packages::PackageManager;
use crate::host::{Host, STEP_BUS_WINDOW, ServiceCall};
use inplace_base::packages::{InstalledPackage, ManagerKind};
use inplace_base::units::{ObservedUnit, UnitFileState};
use inplace_base::{Compared, Existing, FileMeta};
use inplace_plan::NodePath;
use inplace_plan::kinds::{Node, Packages, services_off};

/// [`Node`] over the agent's [`Host`].
#[derive(Debug)]
pub struct HostNode<'a> {
    host: &'a Host,
    /// Parent directories resolved by this node's reads, for a pass with no change to the
    /// node in between ([`HostNode::for_pass`]).
    dirs: Option<RefCell<DirCache>>,
}

impl<'a> HostNode<'a> {
    /// The node of `host`.
    pub fn new(host: &'a Host) -> HostNode<'a> {
        HostNode { host, dirs: None }
    }

    /// The node of `host` for a pass of diffs that changes nothing in between (a batch's
    /// diffs before its first mutation, the staging decision): each directory is resolved
    /// once for the pass, not again for every file read in it (`Root::read_in`).
    pub fn for_pass(host: &'a Host) -> HostNode<'a> {
        HostNode {
            host,
            dirs: Some(RefCell::new(DirCache::default())),
        }
    }
}

impl Node for HostNode<'_> {
    fn read(&self, p: &NodePath) -> Result<Existing, StepError> {
        Ok(match &self.dirs {
            Some(dirs) => self.host.root.read_in(p, &mut dirs.borrow_mut())?,
            None => self.host.root.read(p)?,
        })
    }

    fn compare(&self, p: &NodePath, expected: &[u8]) -> Result<Compared, StepError> {
        Ok(match &self.dirs {
            Some(dirs) => self
                .host
                .root
                .compare(p, expected, Some(&mut dirs.borrow_mut()))?,
            None => self.host.root.compare(p, expected, None)?,
        })
    }

    fn file_meta(&self, p: &NodePath) -> Result<Option<(FileMeta, u64)>, StepError> {
        // Opened, not read: the file there may be a large binary.
        Ok(self
            .host
            .root
            .open_file(p)?
            .map(|(_, meta, size)| (meta, size)))
    }

    fn file_sha256(&self, p: &NodePath) -> Result<Option<String>, StepError> {
        let Some((mut file, _, _)) = self.host.root.open_file(p)? else {
            return Ok(None);
        };
        let (sha, _) =
            crate::host::download::hash_reader(&mut file).map_err(|source| FsError::Io {
                op: "read",
                path: p.to_string(),
                source,
            })?;
        Ok(Some(sha))
    }

    fn read_special(&self, p: &NodePath) -> Result<Option<String>, StepError> {
        Ok(self.host.root.read_special(p)?)
    }

    fn dir_exists(&self, p: &NodePath) -> bool {
        self.host.root.dir_exists(p)
    }

    fn root_display(&self) -> String {
        self.host.root.path().display().to_string()
    }

    fn services_on(&self) -> bool {
        self.host.services().is_some()
    }

    fn unit_file_state(&self, unit: &str) -> Result<Option<UnitFileState>, StepError> {
        let services = self.host.services().ok_or_else(services_off)?;
        let mut call = ServiceCall::within(STEP_BUS_WINDOW);
        Ok(services.unit_file_state(unit, &mut call)?)
    }

    fn unit_state(&self, unit: &str) -> Result<ObservedUnit, StepError> {
        let services = self.host.services().ok_or_else(services_off)?;
        let mut call = ServiceCall::within(STEP_BUS_WINDOW);
        Ok(services.unit_state(unit, &mut call)?)
    }

    fn package_manager(&self, requested: Option<&str>) -> Result<ManagerKind, String> {
        self.host
            .package_manager_kind(requested)
            .map_err(|e| e.to_string())
    }

    fn valid_version(&self, manager: ManagerKind, version: &str) -> Result<(), String> {
        crate::host::packages::validate_version(manager, version).map_err(|e| e.to_string())
    }

    fn packages(&self, manager: ManagerKind, timeout: Duration) -> Box<dyn Packages + '_> {
        Box::new(HostPackages {
            pm: package::manager(self.host, manager, timeout),
        })
    }

    fn cached_artifact(&self, sha256: &str) -> Option<(PathBuf, u64)> {
        self.host.artifact_cache().peek(sha256)
    }

    fn artifact_path(&self, sha256: &str) -> PathBuf {
        self.host.artifact_cache().path(sha256)
    }

    fn cached_member_sha(&self, sha256: &str, member: &str) -> Option<String> {
        self.host.artifact_cache().member_sha(sha256, member)
    }

    fn fetch_artifact(
        &self,
        url: &str,
        sha256: &str,
        member: Option<&str>,
        note: &mut dyn FnMut(Note),
    ) -> Result<String, StepError> {
        super::artifact::fetch(self.host, url, sha256, member, note)
    }

    fn query(&self, argv: &[&str], timeout: Duration) -> Result<String, String> {
        query_with(self.host.command(argv.iter().copied()).timeout(timeout))
    }

    fn query_program(&self, argv: &[&str], timeout: Duration) -> Result<String, String> {
        query_with(
            crate::host::command::node_program(self.host, argv.iter().copied()).timeout(timeout),
        )
    }
}

/// Runs a query: its trimmed stdout, or why it failed.
fn query_with(spec: crate::host::command::CommandSpec) -> Result<String, String> {
    match crate::host::command::run(&spec) {
        Ok(out) if out.success() => Ok(out.stdout.trim().to_string()),
        Ok(out) => Err(format!("{}: {}", spec.display(), out.summary())),
        Err(e) => Err(e.to_string()),
    }
}

/// [`Packages`] over one of the node's package managers.
struct HostPackages {
    pm: Box<dyn PackageManager>,
}

impl Packages for HostPackages {
    fn kind(&self) -> ManagerKind {
        self.pm.kind()
    }

    fn installed(&self, name: &str) -> Result<Option<InstalledPackage>, StepError> {
        self.pm.installed(name).map_err(package::pkg_error)
    }

    fn available_versions(&self, name: &str) -> Result<Vec<String>, StepError> {
        self.pm.available_versions(name).map_err(package::pkg_error)
    }

    fn satisfies(&self, have: &str, want: &str) -> bool {
        self.pm.version_satisfies(have, want)
    }

    fn compare(&self, a: &str, b: &str) -> std::cmp::Ordering {
        self.pm
            .compare_versions(a, b)
            .unwrap_or(std::cmp::Ordering::Equal)
    }

    fn refresh(&self, note: &mut dyn FnMut(Note)) -> Result<(), StepError> {
        self.pm
            .refresh(&mut package::events(note))
            .map(drop)
            .map_err(package::pkg_error)
    }
}

//! One interface over the node's package manager: apt (dpkg) or dnf (rpm), chosen by looking
//! at the root, overridable.
//!
//! Every command runs inside the root (through `chroot(8)` when the root is not `/`) with a
//! timeout and bounded captured output, which callers keep for the journal. apt, dpkg, dnf
//! and rpm act on absolute paths (their databases, `/etc/apt`), so chroot is the only way
//! they act on a root that is not `/`: without it (`node.chroot = false`) such a root has no
//! package manager ([`usable`]), rather than one that would change the agent's own system. Commands that
//! change the package database first check the manager's locks and, while another process
//! holds one (or when the command fails because of one), wait with exponential backoff up to
//! a bound, telling the caller who holds it so the status can say so.

use std::path::Path;

use super::locks::open_in_root;
pub use super::package_manager::*;

/// Whether package managers may act on the node at `root` when node commands run chrooted
/// into it (`commands_in_root`) or not: always on `/`; in another root only chrooted.
pub fn usable(root: &Path, commands_in_root: bool) -> Result<(), PkgError> {
    if commands_in_root || root == Path::new("/") {
        return Ok(());
    }
    Err(PkgError::NoManager {
        root: root.to_path_buf(),
        detail: "package managers act on a root that is not / only chrooted into it, and node \
                 commands do not chroot here (node.chroot = false, --no-chroot): run with \
                 chroot to change packages in this root"
            .to_string(),
    })
}

/// Finds the package manager of the node at `root`: apt when dpkg's status database is not
/// empty and `apt-get` exists, otherwise dnf when an rpm database and `dnf` exist. A Debian
/// node with the rpm tools installed is therefore apt; pass the kind explicitly to
/// [`open`] to say otherwise.
pub fn detect(root: &Path) -> Result<ManagerKind, PkgError> {
    for kind in [ManagerKind::Apt, ManagerKind::Dnf] {
        if check_tools(root, kind).is_ok() {
            return Ok(kind);
        }
    }
    Err(PkgError::NoManager {
        root: root.to_path_buf(),
        detail: "found neither /var/lib/dpkg/status with /usr/bin/apt-get nor an rpm database \
                 with /usr/bin/dnf"
            .to_string(),
    })
}

/// Checks that the node at `root` has what `kind` needs: for apt a non-empty
/// `/var/lib/dpkg/status` and `/usr/bin/apt-get`, for dnf an rpm database and `/usr/bin/dnf`.
pub fn check_tools(root: &Path, kind: ManagerKind) -> Result<(), PkgError> {
    let non_empty = |rel: &str| {
        open_in_root(root, Path::new(rel), rustix::fs::OFlags::RDONLY)
            .and_then(|fd| Ok(rustix::fs::fstat(&fd)?))
            .is_ok_and(|st| st.st_size > 0 && (st.st_mode & 0o170000) == 0o100000)
    };
    let exists = |rel: &str| open_in_root(root, Path::new(rel), rustix::fs::OFlags::PATH).is_ok();
    let missing = match kind {
        ManagerKind::Apt => {
            if !non_empty("var/lib/dpkg/status") {
                Some("no dpkg database (/var/lib/dpkg/status is missing or empty)")
            } else if !exists("usr/bin/apt-get") {
                Some("no /usr/bin/apt-get")
            } else {
                None
            }
        }
        ManagerKind::Dnf => {
            let rpmdb = [
                "var/lib/rpm/rpmdb.sqlite",
                "var/lib/rpm/Packages",
                "var/lib/rpm/Packages.db",
                "usr/lib/sysimage/rpm/rpmdb.sqlite",
                "usr/lib/sysimage/rpm/Packages",
                "usr/lib/sysimage/rpm/Packages.db",
            ];
            if !rpmdb.iter().any(|p| exists(p)) {
                Some("no rpm database (in /var/lib/rpm or /usr/lib/sysimage/rpm)")
            } else if !exists("usr/bin/dnf") {
                Some("no /usr/bin/dnf")
            } else {
                None
            }
        }
    };
    match missing {
        None => Ok(()),
        Some(what) => Err(PkgError::NoManager {
            root: root.to_path_buf(),
            detail: format!("{kind} cannot be used: {what}"),
        }),
    }
}

/// Opens the package manager of the node at `root`: `kind`, or the detected one.
pub fn open(
    root: &Path,
    kind: Option<ManagerKind>,
    options: PkgOptions,
) -> Result<Box<dyn PackageManager>, PkgError> {
    let kind = match kind {
        Some(kind) => kind,
        None => detect(root)?,
    };
    Ok(match kind {
        ManagerKind::Apt => Box::new(super::apt::Apt::new(root, options)),
        ManagerKind::Dnf => Box::new(super::dnf::Dnf::new(root, options)),
    })
}

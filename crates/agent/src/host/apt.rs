//! apt over dpkg: `dpkg-query` for the database, `apt-cache madison` for what the repositories
//! offer, `apt-get install name=version` to install an exact version, `apt-mark` for holds.

use std::cmp::Ordering;
use std::path::Path;

use super::command::CommandOutput;
use super::locks::LockSpec;
use super::package_manager::{
    InstalledPackage, ManagerKind, PackageManager, PkgError, PkgEvent, PkgOptions, Runner,
    Transcript, last_failed, pid_after, validate_name, validate_version,
};
use inplace_base::pkgversion::{VersionError, compare_deb};

/// The dpkg locks every change takes (apt takes the frontend lock first).
fn dpkg_locks() -> Vec<LockSpec> {
    vec![
        LockSpec::fcntl("dpkg lock", "/var/lib/dpkg/lock-frontend"),
        LockSpec::fcntl("dpkg lock", "/var/lib/dpkg/lock"),
    ]
}

/// Whether apt or dpkg failed because another process holds a lock, and who, when they say.
fn lock_failure(out: &CommandOutput) -> Option<Option<u32>> {
    let text = &out.stderr;
    let locked = [
        "Could not get lock",
        "Unable to acquire the dpkg frontend lock",
        "Unable to lock the administration directory",
        "Unable to lock directory",
        "lock was locked by another process",
        "database is locked by another process",
    ]
    .iter()
    .any(|m| text.contains(m));
    locked.then(|| {
        pid_after(text, "held by process").or_else(|| pid_after(text, "another process with pid"))
    })
}

/// Whether apt failed because the version (or the package) is not in any repository.
fn not_available(out: &CommandOutput) -> bool {
    let text = &out.stderr;
    (text.contains("Version '") && text.contains("was not found"))
        || text.contains("Unable to locate package")
        || text.contains("has no installation candidate")
}

/// apt and dpkg in a root.
#[derive(Debug, Clone)]
pub struct Apt {
    runner: Runner,
}

impl Apt {
    /// apt for the node at `root`.
    pub fn new(root: &Path, options: PkgOptions) -> Apt {
        Apt {
            runner: Runner::new(
                root,
                options,
                &[
                    ("DEBIAN_FRONTEND", "noninteractive"),
                    ("APT_LISTCHANGES_FRONTEND", "none"),
                    ("NEEDRESTART_SUSPEND", "1"),
                ],
            ),
        }
    }

    fn hold_command(
        &self,
        name: &str,
        held: bool,
        events: &mut dyn FnMut(&PkgEvent),
        transcript: &mut Transcript,
    ) -> Result<(), PkgError> {
        let verb = if held { "hold" } else { "unhold" };
        let op = format!("{verb} {name}");
        let out = self.runner.change(
            &op,
            &["apt-mark", verb, name],
            &dpkg_locks(),
            lock_failure,
            events,
            transcript,
        )?;
        if !out.success() {
            return Err(last_failed(&self.runner, &op, transcript));
        }
        Ok(())
    }
}

/// Parses `dpkg-query -W -f '${Package}\t${db:Status-Want}\t${db:Status-Status}\t${Version}\n'`
/// output for `name`. Packages dpkg only remembers (not installed, or just configuration
/// files left) count as not installed.
fn parse_dpkg_query(name: &str, stdout: &str) -> Result<Option<InstalledPackage>, String> {
    let mut found: Vec<InstalledPackage> = Vec::new();
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split('\t').collect();
        let [pkg, want, status, version] = fields[..] else {
            return Err(format!("expected 4 tab-separated fields in {line:?}"));
        };
        if pkg != name || matches!(status, "not-installed" | "config-files") {
            continue;
        }
        if version.is_empty() {
            return Err(format!("no version for {name} in state {status}"));
        }
        found.push(InstalledPackage {
            name: name.to_string(),
            version: version.to_string(),
            held: want == "hold",
            status: status.to_string(),
            complete: status == "installed",
        });
    }
    match found.as_slice() {
        [] => Ok(None),
        [first, rest @ ..] => {
            if rest.iter().any(|p| p.version != first.version) {
                return Err(format!(
                    "{name} is installed for several architectures at different versions"
                ));
            }
            Ok(Some(first.clone()))
        }
    }
}

/// Parses `apt-cache madison` output (`name | version | source`) into the binary package
/// versions of `name`, without duplicates, in apt's order (newest first).
fn parse_madison(name: &str, stdout: &str) -> Vec<String> {
    let mut versions: Vec<String> = Vec::new();
    for line in stdout.lines() {
        let fields: Vec<&str> = line.split('|').map(str::trim).collect();
        let [pkg, version, source] = fields[..] else {
            continue;
        };
        if pkg != name || source.ends_with(" Sources") || version.is_empty() {
            continue;
        }
        if !versions.iter().any(|v| v == version) {
            versions.push(version.to_string());
        }
    }
    versions
}

fn same_version(a: &str, b: &str) -> bool {
    compare_deb(a, b) == Ok(Ordering::Equal)
}

impl PackageManager for Apt {
    fn kind(&self) -> ManagerKind {
        ManagerKind::Apt
    }

    fn root(&self) -> &Path {
        &self.runner.root
    }

    fn installed(&self, name: &str) -> Result<Option<InstalledPackage>, PkgError> {
        validate_name(name)?;
        let op = format!("query {name}");
        let record = self.runner.query(
            &op,
            &[
                "dpkg-query",
                "-W",
                "-f=${Package}\\t${db:Status-Want}\\t${db:Status-Status}\\t${Version}\\n",
                name,
            ],
        )?;
        let out = &record.output;
        if !out.success() {
            if out.code == Some(1) && out.stderr.contains("no packages found matching") {
                return Ok(None);
            }
            return Err(self.runner.failed(&op, record));
        }
        parse_dpkg_query(name, &out.stdout).map_err(|detail| self.runner.unexpected(&op, detail))
    }

    fn available_versions(&self, name: &str) -> Result<Vec<String>, PkgError> {
        validate_name(name)?;
        let op = format!("list versions of {name}");
        let record = self.runner.query(&op, &["apt-cache", "madison", name])?;
        if !record.output.success() {
            return Err(self.runner.failed(&op, record));
        }
        Ok(parse_madison(name, &record.output.stdout))
    }

    fn version_satisfies(&self, have: &str, want: &str) -> bool {
        same_version(have, want)
    }

    fn compare_versions(&self, a: &str, b: &str) -> Result<Ordering, VersionError> {
        compare_deb(a, b)
    }

    fn install(
        &self,
        name: &str,
        version: &str,
        events: &mut dyn FnMut(&PkgEvent),
    ) -> Result<Transcript, PkgError> {
        validate_name(name)?;
        validate_version(ManagerKind::Apt, version)?;
        let op = format!("install {name}={version}");
        let before = self.installed(name)?;
        if let Some(pkg) = &before
            && pkg.complete
            && same_version(&pkg.version, version)
        {
            return Ok(Vec::new());
        }
        let mut transcript = Vec::new();
        let spec = format!("{name}={version}");
        let out = self.runner.change(
            &op,
            &[
                "apt-get",
                "install",
                "-y",
                "-q",
                "--no-remove",
                "--allow-downgrades",
                "--allow-change-held-packages",
                "-o",
                "Dpkg::Options::=--force-confold",
                "-o",
                "DPkg::Lock::Timeout=0",
                &spec,
            ],
            &dpkg_locks(),
            lock_failure,
            events,
            &mut transcript,
        )?;
        if !out.success() {
            let record = transcript.last().cloned();
            return Err(match record {
                Some(record) if not_available(&out) => self.runner.not_available(&op, record),
                _ => last_failed(&self.runner, &op, &transcript),
            });
        }
        let after = self.installed(name)?;
        match &after {
            Some(pkg) if pkg.complete && same_version(&pkg.version, version) => {}
            other => {
                let detail = match other {
                    Some(pkg) => format!(
                        "apt-get succeeded but {name} is at {} ({})",
                        pkg.version, pkg.status
                    ),
                    None => format!("apt-get succeeded but {name} is not installed"),
                };
                return Err(self.runner.not_applied(&op, detail, transcript));
            }
        }
        // apt-get drops the hold of a package it changes; put it back.
        let was_held = before.as_ref().is_some_and(|p| p.held);
        if was_held && !after.as_ref().is_some_and(|p| p.held) {
            self.hold_command(name, true, events, &mut transcript)?;
        }
        Ok(transcript)
    }

    fn set_held(
        &self,
        name: &str,
        held: bool,
        events: &mut dyn FnMut(&PkgEvent),
    ) -> Result<Transcript, PkgError> {
        validate_name(name)?;
        if self.installed(name)?.is_some_and(|p| p.held == held) {
            return Ok(Vec::new());
        }
        let mut transcript = Vec::new();
        self.hold_command(name, held, events, &mut transcript)?;
        let now = self.installed(name)?;
        if now.as_ref().is_some_and(|p| p.held) != held {
            let verb = if held { "hold" } else { "unhold" };
            let detail = format!("apt-mark {verb} succeeded but dpkg does not show the change");
            return Err(self
                .runner
                .not_applied(&format!("{verb} {name}"), detail, transcript));
        }
        Ok(transcript)
    }

    fn remove(
        &self,
        name: &str,
        events: &mut dyn FnMut(&PkgEvent),
    ) -> Result<Transcript, PkgError> {
        validate_name(name)?;
        if self.installed(name)?.is_none() {
            return Ok(Vec::new());
        }
        let op = format!("remove {name}");
        let mut transcript = Vec::new();
        // dpkg, not apt-get: apt would also remove the packages that depend on it.
        let out = self.runner.change(
            &op,
            &["dpkg", "--remove", name],
            &dpkg_locks(),
            lock_failure,
            events,
            &mut transcript,
        )?;
        if !out.success() {
            return Err(last_failed(&self.runner, &op, &transcript));
        }
        if let Some(pkg) = self.installed(name)? {
            let detail = format!("dpkg --remove succeeded but {name} is {}", pkg.status);
            return Err(self.runner.not_applied(&op, detail, transcript));
        }
        Ok(transcript)
    }

    fn refresh(&self, events: &mut dyn FnMut(&PkgEvent)) -> Result<Transcript, PkgError> {
        let op = "refresh the apt package lists";
        let mut locks = vec![LockSpec::fcntl("apt lists lock", "/var/lib/apt/lists/lock")];
        locks.extend(dpkg_locks());
        let mut transcript = Vec::new();
        let out = self.runner.change(
            op,
            &["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=0"],
            &locks,
            lock_failure,
            events,
            &mut transcript,
        )?;
        if !out.success() {
            return Err(last_failed(&self.runner, op, &transcript));
        }
        Ok(transcript)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn output(code: i32, stdout: &str, stderr: &str) -> CommandOutput {
        CommandOutput {
            code: Some(code),
            timed_out: false,
            stdout: stdout.to_string(),
            stderr: stderr.to_string(),
            elapsed: Duration::ZERO,
        }
    }

    #[test]
    fn dpkg_query_output_is_parsed() {
        let pkg = parse_dpkg_query("kubelet", "kubelet\thold\tinstalled\t1.31.2-1.1\n")
            .unwrap()
            .unwrap();
        assert_eq!(pkg.version, "1.31.2-1.1");
        assert!(pkg.held && pkg.complete);
        let pkg = parse_dpkg_query("kubelet", "kubelet\tinstall\thalf-configured\t1.31.2-1.1\n")
            .unwrap()
            .unwrap();
        assert!(!pkg.held && !pkg.complete);
        assert_eq!(pkg.status, "half-configured");
        assert_eq!(
            parse_dpkg_query("kubelet", "kubelet\tdeinstall\tconfig-files\t1.30.4-1.1\n").unwrap(),
            None
        );
        assert_eq!(
            parse_dpkg_query("kubelet", "kubelet\tunknown\tnot-installed\t\n").unwrap(),
            None
        );
        assert_eq!(parse_dpkg_query("kubelet", "").unwrap(), None);
        // Multiarch: the same version twice is fine, different versions are not.
        let two = "libc6\tinstall\tinstalled\t2.36-9\nlibc6\tinstall\tinstalled\t2.36-9\n";
        assert!(parse_dpkg_query("libc6", two).unwrap().is_some());
        let skew = "libc6\tinstall\tinstalled\t2.36-9\nlibc6\tinstall\tinstalled\t2.36-8\n";
        assert!(parse_dpkg_query("libc6", skew).is_err());
        assert!(parse_dpkg_query("kubelet", "kubelet 1.0\n").is_err());
    }

    #[test]
    fn madison_output_is_parsed() {
        let out = "   kubelet | 1.31.2-1.1 | file:/srv/repo ./ Packages\n\
                   \x20  kubelet | 1.30.4-1.1 | file:/srv/repo ./ Packages\n\
                   \x20  kubelet | 1.30.4-1.1 | https://mirror ./ Packages\n\
                   \x20  kubelet | 1.29.0-1 | https://mirror ./ Sources\n\
                   \x20  kubeadm | 1.31.2-1.1 | file:/srv/repo ./ Packages\n\
                   N: Unable to locate package\n";
        assert_eq!(parse_madison("kubelet", out), ["1.31.2-1.1", "1.30.4-1.1"]);
        assert!(parse_madison("kubectl", out).is_empty());
    }

    #[test]
    fn lock_and_availability_failures_are_recognised() {
        let frontend = output(
            100,
            "",
            "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 6937 (python3)\n\
             E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), is another process using it?\n",
        );
        assert_eq!(lock_failure(&frontend), Some(Some(6937)));
        let dpkg = output(
            2,
            "",
            "dpkg: error: dpkg frontend lock was locked by another process with pid 812\n",
        );
        assert_eq!(lock_failure(&dpkg), Some(Some(812)));
        let admin = output(
            100,
            "",
            "E: Unable to lock the administration directory (/var/lib/dpkg/), is another process using it?\n",
        );
        assert_eq!(lock_failure(&admin), Some(None));
        let missing = output(100, "", "E: Version '9.9' for 'kubelet' was not found\n");
        assert_eq!(lock_failure(&missing), None);
        assert!(not_available(&missing));
        assert!(not_available(&output(
            100,
            "",
            "E: Unable to locate package kubelot\n"
        )));
        assert!(!not_available(&frontend));
    }
}

//! dnf over rpm: `rpm -q` for the database, `dnf repoquery` for what the repositories offer,
//! `dnf install|downgrade name-version` to install an exact version, the versionlock plugin
//! for holds. Written against dnf 4 (RHEL 8/9 and rebuilds); dnf 5 is not tested.

use std::cmp::Ordering;
use std::path::Path;

use super::command::CommandOutput;
use super::locks::LockSpec;
use super::package_manager::{
    InstalledPackage, ManagerKind, PackageManager, PkgError, PkgEvent, PkgOptions, Runner,
    Transcript, last_failed, pid_after, validate_name, validate_version,
};
use inplace_base::pkgversion::{RpmVersion, VersionError, compare_rpm};

/// rpm's transaction lock (both database locations) and dnf's own PID-file locks.
fn rpm_locks() -> Vec<LockSpec> {
    vec![
        LockSpec::fcntl("rpm lock", "/var/lib/rpm/.rpm.lock"),
        LockSpec::fcntl("rpm lock", "/usr/lib/sysimage/rpm/.rpm.lock"),
        LockSpec::pidfile("dnf lock", "/var/lib/dnf/rpmdb_lock.pid"),
        LockSpec::pidfile("dnf lock", "/var/cache/dnf/metadata_lock.pid"),
        LockSpec::pidfile("dnf lock", "/var/cache/dnf/download_lock.pid"),
    ]
}

/// dnf runs with `exit_on_lock` so it fails ("... already locked by 1234") instead of waiting
/// silently; this recognises that failure and rpm's.
fn lock_failure(out: &CommandOutput) -> Option<Option<u32>> {
    let text = format!("{}\n{}", out.stderr, out.stdout);
    if text.contains("already locked by") {
        return Some(pid_after(&text, "already locked by"));
    }
    (text.contains("can't create transaction lock")
        || text.contains("Waiting for process with pid"))
    .then(|| pid_after(&text, "with pid"))
}

/// Whether dnf failed because no repository offers the requested package version.
fn not_available(out: &CommandOutput) -> bool {
    let text = format!("{}\n{}", out.stderr, out.stdout);
    text.contains("Unable to find a match")
        || text.contains("No match for argument")
        || text.contains("No package") && text.contains("available")
}

/// `[epoch:]version-release` with the epoch only when it is not 0.
fn evr(epoch: &str, version: &str, release: &str) -> String {
    if epoch.is_empty() || epoch == "0" || epoch == "(none)" {
        format!("{version}-{release}")
    } else {
        format!("{epoch}:{version}-{release}")
    }
}

/// Parses `rpm -q --qf '%{NAME}\t%|EPOCH?{%{EPOCH}}:{0}|\t%{VERSION}\t%{RELEASE}\t%{ARCH}\n'`.
/// Several lines mean several architectures (multilib); they must agree on the version.
fn parse_rpm_query(name: &str, stdout: &str) -> Result<Option<String>, String> {
    let mut found: Option<String> = None;
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        if line.ends_with(" is not installed") {
            continue;
        }
        let fields: Vec<&str> = line.split('\t').collect();
        let [pkg, epoch, version, release, _arch] = fields[..] else {
            return Err(format!("expected 5 tab-separated fields in {line:?}"));
        };
        if pkg != name {
            continue;
        }
        let this = evr(epoch, version, release);
        match &found {
            Some(prev) if *prev != this => {
                return Err(format!(
                    "{name} is installed at several versions ({prev} and {this})"
                ));
            }
            _ => found = Some(this),
        }
    }
    Ok(found)
}

/// Parses `dnf repoquery --qf '%{name}\t%{epoch}\t%{version}\t%{release}\t%{arch}'` into the
/// versions of `name`, without duplicates.
fn parse_repoquery(name: &str, stdout: &str) -> Vec<String> {
    let mut versions: Vec<String> = Vec::new();
    for line in stdout.lines() {
        let fields: Vec<&str> = line.trim().split('\t').collect();
        let [pkg, epoch, version, release, _arch] = fields[..] else {
            continue;
        };
        if pkg != name {
            continue;
        }
        let v = evr(epoch, version, release);
        if !versions.contains(&v) {
            versions.push(v);
        }
    }
    versions
}

/// The package names locked by `dnf versionlock list` output (`kubelet-0:1.30.4-1.1.*`).
/// Exclusions (`!name-...`) are not holds.
fn parse_versionlock_list(stdout: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in stdout.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
            continue;
        }
        if line.starts_with("Last metadata expiration check") {
            continue;
        }
        // name-[epoch:]version-release.arch-or-*: the name is all but the last two dashes.
        let mut parts = line.rsplitn(3, '-');
        let (Some(_release), Some(_version), Some(name)) =
            (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        names.push(name.to_string());
    }
    names
}

fn satisfies(have: &str, want: &str) -> bool {
    match (RpmVersion::parse(have), RpmVersion::parse(want)) {
        (Ok(have), Ok(want)) => have.satisfies(&want),
        _ => false,
    }
}

/// dnf and rpm in a root.
#[derive(Debug, Clone)]
pub struct Dnf {
    runner: Runner,
}

impl Dnf {
    /// dnf for the node at `root`.
    pub fn new(root: &Path, options: PkgOptions) -> Dnf {
        Dnf {
            runner: Runner::new(root, options, &[]),
        }
    }

    fn installed_version(&self, name: &str) -> Result<Option<String>, PkgError> {
        let op = format!("query {name}");
        let record = self.runner.query(
            &op,
            &[
                "rpm",
                "-q",
                "--qf",
                "%{NAME}\\t%|EPOCH?{%{EPOCH}}:{0}|\\t%{VERSION}\\t%{RELEASE}\\t%{ARCH}\\n",
                name,
            ],
        )?;
        let out = &record.output;
        if !out.success() {
            if out.code == Some(1) && out.stdout.contains("is not installed") {
                return Ok(None);
            }
            return Err(self.runner.failed(&op, record));
        }
        parse_rpm_query(name, &out.stdout).map_err(|detail| self.runner.unexpected(&op, detail))
    }

    fn locked_names(&self) -> Result<Vec<String>, PkgError> {
        let op = "list version locks";
        let record = self
            .runner
            .query(op, &["dnf", "-q", "-C", "versionlock", "list"])?;
        if !record.output.success() {
            if is_missing_versionlock(&record.output) {
                // Without the plugin nothing can be held.
                return Ok(Vec::new());
            }
            return Err(self.runner.failed(op, record));
        }
        Ok(parse_versionlock_list(&record.output.stdout))
    }

    fn versionlock(
        &self,
        name: &str,
        verb: &str,
        events: &mut dyn FnMut(&PkgEvent),
        transcript: &mut Transcript,
    ) -> Result<(), PkgError> {
        let op = format!("versionlock {verb} {name}");
        let out = self.runner.change(
            &op,
            &[
                "dnf",
                "-y",
                "--setopt=exit_on_lock=True",
                "versionlock",
                verb,
                name,
            ],
            &rpm_locks(),
            lock_failure,
            events,
            transcript,
        )?;
        if !out.success() {
            if is_missing_versionlock(&out) {
                return Err(PkgError::Unsupported {
                    op,
                    root: self.runner.root.clone(),
                    detail: "the dnf versionlock plugin is not installed \
                             (python3-dnf-plugin-versionlock)"
                        .to_string(),
                });
            }
            return Err(last_failed(&self.runner, &op, transcript));
        }
        Ok(())
    }
}

fn is_missing_versionlock(out: &CommandOutput) -> bool {
    out.stderr.contains("No such command: versionlock")
}

impl PackageManager for Dnf {
    fn kind(&self) -> ManagerKind {
        ManagerKind::Dnf
    }

    fn root(&self) -> &Path {
        &self.runner.root
    }

    fn installed(&self, name: &str) -> Result<Option<InstalledPackage>, PkgError> {
        validate_name(name)?;
        let Some(version) = self.installed_version(name)? else {
            return Ok(None);
        };
        let held = self.locked_names()?.iter().any(|n| n == name);
        Ok(Some(InstalledPackage {
            name: name.to_string(),
            version,
            held,
            status: "installed".to_string(),
            complete: true,
        }))
    }

    fn available_versions(&self, name: &str) -> Result<Vec<String>, PkgError> {
        validate_name(name)?;
        let op = format!("list versions of {name}");
        let record = self.runner.query(
            &op,
            &[
                "dnf",
                "-q",
                "repoquery",
                "--available",
                "--showduplicates",
                "--qf",
                "%{name}\\t%{epoch}\\t%{version}\\t%{release}\\t%{arch}",
                name,
            ],
        )?;
        if !record.output.success() {
            return Err(self.runner.failed(&op, record));
        }
        Ok(parse_repoquery(name, &record.output.stdout))
    }

    fn version_satisfies(&self, have: &str, want: &str) -> bool {
        satisfies(have, want)
    }

    fn compare_versions(&self, a: &str, b: &str) -> Result<Ordering, VersionError> {
        compare_rpm(a, b)
    }

    fn install(
        &self,
        name: &str,
        version: &str,
        events: &mut dyn FnMut(&PkgEvent),
    ) -> Result<Transcript, PkgError> {
        validate_name(name)?;
        validate_version(ManagerKind::Dnf, version)?;
        let op = format!("install {name}-{version}");
        let before = self.installed(name)?;
        if let Some(pkg) = &before
            && satisfies(&pkg.version, version)
        {
            return Ok(Vec::new());
        }
        let downgrade = before.as_ref().is_some_and(|pkg| {
            compare_rpm(version, &pkg.version).is_ok_and(|o| o == Ordering::Less)
        });
        let verb = if downgrade { "downgrade" } else { "install" };
        let spec = format!("{name}-{version}");
        let mut transcript = Vec::new();
        // The version lock would hide the version we want; it is moved afterwards.
        let out = self.runner.change(
            &op,
            &[
                "dnf",
                "-y",
                "--setopt=exit_on_lock=True",
                "--disableplugin=versionlock",
                verb,
                &spec,
            ],
            &rpm_locks(),
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
        match self.installed_version(name)? {
            Some(have) if satisfies(&have, version) => {}
            other => {
                let detail = match other {
                    Some(have) => format!("dnf {verb} succeeded but {name} is at {have}"),
                    None => format!("dnf {verb} succeeded but {name} is not installed"),
                };
                return Err(self.runner.not_applied(&op, detail, transcript));
            }
        }
        if before.is_some_and(|p| p.held) {
            // Move the lock to the version now installed.
            self.versionlock(name, "delete", events, &mut transcript)?;
            self.versionlock(name, "add", events, &mut transcript)?;
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
        let is_held = self.locked_names()?.iter().any(|n| n == name);
        if is_held == held {
            return Ok(Vec::new());
        }
        let mut transcript = Vec::new();
        let verb = if held { "add" } else { "delete" };
        self.versionlock(name, verb, events, &mut transcript)?;
        if self.locked_names()?.iter().any(|n| n == name) != held {
            let detail = format!("dnf versionlock {verb} succeeded but the lock list disagrees");
            return Err(self.runner.not_applied(
                &format!("versionlock {verb} {name}"),
                detail,
                transcript,
            ));
        }
        Ok(transcript)
    }

    fn remove(
        &self,
        name: &str,
        events: &mut dyn FnMut(&PkgEvent),
    ) -> Result<Transcript, PkgError> {
        validate_name(name)?;
        if self.installed_version(name)?.is_none() {
            return Ok(Vec::new());
        }
        let op = format!("remove {name}");
        let mut transcript = Vec::new();
        // rpm, not dnf: dnf would also remove the packages that depend on it.
        let out = self.runner.change(
            &op,
            &["rpm", "-e", name],
            &rpm_locks(),
            lock_failure,
            events,
            &mut transcript,
        )?;
        if !out.success() {
            return Err(last_failed(&self.runner, &op, &transcript));
        }
        if let Some(have) = self.installed_version(name)? {
            let detail = format!("rpm -e succeeded but {name} {have} is still installed");
            return Err(self.runner.not_applied(&op, detail, transcript));
        }
        Ok(transcript)
    }

    fn refresh(&self, events: &mut dyn FnMut(&PkgEvent)) -> Result<Transcript, PkgError> {
        let op = "refresh the dnf metadata";
        let mut transcript = Vec::new();
        let out = self.runner.change(
            op,
            &["dnf", "-y", "--setopt=exit_on_lock=True", "makecache"],
            &rpm_locks(),
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
    fn rpm_query_output_is_parsed() {
        assert_eq!(
            parse_rpm_query("kubelet", "kubelet\t0\t1.31.2\t150500.1.1\tx86_64\n").unwrap(),
            Some("1.31.2-150500.1.1".to_string())
        );
        assert_eq!(
            parse_rpm_query("docker-ce", "docker-ce\t3\t24.0.7\t1.el9\tx86_64\n").unwrap(),
            Some("3:24.0.7-1.el9".to_string())
        );
        assert_eq!(
            parse_rpm_query("kubelet", "package kubelet is not installed\n").unwrap(),
            None
        );
        let multilib = "glibc\t0\t2.34\t100.el9\tx86_64\nglibc\t0\t2.34\t100.el9\ti686\n";
        assert_eq!(
            parse_rpm_query("glibc", multilib).unwrap(),
            Some("2.34-100.el9".to_string())
        );
        let skew = "glibc\t0\t2.34\t100.el9\tx86_64\nglibc\t0\t2.34\t99.el9\ti686\n";
        assert!(parse_rpm_query("glibc", skew).is_err());
        assert!(parse_rpm_query("kubelet", "kubelet-1.31.2\n").is_err());
    }

    #[test]
    fn repoquery_output_is_parsed() {
        let out = "kubelet\t0\t1.30.4\t150500.1.1\tx86_64\n\
                   kubelet\t0\t1.31.2\t150500.1.1\tx86_64\n\
                   kubelet\t0\t1.31.2\t150500.1.1\taarch64\n\
                   kubelet\t1\t1.31.3\t1\tx86_64\n\
                   kubeadm\t0\t1.31.2\t150500.1.1\tx86_64\n";
        assert_eq!(
            parse_repoquery("kubelet", out),
            ["1.30.4-150500.1.1", "1.31.2-150500.1.1", "1:1.31.3-1"]
        );
        assert!(parse_repoquery("kubectl", out).is_empty());
    }

    #[test]
    fn versionlock_list_is_parsed() {
        let out = "Last metadata expiration check: 0:00:08 ago on Mon Nov 30 14:45:58 2026.\n\
                   # Added lock on Mon Nov 30 14:46:06 2026\n\
                   kubelet-0:1.30.4-150500.1.1.*\n\
                   container-selinux-2:2.221.0-1.el9.noarch\n\
                   !kubectl-0:1.29.0-1.*\n";
        assert_eq!(
            parse_versionlock_list(out),
            ["kubelet", "container-selinux"]
        );
    }

    #[test]
    fn requests_without_a_release_accept_any_release() {
        assert!(satisfies("1.31.2-150500.1.1", "1.31.2"));
        assert!(satisfies("1.31.2-150500.1.1", "0:1.31.2-150500.1.1"));
        assert!(!satisfies("1.31.2-150500.1.1", "1.31.2-150500.1.2"));
        assert!(!satisfies("1.31.2-150500.1.1", "1.30.4"));
    }

    #[test]
    fn lock_and_availability_failures_are_recognised() {
        assert_eq!(
            lock_failure(&output(1, "", "Error: RPMDB already locked by 4242\n")),
            Some(Some(4242))
        );
        assert_eq!(
            lock_failure(&output(
                1,
                "",
                "error: can't create transaction lock on /var/lib/rpm/.rpm.lock (Resource temporarily unavailable)\n"
            )),
            Some(None)
        );
        let missing = output(
            1,
            "",
            "All matches were filtered out by exclude filtering for argument: kubelet-1.31.2\n\
             Error: Unable to find a match: kubelet-1.31.2\n",
        );
        assert_eq!(lock_failure(&missing), None);
        assert!(not_available(&missing));
        assert!(not_available(&output(
            1,
            "No match for argument: kubelet-9\n",
            ""
        )));
        assert!(!not_available(&output(
            1,
            "",
            "Error: Transaction test error\n"
        )));
    }
}

//! Real dnf and rpm (Debian's packages of them) against a local repository of stand-in
//! Kubernetes rpms, inside a disposable overlay root set up like an rpm node: rpm database in
//! /var/lib/rpm, a file repository, versionlock plugin. Needs root.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use crate::support::overlay::{self, LockHolder, Overlay, sh};
use crate::support::require_root;
use inplace_agent::host::dnf::Dnf;
use inplace_agent::host::packages::{
    self, LockWait, ManagerKind, PackageManager, PkgEvent, PkgOptions,
};

const OLD: &str = "1.30.4-150500.1.1";
const NEW: &str = "1.31.2-150500.1.1";

#[test]
#[ignore = "helper process for the lock test, started by it"]
fn lock_holder_process() {
    overlay::lock_holder_main();
}

const SPEC: &str = r#"Name: %{pkgname}
Version: %{pkgver}
Release: %{pkgrel}
Summary: stand-in for the inplace-agent tests
License: Apache-2.0
BuildArch: noarch
AutoReqProv: no
%description
stand-in for the inplace-agent tests
%install
mkdir -p %{buildroot}/usr/bin
printf '#!/bin/sh\necho "Kubernetes v%s"\n' %{pkgver} > %{buildroot}/usr/bin/%{pkgname}
chmod 755 %{buildroot}/usr/bin/%{pkgname}
%files
/usr/bin/%{pkgname}
"#;

fn setup(test: &str) -> Option<(Overlay, Dnf)> {
    if !require_root(test, "mounts an overlay root") {
        return None;
    }
    let overlay = Overlay::new();
    let top = overlay.path("/tmp/rpmbuild");
    let spec = overlay.path("/tmp/stand-in.spec");
    std::fs::create_dir_all(&top).unwrap();
    std::fs::write(&spec, SPEC).unwrap();
    for evr in [OLD, NEW] {
        let (version, release) = evr.split_once('-').unwrap();
        for name in ["kubeadm", "kubelet"] {
            sh(&[
                "rpmbuild",
                "-bb",
                "--quiet",
                "--define",
                &format!("_topdir {}", top.display()),
                "--define",
                &format!("pkgname {name}"),
                "--define",
                &format!("pkgver {version}"),
                "--define",
                &format!("pkgrel {release}"),
                spec.to_str().unwrap(),
            ]);
        }
    }
    let repo = overlay.path("/srv/rpmrepo");
    std::fs::create_dir_all(&repo).unwrap();
    for entry in std::fs::read_dir(top.join("RPMS/noarch")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), repo.join(entry.file_name())).unwrap();
    }
    sh(&["createrepo_c", "--quiet", repo.to_str().unwrap()]);

    // Make the overlay look like an rpm node: the database where rpm distributions keep it
    // (Debian's rpm defaults to ~/.rpmdb), our repository only, a release version (dnf
    // cannot detect one on Debian), and without Debian's "local" dnf plugin.
    overlay.write("/etc/rpm/macros", "%_dbpath /var/lib/rpm\n");
    overlay.chroot(&["rpm", "--initdb"]);
    let _ = std::fs::remove_dir_all(overlay.path("/etc/yum.repos.d"));
    overlay.write(
        "/etc/yum.repos.d/local.repo",
        "[local]\nname=local\nbaseurl=file:///srv/rpmrepo\ngpgcheck=0\nenabled=1\n",
    );
    overlay.write("/etc/dnf/vars/releasever", "12\n");
    overlay.write("/etc/dnf/plugins/local.conf", "[main]\nenabled = 0\n");
    let dnf = Dnf::new(
        overlay.root(),
        PkgOptions {
            query_timeout: Duration::from_secs(60),
            change_timeout: Duration::from_secs(300),
            lock_wait: LockWait {
                first_delay: Duration::from_millis(100),
                max_delay: Duration::from_millis(400),
                give_up_after: Duration::from_secs(60),
            },
            max_output: 16 * 1024,
        },
    );
    dnf.refresh(&mut |_| {}).expect("dnf makecache");
    Some((overlay, dnf))
}

fn version_of(overlay: &Overlay, name: &str) -> String {
    overlay.chroot(&[name]).trim().to_string()
}

fn locks(overlay: &Overlay) -> String {
    overlay.chroot(&["dnf", "-q", "-C", "versionlock", "list"])
}

#[test]
fn dnf_install_hold_upgrade_and_downgrade() {
    let Some((overlay, dnf)) = setup("dnf_install_hold_upgrade_and_downgrade") else {
        return;
    };
    assert_eq!(dnf.installed("kubelet").unwrap(), None);
    assert_eq!(dnf.available_versions("kubelet").unwrap(), [OLD, NEW]);
    assert!(dnf.is_available("kubelet", NEW).unwrap());
    assert!(
        dnf.is_available("kubelet", "1.31.2").unwrap(),
        "any release"
    );
    assert!(!dnf.is_available("kubelet", "1.29.0-150500.1.1").unwrap());

    let transcript = dnf.install("kubelet", OLD, &mut |_| {}).unwrap();
    assert!(
        transcript[0]
            .command
            .contains("install kubelet-1.30.4-150500.1.1")
    );
    assert_eq!(version_of(&overlay, "kubelet"), "Kubernetes v1.30.4");
    let kubelet = dnf.installed("kubelet").unwrap().unwrap();
    assert_eq!((kubelet.version.as_str(), kubelet.held), (OLD, false));
    assert!(dnf.install("kubelet", OLD, &mut |_| {}).unwrap().is_empty());

    dnf.set_held("kubelet", true, &mut |_| {}).unwrap();
    assert!(dnf.installed("kubelet").unwrap().unwrap().held);
    assert!(locks(&overlay).contains("kubelet-0:1.30.4-150500.1.1"));

    // Upgrading the held package moves the lock with it.
    let transcript = dnf.install("kubelet", NEW, &mut |_| {}).unwrap();
    assert_eq!(transcript.len(), 3, "install, unlock, lock: {transcript:?}");
    assert_eq!(version_of(&overlay, "kubelet"), "Kubernetes v1.31.2");
    let kubelet = dnf.installed("kubelet").unwrap().unwrap();
    assert_eq!((kubelet.version.as_str(), kubelet.held), (NEW, true));
    let list = locks(&overlay);
    assert!(
        list.contains("kubelet-0:1.31.2-150500.1.1") && !list.contains("1.30.4"),
        "{list}"
    );

    // Downgrade (rollback).
    let transcript = dnf.install("kubelet", OLD, &mut |_| {}).unwrap();
    assert!(
        transcript[0]
            .command
            .contains(" downgrade kubelet-1.30.4-150500.1.1")
    );
    assert_eq!(version_of(&overlay, "kubelet"), "Kubernetes v1.30.4");

    dnf.set_held("kubelet", false, &mut |_| {}).unwrap();
    assert!(!dnf.installed("kubelet").unwrap().unwrap().held);

    // A version no repository has.
    let err = dnf
        .install("kubeadm", "1.29.0-150500.1.1", &mut |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), "version_not_available", "{err}");
    assert!(
        err.to_string().starts_with(&format!(
            "install kubeadm-1.29.0-150500.1.1 in {}: exit status 1: ",
            overlay.root().display()
        )),
        "{err}"
    );

    // This overlay is still a Debian system underneath: detection says apt, and the explicit
    // choice is how such a node is driven with dnf.
    assert_eq!(packages::detect(overlay.root()).unwrap(), ManagerKind::Apt);
    let pm = packages::open(overlay.root(), Some(ManagerKind::Dnf), Default::default()).unwrap();
    assert_eq!(pm.installed("kubelet").unwrap().unwrap().version, OLD);
    assert!(
        !Path::new("/usr/bin/kubelet").exists(),
        "the machine itself is untouched"
    );
}

#[test]
fn dnf_waits_for_the_rpm_lock() {
    let Some((overlay, dnf)) = setup("dnf_waits_for_the_rpm_lock") else {
        return;
    };
    let holder = LockHolder::start(module_path!(), &overlay.path("/var/lib/rpm/.rpm.lock"));
    let pid = holder.pid();
    let (tx, rx) = mpsc::channel::<PkgEvent>();
    let worker = std::thread::spawn(move || {
        let result = dnf.install("kubeadm", NEW, &mut |e| {
            let _ = tx.send(e.clone());
        });
        (result, dnf)
    });
    let first = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert!(
        first.to_string().starts_with(&format!(
            "waiting for the rpm lock (/var/lib/rpm/.rpm.lock), held by PID {pid} ("
        )),
        "{first}"
    );
    holder.release();
    let (result, dnf) = worker.join().unwrap();
    result.unwrap();
    assert_eq!(dnf.installed("kubeadm").unwrap().unwrap().version, NEW);
    assert_eq!(version_of(&overlay, "kubeadm"), "Kubernetes v1.31.2");
}

/// `inplace-agent apply -o json` on the overlay; exit code and status.
fn apply_plan(
    overlay: &Overlay,
    id: &str,
    changes: &str,
    verify: &str,
) -> (i32, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.yaml");
    std::fs::write(
        &path,
        format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n{changes}{verify}"),
    )
    .unwrap();
    let out = std::process::Command::new(crate::support::bin())
        .args(["apply", "--no-progress", "-o", "json", "--root"])
        .arg(overlay.root())
        .arg(&path)
        .env("INPLACE_AGENT_SERVICES", "off")
        .output()
        .unwrap();
    let status = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code().unwrap_or(-1), status)
}

#[test]
fn dnf_packages_through_plans() {
    let Some((overlay, dnf)) = setup("dnf_packages_through_plans") else {
        return;
    };
    let changes = |v: &str| {
        ["kubeadm", "kubelet"]
            .map(|n| {
                format!("  - package: {{name: {n}, version: {v}, hold: true, manager: dnf}}\n")
            })
            .concat()
    };
    let (code, status) = apply_plan(&overlay, "d/1", &changes(OLD), "");
    assert_eq!(code, 0, "{status:#}");
    let kubelet = dnf.installed("kubelet").unwrap().unwrap();
    assert_eq!((kubelet.version.as_str(), kubelet.held), (OLD, true));

    // The upgrade with a gate that fails: rolled back with dnf downgrade, locks put back.
    let gate = "verify:\n  - command: {argv: [\"false\"], timeoutSeconds: 1}\n";
    let (code, status) = apply_plan(&overlay, "d/2", &changes(NEW), gate);
    assert_eq!(code, 1);
    assert_eq!(status["phase"], "RolledBack", "{status:#}");
    for name in ["kubeadm", "kubelet"] {
        let p = dnf.installed(name).unwrap().unwrap();
        assert_eq!((p.version.as_str(), p.held), (OLD, true), "{name}");
    }
    assert!(locks(&overlay).contains("kubelet-0:1.30.4-150500.1.1"));

    // The upgrade: both move, the locks with them.
    let (code, status) = apply_plan(&overlay, "d/3", &changes(NEW), "");
    assert_eq!(code, 0, "{status:#}");
    assert_eq!(
        status["changes"][1]["message"],
        "install kubelet 1.31.2-150500.1.1 (was 1.30.4-150500.1.1), hold"
    );
    assert_eq!(version_of(&overlay, "kubelet"), "Kubernetes v1.31.2");
    let list = locks(&overlay);
    assert!(
        list.contains("kubelet-0:1.31.2-150500.1.1") && !list.contains("1.30.4"),
        "{list}"
    );

    // Again, under another id and with the version written without its release (rpm's
    // rules: it matches any release): nothing to do.
    let (code, status) = apply_plan(&overlay, "d/4", &changes("1.31.2"), "");
    assert_eq!(code, 0, "{status:#}");
    for c in status["changes"].as_array().unwrap() {
        assert_eq!(c["state"], "Unchanged", "{c:#}");
    }
}

//! Real apt and dpkg against a local file repository of stand-in Kubernetes packages, inside a
//! disposable overlay root (the machine's own dpkg state is never touched). Needs root.

use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::support::overlay::{self, LockHolder, Overlay};
use crate::support::require_root;
use inplace_agent::host::apt::Apt;
use inplace_agent::host::packages::{
    self, LockWait, ManagerKind, PackageManager, PkgEvent, PkgOptions,
};

const OLD: &str = "1.30.4-1.1";
const NEW: &str = "1.31.2-1.1";
const NAMES: [&str; 3] = ["kubeadm", "kubelet", "kubectl"];

#[test]
#[ignore = "helper process for the lock test, started by it"]
fn lock_holder_process() {
    overlay::lock_holder_main();
}

/// Stand-in `kubeadm`, `kubelet` and `kubectl` packages at two versions (each installs
/// `/usr/bin/<name>` printing `Kubernetes v<version>`) in the overlay's only apt source.
fn with_repo(overlay: &Overlay) {
    let debs: Vec<overlay::Deb> = [OLD, NEW]
        .iter()
        .flat_map(|v| NAMES.map(|n| overlay::Deb::printing_version(n, v)))
        .collect();
    overlay::apt_repo(overlay, &debs);
    let index = std::fs::read_to_string(overlay.path("/srv/repo/Packages")).unwrap();
    assert!(index.contains("Package: kubelet"), "{index}");
}

fn options() -> PkgOptions {
    PkgOptions {
        query_timeout: Duration::from_secs(60),
        change_timeout: Duration::from_secs(300),
        lock_wait: LockWait {
            first_delay: Duration::from_millis(100),
            max_delay: Duration::from_millis(400),
            give_up_after: Duration::from_secs(60),
        },
        max_output: 16 * 1024,
    }
}

fn setup(test: &str) -> Option<(Overlay, Apt)> {
    if !require_root(test, "mounts an overlay root") {
        return None;
    }
    let overlay = Overlay::new();
    with_repo(&overlay);
    let apt = Apt::new(overlay.root(), options());
    apt.refresh(&mut |_| {}).expect("apt-get update");
    Some((overlay, apt))
}

fn version_of(overlay: &Overlay, name: &str) -> String {
    overlay.chroot(&[name]).trim().to_string()
}

#[test]
fn install_upgrade_hold_and_downgrade() {
    let Some((overlay, apt)) = setup("install_upgrade_hold_and_downgrade") else {
        return;
    };
    let started = Instant::now();
    assert_eq!(
        packages::detect(overlay.root()).unwrap(),
        ManagerKind::Apt,
        "an overlay of this Debian machine is an apt node"
    );
    assert_eq!(
        apt.installed("kubelet").unwrap(),
        None,
        "not installed is not an error"
    );
    assert_eq!(apt.available_versions("kubelet").unwrap(), [NEW, OLD]);
    assert!(apt.is_available("kubelet", OLD).unwrap());
    assert!(
        apt.is_available("kubelet", "0:1.31.2-1.1").unwrap(),
        "dpkg equality"
    );

    // Install the old version of all three.
    let mut events = Vec::new();
    for name in NAMES {
        let transcript = apt
            .install(name, OLD, &mut |e| events.push(e.clone()))
            .unwrap();
        assert_eq!(transcript.len(), 1);
        assert!(transcript[0].command.starts_with("apt-get install"));
        assert!(transcript[0].output.success());
    }
    assert!(
        matches!(&events[0], PkgEvent::Running { command } if command.contains("kubeadm=1.30.4-1.1"))
    );
    assert_eq!(version_of(&overlay, "kubelet"), "Kubernetes v1.30.4");
    assert!(overlay.path("/usr/bin/kubelet").is_file());
    let kubelet = apt.installed("kubelet").unwrap().unwrap();
    assert_eq!(kubelet.version, OLD);
    assert!(kubelet.complete && !kubelet.held);

    // Installing the installed version again runs nothing.
    assert!(apt.install("kubelet", OLD, &mut |_| {}).unwrap().is_empty());

    // Hold, and the hold is reported.
    let transcript = apt.set_held("kubelet", true, &mut |_| {}).unwrap();
    assert_eq!(transcript[0].command, "apt-mark hold kubelet");
    assert!(apt.installed("kubelet").unwrap().unwrap().held);
    assert!(
        apt.set_held("kubelet", true, &mut |_| {})
            .unwrap()
            .is_empty()
    );
    let selections = overlay.chroot(&["apt-mark", "showhold"]);
    assert_eq!(selections.trim(), "kubelet");

    // Upgrade the held package: it moves, and stays held.
    let transcript = apt.install("kubelet", NEW, &mut |_| {}).unwrap();
    assert_eq!(
        transcript.len(),
        2,
        "install, then hold again: {transcript:?}"
    );
    assert_eq!(version_of(&overlay, "kubelet"), "Kubernetes v1.31.2");
    let kubelet = apt.installed("kubelet").unwrap().unwrap();
    assert_eq!((kubelet.version.as_str(), kubelet.held), (NEW, true));

    // Upgrade an unheld one.
    apt.install("kubeadm", NEW, &mut |_| {}).unwrap();
    assert_eq!(version_of(&overlay, "kubeadm"), "Kubernetes v1.31.2");

    // Downgrade (rollback) the held kubelet.
    apt.install("kubelet", OLD, &mut |_| {}).unwrap();
    assert_eq!(version_of(&overlay, "kubelet"), "Kubernetes v1.30.4");
    assert!(apt.installed("kubelet").unwrap().unwrap().held);

    // Release the hold.
    apt.set_held("kubelet", false, &mut |_| {}).unwrap();
    assert!(!apt.installed("kubelet").unwrap().unwrap().held);
    assert_eq!(overlay.chroot(&["apt-mark", "showhold"]).trim(), "");

    // Through the generic entry point, detected.
    let pm = packages::open(overlay.root(), None, options()).unwrap();
    assert_eq!(pm.kind(), ManagerKind::Apt);
    assert_eq!(pm.installed("kubeadm").unwrap().unwrap().version, NEW);

    // The machine itself was not touched.
    assert!(!Path::new("/usr/bin/kubelet").exists());
    let real = std::process::Command::new("dpkg-query")
        .args(["-W", "kubelet"])
        .output()
        .unwrap();
    assert!(
        !real.status.success(),
        "kubelet must not be in the real dpkg database"
    );
    eprintln!(
        "install_upgrade_hold_and_downgrade took {:?}",
        started.elapsed()
    );
}

#[test]
fn unavailable_versions_are_reported_plainly() {
    let Some((overlay, apt)) = setup("unavailable_versions_are_reported_plainly") else {
        return;
    };
    assert!(!apt.is_available("kubelet", "1.29.0-1.1").unwrap());
    assert!(
        apt.available_versions("no-such-package")
            .unwrap()
            .is_empty()
    );
    assert!(!apt.is_available("no-such-package", "1.0").unwrap());

    let err = apt
        .install("kubelet", "1.29.0-1.1", &mut |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), "version_not_available", "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "install kubelet=1.29.0-1.1 in {}: exit status 100: E: Version '1.29.0-1.1' for 'kubelet' was not found",
            overlay.root().display()
        )
    );
    assert!(
        err.record()
            .unwrap()
            .output
            .stderr
            .contains("was not found")
    );

    let err = apt
        .install("no-such-package", "1.0", &mut |_| {})
        .unwrap_err();
    assert_eq!(err.kind(), "version_not_available", "{err}");

    // Bad input never reaches apt.
    let err = apt.install("kubelet", "1.31.*", &mut |_| {}).unwrap_err();
    assert_eq!(err.kind(), "invalid_argument");
    let err = apt.install("-oAPT::x=1", "1.0", &mut |_| {}).unwrap_err();
    assert_eq!(err.kind(), "invalid_argument");
    assert_eq!(apt.installed("kubelet").unwrap(), None);
}

#[test]
fn waits_for_a_held_dpkg_lock_and_says_who_holds_it() {
    let Some((overlay, apt)) = setup("waits_for_a_held_dpkg_lock_and_says_who_holds_it") else {
        return;
    };
    let holder = LockHolder::start(module_path!(), &overlay.path("/var/lib/dpkg/lock-frontend"));
    let holder_pid = holder.pid();

    let (tx, rx) = mpsc::channel::<PkgEvent>();
    let started = Instant::now();
    let worker = std::thread::spawn(move || {
        let result = apt.install("kubelet", NEW, &mut |e| {
            let _ = tx.send(e.clone());
        });
        (result, apt)
    });

    // The first thing we hear is that the dpkg lock is held, by whom.
    let first = rx.recv_timeout(Duration::from_secs(30)).expect("an event");
    let PkgEvent::WaitingForLock {
        label,
        path,
        holder: who,
        ..
    } = &first
    else {
        panic!("expected a lock wait first, got {first:?}");
    };
    assert_eq!(*label, "dpkg lock");
    assert_eq!(path, Path::new("/var/lib/dpkg/lock-frontend"));
    assert_eq!(who.as_ref().and_then(|h| h.pid), Some(holder_pid));
    let message = first.to_string();
    assert!(
        message.starts_with(&format!(
            "waiting for the dpkg lock (/var/lib/dpkg/lock-frontend), held by PID {holder_pid} ("
        )),
        "{message}"
    );
    // It keeps waiting while the lock is held.
    let second = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("another event");
    assert!(
        matches!(second, PkgEvent::WaitingForLock { .. }),
        "{second:?}"
    );
    assert!(!overlay.path("/usr/bin/kubelet").exists());

    holder.release();
    let (result, apt) = worker.join().unwrap();
    let transcript = result.expect("install after the lock is released");
    assert_eq!(
        transcript.len(),
        1,
        "the probe kept apt from failing: {transcript:?}"
    );
    let events: Vec<PkgEvent> = rx.try_iter().collect();
    assert!(
        events.iter().any(|e| matches!(e, PkgEvent::Running { .. })),
        "{events:?}"
    );
    assert_eq!(version_of(&overlay, "kubelet"), "Kubernetes v1.31.2");
    assert_eq!(apt.installed("kubelet").unwrap().unwrap().version, NEW);
    eprintln!("lock wait test took {:?}", started.elapsed());
}

#[test]
fn gives_up_on_a_lock_that_stays_held() {
    let Some((overlay, _)) = setup("gives_up_on_a_lock_that_stays_held") else {
        return;
    };
    let mut opts = options();
    opts.lock_wait.give_up_after = Duration::from_millis(700);
    let apt = Apt::new(overlay.root(), opts);
    // (The machine under the overlay may have a kubectl of its own.)
    let before = apt.installed("kubectl").unwrap();
    let holder = LockHolder::start(module_path!(), &overlay.path("/var/lib/dpkg/lock"));
    let err = apt.install("kubectl", NEW, &mut |_| {}).unwrap_err();
    assert_eq!(err.kind(), "lock_timeout", "{err}");
    let text = err.to_string();
    assert!(
        text.contains("for the dpkg lock (/var/lib/dpkg/lock), held by PID")
            && text.contains(&holder.pid().to_string()),
        "{text}"
    );
    holder.release();
    assert_eq!(apt.installed("kubectl").unwrap(), before, "nothing changed");
}

//! `inplace-agent demo --systemd` end to end: the real-systemd tour and the Kubernetes version
//! bump from stand-in packages, as a user runs it. Needs root; otherwise it prints a SKIP line
//! (and fails when CI=true).

use std::process::Command;

#[test]
fn the_systemd_demo_goes_as_described() {
    if !crate::support::require_root(
        "the_systemd_demo_goes_as_described",
        "demo --systemd boots this machine's systemd in namespaces",
    ) {
        return;
    }
    let out = Command::new(crate::support::bin())
        .args(["demo", "--systemd", "--plain"])
        .env_remove("INPLACE_AGENT_SERVICES")
        .env_remove("INPLACE_AGENT_ROOT")
        .env_remove("INPLACE_AGENT_STATE_DIR")
        .output()
        .expect("run the demo");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("Everything went as described."), "{text}");
    assert!(
        !text.contains("skipped: a real-systemd sandbox") && !text.contains("skipped: the demo"),
        "{text}"
    );
    // The version bump: the upgrade plan as it is in the repository, one restart at 1.31.2.
    for line in [
        "== 9. apply it: kubeadm, kubeadm upgrade node, kubelet, kubectl",
        "packages now: kubeadm 1.31.2-1.1 (held), kubelet 1.31.2-1.1 (held), kubectl 1.31.2-1.1 (held)",
        "the stand-in kubeadm logged: kubeadm v1.31.2 upgrade node (kubelet v1.30.4)",
        "1 new start(s) of the stand-in:",
        "[7/7] verify[2] kubeletVersion v1.31.2: passed: /usr/bin/kubelet reports v1.31.2",
        "succeeded in",
        "0 changed, 4 unchanged, 3/3 gates passed",
        "daemonReloaded",
    ] {
        assert!(text.contains(line), "{line:?} not in:\n{text}");
    }
}

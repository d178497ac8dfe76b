//! One meaning of the node's root: the node's own programs a plan runs act on the node at
//! `--root` whether or not the agent chroots into it (docs/configuration.md, `chroot`).
//! Without chroot (`--no-chroot`, sandbox trees) `kubeadm upgrade node` is the tree's own
//! kubeadm, started in the tree and told its root, never a kubeadm on the agent's `PATH`;
//! and package managers, which reach a root only by chroot, are not used at all.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::support::{Node, text};

fn script(path: &Path, body: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, format!("#!/bin/sh\n{body}")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn plan(node: &Node, id: &str, changes: &str) -> std::path::PathBuf {
    node.plan_file(
        &format!("{id}.yaml"),
        &format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n{changes}"),
    )
}

/// `PATH` with a directory holding a decoy `kubeadm` first: it records that it ran.
fn decoy_path(node: &Node) -> (String, std::path::PathBuf) {
    let dir = node.beside("agent-bin");
    let ran = node.beside("agent-kubeadm-ran");
    script(
        &dir.join("kubeadm"),
        &format!("echo \"$*\" >> '{}'\n", ran.display()),
    );
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    (path, ran)
}

#[test]
fn without_chroot_kubeadm_is_the_trees_own_run_in_the_tree_never_the_agents() {
    let node = Node::new();
    let root = node.root().canonicalize().unwrap();
    // The tree's kubeadm records where it ran, the root it was told, and its arguments.
    let record = node.path("var/log/kubeadm-ran");
    std::fs::create_dir_all(node.path("var/log")).unwrap();
    script(
        &node.path("usr/bin/kubeadm"),
        &format!(
            "echo \"$(pwd -P) ${{INPLACE_NODE_ROOT:-unset}} $*\" >> '{}'\n",
            record.display()
        ),
    );
    let (path, decoy) = decoy_path(&node);
    let p = plan(
        &node,
        "kubeadm-in-root",
        "  - file: {path: /etc/kubernetes/kubeadm-upgrade.yaml, content: \"kind: UpgradeConfiguration\\n\"}\n  \
         - kubeadmUpgradeNode: {extraArgs: [--config, /etc/kubernetes/kubeadm-upgrade.yaml]}\n",
    );
    let out = node.agent_env(
        &["apply", "--no-chroot", p.to_str().unwrap()],
        &[("PATH", &path)],
    );
    assert!(
        !decoy.exists(),
        "the agent ran the kubeadm on its own PATH ({}), which acts on its own system, not on \
         the node at {}: {}",
        std::fs::read_to_string(&decoy).unwrap_or_default().trim(),
        root.display(),
        text(&out)
    );
    assert!(out.status.success(), "{}", text(&out));
    let seen = std::fs::read_to_string(&record)
        .unwrap_or_else(|e| panic!("the tree's kubeadm did not run ({e}): {}", text(&out)));
    assert_eq!(
        seen,
        format!(
            "{} {} upgrade node --config /etc/kubernetes/kubeadm-upgrade.yaml\n",
            root.display(),
            node.root().display()
        ),
        "the tree's kubeadm runs in the tree and is told its root"
    );
}

#[test]
fn without_chroot_a_tree_with_apt_has_no_package_manager_and_the_message_names_the_setting() {
    let node = Node::new();
    // What detection looks for (a dpkg database and apt-get), and an apt-get that records
    // being run: it must not be, chrooted or not.
    std::fs::create_dir_all(node.path("var/lib/dpkg")).unwrap();
    std::fs::write(
        node.path("var/lib/dpkg/status"),
        "Package: kubelet\nStatus: install ok installed\nVersion: 1.35.2-1.1\n\n",
    )
    .unwrap();
    let ran = node.beside("apt-get-ran");
    for tool in [
        "usr/bin/apt-get",
        "usr/bin/dpkg",
        "usr/bin/dpkg-query",
        "usr/bin/apt-mark",
    ] {
        script(
            &node.path(tool),
            &format!("echo \"$0 $*\" >> '{}'\n", ran.display()),
        );
    }
    let p = plan(
        &node,
        "package-in-root",
        "  - package: {name: kubelet, version: 1.35.3-1.1}\n",
    );
    let out = node.agent(&["apply", "--no-chroot", p.to_str().unwrap()]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("node.chroot = false"),
        "the failure names the setting: {}",
        text(&out)
    );
    assert!(
        !ran.exists(),
        "a package tool ran: {}",
        std::fs::read_to_string(&ran).unwrap_or_default()
    );
}

//! A directory tree that looks like a kubeadm worker node (the demo's and the tests' node):
//! kubelet configuration and flags, the kubeadm drop-in, accounts, a kubeconfig.
#![deny(unsafe_code)]
#![warn(missing_docs)]

use std::path::Path;

const KUBELET_CONFIG: &str = "\
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: /etc/kubernetes/pki/ca.crt
authorization:
  mode: Webhook
cgroupDriver: systemd
clusterDNS:
- 10.96.0.10
clusterDomain: cluster.local
healthzBindAddress: 127.0.0.1
healthzPort: 10248
maxPods: 110
rotateCertificates: true
serializeImagePulls: true
staticPodPath: /etc/kubernetes/manifests
";

const KUBEADM_FLAGS: &str = "KUBELET_KUBEADM_ARGS=\"--container-runtime-endpoint=unix:///var/run/containerd/containerd.sock --pod-infra-container-image=registry.k8s.io/pause:3.9 --node-ip=10.0.0.21\"\n";

const KUBEADM_DROPIN: &str = "\
[Service]
Environment=\"KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf\"
Environment=\"KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml\"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS
";

/// Writes a tree that looks like a kubeadm worker node under `dir`. Its `root` account is
/// the calling user, so an unprivileged demo can own its files.
pub fn build_kubeadm_worker(dir: &Path) -> std::io::Result<()> {
    let uid = rustix::process::geteuid().as_raw();
    let gid = rustix::process::getegid().as_raw();
    let files: [(&str, String); 9] = [
        (
            "etc/passwd",
            format!("root:x:{uid}:{gid}:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
        ),
        ("etc/group", format!("root:x:{gid}:\nadm:x:{gid}:\nnogroup:x:65534:\n")),
        (
            "etc/kubernetes/kubelet.conf",
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    server: https://10.0.0.10:6443\n  name: demo\n# demo sandbox: not a real kubeconfig\n".into(),
        ),
        (
            "etc/kubernetes/pki/ca.crt",
            "-----BEGIN CERTIFICATE-----\n(demo sandbox: not a real certificate)\n-----END CERTIFICATE-----\n".into(),
        ),
        ("etc/kubernetes/old-bootstrap.conf", "# left over from bootstrap\n".into()),
        ("var/lib/kubelet/config.yaml", KUBELET_CONFIG.into()),
        ("var/lib/kubelet/kubeadm-flags.env", KUBEADM_FLAGS.into()),
        (
            "etc/systemd/system/kubelet.service.d/10-kubeadm.conf",
            KUBEADM_DROPIN.into(),
        ),
        ("etc/sysctl.d/99-sysctl.conf", "# distribution defaults\n".into()),
    ];
    for (rel, content) in files {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&path, content)?;
    }
    std::fs::create_dir_all(dir.join("etc/kubernetes/manifests"))?;
    Ok(())
}

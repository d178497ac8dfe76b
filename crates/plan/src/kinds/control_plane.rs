//! `controlPlane`: the health gate of a kubeadm control-plane node (a `verify[]` entry, not
//! a change): the node's API server ready, the static pods it runs on the manifests the plan
//! left, and where etcd is stacked, the local member healthy and the cluster's quorum intact.
//!
//! ```yaml
//! verify:
//!   - controlPlane:
//!       nodeName: cp-0                      # the mirror pods are <component>-<nodeName>
//!       components: [kube-apiserver, kube-controller-manager, kube-scheduler, etcd]
//!       etcd: stacked                       # stacked | external | none
//!       apiServer: 10.0.0.10:6443           # default: the manifest's advertise endpoint, else 127.0.0.1:6443
//!       etcdMetrics: 127.0.0.1:2381         # default: kubeadm's etcd metrics listener
//!       timeoutSeconds: 300
//! ```
//!
//! What it proves is decided in `docs/decisions/0019-control-plane-gates.md`; the agent runs
//! it (`steps/control_plane.rs`). Here: the validated body, its canonical form.

use serde_json::{Map, Value, json};

use crate::parse::Cx;

/// The static pod components a kubeadm control-plane node runs, in kubeadm's order.
pub const CONTROL_PLANE_COMPONENTS: [&str; 4] = [
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
];

/// kubeadm's etcd metrics listener on a stacked control-plane node
/// (`--listen-metrics-urls=http://127.0.0.1:2381`), which serves `/health`.
pub const ETCD_METRICS_DEFAULT: &str = "127.0.0.1:2381";

/// Where etcd runs for this control plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EtcdTopology {
    /// A member on this node (kubeadm's local etcd, a static pod): checked here.
    Stacked,
    /// Outside the node: the API server's `/readyz` covers its reachability.
    External,
    /// Not checked.
    None,
}

impl EtcdTopology {
    /// The plan-file word.
    pub fn as_str(self) -> &'static str {
        match self {
            EtcdTopology::Stacked => "stacked",
            EtcdTopology::External => "external",
            EtcdTopology::None => "none",
        }
    }
}

/// The body of a `controlPlane` gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlPlaneGate {
    /// The node's name as the kubelet registered it (mirror pods are `<component>-<node>`).
    pub node_name: String,
    /// The static pods whose mirror pods must be Ready (and run the current manifest), in
    /// the order given, each once.
    pub components: Vec<String>,
    /// Where etcd runs.
    pub etcd: EtcdTopology,
    /// `host:port` of the local API server; `None`: the advertise endpoint kubeadm wrote
    /// into the kube-apiserver manifest, else `127.0.0.1:6443`.
    pub api_server: Option<String>,
    /// `host:port` of the local etcd's metrics listener (`/health`).
    pub etcd_metrics: String,
}

impl ControlPlaneGate {
    /// What is checked, for people: `node cp-0: kube-apiserver, etcd (stacked)`.
    pub fn target(&self) -> String {
        format!(
            "node {}: {} (etcd {})",
            self.node_name,
            self.components.join(", "),
            self.etcd.as_str()
        )
    }

    /// The canonical body (without the common `timeoutSeconds`/`periodSeconds`).
    pub fn canonical(&self) -> Value {
        let mut m = Map::new();
        m.insert("nodeName".into(), json!(self.node_name));
        m.insert("components".into(), json!(self.components));
        m.insert("etcd".into(), json!(self.etcd.as_str()));
        if let Some(a) = &self.api_server {
            m.insert("apiServer".into(), json!(a));
        }
        m.insert("etcdMetrics".into(), json!(self.etcd_metrics));
        Value::Object(m)
    }

    /// The keys of the body besides the common ones.
    pub const KEYS: [&'static str; 5] =
        ["nodeName", "components", "etcd", "apiServer", "etcdMetrics"];

    /// Reads the body `m` at field path `path`, reporting problems through `cx`.
    pub(crate) fn parse(cx: &mut Cx<'_>, path: &str, m: &Map<String, Value>) -> Option<Self> {
        let field = |k: &str| format!("{path}.{k}");
        let node_name = cx.string(path, m, "nodeName", true)?.to_string();
        if !crate::is_dns_subdomain(&node_name) {
            cx.err(
                field("nodeName"),
                format!("{node_name:?} is not a node name (a DNS subdomain)"),
            );
            return None;
        }
        let etcd = match cx.string(path, m, "etcd", false) {
            None | Some("stacked") => EtcdTopology::Stacked,
            Some("external") => EtcdTopology::External,
            Some("none") => EtcdTopology::None,
            Some(other) => {
                cx.err(
                    field("etcd"),
                    format!("{other:?} is not one of stacked, external, none"),
                );
                return None;
            }
        };
        let components = match m.get("components") {
            None | Some(Value::Null) => CONTROL_PLANE_COMPONENTS
                .iter()
                .filter(|c| **c != "etcd" || etcd == EtcdTopology::Stacked)
                .map(|c| (*c).to_string())
                .collect(),
            Some(_) => {
                let list = cx.string_list(path, m, "components")?;
                let mut seen: Vec<String> = Vec::new();
                for c in list {
                    if !CONTROL_PLANE_COMPONENTS.contains(&c.as_str()) {
                        cx.err(
                            field("components"),
                            format!(
                                "{c:?} is not a kubeadm control-plane static pod ({})",
                                CONTROL_PLANE_COMPONENTS.join(", ")
                            ),
                        );
                        return None;
                    }
                    if c == "etcd" && etcd != EtcdTopology::Stacked {
                        cx.err(
                            field("components"),
                            format!(
                                "etcd runs on the node only when etcd is stacked (etcd: {})",
                                etcd.as_str()
                            ),
                        );
                        return None;
                    }
                    if seen.contains(&c) {
                        cx.err(field("components"), format!("{c:?} is named twice"));
                        return None;
                    }
                    seen.push(c);
                }
                if seen.is_empty() {
                    cx.err(field("components"), "must name at least one component");
                    return None;
                }
                seen
            }
        };
        let endpoint = |cx: &mut Cx<'_>, key: &str| -> Option<Option<String>> {
            match cx.string(path, m, key, false) {
                None => Some(None),
                Some(s) => match check_endpoint(s) {
                    Ok(()) => Some(Some(s.to_string())),
                    Err(e) => {
                        cx.err(field(key), e);
                        None
                    }
                },
            }
        };
        let api_server = endpoint(cx, "apiServer")?;
        let etcd_metrics =
            endpoint(cx, "etcdMetrics")?.unwrap_or_else(|| ETCD_METRICS_DEFAULT.into());
        Some(ControlPlaneGate {
            node_name,
            components,
            etcd,
            api_server,
            etcd_metrics,
        })
    }
}

/// `host:port` with a literal IP address (`[v6]:port` for IPv6) or a DNS name, port 1-65535:
/// the gate talks to this node's own listeners, named as the node's configuration names them.
pub fn check_endpoint(s: &str) -> Result<(), String> {
    let bad = || format!("{s:?} is not host:port (such as 127.0.0.1:6443)");
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let host_ok = host.parse::<std::net::IpAddr>().is_ok() || crate::is_dns_subdomain(host);
    if port_ok && host_ok && !host.is_empty() {
        Ok(())
    } else {
        Err(bad())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Limits, Probe, parse_plan};

    fn gate(body: &str) -> Result<ControlPlaneGate, String> {
        let yaml = format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: a/b@c\nverify:\n  - controlPlane: {body}\n"
        );
        match parse_plan(yaml.as_bytes(), "t.yaml", &Limits::default()) {
            Ok(plan) => match &plan.verify[0].probe {
                Probe::ControlPlane(g) => {
                    // The canonical form reads back as the same plan.
                    let again =
                        crate::validate_value(&plan.canonical_json(), "c", &Limits::default())
                            .map_err(|e| e.to_string())?;
                    assert_eq!(again, plan);
                    Ok(g.clone())
                }
                other => panic!("{other:?}"),
            },
            Err(e) => Err(e.to_string()),
        }
    }

    #[test]
    fn defaults_follow_the_etcd_topology() {
        let g = gate("{nodeName: cp-0}").unwrap();
        assert_eq!(g.etcd, EtcdTopology::Stacked);
        assert_eq!(g.components, CONTROL_PLANE_COMPONENTS);
        assert_eq!(g.api_server, None);
        assert_eq!(g.etcd_metrics, ETCD_METRICS_DEFAULT);
        let g = gate("{nodeName: cp-0, etcd: external, apiServer: \"10.0.0.1:6443\"}").unwrap();
        assert_eq!(
            g.components,
            [
                "kube-apiserver",
                "kube-controller-manager",
                "kube-scheduler"
            ]
        );
        assert_eq!(g.api_server.as_deref(), Some("10.0.0.1:6443"));
    }

    #[test]
    fn bad_bodies_name_their_field() {
        let e = gate("{etcd: stacked}").unwrap_err();
        assert!(e.contains("verify[0].controlPlane.nodeName"), "{e}");
        let e = gate("{nodeName: cp-0, components: [kube-proxy]}").unwrap_err();
        assert!(
            e.contains("\"kube-proxy\" is not a kubeadm control-plane static pod"),
            "{e}"
        );
        let e = gate("{nodeName: cp-0, etcd: external, components: [etcd]}").unwrap_err();
        assert!(
            e.contains("etcd runs on the node only when etcd is stacked"),
            "{e}"
        );
        let e = gate("{nodeName: cp-0, etcd: local}").unwrap_err();
        assert!(e.contains("verify[0].controlPlane.etcd"), "{e}");
        let e = gate("{nodeName: cp-0, apiServer: \"https://x:6443\"}").unwrap_err();
        assert!(e.contains("verify[0].controlPlane.apiServer"), "{e}");
        let e = gate("{nodeName: cp-0, components: [etcd, etcd]}").unwrap_err();
        assert!(e.contains("named twice"), "{e}");
    }

    #[test]
    fn endpoints_are_host_and_port() {
        assert!(check_endpoint("127.0.0.1:6443").is_ok());
        assert!(check_endpoint("[::1]:2381").is_ok());
        assert!(check_endpoint("cp.example:6443").is_ok());
        assert!(check_endpoint("127.0.0.1").is_err());
        assert!(check_endpoint("127.0.0.1:0").is_err());
        assert!(check_endpoint("http://127.0.0.1:6443").is_err());
        assert!(check_endpoint("a b:1").is_err());
    }
}

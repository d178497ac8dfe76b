//! Why a Machine is not updated in place: the reason a `CanUpdateMachineSet` or
//! `CanUpdateMachine` answer covers less than everything, as a value built where the
//! decision is made ([`super::patch`] for fields, the handlers for settings, agents and
//! reads), never re-parsed from a message.
//!
//! Cluster API does not show it: KubeadmControlPlane drops the `CanUpdateMachine` message
//! (cluster-api `controlplane/kubeadm/internal/controllers/inplace_canupdatemachine.go`
//! logs only its own diff), and its runtime client returns a successful answer without
//! looking at its message (`internal/runtime/client/client.go`, `Call`: the message is read
//! only when the status is Failure). So the updater tells it itself: its log line
//! ([`super::server`]), an Event on the object an operator looks at ([`super::events`]), a
//! metric by [`Class`] ([`super::metrics`]), and `inplace-updater explain`
//! ([`super::explain`]) before the change is applied. docs/decisions/0017-why-not-in-place.md.

use std::fmt;

/// What kind of reason it is: the bounded label of the metric and the log's `reason_class`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// A field this updater never changes in place (diskSetup, commands, the infrastructure).
    FieldNotInPlace,
    /// The bootstrap config is not a KubeadmConfig (another bootstrap provider).
    UnsupportedBootstrap,
    /// The nodes' agents lack what the change needs (services off, no package manager).
    AgentCapability,
    /// An agent checked the plan and said it cannot apply it (`CheckPlan`).
    AgentRefused,
    /// An agent could not be reached or did not answer in time.
    Unreachable,
    /// The agent could not be bound to the Machine's cluster (trust: `settings.agentCA`).
    AgentTrust,
    /// The desired state could not be translated into a plan (a Secret it names, a file).
    Translation,
    /// The version move breaks Kubernetes' version skew rules ([`super::skew`]).
    Skew,
    /// The change moves something that never goes backwards backwards (an etcd image tag
    /// lower than the running one).
    Downgrade,
    /// An object the decision needs could not be read from the management cluster.
    Lookup,
    /// The operator's settings turn in-place updates off (`disableInPlaceUpdates`).
    Settings,
}

impl Class {
    /// Every class, in the order the metric lists them.
    pub const ALL: [Class; 11] = [
        Class::FieldNotInPlace,
        Class::UnsupportedBootstrap,
        Class::AgentCapability,
        Class::AgentRefused,
        Class::Unreachable,
        Class::AgentTrust,
        Class::Translation,
        Class::Skew,
        Class::Downgrade,
        Class::Lookup,
        Class::Settings,
    ];

    /// The label value (`field-not-in-place`, `agent-capability`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Class::FieldNotInPlace => "field-not-in-place",
            Class::UnsupportedBootstrap => "unsupported-bootstrap",
            Class::AgentCapability => "agent-capability",
            Class::AgentRefused => "agent-refused",
            Class::Unreachable => "unreachable",
            Class::AgentTrust => "agent-trust",
            Class::Translation => "translation",
            Class::Skew => "skew",
            Class::Downgrade => "downgrade",
            Class::Lookup => "lookup",
            Class::Settings => "settings",
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an agent must be able to do for a field to go in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Need {
    /// Write files (`file` change kind).
    Files,
    /// Remove a file dropped from `files[]` (`prune` feature).
    Prune,
    /// Set kubelet flags and restart the kubelet (`kubeletFlags`, service management).
    KubeletRestart,
    /// Move the Kubernetes version (packages, `kubeadm upgrade node`, version patterns).
    Version,
    /// Regenerate a control-plane node's static pods from the cluster configuration and
    /// prove them healthy (`kubeadmUpgradeNode`, the `controlPlane` gate).
    ControlPlaneConfig,
    /// Reissue the API server's serving certificate (`apiServerCertificate`).
    ApiServerCertificate,
}

/// One field that stays different, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gap {
    /// The field, as a path in the spec (`joinConfiguration.nodeRegistration.kubeletExtraArgs`).
    pub field: String,
    /// The reason's class.
    pub class: Class,
    /// Why, in words (`needs a kubelet restart`, `runs only at bootstrap`).
    pub why: String,
    /// What the agents lack, when that is the reason ([`Class::AgentCapability`]).
    pub need: Option<Need>,
    /// The nodes whose agents lack it, and what they lack, in words (filled in by the
    /// handler that asked them).
    pub lacking: Vec<Lacking>,
}

impl Gap {
    /// A field that stays different for `why`.
    pub fn new(field: impl Into<String>, class: Class, why: impl Into<String>) -> Gap {
        Gap {
            field: field.into(),
            class,
            why: why.into(),
            need: None,
            lacking: Vec::new(),
        }
    }

    /// A field the agents cannot do because they lack `need`.
    pub fn needs(field: impl Into<String>, need: Need, why: impl Into<String>) -> Gap {
        Gap {
            need: Some(need),
            ..Gap::new(field, Class::AgentCapability, why)
        }
    }
}

/// `field (why)`: the form of the hook response's message.
impl fmt::Display for Gap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.field, self.why)
    }
}

/// Nodes whose agents lack the same thing for the same cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lacking {
    /// What they lack, as a predicate (`do not manage services (--services off)`).
    pub cause: String,
    /// The nodes, each `node` or `node (Machine ns/name)` where they differ, sorted.
    pub nodes: Vec<String>,
}

/// The most nodes a sentence names; the rest are counted.
pub const MAX_NAMED: usize = 3;

/// Why an answer covers less than everything: the fields that stay different, or the one
/// reason nothing was covered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Why {
    /// What stays different (at least one).
    pub gaps: Vec<Gap>,
}

impl Why {
    /// Nothing covered, for one reason (the agents did not answer, the settings …).
    pub fn whole(class: Class, sentence: impl Into<String>) -> Why {
        Why {
            gaps: vec![Gap::new(String::new(), class, sentence)],
        }
    }

    /// The fields that stay different; `None` when there are none.
    pub fn of(gaps: Vec<Gap>) -> Option<Why> {
        (!gaps.is_empty()).then_some(Why { gaps })
    }

    /// The class of the decision: the first of its gaps' classes in [`Class`] order (a
    /// field that never goes in place outranks what an agent lacks, which no agent could
    /// change).
    pub fn class(&self) -> Class {
        self.gaps
            .iter()
            .map(|g| g.class)
            .min()
            .unwrap_or(Class::FieldNotInPlace)
    }

    /// The reason for people: each field and why, with the nodes that lack what it needs
    /// (`joinConfiguration.nodeRegistration.kubeletExtraArgs needs a kubelet restart; the
    /// agents on md-0-abc, md-0-def do not manage services (--services off)`).
    pub fn sentence(&self) -> String {
        let parts: Vec<String> = self.gaps.iter().map(sentence_of).collect();
        parts.join("; ")
    }

    /// What the nodes lack, alone (`the agent on node-d does not manage services (--services
    /// off)`), each once; empty when no node lacks anything.
    pub fn lacking(&self) -> String {
        let mut parts: Vec<String> = Vec::new();
        for part in self
            .gaps
            .iter()
            .flat_map(|g| g.lacking.iter().map(lacking_of))
        {
            if !parts.contains(&part) {
                parts.push(part);
            }
        }
        parts.join("; ")
    }
}

fn sentence_of(gap: &Gap) -> String {
    let mut out = if gap.field.is_empty() {
        gap.why.clone()
    } else {
        format!("{} {}", gap.field, gap.why)
    };
    for l in &gap.lacking {
        out.push_str(&format!("; {}", lacking_of(l)));
    }
    out
}

fn lacking_of(l: &Lacking) -> String {
    let (agents, cause) = if l.nodes.len() == 1 {
        ("the agent on", singular(&l.cause))
    } else {
        ("the agents on", l.cause.clone())
    };
    format!("{agents} {} {cause}", named(&l.nodes))
}

/// A cause written for several agents (`do not …`, `have no …`) said of one.
fn singular(cause: &str) -> String {
    if let Some(rest) = cause.strip_prefix("do not ") {
        format!("does not {rest}")
    } else if let Some(rest) = cause.strip_prefix("have ") {
        format!("has {rest}")
    } else {
        cause.to_owned()
    }
}

/// `a, b, c and 4 more`.
fn named(nodes: &[String]) -> String {
    if nodes.len() <= MAX_NAMED {
        return nodes.join(", ");
    }
    format!(
        "{} and {} more",
        nodes[..MAX_NAMED].join(", "),
        nodes.len() - MAX_NAMED
    )
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.sentence())
    }
}

/// What the agent on one node lacks of `need`, in words, given what it reported; `None` when
/// it has it. `facts` are the agent's `GetNodeInfo`.
pub fn lacks(need: Need, facts: &super::translate::NodeFacts) -> Option<&'static str> {
    let caps = facts.capabilities();
    match need {
        Need::Files if !caps.files => Some("cannot write files (an agent too old for them)"),
        Need::Prune if !caps.prune => {
            Some("cannot remove a dropped file (an agent without the prune feature)")
        }
        Need::KubeletRestart if !facts.services_managed => {
            Some("do not manage services (--services off)")
        }
        Need::KubeletRestart if !caps.kubelet_flags => {
            Some("cannot set kubelet flags (an agent too old for them)")
        }
        Need::Version if facts.package_manager.is_empty() => {
            Some("have no package manager (apt or dnf) to install the new version with")
        }
        Need::Version if !caps.version => {
            Some("cannot run kubeadm upgrade node or match package versions (an agent too old)")
        }
        Need::ControlPlaneConfig if !facts.kind("kubeadmUpgradeNode") || !facts.kind("file") => {
            Some("cannot run kubeadm upgrade node (an agent too old)")
        }
        Need::ControlPlaneConfig if !facts.check("controlPlane") => Some(
            "cannot prove a control-plane node healthy (an agent without the controlPlane gate)",
        ),
        Need::ApiServerCertificate if !facts.kind(super::translate::API_SERVER_CERTIFICATE) => {
            Some(
                "cannot reissue the API server's serving certificate (an agent without the \
                 apiServerCertificate change kind)",
            )
        }
        _ => None,
    }
}

/// Fills in, for each gap that needs something of the agents, which of `nodes` lack it
/// (`(Machine, facts)`, as asked), grouped by cause.
pub fn attribute(why: &mut Why, nodes: &[(String, super::translate::NodeFacts)]) {
    for gap in &mut why.gaps {
        let Some(need) = gap.need else { continue };
        let mut by_cause: Vec<Lacking> = Vec::new();
        for (machine, facts) in nodes {
            let Some(cause) = lacks(need, facts) else {
                continue;
            };
            let short = machine.rsplit('/').next().unwrap_or(machine);
            let name = if facts.node_name == short || facts.node_name.is_empty() {
                short.to_owned()
            } else {
                format!("{} (Machine {machine})", facts.node_name)
            };
            match by_cause.iter_mut().find(|l| l.cause == cause) {
                Some(l) => l.nodes.push(name),
                None => by_cause.push(Lacking {
                    cause: cause.to_owned(),
                    nodes: vec![name],
                }),
            }
        }
        for l in &mut by_cause {
            l.nodes.sort();
        }
        gap.lacking = by_cause;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::NodeFacts;

    fn services_off(node: &str) -> NodeFacts {
        NodeFacts {
            services_managed: false,
            ..NodeFacts::assumed(node)
        }
    }

    #[test]
    fn the_sentence_names_the_field_what_it_needs_and_the_nodes_that_lack_it() {
        let mut why = Why::of(vec![Gap::needs(
            "kubeletExtraArgs",
            Need::KubeletRestart,
            "needs a kubelet restart",
        )])
        .unwrap();
        attribute(
            &mut why,
            &[
                ("default/md-0-def".into(), services_off("md-0-def")),
                ("default/md-0-abc".into(), services_off("md-0-abc")),
                ("default/md-0-ok".into(), NodeFacts::assumed("md-0-ok")),
            ],
        );
        assert_eq!(
            why.sentence(),
            "kubeletExtraArgs needs a kubelet restart; the agents on md-0-abc, md-0-def do not \
             manage services (--services off)"
        );
        assert_eq!(why.class(), Class::AgentCapability);
    }

    #[test]
    fn a_field_that_never_goes_in_place_outranks_what_agents_lack() {
        let why = Why::of(vec![
            Gap::needs("version", Need::Version, "needs new packages"),
            Gap::new(
                "preKubeadmCommands",
                Class::FieldNotInPlace,
                "runs only at bootstrap",
            ),
        ])
        .unwrap();
        assert_eq!(why.class(), Class::FieldNotInPlace);
        assert_eq!(
            why.sentence(),
            "version needs new packages; preKubeadmCommands runs only at bootstrap"
        );
        assert_eq!(Why::of(Vec::new()), None);
    }

    #[test]
    fn many_nodes_are_counted_and_a_node_named_apart_from_its_machine_says_both() {
        let nodes: Vec<(String, NodeFacts)> = (0..5)
            .map(|i| (format!("ns/m-{i}"), services_off(&format!("n-{i}"))))
            .collect();
        let mut why = Why::of(vec![Gap::needs("f", Need::KubeletRestart, "x")]).unwrap();
        attribute(&mut why, &nodes);
        let s = why.sentence();
        assert!(
            s.contains(
                "n-0 (Machine ns/m-0), n-1 (Machine ns/m-1), n-2 (Machine ns/m-2) and 2 more"
            ),
            "{s}"
        );
        let labels: Vec<&str> = Class::ALL.iter().map(|c| c.as_str()).collect();
        let mut sorted = labels.clone();
        sorted.dedup();
        assert_eq!(sorted.len(), Class::ALL.len(), "{labels:?}");
    }
}

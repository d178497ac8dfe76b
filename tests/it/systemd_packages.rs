//! The Kubernetes version bump on a real systemd. Each test boots this machine's systemd in a
//! sandbox (tests/sandbox, docs/testing-systemd.md), makes it a kubeadm node at 1.30 installed
//! from a local repository of stand-in `kubeadm`/`kubelet`/`kubectl` packages built in the
//! node (`inplace_agent::sandbox::packages`: the packaged `kubelet.service` runs the kubelet
//! stand-in, stripped, from `/usr/bin/kubelet`), and applies `examples/plans/upgrade-1.30-to-1.31.yaml`
//! (or `-dnf.yaml`) exactly as it is in the repository, with the real binary:
//! `inplace-agent apply --root /proc/<pid>/root --bus <the node's bus>`, run in the node's
//! network namespace so that its health gate reaches the node's 127.0.0.1:10248.
//! As root these tests run; otherwise they print a SKIP line (and fail when CI=true).

use crate::support::overlay;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::support::sandbox::{self, KUBELET_CONFIG, START_LOG, SandboxNode, Standin, Systemd};
use crate::support::text;
use inplace_agent::host::packages::ManagerKind;
use inplace_agent::sandbox::packages::{self, KUBE_PACKAGES, KUBEADM_FAIL, KUBEADM_LOG};
use serde_json::Value;

const KUBELET: &str = "kubelet.service";

fn example(kind: ManagerKind) -> PathBuf {
    let file = match kind {
        ManagerKind::Apt => "upgrade-1.30-to-1.31.yaml",
        ManagerKind::Dnf => "upgrade-1.30-to-1.31-dnf.yaml",
    };
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/plans")
        .join(file)
}

/// A sandboxed kubeadm node at 1.30, installed from stand-in packages with `kind`.
struct Node {
    node: SandboxNode,
    systemd: Systemd,
    kind: ManagerKind,
    work: tempfile::TempDir,
}

impl Node {
    /// Boots it, or returns `None` after a loud SKIP line (not root, or the tools to build
    /// the repository are missing; both fail the test when CI=true).
    fn new(kind: ManagerKind) -> Option<Node> {
        let node = SandboxNode::boot()?;
        if let Some(why) = packages::missing_tools(&node.path("/"), kind) {
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("cannot build a {kind} repository with CI=true: {why}");
            }
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                format!(
                    "\n**** SKIP: {}: {kind} version bump not run: {why} (tests/setup installs \
                     them) ****\n",
                    std::thread::current().name().unwrap_or("test")
                )
                .as_bytes(),
            );
            return None;
        }
        let started = Instant::now();
        let systemd = node
            .install_kube_packages(kind, Standin::Binary(&overlay::standin_for_packages()))
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "{kind}: node booted in {:?}, repository built and 1.30 installed in {:?}",
            node.boot_time(),
            started.elapsed()
        );
        Some(Node {
            node,
            systemd,
            kind,
            work: tempfile::Builder::new()
                .prefix("inplace-systemd-packages-")
                .tempdir()
                .expect("tempdir"),
        })
    }

    /// `inplace-agent <args> --root <node> --bus <node's bus>`, in the node's network
    /// namespace.
    fn agent(&self, args: &[&str]) -> Command {
        sandbox::agent_command(&self.node, args)
    }

    /// Applies a plan file; the exit code, the final status (`-o json`) and all output.
    fn apply(&self, plan: &Path) -> (i32, Value, String) {
        let out = self
            .agent(&["apply", "--no-progress", "-o", "json"])
            .arg(plan)
            .output()
            .expect("run the agent");
        let status = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        (out.status.code().unwrap_or(-1), status, text(&out))
    }

    /// The example with another id (the same desired state as a new plan).
    fn example_as(&self, id: &str) -> PathBuf {
        let text = std::fs::read_to_string(example(self.kind)).expect("read the example");
        let old_id = text
            .lines()
            .find_map(|l| l.strip_prefix("id: "))
            .expect("the example has an id")
            .to_string();
        let path = self.work.path().join("again.yaml");
        std::fs::write(
            &path,
            text.replace(&format!("id: {old_id}\n"), &format!("id: {id}\n")),
        )
        .expect("write plan");
        path
    }

    /// The journal records of `run` (`type`, `time`, `record` body), in order.
    fn journal(&self, run: u64) -> Vec<(String, String, Value)> {
        let out = self
            .agent(&["journal", "-o", "json"])
            .output()
            .expect("run journal");
        assert!(out.status.success(), "{}", text(&out));
        let all: Value = serde_json::from_slice(&out.stdout).expect("journal json");
        all.as_array()
            .expect("array")
            .iter()
            .filter(|e| e["run"].as_u64() == Some(run))
            .map(|e| {
                let kind = e["type"].as_str().unwrap_or_default().to_string();
                let time = e["time"].as_str().unwrap_or_default().to_string();
                (kind.clone(), time, e["record"][&kind].clone())
            })
            .collect()
    }

    fn installed(&self, name: &str) -> Option<(String, bool)> {
        packages::installed(&self.node.path("/"), self.kind, name)
    }

    fn assert_packages(&self, version: &str) {
        for name in KUBE_PACKAGES {
            assert_eq!(
                self.installed(name),
                Some((version.to_string(), true)),
                "{name} at {version} and held"
            );
        }
    }

    /// What changes when a package command runs: dpkg's log, or rpm's install times.
    fn package_trace(&self) -> String {
        match self.kind {
            ManagerKind::Apt => {
                std::fs::read_to_string(self.node.path("/var/log/dpkg.log")).expect("read dpkg.log")
            }
            ManagerKind::Dnf => packages::run_in_root(
                &self.node.path("/"),
                &[
                    "rpm",
                    "-qa",
                    "--qf",
                    "%{NAME} %{VERSION}-%{RELEASE} %{INSTALLTIME}\n",
                ],
            )
            .expect("rpm -qa"),
        }
    }

    fn invocation(&self) -> String {
        self.systemd
            .unit_state(KUBELET)
            .expect("unit state")
            .invocation_id
            .map(|i| i.to_string())
            .unwrap_or_default()
    }

    /// Lines of the stand-in's start log (`<InvocationID> ok|refused ...`).
    fn starts(&self) -> Vec<String> {
        std::fs::read_to_string(self.node.path(START_LOG))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// `systemctl show -p NAME --value kubelet.service` in the node.
    fn show(&self, property: &str) -> String {
        let out = self
            .node
            .command("systemctl")
            .args(["show", "-p", property, "--value", KUBELET])
            .output()
            .expect("systemctl show");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// `/usr/bin/kubelet --version` run in the node (all its namespaces).
    fn kubelet_version(&self) -> String {
        let out = self
            .node
            .command("/usr/bin/kubelet")
            .arg("--version")
            .output()
            .expect("kubelet --version");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn kubeadm_log(&self) -> String {
        std::fs::read_to_string(self.node.path(KUBEADM_LOG)).unwrap_or_default()
    }
}

fn states(status: &Value) -> Vec<String> {
    status["changes"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| c["state"].as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn count(records: &[(String, String, Value)], kind: &str) -> usize {
    records.iter().filter(|(k, _, _)| k == kind).count()
}

/// Milliseconds since midnight of a journal time (`2026-11-30T14:35:46.123456Z`).
fn ms_of_day(time: &str) -> f64 {
    let t = &time[11..time.len() - 1];
    let mut parts = t.split(':');
    let h: f64 = parts.next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let m: f64 = parts.next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let s: f64 = parts.next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
    (h * 3600.0 + m * 60.0 + s) * 1000.0
}

/// "Preparing 12ms, Applying 3400ms, ..." from the phase records of a run.
fn phase_times(records: &[(String, String, Value)]) -> String {
    let marks: Vec<(String, f64)> = records
        .iter()
        .filter(|(k, _, _)| k == "phase" || k == "planFinished")
        .map(|(_, t, r)| {
            (
                r["phase"].as_str().unwrap_or_default().to_string(),
                ms_of_day(t),
            )
        })
        .collect();
    marks
        .windows(2)
        .map(|w| format!("{} {:.0}ms", w[0].0, w[1].1 - w[0].1))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The whole bump with `kind`, then the same plan again and the same state under a new id.
fn version_bump(kind: ManagerKind) {
    let Some(n) = Node::new(kind) else {
        return;
    };
    let (old, new) = packages::versions(kind);
    let plan = example(kind);

    // The node before: 1.30 installed and held, the packaged kubelet.service running it.
    n.assert_packages(old);
    assert_eq!(n.kubelet_version(), "Kubernetes v1.30.4");
    // The packaged unit (`/lib` is `/usr/lib` on a merged-/usr system).
    let fragment = n.show("FragmentPath");
    assert!(
        [
            "/usr/lib/systemd/system/kubelet.service",
            "/lib/systemd/system/kubelet.service"
        ]
        .contains(&fragment.as_str()),
        "{fragment}"
    );
    assert!(
        n.show("DropInPaths")
            .ends_with("kubelet.service.d/10-kubeadm.conf"),
        "{}",
        n.show("DropInPaths")
    );
    assert!(
        n.show("Environment")
            .contains("KUBELET_STANDIN_DROPIN=kubeadm v1.30.4"),
        "{}",
        n.show("Environment")
    );
    let before = n.invocation();
    let starts_before = n.starts();
    assert_eq!(starts_before.len(), 1, "{starts_before:?}");
    assert!(
        starts_before[0].contains(" ok kubelet-standin v1.30.4: serving /healthz"),
        "{starts_before:?}"
    );

    // The dry run: a restart of the kubelet, after a daemon-reload.
    let out = n
        .agent(&["check", "-o", "json"])
        .arg(&plan)
        .output()
        .expect("check");
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("check: {}", text(&out)));
    assert_eq!(report["disruption"], "Restart", "{report:#}");
    assert_eq!(report["restartUnits"], serde_json::json!([KUBELET]));
    assert_eq!(report["daemonReload"], true, "{report:#}");

    let started = Instant::now();
    let (code, status, out) = n.apply(&plan);
    let took = started.elapsed();
    assert_eq!(code, 0, "{out}\n{}", n.node.journal("kubelet"));
    assert_eq!(status["phase"], "Succeeded", "{status:#}");
    assert_eq!(status["hookResponse"]["retryAfterSeconds"], 0);
    assert_eq!(
        states(&status),
        ["Changed", "Changed", "Changed", "Changed"]
    );
    assert!(
        status["changes"][1]["message"]
            .as_str()
            .unwrap_or_default()
            .starts_with("run kubeadm upgrade node (changes[0] changed an input of kubeadm"),
        "{status:#}"
    );
    let gates: Vec<(&str, &str)> = status["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .map(|c| {
            (
                c["state"].as_str().unwrap_or_default(),
                c["message"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(gates.len(), 3, "{gates:?}");
    assert!(gates.iter().all(|(s, _)| *s == "Passed"), "{gates:?}");
    assert!(
        gates[0].1.starts_with("kubelet.service: unit is active/running; status: \"kubelet-standin v1.31.2: serving /healthz"),
        "{gates:?}"
    );
    assert_eq!(gates[1].1, "answered 200");
    assert_eq!(gates[2].1, "/usr/bin/kubelet reports v1.31.2");

    // kubeadm first, `kubeadm upgrade node` by the new kubeadm while the kubelet was still
    // 1.30, then kubelet and kubectl; all held.
    n.assert_packages(new);
    assert_eq!(
        n.kubeadm_log(),
        "kubeadm v1.31.2 upgrade node (kubelet v1.30.4)\n"
    );
    let run = status["run"].as_u64().expect("run");
    let records = n.journal(run);
    let order: Vec<String> = records
        .iter()
        .filter(|(k, _, _)| {
            matches!(
                k.as_str(),
                "stepDone" | "daemonReloaded" | "unitJobStarted" | "unitJobDone"
            )
        })
        .map(|(k, _, r)| match k.as_str() {
            "stepDone" => format!("changes[{}]", r["index"]),
            "daemonReloaded" => format!("daemon-reload (rollback {})", r["rollback"]),
            _ => format!(
                "{k} {} {} {}",
                r["job"].as_str().unwrap_or_default(),
                r["unit"].as_str().unwrap_or_default(),
                r["outcome"].as_str().unwrap_or_default()
            )
            .trim_end()
            .to_string(),
        })
        .collect();
    assert_eq!(
        order,
        [
            "changes[0]",
            "changes[1]",
            "changes[2]",
            "changes[3]",
            "daemon-reload (rollback false)",
            "unitJobStarted restart kubelet.service",
            "unitJobDone restart kubelet.service done",
        ],
        "{records:#?}"
    );
    let outputs: Vec<String> = records
        .iter()
        .filter(|(k, _, _)| k == "stepOutput")
        .map(|(_, _, r)| r["output"].as_str().unwrap_or_default().to_string())
        .collect();
    assert!(
        outputs
            .iter()
            .any(|o| o.contains("$ kubeadm upgrade node (exit 0")
                && o.contains("successfully updated")),
        "{outputs:#?}"
    );

    // Restarted exactly once, and what runs now is 1.31.2: a new InvocationID, one new start
    // of the stand-in (which says its version when it starts, and to systemd), the unit as
    // the packages and the daemon-reload left it.
    let after = n.invocation();
    assert_ne!(after, before);
    let starts = n.starts();
    assert_eq!(starts.len(), 2, "{starts:?}");
    assert!(
        starts[1].starts_with(&after)
            && starts[1].contains(" ok kubelet-standin v1.31.2: serving /healthz"),
        "{starts:?} (invocation {after})"
    );
    let unit = n.systemd.unit_state(KUBELET).expect("unit state");
    assert!(unit.is_active(), "{unit}");
    assert!(
        unit.status_text
            .as_deref()
            .unwrap_or_default()
            .starts_with("kubelet-standin v1.31.2: serving /healthz"),
        "{unit:?}"
    );
    // systemd loaded the new kubeadm package's drop-in: the daemon-reload happened.
    assert!(
        n.show("Environment")
            .contains("KUBELET_STANDIN_DROPIN=kubeadm v1.31.2"),
        "{}",
        n.show("Environment")
    );
    assert_eq!(n.show("NeedDaemonReload"), "no");
    assert!(
        std::fs::read_to_string(
            n.node
                .path("/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf")
        )
        .expect("drop-in")
        .starts_with("# STAND-IN kubeadm v1.31.2"),
        "the kubeadm package's drop-in is the new one"
    );
    let pid = unit.main_pid.expect("main pid");
    let exe = n
        .node
        .command("readlink")
        .arg(format!("/proc/{pid}/exe"))
        .output()
        .expect("readlink");
    assert_eq!(
        String::from_utf8_lossy(&exe.stdout).trim(),
        "/usr/bin/kubelet"
    );
    assert_eq!(n.kubelet_version(), "Kubernetes v1.31.2");
    assert_eq!(
        n.node.http_get(10248, "/healthz"),
        Ok((200, "ok".to_string()))
    );
    eprintln!(
        "{kind}: upgrade plan applied in {took:?}; phases: {}",
        phase_times(&records)
    );

    // The same plan again: it already ran; nothing runs.
    let trace = n.package_trace();
    let (code, again, out) = n.apply(&plan);
    assert_eq!(code, 0, "{out}");
    assert_eq!(again["run"], status["run"]);
    assert!(out.contains("already ran on this node"), "{out}");

    // The same desired state as a new plan: every change unchanged, kubeadm skipped, no
    // package command, no reload, no restart.
    let (code, again, out) = n.apply(&n.example_as("default/md-0-7d9f4-abcde@v1.31.2-again"));
    assert_eq!(code, 0, "{out}");
    assert_eq!(again["phase"], "Succeeded", "{again:#}");
    assert_eq!(
        states(&again),
        ["Unchanged", "Unchanged", "Unchanged", "Unchanged"]
    );
    assert_eq!(
        again["changes"][1]["message"],
        "skipped: nothing kubeadm reads changed in this run and no version bump is pending \
         (kubeadm v1.31.2, kubelet v1.31.2)"
    );
    let records = n.journal(again["run"].as_u64().expect("run"));
    for kind in [
        "stepStarted",
        "stepOutput",
        "daemonReloaded",
        "unitJobStarted",
        "unitJobDone",
    ] {
        assert_eq!(count(&records, kind), 0, "{kind}: {records:#?}");
    }
    assert_eq!(n.package_trace(), trace, "no package command ran");
    assert_eq!(n.invocation(), after);
    assert_eq!(n.starts().len(), 2);
    assert_eq!(n.kubeadm_log().lines().count(), 1, "kubeadm not run again");
}

#[test]
fn the_version_bump_with_apt_on_a_real_systemd() {
    version_bump(ManagerKind::Apt);
}

#[test]
fn the_version_bump_with_dnf_on_a_real_systemd() {
    version_bump(ManagerKind::Dnf);
}

#[test]
fn a_failing_kubeadm_upgrade_node_stops_the_bump_and_rolls_back_without_a_restart() {
    let Some(n) = Node::new(ManagerKind::Apt) else {
        return;
    };
    let (old, _) = packages::versions(ManagerKind::Apt);
    n.node.write_file(KUBEADM_FAIL, "", 0o644);
    let before = n.invocation();
    let starts = n.starts();
    let dpkg_log = n.package_trace();

    let (code, status, out) = n.apply(&example(ManagerKind::Apt));
    assert_eq!(code, 1, "{out}");
    assert_eq!(status["phase"], "RolledBack", "{status:#}");
    assert_eq!(
        states(&status),
        ["RolledBack", "RolledBack", "Skipped", "Skipped"]
    );
    let error = &status["error"];
    assert_eq!(error["kind"], "command");
    assert_eq!(
        error["step"],
        "changes[1] kubeadmUpgradeNode kubeadm upgrade node"
    );
    let detail = error["detail"].as_str().unwrap_or_default();
    assert!(
        detail.starts_with(
            "kubeadm upgrade node: exit status 1: error execution phase kubelet-config: \
             stand-in failure requested by the test\noutput:\n"
        ),
        "{detail}"
    );
    assert!(
        detail.contains("[upgrade/kubelet-config] writing the kubelet configuration"),
        "its stdout too: {detail}"
    );
    let hook = status["hookResponse"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        hook.contains("stand-in failure requested by the test"),
        "{hook}"
    );
    for gate in status["checks"].as_array().expect("checks") {
        assert_eq!(gate["state"], "Skipped", "{gate:#}");
    }

    // Nothing after it ran: the kubelet and kubectl packages were never touched, and kubeadm
    // is back at 1.30, held; the kubelet configuration kubeadm wrote to is restored.
    n.assert_packages(old);
    let dpkg_now = n.package_trace();
    let new_lines = &dpkg_now[dpkg_log.len()..];
    assert!(
        new_lines.contains(" upgrade kubeadm:all 1.30.4-1.1 1.31.2-1.1"),
        "{new_lines}"
    );
    assert!(
        new_lines.contains(" upgrade kubeadm:all 1.31.2-1.1 1.30.4-1.1"),
        "{new_lines}"
    );
    assert!(
        !new_lines.contains("kubelet:all") && !new_lines.contains("kubectl:all"),
        "{new_lines}"
    );
    assert_eq!(
        n.kubeadm_log(),
        "kubeadm v1.31.2 upgrade node (kubelet v1.30.4)\n"
    );
    assert_eq!(
        n.node.read_file("/var/lib/kubelet/config.yaml"),
        KUBELET_CONFIG
    );
    assert!(
        n.node
            .read_file("/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf")
            .starts_with("# STAND-IN kubeadm v1.30.4"),
    );

    // The kubelet was not restarted (nor reloaded): same InvocationID, no new start, no unit
    // job in the journal; still the old one, healthy.
    assert_eq!(n.invocation(), before);
    assert_eq!(n.starts(), starts);
    let records = n.journal(status["run"].as_u64().expect("run"));
    for kind in ["daemonReloaded", "unitJobStarted", "unitJobDone"] {
        assert_eq!(count(&records, kind), 0, "{kind}: {records:#?}");
    }
    assert_eq!(n.kubelet_version(), "Kubernetes v1.30.4");
    assert_eq!(
        n.node.http_get(10248, "/healthz"),
        Ok((200, "ok".to_string()))
    );
    assert!(
        n.show("Environment")
            .contains("KUBELET_STANDIN_DROPIN=kubeadm v1.30.4"),
        "{}",
        n.show("Environment")
    );
}

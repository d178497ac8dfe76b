//! `host::systemd` against a real systemd: each test boots the machine's systemd in a
//! sandbox (tests/sandbox, DESIGN.md §7) and drives it through our D-Bus client only.
//! As root these tests run; otherwise they print a SKIP line (and fail when CI=true).

use std::os::unix::net::UnixListener;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::support;
use crate::support::sandbox::{self, SandboxNode, StandinExt};
use inplace_agent::host::systemd::{
    ActiveState, LoadState, Systemd, UnitFileState, unix_path_address,
};

const JOB: Duration = Duration::from_secs(30);
const KUBELET: &str = "kubelet.service";

#[test]
fn sandbox_boots_on_an_overlay_and_leaves_the_host_alone() {
    // A file in the host's /tmp: systemd's boot-time tmpfiles run must not reach it.
    let canary = tempfile::Builder::new()
        .prefix("inplace-sandbox-canary")
        .tempfile_in("/tmp")
        .expect("create /tmp canary");
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    eprintln!(
        "sandbox {} booted in {} ms",
        node.id(),
        node.boot_time().as_millis()
    );
    let systemd = node.connect();
    assert_eq!(systemd.system_state().expect("system state"), "running");
    assert!(!systemd.version().is_empty());
    assert!(canary.path().exists(), "the host's /tmp was touched");

    // Writes inside the node stay inside it.
    node.write_file("/etc/inplace-sandbox-probe", "inside\n", 0o644);
    assert!(!Path::new("/etc/inplace-sandbox-probe").exists());
    assert_eq!(node.read_file("/etc/inplace-sandbox-probe"), "inside\n");

    // dbus runs, socket-activated as on a real node; the masked units stay masked.
    let dbus = systemd.unit_state("dbus.service").expect("dbus state");
    assert_eq!(dbus.active_state, ActiveState::Active, "{dbus}");
    let tmpfiles = systemd
        .unit_state("systemd-tmpfiles-setup.service")
        .expect("tmpfiles state");
    assert_eq!(tmpfiles.load_state, LoadState::Masked, "{tmpfiles}");
}

#[test]
fn start_and_restart_change_the_invocation_id() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    let first = systemd.unit_state(KUBELET).expect("kubelet state");
    assert_eq!(first.active_state, ActiveState::Active, "{first}");
    assert_eq!(first.sub_state, "running");
    assert_eq!(first.n_restarts, Some(0));
    assert!(first.main_pid.is_some());
    let status = first.status_text.clone().unwrap_or_default();
    assert!(status.contains("serving /healthz"), "{status}");
    let first_id = first
        .invocation_id
        .expect("running unit has an invocation id");
    assert_eq!(
        node.http_get(10248, "/healthz"),
        Ok((200, "ok".to_string()))
    );

    let restarted = systemd.restart(KUBELET, JOB).expect("restart kubelet");
    let second_id = restarted.state.invocation_id.expect("invocation id");
    assert_ne!(first_id, second_id, "restart must start a new invocation");
    assert!(restarted.state.is_active());
    assert_ne!(restarted.state.main_pid, first.main_pid);

    // Starting a running unit is a no-op: same invocation.
    let again = systemd.start(KUBELET, JOB).expect("start running kubelet");
    assert_eq!(again.state.invocation_id, Some(second_id));

    // try-restart restarts a running unit...
    let tried = systemd.try_restart(KUBELET, JOB).expect("try-restart");
    assert_ne!(tried.state.invocation_id, Some(second_id));
    // ...and leaves a stopped one stopped.
    let stopped = systemd.stop(KUBELET, JOB).expect("stop kubelet");
    assert_eq!(stopped.state.active_state, ActiveState::Inactive);
    assert_eq!(stopped.state.main_pid, None);
    let tried = systemd
        .try_restart(KUBELET, JOB)
        .expect("try-restart stopped");
    assert_eq!(tried.state.active_state, ActiveState::Inactive);
    assert!(
        node.http_get(10248, "/healthz").is_err(),
        "stopped kubelet answers"
    );
}

#[test]
fn automatic_restarts_are_counted() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    // Make Restart=always quick, through a drop-in and a daemon-reload.
    node.write_file(
        "/etc/systemd/system/kubelet.service.d/50-test.conf",
        "[Service]\nRestartSec=100ms\n",
        0o644,
    );
    systemd.daemon_reload().expect("daemon-reload");
    let before = systemd.unit_state(KUBELET).expect("state");
    assert_eq!(before.n_restarts, Some(0));

    systemd
        .kill_main(KUBELET, 9)
        .expect("kill kubelet's main process");
    let after = support::poll(|| {
        let s = systemd.unit_state(KUBELET).ok()?;
        (s.n_restarts == Some(1) && s.is_active()).then_some(s)
    })
    .unwrap_or_else(|| panic!("no automatic restart\n{}", node.journal("kubelet")));
    assert_ne!(after.invocation_id, before.invocation_id);
    assert_eq!(
        node.http_get(10248, "/healthz"),
        Ok((200, "ok".to_string()))
    );
}

#[test]
fn restart_with_an_invalid_config_fails_and_says_why() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    let good = node.read_file("/var/lib/kubelet/config.yaml");
    node.write_file(
        "/var/lib/kubelet/config.yaml",
        good.replace("maxPods: 110", "maxPods: 0"),
        0o644,
    );

    let err = systemd
        .restart(KUBELET, JOB)
        .expect_err("restart with maxPods: 0 must fail");
    assert_eq!(err.kind(), "job_failed", "{err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("restart kubelet.service: job failed; unit is "),
        "{msg}"
    );
    assert!(msg.contains("(result exit-code)"), "{msg}");
    assert!(
        msg.contains("maxPods \\\"0\\\" is not a positive integer"),
        "{msg}"
    );
    let state = err.unit_state().expect("state read after the failed job");
    assert!(state.is_failed(), "{state}");
    assert_eq!(state.result.as_deref(), Some("exit-code"));

    // Fixing the config and restarting brings it back.
    node.write_file("/var/lib/kubelet/config.yaml", good, 0o644);
    let ok = systemd
        .restart(KUBELET, JOB)
        .expect("restart after the fix");
    assert!(ok.state.is_active(), "{}", ok.state);
    assert_eq!(
        node.http_get(10248, "/healthz"),
        Ok((200, "ok".to_string()))
    );
}

#[test]
fn a_unit_that_dies_after_its_job_is_reported_failed() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    // Type=oneshot with RemainAfterExit: the job waits for ExecStart, which fails.
    node.write_file(
        "/etc/systemd/system/broken.service",
        "[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/sh -c 'exit 3'\n",
        0o644,
    );
    let systemd = node.connect();
    systemd.daemon_reload().expect("daemon-reload");
    let err = systemd
        .start("broken.service", JOB)
        .expect_err("failing unit");
    assert_eq!(err.kind(), "job_failed", "{err}");
    assert!(
        err.to_string().starts_with(
            "start broken.service: job failed; unit is failed/failed (result exit-code)"
        ),
        "{err}"
    );
    systemd
        .reset_failed("broken.service")
        .expect("reset-failed");
    let state = systemd.unit_state("broken.service").expect("state");
    assert_eq!(state.active_state, ActiveState::Inactive, "{state}");

    // A oneshot that succeeds is a successful start even though it ends inactive.
    node.write_file(
        "/etc/systemd/system/once.service",
        "[Service]\nType=oneshot\nExecStart=/bin/true\n",
        0o644,
    );
    systemd.daemon_reload().expect("daemon-reload");
    let once = systemd.start("once.service", JOB).expect("oneshot start");
    assert_eq!(once.state.active_state, ActiveState::Inactive);
    assert_eq!(once.state.result.as_deref(), Some("success"));
}

#[test]
fn daemon_reload_makes_systemd_see_unit_changes() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.install_kubelet_standin();
    node.write_file(
        "/etc/systemd/system/kubelet.service.d/60-version.conf",
        "[Service]\nEnvironment=KUBELET_STANDIN_VERSION=v1.31.2\n",
        0o644,
    );
    // Without a reload, systemd still runs the old definition.
    let old = systemd.restart(KUBELET, JOB).expect("restart");
    let status = old.state.status_text.unwrap_or_default();
    assert!(status.contains("v1.30.4"), "{status}");

    systemd.daemon_reload().expect("daemon-reload");
    let new = systemd.restart(KUBELET, JOB).expect("restart");
    let status = new.state.status_text.unwrap_or_default();
    assert!(status.contains("v1.31.2"), "{status}");
}

#[test]
fn reload_runs_exec_reload_and_keeps_the_invocation() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    node.write_file(
        "/etc/systemd/system/reloadable.service",
        "[Service]\nExecStart=/bin/sleep infinity\n\
         ExecReload=/bin/sh -c 'touch /run/reloaded'\n",
        0o644,
    );
    let systemd = node.connect();
    systemd.daemon_reload().expect("daemon-reload");
    let started = systemd.start("reloadable.service", JOB).expect("start");
    let reloaded = systemd.reload("reloadable.service", JOB).expect("reload");
    assert_eq!(reloaded.state.invocation_id, started.state.invocation_id);
    assert!(
        node.path("/run/reloaded").exists(),
        "ExecReload did not run"
    );

    // A unit without ExecReload cannot reload: systemd refuses the job outright.
    let err = systemd
        .reload("dbus.socket", JOB)
        .expect_err("sockets cannot reload");
    assert_eq!(err.kind(), "dbus", "{err}");
    assert!(err.to_string().starts_with("reload dbus.socket: "), "{err}");
}

#[test]
fn unknown_units_and_bad_names_are_reported_as_such() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.connect();
    let err = systemd
        .start("no-such-thing.service", JOB)
        .expect_err("unknown unit");
    assert_eq!(err.kind(), "no_such_unit", "{err}");
    assert!(
        err.to_string()
            .starts_with("start no-such-thing.service: no such unit: "),
        "{err}"
    );
    let state = systemd
        .unit_state("no-such-thing.service")
        .expect("state of a unit without a file");
    assert_eq!(state.load_state, LoadState::NotFound);
    let err = systemd
        .unit_file_state("no-such-thing.service")
        .expect_err("no unit file");
    assert_eq!(err.kind(), "no_such_unit", "{err}");
    let err = systemd
        .restart("kubelet; rm -rf /", JOB)
        .expect_err("bad name");
    assert_eq!(err.kind(), "invalid_unit_name", "{err}");
}

#[test]
fn unit_files_can_be_enabled_disabled_masked_and_unmasked() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    // A vendor unit, as a package installs it.
    node.write_file(
        "/usr/lib/systemd/system/hello.service",
        "[Service]\nExecStart=/bin/sleep infinity\n[Install]\nWantedBy=multi-user.target\n",
        0o644,
    );
    node.write_file(
        "/usr/lib/systemd/system/static.service",
        "[Service]\nExecStart=/bin/true\n",
        0o644,
    );
    let systemd = node.connect();
    systemd.daemon_reload().expect("daemon-reload");
    let state = |unit: &str| systemd.unit_file_state(unit).expect("unit file state");
    let wants = "/etc/systemd/system/multi-user.target.wants/hello.service";
    assert_eq!(state("hello.service"), UnitFileState::Disabled);

    let enabled = systemd
        .enable_unit_files(&["hello.service"])
        .expect("enable");
    assert_eq!(enabled.carries_install_info, Some(true));
    assert!(
        enabled
            .changes
            .iter()
            .any(|c| c.kind == "symlink" && c.path == wants),
        "{enabled:?}"
    );
    assert_eq!(state("hello.service"), UnitFileState::Enabled);
    assert!(node.path(wants).symlink_metadata().is_ok());
    // Enabling again changes nothing.
    let again = systemd
        .enable_unit_files(&["hello.service"])
        .expect("enable again");
    assert!(again.changes.is_empty(), "{again:?}");

    let disabled = systemd
        .disable_unit_files(&["hello.service"])
        .expect("disable");
    assert!(
        disabled
            .changes
            .iter()
            .any(|c| c.kind == "unlink" && c.path == wants)
    );
    assert_eq!(state("hello.service"), UnitFileState::Disabled);
    assert!(node.path(wants).symlink_metadata().is_err());

    systemd.mask_unit_files(&["hello.service"]).expect("mask");
    assert_eq!(state("hello.service"), UnitFileState::Masked);
    systemd.daemon_reload().expect("daemon-reload");
    let err = systemd
        .start("hello.service", JOB)
        .expect_err("start a masked unit");
    assert_eq!(err.kind(), "unit_masked", "{err}");
    systemd
        .unmask_unit_files(&["hello.service"])
        .expect("unmask");
    assert_eq!(state("hello.service"), UnitFileState::Disabled);

    // No [Install] section: enabling is possible but does nothing, and says so.
    assert_eq!(state("static.service"), UnitFileState::Static);
    let enabled = systemd
        .enable_unit_files(&["static.service"])
        .expect("enable static");
    assert_eq!(enabled.carries_install_info, Some(false));
    assert!(enabled.changes.is_empty());

    // Masking never overwrites a real unit file in /etc (no force).
    node.write_file(
        "/etc/systemd/system/local.service",
        "[Service]\nExecStart=/bin/true\n",
        0o644,
    );
    let err = systemd
        .mask_unit_files(&["local.service"])
        .expect_err("mask over a unit file");
    assert!(err.to_string().starts_with("mask local.service: "), "{err}");
    assert!(
        node.read_file("/etc/systemd/system/local.service")
            .contains("ExecStart")
    );
}

#[test]
fn a_job_that_takes_too_long_times_out() {
    let Some(node) = SandboxNode::boot() else {
        return;
    };
    node.write_file(
        "/etc/systemd/system/slow.service",
        "[Service]\nType=oneshot\nExecStart=/bin/sleep 60\n",
        0o644,
    );
    let systemd = node.connect();
    systemd.daemon_reload().expect("daemon-reload");
    let began = Instant::now();
    let err = systemd
        .start("slow.service", Duration::from_millis(700))
        .expect_err("a 60 s start cannot finish in 0.7 s");
    let waited = began.elapsed();
    assert_eq!(err.kind(), "timeout", "{err}");
    assert!(
        waited >= Duration::from_millis(700) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.starts_with("start slow.service: timed out after 0."),
        "{msg}"
    );
    assert!(
        msg.contains("waiting for job /org/freedesktop/systemd1/job/"),
        "{msg}"
    );
    assert!(msg.contains("activating/start"), "{msg}");
    // The job is still there; stopping the unit cancels it.
    systemd.stop("slow.service", JOB).expect("stop slow unit");
}

#[test]
fn reboot_takes_the_node_down() {
    let Some(mut node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.connect();
    systemd.reboot().expect("reboot");
    assert!(
        node.wait_stopped(Duration::from_secs(60)),
        "the sandbox did not go down after a reboot request"
    );
    // The bus went with it: calls fail instead of hanging.
    let began = Instant::now();
    let err = systemd
        .unit_state(KUBELET)
        .expect_err("bus is gone after the reboot");
    assert!(began.elapsed() < Duration::from_secs(25), "{err}");
}

#[test]
fn a_dead_bus_is_a_clear_connect_error() {
    // No socket at all.
    let err = Systemd::connect(
        "unix:path=/nonexistent/inplace-agent/bus",
        Duration::from_secs(2),
    )
    .expect_err("no bus there");
    assert_eq!(err.kind(), "connect", "{err}");
    let msg = err.to_string();
    assert!(
        msg.starts_with("connect to system bus unix:path=/nonexistent/inplace-agent/bus: "),
        "{msg}"
    );
    assert!(msg.contains("No such file or directory"), "{msg}");

    // A socket that accepts connections but never answers (a hung bus daemon).
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bus");
    let _listener = UnixListener::bind(&path).expect("bind socket");
    let began = Instant::now();
    let err = Systemd::connect(&unix_path_address(&path), Duration::from_millis(500))
        .expect_err("nobody answers");
    assert!(began.elapsed() < Duration::from_secs(5));
    assert_eq!(err.kind(), "connect", "{err}");
    assert!(err.to_string().ends_with("no answer within 0.5s"), "{err}");
}

#[test]
fn a_bus_that_dies_under_a_connection_fails_calls() {
    let Some(mut node) = SandboxNode::boot() else {
        return;
    };
    let systemd = node.connect();
    let address = node.bus_address();
    node.kill();
    let err = systemd
        .restart("dbus.service", JOB)
        .expect_err("bus is dead");
    assert!(matches!(err.kind(), "dbus" | "timeout"), "{err}");
    assert!(
        err.to_string().starts_with("restart dbus.service: "),
        "{err}"
    );
    let err = Systemd::connect(&address, Duration::from_secs(2)).expect_err("no bus");
    assert_eq!(err.kind(), "connect", "{err}");
}

#[test]
fn parallel_sandboxes_do_not_see_each_other() {
    let (Some(a), Some(b)) = (SandboxNode::boot(), SandboxNode::boot()) else {
        return;
    };
    assert_ne!(a.pid(), b.pid());
    // Both serve 127.0.0.1:10248, each in its own network namespace.
    let sa = a.install_kubelet_standin();
    let sb = b.install_kubelet_standin();
    let b_before = sb.unit_state(KUBELET).expect("b state");
    sa.restart(KUBELET, JOB).expect("restart in a");
    sa.stop(KUBELET, JOB).expect("stop in a");
    let b_after = sb.unit_state(KUBELET).expect("b state");
    assert_eq!(b_after.invocation_id, b_before.invocation_id);
    assert!(b_after.is_active(), "{b_after}");
    assert_eq!(b.http_get(10248, "/healthz"), Ok((200, "ok".to_string())));
    assert!(a.http_get(10248, "/healthz").is_err());
}

#[test]
fn torn_down_sandboxes_leave_nothing_behind() {
    let mut ids = Vec::new();
    for _ in 0..3 {
        let Some(node) = SandboxNode::boot() else {
            return;
        };
        ids.push(node.id().to_string());
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    for id in &ids {
        assert!(
            !mountinfo.contains(id.as_str()),
            "mount of {id} left behind"
        );
        let dir = Path::new(sandbox::SANDBOX_BASE).join(id);
        assert!(!dir.exists(), "{} left behind", dir.display());
        for hierarchy in ["systemd", "unified", "memory", "pids"] {
            let cg = format!("/sys/fs/cgroup/{hierarchy}/inplace-sandbox-{id}");
            assert!(!Path::new(&cg).exists(), "{cg} left behind");
        }
    }
    assert!(
        !mountinfo.contains("inplace-sandbox"),
        "a sandbox mount is visible on the host"
    );
}

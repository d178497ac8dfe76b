//! Starting the agent, and what it says when it cannot (issue 46, items 5 to 8), through the
//! real binary: `serve` names every problem at once (the node name does not hide the TLS
//! files), `serve --check-configured` is not fooled into "configured" by another problem, an
//! argument that came from an `INPLACE_AGENT_*` variable is named as such, a port already in
//! use names the process that holds it, and a key whose section header is still commented out
//! (the packaged config.toml) says which header to uncomment.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::support::pki::NodePki;
use crate::support::{Node, bin, text};
use inplace_api::pki::DEFAULT_UPDATER_IDENTITY;

const NODE: &str = "test-node";

/// The variables of the agent's flags, removed so the host's environment plays no part.
const AGENT_VARS: &[&str] = &[
    "INPLACE_AGENT_ADDR",
    "INPLACE_AGENT_ROOT",
    "INPLACE_AGENT_STATE_DIR",
    "INPLACE_AGENT_CONFIG",
    "INPLACE_AGENT_SERVICES",
    "INPLACE_AGENT_BUS",
    "INPLACE_AGENT_STATUS_SOCKET",
    "INPLACE_AGENT_CA",
    "INPLACE_AGENT_CERT",
    "INPLACE_AGENT_KEY",
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
];

/// `inplace-agent ARGS` with a clean environment plus `env`.
fn agent(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args).stdin(Stdio::null());
    for var in AGENT_VARS {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

// === Item 5: every problem at once ===

#[test]
fn serve_names_every_problem_at_once_and_check_configured_is_not_fooled() {
    let node = Node::new();
    // No node name anywhere: no flag, no key, no <root>/etc/hostname.
    let _ = std::fs::remove_file(node.path("/etc/hostname"));
    let pki = node.beside("pki");
    let state = node.beside("state-is-a-file");
    std::fs::write(&state, "not a directory\n").unwrap();
    let (cert, key, ca) = (
        pki.join("server.crt"),
        pki.join("server.key"),
        pki.join("ca.crt"),
    );
    let args = |extra: &[&str]| -> Output {
        let mut a = vec![
            "serve",
            "--config",
            "/dev/null",
            "--root",
            s(node.root()),
            "--state-dir",
            s(&state),
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            s(&cert),
            "--tls-key",
            s(&key),
            "--client-ca",
            s(&ca),
            "--services",
            "off",
        ];
        a.extend_from_slice(extra);
        agent(&a, &[])
    };
    let out = args(&[]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    for expected in [
        "error: inplace-agent cannot serve with the configuration /dev/null (6 problems):",
        // The node name, with what to do.
        "node name: not set (node.name, --node-name)",
        "etc/hostname has none",
        "set node.name (or --node-name) to this node's Kubernetes name",
        // Each TLS file, with what to do.
        &format!("tls.cert {}: no such file", cert.display()),
        &format!("tls.key {}: no such file", key.display()),
        &format!("tls.client_ca {}: no such file", ca.display()),
        "inplace-agent pki init",
        // Nobody may call it.
        "authorization.admin is empty",
        // The state directory.
        &format!("node.state_dir {}: not a directory", state.display()),
        "point node.state_dir in /dev/null (or --state-dir) at a directory",
    ] {
        assert!(said.contains(expected), "{expected:?} not in:\n{said}");
    }
    assert!(
        !node.path("/var/lib/inplace-agent").exists(),
        "nothing is opened"
    );

    // The unit's ExecCondition=: no certificates, so not configured yet (exit 1, the unit is
    // skipped, not failed), and what else is wrong is named too.
    let out = args(&["--check-configured"]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("inplace-agent is not configured yet, so it does not start: missing ")
            && said.contains(&cert.display().to_string())
            && said.contains(&ca.display().to_string()),
        "{said}"
    );
    assert!(
        said.contains("once they are there it would still not start (3 problems):")
            && said.contains("node name: not set")
            && said.contains("authorization.admin is empty")
            && said.contains("node.state_dir"),
        "{said}"
    );

    // `config check` names them all the same way.
    let config = node.beside("config.toml");
    std::fs::write(
        &config,
        format!(
            "[node]\nroot = {:?}\nstate_dir = {:?}\n[tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n",
            s(node.root()),
            s(&state),
            s(&cert),
            s(&key),
            s(&ca)
        ),
    )
    .unwrap();
    let out = agent(&["config", "check", s(&config)], &[]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("serve would not start (6 problems)")
            && said.contains("node name: not set")
            && said.contains("tls.client_ca"),
        "{said}"
    );
}

// === Item 6: an argument from the environment ===

#[test]
fn an_argument_from_the_environment_is_named_as_such() {
    let node = Node::new();
    let root = s(node.root());
    let out = agent(
        &["drift", "--root", root],
        &[("INPLACE_AGENT_ADDR", "worker-1:9443")],
    );
    let said = text(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("cannot be used with")
            && said.contains(
                "hint: --addr comes from INPLACE_AGENT_ADDR in the environment, not from the \
                 command line: unset INPLACE_AGENT_ADDR or drop --root"
            ),
        "{said}"
    );

    // The other way round: the root from the environment, the address typed.
    let out = agent(
        &["status", "--addr", "worker-1:9443"],
        &[("INPLACE_AGENT_ROOT", root)],
    );
    let said = text(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("unset INPLACE_AGENT_ROOT or drop --addr"),
        "{said}"
    );

    // Both from the environment, nothing typed.
    let out = agent(
        &["status"],
        &[
            ("INPLACE_AGENT_ROOT", root),
            ("INPLACE_AGENT_ADDR", "worker-1:9443"),
        ],
    );
    let said = text(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("INPLACE_AGENT_ADDR")
            && said.contains("INPLACE_AGENT_ROOT")
            && said.contains("in the environment, not from the command line: unset"),
        "{said}"
    );

    // A bad value from the environment.
    let out = agent(
        &["check", "-", "--root", root],
        &[("INPLACE_AGENT_SERVICES", "maybe")],
    );
    let said = text(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains(
            "hint: the value of --services comes from INPLACE_AGENT_SERVICES in the environment"
        ),
        "{said}"
    );

    // Typed by hand, the same conflict has nothing to do with the environment.
    let out = agent(&["drift", "--root", root, "--addr", "worker-1:9443"], &[]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(!said.contains("environment"), "{said}");
}

// === Item 7: a port already in use ===

/// This process's name as the kernel has it (what the agent must report).
fn my_comm() -> String {
    std::fs::read_to_string("/proc/self/comm")
        .unwrap()
        .trim_end()
        .to_string()
}

#[test]
fn a_port_in_use_names_the_process_that_holds_it() {
    let node = Node::new();
    let pki = NodePki::new(NODE).unwrap();
    let f = &pki.files;
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = held.local_addr().unwrap().to_string();
    let serve = |extra: &[&str]| -> Output {
        let mut a = vec![
            "serve",
            "--config",
            "/dev/null",
            "--root",
            s(node.root()),
            "--node-name",
            NODE,
            "--no-chroot",
            "--services",
            "off",
            "--tls-cert",
            s(&f.server_cert),
            "--tls-key",
            s(&f.server_key),
            "--client-ca",
            s(&f.ca_cert),
            "--admin",
            DEFAULT_UPDATER_IDENTITY,
            "--status-group",
            "",
        ];
        a.extend_from_slice(extra);
        agent(&a, &[])
    };
    let me = format!("pid {} ({})", std::process::id(), my_comm());

    let out = serve(&["--listen", &addr]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains(&format!("listen on {addr}: the address is already in use, held by {me}"))
            && said.contains("stop that process, or set grpc.listen in the configuration file (or --listen) to a free address"),
        "{said}"
    );

    let out = serve(&["--listen", "127.0.0.1:0", "--metrics-listen", &addr]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains(&format!(
            "metrics listener on {addr}: the address is already in use, held by {me}"
        )) && said.contains("set metrics.listen in the configuration file (or --metrics-listen)"),
        "{said}"
    );
    drop(held);
}

// === Item 8: a key whose section header is still commented out ===

/// The packaged /etc/inplace-agent/config.toml.
fn packaged_config() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/config.toml"))
        .unwrap()
}

/// The 1-based number of the first line of `text` that is `line` once trimmed.
fn line_no(text: &str, line: &str) -> usize {
    text.lines()
        .position(|l| l.trim() == line)
        .unwrap_or_else(|| panic!("{line:?} is not a line of:\n{text}"))
        + 1
}

/// Uncomments the first line starting with `# {what}`.
fn uncomment(text: &str, what: &str) -> String {
    let mut done = false;
    text.lines()
        .map(|l| match l.strip_prefix("# ") {
            Some(rest) if !done && rest.starts_with(what) => {
                done = true;
                rest.to_string()
            }
            _ => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

fn check(file: &PathBuf, content: &str) -> (Option<i32>, String) {
    std::fs::write(file, content).unwrap();
    let out = agent(&["config", "check", s(file)], &[]);
    (out.status.code(), text(&out))
}

#[test]
fn a_key_under_a_commented_out_header_says_which_header_to_uncomment() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    let packaged = packaged_config();
    let header = line_no(&packaged, "# [authorization]");

    // The admin line uncommented, its header not: the case.
    let edited = uncomment(&packaged, "admin = ");
    let key_line = line_no(
        &edited,
        "admin = [\"spiffe://inplace-agent/updater\"]  # default: nobody",
    );
    let (code, said) = check(&file, &edited);
    assert_eq!(code, Some(2), "{said}");
    assert!(
        said.contains(&format!("line {key_line} key admin: unknown field `admin`"))
            && said.contains(&format!(
                "admin is a key of [authorization], and the header \"# [authorization]\" on line \
                 {header} is still commented out"
            ))
            && said.contains(&format!("uncomment \"[authorization]\" on line {header}")),
        "{said}"
    );
    // serve says the same.
    let out = agent(&["serve", "--config", s(&file)], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("uncomment \"[authorization]\" on line {header}")),
        "{}",
        text(&out)
    );

    // An earlier header uncommented: the key is read as one of [tls], and the nearest header
    // above it is still the commented one.
    let edited = uncomment(&uncomment(&packaged, "[tls]"), "admin = ");
    let (code, said) = check(&file, &edited);
    assert_eq!(code, Some(2), "{said}");
    assert!(
        said.contains("key tls.admin: unknown field `admin`")
            && said.contains(&format!("uncomment \"[authorization]\" on line {header}")),
        "{said}"
    );

    // Under the wrong header, with the right one elsewhere: move it there.
    let (code, said) = check(
        &file,
        "[grpc]\nadmin = []\n\n[authorization]\nreader = []\n",
    );
    assert_eq!(code, Some(2), "{said}");
    assert!(
        said.contains("line 2 key grpc.admin: unknown field `admin`")
            && said.contains("admin is a key of [authorization]")
            && said.contains("move it under the \"[authorization]\" header on line 4"),
        "{said}"
    );

    // No section has such a key: no guess.
    let (code, said) = check(&file, "[grpc]\nlisten_adress = \"x\"\n");
    assert_eq!(code, Some(2), "{said}");
    assert!(!said.contains("is a key of"), "{said}");
}

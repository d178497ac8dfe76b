//! An operator's first hour (issue 15): what a person meets around the plan errors — the
//! version they run, output into a closed pipe, hints that name real keys and flags.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use crate::support;
use crate::support::{Node, bin, header};

/// Runs the agent with its standard output a pipe whose reader goes away after `lines` lines
/// (`| head -n <lines>`); returns the exit status and standard error.
fn into_closed_pipe(cmd: &mut Command, lines: usize) -> (std::process::ExitStatus, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the agent");
    let stdout = child.stdout.take().unwrap();
    let mut reader = BufReader::new(stdout);
    for _ in 0..lines {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
    }
    drop(reader);
    let out = child.wait_with_output().expect("wait for the agent");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn version_names_the_commit_it_was_built_from() {
    let text = Command::new(bin()).arg("version").output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    let json = Command::new(bin())
        .args(["version", "-o", "json"])
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    match head {
        Some(head) => {
            assert!(text.contains(&format!("(commit {}", &head[..12])), "{text}");
            assert_eq!(json["commit"], head.as_str(), "{json:#}");
            assert!(json["modified"].is_boolean(), "{json:#}");
            assert!(!text.contains("unknown"), "{text}");
        }
        None => {
            assert!(
                text.contains("commit unknown: built without git metadata"),
                "{text}"
            );
            assert!(json["commit"].is_null(), "{json:#}");
        }
    }
}

#[test]
fn journal_into_a_closed_pipe_exits_quietly() {
    let node = Node::new();
    let plan = node.plan_file(
        "p.yaml",
        &format!(
            "{}changes:\n  - file: {{path: /etc/kubernetes/a.conf, content: \"a\\n\"}}\n",
            header("pipe")
        ),
    );
    let out = node.agent(&[
        "apply",
        "--services",
        "off",
        "--no-progress",
        plan.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", support::text(&out));
    for lines in [0, 1] {
        let (status, stderr) = into_closed_pipe(
            Command::new(bin())
                .arg("journal")
                .arg("--root")
                .arg(node.root()),
            lines,
        );
        assert_eq!(
            status.code(),
            Some(0),
            "| head -n {lines}: {status}\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(stderr.is_empty(), "nothing to say: {stderr}");
    }
}

#[test]
fn the_demo_into_a_closed_pipe_stops_quietly_and_removes_its_sandbox() {
    let tmp = tempfile::tempdir().unwrap();
    for lines in [0, 3] {
        let (status, stderr) = into_closed_pipe(
            Command::new(bin())
                .args(["demo", "--plain"])
                .env("TMPDIR", tmp.path())
                .env_remove("INPLACE_AGENT_CONFIG"),
            lines,
        );
        assert_eq!(
            status.code(),
            Some(0),
            "demo | head -n {lines}: {status}\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
        let left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "the demo left {left:?} in its TMPDIR");
    }
}

/// A change finished after a crash says what it wrote, as an uninterrupted run does, and the
/// progress line does not wrap "changed" twice (issue 15: "changed (changed (completed after
/// a restart))" on a real node).
#[cfg(feature = "failpoints")]
#[test]
fn a_change_finished_after_a_crash_still_says_what_it_wrote() {
    let node = Node::new();
    let plan = node.plan_file(
        "p.yaml",
        &format!(
            "{}changes:\n  - file: {{path: /etc/kubernetes/audit.yaml, content: \"kind: Policy\\n\", mode: \"0640\"}}\n",
            header("crash-detail")
        ),
    );
    let apply = |env: &[(&str, &str)]| {
        node.agent_env(
            &[
                "apply",
                "--services",
                "off",
                "--no-progress",
                "-o",
                "json",
                plan.to_str().unwrap(),
            ],
            env,
        )
    };
    let crashed = apply(&[("INPLACE_AGENT_CRASH_AT", "step.after_mutation")]);
    assert!(!crashed.status.success(), "{}", support::text(&crashed));
    let resumed = node.agent_env(
        &[
            "apply",
            "--services",
            "off",
            "--no-progress",
            plan.to_str().unwrap(),
        ],
        &[],
    );
    assert!(resumed.status.success(), "{}", support::text(&resumed));
    let said = support::text(&resumed);
    assert!(
        said.contains(
            "changes[0] file /etc/kubernetes/audit.yaml: changed (write /etc/kubernetes/audit.yaml (13 bytes, 0640 "
        ) && said.contains(" (completed after a restart))"),
        "{said}"
    );
    assert!(!said.contains("changed (changed"), "{said}");
    let status = apply(&[]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let message = status["changes"][0]["message"].as_str().unwrap_or_default();
    assert!(
        message.starts_with("write /etc/kubernetes/audit.yaml (13 bytes, 0640 ")
            && message.ends_with(" (completed after a restart)"),
        "{status:#}"
    );
}

/// After a crash, with no agent running, `status` says so and where the plan will resume,
/// instead of "running ... for 2.7s" (issue 15).
#[cfg(feature = "failpoints")]
#[test]
fn status_after_a_crash_says_the_agent_is_not_running_and_where_the_plan_resumes() {
    let node = Node::new();
    let plan = node.plan_file(
        "p.yaml",
        &format!(
            "{}changes:\n  - file: {{path: /etc/kubernetes/a.conf, content: \"a\\n\"}}\n  - file: {{path: /etc/kubernetes/b.conf, content: \"b\\n\"}}\nverify:\n  - command: {{argv: [\"true\"]}}\n",
            header("crashed")
        ),
    );
    let crashed = node.agent_env(
        &[
            "apply",
            "--services",
            "off",
            "--no-progress",
            plan.to_str().unwrap(),
        ],
        &[("INPLACE_AGENT_CRASH_AT", "step.after_mutation@2")],
    );
    assert!(!crashed.status.success(), "{}", support::text(&crashed));
    let status = |args: &[&str]| {
        Command::new(bin())
            .arg("status")
            .arg("--root")
            .arg(node.root())
            .args(args)
            .env_remove("INPLACE_AGENT_CONFIG")
            .output()
            .unwrap()
    };
    let out = status(&[]);
    let shown = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        shown.contains("unfinished: plan crashed attempt 1")
            && shown.contains("the agent is not running: the plan stopped in Applying, step 2/3")
            && shown.contains(
                "it resumes at changes[1] file /etc/kubernetes/b.conf (step 2/3) when the agent starts"
            ),
        "{}",
        support::text(&out)
    );
    assert!(!shown.contains("running: plan"), "{shown}");
    let out = status(&["-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["source"], "journal", "{v:#}");
    assert_eq!(
        v["current"]["resumesAt"], "changes[1] file /etc/kubernetes/b.conf (step 2/3)",
        "{v:#}"
    );
    assert!(v["current"].get("elapsedMs").is_none(), "{v:#}");
}

//! Invalid plans: each exits 2 with an error naming the change and the field, and the node
//! tree (including the agent's state directory) is exactly as before.

use crate::support;
use crate::support::{Node, header, text};

const H: &str = "apiVersion: inplace.agent/v1\nkind: Plan\nid: ns/m@bad\n";

/// (name, plan text, fragments the error output must contain)
fn cases() -> Vec<(&'static str, String, Vec<&'static str>)> {
    let file = |body: &str| format!("{H}changes:\n  - file: {body}\n");
    let big = "A".repeat(6 << 20);
    vec![
        (
            "path traversal",
            file("{path: /etc/kubernetes/../shadow, content: x}"),
            vec!["changes[0].file.path", "contains '..'"],
        ),
        (
            "relative path",
            file("{path: etc/kubernetes/x, content: x}"),
            vec!["changes[0].file.path", "is not absolute"],
        ),
        (
            "symlink dir pointing outside the root",
            file("{path: /etc/kubernetes/evil/etc/shadow, content: x}"),
            vec![
                "changes[0].file.path",
                "resolves through a symlink to /etc/shadow",
            ],
        ),
        (
            "symlink as the file",
            file("{path: /etc/kubernetes/link, content: x}"),
            vec!["changes[0].file.path", "is a symlink to /etc/passwd"],
        ),
        (
            "dangling absolute symlink",
            file("{path: /etc/kubernetes/host/x, content: x}"),
            vec![
                "changes[0].file.path",
                "is a symlink to /nonexistent-on-purpose",
            ],
        ),
        (
            "outside the allow-list",
            file("{path: /etc/shadow, content: x}"),
            vec!["changes[0].file.path", "outside the allow-list"],
        ),
        (
            "root's ssh keys",
            file("{path: /root/.ssh/authorized_keys, content: x}"),
            vec!["changes[0].file.path", "outside the allow-list"],
        ),
        (
            "NUL byte in a path",
            format!("{H}changes:\n  - file: {{path: \"/etc/kubernetes/a\\0b\", content: x}}\n"),
            vec!["changes[0].file.path", "NUL"],
        ),
        (
            "bad mode",
            file("{path: /etc/kubernetes/x, content: x, mode: \"0999\"}"),
            vec!["changes[0].file.mode", "\"0999\" is not an octal mode"],
        ),
        (
            "numeric mode",
            file("{path: /etc/kubernetes/x, content: x, mode: 420}"),
            vec!["changes[0].file.mode", "quoted octal string"],
        ),
        (
            "bad encoding",
            file("{path: /etc/kubernetes/x, content: x, encoding: rot13}"),
            vec!["changes[0].file.encoding", "is not one of plain, base64"],
        ),
        (
            "bad base64",
            file("{path: /etc/kubernetes/x, content: \"not base64!\", encoding: base64}"),
            vec!["changes[0].file.content", "is not valid base64"],
        ),
        (
            "gzip+base64 that is not gzip",
            file("{path: /etc/kubernetes/x, content: aGVsbG8=, encoding: gzip+base64}"),
            vec!["changes[0].file.content", "is not valid gzip"],
        ),
        (
            "unknown user",
            file("{path: /etc/kubernetes/x, content: x, owner: \"nosuchuser:root\"}"),
            vec![
                "changes[0].file.owner",
                "user \"nosuchuser\" does not exist on the node",
            ],
        ),
        (
            "unknown group",
            file("{path: /etc/kubernetes/x, content: x, owner: \"root:nosuchgroup\"}"),
            vec![
                "changes[0].file.owner",
                "group \"nosuchgroup\" does not exist",
            ],
        ),
        (
            "owner syntax",
            file("{path: /etc/kubernetes/x, content: x, owner: \"Root:root\"}"),
            vec!["changes[0].file.owner", "is not a valid user name"],
        ),
        (
            "same path twice",
            format!(
                "{H}changes:\n  - file: {{path: /etc/kubernetes/x, content: a}}\n  - absent: {{path: /etc/kubernetes/x}}\n"
            ),
            vec!["changes[1].absent.path", "is also managed by changes[0]"],
        ),
        (
            "kubelet config twice",
            format!(
                "{H}changes:\n  - file: {{path: /var/lib/kubelet/config.yaml, content: a}}\n  - kubeletConfig: {{mergePatch: {{maxPods: 1}}}}\n"
            ),
            vec![
                "changes[1].kubeletConfig.mergePatch",
                "also managed by changes[0]",
            ],
        ),
        (
            "oversized content",
            file(&format!("{{path: /etc/kubernetes/x, content: {big}}}")),
            vec!["changes[0].file.content", "more than the limit"],
        ),
        (
            "malformed YAML",
            format!("{H}changes:\n  - file: {{path: /etc/kubernetes/x\n"),
            vec!["malformed YAML"],
        ),
        (
            "malformed JSON",
            "{\"apiVersion\": \"inplace.agent/v1\", \"kind\": \"Plan\",".to_string(),
            vec!["malformed JSON"],
        ),
        (
            "merge patch not an object",
            format!("{H}changes:\n  - kubeletConfig: {{mergePatch: [1, 2]}}\n"),
            vec![
                "changes[0].kubeletConfig.mergePatch",
                "must be an object (an RFC 7386 merge patch), got a list",
            ],
        ),
        (
            "merge patch changes kind",
            format!("{H}changes:\n  - kubeletConfig: {{mergePatch: {{kind: Pod}}}}\n"),
            vec![
                "changes[0].kubeletConfig.mergePatch.kind",
                "cannot be changed",
            ],
        ),
        (
            "flag with dashes",
            format!("{H}changes:\n  - kubeletFlags: {{set: {{--node-labels: a=b}}}}\n"),
            vec![
                "changes[0].kubeletFlags.set[\"--node-labels\"]",
                "without leading dashes",
            ],
        ),
        (
            "flag value with a space",
            format!("{H}changes:\n  - kubeletFlags: {{set: {{node-labels: \"a=b c=d\"}}}}\n"),
            vec![
                "changes[0].kubeletFlags.set[\"node-labels\"]",
                "must not contain whitespace",
            ],
        ),
        (
            "flag set and removed",
            format!("{H}changes:\n  - kubeletFlags: {{set: {{v: \"2\"}}, remove: [v]}}\n"),
            vec!["changes[0].kubeletFlags.remove[0]", "both set and removed"],
        ),
        (
            "unknown change kind",
            format!("{H}changes:\n  - fiel: {{path: /etc/kubernetes/x}}\n"),
            vec![
                "changes[0]",
                "unknown change kind \"fiel\" (did you mean \"file\"?)",
            ],
        ),
        (
            "two kinds in one change",
            format!(
                "{H}changes:\n  - file: {{path: /etc/kubernetes/x, content: a}}\n    absent: {{path: /etc/kubernetes/y}}\n"
            ),
            vec!["changes[0]", "exactly one change kind"],
        ),
        (
            "unknown field",
            file("{path: /etc/kubernetes/x, content: x, permissions: \"0644\"}"),
            vec!["changes[0].file.permissions", "unknown field"],
        ),
        (
            "missing id",
            "apiVersion: inplace.agent/v1\nkind: Plan\nchanges: []\n".to_string(),
            vec!["id: is required"],
        ),
        (
            "wrong apiVersion",
            "apiVersion: v2\nkind: Plan\nid: x\n".to_string(),
            vec!["apiVersion: \"v2\" is not supported"],
        ),
        (
            "bad sysctl key",
            format!("{H}changes:\n  - sysctl: {{key: \"../../etc/passwd\", value: \"1\"}}\n"),
            vec!["changes[0].sysctl.key", "is not a sysctl key"],
        ),
        (
            "unknown check kind",
            format!("{H}verify:\n  - tcpConnect: {{port: 1}}\n"),
            vec!["verify[0]", "unknown check kind \"tcpConnect\""],
        ),
        (
            "check URL scheme",
            format!("{H}verify:\n  - httpGet: {{url: \"ftp://x/y\"}}\n"),
            vec!["verify[0].httpGet.url", "scheme \"ftp\" is not supported"],
        ),
        (
            "timeout out of range",
            format!(
                "{H}verify:\n  - httpGet: {{url: \"http://127.0.0.1:1/\", timeoutSeconds: 0}}\n"
            ),
            vec![
                "verify[0].httpGet.timeoutSeconds",
                "must be a whole number from 1 to 3600",
            ],
        ),
        (
            "kubelet config missing on the node",
            format!("{H}changes:\n  - kubeletConfig: {{mergePatch: {{maxPods: 10}}}}\n"),
            vec![
                "changes[0].kubeletConfig.mergePatch",
                "does not exist on this node",
            ],
        ),
        (
            "node name syntax",
            format!("{H}nodeName: Worker_1\n"),
            vec!["nodeName", "is not a valid node name"],
        ),
        ("empty plan", String::new(), vec!["plan is empty"]),
        (
            "artifact over plain http",
            format!(
                "{H}changes:\n  - artifact: {{url: \"http://mirror.local/kubelet\", sha256: \"{}\", path: /usr/local/bin/kubelet}}\n",
                "a".repeat(64)
            ),
            vec![
                "changes[0].artifact.url",
                "plain http to mirror.local is not allowed",
            ],
        ),
        (
            "content of the wrong type",
            file("{path: /etc/kubernetes/x, content: [a, b]}"),
            vec!["changes[0].file.content", "must be a string, got a list"],
        ),
        (
            "unit name",
            format!("{H}changes:\n  - unit: {{name: kubelet, state: running}}\n"),
            vec!["changes[0].unit.name", "is not a valid systemd unit name"],
        ),
        (
            "no package manager on this node",
            format!("{H}changes:\n  - package: {{name: kubelet, version: 1.31.2-1.1}}\n"),
            vec![
                "changes[0].package.manager",
                "found neither /var/lib/dpkg/status with /usr/bin/apt-get nor an rpm database",
            ],
        ),
        (
            "package manager not on this node",
            format!(
                "{H}changes:\n  - package: {{name: kubelet, version: 1.31.2-1.1, manager: dnf}}\n"
            ),
            vec![
                "changes[0].package.manager",
                "dnf cannot be used: no rpm database",
            ],
        ),
        (
            "exec disabled",
            format!("{H}changes:\n  - exec: {{argv: [\"true\"]}}\n"),
            vec!["changes[0] exec", "exec changes are disabled on this node"],
        ),
    ]
}

#[test]
fn invalid_plans_exit_2_name_the_field_and_change_nothing() {
    let node = Node::new();
    let k = node.path("etc/kubernetes");
    std::os::unix::fs::symlink("/", k.join("evil")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", k.join("link")).unwrap();
    std::os::unix::fs::symlink("/nonexistent-on-purpose", k.join("host")).unwrap();
    let cases = cases();
    assert!(cases.len() >= 30, "at least 30 distinct invalid plans");
    let before = node.snapshot();
    for (name, plan, want) in &cases {
        let mut plan = plan.clone();
        if *name == "kubelet config missing on the node" {
            std::fs::rename(
                node.path("var/lib/kubelet/config.yaml"),
                node.path("var/lib/kubelet/config.yaml.away"),
            )
            .unwrap();
        }
        let path = node.plan_file("bad.yaml", &std::mem::take(&mut plan));
        let out = node.agent(&["apply", path.to_str().unwrap()]);
        let msg = text(&out);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{name}: expected exit 2, got {:?}: {msg}",
            out.status
        );
        for w in want {
            assert!(
                msg.contains(w),
                "{name}: error does not contain {w:?}:\n{msg}"
            );
        }
        // `check` agrees that the plan is unusable, also without writing anything.
        let out = node.agent(&["check", path.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{name}: check: {}", text(&out));
        if *name == "kubelet config missing on the node" {
            std::fs::rename(
                node.path("var/lib/kubelet/config.yaml.away"),
                node.path("var/lib/kubelet/config.yaml"),
            )
            .unwrap();
        }
        assert_eq!(
            support::diff(&before, &node.snapshot()),
            Vec::<String>::new(),
            "{name} changed the tree"
        );
    }
}

#[test]
fn all_errors_of_a_plan_are_reported_at_once_as_json() {
    let node = Node::new();
    let plan = node.plan_file(
        "bad.yaml",
        &format!(
            "{}changes:\n  - file: {{path: /etc/kubernetes/a, content: x, mode: \"0999\"}}\n  - file: {{path: relative, content: x}}\n  - sysctl: {{key: \"a\", value: \"\"}}\n",
            header("ns/m@many")
        ),
    );
    let out = node.agent(&["apply", "--output", "json", plan.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["kind"], "InvalidPlan");
    let fields: Vec<&str> = v["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["field"].as_str().unwrap())
        .collect();
    assert_eq!(
        fields,
        [
            "changes[0].file.mode",
            "changes[1].file.path",
            "changes[2].sysctl.key",
            "changes[2].sysctl.value"
        ]
    );
}

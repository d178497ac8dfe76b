use proptest::prelude::*;
use serde_json::{Value, json};

use super::*;

const TOKEN: &str = "abcdef.0123456789abcdef";

const WORKER_CLOUD_CONFIG: &str =
    include_str!("../../../../../tests/fixtures/updater/bootstrap-data/worker.cloud-config");
const CONTROL_PLANE_CLOUD_CONFIG: &str =
    include_str!("../../../../../tests/fixtures/updater/bootstrap-data/control-plane.cloud-config");
const WORKER_IGNITION: &str =
    include_str!("../../../../../tests/fixtures/updater/bootstrap-data/worker.ignition.json");
const CONTROL_PLANE_IGNITION: &str = include_str!(
    "../../../../../tests/fixtures/updater/bootstrap-data/control-plane.ignition.json"
);
const CAN_UPDATE_MACHINE: &str =
    include_str!("../../../../../tests/fixtures/updater/can-update-machine-request.json");
const UPDATE_MACHINE: &str =
    include_str!("../../../../../tests/fixtures/updater/update-machine-request.json");

/// The nodes of a value as [`Budget`] counts them: each scalar, list, map and map key.
fn count(v: &Value) -> (usize, usize) {
    match v {
        Value::Array(items) => items.iter().map(count).fold((1, 0), add),
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| add((1, k.len()), count(v)))
            .fold((1, 0), add),
        Value::String(s) => (1, s.len()),
        _ => (1, 0),
    }
}

fn add(a: (usize, usize), b: (usize, usize)) -> (usize, usize) {
    (a.0 + b.0, a.1 + b.1)
}

fn depth(v: &Value) -> usize {
    match v {
        Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
        Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// The classic shape: each level a list of ten aliases of the level before, `levels` deep
/// (ten to the `levels` scalars once expanded).
fn laughs(levels: usize) -> String {
    let mut doc = String::from(
        "#cloud-config\na0: &a0 [\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\",\"lol\"]\n",
    );
    for i in 1..=levels {
        let prev = format!("*a{}", i - 1);
        let items = [prev.as_str(); 10].join(",");
        doc.push_str(&format!("a{i}: &a{i} [{items}]\n"));
    }
    doc
}

/// The shape: one anchored list in `write_files` and many aliases to it (13.5 KB).
fn one_list_many_aliases() -> String {
    let mut doc = String::from("## template: jinja\n#cloud-config\nwrite_files:\n- &f\n");
    for i in 0..20 {
        doc.push_str(&format!(
            "  - {{path: /etc/x{i}, content: \"{}\"}}\n",
            "y".repeat(40)
        ));
    }
    doc.push_str("runcmd:\n");
    while doc.len() < 13_500 {
        doc.push_str("- *f\n");
    }
    doc
}

fn over(e: &ParseError, limit: Limit) {
    assert_eq!(e.limit(), Some(limit), "{e}");
}

#[test]
fn real_bootstrap_data_and_requests_read_as_serde_reads_them() {
    for doc in [WORKER_CLOUD_CONFIG, CONTROL_PLANE_CLOUD_CONFIG] {
        let got = yaml(doc, &Limits::BOOTSTRAP_YAML).unwrap();
        let want: Value = serde_yaml_ng::from_str(doc).unwrap();
        assert_eq!(got.value(), &want);
        assert_eq!((got.nodes(), got.scalar_bytes()), count(&want));
        assert!(got.nodes() < 500, "{}", got.nodes());
    }
    for doc in [WORKER_IGNITION, CONTROL_PLANE_IGNITION] {
        let got = json(doc.as_bytes(), &Limits::BOOTSTRAP_JSON).unwrap();
        let want: Value = serde_json::from_str(doc).unwrap();
        assert_eq!(got.value(), &want);
        assert_eq!((got.nodes(), got.scalar_bytes()), count(&want));
    }
    for doc in [CAN_UPDATE_MACHINE, UPDATE_MACHINE] {
        let got = json(doc.as_bytes(), &Limits::REQUEST_BODY).unwrap();
        let want: Value = serde_json::from_str(doc).unwrap();
        assert_eq!(got.into_value(), want);
    }
}

#[test]
fn billion_laughs_are_refused_at_the_node_limit() {
    // Refused at the limit, so never expanded: the work is bounded by the limit, not by the
    // document (how fast is `--bench updater`'s, never a timed assertion here).
    for doc in [laughs(9), laughs(30), one_list_many_aliases()] {
        let e = yaml(&doc, &Limits::BOOTSTRAP_YAML).unwrap_err();
        over(&e, Limit::Nodes);
        assert!(e.to_string().contains("node count limit of 100000"), "{e}");
        assert!(e.to_string().contains("at line "), "{e}");
    }
    // Small enough and it reads, expanded.
    let small = yaml(&laughs(2), &Limits::BOOTSTRAP_YAML).unwrap();
    assert_eq!(small.value()["a2"].as_array().unwrap().len(), 10);
    assert_eq!(small.value()["a2"][9][9], json!(vec!["lol"; 10]));
}

#[test]
fn a_long_string_aliased_is_refused_at_the_scalar_bytes_limit() {
    let mut doc = format!("s: &s \"{}\"\nl:\n", "z".repeat(100_000));
    for _ in 0..50 {
        doc.push_str("- *s\n");
    }
    let e = yaml(&doc, &Limits::BOOTSTRAP_YAML).unwrap_err();
    over(&e, Limit::ScalarBytes);
    assert!(
        e.to_string().contains("scalar bytes limit of 4194304"),
        "{e}"
    );
}

#[test]
fn nesting_deeper_than_the_limit_is_refused_in_both_syntaxes() {
    let nested = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let limit = Limits::BOOTSTRAP_YAML.depth;
    assert_eq!(
        depth(
            yaml(&nested(limit), &Limits::BOOTSTRAP_YAML)
                .unwrap()
                .value()
        ),
        limit
    );
    assert_eq!(
        depth(
            json(nested(limit).as_bytes(), &Limits::BOOTSTRAP_JSON)
                .unwrap()
                .value()
        ),
        limit
    );
    let e = yaml(&nested(limit + 1), &Limits::BOOTSTRAP_YAML).unwrap_err();
    over(&e, Limit::Depth);
    assert!(
        e.to_string().contains("nesting depth limit of 64 levels"),
        "{e}"
    );
    let e = json(nested(limit + 1).as_bytes(), &Limits::BOOTSTRAP_JSON).unwrap_err();
    over(&e, Limit::Depth);
    // Maps too, and deeper than the parsers' own recursion limits.
    let maps = format!("{}1{}", "{\"a\":".repeat(500), "}".repeat(500));
    over(
        &json(maps.as_bytes(), &Limits::BOOTSTRAP_JSON).unwrap_err(),
        Limit::Depth,
    );
    over(
        &yaml(&maps, &Limits::BOOTSTRAP_YAML).unwrap_err(),
        Limit::Depth,
    );
}

#[test]
fn a_document_over_the_size_limit_is_not_parsed() {
    let big = format!("#cloud-config\nx: \"{}\"\n", "a".repeat(256 << 10));
    let e = yaml(&big, &Limits::BOOTSTRAP_YAML).unwrap_err();
    assert_eq!(
        e,
        ParseError::TooLarge {
            syntax: Syntax::Yaml,
            size: big.len(),
            limit: 256 << 10
        }
    );
    assert_eq!(
        e.to_string(),
        format!(
            "YAML document of {} bytes is over the size limit of 262144 bytes",
            big.len()
        )
    );
    let e = json(
        &vec![b' '; Limits::REQUEST_BODY.input_bytes + 1],
        &Limits::REQUEST_BODY,
    )
    .unwrap_err();
    over(&e, Limit::InputBytes);
}

#[test]
fn a_request_body_of_many_tiny_nodes_stops_at_the_node_limit() {
    // 8 MiB of `0,` would be 4 million values (128 MiB as serde_json's value).
    let mut body = b"[".to_vec();
    while body.len() < Limits::REQUEST_BODY.input_bytes - 8 {
        body.extend_from_slice(b"0,");
    }
    body.extend_from_slice(b"0]");
    let e = json(&body, &Limits::REQUEST_BODY).unwrap_err();
    over(&e, Limit::Nodes);
}

#[test]
fn yaml_specials_become_json_values() {
    let doc = "a: !custom {b: 1}\n1: one\ntrue: yes\n~: nothing\nf: .inf\nt: !!str 12\nbig: 123456789012345678901234567890\n";
    let v = yaml(doc, &Limits::BOOTSTRAP_YAML).unwrap().into_value();
    assert_eq!(v["a"], json!({"b": 1}), "the tag is dropped");
    assert_eq!(v["1"], "one");
    assert_eq!(v["true"], "yes");
    assert_eq!(v["null"], "nothing");
    assert_eq!(v["f"], Value::Null);
    assert_eq!(v["t"], "12");
    assert!(v["big"].is_number() || v["big"].is_string(), "{}", v["big"]);
    let e = yaml("? [a, b]\n: c\n", &Limits::BOOTSTRAP_YAML).unwrap_err();
    assert!(matches!(e, ParseError::ComplexKey { .. }), "{e}");
    assert_eq!(
        e.to_string(),
        "YAML document has a mapping key that is not a scalar at line 1"
    );
    let e = yaml("a: 1\n---\nb: 2\n", &Limits::BOOTSTRAP_YAML).unwrap_err();
    assert!(matches!(e, ParseError::Syntax { .. }), "{e}");
}

#[test]
fn errors_name_where_never_what() {
    let cases: Vec<(Syntax, String)> = vec![
        (Syntax::Yaml, format!("a: [{TOKEN}\n")),
        (Syntax::Yaml, format!("a: *{TOKEN}\n")),
        (Syntax::Yaml, format!("? [{TOKEN}]\n: x\n")),
        (
            Syntax::Yaml,
            format!("a: &x [\"{TOKEN}\"]\nb: [{}]\n", vec!["*x"; 60].join(",")),
        ),
        (Syntax::Json, format!("{{\"{TOKEN}\": ")),
        (Syntax::Json, format!("{{\"a\": {TOKEN}}}")),
        (Syntax::Json, format!("[\"{TOKEN}\"] {TOKEN}")),
    ];
    let small = Limits {
        input_bytes: 4096,
        depth: 8,
        nodes: 50,
        scalar_bytes: 1000,
    };
    for (syntax, doc) in cases {
        let e = match syntax {
            Syntax::Yaml => yaml(&doc, &small),
            Syntax::Json => json(doc.as_bytes(), &small),
        }
        .unwrap_err();
        let text = e.to_string();
        assert!(!text.contains("abcdef"), "{text}");
        assert!(!text.contains("0123"), "{text}");
    }
}

/// YAML made of pieces that are mostly anchors, aliases and brackets: rarely valid, often
/// expanding.
fn yamlish() -> impl Strategy<Value = String> {
    let piece = prop::sample::select(vec![
        "&a ", "&b ", "*a", "*b", "[", "]", "{", "}", ", ", ": ", "- ", "\n", "  ", "x", "'q'",
        "!t ", "? ", "k: ", "\"s\"", "---\n", "|\n  t\n", "1", "~",
    ]);
    prop::collection::vec(piece, 0..120).prop_map(|p| p.concat())
}

/// An alias-heavy document that is valid YAML: each level a list of aliases of earlier
/// anchors.
fn anchored() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::collection::vec(any::<prop::sample::Index>(), 1..12),
        1..12,
    )
    .prop_map(|levels| {
        let mut doc = String::from("l0: &l0 [\"ha\", {k: \"ha\"}]\n");
        for (i, refs) in levels.iter().enumerate() {
            let i = i + 1;
            let items: Vec<String> = refs.iter().map(|r| format!("*l{}", r.index(i))).collect();
            doc.push_str(&format!("l{i}: &l{i} [{}]\n", items.join(", ")));
        }
        doc
    })
}

const SMALL: Limits = Limits {
    input_bytes: 64 << 10,
    depth: 6,
    nodes: 2_000,
    scalar_bytes: 4_000,
};

fn within(doc: &Document, limits: &Limits) {
    let (nodes, bytes) = count(doc.value());
    assert!(nodes <= doc.nodes() && doc.nodes() <= limits.nodes);
    assert!(bytes <= doc.scalar_bytes() && doc.scalar_bytes() <= limits.scalar_bytes);
    assert!(depth(doc.value()) <= limits.depth);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_yaml_never_panics_and_never_builds_past_the_limits(doc in yamlish()) {
        if let Ok(d) = yaml(&doc, &SMALL) {
            within(&d, &SMALL);
        }
    }

    #[test]
    fn anchored_yaml_is_read_exactly_or_refused_by_a_limit(doc in anchored()) {
        match yaml(&doc, &SMALL) {
            Ok(d) => {
                within(&d, &SMALL);
                let want: Value = serde_yaml_ng::from_str(&doc).unwrap();
                prop_assert_eq!(d.value(), &want);
            }
            Err(e) => prop_assert!(e.limit().is_some(), "{}", e),
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        if let Ok(d) = json(&bytes, &SMALL) {
            within(&d, &SMALL);
        }
        if let Ok(text) = std::str::from_utf8(&bytes)
            && let Ok(d) = yaml(text, &SMALL)
        {
            within(&d, &SMALL);
        }
    }

    #[test]
    fn values_within_the_limits_read_back_as_written(v in arbitrary_value()) {
        let text = serde_json::to_string(&v).unwrap();
        let d = json(text.as_bytes(), &Limits::BOOTSTRAP_JSON).unwrap();
        prop_assert_eq!(d.value(), &v);
        let text = serde_yaml_ng::to_string(&v).unwrap();
        let d = yaml(&text, &Limits::BOOTSTRAP_YAML).unwrap();
        let want: Value = serde_yaml_ng::from_str(&text).unwrap();
        prop_assert_eq!(d.value(), &want);
    }
}

fn arbitrary_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        "[a-z0-9 :&*#!-]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z&*]{1,6}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

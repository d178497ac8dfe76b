//! The canonical form of a plan and its digest.
//!
//! The canonical form is itself a valid plan document (plan-file shape, every default
//! explicit, content base64-encoded), so the journal can store it and read it back with the
//! same validator. The digest is sha256 over that document without `id`, written as JSON
//! with keys sorted and no whitespace — stable across serde feature flags and input formats.

use base64::Engine as _;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::*;

/// Prefix hashed before the document, so a future canonical form can change it.
const DIGEST_DOMAIN: &[u8] = b"inplace.agent/v1 plan\n";

pub(super) fn digest(plan: &Plan) -> String {
    let mut doc = canonical_value(plan, false);
    let Value::Object(top) = &mut doc else {
        unreachable!("the canonical document is an object");
    };
    top.remove("id");
    // Streamed into the hash one change at a time: a plan with megabytes of file content is
    // never held a second time (as base64) in memory. The bytes hashed are exactly
    // `write_canonical` of the whole canonical document without `id`.
    let mut hasher = HashWriter(Sha256::new());
    hasher.0.update(DIGEST_DOMAIN);
    let mut keys: Vec<&String> = top.keys().collect();
    keys.sort();
    put(&mut hasher, b"{");
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            put(&mut hasher, b",");
        }
        write_scalar(&Value::String((*k).clone()), &mut hasher);
        put(&mut hasher, b":");
        if k.as_str() == "changes" {
            put(&mut hasher, b"[");
            for (j, c) in plan.changes.iter().enumerate() {
                if j > 0 {
                    put(&mut hasher, b",");
                }
                match c {
                    Change::File(f) => write_file_change(c, &f.content, &mut hasher),
                    _ => write_canonical(&kinds::canonical_change(c, true), &mut hasher),
                }
            }
            put(&mut hasher, b"]");
        } else {
            write_canonical(&top[k.as_str()], &mut hasher);
        }
    }
    put(&mut hasher, b"}");
    format!("sha256:{}", hex::encode(hasher.0.finalize()))
}

/// The canonical form of the `file` change `c` with content `content`, without building
/// its base64 text: the form with an empty content is written, and the base64 is streamed
/// into its place. The keys are sorted, so the content is the first `"content":""` of the
/// form (`append` alone comes before it, and quotes inside strings are escaped).
fn write_file_change(c: &Change, content: &[u8], out: &mut impl std::io::Write) {
    const HOLE: &[u8] = b"\"content\":\"\"";
    let mut form = Vec::with_capacity(256);
    write_canonical(&kinds::canonical_change(c, false), &mut form);
    let Some(at) = form.windows(HOLE.len()).position(|w| w == HOLE) else {
        unreachable!("the canonical file change has a content");
    };
    let split = at + HOLE.len() - 1;
    put(out, &form[..split]);
    // Whole groups of three bytes encode without padding, so the chunks join up exactly.
    let mut encoded = vec![0u8; (content.len().div_ceil(3) * 4).min(64 * 1024)];
    for chunk in content.chunks(48 * 1024) {
        let n = base64::engine::general_purpose::STANDARD
            .encode_slice(chunk, &mut encoded)
            .expect("the buffer holds a chunk's base64");
        put(out, &encoded[..n]);
    }
    put(out, &form[split..]);
}

/// `io::Write` into a running sha256.
struct HashWriter(Sha256);

impl std::io::Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The canonical document; with `bodies` false every `file` content is left empty (the
/// journal keeps large bodies apart, `journal::bodies`), which skips encoding them.
pub(super) fn canonical_value(plan: &Plan, bodies: bool) -> Value {
    let mut doc = Map::new();
    doc.insert("apiVersion".into(), json!(parse::API_VERSION));
    doc.insert("kind".into(), json!("Plan"));
    doc.insert("id".into(), json!(plan.id));
    if let Some(n) = &plan.node_name {
        doc.insert("nodeName".into(), json!(n));
    }
    let mut options = json!({
        "rollbackOnFailure": plan.options.rollback_on_failure,
        "timeoutSeconds": plan.options.timeout.as_secs(),
        "stepTimeoutSeconds": plan.options.step_timeout.as_secs(),
    });
    // Only when set, so plans without a managed set keep the digests they always had.
    if let (Some(set), Some(m)) = (&plan.options.prune, options.as_object_mut()) {
        m.insert("prune".into(), json!({"set": set}));
    }
    doc.insert("options".into(), options);
    doc.insert(
        "changes".into(),
        Value::Array(
            plan.changes
                .iter()
                .map(|c| kinds::canonical_change(c, bodies))
                .collect(),
        ),
    );
    doc.insert(
        "verify".into(),
        Value::Array(plan.verify.iter().map(check_value).collect()),
    );
    Value::Object(doc)
}

pub(crate) fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn check_value(c: &Check) -> Value {
    let mut body = match &c.probe {
        Probe::UnitActive { name } => json!({"name": name}),
        Probe::HttpGet { url, expect_status } => json!({"url": url, "expectStatus": expect_status}),
        Probe::KubeletVersion { version } => json!({"version": version}),
        Probe::Command { argv } => json!({"argv": argv}),
    };
    if let Value::Object(m) = &mut body {
        m.insert("timeoutSeconds".into(), json!(c.timeout.as_secs()));
        m.insert("periodSeconds".into(), json!(c.period.as_secs()));
    }
    let mut m = Map::new();
    m.insert(c.probe.key().into(), body);
    Value::Object(m)
}

/// JSON with object keys sorted by their UTF-8 bytes and no insignificant whitespace.
pub(crate) fn write_canonical(v: &Value, out: &mut impl std::io::Write) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            put(out, b"{");
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    put(out, b",");
                }
                write_scalar(&Value::String((*k).clone()), out);
                put(out, b":");
                write_canonical(&m[k.as_str()], out);
            }
            put(out, b"}");
        }
        Value::Array(items) => {
            put(out, b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    put(out, b",");
                }
                write_canonical(item, out);
            }
            put(out, b"]");
        }
        scalar => write_scalar(scalar, out),
    }
}

/// The writers used here (a `Vec`, a hash) cannot fail.
fn put(out: &mut impl std::io::Write, bytes: &[u8]) {
    let _ = out.write_all(bytes);
}

fn write_scalar(v: &Value, out: &mut impl std::io::Write) {
    // serde_json's scalar output is already canonical (shortest round-trip numbers,
    // minimal string escapes).
    let _ = serde_json::to_writer(&mut *out, v);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_streamed_digest_is_the_hash_of_the_whole_canonical_document() {
        // Contents of 0, 1 and 2 bytes past whole base64 chunks, and empty, and tiny.
        let sized = |n: usize| "c".repeat(n);
        let text = format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: p\nnodeName: n1\nchanges:\n\
             \x20 - file: {{path: /etc/kubernetes/a, content: \"a\\n\", mode: \"0600\"}}\n\
             \x20 - sysctl: {{key: net.ipv4.ip_forward, value: \"1\"}}\n\
             \x20 - file: {{path: /etc/kubernetes/b, content: \"b\"}}\n\
             \x20 - file: {{path: /etc/kubernetes/c0, content: \"{}\"}}\n\
             \x20 - file: {{path: /etc/kubernetes/c1, content: \"{}\"}}\n\
             \x20 - file: {{path: /etc/kubernetes/c2, content: \"{}\"}}\n\
             \x20 - file: {{path: /etc/kubernetes/e, content: \"\", append: true}}\n\
             verify:\n  - unitActive: {{name: kubelet.service}}\n",
            sized(3 * 48 * 1024),
            sized(2 * 48 * 1024 + 1),
            sized(48 * 1024 + 2),
        );
        let plan = parse::parse_plan(text.as_bytes(), "test", &parse::Limits::default()).unwrap();
        let mut doc = canonical_value(&plan, true);
        doc.as_object_mut().unwrap().remove("id");
        let mut whole = DIGEST_DOMAIN.to_vec();
        write_canonical(&doc, &mut whole);
        let expected = format!("sha256:{}", hex::encode(Sha256::digest(&whole)));
        assert_eq!(digest(&plan), expected);
    }

    #[test]
    fn canonical_writer_sorts_keys_at_every_level() {
        let v = json!({"b": 1, "a": {"z": [true, null], "y": "x\n"}});
        let mut out = Vec::new();
        write_canonical(&v, &mut out);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"a":{"y":"x\n","z":[true,null]},"b":1}"#
        );
    }
}

//! The canonical form of a plan and its digest.
//!
//! The canonical form is itself a valid plan document (plan-file shape, every default
//! explicit, content base64-encoded), so the journal can store it and read it back with the
//! same validator. The digest is sha256 over that document without `id`, written as JSON
//! with keys sorted and no whitespace — stable across serde feature flags and input formats.
//!
//! Two definitions: v2 (`v2:sha256:<hex>`, what the agent gives plans now) writes each
//! `file` content as the hex sha256 of its bytes, so a content is hashed once — the same
//! sums the journal keeps for staged contents — and the contents of a large plan are hashed
//! on several threads. v1 (`sha256:<hex>`) wrote the contents as base64 into the one hash:
//! agents before v2 journaled and reported it, so a plan is still recognised by it
//! ([`super::Plan::has_digest`]).

use std::collections::HashMap;

use base64::Engine as _;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::hasher::KnownSums;
use super::*;

/// Prefix hashed before the document by the first definition (v1).
const DIGEST_DOMAIN: &[u8] = b"inplace.agent/v1 plan\n";

/// Prefix hashed before the document by the second definition (v2).
const DIGEST_DOMAIN_V2: &[u8] = b"inplace.agent/v2 plan\n";

/// How a v1 digest is written: `sha256:<hex>`.
pub const V1_PREFIX: &str = "sha256:";

/// How a v2 digest is written: `v2:sha256:<hex>`.
pub const V2_PREFIX: &str = "v2:sha256:";

/// Below this many bytes of file content the sums are computed on the calling thread.
const PARALLEL_BYTES: usize = 1 << 20;

/// The sha256 of each `file` change's content, by change index (`None` for other kinds).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContentSums(Vec<Option<[u8; 32]>>);

impl ContentSums {
    /// The sums of `plan`'s contents, hashed on up to four threads when the plan is large
    /// (each content by one thread, the next free thread taking the next content).
    pub fn of(plan: &Plan) -> ContentSums {
        ContentSums::of_known(plan, KnownSums::default())
    }

    /// [`ContentSums::of`] taking the sum of each content that `known` holds: a content of
    /// the plan at the address and of the length of a content `known` keeps alive is that
    /// content (its memory cannot have been reused, and `Bytes` never changes what it
    /// holds). Contents copied or built since are not found that way and are hashed here.
    pub fn of_known(plan: &Plan, known: KnownSums) -> ContentSums {
        let known = known.resolve();
        let by_memory: HashMap<(usize, usize), [u8; 32]> = known
            .iter()
            .map(|(b, sum)| ((b.as_ptr() as usize, b.len()), *sum))
            .collect();
        let mut sums = vec![None; plan.changes.len()];
        let mut todo: Vec<(usize, &[u8])> = Vec::new();
        for (i, change) in plan.changes.iter().enumerate() {
            let Change::File(f) = change else {
                continue;
            };
            match by_memory.get(&(f.content.as_ptr() as usize, f.content.len())) {
                Some(sum) => {
                    debug_assert_eq!(
                        *sum,
                        <[u8; 32]>::from(Sha256::digest(&f.content)),
                        "the known sum of change {i}"
                    );
                    sums[i] = Some(*sum);
                }
                None => todo.push((i, &f.content[..])),
            }
        }
        let total: usize = todo.iter().map(|(_, c)| c.len()).sum();
        let workers = if total < PARALLEL_BYTES {
            1
        } else {
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(4)
        };
        let hash = |c: &[u8]| <[u8; 32]>::from(Sha256::digest(c));
        if workers == 1 {
            for (i, c) in todo {
                sums[i] = Some(hash(c));
            }
            return ContentSums(sums);
        }
        let next = std::sync::atomic::AtomicUsize::new(0);
        let work = || {
            let mut done = Vec::new();
            loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some((i, c)) = todo.get(k) else {
                    return done;
                };
                done.push((*i, hash(c)));
            }
        };
        std::thread::scope(|s| {
            let helpers: Vec<_> = (1..workers).map(|_| s.spawn(work)).collect();
            let mine = work();
            let theirs = helpers
                .into_iter()
                .flat_map(|h| h.join().expect("hashing does not panic"));
            for (i, sum) in mine.into_iter().chain(theirs) {
                sums[i] = Some(sum);
            }
        });
        ContentSums(sums)
    }

    /// The sum of change `index`'s content, in hex.
    pub fn hex(&self, index: usize) -> Option<String> {
        self.0.get(index).copied().flatten().map(hex::encode)
    }
}

/// The plan's digest (v2): sha256 over the canonical document without `id`, with each
/// `file` content replaced by the hex sha256 of its bytes (`sums`, from [`ContentSums::of`]
/// for this plan). Each content is hashed once, and the sums serve the journal too.
pub(super) fn digest_v2(plan: &Plan, sums: &ContentSums) -> String {
    let mut hasher = HashWriter(Sha256::new());
    hasher.0.update(DIGEST_DOMAIN_V2);
    write_without_id(plan, &mut hasher, |index, _, out| {
        let hex = sums
            .hex(index)
            .expect("the sums are this plan's: one for each file change");
        put(out, hex.as_bytes());
    });
    format!("{V2_PREFIX}{}", hex::encode(hasher.0.finalize()))
}

/// The plan's digest by the first definition (v1), which agents before v2 journaled and
/// reported: sha256 over the canonical document without `id`, contents as base64.
pub(super) fn digest_v1(plan: &Plan) -> String {
    // Streamed into the hash one change at a time: a plan with megabytes of file content is
    // never held a second time (as base64) in memory. The bytes hashed are exactly
    // `write_canonical` of the whole canonical document without `id`.
    let mut hasher = HashWriter(Sha256::new());
    hasher.0.update(DIGEST_DOMAIN);
    write_without_id(plan, &mut hasher, |_, content, out| {
        // Whole groups of three bytes encode without padding, so the chunks join up exactly.
        let mut encoded = vec![0u8; (content.len().div_ceil(3) * 4).min(64 * 1024)];
        for chunk in content.chunks(48 * 1024) {
            let n = base64::engine::general_purpose::STANDARD
                .encode_slice(chunk, &mut encoded)
                .expect("the buffer holds a chunk's base64");
            put(out, &encoded[..n]);
        }
    });
    format!("{V1_PREFIX}{}", hex::encode(hasher.0.finalize()))
}

/// Writes the canonical document of `plan` without `id` to `out`, each `file` content
/// written by `content(change index, content, out)` between its quotes.
fn write_without_id<W: std::io::Write>(
    plan: &Plan,
    out: &mut W,
    content: impl Fn(usize, &[u8], &mut W),
) {
    let mut doc = canonical_value(plan, false);
    let Value::Object(top) = &mut doc else {
        unreachable!("the canonical document is an object");
    };
    top.remove("id");
    let mut keys: Vec<&String> = top.keys().collect();
    keys.sort();
    put(out, b"{");
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            put(out, b",");
        }
        write_scalar(&Value::String((*k).clone()), out);
        put(out, b":");
        if k.as_str() == "changes" {
            put(out, b"[");
            for (j, c) in plan.changes.iter().enumerate() {
                if j > 0 {
                    put(out, b",");
                }
                match c {
                    Change::File(f) => write_file_change(c, out, |out| content(j, &f.content, out)),
                    _ => write_canonical(&kinds::canonical_change(c, true), out),
                }
            }
            put(out, b"]");
        } else {
            write_canonical(&top[k.as_str()], out);
        }
    }
    put(out, b"}");
}

/// The canonical form of the `file` change `c`, its content written by `content`: the form
/// with an empty content is written, and the content goes into its place. The keys are
/// sorted, so the content is the first `"content":""` of the form (`append` alone comes
/// before it, and quotes inside strings are escaped).
fn write_file_change<W: std::io::Write>(c: &Change, out: &mut W, content: impl FnOnce(&mut W)) {
    const HOLE: &[u8] = b"\"content\":\"\"";
    let mut form = Vec::with_capacity(256);
    write_canonical(&kinds::canonical_change(c, false), &mut form);
    let Some(at) = form.windows(HOLE.len()).position(|w| w == HOLE) else {
        unreachable!("the canonical file change has a content");
    };
    let split = at + HOLE.len() - 1;
    put(out, &form[..split]);
    content(out);
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

pub fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn check_value(c: &Check) -> Value {
    let mut body = match &c.probe {
        Probe::UnitActive { name } => json!({"name": name}),
        Probe::HttpGet { url, expect_status } => json!({"url": url, "expectStatus": expect_status}),
        Probe::KubeletVersion { version } => json!({"version": version}),
        Probe::Command { argv } => json!({"argv": argv}),
        Probe::ControlPlane(g) => g.canonical(),
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
pub fn write_canonical(v: &Value, out: &mut impl std::io::Write) {
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
        assert_eq!(digest_v1(&plan), expected);

        // v2: the same document, each content replaced by its sha256 in hex.
        let mut doc = canonical_value(&plan, true);
        doc.as_object_mut().unwrap().remove("id");
        for change in doc["changes"].as_array_mut().unwrap() {
            if let Some(Value::String(content)) = change.pointer_mut("/file/content") {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(&*content)
                    .unwrap();
                *content = hex::encode(Sha256::digest(&bytes));
            }
        }
        let mut whole = DIGEST_DOMAIN_V2.to_vec();
        write_canonical(&doc, &mut whole);
        let expected = format!("v2:sha256:{}", hex::encode(Sha256::digest(&whole)));
        assert_eq!(plan.digest(), expected);
    }

    /// A large plan's contents are hashed on several threads, each sum in its place.
    #[test]
    fn content_sums_are_the_same_on_one_thread_and_several() {
        let mut text = String::from("apiVersion: inplace.agent/v1\nkind: Plan\nid: p\nchanges:\n");
        for i in 0..40 {
            if i % 7 == 3 {
                text.push_str(&format!(
                    "  - sysctl: {{key: net.ipv4.conf.e{i}.forwarding, value: \"1\"}}\n"
                ));
            } else {
                let body = format!("{i}").repeat(1000 + i * 2000);
                text.push_str(&format!(
                    "  - file: {{path: /etc/kubernetes/f{i}, content: \"{body}\"}}\n"
                ));
            }
        }
        let plan = parse::parse_plan(text.as_bytes(), "test", &parse::Limits::default()).unwrap();
        let total: usize = plan
            .changes
            .iter()
            .map(|c| match c {
                Change::File(f) => f.content.len(),
                _ => 0,
            })
            .sum();
        assert!(total > PARALLEL_BYTES);
        let sums = ContentSums::of(&plan);
        for (i, c) in plan.changes.iter().enumerate() {
            let want = match c {
                Change::File(f) => Some(hex::encode(Sha256::digest(&f.content))),
                _ => None,
            };
            assert_eq!(sums.hex(i), want, "change {i}");
        }
        assert_eq!(plan.digest_with(&sums), plan.digest());
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

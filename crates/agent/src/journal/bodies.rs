//! File bodies of a large plan, kept out of its `PlanAccepted` record.
//!
//! The journal must hold the whole plan durably before anything changes (a run resumes
//! from it), but base64 inside a JSON line is the most expensive way to store megabytes of
//! file content: it is encoded, escaped, hashed into the chain and fdatasynced as 4/3 of its
//! size, and written again for every plan that carries it. A plan whose file contents add up
//! to [`THRESHOLD`] or more journals them as **one blob** in the content-addressed backup
//! store instead (raw bytes, durable before the record), and its record keeps the canonical
//! document with those contents emptied plus the blob's sha256 (`bodies`). The same desired
//! state submitted again (a no-op re-apply under a new id) finds the blob already stored
//! and writes nothing but a small record.
//!
//! Most of a large plan's file contents are not in the blob at all: the engine stages the
//! content of each file that must change beside its target before accepting the plan, and
//! leaves the content of a file that already holds it where it is when nothing else of the
//! plan can change that file (`engine::staging`); the record references both. Only the
//! other contents (`append`, a file whose diff failed, one already in place in a plan that
//! also restarts units or installs packages) go to the blob.
//!
//! Blob format: for each `file` change in plan order that was neither staged nor held, its
//! content length as 8 bytes little-endian, then the content.

use std::collections::BTreeSet;

use base64::Engine as _;
use serde_json::Value;

use inplace_plan::{Change, Plan};

/// Plans with at least this many bytes of file content keep them out of the record.
pub const THRESHOLD: usize = 64 * 1024;

/// The bytes of `file` content in `plan`.
pub fn total(plan: &Plan) -> usize {
    plan.changes
        .iter()
        .map(|c| match c {
            Change::File(f) => f.content.len(),
            _ => 0,
        })
        .sum()
}

/// The blob of a plan's file bodies except those of the changes in `apart` (staged or
/// held), when the plan is large enough to keep them apart and some are left.
pub fn pack(plan: &Plan, apart: &BTreeSet<u32>) -> Option<Vec<u8>> {
    let files = || {
        plan.changes
            .iter()
            .enumerate()
            .filter(|(i, _)| !apart.contains(&(*i as u32)))
            .filter_map(|(_, c)| match c {
                Change::File(f) => Some(&f.content),
                _ => None,
            })
    };
    if total(plan) < THRESHOLD || files().next().is_none() {
        return None;
    }
    let size: usize = files().map(|c| c.len() + 8).sum();
    let mut blob = Vec::with_capacity(size);
    for content in files() {
        blob.extend_from_slice(&(content.len() as u64).to_le_bytes());
        blob.extend_from_slice(content);
    }
    Some(blob)
}

/// The `file` change objects of a canonical plan document with their change index, in
/// order.
fn file_changes(
    doc: &mut Value,
) -> impl Iterator<Item = (u32, &mut serde_json::Map<String, Value>)> {
    doc.get_mut("changes")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, c)| {
            c.get_mut("file")
                .and_then(Value::as_object_mut)
                .map(|f| (i as u32, f))
        })
}

/// Sets the content of `file` change `index` of a canonical plan document.
pub fn put(doc: &mut Value, index: u32, content: &[u8]) {
    if let Some((_, f)) = file_changes(doc).find(|(i, _)| *i == index) {
        set_content(f, content);
    }
}

fn set_content(f: &mut serde_json::Map<String, Value>, content: &[u8]) {
    f.insert(
        "content".into(),
        Value::String(base64::engine::general_purpose::STANDARD.encode(content)),
    );
    f.insert("encoding".into(), Value::String("base64".into()));
}

/// Empties the content of every `file` change of a canonical plan document (the blob
/// carries it); the engine builds that form directly (`Plan::canonical_json_without_bodies`).
#[cfg(test)]
fn strip(doc: &mut Value) {
    for (_, f) in file_changes(doc) {
        f.insert("content".into(), Value::String(String::new()));
    }
}

/// Puts the contents from `blob` back into a document emptied by [`strip`], all but those of
/// the changes in `apart` (staged or held: [`put`] sets those).
pub fn fill(doc: &mut Value, blob: &[u8], apart: &BTreeSet<u32>) -> Result<(), String> {
    let mut rest = blob;
    for (_, f) in file_changes(doc).filter(|(i, _)| !apart.contains(i)) {
        let (len, tail) = rest
            .split_first_chunk::<8>()
            .ok_or("the plan bodies blob ends early")?;
        let len = usize::try_from(u64::from_le_bytes(*len))
            .map_err(|_| "the plan bodies blob is damaged".to_string())?;
        if tail.len() < len {
            return Err("the plan bodies blob ends early".into());
        }
        let (content, tail) = tail.split_at(len);
        set_content(f, content);
        rest = tail;
    }
    if !rest.is_empty() {
        return Err("the plan bodies blob has more files than the plan".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use inplace_plan::{Limits, parse_plan, validate_value};

    #[test]
    fn stripped_and_filled_again_is_the_same_plan() {
        let big = "x".repeat(THRESHOLD);
        let text = format!(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: p\nchanges:\n\
             \x20 - file: {{path: /etc/kubernetes/a, content: \"{big}\"}}\n\
             \x20 - absent: {{path: /etc/kubernetes/b}}\n\
             \x20 - file: {{path: /etc/kubernetes/c, content: \"\"}}\n\
             \x20 - file: {{path: /etc/kubernetes/d, content: \"small\\n\", mode: \"0600\"}}\n"
        );
        let plan = parse_plan(text.as_bytes(), "test", &Limits::default()).unwrap();
        let blob = pack(&plan, &BTreeSet::new()).expect("large enough");
        let mut doc = plan.canonical_json();
        strip(&mut doc);
        assert_eq!(doc, plan.canonical_json_without_bodies());
        assert!(!doc.to_string().contains(&big[..100]));
        fill(&mut doc, &blob, &BTreeSet::new()).unwrap();
        let back = validate_value(&doc, "test", &Limits::replay()).unwrap();
        assert_eq!(back.digest(), plan.digest());
        assert_eq!(back.canonical_json(), plan.canonical_json());

        let mut doc = plan.canonical_json();
        strip(&mut doc);
        assert!(fill(&mut doc, &blob[..blob.len() - 1], &BTreeSet::new()).is_err());
        assert!(
            fill(
                &mut doc,
                &[blob.as_slice(), &[0u8; 8]].concat(),
                &BTreeSet::new()
            )
            .is_err()
        );

        // Change 0 staged: the blob holds the others, and `put` fills it in.
        let staged = BTreeSet::from([0]);
        let blob = pack(&plan, &staged).expect("some are left");
        let mut doc = plan.canonical_json();
        strip(&mut doc);
        fill(&mut doc, &blob, &staged).unwrap();
        put(&mut doc, 0, big.as_bytes());
        let back = validate_value(&doc, "test", &Limits::replay()).unwrap();
        assert_eq!(back.digest(), plan.digest());
    }

    #[test]
    fn small_plans_stay_inline() {
        let plan = parse_plan(
            b"apiVersion: inplace.agent/v1\nkind: Plan\nid: p\nchanges:\n  - file: {path: /etc/kubernetes/a, content: x}\n",
            "test",
            &Limits::default(),
        )
        .unwrap();
        assert!(pack(&plan, &BTreeSet::new()).is_none());
    }
}

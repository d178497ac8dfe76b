//! Property tests: arbitrary input never panics plan validation or journal decoding, and the
//! canonical form of every valid plan reads back to the same plan and digest.

use std::io::Write;

use inplace_agent::journal::{Journal, Reader};
use inplace_plan::{Limits, parse_plan, validate_value};
use proptest::prelude::*;
use serde_json::{Map, Value};

/// JSON values shaped like plans: plan keys, change kinds and field names appear often, with
/// arbitrary values of arbitrary types underneath.
fn plan_like() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("apiVersion".to_string()),
        Just("kind".to_string()),
        Just("id".to_string()),
        Just("nodeName".to_string()),
        Just("options".to_string()),
        Just("changes".to_string()),
        Just("verify".to_string()),
        Just("file".to_string()),
        Just("absent".to_string()),
        Just("kubeletConfig".to_string()),
        Just("kubeletFlags".to_string()),
        Just("sysctl".to_string()),
        Just("package".to_string()),
        Just("artifact".to_string()),
        Just("unit".to_string()),
        Just("dropIn".to_string()),
        Just("exec".to_string()),
        Just("httpGet".to_string()),
        Just("path".to_string()),
        Just("content".to_string()),
        Just("encoding".to_string()),
        Just("mode".to_string()),
        Just("owner".to_string()),
        Just("mergePatch".to_string()),
        Just("set".to_string()),
        Just("remove".to_string()),
        Just("key".to_string()),
        Just("value".to_string()),
        Just("url".to_string()),
        Just("sha256".to_string()),
        Just("timeoutSeconds".to_string()),
        "[a-zA-Z]{1,8}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        prop_oneof![
            Just("inplace.agent/v1".to_string()),
            Just("Plan".to_string()),
            Just("/etc/kubernetes/x".to_string()),
            Just("0644".to_string()),
            Just("root:root".to_string()),
            Just("base64".to_string()),
            Just("gzip+base64".to_string()),
            "\\PC{0,24}",
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 64, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((key.clone(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_the_parser(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_plan(&bytes, "fuzz", &Limits::default());
    }

    #[test]
    fn arbitrary_text_never_panics_the_parser(text in "\\PC{0,400}") {
        let _ = parse_plan(text.as_bytes(), "fuzz", &Limits::default());
    }

    #[test]
    fn plan_shaped_documents_never_panic_and_valid_ones_round_trip(doc in plan_like()) {
        let mut doc = doc;
        if let Value::Object(m) = &mut doc {
            m.insert("apiVersion".into(), "inplace.agent/v1".into());
            m.insert("kind".into(), "Plan".into());
            m.entry("id").or_insert_with(|| "fuzz".into());
        }
        if let Ok(plan) = validate_value(&doc, "fuzz", &Limits::default()) {
            let again = validate_value(&plan.canonical_json(), "journal", &Limits::replay())
                .expect("a valid plan's canonical form is valid");
            prop_assert_eq!(&plan, &again);
            prop_assert_eq!(plan.digest(), again.digest());
        }
    }

    #[test]
    fn arbitrary_journal_files_never_panic_the_reader(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        let t = tempfile::tempdir().unwrap();
        let path = t.path().join("journal.log");
        std::fs::write(&path, &bytes).unwrap();
        if let Some(reader) = Reader::open(&path).unwrap() {
            for entry in reader {
                if entry.is_err() {
                    break;
                }
            }
        }
    }

    #[test]
    fn damaged_real_journals_are_torn_or_refused_never_misread(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let t = tempfile::tempdir().unwrap();
        {
            let (mut j, _) = Journal::open(t.path(), |_| {}).unwrap();
            for run in 0..8 {
                j.append(run, inplace_agent::journal::Record::CancelRequested { run, reason: String::new(), by: String::new() }, false).unwrap();
            }
        }
        let path = t.path().join("journal").join("journal.log");
        let mut bytes = std::fs::read(&path).unwrap();
        for (at, byte) in &flips {
            let i = at.index(bytes.len());
            bytes[i] = *byte;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&bytes).unwrap();
        drop(f);
        let mut seqs = Vec::new();
        let result = Journal::open(t.path(), |e| seqs.push(e.seq));
        // Whatever survives is a gap-free prefix of what was written.
        for (i, s) in seqs.iter().enumerate() {
            prop_assert_eq!(*s, i as u64 + 1);
        }
        if let Ok((_j, report)) = result {
            prop_assert!(seqs.len() <= 8);
            if seqs.len() < 8 && report.torn.is_none() {
                // Nothing torn means the file ended exactly after the last good record.
                prop_assert!(bytes.is_empty() || bytes.ends_with(b"\n"));
            }
        }
    }
}

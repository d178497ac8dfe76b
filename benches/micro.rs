//! In-process micro-benchmarks (Criterion) of the costs the whole-process figures are made
//! of: parsing and validating a plan (YAML and JSON), its digest and canonical form, and the
//! journal (append, replay). `cargo bench --bench micro` (benches/README.md); Criterion
//! keeps its estimates under `target/criterion/`, where `benches/run` reads them.

use std::hint::black_box;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use inplace_agent::journal::RunPhase as Phase;
use inplace_agent::journal::{Journal, Record};
use inplace_agent::plan::{Limits, parse_plan};

/// The no-op benchmark's plan: 500 files of 4 KiB, as YAML (flow style, as generated).
fn yaml_plan(files: usize, size: usize) -> String {
    let mut plan =
        String::from("apiVersion: inplace.agent/v1\nkind: Plan\nid: bench/micro\nchanges:\n");
    for i in 0..files {
        let line = format!("bench file {i:04} ");
        let content = &line.repeat(size / line.len() + 1)[..size];
        plan.push_str(&format!(
            "  - file: {{path: /etc/kubernetes/bench/f{i:04}.conf, mode: \"0644\", content: \"{content}\"}}\n"
        ));
    }
    plan
}

fn plans(c: &mut Criterion) {
    let yaml = yaml_plan(500, 4096);
    let limits = Limits::default();
    let plan = parse_plan(yaml.as_bytes(), "bench", &limits).expect("plan");
    let json = serde_json::to_string(&plan.canonical_json()).expect("json");
    let mut g = c.benchmark_group("plan-500x4KiB");
    g.sample_size(20);
    g.throughput(Throughput::Bytes(yaml.len() as u64));
    g.bench_function("parse-yaml", |b| {
        b.iter(|| parse_plan(black_box(yaml.as_bytes()), "bench", &limits).expect("plan"))
    });
    g.throughput(Throughput::Bytes(json.len() as u64));
    g.bench_function("parse-json", |b| {
        b.iter(|| parse_plan(black_box(json.as_bytes()), "bench", &limits).expect("plan"))
    });
    g.bench_function("digest", |b| b.iter(|| black_box(&plan).digest()));
    g.bench_function("canonical-json", |b| {
        b.iter(|| black_box(&plan).canonical_json())
    });
    g.finish();
}

fn record(run: u64, index: u32) -> Record {
    Record::StepDone {
        run,
        index,
        changed: true,
        message: format!("write /etc/kubernetes/r/f{index}.conf (9 bytes, 0644 0:0)"),
    }
}

fn journal(c: &mut Criterion) {
    let mut g = c.benchmark_group("journal");
    g.sample_size(20);
    // Appends without a sync (the batched records); the sync is the disk's, not ours.
    g.throughput(Throughput::Elements(1000));
    g.bench_function("append-1000-stepDone", |b| {
        b.iter_batched(
            || {
                let dir = tempfile::tempdir().expect("tempdir");
                let (j, _) = Journal::open(dir.path(), |_| {}).expect("journal");
                (dir, j)
            },
            |(dir, mut j)| {
                for i in 0..1000u32 {
                    j.append(1_700_000_000_000, record(1, i), false)
                        .expect("append");
                }
                (dir, j)
            },
            BatchSize::PerIteration,
        )
    });
    // Replay of 10,000 records through the chain check and decoding (no engine fold).
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let (mut j, _) = Journal::open(dir.path(), |_| {}).expect("journal");
        for run in 0..100u64 {
            j.append(
                0,
                Record::Phase {
                    run,
                    phase: Phase::Applying,
                    error: None,
                },
                false,
            )
            .expect("append");
            for i in 0..99u32 {
                j.append(0, record(run, i), false).expect("append");
            }
        }
        j.sync().expect("sync");
    }
    g.throughput(Throughput::Elements(10_000));
    g.bench_function("replay-10000", |b| {
        b.iter(|| {
            let mut n = 0u64;
            let (_j, report) = Journal::open(dir.path(), |_| n += 1).expect("journal");
            assert_eq!(report.records, 10_000);
            n
        })
    });
    g.finish();
}

criterion_group!(benches, plans, journal);
criterion_main!(benches);

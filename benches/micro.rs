//! In-process micro-benchmarks (Criterion) of the costs the whole-process figures are made
//! of: parsing and validating a plan (YAML and JSON), its digest and canonical form, and the
//! journal (append, replay). `cargo bench --bench micro` (benches/README.md); Criterion
//! keeps its estimates under `target/criterion/`, where `benches/run` reads them.

use std::hint::black_box;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use inplace_agent::journal::RunPhase as Phase;
use inplace_agent::journal::{Journal, Record};
use inplace_plan::{Limits, parse_plan};

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
    // The same plan as JSON with plain (not base64) content, as people and tools write it.
    let plain = serde_json::to_string(
        &serde_json::from_str::<serde_json::Value>(&{
            let mut v = plan.canonical_json();
            for (c, change) in v["changes"]
                .as_array_mut()
                .expect("changes")
                .iter_mut()
                .zip(&plan.changes)
            {
                if let inplace_plan::Change::File(f) = change {
                    c["file"]["content"] =
                        String::from_utf8(f.content.to_vec()).expect("text").into();
                    c["file"]["encoding"] = "plain".into();
                }
            }
            v.to_string()
        })
        .expect("json"),
    )
    .expect("json");
    g.throughput(Throughput::Bytes(plain.len() as u64));
    g.bench_function("parse-json-plain", |b| {
        b.iter(|| parse_plan(black_box(plain.as_bytes()), "bench", &limits).expect("plan"))
    });
    g.bench_function("digest", |b| b.iter(|| black_box(&plan).digest()));
    g.bench_function("canonical-json", |b| {
        b.iter(|| black_box(&plan).canonical_json())
    });
    g.finish();
}

/// sha256 of 4 MiB: the sha2 crate (which uses the CPU's SHA extensions when it has them)
/// against ring's digest.
fn sha256(c: &mut Criterion) {
    use sha2::Digest as _;
    let data = vec![0x5au8; 4 << 20];
    let mut g = c.benchmark_group("sha256-4MiB");
    g.sample_size(20);
    g.throughput(Throughput::Bytes(data.len() as u64));
    g.bench_function("sha2", |b| {
        b.iter(|| sha2::Sha256::digest(black_box(&data)))
    });
    g.bench_function("ring", |b| {
        b.iter(|| ring::digest::digest(&ring::digest::SHA256, black_box(&data)))
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

/// A drift check of the 500-file plan on a node it left unchanged, against the dry run of the
/// same plan (`CheckPlan`'s code): metadata first (nothing changed since the last clean
/// check), and the full check (the plan read back from the journal, its dry run with what
/// differs explained) after a file's metadata changed.
fn drift(c: &mut Criterion) {
    use inplace_agent::config::SettingsInput;
    use inplace_agent::engine::Engine;
    use inplace_agent::engine::drift::CheckOutcome;
    use inplace_agent::engine::dry_run::check_plan;
    use inplace_agent::host::Host;
    use std::sync::Arc;

    let dir = tempfile::tempdir().expect("tempdir");
    inplace_demo_node::build_kubeadm_worker(dir.path()).expect("tree");
    let settings = SettingsInput {
        root: Some(dir.path().to_path_buf()),
        no_chroot: true,
        services_off: true,
        ..SettingsInput::default()
    }
    .resolve()
    .expect("settings");
    let host = Arc::new(Host::open(settings.host.clone()).expect("host"));
    let (engine, _) = Engine::open(settings.engine.clone(), host.clone()).expect("engine");
    let plan =
        parse_plan(yaml_plan(500, 4096).as_bytes(), "bench", &Limits::default()).expect("plan");
    engine.submit(plan.clone(), "bench", false).expect("submit");
    engine.run_until_idle();
    assert_eq!(engine.check_drift(), CheckOutcome::Checked);
    assert!(!engine.drift().drifted());
    let mut g = c.benchmark_group("drift-500x4KiB");
    g.sample_size(20);
    g.throughput(Throughput::Elements(500));
    g.bench_function("check-plan", |b| {
        b.iter(|| check_plan(&settings.engine, &host, black_box(&plan)))
    });
    // Metadata first: no file changed since the last check found the node clean.
    g.bench_function("drift-check", |b| b.iter(|| engine.check_drift()));
    // Every file read: one file rewritten with the same bytes before each check (its
    // metadata changed, its content did not).
    let touched = dir.path().join("etc/kubernetes/bench/f0000.conf");
    let same = std::fs::read(&touched).expect("file");
    g.bench_function("drift-check-full", |b| {
        b.iter_batched(
            || std::fs::write(&touched, &same).expect("write"),
            |()| engine.check_drift(),
            BatchSize::PerIteration,
        )
    });
    // The same full check as the daemon makes it: the node read in a check process of its
    // own (`inplace-agent serve ... --drift-probe`, the release binary benches/run builds).
    let agent = std::env::var_os("INPLACE_AGENT_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/release/inplace-agent")
        });
    if agent.exists() {
        let command = check_command(&agent, dir.path());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let full_in_a_process = || {
            use inplace_agent::cli::drift_probe::look_in_a_process;
            use inplace_agent::engine::drift::Begun;
            let Begun::Look(pending) = engine.begin_drift_check() else {
                panic!("the touched file makes the check read the node");
            };
            let pending: Arc<inplace_agent::engine::drift::Pending> = Arc::from(pending);
            let look = runtime.block_on(look_in_a_process(&command, &engine, pending.clone()));
            engine.finish_drift_check(&pending, look)
        };
        std::fs::write(&touched, &same).expect("write");
        assert_eq!(full_in_a_process(), CheckOutcome::Checked);
        let state = engine.drift();
        assert!(state.problem.is_none() && !state.drifted(), "{state:?}");
        g.bench_function("drift-check-full-in-a-process", |b| {
            b.iter_batched(
                || std::fs::write(&touched, &same).expect("write"),
                |()| full_in_a_process(),
                BatchSize::PerIteration,
            )
        });
    } else {
        eprintln!(
            "SKIPPED drift-500x4KiB/drift-check-full-in-a-process: no agent binary at {} \
             (cargo build --release -p inplace-agent, or set INPLACE_AGENT_BIN)",
            agent.display()
        );
    }
    g.finish();
}

/// The check process of an agent serving `root` with no configuration file (the TLS files
/// are named, not read: a check process does not serve).
fn check_command(
    agent: &std::path::Path,
    root: &std::path::Path,
) -> inplace_agent::config::CheckCommand {
    let args = [
        "serve",
        "--config",
        "/dev/null",
        "--no-chroot",
        "--services",
        "off",
        "--node-name",
        "bench",
        "--tls-cert",
        "unused.crt",
        "--tls-key",
        "unused.key",
        "--client-ca",
        "unused-ca.crt",
        "--root",
    ];
    let mut args: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
    args.push(root.into());
    inplace_agent::config::CheckCommand {
        program: agent.to_path_buf(),
        args,
        time_limit: std::time::Duration::from_secs(300),
    }
}

criterion_group!(benches, sha256, plans, journal, drift);
criterion_main!(benches);

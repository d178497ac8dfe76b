//! The performance suite's measuring program (`benches/run` builds and runs it).
//!
//! Every figure is a median over several runs with its spread, and every comparison is
//! measured side by side in the same run (A and B alternate, the ratio is the median of the
//! rounds' ratios), because these machines are noisy. Each figure carries the 1-minute load
//! average when it was taken. Whole-process measurements spawn the release binary of the
//! agent (`INPLACE_AGENT_BIN`); the no-op re-apply is timed by `hyperfine` when it is on the
//! `PATH` (`benches/run` installs it), by this program otherwise.
//!
//! ```text
//! perf all [--json FILE] [--quick]     every measurement below, figures as JSON
//! perf apply-files [--files N] [--size BYTES] [--runs R] [--replace]   (YAML, JSON and gRPC
//!                                      front ends; --replace: onto existing files)
//! perf noop [--files N] [--runs R]
//! perf noop-large [--files N] [--size BYTES] [--runs R]
//! perf replay [--records N] [--runs R]
//! perf journal-size [--plans N]
//! perf footprint [--runs R]
//! perf ansible [--files N] [--runs R]
//! perf baseline-writes DIR N SIZE      (internal) the raw atomic-write baseline
//! ```

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use inplace_agent::engine::{Engine, EngineConfig};
use inplace_agent::host::{Host, HostSettings};
use inplace_agent::journal::{Journal, Preimage, Record};

use support::daemon::{Daemon, OnDrop, Ready, serve_command};
use support::memory::Memory;
use support::pki::NodePki;

fn agent_bin() -> PathBuf {
    support::daemon::agent_under_test()
}

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.windows(2)
        .find(|w| w[0] == name)
        .and_then(|w| w[1].parse().ok())
        .unwrap_or(default)
}

/// The 1-minute load average now.
fn load() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(-1.0)
}

/// Median, min and max of a sample (milliseconds, or any unit).
#[derive(Debug, Clone, Copy)]
struct Stats {
    median: f64,
    min: f64,
    max: f64,
    n: usize,
}

fn stats_f(mut v: Vec<f64>) -> Stats {
    assert!(!v.is_empty(), "no samples");
    v.sort_by(f64::total_cmp);
    let median = if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    };
    Stats {
        median,
        min: v[0],
        max: v[v.len() - 1],
        n: v.len(),
    }
}

fn ms(v: &[Duration]) -> Vec<f64> {
    v.iter().map(|d| d.as_secs_f64() * 1000.0).collect()
}

fn stats(v: &[Duration]) -> Stats {
    stats_f(ms(v))
}

impl Stats {
    fn json(&self) -> Value {
        json!({"median": self.median, "min": self.min, "max": self.max, "n": self.n})
    }
}

/// Median of the per-round ratios a[i] / b[i] (each round measured both back to back).
fn paired_ratio(a: &[Duration], b: &[Duration]) -> Stats {
    stats_f(
        a.iter()
            .zip(b)
            .map(|(x, y)| x.as_secs_f64() / y.as_secs_f64())
            .collect(),
    )
}

/// Waits until everything written so far is on the disk (`sync`).
fn sync_all() {
    let ok = Command::new("sync").status().is_ok_and(|s| s.success());
    assert!(ok, "sync");
}

fn copy_tree(from: &Path, to: &Path) {
    let ok = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "cp -a {} {}", from.display(), to.display());
}

fn file_content(i: usize, size: usize) -> String {
    let line = format!("bench file {i:04} ");
    line.repeat(size / line.len() + 1)[..size].to_string()
}

/// A kubeadm worker tree and a plan writing `files` files of `size` bytes.
fn setup(work: &Path, files: usize, size: usize, id: &str) -> (PathBuf, PathBuf) {
    let template = work.join("template");
    inplace_demo_node::build_kubeadm_worker(&template).expect("template tree");
    let mut plan = format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: {id}\nchanges:\n");
    for i in 0..files {
        plan.push_str(&format!(
            "  - file: {{path: /etc/kubernetes/bench/f{i:04}.conf, mode: \"0644\", content: \"{}\"}}\n",
            file_content(i, size)
        ));
    }
    let plan_path = work.join(format!("{}.yaml", id.replace('/', "_")));
    std::fs::write(&plan_path, plan).expect("plan file");
    (template, plan_path)
}

fn time_cmd(cmd: &mut Command) -> Duration {
    let start = Instant::now();
    let out = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("spawn");
    let took = start.elapsed();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    took
}

fn apply_cmd(root: &Path, plan: &Path) -> Command {
    let mut c = Command::new(agent_bin());
    c.args(["apply", "--no-progress", "--services", "off", "--root"])
        .arg(root)
        .arg(plan);
    c
}

/// The raw atomic durable writes the agent is compared with: temp (O_EXCL), write, fsync,
/// rename, fsync of the directory — per file, as the agent does.
fn baseline_writes(dir: &Path, n: usize, size: usize) {
    use std::os::unix::fs::OpenOptionsExt;
    let target = dir.join("etc/kubernetes/bench");
    std::fs::create_dir_all(&target).expect("mkdir");
    let dirfd = std::fs::File::open(&target).expect("open dir");
    for i in 0..n {
        let name = format!("f{i:04}.conf");
        let tmp = target.join(format!(".{name}.tmp"));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)
            .expect("create temp");
        f.write_all(file_content(i, size).as_bytes())
            .expect("write");
        f.sync_all().expect("fsync");
        drop(f);
        std::fs::rename(&tmp, target.join(&name)).expect("rename");
        dirfd.sync_all().expect("fsync dir");
    }
}

/// The JSON form of the plan file `setup` wrote: the same plan, content plain; for `node`
/// when given (a daemon requires the plan to name it).
fn json_plan(work: &Path, files: usize, size: usize, id: &str, node: Option<&str>) -> PathBuf {
    let changes: Vec<Value> = (0..files)
        .map(|i| {
            json!({"file": {"path": format!("/etc/kubernetes/bench/f{i:04}.conf"), "mode": "0644",
                            "content": file_content(i, size)}})
        })
        .collect();
    let mut plan =
        json!({"apiVersion": "inplace.agent/v1", "kind": "Plan", "id": id, "changes": changes});
    if let Some(node) = node {
        plan["nodeName"] = node.into();
    }
    let path = work.join(format!(
        "{}-{}.json",
        id.replace('/', "_"),
        node.unwrap_or("any")
    ));
    std::fs::write(&path, plan.to_string()).expect("plan file");
    path
}

/// Peak RSS (KiB) of one `apply` of `plan` on a copy of `template`, by GNU time.
fn peak_rss(work: &Path, template: &Path, plan: &Path, name: &str) -> Option<u64> {
    if !Path::new("/usr/bin/time").exists() {
        return None;
    }
    let a = work.join(name);
    copy_tree(template, &a);
    let mut c = Command::new("/usr/bin/time");
    c.arg("-v")
        .arg(agent_bin())
        .args(apply_cmd(&a, plan).get_args())
        .stdout(Stdio::null());
    let out = c.output().expect("spawn /usr/bin/time");
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .find_map(|l| {
            l.trim()
                .strip_prefix("Maximum resident set size (kbytes): ")
        })
        .and_then(|v| v.parse::<u64>().ok())
}

/// Apply N files against the baseline, side by side, through each front end: `apply` of
/// the YAML plan file and of the JSON one, and `submit --wait` of the JSON one over mutual
/// TLS to a running `serve` (its start is not timed; the file is streamed to the agent as
/// it is read, `SubmitPlanDocument`). Each round times all four, in an order that rotates,
/// on fresh copies of the same tree.
/// Applies `files` files of `size` bytes through each front end and as raw atomic writes,
/// alternating; with `replace`, onto files of as many bytes already there (other contents,
/// each its own), which the agent backs up before replacing them.
fn apply_files(files: usize, size: usize, runs: usize, replace: bool) -> Value {
    let load_before = load();
    let work = tempfile::tempdir().expect("tempdir");
    let (template, plan) = setup(work.path(), files, size, "bench/apply");
    if replace {
        let dir = template.join("etc/kubernetes/bench");
        std::fs::create_dir_all(&dir).expect("mkdir");
        for i in 0..files {
            std::fs::write(
                dir.join(format!("f{i:04}.conf")),
                file_content(i + files, size),
            )
            .expect("existing file");
        }
    }
    let plan_json = json_plan(work.path(), files, size, "bench/apply", None);
    let pki = NodePki::new("bench-node").expect("pki");
    let plan_grpc = json_plan(work.path(), files, size, "bench/apply", Some(&pki.node));
    let (mut yaml, mut jsn, mut grpc, mut base) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let me = std::env::current_exe().expect("current exe");
    for i in 0..runs {
        let dirs: Vec<PathBuf> = ["y", "j", "g", "b"]
            .iter()
            .map(|k| work.path().join(format!("{k}{i}")))
            .collect();
        for d in &dirs {
            copy_tree(&template, d);
        }
        // The rounds start from trees on the disk, as a node's files are: the copies' writeback
        // is not left to land in the middle of a round (nor, when a plan replaces them, in the
        // agent's sync of their backups).
        sync_all();
        // A 50 MiB plan is more than the default largest message (16 MiB).
        let daemon = serve_with(
            work.path(),
            &dirs[2],
            &dirs[2].join("var/lib/inplace-agent"),
            &pki,
            &["--max-message-bytes", "134217728"],
        );
        let mut submit = Command::new(agent_bin());
        submit
            .args(["submit", "--wait", "--addr", &daemon.addr])
            .args(pki.client_flags(support::pki::As::Updater))
            .arg(&plan_grpc);
        let mut order: Vec<Box<dyn FnMut()>> = vec![
            Box::new(|| yaml.push(time_cmd(&mut apply_cmd(&dirs[0], &plan)))),
            Box::new(|| jsn.push(time_cmd(&mut apply_cmd(&dirs[1], &plan_json)))),
            Box::new(|| grpc.push(time_cmd(&mut submit))),
            Box::new(|| {
                base.push(time_cmd(
                    Command::new(&me)
                        .arg("baseline-writes")
                        .arg(&dirs[3])
                        .arg(files.to_string())
                        .arg(size.to_string()),
                ))
            }),
        ];
        // Rotate who goes first, so drift hits all equally.
        order.rotate_left(i % 4);
        for run in &mut order {
            run();
        }
        drop(order);
        drop(daemon);
        for d in &dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    let peak_kib = peak_rss(work.path(), &template, &plan, "timed-yaml");
    let peak_json_kib = peak_rss(work.path(), &template, &plan_json, "timed-json");
    let plan_bytes = std::fs::metadata(&plan_json).map(|m| m.len()).unwrap_or(0);
    let (sa, sb) = (stats(&yaml), stats(&base));
    let (r, rj, rg) = (
        paired_ratio(&yaml, &base),
        paired_ratio(&jsn, &base),
        paired_ratio(&grpc, &base),
    );
    eprintln!(
        "apply {files}×{size}{}: baseline {:.1} ms; yaml {:.1} ms ({:.2}×), json {:.1} ms ({:.2}×), grpc {:.1} ms ({:.2}×)",
        if replace { " onto existing files" } else { "" },
        sb.median,
        sa.median,
        r.median,
        stats(&jsn).median,
        rj.median,
        stats(&grpc).median,
        rg.median
    );
    json!({"files": files, "size": size, "replace": replace, "agent": sa.json(), "baseline": sb.json(),
           "agentJson": stats(&jsn).json(), "agentGrpc": stats(&grpc).json(),
           "ratio": r.json(), "ratioJson": rj.json(), "ratioGrpc": rg.json(),
           "planBytes": plan_bytes,
           "agentPeakRssKiB": peak_kib, "agentPeakRssJsonKiB": peak_json_kib,
           "load": [load_before, load()]})
}

/// Times `commands` with hyperfine (each with its `prepare`), when hyperfine is installed;
/// returns one sample list per command, in milliseconds.
fn hyperfine(commands: &[(String, String)], runs: usize) -> Option<Vec<Vec<f64>>> {
    let bin = std::env::var_os("HYPERFINE").unwrap_or_else(|| "hyperfine".into());
    let out = tempfile::NamedTempFile::new().ok()?;
    let mut cmd = Command::new(bin);
    cmd.args(["--style", "none", "--warmup", "1", "--shell", "bash"])
        .args(["--runs", &runs.to_string()])
        .arg("--export-json")
        .arg(out.path());
    for (prepare, command) in commands {
        cmd.args(["--prepare", prepare]).arg(command);
    }
    let status = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .status()
        .ok()?;
    if !status.success() {
        return None;
    }
    let report: Value = serde_json::from_slice(&std::fs::read(out.path()).ok()?).ok()?;
    report["results"]
        .as_array()?
        .iter()
        .map(|r| {
            r["times"].as_array().map(|t| {
                t.iter()
                    .filter_map(|x| x.as_f64())
                    .map(|s| s * 1000.0)
                    .collect()
            })
        })
        .collect()
}

fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

/// No-op re-apply of the 500-file plan: the same desired state under a new id (every file is
/// diffed, the plan is journaled), and the very same plan again (already succeeded).
fn noop(files: usize, runs: usize) -> Value {
    let load_before = load();
    let work = tempfile::tempdir().expect("tempdir");
    let (template, plan) = setup(work.path(), files, 4096, "bench/noop");
    let root = work.path().join("node");
    copy_tree(&template, &root);
    time_cmd(&mut apply_cmd(&root, &plan));
    let again = work.path().join("again.yaml");
    std::fs::copy(&plan, &again).expect("plan");
    let apply = |p: &Path| {
        format!(
            "{} apply --no-progress --services off --root {} {} >/dev/null",
            shell_quote(&agent_bin()),
            shell_quote(&root),
            shell_quote(p)
        )
    };
    let new_id = format!(
        "sed -i \"s|^id: .*|id: bench/noop-$(date +%s%N)|\" {}",
        shell_quote(&again)
    );
    // The same desired state as a JSON plan file (plain content), under a new id each run.
    let again_json = json_plan(work.path(), files, 4096, "bench/noop", None);
    let new_id_json = format!(
        "sed -i \"s|\\\"id\\\":\\\"[^\\\"]*\\\"|\\\"id\\\":\\\"bench/noop-json-$(date +%s%N)\\\"|\" {}",
        shell_quote(&again_json)
    );
    let (new_ms, same_ms, json_ms, tool) = match hyperfine(
        &[
            (new_id, apply(&again)),
            ("true".into(), apply(&plan)),
            (new_id_json, apply(&again_json)),
        ],
        runs,
    ) {
        Some(mut v) if v.len() == 3 => {
            let json = v.pop().unwrap_or_default();
            let same = v.pop().unwrap_or_default();
            let new = v.pop().unwrap_or_default();
            (new, same, json, "hyperfine")
        }
        _ => {
            let text = std::fs::read_to_string(&plan).expect("plan");
            let text_json = std::fs::read_to_string(&again_json).expect("plan");
            let (mut same, mut new, mut json) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..runs {
                same.push(time_cmd(&mut apply_cmd(&root, &plan)));
                std::fs::write(
                    &again,
                    text.replace("id: bench/noop", &format!("id: bench/noop-{i}")),
                )
                .expect("plan");
                new.push(time_cmd(&mut apply_cmd(&root, &again)));
                std::fs::write(
                    &again_json,
                    text_json.replace(
                        "\"id\":\"bench/noop\"",
                        &format!("\"id\":\"bench/noop-json-{i}\""),
                    ),
                )
                .expect("plan");
                json.push(time_cmd(&mut apply_cmd(&root, &again_json)));
            }
            (ms(&new), ms(&same), ms(&json), "std::process + Instant")
        }
    };
    let (n, s, j) = (stats_f(new_ms), stats_f(same_ms), stats_f(json_ms));
    eprintln!(
        "no-op re-apply: new id {:.1} ms (JSON {:.1} ms), same plan {:.1} ms ({tool})",
        n.median, j.median, s.median
    );
    json!({"files": files, "newId": n.json(), "newIdJson": j.json(), "samePlan": s.json(),
           "tool": tool, "load": [load_before, load()]})
}

/// The no-op re-apply of a plan of `files` files of `size` bytes (JSON) under a new id each
/// time, after its first apply: the contents are in place, so nothing of them is written
/// (held by their files) and each is read and compared once.
fn noop_large(files: usize, size: usize, runs: usize) -> Value {
    let load_before = load();
    let work = tempfile::tempdir().expect("tempdir");
    let root = work.path().join("node");
    inplace_demo_node::build_kubeadm_worker(&root).expect("tree");
    let plan = json_plan(work.path(), files, size, "bench/noop-large", None);
    let text = std::fs::read_to_string(&plan).expect("plan");
    let first = time_cmd(&mut apply_cmd(&root, &plan));
    let again = work.path().join("again.json");
    let mut times = Vec::with_capacity(runs);
    for i in 0..runs {
        std::fs::write(
            &again,
            text.replacen(
                "\"id\":\"bench/noop-large\"",
                &format!("\"id\":\"bench/noop-large-{i}\""),
                1,
            ),
        )
        .expect("plan");
        times.push(time_cmd(&mut apply_cmd(&root, &again)));
    }
    let stored = std::fs::read_dir(root.join("var/lib/inplace-agent/backups"))
        .map(|d| d.count())
        .unwrap_or(0);
    let n = stats(&times);
    eprintln!(
        "no-op re-apply of {files} x {size} bytes under a new id: {:.1} ms (first apply {:.1} ms); {stored} blobs stored",
        n.median,
        first.as_secs_f64() * 1000.0
    );
    json!({"files": files, "size": size, "planBytes": text.len(), "firstMs": first.as_secs_f64() * 1000.0,
           "newId": n.json(), "blobsStored": stored, "load": [load_before, load()]})
}

/// A plan with 100 file changes whose content names its run, parsed.
fn bench_plan(run: u64, changes: usize) -> inplace_plan::Plan {
    let mut plan = format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: ns/m@{run}\nchanges:\n");
    for i in 0..changes {
        plan.push_str(&format!(
            "  - file: {{path: /etc/kubernetes/r/f{i}.conf, content: \"run {run} value {i}\"}}\n"
        ));
    }
    inplace_plan::parse_plan(plan.as_bytes(), "bench", &inplace_plan::Limits::default())
        .expect("plan")
}

/// Writes a journal of about `records` records shaped like real runs (100-change plans).
fn write_journal(state: &Path, records: u64) -> u64 {
    use inplace_agent::journal::RunPhase as Phase;
    let (mut j, _) = Journal::open(state, |_| {}).expect("journal");
    let mut written = 0;
    let mut run = 1;
    let ts = 1_700_000_000_000;
    while written < records {
        // Every plan differs (its content names its run), as on a real node.
        let parsed = bench_plan(run, 100);
        let (changes, checks) = inplace_agent::engine::table::summaries(&parsed);
        let mut recs = vec![Record::PlanAccepted {
            run,
            id: parsed.id.clone(),
            digest: parsed.digest(),
            attempt: 1,
            source: "bench".into(),
            plan: inplace_agent::journal::PlanDoc::from_value(&parsed.canonical_json()),
            changes,
            checks,
            bodies: None,
            staged: Vec::new(),
            held: Vec::new(),
            prune: None,
        }];
        for phase in [Phase::Preparing, Phase::Applying] {
            recs.push(Record::Phase {
                run,
                phase,
                error: None,
            });
        }
        for index in 0..100u32 {
            recs.push(Record::StepStarted {
                run,
                index,
                planned: Vec::new(),
                preimages: vec![Preimage::File {
                    path: inplace_plan::NodePath::parse(&format!(
                        "/etc/kubernetes/r/f{index}.conf"
                    ))
                    .expect("path"),
                    before: inplace_agent::journal::FileBefore::Absent,
                    created_dirs: Vec::new(),
                }],
            });
            recs.push(Record::StepDone {
                run,
                index,
                changed: true,
                message: format!("write /etc/kubernetes/r/f{index}.conf (9 bytes, 0644 0:0)"),
            });
        }
        recs.push(Record::Phase {
            run,
            phase: Phase::Verifying,
            error: None,
        });
        recs.push(Record::PlanFinished {
            run,
            phase: Phase::Succeeded,
            error: None,
        });
        for rec in recs {
            j.append(ts + written, rec, false).expect("append");
            written += 1;
        }
        run += 1;
    }
    j.sync().expect("sync");
    written
}

fn sandbox_host(root: PathBuf, state: &Path) -> std::sync::Arc<Host> {
    std::sync::Arc::new(
        Host::open(HostSettings {
            root,
            allow: inplace_plan::AllowList::default(),
            commands_in_root: false,
            boot_id_path: None,
            services: inplace_agent::host::ServiceSettings::Off,
            packages: Default::default(),
            downloads: inplace_agent::host::download::DownloadConfig::new(state),
        })
        .expect("host"),
    )
}

fn replay(records: u64, runs: usize) -> Value {
    let load_before = load();
    let work = tempfile::tempdir().expect("tempdir");
    let root = work.path().join("node");
    std::fs::create_dir_all(&root).expect("root");
    let state = work.path().join("state");
    let written = write_journal(&state, records);
    let size = std::fs::metadata(state.join("journal/journal.log"))
        .map(|m| m.len())
        .unwrap_or(0);
    let host = sandbox_host(root, &state);
    let mut times = Vec::new();
    for _ in 0..runs {
        let cfg = EngineConfig::new(state.clone());
        let start = Instant::now();
        let (engine, report) = Engine::open(cfg, host.clone()).expect("open");
        times.push(start.elapsed());
        assert_eq!(report.records, written);
        drop(engine);
    }
    let s = stats(&times);
    eprintln!("replay {written} records: {:.1} ms", s.median);
    json!({"records": written, "bytes": size, "time": s.json(), "load": [load_before, load()]})
}

/// Size of a directory tree in bytes (files only).
fn tree_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => tree_bytes(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

/// The journal's size on disk after `plans` plans (each a 10-file change, run through the
/// engine as the daemon does, compaction included).
fn journal_size(plans: u64) -> Value {
    let load_before = load();
    let work = tempfile::tempdir().expect("tempdir");
    let root = work.path().join("node");
    inplace_demo_node::build_kubeadm_worker(&root).expect("tree");
    let state = work.path().join("state");
    let host = sandbox_host(root, &state);
    let (engine, _) = Engine::open(EngineConfig::new(state.clone()), host).expect("open");
    let journal = state.join("journal/journal.log");
    let (mut peak, mut compactions, mut last) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    for run in 1..=plans {
        let mut plan = bench_plan(run, 10);
        plan.id = format!("default/md-0@{run}");
        engine.submit(plan, "bench", false).expect("submit");
        engine.run_until_idle();
        let size = std::fs::metadata(&journal).map(|m| m.len()).unwrap_or(0);
        if size < last {
            compactions += 1;
        }
        peak = peak.max(size);
        last = size;
    }
    let took = started.elapsed();
    let (size, records) = engine.journal_stats();
    let plans_known = engine.plans().len();
    drop(engine);
    eprintln!(
        "journal after {plans} plans: {size} bytes, {records} records, peak {peak}, {compactions} compactions"
    );
    json!({"plans": plans, "bytes": size, "records": records, "peakBytes": peak,
           "compactions": compactions, "plansKnown": plans_known,
           "backupBytes": tree_bytes(&state.join("backups")),
           "msPerPlan": took.as_secs_f64() * 1000.0 / plans as f64,
           "load": [load_before, load()]})
}

/// A running `serve` of the release binary on `root` with its state in `state`, ready when
/// it said `READY=1` on a notify socket in `home`; stopped with SIGTERM on drop.
fn serve(home: &Path, root: &Path, state: &Path, pki: &NodePki) -> Daemon {
    serve_with(home, root, state, pki, &[])
}

/// [`serve`] with more flags.
fn serve_with(home: &Path, root: &Path, state: &Path, pki: &NodePki, flags: &[&str]) -> Daemon {
    let f = &pki.files;
    let mut cmd = serve_command(
        &agent_bin(),
        root,
        &pki.node,
        &f.server_cert,
        &f.server_key,
        &f.ca_cert,
    );
    cmd.args([
        "--listen",
        "127.0.0.1:0",
        "--no-chroot",
        "--services",
        "off",
    ])
    .arg("--state-dir")
    .arg(state)
    .args(flags)
    .env("INPLACE_AGENT_LOG", "warn");
    Daemon::start(cmd, Ready::Notify(home.join("notify.sock")))
        .unwrap_or_else(|e| panic!("serve: {e}"))
        .on_drop(OnDrop::Term)
}

/// Footprint: the stripped binary, start-up to READY=1 (empty state and a 10,000-record
/// journal), and the idle memory of `serve` with that journal.
fn footprint(runs: usize) -> Value {
    let load_before = load();
    let bin = agent_bin();
    let size = std::fs::metadata(&bin).map(|m| m.len()).unwrap_or(0);
    let stripped = {
        let copy = tempfile::NamedTempFile::new().expect("temp");
        std::fs::copy(&bin, copy.path()).expect("copy binary");
        let ok = Command::new("strip")
            .arg(copy.path())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        ok.then(|| std::fs::metadata(copy.path()).map(|m| m.len()).unwrap_or(0))
    };
    let work = tempfile::tempdir().expect("tempdir");
    let root = work.path().join("node");
    inplace_demo_node::build_kubeadm_worker(&root).expect("tree");
    let pki = NodePki::new("bench-node").expect("pki");
    let empty = work.path().join("state-empty");
    let full = work.path().join("state-10k");
    let records = write_journal(&full, 10_000);
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let _ = std::fs::remove_dir_all(&empty);
        cold.push(serve(work.path(), &root, &empty, &pki).ready_after);
        warm.push(serve(work.path(), &root, &full, &pki).ready_after);
    }
    // Idle memory with the 10,000-record journal: 15 s after READY (the runtime's idle
    // blocking threads are gone by then).
    let serve = serve(work.path(), &root, &full, &pki);
    std::thread::sleep(Duration::from_secs(15));
    let Memory {
        rss,
        anon,
        file,
        hwm,
        pss,
        ..
    } = serve.memory();
    drop(serve);
    let (c, w) = (stats(&cold), stats(&warm));
    eprintln!(
        "footprint: binary {size} bytes; ready in {:.1} ms (empty), {:.1} ms ({records} records); idle RSS {rss} KiB (anon {anon}, file {file}, Pss {pss})",
        c.median, w.median
    );
    json!({"binaryBytes": size, "strippedBytes": stripped,
           "startupEmpty": c.json(), "startupJournal": w.json(), "journalRecords": records,
           "idleRssKiB": {"rss": rss, "anon": anon, "file": file, "pss": pss, "peak": hwm},
           "load": [load_before, load()]})
}

/// The same 500-file change with Ansible (`copy` module, `connection: local`), first apply
/// and no-op re-apply, against `inplace-agent apply` of the same plan, side by side.
fn ansible(files: usize, runs: usize) -> Value {
    let Some(playbook_bin) = std::env::var_os("ANSIBLE_PLAYBOOK") else {
        eprintln!("ansible: skipped (ANSIBLE_PLAYBOOK is not set)");
        return json!({"skipped": "ANSIBLE_PLAYBOOK is not set (benches/run installs ansible-core into a virtualenv)"});
    };
    let load_before = load();
    let work = tempfile::tempdir().expect("tempdir");
    let (template, plan) = setup(work.path(), files, 4096, "bench/ansible");
    let playbook = work.path().join("playbook.yml");
    std::fs::write(
        &playbook,
        format!(
            "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n\
             \x20   - ansible.builtin.file: {{path: \"{{{{ root }}}}/etc/kubernetes/bench\", state: directory, mode: \"0755\"}}\n\
             \x20   - ansible.builtin.copy:\n\
             \x20       dest: \"{{{{ root }}}}/etc/kubernetes/bench/f{{{{ '%04d' | format(item) }}}}.conf\"\n\
             \x20       content: \"{{{{ (('bench file %04d ' | format(item)) * 300)[:4096] }}}}\"\n\
             \x20       mode: \"0644\"\n\
             \x20     loop: \"{{{{ range(0, {files}) | list }}}}\"\n"
        ),
    )
    .expect("playbook");
    // The virtualenv's own interpreter (discovery picks pyenv shims that may not resolve).
    let python = Path::new(&playbook_bin)
        .parent()
        .map(|d| d.join("python"))
        .unwrap_or_else(|| PathBuf::from("python3"));
    let ansible_cmd = |root: &Path| {
        let mut c = Command::new(&playbook_bin);
        c.arg("-i")
            .arg("localhost,")
            .arg("-e")
            .arg(format!("root={}", root.display()))
            .arg(&playbook)
            .env("ANSIBLE_NOCOLOR", "1")
            .env("ANSIBLE_LOCALHOST_WARNING", "False")
            .env("ANSIBLE_PYTHON_INTERPRETER", &python);
        c
    };
    let (mut a_first, mut a_noop, mut g_first, mut g_noop) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let text = std::fs::read_to_string(&plan).expect("plan");
    for i in 0..runs {
        let a = work.path().join(format!("ans{i}"));
        let g = work.path().join(format!("agent{i}"));
        copy_tree(&template, &a);
        copy_tree(&template, &g);
        a_first.push(time_cmd(&mut ansible_cmd(&a)));
        g_first.push(time_cmd(&mut apply_cmd(&g, &plan)));
        a_noop.push(time_cmd(&mut ansible_cmd(&a)));
        let again = work.path().join(format!("again{i}.yaml"));
        std::fs::write(
            &again,
            text.replace("id: bench/ansible", &format!("id: bench/ansible-{i}")),
        )
        .expect("plan");
        g_noop.push(time_cmd(&mut apply_cmd(&g, &again)));
        // Both produced the same files.
        for n in [0, files - 1] {
            let rel = format!("etc/kubernetes/bench/f{n:04}.conf");
            assert_eq!(
                std::fs::read(a.join(&rel)).expect("ansible file"),
                std::fs::read(g.join(&rel)).expect("agent file"),
                "ansible and the agent wrote different content"
            );
        }
        let _ = std::fs::remove_dir_all(&a);
        let _ = std::fs::remove_dir_all(&g);
    }
    let first = paired_ratio(&a_first, &g_first);
    let again = paired_ratio(&a_noop, &g_noop);
    eprintln!(
        "ansible: first apply {:.0}× slower, no-op {:.0}× slower than the agent",
        first.median, again.median
    );
    json!({"files": files, "runs": runs,
           "ansibleFirst": stats(&a_first).json(), "agentFirst": stats(&g_first).json(),
           "ansibleNoop": stats(&a_noop).json(), "agentNoop": stats(&g_noop).json(),
           "firstRatio": first.json(), "noopRatio": again.json(),
           "load": [load_before, load()]})
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0);
    json!({"cores": cores, "cpu": cpu, "kernel": kernel.trim(), "memGiB": mem_kib as f64 / 1048576.0})
}

fn write_json(args: &[String], v: &Value) {
    if let Some(out) = args.windows(2).find(|w| w[0] == "--json").map(|w| &w[1]) {
        std::fs::write(out, format!("{v:#}\n")).expect("write figures");
    }
    println!("{v:#}");
}

/// Idle memory of `serve` on a node where the 500-file plan succeeded: drift watching on
/// (its start-up check done, inotify on the plan's directory) against `--no-drift-checks`,
/// in the same rounds (who goes first alternates), 15 s after READY each. With
/// `PERF_DUMP_SMAPS=DIR`, each daemon's `/proc/PID/smaps` and `status` are copied to
/// `DIR/smaps-{on,off}` and `DIR/status-{on,off}` (the last round's) to see where it differs.
fn drift_idle(runs: usize) -> Value {
    let load_before = load();
    let work = tempfile::tempdir().expect("tempdir");
    let (template, plan) = setup(work.path(), 500, 4096, "bench/drift");
    let root = work.path().join("node");
    copy_tree(&template, &root);
    time_cmd(&mut apply_cmd(&root, &plan));
    let state = root.join("var/lib/inplace-agent");
    let pki = NodePki::new("bench-node").expect("pki");
    let idle = |flags: &[&str]| {
        let serve = serve_with(work.path(), &root, &state, &pki, flags);
        std::thread::sleep(Duration::from_secs(15));
        if let Ok(dir) = std::env::var("PERF_DUMP_SMAPS") {
            let name = if flags.is_empty() { "on" } else { "off" };
            let _ = std::fs::copy(
                format!("/proc/{}/smaps", serve.pid()),
                format!("{dir}/smaps-{name}"),
            );
            let _ = std::fs::copy(
                format!("/proc/{}/status", serve.pid()),
                format!("{dir}/status-{name}"),
            );
        }
        serve.memory()
    };
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for round in 0..runs {
        if round % 2 == 0 {
            on.push(idle(&[]));
            off.push(idle(&["--no-drift-checks"]));
        } else {
            off.push(idle(&["--no-drift-checks"]));
            on.push(idle(&[]));
        }
    }
    let rss = |m: &[Memory]| stats_f(m.iter().map(|m| m.rss as f64).collect());
    let ratios: Vec<f64> = on
        .iter()
        .zip(&off)
        .map(|(a, b)| a.rss as f64 / b.rss.max(1) as f64)
        .collect();
    let ratio = stats_f(ratios);
    let (a, b) = (rss(&on), rss(&off));
    let anon = |m: &[Memory]| stats_f(m.iter().map(|m| m.anon as f64).collect());
    let (a_anon, b_anon) = (anon(&on), anon(&off));
    eprintln!(
        "idle RSS with a 500-file baseline: drift watching {:.0} KiB (anon {:.0}), off {:.0} KiB \
         (anon {:.0}), ratio {:.3}",
        a.median, a_anon.median, b.median, b_anon.median, ratio.median
    );
    json!({"files": 500, "watchingKiB": a.json(), "offKiB": b.json(), "ratio": ratio.json(),
           "watchingAnonKiB": a_anon.json(), "offAnonKiB": b_anon.json(),
           "load": [load_before, load()]})
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; ignore it.
    let args: Vec<String> = args.into_iter().filter(|a| a != "--bench").collect();
    let quick = args.iter().any(|a| a == "--quick");
    let runs = |n: usize| if quick { n.min(3) } else { n };
    let r = |name: &str, default: u64| arg(&args, name, default) as usize;
    let v = match args.first().map(String::as_str) {
        Some("baseline-writes") => {
            let dir = PathBuf::from(&args[1]);
            baseline_writes(
                &dir,
                args[2].parse().expect("n"),
                args[3].parse().expect("size"),
            );
            return;
        }
        Some("apply-files") => apply_files(
            r("--files", 500),
            r("--size", 4096),
            r("--runs", 7),
            args.iter().any(|a| a == "--replace"),
        ),
        Some("noop") => noop(r("--files", 500), r("--runs", 10)),
        Some("noop-large") => noop_large(r("--files", 50), r("--size", 1 << 20), r("--runs", 7)),
        Some("replay") => replay(arg(&args, "--records", 100_000), r("--runs", 5)),
        Some("journal-size") => journal_size(arg(&args, "--plans", 1000)),
        Some("footprint") => footprint(r("--runs", 10)),
        Some("drift-idle") => drift_idle(r("--runs", 3)),
        Some("ansible") => ansible(r("--files", 500), r("--runs", 1)),
        Some("all") | None => json!({
            "machine": machine(),
            "apply4k": apply_files(500, 4096, runs(9), false),
            "apply1m": apply_files(50, 1 << 20, runs(7), false),
            "apply1mReplace": apply_files(50, 1 << 20, runs(5), true),
            "noop": noop(500, runs(15)),
            "noopLarge": noop_large(50, 1 << 20, runs(7)),
            "replay100k": replay(100_000, runs(5)),
            "replay1m": replay(1_000_000, runs(3)),
            "journalSize": journal_size(1000),
            "footprint": footprint(runs(10)),
            "driftIdle": drift_idle(runs(3)),
            // One round: Ansible takes minutes per apply of 500 files.
            "ansible": ansible(500, 1),
        }),
        Some(other) => {
            eprintln!("unknown measurement {other:?}");
            std::process::exit(2);
        }
    };
    write_json(&args, &v);
}

//! The performance suite's measuring program (`benches/run` builds and runs it).
//!
//! Every figure is a median over several runs, and every comparison is measured side by side
//! in the same run (A and B alternate), because these machines are noisy. Whole-process
//! measurements spawn the release binary of the agent (`INPLACE_AGENT_BIN`).
//!
//! ```text
//! perf all [--out FILE] [--quick]      every measurement, Markdown to FILE (and stdout)
//! perf apply-files [--files N] [--size BYTES] [--runs R]
//! perf noop [--files N] [--runs R]
//! perf replay [--records N] [--runs R]
//! perf baseline-writes DIR N SIZE      (internal) the raw atomic-write baseline
//! ```

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use inplace_agent::engine::{Engine, EngineConfig};
use inplace_agent::host::{Host, HostSettings};
use inplace_agent::journal::{Journal, Preimage, Record};

fn agent_bin() -> PathBuf {
    std::env::var_os("INPLACE_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target/release/inplace-agent"))
}

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.windows(2)
        .find(|w| w[0] == name)
        .and_then(|w| w[1].parse().ok())
        .unwrap_or(default)
}

/// Median, min and max of durations in milliseconds.
#[derive(Debug, Clone, Copy)]
struct Stats {
    median: f64,
    min: f64,
    max: f64,
}

fn stats(mut v: Vec<Duration>) -> Stats {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let median = if v.len() % 2 == 1 {
        ms(v[v.len() / 2])
    } else {
        (ms(v[v.len() / 2 - 1]) + ms(v[v.len() / 2])) / 2.0
    };
    Stats {
        median,
        min: ms(v[0]),
        max: ms(v[v.len() - 1]),
    }
}

impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} ms (min {:.1}, max {:.1})",
            self.median, self.min, self.max
        )
    }
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
    inplace_agent::cli::demo::build_kubeadm_worker(&template).expect("template tree");
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
    c.args(["apply", "--no-progress", "--root"])
        .arg(root)
        .arg(plan);
    c
}

/// The raw atomic durable writes the agent is compared with: temp (O_EXCL), write, fsync,
/// rename, fsync of the directory — per file, as the agent does.
fn baseline_writes(dir: &Path, n: usize, size: usize) {
    use std::io::Write;
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

struct Report {
    lines: Vec<String>,
}

impl Report {
    fn say(&mut self, s: String) {
        println!("{s}");
        self.lines.push(s);
    }
}

fn apply_files(r: &mut Report, files: usize, size: usize, runs: usize) {
    let work = tempfile::tempdir().expect("tempdir");
    let (template, plan) = setup(work.path(), files, size, "bench/apply");
    let mut agent = Vec::new();
    let mut base = Vec::new();
    let me = std::env::current_exe().expect("current exe");
    for i in 0..runs {
        let a = work.path().join(format!("a{i}"));
        let b = work.path().join(format!("b{i}"));
        copy_tree(&template, &a);
        copy_tree(&template, &b);
        // Alternate which goes first, so drift hits both equally.
        let mut run_agent = || agent.push(time_cmd(&mut apply_cmd(&a, &plan)));
        let mut run_base = || {
            base.push(time_cmd(
                Command::new(&me)
                    .arg("baseline-writes")
                    .arg(&b)
                    .arg(files.to_string())
                    .arg(size.to_string()),
            ))
        };
        if i % 2 == 0 {
            run_agent();
            run_base();
        } else {
            run_base();
            run_agent();
        }
        let _ = std::fs::remove_dir_all(&a);
        let _ = std::fs::remove_dir_all(&b);
    }
    let (sa, sb) = (stats(agent), stats(base));
    r.say(format!(
        "| apply {files} files of {} KiB | agent {sa} | baseline {sb} | **{:.2}×** (target ≤ 1.25×) |",
        size / 1024,
        sa.median / sb.median
    ));
}

fn noop(r: &mut Report, files: usize, runs: usize) {
    let work = tempfile::tempdir().expect("tempdir");
    let (template, plan) = setup(work.path(), files, 4096, "bench/noop");
    let root = work.path().join("node");
    copy_tree(&template, &root);
    time_cmd(&mut apply_cmd(&root, &plan));
    let text = std::fs::read_to_string(&plan).expect("plan");
    let mut same_id = Vec::new();
    let mut new_id = Vec::new();
    for i in 0..runs {
        same_id.push(time_cmd(&mut apply_cmd(&root, &plan)));
        let p = work.path().join(format!("again{i}.yaml"));
        std::fs::write(
            &p,
            text.replace("id: bench/noop", &format!("id: bench/noop-{i}")),
        )
        .expect("plan");
        new_id.push(time_cmd(&mut apply_cmd(&root, &p)));
    }
    r.say(format!(
        "| no-op re-apply, {files} files, same desired state under a new id (diffs every file) | {} | target ≤ 50 ms |",
        stats(new_id)
    ));
    r.say(format!(
        "| no-op re-apply, {files} files, the same plan again (already succeeded) | {} | |",
        stats(same_id)
    ));
}

/// Writes a journal of about `records` records shaped like real runs (100-change plans).
fn write_journal(state: &Path, records: u64) -> u64 {
    let (mut j, _) = Journal::open(state, |_| {}).expect("journal");
    let mut written = 0;
    let mut run = 1;
    let ts = 1_700_000_000_000;
    while written < records {
        // Every plan differs (its content names its run), as on a real node.
        let mut plan =
            format!("apiVersion: inplace.agent/v1\nkind: Plan\nid: ns/m@{run}\nchanges:\n");
        for i in 0..100 {
            plan.push_str(&format!(
                "  - file: {{path: /etc/kubernetes/r/f{i}.conf, content: \"run {run} value {i}\"}}\n"
            ));
        }
        let parsed = inplace_agent::plan::parse_plan(
            plan.as_bytes(),
            "bench",
            &inplace_agent::plan::Limits::default(),
        )
        .expect("plan");
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
        }];
        for phase in [
            inplace_agent::engine::status::Phase::Preparing,
            inplace_agent::engine::status::Phase::Applying,
        ] {
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
                preimages: vec![Preimage::File {
                    path: inplace_agent::plan::NodePath::parse(&format!(
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
            phase: inplace_agent::engine::status::Phase::Verifying,
            error: None,
        });
        recs.push(Record::PlanFinished {
            run,
            phase: inplace_agent::engine::status::Phase::Succeeded,
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

fn replay(r: &mut Report, records: u64, runs: usize) {
    let work = tempfile::tempdir().expect("tempdir");
    let root = work.path().join("node");
    std::fs::create_dir_all(&root).expect("root");
    let state = work.path().join("state");
    let written = write_journal(&state, records);
    let size = std::fs::metadata(state.join("journal/journal.log"))
        .map(|m| m.len())
        .unwrap_or(0);
    let host = std::sync::Arc::new(
        Host::open(HostSettings {
            root,
            commands_in_root: false,
            boot_id_path: None,
            services: inplace_agent::host::ServiceSettings::Off,
            packages: Default::default(),
            downloads: inplace_agent::host::download::DownloadConfig::new(&state),
        })
        .expect("host"),
    );
    let mut times = Vec::new();
    for _ in 0..runs {
        let cfg = EngineConfig::new(state.clone());
        let start = Instant::now();
        let (engine, report) = Engine::open(cfg, host.clone()).expect("open");
        times.push(start.elapsed());
        assert_eq!(report.records, written);
        drop(engine);
    }
    let target = if records >= 1_000_000 {
        "target ≤ 1500 ms"
    } else {
        "target ≤ 200 ms"
    };
    r.say(format!(
        "| replay a journal of {written} records ({:.1} MiB) into the engine's state | {} | {target} |",
        size as f64 / (1 << 20) as f64,
        stats(times)
    ));
}

/// The same 500-file change with Ansible (`copy` module, `connection: local`), first apply
/// and no-op re-apply, against `inplace-agent apply` of the same plan, side by side.
fn ansible(r: &mut Report, files: usize, runs: usize) {
    let Some(playbook_bin) = std::env::var_os("ANSIBLE_PLAYBOOK") else {
        r.say("| Ansible comparison | skipped: ANSIBLE_PLAYBOOK is not set (benches/run installs ansible-core into a virtualenv) | | |".into());
        return;
    };
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
        a_noop.push(time_cmd(&mut ansible_cmd(&a)));
        g_first.push(time_cmd(&mut apply_cmd(&g, &plan)));
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
    let (af, an, gf, gn) = (stats(a_first), stats(a_noop), stats(g_first), stats(g_noop));
    r.say(format!(
        "| {files} files, first apply: Ansible copy vs agent | Ansible {af} | agent {gf} | **{:.1}× faster** (target ≥ 20×) |",
        af.median / gf.median
    ));
    r.say(format!(
        "| {files} files, no-op re-apply: Ansible copy vs agent | Ansible {an} | agent {gn} | **{:.1}× faster** (target ≥ 20×) |",
        an.median / gn.median
    ));
}

fn machine() -> String {
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
    format!("{cores} cores, {cpu}, Linux {}", kernel.trim())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; ignore it.
    let args: Vec<String> = args.into_iter().filter(|a| a != "--bench").collect();
    let mut r = Report { lines: Vec::new() };
    let quick = args.iter().any(|a| a == "--quick");
    let runs = |n: usize| if quick { n.min(3) } else { n };
    match args.first().map(String::as_str) {
        Some("baseline-writes") => {
            let dir = PathBuf::from(&args[1]);
            baseline_writes(
                &dir,
                args[2].parse().expect("n"),
                args[3].parse().expect("size"),
            );
        }
        Some("apply-files") => apply_files(
            &mut r,
            arg(&args, "--files", 500) as usize,
            arg(&args, "--size", 4096) as usize,
            arg(&args, "--runs", 7) as usize,
        ),
        Some("noop") => noop(
            &mut r,
            arg(&args, "--files", 500) as usize,
            arg(&args, "--runs", 10) as usize,
        ),
        Some("replay") => replay(
            &mut r,
            arg(&args, "--records", 100_000),
            arg(&args, "--runs", 5) as usize,
        ),
        Some("ansible") => ansible(
            &mut r,
            arg(&args, "--files", 500) as usize,
            arg(&args, "--runs", 3) as usize,
        ),
        Some("all") | None => {
            r.say(format!("Machine: {}", machine()));
            r.say(String::new());
            r.say("| measurement | result | baseline / target | ratio |".into());
            r.say("|---|---|---|---|".into());
            apply_files(&mut r, 500, 4096, runs(7));
            apply_files(&mut r, 50, 1 << 20, runs(5));
            noop(&mut r, 500, runs(10));
            replay(&mut r, 100_000, runs(5));
            replay(&mut r, 1_000_000, runs(3));
            ansible(&mut r, 500, 1);
            ansible(&mut r, 500, 1);
            if let Some(out) = args
                .windows(2)
                .find(|w| w[0] == "--out")
                .map(|w| w[1].clone())
            {
                std::fs::write(&out, r.lines.join("\n") + "\n").expect("write results");
            }
        }
        Some(other) => {
            eprintln!("unknown measurement {other:?}");
            std::process::exit(2);
        }
    }
}

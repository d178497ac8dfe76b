//! The Kubernetes version bump on a real systemd, timed: from `inplace-agent apply` of
//! `examples/plans/upgrade-1.30-to-1.31.yaml` (or `-dnf.yaml`) to `Succeeded`, split by phase
//! and step from the journal's timestamps.
//!
//! ```sh
//! sudo cargo bench --bench upgrade                       # apt, 5 rounds
//! sudo cargo bench --bench upgrade -- --manager dnf --rounds 3 --payload-mib 60 --json /tmp/u.json
//! ```
//!
//! Each round boots a fresh sandboxed node (`inplace_agent::sandbox`: this machine's systemd
//! on an overlay of `/`), builds a local repository of the stand-in packages in it and
//! installs 1.30 from it, with the packaged `kubelet.service` running the kubelet stand-in
//! (none of that is timed), then runs the release binary as the tests do (`apply --root
//! /proc/<pid>/root --bus ...` in the node's network namespace) and times it. The figures are
//! the median (min–max) over the rounds. `--payload-mib N` adds N MiB of incompressible bytes
//! to each package, to approach the size of the real ones (kubelet, kubeadm and kubectl
//! binaries are 55–80 MB); without it the packages are a few hundred KB.
//!
//! Needs root (namespaces, mounts, cgroups) and the tools to build the repository; without
//! them it says why and exits 0 (`{"skipped": "..."}` with `--json`). Not a pass/fail test.

#[path = "../tests/support/mod.rs"]
mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use inplace_agent::host::packages::ManagerKind;
use inplace_agent::sandbox::packages::{self, Content, PackageFile};
use inplace_agent::sandbox::{BootError, SandboxNode, Standin};
use serde_json::{Value, json};

use support::sandbox::{STANDIN, agent_command};

struct Options {
    kind: ManagerKind,
    rounds: usize,
    payload_mib: u64,
    json: Option<PathBuf>,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let value = |name: &str| args.windows(2).find(|w| w[0] == name).map(|w| w[1].clone());
    let kind = match value("--manager").as_deref() {
        None | Some("apt") => ManagerKind::Apt,
        Some("dnf") => ManagerKind::Dnf,
        Some(other) => panic!("--manager {other}: apt or dnf"),
    };
    Options {
        kind,
        rounds: value("--rounds").map_or(5, |v| v.parse().expect("--rounds N")),
        payload_mib: value("--payload-mib").map_or(0, |v| v.parse().expect("--payload-mib N")),
        json: value("--json").map(PathBuf::from),
    }
}

/// One round's figures, in milliseconds, by name (in the order they happen).
type Figures = Vec<(String, f64)>;

/// Milliseconds since midnight of a journal time (`2026-11-30T14:35:46.123Z`).
fn ms_of_day(time: &str) -> f64 {
    let t = time.get(11..time.len().saturating_sub(1)).unwrap_or("");
    let mut parts = t.split(':').map(|p| p.parse::<f64>().unwrap_or(0.0));
    let (h, m, s) = (
        parts.next().unwrap_or(0.0),
        parts.next().unwrap_or(0.0),
        parts.next().unwrap_or(0.0),
    );
    (h * 3600.0 + m * 60.0 + s) * 1000.0
}

/// Incompressible bytes (xorshift), `mib` MiB, in a file of the work directory.
fn payload(dir: &Path, mib: u64) -> PathBuf {
    let path = dir.join(format!("payload-{mib}mib"));
    let mut out = std::io::BufWriter::new(std::fs::File::create(&path).expect("payload"));
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..mib * 1024 * 128 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.write_all(&x.to_le_bytes()).expect("write payload");
    }
    out.flush().expect("flush payload");
    path
}

/// Why a round did not measure anything.
enum RoundError {
    /// This machine cannot run a sandbox (not root, no systemd): skip.
    Unavailable(String),
    /// It should have worked.
    Failed(String),
}

impl From<String> for RoundError {
    fn from(s: String) -> RoundError {
        RoundError::Failed(s)
    }
}

impl From<&str> for RoundError {
    fn from(s: &str) -> RoundError {
        RoundError::Failed(s.to_string())
    }
}

/// Boots a node, installs 1.30, applies the upgrade and returns the figures.
fn round(opts: &Options, payload: Option<&Path>) -> Result<(Figures, Value), RoundError> {
    let node = SandboxNode::try_boot().map_err(|e| match e {
        BootError::Unavailable(why) => RoundError::Unavailable(why),
        BootError::Failed(why) => RoundError::Failed(why),
    })?;
    let (old, new) = packages::versions(opts.kind);
    let standin = Standin::Binary(Path::new(STANDIN));
    let mut pkgs = packages::kube_packages(old, standin);
    pkgs.extend(packages::kube_packages(new, standin));
    if let Some(payload) = payload {
        for p in &mut pkgs {
            p.files.push(PackageFile {
                path: format!("/usr/share/{}-standin/payload", p.name),
                content: Content::CopyOf(payload.to_path_buf()),
                mode: 0o644,
            });
        }
    }
    node.install_kube_packages_from(opts.kind, standin, &pkgs)?;
    let example = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/plans")
        .join(match opts.kind {
            ManagerKind::Apt => "upgrade-1.30-to-1.31.yaml",
            ManagerKind::Dnf => "upgrade-1.30-to-1.31-dnf.yaml",
        });
    let agent = |args: &[&str]| {
        let mut cmd = agent_command(&node, args);
        cmd.env("INPLACE_AGENT_LOG", "error");
        cmd
    };

    let started = Instant::now();
    let out = agent(&["apply", "--no-progress", "-o", "json"])
        .arg(&example)
        .output()
        .map_err(|e| format!("run the agent: {e}"))?;
    let wall = started.elapsed().as_secs_f64() * 1000.0;
    let status: Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "status: {e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if status["phase"] != "Succeeded" {
        return Err(format!("the upgrade did not succeed: {status:#}").into());
    }
    for name in packages::KUBE_PACKAGES {
        let got = packages::installed(&node.path("/"), opts.kind, name);
        if got != Some((new.to_string(), true)) {
            return Err(format!("{name} is {got:?} after the upgrade").into());
        }
    }
    let run = status["run"].as_u64().unwrap_or(0);
    let journal = agent(&["journal", "-o", "json"])
        .output()
        .map_err(|e| format!("run journal: {e}"))?;
    let all: Value =
        serde_json::from_slice(&journal.stdout).map_err(|e| format!("journal: {e}"))?;
    let records: Vec<(String, f64, Value)> = all
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
        .iter()
        .filter(|e| e["run"].as_u64() == Some(run))
        .map(|e| {
            let kind = e["type"].as_str().unwrap_or_default().to_string();
            let at = ms_of_day(e["time"].as_str().unwrap_or_default());
            (kind.clone(), at, e["record"][&kind].clone())
        })
        .collect();
    let at = |kind: &str, pred: &dyn Fn(&Value) -> bool| {
        records
            .iter()
            .find(|(k, _, r)| k == kind && pred(r))
            .map(|(_, t, _)| *t)
    };
    let any = |_: &Value| true;
    let accepted = at("planAccepted", &any).ok_or("no planAccepted record")?;
    let finished = at("planFinished", &any).ok_or("no planFinished record")?;
    let mut figures: Figures = vec![
        ("apply (process, wall)".into(), wall),
        ("accepted → Succeeded (journal)".into(), finished - accepted),
    ];
    // Phases: from each phase record to the next (the last one to planFinished).
    let marks: Vec<(String, f64)> = records
        .iter()
        .filter(|(k, _, _)| k == "phase")
        .map(|(_, t, r)| (r["phase"].as_str().unwrap_or_default().to_string(), *t))
        .chain(std::iter::once(("end".to_string(), finished)))
        .collect();
    if let Some((_, first)) = marks.first() {
        figures.push(("  accepted → Preparing".into(), first - accepted));
    }
    for w in marks.windows(2) {
        figures.push((format!("  {}", w[0].0), w[1].1 - w[0].1));
        match w[0].0.as_str() {
            "Applying" => {
                for c in status["changes"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or(&[])
                {
                    figures.push((
                        format!(
                            "    {} {}",
                            c["kind"].as_str().unwrap_or_default(),
                            c["target"].as_str().unwrap_or_default()
                        ),
                        c["durationMs"].as_f64().unwrap_or(0.0),
                    ));
                }
            }
            "Restarting" => {
                if let Some(reloaded) = at("daemonReloaded", &any) {
                    figures.push(("    daemon-reload".into(), reloaded - w[0].1));
                }
                let job = |k: &str| at(k, &|r: &Value| r["unit"] == "kubelet.service");
                if let (Some(s), Some(d)) = (job("unitJobStarted"), job("unitJobDone")) {
                    figures.push(("    restart kubelet.service".into(), d - s));
                }
            }
            _ => {}
        }
    }
    // The same desired state again under a new plan id: every change diffs to nothing (no
    // package command, no reload, no restart); the idempotent re-apply an updater's retry
    // costs on an upgraded node.
    let text = std::fs::read_to_string(&example).map_err(|e| format!("read the plan: {e}"))?;
    let again = node.path("/tmp/upgrade-again.yaml");
    let renamed: String = text
        .lines()
        .map(|l| match l.strip_prefix("id: ") {
            Some(id) => format!("id: {id}-again\n"),
            None => format!("{l}\n"),
        })
        .collect();
    std::fs::write(&again, renamed).map_err(|e| format!("write the plan: {e}"))?;
    let started = Instant::now();
    let out = agent(&["apply", "--no-progress", "-o", "json"])
        .arg(&again)
        .output()
        .map_err(|e| format!("run the agent: {e}"))?;
    let noop = started.elapsed().as_secs_f64() * 1000.0;
    let status: Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("status of the re-apply: {e}"))?;
    if status["phase"] != "Succeeded" || status["counts"]["changed"] != 0 {
        return Err(format!("the re-apply changed something: {status:#}").into());
    }
    figures.push(("no-op re-apply, new id (process, wall)".into(), noop));

    // The package sizes, for the record.
    let sizes = match opts.kind {
        ManagerKind::Apt => repo_sizes(&node.path(packages::APT_REPO), ".deb"),
        ManagerKind::Dnf => repo_sizes(&node.path(packages::RPM_REPO), ".rpm"),
    };
    Ok((figures, sizes))
}

fn repo_sizes(dir: &Path, ext: &str) -> Value {
    let mut sizes = serde_json::Map::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(ext) && name.contains("1.31.2") {
                let len = e.metadata().map(|m| m.len()).unwrap_or(0);
                sizes.insert(name, json!(len));
            }
        }
    }
    Value::Object(sizes)
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let mid = if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    };
    (mid, v[0], v[v.len() - 1])
}

fn main() {
    let opts = options();
    let skip = |why: String| {
        println!("upgrade benchmark skipped: {why}");
        if let Some(path) = &opts.json {
            std::fs::write(path, json!({"skipped": why}).to_string()).expect("write json");
        }
        std::process::exit(0);
    };
    if !rustix::process::geteuid().is_root() {
        skip("needs root (it boots systemd in namespaces on an overlay of /)".into());
    }
    if let Some(why) = packages::missing_tools(Path::new("/"), opts.kind) {
        skip(format!("cannot build a {} repository: {why}", opts.kind));
    }
    let work = tempfile::Builder::new()
        .prefix("inplace-bench-upgrade-")
        .tempdir()
        .expect("tempdir");
    let payload = (opts.payload_mib > 0).then(|| payload(work.path(), opts.payload_mib));
    println!(
        "upgrade benchmark: {} rounds, {}, stand-in packages{}; release binary {}",
        opts.rounds,
        opts.kind,
        if opts.payload_mib > 0 {
            format!(" + {} MiB payload each", opts.payload_mib)
        } else {
            String::new()
        },
        support::bin()
    );
    let mut all: Vec<Figures> = Vec::new();
    let mut sizes = Value::Null;
    for i in 0..opts.rounds {
        match round(&opts, payload.as_deref()) {
            Ok((figures, s)) => {
                let line: Vec<String> = figures
                    .iter()
                    .filter(|(n, _)| !n.starts_with("    "))
                    .map(|(n, ms)| format!("{} {ms:.0}", n.trim()))
                    .collect();
                println!("round {}: {}", i + 1, line.join(", "));
                all.push(figures);
                sizes = s;
            }
            Err(RoundError::Unavailable(why)) => skip(why),
            Err(RoundError::Failed(e)) => {
                eprintln!("round {}: {e}", i + 1);
                std::process::exit(1);
            }
        }
    }
    // Medians per figure, in the order of the first round.
    let mut summary = Vec::new();
    println!("\nmedian (min–max) of {} rounds, ms:", all.len());
    for (idx, (name, _)) in all[0].iter().enumerate() {
        let values: Vec<f64> = all
            .iter()
            .filter_map(|r| r.get(idx).filter(|(n, _)| n == name).map(|(_, v)| *v))
            .collect();
        let (mid, min, max) = median(values);
        println!("  {name:<48} {mid:>8.0}  ({min:.0}–{max:.0})");
        summary.push(json!({"name": name.trim(), "depth": (name.len() - name.trim_start().len()) / 2, "medianMs": mid, "minMs": min, "maxMs": max}));
    }
    println!("packages (1.31.2): {sizes}");
    if let Some(path) = &opts.json {
        let doc = json!({
            "manager": opts.kind.name(),
            "rounds": all.len(),
            "payloadMiB": opts.payload_mib,
            "packageBytes": sizes,
            "figures": summary,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc).expect("json"))
            .expect("write json");
        println!("wrote {}", path.display());
    }
}

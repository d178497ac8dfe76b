//! Power cuts on the VM node, many of them (benches/README.md): the power-cut run of
//! `tests/vm_node.rs` (`tests/vm/powercut.rs`) with 50 cuts by default, reporting how many
//! the node survived, and writing the "Power cuts on a VM node" section of
//! benches/RESULTS.md (only that section).
//!
//!   sudo cargo bench --bench powercut                  # 50 cuts
//!   sudo cargo bench --bench powercut -- --cuts 100 --no-results
//!
//! Needs root and qemu like the tests; without them it says why and exits 0 having written
//! nothing.

#[path = "../tests/vm/mod.rs"]
mod vm;

use std::fmt::Write as _;
use std::time::Instant;

const SECTION: &str = "## Power cuts on a VM node";

fn main() {
    let mut cuts = 50usize;
    let mut write_results = true;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--cuts" => cuts = args.next().and_then(|n| n.parse().ok()).unwrap_or(cuts),
            "--no-results" => write_results = false,
            // cargo bench passes --bench.
            _ => {}
        }
    }
    let Some(env) = vm::require(
        "bench powercut",
        env!("INPLACE_AGENT_EXE"),
        env!("CARGO_BIN_EXE_kubelet-standin"),
    ) else {
        return;
    };
    let began = Instant::now();
    let results = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/RESULTS.md");
    // The section is written after every cut, so a run stopped early still reports what it did.
    let report = match vm::powercut::run(env, cuts, vm::powercut::Route::PackagedUnit, |r| {
        if let Some(c) = r.cuts.last() {
            eprintln!("cut {}", c.summary());
        }
        if write_results {
            write_section(&results, &render(env, r, cuts, began.elapsed()));
        }
    }) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("power-cut bench failed: {e:#}");
            std::process::exit(1);
        }
    };
    let s = render(env, &report, cuts, began.elapsed());
    print!("{s}");
    if write_results {
        write_section(&results, &s);
        eprintln!("wrote the power-cut section of {}", results.display());
    }
    if report.survived() != report.cuts.len() || report.cuts.len() != cuts {
        std::process::exit(1);
    }
}

/// The section for the cuts done so far.
fn render(
    env: &vm::VmEnv,
    report: &vm::powercut::Report,
    planned: usize,
    took: std::time::Duration,
) -> String {
    let survived = report.survived();
    let mut phases = std::collections::BTreeMap::<&str, usize>::new();
    for c in &report.cuts {
        *phases.entry(c.phase_after.as_str()).or_default() += 1;
    }
    let torn = report.cuts.iter().filter(|c| c.torn_tail).count();
    let mut dropped: Vec<u64> = report.cuts.iter().map(|c| c.dropped_sectors).collect();
    dropped.sort_unstable();
    let with_loss = dropped.iter().filter(|&&d| d > 0).count();
    let mut boots = report.boot_ms.clone();
    boots.sort_unstable();
    let median_boot = boots.get(boots.len() / 2).copied().unwrap_or(0);
    let done = if report.cuts.len() < planned {
        format!(
            " (so far: {} of {planned} planned cuts done)",
            report.cuts.len()
        )
    } else {
        String::new()
    };
    let mut s = String::new();
    let _ = writeln!(s, "{SECTION}\n");
    let _ = writeln!(
        s,
        "Produced by `cargo bench --bench powercut` on {}, commit {}; {:.0} min on {}{done}.\n",
        now_utc(),
        commit(),
        took.as_secs_f64() / 60.0,
        env.accel.describe()
    );
    let _ = writeln!(
        s,
        "| measurement | result |\n|---|---|\n\
         | power cuts (SIGKILL of qemu) at random moments of a 301-change plan, node converged to the uninterrupted end state, journal verified, no temp files | **{survived} of {} survived** (seed {}) |\n\
         | where the cuts fell (the phase the agent resumed in; ended before the cut; not accepted yet) | {} |\n\
         | cuts that dropped unflushed writes of the guest | {with_loss} of {} (median {} sectors) |\n\
         | torn journal tails truncated at the next start | {torn} |\n\
         | uninterrupted plan A / plan B, submission → Succeeded (of that accepted → Succeeded) | {} |\n\
         | boot → agent serving (median of {}) | {:.1} s |",
        report.cuts.len(),
        report.seed,
        phases
            .iter()
            .map(|(p, n)| format!("{p} {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        report.cuts.len(),
        dropped.get(dropped.len() / 2).copied().unwrap_or(0),
        report
            .reference
            .iter()
            .map(|t| format!(
                "{}: {:.1} s ({:.1} s)",
                t.plan.to_ascii_uppercase(),
                t.total_ms as f64 / 1000.0,
                t.run_ms as f64 / 1000.0
            ))
            .collect::<Vec<_>>()
            .join(", "),
        boots.len(),
        median_boot as f64 / 1000.0,
    );
    s
}

/// Replaces (or appends) the power-cut section of RESULTS.md, leaving the rest as it is.
fn write_section(path: &std::path::Path, section: &str) {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let kept = match old.find(SECTION) {
        Some(start) => {
            let rest = &old[start + SECTION.len()..];
            let end = rest
                .find("\n## ")
                .map(|i| start + SECTION.len() + i + 1)
                .unwrap_or(old.len());
            format!("{}{}", &old[..start], &old[end..])
        }
        None => old,
    };
    if let Err(e) = std::fs::write(path, format!("{}\n\n{section}", kept.trim_end())) {
        eprintln!("write {}: {e}", path.display());
    }
}

fn now_utc() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

//! Showing a run to a person: a progress bar on a terminal, one line per step otherwise,
//! and the final summary.

use inplace_base::time::now_ms;
use std::io::{IsTerminal, Write};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::engine::Event;
use crate::engine::state::{ChangeState, CheckState, Phase, PlanStatus};

/// Renders events of one run.
pub struct Renderer {
    run: u64,
    bar: Option<ProgressBar>,
    quiet_unchanged: bool,
}

impl Renderer {
    /// A renderer for `run`; draws a bar when stderr is a terminal and `plain` is false.
    pub fn new(run: u64, total: u32, plain: bool) -> Renderer {
        let bar = (!plain && std::io::stderr().is_terminal()).then(|| {
            let bar =
                ProgressBar::with_draw_target(Some(u64::from(total)), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{spinner} [{bar:30}] {pos}/{len} {elapsed} {wide_msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.enable_steady_tick(std::time::Duration::from_millis(120));
            bar
        });
        Renderer {
            run,
            bar,
            quiet_unchanged: false,
        }
    }

    /// Do not print a line for each unchanged change (the demo's re-apply).
    pub fn quiet_unchanged(mut self, yes: bool) -> Renderer {
        self.quiet_unchanged = yes;
        self
    }

    fn line(&self, s: &str) {
        match &self.bar {
            Some(bar) => bar.println(s),
            None => {
                // One write per line (stderr is unbuffered; `writeln!` would make two).
                let _ = std::io::stderr().write_all(format!("{s}\n").as_bytes());
            }
        }
    }

    /// Shows one event; returns the final status when the run ended.
    pub fn event(&mut self, event: &Event) -> Option<PlanStatus> {
        match event {
            Event::Status(status) if status.run == self.run => {
                if let Some(bar) = &self.bar {
                    bar.set_message(status.phase.to_string());
                }
                if status.phase.is_terminal() {
                    if let Some(bar) = self.bar.take() {
                        bar.finish_and_clear();
                    }
                    return Some((**status).clone());
                }
                if !matches!(status.phase, Phase::Pending | Phase::Preparing) {
                    self.line(&format!("  phase {}", status.phase));
                }
                None
            }
            Event::Status(other) => {
                self.line(&format!(
                    "  (plan {} attempt {}: {})",
                    other.id, other.attempt, other.phase
                ));
                None
            }
            Event::Progress(p) if p.run == self.run => {
                let (progress, change, check, restart) =
                    (&p.progress, &p.change, &p.check, &p.restart);
                if let Some(bar) = &self.bar {
                    bar.set_position(u64::from(progress.current));
                    bar.set_message(progress.message.clone());
                }
                let n = progress.total;
                if let Some(c) = change {
                    let state = match c.state {
                        ChangeState::Changed => "changed",
                        ChangeState::Unchanged => "unchanged",
                        ChangeState::Failed => "FAILED",
                        ChangeState::RolledBack => "rolled back",
                        ChangeState::RollbackFailed => "NOT RESTORED",
                        ChangeState::Skipped => "skipped",
                        ChangeState::Running | ChangeState::Pending => return None,
                    };
                    if self.quiet_unchanged && c.state == ChangeState::Unchanged {
                        return None;
                    }
                    let detail = match c.state {
                        ChangeState::Failed | ChangeState::RollbackFailed => {
                            format!(": {}", c.message)
                        }
                        ChangeState::Changed if !c.message.is_empty() => {
                            format!(" ({})", c.message)
                        }
                        _ => String::new(),
                    };
                    let width = n.to_string().len();
                    self.line(&format!(
                        "  [{:>width$}/{n}] changes[{}] {} {}: {state}{detail}",
                        c.index + 1,
                        c.index,
                        c.kind,
                        c.target,
                    ));
                }
                if let Some(c) = check {
                    let state = match c.state {
                        CheckState::Passed => "passed",
                        CheckState::Failed => "FAILED",
                        _ => return None,
                    };
                    self.line(&format!(
                        "  [{}/{n}] verify[{}] {} {}: {state}: {}",
                        progress.current, c.index, c.kind, c.target, c.message
                    ));
                }
                if let Some(r) = restart {
                    self.line(&format!("  {r}"));
                }
                if let Some(note) = &p.note {
                    self.line(&format!("  {note}"));
                }
                None
            }
            Event::Progress(_) => None,
        }
    }
}

/// The final lines for a person.
pub fn summary(status: &PlanStatus) -> String {
    let secs = status
        .duration_ms(now_ms())
        .map(|ms| format!(" in {:.2}s", ms as f64 / 1000.0))
        .unwrap_or_default();
    let gates = if status.checks.is_empty() {
        String::new()
    } else {
        let passed = status
            .checks
            .iter()
            .filter(|c| c.state == CheckState::Passed)
            .count();
        format!(", {passed}/{} gates passed", status.checks.len())
    };
    let c = status.counts;
    match status.phase {
        Phase::Succeeded => format!(
            "plan {} succeeded{secs}: {} changed, {} unchanged{gates}",
            status.id, c.changed, c.unchanged
        ),
        _ => {
            let mut s = status.summary();
            if c.rolled_back > 0 {
                s.push_str(&format!(
                    "\n  {} change{} restored to what {} before",
                    c.rolled_back,
                    if c.rolled_back == 1 { "" } else { "s" },
                    if c.rolled_back == 1 {
                        "it was"
                    } else {
                        "they were"
                    }
                ));
            }
            s
        }
    }
}

/// The versioned JSON form of a status (the status socket's `/v1/plans/{id}` document).
pub fn status_json(status: &PlanStatus) -> serde_json::Value {
    serde_json::to_value(crate::status::PlanStatusDocument::new(status.clone())).unwrap_or_default()
}

/// A numbered section heading of the demos (`== 3. ...`).
pub(super) fn heading(n: u32, text: &str) {
    outln!("\n== {n}. {text}");
}

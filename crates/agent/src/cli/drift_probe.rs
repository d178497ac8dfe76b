//! The daemon's drift checks read the node in a check process of their own:
//! `inplace-agent <the daemon's own arguments> --drift-probe`, started when metadata cannot
//! vouch for the node (at start-up, after a write to a managed directory, on the interval
//! for a plan with packages, units or sysctls, at least hourly). The daemon sends it the
//! baseline (the plan and what its run resolved, as the daemon's journal holds it) on its
//! standard input; it reads the node exactly as `CheckPlan` would, answers what it found on
//! its standard output and exits. Its log lines go where the daemon's go. `inplace-agent
//! drift` with no agent serving makes the same look (`engine::drift::look`) in its own
//! process, against the journal's baseline (`cli::drift`, decision 0016).
//!
//! Why a process: what a check touches — the plan read back with its contents, the dry run
//! of every kind, hashing — is code and memory an idle daemon never needs again. Made in the
//! daemon, it stayed resident: +0.74 MiB of idle RSS with a 500-file baseline (decision
//! 0014, benches/RESULTS.md "Drift checks"). In a process of its own, the daemon keeps only
//! the answer, and a check that hangs or crashes cannot take the daemon with it.
//!
//! The check process resolves the same configuration file and flags as the daemon; should
//! the file have been changed to another root or state directory since the daemon started,
//! it refuses (the answer says to restart the agent) rather than check another node.

use std::io::{Read as _, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use super::Exit;
use crate::config::{CheckCommand, DaemonSettings};
use crate::engine::Engine;
use crate::engine::drift::{Look, Pending, look};
use crate::engine::table::Baseline;
use crate::host::Host;
use crate::journal::backup::BackupStore;

/// The flag of `serve` that makes it a check process.
pub const FLAG: &str = "--drift-probe";

/// How long a check process may take before it is killed (a check reads every file of the
/// baseline and asks the package manager and systemd: seconds, not minutes).
pub const TIME_LIMIT: Duration = Duration::from_secs(300);

/// The largest answer read (a look names every drifted change with what differs; the
/// stamps of a plan's files: kilobytes per hundred files).
const MAX_ANSWER: u64 = 64 << 20;

/// The program started: this very executable, even when a package upgrade has replaced the
/// file it was started from (the check must be made by the code that serves).
pub const SELF: &str = "/proc/self/exe";

/// What the daemon sends a check process.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Request<B> {
    /// The node's root the daemon serves.
    root: PathBuf,
    /// The daemon's state directory.
    state_dir: PathBuf,
    /// The baseline's plan id.
    id: String,
    /// The baseline.
    baseline: B,
}

/// Looks at the node against `pending`'s baseline in a check process started by `command`.
/// Never fails: a check process that cannot be started, is killed, or answers nonsense is a
/// look that could not be made, saying why.
pub async fn look_in_a_process(
    command: &CheckCommand,
    engine: &Engine,
    pending: Arc<Pending>,
) -> Look {
    let run = pending.reference.run;
    let program = &command.program;
    // In a process group of its own, so that a hung check is killed with what it started
    // (a package manager's query holding its output open).
    let mut child = match Command::new(program)
        .args(&command.args)
        .arg(FLAG)
        .process_group(0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            let why = format!(
                "cannot start the check process ({} ... {FLAG}): {e}",
                program.display()
            );
            return Look::failed(run, why);
        }
    };
    let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
        let _ = child.kill();
        let _ = child.wait();
        return Look::failed(run, "no pipes to the check process".into());
    };
    let request = (
        engine.host().root.path().to_path_buf(),
        engine.config().state_dir.clone(),
    );
    let io = tokio::task::spawn_blocking(move || {
        let (root, state_dir) = request;
        let request = Request {
            root,
            state_dir,
            id: pending.reference.id.clone(),
            baseline: &pending.baseline,
        };
        // A process that exits early (it refused) closes its end: its answer says why.
        let _ = send(stdin, &request);
        let mut answer = Vec::new();
        let read = stdout.take(MAX_ANSWER).read_to_end(&mut answer);
        match read {
            Ok(_) => serde_json::from_slice::<Look>(&answer).map_err(|e| {
                let text = String::from_utf8_lossy(&answer);
                let text = text.trim();
                if text.is_empty() || text.starts_with('{') {
                    format!("its answer cannot be read ({e})")
                } else {
                    text.chars().take(2000).collect()
                }
            }),
            Err(e) => Err(format!("its answer cannot be read ({e})")),
        }
    });
    tokio::pin!(io);
    let mut killed = false;
    let done = tokio::select! {
        done = &mut io => done,
        () = tokio::time::sleep(command.time_limit) => {
            kill_group(&child);
            killed = true;
            (&mut io).await
        }
    };
    let status = reap(&mut child).await;
    let parsed = done.unwrap_or_else(|e| Err(format!("the thread talking to it failed ({e})")));
    match (parsed, status) {
        (Ok(look), Some(status)) if status.success() && !killed => look,
        (parsed, status) => {
            let how = match status {
                _ if killed => format!("was killed after {:?}", command.time_limit),
                Some(s) => exit_words(s),
                None => "did not exit".to_string(),
            };
            let said = match parsed {
                Err(text) => format!(": {text}"),
                Ok(_) => String::new(),
            };
            // No pid in the words: the same failure on every check is one problem, logged
            // once (`finish_drift_check`).
            Look::failed(run, format!("the check process ({FLAG}) {how}{said}"))
        }
    }
}

/// Writes `request` to the check process and closes its input.
fn send(stdin: std::process::ChildStdin, request: &Request<&Baseline>) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, stdin);
    serde_json::to_writer(&mut out, request)?;
    out.flush()
}

/// Waits for `child` to exit, briefly: its output is closed, so it is exiting; one that has
/// not after 5 s is killed. `None` when it cannot be waited for.
async fn reap(child: &mut Child) -> Option<ExitStatus> {
    let give_up = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if tokio::time::Instant::now() >= give_up => {
                kill_group(child);
                return child.wait().ok();
            }
            Ok(None) => tokio::time::sleep(Duration::from_millis(5)).await,
            Err(_) => return None,
        }
    }
}

/// Kills `child` and every process of its group (it leads one of its own). Only while it
/// has not been waited for: until then its id, so the group's, cannot be reused.
fn kill_group(child: &Child) {
    use rustix::process::{Pid, Signal, kill_process_group};
    if let Some(pid) = Pid::from_raw(child.id() as i32) {
        let _ = kill_process_group(pid, Signal::KILL);
    }
}

/// "exited with status 2", "was killed by signal 9".
fn exit_words(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => format!("was killed by signal {signal}"),
        (None, None) => format!("ended ({status})"),
    }
}

/// `serve ... --drift-probe`: reads the request on standard input, looks at the node and
/// writes the answer on standard output. Exit 0 with the answer; otherwise the output is
/// why, in words (1: the node or configuration does not fit the request; 2: the request
/// cannot be read).
pub fn answer(settings: DaemonSettings) -> Exit {
    let mut input = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut input) {
        println!("cannot read the request on standard input: {e}");
        return Exit::Invalid;
    }
    let request: Request<Baseline> = match serde_json::from_slice(&input) {
        Ok(r) => r,
        Err(e) => {
            println!(
                "the request on standard input cannot be read ({e}); {FLAG} is how the \
                 daemon checks drift, not a command for people: run inplace-agent drift"
            );
            return Exit::Invalid;
        }
    };
    drop(input);
    let engine = settings.settings.engine;
    let host = match Host::open(settings.settings.host) {
        Ok(host) => host,
        Err(e) => {
            println!("cannot open the node's root: {e}");
            return Exit::Failed;
        }
    };
    if host.root.path() != request.root || engine.state_dir != request.state_dir {
        println!(
            "the configuration changed since the agent started: the agent serves root {} \
             with state in {}, the configuration now says root {} and state in {}; restart \
             the agent (systemctl restart inplace-agent) to check with it",
            request.root.display(),
            request.state_dir.display(),
            host.root.path().display(),
            engine.state_dir.display()
        );
        return Exit::Failed;
    }
    let backups = BackupStore::at(&engine.state_dir);
    let found = look(&engine, &host, &backups, &request.baseline, &request.id);
    let mut out = std::io::stdout().lock();
    let written = serde_json::to_writer(&mut out, &found)
        .map_err(std::io::Error::from)
        .and_then(|()| out.flush());
    match written {
        Ok(()) => Exit::Ok,
        // The daemon went away; nobody to tell.
        Err(_) => Exit::Failed,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::SettingsInput;
    use crate::engine::drift::Begun;
    use inplace_plan::Limits;

    /// An engine on a demo node where a one-file plan succeeded, and the check it begins
    /// (nothing vouches for the node yet, so it must look).
    fn pending(dir: &Path) -> (Engine, Arc<Pending>) {
        inplace_demo_node::build_kubeadm_worker(dir).unwrap();
        let settings = SettingsInput {
            root: Some(dir.to_path_buf()),
            state_dir: Some(dir.join("state")),
            no_chroot: true,
            services_off: true,
            ..SettingsInput::default()
        }
        .resolve()
        .unwrap();
        let host = Arc::new(Host::open(settings.host).unwrap());
        let (engine, _) = Engine::open(settings.engine, host).unwrap();
        let plan = inplace_plan::parse_plan(
            b"apiVersion: inplace.agent/v1\nkind: Plan\nid: probe\nchanges:\n\
              - file: {path: /etc/kubernetes/probe.conf, content: x}\n",
            "test",
            &Limits::default(),
        )
        .unwrap();
        engine.submit(plan, "test", false).unwrap();
        engine.run_until_idle();
        match engine.begin_drift_check() {
            Begun::Look(p) => (engine, Arc::from(p)),
            Begun::Done(o) => panic!("no look needed: {o:?}"),
        }
    }

    fn shell(script: &str, time_limit: Duration) -> CheckCommand {
        CheckCommand {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into()],
            time_limit,
        }
    }

    fn problem(look: &Look) -> &str {
        look.found.as_ref().expect_err("a failed look")
    }

    #[tokio::test]
    async fn a_check_process_that_fails_is_a_check_that_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, pending) = pending(dir.path());
        let run = pending.reference.run;

        let said = shell("cat >/dev/null; echo the root is gone; exit 3", TIME_LIMIT);
        let look = look_in_a_process(&said, &engine, pending.clone()).await;
        assert_eq!(look.run, run);
        assert!(
            problem(&look).ends_with("--drift-probe) exited with status 3: the root is gone"),
            "{look:?}"
        );

        let garbled = shell("cat >/dev/null; echo '{\"run\": '", TIME_LIMIT);
        let look = look_in_a_process(&garbled, &engine, pending.clone()).await;
        assert!(
            problem(&look).contains("its answer cannot be read"),
            "{look:?}"
        );

        let hung = shell("sleep 30", Duration::from_millis(300));
        let started = std::time::Instant::now();
        let look = look_in_a_process(&hung, &engine, pending.clone()).await;
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "not killed in time"
        );
        assert!(
            problem(&look).contains("was killed after 300ms"),
            "{look:?}"
        );

        let missing = CheckCommand {
            program: dir.path().join("no-such-agent"),
            ..said
        };
        let look = look_in_a_process(&missing, &engine, pending.clone()).await;
        assert!(
            problem(&look).starts_with("cannot start the check process"),
            "{look:?}"
        );

        // Whatever the process said, the check ends with the problem on record.
        engine.finish_drift_check(&pending, look);
        let state = engine.drift();
        assert!(state.problem.unwrap().contains("no-such-agent"));
        assert!(state.changes.is_empty(), "a failed look is not drift");
    }

    #[tokio::test]
    async fn the_answer_of_a_check_process_is_the_look_it_printed() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, pending) = pending(dir.path());
        // What a check process in this very state would answer: the look made here.
        let expected = engine.look(&pending);
        let answer = dir.path().join("answer.json");
        std::fs::write(&answer, serde_json::to_vec(&expected).unwrap()).unwrap();
        let request = dir.path().join("request.json");
        let echo = shell(
            &format!("cat >{}; cat {}", request.display(), answer.display()),
            TIME_LIMIT,
        );
        let look = look_in_a_process(&echo, &engine, pending.clone()).await;
        assert_eq!(look, expected);
        assert!(look.found.as_ref().unwrap().is_empty());
        assert!(look.stamped.is_some(), "a clean file plan is stamped");
        // The request names the root, the state directory and the baseline, whole.
        let sent: Request<Baseline> =
            serde_json::from_slice(&std::fs::read(&request).unwrap()).unwrap();
        assert_eq!(sent.root, engine.host().root.path());
        assert_eq!(sent.state_dir, dir.path().join("state"));
        assert_eq!(sent.id, "probe");
        assert_eq!(sent.baseline, pending.baseline);
    }
}

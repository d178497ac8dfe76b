//! `inplace-agent demo`: a guided tour on a sandbox node tree that looks like a kubeadm
//! worker. It never touches anything outside its sandbox directory and binds only loopback.

use super::render::heading;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context as _, anyhow, bail};
use clap::Args;

use super::Exit;
use super::apply::run_plan;
use super::render::summary;
use crate::config::SettingsInput;
use crate::engine::Engine;
use crate::engine::dry_run::{ChangeVerdict, check_plan};
use crate::engine::state::Phase;
use crate::host::Host;
use crate::status::api::HookResponse;
use inplace_plan::{Limits, Plan, parse_plan};

/// Arguments of `demo`.
#[derive(Debug, Args, Clone)]
pub struct DemoArgs {
    /// Build the sandbox here (must be empty or absent) instead of a temporary directory
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the sandbox afterwards
    #[arg(long)]
    keep: bool,
    /// Print lines instead of progress bars
    #[arg(long)]
    plain: bool,
    /// The tour against a real systemd: boots this machine's systemd in a sandbox on an
    /// overlay of / and shows a kubelet restart and a rolled-back bad config (needs root)
    #[arg(long)]
    systemd: bool,
}

const TUNING: &str = include_str!("../../../../examples/plans/kubelet-tuning.yaml");
const BAD: &str = include_str!("../../../../examples/plans/bad-kubelet-config.yaml");

/// A stand-in for the kubelet's health endpoint (demo only): answers `GET /healthz` with 200
/// when the sandbox's kubelet configuration is one a kubelet would start with, 500 otherwise.
pub struct DemoKubelet {
    port: u16,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DemoKubelet {
    /// Serves on 127.0.0.1:10248 when free, otherwise on a free port.
    pub fn start(root: &Path) -> std::io::Result<DemoKubelet> {
        let listener =
            TcpListener::bind("127.0.0.1:10248").or_else(|_| TcpListener::bind("127.0.0.1:0"))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let config = root.join("var/lib/kubelet/config.yaml");
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => serve_healthz(stream, &config),
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
                }
            }
        });
        Ok(DemoKubelet {
            port,
            stop,
            thread: Some(thread),
        })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for DemoKubelet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Why a kubelet would refuse this configuration, or `None`.
pub fn kubelet_config_problem(text: &str) -> Option<String> {
    let doc: serde_yaml_ng::Value = match serde_yaml_ng::from_str(text) {
        Ok(d) => d,
        Err(e) => return Some(format!("config.yaml is not YAML: {e}")),
    };
    if doc.get("kind").and_then(|k| k.as_str()) != Some("KubeletConfiguration") {
        return Some("config.yaml is not a KubeletConfiguration".into());
    }
    match doc.get("maxPods") {
        None => None,
        Some(v) if v.as_u64().is_some_and(|n| n > 0) => None,
        Some(v) => Some(format!(
            "invalid configuration: maxPods must be a positive integer, got {}",
            serde_yaml_ng::to_string(v).unwrap_or_default().trim()
        )),
    }
}

fn serve_healthz(mut stream: TcpStream, config: &Path) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(2)));
    let mut request_line = String::new();
    let mut reader = BufReader::new(&stream);
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let (status, body) = if !request_line.starts_with("GET /healthz ") {
        ("404 Not Found", "not found".to_string())
    } else {
        match std::fs::read_to_string(config) {
            Err(e) => ("500 Internal Server Error", format!("read config: {e}")),
            Ok(text) => match kubelet_config_problem(&text) {
                None => ("200 OK", "ok".into()),
                Some(problem) => ("500 Internal Server Error", problem),
            },
        }
    };
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// Why the tour ended before its last section.
enum Ended {
    /// Something went wrong.
    Failed(anyhow::Error),
    /// Nobody reads any more (`demo | head`): stop quietly.
    Unread,
}

impl From<anyhow::Error> for Ended {
    fn from(e: anyhow::Error) -> Ended {
        Ended::Failed(e)
    }
}

/// A section heading; stops the tour when its output is no longer read.
fn section(n: u32, text: &str) -> Result<(), Ended> {
    if super::stdout_closed() {
        return Err(Ended::Unread);
    }
    heading(n, text);
    Ok(())
}

fn plan_for(text: &str, port: u16) -> anyhow::Result<Plan> {
    let text = text.replace("127.0.0.1:10248", &format!("127.0.0.1:{port}"));
    Ok(parse_plan(text.as_bytes(), "example", &Limits::default())?)
}

/// Runs the demo.
pub fn run(args: &DemoArgs) -> Exit {
    if args.systemd {
        return super::demo_systemd::run(args.plain);
    }
    match tour(args) {
        Ok(code) => code,
        Err(e) => super::fail(&e.context("demo")),
    }
}

/// Makes the sandbox, runs the sections in it and removes it again (unless told to keep
/// it), however the sections end.
fn tour(args: &DemoArgs) -> anyhow::Result<Exit> {
    let (dir, temp) = match &args.dir {
        Some(d) => {
            if d.exists()
                && std::fs::read_dir(d)
                    .with_context(|| format!("read {}", d.display()))?
                    .next()
                    .is_some()
            {
                bail!(
                    "{} is not empty; the demo only builds into an empty directory",
                    d.display()
                );
            }
            std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
            (d.clone(), None)
        }
        None => {
            let t = tempfile::Builder::new()
                .prefix("inplace-agent-demo-")
                .tempdir()
                .context("create a temporary directory")?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let keep = args.keep || args.dir.is_some();
    let ended = sections(args, &dir);
    if keep {
        outln!("The sandbox is kept at {}.", dir.display());
        if let Some(t) = temp {
            let _ = t.keep();
        }
    } else {
        if matches!(ended, Ok(_) | Err(Ended::Failed(_))) {
            outln!("The sandbox is removed now (use --keep to look around).");
        }
        if let Some(t) = temp {
            t.close()
                .with_context(|| format!("remove the sandbox {}", dir.display()))?;
        }
    }
    if ended.is_ok() {
        if rustix::process::geteuid().is_root() {
            outln!(
                "\nWith a real systemd (restarts done, not only journaled) and the Kubernetes \
                 version bump from packages: inplace-agent demo --systemd"
            );
        } else {
            outln!(
                "\n(inplace-agent demo --systemd shows restarts on a real systemd and the \
                 Kubernetes version bump from packages; it needs root)"
            );
        }
    }
    match ended {
        Ok(code) => Ok(code),
        Err(Ended::Unread) => Ok(Exit::Ok),
        Err(Ended::Failed(e)) => Err(e),
    }
}

/// The tour's sections in the sandbox `dir`; the exit code says whether everything behaved
/// as the demo says.
fn sections(args: &DemoArgs, dir: &Path) -> Result<Exit, Ended> {
    let dir = dir.to_path_buf();
    outln!("inplace-agent demo: a sandbox node at {}", dir.display());
    outln!("(nothing outside that directory is touched; the kubelet is an in-process stand-in)");
    inplace_demo_node::build_kubeadm_worker(&dir).context("build the sandbox")?;
    let kubelet = DemoKubelet::start(&dir).context("start the kubelet stand-in")?;
    outln!(
        "kubelet stand-in: http://127.0.0.1:{}/healthz answers 200 while the sandbox's \
         /var/lib/kubelet/config.yaml is valid",
        kubelet.port()
    );
    let settings = SettingsInput {
        root: Some(dir.clone()),
        no_chroot: true,
        services_off: true,
        ..SettingsInput::default()
    }
    .resolve()
    .map_err(anyhow::Error::msg)?;
    let host = Arc::new(
        Host::open(settings.host.clone())
            .with_context(|| format!("open root {}", dir.display()))?,
    );
    let tuning = plan_for(TUNING, kubelet.port())?;
    let bad = plan_for(BAD, kubelet.port())?;

    section(
        1,
        "check: what would examples/plans/kubelet-tuning.yaml change?",
    )?;
    let report = check_plan(&settings.engine, &host, &tuning);
    for c in &report.changes {
        let what = match c.result {
            ChangeVerdict::WouldChange => format!("would change ({} when applied)", c.disruption),
            ChangeVerdict::Unchanged => "unchanged".into(),
            other => format!("{other:?}: {}", c.detail),
        };
        outln!("  changes[{}] {} {}: {what}", c.index, c.kind, c.target);
    }
    outln!(
        "  plan disruption: {} (restarts: {})",
        report.disruption,
        report.restart_units.join(", ")
    );

    let (engine, _) = Engine::open(settings.engine.clone(), host.clone()).with_context(|| {
        format!(
            "open the journal in {}",
            settings.engine.state_dir.display()
        )
    })?;
    section(2, "apply it")?;
    let first = run_plan(&engine, tuning.clone(), false, args.plain, false)
        .map_err(|_| anyhow!("apply failed"))?;
    outln!("{}", summary(&first));
    outln!(
        "  (service management is off in the sandbox: the kubelet restart is recorded, not done)"
    );

    section(
        3,
        "apply the same plan again: CAPI calls UpdateMachine again and again",
    )?;
    let again = run_plan(&engine, tuning.clone(), false, args.plain, false)
        .map_err(|_| anyhow!("re-apply failed"))?;
    outln!(
        "  hook response: {}",
        serde_json::to_string(&HookResponse::from(&again.hook_response())).unwrap_or_default()
    );

    section(
        4,
        "the same desired state under a new plan id: every change is already in place",
    )?;
    let config = dir.join("var/lib/kubelet/config.yaml");
    let stat = || std::fs::metadata(&config).with_context(|| format!("stat {}", config.display()));
    let before = stat()?;
    let mut same = tuning.clone();
    same.id.push_str("-again");
    let noop =
        run_plan(&engine, same, false, args.plain, true).map_err(|_| anyhow!("re-apply failed"))?;
    outln!("{}", summary(&noop));
    let after = stat()?;
    use std::os::unix::fs::MetadataExt;
    outln!(
        "  config.yaml inode {} → {}, mtime {} → {}: nothing was rewritten",
        before.ino(),
        after.ino(),
        before.mtime(),
        after.mtime()
    );

    section(
        5,
        "a bad kubelet configuration: the health gate fails and everything is restored",
    )?;
    let read = || std::fs::read(&config).with_context(|| format!("read {}", config.display()));
    let config_before = read()?;
    let failed = run_plan(&engine, bad, false, args.plain, false)
        .map_err(|_| anyhow!("bad plan could not run"))?;
    outln!("{}", summary(&failed));
    outln!(
        "  hook response: {}",
        serde_json::to_string(&HookResponse::from(&failed.hook_response())).unwrap_or_default()
    );
    let config_after = read()?;
    outln!(
        "  /var/lib/kubelet/config.yaml after rollback: {}",
        if config_before == config_after {
            "byte for byte what it was before"
        } else {
            "DIFFERENT (this is a bug)"
        }
    );
    drop(engine);

    let api_ok = super::demo_grpc::section(6, &dir, kubelet.port(), args.plain)?;

    section(
        7,
        "the journal: every step, hash-chained, written before the node changed",
    )?;
    super::journal::run(&super::journal::JournalArgs::for_root(&dir));
    let state = settings.engine.state_dir.clone();
    match crate::journal::verify(&state) {
        Ok(r) => outln!(
            "inplace-agent journal --verify: {} records, hash chain intact, {} missing backups",
            r.records,
            r.bad_backups.len()
        ),
        Err(e) => outln!("inplace-agent journal --verify: {e}"),
    }
    drop(kubelet);
    let ok = first.phase == Phase::Succeeded
        && noop.counts.changed == 0
        && failed.phase == Phase::RolledBack
        && config_before == config_after
        && api_ok;
    Ok(if ok { Exit::Ok } else { Exit::Failed })
}

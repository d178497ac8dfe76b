//! `inplace-agent journal`: the journal as a table or JSON, and `--verify`.

use clap::Args;
use inplace_base::time::rfc3339;

use super::{Exit, NodeArgs, Output};
use crate::journal::{Entry, JOURNAL_FILE, Reader, Record, verify};
use crate::status::api::JournalItem;

/// Arguments of `journal`.
#[derive(Debug, Args, Clone)]
pub struct JournalArgs {
    #[command(flatten)]
    node: NodeArgs,
    /// Output format
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
    output: Output,
    /// Check the hash chain and the backups instead of printing
    #[arg(long)]
    verify: bool,
    /// Only records with a sequence number above this
    #[arg(long, default_value_t = 0)]
    since: u64,
    /// Only the last N records
    #[arg(long)]
    tail: Option<usize>,
}

impl JournalArgs {
    /// The whole journal of the node at `root`, as a table.
    pub fn for_root(root: &std::path::Path) -> JournalArgs {
        JournalArgs {
            node: NodeArgs {
                root: root.to_path_buf(),
                state_dir: None,
                allow_paths: Vec::new(),
                node_name: None,
                no_chroot: true,
                allow_exec: false,
                services: super::Services::Off,
                bus: None,
                boot_id_file: None,
                package_manager: None,
                allow_http_hosts: Vec::new(),
                download_ca_files: Vec::new(),
            },
            output: Output::Text,
            verify: false,
            since: 0,
            tail: None,
        }
    }
}

/// One line of detail for a record.
pub fn describe(record: &Record) -> String {
    match record {
        Record::Compacted {
            previous_seq,
            previous_hash,
        } => format!(
            "journal compacted after record {previous_seq} ({})",
            &previous_hash[..previous_hash.len().min(12)]
        ),
        Record::PlanAccepted {
            id,
            digest,
            attempt,
            source,
            changes,
            ..
        } => {
            let n = changes.len();
            format!(
                "{id} {} attempt {attempt} from {source}: {n} changes",
                short(digest)
            )
        }
        Record::VersionResolved { index, version, .. } => {
            format!("changes[{index}] package version resolved to {version}")
        }
        Record::PruneResolved { paths, .. } => {
            format!(
                "managed set: removing {} ({})",
                paths.len(),
                paths.join(", ")
            )
        }
        Record::SetMembers { set, paths } => {
            format!("managed set {set}: {} paths", paths.len())
        }
        Record::Phase { phase, error, .. } => match error {
            Some(e) => format!("{phase}: {e}"),
            None => phase.to_string(),
        },
        Record::StepStarted {
            index,
            preimages,
            planned,
            ..
        } => format!(
            "changes[{index}]: {}{} pre-image{} saved",
            planned.iter().map(|p| format!("{p}; ")).collect::<String>(),
            preimages.len(),
            if preimages.len() == 1 { "" } else { "s" }
        ),
        Record::StepDone {
            index,
            changed,
            message,
            ..
        } => format!(
            "changes[{index}] {}: {message}",
            if *changed { "changed" } else { "unchanged" }
        ),
        Record::StepOutput { index, output, .. } => {
            let commands: Vec<&str> = output
                .lines()
                .filter_map(|l| l.strip_prefix("$ "))
                .collect();
            format!(
                "changes[{index}] ran {} ({} bytes of output kept; -o json shows it)",
                commands.join("; "),
                output.len()
            )
        }
        Record::StepFailed { index, error, .. } => format!("changes[{index}] failed: {error}"),
        Record::StepAbandoned { index, .. } => {
            format!("changes[{index}] abandoned before it started")
        }
        Record::StepRolledBack { index, .. } => format!("changes[{index}] restored"),
        Record::StepRollbackFailed { index, error, .. } => {
            format!("changes[{index}] NOT restored: {}", error.detail)
        }
        Record::DaemonReloaded { rollback, .. } => {
            format!(
                "daemon-reload{}",
                if *rollback { " (rollback)" } else { "" }
            )
        }
        Record::UnitRestarted {
            unit,
            rollback,
            message,
            ..
        } => format!(
            "{unit}{}: {message}",
            if *rollback { " (rollback)" } else { "" }
        ),
        Record::UnitJobStarted {
            unit,
            job,
            rollback,
            before,
            ..
        } => format!(
            "{job} {unit}{}: queued (was {}/{})",
            if *rollback { " (rollback)" } else { "" },
            before.active_state,
            before.sub_state
        ),
        Record::UnitJobDone {
            outcome,
            rollback,
            message,
            ..
        } => format!(
            "{}{}: {message}",
            match outcome {
                crate::journal::UnitJobOutcome::Done => "done",
                crate::journal::UnitJobOutcome::Skipped => "skipped",
                crate::journal::UnitJobOutcome::Failed => "FAILED",
            },
            if *rollback { " (rollback)" } else { "" }
        ),
        Record::SystemdUnreachable { message, .. } => message.clone(),
        Record::ServiceManager { description, .. } => {
            format!("service management: {description}")
        }
        Record::RebootRequested { index, boot_id, .. } => {
            format!("changes[{index}] reboot requested from boot {boot_id}")
        }
        Record::CheckDone {
            index,
            passed,
            message,
            ..
        } => format!(
            "verify[{index}] {}: {message}",
            if *passed { "passed" } else { "failed" }
        ),
        Record::CancelRequested { reason, by, .. } => format!(
            "cancel requested{}{}",
            if by.is_empty() {
                String::new()
            } else {
                format!(" by {by}")
            },
            if reason.is_empty() {
                String::new()
            } else {
                format!(": {reason}")
            }
        ),
        Record::PlanFinished { phase, error, .. } => match error {
            Some(e) => format!("{phase}: {e}"),
            None => phase.to_string(),
        },
        Record::Staging { run, paths, .. } => format!(
            "run {run}: staging {} file(s) beside their targets",
            paths.len()
        ),
        Record::BodiesKept { bodies, .. } => {
            format!("file contents kept for a retry in blob {}", short(bodies))
        }
        Record::Summary { status, .. } => format!(
            "{} {} attempt {}: {}",
            status.id,
            short(&status.digest),
            status.attempt,
            status.phase
        ),
        Record::DriftFound { run, changes } => format!(
            "drift from run {run}: {}",
            changes
                .iter()
                .map(|c| format!("changes[{}] {} {}: {}", c.index, c.kind, c.target, c.detail))
                .collect::<Vec<_>>()
                .join("; ")
        ),
        Record::DriftCleared { run } => format!("the node matches run {run} again"),
    }
}

fn short(digest: &str) -> &str {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    &hex[..hex.len().min(12)]
}

/// Runs `journal`.
pub fn run(args: &JournalArgs) -> Exit {
    let settings = match args.node.input().resolve() {
        Ok(s) => s,
        Err(e) => {
            errln!("error: {e}");
            return Exit::Invalid;
        }
    };
    let state_dir = &settings.engine.state_dir;
    if args.verify {
        return match verify(state_dir) {
            Ok(report) => {
                match args.output {
                    Output::Json => {
                        outln!("{:#}", serde_json::to_value(&report).unwrap_or_default())
                    }
                    Output::Text => {
                        let range = match (report.first_seq, report.last_seq) {
                            (Some(a), Some(b)) => format!(" (seq {a}..{b})"),
                            _ => String::new(),
                        };
                        outln!(
                            "journal {}: {} records{range}, hash chain intact",
                            report.path.display(),
                            report.records
                        );
                        if let Some(bytes) = report.torn_tail_bytes {
                            outln!(
                                "torn tail: {bytes} bytes after the last complete record (a crash \
                                 left them; the agent truncates them at its next start)"
                            );
                        }
                        for b in &report.bad_backups {
                            outln!("missing or damaged backup: {b}");
                        }
                    }
                }
                if report.bad_backups.is_empty() {
                    Exit::Ok
                } else {
                    Exit::Failed
                }
            }
            Err(e) => {
                errln!("error: {e}");
                Exit::Failed
            }
        };
    }
    let path = state_dir.join("journal").join(JOURNAL_FILE);
    let reader = match Reader::open(&path) {
        Ok(Some(r)) => r,
        Ok(None) => {
            match args.output {
                Output::Json => outln!("[]"),
                Output::Text => outln!("journal {} is empty", path.display()),
            }
            return Exit::Ok;
        }
        Err(e) => {
            errln!("error: {e}");
            return Exit::Failed;
        }
    };
    let mut entries: Vec<Entry> = Vec::new();
    let mut error = None;
    for e in reader {
        match e {
            Ok(entry) if entry.seq > args.since => {
                entries.push(entry);
                if let Some(n) = args.tail
                    && entries.len() > n * 2 + 1024
                {
                    let cut = entries.len() - n;
                    entries.drain(..cut);
                }
            }
            Ok(_) => {}
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    if let Some(n) = args.tail
        && entries.len() > n
    {
        let cut = entries.len() - n;
        entries.drain(..cut);
    }
    match args.output {
        Output::Json => {
            // The same items as the status socket's `/v1/journal` (which leaves plans out).
            let items: Vec<JournalItem> =
                entries.iter().map(|e| JournalItem::new(e, false)).collect();
            outln!(
                "{}",
                serde_json::to_string_pretty(&items).unwrap_or_default()
            );
        }
        Output::Text => {
            outln!(
                "{:>6}  {:<24}  {:>4}  {:<15}  DETAIL",
                "SEQ",
                "TIME",
                "RUN",
                "EVENT"
            );
            for e in &entries {
                let run = e.record.run().map(|r| r.to_string()).unwrap_or_default();
                outln!(
                    "{:>6}  {:<24}  {:>4}  {:<15}  {}",
                    e.seq,
                    rfc3339(e.ts),
                    run,
                    e.record.name(),
                    describe(&e.record)
                );
                if super::stdout_closed() {
                    // The reader has what it wanted (`| head`).
                    return Exit::Ok;
                }
            }
        }
    }
    match error {
        Some(e) => {
            errln!("error: {e}");
            Exit::Failed
        }
        None => Exit::Ok,
    }
}

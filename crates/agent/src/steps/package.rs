//! `package`: a package at an exact version, held or not, through the node's package manager
//! (apt/dpkg or dnf/rpm, see `host::packages`).
//!
//! Desired state is declarative: `hold: true` means held, `hold: false` (the default, and
//! what an unset proto3 bool means) means not held. The version is compared with the
//! manager's own rules (dpkg equality; for rpm a version without release matches any
//! release). The pre-image is the installed version (or "not installed") and the hold;
//! rollback reinstalls that version when a configured repository still offers it, and says
//! so plainly when none does.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Note, StepError};
use crate::host::Host;
use crate::host::packages::{
    CommandRecord, InstalledPackage, ManagerKind, PackageManager, PkgError, PkgEvent, PkgOptions,
    Transcript,
};
use crate::journal::Preimage;
use inplace_base::ErrorKind;
use inplace_plan::kinds::PackageMutation;

/// `Preimage::Other` kind of package pre-images.
pub const PREIMAGE_KIND: &str = "package";

/// Most bytes of command output kept in the journal for one step.
pub const MAX_JOURNAL_OUTPUT: usize = 8 * 1024;

/// Most bytes of command output put into an error (and so into the status).
pub const MAX_ERROR_OUTPUT: usize = 2 * 1024;

/// What was there before a package change: the journaled pre-image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackageBefore {
    /// `package:<name>` (see [`super::preimage_target`]).
    pub target: String,
    /// `apt` or `dnf`.
    pub manager: String,
    /// Package name.
    pub name: String,
    /// The installed version, `None` when it was not installed.
    pub version: Option<String>,
    /// Whether it was held.
    pub held: bool,
}

/// The manager for a step: the configured options with every command and lock wait bounded
/// by the step's timeout.
pub(crate) fn manager(
    host: &Host,
    kind: ManagerKind,
    timeout: Duration,
) -> Box<dyn PackageManager> {
    host.package_manager(kind, |o: &mut PkgOptions| {
        if !timeout.is_zero() {
            o.query_timeout = o.query_timeout.min(timeout);
            o.change_timeout = o.change_timeout.min(timeout);
            o.lock_wait.give_up_after = o.lock_wait.give_up_after.min(timeout);
        }
    })
}

pub(crate) fn pkg_error(e: PkgError) -> StepError {
    let mut detail = e.to_string();
    if let Some(record) = e.record() {
        let tail = output_tail(
            &record.output.stderr,
            &record.output.stdout,
            MAX_ERROR_OUTPUT,
        );
        if !tail.is_empty() {
            detail.push_str("\noutput:\n");
            detail.push_str(&tail);
        }
    }
    let kind = match &e {
        PkgError::Failed { record, .. } if record.output.timed_out => ErrorKind::Timeout,
        PkgError::LockTimeout { .. } => ErrorKind::Timeout,
        PkgError::NoManager { .. } | PkgError::InvalidArgument { .. } => ErrorKind::Precondition,
        _ => ErrorKind::Package,
    };
    StepError::new(kind, detail)
}

/// The last `limit` bytes of a command's stderr then stdout, on line boundaries.
pub fn output_tail(stderr: &str, stdout: &str, limit: usize) -> String {
    let mut text = String::new();
    for part in [stdout.trim_end(), stderr.trim_end()] {
        if !part.is_empty() {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(part);
        }
    }
    tail(&text, limit)
}

/// The last `limit` bytes of `text`, starting at a line (and char) boundary when it is cut.
pub fn tail(text: &str, limit: usize) -> String {
    if text.len() <= limit {
        return text.to_string();
    }
    let mut start = text.len() - limit;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    let cut = &text[start..];
    let cut = cut.find('\n').map_or(cut, |i| &cut[i + 1..]);
    format!("[... {} bytes cut]\n{cut}", text.len() - cut.len())
}

/// Commands and what they printed, bounded, for the journal.
pub fn transcript_text(transcript: &[CommandRecord], limit: usize) -> String {
    let mut text = String::new();
    for record in transcript {
        text.push_str(&format!(
            "$ {} ({}, {:.1}s)\n",
            record.command,
            match (record.output.timed_out, record.output.code) {
                (true, _) => "timed out".to_string(),
                (false, Some(c)) => format!("exit {c}"),
                (false, None) => "killed".to_string(),
            },
            record.output.elapsed.as_secs_f64()
        ));
        let out = output_tail(&record.output.stderr, &record.output.stdout, limit);
        if !out.is_empty() {
            text.push_str(&out);
            text.push('\n');
        }
    }
    tail(&text, limit)
}

/// The package's version and hold before the change.
pub fn capture(host: &Host, m: &PackageMutation) -> Result<Preimage, StepError> {
    let pm = manager(host, m.manager, m.timeout);
    let installed = pm.installed(&m.name).map_err(pkg_error)?;
    let before = PackageBefore {
        target: m.target(),
        manager: m.manager.name().to_string(),
        name: m.name.clone(),
        version: installed.as_ref().map(|p| p.version.clone()),
        held: installed.is_some_and(|p| p.held),
    };
    Ok(Preimage::Other {
        kind: PREIMAGE_KIND.to_string(),
        data: serde_json::to_value(&before)
            .map_err(|e| StepError::new(ErrorKind::Internal, e.to_string()))?,
    })
}

/// Turns package manager events into notes: lock waits are events, commands status.
pub(crate) fn events<'a>(note: &'a mut dyn FnMut(Note)) -> impl FnMut(&PkgEvent) + 'a {
    move |e: &PkgEvent| {
        let text = e.to_string();
        match e {
            PkgEvent::WaitingForLock { .. } => note(Note::Event(&text)),
            PkgEvent::Running { .. } => note(Note::Status(&text)),
        }
    }
}

/// Installs `version`, refreshing the repository metadata once when the version is not
/// offered (the plan may just have changed the package sources).
fn install(
    pm: &dyn PackageManager,
    name: &str,
    version: &str,
    note: &mut dyn FnMut(Note),
    transcript: &mut Transcript,
) -> Result<(), StepError> {
    match pm.install(name, version, &mut events(note)) {
        Ok(t) => {
            transcript.extend(t);
            return Ok(());
        }
        Err(PkgError::NotAvailable { record, .. }) => transcript.push(*record),
        Err(e) => return Err(pkg_error(e)),
    }
    note(Note::Event(&format!(
        "{name} {version} is not in the package lists as last refreshed; refreshing them"
    )));
    transcript.extend(pm.refresh(&mut events(note)).map_err(pkg_error)?);
    match pm.install(name, version, &mut events(note)) {
        Ok(t) => {
            transcript.extend(t);
            Ok(())
        }
        Err(e @ PkgError::NotAvailable { .. }) => {
            let offered = pm.available_versions(name).unwrap_or_default();
            let mut err = pkg_error(e);
            err.detail = format!(
                "{name} {version} is not offered by any configured repository (after \
                 refreshing the package lists; offered: {}): {}",
                if offered.is_empty() {
                    "none".to_string()
                } else {
                    offered.join(", ")
                },
                err.detail
            );
            Err(err)
        }
        Err(e) => Err(pkg_error(e)),
    }
}

/// Installs and holds (or releases) as the mutation says; returns the bounded transcript.
pub fn execute(
    host: &Host,
    m: &PackageMutation,
    note: &mut dyn FnMut(Note),
) -> Result<String, StepError> {
    let pm = manager(host, m.manager, m.timeout);
    let mut transcript = Vec::new();
    if let Some(version) = &m.version {
        install(&*pm, &m.name, version, note, &mut transcript)?;
    }
    transcript.extend(
        pm.set_held(&m.name, m.hold, &mut events(note))
            .map_err(pkg_error)?,
    );
    Ok(transcript_text(&transcript, MAX_JOURNAL_OUTPUT))
}

/// Puts the package back: the previous version (when a repository still offers it) and
/// hold, or removes it when it was not installed. Idempotent.
pub fn restore(
    host: &Host,
    data: &serde_json::Value,
    note: &mut dyn FnMut(Note),
) -> Result<(), StepError> {
    let before: PackageBefore = serde_json::from_value(data.clone()).map_err(|e| {
        StepError::new(
            ErrorKind::Internal,
            format!("package pre-image {data}: {e}"),
        )
    })?;
    let kind: ManagerKind =
        crate::host::packages::manager_kind(&before.manager).map_err(pkg_error)?;
    let pm = manager(host, kind, Duration::ZERO);
    let name = &before.name;
    let now = pm.installed(name).map_err(pkg_error)?;
    let Some(version) = &before.version else {
        if now.is_some() {
            note(Note::Event(&format!(
                "removing {name}: it was not installed before the plan"
            )));
            pm.set_held(name, false, &mut events(note))
                .map_err(pkg_error)?;
            pm.remove(name, &mut events(note)).map_err(pkg_error)?;
        }
        return Ok(());
    };
    let in_place = now
        .as_ref()
        .is_some_and(|p| p.complete && pm.version_satisfies(&p.version, version));
    if !in_place {
        // The package lists may be stale (a repository dropped the version since the last
        // refresh, or the plan changed the sources): on a failure, refresh once and look
        // again before saying the version is gone.
        let mut refreshed = false;
        loop {
            let available = pm.is_available(name, version).map_err(pkg_error)?;
            let failure = if available {
                note(Note::Event(&format!("reinstalling {name} {version}")));
                match pm.install(name, version, &mut events(note)) {
                    Ok(_) => break,
                    Err(e) => Some(e),
                }
            } else {
                None
            };
            if refreshed {
                return Err(match failure {
                    Some(e) => pkg_error(e),
                    None => gone(&*pm, name, version, now.as_ref()),
                });
            }
            pm.refresh(&mut events(note)).map_err(pkg_error)?;
            refreshed = true;
        }
    }
    pm.set_held(name, before.held, &mut events(note))
        .map_err(pkg_error)?;
    Ok(())
}

/// The error of a rollback that cannot get the previous version any more.
fn gone(
    pm: &dyn PackageManager,
    name: &str,
    version: &str,
    now: Option<&InstalledPackage>,
) -> StepError {
    let offered = pm.available_versions(name).unwrap_or_default();
    let stays = now.map_or("not installed".to_string(), |p| format!("at {}", p.version));
    StepError::new(
        ErrorKind::Package,
        format!(
            "cannot reinstall {name} {version} with {}: no configured repository offers that \
             version any more (offered: {}); {name} stays {stays}",
            pm.kind(),
            if offered.is_empty() {
                "none".to_string()
            } else {
                offered.join(", ")
            }
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_read_well() {
        let mut m = PackageMutation {
            manager: ManagerKind::Apt,
            name: "kubelet".into(),
            version: Some("1.31.2-1.1".into()),
            from: Some("1.30.4-1.1".into()),
            hold: true,
            timeout: Duration::from_secs(300),
        };
        assert_eq!(
            m.describe(),
            "install kubelet 1.31.2-1.1 (was 1.30.4-1.1), hold"
        );
        m.from = None;
        m.hold = false;
        assert_eq!(
            m.describe(),
            "install kubelet 1.31.2-1.1 (not installed before), release the hold"
        );
        m.version = None;
        m.from = Some("1.31.2-1.1".into());
        m.hold = true;
        assert_eq!(m.describe(), "hold kubelet (at 1.31.2-1.1)");
        m.hold = false;
        assert_eq!(m.describe(), "release the hold of kubelet (at 1.31.2-1.1)");
        assert_eq!(m.target(), "package:kubelet");
    }

    #[test]
    fn output_is_bounded_on_line_boundaries() {
        assert_eq!(tail("short", 100), "short");
        let long: String = (0..100).map(|i| format!("line {i}\n")).collect();
        let t = tail(&long, 60);
        assert!(t.starts_with("[... "), "{t}");
        assert!(t.ends_with("line 99\n"), "{t}");
        assert!(t.lines().nth(1).unwrap().starts_with("line "), "{t}");
        assert!(t.len() <= 60 + 30);
        let multibyte = "é".repeat(100);
        assert!(tail(&multibyte, 11).ends_with('é'));
        assert_eq!(output_tail("err\n", "out\n", 100), "out\nerr");
    }
}

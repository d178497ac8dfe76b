//! `package`: a package at an exact version (or the highest matching a pattern such as
//! `1.31.2-*`, resolved when the plan prepares), held or not, through the node's package
//! manager (apt/dpkg or dnf/rpm).
//!
//! Desired state is declarative: `hold: true` means held, `hold: false` (the default, and
//! what an unset proto3 bool means) means not held. The version is compared with the
//! manager's own rules (dpkg equality; for rpm a version without release matches any
//! release).

use serde_json::{Map, Value, json};

use super::PackageMutation;
use super::{Diff, Mutation, Node, Note, StepCtx};
use super::{KUBELET_UNIT, Kind, Written, put_opt};
use crate::parse::{Cx, join};
use crate::{Disruption, NodePath, Owner};
use inplace_base::ErrorKind;
use inplace_base::StepError;
use inplace_base::packages::InstalledPackage;
use std::time::Duration;

/// `package`: a package at an exact version.
#[derive(Debug, Clone, PartialEq)]
pub struct PackageChange {
    /// Package name.
    pub name: String,
    /// Exact version (`1.31.2-1.1`), or a pattern ending in `*` (`1.31.2-*`) that the
    /// engine resolves to the highest available match when the plan prepares.
    pub version: String,
    /// `apt` or `dnf`; detected from the node when absent.
    pub manager: Option<String>,
    /// Hold the package at that version.
    pub hold: bool,
}

impl PackageChange {
    /// The part before the `*` when `version` is a pattern (`1.31.2-*` → `1.31.2-`).
    pub fn version_prefix(&self) -> Option<&str> {
        self.version.strip_suffix('*')
    }

    /// The version a pattern (`1.31.2-*`) stands for: the highest version the package
    /// manager offers that starts with its prefix (by the manager's ordering). With
    /// `refresh`, the package lists are refreshed once when nothing matches (the plan may
    /// just have switched the repository). `None`: nothing offered matches. An exact
    /// version is returned as it is.
    pub fn resolve(
        &self,
        node: &dyn Node,
        timeout: Duration,
        refresh: bool,
        note: &mut dyn FnMut(Note),
    ) -> Result<Option<String>, StepError> {
        let Some(prefix) = self.version_prefix() else {
            return Ok(Some(self.version.clone()));
        };
        let kind = node
            .package_manager(self.manager.as_deref())
            .map_err(|e| StepError::new(ErrorKind::Precondition, e))?;
        let pm = node.packages(kind, timeout);
        let pick = || -> Result<Option<String>, StepError> {
            let offered = pm.available_versions(&self.name)?;
            Ok(highest_match(&offered, prefix, |a, b| pm.compare(a, b)))
        };
        if let Some(v) = pick()? {
            return Ok(Some(v));
        }
        if !refresh {
            return Ok(None);
        }
        note(Note::Event(&format!(
            "no version of {} matching {} in the package lists as last refreshed; refreshing them",
            self.name, self.version
        )));
        pm.refresh(note)?;
        pick()
    }
}

/// What must change for `change` given what is installed (pure): (install the version?,
/// change the hold?). `satisfies(have, want)` is the manager's version rule.
pub fn decide(
    installed: Option<&InstalledPackage>,
    change: &PackageChange,
    satisfies: impl Fn(&str, &str) -> bool,
) -> (bool, bool) {
    let version_ok =
        installed.is_some_and(|p| p.complete && satisfies(&p.version, &change.version));
    let held = installed.is_some_and(|p| p.held);
    (!version_ok, held != change.hold)
}

/// The highest of `offered` that starts with `prefix` (pure).
pub fn highest_match(
    offered: &[String],
    prefix: &str,
    cmp: impl Fn(&str, &str) -> std::cmp::Ordering,
) -> Option<String> {
    offered
        .iter()
        .filter(|v| v.starts_with(prefix))
        .max_by(|a, b| cmp(a, b))
        .cloned()
}

impl Kind for PackageChange {
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(path, m, &["name", "version", "manager", "hold"]);
        let before = cx.errors.len();
        let name = cx.string(path, m, "name", true).map(str::to_string);
        if let Some(n) = &name {
            let valid = n.len() <= 128
                && n.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
                && n.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+._-".contains(c));
            if !valid {
                cx.err(
                    join(path, "name"),
                    format!("{n:?} is not a valid package name"),
                );
            } else {
                cx.claim(&join(path, "name"), format!("package:{n}"), n, index);
            }
        }
        let version = cx.string(path, m, "version", true).map(str::to_string);
        if let Some(v) = &version {
            // An exact version, or a pattern: a non-empty prefix and one final `*`.
            let exact = v.strip_suffix('*').unwrap_or(v);
            let valid = !exact.is_empty()
                && v.len() <= 128
                && exact
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphanumeric())
                && exact
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || ".+~:_^-".contains(c));
            if !valid {
                cx.err(
                    join(path, "version"),
                    format!(
                        "{v:?} is not a valid package version (an exact version, or a prefix and a final *)"
                    ),
                );
            }
        }
        let manager = match cx.string(path, m, "manager", false) {
            None => Some(None),
            Some(s @ ("apt" | "dnf")) => Some(Some(s.to_string())),
            Some(other) => {
                cx.err(
                    join(path, "manager"),
                    format!("{other:?} is not a supported package manager (apt, dnf)"),
                );
                None
            }
        };
        let hold = cx.boolean(path, m, "hold").unwrap_or(false);
        if cx.errors.len() > before {
            return None;
        }
        Some(PackageChange {
            name: name?,
            version: version?,
            manager: manager?,
            hold,
        })
    }

    fn canonical(&self, _bodies: bool) -> Value {
        let mut m = Map::new();
        m.insert("name".into(), json!(self.name));
        m.insert("version".into(), json!(self.version));
        put_opt(&mut m, "manager", &self.manager);
        m.insert("hold".into(), json!(self.hold));
        Value::Object(m)
    }

    fn target(&self) -> String {
        format!("{}={}", self.name, self.version)
    }

    fn restart_units(&self) -> Vec<String> {
        if self.name == "kubelet" {
            vec![KUBELET_UNIT.to_string()]
        } else {
            Vec::new()
        }
    }

    fn restart_field(&self) -> Option<&'static str> {
        None
    }

    fn fed_units(&self) -> Vec<String> {
        self.restart_units()
    }

    fn run_state(&self) -> Option<(&str, super::UnitState)> {
        None
    }

    fn declared_disruption(&self) -> Option<Disruption> {
        None
    }

    fn fed_by(&self, other: &super::Change) -> bool {
        let _ = other;
        false
    }

    fn writes(&self) -> Vec<Written> {
        Vec::new()
    }

    fn packages(&self) -> Vec<&str> {
        vec![self.name.as_str()]
    }

    fn disruption(&self) -> Disruption {
        if self.restart_units().is_empty() {
            Disruption::None
        } else {
            Disruption::Restart
        }
    }

    fn needs_services(&self) -> bool {
        false
    }

    fn batchable(&self) -> bool {
        false
    }

    fn owner(&self) -> Option<&Owner> {
        None
    }

    fn preflight(&self, node: &dyn Node) -> Vec<(&'static str, String)> {
        // A pattern's prefix ends where a version part would follow (`1.31.2-`): check the
        // version it names up to there.
        let exact = match self.version_prefix() {
            Some(prefix) => prefix.trim_end_matches(['-', '.', '~', ':', '+', '_', '^']),
            None => self.version.as_str(),
        };
        match node.package_manager(self.manager.as_deref()) {
            Err(e) => vec![("manager", e)],
            Ok(kind) => match node.valid_version(kind, exact) {
                Err(e) => vec![("version", format!("{e} (for {kind})"))],
                Ok(()) => Vec::new(),
            },
        }
    }

    fn prepare(
        &self,
        _node: &dyn Node,
        _note: &mut dyn FnMut(Note),
    ) -> Result<Option<String>, StepError> {
        Ok(None)
    }

    fn undecided(&self, _node: &dyn Node) -> Option<String> {
        None
    }

    fn diff(&self, node: &dyn Node, ctx: StepCtx) -> Result<Diff, StepError> {
        let kind = node
            .package_manager(self.manager.as_deref())
            .map_err(|e| StepError::new(ErrorKind::Precondition, e))?;
        let pm = node.packages(kind, ctx.step_timeout);
        let installed = pm.installed(&self.name)?;
        let resolved;
        let change = match self.version_prefix() {
            None => self,
            Some(prefix) => {
                let version = self
                    .resolve(node, ctx.step_timeout, false, &mut |_| {})?
                    .or_else(|| {
                        installed
                            .as_ref()
                            .filter(|p| p.version.starts_with(prefix))
                            .map(|p| p.version.clone())
                    })
                    .unwrap_or_else(|| self.version.clone());
                resolved = PackageChange {
                    version,
                    ..self.clone()
                };
                &resolved
            }
        };
        let (install, rehold) = decide(installed.as_ref(), change, |have, want| {
            pm.satisfies(have, want)
        });
        if !install && !rehold {
            let held = if change.hold { "held" } else { "not held" };
            let at = installed.map(|p| p.version).unwrap_or_default();
            return Ok(Diff {
                mutations: Vec::new(),
                note: Some(format!(
                    "{} {at} is installed ({kind}) and {held}",
                    change.name
                )),
            });
        }
        Ok(Diff {
            mutations: vec![Mutation::Package(PackageMutation {
                manager: kind,
                name: change.name.clone(),
                version: install.then(|| change.version.clone()),
                from: installed.map(|p| p.version),
                hold: change.hold,
                timeout: ctx.step_timeout,
            })],
            note: None,
        })
    }

    fn resolve(
        &self,
        node: &dyn Node,
        timeout: std::time::Duration,
        refresh: bool,
        note: &mut dyn FnMut(Note),
    ) -> Result<Option<Option<String>>, StepError> {
        if self.version_prefix().is_none() {
            return Ok(None);
        }
        PackageChange::resolve(self, node, timeout, refresh, note).map(Some)
    }

    fn resolved(&self, value: &str) -> Option<super::Change> {
        Some(super::Change::Package(PackageChange {
            version: value.to_string(),
            ..self.clone()
        }))
    }

    fn set_members(&self) -> Vec<NodePath> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(version: &str, hold: bool) -> PackageChange {
        PackageChange {
            name: "kubelet".into(),
            version: version.into(),
            manager: None,
            hold,
        }
    }

    fn installed(version: &str, held: bool, complete: bool) -> InstalledPackage {
        InstalledPackage {
            name: "kubelet".into(),
            version: version.into(),
            held,
            status: if complete {
                "installed"
            } else {
                "half-configured"
            }
            .into(),
            complete,
        }
    }

    fn deb_equal(a: &str, b: &str) -> bool {
        inplace_base::pkgversion::compare_deb(a, b) == Ok(std::cmp::Ordering::Equal)
    }

    #[test]
    fn versions_and_holds_are_decided_by_the_managers_rules() {
        let want = change("1.31.2-1.1", true);
        assert_eq!(decide(None, &want, deb_equal), (true, true));
        let at_old = installed("1.30.4-1.1", true, true);
        assert_eq!(decide(Some(&at_old), &want, deb_equal), (true, false));
        let there = installed("0:1.31.2-1.1", true, true);
        assert_eq!(
            decide(Some(&there), &want, deb_equal),
            (false, false),
            "dpkg equality: an explicit zero epoch is the same version"
        );
        let unheld = installed("1.31.2-1.1", false, true);
        assert_eq!(decide(Some(&unheld), &want, deb_equal), (false, true));
        let broken = installed("1.31.2-1.1", true, false);
        assert_eq!(
            decide(Some(&broken), &want, deb_equal),
            (true, false),
            "half-configured is installed again"
        );
        let release = change("1.31.2-1.1", false);
        assert_eq!(decide(Some(&there), &release, deb_equal), (false, true));
    }

    #[test]
    fn a_pattern_resolves_to_the_highest_match_by_the_managers_order() {
        let offered: Vec<String> = [
            "1.31.2-1.1",
            "1.31.2-1.10",
            "1.31.2-1.2",
            "1.31.3-1.1",
            "1.30.9-1.1",
        ]
        .iter()
        .map(|s| (*s).to_string())
        .collect();
        let deb = |a: &str, b: &str| {
            inplace_base::pkgversion::compare_deb(a, b).unwrap_or(std::cmp::Ordering::Equal)
        };
        assert_eq!(
            highest_match(&offered, "1.31.2-", deb).as_deref(),
            Some("1.31.2-1.10")
        );
        assert_eq!(highest_match(&offered, "1.32.0-", deb), None);
    }
}

//! `artifact`: a binary downloaded from a URL (or one member of a downloaded `.tar.gz`),
//! verified against its sha256, installed at a path with a mode.
//!
//! The download happens while the plan is Preparing, for every artifact of the plan, before
//! anything on the node changes, into the agent's content-addressed cache. Applying then
//! installs from the cache as an ordinary file mutation (`Mutation::WriteFrom`): batched,
//! backed up and rolled back like any file, with the content streamed and its sha256
//! checked again while it is copied, so a large binary is never held in memory and a
//! corrupted cache entry never lands on the node.

use serde_json::{Map, Value, json};

use super::{Diff, Mutation, Node, Note, StepCtx};
use super::{Kind, Written, put_opt};
use crate::parse::{Cx, check_url, join};
use crate::{Disruption, Mode, NodePath, Owner};
use inplace_base::StepError;
use inplace_base::{ErrorKind, FileMeta};

/// `artifact`: a binary from a URL, checked against its sha256.
#[derive(Debug, Clone, PartialEq)]
pub struct ArtifactChange {
    /// Where to download from.
    pub url: String,
    /// Expected sha256 of the download (lowercase hex).
    pub sha256: String,
    /// Install path on the node.
    pub path: NodePath,
    /// Permission bits (default 0755).
    pub mode: Mode,
    /// Member of a `.tar.gz` to install instead of the download itself.
    pub extract: Option<String>,
    /// Units restarted when the binary changes.
    pub restart_units: Vec<String>,
}

impl ArtifactChange {
    /// What it is, for messages: the URL, and the member when one is extracted.
    pub fn origin(&self) -> String {
        match &self.extract {
            Some(member) => format!("{member} of {}", self.url),
            None => self.url.clone(),
        }
    }
}

impl Kind for ArtifactChange {
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(
            path,
            m,
            &["url", "sha256", "path", "mode", "extract", "restartUnits"],
        );
        let before = cx.errors.len();
        let url = cx.string(path, m, "url", true).map(str::to_string);
        if let Some(u) = &url
            && let Err(e) = check_url(u, &cx.limits.allow_http_hosts)
        {
            cx.err(join(path, "url"), e);
        }
        let sha = cx
            .string(path, m, "sha256", true)
            .map(str::to_ascii_lowercase);
        if let Some(s) = &sha
            && (s.len() != 64 || !s.chars().all(|c| c.is_ascii_hexdigit()))
        {
            cx.err(join(path, "sha256"), "must be 64 hexadecimal characters");
        }
        let p = cx
            .string(path, m, "path", true)
            .and_then(|s| cx.node_path(&join(path, "path"), s));
        if let Some(p) = &p {
            cx.claim(&join(path, "path"), format!("path:{p}"), p.as_str(), index);
        }
        let mode = cx.mode(path, m, Mode::EXEC_DEFAULT);
        let extract = cx.string(path, m, "extract", false).map(str::to_string);
        if let Some(x) = &extract
            && (x.is_empty()
                || x.starts_with('/')
                || x.split('/').any(|c| c == ".." || c.is_empty()))
        {
            cx.err(
                join(path, "extract"),
                format!("{x:?} must be a relative member path inside the archive"),
            );
        }
        let restart_units = cx.restart_units(path, m);
        if cx.errors.len() > before {
            return None;
        }
        Some(ArtifactChange {
            url: url?,
            sha256: sha?,
            path: p?,
            mode: mode?,
            extract,
            restart_units: restart_units?,
        })
    }

    fn canonical(&self, _bodies: bool) -> Value {
        let mut m = Map::new();
        m.insert("url".into(), json!(self.url));
        m.insert("sha256".into(), json!(self.sha256));
        m.insert("path".into(), json!(self.path.as_str()));
        m.insert("mode".into(), json!(self.mode.to_string()));
        put_opt(&mut m, "extract", &self.extract);
        m.insert("restartUnits".into(), json!(self.restart_units));
        Value::Object(m)
    }

    fn target(&self) -> String {
        self.path.to_string()
    }

    fn restart_units(&self) -> Vec<String> {
        self.restart_units.clone()
    }

    fn restart_field(&self) -> Option<&'static str> {
        Some("restartUnits")
    }

    fn fed_units(&self) -> Vec<String> {
        self.restart_units.clone()
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
        vec![Written::replaces("path", self.path.clone())]
    }

    fn packages(&self) -> Vec<&str> {
        Vec::new()
    }

    fn disruption(&self) -> Disruption {
        if self.restart_units.is_empty() {
            Disruption::None
        } else {
            Disruption::Restart
        }
    }

    fn needs_services(&self) -> bool {
        false
    }

    fn batchable(&self) -> bool {
        true
    }

    fn owner(&self) -> Option<&Owner> {
        None
    }

    fn preflight(&self, _node: &dyn Node) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    fn prepare(
        &self,
        node: &dyn Node,
        note: &mut dyn FnMut(Note),
    ) -> Result<Option<String>, StepError> {
        node.fetch_artifact(&self.url, &self.sha256, self.extract.as_deref(), note)
            .map(Some)
    }

    fn undecided(&self, node: &dyn Node) -> Option<String> {
        let member = self.extract.as_ref()?;
        match node.cached_member_sha(&self.sha256, member) {
            Some(_) => None,
            None => Some(format!(
                "{} is compared with {} once the archive is downloaded (while the plan is Preparing)",
                self.origin(),
                self.path
            )),
        }
    }

    fn diff(&self, node: &dyn Node, ctx: StepCtx) -> Result<Diff, StepError> {
        let sha256 = match &self.extract {
            None => self.sha256.to_ascii_lowercase(),
            Some(member) => node
                .cached_member_sha(&self.sha256, member)
                .ok_or_else(|| {
                    StepError::new(
                        ErrorKind::Download,
                        format!(
                            "{} is not in the download cache (it is fetched while the plan is \
                         Preparing)",
                            self.origin()
                        ),
                    )
                })?,
        };
        let meta = FileMeta {
            mode: self.mode.0,
            uid: ctx.root_ids.0,
            gid: ctx.root_ids.1,
        };
        let cached = node.cached_artifact(&sha256);
        if let Some((have_meta, size)) = node.file_meta(&self.path)? {
            let same_size = cached.as_ref().is_none_or(|(_, want)| *want == size);
            if have_meta == meta
                && same_size
                && node.file_sha256(&self.path)?.as_deref() == Some(sha256.as_str())
            {
                return Ok(Diff {
                    mutations: Vec::new(),
                    note: Some(format!(
                        "{} has sha256 {}",
                        self.path,
                        &sha256[..sha256.len().min(12)]
                    )),
                });
            }
        }
        let source = node.artifact_path(&sha256);
        Ok(Diff {
            mutations: vec![Mutation::WriteFrom {
                path: self.path.clone(),
                source,
                sha256,
                meta,
            }],
            note: Some(format!("from {}", self.origin())),
        })
    }

    fn resolve(
        &self,
        _node: &dyn Node,
        _timeout: std::time::Duration,
        _refresh: bool,
        _note: &mut dyn FnMut(Note),
    ) -> Result<Option<Option<String>>, StepError> {
        Ok(None)
    }

    fn resolved(&self, _value: &str) -> Option<super::Change> {
        None
    }

    fn set_members(&self) -> Vec<NodePath> {
        Vec::new()
    }
}

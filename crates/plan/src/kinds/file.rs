//! `file`: a file with these bytes, mode and owner (CAPI `files[]`).

use serde_json::{Map, Value, json};

use super::Mutation;
use super::{Diff, Node, Note, StepCtx};
use super::{Kind, Written, file_disruption};
use crate::parse::{Cx, join};
use crate::{Disruption, Encoding, Mode, NodePath, Owner, decode_content};
use inplace_base::StepError;
use inplace_base::{Compared, ErrorKind, Existing, FileMeta};

/// `file`: a file with these bytes, mode and owner.
#[derive(Debug, Clone, PartialEq)]
pub struct FileChange {
    /// Absolute path on the node.
    pub path: NodePath,
    /// The decoded bytes (the encoding is undone at validation).
    pub content: bytes::Bytes,
    /// Permission bits (default 0644).
    pub mode: Mode,
    /// Owner (default root:root).
    pub owner: Owner,
    /// Append `content` unless the file already contains it, instead of replacing the file.
    pub append: bool,
    /// Units restarted when this file changes.
    pub restart_units: Vec<String>,
}

/// The desired content of a file given what is there now (pure). With `append`, the content
/// is added unless the file already contains it, so applying twice appends once.
pub fn desired_content(existing: Option<&[u8]>, change: &FileChange) -> bytes::Bytes {
    match (existing, change.append) {
        (Some(current), true) => {
            if contains(current, &change.content) {
                bytes::Bytes::copy_from_slice(current)
            } else {
                let mut out = current.to_vec();
                out.extend_from_slice(&change.content);
                out.into()
            }
        }
        // Shared, not copied: a plan's content is held once however many steps use it.
        _ => change.content.clone(),
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || hay.windows(needle.len()).any(|w| w == needle)
}

/// The mutation a `file` change needs given what is at its path (pure).
pub fn file_mutation(
    existing: &Existing,
    change: &FileChange,
    ids: (u32, u32),
) -> Result<Option<Mutation>, String> {
    let current = match existing {
        Existing::File { content, .. } => Some(content.as_slice()),
        Existing::Absent | Existing::Other { .. } => None,
    };
    let content = desired_content(current, change);
    write_unless_held(&Compared::of(existing, &content), change, content, ids)
}

/// The mutation a `file` change that replaces the whole content (not `append`) needs given
/// what is at its path, compared with its content (pure): [`file_mutation`] without the
/// file's bytes.
pub fn replace_mutation(
    compared: &Compared,
    change: &FileChange,
    ids: (u32, u32),
) -> Result<Option<Mutation>, String> {
    write_unless_held(compared, change, change.content.clone(), ids)
}

/// Writing `content` with the mode and owner `change` sets (its owner resolved to `ids`),
/// unless what is at its path (`compared` with `content`) already holds exactly that.
fn write_unless_held(
    compared: &Compared,
    change: &FileChange,
    content: bytes::Bytes,
    ids: (u32, u32),
) -> Result<Option<Mutation>, String> {
    let meta = FileMeta {
        mode: change.mode.0,
        uid: ids.0,
        gid: ids.1,
    };
    match compared {
        Compared::Other { kind } => Err(format!("{} is a {kind}, not a regular file", change.path)),
        Compared::File {
            meta: m,
            same: true,
        } if *m == meta => Ok(None),
        Compared::Absent | Compared::File { .. } => Ok(Some(Mutation::Write {
            path: change.path.clone(),
            content,
            meta,
        })),
    }
}

impl Kind for FileChange {
    fn parse(cx: &mut Cx<'_>, index: usize, path: &str, m: &Map<String, Value>) -> Option<Self> {
        cx.known_keys(
            path,
            m,
            &[
                "path",
                "content",
                "encoding",
                "mode",
                "owner",
                "append",
                "restartUnits",
            ],
        );
        let p = cx
            .string(path, m, "path", true)
            .and_then(|s| cx.node_path(&join(path, "path"), s));
        if let Some(p) = &p {
            cx.claim(&join(path, "path"), format!("path:{p}"), p.as_str(), index);
        }
        let encoding = match cx.string(path, m, "encoding", false) {
            None | Some("plain") => Some(Encoding::Plain),
            Some("base64") => Some(Encoding::Base64),
            Some("gzip") => Some(Encoding::Gzip),
            Some("gzip+base64") => Some(Encoding::GzipBase64),
            Some(other) => {
                cx.err(
                    join(path, "encoding"),
                    format!("{other:?} is not one of plain, base64, gzip, gzip+base64"),
                );
                None
            }
        };
        let raw = cx.string(path, m, "content", true);
        let taken = cx.take_body(index);
        let content = match (raw, encoding) {
            (Some(_), Some(Encoding::Plain)) if taken.is_some() => {
                let bytes = taken.unwrap_or_default();
                cx.content_size(&join(path, "content"), bytes.len())
                    .then_some(bytes)
            }
            (Some(raw), Some(enc)) => match decode_content(raw, enc, cx.limits.max_content_bytes) {
                Ok(bytes) => cx
                    .content_size(&join(path, "content"), bytes.len())
                    .then(|| bytes.into()),
                Err(e) => {
                    cx.err(join(path, "content"), e);
                    None
                }
            },
            _ => None,
        };
        let mode = cx.mode(path, m, Mode::FILE_DEFAULT);
        let owner = cx.owner(path, m);
        let append = cx.boolean(path, m, "append").unwrap_or(false);
        let restart_units = cx.restart_units(path, m);
        Some(FileChange {
            path: p?,
            content: content?,
            mode: mode?,
            owner: owner?,
            append,
            restart_units: restart_units?,
        })
    }

    fn canonical(&self, bodies: bool) -> Value {
        json!({
            "path": self.path.as_str(),
            "content": if bodies { crate::digest::b64(&self.content) } else { String::new() },
            "encoding": "base64",
            "mode": self.mode.to_string(),
            "owner": self.owner.to_string(),
            "append": self.append,
            "restartUnits": self.restart_units,
        })
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
        vec![Written {
            field: "path",
            path: self.path.clone(),
            append: self.append,
            removes: false,
        }]
    }

    fn packages(&self) -> Vec<&str> {
        Vec::new()
    }

    fn disruption(&self) -> Disruption {
        file_disruption(&self.path, &self.restart_units)
    }

    fn needs_services(&self) -> bool {
        false
    }

    fn batchable(&self) -> bool {
        true
    }

    fn owner(&self) -> Option<&Owner> {
        Some(&self.owner)
    }

    fn preflight(&self, _node: &dyn Node) -> Vec<(&'static str, String)> {
        Vec::new()
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
        let ids = ctx.ids.unwrap_or(ctx.root_ids);
        // Replacing the whole content only needs to know whether the file holds it already.
        let mutation = if self.append {
            file_mutation(&node.read(&self.path)?, self, ids)
        } else {
            replace_mutation(&node.compare(&self.path, &self.content)?, self, ids)
        };
        Ok(Diff {
            mutations: mutation
                .map_err(|e| StepError::new(ErrorKind::Precondition, e))?
                .into_iter()
                .collect(),
            note: None,
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
        vec![self.path.clone()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Mode, NodePath, Owner};

    fn change(content: &str, append: bool) -> FileChange {
        FileChange {
            path: NodePath::parse("/etc/kubernetes/x").unwrap(),
            content: bytes::Bytes::copy_from_slice(content.as_bytes()),
            mode: Mode(0o640),
            owner: Owner::default(),
            append,
            restart_units: vec![],
        }
    }

    fn file(content: &str, mode: u32) -> Existing {
        Existing::File {
            content: content.as_bytes().to_vec(),
            meta: FileMeta {
                mode,
                uid: 0,
                gid: 0,
            },
        }
    }

    #[test]
    fn unchanged_only_when_bytes_mode_and_owner_match() {
        let c = change("a\n", false);
        assert_eq!(
            file_mutation(&file("a\n", 0o640), &c, (0, 0)).unwrap(),
            None
        );
        assert!(
            file_mutation(&file("a\n", 0o644), &c, (0, 0))
                .unwrap()
                .is_some()
        );
        assert!(
            file_mutation(&file("a\n", 0o640), &c, (0, 5))
                .unwrap()
                .is_some()
        );
        assert!(
            file_mutation(&file("b\n", 0o640), &c, (0, 0))
                .unwrap()
                .is_some()
        );
        assert!(
            file_mutation(&Existing::Absent, &c, (0, 0))
                .unwrap()
                .is_some()
        );
        assert!(file_mutation(&Existing::Other { kind: "directory" }, &c, (0, 0)).is_err());
    }

    #[test]
    fn a_replacement_is_decided_from_the_comparison_as_from_the_content() {
        let c = change("a\n", false);
        for existing in [
            file("a\n", 0o640),
            file("a\n", 0o644),
            file("b\n", 0o640),
            file("", 0o640),
            Existing::Absent,
            Existing::Other { kind: "directory" },
        ] {
            for ids in [(0, 0), (0, 5)] {
                assert_eq!(
                    replace_mutation(&Compared::of(&existing, &c.content), &c, ids),
                    file_mutation(&existing, &c, ids),
                    "{existing:?} {ids:?}"
                );
            }
        }
    }

    #[test]
    fn append_is_idempotent() {
        let c = change("line2\n", true);
        assert_eq!(
            &desired_content(Some(b"line1\n"), &c)[..],
            b"line1\nline2\n"
        );
        assert_eq!(
            &desired_content(Some(b"line1\nline2\n"), &c)[..],
            b"line1\nline2\n"
        );
        assert_eq!(&desired_content(None, &c)[..], b"line2\n");
    }
}

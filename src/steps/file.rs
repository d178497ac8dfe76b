//! `file` and `absent`.

use super::{Diff, Mutation, StepError};
use crate::base::FileMeta;
use crate::host::Host;
use crate::host::fs::{Existing, FsError};
use crate::plan::{AbsentChange, FileChange};

/// The desired content of a file given what is there now (pure). With `append`, the content
/// is added unless the file already contains it, so applying twice appends once.
pub fn desired_content(existing: Option<&[u8]>, change: &FileChange) -> Vec<u8> {
    match (existing, change.append) {
        (Some(current), true) => {
            if contains(current, &change.content) {
                current.to_vec()
            } else {
                let mut out = current.to_vec();
                out.extend_from_slice(&change.content);
                out
            }
        }
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
) -> Result<Option<Mutation>, FsError> {
    let meta = FileMeta {
        mode: change.mode.0,
        uid: ids.0,
        gid: ids.1,
    };
    let current = match existing {
        Existing::Absent => None,
        Existing::File { content, meta: m } => Some((content.as_slice(), *m)),
        Existing::Other { kind } => {
            return Err(FsError::NotAFile {
                path: change.path.to_string(),
                kind,
            });
        }
    };
    let content = desired_content(current.map(|(c, _)| c), change);
    if let Some((c, m)) = current
        && c == content.as_slice()
        && m == meta
    {
        return Ok(None);
    }
    Ok(Some(Mutation::Write {
        path: change.path.clone(),
        content,
        meta,
    }))
}

/// Reads the node and diffs a `file` change.
pub fn diff_file(host: &Host, change: &FileChange, ids: (u32, u32)) -> Result<Diff, StepError> {
    let existing = host.root.read(&change.path)?;
    Ok(Diff {
        mutations: file_mutation(&existing, change, ids)?.into_iter().collect(),
        note: None,
    })
}

/// Reads the node and diffs an `absent` change.
pub fn diff_absent(host: &Host, change: &AbsentChange) -> Result<Diff, StepError> {
    let mutations = match host.root.read(&change.path)? {
        Existing::Absent => Vec::new(),
        Existing::File { .. } => vec![Mutation::Remove {
            path: change.path.clone(),
        }],
        Existing::Other { kind } => {
            return Err(FsError::NotAFile {
                path: change.path.to_string(),
                kind,
            }
            .into());
        }
    };
    Ok(Diff {
        mutations,
        note: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Mode, NodePath, Owner};

    fn change(content: &str, append: bool) -> FileChange {
        FileChange {
            path: NodePath::parse("/etc/kubernetes/x").unwrap(),
            content: content.as_bytes().to_vec(),
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
    fn append_is_idempotent() {
        let c = change("line2\n", true);
        assert_eq!(desired_content(Some(b"line1\n"), &c), b"line1\nline2\n");
        assert_eq!(
            desired_content(Some(b"line1\nline2\n"), &c),
            b"line1\nline2\n"
        );
        assert_eq!(desired_content(None, &c), b"line2\n");
    }
}

//! Node paths and the allow-list: the only paths a plan may write.

use std::fmt;

/// An absolute, normalised path on the node (relative to the configured root):
/// starts with `/`, no `.`/`..`/empty components, no trailing slash, no NUL.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodePath(String);

/// Why a string is not a [`NodePath`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// Empty string.
    #[error("is empty")]
    Empty,
    /// Does not start with `/`.
    #[error("{0:?} is not absolute (it must start with /)")]
    Relative(String),
    /// Contains a NUL byte.
    #[error("contains a NUL byte")]
    Nul,
    /// Contains `..`.
    #[error("{0:?} contains '..'")]
    DotDot(String),
    /// Contains `.` or an empty component.
    #[error("{0:?} is not normalised (no '.', '//' or trailing '/')")]
    NotNormal(String),
    /// Is `/` itself.
    #[error("is the root directory")]
    Root,
    /// Longer than PATH_MAX or a component longer than NAME_MAX.
    #[error("is too long")]
    TooLong,
}

impl NodePath {
    /// Validates and wraps a path.
    pub fn parse(s: &str) -> Result<NodePath, PathError> {
        if s.is_empty() {
            return Err(PathError::Empty);
        }
        if s.contains('\0') {
            return Err(PathError::Nul);
        }
        if !s.starts_with('/') {
            return Err(PathError::Relative(s.to_string()));
        }
        if s == "/" {
            return Err(PathError::Root);
        }
        if s.len() > 4095 {
            return Err(PathError::TooLong);
        }
        for comp in s[1..].split('/') {
            match comp {
                ".." => return Err(PathError::DotDot(s.to_string())),
                "" | "." => return Err(PathError::NotNormal(s.to_string())),
                c if c.len() > 255 => return Err(PathError::TooLong),
                _ => {}
            }
        }
        Ok(NodePath(s.to_string()))
    }

    /// The path as a string (`/etc/kubernetes/x.conf`).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The path without its leading `/`, for `*at` calls relative to the root.
    pub fn relative(&self) -> &str {
        &self.0[1..]
    }

    /// The last component.
    pub fn file_name(&self) -> &str {
        self.0.rsplit('/').next().unwrap_or(&self.0)
    }

    /// The parent directory; `None` for a top-level entry such as `/etc`.
    pub fn parent(&self) -> Option<NodePath> {
        let idx = self.0.rfind('/')?;
        (idx > 0).then(|| NodePath(self.0[..idx].to_string()))
    }

    /// `self` and each ancestor, from the top (`/etc`, `/etc/kubernetes`, ...).
    pub fn ancestors_from_top(&self) -> Vec<NodePath> {
        let mut out = Vec::new();
        let mut cur = Some(self.clone());
        while let Some(p) = cur {
            cur = p.parent();
            out.push(p);
        }
        out.reverse();
        out
    }

    /// A child path.
    pub fn join(&self, name: &str) -> Result<NodePath, PathError> {
        NodePath::parse(&format!("{}/{}", self.0, name))
    }

    /// True when `self` is `dir` or lies below it.
    pub fn starts_with(&self, dir: &NodePath) -> bool {
        self.0 == dir.0
            || (self.0.starts_with(&dir.0) && self.0.as_bytes().get(dir.0.len()) == Some(&b'/'))
    }
}

impl fmt::Display for NodePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl serde::Serialize for NodePath {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for NodePath {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        NodePath::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Directories under which plans may write; everything else is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowList {
    dirs: Vec<NodePath>,
    /// Every path is allowed ([`AllowList::everything`]); an empty `dirs` alone allows nothing.
    everything: bool,
}

impl AllowList {
    /// The defaults of the agent's configuration.
    pub const DEFAULTS: [&'static str; 9] = [
        "/etc/kubernetes",
        "/var/lib/kubelet",
        "/etc/systemd/system",
        "/etc/containerd",
        "/etc/sysctl.d",
        "/etc/default",
        "/usr/local/bin",
        "/opt/cni/bin",
        "/etc/modules-load.d",
    ];

    /// An allow-list of these directories (none: nothing is allowed).
    pub fn new(dirs: Vec<NodePath>) -> AllowList {
        AllowList {
            dirs,
            everything: false,
        }
    }

    /// Every path is allowed: for re-reading plans the journal already accepted, never for
    /// the node's file access.
    pub fn everything() -> AllowList {
        AllowList {
            dirs: Vec::new(),
            everything: true,
        }
    }

    /// True for [`AllowList::everything`].
    pub fn is_everything(&self) -> bool {
        self.everything
    }

    /// True when `path` lies strictly below one of the directories (the directories
    /// themselves are not managed files).
    pub fn allows(&self, path: &NodePath) -> bool {
        self.everything || self.dirs.iter().any(|d| path.starts_with(d) && path != d)
    }

    /// The most specific directory `path` lies strictly below, if any.
    pub fn entry_of(&self, path: &NodePath) -> Option<&NodePath> {
        self.dirs
            .iter()
            .filter(|d| path.starts_with(d) && path != *d)
            .max_by_key(|d| d.as_str().len())
    }

    /// True when `dir` is one of the directories or lies below one (where an allow-listed
    /// directory may really be, through a symlink on its way).
    pub fn covers_dir(&self, dir: &NodePath) -> bool {
        self.everything || self.dirs.iter().any(|d| dir.starts_with(d))
    }

    /// True when `dir` is an allow-listed directory or lies above one: the way to it.
    pub fn leads_to(&self, dir: &NodePath) -> bool {
        self.everything || self.dirs.iter().any(|d| d.starts_with(dir))
    }

    /// The directories.
    pub fn dirs(&self) -> &[NodePath] {
        &self.dirs
    }
}

impl Default for AllowList {
    fn default() -> Self {
        AllowList::new(
            AllowList::DEFAULTS
                .iter()
                .filter_map(|p| NodePath::parse(p).ok())
                .collect(),
        )
    }
}

impl fmt::Display for AllowList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.everything {
            return f.write_str("(everything)");
        }
        let dirs: Vec<&str> = self.dirs.iter().map(NodePath::as_str).collect();
        f.write_str(&dirs.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_normal_paths() {
        let p = NodePath::parse("/etc/kubernetes/x.conf").unwrap();
        assert_eq!(p.file_name(), "x.conf");
        assert_eq!(p.parent().unwrap().as_str(), "/etc/kubernetes");
        assert_eq!(p.relative(), "etc/kubernetes/x.conf");
        assert_eq!(NodePath::parse("/etc").unwrap().parent(), None);
        let anc: Vec<String> = p
            .ancestors_from_top()
            .iter()
            .map(|p| p.to_string())
            .collect();
        assert_eq!(anc, ["/etc", "/etc/kubernetes", "/etc/kubernetes/x.conf"]);
    }

    #[test]
    fn rejects_bad_paths() {
        for bad in [
            "",
            "etc/x",
            "/",
            "/etc/../x",
            "/etc/./x",
            "/etc//x",
            "/etc/x/",
            "/a\0b",
        ] {
            assert!(NodePath::parse(bad).is_err(), "{bad:?} accepted");
        }
        let long = format!("/{}", "a".repeat(256));
        assert_eq!(NodePath::parse(&long), Err(PathError::TooLong));
    }

    #[test]
    fn allow_list_is_component_wise() {
        let allow = AllowList::default();
        let ok = |s| allow.allows(&NodePath::parse(s).unwrap());
        assert!(ok("/etc/kubernetes/audit.yaml"));
        assert!(ok("/etc/kubernetes/pki/ca.crt"));
        assert!(!ok("/etc/kubernetes"));
        assert!(!ok("/etc/kubernetes-evil/x"));
        assert!(!ok("/etc/shadow"));
        assert!(!ok("/root/.ssh/authorized_keys"));
        let np = |s| NodePath::parse(s).unwrap();
        assert_eq!(
            allow.entry_of(&np("/etc/kubernetes/pki/ca.crt")),
            Some(&np("/etc/kubernetes"))
        );
        assert!(allow.covers_dir(&np("/etc/kubernetes")));
        assert!(allow.leads_to(&np("/opt/cni")));
        assert!(!allow.leads_to(&np("/root")));
        assert!(!AllowList::new(Vec::new()).allows(&np("/etc/kubernetes/x")));
        assert!(AllowList::everything().allows(&np("/root/x")));
    }
}

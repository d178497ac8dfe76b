//! Users and groups of the node, from the root's `/etc/passwd` and `/etc/group` (never the
//! agent's own NSS: in the DaemonSet the container's users are not the node's).

use std::collections::HashMap;

use super::fs::{Existing, FsError, Root};
use inplace_plan::{IdRef, NodePath, Owner};

/// The node's user and group tables.
#[derive(Debug, Clone, Default)]
pub struct Accounts {
    users: HashMap<String, (u32, u32)>,
    groups: HashMap<String, u32>,
}

impl Accounts {
    /// Reads `/etc/passwd` and `/etc/group` under the root; missing files read as empty.
    pub fn load(root: &Root) -> Result<Accounts, FsError> {
        let read = |p: &str| -> Result<String, FsError> {
            let path = NodePath::parse(p).expect("constant path");
            Ok(match root.read(&path)? {
                Existing::File { content, .. } => String::from_utf8_lossy(&content).into_owned(),
                _ => String::new(),
            })
        };
        Ok(Accounts::parse(&read("/etc/passwd")?, &read("/etc/group")?))
    }

    /// Parses the two files' contents.
    pub fn parse(passwd: &str, group: &str) -> Accounts {
        let mut users = HashMap::new();
        for line in passwd.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() >= 4
                && !line.starts_with('#')
                && let (Ok(uid), Ok(gid)) = (f[2].parse(), f[3].parse())
            {
                users.entry(f[0].to_string()).or_insert((uid, gid));
            }
        }
        let mut groups = HashMap::new();
        for line in group.lines() {
            let f: Vec<&str> = line.split(':').collect();
            if f.len() >= 3
                && !line.starts_with('#')
                && let Ok(gid) = f[2].parse()
            {
                groups.entry(f[0].to_string()).or_insert(gid);
            }
        }
        Accounts { users, groups }
    }

    /// The ids of `root:root` on this node (0:0 unless the node's files say otherwise, as in
    /// an unprivileged sandbox).
    pub fn root_ids(&self) -> (u32, u32) {
        self.resolve(&Owner::default()).unwrap_or((0, 0))
    }

    /// Resolves an owner to numeric ids; the error says which name is unknown. `root` is
    /// 0 when the node's files do not list it.
    pub fn resolve(&self, owner: &Owner) -> Result<(u32, u32), String> {
        let (uid, primary) = match &owner.user {
            IdRef::Id(uid) => (*uid, None),
            IdRef::Name(name) => {
                let (uid, gid) = match self.users.get(name) {
                    Some(ids) => *ids,
                    None if name == "root" => (0, 0),
                    None => {
                        return Err(format!(
                            "user {name:?} does not exist on the node (/etc/passwd)"
                        ));
                    }
                };
                (uid, Some(gid))
            }
        };
        let gid = match &owner.group {
            Some(IdRef::Id(gid)) => *gid,
            Some(IdRef::Name(name)) => match self.groups.get(name) {
                Some(gid) => *gid,
                None if name == "root" => 0,
                None => {
                    return Err(format!(
                        "group {name:?} does not exist on the node (/etc/group)"
                    ));
                }
            },
            None => match primary {
                Some(gid) => gid,
                None => self
                    .users
                    .values()
                    .find(|(u, _)| *u == uid)
                    .map(|(_, g)| *g)
                    .unwrap_or(uid),
            },
        };
        Ok((uid, gid))
    }
}

/// The gid of the node's group `name` (its `/etc/group`, like file owners), creating it as a
/// system group when it is missing: with the node's own `groupadd` (chrooted into the root
/// when commands run there), or, when node commands do not chroot and the root is not `/`
/// (a sandbox), with this machine's `groupadd --prefix <root>`, which edits the root's files.
/// Returns the gid and whether it was created.
pub fn ensure_group(host: &super::Host, name: &str) -> Result<(u32, bool), String> {
    let lookup = || {
        Accounts::load(&host.root)
            .map(|a| a.groups.get(name).copied())
            .map_err(|e| format!("read the node's /etc/group: {e}"))
    };
    if let Some(gid) = lookup()? {
        return Ok((gid, false));
    }
    let root = host.root_path();
    let spec = if host.settings().commands_in_root || root == std::path::Path::new("/") {
        host.command(["groupadd", "--system", name])
    } else {
        super::command::CommandSpec::new([
            "groupadd".to_string(),
            "--system".to_string(),
            "--prefix".to_string(),
            root.display().to_string(),
            name.to_string(),
        ])
    }
    .timeout(std::time::Duration::from_secs(30));
    let out = super::command::run(&spec).map_err(|e| format!("{}: {e}", spec.display()))?;
    if !out.success() {
        return Err(format!("{}: {}", spec.display(), out.summary()));
    }
    match lookup()? {
        Some(gid) => Ok((gid, true)),
        None => Err(format!(
            "{} succeeded but the group is not in the node's /etc/group",
            spec.display()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use inplace_plan::parse_owner;

    #[test]
    fn resolves_names_numbers_and_primary_groups() {
        let acc = Accounts::parse(
            "root:x:0:0:root:/root:/bin/bash\netcd:x:998:997::/var/lib/etcd:/sbin/nologin\n",
            "root:x:0:\nadm:x:4:\netcd:x:997:\n",
        );
        let r = |s: &str| acc.resolve(&parse_owner(s).unwrap());
        assert_eq!(r("root:root"), Ok((0, 0)));
        assert_eq!(r("etcd"), Ok((998, 997)));
        assert_eq!(r("root:adm"), Ok((0, 4)));
        assert_eq!(r("1000:1000"), Ok((1000, 1000)));
        assert_eq!(
            r("kubelet:root"),
            Err("user \"kubelet\" does not exist on the node (/etc/passwd)".into())
        );
        assert!(r("root:nogroup").unwrap_err().contains("group \"nogroup\""));
    }
}

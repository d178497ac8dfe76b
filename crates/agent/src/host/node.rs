//! Facts about the node for `GetNodeInfo` and the daemon's defaults: `/etc/os-release`,
//! `/etc/hostname`, the kernel, and the installed kubelet's version. Read-only, best effort:
//! a fact that cannot be read is empty, never an error.

use std::io::Read;
use std::path::Path;
use std::time::Duration;

use rustix::fs::OFlags;

use super::Host;
use super::locks::open_in_root;

/// Longest file read here; os-release and hostname are tiny.
const MAX_FACT_FILE: u64 = 64 * 1024;

/// How long `kubelet --version` may take.
const KUBELET_VERSION_TIMEOUT: Duration = Duration::from_secs(5);

/// The operating system of the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OsInfo {
    /// os-release `ID` (`debian`).
    pub id: String,
    /// os-release `VERSION_ID` (`12`).
    pub version_id: String,
    /// os-release `PRETTY_NAME` (`Debian GNU/Linux 12 (bookworm)`).
    pub pretty_name: String,
    /// Kernel release (`uname -r`).
    pub kernel_release: String,
    /// Machine architecture (`uname -m`).
    pub architecture: String,
}

/// Reads a small file inside `root`, following symlinks only within it (os-release is
/// usually a symlink to `../usr/lib/os-release`).
fn read_in_root(root: &Path, rel: &str) -> Option<String> {
    let fd = open_in_root(root, Path::new(rel), OFlags::RDONLY).ok()?;
    let mut text = String::new();
    std::fs::File::from(fd)
        .take(MAX_FACT_FILE)
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

/// Parses os-release text (`KEY=value`, values optionally quoted) into `(key, value)` pairs.
pub fn parse_os_release(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            if line.starts_with('#') {
                return None;
            }
            let (key, value) = line.split_once('=')?;
            let value = value.trim();
            let unquoted = match value.as_bytes() {
                [b'"', .., b'"'] | [b'\'', .., b'\''] if value.len() >= 2 => {
                    &value[1..value.len() - 1]
                }
                _ => value,
            };
            // Shell escapes os-release allows inside double quotes.
            let unescaped = unquoted
                .replace("\\\"", "\"")
                .replace("\\$", "$")
                .replace("\\`", "`")
                .replace("\\\\", "\\");
            Some((key.trim().to_string(), unescaped))
        })
        .collect()
}

/// The node's OS: `<root>/etc/os-release` (else `<root>/usr/lib/os-release`) and uname.
pub fn os_info(host: &Host) -> OsInfo {
    let root = host.root_path();
    let text = read_in_root(root, "etc/os-release")
        .or_else(|| read_in_root(root, "usr/lib/os-release"))
        .unwrap_or_default();
    let fields = parse_os_release(&text);
    let get = |key: &str| {
        fields
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let uname = rustix::system::uname();
    OsInfo {
        id: get("ID"),
        version_id: get("VERSION_ID"),
        pretty_name: get("PRETTY_NAME"),
        kernel_release: uname.release().to_string_lossy().into_owned(),
        architecture: uname.machine().to_string_lossy().into_owned(),
    }
}

/// The first line of `<root>/etc/hostname`, trimmed; `None` when missing or empty.
pub fn hostname(root: &Path) -> Option<String> {
    let text = read_in_root(root, "etc/hostname")?;
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
}

/// The version `kubelet --version` reports (`v1.31.2`), the node's own kubelet run as every
/// node program (chrooted into the root, or the root's kubelet without chroot:
/// [`super::command::node_program`]); `None` when there is no kubelet or it does not answer
/// within 5 seconds.
pub fn kubelet_version(host: &Host) -> Option<String> {
    let spec = super::command::node_program(host, ["kubelet", "--version"])
        .timeout(KUBELET_VERSION_TIMEOUT);
    let output = super::command::run(&spec).ok()?;
    if !output.success() {
        return None;
    }
    parse_kubelet_version(&output.stdout)
}

/// The version in `kubelet --version` output (`Kubernetes v1.31.2`).
pub fn parse_kubelet_version(output: &str) -> Option<String> {
    output
        .split_whitespace()
        .rev()
        .find(|w| w.starts_with('v') && w[1..].starts_with(|c: char| c.is_ascii_digit()))
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_release_values_are_unquoted() {
        let fields = parse_os_release(
            "# comment\nPRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nID=debian\nVERSION_ID='12'\nX=\"a \\\"b\\\"\"\n",
        );
        assert_eq!(
            fields,
            vec![
                (
                    "PRETTY_NAME".into(),
                    "Debian GNU/Linux 12 (bookworm)".into()
                ),
                ("ID".into(), "debian".into()),
                ("VERSION_ID".into(), "12".into()),
                ("X".into(), "a \"b\"".into()),
            ]
        );
    }

    #[test]
    fn kubelet_version_is_found() {
        assert_eq!(
            parse_kubelet_version("Kubernetes v1.31.2\n").as_deref(),
            Some("v1.31.2")
        );
        assert_eq!(parse_kubelet_version("command not found"), None);
        assert_eq!(parse_kubelet_version(""), None);
    }

    #[test]
    fn facts_come_from_the_root() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("etc")).unwrap();
        std::fs::create_dir_all(dir.path().join("usr/lib")).unwrap();
        std::fs::write(
            dir.path().join("usr/lib/os-release"),
            "ID=fedora\nVERSION_ID=41\nPRETTY_NAME=\"Fedora Linux 41\"\n",
        )
        .unwrap();
        // Absolute symlink: resolved inside the root, not on the agent's filesystem.
        std::os::unix::fs::symlink("/usr/lib/os-release", dir.path().join("etc/os-release"))
            .unwrap();
        std::fs::write(dir.path().join("etc/hostname"), "\n worker-7 \n").unwrap();
        let host = Host::open(crate::host::HostSettings {
            root: dir.path().to_path_buf(),
            allow: inplace_plan::AllowList::default(),
            commands_in_root: false,
            boot_id_path: None,
            services: crate::host::ServiceSettings::Off,
            packages: Default::default(),
            downloads: crate::host::download::DownloadConfig::new(dir.path()),
        })
        .unwrap();
        let os = os_info(&host);
        assert_eq!(os.id, "fedora");
        assert_eq!(os.version_id, "41");
        assert_eq!(os.pretty_name, "Fedora Linux 41");
        assert!(!os.kernel_release.is_empty());
        assert_eq!(hostname(dir.path()).as_deref(), Some("worker-7"));
        std::fs::write(dir.path().join("etc/hostname"), "").unwrap();
        assert_eq!(hostname(dir.path()), None);
    }
}

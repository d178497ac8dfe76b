//! STAND-IN Kubernetes packages (`kubeadm`, `kubelet`, `kubectl`) and a local repository of
//! them inside a node's root, for the version-bump tests, the upgrade benchmark and `demo
//! --systemd`. **Not part of the agent**, and not Kubernetes: the packages carry shell
//! scripts and the kubelet stand-in ([`super::standin`]).
//!
//! The root is any directory holding a system (an overlay of `/` in the package tests, a
//! sandboxed node's `/proc/<pid>/root`); the tools run chrooted into it (`dpkg-deb`,
//! `dpkg-scanpackages` or `apt-ftparchive`, `apt-get`; `rpmbuild`, `createrepo_c`, `rpm`,
//! `dnf`), so they are the root's own. A sandboxed node is an overlay of this machine's `/`,
//! so they are this machine's: [`missing_tools`] says which are not installed.
//!
//! What the packages of one version (`1.31.2-1.1`, upstream `v1.31.2`) hold, laid out like
//! pkgs.k8s.io's:
//! - `kubeadm`: `/usr/bin/kubeadm`, a script — `kubeadm version -o short` prints `v1.31.2`;
//!   `kubeadm upgrade node ARGS` appends `kubeadm v1.31.2 upgrade node ARGS (kubelet
//!   v1.30.4)` (the kubelet installed at that moment) to [`KUBEADM_LOG`], appends a comment to
//!   `/var/lib/kubelet/config.yaml` (the real one rewrites it), on a control-plane node moves
//!   the image tag of the kube-apiserver, kube-controller-manager and kube-scheduler static
//!   pod manifests under [`MANIFESTS`] that exist to `v1.31.2` (the real one regenerates them;
//!   etcd's is left as it is, and a node without those manifests, a worker, sees no change),
//!   and then fails with exit 1 when [`KUBEADM_FAIL`] exists. Also the kubelet drop-in
//!   `/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf`, as upstream's kubeadm
//!   package ships it; it sets `KUBELET_STANDIN_DROPIN=kubeadm v1.31.2` in the unit's
//!   environment, so `systemctl show -p Environment` tells which drop-in systemd loaded.
//! - `kubelet`: the stand-in at `/usr/bin/kubelet` with `/usr/bin/kubelet.version` saying
//!   `v1.31.2`, and `/usr/lib/systemd/system/kubelet.service` (`ExecStart=/usr/bin/kubelet`,
//!   `Type=notify` like `tests/fixtures/kubelet.service`, each start logged to
//!   [`super::START_LOG`]). With [`Standin::Binary`] `/usr/bin/kubelet` is that program;
//!   with [`Standin::Agent`] (the demo) it is a script running the agent binary's hidden
//!   `kubelet-standin` subcommand from [`AGENT_IN_NODE`] with the package's version.
//! - `kubectl`: `/usr/bin/kubectl`, a script printing `Client Version: v1.31.2`.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::{AGENT_IN_NODE, KUBEADM_FLAGS, KUBELET_CONFIG, SandboxNode, Standin};
use crate::host::packages::ManagerKind;
use crate::host::systemd::Systemd;

/// Where the apt repository is built, in the root.
pub const APT_REPO: &str = "/srv/repo";
/// Where the rpm repository is built, in the root.
pub const RPM_REPO: &str = "/srv/rpmrepo";
/// Where the stand-in `kubeadm upgrade node` logs each run.
pub const KUBEADM_LOG: &str = "/var/log/kubeadm-standin.log";
/// The static pod manifests the stand-in `kubeadm upgrade node` moves on a control-plane node.
pub const MANIFESTS: &str = "/etc/kubernetes/manifests";
/// When this file exists, the stand-in `kubeadm upgrade node` fails (exit 1).
pub const KUBEADM_FAIL: &str = "/etc/kubernetes/kubeadm-standin-fail";
/// The three packages of a version bump, in the order they are upgraded.
pub const KUBE_PACKAGES: [&str; 3] = ["kubeadm", "kubelet", "kubectl"];

/// The old and the new version of the stand-in packages for a manager, as the example plans
/// `examples/plans/upgrade-1.30-to-1.31*.yaml` name them (pkgs.k8s.io's version schemes).
pub fn versions(kind: ManagerKind) -> (&'static str, &'static str) {
    match kind {
        ManagerKind::Apt => ("1.30.4-1.1", "1.31.2-1.1"),
        ManagerKind::Dnf => ("1.30.4-150500.1.1", "1.31.2-150500.1.1"),
    }
}

/// `1.31.2-1.1` → `1.31.2`.
pub fn upstream(version: &str) -> &str {
    version.split('-').next().unwrap_or(version)
}

/// The bytes of a file in a package.
#[derive(Debug, Clone)]
pub enum Content {
    /// These bytes.
    Bytes(Vec<u8>),
    /// A copy of this file on the machine, made when the package is built (a large binary
    /// is never held in memory).
    CopyOf(PathBuf),
}

/// One file of a stand-in package.
#[derive(Debug, Clone)]
pub struct PackageFile {
    /// Absolute path it installs to.
    pub path: String,
    /// Its bytes.
    pub content: Content,
    /// Its mode.
    pub mode: u32,
}

impl PackageFile {
    fn new(path: &str, content: impl Into<Vec<u8>>, mode: u32) -> PackageFile {
        PackageFile {
            path: path.to_string(),
            content: Content::Bytes(content.into()),
            mode,
        }
    }
}

/// A stand-in package: a name, a version (the manager's syntax) and files.
#[derive(Debug, Clone)]
pub struct Package {
    /// Its name.
    pub name: String,
    /// Its version, `1.31.2-1.1` (deb) or `1.31.2-150500.1.1` (rpm: version-release).
    pub version: String,
    /// Its files.
    pub files: Vec<PackageFile>,
}

impl Package {
    /// A package whose `/usr/bin/<name>` prints `Kubernetes v<upstream version>`.
    pub fn printing_version(name: &str, version: &str) -> Package {
        Package {
            name: name.to_string(),
            version: version.to_string(),
            files: vec![PackageFile::new(
                &format!("/usr/bin/{name}"),
                format!("#!/bin/sh\necho \"Kubernetes v{}\"\n", upstream(version)),
                0o755,
            )],
        }
    }
}

/// The stand-ins of the three Kubernetes packages at `version` (see the module docs), with
/// `kubelet` as the kubelet program.
pub fn kube_packages(version: &str, kubelet: Standin<'_>) -> Vec<Package> {
    let v = upstream(version);
    let kubeadm = format!(
        r##"#!/bin/sh
# STAND-IN kubeadm v{v} for the inplace-agent tests and demo; not kubeadm.
case "$1 $2" in
  "version -o") echo "v{v}" ;;
  "upgrade node")
    shift 2
    echo "[upgrade] Reading configuration from the cluster..."
    kubelet_now=$(/usr/bin/kubelet --version 2>/dev/null | sed -n 's/^Kubernetes //p')
    echo "kubeadm v{v} upgrade node${{*:+ $*}} (kubelet ${{kubelet_now:-not installed}})" >> {KUBEADM_LOG}
    if [ -f /var/lib/kubelet/config.yaml ]; then
      echo "# written by kubeadm v{v}" >> /var/lib/kubelet/config.yaml
    fi
    # A control-plane node: the real kubeadm regenerates its static pod manifests for the
    # new release. STAND-IN for that: each of kubeadm's three Kubernetes components'
    # manifests that exists gets its image tag moved to v{v}, nothing else; etcd's is left
    # alone (kubeadm picks etcd's version from a table of its own, which this has not).
    for c in kube-apiserver kube-controller-manager kube-scheduler; do
      m={MANIFESTS}/$c.yaml
      if [ -f "$m" ]; then
        echo "[upgrade/staticpods] Writing new static pod manifest for $c to $m"
        sed -i -E "s#^( *image: [^ ]*/$c):[^ ]*\$#\1:v{v}#" "$m"
      fi
    done
    if [ -e {KUBEADM_FAIL} ]; then
      echo "[upgrade/kubelet-config] writing the kubelet configuration"
      echo "error execution phase kubelet-config: stand-in failure requested by the test" >&2
      exit 1
    fi
    echo "[upgrade] The configuration for this node was successfully updated!"
    ;;
  *) echo "stand-in kubeadm: unsupported arguments: $*" >&2; exit 2 ;;
esac
"##
    );
    let drop_in = format!(
        "# STAND-IN kubeadm v{v}: the kubelet drop-in the kubeadm package ships\n\
         [Service]\n\
         Environment=\"KUBELET_STANDIN_DROPIN=kubeadm v{v}\"\n\
         Environment=\"KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf --kubeconfig=/etc/kubernetes/kubelet.conf\"\n\
         Environment=\"KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml\"\n\
         EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env\n\
         EnvironmentFile=-/etc/default/kubelet\n\
         ExecStart=\n\
         ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS $KUBELET_EXTRA_ARGS\n"
    );
    let unit = format!(
        "# STAND-IN kubelet v{v}: the kubelet.service the kubelet package ships, with\n\
         # Type=notify (see tests/fixtures/kubelet.service) and a start log for the tests.\n\
         [Unit]\n\
         Description=kubelet: The Kubernetes Node Agent (stand-in)\n\
         Documentation=https://kubernetes.io/docs/\n\
         Wants=network-online.target\n\
         After=network-online.target\n\
         StartLimitIntervalSec=0\n\
         \n\
         [Service]\n\
         Type=notify\n\
         Environment=KUBELET_STANDIN_START_LOG={}\n\
         ExecStart=/usr/bin/kubelet\n\
         Restart=always\n\
         RestartSec=10\n\
         \n\
         [Install]\n\
         WantedBy=multi-user.target\n",
        super::START_LOG
    );
    let kubelet_program = match kubelet {
        Standin::Binary(path) => PackageFile {
            path: "/usr/bin/kubelet".into(),
            content: Content::CopyOf(path.to_path_buf()),
            mode: 0o755,
        },
        Standin::Agent(_) => PackageFile::new(
            "/usr/bin/kubelet",
            format!(
                "#!/bin/sh\n# DEMO STAND-IN kubelet v{v} (inplace-agent demo --systemd); not a \
                 kubelet.\nexport KUBELET_STANDIN_VERSION=v{v}\n\
                 exec {AGENT_IN_NODE} kubelet-standin \"$@\"\n"
            ),
            0o755,
        ),
    };
    let kubectl = format!("#!/bin/sh\necho \"Client Version: v{v}\"\n");
    let package = |name: &str, files| Package {
        name: name.to_string(),
        version: version.to_string(),
        files,
    };
    vec![
        package(
            "kubeadm",
            vec![
                PackageFile::new("/usr/bin/kubeadm", kubeadm, 0o755),
                PackageFile::new(
                    "/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf",
                    drop_in,
                    0o644,
                ),
            ],
        ),
        package(
            "kubelet",
            vec![
                kubelet_program,
                PackageFile::new("/usr/bin/kubelet.version", format!("v{v}\n"), 0o644),
                PackageFile::new("/usr/lib/systemd/system/kubelet.service", unit, 0o644),
            ],
        ),
        package(
            "kubectl",
            vec![PackageFile::new("/usr/bin/kubectl", kubectl, 0o755)],
        ),
    ]
}

/// What is missing in `root` to build a repository of stand-in packages and install from it
/// with `kind`, or `None` when nothing is (the Debian packages to install are named).
pub fn missing_tools(root: &Path, kind: ManagerKind) -> Option<String> {
    let has = |tool: &str| {
        ["usr/bin", "usr/sbin", "bin", "sbin"]
            .iter()
            .any(|d| root.join(d).join(tool).is_file())
    };
    let mut missing = Vec::new();
    match kind {
        ManagerKind::Apt => {
            for (tool, package) in [
                ("dpkg-deb", "dpkg"),
                ("apt-get", "apt"),
                ("apt-mark", "apt"),
            ] {
                if !has(tool) {
                    missing.push(format!("{tool} (Debian package {package})"));
                }
            }
            if !has("dpkg-scanpackages") && !has("apt-ftparchive") {
                missing.push(
                    "dpkg-scanpackages or apt-ftparchive (Debian package dpkg-dev or apt-utils)"
                        .to_string(),
                );
            }
        }
        ManagerKind::Dnf => {
            for (tool, package) in [
                ("rpmbuild", "rpm"),
                ("rpm", "rpm"),
                ("createrepo_c", "createrepo-c"),
                ("dnf", "dnf"),
            ] {
                if !has(tool) {
                    missing.push(format!("{tool} (Debian package {package})"));
                }
            }
            let versionlock = ["usr/lib/python3/dist-packages/dnf-plugins/versionlock.py"]
                .iter()
                .any(|p| root.join(p).is_file());
            if !versionlock {
                missing.push(
                    "the dnf versionlock plugin (Debian package dnf-plugins-core)".to_string(),
                );
            }
        }
    }
    (!missing.is_empty()).then(|| format!("missing {}", missing.join(", ")))
}

/// Runs `argv` chrooted into `root` (`LC_ALL=C`, apt non-interactive) and returns its
/// stdout, or an error with its output.
pub fn run_in_root(root: &Path, argv: &[&str]) -> Result<String, String> {
    let out = Command::new("chroot")
        .arg(root)
        .args(argv)
        .env("LC_ALL", "C")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .output()
        .map_err(|e| format!("start chroot {} {}: {e}", root.display(), argv.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "{} (in {}): {}\n{}{}",
            argv.join(" "),
            root.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn in_root(root: &Path, abs: &str) -> PathBuf {
    root.join(abs.trim_start_matches('/'))
}

fn io(what: &str, path: &Path, e: std::io::Error) -> String {
    format!("{what} {}: {e}", path.display())
}

/// Writes the files of `package` under `dir` (an absolute path on this machine) with their
/// modes.
fn lay_out(package: &Package, dir: &Path) -> Result<(), String> {
    for f in &package.files {
        let path = dir.join(f.path.trim_start_matches('/'));
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| io("create", parent, e))?;
        }
        match &f.content {
            Content::Bytes(bytes) => fs::write(&path, bytes).map_err(|e| io("write", &path, e))?,
            Content::CopyOf(from) => {
                fs::copy(from, &path).map_err(|e| io("copy to", &path, e))?;
            }
        }
        fs::set_permissions(&path, fs::Permissions::from_mode(f.mode))
            .map_err(|e| io("chmod", &path, e))?;
    }
    Ok(())
}

/// Builds `packages` as .debs (`dpkg-deb`, chrooted into `root`) into [`APT_REPO`], indexes
/// them ([`apt_repo_index`]) and makes that repository the root's only apt source (no
/// network). Run `apt-get update` (or let the agent refresh) afterwards.
pub fn apt_repo(root: &Path, packages: &[Package]) -> Result<(), String> {
    let repo = in_root(root, APT_REPO);
    fs::create_dir_all(&repo).map_err(|e| io("create", &repo, e))?;
    let build = "/tmp/inplace-standin-debs";
    for package in packages {
        let name = format!("{}-{}", package.name, package.version);
        let dir = in_root(root, build).join(&name);
        let _ = fs::remove_dir_all(&dir);
        lay_out(package, &dir)?;
        let control = dir.join("DEBIAN/control");
        fs::create_dir_all(dir.join("DEBIAN")).map_err(|e| io("create", &dir, e))?;
        fs::write(
            &control,
            format!(
                "Package: {}\nVersion: {}\nArchitecture: all\n\
                 Maintainer: inplace-agent tests <tests@example.invalid>\n\
                 Description: STAND-IN {} for the inplace-agent tests and demo\n",
                package.name, package.version, package.name
            ),
        )
        .map_err(|e| io("write", &control, e))?;
        run_in_root(
            root,
            &[
                "dpkg-deb",
                "--root-owner-group",
                "-Zgzip",
                "-z1",
                "--build",
                &format!("{build}/{name}"),
                &format!("{APT_REPO}/{}_{}_all.deb", package.name, package.version),
            ],
        )?;
        let _ = fs::remove_dir_all(&dir);
    }
    apt_repo_index(root)?;
    let sources = in_root(root, "/etc/apt/sources.list.d");
    let _ = fs::remove_dir_all(&sources);
    fs::create_dir_all(&sources).map_err(|e| io("create", &sources, e))?;
    let list = in_root(root, "/etc/apt/sources.list");
    fs::write(&list, format!("deb [trusted=yes] file:{APT_REPO} ./\n"))
        .map_err(|e| io("write", &list, e))
}

/// Indexes [`APT_REPO`] again (after packages were added or removed), with
/// `dpkg-scanpackages`, or `apt-ftparchive` when that is what the root has. Runs in the root:
/// a directory reached through `/proc/<pid>/root` has no usable name for those tools outside
/// it.
pub fn apt_repo_index(root: &Path) -> Result<(), String> {
    let scan = if in_root(root, "/usr/bin/dpkg-scanpackages").is_file() {
        "dpkg-scanpackages --multiversion . 2>/dev/null"
    } else {
        "apt-ftparchive packages ."
    };
    let index = run_in_root(root, &["sh", "-c", &format!("cd {APT_REPO} && {scan}")])?;
    if index.trim().is_empty() {
        return Err(format!("{scan} in {APT_REPO} found no packages"));
    }
    let path = in_root(root, &format!("{APT_REPO}/Packages"));
    fs::write(&path, index).map_err(|e| io("write", &path, e))
}

/// Builds `packages` as rpms (`rpmbuild`, chrooted into `root`) into [`RPM_REPO`], indexes
/// them (`createrepo_c`) and sets the root up like an rpm node with that repository as its
/// only one: the rpm database in `/var/lib/rpm` (Debian's rpm keeps it elsewhere by
/// default), a release version (dnf cannot detect one on Debian), Debian's "local" dnf
/// plugin off. Then refreshes dnf's metadata.
pub fn dnf_repo(root: &Path, packages: &[Package]) -> Result<(), String> {
    let macros = in_root(root, "/etc/rpm/macros");
    if let Some(parent) = macros.parent() {
        fs::create_dir_all(parent).map_err(|e| io("create", parent, e))?;
    }
    fs::write(&macros, "%_dbpath /var/lib/rpm\n").map_err(|e| io("write", &macros, e))?;
    run_in_root(root, &["rpm", "--initdb"])?;
    let build = "/tmp/inplace-standin-rpms";
    let repo = in_root(root, RPM_REPO);
    fs::create_dir_all(&repo).map_err(|e| io("create", &repo, e))?;
    for package in packages {
        let (version, release) = package.version.split_once('-').ok_or_else(|| {
            format!(
                "rpm version {} has no release (version-release)",
                package.version
            )
        })?;
        let name = format!("{}-{}", package.name, package.version);
        let sources = format!("{build}/{name}/files");
        lay_out(package, &in_root(root, &sources))?;
        let install: String = package
            .files
            .iter()
            .map(|f| {
                format!(
                    "install -D -m {:o} {sources}{} %{{buildroot}}{}\n",
                    f.mode, f.path, f.path
                )
            })
            .collect();
        let files: String = package
            .files
            .iter()
            .map(|f| format!("{}\n", f.path))
            .collect();
        let spec = format!(
            "%global debug_package %{{nil}}\n\
             %global __os_install_post %{{nil}}\n\
             %global _build_id_links none\n\
             %global _binaries_in_noarch_packages_terminate_build 0\n\
             %global _binary_payload w1.gzdio\n\
             Name: {}\nVersion: {version}\nRelease: {release}\n\
             Summary: STAND-IN {} for the inplace-agent tests and demo\n\
             License: Apache-2.0\nBuildArch: noarch\nAutoReqProv: no\n\
             %description\nSTAND-IN {} for the inplace-agent tests and demo; not Kubernetes.\n\
             %install\n{install}%files\n{files}",
            package.name, package.name, package.name
        );
        let spec_path = format!("{build}/{name}/{}.spec", package.name);
        fs::write(in_root(root, &spec_path), spec)
            .map_err(|e| io("write", &in_root(root, &spec_path), e))?;
        run_in_root(
            root,
            &[
                "rpmbuild",
                "-bb",
                "--quiet",
                "--define",
                &format!("_topdir {build}/{name}/top"),
                &spec_path,
            ],
        )?;
        let rpms = in_root(root, &format!("{build}/{name}/top/RPMS/noarch"));
        for entry in fs::read_dir(&rpms).map_err(|e| io("read", &rpms, e))? {
            let entry = entry.map_err(|e| io("read", &rpms, e))?;
            let to = repo.join(entry.file_name());
            fs::copy(entry.path(), &to).map_err(|e| io("copy to", &to, e))?;
        }
        let _ = fs::remove_dir_all(in_root(root, &format!("{build}/{name}")));
    }
    run_in_root(root, &["createrepo_c", "--quiet", RPM_REPO])?;
    let repos = in_root(root, "/etc/yum.repos.d");
    let _ = fs::remove_dir_all(&repos);
    fs::create_dir_all(&repos).map_err(|e| io("create", &repos, e))?;
    let write = |abs: &str, text: &str| {
        let path = in_root(root, abs);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| io("create", parent, e))?;
        }
        fs::write(&path, text).map_err(|e| io("write", &path, e))
    };
    write(
        "/etc/yum.repos.d/local.repo",
        &format!("[local]\nname=local\nbaseurl=file://{RPM_REPO}\ngpgcheck=0\nenabled=1\n"),
    )?;
    write("/etc/dnf/vars/releasever", "12\n")?;
    write("/etc/dnf/plugins/local.conf", "[main]\nenabled = 0\n")?;
    run_in_root(root, &["dnf", "-q", "makecache"]).map(drop)
}

/// Installs the three Kubernetes packages at `version` with `kind` (directly with apt-get or
/// dnf, not through the agent) and holds them.
pub fn install_held(root: &Path, kind: ManagerKind, version: &str) -> Result<(), String> {
    match kind {
        ManagerKind::Apt => {
            let wanted: Vec<String> = KUBE_PACKAGES
                .iter()
                .map(|n| format!("{n}={version}"))
                .collect();
            // Downgrades too: the machine under an overlay may have a newer package of the
            // same name (Google's kubectl 1:528.0.0 from the Cloud SDK, for one).
            let mut argv = vec![
                "apt-get",
                "install",
                "-y",
                "-q",
                "--no-install-recommends",
                "--allow-downgrades",
            ];
            argv.extend(wanted.iter().map(String::as_str));
            run_in_root(root, &argv)?;
            let mut hold = vec!["apt-mark", "hold"];
            hold.extend(KUBE_PACKAGES);
            run_in_root(root, &hold).map(drop)
        }
        ManagerKind::Dnf => {
            let wanted: Vec<String> = KUBE_PACKAGES
                .iter()
                .map(|n| format!("{n}-{version}"))
                .collect();
            let mut argv = vec!["dnf", "-y", "-q", "install"];
            argv.extend(wanted.iter().map(String::as_str));
            run_in_root(root, &argv)?;
            let mut hold = vec!["dnf", "-q", "versionlock", "add"];
            hold.extend(KUBE_PACKAGES);
            run_in_root(root, &hold).map(drop)
        }
    }
}

/// The version of a package installed in `root` and whether it is held, or `None` when it is
/// not installed (read with dpkg-query or rpm and dnf versionlock, not through the agent).
pub fn installed(root: &Path, kind: ManagerKind, name: &str) -> Option<(String, bool)> {
    match kind {
        ManagerKind::Apt => {
            let out = run_in_root(
                root,
                &[
                    "dpkg-query",
                    "-W",
                    "-f=${db:Status-Want} ${db:Status-Status} ${Version}",
                    name,
                ],
            )
            .ok()?;
            match out.split_whitespace().collect::<Vec<_>>()[..] {
                [want, "installed", version] => Some((version.to_string(), want == "hold")),
                _ => None,
            }
        }
        ManagerKind::Dnf => {
            let version =
                run_in_root(root, &["rpm", "-q", "--qf", "%{VERSION}-%{RELEASE}", name]).ok()?;
            let locks =
                run_in_root(root, &["dnf", "-q", "-C", "versionlock", "list"]).unwrap_or_default();
            let held = locks
                .lines()
                .any(|l| l.starts_with(&format!("{name}-0:{version}.")));
            Some((version, held))
        }
    }
}

impl SandboxNode {
    /// Makes this node a kubeadm node at the old version of [`versions`] installed from
    /// packages: a local repository (apt or rpm, built in the node) offering the stand-in
    /// packages ([`kube_packages`]) at both versions, the old ones installed and held, the
    /// kubelet configuration and `kubeadm-flags.env` as `kubeadm join` leaves them, and the
    /// packaged `kubelet.service` enabled and started. Needs [`missing_tools`] to be `None`.
    pub fn install_kube_packages(
        &self,
        kind: ManagerKind,
        standin: Standin<'_>,
    ) -> Result<Systemd, String> {
        let (old, new) = versions(kind);
        let mut packages = kube_packages(old, standin);
        packages.extend(kube_packages(new, standin));
        self.install_kube_packages_from(kind, standin, &packages)
    }

    /// [`SandboxNode::install_kube_packages`] with these packages (both versions of
    /// [`kube_packages`], changed as the caller needs: the benchmark adds a payload to each).
    pub fn install_kube_packages_from(
        &self,
        kind: ManagerKind,
        standin: Standin<'_>,
        packages: &[Package],
    ) -> Result<Systemd, String> {
        let root = self.path("/");
        if let Some(why) = missing_tools(&root, kind) {
            return Err(format!("cannot build a {kind} repository: {why}"));
        }
        if let Standin::Agent(agent) = standin {
            let binary = fs::read(agent)
                .map_err(|e| format!("read agent binary {}: {e}", agent.display()))?;
            self.write_file(AGENT_IN_NODE, binary, 0o755);
        }
        let (old, _) = versions(kind);
        match kind {
            ManagerKind::Apt => {
                apt_repo(&root, packages)?;
                run_in_root(&root, &["apt-get", "update", "-q"])?;
            }
            ManagerKind::Dnf => dnf_repo(&root, packages)?,
        }
        install_held(&root, kind, old)?;
        self.write_file("/var/lib/kubelet/config.yaml", KUBELET_CONFIG, 0o644);
        self.write_file("/var/lib/kubelet/kubeadm-flags.env", KUBEADM_FLAGS, 0o644);
        let fail = |e: crate::host::systemd::SystemdError| format!("sandbox {}: {e}", self.id);
        let systemd = Systemd::connect(&self.bus_address(), super::CALL_TIMEOUT).map_err(fail)?;
        systemd.daemon_reload().map_err(fail)?;
        systemd
            .enable_unit_files(&["kubelet.service"])
            .map_err(fail)?;
        systemd.daemon_reload().map_err(fail)?;
        systemd
            .start("kubelet.service", Duration::from_secs(30))
            .map_err(|e| format!("sandbox {}: {e}\n{}", self.id, self.journal("kubelet")))?;
        Ok(systemd)
    }
}

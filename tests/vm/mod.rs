//! The disposable VM node of the VM tests (docs/testing-vm.md): a Debian guest built by
//! `tests/vm/build-image` and cached under `~/.cache/inplace-agent/vm/<key>`, booted by qemu
//! from its extracted kernel and initrd, its disk served by the NBD stand-in ([`nbd`]), the
//! agent, the packaged unit and the plans passed in through a read-only 9p share, and commands
//! run through the guest agent ([`qga`]). Shared by `tests/vm_node.rs` and
//! `benches/powercut.rs`.
#![allow(dead_code)]

pub mod nbd;
pub mod powercut;
pub mod qga;

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

use nbd::{Disk, Snapshot};
use qga::{ExecOutput, Qga};

/// The image build script; its hash keys the cache.
const BUILD_SCRIPT: &str = include_str!("build-image");
/// Run in the guest once, on the fresh image: installs the agent as a package would.
const GUEST_SETUP: &str = include_str!("guest-setup");

/// How long a boot may take until the guest agent answers (software emulation on 2 busy
/// cores takes about a minute at worst).
pub const BOOT_TIMEOUT: Duration = Duration::from_secs(240);
/// How long the KVM probe waits for the kernel's first words on the serial console.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// How qemu runs the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation (a guest kernel that boots on this host's /dev/kvm).
    Kvm,
    /// Software emulation (TCG): the same guest, about 10× slower.
    Tcg {
        /// Why KVM is not used.
        why: String,
    },
}

impl Accel {
    fn qemu_arg(&self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg { .. } => "tcg",
        }
    }

    /// The guest's virtual CPUs. Under TCG each is a host thread that must be scheduled
    /// promptly: a guest whose vCPU threads wait behind other VMs' stalls its kernel (RCU
    /// stall warnings, timers that do not fire) and its boot never reaches the guest agent.
    /// One vCPU per emulated guest, and [`VmEnv::node`] runs only as many guests at once as
    /// the host has cores for.
    pub fn vcpus(&self) -> usize {
        match self {
            Accel::Kvm => 2,
            Accel::Tcg { .. } => 1,
        }
    }

    /// One line for test output and the bench report.
    pub fn describe(&self) -> String {
        match self {
            Accel::Kvm => "KVM (hardware virtualisation)".into(),
            Accel::Tcg { why } => format!("TCG (software emulation, about 10x slower): {why}"),
        }
    }
}

/// The built image: kernel, initrd, root file system.
#[derive(Debug, Clone)]
pub struct Image {
    pub dir: PathBuf,
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    pub rootfs: PathBuf,
    /// How long the build took (None: it came from the cache).
    pub built_in: Option<Duration>,
}

/// What a VM test needs, found once per process.
pub struct VmEnv {
    pub image: Image,
    pub accel: Accel,
    /// The agent and the stand-in kubelet under test.
    pub agent_bin: PathBuf,
    pub kubelet_bin: PathBuf,
    /// The node after `guest-setup` and a clean power-off, forked for each test.
    prepared: Mutex<Option<Arc<Snapshot>>>,
    pub setup_boot: Mutex<Option<Duration>>,
    /// Free VM slots: the host's cores divided by the guests' vCPUs (at least one).
    slots: Arc<(Mutex<usize>, Condvar)>,
}

/// A VM slot, held by a [`Node`] for its life and given back when it is dropped.
pub struct Slot(Arc<(Mutex<usize>, Condvar)>);

impl Slot {
    fn take(slots: &Arc<(Mutex<usize>, Condvar)>, node: &str) -> Slot {
        let (free, freed) = &**slots;
        let mut n = free.lock().unwrap_or_else(|e| e.into_inner());
        if *n == 0 {
            eprintln!("VM node {node}: waiting for a free VM slot (one guest per core it needs)");
        }
        while *n == 0 {
            n = freed.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        *n -= 1;
        Slot(slots.clone())
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let (free, freed) = &*self.0;
        *free.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        freed.notify_one();
    }
}

fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// Says why the VM tests cannot run: a failure in CI (or as root with the packages
/// installed, where they must run), a loud skip otherwise.
fn cannot(test: &str, why: &str, must_run: bool) -> Option<&'static VmEnv> {
    if must_run {
        panic!("{test}: the VM node cannot be had: {why}");
    }
    eprintln!("SKIP {test}: {why} (CI runs it: as root, with tests/packages.txt installed)");
    None
}

/// The VM environment, or None after a loud skip. `agent_bin` and `kubelet_bin` are the
/// binaries to install in the guest.
pub fn require(test: &str, agent_bin: &str, kubelet_bin: &str) -> Option<&'static VmEnv> {
    static ENV: OnceLock<std::result::Result<VmEnv, String>> = OnceLock::new();
    let root = rustix::process::geteuid().is_root();
    if !root {
        return cannot(test, "needs root (debootstrap builds the image)", in_ci());
    }
    let missing: Vec<&str> = ["qemu-system-x86_64", "debootstrap", "mkfs.ext4"]
        .into_iter()
        .filter(|t| !on_path(t))
        .collect();
    if !missing.is_empty() {
        return cannot(
            test,
            &format!(
                "not installed: {} (tests/setup installs qemu-system-x86, debootstrap)",
                missing.join(", ")
            ),
            in_ci(),
        );
    }
    // Root with the tools installed: from here on every failure is a test failure.
    let env = ENV.get_or_init(|| {
        VmEnv::open(Path::new(agent_bin), Path::new(kubelet_bin)).map_err(|e| format!("{e:#}"))
    });
    match env {
        Ok(env) => Some(env),
        Err(e) => cannot(test, &format!("no image could be built: {e}"), true),
    }
}

fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false)
        || ["/usr/sbin", "/sbin"]
            .iter()
            .any(|d| Path::new(d).join(tool).is_file())
}

impl VmEnv {
    fn open(agent_bin: &Path, kubelet_bin: &Path) -> Result<VmEnv> {
        let image = Image::get()?;
        let accel = detect_accel(&image);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let at_once = (cores / accel.vcpus()).max(1);
        eprintln!(
            "VM node: accelerator {}; {at_once} guest(s) at a time on {cores} core(s)",
            accel.describe()
        );
        Ok(VmEnv {
            image,
            accel,
            agent_bin: agent_bin.to_path_buf(),
            kubelet_bin: kubelet_bin.to_path_buf(),
            prepared: Mutex::new(None),
            setup_boot: Mutex::new(None),
            slots: Arc::new((Mutex::new(at_once), Condvar::new())),
        })
    }

    /// A new node: the prepared disk forked (first use boots the fresh image once and runs
    /// `guest-setup` in it), with its own share directory.
    /// Waits for a free VM slot first; the node holds it until it is dropped.
    pub fn node(&self, name: &str) -> Result<Node> {
        let slot = Slot::take(&self.slots, name);
        let prepared = {
            let mut p = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
            if p.is_none() {
                *p = Some(Arc::new(self.prepare()?));
            }
            p.clone().context("prepared disk")?
        };
        let dir = tempfile::Builder::new()
            .prefix(&format!("inplace-vm-{name}-"))
            .tempdir()?;
        let share = self.share(dir.path())?;
        let disk = prepared.serve(&dir.path().join("disk.sock"))?;
        Ok(Node {
            dir,
            share,
            disk,
            accel: self.accel.clone(),
            image: self.image.clone(),
            boots: 0,
            _slot: slot,
        })
    }

    /// The share: binaries, unit, configuration, certificates, guest scripts; plans are
    /// added by the tests under `plans/`.
    fn share(&self, dir: &Path) -> Result<PathBuf> {
        let share = dir.join("share");
        std::fs::create_dir_all(share.join("plans"))?;
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        std::fs::copy(&self.agent_bin, share.join("inplace-agent"))
            .with_context(|| format!("copy {}", self.agent_bin.display()))?;
        std::fs::copy(&self.kubelet_bin, share.join("kubelet"))
            .with_context(|| format!("copy {}", self.kubelet_bin.display()))?;
        for (from, to) in [
            ("systemd/inplace-agent.service", "inplace-agent.service"),
            ("systemd/inplace-agent.sysusers", "inplace-agent.sysusers"),
            ("systemd/inplace-agent.tmpfiles", "inplace-agent.tmpfiles"),
            ("tests/fixtures/kubelet.service", "kubelet.service"),
            ("tests/fixtures/kubelet-config.yaml", "kubelet-config.yaml"),
            ("tests/fixtures/kubeadm-flags.env", "kubeadm-flags.env"),
        ] {
            std::fs::copy(repo.join(from), share.join(to))
                .with_context(|| format!("copy {from}"))?;
        }
        std::fs::write(share.join("guest-setup"), GUEST_SETUP)?;
        // Throwaway certificates, made by the agent's own `pki init` on the host.
        let out = Command::new(&self.agent_bin)
            .args(["pki", "init"])
            .arg(share.join("pki"))
            .args(["--node-name", "vmnode"])
            .output()
            .context("run inplace-agent pki init")?;
        if !out.status.success() {
            bail!("pki init: {}", String::from_utf8_lossy(&out.stderr));
        }
        for entry in std::fs::read_dir(&share)? {
            let p = entry?.path();
            if p.is_file() {
                // The share is read as the guest's root through `security_model=none`.
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))?;
            }
        }
        Ok(share)
    }

    /// Boots the fresh image once, runs `guest-setup` and powers the guest off cleanly.
    fn prepare(&self) -> Result<Snapshot> {
        let began = Instant::now();
        let work = tempfile::Builder::new()
            .prefix("inplace-vm-prepare-")
            .tempdir()?;
        let disk = Disk::new(&self.image.rootfs, &work.path().join("disk.sock"))?;
        let share = self.share(work.path())?;
        let mut vm = Vm::boot(
            &self.image,
            &self.accel,
            &disk,
            &share,
            work.path(),
            "prepare",
        )?;
        let mut qga = vm.qga(BOOT_TIMEOUT)?;
        // The power-cut model needs the guest to see a volatile write cache (and so to
        // flush it): qemu's `cache=writeback` shows one.
        let cache = sh_ok(
            &mut qga,
            "cat /sys/block/vda/queue/write_cache",
            Duration::from_secs(30),
        )?;
        if cache.trim() != "write back" {
            bail!("the guest's disk has no volatile write cache: write_cache is {cache:?}");
        }
        let out = qga.exec(
            &["/bin/sh", "/mnt/share/guest-setup"],
            Duration::from_secs(300),
        )?;
        if out.code != 0 {
            bail!(
                "guest-setup failed ({}): {}{}",
                out.code,
                out.stdout,
                out.stderr
            );
        }
        // A clean power-off: systemd stops everything, syncs, and qemu flushes and quits.
        let _ = qga.exec(&["/bin/systemctl", "poweroff"], Duration::from_secs(10));
        vm.wait_exit(Duration::from_secs(120))
            .context("the guest did not power off after guest-setup")?;
        if !disk.wait_disconnected(Duration::from_secs(10)) {
            bail!("the disk stayed connected after qemu quit");
        }
        let took = began.elapsed();
        let st = disk.stats();
        eprintln!(
            "VM node: prepared (boot + guest-setup + power-off) in {:.0} s; the disk saw {} \
             writes ({} with FUA) and {} flushes",
            took.as_secs_f64(),
            st.writes,
            st.fua_writes,
            st.flushes
        );
        *self.setup_boot.lock().unwrap_or_else(|e| e.into_inner()) = Some(took);
        Ok(disk.snapshot()?)
    }
}

// === impl Image ===

impl Image {
    /// The cached image for this build script, built first if missing.
    fn get() -> Result<Image> {
        let key = hex::encode(&Sha256::digest(BUILD_SCRIPT.as_bytes())[..8]);
        let cache = cache_dir().join("vm");
        let dir = cache.join(&key);
        std::fs::create_dir_all(&cache)?;
        // One build at a time across processes (two test binaries, a bench).
        // tests/setup may be building it in the background under this lock.
        let lock = File::create(cache.join("build.lock"))?;
        let waited = Instant::now();
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
            .context("lock the VM image cache")?;
        if waited.elapsed() > Duration::from_secs(2) {
            eprintln!(
                "VM node: waited {:.0} s for the image build of tests/setup ({})",
                waited.elapsed().as_secs_f64(),
                cache.join("build.log").display()
            );
        }
        let mut built_in = None;
        if !dir.join("ready").is_file() {
            let began = Instant::now();
            let _ = std::fs::remove_dir_all(&dir);
            eprintln!(
                "VM node: building the image into {} (debootstrap; a few minutes)",
                dir.display()
            );
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vm/build-image");
            let out = Command::new("bash")
                .arg(&script)
                .arg(&dir)
                .stdin(Stdio::null())
                .output()
                .context("run tests/vm/build-image")?;
            if !out.status.success() {
                bail!(
                    "tests/vm/build-image failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            built_in = Some(began.elapsed());
            eprintln!(
                "VM node: image built in {:.0} s",
                began.elapsed().as_secs_f64()
            );
        } else {
            eprintln!("VM node: image from the cache {}", dir.display());
        }
        // Images of older scripts are never used again (nor are unfinished builds).
        for entry in std::fs::read_dir(&cache)? {
            let p = entry?.path();
            if p.is_dir() && p != dir {
                let _ = std::fs::remove_dir_all(&p);
            }
        }
        Ok(Image {
            kernel: dir.join("vmlinuz"),
            initrd: dir.join("initrd.img"),
            rootfs: dir.join("rootfs.img"),
            dir,
            built_in,
        })
    }
}

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("inplace-agent");
    }
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache/inplace-agent")
}

/// KVM when /dev/kvm runs this guest's kernel: in a probe boot the kernel must print its
/// first line on the serial console within seconds. On these machines /dev/kvm is a nested PVM device that runs only
/// PVM-enabled kernels (Debian's hangs in its decompressor, printing nothing), so the probe
/// is what decides, not the device's presence. `INPLACE_VM_ACCEL=tcg|kvm` forces a choice.
fn detect_accel(image: &Image) -> Accel {
    match std::env::var("INPLACE_VM_ACCEL").as_deref() {
        Ok("tcg") => {
            return Accel::Tcg {
                why: "INPLACE_VM_ACCEL=tcg".into(),
            };
        }
        Ok("kvm") => return Accel::Kvm,
        _ => {}
    }
    if let Err(e) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        return Accel::Tcg {
            why: format!("/dev/kvm cannot be opened: {e}"),
        };
    }
    match probe_kvm(image) {
        Ok(()) => Accel::Kvm,
        Err(why) => Accel::Tcg { why },
    }
}

fn probe_kvm(image: &Image) -> std::result::Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let log = dir.path().join("serial.log");
    let mut child = Command::new("setpriv")
        .args(["--pdeathsig", "KILL", "--", "qemu-system-x86_64"])
        .args(["-accel", "kvm", "-cpu", "host", "-m", "256", "-nodefaults"])
        .args(["-display", "none", "-no-reboot"])
        .arg("-kernel")
        .arg(&image.kernel)
        .args(["-append", "console=ttyS0 earlyprintk=ttyS0 panic=-1"])
        .arg("-serial")
        .arg(format!("file:{}", log.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("qemu-system-x86_64 -accel kvm: {e}"))?;
    let began = Instant::now();
    let result = loop {
        // The real-mode setup code prints ("Probing EDD") even where the kernel then hangs;
        // the kernel proper's first line is what shows it runs.
        let printed = std::fs::read_to_string(&log).unwrap_or_default();
        if printed.contains("Linux version") {
            break Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            break Err(format!(
                "the KVM probe boot exited ({status}) before printing: {}",
                err.trim()
            ));
        }
        if began.elapsed() > PROBE_TIMEOUT {
            break Err(format!(
                "/dev/kvm is there but in a probe boot the guest kernel printed no \
                 \"Linux version\" on the serial console in {} s (a nested PVM device runs only PVM-enabled \
                 kernels)",
                PROBE_TIMEOUT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    result
}

// === impl Node ===

/// One disposable node: its disk (forked from the prepared one), its share, its VM runs.
pub struct Node {
    pub dir: tempfile::TempDir,
    pub share: PathBuf,
    pub disk: Disk,
    pub accel: Accel,
    image: Image,
    boots: u32,
    _slot: Slot,
}

impl Node {
    /// Boots the node (a new qemu process on the same disk).
    pub fn boot(&mut self) -> Result<Vm> {
        self.boots += 1;
        let name = format!("boot{}", self.boots);
        Vm::boot(
            &self.image,
            &self.accel,
            &self.disk,
            &self.share,
            self.dir.path(),
            &name,
        )
    }

    /// Writes a plan into the share; its path in the guest.
    pub fn put_plan(&self, name: &str, text: &str) -> Result<String> {
        let p = self.share.join("plans").join(name);
        std::fs::write(&p, text)?;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644))?;
        Ok(format!("/mnt/share/plans/{name}"))
    }
}

// === impl Vm ===

/// A running qemu process. Dropping it kills qemu.
pub struct Vm {
    child: Option<Child>,
    qga_socket: PathBuf,
    pub serial_log: PathBuf,
}

impl Vm {
    fn boot(
        image: &Image,
        accel: &Accel,
        disk: &Disk,
        share: &Path,
        dir: &Path,
        name: &str,
    ) -> Result<Vm> {
        let qga_socket = dir.join(format!("{name}.qga"));
        let serial_log = dir.join(format!("{name}.serial.log"));
        // qemu must not outlive the test process (a test killed by its runner): setpriv
        // (util-linux) sets the parent-death signal and execs it.
        let mut cmd = Command::new("setpriv");
        cmd.args(["--pdeathsig", "KILL", "--", "qemu-system-x86_64"])
            .args(["-accel", accel.qemu_arg()]);
        if *accel == Accel::Kvm {
            cmd.args(["-cpu", "host"]);
        }
        cmd.args(["-machine", "q35", "-m", "1024"])
            .args(["-smp", &accel.vcpus().to_string()])
            .args(["-nodefaults", "-display", "none", "-no-user-config"])
            .arg("-kernel")
            .arg(&image.kernel)
            .arg("-initrd")
            .arg(&image.initrd)
            .args([
                "-append",
                "root=/dev/vda rw console=ttyS0 loglevel=4 systemd.show_status=false \
                 mitigations=off panic=-1",
            ])
            .arg("-serial")
            .arg(format!("file:{}", serial_log.display()))
            // The disk: the NBD stand-in; qemu's writeback mode shows the guest a volatile
            // write cache and passes its flushes on (docs/testing-vm.md).
            .arg("-drive")
            .arg(format!(
                "file=nbd+unix:///?socket={},format=raw,if=virtio,cache=writeback,discard=ignore",
                disk.socket().display()
            ))
            .arg("-virtfs")
            .arg(format!(
                "local,path={},mount_tag=share,security_model=none,readonly=on",
                share.display()
            ))
            .arg("-chardev")
            .arg(format!(
                "socket,id=qga0,path={},server=on,wait=off",
                qga_socket.display()
            ))
            .args(["-device", "virtio-serial-pci"])
            .args([
                "-device",
                "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
            ])
            .args(["-nic", "none"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(File::create(
                dir.join(format!("{name}.qemu.log")),
            )?));
        let child = cmd.spawn().context("start qemu-system-x86_64")?;
        let vm = Vm {
            child: Some(child),
            qga_socket,
            serial_log,
        };
        // qemu creates the socket as it starts.
        let began = Instant::now();
        while !vm.qga_socket.exists() {
            if began.elapsed() > Duration::from_secs(30) {
                bail!("qemu did not create {}", vm.qga_socket.display());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(vm)
    }

    /// The guest agent, once it answers (the guest has booted far enough).
    pub fn qga(&mut self, timeout: Duration) -> Result<Qga> {
        let began = Instant::now();
        loop {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                bail!("qemu exited ({status}) while booting; {}", self.tail());
            }
            match Qga::connect(&self.qga_socket) {
                Ok(mut q) => match q.sync(Duration::from_secs(3)) {
                    Ok(()) => return Ok(q),
                    Err(e) if began.elapsed() > timeout => {
                        bail!(
                            "the guest agent did not answer within {} s: {e:#}; {}",
                            timeout.as_secs(),
                            self.tail()
                        )
                    }
                    Err(_) => {}
                },
                Err(e) if began.elapsed() > timeout => {
                    bail!("connect {}: {e}", self.qga_socket.display())
                }
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// The power cut: SIGKILL to qemu. Nothing the guest did not flush survives (the NBD
    /// stand-in drops it when the connection ends).
    pub fn cut(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for qemu to exit on its own (guest power-off).
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<()> {
        let began = Instant::now();
        while let Some(c) = self.child.as_mut() {
            if c.try_wait()?.is_some() {
                self.child = None;
                return Ok(());
            }
            if began.elapsed() > timeout {
                bail!("qemu still running after {} s", timeout.as_secs());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// The guest kernel reported that its CPUs stalled (RCU stall warnings): the host did
    /// not schedule the emulator's threads for seconds. That says nothing about the node.
    pub fn guest_starved(&self) -> bool {
        let text = std::fs::read_to_string(&self.serial_log).unwrap_or_default();
        text.contains("rcu_preempt detected stalls")
            || text.contains("rcu_sched detected stalls")
            || text.contains("self-detected stall")
    }

    /// The last lines of the serial console, for error messages.
    pub fn tail(&self) -> String {
        let text = std::fs::read_to_string(&self.serial_log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(15);
        format!(
            "serial console ({}), last lines:\n{}",
            self.serial_log.display(),
            lines[from..].join("\n")
        )
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.cut();
    }
}

/// Runs a shell script in the guest and fails on a non-zero exit.
pub fn sh_ok(qga: &mut Qga, script: &str, timeout: Duration) -> Result<String> {
    let out: ExecOutput = qga.sh(script, timeout)?;
    if out.code != 0 {
        bail!(
            "in the guest: `{script}` exited {}: {}{}",
            out.code,
            out.stdout,
            out.stderr
        );
    }
    Ok(out.stdout)
}

//! A STAND-IN disk for the VM tests: a minimal NBD server (fixed newstyle handshake, simple
//! replies) on a Unix socket that qemu opens as the guest's virtio disk. It models a disk with
//! a volatile write cache that loses power:
//!
//! - writes land in a *volatile* layer and are visible to reads at once;
//! - `NBD_CMD_FLUSH` moves the volatile layer into the *durable* layer (a write with `FUA`
//!   goes to the durable layer directly, with the volatile sectors it covers);
//! - when the connection ends without `NBD_CMD_DISC` (qemu was SIGKILLed: the power cut) the
//!   volatile layer is dropped. So after a cut the disk holds exactly what the guest flushed.
//!
//! Both layers sit over the cached base image, opened read-only: the image is never written,
//! and a new node costs no copy of it ([`Snapshot::serve`]).
//! Why a stand-in and not one of qemu's cache modes: docs/testing-vm.md.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

const SECTOR: u64 = 512;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const TFLAG_HAS_FLAGS: u16 = 1;
const TFLAG_SEND_FLUSH: u16 = 4;
const TFLAG_SEND_FUA: u16 = 8;

const OPT_EXPORT_NAME: u32 = 1;
const OPT_ABORT: u32 = 2;
const OPT_INFO: u32 = 6;
const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERR_UNSUP: u32 = 0x8000_0001;
const INFO_EXPORT: u16 = 0;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_FLAG_FUA: u16 = 1;
const EINVAL: u32 = 22;
const EIO: u32 = 5;

/// Largest request accepted (qemu sends at most 32 MiB).
const MAX_REQUEST: u32 = 64 << 20;

type Sector = Box<[u8; SECTOR as usize]>;

/// Counters of what the guest did to the disk.
#[derive(Debug, Default, Clone, Copy)]
pub struct DiskStats {
    /// Connections (boots of qemu).
    pub connections: u64,
    /// `NBD_CMD_FLUSH` requests.
    pub flushes: u64,
    /// Write requests, and of them with FUA.
    pub writes: u64,
    pub fua_writes: u64,
    /// Sectors written and never flushed that a cut dropped.
    pub dropped_sectors: u64,
}

struct Layers {
    base: File,
    size: u64,
    durable: HashMap<u64, Sector>,
    volatile: HashMap<u64, Sector>,
    connected: bool,
    stats: DiskStats,
}

impl Layers {
    fn sector(&self, n: u64) -> io::Result<[u8; SECTOR as usize]> {
        if let Some(s) = self.volatile.get(&n).or_else(|| self.durable.get(&n)) {
            return Ok(**s);
        }
        let mut buf = [0u8; SECTOR as usize];
        self.base.read_exact_at(&mut buf, n * SECTOR)?;
        Ok(buf)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let mut done = 0usize;
        while done < out.len() {
            let pos = offset + done as u64;
            let (n, within) = (pos / SECTOR, (pos % SECTOR) as usize);
            let take = (SECTOR as usize - within).min(out.len() - done);
            let s = self.sector(n)?;
            out[done..done + take].copy_from_slice(&s[within..within + take]);
            done += take;
        }
        Ok(())
    }

    fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.stats.writes += 1;
        self.stats.fua_writes += u64::from(fua);
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset + done as u64;
            let (n, within) = (pos / SECTOR, (pos % SECTOR) as usize);
            let take = (SECTOR as usize - within).min(data.len() - done);
            let mut s = if within == 0 && take == SECTOR as usize {
                [0u8; SECTOR as usize]
            } else {
                self.sector(n)?
            };
            s[within..within + take].copy_from_slice(&data[done..done + take]);
            if fua {
                self.volatile.remove(&n);
                self.durable.insert(n, Box::new(s));
            } else {
                self.volatile.insert(n, Box::new(s));
            }
            done += take;
        }
        Ok(())
    }

    fn flush(&mut self) {
        self.stats.flushes += 1;
        let volatile = std::mem::take(&mut self.volatile);
        self.durable.extend(volatile);
    }
}

struct Shared {
    layers: Mutex<Layers>,
    changed: Condvar,
    stop: AtomicBool,
}

/// The durable content of a disk without a server: the prepared node every test starts from.
pub struct Snapshot {
    base: File,
    size: u64,
    durable: HashMap<u64, Sector>,
}

impl Snapshot {
    /// A new disk with this content, served on `socket`.
    pub fn serve(&self, socket: &Path) -> io::Result<Disk> {
        Disk::serve(
            Layers {
                base: self.base.try_clone()?,
                size: self.size,
                durable: self.durable.clone(),
                volatile: HashMap::new(),
                connected: false,
                stats: DiskStats::default(),
            },
            socket,
        )
    }
}

/// The stand-in disk and its server thread. Dropping it stops the server.
pub struct Disk {
    shared: Arc<Shared>,
    socket: PathBuf,
    accept: Option<JoinHandle<()>>,
}

impl Disk {
    /// A disk over the base image `base` (opened read-only), served on `socket`.
    pub fn new(base: &Path, socket: &Path) -> io::Result<Disk> {
        let file = File::open(base)?;
        let size = file.metadata()?.len();
        Disk::serve(
            Layers {
                base: file,
                size,
                durable: HashMap::new(),
                volatile: HashMap::new(),
                connected: false,
                stats: DiskStats::default(),
            },
            socket,
        )
    }

    fn serve(layers: Layers, socket: &Path) -> io::Result<Disk> {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket)?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            layers: Mutex::new(layers),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let accept = std::thread::spawn(move || {
            while !s.stop.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let conn = s.clone();
                        std::thread::spawn(move || connection(&conn, stream));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        Ok(Disk {
            shared,
            socket: socket.to_path_buf(),
            accept: Some(accept),
        })
    }

    /// What a powered-off node left on this disk, to serve again as new disks
    /// ([`Snapshot::serve`]). Only while nothing is connected.
    pub fn snapshot(&self) -> io::Result<Snapshot> {
        let l = self.lock();
        assert!(!l.connected, "snapshot of a disk in use");
        Ok(Snapshot {
            base: l.base.try_clone()?,
            size: l.size,
            durable: l.durable.clone(),
        })
    }

    /// The socket qemu connects to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// What the guest did so far.
    pub fn stats(&self) -> DiskStats {
        self.lock().stats
    }

    /// Waits until no qemu is connected (after a kill, the server sees the end of the
    /// connection and drops the unflushed writes); false on timeout.
    pub fn wait_disconnected(&self, timeout: Duration) -> bool {
        let l = self.lock();
        let (l, _) = self
            .shared
            .changed
            .wait_timeout_while(l, timeout, |l| l.connected)
            .unwrap_or_else(|e| e.into_inner());
        !l.connected
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Layers> {
        self.shared.layers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Serves one connection; at its end without `NBD_CMD_DISC`, the volatile layer is dropped.
fn connection(shared: &Shared, stream: UnixStream) {
    {
        let mut l = shared.layers.lock().unwrap_or_else(|e| e.into_inner());
        l.connected = true;
        l.stats.connections += 1;
    }
    let clean = match serve_connection(shared, &stream) {
        Ok(clean) => clean,
        Err(e) => {
            // The usual end of a cut: qemu died mid-request or between requests.
            if e.kind() != io::ErrorKind::UnexpectedEof && e.kind() != io::ErrorKind::BrokenPipe {
                eprintln!("nbd stand-in: connection ended: {e}");
            }
            false
        }
    };
    let mut l = shared.layers.lock().unwrap_or_else(|e| e.into_inner());
    if !clean {
        let dropped = l.volatile.len() as u64;
        l.stats.dropped_sectors += dropped;
        l.volatile.clear();
    }
    l.connected = false;
    shared.changed.notify_all();
}

fn read_u16(r: &mut impl Read) -> io::Result<u16> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b)?;
    Ok(u16::from_be_bytes(b))
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

fn option_reply(w: &mut impl Write, option: u32, kind: u32, data: &[u8]) -> io::Result<()> {
    w.write_all(&REPLY_MAGIC.to_be_bytes())?;
    w.write_all(&option.to_be_bytes())?;
    w.write_all(&kind.to_be_bytes())?;
    w.write_all(&(data.len() as u32).to_be_bytes())?;
    w.write_all(data)?;
    w.flush()
}

/// Handshake then transmission; Ok(true) when the client disconnected cleanly.
fn serve_connection(shared: &Shared, stream: &UnixStream) -> io::Result<bool> {
    let mut r = BufReader::new(stream.try_clone()?);
    let mut w = BufWriter::new(stream.try_clone()?);
    let size = shared.layers.lock().unwrap_or_else(|e| e.into_inner()).size;
    let tflags = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA;

    w.write_all(&NBDMAGIC.to_be_bytes())?;
    w.write_all(&IHAVEOPT.to_be_bytes())?;
    w.write_all(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes())?;
    w.flush()?;
    let client_flags = read_u32(&mut r)?;
    let no_zeroes = client_flags & u32::from(FLAG_NO_ZEROES) != 0;

    // Option haggling until the client picks the export.
    loop {
        if read_u64(&mut r)? != IHAVEOPT {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad option magic",
            ));
        }
        let option = read_u32(&mut r)?;
        let len = read_u32(&mut r)?;
        if len > 4096 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "option too long",
            ));
        }
        let mut data = vec![0u8; len as usize];
        r.read_exact(&mut data)?;
        match option {
            OPT_EXPORT_NAME => {
                w.write_all(&size.to_be_bytes())?;
                w.write_all(&tflags.to_be_bytes())?;
                if !no_zeroes {
                    w.write_all(&[0u8; 124])?;
                }
                w.flush()?;
                break;
            }
            OPT_INFO | OPT_GO => {
                let mut info = Vec::with_capacity(12);
                info.extend_from_slice(&INFO_EXPORT.to_be_bytes());
                info.extend_from_slice(&size.to_be_bytes());
                info.extend_from_slice(&tflags.to_be_bytes());
                option_reply(&mut w, option, REP_INFO, &info)?;
                option_reply(&mut w, option, REP_ACK, &[])?;
                if option == OPT_GO {
                    break;
                }
            }
            OPT_ABORT => {
                option_reply(&mut w, option, REP_ACK, &[])?;
                return Ok(true);
            }
            _ => option_reply(&mut w, option, REP_ERR_UNSUP, &[])?,
        }
    }

    // Transmission: one request at a time (qemu waits for nothing but the replies).
    loop {
        if read_u32(&mut r)? != REQUEST_MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "bad request magic",
            ));
        }
        let flags = read_u16(&mut r)?;
        let kind = read_u16(&mut r)?;
        let handle = read_u64(&mut r)?;
        let offset = read_u64(&mut r)?;
        let len = read_u32(&mut r)?;
        let in_range = offset
            .checked_add(u64::from(len))
            .is_some_and(|end| end <= size)
            && len <= MAX_REQUEST;
        let reply = |w: &mut BufWriter<UnixStream>, error: u32| -> io::Result<()> {
            w.write_all(&SIMPLE_REPLY_MAGIC.to_be_bytes())?;
            w.write_all(&error.to_be_bytes())?;
            w.write_all(&handle.to_be_bytes())
        };
        match kind {
            CMD_READ => {
                if !in_range {
                    reply(&mut w, EINVAL)?;
                } else {
                    let mut buf = vec![0u8; len as usize];
                    let res = shared
                        .layers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .read(offset, &mut buf);
                    match res {
                        Ok(()) => {
                            reply(&mut w, 0)?;
                            w.write_all(&buf)?;
                        }
                        Err(_) => reply(&mut w, EIO)?,
                    }
                }
            }
            CMD_WRITE => {
                if len > MAX_REQUEST {
                    return Err(io::Error::new(io::ErrorKind::InvalidData, "write too long"));
                }
                let mut buf = vec![0u8; len as usize];
                r.read_exact(&mut buf)?;
                if !in_range {
                    reply(&mut w, EINVAL)?;
                } else {
                    let res = shared
                        .layers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .write(offset, &buf, flags & CMD_FLAG_FUA != 0);
                    reply(&mut w, if res.is_ok() { 0 } else { EIO })?;
                }
            }
            CMD_FLUSH => {
                shared
                    .layers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .flush();
                reply(&mut w, 0)?;
            }
            CMD_DISC => {
                // A clean close (qemu quitting) flushes first; what is still volatile is
                // kept as a disk would keep it with its power on.
                shared
                    .layers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .flush();
                return Ok(true);
            }
            _ => reply(&mut w, EINVAL)?,
        }
        w.flush()?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers(size: u64) -> Layers {
        let f = tempfile::tempfile().unwrap();
        f.set_len(size).unwrap();
        Layers {
            base: f,
            size,
            durable: HashMap::new(),
            volatile: HashMap::new(),
            connected: false,
            stats: DiskStats::default(),
        }
    }

    #[test]
    fn unflushed_writes_are_read_back_and_flush_makes_them_durable() {
        let mut l = layers(8192);
        l.write(100, b"hello", false).unwrap();
        let mut buf = [0u8; 5];
        l.read(100, &mut buf).unwrap();
        assert_eq!(&buf, b"hello");
        assert!(l.durable.is_empty());
        l.flush();
        assert!(l.volatile.is_empty());
        // A write spanning a sector boundary keeps the bytes around it.
        l.write(510, b"abcd", true).unwrap();
        let mut buf = [0u8; 8];
        l.read(508, &mut buf).unwrap();
        assert_eq!(&buf, b"\0\0abcd\0\0");
        assert!(l.volatile.is_empty());
    }
}

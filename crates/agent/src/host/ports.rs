//! Which process holds a TCP port, for the message of a listener that cannot bind: the
//! listening sockets of `/proc/net/tcp` and `/proc/net/tcp6` on that port, then the processes
//! whose `/proc/<pid>/fd` hold one of them. This is the agent's own `/proc` (its network
//! namespace, the processes it may see), not the managed root's. The scan is bounded and
//! every read may fail (a process that ends meanwhile, one it may not look into): a holder
//! that cannot be found is said to be unknown, never guessed.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

/// Most `/proc/<pid>/fd` entries looked at.
const MAX_FDS: usize = 200_000;

/// Most time spent looking.
const MAX_TIME: Duration = Duration::from_secs(2);

/// A process that holds a socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// Its process id.
    pub pid: u32,
    /// Its name (`/proc/<pid>/comm`).
    pub comm: String,
}

/// What is known of who holds a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortHolders {
    /// These processes hold a listening socket on it.
    Found(Vec<Holder>),
    /// A socket listens on it, but no process that holds it could be seen (another user's
    /// without the right to look, or the scan's bound was reached).
    Hidden,
    /// No socket on it shows in this network namespace's tables.
    NoSocket,
}

/// Who holds `addr`'s port (a listener on the same address, or on the unspecified one).
pub fn holders(addr: SocketAddr) -> PortHolders {
    holders_in(Path::new("/proc"), addr)
}

/// Who holds `addr`'s port, in words for a message: "held by pid 4242 (nginx)", or why
/// that cannot be told (and how to find out).
pub fn held_by(addr: SocketAddr) -> String {
    match holders(addr) {
        PortHolders::Found(found) => {
            let me = std::process::id();
            let each: Vec<String> = found
                .iter()
                .map(|h| {
                    if h.pid == me {
                        format!("this agent itself (pid {}, {})", h.pid, h.comm)
                    } else {
                        format!("pid {} ({})", h.pid, h.comm)
                    }
                })
                .collect();
            format!("held by {}", each.join(", "))
        }
        PortHolders::Hidden => format!(
            "held by a process this agent cannot see (another user's, or one the search did \
             not reach): `ss -ltnp 'sport = :{}'` as root names it",
            addr.port()
        ),
        PortHolders::NoSocket => format!(
            "no listening socket on port {} shows in /proc/net/tcp or /proc/net/tcp6, so the \
             holder could not be found: `ss -tanp 'sport = :{}'` as root names it",
            addr.port(),
            addr.port()
        ),
    }
}

fn holders_in(proc: &Path, addr: SocketAddr) -> PortHolders {
    let mut inodes = BTreeSet::new();
    for table in ["net/tcp", "net/tcp6"] {
        if let Ok(text) = std::fs::read_to_string(proc.join(table)) {
            inodes.extend(listening_inodes(&text, addr));
        }
    }
    if inodes.is_empty() {
        return PortHolders::NoSocket;
    }
    let found = processes_holding(proc, &inodes);
    if found.is_empty() {
        PortHolders::Hidden
    } else {
        PortHolders::Found(found)
    }
}

/// The inodes of the sockets of a `/proc/net/tcp{,6}` table that listen on `addr`'s port on
/// an address that overlaps it (the same, or either unspecified).
fn listening_inodes(table: &str, addr: SocketAddr) -> Vec<u64> {
    const LISTEN: &str = "0A";
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
            if *state != LISTEN {
                return None;
            }
            let (ip, port) = local.split_once(':')?;
            let port = u16::from_str_radix(port, 16).ok()?;
            let ip = parse_ip(ip)?;
            let overlaps = ip.is_unspecified()
                || addr.ip().is_unspecified()
                || ip == addr.ip()
                || ip.to_canonical() == addr.ip().to_canonical();
            (port == addr.port() && overlaps)
                .then(|| inode.parse().ok())
                .flatten()
        })
        .collect()
}

/// An address as the kernel prints it: the address's bytes as 32-bit words in the machine's
/// byte order, each in hex.
fn parse_ip(hex: &str) -> Option<IpAddr> {
    let word = |i: usize| -> Option<[u8; 4]> {
        let w = u32::from_str_radix(hex.get(i * 8..i * 8 + 8)?, 16).ok()?;
        Some(w.to_ne_bytes())
    };
    match hex.len() {
        8 => Some(IpAddr::V4(Ipv4Addr::from(word(0)?))),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            Some(IpAddr::V6(Ipv6Addr::from(bytes)))
        }
        _ => None,
    }
}

/// The processes with an open file descriptor on one of `inodes`' sockets, looked for within
/// the scan's bounds.
fn processes_holding(proc: &Path, inodes: &BTreeSet<u64>) -> Vec<Holder> {
    let started = Instant::now();
    let mut looked = 0usize;
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(proc) else {
        return found;
    };
    'pids: for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // Processes come and go while we look: every read may fail, and is skipped.
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            looked += 1;
            if looked > MAX_FDS || started.elapsed() > MAX_TIME {
                break 'pids;
            }
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let holds = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok())
                .is_some_and(|inode| inodes.contains(&inode));
            if holds {
                let comm = std::fs::read_to_string(entry.path().join("comm"))
                    .map(|c| c.trim_end().to_owned())
                    .unwrap_or_else(|_| "?".to_owned());
                found.push(Holder { pid, comm });
                continue 'pids;
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_tables_are_read() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   \
                  0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0 100 0 0 10 0\n   \
                  1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0 100 0 0 10 0\n   \
                  2: 00000000:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0 100 0 0 10 0\n";
        if cfg!(target_endian = "little") {
            let at = |s: &str| s.parse::<SocketAddr>().unwrap();
            assert_eq!(listening_inodes(v4, at("127.0.0.1:8080")), [4242]);
            assert_eq!(listening_inodes(v4, at("0.0.0.0:8080")), [4242]);
            assert_eq!(listening_inodes(v4, at("10.0.0.1:8080")), Vec::<u64>::new());
            assert_eq!(listening_inodes(v4, at("10.0.0.1:8081")), [4444]);
            assert_eq!(
                parse_ip("00000000000000000000000001000000"),
                Some("::1".parse().unwrap())
            );
        }
        assert_eq!(
            listening_inodes("header only\n", "127.0.0.1:1".parse().unwrap()),
            Vec::<u64>::new()
        );
        assert_eq!(parse_ip("xyz"), None);
    }

    #[test]
    fn this_process_is_found_holding_its_listener() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        match holders(addr) {
            PortHolders::Found(h) => {
                assert!(h.iter().any(|h| h.pid == std::process::id()), "{h:?}")
            }
            other => panic!("{other:?}"),
        }
        drop(listener);
        assert_eq!(holders(addr), PortHolders::NoSocket);
    }
}

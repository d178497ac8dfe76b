//! The daemon's side of the systemd notification protocol (`sd_notify(3)`), without
//! libsystemd: datagrams such as `READY=1`, `STATUS=...`, `WATCHDOG=1` and `STOPPING=1` sent
//! to the socket named by `$NOTIFY_SOCKET` (a path, or an abstract name starting with `@`).
//! Outside systemd (`Type=notify` not set, or a test) there is no socket and every call is a
//! no-op.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// A connection to the service manager's notification socket.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
}

impl Notifier {
    /// The notifier systemd asked for through `$NOTIFY_SOCKET`, if any.
    pub fn from_env() -> Option<Notifier> {
        let name = std::env::var_os("NOTIFY_SOCKET")?;
        let name = name.to_str()?;
        let addr = match name.strip_prefix('@') {
            Some(abstract_name) => SocketAddr::from_abstract_name(abstract_name.as_bytes()).ok()?,
            None => SocketAddr::from_pathname(name).ok()?,
        };
        Notifier::connect(addr).ok()
    }

    /// A notifier sending to the datagram socket at `path` (tests).
    #[cfg(test)]
    pub fn to_path(path: &std::path::Path) -> io::Result<Notifier> {
        Notifier::connect(SocketAddr::from_pathname(path)?)
    }

    fn connect(addr: SocketAddr) -> io::Result<Notifier> {
        Ok(Notifier {
            socket: UnixDatagram::unbound()?,
            addr,
        })
    }

    /// Sends one notification (newline-separated `KEY=value` assignments).
    pub fn send(&self, message: &str) -> io::Result<()> {
        self.socket
            .send_to_addr(message.as_bytes(), &self.addr)
            .map(|_| ())
    }

    /// `READY=1` with a status line: the daemon serves.
    pub fn ready(&self, status: &str) -> io::Result<()> {
        self.send(&format!("READY=1\nSTATUS={}", one_line(status)))
    }

    /// `STATUS=...`: shown by `systemctl status`.
    pub fn status(&self, status: &str) -> io::Result<()> {
        self.send(&format!("STATUS={}", one_line(status)))
    }

    /// `WATCHDOG=1`: the daemon is alive.
    pub fn watchdog(&self) -> io::Result<()> {
        self.send("WATCHDOG=1")
    }

    /// `STOPPING=1` with a status line.
    pub fn stopping(&self, status: &str) -> io::Result<()> {
        self.send(&format!("STOPPING=1\nSTATUS={}", one_line(status)))
    }
}

/// How often systemd wants a watchdog ping (`$WATCHDOG_USEC`, for this process when
/// `$WATCHDOG_PID` is set): half the timeout, as sd_watchdog_enabled(3) advises.
pub fn watchdog_interval() -> Option<Duration> {
    if let Some(pid) = std::env::var_os("WATCHDOG_PID")
        && pid.to_str().and_then(|p| p.parse::<u32>().ok()) != Some(std::process::id())
    {
        return None;
    }
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// A status line: one line, at most 200 characters.
fn one_line(s: &str) -> String {
    let line: String = s
        .chars()
        .map(|c| if c == '\n' || c == '\r' { ' ' } else { c })
        .collect();
    if line.chars().count() > 200 {
        let mut cut: String = line.chars().take(199).collect();
        cut.push('…');
        cut
    } else {
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_arrive_as_datagrams() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let listener = UnixDatagram::bind(&path).unwrap();
        let n = Notifier::to_path(&path).unwrap();
        n.ready("serving on 127.0.0.1:9443\nsecond line").unwrap();
        n.watchdog().unwrap();
        n.status(&"x".repeat(300)).unwrap();
        let mut buf = [0u8; 512];
        let got = |buf: &mut [u8]| {
            let n = listener.recv(buf).unwrap();
            String::from_utf8_lossy(&buf[..n]).into_owned()
        };
        assert_eq!(
            got(&mut buf),
            "READY=1\nSTATUS=serving on 127.0.0.1:9443 second line"
        );
        assert_eq!(got(&mut buf), "WATCHDOG=1");
        let status = got(&mut buf);
        assert_eq!(status.chars().count(), "STATUS=".len() + 200);
        assert!(status.ends_with('…'));
    }
}

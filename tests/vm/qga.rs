//! A small client of the QEMU guest agent (qemu-ga in the guest, reached through qemu's
//! virtio-serial port on a Unix socket): `guest-sync-delimited` to find the start of a
//! conversation, `guest-exec` / `guest-exec-status` to run commands.
//!
//! The port is a byte stream that outlives guest boots: a request written while the guest
//! agent is down waits in the port and reaches the next one, and a reply may arrive after we
//! stopped waiting for it. So every call begins with a sync: a 0xFF byte (which resets the
//! guest agent's JSON parser) and `guest-sync-delimited` with a fresh id, and everything read
//! before the sentinel 0xFF and the reply carrying that id is discarded.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use serde_json::{Value, json};

/// A connection to the guest agent.
pub struct Qga {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    next_id: u64,
}

/// What a command run in the guest did.
#[derive(Debug, Clone)]
pub struct ExecOutput {
    /// Exit code (128 + signal when killed by one).
    pub code: i64,
    pub stdout: String,
    pub stderr: String,
}

impl Qga {
    /// Connects to qemu's end of the port.
    pub fn connect(socket: &Path) -> std::io::Result<Qga> {
        let stream = UnixStream::connect(socket)?;
        Ok(Qga {
            writer: stream.try_clone()?,
            reader: BufReader::new(stream),
            // Ids unlike any an earlier client of the port used.
            next_id: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_micros() as u64)
                .unwrap_or(1),
        })
    }

    /// Synchronises with the guest agent; fails when it does not answer within `timeout`.
    pub fn sync(&mut self, timeout: Duration) -> Result<()> {
        self.next_id += 1;
        let id = self.next_id;
        let mut req = vec![0xffu8];
        req.extend_from_slice(
            json!({"execute": "guest-sync-delimited", "arguments": {"id": id}})
                .to_string()
                .as_bytes(),
        );
        req.push(b'\n');
        self.writer
            .write_all(&req)
            .context("write to the guest agent")?;
        let deadline = Instant::now() + timeout;
        loop {
            // Skip to the sentinel, then read the reply line.
            let mut byte = [0u8; 1];
            loop {
                self.set_deadline(deadline)?;
                match self.reader.read(&mut byte) {
                    Ok(0) => bail!("the guest agent's port closed"),
                    Ok(_) if byte[0] == 0xff => break,
                    Ok(_) => {}
                    Err(e) => return Err(e).context("no answer from the guest agent"),
                }
            }
            let line = self.read_line(deadline)?;
            if let Ok(v) = serde_json::from_str::<Value>(&line)
                && v.get("return").and_then(Value::as_u64) == Some(id)
            {
                return Ok(());
            }
        }
    }

    fn set_deadline(&mut self, deadline: Instant) -> Result<()> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            bail!("timed out waiting for the guest agent");
        }
        self.reader.get_ref().set_read_timeout(Some(left))?;
        Ok(())
    }

    fn read_line(&mut self, deadline: Instant) -> Result<String> {
        let mut line = Vec::new();
        loop {
            self.set_deadline(deadline)?;
            let n = self
                .reader
                .read_until(b'\n', &mut line)
                .context("read from the guest agent")?;
            if n == 0 {
                bail!("the guest agent's port closed");
            }
            if line.ends_with(b"\n") {
                return Ok(String::from_utf8_lossy(&line).into_owned());
            }
        }
    }

    /// One command: its `return` value, or its error as an error.
    pub fn call(&mut self, execute: &str, arguments: Value, timeout: Duration) -> Result<Value> {
        self.sync(timeout.min(Duration::from_secs(30)))?;
        let mut req = json!({"execute": execute, "arguments": arguments}).to_string();
        req.push('\n');
        self.writer.write_all(req.as_bytes())?;
        let deadline = Instant::now() + timeout;
        let line = self.read_line(deadline)?;
        let v: Value = serde_json::from_str(line.trim_start_matches('\u{ff}'))
            .with_context(|| format!("guest agent reply to {execute}: {line}"))?;
        if let Some(e) = v.get("error") {
            bail!("guest agent: {execute}: {e}");
        }
        Ok(v.get("return").cloned().unwrap_or(Value::Null))
    }

    /// Starts `argv` in the guest with its output captured; returns its guest pid.
    pub fn spawn(&mut self, argv: &[&str]) -> Result<i64> {
        let ret = self.call(
            "guest-exec",
            json!({"path": argv[0], "arg": &argv[1..], "capture-output": true}),
            Duration::from_secs(30),
        )?;
        ret.get("pid")
            .and_then(Value::as_i64)
            .context("guest-exec returned no pid")
    }

    /// The result of a command started by [`Qga::spawn`], once it exited.
    pub fn wait(&mut self, pid: i64, timeout: Duration) -> Result<ExecOutput> {
        let deadline = Instant::now() + timeout;
        loop {
            let st = self.call(
                "guest-exec-status",
                json!({"pid": pid}),
                Duration::from_secs(30),
            )?;
            if st.get("exited").and_then(Value::as_bool) == Some(true) {
                let text = |key: &str| -> String {
                    st.get(key)
                        .and_then(Value::as_str)
                        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .unwrap_or_default()
                };
                let code = match (st.get("exitcode"), st.get("signal")) {
                    (Some(c), _) if c.is_i64() => c.as_i64().unwrap_or(-1),
                    (_, Some(s)) => 128 + s.as_i64().unwrap_or(0),
                    _ => -1,
                };
                return Ok(ExecOutput {
                    code,
                    stdout: text("out-data"),
                    stderr: text("err-data"),
                });
            }
            if Instant::now() > deadline {
                bail!(
                    "guest pid {pid} still running after {} s",
                    timeout.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Runs `argv` in the guest and waits for it.
    pub fn exec(&mut self, argv: &[&str], timeout: Duration) -> Result<ExecOutput> {
        let pid = self.spawn(argv)?;
        self.wait(pid, timeout)
            .with_context(|| format!("in the guest: {}", argv.join(" ")))
    }

    /// Runs a shell script in the guest and waits for it.
    pub fn sh(&mut self, script: &str, timeout: Duration) -> Result<ExecOutput> {
        self.exec(&["/bin/sh", "-c", script], timeout)
    }
}

//! The real `inplace-agent serve` on a sandbox node tree, over mutual TLS on 127.0.0.1 with
//! the node's PKI, as the node API tests run it: a debug log (kept), service management off
//! (a plain tree has no systemd: restarts are journaled as skipped), node commands without
//! chroot. Killed when dropped.

use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use inplace_agent::status::client;
use inplace_api::pki::DEFAULT_READER_IDENTITY;

use super::daemon::{Daemon, Ready, serve_command};
use super::node::{Node, bin};
use super::pki::NodePki;

/// A running `inplace-agent serve`; derefs to its [`Daemon`] (`addr`, `child`, `log()`,
/// `kill9()`, `terminate()`).
pub struct Agent {
    daemon: Daemon,
    /// Its status socket (empty for [`Agent::start_with_config`]: the file says where).
    pub socket: PathBuf,
}

impl Agent {
    /// Starts serve on the node with the PKI, the updater as admin, the reader as reader, and
    /// `extra` flags.
    pub fn start(node: &Node, pki: &NodePki, extra: &[&str]) -> Agent {
        Agent::start_with_stderr(node, pki, extra, &[], None)
    }

    /// [`Agent::start`] with extra environment.
    pub fn start_env(node: &Node, pki: &NodePki, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        Agent::start_with_stderr(node, pki, extra, env, None)
    }

    /// [`Agent::start_env`]; with `stderr_file` its stderr goes there (and the address is
    /// read from the file) instead of a pipe.
    pub fn start_with_stderr(
        node: &Node,
        pki: &NodePki,
        extra: &[&str],
        env: &[(&str, &str)],
        stderr_file: Option<&Path>,
    ) -> Agent {
        let f = &pki.files;
        let mut cmd = serve_command(
            Path::new(bin()),
            node.root(),
            &pki.node,
            &f.server_cert,
            &f.server_key,
            &f.ca_cert,
        );
        cmd.args(["--listen", "127.0.0.1:0", "--no-chroot"])
            .args(["--reader", DEFAULT_READER_IDENTITY])
            .args(extra);
        let ready = match stderr_file {
            Some(path) => Ready::LogFile(path.to_path_buf()),
            None => Ready::Log,
        };
        Agent::spawn(cmd, env, ready, node.path("/run/inplace-agent/status.sock"))
    }

    /// Starts serve with a configuration file and nothing else.
    pub fn start_with_config(config: &Path) -> Agent {
        let mut cmd = Command::new(bin());
        cmd.arg("serve").arg("--config").arg(config);
        for var in [
            "INPLACE_AGENT_ROOT",
            "INPLACE_AGENT_STATE_DIR",
            "INPLACE_AGENT_CONFIG",
        ] {
            cmd.env_remove(var);
        }
        Agent::spawn(cmd, &[], Ready::Log, PathBuf::new())
    }

    fn spawn(mut cmd: Command, env: &[(&str, &str)], ready: Ready, socket: PathBuf) -> Agent {
        cmd.env("INPLACE_AGENT_LOG", "debug")
            .env("INPLACE_AGENT_SERVICES", "off");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let daemon = Daemon::start(cmd, ready).unwrap_or_else(|e| panic!("serve: {e}"));
        Agent { daemon, socket }
    }

    /// `GET target` on the status socket: the HTTP status and the JSON body.
    pub fn get(&self, target: &str) -> (u16, Value) {
        let r = client::get(&self.socket, target, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("GET {target}: {e}"));
        let v = serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("GET {target}: {e}: {}", String::from_utf8_lossy(&r.body)));
        (r.status, v)
    }
}

impl Deref for Agent {
    type Target = Daemon;
    fn deref(&self) -> &Daemon {
        &self.daemon
    }
}

impl DerefMut for Agent {
    fn deref_mut(&mut self) -> &mut Daemon {
        &mut self.daemon
    }
}

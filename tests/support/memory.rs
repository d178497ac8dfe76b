//! A process's memory as the kernel reports it (`/proc/PID/status`, `/proc/PID/smaps_rollup`).

/// Memory of one process, in KiB (0 where the kernel did not say, or the process is gone).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// VmRSS: resident now.
    pub rss: u64,
    /// VmHWM: the peak of VmRSS.
    pub hwm: u64,
    /// RssAnon: resident anonymous memory (heap, stacks).
    pub anon: u64,
    /// RssFile: resident file-backed pages (the binary, libc).
    pub file: u64,
    /// Pss: resident, with pages shared with other processes split among them.
    pub pss: u64,
    /// Threads (a count, not KiB).
    pub threads: u64,
}

impl Memory {
    /// The memory of process `pid`.
    pub fn of(pid: u32) -> Memory {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let rollup =
            std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
        let field = |text: &str, name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Memory {
            rss: field(&status, "VmRSS:"),
            hwm: field(&status, "VmHWM:"),
            anon: field(&status, "RssAnon:"),
            file: field(&status, "RssFile:"),
            pss: field(&rollup, "Pss:"),
            threads: field(&status, "Threads:"),
        }
    }

    /// The memory of this process.
    pub fn of_self() -> Memory {
        Memory::of(std::process::id())
    }
}

//! Process-abort injection for crash tests (cargo feature `failpoints`).
//!
//! Code calls [`hit`] before and after every mutation and every journal record. With the
//! feature on and `INPLACE_AGENT_CRASH_AT=N` in the environment, the N-th hit of the process
//! calls `abort()` — no destructors, no flushing, like a power cut for everything not yet
//! fsynced. `INPLACE_AGENT_CRASH_AT=name` aborts at the first hit of that point, and
//! `name@K` at its K-th. Without the feature, `hit` compiles to nothing.

#[cfg(feature = "failpoints")]
mod imp {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    enum Target {
        Nth(u64),
        Named(String, u64),
    }

    static TARGET: OnceLock<Option<Target>> = OnceLock::new();
    static HITS: AtomicU64 = AtomicU64::new(0);
    static NAMED_HITS: AtomicU64 = AtomicU64::new(0);

    fn target() -> &'static Option<Target> {
        TARGET.get_or_init(|| {
            let spec = std::env::var("INPLACE_AGENT_CRASH_AT").ok()?;
            if let Ok(n) = spec.parse::<u64>() {
                return Some(Target::Nth(n));
            }
            match spec.split_once('@') {
                Some((name, k)) => Some(Target::Named(name.to_string(), k.parse().ok()?)),
                None => Some(Target::Named(spec, 1)),
            }
        })
    }

    pub fn hit(name: &str) {
        let Some(target) = target() else { return };
        let n = HITS.fetch_add(1, Ordering::SeqCst) + 1;
        let fire = match target {
            Target::Nth(at) => n == *at,
            Target::Named(want, k) => {
                want == name && NAMED_HITS.fetch_add(1, Ordering::SeqCst) + 1 == *k
            }
        };
        if fire {
            eprintln!("failpoint: aborting at {name} (hit {n})");
            std::process::abort();
        }
    }
}

/// Marks a crash point; aborts the process when the crash test asks for it.
#[inline(always)]
pub fn hit(_name: &str) {
    #[cfg(feature = "failpoints")]
    imp::hit(_name);
}

//! The local status socket: what the agent is doing, for people on the node and for scripts,
//! without certificates. HTTP/1.1 with JSON over a Unix socket (`/run/inplace-agent/status.sock`,
//! mode 0660, group `inplace-agent`), plus Prometheus metrics.
//!
//! - `api.rs`: the versioned documents (`AgentStatus`, `PlanStatus`, `JournalRecords`), built
//!   from the engine's table under its lock without copying per-change lists, or from a
//!   journal read directly when no agent runs; their JSON Schema is `docs/status-api.schema.json`.
//! - `server.rs`: the socket (permissions, group, peer credentials), the optional TCP metrics
//!   listener, routing, and the bounds on requests.
//! - `metrics.rs`: the Prometheus registry: counters the engine feeds as it journals
//!   ([`crate::engine::RecordObserver`]) and values read at scrape time.
//! - `client.rs`: the small HTTP/1.1 client `inplace-agent status` uses.
//!
//! **Invariant:** nothing here changes the node or the journal; every read of the engine is
//! a short critical section on the blocking pool, never on the runtime that serves gRPC.

pub(crate) mod api;
pub mod client;
pub(crate) mod metrics;
pub(crate) mod server;

pub use api::{AgentStatus, JournalRecords, PlanStatusDocument};

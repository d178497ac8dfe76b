//! What the updater remembers between `UpdateMachine` calls, so that a call for a plan in
//! flight is answered from memory instead of with round trips to the cluster and the agent.
//!
//! One entry per Machine: the fingerprint of the request that was last checked against the
//! live objects (sha256 of its body), the plan it translated to (id, digest, agent target,
//! node), and what the agent last said about that plan (phase and hook response). While the
//! plan is in flight a follower task holds the agent's `WatchPlan` stream open and writes
//! every snapshot into the entry; the stream ends at the terminal snapshot, and a broken
//! stream (agent restart, node reboot) is opened again with backoff.
//!
//! Rules that keep a remembered answer correct (docs/updater.md, "UpdateMachine"):
//! - an answer is only given for a request whose body is byte for byte the one checked
//!   against the live Machine and KubeadmConfig, and only for the plan (id *and* digest)
//!   that request translated to: another desired state is another fingerprint, a miss;
//! - an in-flight status is used only while the stream that delivers it is open and spoke
//!   within [`SILENT`], or for [`GRACE`] after the agent answered a call; otherwise the
//!   call asks the agent itself;
//! - a terminal status (a failed gate answers `Failure`) is used until the entry is
//!   [`TTL`] old, then the request is checked again against the cluster and the agent in
//!   the background while the remembered answer is given (an answer is at most `TTL` plus
//!   one check behind the live objects; the check's outcome replaces or drops the entry);
//! - entries not read for [`IDLE`] are dropped with their follower.
//!
//! Nothing here is durable: a restarted updater (or another replica) starts empty and
//! answers its first call per Machine the slow way, exactly as before.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::agent::Agents;
use super::edge::agent_ca::Peer;
use inplace_api::pb;

/// How long an entry's check against the live objects is trusted before it is repeated.
pub const TTL: Duration = Duration::from_secs(30);

/// How long after the agent answered a call its in-flight status is used without a stream.
pub const GRACE: Duration = Duration::from_secs(2);

/// How long an open stream may stay silent before its in-flight status is not used.
pub const SILENT: Duration = Duration::from_secs(30);

/// Entries not read for this long are dropped (the Machine is gone or done).
pub const IDLE: Duration = Duration::from_secs(600);

/// How many calls may wait for their plan's end at once (each holds one of Cluster API's
/// Machine reconcile workers, 10 by default: `--machine-concurrency` in Cluster API's
/// `main.go`); beyond, a call that would hold answers in progress with a retry of 1 s.
pub const MAX_HOLDS: usize = 4;

/// Backoff between attempts to open a plan's stream again.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The fingerprint of a request (sha256 of its body).
pub type Fingerprint = [u8; 32];

/// The plan a checked request translated to, and where its agent is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanRef {
    /// Plan id.
    pub id: String,
    /// The plan's digest (`v2:sha256:...`).
    pub digest: String,
    /// The plan's digest by the first definition (`sha256:...`), which agents before
    /// digests v2 report for it.
    pub digest_v1: String,
    /// The node's agent: where it is, its node name and how it is verified.
    pub peer: Peer,
    /// The expected time of each change, for pacing CAPI's calls ([`super::pace::costs`]).
    pub costs: Vec<u32>,
    /// The Machine's workload cluster (`<namespace>/<spec.clusterName>`), for the fleet
    /// metrics.
    pub cluster: String,
    /// How long a call may wait for the plan's end (the effective `updateWaitSeconds`):
    /// [`super::pace::Next::Hold`].
    pub hold: Duration,
}

impl PlanRef {
    /// Whether `digest`, as an agent reports it (of either definition), is this plan's.
    pub fn has_digest(&self, digest: &str) -> bool {
        digest == self.digest || digest == self.digest_v1
    }
}

/// What the agent last said about a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Heard {
    /// The attempt (a retry on the agent starts a new one).
    pub attempt: u32,
    /// `pb::Phase` as sent.
    pub phase: i32,
    /// The hook response the agent computed for that status.
    pub hook: pb::HookResponse,
    /// The step in progress and how many there are, when the agent said.
    pub step: Option<(u32, u32)>,
    /// The node is rebooting for the plan.
    pub rebooting: bool,
}

impl Heard {
    /// The parts of a status an answer needs.
    pub fn of(status: &pb::PlanStatus) -> Heard {
        Heard {
            attempt: status.attempt,
            phase: status.phase,
            hook: status.hook_response.clone().unwrap_or_default(),
            step: status
                .step
                .as_ref()
                .filter(|s| s.total > 0)
                .map(|s| (s.index, s.total)),
            rebooting: status.rebooting,
        }
    }

    /// Where the plan is, for pacing.
    pub fn position(&self) -> super::pace::Position {
        super::pace::Position {
            phase: self.phase,
            step: self.step,
            rebooting: self.rebooting,
        }
    }
}

/// Whether a phase ends the plan's attempt.
pub fn terminal(phase: i32) -> bool {
    use pb::Phase;
    [
        Phase::Succeeded,
        Phase::Failed,
        Phase::RolledBack,
        Phase::Superseded,
        Phase::Cancelled,
    ]
    .iter()
    .any(|p| *p as i32 == phase)
}

struct Entry {
    fingerprint: Fingerprint,
    plan: PlanRef,
    heard: Heard,
    /// When the agent last confirmed `heard` (a call's answer or a stream snapshot).
    heard_at: Instant,
    /// When the request was last checked against the live objects.
    verified_at: Instant,
    read_at: Instant,
    /// The stream of the follower is open.
    streaming: bool,
    /// Generation of this entry's plan: a follower of another generation stops.
    generation: u64,
    /// A follower of `generation` runs (or is being started).
    following: bool,
    follower: Option<tokio::task::AbortHandle>,
    refreshing: bool,
    submit: Submit,
    /// When this replica first took up the plan (its submission, or the first call that
    /// found it on the agent): the start of its duration in the fleet metrics.
    began: Instant,
    /// What the updater saw of the plan's pace ([`super::pace::Seen`]).
    tracked: Tracked,
}

/// Where an entry's plan is and since when, and how long its finished changes took.
#[derive(Debug, Clone, Copy)]
struct Tracked {
    /// (attempt, phase, step, rebooting) as last seen.
    at: (u32, i32, u32, bool),
    /// When the plan was first seen there.
    since: Instant,
    spent_ms: u64,
    expected_ms: u64,
}

impl Tracked {
    fn new(now: Instant) -> Tracked {
        Tracked {
            at: (0, pb::Phase::Unspecified as i32, 0, false),
            since: now,
            spent_ms: 0,
            expected_ms: 0,
        }
    }

    /// A status of the plan arrived at `now`: a new position restarts the clock, and the
    /// finished changes' times are summed against their estimates (`costs`).
    fn observe(&mut self, status: &pb::PlanStatus, costs: &[u32], now: Instant) {
        let at = (
            status.attempt,
            status.phase,
            status.step.as_ref().map_or(0, |s| s.index),
            status.rebooting,
        );
        if at != self.at {
            self.at = at;
            self.since = now;
        }
        let (mut spent, mut expected) = (0u64, 0u64);
        for c in &status.changes {
            let finished = [pb::ChangeState::Changed, pb::ChangeState::Unchanged]
                .iter()
                .any(|s| *s as i32 == c.state);
            let (Some(d), Some(cost)) = (c.duration.as_ref(), costs.get(c.index as usize)) else {
                continue;
            };
            if !finished || d.seconds < 0 || d.nanos < 0 {
                continue;
            }
            spent += d.seconds as u64 * 1000 + d.nanos as u64 / 1_000_000;
            expected += u64::from(*cost);
        }
        self.spent_ms = spent;
        self.expected_ms = expected;
    }

    fn seen(&self, now: Instant) -> super::pace::Seen {
        super::pace::Seen {
            spent_ms: self.spent_ms,
            expected_ms: self.expected_ms,
            here: now.duration_since(self.since),
        }
    }
}

/// Where the submission of an entry's plan is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Submit {
    /// The agent answered for the plan (`heard` is its word).
    Answered,
    /// Being submitted in the background (`heard` says so).
    Running,
    /// The submission failed: calls take the slow way, synchronously, until one succeeds.
    Failed,
}

impl Entry {
    fn fresh(&self, now: Instant) -> bool {
        match self.submit {
            Submit::Running => return now.duration_since(self.heard_at) < SILENT,
            Submit::Failed => return false,
            Submit::Answered => {}
        }
        terminal(self.heard.phase)
            || (self.streaming && now.duration_since(self.heard_at) < SILENT)
            || now.duration_since(self.heard_at) < GRACE
    }
}

/// A remembered answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Remembered {
    /// What the agent said.
    pub heard: Heard,
    /// The plan.
    pub plan: PlanRef,
    /// The request is due to be checked again (the caller starts that, in the background).
    pub refresh: bool,
    /// The plan is in flight and the agent's word is older than [`GRACE`]: the stream
    /// sends a snapshot when the phase or step moves, not when only the message does (a
    /// gate's attempts are status notes, not events), so the caller asks the agent
    /// (`GetPlanStatus`, no cluster reads) before answering ([`Plans::heard_by_call`]).
    pub word_stale: bool,
    /// What the updater saw of the plan's pace, for the answer's `retryAfterSeconds`.
    pub seen: super::pace::Seen,
}

/// The remembered plans, by Machine (`namespace/name`).
#[derive(Default)]
pub struct Plans {
    entries: Mutex<HashMap<String, Entry>>,
    /// Fingerprint → Machine, for answering before the body is even parsed; checked
    /// against the entry on every use (a stale line is harmless), pruned by the sweep.
    by_fingerprint: Mutex<HashMap<Fingerprint, String>>,
    generation: std::sync::atomic::AtomicU64,
    swept: Mutex<Option<Instant>>,
    /// Told whenever what the agent said of a plan changes ([`Plans::settled`] waits on it).
    changed: tokio::sync::Notify,
    /// Told when a plan this replica took up reaches a terminal phase (the metrics).
    on_end: std::sync::OnceLock<OnEnd>,
    /// Calls waiting for their plan's end now ([`MAX_HOLDS`]).
    holding: std::sync::atomic::AtomicUsize,
}

/// A call's leave to wait for its plan's end ([`Plans::try_hold`]); given back when dropped.
#[derive(Debug)]
pub struct Holding<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Called with the outcome word and the duration of a plan that reached a terminal phase.
pub type OnEnd = Box<dyn Fn(&'static str, Duration) + Send + Sync>;

/// The Machines in the memory by workload cluster and plan phase, for the fleet metrics.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Census {
    /// (cluster, phase word, Machines), sorted.
    pub machines: Vec<(String, &'static str, u64)>,
    /// (cluster, age in seconds of its oldest unfinished update), sorted.
    pub oldest: Vec<(String, f64)>,
}

/// The cluster label of the Machines of clusters beyond the cap.
pub const OTHER_CLUSTERS: &str = "other";

/// The word of a phase in the fleet metrics (`None`: not counted: superseded, cancelled).
pub fn phase_word(phase: i32, rebooting: bool) -> Option<&'static str> {
    use pb::Phase;
    let phase = Phase::try_from(phase).unwrap_or(Phase::Unspecified);
    Some(match phase {
        Phase::Unspecified => "submitting",
        Phase::Pending => "pending",
        _ if rebooting => "rebooting",
        Phase::Preparing
        | Phase::Applying
        | Phase::Restarting
        | Phase::Verifying
        | Phase::RollingBack => "running",
        Phase::Succeeded => "succeeded",
        Phase::Failed => "failed",
        Phase::RolledBack => "rolled_back",
        Phase::Superseded | Phase::Cancelled => return None,
    })
}

impl std::fmt::Debug for Plans {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plans").field("len", &self.len()).finish()
    }
}

/// What [`Plans::record`] asks of the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Follow {
    /// Nothing: the plan is terminal, or a follower already streams it.
    No,
    /// Start a follower of this generation ([`follow`]).
    Start(u64),
}

impl Plans {
    /// An empty memory.
    pub fn new() -> Plans {
        Plans::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many Machines are remembered.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The remembered answer for a request by its fingerprint alone (the Machine it is
    /// about, and the answer), if it may be used now.
    pub fn answer_by_fingerprint(&self, fingerprint: &Fingerprint) -> Option<(String, Remembered)> {
        let machine = self.index().get(fingerprint).cloned()?;
        let known = self.answer(&machine, fingerprint)?;
        Some((machine, known))
    }

    fn index(&self) -> std::sync::MutexGuard<'_, HashMap<Fingerprint, String>> {
        self.by_fingerprint
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn indexed(&self, fingerprint: Fingerprint, machine: &str) {
        self.index().insert(fingerprint, machine.to_owned());
    }

    /// The remembered answer for this Machine and request, if it may be used now.
    pub fn answer(&self, machine: &str, fingerprint: &Fingerprint) -> Option<Remembered> {
        let now = Instant::now();
        let mut entries = self.lock();
        let e = entries.get_mut(machine)?;
        if &e.fingerprint != fingerprint || !e.fresh(now) {
            return None;
        }
        e.read_at = now;
        let refresh = !e.refreshing && now.duration_since(e.verified_at) >= TTL;
        if refresh {
            e.refreshing = true;
        }
        let word_stale = e.submit == Submit::Answered
            && !terminal(e.heard.phase)
            && now.duration_since(e.heard_at) >= GRACE;
        Some(Remembered {
            heard: e.heard.clone(),
            plan: e.plan.clone(),
            refresh,
            word_stale,
            seen: e.tracked.seen(now),
        })
    }

    /// What the updater saw of the pace of `machine`'s entry, if it is of `plan`.
    pub fn seen(&self, machine: &str, plan: &PlanRef) -> Option<super::pace::Seen> {
        let now = Instant::now();
        self.lock()
            .get(machine)
            .filter(|e| &e.plan == plan)
            .map(|e| e.tracked.seen(now))
    }

    /// Leave for one more call to wait for its plan's end, unless [`MAX_HOLDS`] calls
    /// already do.
    pub fn try_hold(&self) -> Option<Holding<'_>> {
        use std::sync::atomic::Ordering;
        self.holding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_HOLDS).then_some(n + 1)
            })
            .ok()
            .map(|_| Holding(&self.holding))
    }

    /// A request was checked against the live objects and the agent answered `status` for
    /// its plan: remember it. Another request or plan replaces the entry (and stops its
    /// follower).
    pub fn record(
        &self,
        machine: &str,
        fingerprint: Fingerprint,
        plan: PlanRef,
        status: &pb::PlanStatus,
    ) -> Follow {
        let follow = self.record_status(machine, fingerprint, plan, status);
        self.changed.notify_waiters();
        follow
    }

    fn record_status(
        &self,
        machine: &str,
        fingerprint: Fingerprint,
        plan: PlanRef,
        status: &pb::PlanStatus,
    ) -> Follow {
        let now = Instant::now();
        self.sweep(now);
        let heard = Heard::of(status);
        let done = terminal(heard.phase);
        self.indexed(fingerprint, machine);
        let mut entries = self.lock();
        if let Some(e) = entries.get_mut(machine)
            && e.plan == plan
        {
            e.fingerprint = fingerprint;
            e.verified_at = now;
            e.read_at = now;
            e.refreshing = false;
            e.submit = Submit::Answered;
            // A call's answer may be older than the stream's last snapshot: an attempt that
            // ended does not go back to running (a retry is a new attempt).
            let older = heard.attempt == e.heard.attempt && terminal(e.heard.phase) && !done;
            if !older && done && !terminal(e.heard.phase) {
                self.ended(heard.phase, e.began);
            }
            if !older {
                e.heard = heard;
                e.heard_at = now;
                e.tracked.observe(status, &e.plan.costs, now);
            }
            if terminal(e.heard.phase) || e.following {
                return Follow::No;
            }
            let generation = self.next_generation();
            e.generation = generation;
            e.following = true;
            return Follow::Start(generation);
        }
        let generation = self.next_generation();
        let mut tracked = Tracked::new(now);
        tracked.observe(status, &plan.costs, now);
        if let Some(old) = entries.insert(
            machine.to_owned(),
            Entry {
                fingerprint,
                plan,
                heard,
                heard_at: now,
                verified_at: now,
                read_at: now,
                streaming: false,
                generation,
                following: !done,
                follower: None,
                refreshing: false,
                submit: Submit::Answered,
                began: now,
                tracked,
            },
        ) && let Some(f) = old.follower
        {
            f.abort();
        }
        if done {
            Follow::No
        } else {
            Follow::Start(generation)
        }
    }

    /// Whether an entry of `machine` is about this very plan (then the slow way asks the
    /// agent before it answers; otherwise it may answer while the plan is submitted).
    pub fn knows(&self, machine: &str, plan: &PlanRef) -> bool {
        self.lock().get(machine).is_some_and(|e| &e.plan == plan)
    }

    /// A checked request's plan is being submitted in the background: until the agent
    /// answers, calls with this request are answered with `heard` (in progress).
    pub fn submitting(&self, machine: &str, fingerprint: Fingerprint, plan: PlanRef, heard: Heard) {
        let now = Instant::now();
        self.sweep(now);
        self.indexed(fingerprint, machine);
        let generation = self.next_generation();
        if let Some(old) = self.lock().insert(
            machine.to_owned(),
            Entry {
                fingerprint,
                plan,
                heard,
                heard_at: now,
                verified_at: now,
                read_at: now,
                streaming: false,
                generation,
                following: false,
                follower: None,
                refreshing: false,
                submit: Submit::Running,
                began: now,
                tracked: Tracked::new(now),
            },
        ) && let Some(f) = old.follower
        {
            f.abort();
        }
    }

    /// The background submission of `plan` failed: calls take the slow way again.
    pub fn submit_failed(&self, machine: &str, plan: &PlanRef) {
        if let Some(e) = self.lock().get_mut(machine)
            && &e.plan == plan
            && e.submit == Submit::Running
        {
            e.submit = Submit::Failed;
        }
        self.changed.notify_waiters();
    }

    /// What the agent said of `plan` once it is terminal, waiting for that until `until`;
    /// `None` when it is not terminal by then (or the entry is of another plan, or its
    /// submission failed).
    pub async fn settled(&self, machine: &str, plan: &PlanRef, until: Instant) -> Option<Heard> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before looking, so a change between the look and the wait wakes it.
            changed.as_mut().enable();
            {
                let entries = self.lock();
                let e = entries.get(machine).filter(|e| &e.plan == plan)?;
                if e.submit == Submit::Failed {
                    return None;
                }
                if e.submit == Submit::Answered && terminal(e.heard.phase) {
                    return Some(e.heard.clone());
                }
            }
            if tokio::time::timeout_at(until.into(), changed)
                .await
                .is_err()
            {
                return None;
            }
        }
    }

    /// The plan of `machine`'s entry and what the agent last said of it (no effect on the
    /// entry: not a read that keeps it or asks for a refresh).
    pub fn current(&self, machine: &str) -> Option<(PlanRef, Heard)> {
        self.lock()
            .get(machine)
            .filter(|e| e.submit == Submit::Answered)
            .map(|e| (e.plan.clone(), e.heard.clone()))
    }

    fn next_generation(&self) -> u64 {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// The follower of `generation` was started (its handle stops it when replaced).
    pub fn started(&self, machine: &str, generation: u64, handle: tokio::task::AbortHandle) {
        let mut entries = self.lock();
        match entries.get_mut(machine) {
            Some(e) if e.generation == generation => e.follower = Some(handle),
            _ => handle.abort(),
        }
    }

    /// A background check of the request ended; `recorded` is false when it did not end in
    /// [`Plans::record`] (the Machine is no longer updated, differs, or the agent could not
    /// be asked): the entry is dropped so the next call takes the slow way and says why.
    pub fn refreshed(&self, machine: &str, fingerprint: &Fingerprint, recorded: bool) {
        let mut entries = self.lock();
        if let Some(e) = entries.get_mut(machine)
            && &e.fingerprint == fingerprint
        {
            e.refreshing = false;
            if !recorded && let Some(e) = entries.remove(machine) {
                if let Some(f) = e.follower {
                    f.abort();
                }
            }
        }
    }

    /// Drops the entry of `machine` (of `generation` only, when given).
    pub fn forget(&self, machine: &str, generation: Option<u64>) {
        let mut entries = self.lock();
        if entries
            .get(machine)
            .is_some_and(|e| generation.is_none_or(|g| e.generation == g))
            && let Some(e) = entries.remove(machine)
            && let Some(f) = e.follower
            && generation.is_none()
        {
            f.abort();
        }
    }

    /// Whether the follower of `generation` is still wanted; an idle entry is dropped here.
    fn wanted(&self, machine: &str, generation: u64) -> bool {
        let mut entries = self.lock();
        let Some(e) = entries.get(machine) else {
            return false;
        };
        if e.generation != generation {
            return false;
        }
        if e.read_at.elapsed() >= IDLE {
            entries.remove(machine);
            return false;
        }
        true
    }

    /// A snapshot arrived on the stream of `generation`; false: stop following.
    fn heard(&self, machine: &str, generation: u64, status: &pb::PlanStatus) -> bool {
        let more = self.heard_snapshot(machine, generation, status);
        self.changed.notify_waiters();
        more
    }

    fn heard_snapshot(&self, machine: &str, generation: u64, status: &pb::PlanStatus) -> bool {
        let mut entries = self.lock();
        let Some(e) = entries.get_mut(machine) else {
            return false;
        };
        if e.generation != generation {
            return false;
        }
        if terminal(status.phase) && !terminal(e.heard.phase) {
            self.ended(status.phase, e.began);
        }
        let now = Instant::now();
        e.heard = Heard::of(status);
        e.heard_at = now;
        e.tracked.observe(status, &e.plan.costs, now);
        e.streaming = true;
        if terminal(status.phase) {
            e.streaming = false;
            e.following = false;
            e.follower = None;
            return false;
        }
        true
    }

    /// The stream of `generation` broke.
    fn disconnected(&self, machine: &str, generation: u64) {
        if let Some(e) = self.lock().get_mut(machine)
            && e.generation == generation
        {
            e.streaming = false;
        }
    }

    /// The follower of `generation` stops for good.
    fn stopped(&self, machine: &str, generation: u64) {
        if let Some(e) = self.lock().get_mut(machine)
            && e.generation == generation
        {
            e.streaming = false;
            e.following = false;
            e.follower = None;
        }
    }

    /// The agent answered a call about `plan` (`GetPlanStatus`) with `status`: it becomes the
    /// entry's word unless it is older than what the entry holds (an attempt that ended does
    /// not go back to running). The word to answer with; `None` when the entry is of
    /// another plan.
    pub fn heard_by_call(
        &self,
        machine: &str,
        plan: &PlanRef,
        status: &pb::PlanStatus,
    ) -> Option<Heard> {
        let heard = Heard::of(status);
        let word = {
            let mut entries = self.lock();
            let e = entries.get_mut(machine).filter(|e| &e.plan == plan)?;
            let older = heard.attempt < e.heard.attempt
                || (heard.attempt == e.heard.attempt
                    && terminal(e.heard.phase)
                    && !terminal(heard.phase));
            if !older {
                if terminal(heard.phase) && !terminal(e.heard.phase) {
                    self.ended(heard.phase, e.began);
                }
                let now = Instant::now();
                e.heard = heard;
                e.heard_at = now;
                e.tracked.observe(status, &e.plan.costs, now);
            }
            e.heard.clone()
        };
        self.changed.notify_waiters();
        Some(word)
    }

    /// Who is told when a plan reaches a terminal phase (set once).
    pub fn on_end(&self, f: OnEnd) {
        let _ = self.on_end.set(f);
    }

    fn ended(&self, phase: i32, began: Instant) {
        if let (Some(f), Some(word)) = (self.on_end.get(), phase_word(phase, false)) {
            f(word, began.elapsed());
        }
    }

    /// The Machines remembered by (cluster, phase), those in `unreachable` (Machine →
    /// cluster) counted as `unreachable` instead, and each cluster's oldest unfinished
    /// update. At most `cap` clusters by name; the Machines of the rest count under
    /// [`OTHER_CLUSTERS`].
    pub fn census(&self, unreachable: &HashMap<String, String>, cap: usize) -> Census {
        let now = Instant::now();
        let mut rows: Vec<(String, &'static str, Option<f64>)> = Vec::new();
        {
            let entries = self.lock();
            for (machine, e) in entries.iter() {
                if unreachable.contains_key(machine) {
                    continue;
                }
                let word = match e.submit {
                    Submit::Answered => phase_word(e.heard.phase, e.heard.rebooting),
                    Submit::Running | Submit::Failed => Some("submitting"),
                };
                let Some(word) = word else { continue };
                let unfinished = !(e.submit == Submit::Answered && terminal(e.heard.phase));
                let age = unfinished.then(|| now.duration_since(e.began).as_secs_f64());
                rows.push((e.plan.cluster.clone(), word, age));
            }
        }
        for cluster in unreachable.values() {
            rows.push((cluster.clone(), "unreachable", None));
        }
        let mut clusters: Vec<&String> = rows.iter().map(|r| &r.0).collect();
        clusters.sort();
        clusters.dedup();
        let kept: std::collections::HashSet<String> =
            clusters.into_iter().take(cap).cloned().collect();
        let mut machines: std::collections::BTreeMap<(String, &'static str), u64> =
            Default::default();
        let mut oldest: std::collections::BTreeMap<String, f64> = Default::default();
        for (cluster, word, age) in rows {
            let cluster = if kept.contains(&cluster) {
                cluster
            } else {
                OTHER_CLUSTERS.to_owned()
            };
            if let Some(age) = age {
                let o = oldest.entry(cluster.clone()).or_insert(0.0);
                *o = o.max(age);
            }
            *machines.entry((cluster, word)).or_default() += 1;
        }
        Census {
            machines: machines.into_iter().map(|((c, w), n)| (c, w, n)).collect(),
            oldest: oldest.into_iter().collect(),
        }
    }

    /// Drops idle entries, at most once a minute.
    fn sweep(&self, now: Instant) {
        {
            let mut swept = self.swept.lock().unwrap_or_else(|e| e.into_inner());
            if swept.is_some_and(|at| now.duration_since(at) < Duration::from_secs(60)) {
                return;
            }
            *swept = Some(now);
        }
        let mut entries = self.lock();
        entries.retain(|_, e| {
            let keep = now.duration_since(e.read_at) < IDLE;
            if !keep && let Some(f) = &e.follower {
                f.abort();
            }
            keep
        });
        self.index().retain(|fingerprint, machine| {
            entries
                .get(machine)
                .is_some_and(|e| &e.fingerprint == fingerprint)
        });
    }
}

/// Follows `plan` on its agent for the entry of `machine` until the plan's terminal
/// snapshot, the entry being replaced or dropped, or the agent no longer knowing the plan
/// (then the entry is dropped: the next call submits it again). A broken stream is opened
/// again after a backoff (100 ms doubling to 5 s); meanwhile calls ask the agent themselves.
pub async fn follow(
    plans: Arc<Plans>,
    agents: Arc<Agents>,
    machine: String,
    plan: PlanRef,
    generation: u64,
) {
    let mut backoff = BACKOFF_MIN;
    while plans.wanted(&machine, generation) {
        match agents.watch(&plan.peer, &plan.id).await {
            Ok(Some(mut stream)) => {
                tracing::debug!(%machine, node = %plan.peer.node(), plan = %plan.id, "plan stream opened");
                loop {
                    match stream.message().await {
                        Ok(Some(status)) => {
                            backoff = BACKOFF_MIN;
                            if !plan.has_digest(&status.digest) {
                                // Another plan under this id: the next call decides afresh.
                                plans.forget(&machine, Some(generation));
                                return;
                            }
                            if !plans.heard(&machine, generation, &status) {
                                return;
                            }
                        }
                        Ok(None) => break,
                        Err(s) => {
                            tracing::debug!(%machine, node = %plan.peer.node(), plan = %plan.id, code = ?s.code(), "plan stream broke");
                            break;
                        }
                    }
                }
            }
            Ok(None) => {
                plans.forget(&machine, Some(generation));
                return;
            }
            Err(e) => {
                tracing::debug!(%machine, plan = %plan.id, error = %e, "plan stream not opened");
            }
        }
        plans.disconnected(&machine, generation);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
    plans.stopped(&machine, generation);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(id: &str, digest: &str) -> PlanRef {
        PlanRef {
            id: id.into(),
            digest: digest.into(),
            digest_v1: format!("v1 of {digest}"),
            peer: Peer::for_tests("https://127.0.0.1:1", "n"),
            costs: vec![20],
            cluster: "c".into(),
            hold: Duration::from_secs(3),
        }
    }

    fn status(phase: pb::Phase, retry: i32, message: &str) -> pb::PlanStatus {
        pb::PlanStatus {
            phase: phase as i32,
            hook_response: Some(pb::HookResponse {
                status: pb::HookStatus::Success as i32,
                retry_after_seconds: retry,
                message: message.into(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_census_counts_machines_by_cluster_and_phase_and_ends_are_told_once() {
        let plans = Plans::new();
        let ended = Arc::new(Mutex::new(Vec::new()));
        let seen = ended.clone();
        plans.on_end(Box::new(move |word, _| {
            seen.lock().unwrap().push(word);
        }));
        let in_cluster = |cluster: &str, id: &str| PlanRef {
            cluster: cluster.into(),
            ..plan(id, "d")
        };
        let Follow::Start(g) = plans.record(
            "ns/a",
            [1u8; 32],
            in_cluster("red", "pa"),
            &status(pb::Phase::Applying, 10, "applying"),
        ) else {
            panic!("a follower is wanted");
        };
        plans.record(
            "ns/b",
            [2u8; 32],
            in_cluster("red", "pb"),
            &status(pb::Phase::Pending, 10, "pending"),
        );
        plans.submitting(
            "ns/c",
            [3u8; 32],
            in_cluster("blue", "pc"),
            Heard::of(&status(pb::Phase::Unspecified, 5, "submitting")),
        );
        plans.record(
            "ns/d",
            [4u8; 32],
            in_cluster("green", "pd"),
            &status(pb::Phase::Applying, 10, "applying"),
        );
        let unreachable: HashMap<String, String> = [("ns/d".to_owned(), "green".to_owned())].into();
        let census = plans.census(&unreachable, 10);
        assert_eq!(
            census.machines,
            vec![
                ("blue".to_owned(), "submitting", 1),
                ("green".to_owned(), "unreachable", 1),
                ("red".to_owned(), "pending", 1),
                ("red".to_owned(), "running", 1),
            ]
        );
        assert_eq!(
            census
                .oldest
                .iter()
                .map(|o| o.0.as_str())
                .collect::<Vec<_>>(),
            ["blue", "red"]
        );
        // The terminal snapshot is told once, and the Machine stays, as succeeded, with no
        // unfinished update.
        assert!(!plans.heard("ns/a", g, &status(pb::Phase::Succeeded, 0, "done")));
        plans.record(
            "ns/a",
            [1u8; 32],
            in_cluster("red", "pa"),
            &status(pb::Phase::Succeeded, 0, "done"),
        );
        assert_eq!(*ended.lock().unwrap(), ["succeeded"]);
        let census = plans.census(&HashMap::new(), 10);
        assert!(
            census
                .machines
                .contains(&("red".to_owned(), "succeeded", 1))
        );
        // Beyond the cap, clusters count as "other".
        let census = plans.census(&HashMap::new(), 1);
        assert_eq!(
            census
                .machines
                .iter()
                .map(|m| (m.0.as_str(), m.1))
                .collect::<Vec<_>>(),
            [
                ("blue", "submitting"),
                ("other", "pending"),
                ("other", "running"),
                ("other", "succeeded"),
            ]
        );
    }

    #[test]
    fn an_in_flight_word_older_than_the_grace_is_asked_for_again() {
        let plans = Plans::new();
        let a = [1u8; 32];
        let Follow::Start(g) = plans.record(
            "ns/m",
            a,
            plan("p1", "d1"),
            &status(
                pb::Phase::Verifying,
                10,
                "verify[0] kubeletVersion: attempt 1",
            ),
        ) else {
            panic!("a follower is wanted");
        };
        // The stream is open (a snapshot came) and silent: the answer may be given, but its
        // word is stale once older than the grace.
        assert!(plans.heard(
            "ns/m",
            g,
            &status(
                pb::Phase::Verifying,
                10,
                "verify[0] kubeletVersion: attempt 1"
            )
        ));
        assert!(!plans.answer("ns/m", &a).unwrap().word_stale);
        std::thread::sleep(GRACE + Duration::from_millis(50));
        let known = plans.answer("ns/m", &a).unwrap();
        assert!(known.word_stale);
        let now = plans
            .heard_by_call(
                "ns/m",
                &known.plan,
                &status(
                    pb::Phase::Verifying,
                    10,
                    "verify[0] kubeletVersion: attempt 11",
                ),
            )
            .unwrap();
        assert!(now.hook.message.ends_with("attempt 11"));
        let known = plans.answer("ns/m", &a).unwrap();
        assert!(!known.word_stale);
        assert!(known.heard.hook.message.ends_with("attempt 11"));
        // A terminal word is never stale, and an older call's answer does not replace it.
        assert!(!plans.heard("ns/m", g, &status(pb::Phase::RolledBack, 0, "rolled back")));
        let word = plans
            .heard_by_call(
                "ns/m",
                &known.plan,
                &status(pb::Phase::Verifying, 10, "late"),
            )
            .unwrap();
        assert_eq!(word.hook.message, "rolled back");
        assert!(
            plans
                .heard_by_call(
                    "ns/m",
                    &plan("p2", "d2"),
                    &status(pb::Phase::Verifying, 10, "x")
                )
                .is_none()
        );
    }

    #[test]
    fn an_answer_needs_the_same_request_and_a_fresh_status() {
        let plans = Plans::new();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        assert!(plans.answer("ns/m", &a).is_none());
        let follow = plans.record(
            "ns/m",
            a,
            plan("p1", "d1"),
            &status(pb::Phase::Applying, 10, "applying"),
        );
        assert!(matches!(follow, Follow::Start(_)));
        let got = plans.answer("ns/m", &a).expect("within the grace");
        assert_eq!(got.heard.hook.message, "applying");
        assert!(!got.refresh);
        assert!(plans.answer("ns/m", &b).is_none(), "another request");
        let (machine, by_fp) = plans.answer_by_fingerprint(&a).unwrap();
        assert_eq!(
            (machine.as_str(), by_fp.heard.hook.message.as_str()),
            ("ns/m", "applying")
        );
        assert!(plans.answer_by_fingerprint(&b).is_none());
        assert!(plans.answer("ns/other", &a).is_none());
    }

    #[test]
    fn snapshots_move_the_answer_and_the_terminal_one_ends_following() {
        let plans = Plans::new();
        let a = [1u8; 32];
        let Follow::Start(g) = plans.record(
            "ns/m",
            a,
            plan("p1", "d1"),
            &status(pb::Phase::Pending, 10, "pending"),
        ) else {
            panic!("a follower is wanted");
        };
        assert!(plans.heard("ns/m", g, &status(pb::Phase::Verifying, 10, "gates")));
        assert_eq!(
            plans.answer("ns/m", &a).unwrap().heard.hook.message,
            "gates"
        );
        assert!(!plans.heard("ns/m", g, &status(pb::Phase::Succeeded, 0, "done")));
        let got = plans.answer("ns/m", &a).unwrap();
        assert_eq!(got.heard.hook.retry_after_seconds, 0);
        // A snapshot of an older generation is ignored.
        assert!(!plans.heard("ns/m", g + 1, &status(pb::Phase::Applying, 10, "x")));
        assert_eq!(plans.answer("ns/m", &a).unwrap().heard.hook.message, "done");
        // The same plan again, terminal: no follower.
        assert_eq!(
            plans.record(
                "ns/m",
                a,
                plan("p1", "d1"),
                &status(pb::Phase::Succeeded, 0, "done")
            ),
            Follow::No
        );
    }

    #[test]
    fn another_plan_replaces_the_entry_and_its_generation() {
        let plans = Plans::new();
        let Follow::Start(g1) = plans.record(
            "ns/m",
            [1; 32],
            plan("p1", "d1"),
            &status(pb::Phase::Applying, 10, "old"),
        ) else {
            panic!()
        };
        let Follow::Start(g2) = plans.record(
            "ns/m",
            [2; 32],
            plan("p2", "d2"),
            &status(pb::Phase::Pending, 10, "new"),
        ) else {
            panic!()
        };
        assert_ne!(g1, g2);
        assert!(!plans.wanted("ns/m", g1), "the old follower stops");
        assert!(plans.wanted("ns/m", g2));
        assert!(!plans.heard("ns/m", g1, &status(pb::Phase::Succeeded, 0, "old done")));
        assert!(plans.answer("ns/m", &[1; 32]).is_none());
        assert!(
            plans.answer_by_fingerprint(&[1; 32]).is_none(),
            "a stale index line"
        );
        assert_eq!(
            plans.answer("ns/m", &[2; 32]).unwrap().heard.hook.message,
            "new"
        );
    }

    #[test]
    fn an_in_flight_status_without_a_stream_expires_and_a_failed_refresh_drops_it() {
        let plans = Plans::new();
        let a = [1u8; 32];
        let Follow::Start(g) = plans.record(
            "ns/m",
            a,
            plan("p1", "d1"),
            &status(pb::Phase::Applying, 10, "x"),
        ) else {
            panic!()
        };
        {
            let mut entries = plans.lock();
            let e = entries.get_mut("ns/m").unwrap();
            e.heard_at -= GRACE;
        }
        assert!(plans.answer("ns/m", &a).is_none(), "no stream, grace over");
        assert!(plans.heard("ns/m", g, &status(pb::Phase::Applying, 10, "y")));
        assert!(plans.answer("ns/m", &a).is_some(), "the stream speaks");
        plans.disconnected("ns/m", g);
        {
            let mut entries = plans.lock();
            entries.get_mut("ns/m").unwrap().heard_at -= GRACE;
        }
        assert!(plans.answer("ns/m", &a).is_none(), "the stream broke");

        // A terminal answer is kept; when old it asks for one refresh at a time.
        plans.record(
            "ns/m",
            a,
            plan("p1", "d1"),
            &status(pb::Phase::Succeeded, 0, "done"),
        );
        {
            let mut entries = plans.lock();
            entries.get_mut("ns/m").unwrap().verified_at -= TTL;
        }
        assert!(plans.answer("ns/m", &a).unwrap().refresh);
        assert!(!plans.answer("ns/m", &a).unwrap().refresh, "one at a time");
        plans.refreshed("ns/m", &a, false);
        assert!(plans.answer("ns/m", &a).is_none(), "dropped");
    }
}

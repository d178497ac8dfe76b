//! The `NodeAgent` service: the gRPC methods over the [`Engine`].
//!
//! Every method that touches the engine does so on the blocking pool: the engine lock is
//! held across journal appends (fdatasync), and the runtime must keep serving other calls
//! meanwhile. Plans from the wire go through [`inplace_api::convert::validate_owned`] (the plan-file
//! validator) and then [`Engine::submit`], which decides idempotency (same id + digest →
//! the existing status) under its submission lock, so any number of concurrent identical
//! `ApplyPlan` calls start the plan once.
//!
//! `WatchPlan` ([`watch_run`]) streams complete snapshots built from the engine's
//! `Event::Status` broadcast (one per phase a run enters) plus a fresh read of the status
//! after `Event::Progress` bursts (coalesced: one read per burst, only while the phase is
//! the one last sent). A watcher that falls behind the broadcast (`Lagged`) recovers the
//! phases it missed from [`Engine::phase_history`], so it still sees every phase, in order,
//! with the content it had; the stream ends after the terminal snapshot.
//!
//! Logs name the caller, method, plan id and digest, never plan content: plans carry
//! bootstrap tokens and file contents, and validation messages may quote field values.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::broadcast::error::{RecvError, TryRecvError};
use tokio::sync::{broadcast, watch};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::replies::{check_report_to_pb, status_to_pb};
use crate::engine::dry_run::check_plan;
use crate::engine::state::{Phase, PlanStatus};
use crate::engine::{Engine, Event, Submission, SubmitError};
use inplace_api::authz::Caller;
use inplace_api::convert::{plan_error_status, validate_owned};
use inplace_api::pb;
use inplace_api::pb::node_agent_server::NodeAgent;
use inplace_plan::{ChangeKind, FieldError, KnownSums, Limits, ReadPlanError, read_plan_hashed};

use inplace_api::document;

/// `source` of plans submitted over gRPC, as the journal and `PlanStatus.source` show it.
pub const GRPC_SOURCE: &str = "grpc";

/// Longest `CancelPlanRequest.reason`, in bytes.
const MAX_CANCEL_REASON: usize = 256;

/// Most broadcast events handled in one go before a snapshot is sent.
const MAX_BURST: usize = 1024;

/// Service counters for the metrics module.
#[derive(Debug, Default)]
pub struct ServiceCounters {
    accepted: AtomicU64,
    existing: AtomicU64,
    refused: AtomicU64,
    watches: AtomicU64,
    watch_lagged: AtomicU64,
}

impl ServiceCounters {
    /// `ApplyPlan`/`RetryPlan` calls that started a new attempt.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    /// `ApplyPlan` calls answered with an existing plan (same id and digest).
    pub fn existing(&self) -> u64 {
        self.existing.load(Ordering::Relaxed)
    }

    /// `ApplyPlan` calls refused (invalid, another node, unsupported, journal failure).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// `WatchPlan` streams opened.
    pub fn watches(&self) -> u64 {
        self.watches.load(Ordering::Relaxed)
    }

    /// Times a watcher fell behind the engine's broadcast and recovered from the phase
    /// history.
    pub fn watch_lagged(&self) -> u64 {
        self.watch_lagged.load(Ordering::Relaxed)
    }
}

/// The `NodeAgent` implementation.
#[derive(Debug, Clone)]
pub struct AgentService {
    engine: Engine,
    limits: Arc<Limits>,
    shutdown: watch::Receiver<bool>,
    counters: Arc<ServiceCounters>,
    /// Longest document `SubmitPlanDocument` takes.
    max_document_bytes: usize,
}

impl AgentService {
    /// A service over `engine`, validating wire plans with `limits`. When `shutdown` turns
    /// true, watch streams end with UNAVAILABLE and mutating calls are refused with it, so
    /// the server can drain.
    pub fn new(engine: Engine, limits: Limits, shutdown: watch::Receiver<bool>) -> Self {
        Self {
            engine,
            max_document_bytes: limits.max_plan_bytes,
            limits: Arc::new(limits),
            shutdown,
            counters: Arc::default(),
        }
    }

    /// Takes plan documents of at most `bytes` over `SubmitPlanDocument` (the server's
    /// largest message; the plan-file limit applies as well).
    pub fn with_max_document_bytes(mut self, bytes: usize) -> Self {
        self.max_document_bytes = bytes.min(self.limits.max_plan_bytes);
        self
    }

    /// The service's counters.
    pub fn counters(&self) -> &Arc<ServiceCounters> {
        &self.counters
    }

    fn refuse_if_stopping(&self) -> Result<(), Status> {
        if *self.shutdown.borrow() {
            return Err(Status::unavailable(
                "the agent is shutting down; retry when it is back",
            ));
        }
        Ok(())
    }
}

/// Runs `f` on the blocking pool.
async fn blocking<T, F>(f: F) -> Result<T, Status>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("request handler failed: {e}")))
}

fn caller<T>(request: &Request<T>) -> String {
    request
        .extensions()
        .get::<Caller>()
        .map_or_else(|| "unknown".to_owned(), |c| c.identity.to_string())
}

fn required_plan(plan: Option<pb::Plan>) -> Result<pb::Plan, Status> {
    plan.ok_or_else(|| Status::invalid_argument("plan: is required"))
}

fn required_id(id: &str) -> Result<(), Status> {
    if id.is_empty() {
        return Err(Status::invalid_argument("id: is required"));
    }
    Ok(())
}

/// The gRPC status for a refused submission (see the status codes in the proto).
pub fn submit_error_status(error: &SubmitError) -> Status {
    match error {
        SubmitError::Invalid(invalid) => plan_error_status(invalid),
        SubmitError::WrongNode { .. } | SubmitError::Unsupported { .. } => {
            Status::failed_precondition(error.to_string())
        }
        SubmitError::NotFound(_) => Status::not_found(error.to_string()),
        SubmitError::Conflict(_) => Status::failed_precondition(error.to_string()),
        SubmitError::Journal(_) => {
            Status::internal(format!("could not record the request: {error}"))
        }
        SubmitError::Staging(_) => Status::internal(error.to_string()),
    }
}

/// A bounded label of a refusal for logs (never the messages, which may quote plan values).
fn refusal_reason(error: &SubmitError) -> &'static str {
    match error {
        SubmitError::Invalid(_) => "invalid",
        SubmitError::WrongNode { .. } => "wrong_node",
        SubmitError::Unsupported { .. } => "unsupported",
        SubmitError::NotFound(_) => "not_found",
        SubmitError::Conflict(_) => "conflict",
        SubmitError::Journal(_) => "journal",
        SubmitError::Staging(_) => "staging",
    }
}

/// Submits a validated plan from `who` to the engine: its status and whether this call
/// started a new attempt (`ApplyPlan`, `SubmitPlanDocument`).
fn submit_valid(
    method: &'static str,
    engine: &Engine,
    counters: &ServiceCounters,
    who: &str,
    plan: inplace_plan::Plan,
    known: KnownSums,
    retry: bool,
) -> Result<(PlanStatus, bool), Status> {
    // The digest is the engine's to compute (for a new id, beside staging the contents):
    // the status carries it.
    let id = plan.id.clone();
    match engine.submit_known(plan, known, GRPC_SOURCE, retry) {
        Ok(Submission::Accepted(status)) => {
            counters.accepted.fetch_add(1, Ordering::Relaxed);
            tracing::info!(caller = %who, %id, digest = %status.digest, attempt = status.attempt, run = status.run, "plan accepted");
            Ok((status, true))
        }
        Ok(Submission::Existing(status)) => {
            counters.existing.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(caller = %who, %id, digest = %status.digest, phase = %status.phase, "plan already known");
            Ok((status, false))
        }
        Err(error) => {
            counters.refused.fetch_add(1, Ordering::Relaxed);
            tracing::info!(caller = %who, method, %id, reason = refusal_reason(&error), "plan refused");
            Err(submit_error_status(&error))
        }
    }
}

fn not_found(id: &str) -> Status {
    if id.is_empty() {
        Status::not_found("this agent knows no plan yet")
    } else {
        Status::not_found(format!("no plan with id {id:?} is known to this agent"))
    }
}

/// The status `GetPlanStatus`/`WatchPlan` mean by `id`: that plan's latest attempt, or for
/// an empty id the current plan, else the most recent one.
fn lookup(engine: &Engine, id: &str) -> Option<PlanStatus> {
    if id.is_empty() {
        engine.current().or_else(|| engine.plans().pop())
    } else {
        engine.status(id)
    }
}

/// What `GetNodeInfo` answers.
pub fn node_info(engine: &Engine) -> pb::GetNodeInfoResponse {
    use crate::host::{node, packages};
    let host = engine.host();
    let config = engine.config();
    let os = node::os_info(host);
    let manager = packages::usable(host.root_path(), host.settings().commands_in_root)
        .and_then(|()| packages::detect(host.root_path()))
        .ok();
    let capabilities = &config.capabilities;
    let supported_change_kinds = ChangeKind::ALL
        .iter()
        .copied()
        .filter(|kind| capabilities.kinds.contains(kind))
        .filter(|kind| *kind != ChangeKind::Exec || capabilities.exec_allowed)
        .filter(|kind| *kind != ChangeKind::Package || manager.is_some())
        .map(|kind| kind.as_str().to_owned())
        .collect();
    pb::GetNodeInfoResponse {
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
        node_name: config.node_name.clone().unwrap_or_default(),
        os: Some(pb::OsInfo {
            id: os.id,
            version_id: os.version_id,
            pretty_name: os.pretty_name,
            kernel_release: os.kernel_release,
            architecture: os.architecture,
        }),
        package_manager: manager.map(|m| m.name().to_owned()).unwrap_or_default(),
        kubelet_version: crate::steps::check::kubelet_version(host).unwrap_or_default(),
        boot_id: host.boot_id().unwrap_or_default(),
        supported_change_kinds,
        current_plan_id: engine.current().map(|s| s.id).unwrap_or_default(),
        supported_check_kinds: supported_check_kinds(host.services().is_some(), capabilities),
        services_managed: host.services().is_some(),
        plan_features: PLAN_FEATURES.iter().map(|f| (*f).to_owned()).collect(),
    }
}

/// `GetNodeInfoResponse.plan_features` of this build.
pub const PLAN_FEATURES: &[&str] = &["prune", "packageVersionPattern"];

/// The check kinds an agent runs: `unitActive` needs service management, `command` exec.
fn supported_check_kinds(services: bool, capabilities: &crate::steps::Capabilities) -> Vec<String> {
    let mut kinds = Vec::new();
    if services {
        kinds.push("unitActive".to_owned());
    }
    kinds.push("httpGet".to_owned());
    kinds.push("kubeletVersion".to_owned());
    kinds.push("controlPlane".to_owned());
    if capabilities.exec_allowed {
        kinds.push("command".to_owned());
    }
    kinds
}

/// The stream type of `WatchPlan`.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::PlanStatus, Status>> + Send>>;

#[tonic::async_trait]
impl NodeAgent for AgentService {
    async fn get_node_info(
        &self,
        _request: Request<pb::GetNodeInfoRequest>,
    ) -> Result<Response<pb::GetNodeInfoResponse>, Status> {
        let engine = self.engine.clone();
        Ok(Response::new(blocking(move || node_info(&engine)).await?))
    }

    async fn check_plan(
        &self,
        request: Request<pb::CheckPlanRequest>,
    ) -> Result<Response<pb::CheckPlanResponse>, Status> {
        let wire = required_plan(request.into_inner().plan)?;
        let (engine, limits) = (self.engine.clone(), self.limits.clone());
        let response = blocking(move || {
            let plan = validate_owned(wire, &limits).map_err(|e| plan_error_status(&e))?;
            let config = engine.config();
            let mut report = check_plan(config, engine.host(), &plan);
            if let (true, None, Some(node)) =
                (config.require_node_name, &plan.node_name, &config.node_name)
            {
                report.errors.push(FieldError::new(
                    "nodeName",
                    format!("is required by this agent (node {node})"),
                ));
                report.applicable = false;
            }
            let existing = engine.find(&plan.id, &report.digest);
            Ok::<_, Status>(check_report_to_pb(&report, existing.as_ref()))
        })
        .await??;
        Ok(Response::new(response))
    }

    async fn apply_plan(
        &self,
        request: Request<pb::ApplyPlanRequest>,
    ) -> Result<Response<pb::ApplyPlanResponse>, Status> {
        self.refuse_if_stopping()?;
        let who = caller(&request);
        let request = request.into_inner();
        let wire = required_plan(request.plan)?;
        let retry = request.retry;
        let (engine, limits, counters) = (
            self.engine.clone(),
            self.limits.clone(),
            self.counters.clone(),
        );
        let (status, created) = blocking(move || {
            let wire_id = wire.id.clone();
            let plan = validate_owned(wire, &limits).map_err(|e| {
                counters.refused.fetch_add(1, Ordering::Relaxed);
                tracing::info!(caller = %who, id = %wire_id, problems = e.errors.len(), "ApplyPlan refused: invalid plan");
                plan_error_status(&e)
            })?;
            submit_valid("ApplyPlan", &engine, &counters, &who, plan, KnownSums::default(), retry)
        })
        .await??;
        Ok(Response::new(pb::ApplyPlanResponse {
            status: Some(status_to_pb(&status)),
            created,
        }))
    }

    async fn submit_plan_document(
        &self,
        request: Request<tonic::Streaming<pb::PlanDocumentPiece>>,
    ) -> Result<Response<pb::ApplyPlanResponse>, Status> {
        self.refuse_if_stopping()?;
        let who = caller(&request);
        let declared = document::declared_bytes(request.metadata(), self.max_document_bytes)?;
        let mut pieces = request.into_inner();
        let first = pieces.message().await?.ok_or_else(|| {
            Status::invalid_argument("the plan document is empty: the call sent no piece")
        })?;
        let name = document::name(&first.name);
        let retry = first.retry;
        let (tx, rx) = tokio::sync::mpsc::channel(document::PIECES_IN_FLIGHT);
        let (engine, limits, counters) = (
            self.engine.clone(),
            self.limits.clone(),
            self.counters.clone(),
        );
        // Parsed as the pieces arrive, on a thread of its own: the reader waits on the
        // network for as long as the client takes, and on the small shared blocking pool four
        // slow uploads held every thread that status calls need. Accepted only once the last
        // piece was read, so a stream that breaks leaves nothing behind.
        let (answer, answered) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("inplace-document".into())
            .spawn(move || {
                let read = read_plan_hashed(&mut document::Pieces::new(rx), &name, &limits);
                let submitted = read
                    .map_err(|e| {
                        counters.refused.fetch_add(1, Ordering::Relaxed);
                        match e {
                            ReadPlanError::Invalid(invalid) => {
                                tracing::info!(caller = %who, problems = invalid.errors.len(), "SubmitPlanDocument refused: invalid plan");
                                plan_error_status(&invalid)
                            }
                            ReadPlanError::Read(e) => {
                                tracing::info!(caller = %who, error = %e, "SubmitPlanDocument refused: the document did not arrive whole");
                                document::read_status(&e)
                            }
                        }
                    })
                    .and_then(|(plan, known)| {
                        submit_valid("SubmitPlanDocument", &engine, &counters, &who, plan, known, retry)
                    });
                let _ = answer.send(submitted);
            })
            .map_err(|e| {
                Status::unavailable(format!(
                    "the agent cannot start a thread to read the plan document: {e}; retry"
                ))
            })?;
        document::forward(first.data, &mut pieces, declared, tx).await;
        let (status, created) = answered.await.map_err(|_| {
            Status::internal(
                "the plan document's reader stopped without an answer (see the agent's log)",
            )
        })??;
        Ok(Response::new(pb::ApplyPlanResponse {
            status: Some(status_to_pb(&status)),
            created,
        }))
    }

    async fn get_plan_status(
        &self,
        request: Request<pb::GetPlanStatusRequest>,
    ) -> Result<Response<pb::PlanStatus>, Status> {
        let id = request.into_inner().id;
        let engine = self.engine.clone();
        let status = blocking(move || lookup(&engine, &id).ok_or_else(|| not_found(&id))).await??;
        Ok(Response::new(status_to_pb(&status)))
    }

    type WatchPlanStream = WatchStream;

    async fn watch_plan(
        &self,
        request: Request<pb::WatchPlanRequest>,
    ) -> Result<Response<Self::WatchPlanStream>, Status> {
        let id = request.into_inner().id;
        let engine = self.engine.clone();
        // Subscribe before reading the first snapshot, so nothing between the two is lost.
        let (events, first) = blocking(move || {
            let events = engine.subscribe();
            let first = lookup(&engine, &id).ok_or_else(|| not_found(&id));
            (events, first)
        })
        .await?;
        let first = first?;
        self.counters.watches.fetch_add(1, Ordering::Relaxed);
        let stream = watch_run(
            self.engine.clone(),
            first,
            events,
            self.shutdown.clone(),
            self.counters.clone(),
        )
        .map(|item| item.map(|status| status_to_pb(&status)));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn cancel_plan(
        &self,
        request: Request<pb::CancelPlanRequest>,
    ) -> Result<Response<pb::PlanStatus>, Status> {
        self.refuse_if_stopping()?;
        let who = caller(&request);
        let request = request.into_inner();
        required_id(&request.id)?;
        if request.reason.len() > MAX_CANCEL_REASON {
            return Err(Status::invalid_argument(format!(
                "reason: is {} bytes, more than the limit of {MAX_CANCEL_REASON} bytes",
                request.reason.len()
            )));
        }
        let engine = self.engine.clone();
        let status = blocking(move || {
            let status = engine
                .cancel_because(&request.id, &who.to_string(), &request.reason)
                .map_err(|e| submit_error_status(&e))?;
            tracing::info!(caller = %who, id = %status.id, digest = %status.digest, run = status.run, reason = %request.reason.escape_debug(), phase = %status.phase, "cancel requested");
            Ok::<_, Status>(status)
        })
        .await??;
        Ok(Response::new(status_to_pb(&status)))
    }

    async fn retry_plan(
        &self,
        request: Request<pb::RetryPlanRequest>,
    ) -> Result<Response<pb::PlanStatus>, Status> {
        self.refuse_if_stopping()?;
        let who = caller(&request);
        let request = request.into_inner();
        required_id(&request.id)?;
        let (engine, counters) = (self.engine.clone(), self.counters.clone());
        let status = blocking(move || retry(&engine, &request, &who, &counters)).await??;
        Ok(Response::new(status_to_pb(&status)))
    }

    async fn get_drift(
        &self,
        _request: Request<pb::GetDriftRequest>,
    ) -> Result<Response<pb::DriftStatus>, Status> {
        Ok(Response::new(super::replies::drift_to_pb(
            &self.engine.drift(),
        )))
    }

    async fn repair_plan(
        &self,
        request: Request<pb::RepairPlanRequest>,
    ) -> Result<Response<pb::PlanStatus>, Status> {
        self.refuse_if_stopping()?;
        let who = caller(&request);
        let request = request.into_inner();
        let (engine, counters) = (self.engine.clone(), self.counters.clone());
        let status = blocking(move || repair(&engine, &request, &who, &counters)).await??;
        Ok(Response::new(status_to_pb(&status)))
    }
}

/// `RepairPlan`.
fn repair(
    engine: &Engine,
    request: &pb::RepairPlanRequest,
    who: &str,
    counters: &ServiceCounters,
) -> Result<PlanStatus, Status> {
    let id = (!request.id.is_empty()).then_some(request.id.as_str());
    match engine.repair_of(id, &format!("{GRPC_SOURCE} {who}")) {
        Ok(Submission::Accepted(status)) | Ok(Submission::Existing(status)) => {
            counters.accepted.fetch_add(1, Ordering::Relaxed);
            tracing::info!(caller = %who, id = %status.id, digest = %status.digest, attempt = status.attempt, run = status.run, "repair accepted");
            Ok(status)
        }
        Err(error) => {
            tracing::info!(caller = %who, reason = refusal_reason(&error), "RepairPlan refused: {error}");
            Err(submit_error_status(&error))
        }
    }
}

/// `RetryPlan`, with `from_attempt` making a resent request a no-op.
fn retry(
    engine: &Engine,
    request: &pb::RetryPlanRequest,
    who: &str,
    counters: &ServiceCounters,
) -> Result<PlanStatus, Status> {
    let id = &request.id;
    let from = request.from_attempt;
    // The attempt after `from` already exists: this request (or its twin) was done.
    let moved_on = |engine: &Engine| {
        engine
            .status(id)
            .filter(|s| from != 0 && s.attempt == from + 1)
    };
    if from != 0 {
        let current = engine.status(id).ok_or_else(|| not_found(id))?;
        if current.attempt == from + 1 {
            return Ok(current);
        }
        if current.attempt != from {
            return Err(Status::failed_precondition(format!(
                "plan {id} is at attempt {}, not {from}",
                current.attempt
            )));
        }
    }
    match engine.retry(id, GRPC_SOURCE) {
        Ok(Submission::Accepted(status)) => {
            counters.accepted.fetch_add(1, Ordering::Relaxed);
            tracing::info!(caller = %who, %id, digest = %status.digest, attempt = status.attempt, run = status.run, "plan retried");
            Ok(status)
        }
        Ok(Submission::Existing(status)) => Ok(status),
        Err(error @ SubmitError::Conflict(_)) => {
            moved_on(engine).ok_or_else(|| submit_error_status(&error))
        }
        Err(error) => {
            tracing::info!(caller = %who, %id, reason = refusal_reason(&error), "RetryPlan refused");
            Err(submit_error_status(&error))
        }
    }
}

// === WatchPlan ===

/// Order of phases within one run: every legal transition goes up (DESIGN §3), so a
/// snapshot whose phase ranks at or below the last one sent is old news.
fn rank(phase: Phase) -> u8 {
    match phase {
        Phase::Pending => 0,
        Phase::Preparing => 1,
        Phase::Applying => 2,
        Phase::Restarting => 3,
        Phase::Verifying => 4,
        Phase::RollingBack => 5,
        Phase::Succeeded
        | Phase::Failed
        | Phase::RolledBack
        | Phase::Superseded
        | Phase::Cancelled => 6,
    }
}

/// The state of one watch stream.
struct Watch {
    engine: Engine,
    run: u64,
    events: broadcast::Receiver<Event>,
    shutdown: watch::Receiver<bool>,
    counters: Arc<ServiceCounters>,
    /// Snapshots to send, in order.
    queue: VecDeque<Arc<PlanStatus>>,
    /// The newest snapshot sent or queued.
    newest: Arc<PlanStatus>,
    /// Progress happened since the newest snapshot was taken.
    dirty: bool,
    /// The broadcast dropped events for this receiver.
    lagged: bool,
    /// The engine is gone: send what can still be read, then end.
    closed: bool,
    /// The terminal snapshot (or an error) was sent.
    ended: bool,
}

/// The snapshots of one run, starting with `first` (its current status): one per phase it
/// enters (never skipped, never out of order), fresh ones as its steps progress, ending
/// after the terminal one. Ends with UNAVAILABLE when `shutdown` turns true first.
/// `events` must have been subscribed before `first` was read.
pub fn watch_run(
    engine: Engine,
    first: PlanStatus,
    events: broadcast::Receiver<Event>,
    shutdown: watch::Receiver<bool>,
    counters: Arc<ServiceCounters>,
) -> impl Stream<Item = Result<Arc<PlanStatus>, Status>> + Send + 'static {
    let first = Arc::new(first);
    let state = Watch {
        engine,
        run: first.run,
        events,
        shutdown,
        counters,
        queue: VecDeque::from([first.clone()]),
        newest: first,
        dirty: false,
        lagged: false,
        closed: false,
        ended: false,
    };
    futures_lite::stream::unfold(state, |mut watch| async move {
        let item = watch.next().await?;
        Some((item, watch))
    })
}

impl Watch {
    async fn next(&mut self) -> Option<Result<Arc<PlanStatus>, Status>> {
        loop {
            if let Some(snapshot) = self.queue.pop_front() {
                self.ended |= snapshot.phase.is_terminal();
                return Some(Ok(snapshot));
            }
            if self.ended {
                return None;
            }
            if self.lagged {
                if let Err(status) = self.recover().await {
                    self.ended = true;
                    return Some(Err(status));
                }
                continue;
            }
            if self.closed {
                // The engine is gone (the process is ending) and the run did not finish.
                self.ended = true;
                return Some(Err(Status::unavailable("the agent's engine stopped")));
            }
            if self.dirty {
                self.dirty = false;
                self.refresh().await;
                if !self.queue.is_empty() {
                    continue;
                }
            }
            let event = tokio::select! {
                biased;
                () = stopping(&mut self.shutdown) => {
                    self.ended = true;
                    return Some(Err(Status::unavailable(
                        "the agent is shutting down; watch again when it is back",
                    )));
                }
                event = self.events.recv() => event,
            };
            self.handle(event);
            // Take the rest of a burst now, so it costs one fresh read, not one per event.
            for _ in 0..MAX_BURST {
                if self.lagged {
                    break;
                }
                match self.events.try_recv() {
                    Ok(event) => self.handle(Ok(event)),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Lagged(n)) => self.handle(Err(RecvError::Lagged(n))),
                    Err(TryRecvError::Closed) => {
                        self.handle(Err(RecvError::Closed));
                        break;
                    }
                }
            }
        }
    }

    fn handle(&mut self, event: Result<Event, RecvError>) {
        match event {
            // After a lag, phase snapshots are taken from the engine's history only: one that
            // arrives before the recovery may be later than phases the lag dropped, and
            // offering it first would make the recovery skip them as older.
            Ok(Event::Status(status)) if status.run == self.run && !self.lagged => {
                self.offer(status)
            }
            Ok(Event::Progress(progress)) if progress.run == self.run => self.dirty = true,
            Ok(_) => {}
            Err(RecvError::Lagged(_)) => {
                if !self.lagged {
                    self.counters.watch_lagged.fetch_add(1, Ordering::Relaxed);
                }
                self.lagged = true;
            }
            Err(RecvError::Closed) => {
                // Whatever happened before the engine went away is still worth sending.
                self.closed = true;
                self.lagged = true;
            }
        }
    }

    /// Queues a phase snapshot if it is newer than what was sent.
    fn offer(&mut self, status: Arc<PlanStatus>) {
        if rank(status.phase) > rank(self.newest.phase) {
            self.newest = status.clone();
            self.queue.push_back(status);
        }
    }

    /// A fresh snapshot after progress, sent only while the run is still in the phase last
    /// sent (a later phase arrives as its own event, with what it looked like then).
    async fn refresh(&mut self) {
        let (engine, run) = (self.engine.clone(), self.run);
        let Ok(Some(current)) = blocking(move || engine.status_of_run(run)).await else {
            return;
        };
        if current.phase == self.newest.phase && current != *self.newest {
            let current = Arc::new(current);
            self.newest = current.clone();
            self.queue.push_back(current);
        }
    }

    /// After the broadcast dropped events: every phase snapshot the engine kept for this run
    /// that is newer than the last one sent, then the current status (which is all there is
    /// when the run's history is gone).
    async fn recover(&mut self) -> Result<(), Status> {
        let (engine, run) = (self.engine.clone(), self.run);
        let (history, current) =
            blocking(move || (engine.phase_history(run), engine.status_of_run(run))).await?;
        self.lagged = false;
        for snapshot in history {
            self.offer(snapshot);
        }
        if let Some(current) = current {
            let current = Arc::new(current);
            if rank(current.phase) > rank(self.newest.phase) {
                self.offer(current);
            } else if current.phase == self.newest.phase && *current != *self.newest {
                self.newest = current.clone();
                self.queue.push_back(current);
            }
        }
        Ok(())
    }
}

/// Completes when `shutdown` is (or turns) true; never when its sender is gone.
async fn stopping(shutdown: &mut watch::Receiver<bool>) {
    loop {
        if *shutdown.borrow_and_update() {
            return;
        }
        if shutdown.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SettingsInput;
    use crate::host::Host;

    /// A watcher whose broadcast dropped the middle phases of a run, and then received a
    /// later phase before it could recover, still sends every phase in order.
    #[tokio::test]
    async fn a_phase_received_after_a_lag_does_not_hide_the_phases_the_lag_dropped() {
        let dir = tempfile::tempdir().unwrap();
        inplace_demo_node::build_kubeadm_worker(dir.path()).unwrap();
        let settings = SettingsInput {
            root: Some(dir.path().to_path_buf()),
            no_chroot: true,
            services_off: true,
            ..SettingsInput::default()
        }
        .resolve()
        .unwrap();
        let host = Arc::new(Host::open(settings.host.clone()).unwrap());
        let (engine, _) = Engine::open(settings.engine.clone(), host).unwrap();
        let plan = inplace_plan::parse_plan(
            b"apiVersion: inplace.agent/v1\nkind: Plan\nid: lag\nchanges:\n  - file: {path: /etc/kubernetes/lag.conf, content: x}\n",
            "lag.yaml",
            &Limits::default(),
        )
        .unwrap();
        let run = engine.submit(plan, "test", false).unwrap().status().run;
        engine.run_until_idle();
        let history = engine.phase_history(run);
        let phases: Vec<Phase> = history.iter().map(|s| s.phase).collect();
        assert!(
            phases.len() >= 4,
            "the run went through its phases: {phases:?}"
        );
        assert!(phases.last().unwrap().is_terminal(), "{phases:?}");

        // The watcher saw the first snapshot; its channel (room for two) then lost all but
        // the last two phases.
        let (tx, rx) = broadcast::channel(2);
        for snapshot in &history[1..] {
            tx.send(Event::Status(snapshot.clone())).unwrap();
        }
        let (_stop, stopping) = watch::channel(false);
        let counters = Arc::new(ServiceCounters::default());
        let stream = watch_run(
            engine.clone(),
            (*history[0]).clone(),
            rx,
            stopping,
            counters.clone(),
        );
        let sent: Vec<Phase> = stream.map(|s| s.unwrap().phase).collect::<Vec<_>>().await;
        assert_eq!(sent, phases, "every phase, in order, once");
        assert_eq!(counters.watch_lagged(), 1, "the watcher did fall behind");
    }
}

//! Prometheus metrics (`prometheus-client`): counters the engine feeds as it journals (plans by
//! result, change durations, unit jobs, failed gates), and values read when scraped (the
//! current phase, the journal, TLS handshakes, authorization, submissions). Every label has
//! a bounded set of values: no plan ids, unit names or paths.
//!
//! Counters count what happened since the process started, as Prometheus expects; the last
//! successful plan's time comes from the journal, so it survives restarts.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::engine::state::{ChangeState, Phase, PlanStatus};
use crate::engine::{Engine, RecordObserver};
use crate::host::systemd::UnitJob;
use crate::journal::{Record, UnitJobOutcome};
use crate::rpc::service::ServiceCounters;
use inplace_api::authz::AuthzCounters;
use inplace_api::tls::TlsCounters;

/// `Content-Type` of the Prometheus text format.
pub const PROMETHEUS_CONTENT_TYPE: &str =
    prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// `Content-Type` of the OpenMetrics text format (served when the scraper asks for it).
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds (seconds) of the change duration buckets: a file write to a package upgrade.
const DURATION_BUCKETS: [f64; 16] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
];

/// The phases a running plan reports in `inplace_agent_phase`, plus `Idle`.
const LIVE_PHASES: [&str; 7] = [
    "Idle",
    "Pending",
    "Preparing",
    "Applying",
    "Restarting",
    "Verifying",
    "RollingBack",
];

type Labels1 = [(&'static str, &'static str); 1];
type Labels2 = [(&'static str, &'static str); 2];

fn histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

/// The agent's metrics: the registry and the counters the engine feeds.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    plans: Family<Labels1, Counter>,
    plan_errors: Family<Labels1, Counter>,
    change_seconds: Family<Labels2, Histogram, fn() -> Histogram>,
    unit_jobs: Family<Labels2, Counter>,
    restarts_issued: Counter,
    verification_failures: Family<Labels1, Counter>,
    last_success: Gauge<f64, AtomicU64>,
    requests: Family<Labels2, Counter>,
}

/// What the metrics read when scraped.
#[derive(Debug, Clone)]
pub struct Sources {
    /// The engine (current phase, journal size).
    pub engine: Engine,
    /// TLS handshakes of the gRPC listener.
    pub tls: Arc<TlsCounters>,
    /// Authorization decisions of the gRPC API.
    pub authz: Arc<AuthzCounters>,
    /// Submissions over gRPC.
    pub service: Arc<ServiceCounters>,
    /// When the process started (Unix ms).
    pub started_at_ms: u64,
}

impl Metrics {
    /// The metrics of a daemon; the engine is told to feed them
    /// ([`Engine::set_observer`]) by [`Metrics::observe`].
    pub fn new(sources: Sources) -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("inplace_agent");
        let plans = Family::<Labels1, Counter>::default();
        registry.register(
            "plans",
            "Plan attempts that ended, by result (Succeeded, Failed, RolledBack, Cancelled, Superseded)",
            plans.clone(),
        );
        let plan_errors = Family::<Labels1, Counter>::default();
        registry.register(
            "plan_errors",
            "Plan attempts that did not succeed, by error kind",
            plan_errors.clone(),
        );
        let change_seconds =
            Family::<Labels2, Histogram, fn() -> Histogram>::new_with_constructor(histogram);
        registry.register(
            "change_duration_seconds",
            "How long applying a change took, by change kind and result (changed, unchanged, failed)",
            change_seconds.clone(),
        );
        let unit_jobs = Family::<Labels2, Counter>::default();
        registry.register(
            "unit_jobs",
            "Unit jobs (start, stop, restart) that ended, by job and outcome (done, failed, skipped)",
            unit_jobs.clone(),
        );
        let restarts_issued = Counter::default();
        registry.register(
            "unit_restarts_issued",
            "Unit restarts queued to systemd (forward and rollback)",
            restarts_issued.clone(),
        );
        let verification_failures = Family::<Labels1, Counter>::default();
        registry.register(
            "verification_failures",
            "Health gates that failed, by check kind",
            verification_failures.clone(),
        );
        let last_success = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "last_success_timestamp_seconds",
            "When the last successful plan ended (Unix seconds; 0: none known)",
            last_success.clone(),
        );
        let requests = Family::<Labels2, Counter>::default();
        registry.register(
            "status_requests",
            "Requests to the status socket and the metrics listener, by endpoint and HTTP status code",
            requests.clone(),
        );
        registry.register(
            "build",
            "The agent's version and commit",
            Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION").to_string()),
                ("commit", crate::BUILD.commit_label()),
            ]),
        );
        if let Some(at) = sources.engine.read(|t| {
            t.plans()
                .iter()
                .filter(|p| p.phase == Phase::Succeeded)
                .filter_map(|p| p.finished_at_ms)
                .max()
        }) {
            last_success.set(at as f64 / 1000.0);
        }
        registry.register_collector(Box::new(Scraped(sources)));
        Arc::new(Metrics {
            registry,
            plans,
            plan_errors,
            change_seconds,
            unit_jobs,
            restarts_issued,
            verification_failures,
            last_success,
            requests,
        })
    }

    /// Makes the engine feed these metrics from now on.
    pub fn observe(self: &Arc<Self>, engine: &Engine) {
        engine.set_observer(self.clone());
    }

    /// Counts a request to the socket or the metrics listener.
    pub fn request(&self, endpoint: &'static str, code: u16) {
        self.requests
            .get_or_create(&[("endpoint", endpoint), ("code", code_label(code))])
            .inc();
    }

    /// The metrics in the Prometheus text format (`openmetrics`: the OpenMetrics format).
    pub fn encode(&self, openmetrics: bool) -> String {
        let mut out = String::with_capacity(16 * 1024);
        let result = if openmetrics {
            prometheus_client::encoding::text::encode(&mut out, &self.registry)
        } else {
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        out
    }
}

fn code_label(code: u16) -> &'static str {
    match code {
        200 => "200",
        400 => "400",
        403 => "403",
        404 => "404",
        405 => "405",
        413 => "413",
        500 => "500",
        503 => "503",
        _ => "other",
    }
}

fn phase_label(phase: Phase) -> &'static str {
    match phase {
        Phase::Pending => "Pending",
        Phase::Preparing => "Preparing",
        Phase::Applying => "Applying",
        Phase::Restarting => "Restarting",
        Phase::Verifying => "Verifying",
        Phase::Succeeded => "Succeeded",
        Phase::Failed => "Failed",
        Phase::RollingBack => "RollingBack",
        Phase::RolledBack => "RolledBack",
        Phase::Superseded => "Superseded",
        Phase::Cancelled => "Cancelled",
    }
}

impl RecordObserver for Metrics {
    fn journaled(&self, record: &Record, ts: u64, status: Option<&PlanStatus>) {
        match record {
            Record::PlanFinished { phase, error, .. } => {
                let phase = Phase::from(*phase);
                self.plans
                    .get_or_create(&[("result", phase_label(phase))])
                    .inc();
                if let Some(e) = error {
                    self.plan_errors
                        .get_or_create(&[("kind", e.kind.as_str())])
                        .inc();
                }
                if phase == Phase::Succeeded {
                    self.last_success.set(ts as f64 / 1000.0);
                }
            }
            Record::StepDone { index, .. } | Record::StepFailed { index, .. } => {
                let Some(change) = status.and_then(|s| s.changes.get(*index as usize)) else {
                    return;
                };
                let result = match change.state {
                    ChangeState::Changed => "changed",
                    ChangeState::Unchanged => "unchanged",
                    ChangeState::Failed => "failed",
                    _ => return,
                };
                if let Some(ms) = change.duration_ms {
                    self.change_seconds
                        .get_or_create(&[("kind", change.kind.as_str()), ("result", result)])
                        .observe(ms as f64 / 1000.0);
                }
            }
            Record::UnitJobStarted {
                job: UnitJob::Restart,
                ..
            } => {
                self.restarts_issued.inc();
            }
            Record::UnitJobDone { job, outcome, .. } => {
                self.unit_jobs
                    .get_or_create(&[("job", job.verb()), ("outcome", outcome_label(*outcome))])
                    .inc();
            }
            Record::UnitRestarted { skipped, .. } => {
                let outcome = if *skipped {
                    UnitJobOutcome::Skipped
                } else {
                    UnitJobOutcome::Done
                };
                self.unit_jobs
                    .get_or_create(&[("job", "restart"), ("outcome", outcome_label(outcome))])
                    .inc();
            }
            Record::CheckDone {
                index,
                passed: false,
                ..
            } => {
                let kind = status
                    .and_then(|s| s.checks.get(*index as usize))
                    .map(|c| check_kind_label(&c.kind))
                    .unwrap_or("unknown");
                self.verification_failures
                    .get_or_create(&[("kind", kind)])
                    .inc();
            }
            _ => {}
        }
    }
}

fn outcome_label(outcome: UnitJobOutcome) -> &'static str {
    match outcome {
        UnitJobOutcome::Done => "done",
        UnitJobOutcome::Skipped => "skipped",
        UnitJobOutcome::Failed => "failed",
    }
}

/// The check kinds plans can name (a bounded label).
fn check_kind_label(kind: &str) -> &'static str {
    const KINDS: [&str; 5] = [
        "httpGet",
        "command",
        "unitActive",
        "kubeletVersion",
        "controlPlane",
    ];
    KINDS.into_iter().find(|k| *k == kind).unwrap_or("other")
}

/// Values read when scraped.
#[derive(Debug)]
struct Scraped(Sources);

fn counter(encoder: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    let e = encoder.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(e)
}

fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, v: i64) -> std::fmt::Result {
    let g = ConstGauge::new(v);
    let e = encoder.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(e)
}

fn labelled(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: MetricType,
    label: &'static str,
    values: &[(&'static str, i64)],
) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (value, n) in values {
        let labels = [(label, *value)];
        let e = family.encode_family(&labels)?;
        match metric_type {
            MetricType::Counter => ConstCounter::new(*n as u64).encode(e)?,
            _ => ConstGauge::new(*n).encode(e)?,
        }
    }
    Ok(())
}

impl Collector for Scraped {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        let (phase, step, steps) = s.engine.read(|t| {
            t.unfinished()
                .next()
                .and_then(|(run, _)| t.by_run(*run))
                .map(|p| (phase_label(p.phase), p.progress.current, p.progress.total))
                .unwrap_or(("Idle", 0, 0))
        });
        let phases: Vec<(&'static str, i64)> = LIVE_PHASES
            .iter()
            .map(|p| (*p, i64::from(*p == phase)))
            .collect();
        labelled(
            &mut encoder,
            "phase",
            "The phase of the plan running now (1), or Idle.",
            MetricType::Gauge,
            "phase",
            &phases,
        )?;
        gauge(
            &mut encoder,
            "current_plan_step",
            "Step i of the plan running now (0 when idle).",
            i64::from(step),
        )?;
        gauge(
            &mut encoder,
            "current_plan_steps",
            "Steps (changes plus gates) of the plan running now (0 when idle).",
            i64::from(steps),
        )?;
        let journal = s.engine.journal_info();
        gauge(
            &mut encoder,
            "journal_records",
            "Records in the journal file.",
            journal.records as i64,
        )?;
        gauge(
            &mut encoder,
            "journal_bytes",
            "Size of the journal file in bytes.",
            journal.bytes as i64,
        )?;
        counter(
            &mut encoder,
            "tls_handshakes",
            "TLS handshakes of the gRPC listener that succeeded.",
            s.tls.handshakes(),
        )?;
        let failures: Vec<(&'static str, i64)> = s
            .tls
            .failures_by_reason()
            .into_iter()
            .map(|(r, n)| (r.as_str(), n as i64))
            .collect();
        labelled(
            &mut encoder,
            "tls_handshake_failures",
            "TLS handshakes of the gRPC listener that failed, by reason.",
            MetricType::Counter,
            "reason",
            &failures,
        )?;
        counter(
            &mut encoder,
            "tls_reloads",
            "Changed TLS files loaded without a restart.",
            s.tls.reloads(),
        )?;
        counter(
            &mut encoder,
            "tls_reload_failures",
            "Changed TLS files that were rejected (the previous ones stay in use).",
            s.tls.reload_failures(),
        )?;
        if let Some(t) = s.tls.server_cert_not_after() {
            gauge(
                &mut encoder,
                "tls_server_certificate_expiry_timestamp_seconds",
                "When the server certificate in use expires (Unix seconds).",
                t,
            )?;
        }
        counter(
            &mut encoder,
            "rpc_allowed",
            "gRPC calls allowed by authorization.",
            s.authz.allowed(),
        )?;
        let denied: Vec<(&'static str, i64)> = s
            .authz
            .denied_by_reason()
            .into_iter()
            .map(|(r, n)| (r, n as i64))
            .collect();
        labelled(
            &mut encoder,
            "rpc_denied",
            "gRPC calls denied by authorization, by reason.",
            MetricType::Counter,
            "reason",
            &denied,
        )?;
        let submissions = [
            ("accepted", s.service.accepted() as i64),
            ("existing", s.service.existing() as i64),
            ("refused", s.service.refused() as i64),
        ];
        labelled(
            &mut encoder,
            "plan_submissions",
            "ApplyPlan calls: a new attempt accepted, an existing plan answered, or refused.",
            MetricType::Counter,
            "outcome",
            &submissions,
        )?;
        gauge(
            &mut encoder,
            "start_time_seconds",
            "When the agent started (Unix seconds).",
            (s.started_at_ms / 1000) as i64,
        )?;
        let drift = s.engine.drift();
        let by_kind = drift.by_kind();
        let drifted: Vec<(&'static str, i64)> = inplace_plan::ChangeKind::ALL
            .iter()
            .map(|k| (k.as_str(), by_kind.get(k).copied().unwrap_or(0) as i64))
            .collect();
        labelled(
            &mut encoder,
            "drifted_changes",
            "Changes of the last succeeded plan that the node no longer matches, by kind, \
             as of the last drift check.",
            MetricType::Gauge,
            "kind",
            &drifted,
        )?;
        counter(
            &mut encoder,
            "drift_events",
            "Times drift appeared (a change of the last succeeded plan newly found drifted) \
             since the agent started.",
            drift.events,
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SettingsInput;
    use crate::host::Host;
    use crate::host::systemd::UnitBefore;
    use inplace_base::{ErrorInfo, ErrorKind};

    fn metrics() -> (tempfile::TempDir, Arc<Metrics>, Engine) {
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
        let m = Metrics::new(Sources {
            engine: engine.clone(),
            tls: Arc::default(),
            authz: Arc::default(),
            service: Arc::default(),
            started_at_ms: 1_700_000_000_000,
        });
        (dir, m, engine)
    }

    fn line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
        text.lines().find(|l| l.starts_with(prefix))
    }

    /// Records the daemon cannot produce without a real systemd (unit jobs) are counted as
    /// the engine journals them.
    #[test]
    fn unit_jobs_and_failures_are_counted_from_records() {
        let (_dir, m, _engine) = metrics();
        let before = UnitBefore::default();
        for rollback in [false, true] {
            m.journaled(
                &Record::UnitJobStarted {
                    run: 1,
                    unit: "kubelet.service".into(),
                    job: UnitJob::Restart,
                    rollback,
                    before: before.clone(),
                },
                0,
                None,
            );
        }
        m.journaled(
            &Record::UnitJobStarted {
                run: 1,
                unit: "x.service".into(),
                job: UnitJob::Start,
                rollback: false,
                before,
            },
            0,
            None,
        );
        m.journaled(
            &Record::UnitJobDone {
                run: 1,
                unit: "kubelet.service".into(),
                job: UnitJob::Restart,
                rollback: false,
                outcome: UnitJobOutcome::Failed,
                message: String::new(),
            },
            0,
            None,
        );
        m.journaled(
            &Record::PlanFinished {
                run: 1,
                phase: Phase::RolledBack.into(),
                error: Some(ErrorInfo {
                    kind: ErrorKind::Systemd,
                    step: None,
                    detail: "x".into(),
                }),
            },
            0,
            None,
        );
        m.journaled(
            &Record::PlanFinished {
                run: 2,
                phase: Phase::Succeeded.into(),
                error: None,
            },
            1_800_000_000_500,
            None,
        );
        let text = m.encode(false);
        assert_eq!(
            line(&text, "inplace_agent_unit_restarts_issued_total "),
            Some("inplace_agent_unit_restarts_issued_total 2"),
            "{text}"
        );
        assert!(
            text.contains("inplace_agent_unit_jobs_total{job=\"restart\",outcome=\"failed\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("inplace_agent_plans_total{result=\"RolledBack\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("inplace_agent_plan_errors_total{kind=\"systemd\"} 1"),
            "{text}"
        );
        assert_eq!(
            line(&text, "inplace_agent_last_success_timestamp_seconds "),
            Some("inplace_agent_last_success_timestamp_seconds 1800000000.5"),
            "{text}"
        );
        assert!(
            text.contains("inplace_agent_phase{phase=\"Idle\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("inplace_agent_build_info{version=\""),
            "{text}"
        );
        let open = m.encode(true);
        assert!(open.ends_with("# EOF\n"), "{open}");
    }
}

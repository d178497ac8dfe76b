//! The updater's Prometheus metrics (`GET /metrics`): requests by hook and outcome, the
//! in-place decisions by hook, outcome and reason class ([`super::why::Class`]), their
//! latency, plans submitted, agents found unreachable, serving certificate reloads, the
//! drain's (started, finished, timed out, pods evicted, evictions refused, duration). Label
//! values are bounded (hook names and outcome words, never Machine names).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels3 = [(&'static str, &'static str); 3];
type Labels2 = [(&'static str, &'static str); 2];
type Labels1 = [(&'static str, &'static str); 1];

const LATENCY_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

fn histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// Counters read at scrape time from elsewhere.
#[derive(Debug, Default)]
pub struct Scraped {
    /// Agent calls that found the agent unreachable.
    pub agents_unreachable: AtomicU64,
    /// Serving certificate reloads.
    pub tls_reloads: AtomicU64,
    /// Serving certificate reloads that failed (the old certificate stays).
    pub tls_reload_failures: AtomicU64,
}

struct ScrapedCollector(Arc<Scraped>, Arc<dyn Fn() -> u64 + Send + Sync>);

impl std::fmt::Debug for ScrapedCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ScrapedCollector").field(&self.0).finish()
    }
}

impl prometheus_client::collector::Collector for ScrapedCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let mut counter = |name: &str, help: &str, value: u64| -> std::fmt::Result {
            let c = ConstCounter::new(value);
            let e = encoder.encode_descriptor(name, help, None, c.metric_type())?;
            c.encode(e)
        };
        counter(
            "agents_unreachable",
            "Calls to an agent that could not reach it (connect, TLS, timeout, wrong node)",
            (self.1)(),
        )?;
        counter(
            "tls_reloads",
            "Serving certificate reloads after its files changed",
            self.0.tls_reloads.load(Ordering::Relaxed),
        )?;
        counter(
            "tls_reload_failures",
            "Serving certificate reloads that failed (the previous certificate stays in use)",
            self.0.tls_reload_failures.load(Ordering::Relaxed),
        )
    }
}

/// Machines waiting on an unreachable agent, read at scrape time: how many, and the age in
/// seconds of the oldest wait ([`super::unreachable::Waits::gauges`]).
pub type WaitGauges = Arc<dyn Fn() -> (u64, f64) + Send + Sync>;

#[derive(Default)]
struct WaitCollector(Arc<Mutex<Option<WaitGauges>>>);

impl std::fmt::Debug for WaitCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WaitCollector")
    }
}

impl prometheus_client::collector::Collector for WaitCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let read = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let (machines, oldest) = read.map_or((0, 0.0), |f| f());
        let g = ConstGauge::new(i64::try_from(machines).unwrap_or(i64::MAX));
        let e = encoder.encode_descriptor(
            "unreachable_machines",
            "Machines whose UpdateMachine waits on an agent that cannot be reached",
            None,
            g.metric_type(),
        )?;
        g.encode(e)?;
        let g = ConstGauge::new(oldest);
        let e = encoder.encode_descriptor(
            "unreachable_oldest_seconds",
            "Age of the oldest wait on an unreachable agent (0: none)",
            None,
            g.metric_type(),
        )?;
        g.encode(e)
    }
}

/// The fleet's progress, read at scrape time ([`super::progress::Plans::census`]).
pub type FleetCensus = Arc<dyn Fn() -> super::progress::Census + Send + Sync>;

/// At most this many `cluster` label values; the Machines of the rest are `cluster="other"`.
pub const MAX_CLUSTERS: usize = 500;

const DURATION_BUCKETS: [f64; 12] = [
    1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
];

fn duration_histogram() -> Histogram {
    Histogram::new(DURATION_BUCKETS)
}

#[derive(Default)]
struct FleetCollector(Arc<Mutex<Option<FleetCensus>>>);

impl std::fmt::Debug for FleetCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetCollector")
    }
}

impl prometheus_client::collector::Collector for FleetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let read = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let census = read.map(|f| f()).unwrap_or_default();
        let help = format!(
            "Machines this updater is updating in place or updated in the last 10 minutes, by \
             workload cluster and plan phase (submitting, pending, running, rebooting, \
             succeeded, failed, rolled_back, unreachable); at most {MAX_CLUSTERS} clusters, \
             the rest under cluster=\"other\""
        );
        let mut family = encoder.encode_descriptor(
            "machines",
            &help,
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (cluster, phase, n) in &census.machines {
            let g = ConstGauge::new(i64::try_from(*n).unwrap_or(i64::MAX));
            g.encode(family.encode_family(&[("cluster", cluster.as_str()), ("phase", phase)])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "oldest_update_seconds",
            "Age of the oldest unfinished in-place update by workload cluster (since this \
             replica took it up)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (cluster, age) in &census.oldest {
            ConstGauge::new(*age)
                .encode(family.encode_family(&[("cluster", cluster.as_str())])?)?;
        }
        Ok(())
    }
}

/// The registry and the counters the server feeds.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels2, Counter>,
    decisions: Family<Labels3, Counter>,
    latency: Family<Labels1, Histogram, fn() -> Histogram>,
    plans_submitted: Counter,
    plan_failures: Family<Labels1, Counter>,
    waits: WaitCollector,
    fleet: FleetCollector,
    plan_duration: Family<Labels1, Histogram, fn() -> Histogram>,
    /// The drain's ([`super::drain`]).
    pub drain: DrainMetrics,
    /// Counters read at scrape time.
    pub scraped: Arc<Scraped>,
}

impl Metrics {
    /// New metrics; `unreachable` reads the agent pool's counter at scrape time.
    pub fn new(unreachable: Arc<dyn Fn() -> u64 + Send + Sync>) -> Arc<Metrics> {
        let mut registry = Registry::with_prefix("inplace_updater");
        let requests = Family::<Labels2, Counter>::default();
        registry.register(
            "requests",
            "Hook requests answered, by hook and outcome (success, failure, covered, partial, not_covered, in_progress, done)",
            requests.clone(),
        );
        let decisions = Family::<Labels3, Counter>::default();
        registry.register(
            "decisions",
            "CanUpdateMachineSet and CanUpdateMachine answers, by hook, outcome (covered, \
             partial, not_covered) and the class of the reason a change is not in place \
             (none when it is: field-not-in-place, unsupported-bootstrap, agent-capability, \
             agent-refused, unreachable, agent-trust, translation, skew, downgrade, lookup, \
             settings)",
            decisions.clone(),
        );
        let latency =
            Family::<Labels1, Histogram, fn() -> Histogram>::new_with_constructor(histogram);
        registry.register(
            "request_duration_seconds",
            "Time from the request's body read to the response, by hook",
            latency.clone(),
        );
        let plans_submitted = Counter::default();
        registry.register(
            "plans_submitted",
            "Plans an agent accepted as new work (ApplyPlan created an attempt)",
            plans_submitted.clone(),
        );
        let plan_failures = Family::<Labels1, Counter>::default();
        registry.register(
            "plan_failures",
            "Machines whose update ended badly, by kind (failed, rolled_back, unreachable_timeout, refused)",
            plan_failures.clone(),
        );
        let plan_duration = Family::<Labels1, Histogram, fn() -> Histogram>::new_with_constructor(
            duration_histogram,
        );
        registry.register(
            "plan_duration_seconds",
            "Time from a plan's submission (or this replica taking it up) to its terminal phase, by outcome (succeeded, failed, rolled_back)",
            plan_duration.clone(),
        );
        let fleet = FleetCollector::default();
        registry.register_collector(Box::new(FleetCollector(fleet.0.clone())));
        let waits = WaitCollector::default();
        registry.register_collector(Box::new(WaitCollector(waits.0.clone())));
        let drain = DrainMetrics::register(&mut registry);
        let scraped = Arc::new(Scraped::default());
        registry.register_collector(Box::new(ScrapedCollector(scraped.clone(), unreachable)));
        Arc::new(Metrics {
            registry,
            requests,
            decisions,
            latency,
            plans_submitted,
            plan_failures,
            waits,
            fleet,
            plan_duration,
            drain,
            scraped,
        })
    }

    /// Counts an answered request.
    pub fn request(&self, hook: &'static str, outcome: &'static str, seconds: f64) {
        self.requests
            .get_or_create(&[("hook", hook), ("outcome", outcome)])
            .inc();
        self.latency
            .get_or_create(&[("hook", hook)])
            .observe(seconds);
    }

    /// Counts a `CanUpdate*` decision: `outcome` (`covered`, `partial`, `not_covered`; a
    /// Failure answer is counted as `failure`) and the class of why it is not everything in
    /// place (`None`: it is).
    pub fn decision(
        &self,
        hook: &'static str,
        outcome: &'static str,
        class: Option<super::why::Class>,
    ) {
        let reason = class.map_or("none", super::why::Class::as_str);
        self.decisions
            .get_or_create(&[("hook", hook), ("outcome", outcome), ("reason", reason)])
            .inc();
    }

    /// Counts a plan an agent accepted as new.
    pub fn plan_submitted(&self) {
        self.plans_submitted.inc();
    }

    /// Counts a Machine whose update ended badly (`kind`: `failed`, `rolled_back`,
    /// `unreachable_timeout`, `refused`).
    pub fn plan_failure(&self, kind: &'static str) {
        self.plan_failures.get_or_create(&[("kind", kind)]).inc();
    }

    /// A plan reached a terminal phase after `seconds`: its duration, and a failure of
    /// kind `failed` or `rolled_back`.
    pub fn plan_ended(&self, outcome: &'static str, seconds: f64) {
        self.plan_duration
            .get_or_create(&[("outcome", outcome)])
            .observe(seconds);
        if outcome == "failed" || outcome == "rolled_back" {
            self.plan_failure(outcome);
        }
    }

    /// Where the fleet gauges are read from.
    pub fn read_fleet(&self, census: FleetCensus) {
        *self.fleet.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(census);
    }

    /// Where the unreachable-agent gauges are read from.
    pub fn read_waits(&self, gauges: WaitGauges) {
        *self.waits.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(gauges);
    }

    /// How many requests of `hook` ended with `outcome` (tests).
    pub fn requests(&self, hook: &'static str, outcome: &'static str) -> u64 {
        self.requests
            .get_or_create(&[("hook", hook), ("outcome", outcome)])
            .get()
    }

    /// The Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(8 * 1024);
        if let Err(e) =
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
        {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        out
    }
}

/// Seconds a drain may take, from a node with nothing to evict to hours of a PDB holding.
const DRAIN_BUCKETS: [f64; 12] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
];

/// The drain's metrics (counted by the replica that saw the event; a drain continued by
/// another replica is counted there).
#[derive(Debug, Clone)]
pub struct DrainMetrics {
    /// Drains begun (the node cordoned and marked for a plan).
    pub started: Counter,
    /// Drains finished (nothing left to evict; the plan is submitted next).
    pub finished: Counter,
    /// Drains past their timeout (`onDrainTimeout` decides what follows).
    pub timed_out: Counter,
    /// Evictions the API server accepted.
    pub pods_evicted: Counter,
    /// Evictions refused by a PodDisruptionBudget (429), retried on a later call.
    pub evictions_refused: Counter,
    /// From the drain's start (the Node's mark) to its end.
    pub duration: Histogram,
}

impl DrainMetrics {
    fn register(registry: &mut Registry) -> DrainMetrics {
        let m = DrainMetrics {
            started: Counter::default(),
            finished: Counter::default(),
            timed_out: Counter::default(),
            pods_evicted: Counter::default(),
            evictions_refused: Counter::default(),
            duration: Histogram::new(DRAIN_BUCKETS),
        };
        registry.register(
            "drains_started",
            "Drains begun before a disruptive plan (node cordoned and marked)",
            m.started.clone(),
        );
        registry.register(
            "drains_finished",
            "Drains that left nothing to evict (the plan is submitted next)",
            m.finished.clone(),
        );
        registry.register(
            "drains_timed_out",
            "Drains past drainTimeoutSeconds or the Machine's nodeDrainTimeoutSeconds",
            m.timed_out.clone(),
        );
        registry.register(
            "pods_evicted",
            "Pod evictions the workload cluster's API server accepted",
            m.pods_evicted.clone(),
        );
        registry.register(
            "evictions_refused",
            "Pod evictions refused by a PodDisruptionBudget (HTTP 429), retried later",
            m.evictions_refused.clone(),
        );
        registry.register(
            "drain_duration_seconds",
            "Time from a drain's start (the mark on the Node) to its end",
            m.duration.clone(),
        );
        m
    }
}

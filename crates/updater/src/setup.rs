//! Putting the updater together: its Kubernetes client, the agents' client, its metrics
//! and its serving certificate (shared by `serve`, the demo and the tests).

use std::sync::Arc;

use anyhow::Context as _;

use super::agent::Agents;
use super::cluster::Cluster;
use super::edge::extension_config::ExtensionConfigs;
use super::handlers::Updater;
use super::metrics::Metrics;
use super::progress::Plans;
use super::recovery::Recovery;
use super::server::ServingTls;
use super::settings::Defaults;
use crate::edge::kubeconfig::LocalServers;

/// Builds the updater and its serving TLS (shared by `serve`, the demo and the tests).
pub async fn build(
    tls_cert: &std::path::Path,
    tls_key: &std::path::Path,
    agent_files: impl Into<super::agent::ClientFiles>,
    agent_port: u16,
    kubeconfig: Option<&std::path::Path>,
    extension_configs: Vec<String>,
    local_workload_servers: LocalServers,
) -> anyhow::Result<(Arc<Updater>, Arc<ServingTls>)> {
    let agent_files = agent_files.into();
    let agent_ca_file = agent_files.ca.is_some();
    let agents = Arc::new(Agents::new(agent_files).context("agent client certificate")?);
    let cluster = Cluster::connect(kubeconfig).await?;
    let recovery = Arc::new(Recovery::new(cluster.clone(), agents.clone()));
    let not_in_place = Arc::new(super::events::NotInPlace::new(
        cluster.clone(),
        recovery.instance(),
    ));
    let updater = Arc::new_cyclic(|weak: &std::sync::Weak<Updater>| {
        let weak = weak.clone();
        let metrics = Metrics::new(Arc::new(move || {
            weak.upgrade()
                .map(|u| {
                    u.agents
                        .unreachable
                        .load(std::sync::atomic::Ordering::Relaxed)
                })
                .unwrap_or(0)
        }));
        Updater {
            extension_configs: Arc::new(ExtensionConfigs::new(
                extension_configs,
                Defaults {
                    agent_port,
                    agent_ca_file,
                },
            )),
            cluster,
            agents,
            plans: Arc::new(Plans::new()),
            metrics,
            recovery,
            not_in_place,
            cluster_cas: Default::default(),
            waits: Default::default(),
            drains: Arc::new({
                let mut drains = super::handlers::Drains::default();
                drains.workloads = super::workload::Workloads::new(local_workload_servers);
                drains
            }),
        }
    });
    let waits = Arc::downgrade(&updater.waits);
    updater.metrics.read_waits(Arc::new(move || {
        waits
            .upgrade()
            .map_or((0, 0.0), |w| w.gauges(inplace_base::time::now_ms()))
    }));
    let metrics = Arc::downgrade(&updater.metrics);
    updater.plans.on_end(Box::new(move |outcome, took| {
        if let Some(m) = metrics.upgrade() {
            m.plan_ended(outcome, took.as_secs_f64());
        }
    }));
    let (plans, waits) = (
        Arc::downgrade(&updater.plans),
        Arc::downgrade(&updater.waits),
    );
    updater.metrics.read_fleet(Arc::new(move || {
        let unreachable = waits.upgrade().map(|w| w.clusters()).unwrap_or_default();
        plans
            .upgrade()
            .map(|p| p.census(&unreachable, super::metrics::MAX_CLUSTERS))
            .unwrap_or_default()
    }));
    let tls = Arc::new(
        ServingTls::new(
            tls_cert.to_path_buf(),
            tls_key.to_path_buf(),
            updater.metrics.scraped.clone(),
        )
        .context("serving certificate")?,
    );
    Ok((updater, tls))
}

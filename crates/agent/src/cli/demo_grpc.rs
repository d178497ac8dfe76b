//! The demo's node API section: a throwaway PKI in the sandbox, a real `serve` (in-process,
//! on 127.0.0.1) over that sandbox, and the `submit` client's code driving it over mutual
//! TLS: node info, apply and watch, the hook response, an idempotent re-apply, and a reader
//! identity refused an apply.

use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;

use super::remote::{TlsArgs, connect_agent, follow, hook_response_json};
use super::serve::Daemon;
use crate::config::{DaemonInput, SettingsInput};
use crate::rpc::replies::phase_from_pb;
use inplace_api::convert::plan_to_pb;
use inplace_api::pb;
use inplace_api::pki::{DEFAULT_READER_IDENTITY, DEFAULT_UPDATER_IDENTITY, PkiInitOptions};
use inplace_plan::{Limits, parse_plan};

/// The sandbox node's name in this section.
const NODE: &str = "demo-node";

const PLAN: &str = r#"
apiVersion: inplace.agent/v1
kind: Plan
id: default/md-0-7d9f4-abcde@api-demo
nodeName: demo-node
changes:
  - file:
      path: /etc/kubernetes/inplace-demo.conf
      content: "delivered over gRPC with mutual TLS\n"
      mode: "0640"
      restartUnits: [kubelet.service]
  - kubeletConfig: {mergePatch: {maxPods: 120}}
verify:
  - httpGet: {url: "http://127.0.0.1:10248/healthz", expectStatus: 200, timeoutSeconds: 30}
"#;

/// Runs the section; true when everything behaved as the demo says.
pub fn section(n: u32, dir: &Path, kubelet_port: u16, plain: bool) -> anyhow::Result<bool> {
    super::render::heading(
        n,
        "the node API: `serve` over mutual TLS, driven by the `submit` client",
    );
    let pki = dir.join("etc/inplace-agent/pki");
    let files = inplace_api::pki::init(&PkiInitOptions::new(&pki, NODE)).context("pki init")?;
    outln!(
        "  pki init {}: a throwaway CA, a server certificate for {NODE}, an updater (admin) and \
         a reader client certificate (not for production)",
        pki.display()
    );
    let pattern = |s: &str| s.parse().map_err(|e| anyhow::anyhow!("{e}"));
    let settings = DaemonInput {
        settings: SettingsInput {
            root: Some(dir.to_path_buf()),
            node_name: Some(NODE.into()),
            no_chroot: true,
            services_off: true,
            ..SettingsInput::default()
        },
        listen: Some(([127, 0, 0, 1], 0).into()),
        tls_cert: Some(files.server_cert.clone()),
        tls_key: Some(files.server_key.clone()),
        client_ca: Some(files.ca_cert.clone()),
        admin: Some(vec![pattern(DEFAULT_UPDATER_IDENTITY)?]),
        reader: Some(vec![pattern(DEFAULT_READER_IDENTITY)?]),
        ..DaemonInput::default()
    }
    .resolve()
    .map_err(anyhow::Error::msg)?;
    let text = PLAN.replace("127.0.0.1:10248", &format!("127.0.0.1:{kubelet_port}"));
    let plan = parse_plan(text.as_bytes(), "api-demo", &Limits::default())?;
    let tls = |cert: &Path, key: &Path| TlsArgs {
        ca: Some(files.ca_cert.clone()),
        cert: Some(cert.to_path_buf()),
        key: Some(key.to_path_buf()),
        server_name: Some(NODE.into()),
    };
    let updater = tls(&files.updater_cert, &files.updater_key);
    let reader = tls(&files.reader_cert, &files.reader_key);

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(async {
        let daemon = Daemon::start(settings).await?;
        let addr = daemon.addr().to_string();
        outln!(
            "  serve: listening on {addr} as node {NODE}: TLS 1.3, client certificate required \
             (clientAuth), admin {DEFAULT_UPDATER_IDENTITY}, reader {DEFAULT_READER_IDENTITY}"
        );
        let outcome = drive(&addr, &plan, &updater, &reader, plain).await;
        daemon.stop().await?;
        outln!("  serve: stopped (SIGTERM does the same: the current step finishes first)");
        outcome
    })
}

async fn drive(
    addr: &str,
    plan: &inplace_plan::Plan,
    updater: &TlsArgs,
    reader: &TlsArgs,
    plain: bool,
) -> anyhow::Result<bool> {
    let mut client = connect_agent(addr, updater).await?;
    let info = client
        .get_node_info(pb::GetNodeInfoRequest {})
        .await
        .context("GetNodeInfo")?
        .into_inner();
    outln!(
        "  GetNodeInfo: node {}, agent {}, kernel {}, supported changes: {}",
        info.node_name,
        info.agent_version,
        info.os.map(|o| o.kernel_release).unwrap_or_default(),
        info.supported_change_kinds.join(", ")
    );
    let apply = || pb::ApplyPlanRequest {
        plan: Some(plan_to_pb(plan)),
        retry: false,
    };
    let first = client
        .apply_plan(apply())
        .await
        .context("ApplyPlan")?
        .into_inner();
    let accepted = first.status.unwrap_or_default();
    outln!(
        "  ApplyPlan {} as {DEFAULT_UPDATER_IDENTITY}: created={}, attempt {}, run {}; WatchPlan:",
        plan.id,
        first.created,
        accepted.attempt,
        accepted.run
    );
    let done = follow(&mut client, &plan.id, plain, Duration::from_secs(120)).await?;
    let hook = done.hook_response.clone().unwrap_or_default();
    outln!("  hook response: {}", hook_response_json(&hook));
    let again = client
        .apply_plan(apply())
        .await
        .context("ApplyPlan again")?
        .into_inner();
    let again_status = again.status.unwrap_or_default();
    outln!(
        "  ApplyPlan again (CAPI polls UpdateMachine): created={}, the same run {}, the same hook \
         response: {}",
        again.created,
        again_status.run,
        again_status.hook_response == done.hook_response
    );

    let mut read_only = connect_agent(addr, reader).await?;
    let seen = read_only
        .get_plan_status(pb::GetPlanStatusRequest {
            id: plan.id.clone(),
        })
        .await
        .context("GetPlanStatus as reader")?
        .into_inner();
    let refused = read_only.apply_plan(apply()).await;
    let refusal = match &refused {
        Ok(_) => "ACCEPTED (this is a bug)".to_owned(),
        Err(status) => format!("{:?}: {}", status.code(), status.message()),
    };
    outln!(
        "  as {DEFAULT_READER_IDENTITY}: GetPlanStatus answers {:?}; ApplyPlan is refused: {refusal}",
        phase_from_pb(seen.phase)
            .map(|p| p.to_string())
            .unwrap_or_default()
    );
    Ok(first.created
        && phase_from_pb(done.phase) == Some(crate::engine::state::Phase::Succeeded)
        && !again.created
        && again_status.run == accepted.run
        && matches!(&refused, Err(s) if s.code() == tonic::Code::PermissionDenied))
}

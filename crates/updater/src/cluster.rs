//! The management cluster, through kube-rs: the live Machine (status: nodeRef, addresses;
//! annotations), its KubeadmConfig, the Secrets `files[].contentFrom` names and the
//! workload cluster's `<cluster>-ca` Secret ([`super::trust`]) and `<cluster>-kubeconfig`
//! Secret (the drain, [`super::drain`]), each by `get` by name; two lists, of the Machines of
//! a MachineSet by its label selector (`CanUpdateMachineSet`) and of MachineDrainRules;
//! the updater never watches. Two writes, for a failed plan
//! ([`super::recovery`]): `create` of an Event on the Machine, and a merge `patch` of one
//! annotation of the Machine (the retry it acted on). Its RBAC allows exactly this.
//!
//! Objects come back as JSON values (`DynamicObject` serialised), so the handlers read the
//! same shapes as in hook requests.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::Value;

use super::translate::lookup;

/// `cluster.x-k8s.io/v1beta2` Machine.
pub fn machine_resource() -> ApiResource {
    ApiResource {
        group: "cluster.x-k8s.io".into(),
        version: "v1beta2".into(),
        api_version: "cluster.x-k8s.io/v1beta2".into(),
        kind: "Machine".into(),
        plural: "machines".into(),
    }
}

/// `bootstrap.cluster.x-k8s.io/v1beta2` KubeadmConfig.
pub fn kubeadm_config_resource() -> ApiResource {
    ApiResource {
        group: "bootstrap.cluster.x-k8s.io".into(),
        version: "v1beta2".into(),
        api_version: "bootstrap.cluster.x-k8s.io/v1beta2".into(),
        kind: "KubeadmConfig".into(),
        plural: "kubeadmconfigs".into(),
    }
}

/// `cluster.x-k8s.io/v1beta2` MachineSet.
pub fn machine_set_resource() -> ApiResource {
    ApiResource {
        group: "cluster.x-k8s.io".into(),
        version: "v1beta2".into(),
        api_version: "cluster.x-k8s.io/v1beta2".into(),
        kind: "MachineSet".into(),
        plural: "machinesets".into(),
    }
}

/// `runtime.cluster.x-k8s.io/v1beta2` ExtensionConfig (cluster-scoped): where the operator
/// registers the updater and writes its settings.
pub fn extension_config_resource() -> ApiResource {
    ApiResource {
        group: "runtime.cluster.x-k8s.io".into(),
        version: "v1beta2".into(),
        api_version: "runtime.cluster.x-k8s.io/v1beta2".into(),
        kind: "ExtensionConfig".into(),
        plural: "extensionconfigs".into(),
    }
}

/// `v1` Event (the core API's, which `kubectl describe` lists).
pub fn event_resource() -> ApiResource {
    ApiResource {
        group: String::new(),
        version: "v1".into(),
        api_version: "v1".into(),
        kind: "Event".into(),
        plural: "events".into(),
    }
}

/// Most objects one list reads (the Machines of a MachineSet, a cluster's control-plane
/// Machines, a MachineDeployment's MachineSets); more is an error naming the limit.
pub const MAX_LISTED: u32 = 2000;

/// A request to the API server failed (not a 404 of a get, which is `Ok(None)`).
#[derive(Debug, thiserror::Error)]
#[error("{op} {what} {namespace}/{name}: {detail}")]
pub struct ClusterError {
    /// `get`, `create`, `patch`.
    pub op: &'static str,
    /// `Machine`, `KubeadmConfig`, `Secret`.
    pub what: &'static str,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// What the API server or the connection said.
    pub detail: String,
    /// The API server could not be reached or answered that it could not serve now (5xx,
    /// 429): the same request may well succeed in a moment ([`transient`]).
    pub transient: bool,
}

tokio::task_local! {
    /// The first read of this hook call that failed transiently ([`with_read_trouble`]).
    static READ_TROUBLE: std::cell::RefCell<Option<String>>;
}

/// Runs `f` (one hook call) and returns, beside its output, the first read of the
/// management cluster in it that failed transiently ([`ClusterError::transient`]), said as
/// the error says it. A decision made without what that read would have returned is no
/// decision (the handlers turn it into "ask again", decision 0023).
pub async fn with_read_trouble<F: std::future::Future>(f: F) -> (F::Output, Option<String>) {
    READ_TROUBLE
        .scope(std::cell::RefCell::new(None), async {
            let out = f.await;
            let trouble = READ_TROUBLE.with(|t| t.borrow_mut().take());
            (out, trouble)
        })
        .await
}

impl ClusterError {
    /// This error of a read (get or list), noted for [`with_read_trouble`] when it is
    /// transient. Outside a hook call (the CLI's `explain`) nothing is noted.
    fn read(self) -> ClusterError {
        if self.transient {
            let _ = READ_TROUBLE.try_with(|t| {
                let mut t = t.borrow_mut();
                if t.is_none() {
                    *t = Some(self.to_string());
                }
            });
        }
        self
    }
}

/// Whether `e` says nothing about the object, only that the API server could not answer
/// now: the connection failed or timed out, or it answered 5xx or 429 (too many requests).
pub fn transient(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(status) => status.code >= 500 || status.code == 429,
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_) => true,
        _ => false,
    }
}

/// The management cluster client.
#[derive(Clone)]
pub struct Cluster {
    client: kube::Client,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Cluster")
    }
}

impl Cluster {
    /// From a kubeconfig file, or the in-cluster service account when `None`.
    pub async fn connect(kubeconfig: Option<&Path>) -> anyhow::Result<Cluster> {
        let mut config = match kubeconfig {
            Some(path) => {
                let file = Kubeconfig::read_from(path)
                    .with_context(|| format!("read kubeconfig {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                    .await
                    .with_context(|| format!("load kubeconfig {}", path.display()))?
            }
            None => kube::Config::incluster()
                .context("in-cluster configuration (pass --kubeconfig outside a cluster)")?,
        };
        // Every hook must answer within CAPI's 10 s; a read never takes more than a few.
        config.connect_timeout = Some(Duration::from_secs(3));
        config.read_timeout = Some(Duration::from_secs(4));
        config.write_timeout = Some(Duration::from_secs(4));
        let client = kube::Client::try_from(config).context("build the Kubernetes client")?;
        Ok(Cluster { client })
    }

    async fn get_dynamic(
        &self,
        resource: &ApiResource,
        what: &'static str,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, ClusterError> {
        let api = Api::namespaced_with(self.client.clone(), namespace, resource);
        get_from(api, what, namespace, name).await
    }

    /// The live Machine (with status), or `None` when it does not exist.
    pub async fn machine(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, ClusterError> {
        self.get_dynamic(&machine_resource(), "Machine", namespace, name)
            .await
    }

    /// The live MachineSet, or `None` when it does not exist.
    pub async fn machine_set(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, ClusterError> {
        self.get_dynamic(&machine_set_resource(), "MachineSet", namespace, name)
            .await
    }

    /// The ExtensionConfig `name` (cluster-scoped), or `None` when it does not exist.
    pub async fn extension_config(&self, name: &str) -> Result<Option<Value>, ClusterError> {
        let api = Api::all_with(self.client.clone(), &extension_config_resource());
        get_from(api, "ExtensionConfig", "", name).await
    }

    /// The labels of Namespace `name`, or `None` when it does not exist.
    pub async fn namespace_labels(
        &self,
        name: &str,
    ) -> Result<Option<BTreeMap<String, String>>, ClusterError> {
        let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(self.client.clone());
        let object = api.get_opt(name).await.map_err(|e| {
            ClusterError {
                op: "get",
                what: "Namespace",
                namespace: String::new(),
                name: name.to_owned(),
                detail: e.to_string(),
                transient: transient(&e),
            }
            .read()
        })?;
        Ok(object.map(|n| n.metadata.labels.unwrap_or_default()))
    }

    /// The Machines of `namespace` with the labels of `selector` (`k=v,k=v`): the Machines
    /// of a MachineSet, by its `spec.selector` (`CanUpdateMachineSet`).
    pub async fn machines(
        &self,
        namespace: &str,
        selector: &str,
    ) -> Result<Vec<Value>, ClusterError> {
        self.list(&machine_resource(), "Machine", namespace, selector)
            .await
    }

    /// The live KubeadmConfig, or `None`.
    pub async fn kubeadm_config(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, ClusterError> {
        self.get_dynamic(&kubeadm_config_resource(), "KubeadmConfig", namespace, name)
            .await
    }

    /// A Secret's data (decoded bytes by key), or `None`.
    pub async fn secret(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<BTreeMap<String, Vec<u8>>>, ClusterError> {
        Ok(self
            .secret_versioned(namespace, name)
            .await?
            .map(|(_, data)| data))
    }

    /// A Secret's resourceVersion and data, or `None`.
    pub async fn secret_versioned(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<Option<(String, BTreeMap<String, Vec<u8>>)>, ClusterError> {
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let secret = api.get_opt(name).await.map_err(|e| {
            ClusterError {
                op: "get",
                what: "Secret",
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                detail: e.to_string(),
                transient: transient(&e),
            }
            .read()
        })?;
        Ok(secret.map(|s| {
            let version = s.metadata.resource_version.unwrap_or_default();
            let mut data: BTreeMap<String, Vec<u8>> = s
                .string_data
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.into_bytes()))
                .collect();
            for (k, v) in s.data.unwrap_or_default() {
                data.insert(k, v.0);
            }
            (version, data)
        }))
    }

    /// Creates an Event (a `v1` Event object as JSON); `Ok(false)` when one of that name
    /// exists already (409 AlreadyExists: another replica, or this one before a restart,
    /// created it).
    pub async fn create_event(&self, event: &Value) -> Result<bool, ClusterError> {
        let meta = |k: &str| {
            lookup(event, &["metadata", k])
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let (namespace, name) = (meta("namespace"), meta("name"));
        let err = |detail: String, transient: bool| ClusterError {
            op: "create",
            what: "Event",
            namespace: namespace.clone(),
            name: name.clone(),
            detail,
            transient,
        };
        let object: DynamicObject =
            serde_json::from_value(event.clone()).map_err(|e| err(e.to_string(), false))?;
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), &namespace, &event_resource());
        match api.create(&PostParams::default(), &object).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(err(e.to_string(), transient(&e))),
        }
    }

    /// Sets one annotation of a Machine (a JSON merge patch of that key alone).
    pub async fn annotate_machine(
        &self,
        namespace: &str,
        name: &str,
        key: &str,
        value: &str,
    ) -> Result<(), ClusterError> {
        self.patch_annotation(namespace, name, key, Value::from(value))
            .await
    }

    /// Removes one annotation of a Machine (a JSON merge patch of that key to null).
    pub async fn unannotate_machine(
        &self,
        namespace: &str,
        name: &str,
        key: &str,
    ) -> Result<(), ClusterError> {
        self.patch_annotation(namespace, name, key, Value::Null)
            .await
    }

    async fn patch_annotation(
        &self,
        namespace: &str,
        name: &str,
        key: &str,
        value: Value,
    ) -> Result<(), ClusterError> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, &machine_resource());
        let patch = serde_json::json!({"metadata": {"annotations": {key: value}}});
        api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map(drop)
            .map_err(|e| ClusterError {
                op: "patch",
                what: "Machine",
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                detail: e.to_string(),
                transient: transient(&e),
            })
    }
}

/// `cluster.x-k8s.io/v1beta2` MachineDrainRule.
pub fn machine_drain_rule_resource() -> ApiResource {
    ApiResource {
        group: "cluster.x-k8s.io".into(),
        version: "v1beta2".into(),
        api_version: "cluster.x-k8s.io/v1beta2".into(),
        kind: "MachineDrainRule".into(),
        plural: "machinedrainrules".into(),
    }
}

impl Cluster {
    /// The MachineDrainRules of `namespace` (the drain's only `list`; they live beside the
    /// Machines, and CAPI's drain lists them the same way).
    pub async fn machine_drain_rules(&self, namespace: &str) -> Result<Vec<Value>, ClusterError> {
        self.list(
            &machine_drain_rule_resource(),
            "MachineDrainRule",
            namespace,
            "",
        )
        .await
    }
}

/// `name` through `api` (namespaced or cluster-scoped), or `None` when it does not exist;
/// errors name `what`, `namespace` (empty: cluster-scoped) and `name`.
async fn get_from(
    api: Api<DynamicObject>,
    what: &'static str,
    namespace: &str,
    name: &str,
) -> Result<Option<Value>, ClusterError> {
    let err = |detail: String, transient: bool| {
        ClusterError {
            op: "get",
            what,
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            detail,
            transient,
        }
        .read()
    };
    let object = api
        .get_opt(name)
        .await
        .map_err(|e| err(e.to_string(), transient(&e)))?;
    object
        .map(|o| serde_json::to_value(o).map_err(|e| err(e.to_string(), false)))
        .transpose()
}

/// `cluster.x-k8s.io/v1beta2` MachineDeployment (`inplace-updater explain`).
pub fn machine_deployment_resource() -> ApiResource {
    ApiResource {
        group: "cluster.x-k8s.io".into(),
        version: "v1beta2".into(),
        api_version: "cluster.x-k8s.io/v1beta2".into(),
        kind: "MachineDeployment".into(),
        plural: "machinedeployments".into(),
    }
}

/// `controlplane.cluster.x-k8s.io/v1beta2` KubeadmControlPlane (`inplace-updater explain`).
pub fn kubeadm_control_plane_resource() -> ApiResource {
    ApiResource {
        group: "controlplane.cluster.x-k8s.io".into(),
        version: "v1beta2".into(),
        api_version: "controlplane.cluster.x-k8s.io/v1beta2".into(),
        kind: "KubeadmControlPlane".into(),
        plural: "kubeadmcontrolplanes".into(),
    }
}

/// `bootstrap.cluster.x-k8s.io/v1beta2` KubeadmConfigTemplate (`inplace-updater explain`).
pub fn kubeadm_config_template_resource() -> ApiResource {
    ApiResource {
        group: "bootstrap.cluster.x-k8s.io".into(),
        version: "v1beta2".into(),
        api_version: "bootstrap.cluster.x-k8s.io/v1beta2".into(),
        kind: "KubeadmConfigTemplate".into(),
        plural: "kubeadmconfigtemplates".into(),
    }
}

// === the not-in-place Events (`super::events`) and `explain`'s reads ===

impl Cluster {
    /// The Event `name`, or `None` (it expired, or was never created).
    pub async fn event(&self, namespace: &str, name: &str) -> Result<Option<Value>, ClusterError> {
        self.get_dynamic(&event_resource(), "Event", namespace, name)
            .await
    }

    /// A JSON merge patch of the Event `name`; `Ok(false)` when it does not exist (404).
    pub async fn patch_event(
        &self,
        namespace: &str,
        name: &str,
        patch: &Value,
    ) -> Result<bool, ClusterError> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, &event_resource());
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
            Err(e) => Err(ClusterError {
                op: "patch",
                what: "Event",
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                detail: e.to_string(),
                transient: transient(&e),
            }),
        }
    }

    /// Any namespaced object of `resource` by name, or `None` (`explain`).
    pub async fn object(
        &self,
        resource: &ApiResource,
        what: &'static str,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, ClusterError> {
        self.get_dynamic(resource, what, namespace, name).await
    }

    /// The objects of `resource` in `namespace` with the labels of `selector` (`k=v,k=v`;
    /// at most [`MAX_LISTED`], else an error saying so;
    /// `explain`: a MachineDeployment's MachineSets, a KubeadmControlPlane's Machines).
    pub async fn list(
        &self,
        resource: &ApiResource,
        what: &'static str,
        namespace: &str,
        selector: &str,
    ) -> Result<Vec<Value>, ClusterError> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.client.clone(), namespace, resource);
        let err = |detail: String, transient: bool| {
            ClusterError {
                op: "list",
                what,
                namespace: namespace.to_owned(),
                name: format!("?labelSelector={selector}"),
                detail,
                transient,
            }
            .read()
        };
        let list = api
            .list(
                &kube::api::ListParams::default()
                    .labels(selector)
                    .limit(MAX_LISTED),
            )
            .await
            .map_err(|e| err(e.to_string(), transient(&e)))?;
        if list
            .metadata
            .continue_
            .as_deref()
            .is_some_and(|c| !c.is_empty())
        {
            return Err(err(
                format!(
                    "more than {MAX_LISTED} match; the updater reads at most {MAX_LISTED} \
                     (so that the objects of one namespace cannot cost it unbounded memory)"
                ),
                false,
            ));
        }
        list.items
            .into_iter()
            .map(|o| serde_json::to_value(o).map_err(|e| err(e.to_string(), false)))
            .collect()
    }
}

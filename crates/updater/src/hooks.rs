//! The Runtime SDK wire: requests as Cluster API marshals them, responses as it decodes them.
//!
//! Requests are read as JSON values and checked field by field, so every problem names the
//! field (`desired.machine.metadata.name: missing`); unknown fields are ignored, as CAPI's
//! own decoder does. Responses are structs whose field order is CAPI's (`kind`,
//! `apiVersion`, `status`, `message`, then the hook's fields); CAPI does not care about the
//! order, but people comparing with its fixtures do. A [`Patch`] is always a `patchType`
//! together with a non-empty base64 `patch`: a `patchType` alone is decoded by CAPI as an
//! invalid patch, and the reconcile then errors forever instead of falling back to a rollout.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::Serialize;
use serde_json::{Map, Value};

/// `apiVersion` of every hook request and response.
pub const HOOKS_API_VERSION: &str = "hooks.runtime.cluster.x-k8s.io/v1alpha1";

/// Path prefix CAPI builds for hooks (`/<group>/<version>`).
pub const HOOKS_PATH_PREFIX: &str = "/hooks.runtime.cluster.x-k8s.io/v1alpha1";

/// The handler names this extension registers (discovery), one per hook.
pub const HANDLER_CAN_UPDATE_MACHINE: &str = "can-update-machine";
/// See [`HANDLER_CAN_UPDATE_MACHINE`].
pub const HANDLER_CAN_UPDATE_MACHINESET: &str = "can-update-machineset";
/// See [`HANDLER_CAN_UPDATE_MACHINE`].
pub const HANDLER_UPDATE_MACHINE: &str = "update-machine";

/// The annotation CAPI puts on a Machine (and its InfraMachine and BootstrapConfig) while
/// it is updated in place.
pub const UPDATE_IN_PROGRESS_ANNOTATION: &str =
    "in-place-updates.internal.cluster.x-k8s.io/update-in-progress";
/// The annotation listing the hooks CAPI still has to call for a Machine.
pub const PENDING_HOOKS_ANNOTATION: &str = "runtime.cluster.x-k8s.io/pending-hooks";

/// The hooks this extension answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Hook {
    /// `POST .../discovery`.
    Discovery,
    /// `CanUpdateMachine` (called by the KubeadmControlPlane controller).
    CanUpdateMachine,
    /// `CanUpdateMachineSet` (called by the MachineDeployment controller).
    CanUpdateMachineSet,
    /// `UpdateMachine` (called by the Machine controller).
    UpdateMachine,
}

impl Hook {
    /// Every hook, in discovery order.
    pub const ALL: [Hook; 4] = [
        Hook::Discovery,
        Hook::CanUpdateMachine,
        Hook::CanUpdateMachineSet,
        Hook::UpdateMachine,
    ];

    /// The hook's name as CAPI spells it (`CanUpdateMachine`), also the metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Hook::Discovery => "Discovery",
            Hook::CanUpdateMachine => "CanUpdateMachine",
            Hook::CanUpdateMachineSet => "CanUpdateMachineSet",
            Hook::UpdateMachine => "UpdateMachine",
        }
    }

    /// `kind` of the request (`CanUpdateMachineRequest`).
    pub fn request_kind(self) -> &'static str {
        match self {
            Hook::Discovery => "DiscoveryRequest",
            Hook::CanUpdateMachine => "CanUpdateMachineRequest",
            Hook::CanUpdateMachineSet => "CanUpdateMachineSetRequest",
            Hook::UpdateMachine => "UpdateMachineRequest",
        }
    }

    /// `kind` of the response.
    pub fn response_kind(self) -> &'static str {
        match self {
            Hook::Discovery => "DiscoveryResponse",
            Hook::CanUpdateMachine => "CanUpdateMachineResponse",
            Hook::CanUpdateMachineSet => "CanUpdateMachineSetResponse",
            Hook::UpdateMachine => "UpdateMachineResponse",
        }
    }

    /// The handler this extension registers for the hook (none for discovery).
    pub fn handler(self) -> Option<&'static str> {
        match self {
            Hook::Discovery => None,
            Hook::CanUpdateMachine => Some(HANDLER_CAN_UPDATE_MACHINE),
            Hook::CanUpdateMachineSet => Some(HANDLER_CAN_UPDATE_MACHINESET),
            Hook::UpdateMachine => Some(HANDLER_UPDATE_MACHINE),
        }
    }

    /// Finds the hook for a request path exactly as CAPI builds it:
    /// `/hooks.runtime.cluster.x-k8s.io/v1alpha1/discovery` or
    /// `.../<lowercase hook>/<handler>`. The query (`?timeout=10s`) is not part of `path`.
    pub fn from_path(path: &str) -> Option<Hook> {
        let rest = path.strip_prefix(HOOKS_PATH_PREFIX)?.strip_prefix('/')?;
        if rest == "discovery" {
            return Some(Hook::Discovery);
        }
        let (hook, handler) = rest.split_once('/')?;
        // CAPI lowercases the hook name; accept exactly that.
        Hook::ALL
            .into_iter()
            .find(|h| h.handler() == Some(handler) && hook == h.as_str().to_ascii_lowercase())
    }

    /// The path CAPI calls for this hook.
    pub fn path(self) -> String {
        match self.handler() {
            None => format!("{HOOKS_PATH_PREFIX}/discovery"),
            Some(handler) => format!(
                "{HOOKS_PATH_PREFIX}/{}/{handler}",
                self.as_str().to_ascii_lowercase()
            ),
        }
    }
}

impl std::fmt::Display for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

// === Requests ===

/// A request that does not have the shape of its hook; `field` is the JSON path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct RequestError {
    /// Where, e.g. `desired.machine.metadata.name`; empty for the body as a whole.
    pub field: String,
    /// What is wrong and, where it helps, what was expected.
    pub message: String,
}

impl RequestError {
    /// An error at `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> RequestError {
        RequestError {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A Kubernetes object carried in a request (typed or a RawExtension), with the JSON path it
/// came from for error messages.
#[derive(Debug, Clone, PartialEq)]
pub struct Object {
    /// JSON path in the request, e.g. `desired.bootstrapConfig`.
    pub field: String,
    /// The object as sent.
    pub value: Value,
}

impl Object {
    /// `kind`, or empty.
    pub fn kind(&self) -> &str {
        self.value.get("kind").and_then(Value::as_str).unwrap_or("")
    }

    /// `apiVersion`, or empty.
    pub fn api_version(&self) -> &str {
        self.value
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    /// `metadata.name`, or empty.
    pub fn name(&self) -> &str {
        self.meta_str("name")
    }

    /// `metadata.namespace`, or empty.
    pub fn namespace(&self) -> &str {
        self.meta_str("namespace")
    }

    fn meta_str(&self, key: &str) -> &str {
        self.value
            .get("metadata")
            .and_then(|m| m.get(key))
            .and_then(Value::as_str)
            .unwrap_or("")
    }

    /// `spec` (Null when absent).
    pub fn spec(&self) -> &Value {
        self.value.get("spec").unwrap_or(&Value::Null)
    }

    /// Checks `kind` (and the group of `apiVersion`) and that name and namespace are set.
    pub fn expect(&self, kind: &str, group: &str) -> Result<(), RequestError> {
        if self.kind() != kind {
            return Err(RequestError::new(
                format!("{}.kind", self.field),
                format!("is {:?}, expected {kind:?}", self.kind()),
            ));
        }
        let api_group = self.api_version().split_once('/').map_or("", |(g, _)| g);
        if api_group != group {
            return Err(RequestError::new(
                format!("{}.apiVersion", self.field),
                format!("is {:?}, expected {group}/<version>", self.api_version()),
            ));
        }
        self.expect_named()
    }

    /// Checks that name and namespace are set.
    pub fn expect_named(&self) -> Result<(), RequestError> {
        for key in ["name", "namespace"] {
            if self.meta_str(key).is_empty() {
                return Err(RequestError::new(
                    format!("{}.metadata.{key}", self.field),
                    "missing",
                ));
            }
        }
        Ok(())
    }
}

/// The parts of a hook request the handlers use.
#[derive(Debug, Clone, PartialEq)]
pub struct HookRequest {
    /// `settings` (from the ExtensionConfig), empty when absent.
    pub settings: Map<String, Value>,
    /// `current` objects by key (`machine`, `bootstrapConfig`, ...).
    pub current: Map<String, Value>,
    /// `desired` objects by key.
    pub desired: Map<String, Value>,
}

impl HookRequest {
    /// Checks the envelope (`kind`, `apiVersion`, the shapes of `settings`, `current`,
    /// `desired`) of a request for `hook`.
    pub fn parse(hook: Hook, body: &Value) -> Result<HookRequest, RequestError> {
        let Some(top) = body.as_object() else {
            return Err(RequestError::new(
                "",
                format!(
                    "the body is not a JSON object (expected a {})",
                    hook.request_kind()
                ),
            ));
        };
        let kind = top.get("kind").and_then(Value::as_str).unwrap_or("");
        if kind != hook.request_kind() {
            return Err(RequestError::new(
                "kind",
                format!(
                    "is {kind:?}, expected {:?} on {}",
                    hook.request_kind(),
                    hook.path()
                ),
            ));
        }
        let api_version = top.get("apiVersion").and_then(Value::as_str).unwrap_or("");
        if api_version != HOOKS_API_VERSION {
            return Err(RequestError::new(
                "apiVersion",
                format!("is {api_version:?}, expected {HOOKS_API_VERSION:?}"),
            ));
        }
        let object = |key: &str| -> Result<Map<String, Value>, RequestError> {
            match top.get(key) {
                None | Some(Value::Null) => Ok(Map::new()),
                Some(Value::Object(m)) => Ok(m.clone()),
                Some(_) => Err(RequestError::new(key, "is not an object")),
            }
        };
        let settings = object("settings")?;
        if let Some((key, _)) = settings.iter().find(|(_, v)| !v.is_string()) {
            return Err(RequestError::new(
                format!("settings.{key}"),
                "is not a string (ExtensionConfig settings are a map of strings)",
            ));
        }
        Ok(HookRequest {
            settings,
            current: object("current")?,
            desired: object("desired")?,
        })
    }

    /// A required object of `side` (`current` or `desired`).
    pub fn object(&self, side: &str, key: &str) -> Result<Object, RequestError> {
        self.optional_object(side, key)?
            .ok_or_else(|| RequestError::new(format!("{side}.{key}"), "missing"))
    }

    /// An optional object (`bootstrapConfig` may be absent); an empty object counts as absent,
    /// as Go's `omitzero` would have left it out.
    pub fn optional_object(&self, side: &str, key: &str) -> Result<Option<Object>, RequestError> {
        let objects = if side == "current" {
            &self.current
        } else {
            &self.desired
        };
        match objects.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(m)) if m.is_empty() => Ok(None),
            Some(v @ Value::Object(_)) => Ok(Some(Object {
                field: format!("{side}.{key}"),
                value: v.clone(),
            })),
            Some(_) => Err(RequestError::new(
                format!("{side}.{key}"),
                "is not an object",
            )),
        }
    }

    /// A setting's value (settings are strings).
    pub fn setting(&self, key: &str) -> Option<&str> {
        self.settings.get(key).and_then(Value::as_str)
    }
}

// === Responses ===

/// `Success` or `Failure`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Status {
    /// The call worked (for UpdateMachine: in progress or done, see `retryAfterSeconds`).
    Success,
    /// The call failed; CAPI retries with backoff and logs the message.
    Failure,
}

/// A JSON Patch for one object, `patch` being the standard base64 of the RFC 6902 document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Patch {
    /// Always `JSONPatch`.
    #[serde(rename = "patchType")]
    pub patch_type: &'static str,
    /// base64 (standard alphabet, padded) of the operations.
    pub patch: String,
}

impl Patch {
    /// The patch for `operations`, or `None` when there are none (the field is then left
    /// out, which CAPI reads as "no change").
    pub fn json_patch(operations: &[Value]) -> Option<Patch> {
        if operations.is_empty() {
            return None;
        }
        let bytes = serde_json::to_vec(operations).unwrap_or_else(|_| b"[]".to_vec());
        Some(Patch {
            patch_type: "JSONPatch",
            patch: BASE64.encode(bytes),
        })
    }

    /// The operations, decoded (for tests and `translate`).
    pub fn operations(&self) -> Vec<Value> {
        BASE64
            .decode(&self.patch)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }
}

/// `CanUpdateMachineResponse`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CanUpdateMachineResponse {
    /// `CanUpdateMachineResponse`.
    pub kind: &'static str,
    /// [`HOOKS_API_VERSION`].
    pub api_version: &'static str,
    /// Success (also when nothing is covered) or Failure (a bad request).
    pub status: Status,
    /// Why what is not covered is not.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Patch onto `current.machine`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine_patch: Option<Patch>,
    /// Patch onto `current.infrastructureMachine` (never: infrastructure is not node work).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub infrastructure_machine_patch: Option<Patch>,
    /// Patch onto `current.bootstrapConfig`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_config_patch: Option<Patch>,
    /// `false` when the change disrupts no workload (CAPI ≥ 1.15 reads it; older ignore it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affects_availability: Option<bool>,
}

/// `CanUpdateMachineSetResponse`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CanUpdateMachineSetResponse {
    /// `CanUpdateMachineSetResponse`.
    pub kind: &'static str,
    /// [`HOOKS_API_VERSION`].
    pub api_version: &'static str,
    /// Success or Failure.
    pub status: Status,
    /// Why what is not covered is not.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Patch onto `current.machineSet`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub machine_set_patch: Option<Patch>,
    /// Patch onto `current.infrastructureMachineTemplate` (never).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub infrastructure_machine_template_patch: Option<Patch>,
    /// Patch onto `current.bootstrapConfigTemplate`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap_config_template_patch: Option<Patch>,
    /// As in [`CanUpdateMachineResponse`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affects_availability: Option<bool>,
}

/// `UpdateMachineResponse`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UpdateMachineResponse {
    /// `UpdateMachineResponse`.
    pub kind: &'static str,
    /// [`HOOKS_API_VERSION`].
    pub api_version: &'static str,
    /// Success (in progress or done) or Failure.
    pub status: Status,
    /// Shown in the Machine's `Updating` condition while in progress.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Seconds until CAPI calls again; 0 with Success means done. Always written.
    pub retry_after_seconds: i32,
}

/// The longest `retryAfterSeconds` the updater answers with (an agent that is rebooting its
/// node asks for 60). The server keeps an idle connection open longer than this
/// (`deadlines::ConnectionLimits`), so a client that comes back when asked finds its pooled
/// connection still open.
pub const MAX_RETRY_SECONDS: i32 = 60;

impl UpdateMachineResponse {
    /// A response with these values; `retry` is bounded to `0..=MAX_RETRY_SECONDS`.
    pub fn new(status: Status, message: impl Into<String>, retry: i32) -> UpdateMachineResponse {
        UpdateMachineResponse {
            kind: Hook::UpdateMachine.response_kind(),
            api_version: HOOKS_API_VERSION,
            status,
            message: message.into(),
            retry_after_seconds: retry.clamp(0, MAX_RETRY_SECONDS),
        }
    }
}

/// The answer to a bad request, or any failure, of any hook: `status: Failure` and a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FailureResponse {
    /// The hook's response kind.
    pub kind: &'static str,
    /// [`HOOKS_API_VERSION`].
    pub api_version: &'static str,
    /// Failure.
    pub status: Status,
    /// What was wrong.
    pub message: String,
    /// Present (0) on UpdateMachine only, where the field has no `omitempty`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<i32>,
}

impl FailureResponse {
    /// A failure of `hook`.
    pub fn new(hook: Hook, message: impl Into<String>) -> FailureResponse {
        FailureResponse {
            kind: hook.response_kind(),
            api_version: HOOKS_API_VERSION,
            status: Status::Failure,
            message: message.into(),
            retry_after_seconds: (hook == Hook::UpdateMachine).then_some(0),
        }
    }
}

/// `GroupVersionHook` of a discovery handler.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestHook {
    /// [`HOOKS_API_VERSION`].
    pub api_version: &'static str,
    /// `CanUpdateMachine`, ...
    pub hook: &'static str,
}

/// `ExtensionHandler` of the discovery response.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExtensionHandler {
    /// The handler name (the last path segment CAPI calls).
    pub name: &'static str,
    /// The hook it answers.
    pub request_hook: RequestHook,
    /// Seconds CAPI waits.
    pub timeout_seconds: i32,
    /// `Fail`.
    pub failure_policy: &'static str,
}

/// `DiscoveryResponse`.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DiscoveryResponse {
    /// `DiscoveryResponse`.
    pub kind: &'static str,
    /// [`HOOKS_API_VERSION`].
    pub api_version: &'static str,
    /// `Success`.
    pub status: Status,
    /// One per hook.
    pub handlers: Vec<ExtensionHandler>,
}

/// The discovery response: one handler per hook, `failurePolicy: Fail`, 10 s.
pub fn discovery_response() -> DiscoveryResponse {
    let handlers = [
        Hook::CanUpdateMachine,
        Hook::CanUpdateMachineSet,
        Hook::UpdateMachine,
    ]
    .into_iter()
    .filter_map(|hook| {
        Some(ExtensionHandler {
            name: hook.handler()?,
            request_hook: RequestHook {
                api_version: HOOKS_API_VERSION,
                hook: hook.as_str(),
            },
            timeout_seconds: 10,
            failure_policy: "Fail",
        })
    })
    .collect();
    DiscoveryResponse {
        kind: Hook::Discovery.response_kind(),
        api_version: HOOKS_API_VERSION,
        status: Status::Success,
        handlers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_route_exactly_as_capi_builds_them() {
        for hook in Hook::ALL {
            assert_eq!(Hook::from_path(&hook.path()), Some(hook), "{}", hook.path());
        }
        assert_eq!(
            Hook::from_path(
                "/hooks.runtime.cluster.x-k8s.io/v1alpha1/updatemachine/update-machine"
            ),
            Some(Hook::UpdateMachine)
        );
        for bad in [
            "/hooks.runtime.cluster.x-k8s.io/v1alpha1/UpdateMachine/update-machine",
            "/hooks.runtime.cluster.x-k8s.io/v1alpha1/updatemachine/other",
            "/hooks.runtime.cluster.x-k8s.io/v1alpha1/updatemachine/update-machine/x",
            "/hooks.runtime.cluster.x-k8s.io/v1alpha2/discovery",
            "/discovery",
        ] {
            assert_eq!(Hook::from_path(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_patch_type_never_goes_without_a_patch() {
        assert_eq!(Patch::json_patch(&[]), None);
        let p = Patch::json_patch(&[serde_json::json!({"op":"remove","path":"/spec/x"})]).unwrap();
        assert_eq!(p.patch_type, "JSONPatch");
        assert!(!p.patch.is_empty());
        assert_eq!(p.operations().len(), 1);
    }

    #[test]
    fn envelope_errors_name_the_field() {
        let e = HookRequest::parse(
            Hook::UpdateMachine,
            &serde_json::json!({"kind":"CanUpdateMachineRequest","apiVersion":HOOKS_API_VERSION}),
        )
        .unwrap_err();
        assert_eq!(e.field, "kind");
        let e = HookRequest::parse(
            Hook::UpdateMachine,
            &serde_json::json!({"kind":"UpdateMachineRequest","apiVersion":"v1"}),
        )
        .unwrap_err();
        assert_eq!(e.field, "apiVersion");
        let e = HookRequest::parse(Hook::UpdateMachine, &serde_json::json!({"kind":"UpdateMachineRequest","apiVersion":HOOKS_API_VERSION,"settings":{"agentPort":9443}})).unwrap_err();
        assert_eq!(e.field, "settings.agentPort");
        let r = HookRequest::parse(
            Hook::UpdateMachine,
            &serde_json::json!({"kind":"UpdateMachineRequest","apiVersion":HOOKS_API_VERSION}),
        )
        .unwrap();
        assert_eq!(
            r.object("desired", "machine").unwrap_err().field,
            "desired.machine"
        );
    }
}

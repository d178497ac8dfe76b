//! A small evaluator of Kubernetes RBAC for the tests: which requests the rendered
//! ClusterRoles, Roles and their bindings allow a ServiceAccount, decided as the API server
//! decides them, so a test can replay the requests a real flow made (the API stand-in's
//! `requests()`, as (method, path with query)) against the RBAC we ship.
//!
//! - A request is read from its HTTP method and path as the API server's RequestInfoFactory
//!   reads it (kubernetes/kubernetes, staging/src/k8s.io/apiserver/pkg/endpoints/request/
//!   requestinfo.go): `/api/v1/...` is the core group, `/apis/<group>/<version>/...` a
//!   group; `namespaces/<ns>/<resource>` names a namespace (and `namespaces/<name>` alone is
//!   the Namespace object, in that namespace); a GET without a name is `list`, or `watch` when
//!   the query's `watch` is neither `false` nor `0`; DELETE without a name is
//!   `deletecollection`; a third part is the subresource (`pods/eviction`).
//! - It is allowed when some binding of the subject has a rule that matches, as the RBAC
//!   authorizer decides (plugin/pkg/auth/authorizer/rbac/rbac.go and
//!   pkg/apis/rbac/v1/evaluation_helpers.go): a ClusterRoleBinding's ClusterRole applies to
//!   every request, a RoleBinding's Role or ClusterRole only to requests in the RoleBinding's
//!   namespace; a rule matches when its verbs, apiGroups and resources hold the request's (or
//!   `*`; `resource/subresource` for a subresource, `*/subresource` too) and its
//!   resourceNames are empty or hold the request's name.
//!
//! Aggregated ClusterRoles and non-resource URLs are refused, not guessed at: the tests'
//! manifests have none, and a new one must make the evaluator grow rather than pass silently.

use serde_json::Value;

/// One API request as RBAC sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Request {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, `deletecollection`.
    pub verb: String,
    /// The API group; `""` for the core group.
    pub group: String,
    /// The resource (plural), with `/subresource` when there is one.
    pub resource: String,
    /// The namespace the request is in, if any.
    pub namespace: Option<String>,
    /// The object's name, if the path names one.
    pub name: Option<String>,
}

impl std::fmt::Display for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            &self.group
        };
        write!(f, "{} {group}/{}", self.verb, self.resource)?;
        if let Some(name) = &self.name {
            write!(f, " {name:?}")?;
        }
        match &self.namespace {
            Some(ns) => write!(f, " in namespace {ns}"),
            None => write!(f, " (cluster-scoped)"),
        }
    }
}

impl Request {
    /// Reads an HTTP request (method, path with its query) as the API server does; an error
    /// for a path that is not a resource request.
    pub fn from_http(method: &str, path_and_query: &str) -> Result<Request, String> {
        let (path, query) = path_and_query
            .split_once('?')
            .unwrap_or((path_and_query, ""));
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, rest) = match parts.as_slice() {
            ["api", _version, rest @ ..] if !rest.is_empty() => ("", rest),
            ["apis", group, _version, rest @ ..] if !rest.is_empty() => (*group, rest),
            _ => return Err(format!("{method} {path}: not a resource request")),
        };
        let mut verb = match method {
            "POST" => "create",
            "GET" | "HEAD" => "get",
            "PUT" => "update",
            "PATCH" => "patch",
            "DELETE" => "delete",
            other => {
                return Err(format!(
                    "{other} {path}: a method the API server has no verb for"
                ));
            }
        }
        .to_owned();
        let mut rest = rest;
        if matches!(rest.first(), Some(&"watch") | Some(&"proxy")) {
            return Err(format!(
                "{method} {path}: the legacy /watch and /proxy paths are not read here"
            ));
        }
        let mut namespace = None;
        if rest[0] == "namespaces" && rest.len() > 1 {
            namespace = Some(rest[1].to_owned());
            // namespaces/<ns>/status and /finalize are subresources of the Namespace itself.
            if rest.len() > 2 && !["status", "finalize"].contains(&rest[2]) {
                rest = &rest[2..];
            }
        }
        let mut resource = rest[0].to_owned();
        let name = rest.get(1).map(|n| (*n).to_owned());
        if let Some(sub) = rest.get(2) {
            resource = format!("{resource}/{sub}");
        }
        if name.is_none() && verb == "get" {
            let watch = query.split('&').find_map(|kv| kv.strip_prefix("watch="));
            verb = match watch {
                Some(v) if !v.eq_ignore_ascii_case("false") && v != "0" => "watch",
                _ => "list",
            }
            .to_owned();
        }
        if name.is_none() && verb == "delete" {
            verb = "deletecollection".to_owned();
        }
        Ok(Request {
            verb,
            group: group.to_owned(),
            resource,
            namespace,
            name,
        })
    }
}

/// The RBAC objects of a set of rendered manifests.
#[derive(Debug, Default)]
pub struct Rbac {
    cluster_roles: Vec<Value>,
    roles: Vec<Value>,
    cluster_role_bindings: Vec<Value>,
    role_bindings: Vec<Value>,
}

fn name_of(v: &Value) -> &str {
    v["metadata"]["name"].as_str().unwrap_or("")
}

fn namespace_of(v: &Value) -> Option<&str> {
    v["metadata"]["namespace"].as_str()
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

impl Rbac {
    /// The ClusterRoles, Roles, ClusterRoleBindings and RoleBindings among `objects`
    /// (anything else is ignored); an error for what the evaluator does not decide.
    pub fn from_objects(objects: &[Value]) -> Result<Rbac, String> {
        let mut rbac = Rbac::default();
        for o in objects {
            if o["apiVersion"] != "rbac.authorization.k8s.io/v1" {
                continue;
            }
            let what = format!("{} {}", o["kind"], name_of(o));
            match o["kind"].as_str() {
                Some("ClusterRole") => {
                    if o.get("aggregationRule").is_some() {
                        return Err(format!("{what}: aggregated ClusterRoles are not evaluated"));
                    }
                    rbac.cluster_roles.push(o.clone());
                }
                Some("Role") => rbac.roles.push(o.clone()),
                Some("ClusterRoleBinding") => rbac.cluster_role_bindings.push(o.clone()),
                Some("RoleBinding") => {
                    if namespace_of(o).is_none() {
                        return Err(format!("{what}: a RoleBinding without a namespace"));
                    }
                    rbac.role_bindings.push(o.clone())
                }
                _ => continue,
            }
            for rule in o["rules"].as_array().into_iter().flatten() {
                if rule.get("nonResourceURLs").is_some() {
                    return Err(format!("{what}: nonResourceURLs are not evaluated"));
                }
            }
        }
        Ok(rbac)
    }

    /// Whether the ServiceAccount `namespace/name` may make `request`.
    pub fn allows(&self, service_account: (&str, &str), request: &Request) -> bool {
        self.rules_for(service_account, request.namespace.as_deref())
            .iter()
            .any(|rule| rule_matches(rule, request))
    }

    /// The rules that apply to the ServiceAccount for requests in `namespace` (None: a
    /// cluster-scoped request): its ClusterRoleBindings' everywhere, its RoleBindings' in
    /// their own namespace.
    fn rules_for(&self, service_account: (&str, &str), namespace: Option<&str>) -> Vec<&Value> {
        let mut rules = Vec::new();
        let bound = |binding: &Value| {
            binding["subjects"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|s| subject_matches(s, service_account))
        };
        for b in self.cluster_role_bindings.iter().filter(|b| bound(b)) {
            if b["roleRef"]["kind"] == "ClusterRole" {
                rules.extend(self.role_rules(
                    &self.cluster_roles,
                    b["roleRef"]["name"].as_str(),
                    None,
                ));
            }
        }
        let Some(ns) = namespace else {
            return rules;
        };
        for b in self
            .role_bindings
            .iter()
            .filter(|b| namespace_of(b) == Some(ns) && bound(b))
        {
            let name = b["roleRef"]["name"].as_str();
            match b["roleRef"]["kind"].as_str() {
                Some("ClusterRole") => {
                    rules.extend(self.role_rules(&self.cluster_roles, name, None))
                }
                Some("Role") => rules.extend(self.role_rules(&self.roles, name, Some(ns))),
                _ => {}
            }
        }
        rules
    }

    fn role_rules<'a>(
        &'a self,
        roles: &'a [Value],
        name: Option<&str>,
        namespace: Option<&str>,
    ) -> Vec<&'a Value> {
        roles
            .iter()
            .filter(|r| Some(name_of(r)) == name && namespace_of(r) == namespace)
            .flat_map(|r| r["rules"].as_array().into_iter().flatten())
            .collect()
    }
}

/// A binding's subject naming the ServiceAccount, or a group every ServiceAccount (of its
/// namespace) is in.
fn subject_matches(subject: &Value, (namespace, name): (&str, &str)) -> bool {
    match subject["kind"].as_str() {
        Some("ServiceAccount") => subject["name"] == name && subject["namespace"] == namespace,
        Some("Group") => {
            let group = subject["name"].as_str().unwrap_or("");
            group == "system:serviceaccounts"
                || group == format!("system:serviceaccounts:{namespace}")
                || group == "system:authenticated"
        }
        Some("User") => subject["name"] == format!("system:serviceaccount:{namespace}:{name}"),
        _ => false,
    }
}

fn rule_matches(rule: &Value, request: &Request) -> bool {
    let has = |field: &str, value: &str| {
        strings(&rule[field])
            .iter()
            .any(|v| *v == "*" || *v == value)
    };
    let resource_matches = strings(&rule["resources"]).iter().any(|r| {
        *r == "*"
            || *r == request.resource
            || request
                .resource
                .split_once('/')
                .is_some_and(|(_, sub)| *r == format!("*/{sub}"))
    });
    let names = strings(&rule["resourceNames"]);
    has("verbs", &request.verb)
        && has("apiGroups", &request.group)
        && resource_matches
        && (names.is_empty() || request.name.as_deref().is_some_and(|n| names.contains(&n)))
}

/// Parses every YAML document of `text` (rendered manifests), skipping empty ones.
pub fn documents(text: &str) -> Vec<Value> {
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|d| serde::Deserialize::deserialize(d).expect("a YAML document"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// The objects `kubectl apply -k <dir>` would create, as the RBAC evaluator reads them:
/// `kubectl kustomize <dir>` with the kubectl packaging/kubectl picks (the one
/// packaging/validate and packaging/clusterctl/build use).
pub fn kustomize(dir: &std::path::Path) -> Vec<Value> {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let kubectl = std::process::Command::new("bash")
        .arg(repo.join("packaging/kubectl"))
        .output()
        .expect("run packaging/kubectl");
    assert!(
        kubectl.status.success(),
        "packaging/kubectl: {}",
        String::from_utf8_lossy(&kubectl.stderr)
    );
    let kubectl = String::from_utf8_lossy(&kubectl.stdout).trim().to_owned();
    let out = std::process::Command::new(&kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("run {kubectl}: {e}"));
    assert!(
        out.status.success(),
        "{kubectl} kustomize {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    documents(&String::from_utf8_lossy(&out.stdout))
}

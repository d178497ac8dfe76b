//! The effective settings of a call: those of the operator's ExtensionConfig that selects the
//! Machine's namespace, never the request's own.
//!
//! Cluster API copies an ExtensionConfig's `spec.settings` into every request it sends
//! (cluster-api `internal/runtime/client/client.go`, `CallExtension`: `request.SetSettings(
//! registration.Settings)`), but the hook port has no caller authentication: any pod of the
//! management cluster can POST a request with `drain: Never` or a package repository path of
//! its choosing. So the request's `settings` only *point*: the updater reads the
//! ExtensionConfigs it was told are its own (`--extension-config`, cluster-scoped objects only
//! a cluster administrator writes), keeps those whose `spec.namespaceSelector` selects the
//! Machine's namespace (an empty selector selects every namespace, as in Cluster API), and
//! accepts the request only when its `settings` equal one of theirs, key for key. The
//! settings used are then that ExtensionConfig's, validated when it was read: an unknown key
//! (`agentCa` for `agentCA`) refuses every call it governs, with a did-you-mean.
//!
//! Reads: an ExtensionConfig and a Namespace are read by `get` and reused for [`RECHECK`];
//! when a request's settings match none of the cached copies, they are read again once
//! (an operator's edit is seen at the next call, not 30 s later), and only then is the call
//! refused. The Namespace is read only when some selector is not empty.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Map, Value};

use crate::cluster::Cluster;
use crate::drain::Selector;
use crate::settings::{Defaults, Settings};

/// How long an ExtensionConfig or a Namespace's labels are reused before they are read again.
pub const RECHECK: Duration = Duration::from_secs(30);

/// The ExtensionConfig name the shipped manifests use (`--extension-config`'s default).
pub const DEFAULT_NAME: &str = "inplace-updater";

/// The settings a call runs under, and where they come from. Only this room builds one: a
/// handler that holds it knows the settings are the operator's.
#[derive(Debug, Clone)]
pub struct Effective {
    settings: Settings,
    source: Arc<str>,
}

impl Effective {
    /// The validated settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The ExtensionConfig they come from (its name).
    pub fn source(&self) -> &str {
        &self.source
    }
}

impl std::ops::Deref for Effective {
    type Target = Settings;
    fn deref(&self) -> &Settings {
        &self.settings
    }
}

/// One ExtensionConfig as read.
#[derive(Debug)]
struct Registered {
    name: Arc<str>,
    /// `spec.namespaceSelector`, or why it cannot be read.
    selector: Result<Selector, String>,
    /// `spec.settings`, as strings.
    raw: BTreeMap<String, String>,
    /// The settings validated, or why they are not valid.
    settings: Result<Settings, String>,
}

/// What was read, and when.
type Read<T> = (Instant, T);

/// A Namespace's labels.
type Labels = BTreeMap<String, String>;

/// Why a call is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// The updater's ExtensionConfigs, read live and cached.
#[derive(Debug)]
pub struct ExtensionConfigs {
    names: Vec<String>,
    defaults: Defaults,
    configs: Mutex<HashMap<String, Read<Option<Arc<Registered>>>>>,
    namespaces: Mutex<HashMap<String, Read<Labels>>>,
    recheck: Duration,
}

impl ExtensionConfigs {
    /// The registry of the ExtensionConfigs `names` (the `--extension-config` flags).
    pub fn new(names: Vec<String>, defaults: Defaults) -> ExtensionConfigs {
        ExtensionConfigs {
            names,
            defaults,
            configs: Mutex::default(),
            namespaces: Mutex::default(),
            recheck: RECHECK,
        }
    }

    /// The names it reads.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The defaults from the flags.
    pub fn defaults(&self) -> &Defaults {
        &self.defaults
    }

    /// The effective settings of a call about an object in `namespace` whose request carried
    /// `requested`: those of the ExtensionConfig that selects the namespace and whose settings
    /// the request carries, or why the call is refused (no ExtensionConfig selects the
    /// namespace, the settings differ, or the ExtensionConfig's settings are invalid).
    pub async fn effective(
        &self,
        cluster: &Cluster,
        namespace: &str,
        requested: &Map<String, Value>,
    ) -> Result<Effective, Refused> {
        let requested = match strings(requested) {
            Ok(r) => r,
            Err(key) => {
                return Err(Refused(format!(
                    "settings.{key}: is not a string; Cluster API sends an ExtensionConfig's \
                     settings as strings, so this request did not come from one; nothing was done"
                )));
            }
        };
        match self.decide(cluster, namespace, &requested, false).await? {
            Decision::Matched(e) => Ok(*e),
            // What was cached did not match: read live once before refusing (an operator's
            // edit is seen at once).
            Decision::Differs(_) | Decision::NoneSelects => {
                match self.decide(cluster, namespace, &requested, true).await? {
                    Decision::Matched(e) => Ok(*e),
                    Decision::Differs(message) => Err(Refused(message)),
                    Decision::NoneSelects => Err(Refused(format!(
                        "no ExtensionConfig of this updater ({}) selects namespace {namespace} \
                         (spec.namespaceSelector): nothing is done for objects there; an \
                         administrator registers the namespace by its labels or lists another \
                         ExtensionConfig with --extension-config",
                        self.names.join(", ")
                    ))),
                }
            }
        }
    }

    async fn decide(
        &self,
        cluster: &Cluster,
        namespace: &str,
        requested: &BTreeMap<String, String>,
        fresh: bool,
    ) -> Result<Decision, Refused> {
        let mut selecting = Vec::new();
        let mut labels: Option<BTreeMap<String, String>> = None;
        for name in &self.names {
            let Some(config) = self.config(cluster, name, fresh).await? else {
                continue;
            };
            let selector = config.selector.as_ref().map_err(|e| {
                Refused(format!(
                    "ExtensionConfig {name}: spec.namespaceSelector: {e}; fix the ExtensionConfig"
                ))
            })?;
            if *selector != Selector::default() {
                if labels.is_none() {
                    labels = Some(self.namespace_labels(cluster, namespace, fresh).await?);
                }
                if !labels.as_ref().is_some_and(|l| selector.matches(l)) {
                    continue;
                }
            }
            selecting.push(config);
        }
        if selecting.is_empty() {
            return Ok(Decision::NoneSelects);
        }
        if let Some(config) = selecting.iter().find(|c| c.raw == *requested) {
            let settings = config.settings.clone().map_err(|e| {
                Refused(format!(
                    "ExtensionConfig {}: {e}; nothing is done until an administrator fixes it",
                    config.name
                ))
            })?;
            return Ok(Decision::Matched(Box::new(Effective {
                settings,
                source: config.name.clone(),
            })));
        }
        let nearest = &selecting[0];
        Ok(Decision::Differs(format!(
            "the request's settings differ from those of ExtensionConfig {} that selects \
             namespace {namespace} ({}); the updater acts only on its ExtensionConfig's \
             settings, so this request did not come from Cluster API as registered; nothing was done",
            nearest.name,
            differing_keys(&nearest.raw, requested)
        )))
    }

    /// ExtensionConfig `name`, from the cache when fresh enough (and `fresh` is false).
    async fn config(
        &self,
        cluster: &Cluster,
        name: &str,
        fresh: bool,
    ) -> Result<Option<Arc<Registered>>, Refused> {
        if !fresh
            && let Some((at, config)) = lock(&self.configs).get(name)
            && at.elapsed() < self.recheck
        {
            return Ok(config.clone());
        }
        let read = cluster.extension_config(name).await;
        let config = match read {
            Ok(object) => object.map(|o| Arc::new(self.register(name, &o))),
            Err(e) => {
                // The API server did not answer: what was read last stays in use.
                if let Some((_, config)) = lock(&self.configs).get(name) {
                    tracing::warn!(extension_config = %name, error = %e, "ExtensionConfig not read again; keeping the one known");
                    return Ok(config.clone());
                }
                return Err(Refused(format!(
                    "ExtensionConfig {name} could not be read: {}; nothing was done",
                    e.detail
                )));
            }
        };
        let mut configs = lock(&self.configs);
        let changed = configs
            .get(name)
            .is_none_or(|(_, old)| old.as_ref().map(|o| &o.raw) != config.as_ref().map(|c| &c.raw));
        if changed {
            match &config {
                Some(c) => match &c.settings {
                    Ok(_) => {
                        tracing::info!(extension_config = %name, "ExtensionConfig settings read")
                    }
                    Err(e) => {
                        tracing::error!(extension_config = %name, error = %e, "ExtensionConfig settings are invalid; the calls it governs are refused")
                    }
                },
                None => {
                    tracing::warn!(extension_config = %name, "ExtensionConfig does not exist (--extension-config)")
                }
            }
        }
        configs.insert(name.to_owned(), (Instant::now(), config.clone()));
        Ok(config)
    }

    fn register(&self, name: &str, object: &Value) -> Registered {
        let spec = object.get("spec");
        let raw_settings = spec.and_then(|s| s.get("settings"));
        let (raw, settings) = match raw_settings {
            None | Some(Value::Null) => (BTreeMap::new(), Ok(Map::new())),
            Some(Value::Object(m)) => match strings(m) {
                Ok(raw) => (raw, Ok(m.clone())),
                Err(key) => (
                    BTreeMap::new(),
                    Err(format!("spec.settings.{key}: is not a string")),
                ),
            },
            Some(_) => (
                BTreeMap::new(),
                Err("spec.settings: is not a map of strings".to_owned()),
            ),
        };
        let settings = settings.and_then(|m| {
            Settings::from_extension_config(&m, &self.defaults).map_err(|e| e.to_string())
        });
        Registered {
            name: name.into(),
            selector: Selector::from_json(
                spec.and_then(|s| s.get("namespaceSelector")),
                "spec.namespaceSelector",
            ),
            raw,
            settings,
        }
    }

    async fn namespace_labels(
        &self,
        cluster: &Cluster,
        namespace: &str,
        fresh: bool,
    ) -> Result<BTreeMap<String, String>, Refused> {
        if !fresh
            && let Some((at, labels)) = lock(&self.namespaces).get(namespace)
            && at.elapsed() < self.recheck
        {
            return Ok(labels.clone());
        }
        let labels = match cluster.namespace_labels(namespace).await {
            Ok(Some(labels)) => labels,
            Ok(None) => {
                return Err(Refused(format!(
                    "namespace {namespace} does not exist; nothing was done"
                )));
            }
            Err(e) => {
                return Err(Refused(format!(
                    "namespace {namespace} could not be read (to match ExtensionConfig \
                     namespaceSelectors): {}; nothing was done",
                    e.detail
                )));
            }
        };
        lock(&self.namespaces).insert(namespace.to_owned(), (Instant::now(), labels.clone()));
        Ok(labels)
    }
}

enum Decision {
    Matched(Box<Effective>),
    Differs(String),
    NoneSelects,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The map as strings; `Err` names the first key whose value is not a string.
fn strings(m: &Map<String, Value>) -> Result<BTreeMap<String, String>, String> {
    m.iter()
        .map(|(k, v)| match v {
            Value::String(s) => Ok((k.clone(), s.clone())),
            _ => Err(k.clone()),
        })
        .collect()
}

/// The keys whose values differ, missing or extra, in words (never the values: an
/// operator's settings are not a caller's to learn).
fn differing_keys(
    registered: &BTreeMap<String, String>,
    requested: &BTreeMap<String, String>,
) -> String {
    let mut keys: Vec<&str> = registered
        .keys()
        .chain(requested.keys())
        .map(String::as_str)
        .filter(|k| registered.get(*k) != requested.get(*k))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    let shown: Vec<String> = keys
        .iter()
        .take(5)
        .map(|k| format!("settings.{k}"))
        .collect();
    match keys.len() {
        0 => "no key differs".to_owned(),
        n if n <= 5 => format!("differing: {}", shown.join(", ")),
        n => format!("differing: {} and {} more", shown.join(", "), n - 5),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::standin::{ApiStandin, extension_config, namespace};
    use serde_json::json;

    async fn setup() -> (ApiStandin, Cluster, tempfile::TempDir) {
        let api = ApiStandin::start().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let cluster = Cluster::connect(Some(&kubeconfig)).await.unwrap();
        (api, cluster, dir)
    }

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_acts_only_under_the_settings_of_the_extension_config_that_selects_it() {
        let (api, cluster, _dir) = setup().await;
        api.put(extension_config(
            "inplace-updater",
            json!({"drain": "Always", "agentPort": "9443"}),
            json!({"matchLabels": {"team": "a"}}),
        ));
        api.put(namespace("team-a", json!({"team": "a"})));
        api.put(namespace("team-b", json!({"team": "b"})));
        let configs = ExtensionConfigs::new(vec!["inplace-updater".into()], Defaults::default());
        let good = map(json!({"drain": "Always", "agentPort": "9443"}));

        let e = configs.effective(&cluster, "team-a", &good).await.unwrap();
        assert_eq!(e.drain, crate::settings::DrainMode::Always);
        assert_eq!(e.source(), "inplace-updater");

        let forged = map(json!({"drain": "Never", "agentPort": "9443"}));
        let refused = configs
            .effective(&cluster, "team-a", &forged)
            .await
            .unwrap_err();
        assert!(refused.0.contains("settings.drain"), "{refused}");
        assert!(
            !refused.0.contains("Never"),
            "values are not echoed: {refused}"
        );

        let elsewhere = configs
            .effective(&cluster, "team-b", &good)
            .await
            .unwrap_err();
        assert!(
            elsewhere.0.contains(
                "no ExtensionConfig of this updater (inplace-updater) selects namespace team-b"
            ),
            "{elsewhere}"
        );
        let not_strings = configs
            .effective(&cluster, "team-a", &map(json!({"drain": 1})))
            .await
            .unwrap_err();
        assert!(
            not_strings.0.contains("settings.drain: is not a string"),
            "{not_strings}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_operators_edit_is_seen_at_the_next_call_and_reads_are_cached() {
        let (api, cluster, _dir) = setup().await;
        api.put(extension_config(
            "x",
            json!({"drain": "Always"}),
            Value::Null,
        ));
        let configs = ExtensionConfigs::new(vec!["x".into()], Defaults::default());
        let always = map(json!({"drain": "Always"}));
        let never = map(json!({"drain": "Never"}));
        for _ in 0..3 {
            configs
                .effective(&cluster, "default", &always)
                .await
                .unwrap();
        }
        let gets = || {
            api.requests()
                .iter()
                .filter(|(m, p)| m == "GET" && p.ends_with("/extensionconfigs/x"))
                .count()
        };
        assert_eq!(gets(), 1, "cached");
        assert!(
            api.requests()
                .iter()
                .all(|(_, p)| !p.contains("/namespaces/default")),
            "an empty selector needs no Namespace"
        );
        api.put(extension_config(
            "x",
            json!({"drain": "Never"}),
            Value::Null,
        ));
        let e = configs
            .effective(&cluster, "default", &never)
            .await
            .unwrap();
        assert_eq!(e.drain, crate::settings::DrainMode::Never);
        assert_eq!(gets(), 2, "read again on a mismatch");
        configs
            .effective(&cluster, "default", &always)
            .await
            .unwrap_err();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn invalid_operator_settings_refuse_with_a_did_you_mean() {
        let (api, cluster, _dir) = setup().await;
        api.put(extension_config(
            "inplace-updater",
            json!({"agentCa": "ClusterSecret"}),
            Value::Null,
        ));
        let configs = ExtensionConfigs::new(vec!["inplace-updater".into()], Defaults::default());
        let refused = configs
            .effective(
                &cluster,
                "default",
                &map(json!({"agentCa": "ClusterSecret"})),
            )
            .await
            .unwrap_err();
        assert!(
            refused.0.contains("ExtensionConfig inplace-updater"),
            "{refused}"
        );
        assert!(refused.0.contains("settings.agentCa"), "{refused}");
        assert!(refused.0.contains("did you mean \"agentCA\""), "{refused}");
        let missing = ExtensionConfigs::new(vec!["gone".into()], Defaults::default());
        let refused = missing
            .effective(&cluster, "default", &Map::new())
            .await
            .unwrap_err();
        assert!(
            refused
                .0
                .contains("no ExtensionConfig of this updater (gone)"),
            "{refused}"
        );
    }
}

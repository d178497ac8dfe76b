//! Plan files → [`Plan`]: syntax (YAML or JSON), then one pass over the document that
//! collects every error with its field path instead of stopping at the first.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use serde_json::{Map, Value};

use super::*;

/// Bounds and policy applied while validating.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest plan document, in bytes.
    pub max_plan_bytes: usize,
    /// Most entries in `changes[]`.
    pub max_changes: usize,
    /// Most entries in `verify[]`.
    pub max_checks: usize,
    /// Largest decoded content of one file or unit, in bytes.
    pub max_content_bytes: usize,
    /// Directories plans may write under.
    pub allow: AllowList,
    /// Hosts that `artifact` may download from over plain http.
    pub allow_http_hosts: Vec<String>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_plan_bytes: 64 << 20,
            max_changes: 10_000,
            max_checks: 100,
            max_content_bytes: 4 << 20,
            allow: AllowList::default(),
            allow_http_hosts: Vec::new(),
        }
    }
}

impl Limits {
    /// Limits for plans the journal already accepted: re-reading them must not fail because
    /// the configuration was tightened since.
    pub fn replay() -> Limits {
        Limits {
            max_plan_bytes: usize::MAX,
            max_changes: usize::MAX,
            max_checks: usize::MAX,
            max_content_bytes: usize::MAX,
            allow: AllowList::everything(),
            allow_http_hosts: vec!["*".to_string()],
        }
    }
}

/// The document's `apiVersion`.
pub const API_VERSION: &str = "inplace.agent/v1";

/// Parses and validates a plan document (YAML or JSON).
pub fn parse_plan(bytes: &[u8], source: &str, limits: &Limits) -> Result<Plan, InvalidPlan> {
    read_plan(&mut &bytes[..], source, limits).map_err(|e| match e {
        ReadPlanError::Invalid(invalid) => invalid,
        ReadPlanError::Read(e) => InvalidPlan {
            source: source.to_string(),
            errors: vec![FieldError::new("", format!("cannot read the plan: {e}"))],
        },
    })
}

/// Parses and validates a plan document held whole (YAML, or JSON that does not start with
/// `{`, which serde_json then refuses).
fn parse_whole(bytes: &[u8], source: &str, limits: &Limits) -> Result<Plan, InvalidPlan> {
    let fail = |message: String| InvalidPlan {
        source: source.to_string(),
        errors: vec![FieldError::new("", message)],
    };
    if bytes.len() > limits.max_plan_bytes {
        return Err(fail(format!(
            "plan is {} bytes, more than the limit of {} bytes",
            bytes.len(),
            limits.max_plan_bytes
        )));
    }
    let text =
        std::str::from_utf8(bytes).map_err(|e| fail(format!("plan is not UTF-8 text: {e}")))?;
    let value = if text.trim_start().starts_with('{') {
        serde_json::from_str::<Value>(text).map_err(|e| fail(format!("malformed JSON: {e}")))?
    } else {
        let yaml: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(text).map_err(|e| fail(format!("malformed YAML: {e}")))?;
        yaml_to_json(yaml).map_err(|e| fail(format!("unsupported YAML: {e}")))?
    };
    validate_document(value, source, limits)
}

/// Why a plan could not be read from its input.
#[derive(Debug)]
pub enum ReadPlanError {
    /// Reading the input failed.
    Read(std::io::Error),
    /// The plan is not valid.
    Invalid(InvalidPlan),
}

/// [`parse_plan`] reading the plan from `input`. A JSON plan (the first character a `{`) is
/// read in chunks and its long strings decoded as they arrive (`plan::json`): its text is
/// never held whole, so a plan of large files costs about its content in memory, once.
pub fn read_plan(
    input: &mut dyn Read,
    source: &str,
    limits: &Limits,
) -> Result<Plan, ReadPlanError> {
    read(input, source, limits, false).map(|(plan, _)| plan)
}

/// [`read_plan`] for a plan that is going to be submitted: the long contents of a JSON plan
/// are hashed on another thread while the rest of it is read (`plan::hasher`), and their
/// sums come with the plan, for [`super::ContentSums::of_known`].
pub fn read_plan_hashed(
    input: &mut dyn Read,
    source: &str,
    limits: &Limits,
) -> Result<(Plan, KnownSums), ReadPlanError> {
    read(input, source, limits, true)
}

fn read(
    input: &mut dyn Read,
    source: &str,
    limits: &Limits,
    hash: bool,
) -> Result<(Plan, KnownSums), ReadPlanError> {
    let fail = |message: String| {
        ReadPlanError::Invalid(InvalidPlan {
            source: source.to_string(),
            errors: vec![FieldError::new("", message)],
        })
    };
    let max = limits.max_plan_bytes;
    let too_large = |max: usize| fail(format!("plan is more than the limit of {max} bytes"));
    // Enough to see the first character that is not white space.
    let mut head = Vec::new();
    let first = loop {
        let mut chunk = [0u8; 4096];
        let n = match input.read(&mut chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ReadPlanError::Read(e)),
        };
        let start = head.len();
        head.extend_from_slice(&chunk[..n]);
        if let Some(c) = head[start..].iter().find(|c| !c.is_ascii_whitespace()) {
            break Some(*c);
        }
        if n == 0 {
            break None;
        }
    };
    if head.len() > max {
        return Err(too_large(max));
    }
    if first == Some(b'{') {
        let document = super::json::split(head, input, max, hash)
            .map_err(|e| match e {
                super::json::SplitError::Read(e) => ReadPlanError::Read(e),
                super::json::SplitError::TooLarge(max) => too_large(max),
                super::json::SplitError::Syntax(e) => fail(format!("malformed JSON: {e}")),
            })?
            .into_document()
            .map_err(|e| fail(format!("malformed JSON: {e}")))?;
        let plan = validate_document_with_bodies(document.value, document.bodies, source, limits)
            .map_err(ReadPlanError::Invalid)?;
        return Ok((plan, document.sums));
    }
    // YAML (or white space only): parsed from the whole text.
    let mut bytes = head;
    let room = max.saturating_add(1).saturating_sub(bytes.len()) as u64;
    if let Err(e) = input.take(room).read_to_end(&mut bytes) {
        return Err(ReadPlanError::Read(e));
    }
    if bytes.len() > max {
        return Err(too_large(max));
    }
    let plan = parse_whole(&bytes, source, limits).map_err(ReadPlanError::Invalid)?;
    Ok((plan, KnownSums::default()))
}

/// Converts YAML to JSON values: string keys only, finite numbers, no tags.
fn yaml_to_json(v: serde_yaml_ng::Value) -> Result<Value, String> {
    use serde_yaml_ng::Value as Y;
    Ok(match v {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                serde_json::Number::from_f64(f)
                    .map(Value::Number)
                    .ok_or_else(|| format!("number {n} is not finite"))?
            }
        }
        Y::String(s) => Value::String(s),
        Y::Sequence(seq) => Value::Array(
            seq.into_iter()
                .map(yaml_to_json)
                .collect::<Result<_, _>>()?,
        ),
        Y::Mapping(m) => {
            let mut out = Map::new();
            for (k, v) in m {
                let key = match k {
                    Y::String(s) => s,
                    Y::Number(n) => n.to_string(),
                    Y::Bool(b) => b.to_string(),
                    other => return Err(format!("mapping key {other:?} is not a string")),
                };
                out.insert(key, yaml_to_json(v)?);
            }
            Value::Object(out)
        }
        Y::Tagged(t) => return Err(format!("YAML tag {} is not supported", t.tag)),
    })
}

/// Validates a parsed document into a [`Plan`], reporting every error at once.
pub fn validate_value(v: &Value, source: &str, limits: &Limits) -> Result<Plan, InvalidPlan> {
    validate_with(v, HashMap::new(), source, limits)
}

/// [`validate_value`] consuming the document: plain `file` contents move into the plan
/// instead of being copied, so a plan with megabytes of content is held once, not twice,
/// while it is validated.
pub fn validate_document(mut v: Value, source: &str, limits: &Limits) -> Result<Plan, InvalidPlan> {
    let bodies = take_plain_bodies(&mut v);
    validate_with(&v, bodies, source, limits)
}

/// [`validate_document`] for a document whose plain `file` contents were kept apart by its
/// maker (the gRPC front end, which receives them as slices of the request): `bodies` holds
/// the content of each such change by index, and the document an empty `content` string
/// with `encoding: plain` in its place. A body may be any bytes, UTF-8 or not.
pub fn validate_document_with_bodies(
    mut v: Value,
    mut bodies: HashMap<usize, Bytes>,
    source: &str,
    limits: &Limits,
) -> Result<Plan, InvalidPlan> {
    // The empty strings standing in for `bodies` are taken too; the bodies win.
    for (index, body) in take_plain_bodies(&mut v) {
        bodies.entry(index).or_insert(body);
    }
    validate_with(&v, bodies, source, limits)
}

/// Takes the content string out of every `file` change whose encoding is plain, leaving an
/// empty string in its place; keyed by change index.
fn take_plain_bodies(v: &mut Value) -> HashMap<usize, Bytes> {
    let mut bodies = HashMap::new();
    let Some(changes) = v.get_mut("changes").and_then(Value::as_array_mut) else {
        return bodies;
    };
    for (i, change) in changes.iter_mut().enumerate() {
        let Some(file) = change.get_mut("file").and_then(Value::as_object_mut) else {
            continue;
        };
        if super::json::plain_encoding(file)
            && let Some(Value::String(content)) = file.get_mut("content")
        {
            bodies.insert(i, Bytes::from(std::mem::take(content).into_bytes()));
        }
    }
    bodies
}

fn validate_with(
    v: &Value,
    bodies: HashMap<usize, Bytes>,
    source: &str,
    limits: &Limits,
) -> Result<Plan, InvalidPlan> {
    let mut cx = Cx {
        errors: Vec::new(),
        limits,
        claims: HashMap::new(),
        paths: BTreeMap::new(),
        bodies,
    };
    let plan = cx.plan(v);
    cx.nested_paths();
    match plan {
        Some(plan) if cx.errors.is_empty() => Ok(plan),
        _ => {
            if cx.errors.is_empty() {
                cx.err("", "plan is invalid");
            }
            Err(InvalidPlan {
                source: source.to_string(),
                errors: cx.errors,
            })
        }
    }
}

/// Validation context: collected errors and which change claimed which resource.
pub struct Cx<'l> {
    pub(crate) errors: Vec<FieldError>,
    pub(crate) limits: &'l Limits,
    /// "file:/etc/x" → the change index that manages it (duplicates are errors).
    claims: HashMap<String, usize>,
    /// The node paths claimed, with the change and the field that claimed them.
    paths: BTreeMap<String, (usize, String)>,
    /// Plain `file` contents taken out of the document, by change index
    /// ([`validate_document`]).
    bodies: HashMap<usize, Bytes>,
}

impl Cx<'_> {
    /// The plain content of change `index` when it was taken out of the document (the
    /// document then holds an empty string in its place).
    pub fn take_body(&mut self, index: usize) -> Option<Bytes> {
        self.bodies.remove(&index)
    }
}

pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

pub(crate) fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// Levenshtein distance, for "did you mean" hints.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// ` (did you mean "x"?)` when `key` is within two edits of one of `allowed`, else empty.
pub fn suggestion(key: &str, allowed: &[&str]) -> String {
    let lower = key.to_ascii_lowercase().replace(['_', '-'], "");
    allowed
        .iter()
        .map(|a| (a, distance(&lower, &a.to_ascii_lowercase())))
        .filter(|(_, d)| *d <= 2)
        .min_by_key(|(_, d)| *d)
        .map(|(a, _)| format!(" (did you mean {a:?}?)"))
        .unwrap_or_default()
}

impl Cx<'_> {
    pub(crate) fn err(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.errors.push(FieldError::new(field, message));
    }

    pub(crate) fn object<'v>(
        &mut self,
        path: &str,
        v: &'v Value,
    ) -> Option<&'v Map<String, Value>> {
        match v {
            Value::Object(m) => Some(m),
            other => {
                self.err(path, format!("must be an object, got {}", type_name(other)));
                None
            }
        }
    }

    pub(crate) fn known_keys(&mut self, path: &str, m: &Map<String, Value>, allowed: &[&str]) {
        for key in m.keys() {
            if !allowed.contains(&key.as_str()) {
                let hint = suggestion(key, allowed);
                self.err(
                    join(path, key),
                    format!(
                        "unknown field{hint}; expected one of: {}",
                        allowed.join(", ")
                    ),
                );
            }
        }
    }

    pub(crate) fn string<'v>(
        &mut self,
        path: &str,
        m: &'v Map<String, Value>,
        key: &str,
        required: bool,
    ) -> Option<&'v str> {
        match m.get(key) {
            None | Some(Value::Null) => {
                if required {
                    self.err(join(path, key), "is required");
                }
                None
            }
            Some(Value::String(s)) => {
                if s.contains('\0') {
                    self.err(join(path, key), "contains a NUL byte");
                    None
                } else {
                    Some(s)
                }
            }
            Some(other) => {
                self.err(
                    join(path, key),
                    format!("must be a string, got {}", type_name(other)),
                );
                None
            }
        }
    }

    /// A scalar written as a string; numbers and booleans are accepted and stringified.
    pub fn scalar(&mut self, path: &str, v: &Value) -> Option<String> {
        match v {
            Value::String(s) if s.contains('\0') => {
                self.err(path, "contains a NUL byte");
                None
            }
            Value::String(s) => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            Value::Bool(b) => Some(b.to_string()),
            other => {
                self.err(path, format!("must be a string, got {}", type_name(other)));
                None
            }
        }
    }

    pub(crate) fn boolean(
        &mut self,
        path: &str,
        m: &Map<String, Value>,
        key: &str,
    ) -> Option<bool> {
        match m.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::Bool(b)) => Some(*b),
            Some(other) => {
                self.err(
                    join(path, key),
                    format!("must be true or false, got {}", type_name(other)),
                );
                None
            }
        }
    }

    pub(crate) fn uint(
        &mut self,
        path: &str,
        m: &Map<String, Value>,
        key: &str,
        range: std::ops::RangeInclusive<u64>,
    ) -> Option<u64> {
        let v = m.get(key)?;
        if v.is_null() {
            return None;
        }
        match v.as_u64() {
            Some(n) if range.contains(&n) => Some(n),
            _ => {
                self.err(
                    join(path, key),
                    format!(
                        "must be a whole number from {} to {}, got {v}",
                        range.start(),
                        range.end()
                    ),
                );
                None
            }
        }
    }

    pub(crate) fn string_list(
        &mut self,
        path: &str,
        m: &Map<String, Value>,
        key: &str,
    ) -> Option<Vec<String>> {
        let field = join(path, key);
        match m.get(key) {
            None | Some(Value::Null) => Some(Vec::new()),
            Some(Value::Array(items)) => {
                let mut out = Vec::new();
                let mut ok = true;
                for (i, item) in items.iter().enumerate() {
                    match item {
                        Value::String(s) if !s.contains('\0') => out.push(s.clone()),
                        Value::String(_) => {
                            self.err(format!("{field}[{i}]"), "contains a NUL byte");
                            ok = false;
                        }
                        other => {
                            self.err(
                                format!("{field}[{i}]"),
                                format!("must be a string, got {}", type_name(other)),
                            );
                            ok = false;
                        }
                    }
                }
                ok.then_some(out)
            }
            Some(other) => {
                self.err(field, format!("must be a list, got {}", type_name(other)));
                None
            }
        }
    }

    /// Records that change `index` manages `resource`; a second claim is an error.
    pub fn claim(&mut self, field: &str, resource: String, what: &str, index: usize) {
        if let Some(first) = self.claims.get(&resource) {
            let msg = format!("{what} is also managed by changes[{first}]");
            self.err(field, msg);
        } else {
            if let Some(path) = resource.strip_prefix("path:") {
                self.paths
                    .insert(path.to_string(), (index, field.to_string()));
            }
            self.claims.insert(resource, index);
        }
    }

    /// A path claimed below another claimed path: one change needs the upper one as a file,
    /// the other as a directory, so applying fails half-way ("Not a directory"). Refused
    /// with the plan, before anything is touched.
    fn nested_paths(&mut self) {
        let mut found = Vec::new();
        for (path, (_, field)) in &self.paths {
            let Ok(p) = NodePath::parse(path) else {
                continue;
            };
            let upper = p
                .ancestors_from_top()
                .into_iter()
                .rev()
                .skip(1)
                .find_map(|a| self.paths.get(a.as_str()).map(|v| (a, v.0)));
            if let Some((upper, first)) = upper {
                found.push((
                    field.clone(),
                    format!(
                        "{path} is below {upper}, which changes[{first}] manages as a file; a path \
                         cannot be both a file and a directory"
                    ),
                ));
            }
        }
        for (field, message) in found {
            self.err(field, message);
        }
    }

    pub(crate) fn node_path(&mut self, field: &str, s: &str) -> Option<NodePath> {
        match NodePath::parse(s) {
            Ok(p) if self.limits.allow.allows(&p) => Some(p),
            Ok(p) => {
                self.err(
                    field,
                    format!(
                        "{p} is outside the allow-list ({}); to manage it, add its \
                         directory with --allow-path DIR (apply, check) or to \
                         plans.allow_paths in the agent's configuration (serve)",
                        self.limits.allow
                    ),
                );
                None
            }
            Err(e) => {
                self.err(field, format!("path {e}"));
                None
            }
        }
    }

    pub(crate) fn content_size(&mut self, field: &str, len: usize) -> bool {
        if len > self.limits.max_content_bytes {
            self.err(
                field,
                format!(
                    "content is {len} bytes, more than the limit of {} bytes",
                    self.limits.max_content_bytes
                ),
            );
            false
        } else {
            true
        }
    }

    // === the document ===

    fn plan(&mut self, v: &Value) -> Option<Plan> {
        if v.is_null() {
            self.err("", "plan is empty");
            return None;
        }
        let m = self.object("", v)?;
        self.known_keys(
            "",
            m,
            &[
                "apiVersion",
                "kind",
                "id",
                "nodeName",
                "options",
                "changes",
                "verify",
            ],
        );
        match self.string("", m, "apiVersion", true) {
            Some(API_VERSION) | None => {}
            Some(other) => self.err(
                "apiVersion",
                format!("{other:?} is not supported; expected {API_VERSION:?}"),
            ),
        }
        match self.string("", m, "kind", true) {
            Some("Plan") | None => {}
            Some(other) => self.err(
                "kind",
                format!("{other:?} is not supported; expected \"Plan\""),
            ),
        }
        let id = self.string("", m, "id", true).map(str::to_string);
        if let Some(id) = &id {
            if id.is_empty() || id.len() > 512 {
                self.err("id", "must be 1 to 512 characters");
            } else if id.chars().any(|c| c.is_control() || c.is_whitespace()) {
                self.err("id", "must not contain whitespace or control characters");
            }
        }
        let node_name = self.string("", m, "nodeName", false).map(str::to_string);
        if let Some(n) = &node_name
            && !is_dns_subdomain(n)
        {
            self.err(
                "nodeName",
                format!("{n:?} is not a valid node name (lowercase DNS subdomain)"),
            );
        }
        let options = match m.get("options") {
            None | Some(Value::Null) => Some(PlanOptions::default()),
            Some(o) => self.options(o),
        };
        let changes = match m.get("changes") {
            None | Some(Value::Null) => Some(Vec::new()),
            Some(Value::Array(items)) => {
                if items.len() > self.limits.max_changes {
                    self.err(
                        "changes",
                        format!(
                            "has {} entries, more than the limit of {}",
                            items.len(),
                            self.limits.max_changes
                        ),
                    );
                    None
                } else {
                    let mut out = Vec::with_capacity(items.len());
                    let mut ok = true;
                    for (i, item) in items.iter().enumerate() {
                        match self.change(i, item) {
                            Some(c) => out.push(c),
                            None => ok = false,
                        }
                    }
                    ok.then_some(out)
                }
            }
            Some(other) => {
                self.err(
                    "changes",
                    format!("must be a list, got {}", type_name(other)),
                );
                None
            }
        };
        let verify = match m.get("verify") {
            None | Some(Value::Null) => Some(Vec::new()),
            Some(Value::Array(items)) => {
                if items.len() > self.limits.max_checks {
                    self.err(
                        "verify",
                        format!(
                            "has {} entries, more than the limit of {}",
                            items.len(),
                            self.limits.max_checks
                        ),
                    );
                    None
                } else {
                    let mut out = Vec::new();
                    let mut ok = true;
                    for (i, item) in items.iter().enumerate() {
                        match self.check(i, item) {
                            Some(c) => out.push(c),
                            None => ok = false,
                        }
                    }
                    ok.then_some(out)
                }
            }
            Some(other) => {
                self.err(
                    "verify",
                    format!("must be a list, got {}", type_name(other)),
                );
                None
            }
        };
        Some(Plan {
            id: id?,
            node_name,
            options: options?,
            changes: changes?,
            verify: verify?,
        })
    }

    fn options(&mut self, v: &Value) -> Option<PlanOptions> {
        let m = self.object("options", v)?;
        self.known_keys(
            "options",
            m,
            &[
                "rollbackOnFailure",
                "timeoutSeconds",
                "stepTimeoutSeconds",
                "prune",
            ],
        );
        let d = PlanOptions::default();
        let prune = match m.get("prune") {
            None | Some(Value::Null) => None,
            Some(p) => self.object("options.prune", p).and_then(|pm| {
                self.known_keys("options.prune", pm, &["set"]);
                let set = self.string("options.prune", pm, "set", true)?;
                if is_set_name(set) {
                    Some(set.to_string())
                } else {
                    self.err(
                        "options.prune.set",
                        format!(
                            "{set:?} is not a set name (1 to 63 of a-z, 0-9 and -, alphanumeric at both ends)"
                        ),
                    );
                    None
                }
            }),
        };
        Some(PlanOptions {
            prune,
            rollback_on_failure: self
                .boolean("options", m, "rollbackOnFailure")
                .unwrap_or(d.rollback_on_failure),
            timeout: self
                .uint("options", m, "timeoutSeconds", 1..=7 * 86400)
                .map(Duration::from_secs)
                .unwrap_or(d.timeout),
            step_timeout: self
                .uint("options", m, "stepTimeoutSeconds", 1..=86400)
                .map(Duration::from_secs)
                .unwrap_or(d.step_timeout),
        })
    }

    fn change(&mut self, index: usize, v: &Value) -> Option<Change> {
        let base = format!("changes[{index}]");
        let m = self.object(&base, v)?;
        let kinds: Vec<&str> = ChangeKind::ALL.iter().map(|k| k.as_str()).collect();
        if m.len() != 1 {
            let names: Vec<&String> = m.keys().collect();
            self.err(
                &base,
                if m.is_empty() {
                    format!("must name exactly one change kind ({})", kinds.join(", "))
                } else {
                    format!(
                        "must name exactly one change kind, got {}: {}",
                        m.len(),
                        names
                            .iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                },
            );
            return None;
        }
        let (key, body) = m.iter().next()?;
        let Some(kind) = ChangeKind::from_key(key) else {
            let hint = suggestion(key, &kinds);
            self.err(
                &base,
                format!(
                    "unknown change kind {key:?}{hint}; expected one of: {}",
                    kinds.join(", ")
                ),
            );
            return None;
        };
        let path = format!("{base}.{key}");
        let body = if kind == ChangeKind::KubeadmUpgradeNode && body.is_null() {
            &Value::Object(Map::new())
        } else {
            body
        };
        let m = self.object(&path, body)?;
        kind.parse(self, index, &path, m)
    }

    pub(crate) fn restart_units(
        &mut self,
        path: &str,
        m: &Map<String, Value>,
    ) -> Option<Vec<String>> {
        let units = self.string_list(path, m, "restartUnits")?;
        let mut ok = true;
        for (i, u) in units.iter().enumerate() {
            if let Err(e) = check_unit_name(u) {
                self.err(format!("{path}.restartUnits[{i}]"), e);
                ok = false;
            }
        }
        ok.then_some(units)
    }

    pub(crate) fn mode(
        &mut self,
        path: &str,
        m: &Map<String, Value>,
        default: Mode,
    ) -> Option<Mode> {
        let field = join(path, "mode");
        match m.get("mode") {
            None | Some(Value::Null) => Some(default),
            Some(Value::String(s)) => match parse_mode(s) {
                Some(mode) => Some(mode),
                None => {
                    self.err(
                        field,
                        format!("{s:?} is not an octal mode (such as \"0644\")"),
                    );
                    None
                }
            },
            Some(Value::Number(n)) => {
                self.err(
                    field,
                    format!(
                        "{n} must be a quoted octal string such as \"0644\" \
                         (YAML reads an unquoted 0644 as a number)"
                    ),
                );
                None
            }
            Some(other) => {
                self.err(field, format!("must be a string, got {}", type_name(other)));
                None
            }
        }
    }

    pub(crate) fn owner(&mut self, path: &str, m: &Map<String, Value>) -> Option<Owner> {
        let field = join(path, "owner");
        match self.string(path, m, "owner", false) {
            None => Some(Owner::default()),
            Some(s) => match parse_owner(s) {
                Ok(o) => Some(o),
                Err(e) => {
                    self.err(field, e);
                    None
                }
            },
        }
    }

    fn check(&mut self, index: usize, v: &Value) -> Option<Check> {
        let base = format!("verify[{index}]");
        let m = self.object(&base, v)?;
        const PROBES: [&str; 5] = [
            "unitActive",
            "httpGet",
            "kubeletVersion",
            "command",
            "controlPlane",
        ];
        if m.len() != 1 {
            self.err(
                &base,
                format!("must name exactly one check kind ({})", PROBES.join(", ")),
            );
            return None;
        }
        let (key, body) = m.iter().next()?;
        let path = format!("{base}.{key}");
        if !PROBES.contains(&key.as_str()) {
            let hint = suggestion(key, &PROBES);
            self.err(
                &base,
                format!(
                    "unknown check kind {key:?}{hint}; expected one of: {}",
                    PROBES.join(", ")
                ),
            );
            return None;
        }
        let m = self.object(&path, body)?;
        let common = ["timeoutSeconds", "periodSeconds"];
        let with = |extra: &[&'static str]| -> Vec<&'static str> {
            extra.iter().chain(common.iter()).copied().collect()
        };
        let timeout = self
            .uint(&path, m, "timeoutSeconds", 1..=3600)
            .map(Duration::from_secs)
            .unwrap_or(Duration::from_secs(60));
        let period = self
            .uint(&path, m, "periodSeconds", 1..=300)
            .map(Duration::from_secs)
            .unwrap_or(Duration::from_secs(2))
            .min(timeout);
        let probe = match key.as_str() {
            "unitActive" => {
                self.known_keys(&path, m, &with(&["name"]));
                let name = self.string(&path, m, "name", true)?.to_string();
                if let Err(e) = check_unit_name(&name) {
                    self.err(join(&path, "name"), e);
                    return None;
                }
                Probe::UnitActive { name }
            }
            "httpGet" => {
                self.known_keys(&path, m, &with(&["url", "expectStatus"]));
                let url = self.string(&path, m, "url", true)?.to_string();
                if let Err(e) = check_url(&url, &["*".to_string()]) {
                    self.err(join(&path, "url"), e);
                    return None;
                }
                let expect_status = self
                    .uint(&path, m, "expectStatus", 100..=599)
                    .unwrap_or(200) as u16;
                Probe::HttpGet { url, expect_status }
            }
            "kubeletVersion" => {
                self.known_keys(&path, m, &with(&["version"]));
                let version = self.string(&path, m, "version", true)?;
                match normalize_kube_version(version) {
                    Some(v) => Probe::KubeletVersion { version: v },
                    None => {
                        self.err(
                            join(&path, "version"),
                            format!("{version:?} is not a Kubernetes version such as v1.31.2"),
                        );
                        return None;
                    }
                }
            }
            "controlPlane" => {
                self.known_keys(&path, m, &with(&ControlPlaneGate::KEYS));
                Probe::ControlPlane(ControlPlaneGate::parse(self, &path, m)?)
            }
            _ => {
                self.known_keys(&path, m, &with(&["argv"]));
                let argv = self.string_list(&path, m, "argv")?;
                if argv.is_empty() {
                    self.err(join(&path, "argv"), "must name a program");
                    return None;
                }
                Probe::Command { argv }
            }
        };
        Some(Check {
            probe,
            timeout,
            period,
        })
    }
}

// === pure field checks, shared with other modules ===

/// Parses "0644", "644", "1777" into a mode; `None` when not 3-4 octal digits.
pub fn parse_mode(s: &str) -> Option<Mode> {
    if !(3..=4).contains(&s.len()) || !s.bytes().all(|b| (b'0'..=b'7').contains(&b)) {
        return None;
    }
    u32::from_str_radix(s, 8).ok().map(Mode)
}

/// Parses "user", "user:group", "1000:1000".
pub fn parse_owner(s: &str) -> Result<Owner, String> {
    let (user, group) = match s.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (s, None),
    };
    let id = |part: &str, what: &str| -> Result<IdRef, String> {
        if part.is_empty() {
            return Err(format!("{s:?} has an empty {what}; write \"user:group\""));
        }
        if part.bytes().all(|b| b.is_ascii_digit()) {
            return part
                .parse::<u32>()
                .ok()
                .filter(|n| *n != u32::MAX)
                .map(IdRef::Id)
                .ok_or_else(|| format!("{what} id {part} is out of range"));
        }
        let valid = part.len() <= 32
            && part
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
            && part
                .trim_end_matches('$')
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-');
        if valid {
            Ok(IdRef::Name(part.to_string()))
        } else {
            Err(format!("{part:?} is not a valid {what} name"))
        }
    };
    Ok(Owner {
        user: id(user, "user")?,
        group: group.map(|g| id(g, "group")).transpose()?,
    })
}

/// Decodes inline content, bounded by `max` decoded bytes.
pub fn decode_content(raw: &str, enc: Encoding, max: usize) -> Result<Vec<u8>, String> {
    let b64 = |s: &str| -> Result<Vec<u8>, String> {
        let compact: String = s.chars().filter(|c| !c.is_ascii_whitespace()).collect();
        base64::engine::general_purpose::STANDARD
            .decode(compact.as_bytes())
            .map_err(|e| format!("is not valid base64: {e}"))
    };
    let gunzip = |bytes: &[u8]| -> Result<Vec<u8>, String> {
        let mut out = Vec::new();
        let limit = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
        flate2::read::GzDecoder::new(bytes)
            .take(limit)
            .read_to_end(&mut out)
            .map_err(|e| format!("is not valid gzip: {e}"))?;
        if out.len() > max {
            return Err(format!(
                "decompresses to more than the limit of {max} bytes"
            ));
        }
        Ok(out)
    };
    match enc {
        Encoding::Plain => Ok(raw.as_bytes().to_vec()),
        Encoding::Base64 => b64(raw),
        Encoding::GzipBase64 => gunzip(&b64(raw)?),
        Encoding::Gzip => {
            let bytes: Option<Vec<u8>> = raw
                .chars()
                .map(|c| u8::try_from(u32::from(c)).ok())
                .collect();
            let bytes = bytes.ok_or_else(|| {
                "gzip content must be binary (each character one byte); \
                 use gzip+base64 in text plan files"
                    .to_string()
            })?;
            gunzip(&bytes)
        }
    }
}

/// Checks a systemd unit name.
pub fn check_unit_name(name: &str) -> Result<(), String> {
    const SUFFIXES: [&str; 11] = [
        "service",
        "socket",
        "target",
        "timer",
        "mount",
        "path",
        "slice",
        "scope",
        "device",
        "swap",
        "automount",
    ];
    let valid_chars = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || ":-_.\\@".contains(c));
    let suffix_ok = name
        .rsplit_once('.')
        .is_some_and(|(stem, sfx)| !stem.is_empty() && SUFFIXES.contains(&sfx));
    if name.len() > 255 || !valid_chars || !suffix_ok || name.starts_with('.') {
        Err(format!(
            "{name:?} is not a valid systemd unit name (such as kubelet.service)"
        ))
    } else {
        Ok(())
    }
}

pub(crate) fn check_flag_name(name: &str) -> Result<(), String> {
    if let Some(stripped) = name.strip_prefix("--").or_else(|| name.strip_prefix('-')) {
        return Err(format!(
            "flag names are written without leading dashes ({stripped:?})"
        ));
    }
    let valid = !name.is_empty()
        && name.len() <= 128
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if valid {
        Ok(())
    } else {
        Err(format!("{name:?} is not a valid kubelet flag name"))
    }
}

pub(crate) fn check_flag_value(value: &str) -> Result<(), String> {
    if value
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || "\"'\\$`".contains(c))
    {
        Err(format!(
            "value {value:?} must not contain whitespace, quotes, backslashes, '$' or '`' \
             (kubeadm-flags.env cannot carry them)"
        ))
    } else {
        Ok(())
    }
}

/// Checks a sysctl key; returns its segments.
pub fn sysctl_segments(key: &str) -> Result<Vec<&str>, String> {
    let sep = if key.contains('/') { '/' } else { '.' };
    let segs: Vec<&str> = key.split(sep).collect();
    let valid = !key.is_empty()
        && key.len() <= 255
        && segs.len() >= 2
        && segs.iter().all(|s| {
            !s.is_empty()
                && *s != ".."
                && *s != "."
                && s.chars().all(|c| {
                    c.is_ascii_alphanumeric() || "_-:.".contains(c) && (c != '.' || sep == '/')
                })
        });
    if valid {
        Ok(segs)
    } else {
        Err(format!(
            "{key:?} is not a sysctl key (such as net.ipv4.ip_forward)"
        ))
    }
}

pub(crate) fn check_sysctl_key(key: &str) -> Result<(), String> {
    sysctl_segments(key).map(|_| ())
}

pub(crate) fn check_url(url: &str, allow_http_hosts: &[String]) -> Result<(), String> {
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| format!("{url:?} is not an absolute URL"))?;
    let host_port = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = host_port
        .rsplit_once('@')
        .map_or(host_port, |(_, h)| h)
        .trim_start_matches('[');
    let host = host.split([']']).next().unwrap_or(host);
    let host = if host_port.starts_with('[') {
        host
    } else {
        host.split(':').next().unwrap_or(host)
    };
    if host.is_empty() || url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{url:?} is not a valid URL"));
    }
    match scheme {
        "https" => Ok(()),
        "http" if allow_http_hosts.iter().any(|h| h == "*" || h == host) => Ok(()),
        "http" => Err(format!(
            "plain http to {host} is not allowed; use https, or allow the host with \
             --allow-http-host {host} (apply, check) or in plans.allow_http_hosts of the agent's \
             configuration (serve)"
        )),
        other => Err(format!("scheme {other:?} is not supported (https, http)")),
    }
}

/// `1.31.2` or `v1.31.2` (with an optional pre-release) → `v1.31.2`.
pub fn normalize_kube_version(v: &str) -> Option<String> {
    let bare = v.strip_prefix('v').unwrap_or(v);
    let (core, extra) = match bare.find(['-', '+']) {
        Some(i) => (&bare[..i], &bare[i..]),
        None => (bare, ""),
    };
    let parts: Vec<&str> = core.split('.').collect();
    let numeric = parts.len() == 3
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    let extra_ok = extra
        .chars()
        .skip(1)
        .all(|c| c.is_ascii_alphanumeric() || ".-".contains(c));
    (numeric && extra_ok && extra != "-" && extra != "+").then(|| format!("v{bare}"))
}

/// True for a lowercase RFC 1123 DNS subdomain (a valid Kubernetes node name).
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> Result<Plan, InvalidPlan> {
        parse_plan(yaml.as_bytes(), "test.yaml", &Limits::default())
    }

    fn errors(yaml: &str) -> Vec<String> {
        parse(yaml)
            .expect_err("plan should be invalid")
            .errors
            .iter()
            .map(|e| e.to_string())
            .collect()
    }

    const HEAD: &str = "apiVersion: inplace.agent/v1\nkind: Plan\nid: ns/m@1\n";

    #[test]
    fn a_plan_read_from_its_input_is_the_plan_parsed_whole_within_any_limit() {
        let yaml =
            format!("{HEAD}changes:\n  - file: {{path: /etc/kubernetes/a, content: \"a\\n\"}}\n");
        let json = format!(
            r#"  {{"apiVersion": "inplace.agent/v1", "kind": "Plan", "id": "ns/m@1", "changes": [{{"file": {{"path": "/etc/kubernetes/a", "content": "{}"}}}}]}}"#,
            "b\\n".repeat(5000)
        );
        for text in [yaml, json] {
            let whole = parse_whole(text.as_bytes(), "t", &Limits::default()).unwrap();
            for limits in [Limits::default(), Limits::replay()] {
                let read = read_plan(&mut text.as_bytes(), "t", &limits).unwrap();
                assert_eq!(read, whole);
                assert_eq!(read.digest(), whole.digest());
            }
            let small = Limits {
                max_plan_bytes: 100,
                ..Limits::default()
            };
            let Err(ReadPlanError::Invalid(e)) = read_plan(&mut text.as_bytes(), "t", &small)
            else {
                panic!("a plan over the limit is refused");
            };
            assert_eq!(
                e.errors[0].message,
                "plan is more than the limit of 100 bytes"
            );
        }
    }

    /// A JSON plan read for submitting: the same plan as parsed whole, and the sum of each
    /// long plain `file` content known from the read — the sum of those very bytes. Long
    /// strings under `content` that are not plain file contents (base64, a unit's drop-in)
    /// are put back in place as text.
    #[test]
    fn a_plan_read_for_submitting_knows_the_sums_of_its_long_plain_contents() {
        let long = |c: &str| c.repeat(70_000);
        let b64 = base64::engine::general_purpose::STANDARD.encode(long("z").as_bytes());
        let changes = [
            format!(
                r#"{{"file": {{"path": "/etc/kubernetes/a", "content": "{}"}}}}"#,
                long("a\\n\\u00e9\\ud83d\\ude00\\\"")
            ),
            format!(
                r#"{{"file": {{"path": "/etc/kubernetes/b", "content" :
               "{}", "mode": "0600"}}}}"#,
                long("b")
            ),
            format!(
                r#"{{"file": {{"content": "{}", "encoding": "plain", "path": "/etc/kubernetes/c"}}}}"#,
                long("c")
            ),
            format!(
                r#"{{"file": {{"path": "/etc/kubernetes/d", "encoding": "base64", "content": "{b64}"}}}}"#
            ),
            r#"{"file": {"path": "/etc/kubernetes/e", "content": "short"}}"#.to_string(),
            format!(
                r#"{{"file": {{"path": "/etc/kubernetes/g", "content": "{}"}}}}"#,
                "g".repeat(5000)
            ),
            format!(
                r#"{{"unit": {{"name": "x.service", "dropIn": {{"name": "10-a.conf", "content": "[Service]\n{}"}}}}}}"#,
                long("#")
            ),
            format!(
                r#"{{"file": {{"path": "/etc/kubernetes/f", "cont\u0065nt": "{}"}}}}"#,
                long("f")
            ),
        ];
        let text = format!(
            r#"{{"apiVersion": "inplace.agent/v1", "kind": "Plan", "id": "ns/m@1", "changes": [{}]}}"#,
            changes.join(",\n")
        );
        let whole = parse_whole(text.as_bytes(), "t", &Limits::replay()).unwrap();
        for step in [7, 4096, 1 << 20] {
            let mut input = std::io::BufReader::with_capacity(step, text.as_bytes());
            let (plan, known) = read_plan_hashed(&mut input, "t", &Limits::replay()).unwrap();
            assert_eq!(plan, whole);
            // a, b and c; not the base64 one, the short ones (g is long, but under 64 KiB),
            // the drop-in or the escaped key.
            assert_eq!(known.len(), 3, "reads of {step}");
            let sums = ContentSums::of_known(&plan, known);
            assert_eq!(sums, ContentSums::of(&plan));
            let mut input = std::io::BufReader::with_capacity(step, text.as_bytes());
            let (_, known) = read_plan_hashed(&mut input, "t", &Limits::replay()).unwrap();
            let for_whole = ContentSums::of_known(&whole, known);
            assert_eq!(for_whole, sums, "contents of another plan are hashed again");
            assert_eq!(plan.digest_with(&sums), whole.digest());
        }
        let (_, known) = read_plan_hashed(
            &mut format!("{HEAD}changes: []\n").as_bytes(),
            "t",
            &Limits::default(),
        )
        .unwrap();
        assert!(known.is_empty(), "YAML is not hashed while read");
    }

    #[test]
    fn parses_the_design_example() {
        let plan = parse(include_str!(
            "../../../tests/fixtures/plans/design-example.yaml"
        ))
        .unwrap();
        assert_eq!(plan.changes.len(), 10);
        assert_eq!(plan.verify.len(), 3);
        let Change::File(f) = &plan.changes[0] else {
            panic!("first change is a file")
        };
        assert_eq!(f.mode, Mode(0o640));
        assert_eq!(f.restart_units, ["kubelet.service"]);
        assert_eq!(plan.options.timeout, Duration::from_secs(900));
    }

    #[test]
    fn reports_every_error_with_its_field() {
        let errs = errors(&format!(
            "{HEAD}changes:\n\
             - file: {{path: /etc/kubernetes/a, content: x, mode: \"0999\"}}\n\
             - file: {{path: etc/x, content: x}}\n\
             - fiel: {{path: /etc/kubernetes/b}}\n"
        ));
        assert_eq!(
            errs,
            [
                "changes[0].file.mode: \"0999\" is not an octal mode (such as \"0644\")",
                "changes[1].file.path: path \"etc/x\" is not absolute (it must start with /)",
                "changes[2]: unknown change kind \"fiel\" (did you mean \"file\"?); expected one of: \
                 file, absent, kubeletConfig, kubeletFlags, sysctl, package, artifact, unit, \
                 kubeadmUpgradeNode, reboot, exec, apiServerCertificate",
            ]
        );
    }

    #[test]
    fn a_path_below_another_changes_file_is_refused() {
        let errs = errors(&format!(
            "{HEAD}changes:\n\
             - file: {{path: /etc/kubernetes/first.conf, content: a}}\n\
             - file: {{path: /etc/kubernetes/d, content: b}}\n\
             - file: {{path: /etc/kubernetes/d/y.conf, content: c}}\n\
             - file: {{path: /etc/kubernetes/d.conf, content: c}}\n\
             - file: {{path: /etc/kubernetes/d-1/x, content: c}}\n"
        ));
        assert_eq!(
            errs,
            [
                "changes[2].file.path: /etc/kubernetes/d/y.conf is below /etc/kubernetes/d, which \
              changes[1] manages as a file; a path cannot be both a file and a directory"
            ]
        );
    }

    #[test]
    fn a_sysctl_and_a_file_of_its_conf_file_are_refused() {
        let errs = errors(&format!(
            "{HEAD}changes:\n\
             - sysctl: {{key: net.ipv4.ip_forward, value: \"1\"}}\n\
             - file: {{path: /etc/sysctl.d/90-inplace-agent-net.ipv4.ip_forward.conf, content: x}}\n"
        ));
        assert_eq!(
            errs,
            [
                "changes[1].file.path: /etc/sysctl.d/90-inplace-agent-net.ipv4.ip_forward.conf is \
              also managed by changes[0]"
            ]
        );
    }

    #[test]
    fn duplicate_paths_name_the_first_owner() {
        let errs = errors(&format!(
            "{HEAD}changes:\n\
             - file: {{path: /var/lib/kubelet/config.yaml, content: x}}\n\
             - kubeletConfig: {{mergePatch: {{maxPods: 10}}}}\n"
        ));
        assert_eq!(
            errs,
            [
                "changes[1].kubeletConfig.mergePatch: /var/lib/kubelet/config.yaml is also managed by changes[0]"
            ]
        );
    }

    #[test]
    fn content_encodings_decode() {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"hello").unwrap();
        let gz = gz.finish().unwrap();
        let b64 = base64::engine::general_purpose::STANDARD.encode(&gz);
        assert_eq!(
            decode_content(&b64, Encoding::GzipBase64, 100).unwrap(),
            b"hello"
        );
        assert_eq!(
            decode_content("aGk=\n", Encoding::Base64, 100).unwrap(),
            b"hi"
        );
        let latin1: String = gz.iter().map(|b| char::from(*b)).collect();
        assert_eq!(
            decode_content(&latin1, Encoding::Gzip, 100).unwrap(),
            b"hello"
        );
        assert!(decode_content(&b64, Encoding::GzipBase64, 3).is_err());
        assert!(decode_content("!!", Encoding::Base64, 100).is_err());
    }

    #[test]
    fn digest_ignores_encoding_and_id_but_not_content() {
        let a = parse(&format!(
            "{HEAD}changes:\n- file: {{path: /etc/kubernetes/a, content: hi}}\n"
        ))
        .unwrap();
        let b = parse(
            "apiVersion: inplace.agent/v1\nkind: Plan\nid: other\nchanges:\n\
             - file: {path: /etc/kubernetes/a, content: aGk=, encoding: base64, mode: \"644\"}\n",
        )
        .unwrap();
        let c = parse(&format!(
            "{HEAD}changes:\n- file: {{path: /etc/kubernetes/a, content: ho}}\n"
        ))
        .unwrap();
        assert_eq!(a.digest(), b.digest());
        assert_ne!(a.digest(), c.digest());
        assert!(a.digest().starts_with("v2:sha256:"));
        assert_eq!(a.digest_v1(), b.digest_v1());
        assert_ne!(a.digest_v1(), c.digest_v1());
        assert!(a.digest_v1().starts_with("sha256:"));
        for (digest, plan) in [(a.digest(), &b), (b.digest_v1(), &a)] {
            assert!(plan.has_digest(&digest), "{digest}");
            assert!(!c.has_digest(&digest), "{digest}");
        }
    }

    #[test]
    fn canonical_json_round_trips() {
        let plan = parse(include_str!(
            "../../../tests/fixtures/plans/design-example.yaml"
        ))
        .unwrap();
        let again = validate_value(&plan.canonical_json(), "journal", &Limits::replay()).unwrap();
        assert_eq!(plan, again);
        assert_eq!(plan.digest(), again.digest());
    }

    /// Journals keep digests across agent versions: the same plan must keep its digest, by
    /// either definition (v1 is what agents before v2 journaled).
    #[test]
    fn the_digest_of_a_known_plan_does_not_change() {
        let plan = parse(include_str!(
            "../../../tests/fixtures/plans/design-example.yaml"
        ))
        .unwrap();
        assert_eq!(
            plan.digest_v1(),
            "sha256:5b24db0ac4bad5e2b7fc431b4f761c559987e9e7b20ada932ba240b89dab0596"
        );
        assert_eq!(
            plan.digest(),
            "v2:sha256:cfdfc5fb76237dedd1f8c8374cf289f1c200119a44b58ecf090ea25cffd1a171"
        );
    }

    #[test]
    fn field_helpers() {
        assert_eq!(parse_mode("0640"), Some(Mode(0o640)));
        assert_eq!(parse_mode("4755"), Some(Mode(0o4755)));
        assert_eq!(parse_mode("0999"), None);
        assert_eq!(parse_mode("64"), None);
        assert_eq!(parse_owner("root:adm").unwrap().to_string(), "root:adm");
        assert!(parse_owner(":x").is_err());
        assert!(parse_owner("Root").is_err());
        assert_eq!(normalize_kube_version("1.31.2").as_deref(), Some("v1.31.2"));
        assert_eq!(
            normalize_kube_version("v1.31.0-rc.1").as_deref(),
            Some("v1.31.0-rc.1")
        );
        assert_eq!(normalize_kube_version("v1.31"), None);
        assert!(sysctl_segments("net.ipv4.ip_forward").is_ok());
        assert_eq!(
            sysctl_segments("net/ipv4/conf/eth0.1/rp_filter")
                .unwrap()
                .len(),
            5
        );
        assert!(sysctl_segments("net..x").is_err());
        assert!(sysctl_segments("../../etc").is_err());
        assert!(check_unit_name("kubelet.service").is_ok());
        assert!(check_unit_name("getty@tty1.service").is_ok());
        assert!(check_unit_name("kubelet").is_err());
        assert!(check_unit_name("../x.service").is_err());
        assert!(check_url("http://mirror/x", &["mirror".into()]).is_ok());
        assert!(check_url("http://other/x", &["mirror".into()]).is_err());
        assert!(check_url("ftp://x/y", &[]).is_err());
    }
}

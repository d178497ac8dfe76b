//! Bounded parsing of untrusted YAML and JSON: bootstrap data (a Secret a tenant can write),
//! Ignition's `additionalConfig` and hook request bodies (anyone who reaches the hook port
//! can send one) become a [`Document`] only within [`Limits`].
//!
//! The value is built by a [`serde::de::DeserializeSeed`] that counts every node it visits
//! and every byte of every scalar against one budget, and stops at the first node past a
//! limit: nothing larger than the limits is ever allocated for the value. serde_yaml_ng
//! replays an alias's events at each use, so an alias costs the nodes it expands to — the
//! "billion laughs" shapes spend the budget in microseconds and are refused.
//!
//! Aliases are counted, not refused: CABPK's cloud-init templates write none
//! (kubernetes-sigs/cluster-api `bootstrap/kubeadm/internal/cloudinit/files.go`,
//! `cloudinit.go`: `write_files` entries with block-scalar content), but a KubeadmConfig's
//! `owner`, `path` and commands are rendered unquoted, other bootstrap providers and the
//! hand-written Container Linux Configs in `additionalConfig` may use anchors, and cloud-init
//! itself accepts them. Counting expansion bounds memory exactly as well as refusing would,
//! without refusing a document cloud-init runs.
//!
//! Errors name the limit, its value and the line where it was passed when the parser knows
//! it; never a byte of the document (bootstrap data holds a bootstrap token).

use std::cell::Cell;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess};
use serde_json::{Map, Number, Value};

/// Largest request body read: 8 MiB. A request carries six objects (current and desired
/// Machine, infrastructure machine and KubeadmConfig); a KubeadmConfig's content must fit
/// the 1 MiB bootstrap data Secret CABPK renders it into, and the others are a few KiB, so a
/// real request is under 3 MiB. The body, its parse and the request's copies cost about four
/// times its size at peak (tests/it/updater_bounded.rs: 75 MiB for 16 MiB), so 8 MiB keeps
/// the updater under 64 MiB (this module bounds the parse); the server reads no more
/// (`server.rs`).
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// How much of an untrusted document the updater reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest document, in bytes, before parsing starts.
    pub input_bytes: usize,
    /// Deepest nesting of lists and maps (the top level is depth 1).
    pub depth: usize,
    /// Most nodes (scalars, lists, maps and map keys), an alias counted as the nodes it
    /// expands to.
    pub nodes: usize,
    /// Most bytes of all scalars (strings and map keys) together, after alias expansion.
    pub scalar_bytes: usize,
}

impl Limits {
    /// Bootstrap data in YAML (cloud-config) and Ignition's `additionalConfig` (a Container
    /// Linux Config).
    ///
    /// Input: 256 KiB. serde_yaml_ng (libyaml) reads the whole document into a list of
    /// events before the budget sees a node, about 130 bytes of memory per event and up to
    /// one event per input byte (`[[[[…`, measured: 35 MiB peak for 256 KiB, 134 MiB for
    /// 1 MiB), so the input size is what bounds that list. 256 KiB is the largest user data
    /// a provider passes to a machine (GCE's metadata value; EC2 takes 16 KiB, Azure and
    /// OpenStack 64 KiB); a CABPK cloud-config is 5 to 30 KiB. Depth: 64 (a cloud-config
    /// nests 4 levels). Nodes: 100,000 (a CABPK cloud-config with 50 files has about 500).
    /// Scalar bytes: 4 MiB, sixteen times the largest input: room for honest anchors.
    pub const BOOTSTRAP_YAML: Limits = Limits {
        input_bytes: 256 << 10,
        depth: 64,
        nodes: 100_000,
        scalar_bytes: 4 << 20,
    };

    /// Bootstrap data in JSON (Ignition).
    ///
    /// Input: 1 MiB, the most a Kubernetes Secret holds (the API server refuses a larger
    /// one), so no Secret CABPK could write is refused; serde_json reads as it goes, so
    /// only the value costs memory, and the node and byte limits bound it. Depth: 64 (an
    /// Ignition config nests 6 levels). Nodes: 100,000. Scalar bytes: the input's (JSON has
    /// no aliases).
    pub const BOOTSTRAP_JSON: Limits = Limits {
        input_bytes: 1 << 20,
        depth: 64,
        nodes: 100_000,
        scalar_bytes: 1 << 20,
    };

    /// A hook request body (JSON, no aliases: its scalars are never more than its bytes).
    ///
    /// Input: the server's body limit ([`MAX_BODY_BYTES`]). Depth: 64 (a
    /// request nests its objects 3 levels deep, and an object's `managedFields` about 12
    /// more). Nodes: 200,000 (a request with six objects and their managed fields has a
    /// few thousand).
    pub const REQUEST_BODY: Limits = Limits {
        input_bytes: MAX_BODY_BYTES,
        depth: 64,
        nodes: 200_000,
        scalar_bytes: MAX_BODY_BYTES,
    };
}

/// Which limit a document passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// [`Limits::input_bytes`].
    InputBytes,
    /// [`Limits::depth`].
    Depth,
    /// [`Limits::nodes`].
    Nodes,
    /// [`Limits::scalar_bytes`].
    ScalarBytes,
}

impl Limit {
    fn of(self, limits: &Limits) -> usize {
        match self {
            Limit::InputBytes => limits.input_bytes,
            Limit::Depth => limits.depth,
            Limit::Nodes => limits.nodes,
            Limit::ScalarBytes => limits.scalar_bytes,
        }
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Limit::InputBytes => "size limit",
            Limit::Depth => "nesting depth limit",
            Limit::Nodes => "node count limit",
            Limit::ScalarBytes => "scalar bytes limit",
        })
    }
}

/// The syntax a document was read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Syntax {
    /// YAML 1.1/1.2 (cloud-config, Container Linux Config, Butane).
    Yaml,
    /// JSON (Ignition, hook requests).
    Json,
}

impl fmt::Display for Syntax {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Syntax::Yaml => "YAML",
            Syntax::Json => "JSON",
        })
    }
}

/// Why an untrusted document was not read; says where, never what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The document is larger than [`Limits::input_bytes`]; nothing of it was parsed.
    #[error("{syntax} document of {size} bytes is over the size limit of {limit} bytes")]
    TooLarge {
        /// YAML or JSON.
        syntax: Syntax,
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// Reading stopped at the first node past a limit.
    #[error("{syntax} document is over the {limit} of {value}{}{}", what(*.limit), at_line(*.line))]
    OverLimit {
        /// YAML or JSON.
        syntax: Syntax,
        /// Which limit.
        limit: Limit,
        /// The limit's value.
        value: usize,
        /// The line where it was passed, when the parser knows.
        line: Option<usize>,
    },
    /// A mapping key that is a list or a map (YAML's complex keys): no JSON value has one.
    #[error("{syntax} document has a mapping key that is not a scalar{}", at_line(*.line))]
    ComplexKey {
        /// YAML (JSON has none).
        syntax: Syntax,
        /// Where, when known.
        line: Option<usize>,
    },
    /// The document does not parse.
    #[error("{syntax} does not parse{}", at(*.line, *.column))]
    Syntax {
        /// YAML or JSON.
        syntax: Syntax,
        /// Where, when known.
        line: Option<usize>,
        /// Where, when known.
        column: Option<usize>,
    },
}

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

fn at(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(l), Some(c)) => format!(" at line {l} column {c}"),
        (Some(l), None) => format!(" at line {l}"),
        _ => String::new(),
    }
}

fn what(limit: Limit) -> &'static str {
    match limit {
        Limit::InputBytes => " bytes",
        Limit::Depth => " levels",
        Limit::Nodes => " nodes (an alias counts as the nodes it expands to)",
        Limit::ScalarBytes => " bytes of scalars (an alias counts as what it expands to)",
    }
}

impl ParseError {
    /// The limit passed, if that is why.
    pub fn limit(&self) -> Option<Limit> {
        match self {
            ParseError::TooLarge { .. } => Some(Limit::InputBytes),
            ParseError::OverLimit { limit, .. } => Some(*limit),
            _ => None,
        }
    }
}

/// A document read within its [`Limits`]; only this module builds one.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    value: Value,
    nodes: usize,
    scalar_bytes: usize,
}

impl Document {
    /// The document as a JSON value (YAML scalars typed as YAML 1.2's core schema reads
    /// them, tags dropped, map keys as strings).
    pub fn value(&self) -> &Value {
        &self.value
    }

    /// The value, owned.
    pub fn into_value(self) -> Value {
        self.value
    }

    /// The nodes it was counted as (at most [`Limits::nodes`]).
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// The bytes of its scalars (at most [`Limits::scalar_bytes`]).
    pub fn scalar_bytes(&self) -> usize {
        self.scalar_bytes
    }
}

/// One YAML document (a stream of more than one is refused) within `limits`.
pub fn yaml(text: &str, limits: &Limits) -> Result<Document, ParseError> {
    let syntax = Syntax::Yaml;
    check_size(syntax, text.len(), limits)?;
    let budget = Budget::new(*limits);
    let parsed = Root(&budget).deserialize(serde_yaml_ng::Deserializer::from_str(text));
    finish(syntax, &budget, parsed, |e: &serde_yaml_ng::Error| {
        e.location().map(|l| (l.line(), l.column()))
    })
}

/// One JSON document within `limits`.
pub fn json(bytes: &[u8], limits: &Limits) -> Result<Document, ParseError> {
    let syntax = Syntax::Json;
    check_size(syntax, bytes.len(), limits)?;
    let budget = Budget::new(*limits);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed = Root(&budget).deserialize(&mut de).and_then(|v| {
        de.end()?;
        Ok(v)
    });
    finish(syntax, &budget, parsed, |e: &serde_json::Error| {
        (e.line() > 0).then(|| (e.line(), e.column()))
    })
}

fn check_size(syntax: Syntax, size: usize, limits: &Limits) -> Result<(), ParseError> {
    if size > limits.input_bytes {
        return Err(ParseError::TooLarge {
            syntax,
            size,
            limit: limits.input_bytes,
        });
    }
    Ok(())
}

fn finish<E>(
    syntax: Syntax,
    budget: &Budget,
    parsed: Result<Value, E>,
    place: impl Fn(&E) -> Option<(usize, usize)>,
) -> Result<Document, ParseError> {
    match parsed {
        Ok(value) => Ok(Document {
            value,
            nodes: budget.nodes.get(),
            scalar_bytes: budget.scalar_bytes.get(),
        }),
        Err(e) => {
            let place = place(&e);
            let line = place.map(|(l, _)| l);
            Err(match budget.refused.get() {
                Some(Refusal::Limit(limit)) => ParseError::OverLimit {
                    syntax,
                    limit,
                    value: limit.of(&budget.limits),
                    line,
                },
                Some(Refusal::ComplexKey) => ParseError::ComplexKey { syntax, line },
                None => ParseError::Syntax {
                    syntax,
                    line,
                    column: place.map(|(_, c)| c),
                },
            })
        }
    }
}

// === the budget ===

#[derive(Debug, Clone, Copy)]
enum Refusal {
    Limit(Limit),
    ComplexKey,
}

/// What one document may still spend; the first refusal is remembered (the parser's own
/// error text is never shown: it may quote the document).
struct Budget {
    limits: Limits,
    nodes: Cell<usize>,
    scalar_bytes: Cell<usize>,
    refused: Cell<Option<Refusal>>,
}

impl Budget {
    fn new(limits: Limits) -> Budget {
        Budget {
            limits,
            nodes: Cell::new(0),
            scalar_bytes: Cell::new(0),
            refused: Cell::new(None),
        }
    }

    fn refuse<E: serde::de::Error>(&self, why: Refusal) -> E {
        if self.refused.get().is_none() {
            self.refused.set(Some(why));
        }
        E::custom("refused by the limits")
    }

    /// One more node.
    fn node<E: serde::de::Error>(&self) -> Result<(), E> {
        let n = self.nodes.get() + 1;
        if n > self.limits.nodes {
            return Err(self.refuse(Refusal::Limit(Limit::Nodes)));
        }
        self.nodes.set(n);
        Ok(())
    }

    /// One more scalar node of `len` bytes.
    fn scalar<E: serde::de::Error>(&self, len: usize) -> Result<(), E> {
        self.node()?;
        let n = self.scalar_bytes.get().saturating_add(len);
        if n > self.limits.scalar_bytes {
            return Err(self.refuse(Refusal::Limit(Limit::ScalarBytes)));
        }
        self.scalar_bytes.set(n);
        Ok(())
    }

    /// One more list or map at `depth`.
    fn collection<E: serde::de::Error>(&self, depth: usize) -> Result<(), E> {
        if depth > self.limits.depth {
            return Err(self.refuse(Refusal::Limit(Limit::Depth)));
        }
        self.node()
    }
}

// === the seeds ===

/// The top of a document.
struct Root<'b>(&'b Budget);

impl<'de> DeserializeSeed<'de> for Root<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Node {
            budget: self.0,
            depth: 1,
        }
        .deserialize(d)
    }
}

/// A node at `depth` (a list's or map's depth is the depth of its elements less one).
#[derive(Clone, Copy)]
struct Node<'b> {
    budget: &'b Budget,
    depth: usize,
}

impl Node<'_> {
    fn child(self) -> Self {
        Node {
            budget: self.budget,
            depth: self.depth + 1,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Node<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Node<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a YAML or JSON value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Value, E> {
        self.budget.node()?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Value, E> {
        self.budget.node()?;
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Value, E> {
        self.budget.node()?;
        Ok(Value::Number(v.into()))
    }

    fn visit_i128<E: serde::de::Error>(self, v: i128) -> Result<Value, E> {
        self.budget.node()?;
        // Past 64 bits: as a float, as serde_json's own value does.
        Ok(Number::from_f64(v as f64).map_or(Value::Null, Value::Number))
    }

    fn visit_u128<E: serde::de::Error>(self, v: u128) -> Result<Value, E> {
        self.budget.node()?;
        Ok(Number::from_f64(v as f64).map_or(Value::Null, Value::Number))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        self.budget.node()?;
        // `.inf` and `.nan` have no JSON number: null, as serde_json's value makes them.
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Value, E> {
        self.budget.scalar(v.len())?;
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Value, E> {
        self.budget.scalar(v.len())?;
        Ok(Value::String(v))
    }

    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Value, E> {
        self.budget.scalar(v.len())?;
        Ok(Value::String(String::from_utf8_lossy(v).into_owned()))
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
        self.budget.node()?;
        Ok(Value::Null)
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.deserialize(d)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.budget.collection(self.depth)?;
        // No capacity from the size hint: the input says it, the budget decides.
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self.child())? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.budget.collection(self.depth)?;
        let mut entries = Map::new();
        while let Some(key) = map.next_key_seed(Key(self.budget))? {
            let value = map.next_value_seed(self.child())?;
            entries.insert(key, value);
        }
        Ok(Value::Object(entries))
    }

    /// A tagged YAML node (`!tag value`): the value, the tag dropped (no cloud-config or
    /// Ignition field is read by its tag).
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Value, A::Error> {
        let (_tag, variant) = data.variant_seed(Tag(self.budget))?;
        variant.newtype_variant_seed(self)
    }
}

/// A mapping key: a scalar, as a string (YAML allows `1: x` and `true: x`).
#[derive(Clone, Copy)]
struct Key<'b>(&'b Budget);

impl<'de> DeserializeSeed<'de> for Key<'_> {
    type Value = String;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Key<'_> {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a scalar mapping key")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<String, E> {
        self.visit_string(v.to_string())
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<String, E> {
        self.visit_string(v.to_string())
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<String, E> {
        self.visit_string(v.to_string())
    }

    fn visit_i128<E: serde::de::Error>(self, v: i128) -> Result<String, E> {
        self.visit_string(v.to_string())
    }

    fn visit_u128<E: serde::de::Error>(self, v: u128) -> Result<String, E> {
        self.visit_string(v.to_string())
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<String, E> {
        self.visit_string(v.to_string())
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<String, E> {
        self.0.scalar(v.len())?;
        Ok(v.to_owned())
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<String, E> {
        self.0.scalar(v.len())?;
        Ok(v)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<String, E> {
        self.visit_str("null")
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<String, E> {
        self.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<String, D::Error> {
        self.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<String, A::Error> {
        Err(self.0.refuse(Refusal::ComplexKey))
    }

    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<String, A::Error> {
        Err(self.0.refuse(Refusal::ComplexKey))
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<String, A::Error> {
        let (_tag, variant) = data.variant_seed(Tag(self.0))?;
        variant.newtype_variant_seed(self)
    }
}

/// A YAML tag, counted as a scalar and dropped.
struct Tag<'b>(&'b Budget);

impl<'de> DeserializeSeed<'de> for Tag<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_identifier(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Tag<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a YAML tag")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        self.0.scalar(v.len())
    }
}

#[cfg(test)]
mod tests;

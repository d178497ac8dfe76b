//! Who may call what: client identity from the certificate, roles from configured rules,
//! a per-method check and the tower layer that enforces it on every request.
//!
//! Identity: the first URI SAN of the verified client leaf certificate, else its first DNS
//! SAN, else its subject common name. Nothing else in the certificate (organisation, OU)
//! confers anything.
//!
//! Rules: two lists of identity patterns, one per role. A pattern is either an exact
//! identity (`spiffe://inplace-agent/updater`) or a prefix followed by a single trailing
//! `*` (`spiffe://cluster.local/ns/capi-system/sa/*`); `*` alone matches every identity the
//! CA vouches for. Matching is case-sensitive. End a prefix at a separator (`/`): `.../up*`
//! would also match `.../upgrade-evil`. An identity matching an admin pattern is admin,
//! else one matching a reader pattern is reader, else it has no role and every request is
//! denied.
//!
//! Methods: `admin` may call everything; `reader` may call the read-only methods of
//! `NodeAgent` (GetNodeInfo, CheckPlan, GetPlanStatus, WatchPlan), `grpc.health.v1.Health`
//! and server reflection. Any other method path is denied for everyone (fail closed: a new
//! RPC must be added to [`required_role`] to be callable).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use super::tls::TlsConnectInfo;

pub use super::identity::{Identity, IdentityError, IdentitySource, identity_from_certificate};

/// What a client may do. Ordered: `Admin` includes everything `Reader` may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Read-only methods.
    Reader,
    /// Every method, including ApplyPlan, SubmitPlanDocument, CancelPlan and RetryPlan.
    Admin,
}

impl Role {
    /// Lower-case name, as in configuration and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Admin => "admin",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An identity pattern: exact, or a prefix ending in a single `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentityPattern {
    /// Matches this identity only.
    Exact(String),
    /// Matches every identity starting with this prefix (possibly empty).
    Prefix(String),
}

/// A pattern could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    /// The pattern is empty.
    #[error("identity pattern is empty")]
    Empty,
    /// `*` appears somewhere other than at the end.
    #[error("identity pattern {0:?}: '*' is only allowed as the last character")]
    MisplacedWildcard(String),
}

impl std::str::FromStr for IdentityPattern {
    type Err = PatternError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Err(PatternError::Empty);
        }
        match s.strip_suffix('*') {
            Some(prefix) if prefix.contains('*') => {
                Err(PatternError::MisplacedWildcard(s.to_owned()))
            }
            Some(prefix) => Ok(Self::Prefix(prefix.to_owned())),
            None if s.contains('*') => Err(PatternError::MisplacedWildcard(s.to_owned())),
            None => Ok(Self::Exact(s.to_owned())),
        }
    }
}

impl IdentityPattern {
    /// Whether `identity` matches.
    pub fn matches(&self, identity: &str) -> bool {
        match self {
            Self::Exact(exact) => identity == exact,
            Self::Prefix(prefix) => identity.starts_with(prefix.as_str()),
        }
    }
}

impl fmt::Display for IdentityPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exact(exact) => f.write_str(exact),
            Self::Prefix(prefix) => write!(f, "{prefix}*"),
        }
    }
}

/// The configured identity → role mapping.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuthzRules {
    admin: Vec<IdentityPattern>,
    reader: Vec<IdentityPattern>,
}

impl AuthzRules {
    /// Rules from the admin and reader pattern lists.
    pub fn new(admin: Vec<IdentityPattern>, reader: Vec<IdentityPattern>) -> Self {
        Self { admin, reader }
    }

    /// The patterns with the admin role.
    pub fn admin(&self) -> &[IdentityPattern] {
        &self.admin
    }

    /// The patterns with the reader role.
    pub fn reader(&self) -> &[IdentityPattern] {
        &self.reader
    }

    /// The role of an identity: admin if any admin pattern matches, else reader if any
    /// reader pattern matches, else none.
    pub fn role_of(&self, identity: &str) -> Option<Role> {
        if self.admin.iter().any(|p| p.matches(identity)) {
            Some(Role::Admin)
        } else if self.reader.iter().any(|p| p.matches(identity)) {
            Some(Role::Reader)
        } else {
            None
        }
    }
}

// === Methods ===

/// Full gRPC service name of the node agent.
pub const NODE_AGENT_SERVICE: &str = "inplace.agent.v1.NodeAgent";

/// The least role that may call a method, by its HTTP/2 path (`/package.Service/Method`);
/// `None` for a method nobody may call.
pub fn required_role(path: &str) -> Option<Role> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    match (service, method) {
        (
            NODE_AGENT_SERVICE,
            "ApplyPlan" | "SubmitPlanDocument" | "CancelPlan" | "RetryPlan" | "RepairPlan",
        ) => Some(Role::Admin),
        (
            NODE_AGENT_SERVICE,
            "GetNodeInfo" | "CheckPlan" | "GetPlanStatus" | "WatchPlan" | "GetDrift",
        ) => Some(Role::Reader),
        ("grpc.health.v1.Health", "Check" | "Watch") => Some(Role::Reader),
        (
            "grpc.reflection.v1.ServerReflection" | "grpc.reflection.v1alpha.ServerReflection",
            "ServerReflectionInfo",
        ) => Some(Role::Reader),
        _ => None,
    }
}

/// Why a request was denied; a bounded set usable as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Denied {
    /// The connection carries no client identity (the certificate has no usable name).
    #[error("client certificate has no uri san, dns san or common name")]
    NoIdentity,
    /// The identity matches no rule.
    #[error("identity has no role")]
    UnknownIdentity,
    /// The method is not in the method table.
    #[error("method is not callable")]
    UnknownMethod,
    /// The identity's role is below what the method requires.
    #[error("role {role} may not call this method, it requires {required}")]
    InsufficientRole {
        /// The caller's role.
        role: Role,
        /// The role the method requires.
        required: Role,
    },
}

impl Denied {
    /// Every reason label, in [`Denied::reason`] order of the counters.
    pub const REASONS: [&'static str; 4] = [
        "no_identity",
        "unknown_identity",
        "unknown_method",
        "insufficient_role",
    ];

    /// The metric label.
    pub fn reason(&self) -> &'static str {
        Self::REASONS[self.index()]
    }

    fn index(&self) -> usize {
        match self {
            Denied::NoIdentity => 0,
            Denied::UnknownIdentity => 1,
            Denied::UnknownMethod => 2,
            Denied::InsufficientRole { .. } => 3,
        }
    }
}

/// Decides whether `identity` may call `method` (an HTTP/2 path) under `rules`. The
/// identity is checked before the method, so a client without a role learns nothing about
/// which methods exist.
pub fn authorize(identity: Option<&str>, method: &str, rules: &AuthzRules) -> Result<Role, Denied> {
    let identity = identity.ok_or(Denied::NoIdentity)?;
    let role = rules.role_of(identity).ok_or(Denied::UnknownIdentity)?;
    let required = required_role(method).ok_or(Denied::UnknownMethod)?;
    if role >= required {
        Ok(role)
    } else {
        Err(Denied::InsufficientRole { role, required })
    }
}

// === Counters ===

/// Authorization counters for the metrics module.
#[derive(Debug, Default)]
pub struct AuthzCounters {
    allowed: AtomicU64,
    denied: [AtomicU64; Denied::REASONS.len()],
}

impl AuthzCounters {
    /// Requests allowed.
    pub fn allowed(&self) -> u64 {
        self.allowed.load(Ordering::Relaxed)
    }

    /// Requests denied for the reason with this label (see [`Denied::REASONS`]); 0 for an
    /// unknown label.
    pub fn denied(&self, reason: &str) -> u64 {
        Denied::REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.denied[i].load(Ordering::Relaxed))
    }

    /// Denied requests for every reason label.
    pub fn denied_by_reason(&self) -> Vec<(&'static str, u64)> {
        Denied::REASONS
            .iter()
            .zip(&self.denied)
            .map(|(r, n)| (*r, n.load(Ordering::Relaxed)))
            .collect()
    }

    fn record(&self, outcome: &Result<Role, Denied>) {
        match outcome {
            Ok(_) => self.allowed.fetch_add(1, Ordering::Relaxed),
            Err(denied) => self.denied[denied.index()].fetch_add(1, Ordering::Relaxed),
        };
    }
}

// === Enforcement ===

/// The authenticated caller of a request, inserted into the request extensions of every
/// allowed request (`request.extensions().get::<Caller>()`), for handlers that log who did
/// what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The client identity.
    pub identity: Identity,
    /// Its role.
    pub role: Role,
}

/// Tower layer that authorizes every request (see the module docs) before it reaches the
/// gRPC router. Add it with `tonic::transport::Server::builder().layer(..)`.
#[derive(Debug, Clone)]
pub struct AuthzLayer {
    rules: Arc<AuthzRules>,
    counters: Arc<AuthzCounters>,
}

impl AuthzLayer {
    /// A layer enforcing `rules` and counting outcomes in `counters`.
    pub fn new(rules: Arc<AuthzRules>, counters: Arc<AuthzCounters>) -> Self {
        Self { rules, counters }
    }
}

impl<S> tower::Layer<S> for AuthzLayer {
    type Service = AuthzService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AuthzService {
            inner,
            rules: self.rules.clone(),
            counters: self.counters.clone(),
        }
    }
}

/// The service [`AuthzLayer`] produces.
#[derive(Debug, Clone)]
pub struct AuthzService<S> {
    inner: S,
    rules: Arc<AuthzRules>,
    counters: Arc<AuthzCounters>,
}

/// Boxed response future of [`AuthzService`].
pub type AuthzFuture<R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send>>;

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for AuthzService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = http::Response<ResBody>;
    type Error = S::Error;
    type Future = AuthzFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<ReqBody>) -> Self::Future {
        let identity = request
            .extensions()
            .get::<TlsConnectInfo>()
            .and_then(|info| info.identity.clone());
        let method = request.uri().path();
        let outcome = authorize(
            identity.as_ref().map(|i| i.value.as_str()),
            method,
            &self.rules,
        );
        self.counters.record(&outcome);
        match (outcome, identity) {
            (Ok(role), Some(identity)) => {
                request.extensions_mut().insert(Caller { identity, role });
                // Call the instance that poll_ready prepared; keep a fresh clone.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                Box::pin(inner.call(request))
            }
            (outcome, identity) => {
                let denied = outcome.err().unwrap_or(Denied::NoIdentity);
                // Identity and method only: never headers or payload.
                tracing::warn!(
                    identity = ?identity.as_ref().map(|i| i.value.as_str()),
                    method = ?method,
                    reason = denied.reason(),
                    "request denied"
                );
                let status = match denied {
                    Denied::NoIdentity => tonic::Status::unauthenticated(denied.to_string()),
                    _ => tonic::Status::permission_denied(format!(
                        "{}: {denied}",
                        identity.as_ref().map_or("", |i| i.value.as_str())
                    )),
                };
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const APPLY: &str = "/inplace.agent.v1.NodeAgent/ApplyPlan";
    const CANCEL: &str = "/inplace.agent.v1.NodeAgent/CancelPlan";
    const RETRY: &str = "/inplace.agent.v1.NodeAgent/RetryPlan";
    const STATUS: &str = "/inplace.agent.v1.NodeAgent/GetPlanStatus";

    fn rules() -> AuthzRules {
        AuthzRules::new(
            vec!["spiffe://inplace-agent/updater".parse().unwrap()],
            vec![
                "spiffe://inplace-agent/reader".parse().unwrap(),
                "spiffe://cluster.local/ns/monitoring/*".parse().unwrap(),
            ],
        )
    }

    #[test]
    fn admin_may_call_everything() {
        let rules = rules();
        for method in [
            APPLY,
            CANCEL,
            RETRY,
            STATUS,
            "/grpc.health.v1.Health/Check",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        ] {
            assert_eq!(
                authorize(Some("spiffe://inplace-agent/updater"), method, &rules),
                Ok(Role::Admin),
                "{method}"
            );
        }
    }

    #[test]
    fn reader_may_read_but_not_mutate() {
        let rules = rules();
        let reader = Some("spiffe://inplace-agent/reader");
        for method in [
            "GetNodeInfo",
            "CheckPlan",
            "GetPlanStatus",
            "WatchPlan",
            "GetDrift",
        ] {
            let path = format!("/inplace.agent.v1.NodeAgent/{method}");
            assert_eq!(
                authorize(reader, &path, &rules),
                Ok(Role::Reader),
                "{method}"
            );
        }
        for method in [
            APPLY,
            CANCEL,
            RETRY,
            "/inplace.agent.v1.NodeAgent/RepairPlan",
        ] {
            assert_eq!(
                authorize(reader, method, &rules),
                Err(Denied::InsufficientRole {
                    role: Role::Reader,
                    required: Role::Admin
                }),
                "{method}"
            );
        }
    }

    #[test]
    fn unknown_identity_is_denied_everything() {
        let rules = rules();
        for method in [APPLY, STATUS, "/grpc.health.v1.Health/Check", "/x.Y/Z"] {
            assert_eq!(
                authorize(Some("spiffe://inplace-agent/stranger"), method, &rules),
                Err(Denied::UnknownIdentity)
            );
        }
        assert_eq!(authorize(None, STATUS, &rules), Err(Denied::NoIdentity));
        assert_eq!(
            authorize(Some("x"), STATUS, &AuthzRules::default()),
            Err(Denied::UnknownIdentity)
        );
    }

    #[test]
    fn unknown_methods_are_denied_even_to_admin() {
        let rules = rules();
        let admin = Some("spiffe://inplace-agent/updater");
        for method in [
            "/inplace.agent.v1.NodeAgent/DeleteNode",
            "/inplace.agent.v1.NodeAgent/",
            "/inplace.agent.v1.NodeAgentX/ApplyPlan",
            "inplace.agent.v1.NodeAgent/ApplyPlan",
            "/",
            "",
        ] {
            assert_eq!(
                authorize(admin, method, &rules),
                Err(Denied::UnknownMethod),
                "{method:?}"
            );
        }
    }

    #[test]
    fn patterns_match_exactly_or_by_prefix() {
        let rules = rules();
        assert_eq!(
            rules.role_of("spiffe://cluster.local/ns/monitoring/sa/prom"),
            Some(Role::Reader)
        );
        assert_eq!(rules.role_of("spiffe://cluster.local/ns/monitoring"), None);
        assert_eq!(rules.role_of("spiffe://inplace-agent/updater/x"), None);
        assert_eq!(rules.role_of("SPIFFE://inplace-agent/updater"), None);
        let everyone: IdentityPattern = "*".parse().unwrap();
        assert!(everyone.matches("anything"));
        assert_eq!(everyone.to_string(), "*");
    }

    #[test]
    fn admin_rule_wins_over_reader_rule() {
        let rules = AuthzRules::new(vec!["a".parse().unwrap()], vec!["*".parse().unwrap()]);
        assert_eq!(rules.role_of("a"), Some(Role::Admin));
        assert_eq!(rules.role_of("b"), Some(Role::Reader));
    }

    #[test]
    fn bad_patterns_are_rejected() {
        assert_eq!("".parse::<IdentityPattern>(), Err(PatternError::Empty));
        assert!(matches!(
            "a*b".parse::<IdentityPattern>(),
            Err(PatternError::MisplacedWildcard(_))
        ));
        assert!(matches!(
            "a**".parse::<IdentityPattern>(),
            Err(PatternError::MisplacedWildcard(_))
        ));
    }

    #[test]
    fn every_node_agent_method_has_a_role() {
        use prost::Message;
        let fds = prost_types::FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET)
            .expect("descriptor set decodes");
        let service = fds
            .file
            .iter()
            .filter(|f| f.package() == "inplace.agent.v1")
            .flat_map(|f| f.service.iter())
            .find(|s| s.name() == "NodeAgent")
            .expect("NodeAgent service in the descriptor set");
        assert_eq!(service.method.len(), 10);
        for method in &service.method {
            let path = format!("/{NODE_AGENT_SERVICE}/{}", method.name());
            assert!(
                required_role(&path).is_some(),
                "{path} has no role in the method table"
            );
        }
    }

    #[test]
    fn denial_counters_by_reason() {
        let counters = AuthzCounters::default();
        counters.record(&Ok(Role::Reader));
        counters.record(&Err(Denied::UnknownIdentity));
        counters.record(&Err(Denied::UnknownIdentity));
        counters.record(&Err(Denied::InsufficientRole {
            role: Role::Reader,
            required: Role::Admin,
        }));
        assert_eq!(counters.allowed(), 1);
        assert_eq!(counters.denied("unknown_identity"), 2);
        assert_eq!(counters.denied("insufficient_role"), 1);
        assert_eq!(counters.denied("no_identity"), 0);
        assert_eq!(counters.denied("nonsense"), 0);
        assert_eq!(counters.denied_by_reason().len(), Denied::REASONS.len());
    }

    fn cert_with(sans: Vec<rcgen::SanType>, cn: Option<&str>) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::default();
        params.subject_alt_names = sans;
        params.distinguished_name = rcgen::DistinguishedName::new();
        if let Some(cn) = cn {
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, cn);
        }
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn identity_prefers_uri_then_dns_then_cn() {
        use rcgen::SanType;
        let uri = |s: &str| SanType::URI(s.try_into().unwrap());
        let dns = |s: &str| SanType::DnsName(s.try_into().unwrap());

        let both = cert_with(
            vec![dns("updater.example"), uri("spiffe://td/updater")],
            Some("cn"),
        );
        assert_eq!(
            identity_from_certificate(&both),
            Ok(Identity {
                source: IdentitySource::UriSan,
                value: "spiffe://td/updater".into()
            })
        );
        let dns_only = cert_with(vec![dns("a.example"), dns("b.example")], Some("cn"));
        assert_eq!(
            identity_from_certificate(&dns_only),
            Ok(Identity {
                source: IdentitySource::DnsSan,
                value: "a.example".into()
            })
        );
        let cn_only = cert_with(vec![], Some("updater"));
        assert_eq!(
            identity_from_certificate(&cn_only),
            Ok(Identity {
                source: IdentitySource::CommonName,
                value: "updater".into()
            })
        );
        let nameless = cert_with(vec![], None);
        assert_eq!(
            identity_from_certificate(&nameless),
            Err(IdentityError::NoName)
        );
        assert_eq!(
            identity_from_certificate(b"junk"),
            Err(IdentityError::Unparsable)
        );
    }
}

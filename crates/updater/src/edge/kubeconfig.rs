//! A workload cluster's kubeconfig → [`WorkloadCredentials`]: data only, never code or a
//! file path.
//!
//! Cluster API keeps one kubeconfig per cluster in the Secret `<cluster>-kubeconfig` (key
//! `value`) of the cluster's namespace, and whoever can write Secrets there (a tenant) can
//! write it. kube-rs would run what such a file says: `exec` credential plugins and
//! `auth-provider` commands (as the updater's user), `tokenFile` and the other file paths
//! (the updater's own service-account token among them), `insecure-skip-tls-verify`,
//! `proxy-url`. So the updater reads the text itself, under size and node-count limits, and
//! accepts only what Cluster API writes (`util/kubeconfig/kubeconfig.go` of
//! kubernetes-sigs/cluster-api, `New`: a server, its `certificate-authority-data`, an inline
//! client certificate and key) or an inline `token`. Everything else the format has
//! (`tools/clientcmd/api/v1/types.go` of kubernetes/client-go) is refused, naming the Secret
//! and the field and echoing nothing of the content.
//!
//! The server must be `https`, and unless the operator allowed local servers
//! (`inplace-updater serve --allow-local-workload-servers`, for test rigs) its host may not
//! be, or resolve to, a loopback, link-local, unspecified or IPv4-mapped loopback address:
//! the updater's own pod, the node's metadata service and the kubelet are not a tenant's
//! cluster. The host name is resolved once, when the credentials are built, and the client
//! connects to the address it resolved to (the certificate is still checked against the
//! name), so a later DNS answer cannot move it.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use base64::Engine as _;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// The largest kubeconfig read (Cluster API's are about 6 KiB).
pub const MAX_KUBECONFIG_BYTES: usize = 64 * 1024;

/// The most YAML nodes (scalars, lists, maps) read, aliases counted each time they are used.
const MAX_NODES: usize = 4_096;

/// The most bytes of scalars read, aliases counted each time they are used.
const MAX_SCALAR_BYTES: usize = 2 * MAX_KUBECONFIG_BYTES;

/// The deepest nesting read (a kubeconfig's is 5 or 6 below extensions).
const MAX_DEPTH: usize = 24;

/// The longest token accepted.
const MAX_TOKEN_BYTES: usize = 16 * 1024;

/// How long the server's host name may take to resolve.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether a workload cluster's server may be on a loopback, link-local or unspecified
/// address (`--allow-local-workload-servers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LocalServers {
    /// Refused (the default, and the only safe choice outside a test rig).
    #[default]
    Refuse,
    /// Allowed, with a warning in the log each time a client to one is built.
    Allow,
}

/// The name of the `serve` flag that allows local servers.
pub const ALLOW_LOCAL_FLAG: &str = "--allow-local-workload-servers";

/// A kubeconfig refused, or its server not resolved: names the Secret and the field, never
/// a byte of the content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Secret {secret} key value: {refusal}")]
pub struct KubeconfigError {
    /// `<namespace>/<name>` of the Secret.
    pub secret: String,
    /// What is wrong, and where.
    pub refusal: Refusal,
}

/// What is wrong with a kubeconfig: a field path (`users[0].user.exec`; empty for the whole
/// file) and why, in words of the updater's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Where (`clusters[1].cluster.server`), built only from the format's own field names
    /// and list indices.
    pub field: String,
    /// Why, and what to do.
    pub why: String,
    /// Whether asking again may give another answer with the same Secret (a host name
    /// that did not resolve).
    pub transient: bool,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.why)
        } else {
            write!(f, "{}: {}", self.field, self.why)
        }
    }
}

fn refuse(field: impl Into<String>, why: impl Into<String>) -> Refusal {
    Refusal {
        field: field.into(),
        why: why.into(),
        transient: false,
    }
}

/// How the client proves who it is: inline data only.
#[derive(Clone, PartialEq, Eq)]
pub enum User {
    /// A client certificate chain and its private key, PEM.
    Certificate {
        /// The certificate chain (PEM).
        cert_pem: String,
        /// The private key (PEM).
        key_pem: String,
    },
    /// A bearer token.
    Token(String),
}

impl fmt::Debug for User {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            User::Certificate { .. } => f.write_str("Certificate(..)"),
            User::Token(_) => f.write_str("Token(..)"),
        }
    }
}

/// A kubeconfig read and checked, its server not resolved yet (what [`parse`] gives).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    /// Where the server is in the kubeconfig (`clusters[0].cluster.server`), for messages.
    server_field: String,
    host: Host,
    port: u16,
    /// The server URL's path (`/` or a prefix such as `/k8s/clusters/c-1`).
    path: String,
    ca_der: Vec<Vec<u8>>,
    user: User,
}

/// A server's host: an address, or a name to resolve.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Host {
    Ip(IpAddr),
    Name(String),
}

/// What a workload client may be built from: an https server pinned to the address it
/// resolved to, the CA that must have signed its certificate, and inline client
/// credentials. Only this module builds one, and only from a kubeconfig it accepted.
#[derive(Clone)]
pub struct WorkloadCredentials {
    url: http::Uri,
    server_name: Option<String>,
    ca_der: Vec<Vec<u8>>,
    user: User,
    local: Option<&'static str>,
}

impl fmt::Debug for WorkloadCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkloadCredentials")
            .field("url", &self.url)
            .field("server_name", &self.server_name)
            .field("user", &self.user)
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl WorkloadCredentials {
    /// `https://<address>:<port><path>`: the server, at the address its host resolved to.
    pub fn url(&self) -> &http::Uri {
        &self.url
    }

    /// The host name the server's certificate must name, when the kubeconfig's server
    /// named a host rather than an address (`None`: the address in [`Self::url`]).
    pub fn server_name(&self) -> Option<&str> {
        self.server_name.as_deref()
    }

    /// The CA certificates (DER) the server's certificate must chain to; never empty.
    pub fn ca_der(&self) -> &[Vec<u8>] {
        &self.ca_der
    }

    /// The client's credentials.
    pub fn user(&self) -> &User {
        &self.user
    }

    /// What kind of local address the server is on (`loopback`, …), when
    /// [`LocalServers::Allow`] let it through.
    pub fn local(&self) -> Option<&'static str> {
        self.local
    }
}

/// Reads the kubeconfig of Secret `secret` (`<namespace>/<name>`, for messages) and
/// resolves its server: the credentials, or why not.
pub async fn credentials(
    secret: &str,
    value: &[u8],
    local: LocalServers,
) -> Result<WorkloadCredentials, KubeconfigError> {
    let wrap = |refusal| KubeconfigError {
        secret: secret.to_owned(),
        refusal,
    };
    let parsed = parse(value).map_err(wrap)?;
    resolve(parsed, local).await.map_err(wrap)
}

// === the text ===

/// Reads and checks a kubeconfig (no I/O, no resolution).
pub fn parse(value: &[u8]) -> Result<Parsed, Refusal> {
    if value.len() > MAX_KUBECONFIG_BYTES {
        return Err(refuse(
            "",
            format!(
                "{} bytes, more than the {MAX_KUBECONFIG_BYTES} a kubeconfig may have here",
                value.len()
            ),
        ));
    }
    let text = std::str::from_utf8(value).map_err(|_| refuse("", "not UTF-8 text"))?;
    let doc = bounded_yaml(text)?;
    let top = object(&doc, "")?;
    check_fields(
        top,
        "",
        &[
            "apiVersion",
            "kind",
            "clusters",
            "contexts",
            "users",
            "current-context",
            "preferences",
            "extensions",
        ],
    )?;
    let clusters = named_list(top, "clusters", "cluster")?;
    let users = named_list(top, "users", "user")?;
    let contexts = named_list(top, "contexts", "context")?;
    // Every entry is checked for what is never allowed, used or not.
    for (i, (_, c)) in clusters.iter().enumerate() {
        check_fields(
            c,
            &format!("clusters[{i}].cluster"),
            &[
                "server",
                "certificate-authority-data",
                "disable-compression",
                "extensions",
            ],
        )?;
        insecure(c, &format!("clusters[{i}].cluster"))?;
    }
    for (i, (_, u)) in users.iter().enumerate() {
        check_fields(
            u,
            &format!("users[{i}].user"),
            &[
                "client-certificate-data",
                "client-key-data",
                "token",
                "extensions",
            ],
        )?;
    }
    for (i, (_, c)) in contexts.iter().enumerate() {
        check_fields(
            c,
            &format!("contexts[{i}].context"),
            &["cluster", "user", "namespace", "extensions"],
        )?;
    }

    let (ci, context) = current_context(top, &contexts)?;
    let at = format!("contexts[{ci}].context");
    let cluster_name = string(context, "cluster", &at)?.ok_or_else(|| {
        refuse(
            format!("{at}.cluster"),
            "missing: the context must name its cluster",
        )
    })?;
    let user_name = string(context, "user", &at)?.ok_or_else(|| {
        refuse(
            format!("{at}.user"),
            "missing: the context must name a user with inline credentials \
             (client-certificate-data and client-key-data, or token)",
        )
    })?;
    let (ki, cluster) = find(&clusters, cluster_name)
        .ok_or_else(|| refuse(format!("{at}.cluster"), "names no entry of clusters"))?;
    let (ui, user) = find(&users, user_name)
        .ok_or_else(|| refuse(format!("{at}.user"), "names no entry of users"))?;

    let at = format!("clusters[{ki}].cluster");
    let server =
        string(cluster, "server", &at)?.ok_or_else(|| refuse(format!("{at}.server"), "missing"))?;
    let (host, port, path) =
        server_url(server).map_err(|why| refuse(format!("{at}.server"), why))?;
    let ca = string(cluster, "certificate-authority-data", &at)?.ok_or_else(|| {
        refuse(
            format!("{at}.certificate-authority-data"),
            "missing: the updater trusts no system CA for a workload cluster; \
             give the cluster's CA certificate inline",
        )
    })?;
    let ca_der = ca_certificates(ca)
        .map_err(|why| refuse(format!("{at}.certificate-authority-data"), why))?;

    let user = user_credentials(user, &format!("users[{ui}].user"))?;
    Ok(Parsed {
        server_field: format!("{at}.server"),
        host,
        port,
        path,
        ca_der,
        user,
    })
}

/// An entry of `clusters`, `users` or `contexts`: its name and its body.
type Entry<'a> = (&'a str, &'a Map<String, Value>);

/// The context in use: `current-context`, or the only one.
fn current_context<'a>(
    top: &Map<String, Value>,
    contexts: &[Entry<'a>],
) -> Result<(usize, &'a Map<String, Value>), Refusal> {
    match string(top, "current-context", "")?.filter(|c| !c.is_empty()) {
        Some(name) => find(contexts, name)
            .ok_or_else(|| refuse("current-context", "names no entry of contexts")),
        None if contexts.len() == 1 => Ok((0, contexts[0].1)),
        None => Err(refuse(
            "current-context",
            format!(
                "not set, and there are {} contexts: set it (Cluster API's kubeconfig has one)",
                contexts.len()
            ),
        )),
    }
}

fn find<'a>(list: &[Entry<'a>], name: &str) -> Option<(usize, &'a Map<String, Value>)> {
    list.iter()
        .position(|(n, _)| *n == name)
        .map(|i| (i, list[i].1))
}

/// `insecure-skip-tls-verify` is allowed only as `false`.
fn insecure(cluster: &Map<String, Value>, at: &str) -> Result<(), Refusal> {
    match cluster.get("insecure-skip-tls-verify") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(()),
        Some(_) => Err(refuse(
            format!("{at}.insecure-skip-tls-verify"),
            "turns off the check of the server's certificate, which the updater never does: \
             remove it and give certificate-authority-data",
        )),
    }
}

/// The fields of the format the updater refuses, and why (client-go's clientcmd v1 names).
fn refused_field(name: &str) -> Option<&'static str> {
    Some(match name {
        "exec" => {
            "is a credential plugin, and the updater runs no program a kubeconfig names: \
             give client-certificate-data and client-key-data (or token) inline"
        }
        "auth-provider" => {
            "is an auth provider, and the updater runs none: give client-certificate-data \
             and client-key-data (or token) inline"
        }
        "client-certificate" | "client-key" | "certificate-authority" | "tokenFile" => {
            "is a file path, and the updater reads no file a kubeconfig names: put the data \
             inline (client-certificate-data, client-key-data, certificate-authority-data, token)"
        }
        "insecure-skip-tls-verify" => {
            "turns off the check of the server's certificate, which the updater never does"
        }
        "proxy-url" => "sends the requests through a proxy, which the updater does not do",
        "tls-server-name" => {
            "is not supported: the server's certificate must name the server URL's host"
        }
        "username" | "password" => {
            "is basic authentication, which the updater does not use: give \
             client-certificate-data and client-key-data (or token)"
        }
        "as" | "as-uid" | "as-groups" | "as-user-extra" => {
            "is impersonation, which the updater does not do: give the credentials of the \
             user itself"
        }
        _ => return None,
    })
}

/// Every field name of client-go's kubeconfig format (`api/v1/types.go`): an unknown key is
/// named in a message only when it is one of these (anything else is content).
const FORMAT_FIELDS: &[&str] = &[
    "apiVersion",
    "kind",
    "preferences",
    "colors",
    "clusters",
    "users",
    "contexts",
    "current-context",
    "extensions",
    "name",
    "cluster",
    "user",
    "context",
    "extension",
    "server",
    "tls-server-name",
    "insecure-skip-tls-verify",
    "certificate-authority",
    "certificate-authority-data",
    "proxy-url",
    "disable-compression",
    "client-certificate",
    "client-certificate-data",
    "client-key",
    "client-key-data",
    "token",
    "tokenFile",
    "as",
    "as-uid",
    "as-groups",
    "as-user-extra",
    "username",
    "password",
    "auth-provider",
    "exec",
    "namespace",
];

/// Refuses any key of `map` not in `allowed` (a refused field with its reason).
fn check_fields(map: &Map<String, Value>, at: &str, allowed: &[&str]) -> Result<(), Refusal> {
    for key in map.keys() {
        if allowed.contains(&key.as_str()) {
            continue;
        }
        if key == "insecure-skip-tls-verify" && at.starts_with("clusters[") {
            continue; // allowed as false; `insecure` decides
        }
        let path = |k: &str| {
            if at.is_empty() {
                k.to_owned()
            } else {
                format!("{at}.{k}")
            }
        };
        if let Some(why) = refused_field(key) {
            return Err(refuse(path(key), why));
        }
        return Err(
            match FORMAT_FIELDS.iter().copied().find(|f| *f == key.as_str()) {
                Some(f) => refuse(path(f), "is not supported here"),
                None => refuse(
                    if at.is_empty() { "(top level)" } else { at }.to_owned(),
                    "has a field the kubeconfig format does not have",
                ),
            },
        );
    }
    Ok(())
}

fn object<'a>(v: &'a Value, at: &str) -> Result<&'a Map<String, Value>, Refusal> {
    v.as_object().ok_or_else(|| {
        refuse(
            if at.is_empty() { "" } else { at },
            if at.is_empty() {
                "not a kubeconfig (the YAML is not a map)"
            } else {
                "is not a map"
            },
        )
    })
}

/// `map[key]` as a string (`None` when absent or null).
fn string<'a>(
    map: &'a Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<&'a str>, Refusal> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(refuse(
            if at.is_empty() {
                key.to_owned()
            } else {
                format!("{at}.{key}")
            },
            "is not a string",
        )),
    }
}

/// `top[list]`: entries `{name, <inner>: {...}}`, names unique, as (name, inner).
fn named_list<'a>(
    top: &'a Map<String, Value>,
    list: &str,
    inner: &str,
) -> Result<Vec<Entry<'a>>, Refusal> {
    let items = match top.get(list) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(refuse(list, "is not a list")),
    };
    let mut out: Vec<Entry<'a>> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("{list}[{i}]");
        let entry = object(item, &at)?;
        check_fields(entry, &at, &["name", inner, "extensions"])?;
        let name = string(entry, "name", &at)?.unwrap_or("");
        if out.iter().any(|(n, _)| *n == name) {
            return Err(refuse(
                format!("{at}.name"),
                "the same name as an earlier entry",
            ));
        }
        let body = match entry.get(inner) {
            Some(v) => object(v, &format!("{at}.{inner}"))?,
            None => return Err(refuse(format!("{at}.{inner}"), "missing")),
        };
        out.push((name, body));
    }
    Ok(out)
}

/// The server URL: `https://host[:port][/path]`, nothing else.
fn server_url(server: &str) -> Result<(Host, u16, String), String> {
    let uri: http::Uri = server
        .parse()
        .map_err(|_| "not a URL (it must be https://host[:port][/path])".to_owned())?;
    match uri.scheme_str() {
        Some(s) if s.eq_ignore_ascii_case("https") => {}
        Some(s) if s.eq_ignore_ascii_case("http") => {
            return Err(
                "plain http is refused: the updater talks to a workload cluster over https only"
                    .into(),
            );
        }
        _ => return Err("not an https URL (it must be https://host[:port][/path])".into()),
    }
    let authority = uri.authority().ok_or_else(|| "has no host".to_owned())?;
    if authority.as_str().contains('@') {
        return Err("has user information before the host, which is not supported".into());
    }
    if uri.query().is_some() {
        return Err("has a query, which is not supported".into());
    }
    let port = authority.port_u16().unwrap_or(443);
    if port == 0 {
        return Err("port 0".into());
    }
    let host = authority.host();
    let host = if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Host::Ip(IpAddr::V6(
            v6.parse::<Ipv6Addr>()
                .map_err(|_| "an IPv6 address that does not parse".to_owned())?,
        ))
    } else if let Ok(v4) = host.parse::<Ipv4Addr>() {
        Host::Ip(IpAddr::V4(v4))
    } else {
        if rustls::pki_types::ServerName::try_from(host).is_err() || host.is_empty() {
            return Err("its host is neither an IP address nor a DNS name".into());
        }
        Host::Name(host.to_ascii_lowercase())
    };
    let path = uri.path().to_owned();
    Ok((host, port, if path.is_empty() { "/".into() } else { path }))
}

/// base64 of PEM → its certificates (DER), each a usable trust anchor.
fn ca_certificates(data: &str) -> Result<Vec<Vec<u8>>, String> {
    let pem = base64_data(data)?;
    let certs = certificates(&pem)?;
    let mut roots = rustls::RootCertStore::empty();
    for c in &certs {
        roots
            .add(CertificateDer::from(c.clone()))
            .map_err(|_| "holds a certificate that cannot be a CA".to_owned())?;
    }
    Ok(certs)
}

/// The `CERTIFICATE` blocks of a PEM text (at least one).
fn certificates(pem: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .map(|c| c.map(|c| c.to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| "not PEM certificates".to_owned())?;
    if certs.is_empty() {
        return Err("holds no PEM certificate".into());
    }
    Ok(certs)
}

fn base64_data(data: &str) -> Result<Vec<u8>, String> {
    // kubectl writes these without line breaks; a pasted value may have some.
    let compact: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    base64::engine::general_purpose::STANDARD
        .decode(compact.as_bytes())
        .map_err(|_| "not base64".to_owned())
}

/// The user's inline credentials: a certificate and key, or a token.
fn user_credentials(user: &Map<String, Value>, at: &str) -> Result<User, Refusal> {
    let cert = string(user, "client-certificate-data", at)?;
    let key = string(user, "client-key-data", at)?;
    let token = string(user, "token", at)?.filter(|t| !t.is_empty());
    match (cert, key, token) {
        (Some(_), Some(_), Some(_)) => Err(refuse(
            format!("{at}.token"),
            "given with a client certificate: give one of the two",
        )),
        (Some(cert), Some(key), None) => {
            let cert_pem = base64_data(cert)
                .map_err(|why| refuse(format!("{at}.client-certificate-data"), why))?;
            let chain = certificates(&cert_pem)
                .map_err(|why| refuse(format!("{at}.client-certificate-data"), why))?;
            let key_pem =
                base64_data(key).map_err(|why| refuse(format!("{at}.client-key-data"), why))?;
            let key_der = PrivateKeyDer::from_pem_slice(&key_pem)
                .map_err(|_| refuse(format!("{at}.client-key-data"), "holds no PEM private key"))?;
            // What the client is given is written again from what was checked here.
            let cert_pem: String = chain.iter().map(|c| pem("CERTIFICATE", c)).collect();
            let key_pem = match &key_der {
                PrivateKeyDer::Pkcs1(k) => pem("RSA PRIVATE KEY", k.secret_pkcs1_der()),
                PrivateKeyDer::Sec1(k) => pem("EC PRIVATE KEY", k.secret_sec1_der()),
                PrivateKeyDer::Pkcs8(k) => pem("PRIVATE KEY", k.secret_pkcs8_der()),
                _ => {
                    return Err(refuse(
                        format!("{at}.client-key-data"),
                        "a private key of a kind the updater does not support",
                    ));
                }
            };
            usable_identity(chain, key_der).map_err(|why| refuse(at, why))?;
            Ok(User::Certificate { cert_pem, key_pem })
        }
        (Some(_), None, _) => Err(refuse(
            format!("{at}.client-key-data"),
            "missing: client-certificate-data needs its key",
        )),
        (None, Some(_), _) => Err(refuse(
            format!("{at}.client-certificate-data"),
            "missing: client-key-data needs its certificate",
        )),
        (None, None, Some(token)) => {
            if token.len() > MAX_TOKEN_BYTES {
                return Err(refuse(
                    format!("{at}.token"),
                    format!("longer than {MAX_TOKEN_BYTES} bytes"),
                ));
            }
            if !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(refuse(
                    format!("{at}.token"),
                    "holds a character an HTTP header cannot carry",
                ));
            }
            Ok(User::Token(token.to_owned()))
        }
        (None, None, None) => Err(refuse(
            at,
            "no inline credentials: give client-certificate-data and client-key-data, or token",
        )),
    }
}

/// `der` as a PEM block.
fn pem(label: &str, der: &[u8]) -> String {
    let body = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in body.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// Whether rustls takes the certificate chain and key as a client identity (the key's kind
/// supported, the pair matching).
fn usable_identity(chain: Vec<Vec<u8>>, key: PrivateKeyDer<'static>) -> Result<(), &'static str> {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|_| "no TLS version available")?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_client_auth_cert(chain.into_iter().map(CertificateDer::from).collect(), key)
        .map(drop)
        .map_err(|_| {
            "client-certificate-data and client-key-data are not a usable pair (a key of a \
             kind TLS supports, matching the certificate)"
        })
}

// === the server's address ===

/// What kind of local address `ip` is, if it is one the updater refuses by default.
pub fn local_kind(ip: IpAddr) -> Option<&'static str> {
    fn v4(ip: Ipv4Addr) -> Option<&'static str> {
        if ip.is_loopback() {
            Some("loopback")
        } else if ip.is_link_local() {
            Some("link-local")
        } else if ip.octets()[0] == 0 {
            // 0.0.0.0/8: "this host" (RFC 1122); Linux connects it to the host itself.
            Some("unspecified")
        } else {
            None
        }
    }
    match ip {
        IpAddr::V4(ip) => v4(ip),
        IpAddr::V6(ip) => {
            if ip.is_loopback() {
                Some("loopback")
            } else if ip.is_unspecified() {
                Some("unspecified")
            } else if ip.segments()[0] & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else if let Some(mapped) = ip.to_ipv4_mapped() {
                v4(mapped).map(|_| "IPv4-mapped loopback or link-local")
            } else {
                None
            }
        }
    }
}

/// Resolves the server (once) and checks where it points.
async fn resolve(parsed: Parsed, local: LocalServers) -> Result<WorkloadCredentials, Refusal> {
    let field = parsed.server_field.as_str();
    let (addr, server_name) = match &parsed.host {
        Host::Ip(ip) => (SocketAddr::new(*ip, parsed.port), None),
        Host::Name(name) => {
            let found: Vec<SocketAddr> = tokio::time::timeout(
                RESOLVE_TIMEOUT,
                tokio::net::lookup_host((name.as_str(), parsed.port)),
            )
            .await
            .map_err(|_| resolve_failed(field, "its host name took too long to resolve"))?
            .map_err(|_| resolve_failed(field, "its host name did not resolve"))?
            .collect();
            if found.is_empty() {
                return Err(resolve_failed(
                    field,
                    "its host name resolved to no address",
                ));
            }
            if local == LocalServers::Refuse
                && let Some(kind) = found.iter().find_map(|a| local_kind(a.ip()))
            {
                return Err(refuse(
                    field,
                    format!(
                        "its host name resolves to a {kind} address (DNS pointed it there), \
                         which is refused: a workload cluster is not on the updater's own \
                         host (test rigs: inplace-updater serve {ALLOW_LOCAL_FLAG})"
                    ),
                ));
            }
            (found[0], Some(name.clone()))
        }
    };
    let kind = local_kind(addr.ip());
    if let (Some(kind), LocalServers::Refuse) = (kind, local) {
        return Err(refuse(
            field,
            format!(
                "its host is a {kind} address, which is refused: a workload cluster is not \
                 on the updater's own host (test rigs: inplace-updater serve {ALLOW_LOCAL_FLAG})"
            ),
        ));
    }
    let url = format!("https://{addr}{}", parsed.path)
        .parse::<http::Uri>()
        .map_err(|_| refuse(field, "cannot be rebuilt as a URL"))?;
    Ok(WorkloadCredentials {
        url,
        server_name,
        ca_der: parsed.ca_der,
        user: parsed.user,
        local: kind,
    })
}

fn resolve_failed(field: &str, why: &str) -> Refusal {
    Refusal {
        field: field.to_owned(),
        why: why.to_owned(),
        transient: true,
    }
}

// === bounded YAML ===

/// Parses YAML into a JSON value under [`MAX_NODES`], [`MAX_SCALAR_BYTES`] and
/// [`MAX_DEPTH`], aliases counted each time they are used (serde_yaml_ng replays an
/// anchor's events for each alias), duplicate keys refused. Errors say nothing of where.
fn bounded_yaml(text: &str) -> Result<Value, Refusal> {
    let budget = Budget::default();
    let seed = Node {
        budget: &budget,
        depth: 0,
    };
    let value = seed.deserialize(serde_yaml_ng::Deserializer::from_str(text));
    match (value, budget.refusal.take()) {
        (_, Some(r)) => Err(r),
        (Ok(v), None) => Ok(v),
        (Err(_), None) => Err(refuse(
            "",
            "not valid YAML of one document (check it with `kubectl --kubeconfig`)",
        )),
    }
}

#[derive(Default)]
struct Budget {
    nodes: std::cell::Cell<usize>,
    bytes: std::cell::Cell<usize>,
    refusal: std::cell::Cell<Option<Refusal>>,
}

impl Budget {
    fn fail<E: de::Error>(&self, why: String) -> E {
        self.refusal.set(Some(refuse("", why)));
        E::custom("over budget")
    }

    fn node<E: de::Error>(&self, scalar_bytes: usize) -> Result<(), E> {
        let nodes = self.nodes.get() + 1;
        let bytes = self.bytes.get().saturating_add(scalar_bytes);
        self.nodes.set(nodes);
        self.bytes.set(bytes);
        if nodes > MAX_NODES {
            return Err(self.fail(format!(
                "more than {MAX_NODES} YAML nodes (aliases counted each time they are used)"
            )));
        }
        if bytes > MAX_SCALAR_BYTES {
            return Err(self.fail(format!(
                "more than {MAX_SCALAR_BYTES} bytes of values (aliases counted each time they are used)"
            )));
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
struct Node<'b> {
    budget: &'b Budget,
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for Node<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        if self.depth > MAX_DEPTH {
            return Err(self
                .budget
                .fail(format!("nested deeper than {MAX_DEPTH} levels")));
        }
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a YAML value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        self.budget.node(1)?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        self.budget.node(8)?;
        Ok(Value::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        self.budget.node(8)?;
        Ok(Value::from(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        self.budget.node(8)?;
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        self.budget.node(v.len())?;
        Ok(Value::String(v.to_owned()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.budget.node(0)?;
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.budget.node(0)?;
        let inner = Node {
            budget: self.budget,
            depth: self.depth + 1,
        };
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(inner)? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.budget.node(0)?;
        let inner = Node {
            budget: self.budget,
            depth: self.depth + 1,
        };
        let mut out = Map::new();
        while let Some(key) = map.next_key_seed(inner)? {
            let Value::String(key) = key else {
                return Err(self.budget.fail("a map key that is not a string".into()));
            };
            let value = map.next_value_seed(inner)?;
            if out.insert(key, value).is_some() {
                return Err(self.budget.fail("a map with the same key twice".into()));
            }
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests;

//! The kubeconfig room: what Cluster API writes is accepted, every field that is code, a
//! file, a proxy or a way around TLS is refused by name without a byte of its value, and no
//! input panics or yields a file path (property tests).

use super::*;
use proptest::prelude::*;
use serde_json::json;

/// What must never appear in a message.
const SENTINEL: &str = "SENTINEL-c0ntent";

fn b64(data: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(data)
}

/// A CA (PEM) and a client certificate and key it signed (PEM).
fn pki() -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["kubernetes-admin".to_owned()]).unwrap();
    let cert = leaf.signed_by(&key, &issuer).unwrap();
    (ca_pem, cert.pem(), key.serialize_pem())
}

fn ca_pem() -> String {
    static CA: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    CA.get_or_init(|| pki().0).clone()
}

/// A kubeconfig as Cluster API's `util/kubeconfig.New` writes it (client certificate).
fn capi_kubeconfig(server: &str) -> (Value, String, String) {
    let (ca, cert, key) = pki();
    let v = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c1", "cluster": {
            "server": server, "certificate-authority-data": b64(ca.as_bytes())}}],
        "contexts": [{"name": "c1-admin@c1", "context": {"cluster": "c1", "user": "c1-admin"}}],
        "current-context": "c1-admin@c1",
        "preferences": {},
        "users": [{"name": "c1-admin", "user": {
            "client-certificate-data": b64(cert.as_bytes()),
            "client-key-data": b64(key.as_bytes())}}],
    });
    (v, cert, key)
}

/// The same with a token instead of a client certificate.
fn token_kubeconfig(server: &str, token: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "w", "cluster": {
            "server": server, "certificate-authority-data": b64(ca_pem().as_bytes())}}],
        "contexts": [{"name": "w", "context": {"cluster": "w", "user": "u"}}],
        "current-context": "w",
        "users": [{"name": "u", "user": {"token": token}}],
    })
}

fn yaml(v: &Value) -> Vec<u8> {
    serde_yaml_ng::to_string(v).unwrap().into_bytes()
}

fn refusal(v: &Value) -> Refusal {
    parse(&yaml(v)).expect_err("refused")
}

#[test]
fn what_cluster_api_writes_is_accepted() {
    let (v, cert, _) = capi_kubeconfig("https://10.0.0.1:6443");
    let p = parse(&yaml(&v)).unwrap();
    assert_eq!(p.host, Host::Ip("10.0.0.1".parse().unwrap()));
    assert_eq!(p.port, 6443);
    assert_eq!(p.path, "/");
    assert_eq!(p.ca_der.len(), 1);
    let User::Certificate { cert_pem, key_pem } = &p.user else {
        panic!("{:?}", p.user)
    };
    // Written again from the DER: the same certificate.
    let der = |pem: &str| {
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .map(|c| c.unwrap().to_vec())
            .collect::<Vec<_>>()
    };
    assert_eq!(der(cert_pem), der(&cert));
    assert!(
        key_pem.starts_with("-----BEGIN PRIVATE KEY-----\n"),
        "pkcs8"
    );

    let p = parse(&yaml(&token_kubeconfig(
        "https://api.example.com/k8s/c-1",
        "abc.def",
    )))
    .unwrap();
    assert_eq!(p.host, Host::Name("api.example.com".into()));
    assert_eq!((p.port, p.path.as_str()), (443, "/k8s/c-1"));
    assert_eq!(p.user, User::Token("abc.def".into()));
}

/// Every field that is code, a file, a proxy, a way around TLS or another identity is
/// refused by its path, and the message holds nothing of its value.
#[test]
fn every_refused_field_is_refused_by_name_without_its_value() {
    let cases: &[(&str, &str, Value)] = &[
        (
            "user",
            "exec",
            json!({"command": "/bin/sh", "args": ["-c", SENTINEL], "apiVersion": "client.authentication.k8s.io/v1"}),
        ),
        (
            "user",
            "auth-provider",
            json!({"name": "gcp", "config": {"cmd-path": SENTINEL}}),
        ),
        ("user", "tokenFile", json!(SENTINEL)),
        ("user", "client-certificate", json!(SENTINEL)),
        ("user", "client-key", json!(SENTINEL)),
        ("user", "username", json!(SENTINEL)),
        ("user", "password", json!(SENTINEL)),
        ("user", "as", json!(SENTINEL)),
        ("user", "as-uid", json!(SENTINEL)),
        ("user", "as-groups", json!([SENTINEL])),
        ("user", "as-user-extra", json!({"k": [SENTINEL]})),
        ("cluster", "certificate-authority", json!(SENTINEL)),
        ("cluster", "insecure-skip-tls-verify", json!(true)),
        (
            "cluster",
            "proxy-url",
            json!(format!("http://{SENTINEL}:3128")),
        ),
        ("cluster", "tls-server-name", json!(SENTINEL)),
    ];
    for (entry, field, value) in cases {
        let mut v = token_kubeconfig("https://10.0.0.1:6443", "t");
        let list = format!("{entry}s");
        v[&list][0][entry][field] = value.clone();
        let r = refusal(&v);
        assert_eq!(r.field, format!("{list}[0].{entry}.{field}"), "{r}");
        let shown = KubeconfigError {
            secret: "ns/c-kubeconfig".into(),
            refusal: r,
        }
        .to_string();
        assert!(
            shown.starts_with("Secret ns/c-kubeconfig key value: "),
            "{shown}"
        );
        assert!(!shown.contains("SENTINEL"), "{shown}");
        assert!(!shown.contains("/bin/sh"), "{shown}");
    }
    // In an entry the context does not use, too.
    let mut v = token_kubeconfig("https://10.0.0.1:6443", "t");
    v["users"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "other", "user": {"exec": {"command": SENTINEL}}}));
    assert_eq!(refusal(&v).field, "users[1].user.exec");
    // A field the format does not have is refused without naming it (it is content).
    let mut v = token_kubeconfig("https://10.0.0.1:6443", "t");
    v["users"][0]["user"][SENTINEL] = json!("x");
    let r = refusal(&v);
    assert_eq!(r.field, "users[0].user");
    assert!(!r.to_string().contains("SENTINEL"), "{r}");
    // insecure-skip-tls-verify: false is what the default is.
    let mut v = token_kubeconfig("https://10.0.0.1:6443", "t");
    v["clusters"][0]["cluster"]["insecure-skip-tls-verify"] = json!(false);
    parse(&yaml(&v)).unwrap();
}

#[test]
fn the_server_must_be_https_with_the_cas_data() {
    for (server, why) in [
        ("http://10.0.0.1:6443", "plain http is refused"),
        ("10.0.0.1:6443", "not an https URL"),
        ("https://user:pw@10.0.0.1", "user information"),
        ("https://10.0.0.1/?x=1", "has a query"),
        ("ftp://10.0.0.1", "not an https URL"),
    ] {
        let r = refusal(&token_kubeconfig(server, "t"));
        assert_eq!(r.field, "clusters[0].cluster.server", "{server}: {r}");
        assert!(r.why.contains(why), "{server}: {r}");
        assert!(!r.to_string().contains("10.0.0.1"), "{r}");
    }
    let mut v = token_kubeconfig("https://10.0.0.1", "t");
    v["clusters"][0]["cluster"]
        .as_object_mut()
        .unwrap()
        .remove("certificate-authority-data");
    let r = refusal(&v);
    assert_eq!(r.field, "clusters[0].cluster.certificate-authority-data");
    assert!(r.why.contains("missing"), "{r}");
    v["clusters"][0]["cluster"]["certificate-authority-data"] = json!(b64(b"not pem"));
    assert!(refusal(&v).why.contains("no PEM certificate"));
    v["clusters"][0]["cluster"]["certificate-authority-data"] = json!("%%%");
    assert_eq!(refusal(&v).why, "not base64");
}

#[test]
fn the_user_gives_a_certificate_and_its_key_or_a_token() {
    let (mut v, _, _) = capi_kubeconfig("https://10.0.0.1");
    v["users"][0]["user"]
        .as_object_mut()
        .unwrap()
        .remove("client-key-data");
    assert_eq!(refusal(&v).field, "users[0].user.client-key-data");
    // A key that is not the certificate's.
    let (mut v, _, _) = capi_kubeconfig("https://10.0.0.1");
    let (_, _, other_key) = pki();
    v["users"][0]["user"]["client-key-data"] = json!(b64(other_key.as_bytes()));
    let r = refusal(&v);
    assert_eq!(r.field, "users[0].user", "{r}");
    assert!(r.why.contains("not a usable pair"), "{r}");
    let (mut v, _, _) = capi_kubeconfig("https://10.0.0.1");
    v["users"][0]["user"]["client-key-data"] = json!(b64(
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
    ));
    let r = refusal(&v);
    assert!(r.field.starts_with("users[0].user"), "{r}");
    let (mut v, _, _) = capi_kubeconfig("https://10.0.0.1");
    v["users"][0]["user"]["token"] = json!(SENTINEL);
    assert_eq!(refusal(&v).field, "users[0].user.token");
    let v = token_kubeconfig("https://10.0.0.1", "a b");
    assert!(!refusal(&v).to_string().contains("a b"));
    let mut v = token_kubeconfig("https://10.0.0.1", "t");
    v["users"][0]["user"] = json!({});
    assert!(refusal(&v).why.contains("no inline credentials"));
}

#[test]
fn the_context_is_the_current_one_or_the_only_one() {
    let mut v = token_kubeconfig("https://10.0.0.1", "t");
    v.as_object_mut().unwrap().remove("current-context");
    parse(&yaml(&v)).unwrap();
    v["contexts"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "x", "context": {"cluster": "w", "user": "u"}}));
    assert!(refusal(&v).why.contains("there are 2 contexts"));
    v["current-context"] = json!("nope");
    let r = refusal(&v);
    assert_eq!(r.field, "current-context");
    assert!(!r.to_string().contains("nope"));
    v["current-context"] = json!("x");
    parse(&yaml(&v)).unwrap();
    v["contexts"][1]["context"]["user"] = json!("nobody");
    assert_eq!(refusal(&v).field, "contexts[1].context.user");
    v["contexts"][1]["name"] = json!("w");
    assert_eq!(refusal(&v).field, "contexts[1].name", "duplicate name");
}

#[test]
fn size_aliases_depth_and_duplicate_keys_are_bounded() {
    let big = vec![b'a'; MAX_KUBECONFIG_BYTES + 1];
    assert!(parse(&big).unwrap_err().why.contains("65537 bytes"));
    // A billion laughs: each level doubles; refused by the node budget, quickly.
    let mut bomb = String::from("a: &a [x, x, x, x, x, x, x, x]\n");
    for i in 1..12 {
        bomb.push_str(&format!(
            "{}: &{} [*{}, *{}, *{}, *{}]\n",
            (b'a' + i) as char,
            (b'a' + i) as char,
            (b'a' + i - 1) as char,
            (b'a' + i - 1) as char,
            (b'a' + i - 1) as char,
            (b'a' + i - 1) as char
        ));
    }
    let r = parse(bomb.as_bytes()).unwrap_err();
    assert!(r.why.contains("YAML nodes"), "{r}");
    // Long strings through aliases: the byte budget.
    let long = "x".repeat(30_000);
    let text = format!("a: &s {long}\nb: [*s, *s, *s, *s, *s]\n");
    assert!(
        parse(text.as_bytes())
            .unwrap_err()
            .why
            .contains("bytes of values")
    );
    let deep = format!("{}1{}", "[".repeat(100), "]".repeat(100));
    assert!(
        parse(deep.as_bytes())
            .unwrap_err()
            .why
            .contains("nested deeper")
    );
    let dup = "kind: Config\nkind: Config\n";
    assert!(
        parse(dup.as_bytes())
            .unwrap_err()
            .why
            .contains("same key twice")
    );
    let r = parse(b"clusters: [\n").unwrap_err();
    assert!(r.why.starts_with("not valid YAML"), "{r}");
    assert_eq!(parse(b"\xff").unwrap_err().why, "not UTF-8 text");
}

#[test]
fn local_addresses_are_known() {
    for (ip, kind) in [
        ("127.0.0.1", Some("loopback")),
        ("127.9.9.9", Some("loopback")),
        ("169.254.169.254", Some("link-local")),
        ("0.0.0.0", Some("unspecified")),
        ("0.1.2.3", Some("unspecified")),
        ("::1", Some("loopback")),
        ("::", Some("unspecified")),
        ("fe80::1", Some("link-local")),
        ("febf::1", Some("link-local")),
        (
            "::ffff:127.0.0.1",
            Some("IPv4-mapped loopback or link-local"),
        ),
        (
            "::ffff:169.254.1.1",
            Some("IPv4-mapped loopback or link-local"),
        ),
        ("10.0.0.1", None),
        ("192.168.1.1", None),
        ("fec0::1", None),
        ("2001:db8::1", None),
        ("::ffff:10.0.0.1", None),
    ] {
        assert_eq!(local_kind(ip.parse().unwrap()), kind, "{ip}");
    }
}

#[tokio::test]
async fn a_local_server_is_refused_unless_allowed_and_a_name_is_pinned() {
    let secret = "ns/c-kubeconfig";
    for server in [
        "https://127.0.0.1:6443",
        "https://[::1]:6443",
        "https://[::ffff:127.0.0.1]",
        "https://169.254.169.254",
        "https://0.0.0.0",
    ] {
        let v = yaml(&token_kubeconfig(server, "t"));
        let e = credentials(secret, &v, LocalServers::Refuse)
            .await
            .unwrap_err();
        assert_eq!(
            e.refusal.field, "clusters[0].cluster.server",
            "{server}: {e}"
        );
        assert!(e.to_string().contains(ALLOW_LOCAL_FLAG), "{e}");
        assert!(!e.to_string().contains("6443"), "{e}");
        let c = credentials(secret, &v, LocalServers::Allow).await.unwrap();
        assert!(c.local().is_some(), "{server}");
    }
    // A host name that resolves to loopback: DNS pointed it there.
    let v = yaml(&token_kubeconfig("https://localhost:6443", "t"));
    let e = credentials(secret, &v, LocalServers::Refuse)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("DNS pointed it there"), "{e}");
    let c = credentials(secret, &v, LocalServers::Allow).await.unwrap();
    assert_eq!(c.server_name(), Some("localhost"));
    let host = c.url().host().unwrap();
    assert!(
        host == "127.0.0.1" || host == "[::1]",
        "pinned to the address: {}",
        c.url()
    );
    assert_eq!(c.url().port_u16(), Some(6443));
    // An address elsewhere: as given, no server name, nothing local.
    let v = yaml(&token_kubeconfig("https://10.1.2.3:6443/prefix", "t"));
    let c = credentials(secret, &v, LocalServers::Refuse).await.unwrap();
    assert_eq!(c.url().to_string(), "https://10.1.2.3:6443/prefix");
    assert_eq!((c.server_name(), c.local()), (None, None));
    assert_eq!(c.ca_der().len(), 1);
    assert!(!format!("{c:?}").contains("\"t\""), "Debug shows no token");
}

// === properties ===

/// The fields the updater never takes, with where they go.
const POISON: &[(&str, &str)] = &[
    ("user", "exec"),
    ("user", "auth-provider"),
    ("user", "tokenFile"),
    ("user", "client-certificate"),
    ("user", "client-key"),
    ("user", "username"),
    ("user", "password"),
    ("user", "as"),
    ("user", "as-groups"),
    ("cluster", "certificate-authority"),
    ("cluster", "proxy-url"),
    ("cluster", "insecure-skip-tls-verify"),
];

fn any_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(true)),
        "[ -~]{0,20}".prop_map(Value::String),
        Just(json!({"command": "/bin/sh"})),
        Just(json!(["/etc/passwd"])),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    /// Arbitrary bytes never panic, and whatever is accepted holds data only.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(p) = parse(&bytes) {
            prop_assert!(!p.ca_der.is_empty());
        }
    }

    /// YAML-ish text (the characters YAML gives meaning to) never panics.
    #[test]
    fn yamlish_text_never_panics(text in "[a-z:&*!|>\\-\\[\\]{}, \n'\"#%@`0-9.]{0,300}") {
        let _ = parse(text.as_bytes());
    }

    /// A kubeconfig with any of the refused fields, anywhere among its entries, is refused
    /// and names one of them; without them it is accepted.
    #[test]
    fn every_refused_field_is_refused(
        poison in proptest::collection::vec((0..POISON.len(), any_value(), any::<bool>()), 0..4),
    ) {
        let mut v = token_kubeconfig("https://10.0.0.1:6443", "t");
        v["users"].as_array_mut().unwrap().push(json!({"name": "spare", "user": {"token": "s"}}));
        let mut planted = Vec::new();
        for (i, value, spare) in &poison {
            let (entry, field) = POISON[*i];
            let value = if field == "insecure-skip-tls-verify" { json!(true) } else { value.clone() };
            let index = usize::from(*spare && entry == "user");
            v[format!("{entry}s")][index][entry][field] = value;
            planted.push(format!("{entry}s[{index}].{entry}.{field}"));
        }
        match parse(&yaml(&v)) {
            Ok(p) => {
                prop_assert!(planted.is_empty(), "accepted with {planted:?}");
                prop_assert_eq!(p.user, User::Token("t".into()));
            }
            Err(r) => {
                prop_assert!(planted.contains(&r.field), "{} not in {:?}", r, planted);
                prop_assert!(!r.to_string().contains("/bin/sh"));
            }
        }
    }

    /// Minimal kubeconfigs (an https server, the CA data, a token) round-trip.
    #[test]
    fn minimal_kubeconfigs_round_trip(
        octets in (11u8..=223, any::<u8>(), any::<u8>(), 1u8..=254),
        name in "[a-z][a-z0-9]{0,10}(\\.[a-z][a-z0-9]{0,10}){1,3}",
        use_name in any::<bool>(),
        port in 1u16..,
        path in "(/[a-z0-9-]{1,8}){0,3}",
        token in "[!-~]{1,64}",
    ) {
        let ip = Ipv4Addr::new(octets.0, octets.1, octets.2, octets.3);
        let host = if use_name { name.clone() } else { ip.to_string() };
        let v = token_kubeconfig(&format!("https://{host}:{port}{path}"), &token);
        let p = parse(&yaml(&v)).unwrap();
        let want = if use_name { Host::Name(name) } else { Host::Ip(IpAddr::V4(ip)) };
        prop_assert_eq!(p.host, want);
        prop_assert_eq!(p.port, port);
        prop_assert_eq!(p.path, if path.is_empty() { "/".to_owned() } else { path });
        prop_assert_eq!(p.user, User::Token(token));
        prop_assert_eq!(p.ca_der.len(), 1);
    }
}

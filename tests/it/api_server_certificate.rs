//! `apiServerCertificate` (decision 0021) applied by the real agent binary on a sandbox
//! control-plane tree whose `/etc/kubernetes/pki` holds a cluster CA and an API server
//! certificate made here the way kubeadm makes them: the certificate is reissued in place
//! with the new names, from the same key; applied again it is left alone; a failing gate
//! after it puts the old certificate back byte for byte; without `ca.key` (an external CA)
//! the plan is refused, naming the file, and nothing is written.

use std::time::SystemTime;

use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::FromDer as _;

use crate::support::{Node, header, text};

const PKI: &str = "etc/kubernetes/pki";

/// kubeadm's names for a control-plane node `cp-0`, with an old certSAN.
const NAMES: [&str; 6] = [
    "cp-0",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
    "old.example.com",
];

/// A control-plane node's tree with kubeadm's CA and serving certificate (also the crash
/// tests' node for this kind).
pub(crate) fn control_plane_node() -> Node {
    let node = Node::new();
    let pki = node.path(PKI);
    std::fs::create_dir_all(&pki).unwrap();
    for (name, text, mode) in kubeadm_pki() {
        let p = pki.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(*mode)).unwrap();
    }
    node
}

/// The files of kubeadm's PKI with their modes, made once per test process (every node of
/// a test gets the same tree, so trees can be compared).
fn kubeadm_pki() -> &'static [(&'static str, String, u32)] {
    static PKI_FILES: std::sync::OnceLock<Vec<(&'static str, String, u32)>> =
        std::sync::OnceLock::new();
    PKI_FILES.get_or_init(make_pki)
}

fn make_pki() -> Vec<(&'static str, String, u32)> {
    let printable = |s: &str| rcgen::DnValue::PrintableString(s.try_into().unwrap());
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name = rcgen::DistinguishedName::new();
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, printable("kubernetes"));
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        rcgen::KeyUsagePurpose::DigitalSignature,
        rcgen::KeyUsagePurpose::KeyEncipherment,
        rcgen::KeyUsagePurpose::KeyCertSign,
    ];
    let ca_cert = ca.self_signed(&ca_key).unwrap();

    let key = rcgen::KeyPair::generate().unwrap();
    let mut leaf = rcgen::CertificateParams::new(NAMES.map(String::from).to_vec()).unwrap();
    for ip in ["10.96.0.1", "192.0.2.10"] {
        leaf.subject_alt_names
            .push(rcgen::SanType::IpAddress(ip.parse().unwrap()));
    }
    leaf.distinguished_name = rcgen::DistinguishedName::new();
    leaf.distinguished_name
        .push(rcgen::DnType::CommonName, printable("kube-apiserver"));
    leaf.is_ca = rcgen::IsCa::ExplicitNoCa;
    leaf.key_usages = vec![
        rcgen::KeyUsagePurpose::DigitalSignature,
        rcgen::KeyUsagePurpose::KeyEncipherment,
    ];
    leaf.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    leaf.use_authority_key_identifier_extension = true;
    let now = time::OffsetDateTime::now_utc();
    leaf.not_before = now - time::Duration::hours(1);
    leaf.not_after = (now + time::Duration::days(365))
        .replace_nanosecond(0)
        .unwrap();
    let leaf_cert = leaf
        .signed_by(&key, &rcgen::Issuer::from_params(&ca, &ca_key))
        .unwrap();

    vec![
        ("ca.crt", ca_cert.pem(), 0o644),
        ("ca.key", ca_key.serialize_pem(), 0o600),
        ("apiserver.crt", leaf_cert.pem(), 0o644),
        ("apiserver.key", key.serialize_pem(), 0o600),
    ]
}

/// A plan that reissues the certificate and then fails its gate (rolled back).
pub(crate) fn failing_plan(id: &str) -> String {
    plan(
        id,
        "verify:\n  - command: {argv: [\"sh\", \"-c\", \"exit 3\"], timeoutSeconds: 1, periodSeconds: 1}\n",
    )
}

fn plan(id: &str, verify: &str) -> String {
    format!(
        "{}changes:
  - apiServerCertificate:
      certSANs: [api.example.com, 10.0.0.5]
      previous: [old.example.com]
{verify}",
        header(id)
    )
}

fn read(node: &Node, name: &str) -> Vec<u8> {
    std::fs::read(node.path(&format!("{PKI}/{name}"))).unwrap()
}

fn der(pem: &[u8]) -> Vec<u8> {
    x509_parser::pem::parse_x509_pem(pem).unwrap().1.contents
}

/// The names of a certificate, as text.
fn names_of(cert: &X509Certificate<'_>) -> Vec<String> {
    cert.subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names
        .iter()
        .map(|n| match n {
            GeneralName::DNSName(d) => d.to_string(),
            GeneralName::IPAddress(b) => {
                std::net::IpAddr::from(<[u8; 4]>::try_from(*b).unwrap()).to_string()
            }
            other => panic!("unexpected name {other}"),
        })
        .collect()
}

fn apply(node: &Node, plan: &std::path::Path) -> (std::process::Output, serde_json::Value) {
    let out = node.agent(&[
        "apply",
        "--no-chroot",
        "--output",
        "json",
        plan.to_str().unwrap(),
    ]);
    let status = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out, status)
}

#[test]
fn the_certificate_is_reissued_with_the_new_names_and_left_alone_after() {
    let node = control_plane_node();
    let (old_pem, key_before, ca_key_before) = (
        read(&node, "apiserver.crt"),
        read(&node, "apiserver.key"),
        read(&node, "ca.key"),
    );
    let started = SystemTime::now();
    let p1 = node.plan_file("p1.yaml", &plan("ns/cp-0@1", ""));
    let (out, status) = apply(&node, &p1);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(status["phase"], "Succeeded", "{status}");
    assert_eq!(status["changes"][0]["state"], "Changed", "{status}");

    let new_pem = read(&node, "apiserver.crt");
    assert_ne!(new_pem, old_pem);
    let (old_der, new_der, ca_der) = (der(&old_pem), der(&new_pem), der(&read(&node, "ca.crt")));
    let (_, old) = X509Certificate::from_der(&old_der).unwrap();
    let (_, new) = X509Certificate::from_der(&new_der).unwrap();
    let (_, ca) = X509Certificate::from_der(&ca_der).unwrap();
    new.verify_signature(Some(ca.public_key()))
        .expect("the reissued certificate verifies against ca.crt");
    assert_eq!(
        names_of(&new),
        [
            "cp-0",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
            "10.96.0.1",
            "192.0.2.10",
            "api.example.com",
            "10.0.0.5",
        ]
    );
    assert_eq!(
        new.public_key().raw,
        old.public_key().raw,
        "same public key"
    );
    assert_eq!(new.subject().as_raw(), old.subject().as_raw());
    assert_eq!(new.validity().not_after, old.validity().not_after);
    let not_before = new.validity().not_before.timestamp();
    let started = started
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!(
        (started - 6 * 60..=started).contains(&not_before),
        "NotBefore {not_before} is not a few minutes before {started}"
    );
    assert!(new.extended_key_usage().unwrap().unwrap().value.server_auth);
    assert_eq!(
        read(&node, "apiserver.key"),
        key_before,
        "the key is never rewritten"
    );
    assert_eq!(read(&node, "ca.key"), ca_key_before);
    let mode = |name: &str| {
        std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(node.path(&format!("{PKI}/{name}")))
                .unwrap()
                .permissions(),
        ) & 0o7777
    };
    assert_eq!(mode("apiserver.crt"), 0o644);
    // Nothing of the CA's key reaches the journal or the output.
    let journal =
        std::fs::read_to_string(node.path("var/lib/inplace-agent/journal/journal.log")).unwrap();
    assert!(
        journal.contains("apiServerCertificate"),
        "not this plan's journal"
    );
    for secret in [&ca_key_before, &key_before] {
        let body: String = String::from_utf8_lossy(secret)
            .lines()
            .nth(1)
            .unwrap()
            .to_string();
        assert!(!journal.contains(&body), "a key line in the journal");
        assert!(!text(&out).contains(&body), "a key line in the output");
    }

    // The same desired state again, as a new plan: unchanged, nothing written.
    let before = node.snapshot_without_state();
    let p2 = node.plan_file("p2.yaml", &plan("ns/cp-0@2", ""));
    let (out, status) = apply(&node, &p2);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(status["changes"][0]["state"], "Unchanged", "{status}");
    assert_eq!(before, node.snapshot_without_state());
    assert_eq!(read(&node, "apiserver.crt"), new_pem);
}

#[test]
fn a_failing_gate_after_it_restores_the_old_certificate_byte_for_byte() {
    let node = control_plane_node();
    let before = node.snapshot_without_state();
    let old_pem = read(&node, "apiserver.crt");
    let p = node.plan_file("bad.yaml", &failing_plan("ns/cp-0@bad"));
    let (out, status) = apply(&node, &p);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(status["phase"], "RolledBack", "{status}");
    assert_eq!(status["counts"]["rolledBack"], 1, "{status}");
    assert_eq!(read(&node, "apiserver.crt"), old_pem);
    assert_eq!(
        crate::support::diff(&before, &node.snapshot_without_state()),
        Vec::<String>::new()
    );
}

#[test]
fn without_the_cas_key_the_plan_is_refused_naming_it_and_nothing_is_written() {
    let node = control_plane_node();
    std::fs::remove_file(node.path(&format!("{PKI}/ca.key"))).unwrap();
    let before = node.snapshot();
    let p = node.plan_file("p.yaml", &plan("ns/cp-0@1", ""));
    let out = node.agent(&["apply", "--no-chroot", p.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains("/etc/kubernetes/pki/ca.key does not exist")
            && said.contains("externally managed CA")
            && said.contains("/etc/kubernetes/pki/apiserver.crt"),
        "{said}"
    );
    assert_eq!(
        crate::support::diff(&before, &node.snapshot()),
        Vec::<String>::new(),
        "something was written"
    );
    // The dry run says the same.
    let out = node.agent(&["check", "--no-chroot", p.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("ca.key does not exist"),
        "{}",
        text(&out)
    );
}

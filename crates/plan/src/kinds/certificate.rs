//! The X.509 work of `apiServerCertificate` (pure: bytes in, bytes out): the subject
//! alternative names a certificate must carry, and reissuing kubeadm's serving certificate
//! with them, signed by the node's cluster CA with the same public key, subject, usages and
//! NotAfter (decision 0021). Nothing here reads a file; the kind hands the bytes over.

use std::fmt;
use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use rcgen::{
    CertificateParams, DistinguishedName, DnType, DnValue, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyIdMethod, KeyPair, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber,
    SignatureAlgorithm,
};
use sha2::Digest as _;
use x509_parser::certificate::X509Certificate;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::prelude::FromDer as _;
use zeroize::Zeroizing;

/// The largest certificate or key file read (kubeadm's are 1–3 KiB).
pub const MAX_PEM_BYTES: u64 = 64 * 1024;

/// How far before now a reissued certificate starts to be valid: a node whose clock is a
/// little behind this one's still accepts it.
pub const CLOCK_SKEW: Duration = Duration::from_secs(5 * 60);

/// The names kubeadm gives every API server certificate for the `kubernetes` Service; never
/// removed, whatever `previous` says (a `previous` that names one is a mistake, and the
/// certificate without it would break every in-cluster client).
const SERVICE_NAMES: [&str; 3] = ["kubernetes", "kubernetes.default", "kubernetes.default.svc"];

/// One subject alternative name as kubeadm writes them: a DNS name or an IP address.
#[derive(Debug, Clone, Eq)]
pub enum San {
    /// A DNS name (compared without regard to ASCII case, as DNS does).
    Dns(String),
    /// An IP address.
    Ip(IpAddr),
}

impl PartialEq for San {
    fn eq(&self, other: &San) -> bool {
        match (self, other) {
            (San::Dns(a), San::Dns(b)) => a.eq_ignore_ascii_case(b),
            (San::Ip(a), San::Ip(b)) => a == b,
            _ => false,
        }
    }
}

impl fmt::Display for San {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            San::Dns(d) => f.write_str(d),
            San::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

impl San {
    /// A name of `clusterConfiguration.apiServer.certSANs`: an IP address, else a lowercase
    /// DNS subdomain or a wildcard (`*.example.com`), as kubeadm's validation accepts them.
    pub fn parse(s: &str) -> Result<San, String> {
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(San::Ip(ip));
        }
        let bare = s.strip_prefix("*.").unwrap_or(s);
        if crate::parse::is_dns_subdomain(bare) {
            Ok(San::Dns(s.to_string()))
        } else {
            Err(format!(
                "{s:?} is neither an IP address nor a lowercase DNS name (such as \
                 api.example.com or *.example.com)"
            ))
        }
    }

    /// One of the names kubeadm gives the `kubernetes` Service.
    fn is_service_name(&self) -> bool {
        match self {
            San::Dns(d) => {
                let d = d.to_ascii_lowercase();
                SERVICE_NAMES.contains(&d.as_str()) || d.starts_with("kubernetes.default.svc.")
            }
            San::Ip(_) => false,
        }
    }
}

/// The names a certificate carrying `existing` must carry (pure): `existing` in its order
/// without those of `previous` that `wanted` does not name (never the `kubernetes` Service's
/// names), then those of `wanted` it lacks, in their order, each once.
pub fn desired_sans(existing: &[San], wanted: &[San], previous: &[San]) -> Vec<San> {
    let leaves = |s: &San| previous.contains(s) && !wanted.contains(s) && !s.is_service_name();
    let mut out: Vec<San> = Vec::with_capacity(existing.len() + wanted.len());
    for s in existing {
        if !leaves(s) && !out.contains(s) {
            out.push(s.clone());
        }
    }
    for s in wanted {
        if !out.contains(s) {
            out.push(s.clone());
        }
    }
    out
}

/// The DER of the first `CERTIFICATE` block of the PEM text `pem` read from `file`.
pub fn certificate_der(pem: &[u8], file: &str) -> Result<Vec<u8>, String> {
    for block in x509_parser::pem::Pem::iter_from_buffer(pem) {
        let block = block.map_err(|e| format!("{file} is not PEM: {e}"))?;
        if block.label == "CERTIFICATE" {
            return Ok(block.contents);
        }
    }
    Err(format!("{file} holds no PEM CERTIFICATE block"))
}

/// A parsed certificate and the file it came from, for messages.
struct Parsed<'a> {
    cert: X509Certificate<'a>,
    file: &'a str,
}

fn parse<'a>(der: &'a [u8], file: &'a str) -> Result<Parsed<'a>, String> {
    let (rest, cert) = X509Certificate::from_der(der)
        .map_err(|e| format!("{file} is not an X.509 certificate: {e}"))?;
    if !rest.is_empty() {
        return Err(format!("{file} has bytes after its certificate"));
    }
    Ok(Parsed { cert, file })
}

/// The subject alternative names of the certificate `der` (from `file`): DNS names and IP
/// addresses; any other kind of name is refused (kubeadm writes none, and dropping one
/// silently would change what the certificate serves).
pub fn sans_of(der: &[u8], file: &str) -> Result<Vec<San>, String> {
    let p = parse(der, file)?;
    sans(&p)
}

fn sans(p: &Parsed<'_>) -> Result<Vec<San>, String> {
    let file = p.file;
    let ext = p
        .cert
        .subject_alternative_name()
        .map_err(|e| format!("{file}: its subjectAltName extension cannot be read: {e}"))?;
    let Some(ext) = ext else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for name in &ext.value.general_names {
        out.push(match name {
            GeneralName::DNSName(d) => San::Dns(d.to_string()),
            GeneralName::IPAddress(b) => match b.len() {
                4 => San::Ip(IpAddr::from(<[u8; 4]>::try_from(*b).unwrap_or_default())),
                16 => San::Ip(IpAddr::from(<[u8; 16]>::try_from(*b).unwrap_or_default())),
                n => return Err(format!("{file} has an IP address SAN of {n} bytes")),
            },
            other => {
                return Err(format!(
                    "{file} has a subject alternative name of a kind kubeadm does not write \
                     ({other}); renew it with `kubeadm certs renew apiserver` instead"
                ));
            }
        });
    }
    Ok(out)
}

/// What a reissue needs: the PEM texts of the three files and the names to carry.
#[derive(Debug, Clone, Copy)]
pub struct Reissue<'a> {
    /// `apiserver.crt` as it is, and its path for messages.
    pub leaf: (&'a [u8], &'a str),
    /// `ca.crt`, and its path.
    pub ca: (&'a [u8], &'a str),
    /// `ca.key`, and its path (the key is never put into a message).
    pub ca_key: (&'a [u8], &'a str),
    /// The subject alternative names of the new certificate, in order.
    pub sans: &'a [San],
    /// The time it is issued at.
    pub now: SystemTime,
}

/// The public key of the old certificate, handed to rcgen as is.
struct OldKey {
    /// The subjectPublicKey bits.
    bits: Vec<u8>,
    alg: &'static SignatureAlgorithm,
}

impl PublicKeyData for OldKey {
    fn der_bytes(&self) -> &[u8] {
        &self.bits
    }

    fn algorithm(&self) -> &'static SignatureAlgorithm {
        self.alg
    }
}

const OID_RSA: &str = "1.2.840.113549.1.1.1";
const OID_EC: &str = "1.2.840.10045.2.1";
const OID_ED25519: &str = "1.3.101.112";
const OID_P256: &str = "1.2.840.10045.3.1.7";
const OID_P384: &str = "1.3.132.0.34";

/// The signature algorithm that goes with a key of this SubjectPublicKeyInfo.
fn algorithm_of(
    spki: &x509_parser::x509::SubjectPublicKeyInfo<'_>,
) -> Option<&'static SignatureAlgorithm> {
    match spki.algorithm.algorithm.to_id_string().as_str() {
        OID_RSA => Some(&rcgen::PKCS_RSA_SHA256),
        OID_ED25519 => Some(&rcgen::PKCS_ED25519),
        OID_EC => {
            let curve = spki.algorithm.parameters.as_ref()?.as_oid().ok()?;
            match curve.to_id_string().as_str() {
                OID_P256 => Some(&rcgen::PKCS_ECDSA_P256_SHA256),
                OID_P384 => Some(&rcgen::PKCS_ECDSA_P384_SHA384),
                _ => None,
            }
        }
        _ => None,
    }
}

/// One DER element.
fn der(tag: u8, content: &[u8]) -> Vec<u8> {
    // Sized once: a buffer that grew would leave a copy of a key's bytes behind.
    let mut out = Vec::with_capacity(content.len() + 10);
    out.push(tag);
    let n = content.len();
    if n < 0x80 {
        out.push(n as u8);
    } else {
        let bytes: Vec<u8> = n
            .to_be_bytes()
            .into_iter()
            .skip_while(|b| *b == 0)
            .collect();
        out.push(0x80 | bytes.len() as u8);
        out.extend(bytes);
    }
    out.extend_from_slice(content);
    out
}

/// A PKCS#8 `PrivateKeyInfo` of `key` (PKCS#1 or SEC1) under `algorithm`; every buffer that
/// held the key is zeroed when dropped.
fn pkcs8(algorithm: &[u8], key: &[u8]) -> Zeroizing<Vec<u8>> {
    let octets = Zeroizing::new(der(0x04, key));
    let mut body = Zeroizing::new(Vec::with_capacity(algorithm.len() + octets.len() + 16));
    body.extend(der(0x02, &[0]));
    body.extend(der(0x30, algorithm));
    body.extend_from_slice(&octets);
    Zeroizing::new(der(0x30, &body))
}

/// The CA's signing key from `ca.key` (PKCS#8, or kubeadm's PKCS#1 RSA and SEC1 EC keys),
/// for the CA certificate's public key. Messages never quote the key.
fn signing_key(
    pem: &[u8],
    file: &str,
    ca_spki: &x509_parser::x509::SubjectPublicKeyInfo<'_>,
    alg: &'static SignatureAlgorithm,
) -> Result<KeyPair, String> {
    let mut found = None;
    for block in x509_parser::pem::Pem::iter_from_buffer(pem) {
        let Ok(block) = block else {
            return Err(format!("{file} is not a PEM private key"));
        };
        if block.label.ends_with("PRIVATE KEY") {
            found = Some(block);
            break;
        }
    }
    let Some(block) = found else {
        return Err(format!("{file} holds no PEM private key"));
    };
    let oid = |s: &str| -> Vec<u8> {
        let oid: x509_parser::der_parser::oid::Oid<'static> = s
            .parse()
            .unwrap_or_else(|_| x509_parser::der_parser::oid!(1.2));
        der(0x06, oid.as_bytes())
    };
    let label = block.label;
    let block = Zeroizing::new(block.contents);
    let contents = match label.as_str() {
        "PRIVATE KEY" => block,
        "RSA PRIVATE KEY" => {
            let mut alg_id = oid(OID_RSA);
            alg_id.extend([0x05, 0x00]);
            pkcs8(&alg_id, &block)
        }
        "EC PRIVATE KEY" => {
            let curve = ca_spki
                .algorithm
                .parameters
                .as_ref()
                .and_then(|p| p.as_oid().ok())
                .ok_or_else(|| format!("{file} is an EC key but the CA's key names no curve"))?;
            let mut alg_id = oid(OID_EC);
            alg_id.extend(der(0x06, curve.as_bytes()));
            pkcs8(&alg_id, &block)
        }
        other => return Err(format!("{file} holds a key of an unknown form ({other})")),
    };
    let key = KeyPair::from_pkcs8_der_and_sign_algo(
        &rustls_pki_types::PrivatePkcs8KeyDer::from(&contents[..]),
        alg,
    )
    .map_err(|_| {
        format!("{file} cannot be read as the private key of the CA's key type (RSA or ECDSA P-256/P-384)")
    })?;
    if key.subject_public_key_info() != ca_spki.raw {
        return Err(format!(
            "{file} is not the private key of the CA certificate's public key"
        ));
    }
    Ok(key)
}

/// The certificate `r.leaf` reissued with the names `r.sans`, as PEM (pure but for the
/// signature's arithmetic): same subject and public key, the usages it had, NotBefore now
/// less [`CLOCK_SKEW`], its NotAfter, a fresh serial, signed by `r.ca_key`. Refused when the
/// old certificate does not chain to `r.ca`, has expired, or the key is not the CA's.
pub fn reissue(r: Reissue<'_>) -> Result<String, String> {
    let (leaf_file, ca_file, key_file) = (r.leaf.1, r.ca.1, r.ca_key.1);
    let leaf_der = certificate_der(r.leaf.0, leaf_file)?;
    let ca_der = certificate_der(r.ca.0, ca_file)?;
    let leaf = parse(&leaf_der, leaf_file)?;
    let ca = parse(&ca_der, ca_file)?;

    // The old certificate must be this CA's: same issuer name, a signature the CA's key made.
    if leaf.cert.issuer().as_raw() != ca.cert.subject().as_raw()
        || leaf
            .cert
            .verify_signature(Some(ca.cert.public_key()))
            .is_err()
    {
        return Err(format!(
            "{leaf_file} was not issued by {ca_file} (issuer {}, CA {}): the agent reissues \
             only a certificate of the node's cluster CA; renew it with `kubeadm certs renew \
             apiserver` or replace {ca_file}",
            leaf.cert.issuer(),
            ca.cert.subject()
        ));
    }
    let now = time::OffsetDateTime::from(r.now);
    let not_after =
        time::OffsetDateTime::from_unix_timestamp(leaf.cert.validity().not_after.timestamp())
            .map_err(|e| format!("{leaf_file}: its NotAfter is out of range: {e}"))?;
    if not_after <= now {
        return Err(format!(
            "{leaf_file} expired at {not_after}: renew it with `kubeadm certs renew apiserver` \
             before changing its names"
        ));
    }
    let ca_alg = algorithm_of(ca.cert.public_key()).ok_or_else(|| {
        format!(
            "{ca_file} has a key type the agent cannot sign with (RSA, ECDSA P-256/P-384, Ed25519)"
        )
    })?;
    let key = signing_key(r.ca_key.0, key_file, ca.cert.public_key(), ca_alg)?;
    let leaf_alg = algorithm_of(leaf.cert.public_key())
        .ok_or_else(|| format!("{leaf_file} has a key type the agent does not know"))?;
    let public = OldKey {
        bits: leaf.cert.public_key().subject_public_key.data.to_vec(),
        alg: leaf_alg,
    };
    if public.subject_public_key_info() != leaf.cert.public_key().raw {
        return Err(format!(
            "{leaf_file}: its public key cannot be carried over unchanged"
        ));
    }

    let mut params = CertificateParams::default();
    params.distinguished_name = distinguished_name(&leaf)?;
    params.subject_alt_names = r
        .sans
        .iter()
        .map(|s| match s {
            San::Dns(d) => rcgen::string::Ia5String::try_from(d.as_str())
                .map(SanType::DnsName)
                .map_err(|_| format!("{d:?} is not an ASCII DNS name")),
            San::Ip(ip) => Ok(SanType::IpAddress(*ip)),
        })
        .collect::<Result<_, _>>()?;
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = key_usages(&leaf)?;
    params.extended_key_usages = extended_key_usages(&leaf)?;
    let not_before = now - CLOCK_SKEW;
    let ca_not_before =
        time::OffsetDateTime::from_unix_timestamp(ca.cert.validity().not_before.timestamp())
            .unwrap_or(not_before);
    params.not_before = not_before.max(ca_not_before);
    params.not_after = not_after;
    params.serial_number = Some(serial(&leaf_der, r.sans, r.now));
    if let Some(ski) = key_id(&leaf) {
        params.key_identifier_method = KeyIdMethod::PreSpecified(ski);
    }

    let mut issuer_params = CertificateParams::default();
    issuer_params.distinguished_name = distinguished_name(&ca)?;
    match key_id(&ca) {
        Some(ski) => {
            issuer_params.key_identifier_method = KeyIdMethod::PreSpecified(ski);
            params.use_authority_key_identifier_extension = true;
        }
        None => params.use_authority_key_identifier_extension = false,
    }
    let issuer = Issuer::new(issuer_params, &key);
    let cert = params
        .signed_by(&public, &issuer)
        .map_err(|e| format!("sign the new {leaf_file} with {key_file}: {e}"))?;

    // What was meant: the same subject and key, this CA's name as issuer, its signature.
    let new = parse(cert.der(), leaf_file)?;
    if new.cert.subject().as_raw() != leaf.cert.subject().as_raw()
        || new.cert.issuer().as_raw() != ca.cert.subject().as_raw()
        || new.cert.public_key().raw != leaf.cert.public_key().raw
        || new
            .cert
            .verify_signature(Some(ca.cert.public_key()))
            .is_err()
    {
        return Err(format!(
            "the reissued {leaf_file} would not keep its subject and key under {ca_file}'s \
             name (a name encoding the agent cannot reproduce); renew it with `kubeadm certs \
             renew apiserver`"
        ));
    }
    Ok(cert.pem())
}

/// The subject of `p` attribute by attribute, each with its string type.
fn distinguished_name(p: &Parsed<'_>) -> Result<DistinguishedName, String> {
    let file = p.file;
    let mut dn = DistinguishedName::new();
    for rdn in p.cert.subject().iter() {
        let attrs: Vec<_> = rdn.iter().collect();
        let [attr] = attrs.as_slice() else {
            return Err(format!(
                "{file}: its subject has a multi-valued name, which kubeadm does not write"
            ));
        };
        let oid: Vec<u64> = attr
            .attr_type()
            .iter()
            .map(|i| i.collect())
            .ok_or_else(|| format!("{file}: its subject has an attribute of an unreadable type"))?;
        let value = attr.attr_value();
        let data = value.data.to_vec();
        let text = || String::from_utf8(data.clone()).map_err(|_| ());
        let v = match value.header.tag().0 {
            12 => text().map(DnValue::Utf8String),
            19 => text().and_then(|t| {
                rcgen::string::PrintableString::try_from(t)
                    .map(DnValue::PrintableString)
                    .map_err(|_| ())
            }),
            22 => text().and_then(|t| {
                rcgen::string::Ia5String::try_from(t)
                    .map(DnValue::Ia5String)
                    .map_err(|_| ())
            }),
            20 => text().and_then(|t| {
                rcgen::string::TeletexString::try_from(t)
                    .map(DnValue::TeletexString)
                    .map_err(|_| ())
            }),
            30 => rcgen::string::BmpString::from_utf16be(data.clone())
                .map(DnValue::BmpString)
                .map_err(|_| ()),
            28 => rcgen::string::UniversalString::from_utf32be(data.clone())
                .map(DnValue::UniversalString)
                .map_err(|_| ()),
            _ => Err(()),
        }
        .map_err(|()| format!("{file}: its subject has a value the agent cannot reproduce"))?;
        let ty = DnType::CustomDnType(oid);
        if dn.get(&ty).is_some() {
            return Err(format!(
                "{file}: its subject names an attribute twice, which kubeadm does not write"
            ));
        }
        dn.push(ty, v);
    }
    Ok(dn)
}

/// The subject key identifier of `p`, when it has one.
fn key_id(p: &Parsed<'_>) -> Option<Vec<u8>> {
    p.cert
        .extensions()
        .iter()
        .find_map(|e| match e.parsed_extension() {
            ParsedExtension::SubjectKeyIdentifier(k) => Some(k.0.to_vec()),
            _ => None,
        })
}

/// The key usages `p` has (kubeadm's serving certificates: digital signature, and key
/// encipherment for RSA keys).
fn key_usages(p: &Parsed<'_>) -> Result<Vec<KeyUsagePurpose>, String> {
    let ku = p
        .cert
        .key_usage()
        .map_err(|e| format!("{}: its keyUsage cannot be read: {e}", p.file))?;
    let Some(ku) = ku else {
        return Ok(Vec::new());
    };
    let ku = ku.value;
    let all = [
        (ku.digital_signature(), KeyUsagePurpose::DigitalSignature),
        (ku.non_repudiation(), KeyUsagePurpose::ContentCommitment),
        (ku.key_encipherment(), KeyUsagePurpose::KeyEncipherment),
        (ku.data_encipherment(), KeyUsagePurpose::DataEncipherment),
        (ku.key_agreement(), KeyUsagePurpose::KeyAgreement),
        (ku.key_cert_sign(), KeyUsagePurpose::KeyCertSign),
        (ku.crl_sign(), KeyUsagePurpose::CrlSign),
        (ku.encipher_only(), KeyUsagePurpose::EncipherOnly),
        (ku.decipher_only(), KeyUsagePurpose::DecipherOnly),
    ];
    Ok(all
        .into_iter()
        .filter(|(on, _)| *on)
        .map(|(_, k)| k)
        .collect())
}

/// The extended key usages `p` has (kubeadm's: server auth).
fn extended_key_usages(p: &Parsed<'_>) -> Result<Vec<ExtendedKeyUsagePurpose>, String> {
    let eku = p
        .cert
        .extended_key_usage()
        .map_err(|e| format!("{}: its extendedKeyUsage cannot be read: {e}", p.file))?;
    let Some(eku) = eku else {
        return Ok(Vec::new());
    };
    let eku = eku.value;
    let mut out: Vec<ExtendedKeyUsagePurpose> = [
        (eku.any, ExtendedKeyUsagePurpose::Any),
        (eku.server_auth, ExtendedKeyUsagePurpose::ServerAuth),
        (eku.client_auth, ExtendedKeyUsagePurpose::ClientAuth),
        (eku.code_signing, ExtendedKeyUsagePurpose::CodeSigning),
        (
            eku.email_protection,
            ExtendedKeyUsagePurpose::EmailProtection,
        ),
        (eku.time_stamping, ExtendedKeyUsagePurpose::TimeStamping),
        (eku.ocsp_signing, ExtendedKeyUsagePurpose::OcspSigning),
    ]
    .into_iter()
    .filter(|(on, _)| *on)
    .map(|(_, k)| k)
    .collect();
    for oid in &eku.other {
        let arcs: Vec<u64> = oid
            .iter()
            .map(|i| i.collect())
            .ok_or_else(|| format!("{}: an extended key usage is unreadable", p.file))?;
        out.push(ExtendedKeyUsagePurpose::Other(arcs));
    }
    Ok(out)
}

/// A serial number no earlier certificate of the CA has: 16 bytes of SHA-256 over the old
/// certificate, the new names and the time of issue (positive, no leading zero byte).
fn serial(old_der: &[u8], sans: &[San], now: SystemTime) -> SerialNumber {
    let mut h = sha2::Sha256::new();
    h.update(b"inplace-agent apiServerCertificate serial\0");
    h.update(old_der);
    for s in sans {
        h.update(s.to_string().as_bytes());
        h.update([0]);
    }
    let nanos = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    h.update(nanos.to_be_bytes());
    let mut bytes = h.finalize()[..16].to_vec();
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    SerialNumber::from(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RSA_CA: &[u8] = include_bytes!("../../../../tests/fixtures/kubeadm-pki/ca.crt");
    const RSA_CA_KEY: &[u8] = include_bytes!("../../../../tests/fixtures/kubeadm-pki/ca.key");
    const RSA_LEAF: &[u8] = include_bytes!("../../../../tests/fixtures/kubeadm-pki/apiserver.crt");
    const EC_CA: &[u8] = include_bytes!("../../../../tests/fixtures/kubeadm-pki/ecdsa/ca.crt");
    const EC_CA_KEY: &[u8] = include_bytes!("../../../../tests/fixtures/kubeadm-pki/ecdsa/ca.key");
    const EC_LEAF: &[u8] =
        include_bytes!("../../../../tests/fixtures/kubeadm-pki/ecdsa/apiserver.crt");

    fn sans(list: &[&str]) -> Vec<San> {
        list.iter().map(|s| San::parse(s).unwrap()).collect()
    }

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_900_000_000)
    }

    fn reissued(leaf: &[u8], ca: &[u8], key: &[u8], names: &[San]) -> Result<Vec<u8>, String> {
        let pem = reissue(Reissue {
            leaf: (leaf, "/etc/kubernetes/pki/apiserver.crt"),
            ca: (ca, "/etc/kubernetes/pki/ca.crt"),
            ca_key: (key, "/etc/kubernetes/pki/ca.key"),
            sans: names,
            now: now(),
        })?;
        certificate_der(pem.as_bytes(), "new")
    }

    /// The checks every reissue must pass against the old certificate and its CA.
    fn assert_reissued(old_pem: &[u8], ca_pem: &[u8], new_der: &[u8], names: &[San]) {
        let old_der = certificate_der(old_pem, "old").unwrap();
        let ca_der = certificate_der(ca_pem, "ca").unwrap();
        let (_, old) = X509Certificate::from_der(&old_der).unwrap();
        let (_, ca) = X509Certificate::from_der(&ca_der).unwrap();
        let (_, new) = X509Certificate::from_der(new_der).unwrap();
        new.verify_signature(Some(ca.public_key()))
            .expect("the new certificate verifies against the CA");
        assert_eq!(new.issuer().as_raw(), ca.subject().as_raw());
        assert_eq!(new.subject().as_raw(), old.subject().as_raw());
        assert_eq!(
            new.public_key().raw,
            old.public_key().raw,
            "same public key"
        );
        assert_eq!(new.validity().not_after, old.validity().not_after);
        assert_eq!(
            new.validity().not_before.timestamp(),
            1_900_000_000 - CLOCK_SKEW.as_secs() as i64
        );
        assert_ne!(new.raw_serial(), old.raw_serial());
        assert_eq!(sans_of(new_der, "new").unwrap(), names);
        let ku = |c: &X509Certificate<'_>| c.key_usage().unwrap().map(|k| k.value.flags);
        assert_eq!(ku(&new), ku(&old));
        let eku = new.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.server_auth && !eku.client_auth);
        assert!(!new.is_ca());
        let aki = new
            .extensions()
            .iter()
            .find_map(|e| match e.parsed_extension() {
                ParsedExtension::AuthorityKeyIdentifier(a) => a.key_identifier.clone(),
                _ => None,
            })
            .expect("an authority key identifier");
        assert_eq!(
            Some(aki.0.to_vec()),
            key_id(&Parsed {
                cert: ca,
                file: "ca"
            })
        );
    }

    #[test]
    fn desired_names_add_remove_and_keep_kubeadms_own() {
        let existing = sans(&[
            "cp-0",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
            "old.example.com",
            "10.96.0.1",
            "192.0.2.10",
        ]);
        let wanted = sans(&["api.example.com", "10.0.0.5", "old2.example.com"]);
        let previous = sans(&["old.example.com", "kubernetes", "192.0.2.99"]);
        assert_eq!(
            desired_sans(&existing, &wanted, &previous),
            sans(&[
                "cp-0",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
                "10.96.0.1",
                "192.0.2.10",
                "api.example.com",
                "10.0.0.5",
                "old2.example.com",
            ]),
            "old.example.com leaves; the Service's names stay though previous names one; the \
             new names come last"
        );
        // A name in both lists stays; names compare without case; nothing is doubled.
        let existing = vec![
            San::parse("cp-0").unwrap(),
            San::Dns("API.example.com".into()),
        ];
        assert_eq!(
            desired_sans(
                &existing,
                &sans(&["api.example.com", "api.example.com"]),
                &sans(&["api.example.com"])
            ),
            existing
        );
        // Already there: nothing changes.
        assert_eq!(desired_sans(&existing, &[], &[]), existing);
        assert_eq!(
            desired_sans(&existing, &[], &sans(&["api.example.com"])),
            sans(&["cp-0"])
        );
        // IPs compare by value.
        assert_eq!(
            desired_sans(&sans(&["::1"]), &sans(&["0:0::1"]), &[]),
            sans(&["::1"])
        );
    }

    #[test]
    fn names_are_dns_names_or_ips() {
        assert_eq!(
            San::parse("10.0.0.5").unwrap(),
            San::Ip([10, 0, 0, 5].into())
        );
        assert!(matches!(San::parse("*.example.com"), Ok(San::Dns(_))));
        for bad in ["", "API.example.com", "a b", "-x.com", "x..com", "http://x"] {
            assert!(San::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn an_rsa_pkcs1_ca_reissues_with_the_new_names() {
        let existing = sans_of(&certificate_der(RSA_LEAF, "leaf").unwrap(), "leaf").unwrap();
        let names = desired_sans(
            &existing,
            &sans(&["api.example.com", "10.0.0.5"]),
            &sans(&["old.example.com"]),
        );
        let new = reissued(RSA_LEAF, RSA_CA, RSA_CA_KEY, &names).unwrap();
        assert_reissued(RSA_LEAF, RSA_CA, &new, &names);
        assert!(names.contains(&San::parse("api.example.com").unwrap()));
        assert!(!names.contains(&San::parse("old.example.com").unwrap()));
    }

    #[test]
    fn an_ecdsa_sec1_ca_reissues_with_the_new_names() {
        let names = sans(&["cp-0", "kubernetes", "10.96.0.1", "api.example.com"]);
        let new = reissued(EC_LEAF, EC_CA, EC_CA_KEY, &names).unwrap();
        assert_reissued(EC_LEAF, EC_CA, &new, &names);
    }

    /// A CA and leaf as Go's crypto/x509 writes kubeadm's: PrintableString names, a PKCS#8
    /// key here (what rcgen writes).
    fn go_like_pki() -> (String, String, String) {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::default();
        ca.distinguished_name = DistinguishedName::new();
        ca.distinguished_name.push(
            DnType::CommonName,
            DnValue::PrintableString("kubernetes".try_into().unwrap()),
        );
        ca.is_ca = IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyCertSign,
        ];
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let leaf_key = KeyPair::generate().unwrap();
        let mut leaf = CertificateParams::new(vec!["cp-0".to_string()]).unwrap();
        leaf.distinguished_name = DistinguishedName::new();
        leaf.distinguished_name.push(
            DnType::CommonName,
            DnValue::PrintableString("kube-apiserver".try_into().unwrap()),
        );
        leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        leaf.use_authority_key_identifier_extension = true;
        leaf.not_after = time::OffsetDateTime::from(now() + Duration::from_secs(86_400 * 365));
        let issuer = Issuer::from_params(&ca, &ca_key);
        let leaf_cert = leaf.signed_by(&leaf_key, &issuer).unwrap();
        (ca_cert.pem(), ca_key.serialize_pem(), leaf_cert.pem())
    }

    #[test]
    fn a_pkcs8_ca_with_printable_names_reissues() {
        let (ca, key, leaf) = go_like_pki();
        let names = sans(&["cp-0", "api.example.com"]);
        let new = reissued(leaf.as_bytes(), ca.as_bytes(), key.as_bytes(), &names).unwrap();
        assert_reissued(leaf.as_bytes(), ca.as_bytes(), &new, &names);
    }

    #[test]
    fn refuses_another_cas_certificate_a_wrong_key_and_an_expired_one() {
        let names = sans(&["api.example.com"]);
        let err = reissued(RSA_LEAF, EC_CA, EC_CA_KEY, &names).unwrap_err();
        assert!(
            err.contains(
                "/etc/kubernetes/pki/apiserver.crt was not issued by /etc/kubernetes/pki/ca.crt"
            ),
            "{err}"
        );
        let err = reissued(RSA_LEAF, RSA_CA, EC_CA_KEY, &names).unwrap_err();
        assert!(err.contains("/etc/kubernetes/pki/ca.key"), "{err}");
        assert!(!err.contains("BEGIN"), "{err}");
        let (ca, key, leaf) = go_like_pki();
        let err = reissue(Reissue {
            leaf: (leaf.as_bytes(), "apiserver.crt"),
            ca: (ca.as_bytes(), "ca.crt"),
            ca_key: (key.as_bytes(), "ca.key"),
            sans: &names,
            now: now() + Duration::from_secs(86_400 * 366),
        })
        .unwrap_err();
        assert!(err.contains("apiserver.crt expired at"), "{err}");
        assert!(err.contains("kubeadm certs renew apiserver"), "{err}");
        let err = reissued(b"not pem", RSA_CA, RSA_CA_KEY, &names).unwrap_err();
        assert!(err.contains("apiserver.crt"), "{err}");
    }
}

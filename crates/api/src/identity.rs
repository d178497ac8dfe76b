//! Who a client is: the identity taken from its verified certificate — the first URI SAN,
//! else the first DNS SAN, else the subject common name. Nothing else in the certificate
//! (organisation, OU) confers anything. The TLS layer takes it at the handshake; `authz`
//! maps it to a role.

use std::fmt;

/// Which certificate field an identity was taken from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdentitySource {
    /// A URI subject alternative name (e.g. a SPIFFE id).
    UriSan,
    /// A DNS subject alternative name.
    DnsSan,
    /// The subject common name.
    CommonName,
}

/// A client identity taken from its certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    /// The field it came from.
    pub source: IdentitySource,
    /// The name itself, e.g. `spiffe://inplace-agent/updater`.
    pub value: String,
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.value)
    }
}

/// No identity could be taken from a certificate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// The certificate is not valid DER X.509.
    #[error("certificate cannot be parsed")]
    Unparsable,
    /// It has no URI SAN, DNS SAN or common name.
    #[error("certificate has no uri san, dns san or common name")]
    NoName,
}

/// Longest identity accepted; longer names are not identities anyone configures.
const MAX_IDENTITY_LEN: usize = 1024;

fn usable(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_IDENTITY_LEN && !name.chars().any(char::is_control)
}

/// The identity of a certificate: first URI SAN, else first DNS SAN, else subject CN.
/// Names that are empty, longer than 1024 bytes or contain control characters are skipped.
pub fn identity_from_certificate(der: &[u8]) -> Result<Identity, IdentityError> {
    let (_, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|_| IdentityError::Unparsable)?;
    let sans: Vec<&x509_parser::extensions::GeneralName<'_>> = match cert.subject_alternative_name()
    {
        Ok(Some(ext)) => ext.value.general_names.iter().collect(),
        Ok(None) => Vec::new(),
        Err(_) => return Err(IdentityError::Unparsable),
    };
    use x509_parser::extensions::GeneralName;
    let first = |want: IdentitySource| {
        sans.iter().find_map(|name| match (want, name) {
            (IdentitySource::UriSan, GeneralName::URI(v))
            | (IdentitySource::DnsSan, GeneralName::DNSName(v))
                if usable(v) =>
            {
                Some((*v).to_owned())
            }
            _ => None,
        })
    };
    if let Some(value) = first(IdentitySource::UriSan) {
        return Ok(Identity {
            source: IdentitySource::UriSan,
            value,
        });
    }
    if let Some(value) = first(IdentitySource::DnsSan) {
        return Ok(Identity {
            source: IdentitySource::DnsSan,
            value,
        });
    }
    cert.subject()
        .iter_common_name()
        .filter_map(|cn| cn.as_str().ok())
        .find(|cn| usable(cn))
        .map(|cn| Identity {
            source: IdentitySource::CommonName,
            value: cn.to_owned(),
        })
        .ok_or(IdentityError::NoName)
}

// === Roles and rules ===

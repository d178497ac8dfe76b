//! Package version ordering with each package manager's own rules.
//!
//! - Debian: `[epoch:]upstream[-revision]`, compared the way dpkg does (deb-version(7)):
//!   epoch numerically, then upstream and revision with dpkg's `verrevcmp`: alternating
//!   non-digit and digit runs; in non-digit runs `~` sorts before everything (even the end of
//!   the string), letters before non-letters; digit runs compare numerically.
//! - RPM: `[epoch:]version[-release]`, compared the way rpm 4.18 does (`rpmvercmp` on each
//!   part): separators are ignored, numeric segments beat alphabetic ones, `~` sorts before
//!   everything and `^` after the end of the string but before any further segment.
//!
//! Everything here is pure; the tests cross-check tables of cases against the real `dpkg` and
//! `rpm` binaries when they are installed.

use std::cmp::Ordering;
use std::fmt;

/// A version string that the package manager's own parser would reject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("version '{version}' has bad syntax: {reason}")]
pub struct VersionError {
    /// The offending version string.
    pub version: String,
    /// What is wrong with it, in dpkg's or rpm's words where they have some.
    pub reason: &'static str,
}

fn bad(version: &str, reason: &'static str) -> VersionError {
    VersionError {
        version: version.to_string(),
        reason,
    }
}

// === Debian ===

/// A parsed Debian package version.
///
/// Equality is dpkg's: `1.0`, `0:1.0` and `1.0-0` are the same version, so `PartialEq` is
/// derived from the ordering rather than from the text.
#[derive(Debug, Clone)]
pub struct DebVersion {
    /// The epoch; 0 when absent.
    pub epoch: u32,
    /// The upstream version.
    pub upstream: String,
    /// The Debian revision; empty when absent.
    pub revision: String,
}

impl DebVersion {
    /// Parses a version with dpkg's rules: leading and trailing blanks are ignored; an empty
    /// string, embedded blanks, a bad or too large epoch, an empty upstream part or an empty
    /// revision are errors. Characters dpkg only warns about are accepted, as dpkg does.
    pub fn parse(version: &str) -> Result<DebVersion, VersionError> {
        let s = version.trim_matches(|c: char| c.is_ascii_whitespace());
        if s.is_empty() {
            return Err(bad(version, "version string is empty"));
        }
        if s.bytes().any(|b| b.is_ascii_whitespace()) {
            return Err(bad(version, "version string has embedded spaces"));
        }
        let (epoch, rest) = match s.split_once(':') {
            Some((e, rest)) => {
                if e.is_empty() {
                    return Err(bad(version, "epoch in version is empty"));
                }
                if !e.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad(version, "epoch in version is not number"));
                }
                let epoch = e
                    .parse::<u32>()
                    .ok()
                    .filter(|e| i32::try_from(*e).is_ok())
                    .ok_or_else(|| bad(version, "epoch in version is too big"))?;
                if rest.is_empty() {
                    return Err(bad(version, "nothing after colon in version number"));
                }
                (epoch, rest)
            }
            None => (0, s),
        };
        let (upstream, revision) = match rest.rsplit_once('-') {
            Some((_, "")) => return Err(bad(version, "revision number is empty")),
            Some((u, r)) => (u, r),
            None => (rest, ""),
        };
        if upstream.is_empty() {
            return Err(bad(version, "version number is empty"));
        }
        Ok(DebVersion {
            epoch,
            upstream: upstream.to_string(),
            revision: revision.to_string(),
        })
    }
}

impl Ord for DebVersion {
    fn cmp(&self, other: &Self) -> Ordering {
        self.epoch
            .cmp(&other.epoch)
            .then_with(|| verrevcmp(self.upstream.as_bytes(), other.upstream.as_bytes()))
            .then_with(|| verrevcmp(self.revision.as_bytes(), other.revision.as_bytes()))
    }
}

impl PartialOrd for DebVersion {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for DebVersion {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for DebVersion {}

impl fmt::Display for DebVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.epoch != 0 {
            write!(f, "{}:", self.epoch)?;
        }
        f.write_str(&self.upstream)?;
        if !self.revision.is_empty() {
            write!(f, "-{}", self.revision)?;
        }
        Ok(())
    }
}

/// Compares two Debian versions as `dpkg --compare-versions` does.
pub fn compare_deb(a: &str, b: &str) -> Result<Ordering, VersionError> {
    Ok(DebVersion::parse(a)?.cmp(&DebVersion::parse(b)?))
}

/// The weight of one character in a non-digit run: `~` first, then the end of the string
/// (and digits, which end the run), then letters, then everything else. dpkg works on C
/// `char`, which is signed on the platforms we run on, so bytes above 0x7f weigh less than
/// ASCII punctuation; we keep that quirk so odd versions order exactly as dpkg orders them.
fn deb_order(c: Option<u8>) -> i32 {
    match c {
        None => 0,
        Some(c) if c.is_ascii_digit() => 0,
        Some(c) if c.is_ascii_alphabetic() => i32::from(c),
        Some(b'~') => -1,
        Some(c) => i32::from(c as i8) + 256,
    }
}

/// dpkg's comparison of an upstream version or a revision.
fn verrevcmp(a: &[u8], b: &[u8]) -> Ordering {
    let digit_at = |s: &[u8], i: usize| s.get(i).is_some_and(u8::is_ascii_digit);
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        // Non-digit run, character by character.
        while (i < a.len() && !digit_at(a, i)) || (j < b.len() && !digit_at(b, j)) {
            let (ac, bc) = (deb_order(a.get(i).copied()), deb_order(b.get(j).copied()));
            if ac != bc {
                return ac.cmp(&bc);
            }
            i += 1;
            j += 1;
        }
        // Digit run, numerically: skip leading zeros, then the longer run wins, then the
        // first differing digit.
        while a.get(i) == Some(&b'0') {
            i += 1;
        }
        while b.get(j) == Some(&b'0') {
            j += 1;
        }
        let mut first_diff = Ordering::Equal;
        while digit_at(a, i) && digit_at(b, j) {
            if first_diff == Ordering::Equal {
                first_diff = a[i].cmp(&b[j]);
            }
            i += 1;
            j += 1;
        }
        if digit_at(a, i) {
            return Ordering::Greater;
        }
        if digit_at(b, j) {
            return Ordering::Less;
        }
        if first_diff != Ordering::Equal {
            return first_diff;
        }
    }
    Ordering::Equal
}

// === RPM ===

/// A parsed RPM `[epoch:]version[-release]`.
///
/// Ordering and equality follow rpm 4.18's `rpm.vercmp`: a missing epoch is 0 and a missing
/// release sorts before any release (even `~`). Use [`RpmVersion::satisfies`] to ask
/// "is this what a request without a release meant?".
#[derive(Debug, Clone)]
pub struct RpmVersion {
    /// The epoch; 0 when absent.
    pub epoch: u32,
    /// The version.
    pub version: String,
    /// The release, when given.
    pub release: Option<String>,
}

impl RpmVersion {
    /// Parses `[epoch:]version[-release]` the way rpm splits an EVR: the epoch is the run of
    /// leading digits when a `:` follows it (an empty epoch is 0), the release is what follows
    /// the last `-`. Empty strings, blanks, an empty version or release are rejected.
    pub fn parse(evr: &str) -> Result<RpmVersion, VersionError> {
        if evr.is_empty() {
            return Err(bad(evr, "version string is empty"));
        }
        if evr
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
        {
            return Err(bad(evr, "version string has blanks or control characters"));
        }
        let digits = evr.bytes().take_while(u8::is_ascii_digit).count();
        let (epoch, rest) = if evr.as_bytes().get(digits) == Some(&b':') {
            let epoch = if digits == 0 {
                0
            } else {
                evr[..digits]
                    .parse::<u32>()
                    .map_err(|_| bad(evr, "epoch in version is too big"))?
            };
            (epoch, &evr[digits + 1..])
        } else {
            (0, evr)
        };
        let (version, release) = match rest.rsplit_once('-') {
            Some((_, "")) => return Err(bad(evr, "release is empty")),
            Some((v, r)) => (v, Some(r.to_string())),
            None => (rest, None),
        };
        if version.is_empty() {
            return Err(bad(evr, "version number is empty"));
        }
        if version.contains(':') {
            return Err(bad(evr, "epoch in version is not number"));
        }
        Ok(RpmVersion {
            epoch,
            version: version.to_string(),
            release,
        })
    }

    /// True when an installed `self` is what `wanted` asks for: equal epoch and version, and
    /// equal release unless `wanted` names none (as `dnf install name-1.2` accepts any release).
    pub fn satisfies(&self, wanted: &RpmVersion) -> bool {
        self.epoch == wanted.epoch
            && rpmvercmp(&self.version, &wanted.version) == Ordering::Equal
            && match (&wanted.release, &self.release) {
                (None, _) => true,
                (Some(w), Some(r)) => rpmvercmp(r, w) == Ordering::Equal,
                (Some(_), None) => false,
            }
    }
}

impl Ord for RpmVersion {
    fn cmp(&self, other: &Self) -> Ordering {
        self.epoch
            .cmp(&other.epoch)
            .then_with(|| rpmvercmp(&self.version, &other.version))
            .then_with(|| match (&self.release, &other.release) {
                (Some(a), Some(b)) => rpmvercmp(a, b),
                (a, b) => a.is_some().cmp(&b.is_some()),
            })
    }
}

impl PartialOrd for RpmVersion {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for RpmVersion {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for RpmVersion {}

impl fmt::Display for RpmVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.epoch != 0 {
            write!(f, "{}:", self.epoch)?;
        }
        f.write_str(&self.version)?;
        if let Some(r) = &self.release {
            write!(f, "-{r}")?;
        }
        Ok(())
    }
}

/// Compares two RPM `[epoch:]version[-release]` strings as `rpm.vercmp` does.
pub fn compare_rpm(a: &str, b: &str) -> Result<Ordering, VersionError> {
    Ok(RpmVersion::parse(a)?.cmp(&RpmVersion::parse(b)?))
}

/// rpm's `rpmvercmp`: compares one version or release string segment by segment.
pub fn rpmvercmp(a: &str, b: &str) -> Ordering {
    if a == b {
        return Ordering::Equal;
    }
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let is_sep = |c: &u8| !c.is_ascii_alphanumeric() && *c != b'~' && *c != b'^';
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        while a.get(i).is_some_and(is_sep) {
            i += 1;
        }
        while b.get(j).is_some_and(is_sep) {
            j += 1;
        }
        let (ca, cb) = (a.get(i).copied(), b.get(j).copied());

        // `~` sorts before everything, including the end of the string.
        if ca == Some(b'~') || cb == Some(b'~') {
            if ca != Some(b'~') {
                return Ordering::Greater;
            }
            if cb != Some(b'~') {
                return Ordering::Less;
            }
            i += 1;
            j += 1;
            continue;
        }
        // `^` sorts after the end of the string but before anything else.
        if ca == Some(b'^') || cb == Some(b'^') {
            if ca.is_none() {
                return Ordering::Less;
            }
            if cb.is_none() {
                return Ordering::Greater;
            }
            if ca != Some(b'^') {
                return Ordering::Greater;
            }
            if cb != Some(b'^') {
                return Ordering::Less;
            }
            i += 1;
            j += 1;
            continue;
        }
        let (Some(ca), Some(_)) = (ca, cb) else {
            break;
        };

        // One all-digit or all-letter segment from each side, of the kind `a` starts with.
        let numeric = ca.is_ascii_digit();
        let in_segment = |c: &u8| {
            if numeric {
                c.is_ascii_digit()
            } else {
                c.is_ascii_alphabetic()
            }
        };
        let end_a = i + a[i..].iter().take_while(|c| in_segment(c)).count();
        let end_b = j + b[j..].iter().take_while(|c| in_segment(c)).count();
        if end_b == j {
            // Different kinds: a numeric segment is newer than an alphabetic one.
            return if numeric {
                Ordering::Greater
            } else {
                Ordering::Less
            };
        }
        let (mut sa, mut sb) = (&a[i..end_a], &b[j..end_b]);
        if numeric {
            while let [b'0', rest @ ..] = sa {
                sa = rest;
            }
            while let [b'0', rest @ ..] = sb {
                sb = rest;
            }
            match sa.len().cmp(&sb.len()) {
                Ordering::Equal => {}
                longer_wins => return longer_wins,
            }
        }
        match sa.cmp(sb) {
            Ordering::Equal => {}
            decided => return decided,
        }
        i = end_a;
        j = end_b;
    }
    // All segments equal: whichever still has characters left is newer.
    match (i < a.len(), j < b.len()) {
        (false, false) => Ordering::Equal,
        (true, _) => Ordering::Greater,
        (false, true) => Ordering::Less,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Ordering::{Equal as E, Greater as G, Less as L};

    /// (a, b, a compared to b) under dpkg's rules; cross-checked against `dpkg` below.
    pub(crate) const DEB_CASES: &[(&str, &str, Ordering)] = &[
        ("1.0", "1.0", E),
        ("1.0", "1.00", E),
        ("1.0", "0:1.0", E),
        ("1.0", "1.0-0", E),
        ("1.0-1", "1.0-1", E),
        ("1.0", "1.1", L),
        ("1.2", "1.10", L),
        ("1.31.2-1.1", "1.30.4-1.1", G),
        ("1.31.2-1.1", "1.31.2-1.2", L),
        ("1.31.2-1.1", "1.31.10-1.1", L),
        ("1:1.0", "2.0", G),
        ("0:2.0", "1:1.0", L),
        ("1.0~rc1", "1.0", L),
        ("1.0~rc1", "1.0~rc2", L),
        ("1.0~~", "1.0~", L),
        ("1.0~", "1.0", L),
        ("1.0~rc1-1", "1.0-1", L),
        ("1.0", "1.0a", L),
        ("1.0a", "1.0+", L),
        ("1.0+", "1.0.", L),
        ("1.0-1", "1.0.1", L),
        ("1.0+dfsg", "1.0", G),
        ("1.0-1", "1.0-1+b1", L),
        ("1.0-1ubuntu1", "1.0-1", G),
        ("2.30-6", "2.30-10", L),
        ("1.18.4", "1.18.4+deb9u1", L),
        ("7.4.052-1", "7.4.052~rc1-1", G),
        ("1.0-0.1", "1.0-1", L),
        ("10", "9", G),
        ("000123", "123", E),
        ("1.2.3", "1.2.3.0", L),
        ("a", "b", L),
        ("1:1.2-3", "1:1.2-3", E),
        ("2:1.0", "1:9.9", G),
        ("1.0-1-1", "1.0-1-2", L),
        ("1.0-a", "1.0-A", G),
        ("1.0Z", "1.0a", L),
        ("1.0~a", "1.0~b", L),
        ("1.0~A", "1.0~a", L),
        ("1.99999999999999999999", "1.99999999999999999998", G),
        ("1.0.0-1.1", "1.0-1.1", G),
        ("4.18.0+dfsg-1+deb12u1", "4.18.0+dfsg-1", G),
        ("1.0é", "1.0+", L),
    ];

    /// (a, b, a compared to b) under rpm's rules; cross-checked against `rpm` below.
    /// Many come from rpm's own test suite (tests/rpmvercmp.at).
    pub(crate) const RPM_CASES: &[(&str, &str, Ordering)] = &[
        ("1.0", "1.0", E),
        ("1.0", "2.0", L),
        ("2.0", "1.0", G),
        ("2.0.1", "2.0.1", E),
        ("2.0", "2.0.1", L),
        ("2.0.1a", "2.0.1a", E),
        ("2.0.1a", "2.0.1", G),
        ("5.5p1", "5.5p1", E),
        ("5.5p1", "5.5p2", L),
        ("5.5p10", "5.5p1", G),
        ("10xyz", "10.1xyz", L),
        ("xyz10", "xyz10", E),
        ("xyz10", "xyz10.1", L),
        ("xyz.4", "xyz.4", E),
        ("xyz.4", "8", L),
        ("8", "xyz.4", G),
        ("xyz.4", "2", L),
        ("5.5p2", "5.6p1", L),
        ("5.6p1", "6.5p1", L),
        ("6.0.rc1", "6.0", G),
        ("10b2", "10a1", G),
        ("1.0aa", "1.0a", G),
        ("10.0001", "10.1", E),
        ("10.0001", "10.0039", L),
        ("4.999.9", "5.0", L),
        ("20101121", "20101122", L),
        ("2_0", "2_0", E),
        ("2.0", "2_0", E),
        ("a", "a", E),
        ("a+", "a_", E),
        ("+", "_", E),
        ("1.0~rc1", "1.0~rc1", E),
        ("1.0~rc1", "1.0", L),
        ("1.0~rc1", "1.0~rc2", L),
        ("1.0~rc1~git123", "1.0~rc1", L),
        ("1.0^", "1.0^", E),
        ("1.0^", "1.0", G),
        ("1.0^git1", "1.0", G),
        ("1.0^git1", "1.0^git2", L),
        ("1.0^git1", "1.01", L),
        ("1.0^20160101", "1.0.1", L),
        ("1.0^20160101^git1", "1.0^20160101", G),
        ("1.0~rc1^git1", "1.0~rc1", G),
        ("1.0^git1~pre", "1.0^git1", L),
        ("1.0-1", "1.0-1", E),
        ("1.0-1", "1.0-2", L),
        ("1.0", "1.0-1", L),
        ("0:1.0", "1.0", E),
        (":1.0", "1.0", E),
        ("1:1.0", "1.0", G),
        ("2", "1:1", L),
        ("1.31.2-150500.1.1", "1.30.4-150500.1.1", G),
        ("1.31.2-150500.1.1", "1.31.2-150500.1.10", L),
        ("1.0-1.el8", "1.0-1.el9", L),
        ("1.0-1.fc38", "1.0-1.el9", G),
        ("1.0", "1.0-~", L),
        ("+", "+-_", L),
        ("1.0-1", "1.0-1~", G),
    ];

    #[test]
    fn deb_table() {
        for &(a, b, want) in DEB_CASES {
            assert_eq!(compare_deb(a, b), Ok(want), "{a} vs {b}");
            assert_eq!(compare_deb(b, a), Ok(want.reverse()), "{b} vs {a}");
        }
    }

    #[test]
    fn rpm_table() {
        for &(a, b, want) in RPM_CASES {
            assert_eq!(compare_rpm(a, b), Ok(want), "{a} vs {b}");
            assert_eq!(compare_rpm(b, a), Ok(want.reverse()), "{b} vs {a}");
        }
    }

    #[test]
    fn deb_parse_splits_and_rejects_like_dpkg() {
        let v = DebVersion::parse(" 2:1.31.2-1-1.1 ").unwrap();
        assert_eq!(
            (v.epoch, v.upstream.as_str(), v.revision.as_str()),
            (2, "1.31.2-1", "1.1")
        );
        assert_eq!(v.to_string(), "2:1.31.2-1-1.1");
        let v = DebVersion::parse("1:2:3").unwrap();
        assert_eq!((v.epoch, v.upstream.as_str()), (1, "2:3"));
        for (input, reason) in [
            ("", "version string is empty"),
            ("  ", "version string is empty"),
            ("1 2", "version string has embedded spaces"),
            (":1", "epoch in version is empty"),
            ("x:1", "epoch in version is not number"),
            ("1.0-a:b", "epoch in version is not number"),
            ("1.2:3", "epoch in version is not number"),
            ("99999999999:1", "epoch in version is too big"),
            ("2147483648:1", "epoch in version is too big"),
            ("1:", "nothing after colon in version number"),
            ("1-", "revision number is empty"),
            ("1.0--", "revision number is empty"),
            ("-1", "version number is empty"),
        ] {
            let err = DebVersion::parse(input).unwrap_err();
            assert_eq!(err.reason, reason, "{input:?}");
        }
        assert!(DebVersion::parse("2147483647:1").is_ok());
        // dpkg only warns about these, and so do we (by accepting them).
        assert!(DebVersion::parse("a1").is_ok());
        assert!(DebVersion::parse("1.0_x").is_ok());
    }

    #[test]
    fn rpm_parse_splits_and_rejects() {
        let v = RpmVersion::parse("3:1.31.2-150500.1.1").unwrap();
        assert_eq!(
            (v.epoch, v.version.as_str(), v.release.as_deref()),
            (3, "1.31.2", Some("150500.1.1"))
        );
        assert_eq!(v.to_string(), "3:1.31.2-150500.1.1");
        assert_eq!(RpmVersion::parse("1.0").unwrap().release, None);
        assert_eq!(RpmVersion::parse("0:1.0").unwrap().to_string(), "1.0");
        for input in ["", "1.0-", "-1", "1 0", "a:1.0", "99999999999:1"] {
            assert!(RpmVersion::parse(input).is_err(), "{input:?}");
        }
    }

    #[test]
    fn rpm_satisfies_ignores_a_missing_release() {
        let installed = RpmVersion::parse("1.31.2-150500.1.1").unwrap();
        let any_release = RpmVersion::parse("1.31.2").unwrap();
        assert!(installed.satisfies(&any_release));
        assert!(installed.satisfies(&RpmVersion::parse("0:1.31.2-150500.1.1").unwrap()));
        assert!(!installed.satisfies(&RpmVersion::parse("1.31.2-150500.1.2").unwrap()));
        assert!(!installed.satisfies(&RpmVersion::parse("1:1.31.2").unwrap()));
        assert!(!installed.satisfies(&RpmVersion::parse("1.31.3").unwrap()));
    }

    /// A small deterministic generator of well-formed versions over the characters that
    /// matter to the comparison rules.
    struct Gen(u64);

    impl Gen {
        fn next(&mut self) -> u64 {
            // xorshift64*
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn pick(&mut self, chars: &[u8]) -> char {
            chars[(self.next() % chars.len() as u64) as usize] as char
        }
        fn part(&mut self, first_digit: bool, chars: &[u8]) -> String {
            let len = 1 + (self.next() % 6) as usize;
            let mut s = String::new();
            for k in 0..len {
                s.push(if k == 0 && first_digit {
                    self.pick(b"0123456789")
                } else {
                    self.pick(chars)
                });
            }
            s
        }
        fn deb(&mut self) -> String {
            let mut v = String::new();
            if self.next() % 4 == 0 {
                v.push_str(&format!("{}:", self.next() % 3));
            }
            v.push_str(&self.part(true, b"0123456789.+~aZz"));
            if self.next() % 2 == 0 {
                v.push('-');
                v.push_str(&self.part(false, b"0123456789.+~bY"));
            }
            v
        }
        fn rpm(&mut self) -> String {
            let mut v = String::new();
            if self.next() % 4 == 0 {
                v.push_str(&format!("{}:", self.next() % 3));
            }
            v.push_str(&self.part(false, b"0123456789._+~^aZz"));
            if self.next() % 2 == 0 {
                v.push('-');
                v.push_str(&self.part(false, b"0123456789._~^bY"));
            }
            v
        }
    }

    #[test]
    fn orderings_are_total_orders_on_generated_versions() {
        let mut g = Gen(0x9e37_79b9_7f4a_7c15);
        let debs: Vec<DebVersion> = (0..120)
            .map(|_| DebVersion::parse(&g.deb()).unwrap())
            .collect();
        let rpms: Vec<RpmVersion> = (0..120)
            .map(|_| RpmVersion::parse(&g.rpm()).unwrap())
            .collect();
        fn check<T: Ord + fmt::Debug>(xs: &[T]) {
            for a in xs {
                for b in xs {
                    assert_eq!(a.cmp(b), b.cmp(a).reverse(), "{a:?} {b:?}");
                    for c in xs.iter().step_by(7) {
                        if a <= b && b <= c {
                            assert!(a <= c, "{a:?} <= {b:?} <= {c:?}");
                        }
                    }
                }
            }
        }
        check(&debs);
        check(&rpms);
    }

    fn ci() -> bool {
        std::env::var("CI").is_ok_and(|v| v == "true")
    }

    /// Straight to the stderr handle: libtest captures eprintln! of passing tests.
    fn skip_loudly(what: &str) {
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            format!("\n*** SKIPPED {what} ***\n").as_bytes(),
        );
    }

    fn have(program: &str) -> bool {
        std::process::Command::new(program)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }

    /// Asks the real dpkg about every pair with one `sh` process (dpkg exits 0 when the
    /// relation holds, 1 when it does not, 2 on bad syntax); `None` is a syntax error.
    fn dpkg_orders(pairs: &[(String, String)]) -> Vec<Option<Ordering>> {
        let mut script = String::new();
        for (a, b) in pairs {
            script.push_str(&format!(
                "dpkg --compare-versions '{a}' lt '{b}' 2>/dev/null; r=$?; \
                 if [ $r = 0 ]; then echo L; elif [ $r = 2 ]; then echo X; \
                 elif dpkg --compare-versions '{a}' eq '{b}'; then echo E; else echo G; fi\n"
            ));
        }
        let out = std::process::Command::new("sh")
            .args(["-c", &script])
            .env("LC_ALL", "C")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| match l {
                "L" => Some(L),
                "E" => Some(E),
                "G" => Some(G),
                _ => None,
            })
            .collect()
    }

    /// Asks the real rpm (its Lua `rpm.vercmp`, the same EVR comparison rpm uses) about every
    /// pair in one process.
    fn rpm_orders(pairs: &[(String, String)]) -> Vec<Ordering> {
        let mut lua = String::from("%{lua: ");
        for (a, b) in pairs {
            lua.push_str(&format!("print(rpm.vercmp('{a}', '{b}') .. '\\n') "));
        }
        lua.push('}');
        let out = std::process::Command::new("rpm")
            .args(["--eval", &lua])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| l.trim().parse::<i32>().unwrap().cmp(&0))
            .collect()
    }

    #[test]
    fn deb_matches_real_dpkg() {
        if !have("dpkg") {
            assert!(!ci(), "dpkg is required when CI=true");
            skip_loudly("deb_matches_real_dpkg: dpkg is not installed");
            return;
        }
        let mut pairs: Vec<(String, String)> = DEB_CASES
            .iter()
            .map(|(a, b, _)| (a.to_string(), b.to_string()))
            .collect();
        let mut g = Gen(42);
        pairs.extend((0..300).map(|_| (g.deb(), g.deb())));
        pairs.push(("1.2:3".into(), "1".into()));
        pairs.push(("1.0-".into(), "1".into()));
        let real = dpkg_orders(&pairs);
        assert_eq!(real.len(), pairs.len());
        for ((a, b), want) in pairs.iter().zip(real) {
            let ours = compare_deb(a, b).ok();
            assert_eq!(
                ours, want,
                "{a} vs {b} (dpkg says {want:?}; None is bad syntax)"
            );
        }
    }

    #[test]
    fn rpm_matches_real_rpm() {
        if !have("rpm") {
            assert!(!ci(), "rpm is required when CI=true (Debian package rpm)");
            skip_loudly("rpm_matches_real_rpm: rpm is not installed");
            return;
        }
        let mut pairs: Vec<(String, String)> = RPM_CASES
            .iter()
            .map(|(a, b, _)| (a.to_string(), b.to_string()))
            .collect();
        let mut g = Gen(7);
        pairs.extend((0..2000).map(|_| (g.rpm(), g.rpm())));
        let real = rpm_orders(&pairs);
        assert_eq!(real.len(), pairs.len());
        for ((a, b), want) in pairs.iter().zip(real) {
            assert_eq!(
                compare_rpm(a, b),
                Ok(want),
                "{a} vs {b} (rpm says {want:?})"
            );
        }
    }
}

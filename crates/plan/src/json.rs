//! Reading a JSON plan without holding its text.
//!
//! A plan of 50 MiB of file content used to be read whole, then parsed into a document
//! that copies every string: the text and the strings were both in memory (twice the plan)
//! and each byte was touched by the read, the UTF-8 check, the parse and the copy. Here the
//! plan is read in chunks. Every string of at least [`LONG`] bytes is decoded as it is read,
//! straight into the string it becomes, and leaves a short placeholder behind; what is left
//! (the skeleton: keys, small values, structure) is parsed by serde_json, and the
//! placeholders are then swapped for their strings. The text is never held whole, and a
//! long string is copied once, from the read buffer into its own allocation.
//!
//! The skeleton keeps every byte outside the long strings, so serde_json sees the same
//! structure and reports the same syntax errors; a long string cannot contain a raw
//! newline (JSON forbids control characters in strings), so its line numbers are the
//! text's, and columns are translated back ([`Split::position`]). Long strings are decoded
//! here with JSON's rules (escapes, surrogate pairs, no control characters, UTF-8); the
//! tests compare the decoder with serde_json on every kind of string.
//!
//! A placeholder is `"\u0000\u0000iplong:<n>"`. A string of the plan that decodes to
//! something starting like one is taken out like a long one, so every placeholder in the
//! skeleton is ours.

use std::collections::HashMap;
use std::io::Read;

use bytes::Bytes;
use serde_json::{Map, Value};

use super::hasher::{Hasher, KnownSums};

/// Strings of at least this many bytes (as written) are decoded while reading.
pub(super) const LONG: usize = 4096;

/// `content` strings of at least this many bytes are hashed while the plan is read; the
/// sums of smaller ones cost less than handing them over (a plan of 500 files of 4 KiB
/// hashes its contents in about a millisecond once read).
const HASH_AHEAD: usize = 64 << 10;

/// How much of the plan is read at once.
const CHUNK: usize = 1 << 20;

/// The placeholder's decoded prefix and the way it is written.
const MARK: &str = "\u{0}\u{0}iplong:";
const MARK_WRITTEN: &str = r"\u0000\u0000iplong:";

/// A plan read into its skeleton and its long strings.
pub(super) struct Split {
    skeleton: Vec<u8>,
    long: Vec<Option<Long>>,
    /// Hashing the long `content` strings, by number, when asked to.
    hasher: Option<Hasher>,
    /// For each placeholder, in order: its end in the skeleton and how many bytes of the
    /// text it stands for beyond its own length.
    removed: Vec<(usize, isize)>,
}

/// Why a JSON plan could not be read: the text to show after "malformed JSON: ", or a
/// read error.
#[derive(Debug)]
pub(super) enum SplitError {
    Syntax(String),
    Read(std::io::Error),
    TooLarge(usize),
}

/// A long string as decoded.
enum Long {
    Text(String),
    /// The value of a `content` key, shared with the hasher (valid UTF-8).
    Content(Bytes),
}

impl Long {
    fn into_string(self) -> String {
        match self {
            Long::Text(s) => s,
            // Copied only while the hasher still holds it.
            Long::Content(b) => String::from_utf8(Vec::from(b)).expect("decoded as UTF-8"),
        }
    }
}

/// Reads the JSON plan whose first `head` bytes were already read from `input`; at most
/// `max` bytes in all. With `hash`, each long `content` string is hashed on another thread
/// while the rest is read ([`Split::into_document`] gives the sums).
pub(super) fn split(
    head: Vec<u8>,
    input: &mut dyn Read,
    max: usize,
    hash: bool,
) -> Result<Split, SplitError> {
    let mut s = Scanner::new(head, input, max);
    s.out.hasher = hash.then(Hasher::default);
    s.run()?;
    Ok(s.out)
}

/// A plan document with the plain contents of its `file` changes taken out, by change
/// index, and the sums of those that were hashed while it was read.
pub(super) struct Document {
    pub(super) value: Value,
    pub(super) bodies: HashMap<usize, Bytes>,
    pub(super) sums: KnownSums,
}

impl Split {
    /// Parses the skeleton and puts the long strings back in place.
    #[cfg(test)]
    fn into_value(mut self) -> Result<Value, String> {
        let mut value = self.skeleton_value()?;
        restore(&mut value, &mut self.long)?;
        Ok(value)
    }

    /// [`Split::into_value`] with the content of each `file` change whose encoding is
    /// plain taken out where it was a long string (an empty string left in its place, as
    /// `parse::validate_document_with_bodies` expects), with its sum when it was hashed.
    pub(super) fn into_document(mut self) -> Result<Document, String> {
        let mut value = self.skeleton_value()?;
        let mut bodies = HashMap::new();
        let mut hashed = Vec::new();
        let changes = value.get_mut("changes").and_then(Value::as_array_mut);
        for (i, change) in changes.into_iter().flatten().enumerate() {
            let Some(file) = change.get_mut("file").and_then(Value::as_object_mut) else {
                continue;
            };
            let plain = plain_encoding(file);
            let Some(Value::String(content)) = file.get_mut("content") else {
                continue;
            };
            let Some(n) = number(content) else {
                continue;
            };
            if !plain {
                continue;
            }
            let body = match self.long.get_mut(n).and_then(Option::take) {
                Some(Long::Content(b)) => {
                    hashed.push((n, b.clone()));
                    b
                }
                Some(Long::Text(s)) => Bytes::from(s.into_bytes()),
                None => continue,
            };
            content.clear();
            bodies.insert(i, body);
        }
        if let Some(hasher) = &self.hasher {
            let wanted: std::collections::HashSet<usize> = hashed.iter().map(|(n, _)| *n).collect();
            hasher.retain(|n| wanted.contains(&n));
        }
        restore(&mut value, &mut self.long)?;
        Ok(Document {
            value,
            bodies,
            sums: KnownSums::new(self.hasher.take(), hashed),
        })
    }

    /// The skeleton parsed, with its placeholders (errors as serde_json words them, at
    /// their place in the text).
    fn skeleton_value(&mut self) -> Result<Value, String> {
        let value: Value = serde_json::from_slice(&self.skeleton).map_err(|e| {
            let column = self.position(e.line(), e.column());
            let message = e.to_string();
            match message.rfind(" at line ") {
                Some(at) => format!("{} at line {} column {column}", &message[..at], e.line()),
                None => message,
            }
        })?;
        self.skeleton = Vec::new();
        Ok(value)
    }

    /// The column in the text of `column` on `line` of the skeleton.
    fn position(&self, line: usize, column: usize) -> usize {
        if line == 0 {
            return column;
        }
        // The skeleton offset of the line's start.
        let mut start = 0;
        let mut current = 1;
        while current < line {
            match memchr::memchr(b'\n', &self.skeleton[start..]) {
                Some(i) => start += i + 1,
                None => break,
            }
            current += 1;
        }
        let at = start + column;
        let moved: isize = self
            .removed
            .iter()
            .filter(|(end, _)| *end > start && *end <= at)
            .map(|(_, extra)| extra)
            .sum();
        column.saturating_add_signed(moved)
    }
}

/// Replaces every placeholder in `v` (values and keys) by its long string.
fn restore(v: &mut Value, long: &mut [Option<Long>]) -> Result<(), String> {
    match v {
        Value::String(s) => {
            if let Some(full) = take(s, long) {
                *s = full;
            }
        }
        Value::Array(items) => {
            for item in items {
                restore(item, long)?;
            }
        }
        Value::Object(map) => {
            if map.keys().any(|k| k.starts_with(MARK)) {
                let old = std::mem::take(map);
                let mut rebuilt = Map::new();
                for (k, mut item) in old {
                    restore(&mut item, long)?;
                    let key = take(&k, long).unwrap_or(k);
                    if rebuilt.contains_key(&key) {
                        return Err(format!(
                            "an object has the key of {} bytes twice",
                            key.len()
                        ));
                    }
                    rebuilt.insert(key, item);
                }
                *map = rebuilt;
            } else {
                for item in map.values_mut() {
                    restore(item, long)?;
                }
            }
        }
        _ => {}
    }
    Ok(())
}

fn take(s: &str, long: &mut [Option<Long>]) -> Option<String> {
    long.get_mut(number(s)?)?.take().map(Long::into_string)
}

/// Whether a `file` change's object says its content is plain (no `encoding`, or `plain`):
/// such a content is taken out of the document as bytes (here and in `parse`).
pub(super) fn plain_encoding(file: &Map<String, Value>) -> bool {
    match file.get("encoding") {
        None => true,
        Some(Value::String(e)) => e == "plain",
        Some(_) => false,
    }
}

/// The number of the long string `s` stands for, when it is a placeholder.
fn number(s: &str) -> Option<usize> {
    s.strip_prefix(MARK)?.parse().ok()
}

struct Scanner<'a> {
    /// The read buffer: `buf[pos..end]` is read and not consumed yet.
    buf: Vec<u8>,
    pos: usize,
    end: usize,
    input: &'a mut dyn Read,
    eof: bool,
    /// Bytes of the text before `buf[0]`.
    consumed: usize,
    max: usize,
    /// The line `pos` is on and the text offset where it starts (for errors).
    line: usize,
    line_start: usize,
    out: Split,
}

/// One string being read.
struct Str {
    /// The string as written, while it is shorter than [`LONG`].
    raw: Option<Vec<u8>>,
    decoded: Vec<u8>,
    written: usize,
}

impl<'a> Scanner<'a> {
    /// A scanner of `input` whose first `head` bytes were already read.
    fn new(head: Vec<u8>, input: &'a mut dyn Read, max: usize) -> Scanner<'a> {
        let end = head.len();
        let mut buf = head;
        buf.resize(end.max(CHUNK), 0);
        Scanner {
            buf,
            pos: 0,
            end,
            input,
            eof: false,
            consumed: 0,
            max,
            line: 1,
            line_start: 0,
            out: Split {
                skeleton: Vec::new(),
                long: Vec::new(),
                hasher: None,
                removed: Vec::new(),
            },
        }
    }
}

impl Scanner<'_> {
    fn run(&mut self) -> Result<(), SplitError> {
        loop {
            if self.pos == self.end && !self.refill(0)? {
                return Ok(());
            }
            let rest = &self.buf[self.pos..self.end];
            match memchr::memchr(b'"', rest) {
                Some(i) => {
                    self.outside(i);
                    self.pos += 1;
                    self.string()?;
                }
                None => {
                    let n = rest.len();
                    self.outside(n);
                }
            }
        }
    }

    /// Copies `n` bytes outside strings to the skeleton.
    fn outside(&mut self, n: usize) {
        let seg = &self.buf[self.pos..self.pos + n];
        for i in memchr::memchr_iter(b'\n', seg) {
            self.line += 1;
            self.line_start = self.consumed + self.pos + i + 1;
        }
        self.out.skeleton.extend_from_slice(seg);
        self.pos += n;
    }

    /// Makes more than `need` bytes available after `pos` when the input has them; false
    /// when it does not.
    fn refill(&mut self, need: usize) -> Result<bool, SplitError> {
        if self.end - self.pos > need {
            return Ok(true);
        }
        if self.eof {
            return Ok(false);
        }
        // Keep what is not consumed yet, then read after it.
        self.buf.copy_within(self.pos..self.end, 0);
        self.consumed += self.pos;
        self.end -= self.pos;
        self.pos = 0;
        while self.end <= need && !self.eof {
            let n = loop {
                match self.input.read(&mut self.buf[self.end..]) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(SplitError::Read(e)),
                }
            };
            self.end += n;
            if n == 0 {
                self.eof = true;
            }
            if self.consumed + self.end > self.max {
                return Err(SplitError::TooLarge(self.max));
            }
        }
        Ok(self.end - self.pos > need)
    }

    /// A syntax error at the byte `ahead` bytes after `pos` (serde_json's convention: the
    /// byte that showed the error).
    fn error_at(&self, what: &str, ahead: usize) -> SplitError {
        let at = self.consumed + self.pos + ahead;
        SplitError::Syntax(format!(
            "{what} at line {} column {}",
            self.line,
            (at + 1).saturating_sub(self.line_start).max(1)
        ))
    }

    /// A string that ends with the input: the error is at its last byte.
    fn eof_in_string(&self) -> SplitError {
        let last = self.consumed + self.end;
        SplitError::Syntax(format!(
            "EOF while parsing a string at line {} column {}",
            self.line,
            last.saturating_sub(self.line_start).max(1)
        ))
    }

    /// Reads a string whose opening quote was just consumed.
    fn string(&mut self) -> Result<(), SplitError> {
        let mut s = Str {
            raw: Some(Vec::new()),
            decoded: Vec::new(),
            written: 0,
        };
        loop {
            if self.pos == self.end && !self.refill(0)? {
                return Err(self.eof_in_string());
            }
            let rest = &self.buf[self.pos..self.end];
            let special = special_at(rest);
            let seg = &rest[..special];
            s.decoded.extend_from_slice(seg);
            s.written += seg.len();
            if let Some(raw) = &mut s.raw {
                raw.extend_from_slice(seg);
            }
            // At every growth, not only at a read boundary: a long string read whole
            // inside one read must leave the skeleton too.
            s.shorten_if_long();
            self.pos += special;
            if self.pos == self.end {
                continue;
            }
            match self.buf[self.pos] {
                b'"' => {
                    self.pos += 1;
                    return self.finish(s);
                }
                b'\\' => self.escape(&mut s)?,
                _ => {
                    return Err(self.error_at(
                        "control character (\\u0000-\\u001F) found while parsing a string",
                        0,
                    ));
                }
            }
            s.shorten_if_long();
        }
    }

    /// Decodes the escape at `pos` (a backslash).
    fn escape(&mut self, s: &mut Str) -> Result<(), SplitError> {
        // The longest escape is a surrogate pair, 12 bytes.
        self.refill(12)?;
        let rest = &self.buf[self.pos..self.end];
        if rest.len() < 2 {
            self.pos = self.end;
            return Err(self.eof_in_string());
        }
        let (len, ch) = match rest[1] {
            b'"' => (2, '"'),
            b'\\' => (2, '\\'),
            b'/' => (2, '/'),
            b'b' => (2, '\u{8}'),
            b'f' => (2, '\u{c}'),
            b'n' => (2, '\n'),
            b'r' => (2, '\r'),
            b't' => (2, '\t'),
            b'u' if rest.len() < 6 && self.eof => return Err(self.eof_in_string()),
            b'u' => {
                let first = hex4(&rest[2..]).ok_or_else(|| self.error_at("invalid escape", 5))?;
                match first {
                    0xD800..=0xDBFF => {
                        if rest.len() < 8 || rest[6] != b'\\' || rest[7] != b'u' {
                            return Err(self.error_at("lone leading surrogate in hex escape", 1));
                        }
                        let second =
                            hex4(&rest[8..]).ok_or_else(|| self.error_at("invalid escape", 11))?;
                        if !(0xDC00..=0xDFFF).contains(&second) {
                            return Err(self.error_at("lone leading surrogate in hex escape", 1));
                        }
                        let c = 0x10000 + ((first - 0xD800) << 10) + (second - 0xDC00);
                        (12, char::from_u32(c).expect("a surrogate pair is a char"))
                    }
                    0xDC00..=0xDFFF => {
                        return Err(self.error_at("lone trailing surrogate in hex escape", 1));
                    }
                    c => (6, char::from_u32(c).expect("not a surrogate")),
                }
            }
            _ => return Err(self.error_at("invalid escape", 1)),
        };
        let mut utf8 = [0u8; 4];
        s.decoded
            .extend_from_slice(ch.encode_utf8(&mut utf8).as_bytes());
        if let Some(raw) = &mut s.raw {
            raw.extend_from_slice(&rest[..len]);
        }
        s.written += len;
        self.pos += len;
        Ok(())
    }

    /// Ends a string: a short one goes into the skeleton as written, a long one (or one that
    /// looks like a placeholder) is kept and replaced by a placeholder.
    fn finish(&mut self, s: Str) -> Result<(), SplitError> {
        match s.raw {
            Some(raw) if !s.decoded.starts_with(MARK.as_bytes()) => {
                self.out.skeleton.push(b'"');
                self.out.skeleton.extend_from_slice(&raw);
                self.out.skeleton.push(b'"');
            }
            _ => {
                let decoded = String::from_utf8(s.decoded).map_err(|e| {
                    self.error_at(
                        &format!(
                            "invalid unicode code point in the string of {} bytes ending here ({e})",
                            s.written
                        ),
                        0,
                    )
                })?;
                let n = self.out.long.len();
                let start = self.out.skeleton.len();
                let placeholder = format!("\"{MARK_WRITTEN}{n}\"");
                self.out.skeleton.extend_from_slice(placeholder.as_bytes());
                let text_len = s.written + 2;
                self.out.removed.push((
                    self.out.skeleton.len(),
                    text_len as isize - placeholder.len() as isize,
                ));
                let mut decoded = decoded;
                decoded.shrink_to_fit();
                let long = match &mut self.out.hasher {
                    Some(hasher)
                        if decoded.len() >= HASH_AHEAD
                            && is_content_value(&self.out.skeleton[..start]) =>
                    {
                        let bytes = Bytes::from(decoded.into_bytes());
                        hasher.push(n, bytes.clone());
                        Long::Content(bytes)
                    }
                    _ => Long::Text(decoded),
                };
                self.out.long.push(Some(long));
            }
        }
        Ok(())
    }
}

impl Str {
    /// Stops keeping the string as written once it is long.
    fn shorten_if_long(&mut self) {
        if self.raw.as_ref().is_some_and(|r| r.len() >= LONG) {
            self.raw = None;
        }
    }
}

/// Whether the skeleton `before` a string ends with the key `"content"` and its colon: the
/// string is the value of a `content` key (a key written with escapes is not seen as one;
/// its content is then hashed after the plan is read).
fn is_content_value(before: &[u8]) -> bool {
    fn trim(b: &[u8]) -> &[u8] {
        let end = b
            .iter()
            .rposition(|c| !matches!(c, b' ' | b'\t' | b'\n' | b'\r'))
            .map_or(0, |p| p + 1);
        &b[..end]
    }
    match trim(before).strip_suffix(b":") {
        Some(key) => trim(key).ends_with(b"\"content\""),
        None => false,
    }
}

/// The offset of the first byte of `b` that ends a run of plain string bytes: a quote, a
/// backslash or a control character; `b.len()` when there is none. Eight bytes at a time.
fn special_at(b: &[u8]) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero_byte = |x: u64| x.wrapping_sub(ONES) & !x & HIGH;
    let mut i = 0;
    while let Some(word) = b.get(i..i + 8) {
        let w = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        // The lowest flagged byte is exact for each test (borrows only run upwards).
        let hits = zero_byte(w ^ (ONES * u64::from(b'"')))
            | zero_byte(w ^ (ONES * u64::from(b'\\')))
            | (w.wrapping_sub(ONES * 0x20) & !w & HIGH);
        if hits != 0 {
            return i + (hits.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    b[i..]
        .iter()
        .position(|c| matches!(c, b'"' | b'\\' | 0..=0x1f))
        .map_or(b.len(), |p| i + p)
}

fn hex4(b: &[u8]) -> Option<u32> {
    let digits = b.get(..4)?;
    let mut n = 0;
    for d in digits {
        n = n * 16 + (*d as char).to_digit(16)?;
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A reader that hands out at most `step` bytes per call, so every escape and string
    /// end also falls across the boundary of a read.
    struct Trickle<'a> {
        data: &'a [u8],
        step: usize,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
            let n = self.step.min(out.len()).min(self.data.len());
            out[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    fn read(text: &[u8], step: usize) -> Result<Value, String> {
        let mut input = Trickle { data: text, step };
        match split(Vec::new(), &mut input, usize::MAX, false) {
            Ok(s) => s.into_value(),
            Err(SplitError::Syntax(e)) => Err(e),
            Err(e) => Err(format!("{e:?}")),
        }
    }

    /// What serde_json makes of `text`, with the position words of its error.
    fn serde(text: &[u8]) -> Result<Value, String> {
        serde_json::from_slice(text).map_err(|e| e.to_string())
    }

    /// One string as JSON text: plain runs, every escape, surrogate pairs, non-ASCII.
    fn pieces() -> impl Strategy<Value = Vec<String>> {
        prop::collection::vec(
            prop_oneof![
                "[a-z0-9 ]{1,40}".prop_map(String::from),
                Just(r"\n".to_string()),
                Just(r#"\""#.to_string()),
                Just(r"\\".to_string()),
                Just(r"\/".to_string()),
                Just(r"\b\f\r\t".to_string()),
                Just(r"\u00e9\u0000".to_string()),
                Just(r"\ud83d\ude00".to_string()),
                Just("é€😀".to_string()),
            ],
            0..400,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Valid documents read the same as serde_json reads them, short and long strings,
        /// whatever the read boundaries.
        #[test]
        fn reads_what_serde_json_reads(parts in pieces(), repeat in 1usize..40, step in 1usize..9) {
            let s: String = parts.concat().repeat(repeat);
            let text = format!(
                r#"{{"apiVersion": "v", "changes": [{{"file": {{"content": "{s}", "path": "/x"}}}}, "{s}", ["{s}"]], "k": "short"}}"#
            );
            prop_assert_eq!(read(text.as_bytes(), step), serde(text.as_bytes()));
            prop_assert_eq!(read(text.as_bytes(), 1 << 20), serde(text.as_bytes()));
        }

        /// Whatever bytes a long string holds, it is accepted exactly when serde_json accepts
        /// it, with the same value.
        #[test]
        fn accepts_and_refuses_what_serde_json_does(
            body in prop::collection::vec(any::<u8>(), 0..64),
            at in 0usize..5000,
        ) {
            let mut s = vec![b'a'; 5000];
            let at = at.min(s.len());
            s.splice(at..at, body.iter().copied());
            let mut text = b"{\"a\": \"".to_vec();
            text.extend_from_slice(&s);
            text.extend_from_slice(b"\"}");
            let ours = read(&text, 7);
            let theirs = serde(&text);
            prop_assert_eq!(ours.is_ok(), theirs.is_ok(), "{:?} / {:?}", ours, theirs);
            if let (Ok(a), Ok(b)) = (ours, theirs) {
                prop_assert_eq!(a, b);
            }
        }

        #[test]
        fn special_at_finds_the_first_quote_backslash_or_control(b in prop::collection::vec(any::<u8>(), 0..80)) {
            let naive = b.iter().position(|c| matches!(c, b'"' | b'\\' | 0..=0x1f)).unwrap_or(b.len());
            prop_assert_eq!(special_at(&b), naive);
        }
    }

    #[test]
    fn a_string_that_looks_like_a_placeholder_stays_itself() {
        let long = "y".repeat(LONG * 2);
        for fake in [r"\u0000\u0000iplong:0", r"\u0000\u0000\u0069plong:1"] {
            let text = format!(r#"{{"a": "{fake}", "b": "{long}", "c": "{long}x"}}"#);
            assert_eq!(read(text.as_bytes(), 3), serde(text.as_bytes()), "{fake}");
        }
    }

    #[test]
    fn long_keys_are_put_back() {
        let key = "k".repeat(LONG + 1);
        let text = format!(r#"{{"{key}": {{"{key}x": 1}}, "a": "{key}"}}"#);
        assert_eq!(read(text.as_bytes(), 5), serde(text.as_bytes()));
    }

    /// Each text fails with serde_json's message, line and column.
    fn assert_errors_as_serde_json(texts: &[String]) {
        for text in texts {
            assert_eq!(
                read(text.as_bytes(), 1 << 20).unwrap_err(),
                serde(text.as_bytes()).unwrap_err(),
                "{}",
                &text[text.len() - 8..]
            );
        }
    }

    #[test]
    fn syntax_errors_after_a_long_string_point_where_serde_json_points() {
        let long = "z".repeat(LONG * 3);
        assert_errors_as_serde_json(&[
            format!(r#"{{"a": "{long}", "b": }}"#),
            format!("{{\"a\": \"{long}\",\n \"b\": \"{long}\" \"c\": 1}}"),
            format!(r#"{{"a": "{long}""#),
            format!(r#"{{"a": "{long}"}} x"#),
        ]);
    }

    #[test]
    fn errors_inside_a_long_string_point_where_serde_json_points() {
        let long = "z".repeat(LONG * 3);
        assert_errors_as_serde_json(&[
            format!("{{\n\"a\": \"{long}\\q\"}}"),
            format!("{{\"a\": \"{long}"),
            format!("{{\"a\": \"{long}\\"),
            format!("{{\"a\": \"{long}\\u12"),
            format!("{{\"a\": 1,\n \"b\": \"{long}\tz\"}}"),
            format!("{{\"a\": \"{long}\\u12g4\"}}"),
        ]);
    }

    #[test]
    fn every_long_string_leaves_the_skeleton_wherever_the_reads_end() {
        // Strings that fit inside one read as well as strings that cross reads, at every
        // phase against the read boundaries (a plan of 1 MiB files read 1 MiB at a time
        // once kept every string in the skeleton).
        for len in [LONG, LONG + 1, 3 * LONG, CHUNK - 100, CHUNK + 100] {
            for step in [4096, 5000, 1 << 20] {
                let strings = 12;
                let items: Vec<String> = (0..strings)
                    .map(|i| format!(r#"{{"i": {i}, "s": "{}"}}"#, "q".repeat(len)))
                    .collect();
                let text = format!(r#"{{"changes": [{}]}}"#, items.join(", "));
                let mut input = Trickle {
                    data: text.as_bytes(),
                    step,
                };
                let mut s = Scanner::new(Vec::new(), &mut input, usize::MAX);
                s.run().unwrap();
                assert_eq!(s.out.long.len(), strings, "{len} bytes, reads of {step}");
                assert!(
                    s.out.skeleton.len() < 64 * strings,
                    "{len} bytes, reads of {step}: skeleton of {} bytes",
                    s.out.skeleton.len()
                );
            }
        }
    }

    #[test]
    fn the_text_is_never_held_whole() {
        // 8 MiB of content read through 1 MiB chunks: the read buffer stays one chunk.
        let long = "w".repeat(8 << 20);
        let text = format!(r#"{{"a": "{long}"}}"#);
        let mut input = Trickle {
            data: text.as_bytes(),
            step: 1 << 20,
        };
        let mut s = Scanner::new(Vec::new(), &mut input, usize::MAX);
        s.run().unwrap();
        assert_eq!(s.buf.capacity(), CHUNK);
        assert!(s.out.skeleton.len() < 64, "{}", s.out.skeleton.len());
        assert!(matches!(&s.out.long[0], Some(Long::Text(t)) if *t == long));
    }

    #[test]
    fn a_plan_larger_than_the_limit_is_refused_while_reading() {
        let text = format!(r#"{{"a": "{}"}}"#, "v".repeat(3 << 20));
        let mut input = Trickle {
            data: text.as_bytes(),
            step: 1 << 20,
        };
        assert!(matches!(
            split(Vec::new(), &mut input, 2 << 20, false),
            Err(SplitError::TooLarge(_))
        ));
    }
}

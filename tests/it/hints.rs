//! Every hint names a real key or flag (issue 15): the messages in `src/` (string literals
//! outside test modules) and the docs may only name configuration keys the configuration
//! file has (`plans.allow_paths`, `[authorization]`) and flags the command line has
//! (`--allow-path`). A hint that names `paths.allow` sends a person at 3 a.m. to a key that
//! makes `config check` fail.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// The tables of the configuration file.
fn tables() -> BTreeSet<String> {
    keys()
        .iter()
        .map(|k| k.split('.').next().unwrap().to_string())
        .collect()
}

/// `table.key` of every key of the configuration file, from the printed default (which a
/// unit test keeps complete and equal to the defaults).
fn keys() -> BTreeSet<String> {
    let mut table = String::new();
    let mut keys = BTreeSet::new();
    for line in inplace_agent::config::DEFAULT_CONFIG.lines() {
        let line = line.trim().trim_start_matches("# ");
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            table = name.to_string();
        } else if let Some((key, _)) = line.split_once(" = ")
            && !table.is_empty()
            && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        {
            keys.insert(format!("{table}.{key}"));
        }
    }
    assert!(
        keys.contains("plans.allow_paths") && keys.len() > 25,
        "{keys:?}"
    );
    keys
}

/// Every long flag of every subcommand of a command line.
fn long_flags(command: &clap::Command) -> BTreeSet<String> {
    fn walk(cmd: &clap::Command, out: &mut BTreeSet<String>) {
        for arg in cmd.get_arguments() {
            if let Some(long) = arg.get_long() {
                out.insert(format!("--{long}"));
            }
        }
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    let mut out = BTreeSet::from(["--help".to_string(), "--version".to_string()]);
    walk(command, &mut out);
    out
}

/// The flags of `inplace-updater`, which has no configuration file: its messages and
/// docs name its own flags and the fields of Kubernetes objects (`status.nodeRef.name`).
fn updater_flags() -> BTreeSet<String> {
    let out = long_flags(&inplace_updater::cli::command());
    assert!(out.contains("--agent-port"), "{out:?}");
    out
}

/// Every long flag of every subcommand of `inplace-agent`.
fn flags() -> BTreeSet<String> {
    let out = long_flags(&inplace_agent::cli::command());
    assert!(
        out.contains("--allow-path") && out.contains("--server-name"),
        "{out:?}"
    );
    out
}

/// Flags of other programs that messages of the agent name (kubelet and kubeadm flags a
/// plan manages, the package managers' options it reports). Each is not ours by design.
const FOREIGN_FLAGS: &[&str] = &[
    // kubelet flags in KUBELET_KUBEADM_ARGS (steps/kubelet.rs, the demo's node)
    "--container-runtime-endpoint",
    "--pod-infra-container-image",
    "--node-ip",
    "--node-labels",
    "--bootstrap-kubeconfig",
    "--kubeconfig",
    // kubeadm upgrade node's flags (steps/kubeadm.rs, rpc/convert.rs)
    "--patches",
    "--config",
    // cargo test, in a doc comment's command
    "--lib",
    // dpkg, in what a failed package step reports
    "--remove",
    // kubectl, in what the updater says to do about an agent that does not answer
    "--field-selector",
];

/// The string literals of Rust source, outside `#[cfg(test)]` modules and comments.
fn string_literals(source: &str) -> Vec<String> {
    let code = match source.find("#[cfg(test)]") {
        Some(at) => &source[..at],
        None => source,
    };
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            b'r' if matches!(b.get(i + 1), Some(b'"' | b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                let mut hashes = 0;
                let mut j = i + 1;
                while b.get(j) == Some(&b'#') {
                    hashes += 1;
                    j += 1;
                }
                if b.get(j) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                let start = j + 1;
                let end = b[start..]
                    .windows(close.len())
                    .position(|w| w == close.as_slice())
                    .map_or(b.len(), |p| start + p);
                out.push(code[start..end].to_string());
                i = end + close.len();
            }
            b'"' => {
                let mut j = i + 1;
                let mut text = String::new();
                while j < b.len() && b[j] != b'"' {
                    if b[j] == b'\\' && j + 1 < b.len() {
                        // A line continuation joins the next line's text; other escapes
                        // stand for one character.
                        if b[j + 1] == b'\n' {
                            j += 2;
                            while j < b.len() && b[j].is_ascii_whitespace() {
                                j += 1;
                            }
                            continue;
                        }
                        text.push(' ');
                        j += 2;
                        continue;
                    }
                    let c = code[j..].chars().next().unwrap();
                    text.push(c);
                    j += c.len_utf8();
                }
                out.push(text);
                i = j + 1;
            }
            b'\'' => {
                // A char literal ('"', '\'') or a lifetime.
                if b.get(i + 1) == Some(&b'\\') {
                    i = code[i + 2..].find('\'').map_or(b.len(), |p| i + 3 + p);
                } else if b.get(i + 2) == Some(&b'\'') {
                    i += 3;
                } else {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// File name endings that make `x.y` a file, not a key.
const FILE_ENDINGS: &[&str] = &[
    "toml", "yaml", "yml", "json", "conf", "service", "md", "sock", "crt", "key", "env", "log",
    "rs", "d", "target", "socket", "timer", "slice",
];

/// Dotted words of `text` that stand alone (not part of a longer dotted name, a path or a
/// URL): candidates for `table.key`.
fn dotted_words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let chars: Vec<char> = text.chars().collect();
    let word = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_ascii_lowercase()
            || (i > 0 && (word(chars[i - 1]) || "./-:@$".contains(chars[i - 1])))
        {
            i += 1;
            continue;
        }
        let start = i;
        while i < chars.len() && (word(chars[i]) || chars[i] == '.') {
            i += 1;
        }
        let token: String = chars[start..i].iter().collect();
        let token = token.trim_end_matches('.');
        let next = chars.get(start + token.len()).copied();
        let parts: Vec<&str> = token.split('.').collect();
        if parts.len() == 2
            && !parts[1].is_empty()
            && !matches!(next, Some('/' | '(' | '-' | '@' | ':'))
            && !FILE_ENDINGS.contains(&parts[1])
        {
            out.push(token.to_string());
        }
    }
    out
}

/// `[table]` headers named in `text` (not indexes like `changes[0]`).
fn table_headers(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find('[') {
        let before = rest[..open].chars().next_back();
        let after = &rest[open + 1..];
        if let Some(close) = after.find(']') {
            let name = &after[..close];
            if !before.is_some_and(|c| c.is_alphanumeric() || c == ']' || c == '_')
                && !name.is_empty()
                && name.chars().all(|c| c.is_ascii_lowercase() || c == '_')
            {
                out.push(name.to_string());
            }
        }
        rest = after;
    }
    out
}

fn flag_tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in text.match_indices("--") {
        let before = text[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '-') {
            continue;
        }
        let name: String = text[at + 2..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
            .collect();
        if name.starts_with(|c: char| c.is_ascii_lowercase()) {
            out.push(format!("--{}", name.trim_end_matches('-')));
        }
    }
    out
}

#[test]
fn messages_in_the_source_name_real_keys_and_flags() {
    let (keys, tables, flags) = (keys(), tables(), flags());
    let mut files = Vec::new();
    for krate in std::fs::read_dir(Path::new(REPO).join("crates")).unwrap() {
        rust_files(&krate.unwrap().path().join("src"), &mut files);
    }
    files.sort();
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(REPO).unwrap().display().to_string();
        // The sandbox (tests and `demo --systemd`) builds nodes with other programs' argv.
        if rel.starts_with("crates/agent/src/sandbox/") {
            continue;
        }
        let source = std::fs::read_to_string(file).unwrap();
        if rel.starts_with("crates/updater/src/") {
            let ours = updater_flags();
            for lit in string_literals(&source).iter().filter(|l| l.contains(' ')) {
                for f in flag_tokens(lit) {
                    if !ours.contains(&f)
                        && !flags.contains(&f)
                        && !FOREIGN_FLAGS.contains(&f.as_str())
                    {
                        wrong.push(format!(
                            "{rel}: {f} is not a flag of inplace-updater: {lit:?}"
                        ));
                    }
                }
            }
            continue;
        }
        for lit in string_literals(&source) {
            let about_config = lit.contains("config");
            for token in dotted_words(&lit) {
                let table = token.split('.').next().unwrap();
                if (tables.contains(table) || about_config) && !keys.contains(&token) {
                    // `grpc.listen_adress` and friends are what a person typed, quoted back.
                    if tables.contains(table) || lit.contains(" key ") || lit.contains(" to ") {
                        wrong.push(format!(
                            "{rel}: {token:?} is not a configuration key: {lit:?}"
                        ));
                    }
                }
            }
            if about_config || lit.contains("under [") {
                for t in table_headers(&lit) {
                    if !tables.contains(&t) {
                        wrong.push(format!(
                            "{rel}: [{t}] is not a configuration table: {lit:?}"
                        ));
                    }
                }
            }
            // Flags in messages (argv elements of other programs have no spaces).
            if lit.contains(' ') {
                for f in flag_tokens(&lit) {
                    if !flags.contains(&f) && !FOREIGN_FLAGS.contains(&f.as_str()) {
                        wrong.push(format!(
                            "{rel}: {f} is not a flag of inplace-agent: {lit:?}"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "hints that name what does not exist:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_docs_name_real_keys_and_flags() {
    let (keys, tables, flags) = (keys(), tables(), flags());
    let mut docs: Vec<PathBuf> = std::fs::read_dir(Path::new(REPO).join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.push(Path::new(REPO).join("README.md"));
    docs.sort();
    let mut wrong = Vec::new();
    for doc in &docs {
        let rel = doc.strip_prefix(REPO).unwrap().display().to_string();
        let text = std::fs::read_to_string(doc).unwrap();
        // The updater's page names Kubernetes object fields (`status.addresses`), not keys of
        // the agent's configuration; its command lines are checked below.
        let updater_page = rel == "docs/updater.md";
        // Keys in backticks: `plans.allow_paths`, `[authorization] admin`.
        for quoted in text.split('`').skip(1).step_by(2).filter(|_| !updater_page) {
            for token in dotted_words(quoted) {
                let table = token.split('.').next().unwrap();
                if tables.contains(table) && !keys.contains(&token) && quoted == token {
                    wrong.push(format!("{rel}: `{token}` is not a configuration key"));
                }
            }
            if let Some((table, key)) = quoted.strip_prefix('[').and_then(|q| q.split_once("] "))
                && tables.contains(table)
                && !keys.contains(&format!("{table}.{key}"))
            {
                wrong.push(format!("{rel}: `{quoted}` is not a configuration key"));
            }
        }
        // Flags on command lines of the agent (and their continuation lines).
        let mut continued = false;
        let mut updater_continued = false;
        let ours_updater = updater_flags();
        for line in text.lines() {
            let updater_line =
                updater_continued || line.trim_start().starts_with("inplace-updater ");
            if updater_line {
                for f in flag_tokens(line) {
                    if !ours_updater.contains(&f) && !FOREIGN_FLAGS.contains(&f.as_str()) {
                        wrong.push(format!(
                            "{rel}: {f} is not a flag of inplace-updater: {line}"
                        ));
                    }
                }
            }
            updater_continued = updater_line && line.trim_end().ends_with('\\');
            let ours = continued
                || line.trim_start().starts_with("inplace-agent ")
                || line.contains(" inplace-agent ") && line.contains("--");
            if ours {
                // What precedes the agent on the line is another program's (nsenter --net=).
                let line = match line.find("inplace-agent ") {
                    Some(at) if !continued => &line[at..],
                    _ => line,
                };
                for f in flag_tokens(line) {
                    if !flags.contains(&f) && !FOREIGN_FLAGS.contains(&f.as_str()) {
                        wrong.push(format!("{rel}: {f} is not a flag of inplace-agent: {line}"));
                    }
                }
            }
            continued = ours && line.trim_end().ends_with('\\');
        }
    }
    assert!(
        wrong.is_empty(),
        "the docs name what does not exist:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_extraction_finds_what_it_must() {
    // The bug of issue 15, as the checks see it.
    let lit = "/etc/x is outside the allow-list; add its directory to paths.allow in the agent configuration";
    assert_eq!(dotted_words(lit), ["paths.allow"]);
    assert_eq!(
        dotted_words("set grpc.listen; see grpc.health.v1.Health and /run/x/status.sock"),
        ["grpc.listen"]
    );
    assert_eq!(
        table_headers("under [authorization] in changes[0]"),
        ["authorization"]
    );
    assert_eq!(
        flag_tokens("pass --server-name NAME (or --ca=F), not a--b"),
        ["--server-name", "--ca"]
    );
    let lits = string_literals(
        "fn f() { let c = '\"'; g(\"one {x}\", r#\"two \"q\"\"#); // \"no\"\n h(\"a \\\n   b\") }\n#[cfg(test)]\nmod t { \"test\" }",
    );
    assert_eq!(lits, ["one {x}", "two \"q\"", "a b"]);
}

//! The module graph of each crate is a test: it reads every source file of the workspace's
//! crates (outside `#[cfg(test)]` items), finds the modules each one names (`crate::…`,
//! `super::…`, `use crate::{…}`), and fails on
//!
//! - a room of the agent crate (a top-level module of `crates/agent`) that uses a room it may
//!   not (the table below: inside the agent the data flows engine → steps → host, the journal
//!   beside the engine and depending on neither engine nor host, rpc and status reading the
//!   engine, the CLI on top);
//! - a cycle between files of one crate, inside a room or across rooms.
//!
//! Between crates the compiler holds the flow (a crate names only the crates below it in
//! `Cargo.toml`); what is left to check is inside a crate. A new room of the agent must be
//! added to the table: the test fails on one it does not know.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// What each room of the agent crate may use of the others. `lib` (the crate root) declares
/// them all.
const ALLOWED: &[(&str, &[&str])] = &[
    ("failpoint", &[]),
    ("notify", &[]),
    ("host", &["failpoint"]),
    ("journal", &["failpoint"]),
    ("steps", &["failpoint", "host", "journal"]),
    ("engine", &["failpoint", "host", "journal", "steps"]),
    ("rpc", &["engine", "host", "steps"]),
    ("status", &["engine", "host", "journal", "rpc"]),
    ("config", &["engine", "host", "rpc", "status", "steps"]),
    ("sandbox", &["host"]),
    (
        "cli",
        &[
            "config", "engine", "host", "journal", "notify", "rpc", "sandbox", "status", "steps",
        ],
    ),
];

/// The crates of the workspace, each `crates/<name>/src`.
fn crate_sources() -> Vec<PathBuf> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates");
    let mut out: Vec<PathBuf> = std::fs::read_dir(&crates)
        .unwrap()
        .flatten()
        .map(|e| e.path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    assert!(
        out.len() >= 6,
        "the crates of {}: {out:?}",
        crates.display()
    );
    out
}

type ModPath = Vec<String>;

/// The module a file is, relative to the crate root; `None` for binary roots.
fn module_of(src: &Path, file: &Path) -> Option<ModPath> {
    let rel = file.strip_prefix(src).ok()?.with_extension("");
    let mut parts: ModPath = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    match parts.last().map(String::as_str) {
        Some("main") => return None,
        Some("lib") if parts.len() == 1 => return Some(Vec::new()),
        Some("mod") => {
            parts.pop();
        }
        _ => {}
    }
    Some(parts)
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

/// The code of a file without comments, with string and char literals emptied, so braces
/// and paths in them count for nothing.
fn code_only(text: &str) -> String {
    let b: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == '*' && b[i + 1] == '/') {
                i += 1;
            }
            i += 2;
        } else if c == 'r'
            && matches!(next, Some('"' | '#'))
            && (i == 0 || !(b[i - 1].is_alphanumeric() || b[i - 1] == '_'))
        {
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' {
            // A char literal ('{', '\n', '\u{7f}'), or a lifetime ('a).
            let close = (i + 2..(i + 12).min(b.len())).find(|&j| b[j] == '\'');
            match close {
                Some(j) if b[i + 1] == '\\' || j == i + 2 => {
                    out.push_str("' '");
                    i = j + 1;
                }
                _ => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// The code without `#[cfg(test)]` items (a test module, a test helper).
fn without_tests(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at + "#[cfg(test)]".len()..];
        // The item ends at its `;` or at the brace that closes its first `{`.
        let mut depth = 0usize;
        let mut end = item.len();
        for (k, ch) in item.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// Paths a file names: after `crate::`, after each `super::` run, and inside `use crate::{…}`
/// groups, as module paths (not yet resolved to known modules).
fn named_paths(module: &[String], code: &str) -> Vec<ModPath> {
    let mut out = Vec::new();
    let ident = |s: &str| -> Vec<String> {
        let mut parts = Vec::new();
        let mut rest = s;
        loop {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() {
                break;
            }
            rest = &rest[name.len()..];
            parts.push(name);
            match rest.strip_prefix("::") {
                Some(r) if r.starts_with(|c: char| c.is_ascii_lowercase()) => rest = r,
                _ => break,
            }
        }
        parts
    };
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a::b, c::{d, e}}`: every path of the use tree.
            let end = matching_brace(group);
            for path in use_tree(&group[..end]) {
                out.push(ident(&path));
            }
        } else {
            out.push(ident(rest));
        }
    }
    let mut at = 0;
    while let Some(found) = code[at..].find("super::") {
        let start = at + found;
        let before = code[..start].chars().next_back();
        let mut end = start;
        let mut ups = 0;
        while code[end..].starts_with("super::") {
            ups += 1;
            end += "super::".len();
        }
        at = end;
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        if ups > module.len() {
            continue;
        }
        let mut path: ModPath = module[..module.len() - ups].to_vec();
        path.extend(ident(&code[end..]));
        out.push(path);
    }
    out
}

/// The index of the `}` closing a group whose `{` came just before `s`.
fn matching_brace(s: &str) -> usize {
    let mut depth = 0usize;
    for (k, ch) in s.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' if depth == 0 => return k,
            '}' => depth -= 1,
            _ => {}
        }
    }
    s.len()
}

/// The paths of a use tree's group body (`a::b, c::{d, e}` → `a::b`, `c::d`, `c::e`).
fn use_tree(group: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    let mut items = Vec::new();
    for (k, ch) in group.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&group[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    items.push(&group[start..]);
    for item in items {
        let item = item.trim();
        match item.find("::{") {
            Some(at) => {
                let prefix = &item[..at];
                let inner = &item[at + 3..];
                let inner = &inner[..matching_brace(inner)];
                for sub in use_tree(inner) {
                    out.push(format!("{prefix}::{sub}"));
                }
            }
            None if !item.is_empty() => out.push(item.to_string()),
            None => {}
        }
    }
    out
}

/// The module graph of the crate whose sources are `src`: module → the modules it names
/// (ancestors left out).
fn graph(src: &Path) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let sources: BTreeMap<ModPath, String> = files
        .iter()
        .filter_map(|f| {
            let module = module_of(src, f)?;
            let text = std::fs::read_to_string(f).unwrap();
            Some((module, without_tests(&code_only(&text))))
        })
        .collect();
    let known: BTreeSet<&ModPath> = sources.keys().collect();
    let mut edges: BTreeMap<ModPath, BTreeSet<ModPath>> = BTreeMap::new();
    for (module, code) in &sources {
        let entry = edges.entry(module.clone()).or_default();
        for path in named_paths(module, code) {
            let Some(target) = (1..=path.len())
                .rev()
                .map(|n| path[..n].to_vec())
                .find(|p| known.contains(p))
            else {
                continue;
            };
            if target != *module && !module.starts_with(&target) {
                entry.insert(target);
            }
        }
    }
    edges
}

fn room(m: &ModPath) -> &str {
    m.first().map_or("lib", String::as_str)
}

#[test]
fn rooms_use_only_the_rooms_below_them() {
    let agent = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/agent/src");
    let edges = graph(&agent);
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut wrong = Vec::new();
    for (from, targets) in &edges {
        let r = room(from);
        if r == "lib" {
            continue;
        }
        let Some(may) = allowed.get(r) else {
            wrong.push(format!(
                "room {r} is not in the table of tests/it/architecture.rs"
            ));
            continue;
        };
        for to in targets {
            let t = room(to);
            if t != r && t != "lib" && !may.contains(&t) {
                wrong.push(format!(
                    "{} uses {} ({r} may use {:?})",
                    from.join("::"),
                    to.join("::"),
                    may
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "back-edges:\n{}", wrong.join("\n"));
}

#[test]
fn no_file_is_part_of_a_cycle() {
    for src in crate_sources() {
        let edges = graph(&src);
        let cycles = cycles(&edges);
        assert!(cycles.is_empty(), "cycles in {}: {cycles:?}", src.display());
    }
}

/// The strongly connected components of more than one module.
fn cycles(edges: &BTreeMap<ModPath, BTreeSet<ModPath>>) -> Vec<Vec<String>> {
    // Tarjan's strongly connected components.
    struct Walk<'a> {
        edges: &'a BTreeMap<ModPath, BTreeSet<ModPath>>,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on: BTreeSet<&'a ModPath>,
        cycles: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a ModPath) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on.insert(v);
            for w in self.edges.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    component.push(w.join("::"));
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.cycles.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        cycles: Vec::new(),
    };
    for v in edges.keys() {
        if !walk.index.contains_key(v) {
            walk.visit(v);
        }
    }
    walk.cycles
}

#[test]
fn the_reader_sees_what_it_must() {
    let code = code_only(
        "use crate::{plan::Plan, host::{fs, Host}};\n// crate::journal\nlet s = \"crate::engine\";\n\
         fn f() { super::super::steps::diff(); let c = '{'; }\n#[cfg(test)]\nmod tests { use crate::cli; }\n",
    );
    let code = without_tests(&code);
    let module: ModPath = vec!["engine".into(), "run".into(), "services".into()];
    let mut named: Vec<String> = named_paths(&module, &code)
        .iter()
        .map(|p| p.join("::"))
        .collect();
    named.sort();
    assert_eq!(named, ["engine::steps::diff", "host", "host::fs", "plan"]);
}

/// The packages `cargo metadata` resolves for `package` on this platform, with normal and
/// build dependencies (what building its binary compiles), dev-dependencies left out.
fn build_closure(package: &str) -> BTreeSet<String> {
    let out = std::process::Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--filter-platform",
        ])
        .arg(env!("TARGET_TRIPLE"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata: {out:?}");
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let nodes = meta["resolve"]["nodes"].as_array().unwrap();
    let name_of = |id: &str| -> String {
        meta["packages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["id"] == id)
            .map(|p| p["name"].as_str().unwrap().to_string())
            .unwrap()
    };
    let start = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == package)
        .map(|p| p["id"].as_str().unwrap().to_string())
        .unwrap_or_else(|| panic!("no package {package}"));
    let mut seen = BTreeSet::new();
    let mut todo = vec![start];
    while let Some(id) = todo.pop() {
        if !seen.insert(id.clone()) {
            continue;
        }
        let node = nodes.iter().find(|n| n["id"] == id.as_str()).unwrap();
        for dep in node["deps"].as_array().unwrap() {
            let kinds = dep["dep_kinds"].as_array().unwrap();
            if kinds.iter().any(|k| k["kind"] != "dev") {
                todo.push(dep["pkg"].as_str().unwrap().to_string());
            }
        }
    }
    seen.iter().map(|id| name_of(id)).collect()
}

/// The agent's build compiles nothing only the updater needs: no Kubernetes client, no
/// Kubernetes types, no JSON Patch, and no crate of the updater or of the tests.
#[test]
fn the_agent_builds_without_the_updaters_dependencies() {
    let agent = build_closure("inplace-agent");
    let updater = build_closure("inplace-updater");
    for name in [
        "kube",
        "kube-client",
        "kube-core",
        "k8s-openapi",
        "json-patch",
        "inplace-updater",
        "inplace-system-tests",
    ] {
        assert!(
            !agent.contains(name),
            "inplace-agent's build compiles {name}"
        );
    }
    assert!(updater.contains("kube") && updater.contains("k8s-openapi"));
    for name in ["zbus", "inplace-agent", "indicatif", "toml"] {
        assert!(
            !updater.contains(name),
            "inplace-updater's build compiles {name}"
        );
    }
}

/// ARCHITECTURE.md stays a map a newcomer reads in one sitting (at most 2,500 words), and
/// every repository path it names in backquotes or links exists (and a test it names as
/// `file.rs::name` is in that file).
#[test]
fn the_map_is_short_and_names_only_files_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let words = text.split_whitespace().count();
    assert!(words <= 2500, "ARCHITECTURE.md has {words} words");
    let mut missing = Vec::new();
    let mut named = 0;
    for piece in text.split(['`', '(', ')', ' ', '\n']) {
        let path = piece.trim_end_matches(['/', ',', '.', ':']);
        let top = [
            "crates/",
            "tests/",
            "docs/",
            "packaging/",
            "benches/",
            "systemd/",
        ];
        if top.iter().any(|t| path.starts_with(t)) && !path.contains('*') && !path.contains('<') {
            named += 1;
            // `file.rs::test_name`: the file, and a function of that name in it.
            let (file, item) = path.split_once("::").unwrap_or((path, ""));
            let found = match std::fs::read_to_string(root.join(file)) {
                Ok(code) => item.is_empty() || code.contains(&format!("fn {item}(")),
                Err(_) => root.join(file).is_dir() && item.is_empty(),
            };
            if !found {
                missing.push(path.to_string());
            }
        }
    }
    assert!(named >= 20, "only {named} paths found in ARCHITECTURE.md");
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names missing paths: {missing:?}"
    );
}

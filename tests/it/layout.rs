//! The release linker's layout (packaging/layout/link-gcc): the listed functions, named
//! without rustc's hash, are laid out first and in the list's order, only in the release
//! `inplace-agent` binary; any other output links as plain `cc` with rustc's lld.

use std::path::{Path, PathBuf};
use std::process::Command;

const WRAPPER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/layout/link-gcc");

/// The directory of rustc's `gcc-ld/ld.lld`, which rustc puts on the linker's PATH.
fn rustlib_bin() -> PathBuf {
    let out = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .args(["--print", "sysroot"])
        .output()
        .expect("rustc --print sysroot");
    let sysroot = String::from_utf8(out.stdout).unwrap();
    let host = String::from_utf8(Command::new("rustc").args(["-vV"]).output().unwrap().stdout)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .unwrap();
    Path::new(sysroot.trim()).join(format!("lib/rustlib/{host}/bin"))
}

/// Three functions named as rustc names them (legacy mangling, a hash at the end) and a
/// `main` calling them, compiled into objects in `dir`.
fn objects(dir: &Path) -> Vec<PathBuf> {
    let source = dir.join("f.c");
    std::fs::write(
        &source,
        "int _ZN4cold1a17h0000000000000001E(int x) { return x * 3 + 1; }\n\
         int _ZN3hot1b17h00000000000000ffE(int x) { return x * 5 + 2; }\n\
         int _ZN3hot1c17habcdef0123456789E(int x) { return x * 7 + 3; }\n\
         int main(int argc, char **argv) { (void)argv;\n\
           return _ZN4cold1a17h0000000000000001E(argc) + _ZN3hot1b17h00000000000000ffE(argc)\n\
                + _ZN3hot1c17habcdef0123456789E(argc); }\n",
    )
    .unwrap();
    let object = dir.join("f.o");
    let status = Command::new("cc")
        .args(["-c", "-O1", "-fPIC", "-ffunction-sections", "-o"])
        .arg(&object)
        .arg(&source)
        .status()
        .expect("cc");
    assert!(status.success());
    vec![object]
}

/// Links `objects` into `out` through the wrapper with `list` as the hot functions; the
/// addresses of the three functions by name.
fn link(objects: &[PathBuf], out: &Path, list: &Path) -> Vec<(String, u64)> {
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let path = format!(
        "{}:{}",
        rustlib_bin().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = Command::new(WRAPPER)
        .args(objects)
        .arg("-o")
        .arg(out)
        .env("PATH", path)
        .env("INPLACE_LAYOUT_LIST", list)
        .output()
        .expect("run packaging/layout/link-gcc");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let nm = Command::new("nm").arg(out).output().expect("nm");
    let mut found: Vec<(String, u64)> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let addr = u64::from_str_radix(f.next()?, 16).ok()?;
            let name = f.nth(1)?;
            name.starts_with("_ZN").then(|| (name.to_string(), addr))
        })
        .collect();
    found.sort_by_key(|(_, a)| *a);
    found
}

fn names(found: &[(String, u64)]) -> Vec<&str> {
    found.iter().map(|(n, _)| &n[..9]).collect()
}

#[test]
fn the_release_agent_gets_the_listed_functions_first_in_the_list_order() {
    let dir = tempfile::tempdir().unwrap();
    let objects = objects(dir.path());
    let list = dir.path().join("hot.txt");
    // c before b, a not listed; the hashes are not part of the names; comment lines (the
    // markers between the list's parts) are skipped wherever they are.
    std::fs::write(
        &list,
        "# comment\n_ZN3hot1c\n# monitoring: a part\n_ZN3hot1b\n# warm: a part\n_ZN7missing1x\n",
    )
    .unwrap();
    let out = dir.path().join("target/release/deps/inplace_agent-0123");
    let found = link(&objects, &out, &list);
    assert_eq!(names(&found), ["_ZN3hot1c", "_ZN3hot1b", "_ZN4cold1"]);
    let order = std::fs::read_to_string(format!("{}.order", out.display())).unwrap();
    assert_eq!(
        order,
        "_ZN3hot1c17habcdef0123456789E\n_ZN3hot1b17h00000000000000ffE\n"
    );
    // The program it linked runs: main(1) = (1*3+1) + (1*5+2) + (1*7+3).
    let status = Command::new(&out).status().unwrap();
    assert_eq!(status.code(), Some(21));
}

#[test]
fn any_other_output_links_as_plain_cc_without_an_order() {
    let dir = tempfile::tempdir().unwrap();
    let objects = objects(dir.path());
    let list = dir.path().join("hot.txt");
    std::fs::write(&list, "_ZN3hot1c\n").unwrap();
    for out in [
        "target/debug/deps/inplace_agent-0123",
        "target/release/deps/inplace_updater-1",
    ] {
        let out = dir.path().join(out);
        let found = link(&objects, &out, &list);
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(!Path::new(&format!("{}.order", out.display())).exists());
    }
}

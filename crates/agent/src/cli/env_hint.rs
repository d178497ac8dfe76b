//! What clap does not say about its errors: that an argument came from an `INPLACE_AGENT_*`
//! environment variable, not from the command line. `INPLACE_AGENT_ADDR` left in a shell
//! makes `drift --root R` fail with "the argument '--root' cannot be used with '--addr'",
//! though nobody typed `--addr`; the hint names the variable and what to do.

use std::ffi::OsString;

use clap::error::{ContextKind, ContextValue, ErrorKind};

/// An argument of the command line that clap took from the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FromEnv {
    /// `--addr`.
    flag: String,
    /// `INPLACE_AGENT_ADDR`.
    var: String,
}

/// The hints for a parse error of `command` on `argv` (program name first), in an
/// environment where `is_set` tells which variables are set: one line per error that an
/// environment variable caused, nothing when none did.
fn hints(
    command: &clap::Command,
    argv: &[OsString],
    is_set: &dyn Fn(&str) -> bool,
    error: &clap::Error,
) -> Vec<String> {
    if !matches!(
        error.kind(),
        ErrorKind::ArgumentConflict | ErrorKind::InvalidValue | ErrorKind::ValueValidation
    ) {
        return Vec::new();
    }
    let words: Vec<String> = argv
        .iter()
        .skip(1)
        .map(|w| w.to_string_lossy().into_owned())
        .collect();
    // The subcommand: the first word that names one (the command line has no global
    // options before it).
    let Some(sub) = words
        .iter()
        .find_map(|w| command.find_subcommand(w.as_str()))
    else {
        return Vec::new();
    };
    let typed = |arg: &clap::Arg| {
        let Some(long) = arg.get_long() else {
            return false;
        };
        let names: Vec<&str> = std::iter::once(long)
            .chain(arg.get_all_aliases().unwrap_or_default())
            .collect();
        words.iter().any(|w| {
            names.iter().any(|n| {
                w.strip_prefix("--")
                    .is_some_and(|rest| rest == *n || rest.starts_with(&format!("{n}=")))
            })
        })
    };
    // The flags an error names: `--addr <HOST:PORT>` → `--addr`.
    let flag_of = |shown: &str| -> Option<String> {
        let word = shown.split([' ', '=']).next()?.trim_matches('\'');
        word.starts_with("--").then(|| word.to_owned())
    };
    let mut named: Vec<String> = Vec::new();
    for kind in [ContextKind::InvalidArg, ContextKind::PriorArg] {
        match error.get(kind) {
            Some(ContextValue::String(s)) => named.extend(flag_of(s)),
            Some(ContextValue::Strings(list)) => {
                named.extend(list.iter().filter_map(|s| flag_of(s)))
            }
            _ => {}
        }
    }
    let from_env = |flag: &str| -> Option<FromEnv> {
        let arg = sub
            .get_arguments()
            .find(|a| a.get_long().is_some_and(|l| format!("--{l}") == flag))?;
        let var = arg.get_env()?.to_str()?;
        (is_set(var) && !typed(arg)).then(|| FromEnv {
            flag: flag.to_owned(),
            var: var.to_owned(),
        })
    };
    let env: Vec<FromEnv> = named.iter().filter_map(|f| from_env(f)).collect();
    if env.is_empty() {
        return Vec::new();
    }
    if error.kind() != ErrorKind::ArgumentConflict {
        return env
            .iter()
            .map(|e| {
                format!(
                    "hint: the value of {} comes from {} in the environment, not from the \
                     command line: correct or unset {}",
                    e.flag, e.var, e.var
                )
            })
            .collect();
    }
    let typed_flags: Vec<&String> = named
        .iter()
        .filter(|f| !env.iter().any(|e| &e.flag == *f))
        .collect();
    let sources = env
        .iter()
        .map(|e| format!("{} comes from {}", e.flag, e.var))
        .collect::<Vec<_>>()
        .join(" and ");
    let unset = env
        .iter()
        .map(|e| e.var.as_str())
        .collect::<Vec<_>>()
        .join(" and ");
    let what = if typed_flags.is_empty() {
        format!("unset {unset} (one of them is enough)")
    } else {
        let drop = typed_flags
            .iter()
            .map(|f| f.as_str())
            .collect::<Vec<_>>()
            .join(" and ");
        format!("unset {unset} or drop {drop}")
    };
    vec![format!(
        "hint: {sources} in the environment, not from the command line: {what}"
    )]
}

/// Parses the command line; a parse error is shown as clap shows it, followed by what the
/// environment had to do with it, and ends the process as clap would.
pub fn parse<P: clap::Parser>() -> P {
    let argv: Vec<OsString> = std::env::args_os().collect();
    match P::try_parse_from(&argv) {
        Ok(parsed) => parsed,
        Err(error) => {
            let said = hints(
                &P::command(),
                &argv,
                &|var| std::env::var_os(var).is_some(),
                &error,
            );
            if said.is_empty() {
                error.exit();
            }
            let _ = error.print();
            for line in said {
                errln!("{line}");
            }
            std::process::exit(error.exit_code());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(args: &[&str], set: &[&str]) -> Vec<String> {
        let command = super::super::command();
        let argv: Vec<OsString> = std::iter::once("inplace-agent")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect();
        // clap reads the real environment for `env =`; the test's variables are named
        // INPLACE_AGENT_* of no other test, so set them for the parse only.
        let error = command.clone().try_get_matches_from(&argv).unwrap_err();
        hints(&command, &argv, &|var| set.contains(&var), &error)
    }

    #[test]
    fn a_typed_flag_that_conflicts_with_nothing_typed_gets_no_hint() {
        let both = ["INPLACE_AGENT_ADDR", "INPLACE_AGENT_ROOT"];
        assert_eq!(
            run(&["drift", "--root", "/x", "--addr=h:1"], &both),
            Vec::<String>::new()
        );
        assert_eq!(
            run(&["drift", "--bogus"], &["INPLACE_AGENT_ADDR"]),
            Vec::<String>::new()
        );
    }
}

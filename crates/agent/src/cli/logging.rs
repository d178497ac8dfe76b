//! Log output (`tracing-subscriber` on stderr). Plain lines by default: colours only on a
//! terminal; under systemd (`$JOURNAL_STREAM` names our stderr) no timestamps, since journald
//! adds its own, and a `<N>` syslog priority prefix so journald files each line at its level.
//! `--log-format json`: one JSON object a line. Lines about a plan carry the `plan` span
//! (`plan` id, `digest`, `run`), and lines about one change the `change` span (its index).

use std::fmt;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
use tracing_subscriber::registry::LookupSpan;

use crate::config::LogFormat;

/// Installs the global subscriber: `INPLACE_AGENT_LOG` as the filter (else `default_level`),
/// in `format`. `timestamps`: whether plain lines carry a time when not under journald.
pub fn init(default_level: &str, format: LogFormat, timestamps: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("INPLACE_AGENT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .with_target(false)
            .try_init(),
        LogFormat::Plain if under_journald() => builder
            .with_ansi(false)
            .event_format(Journald(
                tracing_subscriber::fmt::format()
                    .without_time()
                    .with_target(false)
                    .with_ansi(false),
            ))
            .try_init(),
        LogFormat::Plain if timestamps => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_target(false)
            .try_init(),
        LogFormat::Plain => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_target(false)
            .without_time()
            .try_init(),
    };
}

/// True when stderr is the journal stream systemd connected (`$JOURNAL_STREAM` is
/// `<device>:<inode>` of it, systemd.exec(5)); a child whose stderr was redirected is not.
pub fn under_journald() -> bool {
    let Some(value) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some((dev, ino)) = value.to_str().and_then(|v| v.split_once(':')) else {
        return false;
    };
    let (Ok(dev), Ok(ino)) = (dev.parse::<u64>(), ino.parse::<u64>()) else {
        return false;
    };
    match rustix::fs::fstat(std::io::stderr()) {
        Ok(st) => st.st_dev == dev && st.st_ino == ino,
        Err(_) => false,
    }
}

/// The sd-daemon(3) priority prefix journald reads from stream lines.
pub fn syslog_priority(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// Plain lines with a `<N>` syslog priority prefix.
struct Journald<F>(F);

impl<S, N, F> FormatEvent<S, N> for Journald<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        write!(writer, "<{}>", syslog_priority(event.metadata().level()))?;
        self.0.format_event(ctx, writer, event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_follow_syslog() {
        assert_eq!(syslog_priority(&Level::ERROR), 3);
        assert_eq!(syslog_priority(&Level::WARN), 4);
        assert_eq!(syslog_priority(&Level::INFO), 6);
        assert_eq!(syslog_priority(&Level::TRACE), 7);
    }
}

//! The daemon's log lines: text (the default) or one JSON object per line (`--log-format json`,
//! for collectors), on stdout, filtered by `RUST_LOG` (default `info`).
//!
//! Under systemd stdout is a stream to journald, and the unit's environment has JOURNAL_STREAM
//! set to that stream's `DEVICE:INODE`. When stdout (or stderr, for the final error line) is
//! that stream, each line starts with `<N>`, the syslog priority, which journald strips and
//! files the line under (`journalctl -p warning`). We write the prefix rather than use
//! tracing-journald: the lines stay on the one stream the unit already captures, in order
//! with the rest, in the same format on a terminal, in a container or in the journal, with no
//! second socket to open or lose; and the prefix is a rule we can test without a journald.

use std::{fmt, os::fd::AsFd};

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::{
    EnvFilter,
    fmt::{FmtContext, FormatEvent, FormatFields, format::Writer},
    registry::LookupSpan,
};

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// `LEVEL message key=value ...`, with a timestamp unless the journal adds its own.
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, fields.message and the other fields.
    Json,
}

/// Installs the daemon's logger. The filter is RUST_LOG's if it parses (e.g. `debug`,
/// `limiter_ctl=debug`), else `info`.
pub(crate) fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let journal = is_journal(&std::io::stdout());
    // Control characters escaped at the sink: a policy name or path in any field cannot write
    // a raw CR or escape sequence into the log or a terminal.
    let writer = || super::escape::Lines(std::io::stdout());
    let builder = tracing_subscriber::fmt().with_writer(writer).with_env_filter(filter).with_ansi(false);
    // try_init: a second logger (a test's) is not an error worth failing the daemon for.
    let _ = match (format, journal) {
        (LogFormat::Json, _) => builder
            .json()
            .with_target(false)
            .event_format(Priority { journal, inner: tracing_subscriber::fmt::format().json().with_target(false) })
            .try_init(),
        (LogFormat::Text, true) => builder
            .event_format(Priority {
                journal,
                inner: tracing_subscriber::fmt::format().without_time().with_target(false).with_ansi(false),
            })
            .try_init(),
        (LogFormat::Text, false) => builder.with_target(false).try_init(),
    };
}

/// The syslog priority journald files a line under: err, warning, info, debug.
pub(crate) fn priority(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        Level::DEBUG | Level::TRACE => 7,
    }
}

/// Whether `fd` is the journal stream JOURNAL_STREAM names.
pub(crate) fn is_journal(fd: &impl AsFd) -> bool {
    let Ok(stat) = nix::sys::stat::fstat(fd.as_fd()) else { return false };
    let named = std::env::var("JOURNAL_STREAM").ok();
    names_stream(named.as_deref(), stat.st_dev, stat.st_ino)
}

/// Whether JOURNAL_STREAM's value (`DEVICE:INODE`, decimal) names the file `dev`, `ino`.
fn names_stream(value: Option<&str>, dev: u64, ino: u64) -> bool {
    let Some((d, i)) = value.and_then(|v| v.split_once(':')) else { return false };
    d.parse() == Ok(dev) && i.parse() == Ok(ino)
}

/// Another event format behind the `<N>` priority prefix, when writing to the journal.
struct Priority<F> {
    journal: bool,
    inner: F,
}

impl<S, N, F> FormatEvent<S, N> for Priority<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        if !self.journal {
            return self.inner.format_event(ctx, writer, event);
        }
        // journald makes each line an entry of its own: a message of several lines (a
        // verifier log, say) gets the prefix on every line, or all but the first would be
        // filed as info.
        let mut text = String::new();
        self.inner.format_event(ctx, Writer::new(&mut text), event)?;
        let level = priority(event.metadata().level());
        for line in text.lines() {
            writeln!(writer, "<{level}>{line}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[test]
    fn journal_stream_must_name_the_very_file() {
        assert!(names_stream(Some("8:1234"), 8, 1234));
        assert!(!names_stream(Some("8:1234"), 8, 1235), "another inode");
        assert!(!names_stream(Some("9:1234"), 8, 1234), "another device");
        for bad in [None, Some(""), Some("8"), Some("8:"), Some(":1234"), Some("8:1234:5"), Some("x:y")] {
            assert!(!names_stream(bad, 8, 1234), "{bad:?}");
        }
    }

    /// Lines written by a `Priority` format into a buffer.
    fn lines(journal: bool, json: bool, log: impl FnOnce()) -> Vec<String> {
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let out = buf.clone();
        let builder = tracing_subscriber::fmt().with_writer(move || out.clone()).with_max_level(Level::DEBUG);
        if json {
            let inner = tracing_subscriber::fmt::format().json();
            tracing::subscriber::with_default(builder.json().event_format(Priority { journal, inner }).finish(), log);
        } else {
            let inner = tracing_subscriber::fmt::format().without_time().with_ansi(false);
            tracing::subscriber::with_default(builder.event_format(Priority { journal, inner }).finish(), log);
        }
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        text.lines().map(str::to_string).collect()
    }

    #[test]
    fn journal_lines_carry_their_syslog_priority() {
        let log = || {
            tracing::error!("e");
            tracing::warn!("w");
            tracing::info!("i");
            tracing::debug!("d");
        };
        let got: Vec<String> = lines(true, false, log).iter().map(|l| l[..3].to_string()).collect();
        assert_eq!(got, ["<3>", "<4>", "<6>", "<7>"]);
        // JSON behind the prefix: journald strips it and keeps the object.
        let json = lines(true, true, log);
        assert!(json[1].starts_with("<4>{"), "{json:?}");
        let object: serde_json::Value = serde_json::from_str(&json[1][3..]).unwrap();
        assert_eq!(object["level"], "WARN");
        // Not the journal: no prefix.
        assert!(lines(false, false, log).iter().all(|l| !l.starts_with('<')));
    }

    #[test]
    fn every_line_of_a_multi_line_message_carries_the_priority() {
        let text = lines(true, false, || tracing::warn!("first\nsecond\n\tthird"));
        assert_eq!(text.len(), 3, "{text:?}");
        assert!(text.iter().all(|l| l.starts_with("<4>")), "{text:?}");
        assert!(text[0].contains("first") && text[2].ends_with("\tthird"), "{text:?}");
    }
}

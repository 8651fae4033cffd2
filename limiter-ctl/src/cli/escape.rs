//! Control characters out of what reaches a terminal or a log: a policy name, a path or a
//! config's text can carry ESC (terminal escape sequences), CR (a line that overwrites
//! another) or bidi overrides, and every error or log line may quote them.

use std::{borrow::Cow, io};

/// `text` with control characters (and bidi controls) written as Rust escapes (`\r`,
/// `\u{1b}`); newlines and tabs kept when `keep_lines` (a multi-line error pointing at a
/// config's line and column).
pub(crate) fn controls(text: &str, keep_lines: bool) -> Cow<'_, str> {
    let unsafe_char = |c: char| (c.is_control() && !(keep_lines && matches!(c, '\n' | '\t'))) || is_bidi(c);
    if !text.chars().any(unsafe_char) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unsafe_char(c) { out.extend(c.escape_debug()) } else { out.push(c) }
    }
    Cow::Owned(out)
}

/// The characters that reorder what a terminal shows (Trojan Source).
fn is_bidi(c: char) -> bool {
    matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// A log writer: each line written (one per event) has its control characters escaped, its
/// final newline kept. Sink-side, so no field of any log line can carry them.
pub(crate) struct Lines<W>(pub W);

impl<W: io::Write> io::Write for Lines<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        let (body, end) = match text.strip_suffix('\n') {
            Some(body) => (body, "\n"),
            None => (&*text, ""),
        };
        let escaped = controls(body, false);
        if matches!(escaped, Cow::Borrowed(_)) && matches!(text, Cow::Borrowed(_)) {
            self.0.write_all(buf)?;
        } else {
            self.0.write_all(format!("{escaped}{end}").as_bytes())?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn control_characters_are_escaped_and_plain_text_kept() {
        assert!(matches!(controls("dns 10.0.0.0/8 ünïcode", false), Cow::Borrowed(_)));
        assert_eq!(controls("a\u{1b}[31mred\rb", false), "a\\u{1b}[31mred\\rb");
        assert_eq!(controls("x\u{202e}y\u{7f}", false), "x\\u{202e}y\\u{7f}");
        assert_eq!(controls("one\n\ttwo\r", true), "one\n\ttwo\\r");
        assert_eq!(controls("one\ntwo", false), "one\\ntwo");
    }

    #[test]
    fn log_lines_keep_their_end_and_lose_the_rest() {
        let mut out = Lines(Vec::new());
        out.write_all(b"INFO reloaded name=\"a\rb\x1b[2J\"\n").unwrap();
        out.write_all(b"INFO plain\n").unwrap();
        assert_eq!(String::from_utf8(out.0).unwrap(), "INFO reloaded name=\"a\\rb\\u{1b}[2J\"\nINFO plain\n");
    }
}

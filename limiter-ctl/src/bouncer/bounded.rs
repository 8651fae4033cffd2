//! The LAPI's answer, read as it arrives and within bounds: at most [`MAX_BODY`] bytes in all,
//! no JSON token (a string, a number, a literal) longer than [`MAX_TOKEN`] bytes, and arrays and
//! objects nested [`MAX_DEPTH`] deep at most. The JSON parser holds the token it reads
//! (serde_json buffers a string whole before handing it on) and a byte per level of what it
//! skips, so these bound what reading an answer costs, whatever the LAPI sends: never the body
//! whole, never more than one token of it.

use std::io::{self, Read};

/// The largest answer read from the LAPI: the full set of a large blocklist (about 200 bytes a
/// decision: a million decisions) and no more. Read as it arrives, so its size costs time, not
/// memory.
pub(crate) const MAX_BODY: u64 = 256 * 1024 * 1024;
/// The longest token of an answer. A decision's fields are a few dozen bytes (an IPv6 range,
/// a scenario's name); a longer one is not a decision stream's.
pub(crate) const MAX_TOKEN: usize = 64 * 1024;
/// The deepest nesting: a decision stream is three levels deep (the answer, a list, a decision).
pub(crate) const MAX_DEPTH: usize = 32;

/// Which bound an answer went past.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Overrun {
    #[error("an answer larger than {} MiB", MAX_BODY >> 20)]
    Body,
    #[error("a JSON token longer than {} KiB", MAX_TOKEN >> 10)]
    Token,
    #[error("JSON nested deeper than {MAX_DEPTH} levels")]
    Depth,
}

impl Overrun {
    /// The bound a failed read went past, if that is why it failed.
    pub(crate) fn of(e: &io::Error) -> Option<Self> {
        e.get_ref().and_then(|inner| inner.downcast_ref::<Self>()).copied()
    }
}

/// `inner`, refused with an [`Overrun`] (as an io error) once past a bound.
pub(crate) struct Bounded<R> {
    inner: R,
    max_body: u64,
    max_token: usize,
    read: u64,
    /// Arrays and objects open.
    depth: usize,
    /// Inside a string, and whether the byte before was its backslash.
    in_string: bool,
    escaped: bool,
    /// The current token's length so far.
    run: usize,
}

impl<R> Bounded<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self::with_bounds(inner, MAX_BODY, MAX_TOKEN)
    }

    fn with_bounds(inner: R, max_body: u64, max_token: usize) -> Self {
        Self { inner, max_body, max_token, read: 0, depth: 0, in_string: false, escaped: false, run: 0 }
    }

    /// One byte through JSON's lexical rules, as far as they tell tokens apart: a string runs
    /// from its quote to the next one not escaped; outside strings, a structural character
    /// ends a token. A JSON string holds no raw quote or backslash but as written here, so
    /// this never mistakes where a string ends (the parser refuses anything else anyway).
    fn scan(&mut self, b: u8) -> Result<(), Overrun> {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
                self.run = 0;
                return Ok(());
            }
            self.run += 1;
        } else {
            match b {
                b'"' => {
                    self.in_string = true;
                    self.run = 0;
                }
                b'{' | b'[' => {
                    self.depth += 1;
                    self.run = 0;
                    if self.depth > MAX_DEPTH {
                        return Err(Overrun::Depth);
                    }
                }
                // Unbalanced closings are the parser's to refuse.
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    self.run = 0;
                }
                b',' | b':' => self.run = 0,
                _ => self.run += 1,
            }
        }
        if self.run > self.max_token { Err(Overrun::Token) } else { Ok(()) }
    }
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // One byte past the bound is read, to tell an answer of exactly MAX_BODY from a longer one.
        let room = usize::try_from(self.max_body.saturating_add(1).saturating_sub(self.read)).unwrap_or(usize::MAX);
        let take = buf.len().min(room);
        let n = self.inner.read(&mut buf[..take])?;
        self.read += n as u64;
        if self.read > self.max_body {
            return Err(io::Error::other(Overrun::Body));
        }
        for &b in &buf[..n] {
            self.scan(b).map_err(io::Error::other)?;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(body: &[u8], max_body: u64, max_token: usize) -> Result<Vec<u8>, Option<Overrun>> {
        let mut out = Vec::new();
        Bounded::with_bounds(body, max_body, max_token).read_to_end(&mut out).map_err(|e| Overrun::of(&e))?;
        Ok(out)
    }

    #[test]
    fn an_answer_within_bounds_reads_whole() {
        let body = br#"{"new":[{"value":"198.18.0.1","duration":"4h"}], "deleted" : null}"#;
        assert_eq!(read_all(body, body.len() as u64, 10).unwrap(), body);
    }

    #[test]
    fn a_body_past_its_bound_is_refused() {
        assert_eq!(read_all(b"[0,0,0]", 6, 10), Err(Some(Overrun::Body)));
        assert!(read_all(b"[0,0,0]", 7, 10).is_ok(), "exactly the bound is allowed");
    }

    #[test]
    fn a_long_token_is_refused_wherever_it_is() {
        for long in [
            r#"{"new":"0123456789a"}"#.to_string(),
            r#"{"new":[12345678901]}"#.to_string(),
            r#"{"0123456789a":1}"#.to_string(),
            format!("[{}1]", " ".repeat(11)),
            // Escaped quotes do not end the string.
            r#"["0123\"\"\"\"\""]"#.to_string(),
        ] {
            assert_eq!(read_all(long.as_bytes(), 1000, 10), Err(Some(Overrun::Token)), "{long}");
        }
        for short in [r#"{"new":"0123456789"}"#, r#"["a\\","0123456789"]"#, "[1234567890,1234567890]"] {
            assert!(read_all(short.as_bytes(), 1000, 10).is_ok(), "{short}");
        }
    }

    #[test]
    fn deep_nesting_is_refused_but_brackets_in_strings_are_text() {
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(read_all(deep.as_bytes(), 1000, 10).is_ok());
        let deeper = format!("[{deep}]");
        assert_eq!(read_all(deeper.as_bytes(), 1000, 10), Err(Some(Overrun::Depth)));
        let in_strings = format!(r#"["{}"]"#, "[{".repeat(40));
        assert!(read_all(in_strings.as_bytes(), 1000, 100).is_ok());
    }
}

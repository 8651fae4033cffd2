//! Reading the daemon's Prometheus endpoint the way a scraper does: a plain HTTP/1.0 GET over
//! TCP (from inside the daemon's network namespace: call it on a thread that entered it), and
//! the OpenMetrics text parsed into samples with their labels.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};

/// One answer to a GET.
#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    /// The header lines, as sent.
    pub headers: Vec<String>,
    pub body: String,
    /// From before connecting to the last byte of the answer.
    pub latency: Duration,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find_map(|h| {
            let (k, v) = h.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// `GET path` from `addr` over HTTP/1.0 (so the body is sent whole, then the connection closes),
/// each step bounded by `timeout`.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> anyhow::Result<Response> {
    let start = Instant::now();
    let mut stream = TcpStream::connect_timeout(&addr, timeout).with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: */*\r\n\r\n").context("sending the request")?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).with_context(|| format!("reading the answer from {addr}"))?;
    let latency = start.elapsed();
    let text = String::from_utf8(raw).context("the answer is not UTF-8")?;
    let (head, body) = text.split_once("\r\n\r\n").with_context(|| format!("no end of headers in {text:?}"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let headers: Vec<String> = lines.map(String::from).collect();
    let response = Response { status, headers, body: body.to_string(), latency };
    if let Some(len) = response.header("content-length") {
        let len: usize = len.parse().with_context(|| format!("content-length {len:?}"))?;
        ensure!(len == response.body.len(), "content-length {len} but {} bytes of body", response.body.len());
    }
    ensure!(
        response.header("transfer-encoding").is_none(),
        "an HTTP/1.0 request got a transfer-encoded answer: {:?}",
        response.headers
    );
    Ok(response)
}

/// One sample line: `name{k="v",...} value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    /// As written (counters can exceed what an f64 holds exactly).
    pub value: String,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    pub fn f64(&self) -> anyhow::Result<f64> {
        self.value.parse().with_context(|| format!("{}: value {:?}", self.name, self.value))
    }

    /// The value as a whole number (counters).
    pub fn u64(&self) -> anyhow::Result<u64> {
        self.value.parse().with_context(|| format!("{}: value {:?} is not a whole number", self.name, self.value))
    }
}

/// The samples of an OpenMetrics (or Prometheus text) exposition, in order; comment lines
/// (`# TYPE`, `# HELP`, `# EOF`) are skipped. Fails on a line it cannot read.
pub fn parse(text: &str) -> anyhow::Result<Vec<Sample>> {
    let mut out = Vec::new();
    for line in text.lines() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        out.push(parse_line(line).with_context(|| format!("metrics line {line:?}"))?);
    }
    Ok(out)
}

fn parse_line(line: &str) -> anyhow::Result<Sample> {
    let name_end = line.find(['{', ' ']).context("no value")?;
    let name = line[..name_end].to_string();
    ensure!(
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
        "bad metric name {name:?}"
    );
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices().peekable();
        loop {
            // key
            let start = match chars.peek() {
                Some(&(_, '}')) => {
                    chars.next();
                    break;
                }
                Some(&(i, _)) => i,
                None => bail!("unterminated labels"),
            };
            let mut eq = None;
            for (i, c) in chars.by_ref() {
                if c == '=' {
                    eq = Some(i);
                    break;
                }
            }
            let eq = eq.context("a label without '='")?;
            let key = inner[start..eq].to_string();
            ensure!(matches!(chars.next(), Some((_, '"'))), "label {key} has no quoted value");
            let mut value = String::new();
            loop {
                match chars.next() {
                    Some((_, '\\')) => match chars.next() {
                        Some((_, 'n')) => value.push('\n'),
                        Some((_, c)) => value.push(c),
                        None => bail!("unterminated escape"),
                    },
                    Some((_, '"')) => break,
                    Some((_, c)) => value.push(c),
                    None => bail!("unterminated label value"),
                }
            }
            labels.push((key, value));
            match chars.next() {
                Some((_, ',')) => {}
                Some((_, '}')) => break,
                other => bail!("expected ',' or '}}' after a label, got {other:?}"),
            }
        }
        let consumed = chars.peek().map_or(inner.len(), |&(i, _)| i);
        rest = &inner[consumed..];
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().context("no value")?.to_string();
    Ok(Sample { name, labels, value })
}

/// The one sample of `name` whose labels include all of `labels`; fails if there is none or
/// more than one.
pub fn one<'a>(samples: &'a [Sample], name: &str, labels: &[(&str, &str)]) -> anyhow::Result<&'a Sample> {
    let found: Vec<&Sample> =
        samples.iter().filter(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(v))).collect();
    match found.as_slice() {
        [one] => Ok(one),
        [] => bail!("no sample {name}{labels:?}"),
        more => bail!("{} samples {name}{labels:?}: {more:?}", more.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_names_labels_and_values() {
        let text = "# HELP x help\n# TYPE x counter\nx_total{policy=\"a.b\",decision=\"admitted\"} 17\n\
                    y 0.25\nz{} 3\nw{k=\"q\\\"uote\\\\d\"} 1e3 1700000000\n# EOF\n";
        let s = parse(text).unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].name, "x_total");
        assert_eq!(s[0].labels, vec![("policy".into(), "a.b".into()), ("decision".into(), "admitted".into())]);
        assert_eq!(s[0].u64().unwrap(), 17);
        assert_eq!((s[1].name.as_str(), s[1].f64().unwrap()), ("y", 0.25));
        assert!(s[2].labels.is_empty());
        assert_eq!(s[3].label("k"), Some("q\"uote\\d"));
        assert_eq!(one(&s, "x_total", &[("decision", "admitted")]).unwrap().value, "17");
        assert!(one(&s, "x_total", &[("decision", "refused")]).is_err());
        assert!(parse("x{k=\"v\" 1").is_err());
    }
}

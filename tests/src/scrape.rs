//! Reading the daemon's Prometheus endpoint the way a scraper does: an HTTP GET with `ureq`
//! (from inside the daemon's network namespace: call it on a thread that entered it), and the
//! OpenMetrics text parsed into samples with their labels by `prometheus-parse`.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use prometheus_parse::{Scrape, Value};

/// One answer to a GET.
#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    /// The headers, by lowercase name, in the order received.
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// From before connecting to the last byte of the answer.
    pub latency: Duration,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// `GET path` from `addr`, straight (no proxy, no redirect), connecting, each write and each
/// read bounded by `timeout`; any status is an answer.
pub fn get(addr: SocketAddr, path: &str, timeout: Duration) -> anyhow::Result<Response> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .proxy(None)
        .max_redirects(0)
        .http_status_as_error(false)
        .timeout_connect(Some(timeout))
        .timeout_per_write(Some(timeout))
        .timeout_per_read(Some(timeout))
        .build()
        .into();
    let start = Instant::now();
    let mut answer =
        agent.get(format!("http://{addr}{path}")).call().with_context(|| format!("GET {path} from {addr}"))?;
    let body = answer.body_mut().read_to_string().with_context(|| format!("reading the answer from {addr}"))?;
    let latency = start.elapsed();
    let headers = answer
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
        .collect();
    Ok(Response { status: answer.status().as_u16(), headers, body, latency })
}

/// One sample: `name{k="v",...} value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    pub fn f64(&self) -> anyhow::Result<f64> {
        Ok(self.value)
    }

    /// The value as a whole number (counters), exact only up to 2^53 (an f64's integers).
    pub fn u64(&self) -> anyhow::Result<u64> {
        const EXACT: f64 = (1u64 << 53) as f64;
        let v = self.value;
        ensure!(
            v >= 0.0 && v.fract() == 0.0 && v <= EXACT,
            "{}: value {v} is not a whole number up to 2^53",
            self.name
        );
        Ok(v as u64)
    }
}

/// The samples of an OpenMetrics (or Prometheus text) exposition of counters and gauges, in
/// order. Fails on a sample line it cannot read (which `prometheus-parse` would skip), and on a
/// histogram or summary (which it folds into one sample).
pub fn parse(text: &str) -> anyhow::Result<Vec<Sample>> {
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).context("parsing the exposition")?;
    let lines = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).count();
    ensure!(scrape.samples.len() == lines, "{} sample lines, {} of them read", lines, scrape.samples.len());
    scrape
        .samples
        .into_iter()
        .map(|s| {
            let value = match s.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
                Value::Histogram(_) | Value::Summary(_) => bail!("{}: a histogram or summary", s.metric),
            };
            let mut labels: Vec<(String, String)> = s.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            labels.sort();
            Ok(Sample { name: s.metric, labels, value })
        })
        .collect()
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
                    y 0.25\nz 3\nw{k=\"v\"} 1e3 1700000000\n# EOF\n";
        let s = parse(text).unwrap();
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].name, "x_total");
        assert_eq!(s[0].labels, vec![("decision".into(), "admitted".into()), ("policy".into(), "a.b".into())]);
        assert_eq!(s[0].u64().unwrap(), 17);
        assert_eq!((s[1].name.as_str(), s[1].f64().unwrap()), ("y", 0.25));
        assert!(s[2].labels.is_empty());
        assert_eq!((s[3].label("k"), s[3].u64().unwrap()), (Some("v"), 1000));
        assert!(s[1].u64().is_err());
        assert_eq!(one(&s, "x_total", &[("decision", "admitted")]).unwrap().value, 17.0);
        assert!(one(&s, "x_total", &[("decision", "refused")]).is_err());
        assert!(parse("x{k=\"v\" 1").is_err());
    }
}

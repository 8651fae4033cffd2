//! Reading what a running daemon reports, the way its users do: `limiter-ctl stats --json`
//! snapshots (taken once a second by the daemon) and the samples of its /metrics endpoint.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::{
    rig::{METRICS, Rig},
    scrape::{self, Sample},
};

/// How long [`fresh_stats`] waits for the next snapshot (the daemon takes one a second).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(3);

/// Wall-clock milliseconds since the epoch, the clock of a snapshot's `taken_at_ms`.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// `stats --json`, parsed; panics unless it exits 0 with JSON.
pub fn stats(rig: &Rig) -> Value {
    let out = rig.ctl_ok(&["stats", "--json"]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("stats --json ({e}): {out}"))
}

/// Waits for a snapshot taken after now (so it covers everything that happened before the
/// call), and returns it; panics if none comes within 3 s.
pub fn fresh_stats(rig: &Rig) -> Value {
    let since = now_ms();
    let deadline = Instant::now() + crate::slowdown::stretch(SNAPSHOT_TIMEOUT);
    loop {
        let s = stats(rig);
        if s["taken_at_ms"].as_u64().is_some_and(|t| t > since) {
            return s;
        }
        assert!(Instant::now() < deadline, "no new stats snapshot within {SNAPSHOT_TIMEOUT:?}: {s}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A policy's entry in a stats snapshot.
pub fn policy_stats<'a>(s: &'a Value, name: &str) -> &'a Value {
    s["policies"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["name"] == name))
        .unwrap_or_else(|| panic!("no policy {name} in {s}"))
}

/// GET /metrics from the daemon's default address, parsed; panics unless it answers 200 with
/// text that parses.
pub fn metrics(rig: &Rig) -> (scrape::Response, Vec<Sample>) {
    let r = rig.scrape(METRICS).unwrap_or_else(|e| panic!("GET /metrics: {e:#}"));
    assert_eq!(r.status, 200, "{r:?}");
    let samples = scrape::parse(&r.body).unwrap_or_else(|e| panic!("{e:#}:\n{}", r.body));
    (r, samples)
}

/// The whole-number value of the one sample `name{labels}` (counters); panics unless there is
/// exactly one.
pub fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> u64 {
    scrape::one(samples, name, labels).and_then(|s| s.u64()).unwrap_or_else(|e| panic!("{e:#}"))
}

/// The value of the one sample `name{labels}` (gauges); panics unless there is exactly one.
pub fn gauge(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape::one(samples, name, labels).and_then(|s| s.f64()).unwrap_or_else(|e| panic!("{e:#}"))
}

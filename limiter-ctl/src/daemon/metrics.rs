//! The Prometheus endpoint (`--metrics ADDR`, default 127.0.0.1:9464): the latest snapshot in
//! the OpenMetrics text format. Labels are policies and decisions, never sources.

use std::net::SocketAddr;

use axum::{Router, http::header, response::IntoResponse, routing::get};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _, text::encode},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};

use super::{Error, stats::Shared};

#[derive(Debug)]
struct Exposition(Shared);

type Labels = Vec<(&'static str, String)>;

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: Vec<(Labels, u64)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, value) in series {
        ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    labels: Labels,
    value: f64,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(value).encode(family.encode_family(&labels)?)
}

fn by_decision(policy: &str, decisions: &[(&'static str, u64)]) -> Vec<(Labels, u64)> {
    decisions.iter().map(|(d, n)| (vec![("policy", policy.to_string()), ("decision", (*d).to_string())], *n)).collect()
}

impl Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.0.read().map_err(|_| std::fmt::Error)?.clone();
        let (mut packets, mut bytes) = (Vec::new(), Vec::new());
        for p in &s.policies {
            let c = &p.totals;
            packets.extend(by_decision(
                &p.name,
                &[
                    ("admitted", c.admitted_packets),
                    ("refused", c.refused_packets),
                    ("dry_run", c.dry_run_packets),
                    ("allowed", c.allowed_packets),
                    ("denied", c.denied_packets),
                ],
            ));
            bytes.extend(by_decision(
                &p.name,
                &[("admitted", c.admitted_bytes), ("refused", c.refused_bytes), ("dry_run", c.dry_run_bytes)],
            ));
        }
        counter(
            &mut encoder,
            "limiter_packets",
            "Packets judged by a policy, by decision (dry_run: passed, would have been refused).",
            packets,
        )?;
        counter(&mut encoder, "limiter_bytes", "Bytes judged by a policy, by decision.", bytes)?;
        let u = &s.unjudged;
        let reason = |r: &str, n: u64| (vec![("reason", r.to_string())], n);
        counter(
            &mut encoder,
            "limiter_unjudged_packets",
            "Packets passed without a policy's judgement, by reason (allowed: every allow list pass, whether a \
             policy matched or not).",
            vec![
                reason("not_ip", u.not_ip),
                reason("malformed", u.malformed),
                reason("unmatched", u.unmatched),
                reason("allowed", s.allowed),
            ],
        )?;
        counter(
            &mut encoder,
            "limiter_dropped_packets",
            "Packets dropped without a policy's judgement, by reason (deny: every deny list drop, whether a \
             policy matched or not; unreadable_port: a TCP/UDP datagram whose port could not be read while \
             port policies exist, RFC 1858).",
            vec![reason("deny", s.denied), reason("unreadable_port", s.unreadable_ports)],
        )?;
        counter(
            &mut encoder,
            "limiter_errors",
            "The limiter's own faults (always passed, never dropped).",
            vec![(vec![], u.errors)],
        )?;
        gauge(
            &mut encoder,
            "limiter_attach_mode",
            "1 for the XDP mode the program runs in.",
            vec![("mode", s.attach_mode.clone())],
            1.0,
        )?;
        gauge(&mut encoder, "limiter_policies", "Policies loaded.", vec![], s.policies.len() as f64)?;
        gauge(
            &mut encoder,
            "limiter_salt_age_seconds",
            "Seconds since the salt was last rotated.",
            vec![],
            s.salt_age_s,
        )?;
        let r = &s.reloads;
        let result = |r: &str, n: u64| (vec![("result", r.to_string())], n);
        counter(
            &mut encoder,
            "limiter_config_reloads",
            "Config reloads (SIGHUP, `limiter-ctl reload`), by result (refused: the running config stayed).",
            vec![result("applied", r.applied), result("refused", r.refused)],
        )?;
        gauge(
            &mut encoder,
            "limiter_config_last_reload_successful",
            "1 if the last reload was applied (or none was tried since start), 0 if it was refused.",
            vec![],
            if r.last_successful { 1.0 } else { 0.0 },
        )?;
        gauge(
            &mut encoder,
            "limiter_config_last_reload_success_timestamp_seconds",
            "When the running config was loaded (at start or by the last applied reload), seconds since the epoch.",
            vec![],
            r.last_success_ms as f64 / 1000.0,
        )?;
        if let Some(occupancy) = s.bucket_occupancy {
            gauge(
                &mut encoder,
                "limiter_bucket_occupancy_ratio",
                "Fraction of buckets whose TAT is ahead of now: a newcomer's chance of sharing one, in each of its rows.",
                vec![],
                occupancy,
            )?;
        }
        Ok(())
    }
}

/// The exposition text for a snapshot.
fn render(shared: &Shared) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Exposition(shared.clone())));
    let mut out = String::new();
    encode(&mut out, &registry)?;
    Ok(out)
}

/// Serves `/metrics` (and `probes`, see `health`) on `addr` until the process ends. Binding
/// happens before this returns, so a taken port is reported at start.
pub(super) async fn serve(
    addr: SocketAddr,
    shared: Shared,
    probes: Router,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Metrics { addr, source })?;
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let shared = shared.clone();
                async move {
                    match render(&shared) {
                        Ok(body) => (
                            [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
                            body,
                        )
                            .into_response(),
                        Err(_) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "encoding failed").into_response(),
                    }
                }
            }),
        )
        .merge(probes);
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the metrics endpoint stopped");
        }
    }))
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, RwLock};

    use super::*;
    use crate::daemon::{
        ipc::PolicyCounters,
        stats::{PolicyStats, Snapshot},
    };

    #[test]
    fn exposes_policy_and_decision_labels_only() {
        let snapshot = Snapshot {
            policies: vec![PolicyStats {
                name: "dns".into(),
                id: 1,
                totals: PolicyCounters { admitted_packets: 7, refused_packets: 3, ..Default::default() },
                rates: Default::default(),
            }],
            attach_mode: "native".into(),
            bucket_occupancy: Some(0.25),
            denied: 5,
            allowed: 2,
            ..Default::default()
        };
        let text = render(&Arc::new(RwLock::new(snapshot))).unwrap();
        assert!(text.contains(r#"limiter_packets_total{policy="dns",decision="admitted"} 7"#), "{text}");
        assert!(text.contains(r#"limiter_packets_total{policy="dns",decision="refused"} 3"#), "{text}");
        assert!(text.contains(r#"limiter_attach_mode{mode="native"} 1"#), "{text}");
        assert!(text.contains("limiter_bucket_occupancy_ratio 0.25"), "{text}");
        assert!(text.contains(r#"limiter_dropped_packets_total{reason="deny"} 5"#), "{text}");
        assert!(text.contains(r#"limiter_unjudged_packets_total{reason="allowed"} 2"#), "{text}");
        assert!(text.contains(r#"limiter_config_reloads_total{result="refused"} 0"#), "{text}");
        assert!(text.contains("limiter_config_last_reload_successful 1"), "{text}");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let labels = line.split_once('{').map_or("", |(_, rest)| rest.split_once('}').map_or("", |(l, _)| l));
            for label in labels.split(',').filter(|l| !l.is_empty()) {
                let key = label.split('=').next().unwrap_or("");
                assert!(
                    ["policy", "decision", "reason", "mode", "result"].contains(&key),
                    "unexpected label {key} in {line}"
                );
            }
        }
    }
}

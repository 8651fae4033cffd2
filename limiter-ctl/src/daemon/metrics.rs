//! The Prometheus endpoint (`--metrics ADDR`, default 127.0.0.1:9464): the latest snapshot in
//! the OpenMetrics text format (or Prometheus' text format 0.0.4 for a client that asks only
//! for that, such as `promtool check metrics`), with the build, each policy's settings and the
//! process's own CPU, memory and descriptors. Labels are policies and decisions, never sources.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use axum::{Router, http::header, response::IntoResponse, routing::get};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _, text::encode},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};
use tokio::sync::Semaphore;
use tokio_io_timeout::TimeoutStream;

use super::{
    Error,
    stats::Shared,
    text004::{OPENMETRICS, TEXT_004, to_text_004, wants_text_004},
    throttled::Throttled,
};
use crate::config::{FIELDS, Field};

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

/// A float counter (seconds of CPU).
fn counter_f64(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: f64) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    ConstCounter::new(value).encode(family.encode_family(&Labels::new())?)
}

/// An info gauge: one series of value 1 per label set (a gauge, not OpenMetrics' `info` type,
/// which Prometheus' text format and promtool do not know).
fn info(encoder: &mut DescriptorEncoder, name: &str, help: &str, series: Vec<Labels>) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for labels in series {
        ConstGauge::new(1i64).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The commit the binary was built from (build.rs asks git; "unknown" outside a checkout).
const COMMIT: &str = env!("LIMITER_COMMIT");

/// The process's own resources, read from /proc/self at each scrape: the names and meanings of
/// the Prometheus client libraries' process collectors, so dashboards made for them work.
fn process(encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    // A /proc that cannot be read (hidepid, an odd container) costs these series, not the scrape.
    let Ok(me) = procfs::process::Process::myself() else { return Ok(()) };
    if let Ok(stat) = me.stat() {
        let ticks = procfs::ticks_per_second() as f64;
        counter_f64(
            encoder,
            "process_cpu_seconds",
            "User and system CPU time spent, in seconds.",
            (stat.utime + stat.stime) as f64 / ticks,
        )?;
        let page = procfs::page_size() as f64;
        gauge(
            encoder,
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            vec![],
            stat.rss as f64 * page,
        )?;
        gauge(encoder, "process_virtual_memory_bytes", "Virtual memory size in bytes.", vec![], stat.vsize as f64)?;
        gauge(encoder, "process_threads", "Number of OS threads in the process.", vec![], stat.num_threads as f64)?;
        if let Ok(boot) = procfs::boot_time_secs() {
            gauge(
                encoder,
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch, in seconds.",
                vec![],
                boot as f64 + stat.starttime as f64 / ticks,
            )?;
        }
    }
    if let Ok(fds) = me.fd_count() {
        gauge(encoder, "process_open_fds", "Number of open file descriptors.", vec![], fds as f64)?;
    }
    if let Ok(limits) = me.limits()
        && let procfs::process::LimitValue::Value(max) = limits.max_open_files.soft_limit
    {
        gauge(encoder, "process_max_fds", "Maximum number of open file descriptors.", vec![], max as f64)?;
    }
    Ok(())
}

fn by_decision(policy: &str, decisions: &[(&'static str, u64)]) -> Vec<(Labels, u64)> {
    decisions.iter().map(|(d, n)| (vec![("policy", policy.to_string()), ("decision", (*d).to_string())], *n)).collect()
}

impl Collector for Exposition {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.0.read().map_err(|_| std::fmt::Error)?.clone();
        info(
            &mut encoder,
            "limiter_build_info",
            "1, labelled with the version, the commit and the pinned maps' layout version of the running binary.",
            vec![vec![
                ("version", env!("CARGO_PKG_VERSION").to_string()),
                ("commit", COMMIT.to_string()),
                ("layout", limiter_common::maps::LAYOUT_VERSION.to_string()),
            ]],
        )?;
        // The policies' labels, by key: the fields of words (see `PolicyDef::labels`).
        let mut judging: Vec<&Field> = FIELDS.iter().filter(|f| !f.words.is_empty()).collect();
        judging.sort_by_key(|f| f.key);
        let described: Vec<String> = judging.iter().map(|f| format!("{} ({})", f.key, f.words.join(", "))).collect();
        info(
            &mut encoder,
            "limiter_policy_info",
            &format!("1 per policy, labelled with how it judges: {}.", described.join(", ")),
            s.policies
                .iter()
                .map(|p| {
                    let labels = judging.iter().filter_map(|f| Some((f.key, p.labels.get(f.key)?.clone())));
                    [("policy", p.name.clone())].into_iter().chain(labels).collect()
                })
                .collect(),
        )?;
        let (mut packets, mut bytes) = (Vec::new(), Vec::new());
        for p in &s.policies {
            let c = &p.totals;
            packets.extend(by_decision(
                &p.name,
                &[
                    ("admitted", c.admitted_packets),
                    ("refused", c.refused_packets),
                    ("dry_run", c.dry_run_packets),
                    ("overruled", c.overruled_packets),
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
            "Packets judged by a policy, by decision (dry_run: passed, would have been refused; overruled: \
             judged by this policy as one layer of several and refused by another, which counts it as refused).",
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
             a policy could need it: a port policy, or one keyed on the port; RFC 1858).",
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
            "1 for where the program runs: native or skb (XDP modes), or tcx or netlink (tc ingress: a tcx \
             link, or a filter on the clsact qdisc).",
            vec![("mode", s.attach_mode.clone())],
            1.0,
        )?;
        info(
            &mut encoder,
            "limiter_attach_tc",
            "1 while the program runs at tc ingress rather than XDP, by reason: xdp_held (another program holds \
             XDP), xdp_refused (XDP refused the program: `stats` says why), asked (--attach tc), moved \
             (`limiter-ctl attach tc`), kept (a pinned limiter at tc ingress adopted, or attached again there).",
            s.attach_reason_code.iter().map(|code| vec![("reason", code.clone())]).collect(),
        )?;
        info(
            &mut encoder,
            "limiter_attach_netlink",
            "1 while the program runs at tc ingress through a netlink filter rather than tcx, by reason: no_tcx \
             (the kernel has no tcx: Linux before 6.6), asked (--tc-api netlink), kept (a pinned filter adopted).",
            s.attach_api_reason_code.iter().map(|code| vec![("reason", code.clone())]).collect(),
        )?;
        gauge(&mut encoder, "limiter_policies", "Policies loaded.", vec![], s.policies.len() as f64)?;
        gauge(
            &mut encoder,
            "limiter_salt_age_seconds",
            "Seconds since the salt was last rotated.",
            vec![],
            s.salt_age_s,
        )?;
        if let Some(every) = s.rotate_every_s {
            gauge(
                &mut encoder,
                "limiter_salt_rotation_interval_seconds",
                "--rotate-every in seconds: the salt's age stays under it (absent with --rotate-every off).",
                vec![],
                every,
            )?;
        }
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
        if let Some(b) = &s.bans {
            {
                let mut family = encoder.encode_descriptor(
                    "limiter_bans_active",
                    "Expiring allow and deny entries (bans) in force, by address family and origin (cli, fail2ban, \
                 crowdsec).",
                    None,
                    MetricType::Gauge,
                )?;
                for (name, active) in [("ipv4", &b.active_v4), ("ipv6", &b.active_v6)] {
                    for (origin, n) in active {
                        let labels: Labels = vec![("family", name.to_string()), ("origin", origin.clone())];
                        ConstGauge::new(*n as i64).encode(family.encode_family(&labels)?)?;
                    }
                }
            }
            let by_origin = |m: &std::collections::BTreeMap<String, u64>| {
                m.iter().map(|(o, n)| (vec![("origin", o.clone())], *n)).collect::<Vec<_>>()
            };
            counter(
                &mut encoder,
                "limiter_bans_added",
                "Bans added since the daemon started, by origin (a renewal counts again).",
                by_origin(&b.added),
            )?;
            counter(
                &mut encoder,
                "limiter_bans_expired",
                "Bans that expired since the daemon started, by origin (removed ones are not counted).",
                by_origin(&b.expired),
            )?;
            counter(
                &mut encoder,
                "limiter_bans_refused",
                "Bans refused since the daemon started, by origin: broader than the floor (IPv4 /8, IPv6 /32), or a \
                 deny over the config's allow list.",
                by_origin(&b.refused),
            )?;
            counter(
                &mut encoder,
                "limiter_ban_dropped_packets",
                "Packets a deny ban dropped (also counted in limiter_dropped_packets_total{reason=\"deny\"}).",
                vec![(vec![], b.dropped_packets)],
            )?;
        }
        if let Some(occupancy) = s.bucket_occupancy {
            gauge(
                &mut encoder,
                "limiter_bucket_occupancy_ratio",
                "Fraction of buckets whose TAT is ahead of now: a newcomer's chance of sharing one, in each of its rows.",
                vec![],
                occupancy,
            )?;
        }
        process(&mut encoder)
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
/// Metrics connections served at once; more are closed as soon as accepted. A scraper or two
/// and the probes need a handful: the cap keeps whoever can reach the port from taking the
/// daemon's descriptors, which the control socket, reloads and the interface lookup need.
pub(super) const MAX_CONNECTIONS: usize = 64;
/// A connection has this long to send a request's headers (also between requests).
pub(super) const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection on which nothing is read or written for this long is closed.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) async fn serve(
    addr: SocketAddr,
    shared: Shared,
    probes: Router,
) -> Result<tokio::task::JoinHandle<()>, Error> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| Error::Metrics { addr, source })?;
    let app = Router::new()
        .route(
            "/metrics",
            get(move |headers: axum::http::HeaderMap| {
                let shared = shared.clone();
                async move {
                    match render(&shared) {
                        Ok(body) if wants_text_004(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok())) => {
                            ([(header::CONTENT_TYPE, TEXT_004)], to_text_004(&body)).into_response()
                        }
                        Ok(body) => ([(header::CONTENT_TYPE, OPENMETRICS)], body).into_response(),
                        Err(_) => (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "encoding failed").into_response(),
                    }
                }
            }),
        )
        .merge(probes);
    Ok(tokio::spawn(accept(listener, app)))
}

/// Accepts metrics connections, at most [`MAX_CONNECTIONS`] at once, each served by a task of
/// its own with [`HEADER_TIMEOUT`] and [`IDLE_TIMEOUT`].
async fn accept(listener: tokio::net::TcpListener, app: Router) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let (mut over, mut failing) = (Throttled::default(), Throttled::default());
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                if let Some(unlogged) = failing.hit() {
                    tracing::warn!(error = %e, unlogged, "accepting a metrics connection failed");
                }
                // Out of descriptors, most likely: give the open connections time to end.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Dropped: closed at once.
            if let Some(unlogged) = over.hit() {
                tracing::warn!(max = MAX_CONNECTIONS, unlogged, "metrics connection closed: too many open");
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mut stream = TimeoutStream::new(stream);
        stream.set_read_timeout(Some(IDLE_TIMEOUT));
        stream.set_write_timeout(Some(IDLE_TIMEOUT));
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(Box::pin(stream)), service);
            // A client that goes or times out is no news.
            let _ = connection.await;
            drop(slot);
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, RwLock};

    use super::*;
    use crate::api::{
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
                labels: [("mode", "dry-run"), ("scope", "host"), ("unit", "bytes")]
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .into(),
            }],
            attach_mode: "native".into(),
            bucket_occupancy: Some(0.25),
            denied: 5,
            allowed: 2,
            bans: Some(crate::api::stats::BanStats {
                active_v4: [("cli".to_string(), 2), ("crowdsec".to_string(), 0)].into(),
                active_v6: [("fail2ban".to_string(), 1)].into(),
                added: [("cli".to_string(), 3)].into(),
                expired: [("cli".to_string(), 1)].into(),
                refused: [("crowdsec".to_string(), 2)].into(),
                dropped_packets: 4,
                allowed_packets: 0,
            }),
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
        assert!(text.contains(r#"limiter_bans_active{family="ipv4",origin="cli"} 2"#), "{text}");
        assert!(text.contains(r#"limiter_bans_active{family="ipv6",origin="fail2ban"} 1"#), "{text}");
        assert!(text.contains(r#"limiter_bans_added_total{origin="cli"} 3"#), "{text}");
        assert!(text.contains(r#"limiter_bans_expired_total{origin="cli"} 1"#), "{text}");
        assert!(text.contains(r#"limiter_bans_refused_total{origin="crowdsec"} 2"#), "{text}");
        assert!(text.contains("limiter_ban_dropped_packets_total 4"), "{text}");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let labels = line.split_once('{').map_or("", |(_, rest)| rest.split_once('}').map_or("", |(l, _)| l));
            for label in labels.split(',').filter(|l| !l.is_empty()) {
                let key = label.split('=').next().unwrap_or("");
                assert!(
                    [
                        "policy", "decision", "reason", "mode", "result", "scope", "unit", "version", "commit",
                        "layout", "family", "origin"
                    ]
                    .contains(&key),
                    "unexpected label {key} in {line}"
                );
            }
        }
    }

    #[test]
    fn a_netlink_filter_is_said_with_its_reason() {
        let at = |mode: &str, code: Option<&str>| {
            let snapshot = Snapshot {
                attach_mode: mode.into(),
                attach_reason_code: code.map(|_| "xdp_refused".to_string()),
                attach_api_reason_code: code.map(str::to_string),
                ..Default::default()
            };
            render(&Arc::new(RwLock::new(snapshot))).unwrap()
        };
        let text = at("netlink", Some("no_tcx"));
        assert!(text.contains(r#"limiter_attach_mode{mode="netlink"} 1"#), "{text}");
        assert!(text.contains(r#"limiter_attach_netlink{reason="no_tcx"} 1"#), "{text}");
        assert!(text.contains(r#"limiter_attach_tc{reason="xdp_refused"} 1"#), "{text}");
        let text = at("tcx", None);
        assert!(!text.lines().any(|l| l.starts_with("limiter_attach_netlink{")), "{text}");
        assert!(!text.lines().any(|l| l.starts_with("limiter_attach_tc{")), "{text}");
    }

    fn sample() -> Shared {
        Arc::new(RwLock::new(Snapshot {
            policies: vec![PolicyStats {
                name: "dns".into(),
                labels: [("mode", "enforce"), ("scope", "cpu"), ("unit", "packets")]
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .into(),
                ..Default::default()
            }],
            attach_mode: "skb".into(),
            rotate_every_s: Some(3600.0),
            ..Default::default()
        }))
    }

    #[test]
    fn build_info_names_version_commit_and_layout() {
        let text = render(&sample()).unwrap();
        let line = text.lines().find(|l| l.starts_with("limiter_build_info{")).expect(&text);
        assert!(line.contains(&format!(r#"version="{}""#, env!("CARGO_PKG_VERSION"))), "{line}");
        assert!(line.contains(&format!(r#"layout="{}""#, limiter_common::maps::LAYOUT_VERSION)), "{line}");
        // build.rs ran in this checkout: a hex commit, or "unknown" where git could not say.
        let commit = line.split(r#"commit=""#).nth(1).and_then(|r| r.split('"').next()).expect(line);
        assert!(commit == "unknown" || (commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit())), "{line}");
        assert!(line.ends_with("} 1"), "{line}");
        assert!(text.contains("# TYPE limiter_build_info gauge"), "{text}");
    }

    #[test]
    fn policy_info_gives_each_policy_its_mode_scope_and_unit() {
        let text = render(&sample()).unwrap();
        assert!(
            text.contains(r#"limiter_policy_info{policy="dns",mode="enforce",scope="cpu",unit="packets"} 1"#),
            "{text}"
        );
        let empty = render(&Arc::new(RwLock::new(Snapshot::default()))).unwrap();
        assert!(!empty.lines().any(|l| l.starts_with("limiter_policy_info{")), "{empty}");
    }

    #[test]
    fn salt_rotation_interval_is_exposed_unless_rotation_is_off() {
        let text = render(&sample()).unwrap();
        assert!(text.contains("limiter_salt_rotation_interval_seconds 3600.0"), "{text}");
        let off = render(&Arc::new(RwLock::new(Snapshot::default()))).unwrap();
        assert!(!off.contains("limiter_salt_rotation_interval_seconds"), "{off}");
    }

    #[test]
    fn process_metrics_describe_this_process() {
        let text = render(&sample()).unwrap();
        let value = |name: &str| -> f64 {
            let line =
                text.lines().find(|l| l.split(' ').next() == Some(name)).unwrap_or_else(|| panic!("{name}: {text}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        assert!(value("process_resident_memory_bytes") > 1e6, "{text}");
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        let fds = std::fs::read_dir("/proc/self/fd").unwrap().count() as f64;
        assert!((value("process_open_fds") - fds).abs() <= 2.0, "open fds {} vs {fds}", value("process_open_fds"));
        assert!(value("process_max_fds") >= value("process_open_fds"));
        assert!(value("process_threads") >= 1.0);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        let start = value("process_start_time_seconds");
        // This test process started within the last hour, and not in the future (1 s of rounding).
        assert!(start <= now + 1.0 && start > now - 3600.0, "start {start}, now {now}");
        // This thread burns 300 ms of CPU (by its own clock, however long a busy machine makes
        // that take): the process's CPU seconds grow by at least that (less two ticks of rounding:
        // user and system time are each whole ticks).
        let thread_cpu = || {
            let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).unwrap();
            t.tv_sec() as f64 + t.tv_nsec() as f64 / 1e9
        };
        let before = value("process_cpu_seconds_total");
        let (start, wall) = (thread_cpu(), std::time::Instant::now());
        while thread_cpu() - start < 0.3 {
            assert!(wall.elapsed() < std::time::Duration::from_secs(60), "no 300 ms of CPU in 60 s");
            std::hint::black_box(0u64);
        }
        let text = render(&sample()).unwrap();
        let line = text.lines().find(|l| l.starts_with("process_cpu_seconds_total ")).unwrap();
        let after: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(after - before >= 0.27, "CPU seconds went from {before} to {after} over 300 ms of this thread's CPU");
        assert!(text.contains("# TYPE process_cpu_seconds counter"), "{text}");
    }

    #[test]
    fn text_004_names_counters_by_their_total_series_and_drops_eof() {
        let text = to_text_004(&render(&sample()).unwrap());
        assert!(text.contains("# HELP limiter_packets_total Packets judged"), "{text}");
        assert!(text.contains("# TYPE limiter_packets_total counter"), "{text}");
        assert!(text.contains("# TYPE process_cpu_seconds_total counter"), "{text}");
        assert!(text.contains("# TYPE limiter_salt_age_seconds gauge"), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
        assert!(wants_text_004(Some("text/plain; version=0.0.4")));
        for accept in [
            None,
            Some("*/*"),
            Some("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"),
        ] {
            assert!(!wants_text_004(accept), "{accept:?}");
        }
    }
}

//! End to end: per-policy counters as `limiter-ctl stats` and the Prometheus endpoint
//! report them, checked against what the flood offered (the sender's exact count) and what got
//! through (a packet socket on the receiver's veth); `limiter-ctl top` from sampled refusals;
//! counters across restarts; labels that never name a source; `stats --watch`.
//!
//! /metrics is read with a plain HTTP GET ([`limiter_tests::scrape`]) from a thread inside the receiver's network
//! namespace, where the daemon listens on its default 127.0.0.1:9464 (the rig brings `lo` up).

use std::{
    collections::BTreeSet,
    io::Read as _,
    net::IpAddr,
    os::unix::process::CommandExt as _,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use limiter_common::{
    FlowKey,
    key::{FAMILY_V4, FAMILY_V6},
    maps::Config,
};
use limiter_tests::{
    bounds::{Judged, check_overload, check_upper, nanos},
    daemon::{Ctl, Daemon, limiter_ctl_binary},
    flood::{Limits, Sources},
    observe::{fresh_stats, gauge, metrics, policy_stats, stats, value},
    policies::{gcra, src},
    require_root,
    rig::{Flooding, METRICS, Rig, flow},
    scrape::{self, Sample},
};
use nix::sys::signal::Signal;
use serde_json::Value;

/// How fast /metrics must answer, also under a flood.
const SCRAPE_BUDGET: Duration = Duration::from_millis(100);
/// The label keys a metric may carry: never one per source.
/// (version, commit and layout are limiter_build_info's; scope and unit limiter_policy_info's;
/// family and origin the bans'.)
const LABEL_KEYS: [&str; 12] = [
    "policy", "decision", "reason", "mode", "result", "scope", "unit", "version", "commit", "layout", "family",
    "origin",
];

/// A network `ADDR/LEN` as `top` prints it (host bits zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Net {
    addr: IpAddr,
    len: u8,
}

impl Net {
    fn parse(s: &str) -> Option<Self> {
        let (a, l) = s.split_once('/')?;
        let (addr, len): (IpAddr, u8) = (a.parse().ok()?, l.parse().ok()?);
        (u32::from(len) <= if addr.is_ipv4() { 32 } else { 128 }).then_some(Self { addr, len })
    }

    fn bits(a: IpAddr) -> u128 {
        match a {
            IpAddr::V4(v) => u128::from(u32::from(v)) << 96,
            IpAddr::V6(v) => u128::from(v),
        }
    }

    /// Whether the two overlap (one contains the other).
    fn overlaps(&self, o: &Self) -> bool {
        let len = u32::from(self.len.min(o.len));
        let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
        self.addr.is_ipv4() == o.addr.is_ipv4() && Self::bits(self.addr) & mask == Self::bits(o.addr) & mask
    }
}

fn net(s: &str) -> Net {
    Net::parse(s).unwrap_or_else(|| panic!("not a network: {s}"))
}

fn packets(samples: &[Sample], policy: &str, decision: &str) -> u64 {
    value(samples, "limiter_packets_total", &[("policy", policy), ("decision", decision)])
}

// ---------------------------------------------------------------------------------------------
// e. The counters agree with the flood

/// During a flood, /metrics answers within 100 ms every time (scraped every 100 ms from inside
/// the namespace) and `stats` reports the policy's rates over the last second (admitted at
/// about the rate, refused at the flood's pace). After it, once a snapshot covers it, /metrics,
/// `stats --json` and the kernel's counters agree exactly: admitted == delivered (packets and
/// bytes), admitted + refused == offered, admitted within the GCRA bound; nothing unjudged, no
/// errors; mode, policy count and salt age reported.
#[test]
fn metrics_and_stats_agree_with_what_was_offered_and_delivered() {
    require_root!();
    const RATE: u64 = 1000;
    const BURST: u64 = 100;
    let started = Instant::now();
    let rig = Rig::start(&["--buckets", "1024", "--rotate-every", "off"]).expect("rig");
    rig.ctl_ok(&["policy", "set", "flood", "--match", "udp", "--rate", "1000/s", "--burst", "100"]);
    let id = rig.policy_id("flood");
    let limit = gcra(RATE, BURST);
    let before = rig.daemon.counters(id).expect("counters");
    let stream = rig.udp(Sources::One(src("198.19.1.1")), 7000);
    let flow = flow(&stream, src("198.19.1.1"));
    // Snapshots are taken once a second: from the next one on, the policy is in them.
    fresh_stats(&rig);

    // Scrapes on a thread in the receiver's namespace, every 100 ms while the flood runs.
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let scraper = rig.net.receiver.spawn(move || -> anyhow::Result<Vec<(Duration, String)>> {
        let mut out = Vec::new();
        while !flag.load(Ordering::Relaxed) {
            let r = scrape::get(METRICS, "/metrics", Duration::from_secs(5))?;
            anyhow::ensure!(r.status == 200, "status {}", r.status);
            out.push((r.latency, r.body));
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(out)
    });
    let flooding = rig
        .start_flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(2500)), None)
        .expect("flood");
    std::thread::sleep(Duration::from_millis(2200));
    let during = stats(&rig);
    let run = flooding.finish().expect("flood");
    stop.store(true, Ordering::Relaxed);
    let scrapes = scraper.join().expect("scraper").expect("namespace").unwrap_or_else(|e| panic!("scraping: {e:#}"));
    let after = fresh_stats(&rig);
    let (response, samples) = metrics(&rig);
    let judged = Judged::between(&before, &rig.daemon.counters(id).expect("counters"));
    let kernel = judged.total;
    eprintln!("flood: {}; {judged}; delivered {}", run.report, run.delivered(&flow));

    // Latency under the flood.
    let latencies: Vec<Duration> = scrapes.iter().map(|(l, _)| *l).collect();
    let max = latencies.iter().max().copied().unwrap_or_default();
    let mean = latencies.iter().sum::<Duration>() / latencies.len().max(1) as u32;
    eprintln!(
        "  {} scrapes during the flood: max {max:?}, mean {mean:?}; after it {:?}",
        latencies.len(),
        response.latency
    );
    assert!(
        latencies.len() >= 10,
        "only {} scrapes (one every 100 ms, each waiting for the answer) during the flood of {:?} ({}): the scraper \
         did not get to run",
        latencies.len(),
        run.report.duration(),
        run.report
    );
    assert!(
        max <= SCRAPE_BUDGET,
        "a scrape took {max:?} during the flood, over the budget of {SCRAPE_BUDGET:?} (mean {mean:?}): {latencies:?}"
    );
    assert!(
        scrapes.iter().all(|(_, body)| body.contains("limiter_packets_total{policy=\"flood\",decision=\"refused\"}"))
    );
    let content_type = response.header("content-type").unwrap_or_default();
    assert!(content_type.starts_with("application/openmetrics-text"), "content type {content_type:?}");
    assert!(response.body.trim_end().ends_with("# EOF"), "OpenMetrics text ends with # EOF");

    // Rates over the last second, mid-flood (of a flood fast enough to test them).
    check_overload(&run.report, RATE as f64, 1);
    let rates = &policy_stats(&during, "flood")["rates"];
    let interval = during["interval_s"].as_f64().expect("interval");
    let admitted_per_s = rates["admitted_per_s"].as_f64().expect("rate");
    let refused_per_s = rates["refused_per_s"].as_f64().expect("rate");
    eprintln!("  mid-flood stats over {interval:.3} s: admitted {admitted_per_s:.0}/s, refused {refused_per_s:.0}/s");
    assert!((0.9..=1.1).contains(&interval), "stats interval {interval} s, expected 1 s (within 0.1 s)");
    let most = limit.bound(nanos(Duration::from_secs_f64(interval))) as f64 / interval;
    assert!(
        admitted_per_s <= most,
        "stats: admitted {admitted_per_s:.0}/s over {interval:.3} s, over the bound {most:.0}/s (rate {RATE}/s, burst \
         {BURST})"
    );
    assert!(
        admitted_per_s >= 0.8 * RATE as f64,
        "stats: admitted {admitted_per_s:.0}/s over {interval:.3} s, under 80% of the {RATE}/s rate (flood: {})",
        run.report
    );
    // The flood's own speed, whatever the machine: what it offered less what was admitted.
    let offered = run.report.pps();
    assert!(
        refused_per_s >= 0.5 * (offered - most),
        "stats: refused {refused_per_s:.0}/s during a flood of {offered:.0}/s of which at most {most:.0}/s may be \
         admitted: under half of the rest ({})",
        run.report
    );

    // After the flood: exact agreement.
    judged.check_against(&run.report);
    let sent = run.sent(&flow);
    let delivered = run.delivered(&flow);
    let bytes = run.captured.bytes(|f| *f == flow);
    let admitted = packets(&samples, "flood", "admitted");
    let refused = packets(&samples, "flood", "refused");
    eprintln!("  offered {sent}, delivered {delivered}; /metrics admitted {admitted}, refused {refused}");
    assert_eq!(admitted, delivered, "/metrics admitted vs delivered");
    assert_eq!(admitted + refused, sent, "/metrics admitted + refused vs offered");
    check_upper("/metrics admitted", admitted, &limit, &judged, run.window());
    assert_eq!(
        value(&samples, "limiter_bytes_total", &[("policy", "flood"), ("decision", "admitted")]),
        bytes,
        "admitted bytes"
    );
    let refused_bytes = value(&samples, "limiter_bytes_total", &[("policy", "flood"), ("decision", "refused")]);
    assert_eq!(refused_bytes, refused * 60, "refused bytes of 60-byte frames");
    for decision in ["dry_run", "allowed", "denied"] {
        assert_eq!(packets(&samples, "flood", decision), 0, "{decision}");
    }
    let totals = &policy_stats(&after, "flood")["totals"];
    assert_eq!(totals["admitted_packets"].as_u64(), Some(admitted), "stats --json vs /metrics: {totals}");
    assert_eq!(totals["refused_packets"].as_u64(), Some(refused), "stats --json vs /metrics: {totals}");
    assert_eq!(totals["admitted_bytes"].as_u64(), Some(bytes), "{totals}");
    assert_eq!(
        (kernel.admitted_packets, kernel.refused_packets),
        (admitted, refused),
        "the kernel's counters vs /metrics"
    );
    let after_rates = &policy_stats(&after, "flood")["rates"];
    assert!(after_rates["admitted_per_s"].as_f64().is_some(), "{after}");

    for reason in ["not_ip", "malformed", "unmatched", "allowed"] {
        assert_eq!(value(&samples, "limiter_unjudged_packets_total", &[("reason", reason)]), 0, "unjudged {reason}");
    }
    for reason in ["deny", "unreadable_port"] {
        assert_eq!(value(&samples, "limiter_dropped_packets_total", &[("reason", reason)]), 0, "dropped {reason}");
    }
    assert_eq!((after["denied"].as_u64(), after["allowed"].as_u64()), (Some(0), Some(0)), "{after}");
    assert_eq!(value(&samples, "limiter_errors_total", &[]), 0);
    assert_eq!(after["unjudged"], serde_json::json!({"not_ip": 0, "malformed": 0, "unmatched": 0, "errors": 0}));
    assert_eq!(gauge(&samples, "limiter_attach_mode", &[("mode", "native")]), 1.0);
    assert_eq!(scrape::one(&samples, "limiter_attach_mode", &[]).map(|s| s.labels.len()).ok(), Some(1), "one mode");
    assert_eq!(after["attach_mode"], "native");
    assert_eq!(gauge(&samples, "limiter_policies", &[]), 1.0);
    let age = gauge(&samples, "limiter_salt_age_seconds", &[]);
    assert!(
        age > 0.0 && age <= started.elapsed().as_secs_f64(),
        "salt age {age} s, the daemon is {:?} old",
        started.elapsed()
    );
    // Measured at start and every 15 s: present after the first measurement, a fraction.
    let occupancy = gauge(&samples, "limiter_bucket_occupancy_ratio", &[]);
    assert!((0.0..=1.0).contains(&occupancy), "occupancy {occupancy}");
    let rotated = rig.ctl_ok(&["salt", "rotate"]);
    assert_eq!(rotated.trim(), "salt rotated");
    fresh_stats(&rig);
    let (_, samples) = metrics(&rig);
    let age2 = gauge(&samples, "limiter_salt_age_seconds", &[]);
    assert!(
        age2 < 1.5 && age2 < age,
        "salt age after a rotation: {age2} s, expected under 1.5 s and under the {age} s before it"
    );
}

/// /metrics and the control socket keep answering within 100 ms while the daemon rotates the
/// salt with a large bucket table (--buckets 1048576, a tenth of the allowed maximum): they read a
/// snapshot and must not wait for the rotation.
///
/// A rotation that cleared the next generation one bucket (one bpf syscall) at a time on the
/// daemon's single-threaded runtime, which also serves /metrics and the control socket, fails it.
#[test]
fn metrics_and_stats_answer_within_100_ms_during_a_salt_rotation() {
    require_root!();
    let rig = Rig::start(&["--buckets", "1048576", "--rotate-every", "off"]).expect("rig");
    rig.ctl_ok(&["policy", "set", "p", "--match", "udp", "--rate", "1000/s", "--burst", "100"]);
    fresh_stats(&rig);
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let scraper = rig.net.receiver.spawn(move || -> anyhow::Result<Vec<Duration>> {
        let mut out = Vec::new();
        while !flag.load(Ordering::Relaxed) {
            out.push(scrape::get(METRICS, "/metrics", Duration::from_secs(60))?.latency);
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(out)
    });
    let (socket, bin) = (rig.scratch.socket(), limiter_ctl_binary().expect("limiter-ctl"));
    let stats_stop = stop.clone();
    // Each call's latency and outcome: a call that failed did not answer.
    let stats_thread = std::thread::spawn(move || -> Vec<(Duration, Result<(), String>)> {
        let mut out = Vec::new();
        while !stats_stop.load(Ordering::Relaxed) {
            let t = Instant::now();
            let answer = Ctl::run(&mut Ctl::command(&bin, &socket, &["stats", "--json"]));
            let latency = t.elapsed();
            let outcome = match answer {
                Err(e) => Err(format!("{e:#}")),
                Ok(ctl) if ctl.code != Some(0) => Err(format!("{ctl:?}")),
                Ok(ctl) => serde_json::from_str::<Value>(&ctl.stdout)
                    .map(drop)
                    .map_err(|e| format!("not JSON ({e}): {}", ctl.stdout)),
            };
            out.push((latency, outcome));
            std::thread::sleep(Duration::from_millis(20));
        }
        out
    });
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let rotated = rig.daemon.ctl(&["salt", "rotate"]).expect("salt rotate");
    let took = t.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let scrapes = scraper.join().expect("scraper").expect("namespace").unwrap_or_else(|e| panic!("{e:#}"));
    let stats_answers = stats_thread.join().expect("stats thread");
    let stats_calls: Vec<Duration> = stats_answers.iter().map(|(l, _)| *l).collect();
    let worst = |v: &[Duration]| v.iter().max().copied().unwrap_or_default();
    eprintln!(
        "rotation with 1048576 buckets took {took:?} ({:?}); /metrics: {} scrapes, worst {:?}; stats: {} calls, worst {:?}",
        rotated.code,
        scrapes.len(),
        worst(&scrapes),
        stats_calls.len(),
        worst(&stats_calls)
    );
    assert_eq!(rotated.code, Some(0), "{rotated:?}");
    assert!(!scrapes.is_empty() && !stats_calls.is_empty(), "no scrape or no `stats` call was made");
    let failed: Vec<&String> = stats_answers.iter().filter_map(|(_, o)| o.as_ref().err()).collect();
    assert!(failed.is_empty(), "{} of {} `stats` calls failed: {failed:#?}", failed.len(), stats_calls.len());
    assert!(
        worst(&scrapes) <= SCRAPE_BUDGET,
        "/metrics took {:?} during a salt rotation (of {took:?}), over the budget of {SCRAPE_BUDGET:?}: {scrapes:?}",
        worst(&scrapes)
    );
    // The CLI is a process of its own (start-up included): a looser budget.
    assert!(
        worst(&stats_calls) <= 3 * SCRAPE_BUDGET,
        "`stats` took {:?} during a salt rotation (of {took:?}), over the budget of {:?}: {stats_calls:?}",
        worst(&stats_calls),
        3 * SCRAPE_BUDGET
    );
}

// ---------------------------------------------------------------------------------------------
// f. top

/// 64 spoofed sources in one IPv4 /24 and 64 in one IPv6 /48 flood under a src/24,/48 policy,
/// while a source in another /24 (and one in another /48) sends under its limit: `top` names the
/// two flooding prefixes, first, as prefixes of the policy's length, and never the quiet ones,
/// which lose nothing; its estimate of refusals per second holds under the budget of samples.
#[test]
fn top_names_the_flooding_prefixes_and_not_the_quiet_ones() {
    require_root!();
    let rig = Rig::start(&["--buckets", "1024", "--metrics", "off", "--rotate-every", "off"]).expect("rig");
    // Scope cpu: the test reads the per-CPU buckets the kernel picked (the host-scope ones are
    // another array).
    let p = ["policy", "set", "p", "--match", "udp", "--rate", "1000/s", "--burst", "100", "--key", "src/24,/48"];
    rig.ctl_ok(&[&p[..], &["--scope", "cpu"]].concat());
    let id = rig.policy_id("p");
    let before = rig.daemon.counters(id).expect("counters");
    let flood4 = rig.udp(Sources::Spoofed { prefix: "198.19.5.0/24".parse().expect("prefix"), count: 64 }, 7000);
    let flood6 = rig.udp(Sources::Spoofed { prefix: "2001:db8:5::/64".parse().expect("prefix"), count: 64 }, 7000);
    // Quiet prefixes that do not share a bucket with a flooding one under this salt (a shared
    // bucket shares the allowance, by design; with rows, none of their buckets): rare otherwise.
    let config = rig.daemon.maps().expect("maps").rules.config;
    let flooding_buckets = [bucket(&config, id, src("198.19.5.0")), bucket(&config, id, src("2001:db8:5::"))].concat();
    let pick = |candidates: Vec<IpAddr>| {
        let own =
            candidates.into_iter().find(|a| bucket(&config, id, *a).iter().all(|b| !flooding_buckets.contains(b)));
        own.expect("a quiet prefix with a bucket of its own")
    };
    let quiet4 = pick((9..20).map(|n| IpAddr::from([198, 19, n, 7])).collect());
    let quiet6 = pick((9..20).map(|n| IpAddr::from([0x2001, 0xdb8, n, 0, 0, 0, 0, 7u16])).collect());
    let quiet = [rig.udp(Sources::One(quiet4), 7000), rig.udp(Sources::One(quiet6), 7000)];

    // The capture (started with the flood) sees every quiet frame: they start after it.
    let flooding = rig
        .start_flood(&[flood4.clone(), flood6.clone()], Limits::timed(Duration::from_millis(1500)), None)
        .expect("flood");
    // The quiet sources: 50 frames a second each, a twentieth of the rate, on their own thread.
    let limits = Limits::timed(Duration::from_secs(5));
    let quietly = Flooding::start(&rig.net.sender, &quiet, limits, Some(100.0), None);
    // The flood stops itself after 1.5 s; the quiet sources stop before the capture does.
    std::thread::sleep(Duration::from_millis(1700));
    quietly.stop();
    let quiet_run = quietly.finish().expect("quiet sources");
    let run = flooding.finish().expect("flood");
    std::thread::sleep(Duration::from_millis(300));
    let judged = Judged::between(&before, &rig.daemon.counters(id).expect("counters"));
    eprintln!("top: {}; quiet {}; {judged}", run.report, quiet_run.report);
    // The bucket computation above is the kernel's: exactly the four predicted buckets hold a TAT.
    let buckets = rig.daemon.current_buckets().expect("buckets");
    let used: BTreeSet<u32> =
        (0u32..).zip(&buckets).filter(|(_, tats)| tats.iter().any(|&t| t != 0)).map(|(b, _)| b).collect();
    let sources = [src("198.19.5.0"), src("2001:db8:5::"), quiet4, quiet6];
    let predicted: BTreeSet<u32> = sources.iter().flat_map(|a| bucket(&config, id, *a)).collect();
    assert_eq!(used, predicted, "buckets in use vs predicted");

    let out = rig.ctl_ok(&["top", "--json"]);
    let report: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("top --json ({e}): {out}"));
    let entries = report["entries"].as_array().expect("entries");
    let prefixes: Vec<Net> = entries.iter().map(|e| net(e["prefix"].as_str().expect("prefix"))).collect();
    eprintln!("  top --json: {prefixes:?}\n{out}");
    let (v4, v6) = (net("198.19.5.0/24"), net("2001:db8:5::/48"));
    assert_eq!(
        prefixes.iter().take(2).copied().collect::<BTreeSet<_>>(),
        BTreeSet::from([v4, v6]),
        "the flooding prefixes first: {out}"
    );
    assert!(
        prefixes.iter().all(|p| p.len == if p.addr.is_ipv4() { 24 } else { 48 }),
        "prefixes finer than the key: {prefixes:?}"
    );
    for q in [Net { addr: quiet4, len: 24 }, Net { addr: quiet6, len: 48 }] {
        assert!(!prefixes.iter().any(|p| p.overlaps(&q)), "top names the quiet {q:?}: {out}");
    }
    assert!(entries.iter().all(|e| e["policy"] == "p" && e["dry_run"] == false && e["dport"].is_null()), "{out}");
    assert_eq!(report["sample_one_in"], 256);
    assert_eq!(report["samples_per_s"], 256);
    assert_eq!(report["window_s"], 10);
    // The samples' weights x N estimate the refusals (each refusal drawn with probability 1/256;
    // a draw the budget kept from the ring weighs on its CPU's next sample), over the window.
    let samples: u64 = entries.iter().map(|e| e["samples"].as_u64().expect("samples")).sum();
    let refused = judged.total.refused_packets;
    let per_s: f64 = entries.iter().map(|e| e["refused_per_s"].as_f64().expect("rate")).sum();
    let estimate = per_s * 10.0;
    eprintln!("  {samples} samples standing for {estimate:.0} vs {refused} refused");
    assert!(
        estimate >= 0.7 * refused as f64 && estimate <= 1.3 * refused as f64,
        "{samples} samples standing for {estimate:.0} refusals, of {refused}"
    );
    // No more samples than the host's budget over the 1.5 s flood (two windows, or three).
    let cpus = aya::util::nr_cpus().expect("possible CPUs");
    let budget =
        u64::from(limiter_ctl::kernel::per_cpu_budget(limiter_ctl::kernel::DEFAULT_SAMPLES_PER_S, cpus)) * cpus as u64;
    assert!(samples <= 3 * budget, "{samples} samples, over the budget of {budget} a second");

    // The human table says the same.
    let table = rig.ctl_ok(&["top", "--limit", "5"]);
    assert!(table.contains("198.19.5.0/24") && table.contains("2001:db8:5::/48"), "{table}");
    for q in [&quiet4.to_string()[..10], &quiet6.to_string()[..11]] {
        assert!(!table.contains(q), "the table names the quiet {q}: {table}");
    }
    assert_eq!(rig.ctl_ok(&["top", "--limit", "1", "--json"]).matches("\"prefix\"").count(), 1);

    // The quiet sources lost nothing.
    for q in &quiet {
        let Sources::One(a) = q.sources else { unreachable!() };
        let f = flow(q, a);
        let sent = quiet_run.sent(&f);
        assert!(
            sent >= 50,
            "the quiet {a}, paced at 50/s, sent only {sent} in {:?} ({}): the machine did not run its sender",
            quiet_run.report.duration(),
            quiet_run.report
        );
        assert_eq!(run.captured.packets(|x| *x == f), sent, "the quiet {a} was refused");
    }
}

/// The buckets (indexes within the current generation, one per count-min row) of `addr` under
/// policy `id` keyed on src/24,/48, as the kernel computes them.
fn bucket(config: &Config, id: u16, addr: IpAddr) -> Vec<u32> {
    let mut bytes = [0u8; 16];
    let family = match addr {
        IpAddr::V4(a) => {
            bytes[..3].copy_from_slice(&a.octets()[..3]);
            FAMILY_V4
        }
        IpAddr::V6(a) => {
            bytes[..6].copy_from_slice(&a.octets()[..6]);
            FAMILY_V6
        }
    };
    let words = FlowKey { addr: bytes, policy: id, dport: 0, family }.words();
    let salt = &config.salts[(config.generation & 1) as usize];
    let rows = config.rows.max(1) as usize;
    let hash = limiter_common::key::key_hash(salt, family, &words);
    limiter_common::rows::row_indexes(hash, rows, config.row_len)[..rows].to_vec()
}

// ---------------------------------------------------------------------------------------------
// Bucket occupancy

/// `limiter_bucket_occupancy_ratio` is measured at start and then every 15 s (not on every
/// snapshot): a sweep of 65,536 sources over 1,024 buckets, under a policy whose burst window
/// (30 s) keeps every touched bucket ahead of now, shows only after the 15 s measurement, as the
/// fraction of (bucket, CPU) pairs holding a TAT ahead of now, counted here from the maps.
#[test]
fn bucket_occupancy_is_measured_every_15_s() {
    require_root!();
    let rig = Rig::start(&["--buckets", "1024", "--rotate-every", "off", "--sample-refusals", "0"]).expect("rig");
    let started = Instant::now();
    // Scope cpu: the gauge is the higher of the two arrays, and the host-scope one stays empty.
    rig.ctl_ok(&["policy", "set", "sweep", "--match", "udp", "--rate", "1/s", "--burst", "30", "--scope", "cpu"]);
    let id = rig.policy_id("sweep");
    let occupancy = |rig: &Rig| gauge(&metrics(rig).1, "limiter_bucket_occupancy_ratio", &[]);
    fresh_stats(&rig);
    assert_eq!(occupancy(&rig), 0.0, "measured at start, before any traffic");

    let before = rig.daemon.counters(id).expect("counters");
    let sweep = rig.udp(Sources::Sweep("198.19.0.0/16".parse().expect("prefix")), 7000);
    // Bounded in packets: twice over the /16 (a time limit too).
    let run = rig.flood(&[sweep], Limits::counted(2 * 65_536, Duration::from_secs(5)), None).expect("flood");
    let judged = Judged::between(&before, &rig.daemon.counters(id).expect("counters"));
    eprintln!("occupancy: {}; {judged}", run.report);
    assert!(
        run.report.sent >= 65_536,
        "the machine sent only {} packets in {:?} ({}): too slow to sweep the /16 and test occupancy",
        run.report.sent,
        run.report.duration(),
        run.report
    );
    fresh_stats(&rig);
    assert!(
        started.elapsed() < Duration::from_secs(13),
        "the sweep and a stats snapshot took until {:?} after the start, past 13 s: the machine was too slow to see \
         the value measured at start before the 15 s one (flood: {})",
        started.elapsed(),
        run.report
    );
    assert_eq!(occupancy(&rig), 0.0, "re-measured before 15 s");

    // The next measurement, 15 s after the first.
    let deadline = started + Duration::from_secs(20);
    let changed = loop {
        let s = stats(&rig);
        if s["bucket_occupancy"].as_f64().is_some_and(|o| o > 0.0) {
            break Instant::now();
        }
        assert!(Instant::now() < deadline, "occupancy not re-measured within 20 s of the start: {s}");
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("  re-measured {:?} after the start", changed - started);
    assert!(
        changed - started >= Duration::from_secs(13),
        "re-measured after {:?}, before the 15 s tick",
        changed - started
    );
    let measured = occupancy(&rig);
    // What the maps say: every (bucket, CPU) whose TAT is set is ahead (30 s window).
    let (mut ahead, mut pairs) = (0u64, 0u64);
    for tats in rig.daemon.current_buckets().expect("buckets") {
        for tat in tats {
            pairs += 1;
            ahead += u64::from(tat != 0);
        }
    }
    let expected = ahead as f64 / pairs as f64;
    eprintln!(
        "  limiter_bucket_occupancy_ratio {measured}; the maps: {ahead} of {pairs} (bucket, CPU) pairs ahead = {expected}"
    );
    assert!(ahead >= 1024, "the sweep should have touched every bucket on its CPU");
    assert!((measured - expected).abs() < 0.01, "occupancy {measured}, the maps say {expected}");
}

// ---------------------------------------------------------------------------------------------
// g. Counters across restarts

/// Counters live in the pinned maps: after SIGKILL and a restart that adopts, /metrics and
/// `stats --json` report the same totals as before (no traffic in between), and go on counting
/// from there. A clean stop (SIGINT) leaves them pinned too, so the next daemon adopts them;
/// `limiter-ctl detach` removes them, and the daemon after that starts from zero: documented
/// here as the expected behaviour.
#[test]
fn counters_carry_on_across_restarts_and_reset_after_detach() {
    require_root!();
    let args = ["--buckets", "1024", "--rotate-every", "off"];
    let mut rig = Rig::start(&args).expect("rig");
    rig.ctl_ok(&["policy", "set", "p", "--match", "udp", "--rate", "1000/s", "--burst", "100"]);
    let stream = rig.udp(Sources::One(src("198.19.1.1")), 7000);
    let flow = flow(&stream, src("198.19.1.1"));
    let run = rig.flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(400)), None).expect("flood");
    fresh_stats(&rig);
    let (_, before) = metrics(&rig);
    let (admitted, refused) = (packets(&before, "p", "admitted"), packets(&before, "p", "refused"));
    assert_eq!(admitted, run.delivered(&flow));
    assert_eq!(admitted + refused, run.sent(&flow));

    rig.daemon.kill().expect("SIGKILL");
    rig.daemon = Daemon::adopt(&rig.net.receiver, &rig.scratch, &args).unwrap_or_else(|e| panic!("restart: {e:#}")).0;
    let (_, adopted) = metrics(&rig);
    let carried = (packets(&adopted, "p", "admitted"), packets(&adopted, "p", "refused"));
    eprintln!("before the kill: admitted {admitted}, refused {refused}; after adopting: {carried:?}");
    assert_eq!(carried, (admitted, refused), "counters after adopting");
    let now = stats(&rig);
    let totals = &policy_stats(&now, "p")["totals"];
    assert_eq!(
        (totals["admitted_packets"].as_u64(), totals["refused_packets"].as_u64()),
        (Some(admitted), Some(refused)),
        "{totals}"
    );
    assert_eq!(
        value(&adopted, "limiter_bytes_total", &[("policy", "p"), ("decision", "admitted")]),
        value(&before, "limiter_bytes_total", &[("policy", "p"), ("decision", "admitted")])
    );

    let run2 =
        rig.flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(400)), None).expect("flood");
    fresh_stats(&rig);
    let (_, more) = metrics(&rig);
    assert_eq!(
        packets(&more, "p", "admitted"),
        admitted + run2.delivered(&flow),
        "admitted after adopting goes on from the old count"
    );
    assert_eq!(packets(&more, "p", "admitted") + packets(&more, "p", "refused"), run.sent(&flow) + run2.sent(&flow));

    rig.daemon.stop_ok();
    assert!(!rig.scratch.pinned(&rig.net.receiver.iface).expect("pins").is_empty(), "a clean stop leaves the pins");
    rig.daemon = Daemon::adopt(&rig.net.receiver, &rig.scratch, &args).unwrap_or_else(|e| panic!("restart: {e:#}")).0;
    let (_, kept) = metrics(&rig);
    assert_eq!(
        (packets(&kept, "p", "admitted"), packets(&kept, "p", "refused")),
        (packets(&more, "p", "admitted"), packets(&more, "p", "refused")),
        "counters after a clean stop and a start"
    );
    rig.daemon.stop_ok();
    let out = rig.scratch.detach(&rig.net.receiver).expect("limiter-ctl detach");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(rig.scratch.pinned(&rig.net.receiver.iface).expect("pins").is_empty(), "detach leaves no pins");
    // Starting waits for " attached " and fails if the daemon adopted instead.
    rig.daemon = Daemon::start(&rig.net.receiver, &rig.scratch, &args)
        .unwrap_or_else(|e| panic!("after detach the daemon should attach afresh: {e:#}"));
    let (_, fresh) = metrics(&rig);
    eprintln!(
        "after detach and a start: admitted {}, refused {}",
        packets(&fresh, "p", "admitted"),
        packets(&fresh, "p", "refused")
    );
    assert_eq!(
        (packets(&fresh, "p", "admitted"), packets(&fresh, "p", "refused")),
        (0, 0),
        "detach resets the counters (by design)"
    );
}

// ---------------------------------------------------------------------------------------------
// h. No label per source

/// After floods from 64 IPv4 and 64 IPv6 spoofed sources, over policies of every kind and lists
/// with entries, /metrics has labels keyed only by policy, decision, reason, mode and the build's
/// and policies' settings, no label
/// value that reads as an address or a network, no address anywhere in the text, and exactly the
/// series its policies make (a fixed number per policy, whatever the sources).
#[test]
fn metrics_carry_no_label_per_source() {
    require_root!();
    let rig = Rig::start(&["--buckets", "1024", "--rotate-every", "off"]).expect("rig");
    rig.ctl_ok(&["policy", "set", "per-source", "--match", "udp:7000", "--rate", "100/s", "--burst", "10"]);
    rig.ctl_ok(&[
        "policy",
        "set",
        "per-net",
        "--match",
        "udp:7001",
        "--rate",
        "100/s",
        "--burst",
        "10",
        "--key",
        "src/24,/48+dport",
    ]);
    rig.ctl_ok(&["policy", "set", "watch", "--match", "udp:7002", "--rate", "100/s", "--burst", "10", "--dry-run"]);
    rig.ctl_ok(&["allow", "add", "198.19.200.0/24"]);
    rig.ctl_ok(&["deny", "add", "2001:db8:dd::/48"]);
    let spoof = |p: &str, port| rig.udp(Sources::Spoofed { prefix: p.parse().expect("prefix"), count: 64 }, port);
    let streams = [
        spoof("198.19.1.0/24", 7000),
        spoof("2001:db8:1::/64", 7000),
        spoof("198.19.2.0/24", 7001),
        spoof("2001:db8:2::/64", 7002),
        spoof("198.19.200.0/24", 7000),
        spoof("2001:db8:dd::/64", 7001),
        spoof("198.19.3.0/24", 9999),
    ];
    let run = rig.flood(&streams, Limits::timed(Duration::from_millis(700)), None).expect("flood");
    eprintln!("labels: {}", run.report);
    fresh_stats(&rig);
    let (response, samples) = metrics(&rig);
    let body = &response.body;

    let mut keys = BTreeSet::new();
    for s in &samples {
        for (k, v) in &s.labels {
            keys.insert(k.clone());
            assert!(LABEL_KEYS.contains(&k.as_str()), "label {k} on {s:?}");
            assert!(v.parse::<IpAddr>().is_err() && Net::parse(v).is_none(), "an address as a label value: {s:?}");
            let dots = v.chars().filter(|c| *c == '.').count();
            assert!(!v.contains(':') && !v.contains('/') && dots < 3, "an address-like label value: {s:?}");
        }
    }
    eprintln!("  {} series, label keys {keys:?}", samples.len());
    for needle in ["198.19.", "2001:db8", "2001:DB8"] {
        assert!(!body.contains(needle), "an address in /metrics ({needle}):\n{body}");
    }
    // The series: 6 packet (overruled among them) and 3 byte decisions and an info per policy, 4 unjudged reasons, 2 drop reasons,
    // errors, mode, policy count, salt age, occupancy, 2 reload results, the last reload's outcome and time,
    // the build, 7 of the process (no rotation interval: rotation is off), 16 of the bans (active by
    // 2 families and 3 origins, added, expired and refused by origin, dropped). The sources do not add any.
    let names: BTreeSet<&str> = samples.iter().map(|s| s.name.as_str()).collect();
    let expected: BTreeSet<&str> = [
        "limiter_packets_total",
        "limiter_bytes_total",
        "limiter_unjudged_packets_total",
        "limiter_dropped_packets_total",
        "limiter_errors_total",
        "limiter_attach_mode",
        "limiter_policies",
        "limiter_salt_age_seconds",
        "limiter_bucket_occupancy_ratio",
        "limiter_config_reloads_total",
        "limiter_config_last_reload_successful",
        "limiter_config_last_reload_success_timestamp_seconds",
        "limiter_build_info",
        "limiter_policy_info",
        "limiter_bans_active",
        "limiter_bans_added_total",
        "limiter_bans_expired_total",
        "limiter_bans_refused_total",
        "limiter_ban_dropped_packets_total",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_threads",
        "process_start_time_seconds",
        "process_open_fds",
        "process_max_fds",
    ]
    .into();
    assert_eq!(names, expected, "metric families");
    assert_eq!(samples.len(), 3 * (6 + 3 + 1) + 4 + 2 + 4 + 1 + 2 + 2 + 1 + 7 + 16, "series count:\n{body}");
    // The flood did reach every policy, so the labels were tested with traffic behind them.
    assert!(packets(&samples, "per-source", "refused") > 0 && packets(&samples, "per-net", "refused") > 0);
    assert!(packets(&samples, "watch", "dry_run") > 0 && packets(&samples, "per-source", "allowed") > 0);
    assert!(packets(&samples, "per-net", "denied") > 0);
    assert!(value(&samples, "limiter_unjudged_packets_total", &[("reason", "unmatched")]) > 0);
    // Every list decision is in the totals: here all of them met a policy.
    let sum = |decision| ["per-source", "per-net", "watch"].map(|p| packets(&samples, p, decision)).iter().sum::<u64>();
    assert_eq!(value(&samples, "limiter_dropped_packets_total", &[("reason", "deny")]), sum("denied"), "deny drops");
    assert_eq!(value(&samples, "limiter_unjudged_packets_total", &[("reason", "allowed")]), sum("allowed"), "allowed");
}

// ---------------------------------------------------------------------------------------------
// i. stats --watch

/// `stats --watch` clears the screen and redraws once a second until it is stopped: run for
/// about 2.5 s, it drew at least twice, each time the table with the policy.
#[test]
fn stats_watch_redraws_until_stopped() {
    require_root!();
    let rig = Rig::start(&["--buckets", "1024", "--metrics", "off", "--rotate-every", "off"]).expect("rig");
    rig.ctl_ok(&["policy", "set", "p", "--match", "udp", "--rate", "1000/s"]);
    fresh_stats(&rig);
    let bin = limiter_ctl_binary().expect("limiter-ctl");
    let mut cmd = Ctl::command(&bin, &rig.scratch.socket(), &["stats", "--watch"]);
    // SIGINT as a terminal sends it: a test run started in the background (where SIGINT is
    // ignored, and children inherit that) must still stop the CLI with it.
    // SAFETY: signal() is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::signal::signal(Signal::SIGINT, nix::sys::signal::SigHandler::SigDfl)
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("limiter-ctl stats --watch");
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    std::thread::sleep(Duration::from_millis(2500));
    let running = child.try_wait().expect("try_wait").is_none();
    // Killed by its pid, whatever happens next.
    nix::sys::signal::kill(pid, Signal::SIGINT).expect("SIGINT");
    let status = child.wait().expect("wait");
    let mut out = String::new();
    child.stdout.take().expect("stdout").read_to_string(&mut out).expect("stdout");
    let mut err = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut err).expect("stderr");
    assert!(running, "stats --watch exited on its own ({status}): {out}{err}");
    let clear = "\x1b[H\x1b[2J";
    let frames: Vec<&str> = out.split(clear).skip(1).collect();
    eprintln!("stats --watch: {} redraws in 2.5 s ({status})", frames.len());
    assert!(frames.len() >= 2, "{} redraws in 2.5 s, expected at least 2 (one a second): {out:?}", frames.len());
    assert!(out.starts_with(clear), "the first draw does not clear the screen: {out:?}");
    for f in &frames {
        assert!(
            f.contains("POLICY") && f.lines().any(|l| l.trim_start().starts_with("p ")),
            "a redraw without the table: {f:?}"
        );
    }
    assert!(err.is_empty(), "stderr: {err}");
}

//! `limiter-ctl explain ADDR`: what a packet from ADDR would meet now, and until when.
//!
//! Each agreement test drives a source (or an aggregate) into refusal on the veth pair with the
//! real daemon, asks `explain --json`, then sends the source's frames at 1,000 a second: the
//! policy (or entry) named is the one in force, and the first frame that reaches the receiver
//! arrives within 10 ms of the moment `explain` gave (its clock reading plus the Retry-After).
//! Also: asking changes no map; bad input gets one line and exit 2.

use std::{
    thread,
    time::{Duration, Instant},
};

use limiter_tests::{
    ban_rig::raw_request,
    cpu::flood_cpu,
    flood::{L4, Limits, Sources, Stream},
    require_root,
    rig::{Rig, flow_of},
};
use nix::time::{ClockId, clock_gettime};
use serde_json::Value;

const PORT: u16 = 4100;
/// How far from the moment `explain` gave the first frame through may arrive.
const AGREE: Duration = Duration::from_millis(10);
/// A Retry-After shorter than this leaves too little time to start sending before it: the
/// source is driven into refusal again (the moment within a packet's interval is chance).
const SHORTEST: f64 = 150.0;

fn explain(rig: &Rig, args: &[&str]) -> Value {
    let mut all = vec!["explain", "--json"];
    all.extend_from_slice(args);
    let out = rig.ctl_ok(&all);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("explain's JSON: {e}: {out}"))
}

/// The `Instant` of a reading of CLOCK_MONOTONIC (what `Instant` reads on Linux).
fn instant_at(monotonic_ns: u64) -> Instant {
    let (now, ts) = (Instant::now(), clock_gettime(ClockId::CLOCK_MONOTONIC).expect("the monotonic clock"));
    let ns = ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64;
    if monotonic_ns >= ns {
        now + Duration::from_nanos(monotonic_ns - ns)
    } else {
        now - Duration::from_nanos(ns - monotonic_ns)
    }
}

/// Drives `flood` for 300 ms at full speed (unless None), then asks `explain` with `args`;
/// again while the Retry-After is shorter than [`SHORTEST`]. The answer, and the moment it says
/// the next frame passes.
fn refused(rig: &Rig, flood: Option<&Stream>, args: &[&str]) -> (Value, Instant) {
    for _ in 0..6 {
        if let Some(flood) = flood {
            rig.flood(std::slice::from_ref(flood), Limits::timed(Duration::from_millis(300)), None).expect("the flood");
        }
        let e = explain(rig, args);
        let retry = e["retry_after_ms"].as_f64().unwrap_or_else(|| panic!("no Retry-After: {e:#}"));
        let at = instant_at(e["at_monotonic_ns"].as_u64().expect("at_monotonic_ns"));
        if retry >= SHORTEST || flood.is_none() {
            return (e, at + Duration::from_secs_f64(retry / 1000.0));
        }
        thread::sleep(Duration::from_secs_f64(retry / 1000.0) + Duration::from_millis(50));
    }
    panic!("the Retry-After stayed under {SHORTEST} ms in six tries");
}

/// Sends `probe`'s frames at 1,000 a second until 300 ms past `at`: the first to reach the
/// receiver arrives within [`AGREE`] of `at`, none before.
fn first_through_at(rig: &Rig, probe: &Stream, at: Instant, what: &str) {
    let started = Instant::now();
    assert!(started + Duration::from_millis(20) < at, "{what}: too late to start sending");
    let run = rig
        .flood(std::slice::from_ref(probe), Limits::timed(at + Duration::from_millis(300) - started), Some(1000.0))
        .expect("the probe");
    let flow = flow_of(probe);
    let first = run.captured.seen.iter().find(|s| s.flow == flow).map(|s| s.at);
    let first = first.unwrap_or_else(|| panic!("{what}: nothing passed by 300 ms after the moment given"));
    // A stall of the sender over the moment sends nothing until it ends: the first frame is due
    // then. (Stalls are timed from the flood's own start, after `started`: never later than
    // they were.)
    let due = run
        .report
        .stalls
        .each
        .iter()
        .map(|s| (started + s.from, started + s.end()))
        .filter(|&(from, to)| from <= at && at < to)
        .map(|(_, to)| to)
        .fold(at, Instant::max);
    let off = |a: Instant, b: Instant| if a >= b { a - b } else { b - a };
    eprintln!(
        "{what}: first through {:?} from the moment explain gave ({}); due {:?} after it",
        off(first, at),
        if first >= at { "after" } else { "before" },
        due - at
    );
    assert!(
        first + AGREE >= at && first <= due + AGREE,
        "{what}: the first frame through arrived {:?} from the moment explain gave, {:?} from when a frame was \
         due (sent: {})",
        off(first, at),
        off(first, due),
        run.report
    );
}

fn stream(rig: &Rig, src: &str) -> Stream {
    rig.stream(L4::Udp, PORT, src)
}

fn names(e: &Value) -> Vec<&str> {
    e["policies"].as_array().map_or(Vec::new(), |p| p.iter().filter_map(|p| p["name"].as_str()).collect())
}

/// A source over its rate (host scope, the default): `explain` names its policy and key, says
/// refused, and the Retry-After it gives is when the source's next frame passes.
#[test]
fn a_refused_source_is_named_with_its_retry_after() {
    require_root!();
    let rig = Rig::start(&[]).expect("the rig");
    rig.ctl_ok(&["policy", "set", "each", "--match", &format!("udp:{PORT}"), "--rate", "1/s", "--burst", "3"]);
    let source = stream(&rig, "198.19.10.5");
    let args = ["198.19.10.5", "--proto", "udp", "--dport", &PORT.to_string()];
    let (e, at) = refused(&rig, Some(&source), &args);
    assert_eq!((e["verdict"].as_str(), e["by"].as_str()), (Some("refused"), Some("each")), "{e:#}");
    assert_eq!(names(&e), ["each"]);
    let p = &e["policies"][0];
    assert_eq!((p["scope"].as_str(), p["key"].as_str()), (Some("host"), Some("198.19.10.5/32")), "{p:#}");
    let rows = p["buckets"][0]["rows"].as_array().expect("rows");
    assert!(!rows.is_empty() && rows.iter().all(|r| r["spent_ms"].as_f64() > Some(0.0)), "{p:#}");
    assert_eq!(e["on_cpus"], Value::Null, "host scope refuses on every CPU");
    assert_eq!(e["warnings"], serde_json::json!([]), "a key of its own, in a million buckets");
    first_through_at(&rig, &source, at, "host scope");

    // IPv6: the key is the source's prefix under the policy's IPv6 mask.
    let source = stream(&rig, "2001:db8:10::5");
    let (e, at) = refused(&rig, Some(&source), &["2001:db8:10::5", "--proto", "udp", "--dport", &PORT.to_string()]);
    assert_eq!((e["verdict"].as_str(), e["by"].as_str()), (Some("refused"), Some("each")), "{e:#}");
    let key = e["policies"][0]["key"].as_str().unwrap_or_default();
    assert!(key.starts_with("2001:db8:10:"), "{e:#}");
    first_through_at(&rig, &source, at, "host scope, IPv6");
}

/// A per-CPU policy: refused on the flood's CPU only, and agreed there.
#[test]
fn a_per_cpu_refusal_names_its_cpu() {
    require_root!();
    let rig = Rig::start(&[]).expect("the rig");
    let m = format!("udp:{PORT}");
    rig.ctl_ok(&["policy", "set", "each", "--match", &m, "--rate", "1/s", "--burst", "3", "--scope", "cpu"]);
    let source = stream(&rig, "198.19.11.5");
    let (e, at) = refused(&rig, Some(&source), &["198.19.11.5", "--proto", "udp", "--dport", &PORT.to_string()]);
    assert_eq!((e["verdict"].as_str(), e["by"].as_str()), (Some("refused"), Some("each")), "{e:#}");
    let cpus = thread::available_parallelism().map_or(1, |n| n.get());
    let spent: Vec<u64> =
        e["policies"][0]["buckets"].as_array().expect("buckets").iter().filter_map(|b| b["cpu"].as_u64()).collect();
    assert_eq!(spent, [flood_cpu() as u64], "the CPUs whose buckets are spent: {e:#}");
    if cpus > 1 {
        assert_eq!(e["on_cpus"], serde_json::json!([flood_cpu()]), "{e:#}");
    }
    first_through_at(&rig, &source, at, "per-CPU");
}

/// Behind a generous per-source policy, an aggregate (`--key src/0`) that a spoofed flood
/// spent: an address that never sent is refused by the aggregate, until the moment given.
#[test]
fn an_aggregate_layer_refuses_a_quiet_source_until_the_moment_given() {
    require_root!();
    let rig = Rig::start(&[]).expect("the rig");
    let m = format!("udp:{PORT}");
    rig.ctl_ok(&["policy", "set", "each", "--match", &m, "--rate", "1000/s", "--burst", "100"]);
    rig.ctl_ok(&["policy", "set", "all", "--match", &m, "--rate", "1/s", "--burst", "3", "--key", "src/0"]);
    let spoofed = rig.udp(Sources::Spoofed { prefix: "198.19.12.0/24".parse().expect("prefix"), count: 64 }, PORT);
    let (e, at) = refused(&rig, Some(&spoofed), &["198.19.13.5", "--proto", "udp", "--dport", &PORT.to_string()]);
    assert_eq!((e["verdict"].as_str(), e["by"].as_str()), (Some("refused"), Some("all")), "{e:#}");
    assert_eq!(names(&e), ["each", "all"], "both layers, in judging order");
    assert_eq!(e["policies"][0]["verdict"].as_str(), Some("admitted"), "{e:#}");
    assert_eq!(e["policies"][1]["key"].as_str(), Some("0.0.0.0/0"), "{e:#}");
    // In words: the verdict and the refusing layer first.
    let text = rig.ctl_ok(&["explain", "198.19.13.5", "--proto", "udp", "--dport", &PORT.to_string()]);
    eprintln!("{text}");
    let first = text.lines().next().unwrap_or_default();
    assert!(first.contains("REFUSED by all") && first.contains("Retry-After"), "{text}");
    first_through_at(&rig, &stream(&rig, "198.19.13.5"), at, "aggregate");
}

/// A ban with expiry: denied by the entry (origin, time left), and through again at its end;
/// an allow-listed source over its policy's rate: allowed, every frame through.
#[test]
fn a_ban_is_named_until_its_expiry_and_an_allowed_source_passes() {
    require_root!();
    let rig = Rig::start(&[]).expect("the rig");
    rig.ctl_ok(&["policy", "set", "each", "--match", &format!("udp:{PORT}"), "--rate", "1000/s", "--burst", "100"]);
    rig.ctl_ok(&["deny", "add", "198.19.14.5", "--for", "2s"]);
    let (e, at) = refused(&rig, None, &["198.19.14.5", "--proto", "udp", "--dport", &PORT.to_string()]);
    assert_eq!(e["verdict"].as_str(), Some("denied"), "{e:#}");
    assert_eq!(e["by"].as_str(), Some("deny entry 198.19.14.5/32 (origin cli)"), "{e:#}");
    let entry = &e["entries"][0];
    assert_eq!((entry["list"].as_str(), entry["origin"].as_str()), (Some("deny"), Some("cli")), "{e:#}");
    let left = entry["expires_in_ms"].as_u64().expect("time left");
    assert!((1500..=2000).contains(&left), "{left} ms left of a 2 s ban");
    first_through_at(&rig, &stream(&rig, "198.19.14.5"), at, "ban");

    rig.ctl_ok(&["policy", "set", "each", "--rate", "1/s", "--burst", "3"]);
    rig.ctl_ok(&["allow", "add", "198.19.15.0/24"]);
    let allowed = stream(&rig, "198.19.15.5");
    let run =
        rig.flood(std::slice::from_ref(&allowed), Limits::timed(Duration::from_millis(300)), None).expect("flood");
    let flow = flow_of(&allowed);
    assert_eq!(run.delivered(&flow), run.sent(&flow), "the allow-listed source lost frames");
    let e = explain(&rig, &["198.19.15.5", "--proto", "udp", "--dport", &PORT.to_string()]);
    assert_eq!(e["verdict"].as_str(), Some("allowed"), "{e:#}");
    assert_eq!(e["by"].as_str(), Some("allow entry 198.19.15.0/24 (the config file)"), "{e:#}");
    assert_eq!(e["retry_after_ms"], Value::Null);
}

/// Collision collateral: with 16 host-scope buckets (two rows of 8) and 64 sources flooding, a
/// source that never sent shares each of its rows with flooders: `explain` says it is refused,
/// and warns that its key shares every row with other sources, naming sampled flooders.
#[test]
fn a_key_sharing_every_row_with_flooders_gets_a_warning() {
    require_root!();
    // Every refusal sampled, without the budget: each flooder's key is seen.
    let rig =
        Rig::start(&["--host-buckets", "16", "--host-rows", "2", "--sample-refusals", "1", "--samples-per-s", "0"])
            .expect("the rig");
    rig.ctl_ok(&["policy", "set", "each", "--match", &format!("udp:{PORT}"), "--rate", "1/s", "--burst", "3"]);
    let spoofed = rig.udp(Sources::Spoofed { prefix: "198.19.20.0/24".parse().expect("prefix"), count: 64 }, PORT);
    rig.flood(std::slice::from_ref(&spoofed), Limits::timed(Duration::from_millis(300)), None).expect("the flood");
    let e = explain(&rig, &["198.19.21.5", "--proto", "udp", "--dport", &PORT.to_string()]);
    assert_eq!(e["verdict"].as_str(), Some("refused"), "a quiet source behind full rows: {e:#}");
    let shared = e["policies"][0]["shared"].as_str().unwrap_or_else(|| panic!("no sharers named: {e:#}"));
    assert!(shared.contains("row 0: 198.19.20.") && shared.contains("row 1: 198.19.20."), "{shared}");
    let warnings = e["warnings"].as_array().expect("warnings");
    assert!(warnings.iter().any(|w| w.as_str().is_some_and(|w| w.contains("shares its bucket in every row"))), "{e:#}");
}

/// Asking changes nothing: every map the daemon pinned, the counters, and both bucket arrays
/// read the same before and after many questions (no traffic in between).
#[test]
fn asking_writes_nothing() {
    require_root!();
    let rig = Rig::start(&[]).expect("the rig");
    let m = format!("udp:{PORT}");
    rig.ctl_ok(&["policy", "set", "each", "--match", &m, "--rate", "1/s", "--burst", "3", "--scope", "cpu"]);
    rig.ctl_ok(&["policy", "set", "all", "--match", &m, "--rate", "5/s", "--burst", "5", "--key", "src/0"]);
    rig.ctl_ok(&["deny", "add", "198.19.16.9", "--for", "1h"]);
    rig.flood(&[stream(&rig, "198.19.16.5")], Limits::timed(Duration::from_millis(200)), None).expect("flood");
    let read = || {
        let d = &rig.daemon;
        (rig.snapshot(), d.current_buckets().expect("buckets"), d.host_buckets().expect("host buckets"))
    };
    let before = read();
    for addr in ["198.19.16.5", "198.19.16.9", "198.19.16.77", "2001:db8:16::5"] {
        for extra in [&["--proto", "udp", "--dport", "4100"][..], &["--syn", "--dport", "22"], &["--proto", "icmp"]] {
            let mut args = vec![addr];
            args.extend_from_slice(extra);
            explain(&rig, &args);
        }
    }
    let after = read();
    assert!(before.0 == after.0, "explain changed the rules or counters");
    assert!(before.1 == after.1, "explain changed a per-CPU bucket");
    assert!(before.2 == after.2, "explain changed a host-scope bucket");
}

/// Bad input: one line, exit 2, from the CLI (before any daemon is asked) and from the socket.
#[test]
fn bad_input_gets_one_line_and_exit_2() {
    require_root!();
    let rig = Rig::start(&[]).expect("the rig");
    for (args, says) in [
        (&["not-an-address"][..], "ADDR"),
        (&["198.19.17.5", "--dport", "70000"], "70000"),
        (&["198.19.17.5", "--sport", "65536"], "65536"),
        (&["198.19.17.5", "--proto", "udp", "--syn"], "--syn"),
        (&["198.19.17.5", "--proto", "icmp", "--dport", "80"], "ports"),
        (&["198.19.17.5", "--proto", "sctp"], "sctp"),
        (&["198.19.17.5", "--dst", "2001:db8::1"], "family"),
    ] {
        let mut all = vec!["explain"];
        all.extend_from_slice(args);
        let out = rig.daemon.ctl(&all).expect("running limiter-ctl");
        let lines = out.stderr_lines();
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        assert_eq!(lines.len(), 1, "{args:?}: one line: {lines:?}");
        assert!(lines[0].contains(says), "{args:?}: {lines:?}");
    }
    let answer =
        raw_request(&rig.scratch.socket(), r#"{"op":"explain","addr":"198.19.17.5","proto":"udp","syn":true}"#);
    assert!(answer.contains(r#""status":"usage""#) && answer.contains("--syn"), "{answer}");
    let answer = raw_request(&rig.scratch.socket(), r#"{"op":"explain","addr":"198.19.17.500"}"#);
    assert!(!answer.contains(r#""status":"ok""#), "{answer}");
}

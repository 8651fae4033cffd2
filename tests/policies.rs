//! Issue 3 end to end: named policies, allow/deny lists and the TOML config, driven through the
//! real `limiter-ctl` binary (daemon and CLI), enforced by the real XDP program on a veth pair.
//!
//! The daemon, its floods and their capture come from the shared [`limiter_tests::rig`]. What got
//! through is counted by an AF_PACKET capture on the receiver's veth end
//! ([`limiter_tests::capture`]), which sees exactly the frames XDP passed; what was sent is exact
//! too ([`limiter_tests::flood::Frames::sent_per_flow`]). Delivered counts are held to
//! `Gcra::bound` of the policy as this file computes it from the numbers it gave the CLI, per CPU
//! that judged the policy's packets (see [`limiter_tests::bounds`]); the policy the kernel holds
//! is checked to be that same GCRA. Floods are bounded by time ([`Limits::timed`]; a few by the
//! packet count that is their point, with a time limit too) and pinned to one CPU; bounds are
//! held to what was sent and when, whatever the machine's speed.

use std::{
    collections::BTreeMap,
    os::unix::fs::{FileTypeExt as _, MetadataExt as _},
    path::Path,
    time::{Duration, Instant},
};

use limiter_common::{
    Gcra,
    maps::{Counters, MAX_FRAME_WEIGHT, Policy},
};
use limiter_tests::{
    bounds::{check_bounds, check_lower_during, check_lower_weighted, check_overload, check_upper, first, stall_cost},
    daemon::{Ctl, Daemon, Rules, SIGNAL_TIMEOUT, Scratch, limiter_ctl_binary, xdp_program_id},
    flood::{Flow, L4, Limits, Stream},
    netns::TestNet,
    require_root,
    rig::{Flooding, Rig, Run, SEC, flow_of},
};
use nix::sys::signal::Signal;
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// 1. Each policy field

/// `--match` by protocol, exact port and port range, over IPv4 and IPv6: each flow is judged by
/// its own policy (each has a different rate, so a mix-up breaks a bound), and UDP that no
/// policy matches passes untouched and is counted as unmatched.
#[test]
fn protocol_port_and_range_each_select_their_policy() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let pols = [
        Pol::new("web", "tcp", 300, 30),
        Pol::new("ping", "icmp", 200, 20),
        Pol::new("dns", "udp:7000", 500, 50),
        Pol::new("games", "udp:7100-7199", 400, 40),
    ];
    rig.set_all(&pols);
    let judged = [
        ("web", rig.stream(L4::TcpSyn, 80, "198.19.1.1")),
        ("web", rig.stream(L4::TcpSyn, 443, "2001:db8:1::1")),
        ("ping", rig.stream(L4::IcmpEcho, 0, "198.19.1.2")),
        ("ping", rig.stream(L4::IcmpEcho, 0, "2001:db8:1::2")),
        ("dns", rig.stream(L4::Udp, 7000, "198.19.1.3")),
        ("dns", rig.stream(L4::Udp, 7000, "2001:db8:1::3")),
        ("games", rig.stream(L4::Udp, 7100, "198.19.1.4")),
        ("games", rig.stream(L4::Udp, 7150, "2001:db8:1::4")),
        ("games", rig.stream(L4::Udp, 7199, "198.19.1.5")),
    ];
    // Next to the range and the exact port, but no policy covers them (there is no `udp`).
    let unmatched = [rig.stream(L4::Udp, 7200, "198.19.1.6"), rig.stream(L4::Udp, 6999, "2001:db8:1::6")];
    let streams: Vec<Stream> = judged.iter().map(|(_, s)| s.clone()).chain(unmatched.iter().cloned()).collect();

    let run = rig.counted_flood(&streams, Limits::timed(Duration::from_secs(1)));
    eprintln!("match: {}", run.report);
    check_overload(&run.report, 500.0, streams.len());
    for pol in &pols {
        let flows: Vec<Flow> = judged.iter().filter(|(n, _)| *n == pol.name).map(|(_, s)| flow_of(s)).collect();
        // Each flow comes from its own source: its own bucket.
        let groups: Vec<Vec<Flow>> = flows.iter().map(|f| vec![*f]).collect();
        rig.check_policy(pol, &run, &groups);
    }
    let unmatched: Vec<Flow> = unmatched.iter().map(flow_of).collect();
    for flow in &unmatched {
        assert_eq!(run.delivered(flow), run.sent(flow), "unmatched {flow:?}: not everything got through");
    }
    let sent_unmatched: u64 = unmatched.iter().map(|f| run.sent(f)).sum();
    rig.check_unjudged(sent_unmatched, &run);
}

/// `--key`: sources in one /24 (IPv4) or /56 (IPv6) share one allowance under `src/24,/56`;
/// under the default `src/32,/64` each IPv4 source has its own and one /64 shares; with `+dport`
/// one source has an allowance per destination port, without it one for the whole range.
#[test]
fn key_prefixes_and_dport_share_or_split_allowances() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let pols = [
        Pol::new("p24", "udp:7000", 300, 30).key("src/24,/56"),
        Pol::new("p32", "udp:7001", 300, 30),
        Pol::new("dport", "udp:7100-7101", 300, 30).key("src+dport"),
        Pol::new("nodport", "udp:7200-7201", 300, 30),
    ];
    rig.set_all(&pols);
    let s = |port, src| rig.stream(L4::Udp, port, src);
    // Each inner list is one expected bucket.
    let plan: [(&str, Vec<Vec<Stream>>); 4] = [
        (
            "p24",
            vec![
                vec![s(7000, "198.19.1.1"), s(7000, "198.19.1.200")],
                vec![s(7000, "2001:db8:1:100::1"), s(7000, "2001:db8:1:1ff::2")],
            ],
        ),
        (
            "p32",
            vec![
                vec![s(7001, "198.19.2.1")],
                vec![s(7001, "198.19.2.2")],
                vec![s(7001, "2001:db8:2::1"), s(7001, "2001:db8:2::1:1")],
                vec![s(7001, "2001:db8:2:1::1")],
            ],
        ),
        ("dport", vec![vec![s(7100, "198.19.3.1")], vec![s(7101, "198.19.3.1")]]),
        ("nodport", vec![vec![s(7200, "198.19.4.1"), s(7201, "198.19.4.1")]]),
    ];
    let streams: Vec<Stream> = plan.iter().flat_map(|(_, groups)| groups.iter().flatten().cloned()).collect();
    let run = rig.counted_flood(&streams, Limits::timed(Duration::from_secs(1)));
    eprintln!("keys: {}", run.report);
    check_overload(&run.report, 300.0, streams.len());
    for (pol, (name, groups)) in pols.iter().zip(&plan) {
        assert_eq!(pol.name, *name);
        let groups: Vec<Vec<Flow>> = groups.iter().map(|g| g.iter().map(flow_of).collect()).collect();
        rig.check_policy(pol, &run, &groups);
    }
    rig.check_unjudged(0, &run);
}

/// `--rate` and `--burst` as bounds, and `--unit bytes` against a bound in bytes: a big burst is
/// granted at once (the lower bound needs it), a burst of 1 still lets the rate through, and a
/// byte policy charges each frame's length (frames of two sizes from one source).
#[test]
fn rate_burst_and_byte_unit_hold_to_their_bounds() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let big_burst = Pol::new("bigburst", "udp:7000", 200, 400);
    // With no burst to catch up from, any stall of the sender longer than the 10 ms emission
    // interval would cost admissions for good: a slow rate keeps the lower bound about the limiter.
    let no_burst = Pol::new("noburst", "udp:7001", 100, 1);
    // 60,000 bytes/s is about 200 frames/s of the mix: as packets it would admit everything.
    let bytes = Pol::new("bytes", "udp:7002", 60_000, 6_000).bytes();
    rig.set_all(&[big_burst.clone(), no_burst.clone(), bytes.clone()]);
    let small = rig.stream(L4::Udp, 7002, "198.19.3.1");
    let mut big = small.clone();
    big.spec.payload = 500;
    let streams =
        [rig.stream(L4::Udp, 7000, "198.19.1.1"), rig.stream(L4::Udp, 7001, "198.19.2.1"), small.clone(), big];
    let run = rig.counted_flood(&streams, Limits::timed(Duration::from_secs(1)));
    eprintln!("rate/burst/bytes: {}", run.report);
    check_overload(&run.report, 200.0, streams.len());
    for (pol, stream) in [(&big_burst, &streams[0]), (&no_burst, &streams[1])] {
        rig.check_policy(pol, &run, &[vec![flow_of(stream)]]);
    }

    // Bytes: the two sizes share one flow (same source, protocol and port), so one bucket.
    let flow = flow_of(&small);
    let id = rig.policy_id("bytes");
    rig.check_installed(&bytes, id);
    let judged = rig.judged(&run, id);
    let got = run.captured.bytes(|f| *f == flow);
    check_upper("bytes delivered", got, &bytes.gcra(), judged.cpus.len(), run.window());
    // Each stall can cost up to one whole frame on top of the time.
    check_lower_weighted("bytes delivered", got, &bytes.gcra(), &run.report, big_frame_len(&run, &flow));
    assert_eq!(judged.total.admitted_bytes, got, "admitted bytes vs bytes delivered");
    assert_eq!(judged.total.admitted_packets, run.delivered(&flow), "admitted frames vs frames delivered");
    assert_eq!(judged.total.admitted_packets + judged.total.refused_packets, run.sent(&flow), "judged vs sent");
    let sizes: Vec<u64> = run.captured.seen.iter().filter(|s| s.flow == flow).map(|s| s.len).collect();
    assert!(sizes.contains(&60) && sizes.contains(&542), "both frame sizes should get through sometimes");
    rig.check_unjudged(0, &run);
}

/// `--dry-run`: everything is delivered; what would have been admitted stays within the bound,
/// and the rest is counted as dry-run (would have been refused), none as refused.
#[test]
fn dry_run_passes_everything_and_counts_what_it_would_refuse() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let pol = Pol::new("watch", "udp:7000", 1000, 100).dry_run();
    rig.set_all(std::slice::from_ref(&pol));
    let stream = rig.stream(L4::Udp, 7000, "198.19.1.1");
    // Bounded in packets: all of them reach the capture.
    const FRAMES: u64 = 20_000;
    let run = rig.counted_flood(std::slice::from_ref(&stream), Limits::counted(FRAMES, Duration::from_secs(10)));
    eprintln!("dry run: {}", run.report);
    check_sent_all(&run, FRAMES, "a dry-run policy's counts");
    check_overload(&run.report, 1000.0, 1);
    let flow = flow_of(&stream);
    let id = rig.policy_id("watch");
    rig.check_installed(&pol, id);
    let judged = rig.judged(&run, id);
    let t = judged.total;
    eprintln!("  {judged}; dry-run {}", t.dry_run_packets);
    assert_eq!(run.sent(&flow), FRAMES);
    assert_eq!(run.delivered(&flow), run.sent(&flow), "a dry-run policy must pass everything");
    assert_eq!(t.refused_packets, 0, "a dry-run policy refused packets");
    assert_eq!(t.admitted_packets + t.dry_run_packets, run.sent(&flow), "judged vs sent");
    assert_eq!(t.dry_run_bytes, t.dry_run_packets * 60, "dry-run bytes of 60-byte frames");
    check_bounds("would have admitted", t.admitted_packets, &pol.gcra(), judged.cpus.len(), run.window(), &run.report);
    rig.check_unjudged(0, &run);
}

// ---------------------------------------------------------------------------------------------
// 2. Precedence

/// Exact port > range > protocol > any: UDP to 53, 55 and 61, TCP to 53 and ICMP land in the
/// right policies' counters, exactly. After removing `any` and the exact port, port 53 falls to
/// the range, and TCP and ICMP pass untouched, counted as unmatched.
#[test]
fn precedence_is_exact_port_then_range_then_protocol_then_any() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let pols = [
        Pol::new("exact", "udp:53", 400, 40),
        Pol::new("range", "udp:50-60", 300, 30),
        Pol::new("proto", "udp", 200, 20),
        Pol::new("all", "any", 100, 10),
    ];
    rig.set_all(&pols);
    let s = |l4, port, src| rig.stream(l4, port, src);
    let plan = [
        ("exact", s(L4::Udp, 53, "198.19.1.1")),
        ("range", s(L4::Udp, 55, "198.19.1.2")),
        ("proto", s(L4::Udp, 61, "2001:db8:1::3")),
        ("all", s(L4::TcpSyn, 53, "198.19.1.4")),
        ("all", s(L4::IcmpEcho, 0, "2001:db8:1::5")),
    ];
    let streams: Vec<Stream> = plan.iter().map(|(_, s)| s.clone()).collect();
    let run = rig.counted_flood(&streams, Limits::timed(Duration::from_millis(700)));
    eprintln!("precedence: {}", run.report);
    check_overload(&run.report, 400.0, streams.len());
    for pol in &pols {
        let groups: Vec<Vec<Flow>> =
            plan.iter().filter(|(n, _)| *n == pol.name).map(|(_, s)| vec![flow_of(s)]).collect();
        rig.check_policy(pol, &run, &groups);
    }
    rig.check_unjudged(0, &run);

    rig.ctl_ok(&["policy", "rm", "all"]);
    rig.ctl_ok(&["policy", "rm", "exact"]);
    let (udp53, tcp, icmp) = (streams[0].clone(), streams[3].clone(), streams[4].clone());
    let run = rig.counted_flood(&[udp53.clone(), tcp.clone(), icmp.clone()], Limits::timed(Duration::from_millis(500)));
    eprintln!("after rm: {}", run.report);
    let to_range = rig.judged(&run, rig.policy_id("range")).total;
    let flow53 = flow_of(&udp53);
    assert_eq!(to_range.admitted_packets + to_range.refused_packets, run.sent(&flow53), "udp:53 now judged by 'range'");
    assert_eq!(to_range.admitted_packets, run.delivered(&flow53), "admitted by 'range' vs delivered");
    let passing = [flow_of(&tcp), flow_of(&icmp)];
    for flow in &passing {
        assert_eq!(run.delivered(flow), run.sent(flow), "{flow:?} matches nothing now: all of it must pass");
    }
    let unmatched = rig.judged(&run, 0).total.unmatched;
    assert_eq!(unmatched, passing.iter().map(|f| run.sent(f)).sum::<u64>(), "unmatched count vs TCP+ICMP sent");
}

// ---------------------------------------------------------------------------------------------
// 3. Changing a rate mid-flood

/// `policy set` on a running policy with a new rate: from 1 s after the command on, the policy
/// admits at the new rate (and before it, at the old one). Another policy flooded all along keeps
/// its counters and its bucket: it stays within its own bound over the whole run, which a
/// refilled bucket (a second burst) would break.
#[test]
fn a_rate_changed_mid_flood_applies_within_a_second() {
    require_root!();
    const CHANGE_AT: Duration = Duration::from_millis(500);
    /// The flood goes on this long after the change was answered (it is stopped then), so the new
    /// rate is watched for 1 s whatever the machine's speed and however long the change took.
    const AFTER: Duration = Duration::from_secs(2);
    /// The least the flood must run past the command for the new rate to be tested.
    const NEEDED: Duration = Duration::from_millis(1300);
    /// Frames are timed when the capture reads them, a little after XDP passed them.
    const CAPTURE_LAG: Duration = Duration::from_millis(50);
    let rig = Rig::start(&[]).expect("starting the rig");
    let old = Pol::new("changing", "udp:7000", 2000, 50);
    let new = Pol::new("changing", "udp:7000", 500, 50);
    // A burst that dominates the rate: a bucket refilled mid-run would show at once.
    let other = Pol::new("steady", "udp:7001", 200, 400);
    rig.set_all(&[old.clone(), other.clone()]);
    let (a, b) = (rig.stream(L4::Udp, 7000, "198.19.1.1"), rig.stream(L4::Udp, 7001, "198.19.2.1"));
    let (flow_a, flow_b) = (flow_of(&a), flow_of(&b));

    // Bounded by time (a safety limit far beyond what the test waits) and stopped by the test.
    let limits = Limits::timed(CHANGE_AT + AFTER + Duration::from_secs(30));
    let flooding = rig.start_counted_flood(&[a, b], limits, None).expect("starting the flood");
    std::thread::sleep(CHANGE_AT);
    let issued = Instant::now();
    rig.set(&new);
    let answered = Instant::now();
    std::thread::sleep(AFTER);
    flooding.stop();
    let run = finish(flooding);
    eprintln!("rate change: {}; the change took {:?}", run.report, answered - issued);
    check_overload(&run.report, 2000.0, 2);
    let start = first(&run.report);
    let end = run.report.last.expect("a flood records its end");
    assert!(
        issued + NEEDED < end,
        "the flood ended {:?} after the command, under the {NEEDED:?} needed ({}): the sender stopped early, \
         the machine's fault, not the limiter's",
        end.saturating_duration_since(issued),
        run.report
    );

    let id = rig.policy_id("changing");
    rig.check_installed(&new, id);
    let judged = rig.judged(&run, id);
    let cpus = judged.cpus.len();
    let is_a = |f: &Flow| *f == flow_a;
    let before = run.captured.between(is_a, start, issued);
    // Captured before the command, so admitted before it: under the old rate throughout.
    check_upper("old rate, before the change", before, &old.gcra(), cpus, issued - start);
    check_lower_during("old rate, before the change", before, &old.gcra(), issued - start, &run.report, 1);
    let settled = issued + Duration::from_secs(1);
    let after = run.captured.between(is_a, settled, Instant::now());
    // Captured from `settled` on, so admitted from `settled - CAPTURE_LAG` on.
    let after_window = run.captured.last().unwrap_or(end).saturating_duration_since(settled) + CAPTURE_LAG;
    check_upper("new rate, from 1 s after the change", after, &new.gcra(), cpus, after_window);
    // The bucket is spent when the window opens: no burst on top of the rate there; the sender's
    // stalls may have cost some of the rate.
    let watched = end - settled;
    let rate_only = new.per_sec as f64 * watched.as_secs_f64();
    let lost = stall_cost(&new.gcra(), &run.report, 1) as f64;
    let least = (rate_only - lost) * 0.9;
    assert!(
        after as f64 >= least,
        "new rate: admitted {after} from 1 s after the change to the end ({watched:?}), under 90% of \
         {rate_only:.0} (the new rate over that time) less {lost:.0} for the sender's stalls = {least:.0}: the \
         limiter refused what its new rate allows (flood: {})",
        run.report
    );
    let soon = run.captured.between(is_a, answered, settled);
    eprintln!("  (for information: {soon} admitted between the answer and 1 s after the command)");
    // Replacing keeps the counters: they cover the whole run.
    assert_eq!(
        judged.total.admitted_packets + judged.total.refused_packets,
        run.sent(&flow_a),
        "'changing' judged vs sent"
    );
    assert_eq!(judged.total.admitted_packets, run.delivered(&flow_a), "'changing' admitted vs delivered");

    rig.check_policy(&other, &run, &[vec![flow_b]]);
}

// ---------------------------------------------------------------------------------------------
// 4. Allow and deny lists

/// Allowed sources are never refused (all delivered, counted as allowed), denied ones always
/// dropped (none delivered, counted as denied), IPv4 and IPv6, and the longest prefix wins both
/// ways: an allowed /24 inside a denied /16, an allowed /64 inside a denied /48. The lists apply
/// to traffic no policy matches too (ICMP here: the only policy is `udp`), counted under id 0.
#[test]
fn allow_and_deny_lists_with_longest_prefix_winning() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let pol = Pol::new("udp", "udp", 100, 10);
    rig.set_all(std::slice::from_ref(&pol));
    for (list, cidr) in [
        ("deny", "198.19.0.0/16"),
        ("allow", "198.19.10.0/24"),
        ("deny", "2001:db8:d::/48"),
        ("allow", "2001:db8:d:a::/64"),
    ] {
        rig.ctl_ok(&[list, "add", cidr]);
    }
    assert_eq!(list_json(&rig, "allow"), vec!["198.19.10.0/24", "2001:db8:d:a::/64"]);
    assert_eq!(list_json(&rig, "deny"), vec!["198.19.0.0/16", "2001:db8:d::/48"]);
    let acl = rig.snapshot().rules.acl;
    let expected: BTreeMap<String, &str> = [
        ("198.19.0.0/16", "deny"),
        ("198.19.10.0/24", "allow"),
        ("2001:db8:d::/48", "deny"),
        ("2001:db8:d:a::/64", "allow"),
    ]
    .into_iter()
    .map(|(n, a)| (n.to_string(), a))
    .collect();
    assert_eq!(acl, expected, "the kernel's tries");

    let s = |l4, src| rig.stream(l4, 7000, src);
    let allowed = [s(L4::Udp, "198.19.10.5"), s(L4::Udp, "2001:db8:d:a::5")];
    let denied = [s(L4::Udp, "198.19.20.5"), s(L4::Udp, "2001:db8:d:b::5")];
    let limited = [s(L4::Udp, "198.18.200.5"), s(L4::Udp, "2001:db8:e::5")];
    let unmatched_allowed = s(L4::IcmpEcho, "198.19.10.6");
    let unmatched_denied = s(L4::IcmpEcho, "2001:db8:d:c::6");
    let streams: Vec<Stream> =
        allowed.iter().chain(&denied).chain(&limited).chain([&unmatched_allowed, &unmatched_denied]).cloned().collect();
    // Bounded in packets: every allowed frame reaches the capture.
    const FRAMES: u64 = 40_000;
    let run = rig.counted_flood(&streams, Limits::counted(FRAMES, Duration::from_secs(10)));
    eprintln!("lists: {}", run.report);
    check_sent_all(&run, FRAMES, "the lists");
    check_overload(&run.report, 100.0, streams.len());
    let f = flow_of;
    for stream in allowed.iter().chain([&unmatched_allowed]) {
        assert_eq!(run.delivered(&f(stream)), run.sent(&f(stream)), "allowed {:?} was refused", f(stream));
    }
    for stream in denied.iter().chain([&unmatched_denied]) {
        assert!(run.sent(&f(stream)) > 0);
        assert_eq!(run.delivered(&f(stream)), 0, "denied {:?} got through", f(stream));
    }
    let groups: Vec<Vec<Flow>> = limited.iter().map(|s| vec![f(s)]).collect();
    let id = rig.policy_id("udp");
    rig.check_installed(&pol, id);
    let judged = rig.judged(&run, id);
    for group in &groups {
        let got = run.delivered(&group[0]);
        check_bounds(&format!("{:?}", group[0]), got, &pol.gcra(), judged.cpus.len(), run.window(), &run.report);
    }
    let sum = |streams: &[Stream]| streams.iter().map(|s| run.sent(&f(s))).sum::<u64>();
    let t = judged.total;
    assert_eq!(t.allowed_packets, sum(&allowed), "'udp' allowed count");
    assert_eq!(t.denied_packets, sum(&denied), "'udp' denied count");
    assert_eq!(t.admitted_packets + t.refused_packets, sum(&limited), "'udp' judged by rate");
    assert_eq!(t.admitted_packets, groups.iter().map(|g| run.delivered(&g[0])).sum::<u64>(), "admitted vs delivered");
    let none = rig.judged(&run, 0).total;
    assert_eq!(none.allowed_packets, run.sent(&f(&unmatched_allowed)), "id 0 allowed count");
    assert_eq!(none.denied_packets, run.sent(&f(&unmatched_denied)), "id 0 denied count");
    assert_eq!(none.unmatched, 0, "listed ICMP must not count as unmatched");
    // The CLI reports the same counters.
    let shown = rig.show("udp");
    assert_eq!(shown["counters"]["allowed_packets"], Value::from(t.allowed_packets), "{shown}");
    assert_eq!(shown["counters"]["denied_packets"], Value::from(t.denied_packets), "{shown}");
    run.check_capture();
}

// ---------------------------------------------------------------------------------------------
// 5. Persistence

/// Policies and lists survive a restart: stopped with SIGINT and started again on the same
/// config, the daemon lists the same policies and lists, puts the same rules in the kernel (all
/// but the salt), leaves the file alone, and enforces the same way.
#[test]
fn policies_and_lists_survive_a_restart() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let pols = [
        Pol::new("a", "udp:7000", 300, 30).key("src/24"),
        Pol::new("b", "tcp", 200, 20).dry_run(),
        Pol::new("c", "any", 100_000, 70_000).bytes(),
    ];
    rig.set_all(&pols);
    rig.ctl_ok(&["allow", "add", "198.19.10.0/24"]);
    rig.ctl_ok(&["deny", "add", "2001:db8:d::/48"]);
    // Before any traffic: the restarted daemon (a new program) starts its counters from zero too.
    let listed = rig.ctl_ok(&["policy", "list", "--json"]);
    let lists = (list_json(&rig, "allow"), list_json(&rig, "deny"));
    let rules = rig.snapshot().rules;
    let file = rig.scratch.config_file().expect("config").expect("the daemon wrote its config");
    let s = |l4, port, src| rig.stream(l4, port, src);
    let streams = [
        s(L4::Udp, 7000, "198.19.1.1"),
        s(L4::Udp, 7000, "198.19.1.2"),
        s(L4::TcpSyn, 80, "198.19.2.1"),
        s(L4::Udp, 7000, "198.19.10.1"),
        s(L4::Udp, 7000, "2001:db8:d::1"),
    ];
    check_enforced(&rig, &pols[0], &streams, "first daemon");

    let mut rig = rig;
    rig.daemon.stop_ok();
    rig.restart(&[]).expect("restarting the daemon");
    assert_eq!(rig.ctl_ok(&["policy", "list", "--json"]), listed, "`policy list --json` after the restart");
    assert_eq!((list_json(&rig, "allow"), list_json(&rig, "deny")), lists, "lists after the restart");
    assert_eq!(rig.snapshot().rules.unsalted(), rules.unsalted(), "kernel rules after the restart");
    assert_eq!(rig.scratch.config_file().expect("config").as_ref(), Some(&file), "the restart rewrote the file");
    // Written by rename from a temporary file: none may be left behind.
    let mut names: Vec<String> = std::fs::read_dir(rig.scratch.path())
        .expect("listing the scratch directory")
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()
        .expect("listing the scratch directory");
    names.sort();
    assert_eq!(names, vec!["ctl.sock", "limiter.toml"], "files beside the config");
    check_enforced(&rig, &pols[0], &streams, "restarted daemon");
}

/// The restart test's flood: two sources of one /24 share `a`'s allowance, dry-run TCP all
/// passes, the allowed source all passes, the denied one never does.
fn check_enforced(rig: &Rig, a: &Pol, streams: &[Stream; 5], round: &str) {
    let run = rig.counted_flood(streams, Limits::timed(Duration::from_millis(500)));
    eprintln!("{round}: {}", run.report);
    check_overload(&run.report, 300.0, streams.len());
    let f = |i: usize| flow_of(&streams[i]);
    rig.check_policy(a, &run, &[vec![f(0), f(1)]]);
    assert_eq!(run.delivered(&f(2)), run.sent(&f(2)), "{round}: dry-run TCP must all pass");
    assert_eq!(run.delivered(&f(3)), run.sent(&f(3)), "{round}: allowed source refused");
    assert_eq!(run.delivered(&f(4)), 0, "{round}: denied source got through");
}

/// SIGHUP re-reads the file: a valid hand edit is applied (listed, in the kernel, enforced); an
/// edit that does not parse or does not validate is refused with "reload failed", the running
/// rules stay exactly as they were, and the daemon keeps serving.
#[test]
fn sighup_applies_a_valid_edit_and_keeps_running_on_a_bad_one() {
    require_root!();
    let mut rig = Rig::start(&[]).expect("starting the rig");
    rig.set(&Pol::new("dns", "udp:53", 300, 30));
    let edited = "# edited by hand\n\
        allow = [\"198.19.10.0/24\"]\n\n\
        [[policy]]\nname = \"dns\"\nmatch = \"udp:53\"\nrate = \"400/s\"\nburst = 40\n\n\
        [[policy]]\nname = \"web\"\nmatch = \"tcp:80\"\nrate = \"150/s\"\nburst = 15\n";
    std::fs::write(rig.scratch.config(), edited).expect("editing the config");
    rig.hup("reloaded");
    let (dns, web) = (Pol::new("dns", "udp:53", 400, 40), Pol::new("web", "tcp:80", 150, 15));
    let names: Vec<String> =
        policies_json(&rig).iter().map(|d| d["name"].as_str().unwrap_or_default().to_string()).collect();
    assert_eq!(names, vec!["dns", "web"]);
    let (dns_id, web_id) = (rig.policy_id("dns"), rig.policy_id("web"));
    rig.check_installed(&dns, dns_id);
    rig.check_installed(&web, web_id);
    assert_eq!(list_json(&rig, "allow"), vec!["198.19.10.0/24"]);
    let streams = [rig.stream(L4::TcpSyn, 80, "198.19.1.1"), rig.stream(L4::Udp, 53, "198.19.10.1")];
    let run = rig.counted_flood(&streams, Limits::timed(Duration::from_millis(500)));
    eprintln!("after reload: {}", run.report);
    check_overload(&run.report, 150.0, streams.len());
    rig.check_policy(&web, &run, &[vec![flow_of(&streams[0])]]);
    let allowed = flow_of(&streams[1]);
    assert_eq!(run.delivered(&allowed), run.sent(&allowed), "the reloaded allow list");

    let bad_edits = [
        ("a syntax error", "[[policy]\nname = \"dns\"\n"),
        ("an unknown key", "[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nspeed = 3\n"),
        ("a wrong type", "[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nburst = \"ten\"\n"),
        (
            "a clash",
            "[[policy]]\nname = \"x\"\nmatch = \"udp\"\nrate = \"1/s\"\n\n[[policy]]\nname = \"y\"\nmatch = \"udp\"\nrate = \"2/s\"\n",
        ),
        ("host bits", "deny = [\"198.19.0.1/16\"]\n"),
    ];
    for (what, text) in bad_edits {
        let listed = rig.ctl_ok(&["policy", "list", "--json"]);
        let rules = rig.snapshot().rules;
        std::fs::write(rig.scratch.config(), text).expect("editing the config");
        rig.hup("reload failed");
        assert!(rig.daemon.is_running(), "{what}: the daemon exited:\n{}", rig.daemon.output());
        assert_eq!(rig.snapshot().rules, rules, "{what}: the kernel rules changed");
        assert_eq!(rig.ctl_ok(&["policy", "list", "--json"]), listed, "{what}: `policy list --json` changed");
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Bad input

/// Every kind of bad input through the real CLI: exit code 2, exactly one line on stderr naming
/// the field (or the policy or network at fault), and neither the config file nor the kernel
/// maps change.
#[test]
fn bad_input_exits_2_with_one_line_and_changes_nothing() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    rig.set_all(&[
        Pol::new("dns", "udp:53", 300, 30),
        Pol::new("web", "tcp:80-89", 300, 30),
        Pol::new("all", "any", 100, 10),
    ]);
    rig.ctl_ok(&["deny", "add", "198.19.0.0/16"]);
    rig.ctl_ok(&["allow", "add", "198.19.10.0/24"]);
    check_good_input_works(&rig);
    let missing_iface = format!("{}-nope", rig.net.receiver.iface);
    let other_config = rig.scratch.path().join("other.toml");
    let other_config = other_config.to_string_lossy();
    let long_name = "x".repeat(33);
    let set = |extra: &[&str]| -> Vec<String> {
        ["policy", "set", "p", "--rate", "10/s"].iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let args = |a: &[&str]| -> Vec<String> { a.iter().map(|s| s.to_string()).collect() };
    // (arguments, what the one line must name)
    let cases: Vec<(Vec<String>, &str)> = vec![
        (args(&["policy", "set", "p"]), "--rate"),
        (args(&["policy", "set", "p", "--rate", "10/d"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "0/s"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "1.5/s"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "ten/s"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "10"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "2000000000000/s"]), "rate"),
        (set(&["--burst", "0"]), "burst"),
        (set(&["--burst", "1.5"]), "burst"),
        (set(&["--burst", "-1"]), "burst"),
        (args(&["policy", "set", "p", "--rate", "1/h", "--burst", "2000000"]), "burst"),
        (set(&["--match", "udp:0"]), "match"),
        (set(&["--match", "udp:65536"]), "match"),
        (set(&["--match", "tcp:"]), "match"),
        (set(&["--match", "sctp"]), "match"),
        (set(&["--match", "icmp:1"]), "match"),
        (set(&["--match", "any:53"]), "match"),
        (set(&["--match", "udp:9-8"]), "match"),
        (set(&["--match", "udp:1-70000"]), "match"),
        (set(&["--match", "tcp:80,81"]), "match"),
        (set(&["--key", "src/33"]), "key"),
        (set(&["--key", "src/24,/129"]), "key"),
        (set(&["--key", "dst/24"]), "key"),
        (set(&["--key", "src/24+sport"]), "key"),
        (set(&["--unit", "frames"]), "unit"),
        (args(&["policy", "set", "_p", "--rate", "1/s"]), "name"),
        (args(&["policy", "set", "has space", "--rate", "1/s"]), "name"),
        (args(&["policy", "set", &long_name, "--rate", "1/s"]), "name"),
        (args(&["policy", "set", "a/b", "--rate", "1/s"]), "name"),
        (args(&["policy", "rm", "a/b"]), "name"),
        (args(&["policy", "frob"]), "frob"),
        (args(&["frob"]), "frob"),
        (set(&["--bogus"]), "--bogus"),
        (args(&["policy", "list", "--yaml"]), "--yaml"),
        (args(&["allow", "add", "198.18.0.0/33"]), "cidr"),
        (args(&["allow", "add", "198.18.0.0"]), "cidr"),
        (args(&["deny", "add", "2001:db8::/129"]), "cidr"),
        (args(&["deny", "add", "not-a-network"]), "cidr"),
        (args(&["allow", "add", "198.19.10.1/24"]), "host bits"),
        (args(&["deny", "add", "2001:db8::1/32"]), "host bits"),
        (args(&["completions", "fish2"]), "shell"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--burst", "5"]), "--rate"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--buckets", "100"]), "bucket"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config]), &missing_iface),
        // Refused by the daemon: the form is fine, the request is not.
        (set(&["--match", "udp:53"]), "dns"),
        (set(&["--match", "tcp:85-95"]), "web"),
        (set(&["--match", "any"]), "all"),
        (args(&["policy", "rm", "nosuch"]), "nosuch"),
        (args(&["policy", "show", "nosuch"]), "nosuch"),
        (args(&["allow", "add", "198.19.0.0/16"]), "deny"),
        (args(&["deny", "add", "198.19.10.0/24"]), "allow"),
        (args(&["allow", "rm", "198.18.0.0/24"]), "198.18.0.0/24"),
        (args(&["deny", "rm", "2001:db8::/32"]), "2001:db8::/32"),
    ];
    let file = rig.scratch.config_file().expect("config").expect("the daemon wrote its config");
    let maps = rig.snapshot();
    let mut failures = Vec::new();
    for (args, field) in &cases {
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = rig.daemon.ctl(&argv).expect("running limiter-ctl");
        if let Some(problem) = bad_input_problem(&out, field) {
            failures.push(format!("limiter-ctl {}: {problem}", args.join(" ")));
        }
        assert_eq!(
            rig.scratch.config_file().expect("config").as_ref(),
            Some(&file),
            "{args:?} changed the config file"
        );
        let now = rig.snapshot();
        assert_eq!(now.rules, maps.rules, "{args:?} changed the kernel's rules");
        assert_eq!(now.counters[1..], maps.counters[1..], "{args:?} changed policy counters");
    }
    assert!(!Path::new(&*other_config).exists(), "a refused daemon wrote its config");
    assert!(
        failures.is_empty(),
        "{} of {} bad inputs were not reported as required:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Positive controls for the bad-input table: the same commands, well formed, succeed, and the
/// read commands print what was set in both forms.
fn check_good_input_works(rig: &Rig) {
    let table = rig.ctl_ok(&["policy", "list"]);
    for name in ["NAME", "dns", "udp:53", "web", "tcp:80-89", "all"] {
        assert!(table.contains(name), "`policy list` lacks {name}:\n{table}");
    }
    let shown = rig.ctl_ok(&["policy", "show", "web"]);
    assert!(shown.contains("tcp:80-89") && shown.contains("300/s"), "`policy show web`:\n{shown}");
    assert_eq!(rig.show("web")["match"], "tcp:80-89");
    assert_eq!(rig.ctl_ok(&["deny", "list"]).trim(), "198.19.0.0/16");
    assert_eq!(list_json(rig, "allow"), vec!["198.19.10.0/24"]);
    let script = rig.ctl_ok(&["completions", "bash"]);
    assert!(script.contains("limiter-ctl") && script.contains("policy"), "no bash completions");
}

/// What is wrong with how the CLI refused bad input, if anything.
fn bad_input_problem(out: &Ctl, field: &str) -> Option<String> {
    let lines = out.stderr_lines();
    if out.code != Some(2) {
        return Some(format!("exit {:?}, expected 2; stderr {:?}", out.code, out.stderr));
    }
    if lines.len() != 1 {
        return Some(format!("{} lines on stderr, expected 1: {:?}", lines.len(), out.stderr));
    }
    if !lines[0].to_lowercase().contains(&field.to_lowercase()) {
        return Some(format!("the line does not name '{field}': {:?}", lines[0]));
    }
    None
}

/// A config that does not parse stops the daemon before anything happens: exit 2, one line with
/// PATH:LINE:COL, no XDP program on the interface, no socket, the file untouched.
#[test]
fn a_bad_config_at_start_aborts_with_its_position() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch directory");
    // (what, text, line of the error)
    let cases = [
        ("a syntax error", "allow = [\"198.18.0.0/24\"]\n[[policy]\nname = \"a\"\n", 2),
        ("an unknown key", "[[policy]]\nname = \"a\"\nrate = \"10/s\"\nspeed = 3\n", 4),
        ("a wrong type", "[[policy]]\nname = \"a\"\nrate = \"10/s\"\nburst = \"ten\"\n", 4),
        ("a bad rate", "\n[[policy]]\nname = \"a\"\nrate = \"10/d\"\n", 4),
        ("a bad match", "[[policy]]\nname = \"a\"\nmatch = \"udp:0\"\nrate = \"10/s\"\n", 3),
        ("a bad CIDR", "deny = [\"198.19.0.0/16\", \"2001:db8::/129\"]\n", 1),
    ];
    let path = scratch.config();
    for (what, text, line) in cases {
        let out = Daemon::refused_start(&net.receiver, &scratch, &[], text).unwrap_or_else(|e| panic!("{what}: {e:#}"));
        let errors: Vec<&str> = out.lines().filter(|l| l.starts_with("stderr: ")).collect();
        assert_eq!(errors.len(), 1, "{what}: expected one line on stderr:\n{out}");
        let position = format!("{}:{line}:", path.display());
        let after = errors[0].split_once(&position).map(|(_, rest)| rest);
        let column_ok = after
            .and_then(|r| r.split_once(':'))
            .is_some_and(|(col, _)| !col.is_empty() && col.chars().all(|c| c.is_ascii_digit()));
        assert!(column_ok, "{what}: no {position}COL: in {:?}", errors[0]);
        assert_eq!(xdp_program_id(&net.receiver).expect("ip link"), None, "{what}: an XDP program is attached");
        assert!(!scratch.socket().exists(), "{what}: the control socket was created");
    }
}

/// The control socket is root's alone (mode 0600): an unprivileged caller gets one line saying
/// so; with no daemon at all the CLI names the socket it tried.
#[test]
fn the_socket_is_root_only_and_a_missing_daemon_is_named() {
    require_root!();
    let scratch = Scratch::new().expect("scratch directory");
    let bin = limiter_ctl_binary().expect("limiter-ctl");
    let absent = Ctl::run(&mut Ctl::command(&bin, &scratch.socket(), &["policy", "list"])).expect("limiter-ctl");
    assert_ne!(absent.code, Some(0), "no daemon, yet success: {absent:?}");
    assert_eq!(absent.stderr_lines().len(), 1, "{absent:?}");
    let named = absent.stderr.contains(&*scratch.socket().to_string_lossy());
    assert!(absent.stderr.contains("no daemon is listening") && named, "{absent:?}");

    let rig = Rig::start(&[]).expect("starting the rig");
    let socket = rig.scratch.socket();
    let meta = std::fs::metadata(&socket).expect("the control socket");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.mode() & 0o7777, 0o600, "socket mode {:o}", meta.mode() & 0o7777);
    assert_eq!(meta.uid(), 0, "socket owner");
    let before = rig.scratch.config_file().expect("config");
    for args in [&["policy", "list"][..], &["policy", "set", "p", "--rate", "1/s"], &["deny", "add", "198.19.0.0/16"]] {
        let mut cmd = std::process::Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&bin)
            .arg("--socket")
            .arg(&socket)
            .args(args);
        let out = Ctl::run(&mut cmd).expect("setpriv (util-linux) runs limiter-ctl as nobody");
        assert_ne!(out.code, Some(0), "{args:?} as nobody succeeded: {out:?}");
        let lines = out.stderr_lines();
        assert_eq!(lines.len(), 1, "{args:?} as nobody: {out:?}");
        assert!(lines[0].contains("permission denied") && lines[0].contains("run as root"), "{args:?}: {:?}", lines[0]);
    }
    assert_eq!(rig.scratch.config_file().expect("config"), before, "an unprivileged caller changed the config");
    assert!(policies_json(&rig).is_empty(), "an unprivileged caller set a policy");
}

// ---------------------------------------------------------------------------------------------
// Policies as tests set them, on the shared rig ([`limiter_tests::rig`])

/// A policy as a test sets it: the CLI arguments, and the GCRA the test expects for it, computed
/// here from the same numbers (so a daemon that compiled them wrong cannot move the bound).
#[derive(Clone, Debug)]
struct Pol {
    name: &'static str,
    matches: &'static str,
    per_sec: u64,
    burst: u64,
    key: Option<&'static str>,
    bytes: bool,
    dry_run: bool,
}

impl Pol {
    fn new(name: &'static str, matches: &'static str, per_sec: u64, burst: u64) -> Self {
        Self { name, matches, per_sec, burst, key: None, bytes: false, dry_run: false }
    }

    fn key(self, key: &'static str) -> Self {
        Self { key: Some(key), ..self }
    }

    fn bytes(self) -> Self {
        Self { bytes: true, ..self }
    }

    fn dry_run(self) -> Self {
        Self { dry_run: true, ..self }
    }

    fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = ["policy", "set", self.name, "--match", self.matches].map(String::from).to_vec();
        args.extend(["--rate".into(), format!("{}/s", self.per_sec), "--burst".into(), self.burst.to_string()]);
        if let Some(key) = self.key {
            args.extend(["--key".into(), key.into()]);
        }
        if self.bytes {
            args.extend(["--unit".into(), "bytes".into()]);
        }
        if self.dry_run {
            args.push("--dry-run".into());
        }
        args
    }

    fn gcra(&self) -> Gcra {
        let max_weight = if self.bytes { MAX_FRAME_WEIGHT } else { 1 };
        Gcra::new(self.per_sec, SEC, self.burst, max_weight).expect("the test's policies are valid")
    }
}

/// What this file does with the shared [`Rig`]: sets its [`Pol`]s, floods with every policy's
/// counters read first and the capture checked, and holds a policy to its bound.
trait PolicyRig {
    fn set(&self, pol: &Pol);
    fn set_all(&self, pols: &[Pol]);
    fn hup(&mut self, outcome: &str);
    fn check_installed(&self, pol: &Pol, id: u16);
    fn counted_flood(&self, streams: &[Stream], limits: Limits) -> Run;
    fn check_policy(&self, pol: &Pol, run: &Run, groups: &[Vec<Flow>]);
    fn check_unjudged(&self, unmatched: u64, run: &Run);
}

impl PolicyRig for Rig {
    fn set(&self, pol: &Pol) {
        let args = pol.args();
        self.ctl_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    }

    fn set_all(&self, pols: &[Pol]) {
        pols.iter().for_each(|p| self.set(p));
    }

    /// SIGHUP, then waits for the log line saying `outcome`.
    fn hup(&mut self, outcome: &str) {
        self.daemon.signal(Signal::SIGHUP).expect("SIGHUP");
        let line = self.daemon.wait_for(|l| l.contains("reload"), SIGNAL_TIMEOUT);
        let line = line.unwrap_or_else(|e| panic!("no '{outcome}' after SIGHUP: {e:#}"));
        assert!(line.contains(outcome), "after SIGHUP expected '{outcome}', got: {line}");
    }

    /// The kernel holds `pol` under `id`: the GCRA this file computed, with its flags.
    fn check_installed(&self, pol: &Pol, id: u16) {
        let rules: Rules = self.snapshot().rules;
        let kernel = rules.policy(id).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(kernel.gcra, pol.gcra(), "policy '{}' (id {id}) in the kernel", pol.name);
        assert_eq!(kernel.flags & Policy::BYTES != 0, pol.bytes, "'{}' byte flag", pol.name);
        assert_eq!(kernel.flags & Policy::DRY_RUN != 0, pol.dry_run, "'{}' dry-run flag", pol.name);
    }

    /// A flood of `streams` (interleaved) under `limits`, with every policy's counters read
    /// before it and a capture running from before it to after the link went quiet, which must
    /// have seen all of it and nothing else.
    fn counted_flood(&self, streams: &[Stream], limits: Limits) -> Run {
        let flooding = self.start_counted_flood(streams, limits, None);
        finish(flooding.unwrap_or_else(|e| panic!("starting the flood: {e:#}")))
    }

    /// The policy's counters and its deliveries: each group of flows (one expected bucket) within
    /// the bound, every frame sent to it judged, every admitted one delivered.
    fn check_policy(&self, pol: &Pol, run: &Run, groups: &[Vec<Flow>]) {
        let sent: u64 = groups.iter().flatten().map(|f| run.sent(f)).sum();
        let id = self.policy_id(pol.name);
        self.check_installed(pol, id);
        let judged = self.judged(run, id);
        eprintln!("  '{}' (id {id}): {judged}", pol.name);
        let window = run.window();
        for group in groups {
            let got = group.iter().map(|f| run.delivered(f)).sum();
            let what = format!("'{}' {group:?}", pol.name);
            check_bounds(&what, got, &pol.gcra(), judged.cpus.len(), window, &run.report);
        }
        let t = judged.total;
        assert_eq!(
            t.admitted_packets + t.refused_packets + t.dry_run_packets,
            sent,
            "'{}': judged vs sent to it",
            pol.name
        );
        let delivered: u64 = groups.iter().flatten().map(|f| run.delivered(f)).sum();
        assert_eq!(t.admitted_packets, delivered, "'{}': admitted vs delivered", pol.name);
        assert!(t.refused_packets > 0, "'{}' refused nothing: the flood did not test it", pol.name);
        assert_eq!(t.errors, 0, "'{}': the program reported internal errors", pol.name);
    }

    /// What no policy judged: exactly `unmatched` frames, no internal errors, nothing else.
    fn check_unjudged(&self, unmatched: u64, run: &Run) {
        let none = self.judged(run, 0).total;
        let expected = Counters { unmatched, ..Counters::default() };
        assert_eq!(none, expected, "traffic no policy judged (anything else reached XDP?)");
        run.check_capture();
    }
}

/// A flood bounded in packets sent all of them within its time limit; if not, the machine was
/// too slow (it is never the limiter: it cannot slow the sender).
fn check_sent_all(run: &Run, frames: u64, what: &str) {
    assert_eq!(
        run.report.sent,
        frames,
        "the machine sent only {} of {frames} packets in {:?} ({}): too slow to test {what}",
        run.report.sent,
        run.report.duration(),
        run.report
    );
}

/// The largest frame of `flow` the capture saw (the most one arrival weighs in bytes).
fn big_frame_len(run: &Run, flow: &Flow) -> u64 {
    run.captured.seen.iter().filter(|s| s.flow == *flow).map(|s| s.len).max().unwrap_or(1)
}

/// Waits for the flood, then for the link to go quiet; checks the capture is complete and holds
/// nothing but the flood.
fn finish(flooding: Flooding) -> Run {
    let run = flooding.finish().unwrap_or_else(|e| panic!("flood: {e:#}"));
    run.check_capture();
    run
}

/// `allow|deny list --json`.
fn list_json(rig: &Rig, list: &str) -> Vec<String> {
    let out = rig.ctl_ok(&[list, "list", "--json"]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("`{list} list --json` ({e}): {out}"))
}

/// `policy list --json`, parsed.
fn policies_json(rig: &Rig) -> Vec<Value> {
    let out = rig.ctl_ok(&["policy", "list", "--json"]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("`policy list --json` ({e}): {out}"))
}

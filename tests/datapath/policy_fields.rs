//! Each field of a policy does what it says: `--match` (protocol, exact port, port range)
//! selects, `--key` shares or splits allowances, `--rate`, `--burst` and `--unit bytes` bound what
//! is admitted, `--dry-run` passes everything and counts what it would refuse; and the most
//! specific match wins (exact port, then range, then protocol, then `any`).
//!
//! End to end through the real `limiter-ctl` (daemon and CLI) and the real XDP program on a veth
//! pair, on the shared [`limiter_tests::rig`], with policies as [`limiter_tests::policies`] sets
//! them and holds them to their bounds.

use std::time::Duration;

use limiter_tests::{
    bounds::{check_bounds, check_lower_weighted, check_overload, check_upper},
    flood::{Flow, L4, Limits, Stream},
    policies::{Pol, PolicyRig as _, big_frame_len, check_sent_all},
    require_root,
    rig::{Rig, flow_of},
};

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
    check_upper("bytes delivered", got, &bytes.gcra(), &judged, run.window());
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
    check_bounds("would have admitted", t.admitted_packets, &pol.gcra(), &judged, run.window(), &run.report);
    rig.check_unjudged(0, &run);
}

/// Every policy that covers a packet judges it, most specific first: UDP to 53 meets the exact
/// port, the range, the protocol and any; UDP to 55 the last three; TCP and ICMP only any. The
/// most specific is the tightest here, so it refuses first and counts every refusal of its
/// flows, and the broader layers behind it, never reached by a refused packet, count exactly
/// what was delivered of all the flows they cover. After removing `any` and the exact port, port
/// 53 is judged by the range, and TCP and ICMP pass untouched, counted as unmatched.
#[test]
fn every_covering_policy_judges_most_specific_first() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let pols = [
        Pol::new("exact", "udp:53", 100, 10),
        Pol::new("range", "udp:50-60", 200, 20),
        Pol::new("proto", "udp", 300, 30),
        Pol::new("all", "any", 400, 40),
    ];
    rig.set_all(&pols);
    let s = |l4, port, src| rig.stream(l4, port, src);
    // Each stream, the policy it meets first, and every policy it meets.
    let plan = [
        ("exact", s(L4::Udp, 53, "198.19.1.1"), &["exact", "range", "proto", "all"][..]),
        ("range", s(L4::Udp, 55, "198.19.1.2"), &["range", "proto", "all"][..]),
        ("proto", s(L4::Udp, 61, "2001:db8:1::3"), &["proto", "all"][..]),
        ("all", s(L4::TcpSyn, 53, "198.19.1.4"), &["all"][..]),
        // IPv4: under `all`'s default key (src/32,/64) an IPv6 source of the same /64 as the flow
        // above would share its allowance there.
        ("all", s(L4::IcmpEcho, 0, "198.19.1.5"), &["all"][..]),
    ];
    let streams: Vec<Stream> = plan.iter().map(|(_, s, _)| s.clone()).collect();
    let run = rig.counted_flood(&streams, Limits::timed(Duration::from_millis(700)));
    eprintln!("layers: {}", run.report);
    check_overload(&run.report, 400.0, streams.len());
    let window = run.window();
    for pol in &pols {
        let id = rig.policy_id(pol.name);
        rig.check_installed(pol, id);
        let judged = rig.judged(&run, id);
        eprintln!("  '{}' (id {id}): {judged}", pol.name);
        let t = judged.total;
        let (mut first_sent, mut first_delivered, mut covered_delivered) = (0, 0, 0);
        for (first, stream, meets) in &plan {
            let flow = flow_of(stream);
            if *first == pol.name {
                first_sent += run.sent(&flow);
                first_delivered += run.delivered(&flow);
                check_bounds(
                    &format!("'{}' {flow:?}", pol.name),
                    run.delivered(&flow),
                    &pol.gcra(),
                    &judged,
                    window,
                    &run.report,
                );
            }
            if meets.contains(&pol.name) {
                covered_delivered += run.delivered(&flow);
            }
        }
        assert_eq!(
            t.refused_packets,
            first_sent - first_delivered,
            "'{}': refusals of the flows it meets first",
            pol.name
        );
        assert_eq!(
            t.admitted_packets, covered_delivered,
            "'{}': admitted vs delivered of every flow it covers",
            pol.name
        );
        assert_eq!(t.overruled_packets, 0, "'{}': the tightest layer is judged first, so none is overruled", pol.name);
        assert!(t.refused_packets > 0, "'{}' refused nothing: the flood did not test it", pol.name);
        assert_eq!(t.errors, 0, "'{}': internal errors", pol.name);
    }
    rig.check_unjudged(0, &run);

    rig.ctl_ok(&["policy", "rm", "all"]);
    rig.ctl_ok(&["policy", "rm", "exact"]);
    let (udp53, tcp, icmp) = (streams[0].clone(), streams[3].clone(), streams[4].clone());
    // Port 53 now meets the range, the protocol and nothing else: the range, tightest, refuses.
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

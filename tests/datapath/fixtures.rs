//! The real limiter program on the packet fixtures, through BPF_PROG_TEST_RUN: where each
//! fixture is counted, what every truncation of it becomes, that a burst is enforced per
//! source, and that the program picks the very bucket userspace predicts.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use etherparse::EtherType;
use limiter_common::{
    SipKey,
    key::{FAMILY_V4, FAMILY_V6},
    maps::{CLASS_ICMP, CLASS_OTHER, CLASS_TCP, CLASS_UDP, Counters, GENERATIONS, Policy},
    testing::ParseProbe,
};
use limiter_ctl::{
    Hook, Limiter,
    config::{KeySpec, Mode, PolicyDef, Rate, Scope, Unit},
    kernel::{Geometry, TestHook, compile},
};
use limiter_tests::{
    cpu::pin_current_thread,
    frames::{self, ETH_LEN, Expect, Tag, V4, ethernet, hex, ipv6, tcp, udp},
    kernel_programs::{Judge, Landed, Probe, XDP_DROP, XDP_PASS, errno, judged_alike, permissive, shortcut_builds},
    reference::{self, PROBE_KEY},
    require_root,
    verifier::{MAX_INSNS, thousands},
};
use rand::{Rng, SeedableRng, rngs::StdRng};

const BUCKETS: u32 = 1 << 16;
/// The SipHash paper's test key: fixed so any failure reproduces bucket for bucket.
const SALT: SipKey = SipKey { k0: 0x0706_0504_0302_0100, k1: 0x0f0e_0d0c_0b0a_0908 };
/// The CPU the tests that read per-CPU state run on (BPF_PROG_TEST_RUN runs on the caller's).
const CPU: usize = 0;

fn judge() -> Judge {
    Judge::load(BUCKETS, SALT, PROBE_KEY).expect("loading the limiter with a permissive policy (root, BPF)")
}

fn counters(limiter: &Limiter) -> Vec<Counters> {
    limiter.counters().expect("reading COUNTERS")
}

/// `before` with the one counter a frame that lands at `landed` must move.
fn counted(mut before: Vec<Counters>, landed: Landed, len: usize) -> Vec<Counters> {
    match landed {
        Landed::NotIp => before[0].not_ip += 1,
        Landed::Malformed => before[0].malformed += 1,
        Landed::Unreadable => before[0].unreadable_ports += 1,
        Landed::Policy(id) => {
            let c = &mut before[usize::from(id)];
            c.admitted_packets += 1;
            c.admitted_bytes += len as u64;
        }
    }
    before
}

/// The verdict (`ParseProbe::{NOT_IP, MALFORMED, IP}`) of a frame that landed at `landed`.
fn verdict(landed: Landed) -> u32 {
    match landed {
        Landed::NotIp => ParseProbe::NOT_IP,
        Landed::Malformed => ParseProbe::MALFORMED,
        Landed::Unreadable | Landed::Policy(_) => ParseProbe::IP,
    }
}

/// Where fixture `f` must land: its class from the reference, checked against the fixture's own
/// expectation of verdict, L4 and hidden ports.
fn landing(f: &frames::Fixture) -> Landed {
    let parsed = reference::parse(&f.frame);
    let landed = Judge::expected(&parsed);
    assert_eq!(verdict(landed), f.expect.verdict(), "{}: the reference disagrees with the fixture", f.name);
    if let Expect::Ip { hidden, .. } = f.expect {
        assert_eq!(landed == Landed::Unreadable, hidden, "{}: hidden ports, reference {:?}", f.name, parsed.probe);
    }
    landed
}

/// The entries of `got` that differ from `want`, by policy id (a failure names only those).
fn differences(got: &[Counters], want: &[Counters]) -> Vec<String> {
    let diff = got.iter().zip(want).enumerate().filter(|(_, (g, w))| g != w);
    diff.map(|(id, (g, w))| format!("policy {id}: got {g:?}, want {w:?}")).collect()
}

/// Panics listing every failure, so one run shows all of them.
fn assert_none(failures: &[String], what: &str) {
    assert!(failures.is_empty(), "{} {what}:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn every_fixture_passes_and_is_counted_in_its_class() {
    require_root!();
    let judge = judge();
    let mut failures = Vec::new();
    for f in frames::fixtures() {
        let landed = landing(&f);
        let before = counters(&judge.limiter);
        let action = judge.limiter.test_run(&f.frame).unwrap_or_else(|e| panic!("{}: test run: {e}", f.name));
        // Permissive policies pass everything; only hidden ports are dropped (a port policy exists).
        let want_action = if landed == Landed::Unreadable { XDP_DROP } else { XDP_PASS };
        if action != want_action {
            failures.push(format!("{}: XDP action {action}, want {want_action} ({landed:?})", f.name));
        }
        // Exactly one counter moved, the right one: every other field of every policy is unchanged.
        let want = counted(before, landed, f.frame.len());
        for d in differences(&counters(&judge.limiter), &want) {
            failures.push(format!("{} ({:?}, {landed:?}): {d}", f.name, f.expect));
        }
    }
    assert_none(&failures, "wrong counters after a fixture");
}

#[test]
fn named_malformed_cases_are_in_the_table_and_counted_malformed() {
    require_root!();
    let cases = [
        "v4_ihl_4",
        "v4_ihl_0",
        "v4_total_len_below_ihl",
        "v4_total_len_below_ihl_options",
        "v4_total_len_past_frame",
        "v6_payload_len_past_frame",
        "three_vlan_tags",
        "three_vlan_tags_ad",
    ];
    let all = frames::fixtures();
    let mut judge = judge();
    for name in cases {
        let f = all.iter().find(|f| f.name == name).unwrap_or_else(|| panic!("fixture {name} is gone"));
        assert_eq!(f.expect, Expect::Malformed, "{name}");
        let landed = judge.classify(&f.frame).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(landed, Landed::Malformed, "{name}");
    }
}

/// No header trick past the fixed IP header escapes judgement: what used to pass as malformed
/// (cut L4 headers, long or cut extension chains) lands in its class policy, tiny first
/// fragments and over-long chains are dropped while a port policy exists, and a later IPv6
/// fragment cannot pick its policy by the next header it states.
#[test]
fn header_tricks_are_judged_by_class_or_dropped() {
    require_root!();
    let tcp = Judge::class_policy(CLASS_TCP);
    let udp = Judge::class_policy(CLASS_UDP);
    let icmp = Judge::class_policy(CLASS_ICMP);
    let other = Judge::class_policy(CLASS_OTHER);
    let cases = [
        ("v4_tcp_past_datagram", Landed::Policy(tcp)),
        ("v4_tcp_doff_4", Landed::Policy(tcp)),
        ("v4_tcp_doff_past_datagram", Landed::Policy(tcp)),
        ("v4_udp_7_bytes", Landed::Policy(udp)),
        ("v4_udp_7_bytes_padded", Landed::Policy(udp)),
        ("v4_icmp_4_bytes", Landed::Policy(icmp)),
        ("v4_first_fragment_4_bytes_of_icmp", Landed::Policy(icmp)),
        ("v4_first_fragment_8_bytes_of_tcp", Landed::Unreadable),
        ("v4_first_fragment_8_bytes_of_tcp_padded", Landed::Unreadable),
        ("v4_first_fragment_doff_past_fragment", Landed::Unreadable),
        ("v4_first_fragment_4_bytes_of_udp", Landed::Unreadable),
        ("v4_first_fragment_no_l4_bytes_tcp", Landed::Unreadable),
        ("v4_non_first_fragment", Landed::Policy(udp)),
        ("v6_tcp_doff_3", Landed::Policy(tcp)),
        ("v6_udp_cut", Landed::Policy(udp)),
        ("v6_ext_len_past_datagram", Landed::Policy(other)),
        ("v6_payload_len_0_with_ext", Landed::Policy(other)),
        ("v6_atomic_fragment_cut_udp", Landed::Policy(udp)),
        ("v6_seven_exts_tcp", Landed::Policy(tcp)),
        ("v6_sixteen_hop_by_hop_udp", Landed::Policy(udp)),
        ("v6_32_dest_opts_udp", Landed::Policy(Judge::PORT_POLICY)),
        ("v6_31_dest_opts_first_fragment_tcp", Landed::Policy(Judge::PORT_POLICY)),
        ("v6_33_dest_opts_udp", Landed::Unreadable),
        ("v6_32_dest_opts_then_non_first_fragment", Landed::Unreadable),
        ("v6_non_first_fragment_claims_tcp", Landed::Policy(other)),
        ("v6_non_first_fragment", Landed::Policy(other)),
        ("v6_first_fragment_7_bytes_of_udp", Landed::Unreadable),
        ("v6_first_fragment_doff_past_fragment", Landed::Unreadable),
        ("v6_first_fragment_cut_chain", Landed::Unreadable),
        ("v6_first_fragment_icmpv6_cut", Landed::Policy(icmp)),
    ];
    let all = frames::fixtures();
    let mut judge = judge();
    let mut failures = Vec::new();
    for (name, want) in cases {
        let f = all.iter().find(|f| f.name == name).unwrap_or_else(|| panic!("fixture {name} is gone"));
        let landed = judge.classify(&f.frame).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        if landed != want {
            failures.push(format!("{name}: landed {landed:?}, want {want:?}"));
        }
    }
    assert_none(&failures, "header tricks judged wrong");
}

#[test]
fn every_cut_of_every_fixture_gets_the_expected_class_at_both_hooks() {
    require_root!();
    // The XDP program and the tc one (the same judgement over `__sk_buff`), on the same frames:
    // each must land every cut where the rule and the reference say, so both land it alike.
    let mut judges = TestHook::ALL.map(|hook| {
        Judge::load_at(hook, BUCKETS, SALT, PROBE_KEY)
            .expect("loading the limiter with a permissive policy (root, BPF)")
    });
    let (mut runs, mut unrunnable, mut failures) = (0, 0, Vec::new());
    for f in frames::fixtures() {
        for len in ETH_LEN..=f.frame.len() {
            let cut = &f.frame[..len];
            let [xdp_judge, tcx_judge] = &mut judges;
            let xdp = xdp_judge.classify(cut).unwrap_or_else(|e| panic!("{} cut to {len}: {e:#}", f.name));
            let tcx = match tcx_judge.classify(cut) {
                Ok(landed) => landed,
                // The kernel builds a test run's skb as the stack would: an IP frame must hold
                // its fixed IP header (EINVAL otherwise), so the shorter cuts never reach the tc
                // program. Real ones do (tc ingress comes before the IP layer's checks), and the
                // parser's bounds checks take them as at XDP.
                Err(e) if len < ip_header_end(cut) && errno(e.as_ref()) == Some(libc::EINVAL) => {
                    unrunnable += 1;
                    xdp
                }
                Err(e) => panic!("{} cut to {len} at tcx: {e:#}", f.name),
            };
            // Two independent expectations: the fixture's own rule, and the reference parser.
            let rule = f.expect_cut(len).verdict();
            let parsed = reference::parse(cut);
            let reference = parsed.probe.verdict;
            if rule != reference || verdict(xdp) != rule || xdp != Judge::expected(&parsed) || tcx != xdp {
                let got = format!("xdp {xdp:?}, tcx {tcx:?}, rule {rule}, reference {reference}");
                failures.push(format!("{} cut to {len}: {got}: {}", f.name, hex(cut)));
            }
            runs += 1;
        }
    }
    eprintln!("{runs} cuts checked ({unrunnable} of them too short for a tc test run)");
    assert!(unrunnable < runs / 2, "most cuts must run at tcx: {unrunnable} of {runs} did not");
    assert_none(&failures, "cuts with the wrong class (1 not IP, 2 malformed, 3 IP)");
}

/// Where the fixed IP header of an untagged IP frame ends (0 for anything else): a tc test run
/// needs it whole.
fn ip_header_end(frame: &[u8]) -> usize {
    match frame.get(12..14) {
        Some([0x08, 0x00]) => ETH_LEN + 20,
        Some([0x86, 0xdd]) => ETH_LEN + 40,
        _ => 0,
    }
}

/// BPF_PROG_TEST_RUN refuses an XDP frame shorter than an Ethernet header with EINVAL (and a tc
/// one of no more than that header), so the
/// program can never be handed one (not by test runs, and no driver delivers one either): the
/// parser's "shorter than 14 bytes" path is only reachable through its bounds checks.
#[test]
fn frames_shorter_than_ethernet_never_reach_the_program() {
    require_root!();
    let judge = judge();
    let before = counters(&judge.limiter);
    let frame = ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(0, 1)).datagram(&tcp(1, 2)));
    for len in 0..ETH_LEN {
        let err = judge.limiter.test_run(&frame[..len]).expect_err("the kernel ran a frame shorter than Ethernet");
        assert_eq!(errno(&err), Some(libc::EINVAL), "{len} bytes: {err}");
    }
    assert_eq!(counters(&judge.limiter), before, "a refused test run must not reach the program");
    // The tc program's test runs want more: an skb whose Ethernet header is all it holds is
    // refused too (the stack pulls that header before tc ingress; such a frame is empty).
    let judge = Judge::load_at(TestHook::Tcx, BUCKETS, SALT, PROBE_KEY).expect("loading the limiter at tcx");
    let before = counters(&judge.limiter);
    for len in 0..=ETH_LEN {
        let err =
            judge.limiter.test_run_at(TestHook::Tcx, &frame[..len]).expect_err("the kernel ran a frame this short");
        assert_eq!(errno(&err), Some(libc::EINVAL), "{len} bytes at tcx: {err}");
    }
    assert_eq!(counters(&judge.limiter), before, "a refused test run must not reach the tc program");
}

/// A policy of 10 per minute with a burst of 5: slow enough that no refill happens between
/// packets sent microseconds apart, even on a loaded machine.
fn burst_policy(id: u16) -> Policy {
    let spec = PolicyDef::any(Rate { count: 10, period_ns: 60_000_000_000 }, 5);
    compile::policy(&spec, id).expect("10/min burst 5 is representable")
}

#[test]
fn a_source_gets_its_burst_then_is_dropped_and_others_still_pass() {
    require_root!();
    pin_current_thread(CPU).expect("pinning the test thread");
    let v4 = |s, h| V4::from(frames::v4(s, h)).datagram(&udp(1000, 53, 16));
    let v6 = |s, h| ipv6(frames::v6(s, h), &[], &udp(1000, 53, 16));
    let cases = [
        ("v4", ethernet(&[], EtherType::IPV4, &v4(0, 10)), ethernet(&[], EtherType::IPV4, &v4(1, 10))),
        // B is tagged: the tag must not matter to the key.
        ("v6", ethernet(&[], EtherType::IPV6, &v6(1, 10)), ethernet(&[Tag::Q(7)], EtherType::IPV6, &v6(2, 11))),
    ];
    const ID: u16 = 3;
    const BURST: u64 = 5;
    for ((family, a, b), hook) in cases.iter().flat_map(|c| TestHook::ALL.map(|h| (c, h))) {
        let family = format!("{family} at {hook:?}");
        let mut limiter = Limiter::load(BUCKETS).expect("loading the limiter");
        if hook == TestHook::Tcx {
            limiter.load_hook(Hook::Tc).expect("loading the tc programs");
        }
        limiter.set_salt(SALT).expect("salt");
        limiter.set_policy(&burst_policy(ID)).expect("policy");
        limiter.set_default_policy(ID).expect("default policy");
        let run = |frame: &[u8]| limiter.test_run_at(hook, frame).expect("test run");
        for i in 1..=BURST {
            assert_eq!(run(a), XDP_PASS, "{family}: packet {i} of the burst from A");
        }
        assert_eq!(run(a), XDP_DROP, "{family}: packet {} from A, past the burst", BURST + 1);
        assert_eq!(run(b), XDP_PASS, "{family}: B has its own allowance");

        let all = counters(&limiter);
        let expect = Counters {
            admitted_packets: BURST + 1,
            admitted_bytes: BURST * a.len() as u64 + b.len() as u64,
            refused_packets: 1,
            refused_bytes: a.len() as u64,
            ..Counters::default()
        };
        assert_eq!(all[usize::from(ID)], expect, "{family}: policy counters");
        assert_eq!(all[0], Counters::default(), "{family}: nothing unjudged");
        let per_cpu = limiter.counters_per_cpu(ID).expect("per-CPU counters");
        assert_eq!(per_cpu[CPU], expect, "{family}: everything on the pinned CPU");
    }
}

/// The same judgement at both hooks: two limiters with the same salt and policies, one run at
/// XDP and one at tcx, take the same stream of frames (sources, protocols, ports, sizes, SYNs
/// drawn from a fixed seed) and must return the same action for every frame and end with the
/// same counters. The policies refuse (burst, then one per minute), charge bytes, share a
/// host-scope bucket, and overlap, so a UDP frame to port 53 and a SYN go through the layers'
/// tail call, which at tcx is the tc program's own.
#[test]
fn both_hooks_take_the_same_decisions_on_a_mixed_stream() {
    use frames::Segment;
    require_root!();
    pin_current_thread(CPU).expect("pinning the test thread");
    let minute = |count| Rate { count, period_ns: 60_000_000_000 };
    let def = |name: &str, matches: &str, rate, burst, edit: &dyn Fn(&mut PolicyDef)| {
        let mut d = PolicyDef {
            name: name.parse().expect("a name"),
            matches: matches.parse().expect("a match"),
            ..PolicyDef::any(rate, burst)
        };
        edit(&mut d);
        d
    };
    let policies = [
        def("dns", "udp:53", minute(1), 20, &|_| {}),
        def("udp-bytes", "udp", minute(6_000), 20_000, &|d| {
            d.unit = Unit::Bytes;
            d.key = KeySpec { v4_prefix: 24, v6_prefix: 48, dport: false };
        }),
        def("syn-cap", "tcp,syn", minute(1), 40, &|d| {
            d.scope = limiter_ctl::config::Scope::Host;
            d.key = KeySpec { v4_prefix: 0, v6_prefix: 0, dport: false };
        }),
        def("any", "any", minute(1), 30, &|_| {}),
    ];
    let state = policies
        .iter()
        .fold(limiter_ctl::config::State::default(), |s, d| s.with_policy(d.clone()).expect("a valid state"));
    let limiters = TestHook::ALL.map(|hook| {
        let mut limiter = Limiter::load(BUCKETS).expect("loading the limiter");
        if hook == TestHook::Tcx {
            limiter.load_hook(Hook::Tc).expect("loading the tc programs");
        }
        limiter.set_salt(SALT).expect("salt");
        let old = limiter.read_view().expect("view");
        limiter.apply(&old, &limiter_ctl::kernel::MapView::of(&state)).expect("policies and routes");
        (hook, limiter)
    });
    let mut rng = StdRng::seed_from_u64(25);
    let (mut refused, mut failures) = (0, Vec::new());
    for i in 0..600 {
        let source = rng.random_range(0..6u8);
        let (v4, v6) = (rng.random_bool(0.5), u16::from(source / 3));
        let l4 = match rng.random_range(0..4) {
            0 => udp(40_000, 53, rng.random_range(0..200)),
            1 => udp(40_000, rng.random_range(1000..1004), rng.random_range(0..900)),
            2 => frames::tcp_segment(40_000, 443, if rng.random_bool(0.7) { Segment::Syn } else { Segment::Ack }),
            _ if v4 => frames::icmpv4_echo(),
            _ => frames::icmpv6_echo(),
        };
        let frame = if v4 {
            ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(v6, source)).datagram(&l4))
        } else {
            ethernet(&[], EtherType::IPV6, &ipv6(frames::v6(v6, u16::from(source)), &[], &l4))
        };
        let [xdp, tcx] = limiters.each_ref().map(|(hook, l)| l.test_run_at(*hook, &frame).expect("test run"));
        refused += u32::from(xdp == XDP_DROP);
        if xdp != tcx {
            failures.push(format!("frame {i} (source {source}): xdp {xdp}, tcx {tcx}: {}", hex(&frame)));
        }
    }
    assert_none(&failures, "frames the hooks decided differently");
    let [xdp, tcx] = limiters.each_ref().map(|(_, l)| counters(l));
    assert_eq!(xdp, tcx, "the hooks' counters");
    // The stream must have exercised refusals, and admissions.
    eprintln!("{refused} of 600 refused at both hooks alike");
    assert!(refused > 60 && refused < 540, "{refused} of 600 refused: the policies must both admit and refuse");
}

/// `limiter` with the test salt and `policy` (id 1) as the policy of every packet.
fn judging_all_by(mut limiter: Limiter, policy: &Policy) -> Limiter {
    limiter.set_salt(SALT).expect("salt");
    limiter.set_policy(policy).expect("policy");
    limiter.set_default_policy(1).expect("default policy");
    limiter
}

/// The memo tests' shapes: each scope, with the rows its array is split into (both arrays
/// alike: `Geometry::same`). Host scope with 2 rows is the daemon's default.
const MEMO_SHAPES: [(Scope, u32); 5] =
    [(Scope::Cpu, 1), (Scope::Cpu, 4), (Scope::Host, 1), (Scope::Host, 2), (Scope::Host, 4)];

/// `def` compiled as policy 1, of `scope`.
fn scoped(def: &PolicyDef, scope: Scope) -> Policy {
    compile::policy(&PolicyDef { scope, ..def.clone() }, 1).expect("the test's policy compiles")
}

/// One test run of `frame`, with the user-side moments it began and ended.
fn timed_run(limiter: &Limiter, frame: &[u8]) -> (Instant, Instant, u32) {
    let start = Instant::now();
    let verdict = limiter.test_run(frame).expect("test run");
    (start, Instant::now(), verdict)
}

/// The per-CPU key memo refuses a flooding source without reading its buckets until its
/// refusal ends (limiter-ebpf `KeyMemo`): on the precise clock (the tick refusal off, below for
/// it on) it must end exactly when the exact GCRA would admit
/// again, never later, never earlier; at either scope, with one row or several. One source floods (back-to-back test runs on one CPU)
/// under 10/s, burst 1: after each admission at kernel time `t` (inside the user-measured call
/// `[u0, u1]`), the next is due at `t + T`. A refusal whose call began at or after `u1 + T` was
/// refused too long; an admission whose call ended before `u0 + T` came early.
#[test]
fn a_memo_refusal_ends_when_the_allowance_returns() {
    require_root!();
    pin_current_thread(CPU).expect("pinning the test thread");
    const T: Duration = Duration::from_millis(100);
    const CYCLES: usize = 4;
    let frame = ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(0, 10)).datagram(&udp(1000, 53, 16)));
    let def = PolicyDef::any(Rate { count: 10, period_ns: 1_000_000_000 }, 1);
    for (scope, rows) in MEMO_SHAPES {
        let loaded = Limiter::load_switchable_geometry(Geometry::same(BUCKETS, rows), true, false);
        let limiter = judging_all_by(loaded.expect("loading the limiter"), &scoped(&def, scope));
        let rows = format!("{scope:?} {rows}");
        let timed = || timed_run(&limiter, &frame);
        let (mut u0, mut u1, first) = timed();
        assert_eq!(first, XDP_PASS, "rows {rows}: the first packet has its burst");
        for cycle in 0..CYCLES {
            let mut refused = 0u64;
            loop {
                let (s, e, verdict) = timed();
                if verdict == XDP_PASS {
                    assert!(e >= u0 + T, "rows {rows}, cycle {cycle}: admitted {:?} after the last admission", e - u0);
                    assert!(refused > 0, "rows {rows}, cycle {cycle}: nothing refused in between");
                    (u0, u1) = (s, e);
                    break;
                }
                assert_eq!(verdict, XDP_DROP, "rows {rows}, cycle {cycle}: refused");
                assert!(
                    s < u1 + T + Duration::from_micros(1),
                    "rows {rows}, cycle {cycle}: still refused {:?} after the last admission (due after {T:?})",
                    s - u1
                );
                refused += 1;
                assert!(e < u1 + 20 * T, "rows {rows}, cycle {cycle}: never admitted again");
            }
        }
    }
}

/// The tick refusal (`limiter_common::tick`): once a key has been refused, within one tick,
/// more often than any source keeping to its rate could send, the rest of that tick's packets of
/// it are refused without reading the clock. So a refusal may outlast its exact end by the rest
/// of the tick, never by more than `tick::SLACK_NS`, and the admission never comes early. The
/// same flood as above, but with T = 100.37 ms (burst 1: two refusals within one tick earn the
/// skip): a whole number of ticks at every HZ Linux has (100, 250, 300, 1000) and 0.37 ms, so
/// each admission, made at the start of a tick once the skip ended, falls due 0.37 ms into a
/// later tick, after the skip has begun there: every cycle takes the tick path, whatever the
/// phase the flood starts in (with T a whole number of ticks, it could fall due before the
/// skip began, every time). The tick path must show where nothing else can explain it: a refusal of a call that began well after the
/// exact due time (500 us, where the precise clock allows 1: the test above). A late admission
/// proves nothing, as the thread may simply have been descheduled; a late refusal cannot come
/// from that (a call delayed past the due time reads a later clock, and is admitted).
#[test]
fn a_tick_refusal_outlasts_the_exact_end_by_at_most_the_tick() {
    require_root!();
    // Alone on its CPU: the other tests pin to CPU, and a tick shared with them may see too few
    // calls to earn the skip this test looks for.
    pin_current_thread(limiter_tests::cpu::flood_cpu()).expect("pinning the test thread");
    const T: Duration = Duration::from_micros(100_370);
    const CYCLES: usize = 8;
    /// A refusal this far past the exact due time shows the tick path: on the precise clock no
    /// refusal begins even 1 us past it, while the skip lasts to the end of the tick the
    /// admission fell due in, 0.37 ms into it: at least 0.63 ms at Linux's shortest tick (1 ms,
    /// HZ = 1000; 3.6 ms at HZ = 250).
    const TICK_PROOF: Duration = Duration::from_micros(500);
    let slack = Duration::from_nanos(limiter_common::tick::SLACK_NS);
    let frame = ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(0, 10)).datagram(&udp(1000, 53, 16)));
    let rate = Rate { count: 1000, period_ns: 1000 * T.as_nanos() as u64 };
    let def = PolicyDef::any(rate, 1);
    for (scope, rows) in MEMO_SHAPES {
        let loaded = Limiter::load_geometry(Geometry::same(BUCKETS, rows));
        let limiter = judging_all_by(loaded.expect("loading the limiter"), &scoped(&def, scope));
        let rows = format!("{scope:?} {rows}");
        let timed = || timed_run(&limiter, &frame);
        let (mut u0, mut u1, first) = timed();
        assert_eq!(first, XDP_PASS, "rows {rows}: the first packet has its burst");
        // How late the latest admission and the latest refusal came past the exact due time.
        let (mut latest, mut latest_refusal) = (Duration::ZERO, Duration::ZERO);
        for cycle in 0..CYCLES {
            loop {
                let (s, e, verdict) = timed();
                if verdict == XDP_PASS {
                    assert!(e >= u0 + T, "rows {rows}, cycle {cycle}: admitted {:?} after the last admission", e - u0);
                    // Late by at least this much, even if the last admission came at the end of
                    // its call.
                    latest = latest.max(s.saturating_duration_since(u1 + T));
                    (u0, u1) = (s, e);
                    break;
                }
                assert_eq!(verdict, XDP_DROP, "rows {rows}, cycle {cycle}: refused");
                assert!(
                    s < u1 + T + slack,
                    "rows {rows}, cycle {cycle}: still refused {:?} after the last admission (due after {T:?}, slack {slack:?})",
                    s - u1
                );
                latest_refusal = latest_refusal.max(s.saturating_duration_since(u1 + T));
            }
        }
        eprintln!(
            "rows {rows}: latest admission {latest:?}, latest refusal {latest_refusal:?} past the exact due time"
        );
        assert!(
            latest_refusal >= TICK_PROOF,
            "rows {rows}: no call was refused {TICK_PROOF:?} or more past its exact due time (latest {latest_refusal:?}): \
             the tick refusal never applied"
        );
    }
}

/// A flood at the 1000/s burst 100 with the tick refusal: the key gets what the exact
/// GCRA gives the very same arrivals up to `tick::SLACK_NS` before the flood's end (owed
/// admissions are made up when the next tick's first packet is judged), and never more than its
/// bound over the flood. In the daemon's default shapes: 4 rows per CPU, or host scope in 2
/// rows; 1 in 256 refusals sampled.
#[test]
fn a_tick_refused_flood_keeps_its_allowance() {
    require_root!();
    pin_current_thread(CPU).expect("pinning the test thread");
    let spec = PolicyDef::any(Rate { count: 1000, period_ns: 1_000_000_000 }, 100);
    let shape = limiter_tests::kernel_programs::Shape::DAEMON;
    // Per CPU in the daemon's per-CPU rows, and host scope in its host rows (2).
    for (scope, rows) in [(Scope::Cpu, shape.rows), (Scope::Host, 2)] {
        let policy = scoped(&spec, scope);
        let mut limiter = Limiter::load_geometry(Geometry::same(BUCKETS, rows)).expect("loading the limiter");
        limiter.set_sampling(shape.sample_refusals).expect("refusal sampling");
        let limiter = judging_all_by(limiter, &policy);
        tick_refused_flood(&limiter, &policy, &format!("{scope:?} {rows} rows"));
    }
}

/// [`a_tick_refused_flood_keeps_its_allowance`] on one limiter, judging every packet by `policy`.
fn tick_refused_flood(limiter: &Limiter, policy: &Policy, what: &str) {
    const RUN: Duration = Duration::from_millis(1200);
    let slack_ns = limiter_common::tick::SLACK_NS;
    let frame = ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(0, 10)).datagram(&udp(1000, 53, 16)));
    let start = Instant::now();
    // (call start in ns since `start`, admitted)
    let mut log: Vec<(u64, bool)> = Vec::with_capacity(1 << 20);
    let mut end = start;
    while end - start < RUN {
        let s = Instant::now();
        let verdict = limiter.test_run(&frame).expect("test run");
        end = Instant::now();
        log.push(((s - start).as_nanos() as u64, verdict == XDP_PASS));
    }
    let admitted = log.iter().filter(|(_, a)| *a).count() as u64;
    // The exact GCRA on the same arrivals (its clock offset so that 0 is not "never").
    let mut bucket = 0u64;
    let last = log.last().map_or(0, |l| l.0);
    let mut exact_total = 0u64;
    let mut exact_before_slack = 0u64;
    for &(t, _) in &log {
        if policy.gcra.admit(&mut bucket, t + 1_000_000_000, 1) {
            exact_total += 1;
            if t + slack_ns <= last {
                exact_before_slack += 1;
            }
        }
    }
    let bound = policy.gcra.bound((end - start).as_nanos() as u64);
    eprintln!(
        "{what}: {} packets in {:?}: admitted {admitted}, exact {exact_total} ({exact_before_slack} up to the slack before the end), bound {bound}",
        log.len(),
        end - start
    );
    assert!(admitted <= bound, "{what}: admitted {admitted} > bound {bound}");
    // One more for the microseconds between a call's start and the kernel's clock read.
    assert!(
        admitted + 1 >= exact_before_slack,
        "{what}: admitted {admitted}, but the exact GCRA admits {exact_before_slack} of the same arrivals before the last {slack_ns} ns"
    );
    assert!(
        log.len() > 10 * exact_total as usize,
        "{what}: not a flood: {} packets for {exact_total} admissions",
        log.len()
    );
}

/// A source that keeps to its rate is never refused while another floods on the same CPU: the
/// flood's packets take the key memo's standing refusal, the at-rate source's replace the memo
/// each time (both paths, interleaved), and the flood stays within its bound.
#[test]
fn an_at_rate_source_is_never_refused_beside_a_memo_refused_flood() {
    require_root!();
    pin_current_thread(CPU).expect("pinning the test thread");
    const T: Duration = Duration::from_millis(50);
    const RUN: Duration = Duration::from_millis(600);
    let datagram = |s| ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(s, 10)).datagram(&udp(1000, 53, 16)));
    let (flood, steady) = (datagram(0), datagram(1));
    let spec = PolicyDef::any(Rate { count: 20, period_ns: 1_000_000_000 }, 2);
    for (scope, rows) in MEMO_SHAPES {
        let loaded = Limiter::load_geometry(Geometry::same(BUCKETS, rows)).expect("loading the limiter");
        let limiter = judging_all_by(loaded, &scoped(&spec, scope));
        let rows = format!("{scope:?} {rows}");
        let run = |frame: &[u8]| limiter.test_run(frame).expect("test run");
        let start = Instant::now();
        let (mut flood_admitted, mut flood_refused, mut steady_sent) = (0u64, 0u64, 0u64);
        let mut steady_due = start;
        while start.elapsed() < RUN {
            if Instant::now() >= steady_due {
                assert_eq!(
                    run(&steady),
                    XDP_PASS,
                    "rows {rows}: the at-rate source's packet {steady_sent} was refused"
                );
                // Its next packet is due a full interval after this call ended.
                steady_due = Instant::now() + T;
                steady_sent += 1;
            }
            match run(&flood) {
                XDP_PASS => flood_admitted += 1,
                v => {
                    assert_eq!(v, XDP_DROP);
                    flood_refused += 1;
                }
            }
        }
        let elapsed = start.elapsed();
        let gcra = scoped(&spec, scope).gcra;
        let bound = gcra.bound(elapsed.as_nanos() as u64);
        assert!(flood_admitted <= bound, "rows {rows}: the flood got {flood_admitted}, bound {bound}");
        assert!(
            flood_refused > 1000 && steady_sent >= 5,
            "rows {rows}: {flood_refused} refused, {steady_sent} sent at rate"
        );
    }
}

/// The key memo and the tick refusal change no verdict: the shipped program (both on), the test
/// build with the tick refusal off, and with the memo off judge the same frames alike, at
/// either scope, over one row or several, with keys forced to share rows (16 buckets for 12
/// sources). 1/h, burst 3: nothing refills during the test, so each verdict is decided by what
/// the rows hold, not by when it is judged; the memo's standing refusals last the whole test.
/// Sources come in runs (the memo's case) and alternate (its replacement). Halfway, the policy
/// switches scope with the same rate: a refusal memoised at one scope must not answer for the
/// other's buckets (fresh there: the burst again).
#[test]
fn the_memo_and_the_tick_refusal_change_no_verdict() {
    require_root!();
    pin_current_thread(CPU).expect("pinning the test thread");
    const TINY: u32 = limiter_common::maps::MIN_BUCKETS;
    let datagram = |s| ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(s, 10)).datagram(&udp(1000, 53, 16)));
    let spec = PolicyDef::any(Rate { count: 1, period_ns: 3_600_000_000_000 }, 3);
    let mut rng = StdRng::seed_from_u64(0x6d656d6f);
    for (scope, rows) in MEMO_SHAPES {
        let other = if scope == Scope::Host { Scope::Cpu } else { Scope::Host };
        let geometry = Geometry::same(TINY, rows);
        let mut limiters = shortcut_builds(geometry, |l| judging_all_by(l, &scoped(&spec, scope)));
        let (mut refused, mut admitted) = (0u64, 0u64);
        for step in 0..400 {
            if step == 200 {
                for limiter in &mut limiters {
                    limiter.set_policy(&scoped(&spec, other)).expect("switching the scope");
                }
            }
            let frame = datagram(rng.random_range(0..12u16));
            for _ in 0..rng.random_range(1..=6) {
                match judged_alike(&limiters, &frame, || format!("{scope:?}, {rows} rows, step {step}")) {
                    XDP_PASS => admitted += 1,
                    v => {
                        assert_eq!(v, XDP_DROP);
                        refused += 1;
                    }
                }
            }
        }
        eprintln!("{scope:?}, {rows} rows: {admitted} admitted, {refused} refused alike");
        // Both scopes' bursts were had (12 sources, burst 3: at most 72 admissions in all), and
        // the memo served refusals.
        assert!(
            admitted > 12 && admitted <= 72 && refused > 500,
            "{scope:?}, {rows} rows: {admitted} admitted, {refused} refused"
        );
    }
}

/// The same three builds through what changes a key's buckets under the memo: the policy's
/// rate and burst edited, the policy removed (its packets then pass unjudged) and its id reused
/// by another, salt rotations (one without a grace, one with a grace that outlasts the test, so
/// the three see the same generations at every packet),
/// every few dozen packets of 12 sources sharing a tiny array, at both scopes. Every packet gets
/// the same verdict from all three. (Idle spells cannot be driven here: a test run reads the
/// kernel's clock.)
#[test]
fn the_memo_changes_no_verdict_through_edits_removals_and_rotations() {
    require_root!();
    pin_current_thread(CPU).expect("pinning the test thread");
    const TINY: u32 = limiter_common::maps::MIN_BUCKETS;
    let datagram = |s| ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(s, 10)).datagram(&udp(1000, 53, 16)));
    let hour = 3_600_000_000_000;
    let mut rng = StdRng::seed_from_u64(0x65646974);
    for (scope, rows) in MEMO_SHAPES {
        let geometry = Geometry::same(TINY, rows);
        let first = scoped(&PolicyDef::any(Rate { count: 1, period_ns: hour }, 3), scope);
        let mut limiters = shortcut_builds(geometry, |l| judging_all_by(l, &first));
        let (mut refused, mut passed, mut events, mut rotations) = (0u64, 0u64, Vec::new(), 0u8);
        for step in 0..600 {
            if step % 50 == 49 {
                let event = rng.random_range(0..4u8);
                let count = rng.random_range(1..=3u64);
                let burst = rng.random_range(1..=4u64);
                let edited = scoped(&PolicyDef::any(Rate { count, period_ns: hour }, burst), scope);
                let salt = SipKey { k0: rng.random(), k1: rng.random() };
                for limiter in &mut limiters {
                    match event {
                        // An edit, or the id reused by another policy: new parameters in slot 1.
                        0 | 1 => limiter.set_policy(&edited).expect("editing the policy"),
                        // Removed: the slot inactive, its packets unjudged.
                        2 => limiter
                            .set_policy(&Policy { flags: edited.flags & !Policy::ACTIVE, ..edited })
                            .expect("removing"),
                        // A rotation: the first without a grace (a fresh generation), the
                        // second with one that outlasts the test (the previous generation read
                        // too, by all three alike); later ones would be refused during it.
                        _ if rotations < 2 => {
                            let grace = if rotations == 0 { Duration::ZERO } else { Duration::from_secs(600) };
                            limiter.rotate_salt(salt, grace).expect("rotating the salt")
                        }
                        _ => limiter.set_policy(&edited).expect("editing the policy"),
                    }
                }
                rotations += u8::from(event == 3);
                events.push(event);
            }
            let frame = datagram(rng.random_range(0..12u16));
            for _ in 0..rng.random_range(1..=6) {
                let what = || format!("{scope:?}, {rows} rows, step {step} after events {events:?}");
                if judged_alike(&limiters, &frame, what) == XDP_DROP { refused += 1 } else { passed += 1 }
            }
        }
        eprintln!("{scope:?}, {rows} rows, events {events:?}: {passed} passed, {refused} refused alike");
        assert!(refused > 300 && passed > 12, "{scope:?}, {rows} rows: {passed} passed, {refused} refused");
    }
}

/// A frame sent in the bucket test, and what userspace knows of its source.
struct Sent {
    frame: Vec<u8>,
    family: u8,
    src: [u8; 16],
    dport: u16,
}

/// IPv4 and IPv6 sources in distinct prefixes, with TCP, UDP and ICMP (dport 0).
fn bucket_traffic() -> Vec<Sent> {
    let mut out = Vec::new();
    for (i, dport) in [53u16, 443, 0].into_iter().enumerate() {
        let src4 = frames::v4(3 + i as u16, 77);
        let l4 = if dport == 0 { frames::icmpv4_echo() } else { tcp(40_000, dport) };
        let frame = ethernet(&[], EtherType::IPV4, &V4::from(src4).datagram(&l4));
        let mut src = [0u8; 16];
        src[..4].copy_from_slice(&src4);
        out.push(Sent { frame, family: FAMILY_V4, src, dport });

        let src = frames::v6(9 + i as u16, 77);
        let l4 = if dport == 0 { frames::icmpv6_echo() } else { udp(40_000, dport, 8) };
        let frame = ethernet(&[Tag::Ad(3)], EtherType::IPV6, &ipv6(src, &[], &l4));
        out.push(Sent { frame, family: FAMILY_V6, src, dport });
    }
    out
}

#[test]
fn the_program_picks_the_bucket_userspace_predicts() {
    require_root!();
    pin_current_thread(CPU).expect("pinning the test thread");
    let seed: u64 = 0x5a17_b0c7;
    eprintln!("salt seed {seed:#x}");
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..4 {
        let salt = SipKey { k0: rng.random(), k1: rng.random() };
        let judge = Judge::load(BUCKETS, salt, PROBE_KEY).expect("loading the limiter");
        let mut predicted = BTreeSet::new();
        for sent in bucket_traffic() {
            assert_eq!(judge.limiter.test_run(&sent.frame).expect("test run"), XDP_PASS);
            let Landed::Policy(id) = Judge::expected(&reference::parse(&sent.frame)) else {
                panic!("round {round}: a bucket test frame is not judged: {}", hex(&sent.frame));
            };
            let key = reference::flow_key(id, &PROBE_KEY, sent.family, &sent.src, sent.dport);
            // Generation 0 (the salt's, at load): its buckets are the first `BUCKETS` entries.
            predicted.insert(key.bucket(&salt, BUCKETS - 1));
        }
        // Every bucket of both generations: the predicted ones used, on the pinned CPU only.
        let mut used = BTreeSet::new();
        for index in 0..GENERATIONS * BUCKETS {
            let tats = judge.limiter.bucket(index).expect("reading BUCKETS");
            for (cpu, &tat) in tats.iter().enumerate() {
                assert!(tat == 0 || cpu == CPU, "round {round}: bucket {index} used on CPU {cpu}, not the pinned one");
            }
            if tats[CPU] != 0 {
                used.insert(index);
            }
        }
        assert_eq!(used, predicted, "round {round}: buckets used vs predicted");
    }
}

/// Every program passes the verifier (the IPv6 chain walk is the costly part), each within the
/// bar of [`MAX_INSNS`] processed instructions the kernel matrix holds them to: the verifier's
/// own counts, printed as rows of docs/DESIGN.md's table.
#[test]
fn the_programs_pass_the_verifier() {
    require_root!();
    let mut limiter = Limiter::load(BUCKETS).expect("the limiter passes the verifier");
    limiter.load_hook(Hook::Tc).expect("the limiter's tc programs pass the verifier");
    let mut counts = Vec::new();
    for name in [limiter_common::maps::PROGRAM, limiter_common::maps::PROGRAM_LAYERS] {
        let info = limiter.program_named(name).expect("the program").info().expect("program info");
        counts.push((name, info.verified_instruction_count()));
    }
    for name in [limiter_common::maps::PROGRAM_TCX, limiter_common::maps::PROGRAM_LAYERS_TCX] {
        let info = limiter.classifier_named(name).expect("the program").info().expect("program info");
        counts.push((name, info.verified_instruction_count()));
    }
    Probe::load().expect("the probe passes the verifier");
    // The verifier's own count, held to the bar every kernel of the matrix is held to
    // (tests/kernels/matrix.rs), so a feature cannot quietly eat the headroom under its 1,000,000.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    for (name, count) in &counts {
        eprintln!("| {} (host) | {name} | {} |", release.trim(), count.map_or("?".into(), |n| thousands(n.into())));
    }
    let over: Vec<String> = counts
        .iter()
        .filter_map(|(name, count)| match count {
            Some(n) if u64::from(*n) <= MAX_INSNS => None,
            Some(n) => Some(format!("{name}: {} processed instructions", thousands((*n).into()))),
            None => Some(format!("{name}: the kernel did not report its count")),
        })
        .collect();
    assert!(
        over.is_empty(),
        "over the verifier's bar of {} instructions:\n  {}",
        thousands(MAX_INSNS),
        over.join("\n  ")
    );
}

/// Where the limiter put one frame: dropped as unreadable, judged by a policy, or unmatched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Went {
    Unreadable,
    Judged(u16),
    Unmatched,
}

/// One policy shape of [`hidden_ports_are_dropped_only_where_a_policy_could_miss_them`]: its
/// policies (id, keyed on the port, unit, mode), the policy of each class (`any` folded in),
/// whether `tcp:443` has a port policy, and where each of [`HIDDEN_FRAMES`] must go.
struct Shape {
    name: &'static str,
    policies: &'static [(u16, bool, Unit, Mode)],
    classes: [u16; 4],
    port_policy: bool,
    expect: [Went; 7],
}

/// First fragments hiding their ports (TCP over IPv4 and IPv6, UDP over IPv6), hiding even their
/// protocol (a cut or too long IPv6 chain), then later fragments (UDP over IPv4; IPv6 stating TCP).
const HIDDEN_FRAMES: [&str; 7] = [
    "v4_first_fragment_8_bytes_of_tcp",
    "v6_first_fragment_doff_past_fragment",
    "v6_first_fragment_7_bytes_of_udp",
    "v6_first_fragment_cut_chain",
    "v6_33_dest_opts_udp",
    "v4_non_first_fragment",
    "v6_non_first_fragment_claims_tcp",
];

/// Hidden ports are dropped only where a policy could miss them, and never buy an allowance: a
/// datagram that hides its port is judged by its class only where every policy it could be
/// meant for is that one policy and it does not key on the port (else the hidden port's key,
/// port 0, would be a second allowance beside the real port's). Later fragments, which have no
/// port at all, are judged by the policy of the class they state (IPv4) or `other` (IPv6).
#[test]
fn hidden_ports_are_dropped_only_where_a_policy_could_miss_them() {
    use Went::{Judged as J, Unmatched as N, Unreadable as U};
    require_root!();
    const ANY: u16 = 1;
    const TCP: u16 = 2;
    const UDP: u16 = 3;
    const PORT: u16 = 4;
    const PK: Unit = Unit::Packets;
    const BY: Unit = Unit::Bytes;
    const EN: Mode = Mode::Enforce;
    const DR: Mode = Mode::DryRun;
    let shapes = [
        Shape {
            name: "any",
            policies: &[(ANY, false, PK, EN)],
            classes: [ANY; 4],
            port_policy: false,
            expect: [J(ANY), J(ANY), J(ANY), J(ANY), J(ANY), J(ANY), J(ANY)],
        },
        Shape {
            name: "any +dport",
            policies: &[(ANY, true, PK, EN)],
            classes: [ANY; 4],
            port_policy: false,
            expect: [U, U, U, U, U, J(ANY), J(ANY)],
        },
        Shape {
            name: "any, tcp",
            policies: &[(ANY, false, PK, EN), (TCP, false, PK, EN)],
            classes: [TCP, ANY, ANY, ANY],
            port_policy: false,
            expect: [J(TCP), J(TCP), J(ANY), U, U, J(ANY), J(ANY)],
        },
        Shape {
            name: "any, tcp +dport",
            policies: &[(ANY, false, PK, EN), (TCP, true, PK, EN)],
            classes: [TCP, ANY, ANY, ANY],
            port_policy: false,
            expect: [U, U, J(ANY), U, U, J(ANY), J(ANY)],
        },
        Shape {
            name: "tcp +dport",
            policies: &[(TCP, true, PK, EN)],
            classes: [TCP, 0, 0, 0],
            port_policy: false,
            expect: [U, U, N, U, U, N, N],
        },
        Shape {
            name: "tcp +dport, dry-run",
            policies: &[(TCP, true, PK, DR)],
            classes: [TCP, 0, 0, 0],
            port_policy: false,
            expect: [U, U, N, U, U, N, N],
        },
        Shape {
            name: "udp +dport, bytes",
            policies: &[(UDP, true, BY, EN)],
            classes: [0, UDP, 0, 0],
            port_policy: false,
            expect: [N, N, U, U, U, J(UDP), N],
        },
        Shape {
            name: "udp, bytes",
            policies: &[(UDP, false, BY, EN)],
            classes: [0, UDP, 0, 0],
            port_policy: false,
            expect: [N, N, J(UDP), U, U, J(UDP), N],
        },
        Shape {
            name: "tcp:443, any",
            policies: &[(ANY, false, PK, EN), (PORT, false, PK, EN)],
            classes: [ANY; 4],
            port_policy: true,
            expect: [U, U, U, U, U, J(ANY), J(ANY)],
        },
    ];
    let all = frames::fixtures();
    let frames: Vec<Vec<u8>> = HIDDEN_FRAMES
        .iter()
        .map(|name| all.iter().find(|f| f.name == *name).unwrap_or_else(|| panic!("no fixture {name}")).frame.clone())
        .collect();
    let mut failures = Vec::new();
    for (shape, hook) in shapes.iter().flat_map(|s| TestHook::ALL.map(|h| (s, h))) {
        let mut limiter = Limiter::load(BUCKETS).expect("loading the limiter");
        if hook == TestHook::Tcx {
            limiter.load_hook(Hook::Tc).expect("loading the tc programs");
        }
        limiter.set_salt(SALT).expect("salt");
        for &(id, dport, unit, mode) in shape.policies {
            let key = KeySpec { dport, ..KeySpec::default() };
            let spec = PolicyDef { unit, mode, ..permissive(key) };
            limiter.set_policy(&compile::policy(&spec, id).expect("policy")).expect("policy");
        }
        let old = limiter.read_view().expect("view");
        let mut new = old.clone();
        new.routes.class_policy = shape.classes;
        if shape.port_policy {
            new.routes.ports[(CLASS_TCP << 16) | 443] = PORT;
        }
        limiter.apply(&old, &new).expect("routes");
        for (i, frame) in frames.iter().enumerate() {
            let before = counters(&limiter);
            let action = limiter.test_run_at(hook, frame).expect("test run");
            let after = counters(&limiter);
            let moved = differences(&after, &before);
            let went = if after[0].unreadable_ports == before[0].unreadable_ports + 1 {
                Some(U)
            } else if after[0].unmatched == before[0].unmatched + 1 {
                Some(N)
            } else {
                (1..after.len()).find(|&id| after[id].packets() == before[id].packets() + 1).map(|id| J(id as u16))
            };
            let want = shape.expect[i];
            let want_action = if want == U { XDP_DROP } else { XDP_PASS };
            if went != Some(want) || action != want_action || moved.len() != 1 {
                failures.push(format!(
                    "{} at {hook:?}: {}: went {went:?} with action {action}, want {want:?}; moved {moved:?}",
                    shape.name, HIDDEN_FRAMES[i]
                ));
            }
        }
    }
    assert_none(&failures, "hidden or later fragments judged wrong");
}

/// A SYN-only policy (`tcp:443,syn`, `tcp,syn`) judges SYNs without ACK only; every other
/// segment (SYN-ACK, ACK, RST, FIN) is judged as if it were absent: by the protocol's policy,
/// else `any`'s, else by none. IPv4 and IPv6 alike.
#[test]
fn syn_only_policies_judge_connection_openings_only() {
    use frames::Segment;
    require_root!();
    const TCP: u16 = 2;
    // (name, policies (name, match), which judge a SYN to port 443, which judge every other
    // segment): every policy that covers a segment judges it, a SYN-only one only SYNs.
    type Case =
        (&'static str, &'static [(&'static str, &'static str)], &'static [&'static str], &'static [&'static str]);
    let cases: [Case; 6] = [
        ("tcp:443,syn", &[("port", "tcp:443,syn")], &["port"], &[]),
        ("tcp:443,syn, tcp", &[("port", "tcp:443,syn"), ("tcp", "tcp")], &["port", "tcp"], &["tcp"]),
        ("tcp:443,syn, any", &[("port", "tcp:443,syn"), ("any", "any")], &["port", "any"], &["any"]),
        (
            "tcp:443,syn, tcp, any",
            &[("port", "tcp:443,syn"), ("tcp", "tcp"), ("any", "any")],
            &["port", "tcp", "any"],
            &["tcp", "any"],
        ),
        ("tcp,syn", &[("tcp", "tcp,syn")], &["tcp"], &[]),
        ("tcp,syn, any", &[("tcp", "tcp,syn"), ("any", "any")], &["tcp", "any"], &["any"]),
    ];
    let v4 = frames::v4(1, 1);
    let v6 = frames::v6(1, 1);
    let segments: Vec<(String, Segment, Vec<u8>)> = Segment::ALL
        .iter()
        .flat_map(|&seg| {
            let l4 = frames::tcp_segment(40_000, 443, seg);
            [
                (format!("v4 {seg:?}"), seg, ethernet(&[], EtherType::IPV4, &V4::from(v4).datagram(&l4))),
                (format!("v6 {seg:?}"), seg, ethernet(&[], EtherType::IPV6, &ipv6(v6, &[], &l4))),
            ]
        })
        .collect();
    let mut failures = Vec::new();
    // At both hooks: a SYN several policies judge goes through the layers' tail call, which at
    // tcx is the tc program's own (`JUMPS_TCX`).
    for ((name, policies, syn_judges, other_judges), hook) in cases.iter().flat_map(|c| TestHook::ALL.map(|h| (c, h))) {
        let name = format!("{name} at {hook:?}");
        let mut limiter = Limiter::load(BUCKETS).expect("loading the limiter");
        if hook == TestHook::Tcx {
            limiter.load_hook(Hook::Tc).expect("loading the tc programs");
        }
        limiter.set_salt(SALT).expect("salt");
        let state = policies.iter().fold(limiter_ctl::config::State::default(), |s, &(n, matches)| {
            let def = PolicyDef {
                name: n.parse().expect("a name"),
                matches: matches.parse().expect("a match"),
                ..permissive(KeySpec::default())
            };
            s.with_policy(def).expect("a valid state")
        });
        let names: Vec<(u16, &str)> = policies
            .iter()
            .map(|&(n, _)| (state.policy(&n.parse().expect("a name")).expect("its entry").id, n))
            .collect();
        let old = limiter.read_view().expect("view");
        limiter.apply(&old, &limiter_ctl::kernel::MapView::of(&state)).expect("policies and routes");
        for (frame_name, seg, frame) in &segments {
            let before = counters(&limiter);
            let action = limiter.test_run_at(hook, frame).expect("test run");
            let after = counters(&limiter);
            let judged: Vec<&str> = names
                .iter()
                .filter(|(id, _)| {
                    after[usize::from(*id)].admitted_packets == before[usize::from(*id)].admitted_packets + 1
                })
                .map(|(_, n)| *n)
                .collect();
            let unmatched = after[0].unmatched == before[0].unmatched + 1;
            let want = if *seg == Segment::Syn { *syn_judges } else { *other_judges };
            let mut sorted_want: Vec<&str> = want.to_vec();
            sorted_want.sort();
            let mut sorted_judged = judged.clone();
            sorted_judged.sort();
            if sorted_judged != sorted_want || unmatched != want.is_empty() || action != XDP_PASS {
                failures.push(format!(
                    "{name}: {frame_name}: judged by {judged:?} (unmatched: {unmatched}) with action {action}, want {want:?}"
                ));
            }
        }
    }
    assert_none(&failures, "segments judged wrong under SYN-only policies");

    // A first fragment hiding its TCP header hides its flags too: under `tcp,syn` (no port policy,
    // no `+dport`) it is dropped, not passed by as if it were no SYN (a tiny-fragment SYN flood).
    let mut limiter = Limiter::load(BUCKETS).expect("loading the limiter");
    limiter.set_salt(SALT).expect("salt");
    let spec = PolicyDef { matches: "tcp,syn".parse().expect("a match"), ..permissive(KeySpec::default()) };
    limiter.set_policy(&compile::policy(&spec, TCP).expect("policy")).expect("policy");
    let old = limiter.read_view().expect("view");
    let mut new = old.clone();
    new.routes.class_policy = [TCP, 0, 0, 0];
    limiter.apply(&old, &new).expect("routes");
    let all = frames::fixtures();
    for name in ["v4_first_fragment_8_bytes_of_tcp", "v6_first_fragment_doff_past_fragment"] {
        let frame = &all.iter().find(|f| f.name == name).unwrap_or_else(|| panic!("no fixture {name}")).frame;
        let before = counters(&limiter);
        let action = limiter.test_run(frame).expect("test run");
        let after = counters(&limiter);
        assert_eq!(action, XDP_DROP, "{name} under tcp,syn");
        assert_eq!(after[0].unreadable_ports, before[0].unreadable_ports + 1, "{name} under tcp,syn");
    }
}

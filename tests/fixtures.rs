//! The real limiter program on the packet fixtures, through BPF_PROG_TEST_RUN: where each
//! fixture is counted, what every truncation of it becomes, that a burst is enforced per
//! source, and that the program picks the very bucket userspace predicts.

use std::collections::BTreeSet;

use etherparse::EtherType;
use limiter_common::{
    SipKey,
    key::{FAMILY_V4, FAMILY_V6},
    maps::{Counters, GENERATIONS, ParseProbe, Policy},
};
use limiter_ctl::{Limiter, policy::PolicySpec, rate::Rate};
use limiter_tests::{
    cpu::pin_current_thread,
    frames::{self, ETH_LEN, Expect, Tag, V4, ethernet, hex, ipv6, tcp, udp},
    privileged::require,
    reference::{
        self, PROBE_KEY,
        kernel::{Judge, XDP_DROP, XDP_PASS, errno},
    },
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

/// `before` with the one counter a fixture of class `expect` must move.
fn counted(mut before: Vec<Counters>, expect: Expect, len: usize) -> Vec<Counters> {
    match expect {
        Expect::NotIp => before[0].not_ip += 1,
        Expect::Malformed => before[0].malformed += 1,
        Expect::Ip { .. } => {
            let c = &mut before[usize::from(Judge::POLICY)];
            c.admitted_packets += 1;
            c.admitted_bytes += len as u64;
        }
    }
    before
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
    if !require("every_fixture_passes_and_is_counted_in_its_class") {
        return;
    }
    let judge = judge();
    let mut failures = Vec::new();
    for f in frames::fixtures() {
        let before = counters(&judge.limiter);
        let action = judge.limiter.test_run(&f.frame).unwrap_or_else(|e| panic!("{}: test run: {e}", f.name));
        if action != XDP_PASS {
            failures.push(format!("{}: XDP action {action}; a permissive policy passes everything", f.name));
        }
        // Exactly one counter moved, the right one: every other field of every policy is unchanged.
        let want = counted(before, f.expect, f.frame.len());
        for d in differences(&counters(&judge.limiter), &want) {
            failures.push(format!("{} ({:?}): {d}", f.name, f.expect));
        }
    }
    assert_none(&failures, "wrong counters after a fixture");
}

#[test]
fn named_malformed_cases_are_in_the_table_and_counted_malformed() {
    if !require("named_malformed_cases_are_in_the_table_and_counted_malformed") {
        return;
    }
    let cases = [
        "v4_ihl_4",
        "v4_ihl_0",
        "v4_total_len_below_ihl",
        "v4_total_len_below_ihl_options",
        "v4_total_len_past_frame",
        "v6_payload_len_past_frame",
        "v6_seven_exts_tcp",
        "v6_endless_hop_by_hop",
        "v6_ext_len_past_datagram",
        "three_vlan_tags",
        "three_vlan_tags_ad",
    ];
    let all = frames::fixtures();
    let mut judge = judge();
    for name in cases {
        let f = all.iter().find(|f| f.name == name).unwrap_or_else(|| panic!("fixture {name} is gone"));
        assert_eq!(f.expect, Expect::Malformed, "{name}");
        let class = judge.classify(&f.frame).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(class, ParseProbe::MALFORMED, "{name}");
    }
}

#[test]
fn every_cut_of_every_fixture_gets_the_expected_class() {
    if !require("every_cut_of_every_fixture_gets_the_expected_class") {
        return;
    }
    let mut judge = judge();
    let (mut runs, mut failures) = (0, Vec::new());
    for f in frames::fixtures() {
        for len in ETH_LEN..=f.frame.len() {
            let cut = &f.frame[..len];
            let class = judge.classify(cut).unwrap_or_else(|e| panic!("{} cut to {len}: {e:#}", f.name));
            // Two independent expectations: the fixture's own rule, and the reference parser.
            let rule = f.expect_cut(len).verdict();
            let reference = reference::parse(cut).probe.verdict;
            if rule != reference || class != rule {
                let got = format!("kernel {class}, rule {rule}, reference {reference}");
                failures.push(format!("{} cut to {len}: {got}: {}", f.name, hex(cut)));
            }
            runs += 1;
        }
    }
    eprintln!("{runs} cuts checked");
    assert_none(&failures, "cuts with the wrong class (1 not IP, 2 malformed, 3 IP)");
}

/// BPF_PROG_TEST_RUN refuses an XDP frame shorter than an Ethernet header with EINVAL, so the
/// program can never be handed one (not by test runs, and no driver delivers one either): the
/// parser's "shorter than 14 bytes" path is only reachable through its bounds checks.
#[test]
fn frames_shorter_than_ethernet_never_reach_the_program() {
    if !require("frames_shorter_than_ethernet_never_reach_the_program") {
        return;
    }
    let judge = judge();
    let before = counters(&judge.limiter);
    let frame = ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(0, 1)).datagram(&tcp(1, 2)));
    for len in 0..ETH_LEN {
        let err = judge.limiter.test_run(&frame[..len]).expect_err("the kernel ran a frame shorter than Ethernet");
        assert_eq!(errno(&err), Some(libc::EINVAL), "{len} bytes: {err}");
    }
    assert_eq!(counters(&judge.limiter), before, "a refused test run must not reach the program");
}

/// A policy of 10 per minute with a burst of 5: slow enough that no refill happens between
/// packets sent microseconds apart, even on a loaded machine.
fn burst_policy(id: u16) -> Policy {
    let spec = PolicySpec::any(Rate { count: 10, period_ns: 60_000_000_000 }, 5);
    spec.compile(id).expect("10/min burst 5 is representable")
}

#[test]
fn a_source_gets_its_burst_then_is_dropped_and_others_still_pass() {
    if !require("a_source_gets_its_burst_then_is_dropped_and_others_still_pass") {
        return;
    }
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
    for (family, a, b) in cases {
        let mut limiter = Limiter::load(BUCKETS).expect("loading the limiter");
        limiter.set_salt(SALT).expect("salt");
        limiter.set_policy(&burst_policy(ID)).expect("policy");
        limiter.set_default_policy(ID).expect("default policy");
        let run = |frame: &[u8]| limiter.test_run(frame).expect("test run");
        for i in 1..=BURST {
            assert_eq!(run(&a), XDP_PASS, "{family}: packet {i} of the burst from A");
        }
        assert_eq!(run(&a), XDP_DROP, "{family}: packet {} from A, past the burst", BURST + 1);
        assert_eq!(run(&b), XDP_PASS, "{family}: B has its own allowance");

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
    if !require("the_program_picks_the_bucket_userspace_predicts") {
        return;
    }
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
            let key = reference::flow_key(Judge::POLICY, &PROBE_KEY, sent.family, &sent.src, sent.dport);
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

//! Differential test of the XDP parser: the probe program (the limiter's own parser and key
//! builder, compiled for BPF) against the independent userspace reference, field by field, on
//! every cut of every fixture and on at least 100,000 mutated and random frames. The real
//! limiter program runs on each frame too, with a policy per protocol class and one port policy,
//! and must count it where the reference says: not IP, malformed, dropped for hidden ports, or
//! admitted by the port policy or its class's policy.
//!
//! The generator is a seeded `StdRng`: the seed is printed, and `LIMITER_DIFF_SEED=<n>` replays
//! (or varies) a run.

use limiter_common::{SipKey, key::FAMILY_V4, testing::ParseProbe};
use limiter_tests::{
    frames::{self, ETH_LEN, Fixture, TAG_LEN, hex, set_u16},
    kernel_programs::{Judge, Landed, Probe, errno},
    reference::{self, MAX_EXT_HEADERS, MAX_VLAN_TAGS, PROBE_KEY, Parsed},
    require_root,
};
use rand::{Rng, SeedableRng, rngs::StdRng, seq::IndexedRandom};

/// Random and mutated frames actually test-run (the kernel refuses the shorter-than-Ethernet ones).
const RANDOM_FRAMES: usize = 100_000;
const DEFAULT_SEED: u64 = 0x1100_17e5;
const SALT: SipKey = SipKey { k0: 0x1111_2222_3333_4444, k1: 0x5555_6666_7777_8888 };
/// Shares of the run the rarer paths must reach (about half of what the default seed reaches).
const COVER_CUT_L4: f64 = 0.05;
const COVER_HIDDEN: f64 = 0.02;
const COVER_CUT_CHAIN: f64 = 0.02;
const COVER_LONG_CHAIN: f64 = 0.004;
const COVER_PORT_POLICY: f64 = 0.02;
const COVER_MID_CHAIN: f64 = 0.005;
const COVER_MAX_CHAIN: f64 = 0.008;
/// Mismatches printed in full; the rest are only counted.
const SHOWN: usize = 20;

/// Byte values that steer a parser: versions/IHLs, protocol and next-header numbers, TCP data
/// offsets, ethertype halves.
const BYTES: &[u8] = &[
    0x00, 0x01, 0x06, 0x08, 0x11, 0x2b, 0x2c, 0x33, 0x3a, 0x3b, 0x3c, 0x40, 0x44, 0x45, 0x46, 0x4f, 0x50, 0x60, 0x81,
    0x86, 0x88, 0xa8, 0xdd, 0xf0, 0xff,
];
/// 16-bit values: ethertypes and TPIDs, fragment fields, extreme lengths.
const WORDS: &[u16] =
    &[0x0800, 0x86dd, 0x8100, 0x88a8, 0x0806, 0x9100, 0x0000, 0xffff, 0x0001, 0x0014, 0x0028, 0x2000, 0x1fff, 0x3fff];
/// IPv4 protocols / IPv6 next headers worth landing on.
const PROTOS: &[u8] = &[0, 1, 6, 17, 43, 44, 47, 50, 51, 58, 59, 60, 255];

fn seed() -> u64 {
    match std::env::var("LIMITER_DIFF_SEED") {
        Ok(s) => s.parse().expect("LIMITER_DIFF_SEED must be a u64"),
        Err(_) => DEFAULT_SEED,
    }
}

/// A frame being mutated, with where its network header currently starts.
struct Frame {
    bytes: Vec<u8>,
    l3: usize,
}

impl Frame {
    fn version(&self) -> Option<u8> {
        self.bytes.get(self.l3).map(|b| b >> 4)
    }

    /// A random offset among the first `span` bytes from `from`, if any is inside the frame.
    fn offset(&self, rng: &mut StdRng, from: usize, span: usize) -> Option<usize> {
        let end = self.bytes.len().min(from + span);
        (from < end).then(|| rng.random_range(from..end))
    }

    fn set_u16_at(&mut self, at: usize, value: u16) {
        if at + 2 <= self.bytes.len() {
            set_u16(&mut self.bytes, at, value);
        }
    }

    /// One random mutation, mostly aimed at header fields.
    fn mutate(&mut self, rng: &mut StdRng) {
        let headers = self.l3 + 80;
        match rng.random_range(0..14) {
            0..=2 => {
                if let Some(at) = self.offset(rng, 0, headers) {
                    self.bytes[at] = if rng.random() { *BYTES.choose(rng).expect("non-empty") } else { rng.random() };
                }
            }
            3 | 4 => {
                if let Some(at) = self.offset(rng, 12, headers) {
                    let value = if rng.random() { *WORDS.choose(rng).expect("non-empty") } else { rng.random() };
                    self.set_u16_at(at, value);
                }
            }
            5 => self.ip_length(rng),
            6 => self.next_header(rng),
            7 => {
                // Version and IHL together.
                if let Some(b) = self.bytes.get_mut(self.l3) {
                    *b = rng.random_range(0..16u8) << 4 | rng.random_range(0..16u8);
                }
            }
            8 => self.truncate(rng),
            9 => {
                let n = rng.random_range(1..=64);
                self.bytes.extend((0..n).map(|_| rng.random::<u8>()));
            }
            10 => self.tag(rng),
            11 => self.untag(),
            12 => self.source(rng),
            _ => {
                // IPv4 flags and fragment offset (also lands in IPv6's flow label / payload length).
                let value = *[0x0000, 0x2000, 0x4000, 0x0001, 0x00b9, 0x1fff, 0x3fff].choose(rng).expect("non-empty");
                self.set_u16_at(self.l3 + 6, value);
            }
        }
    }

    /// Cuts the frame, half the time within its last 16 bytes (where the L4 header ends).
    fn truncate(&mut self, rng: &mut StdRng) {
        let len = self.bytes.len();
        let from = if rng.random() { len.saturating_sub(16) } else { 0 };
        self.bytes.truncate(rng.random_range(from..=len));
    }

    /// A random source address (and so a different key), the rest of the frame untouched.
    fn source(&mut self, rng: &mut StdRng) {
        let (at, len) = if self.version() == Some(6) { (self.l3 + 8, 16) } else { (self.l3 + 12, 4) };
        if at + len <= self.bytes.len() {
            rng.fill(&mut self.bytes[at..at + len]);
        }
    }

    /// The IPv4 total length or IPv6 payload length, near what the frame holds.
    fn ip_length(&mut self, rng: &mut StdRng) {
        let (at, fixed) = if self.version() == Some(6) { (self.l3 + 4, 40) } else { (self.l3 + 2, 0) };
        let held = self.bytes.len() as i64 - self.l3 as i64 - fixed;
        let near = (held + rng.random_range(-48..=8)).clamp(0, 0xffff) as u16;
        let value = if rng.random_ratio(1, 4) { rng.random() } else { near };
        self.set_u16_at(at, value);
    }

    /// The IPv4 protocol, the IPv6 next header, or the next-header byte of an (8-byte aligned)
    /// extension header further on.
    fn next_header(&mut self, rng: &mut StdRng) {
        let at = match self.version() {
            Some(4) => self.l3 + 9,
            Some(6) if rng.random() => self.l3 + 6,
            // Extension headers of 8 bytes, as far as the longest chains of the fixtures.
            _ => self.l3 + 40 + 8 * rng.random_range(0..=MAX_EXT_HEADERS + 1),
        };
        if let Some(b) = self.bytes.get_mut(at) {
            *b = *PROTOS.choose(rng).expect("non-empty");
        }
    }

    /// Inserts a tag right after the MAC addresses (the old ethertype follows it).
    fn tag(&mut self, rng: &mut StdRng) {
        if self.bytes.len() >= 12 {
            let tpid: u16 = if rng.random() { 0x8100 } else { 0x88a8 };
            let mut tag = tpid.to_be_bytes().to_vec();
            tag.extend_from_slice(&rng.random_range(0..0x1000u16).to_be_bytes());
            self.bytes.splice(12..12, tag);
            self.l3 += TAG_LEN;
        }
    }

    fn untag(&mut self) {
        if self.bytes.len() >= ETH_LEN + TAG_LEN && self.l3 >= ETH_LEN + TAG_LEN {
            self.bytes.drain(12..12 + TAG_LEN);
            self.l3 -= TAG_LEN;
        }
    }
}

/// Random bytes, usually under an ethertype and version the parser will follow.
fn noise(rng: &mut StdRng) -> Vec<u8> {
    let len = rng.random_range(0..=160);
    let mut bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
    if len >= ETH_LEN && rng.random_ratio(3, 4) {
        let ether_type = *[0x0800u16, 0x86dd, 0x8100, 0x88a8].choose(rng).expect("non-empty");
        set_u16(&mut bytes, 12, ether_type);
        if let Some(b) = bytes.get_mut(ETH_LEN) {
            *b = if ether_type == 0x86dd { 0x60 } else { 0x45 };
        }
    }
    bytes
}

fn mutated(rng: &mut StdRng, fixtures: &[Fixture]) -> Vec<u8> {
    if rng.random_ratio(1, 10) {
        return noise(rng);
    }
    let f = fixtures.choose(rng).expect("fixtures");
    let mut frame = Frame { bytes: f.frame.clone(), l3: f.l3 };
    // Mostly one mutation: each one more makes a malformed frame likelier.
    let count = *[1, 1, 1, 1, 1, 2, 2, 2, 3, 4].choose(rng).expect("non-empty");
    for _ in 0..count {
        frame.mutate(rng);
    }
    frame.bytes
}

/// What the run covered: checked by [`Coverage::assert_broad`] so the generator cannot quietly
/// stop reaching a class.
#[derive(Default, Debug)]
struct Coverage {
    frames: usize,
    too_short: usize,
    not_ip: usize,
    malformed: usize,
    ip_v4: usize,
    ip_v6: usize,
    with_l4: usize,
    /// IP with L4 by class: TCP, UDP, ICMP/ICMPv6.
    tcp: usize,
    /// TCP with SYN set and ACK clear (`Packet::syn`).
    tcp_syn: usize,
    udp: usize,
    icmp: usize,
    /// IP without an L4 header (another protocol, a later fragment, a cut header).
    no_l4: usize,
    /// IP of TCP, UDP or ICMP whose header is cut (not a later fragment, no long chain).
    cut_l4: usize,
    non_first_fragment: usize,
    ports_hidden: usize,
    cut_chain: usize,
    long_chain: usize,
    /// Landed on the port policy.
    port_policy: usize,
    /// IP packets by how many IPv6 extension headers were walked.
    ext_headers: Vec<usize>,
    /// Frames (any class) by how many VLAN tags were read.
    tags: [usize; MAX_VLAN_TAGS + 1],
}

impl Coverage {
    fn record(&mut self, parsed: &Parsed) {
        let p = &parsed.probe;
        self.frames += 1;
        self.tags[parsed.path.tags] += 1;
        match p.verdict {
            ParseProbe::NOT_IP => self.not_ip += 1,
            ParseProbe::MALFORMED => self.malformed += 1,
            _ => self.record_ip(parsed),
        }
    }

    fn record_ip(&mut self, parsed: &Parsed) {
        let p = &parsed.probe;
        if p.family == FAMILY_V4 {
            self.ip_v4 += 1
        } else {
            self.ip_v6 += 1
        }
        self.ext_headers.resize(MAX_EXT_HEADERS + 1, 0);
        self.ext_headers[parsed.path.ext_headers] += 1;
        self.non_first_fragment += usize::from(parsed.path.non_first_fragment);
        self.ports_hidden += usize::from(p.ports_hidden != 0);
        self.cut_chain += usize::from(parsed.path.cut_chain);
        self.long_chain += usize::from(parsed.path.long_chain);
        self.port_policy += usize::from(Judge::expected(parsed) == Landed::Policy(Judge::PORT_POLICY));
        if p.has_l4 == 0 {
            self.no_l4 += 1;
            let path = &parsed.path;
            let chain_ended = !path.non_first_fragment && !path.cut_chain && !path.long_chain;
            self.cut_l4 += usize::from(chain_ended && matches!(p.proto, 6 | 17 | 1 | 58) && parsed.class != 3);
            return;
        }
        self.with_l4 += 1;
        match p.proto {
            6 => {
                self.tcp += 1;
                self.tcp_syn += usize::from(p.syn != 0);
            }
            17 => self.udp += 1,
            _ => self.icmp += 1,
        }
    }

    fn print(&self) {
        let pct = |n: usize| 100.0 * n as f64 / self.frames.max(1) as f64;
        eprintln!("{} frames test-run; {} shorter than Ethernet, refused (EINVAL)", self.frames, self.too_short);
        for (name, n) in [
            ("not IP", self.not_ip),
            ("malformed", self.malformed),
            ("IPv4", self.ip_v4),
            ("IPv6", self.ip_v6),
            ("  with L4", self.with_l4),
            ("    TCP", self.tcp),
            ("      SYN", self.tcp_syn),
            ("      not SYN", self.tcp - self.tcp_syn),
            ("    UDP", self.udp),
            ("    ICMP/ICMPv6", self.icmp),
            ("  no L4", self.no_l4),
            ("    cut L4 header", self.cut_l4),
            ("  later fragments", self.non_first_fragment),
            ("  ports hidden", self.ports_hidden),
            ("  cut IPv6 chain", self.cut_chain),
            ("  IPv6 chain > max", self.long_chain),
            ("  port policy", self.port_policy),
        ] {
            eprintln!("{name:<20} {n:>7} {:>5.1}%", pct(n));
        }
        eprintln!("IP by IPv6 extension headers walked (0..={MAX_EXT_HEADERS}): {:?}", self.ext_headers);
        eprintln!("frames by VLAN tags (0..={MAX_VLAN_TAGS}): {:?}", self.tags);
    }

    /// Every path the parser has is exercised a fair number of times.
    fn assert_broad(&self) {
        let at_least = |what: &str, n: usize, share: f64| {
            let need = (self.frames as f64 * share) as usize;
            assert!(n >= need, "coverage: {what} {n} < {need} ({:.1}% of {})", share * 100.0, self.frames);
        };
        // About half of what the default seed reaches.
        at_least("not IP", self.not_ip, 0.05);
        at_least("malformed", self.malformed, 0.2);
        at_least("IPv4", self.ip_v4, 0.05);
        at_least("IPv6", self.ip_v6, 0.05);
        at_least("TCP", self.tcp, 0.03);
        at_least("TCP SYN", self.tcp_syn, 0.03);
        // The fixtures' TCP is SYNs: other flags come from mutated bytes only.
        at_least("TCP not SYN", self.tcp - self.tcp_syn, 0.0003);
        at_least("UDP", self.udp, 0.03);
        at_least("ICMP", self.icmp, 0.005);
        at_least("IP without L4", self.no_l4, 0.05);
        at_least("later fragments", self.non_first_fragment, 0.02);
        at_least("cut L4 headers", self.cut_l4, COVER_CUT_L4);
        at_least("ports hidden", self.ports_hidden, COVER_HIDDEN);
        at_least("cut IPv6 chains", self.cut_chain, COVER_CUT_CHAIN);
        at_least("IPv6 chains past the max", self.long_chain, COVER_LONG_CHAIN);
        at_least("port policy", self.port_policy, COVER_PORT_POLICY);
        at_least("2 VLAN tags", self.tags[2], 0.03);
        for (n, &count) in self.ext_headers.iter().enumerate().take(7).skip(1) {
            at_least(&format!("IP after {n} extension headers"), count, 0.002);
        }
        let between: usize = self.ext_headers[7..MAX_EXT_HEADERS].iter().sum();
        at_least(&format!("IP after 7..{MAX_EXT_HEADERS} extension headers"), between, COVER_MID_CHAIN);
        at_least(
            &format!("IP after {MAX_EXT_HEADERS} extension headers"),
            self.ext_headers[MAX_EXT_HEADERS],
            COVER_MAX_CHAIN,
        );
        at_least("frames shorter than Ethernet", self.too_short, 0.005);
    }
}

struct Mismatch {
    frame: Vec<u8>,
    reference: ParseProbe,
    probe: ParseProbe,
    landed: Landed,
    expected: Landed,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "frame ({} bytes) {}", self.frame.len(), hex(&self.frame))?;
        writeln!(f, "  reference     {:?}", self.reference)?;
        writeln!(f, "  probe         {:?}", self.probe)?;
        write!(f, "  limiter       landed {:?}, reference says {:?}", self.landed, self.expected)
    }
}

struct Harness {
    probe: Probe,
    judge: Judge,
    coverage: Coverage,
    mismatches: Vec<Mismatch>,
}

impl Harness {
    /// Compares the programs with the reference on `frame`; false when the kernel refused it.
    fn check(&mut self, frame: &[u8]) -> bool {
        if frame.len() < ETH_LEN {
            self.refused(frame);
            return false;
        }
        let want = reference::parse(frame);
        let failed = |what: &str, e: anyhow::Error| -> ! { panic!("{what} test run on {}: {e:#}", hex(frame)) };
        let probe = self.probe.run(frame).unwrap_or_else(|e| failed("probe", e));
        let landed = self.judge.classify(frame).unwrap_or_else(|e| failed("limiter", e));
        let expected = Judge::expected(&want);
        self.coverage.record(&want);
        if probe != want.probe || landed != expected {
            self.mismatches.push(Mismatch { frame: frame.to_vec(), reference: want.probe, probe, landed, expected });
        }
        true
    }

    /// The kernel refuses frames shorter than an Ethernet header (EINVAL) for both programs:
    /// they are counted, never compared.
    fn refused(&mut self, frame: &[u8]) {
        let probe = self.probe.run(frame).expect_err("the probe ran a frame shorter than Ethernet");
        assert_eq!(errno(probe.as_ref()), Some(libc::EINVAL), "probe, {} bytes: {probe:#}", frame.len());
        let limiter = self.judge.classify(frame).expect_err("the limiter ran a frame shorter than Ethernet");
        assert_eq!(errno(limiter.as_ref()), Some(libc::EINVAL), "limiter, {} bytes: {limiter:#}", frame.len());
        self.coverage.too_short += 1;
    }
}

#[test]
fn kernel_parser_matches_the_reference() {
    require_root!();
    let seed = seed();
    eprintln!("seed {seed} (replay with LIMITER_DIFF_SEED={seed})");
    let mut h = Harness {
        probe: Probe::load().expect("loading the probe program (root, BPF)"),
        judge: Judge::load(1 << 16, SALT, PROBE_KEY).expect("loading the limiter"),
        coverage: Coverage::default(),
        mismatches: Vec::new(),
    };
    let fixtures = frames::fixtures();
    // Deterministic part: every fixture cut at every length, the short ones included.
    for f in &fixtures {
        for len in 0..=f.frame.len() {
            let _ = h.check(&f.frame[..len]);
        }
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut random = 0;
    while random < RANDOM_FRAMES {
        let frame = mutated(&mut rng, &fixtures);
        random += usize::from(h.check(&frame));
    }
    h.coverage.print();
    for m in h.mismatches.iter().take(SHOWN) {
        eprintln!("MISMATCH {m}");
    }
    assert!(h.mismatches.is_empty(), "{} mismatches (first {SHOWN} above), seed {seed}", h.mismatches.len());
    h.coverage.assert_broad();
}

//! An independent userspace reference for the XDP parser: etherparse's header parsers applied
//! to the parser's written spec (the module docs of `limiter-ebpf/src/parse.rs`), never to its
//! code. It yields exactly what the probe program records ([`ParseProbe`]), so the differential
//! test can compare the two field by field.
//!
//! The spec, as implemented here:
//! - Ethernet II, then at most [`MAX_VLAN_TAGS`] tags (TPID 0x8100 or 0x88a8); a third tag is
//!   malformed, any ethertype other than IPv4/IPv6 after the tags is not IP.
//! - IPv4: version 4, IHL >= 5, total length >= IHL, the datagram fits in the frame. A non-first
//!   fragment (offset != 0) carries no L4 header.
//! - IPv6: version 6, the datagram (40 + payload length) fits in the frame; at most
//!   [`MAX_EXT_HEADERS`] hop-by-hop / routing / fragment / destination-options headers are
//!   walked, one more is malformed. A non-first fragment ends the walk with no L4 header.
//! - Every header lies inside both the frame and the datagram. TCP needs 20 bytes and a data
//!   offset >= 5 whose header fits; UDP, ICMP (over IPv4 only) and ICMPv6 (over IPv6 only) need
//!   8. Any other protocol is IP without an L4 header.
//!
//! [`kernel`] runs the same frames through the real programs for comparison.

use etherparse::{
    EtherType, Ethernet2Header, Icmpv4Header, Icmpv6Header, IpNumber, Ipv4Header, Ipv6FragmentHeader, Ipv6Header,
    Ipv6RawExtHeader, SingleVlanHeader, TcpHeader, UdpHeader,
};
use limiter_common::{
    FlowKey,
    key::{FAMILY_V4, FAMILY_V6},
    maps::ParseProbe,
};
use limiter_ctl::policy::KeySpec;

pub const MAX_VLAN_TAGS: usize = 2;
pub const MAX_EXT_HEADERS: usize = 6;

/// The probe program's fixed policy key: /24, /48 and the destination port.
pub const PROBE_KEY: KeySpec =
    KeySpec { v4_prefix: ParseProbe::V4_PREFIX, v6_prefix: ParseProbe::V6_PREFIX, dport: true };

/// What the reference made of a frame, and the way it went (for coverage counts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub probe: ParseProbe,
    pub path: Path,
}

/// How far the parse went, whatever its verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Path {
    pub tags: usize,
    pub ext_headers: usize,
    pub non_first_fragment: bool,
}

enum Skip {
    NotIp,
    Malformed,
}

/// An IP packet as far as the limiter cares.
struct Ip {
    family: u8,
    /// IPv4 protocol, or the IPv6 next header after the extension headers.
    proto: IpNumber,
    /// IPv4 in the first 4 bytes, the rest zero.
    src: [u8; 16],
    l4: Option<L4>,
}

/// A parsed L4 header: ports for TCP and UDP, none for ICMP.
#[derive(Clone, Copy)]
enum L4 {
    Ports { sport: u16, dport: u16 },
    Icmp,
}

pub fn parse(frame: &[u8]) -> Parsed {
    let mut path = Path::default();
    let probe = match parse_frame(frame, &mut path) {
        Ok(ip) => ip.probe(),
        Err(Skip::NotIp) => ParseProbe { verdict: ParseProbe::NOT_IP, ..ParseProbe::default() },
        Err(Skip::Malformed) => ParseProbe { verdict: ParseProbe::MALFORMED, ..ParseProbe::default() },
    };
    Parsed { probe, path }
}

/// Any header etherparse cannot read from the bytes it is given is a malformed frame.
fn malformed<E>(_: E) -> Skip {
    Skip::Malformed
}

fn is_vlan_tpid(t: EtherType) -> bool {
    t == EtherType::VLAN_TAGGED_FRAME || t == EtherType::PROVIDER_BRIDGING
}

fn parse_frame(frame: &[u8], path: &mut Path) -> Result<Ip, Skip> {
    let (eth, mut rest) = Ethernet2Header::from_slice(frame).map_err(malformed)?;
    let mut ether_type = eth.ether_type;
    while is_vlan_tpid(ether_type) {
        if path.tags == MAX_VLAN_TAGS {
            return Err(Skip::Malformed);
        }
        let (tag, after) = SingleVlanHeader::from_slice(rest).map_err(malformed)?;
        path.tags += 1;
        ether_type = tag.ether_type;
        rest = after;
    }
    match ether_type {
        EtherType::IPV4 => parse_ipv4(rest, path),
        EtherType::IPV6 => parse_ipv6(rest, path),
        _ => Err(Skip::NotIp),
    }
}

fn parse_ipv4(l3: &[u8], path: &mut Path) -> Result<Ip, Skip> {
    // etherparse checks version 4, IHL >= 5 and that the IHL bytes are in the frame.
    let (header, _) = Ipv4Header::from_slice(l3).map_err(malformed)?;
    // The datagram fits in the frame, and total length >= IHL.
    let datagram = l3.get(..usize::from(header.total_len)).ok_or(Skip::Malformed)?;
    let payload = datagram.get(header.header_len()..).ok_or(Skip::Malformed)?;
    let mut src = [0u8; 16];
    src[..4].copy_from_slice(&header.source);
    let mut ip = Ip { family: FAMILY_V4, proto: header.protocol, src, l4: None };
    if header.fragment_offset.value() != 0 {
        path.non_first_fragment = true;
        return Ok(ip);
    }
    ip.l4 = parse_l4(FAMILY_V4, header.protocol, payload)?;
    Ok(ip)
}

fn is_walked_ext(n: IpNumber) -> bool {
    matches!(
        n,
        IpNumber::IPV6_HEADER_HOP_BY_HOP
            | IpNumber::IPV6_ROUTE_HEADER
            | IpNumber::IPV6_FRAGMENTATION_HEADER
            | IpNumber::IPV6_DESTINATION_OPTIONS
    )
}

fn parse_ipv6(l3: &[u8], path: &mut Path) -> Result<Ip, Skip> {
    // etherparse checks version 6 and the 40 bytes; the datagram must fit in the frame.
    let (header, _) = Ipv6Header::from_slice(l3).map_err(malformed)?;
    let datagram = l3.get(..Ipv6Header::LEN + usize::from(header.payload_length)).ok_or(Skip::Malformed)?;
    let mut rest = &datagram[Ipv6Header::LEN..];
    let mut ip = Ip { family: FAMILY_V6, proto: header.next_header, src: header.source, l4: None };
    // Extension headers are read by hand, not with Ipv6Extensions: that one insists on RFC 8200
    // order (hop-by-hop first, one of each), which the spec does not.
    while is_walked_ext(ip.proto) {
        if path.ext_headers == MAX_EXT_HEADERS {
            return Err(Skip::Malformed);
        }
        path.ext_headers += 1;
        if ip.proto == IpNumber::IPV6_FRAGMENTATION_HEADER {
            let (frag, after) = Ipv6FragmentHeader::from_slice(rest).map_err(malformed)?;
            ip.proto = frag.next_header;
            rest = after;
            if frag.fragment_offset.value() != 0 {
                path.non_first_fragment = true;
                return Ok(ip);
            }
        } else {
            let (ext, after) = Ipv6RawExtHeader::from_slice(rest).map_err(malformed)?;
            ip.proto = ext.next_header;
            rest = after;
        }
    }
    ip.l4 = parse_l4(FAMILY_V6, ip.proto, rest)?;
    Ok(ip)
}

/// The L4 header at the start of `payload` (the rest of the datagram, never past the frame).
fn parse_l4(family: u8, proto: IpNumber, payload: &[u8]) -> Result<Option<L4>, Skip> {
    match proto {
        IpNumber::TCP => {
            let (h, _) = TcpHeader::from_slice(payload).map_err(malformed)?;
            Ok(Some(L4::Ports { sport: h.source_port, dport: h.destination_port }))
        }
        IpNumber::UDP => {
            let (h, _) = UdpHeader::from_slice(payload).map_err(malformed)?;
            Ok(Some(L4::Ports { sport: h.source_port, dport: h.destination_port }))
        }
        // Only the 8-byte fixed part counts (etherparse's ICMPv4 parser wants more for
        // timestamp messages, the spec does not).
        IpNumber::ICMP if family == FAMILY_V4 => icmp(payload, Icmpv4Header::MIN_LEN),
        IpNumber::IPV6_ICMP if family == FAMILY_V6 => icmp(payload, Icmpv6Header::MIN_LEN),
        _ => Ok(None),
    }
}

fn icmp(payload: &[u8], fixed: usize) -> Result<Option<L4>, Skip> {
    if payload.len() < fixed { Err(Skip::Malformed) } else { Ok(Some(L4::Icmp)) }
}

impl Ip {
    fn probe(&self) -> ParseProbe {
        let (sport, dport) = match self.l4 {
            Some(L4::Ports { sport, dport }) => (sport, dport),
            Some(L4::Icmp) | None => (0, 0),
        };
        let key = flow_key(ParseProbe::POLICY_ID, &PROBE_KEY, self.family, &self.src, dport);
        ParseProbe {
            verdict: ParseProbe::IP,
            family: self.family,
            proto: self.proto.0,
            has_l4: u8::from(self.l4.is_some()),
            sport,
            dport,
            src: self.src,
            key: key.words(),
            ..ParseProbe::default()
        }
    }
}

/// The key a source gets under policy `policy` keyed by `key` (what userspace predicts).
pub fn flow_key(policy: u16, key: &KeySpec, family: u8, src: &[u8; 16], dport: u16) -> FlowKey {
    FlowKey { addr: masked(family, src, key), policy, dport: if key.dport { dport } else { 0 }, family }
}

/// The address cut to the key's prefix, as integers in network order (no word tricks).
fn masked(family: u8, src: &[u8; 16], key: &KeySpec) -> [u8; 16] {
    let mut out = [0u8; 16];
    if family == FAMILY_V4 {
        let addr = u32::from_be_bytes([src[0], src[1], src[2], src[3]]);
        let mask = u32::MAX.checked_shl(32 - u32::from(key.v4_prefix.min(32))).unwrap_or(0);
        out[..4].copy_from_slice(&(addr & mask).to_be_bytes());
    } else {
        let mask = u128::MAX.checked_shl(128 - u32::from(key.v6_prefix.min(128))).unwrap_or(0);
        out = (u128::from_be_bytes(*src) & mask).to_be_bytes();
    }
    out
}

/// The kernel side of a comparison: the probe program and the real limiter, run on frames with
/// BPF_PROG_TEST_RUN (on the calling CPU).
pub mod kernel {
    use std::{error::Error as StdError, io};

    use anyhow::{Context, anyhow, bail};
    use aya::{
        Ebpf, EbpfLoader,
        maps::Array,
        programs::{TestRun, TestRunOptions, Xdp},
    };
    use limiter_common::{
        SipKey,
        maps::{CLASS_UDP, Counters, ParseProbe, Policy},
    };
    use limiter_ctl::{
        Limiter, objects,
        policy::{KeySpec, PolicySpec},
        rate::Rate,
    };

    use super::PROBE_KEY;

    pub const XDP_DROP: u32 = 1;
    pub const XDP_PASS: u32 = 2;

    const PROBE_PROGRAM: &str = "limiter_probe";
    const PROBE_MAP: &str = "PROBE";
    const PROBE_POLICY_MAP: &str = "PROBE_POLICY";

    /// A policy no test refuses anything under: 10^9 per second, burst 10^6.
    pub fn permissive(key: KeySpec) -> PolicySpec {
        PolicySpec { key, ..PolicySpec::any(Rate { count: 1_000_000_000, period_ns: 1_000_000_000 }, 1_000_000) }
    }

    /// The real limiter loaded in-process with `salt` and `policy` (compiled under its own id),
    /// which judges UDP only: anything else passes unjudged.
    pub fn udp_limiter(buckets: u32, salt: SipKey, policy: &Policy) -> anyhow::Result<Limiter> {
        let mut limiter = Limiter::load(buckets).context("loading the limiter")?;
        limiter.set_salt(salt)?;
        limiter.set_policy(policy)?;
        let mut config = limiter.config()?;
        config.class_policy[CLASS_UDP] = policy.id;
        limiter.write_config(&config)?;
        Ok(limiter)
    }

    /// The errno behind a failed test run, wherever it sits in the error chain.
    pub fn errno(e: &(dyn StdError + 'static)) -> Option<i32> {
        let mut cur = Some(e);
        while let Some(err) = cur {
            if let Some(io) = err.downcast_ref::<io::Error>() {
                return io.raw_os_error();
            }
            cur = err.source();
        }
        None
    }

    /// The probe program: the limiter's parser and key builder, recording what they derive.
    pub struct Probe {
        ebpf: Ebpf,
    }

    impl Probe {
        pub fn load() -> anyhow::Result<Self> {
            let mut ebpf = EbpfLoader::new().load(objects::PROBE).context("loading the probe object")?;
            let program: &mut Xdp = ebpf
                .program_mut(PROBE_PROGRAM)
                .context("the probe object has no limiter_probe program")?
                .try_into()
                .context("limiter_probe is not XDP")?;
            program.load().context("the verifier rejected limiter_probe")?;
            let policy = permissive(PROBE_KEY).compile(ParseProbe::POLICY_ID).map_err(|e| anyhow!("{e}"))?;
            let map = ebpf.map_mut(PROBE_POLICY_MAP).context("no PROBE_POLICY map")?;
            Array::<_, Policy>::try_from(map)?.set(0, policy, 0).context("writing PROBE_POLICY")?;
            Ok(Self { ebpf })
        }

        /// Runs the probe on `frame`. A cleared record first, so a run that records nothing
        /// cannot pass for the previous frame's.
        pub fn run(&mut self, frame: &[u8]) -> anyhow::Result<ParseProbe> {
            self.record_map()?.set(0, ParseProbe::default(), 0).context("clearing PROBE")?;
            let program: &Xdp = self.ebpf.program(PROBE_PROGRAM).context("no limiter_probe")?.try_into()?;
            let action = program.test_run(TestRunOptions { data_in: Some(frame), ..TestRunOptions::default() })?;
            if action.return_value != XDP_PASS {
                bail!("the probe returned XDP action {}, not XDP_PASS", action.return_value);
            }
            let record = self.record_map()?.get(&0, 0).context("reading PROBE")?;
            if record.verdict == 0 {
                bail!("the probe ran but recorded nothing");
            }
            Ok(record)
        }

        fn record_map(&mut self) -> anyhow::Result<Array<&mut aya::maps::MapData, ParseProbe>> {
            let map = self.ebpf.map_mut(PROBE_MAP).context("no PROBE map")?;
            Ok(Array::try_from(map)?)
        }
    }

    /// The real limiter with one permissive policy for every class: the class a frame lands in
    /// is read from which counter moved.
    pub struct Judge {
        pub limiter: Limiter,
        seen: [Counters; 2],
    }

    impl Judge {
        pub const POLICY: u16 = 1;

        pub fn load(buckets: u32, salt: SipKey, key: KeySpec) -> anyhow::Result<Self> {
            let mut limiter = Limiter::load(buckets).context("loading the limiter")?;
            limiter.set_salt(salt)?;
            let policy = permissive(key).compile(Self::POLICY).map_err(|e| anyhow!("{e}"))?;
            limiter.set_policy(&policy)?;
            limiter.set_default_policy(Self::POLICY)?;
            let mut judge = Self { limiter, seen: [Counters::default(); 2] };
            judge.seen = judge.read()?;
            Ok(judge)
        }

        /// Counters of "no policy" (0) and of the policy, summed over CPUs.
        fn read(&self) -> anyhow::Result<[Counters; 2]> {
            let sum =
                |id| -> anyhow::Result<Counters> { Ok(crate::bounds::total(&self.limiter.counters_per_cpu(id)?)) };
            Ok([sum(0)?, sum(Self::POLICY)?])
        }

        /// Runs `frame` and says where it was counted: `ParseProbe::{NOT_IP, MALFORMED, IP}`
        /// (IP: admitted under the policy). Anything but one pass counted once is an error.
        pub fn classify(&mut self, frame: &[u8]) -> anyhow::Result<u32> {
            let action = self.limiter.test_run(frame)?;
            let now = self.read()?;
            let [b0, b1] = self.seen;
            let [a0, a1] = now;
            self.seen = now;
            let total = a0.packets() + a1.packets() - b0.packets() - b1.packets();
            let class = if a0.not_ip == b0.not_ip + 1 {
                ParseProbe::NOT_IP
            } else if a0.malformed == b0.malformed + 1 {
                ParseProbe::MALFORMED
            } else if a1.admitted_packets == b1.admitted_packets + 1 {
                ParseProbe::IP
            } else {
                0
            };
            if action != XDP_PASS || total != 1 || class == 0 {
                bail!("action {action}, {total} packets counted; before {b0:?} / {b1:?}, after {a0:?} / {a1:?}");
            }
            Ok(class)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frames::{self, Expect};

    #[test]
    fn every_fixture_gets_its_expected_class() {
        for f in frames::fixtures() {
            let p = parse(&f.frame).probe;
            assert_eq!(p.verdict, f.expect.verdict(), "{}: {p:?}", f.name);
            if let Expect::Ip { l4 } = f.expect {
                assert_eq!(p.has_l4 == 1, l4, "{}: {p:?}", f.name);
            }
        }
    }

    #[test]
    fn fields_of_a_tagged_v6_tcp_frame() {
        let f = frames::fixtures().into_iter().find(|f| f.name == "qinq_ad_q_v6_tcp").expect("fixture");
        let p = parse(&f.frame);
        assert_eq!(p.path.tags, 2);
        assert_eq!((p.probe.family, p.probe.proto, p.probe.sport, p.probe.dport), (FAMILY_V6, 6, 1000, 22));
        assert_eq!(p.probe.src, frames::v6(2, 7));
        // /48: the first three groups survive, dport 22, policy 1, family 6.
        let mut addr = [0u8; 16];
        addr[..6].copy_from_slice(&frames::v6(2, 7)[..6]);
        let expect = FlowKey { addr, policy: 1, dport: 22, family: FAMILY_V6 };
        assert_eq!(p.probe.key, expect.words());
    }

    #[test]
    fn v4_key_keeps_the_slash_24() {
        let src = {
            let mut s = [0u8; 16];
            s[..4].copy_from_slice(&[198, 18, 7, 200]);
            s
        };
        let k = flow_key(9, &PROBE_KEY, FAMILY_V4, &src, 53);
        assert_eq!(&k.addr[..4], &[198, 18, 7, 0]);
        assert!(k.addr[4..].iter().all(|&b| b == 0));
        let whole = KeySpec { v4_prefix: 32, v6_prefix: 128, dport: false };
        assert_eq!(flow_key(9, &whole, FAMILY_V4, &src, 53).addr, src);
        assert_eq!(flow_key(9, &whole, FAMILY_V4, &src, 53).dport, 0);
        let none = KeySpec { v4_prefix: 0, v6_prefix: 0, dport: false };
        assert_eq!(flow_key(9, &none, FAMILY_V6, &[0xff; 16], 0).addr, [0; 16]);
    }

    #[test]
    fn six_extension_headers_are_walked_and_seven_are_not() {
        let by_name = |n: &str| frames::fixtures().into_iter().find(|f| f.name == n).expect("fixture");
        let six = parse(&by_name("v6_six_exts_tcp").frame);
        assert_eq!((six.probe.verdict, six.path.ext_headers), (ParseProbe::IP, 6));
        let seven = parse(&by_name("v6_seven_exts_tcp").frame);
        assert_eq!((seven.probe.verdict, seven.path.ext_headers), (ParseProbe::MALFORMED, 6));
    }
}

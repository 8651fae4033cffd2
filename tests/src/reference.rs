//! An independent userspace reference for the XDP parser: etherparse's header parsers applied
//! to the parser's written spec (the module docs of `limiter-ebpf/src/parse.rs`), never to its
//! code. It yields exactly what the probe program records ([`ParseProbe`]), so the differential
//! test can compare the two field by field.
//!
//! The spec, as implemented here:
//! - Ethernet II, then at most [`MAX_VLAN_TAGS`] tags (TPID 0x8100 or 0x88a8); a third tag is
//!   malformed, any ethertype other than IPv4/IPv6 after the tags is not IP.
//! - Malformed: the fixed IP header is cut by the frame or invalid (IPv4: version 4, IHL >= 5,
//!   total length >= IHL; IPv6: version 6), or the datagram does not fit in the frame.
//! - Everything after the fixed header is read from the datagram only (never the padding after
//!   it). What the datagram does not hold leaves the packet IP without an L4 header, never
//!   malformed: a cut or invalid L4 header (TCP needs 20 bytes and a data offset >= 5 whose
//!   header fits; UDP, ICMP over IPv4 and ICMPv6 over IPv6 need 8), or an IPv6 extension header
//!   (hop-by-hop, routing, fragment, destination options) running past the datagram's end.
//! - The class follows the protocol (TCP, UDP, ICMP for the family's ICMP, else OTHER), except
//!   for IPv6 non-first fragments (class OTHER, whatever their fragment header states). `proto`
//!   is the last next header followed: a cut extension header's own number; for an IPv6
//!   non-first fragment, the next header its fragment header states.
//! - IPv4: a non-first fragment (offset != 0) carries no L4 header.
//! - IPv6: at most [`MAX_EXT_HEADERS`] extension headers are walked; a non-first fragment header
//!   ends the walk with no L4 header.
//! - Ports hidden: an IPv4 first fragment (offset 0, MF) of TCP/UDP with a cut L4 header; an
//!   IPv6 datagram whose walk passed a first-fragment header (offset 0, M) and then found a cut
//!   TCP/UDP header or a cut extension header; an IPv6 chain longer than [`MAX_EXT_HEADERS`]
//!   (`proto` the first header not walked).
//!
//! [`crate::kernel_programs`] runs the same frames through the real programs for comparison.

use etherparse::{
    EtherType, Ethernet2Header, Icmpv4Header, Icmpv6Header, IpNumber, Ipv4Header, Ipv6FragmentHeader, Ipv6Header,
    Ipv6RawExtHeader, SingleVlanHeader, TcpHeader, UdpHeader,
};
use limiter_common::{
    FlowKey,
    key::{FAMILY_V4, FAMILY_V6},
    maps::{CLASS_ICMP, CLASS_OTHER, CLASS_TCP, CLASS_UDP},
    testing::ParseProbe,
};
use limiter_ctl::config::KeySpec;

pub const MAX_VLAN_TAGS: usize = 2;
pub const MAX_EXT_HEADERS: usize = 32;

/// The probe program's fixed policy key: /24, /48 and the destination port.
pub const PROBE_KEY: KeySpec =
    KeySpec { v4_prefix: ParseProbe::V4_PREFIX, v6_prefix: ParseProbe::V6_PREFIX, dport: true };

/// What the reference made of a frame, and the way it went (for coverage counts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub probe: ParseProbe,
    /// The protocol class (`CLASS_*`) an IP packet is judged under; 0 for anything else.
    pub class: usize,
    pub path: Path,
}

/// How far the parse went, whatever its verdict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Path {
    pub tags: usize,
    /// IPv6 extension headers walked (read whole), at most [`MAX_EXT_HEADERS`].
    pub ext_headers: usize,
    pub non_first_fragment: bool,
    /// An IPv6 extension header ran past the datagram's end.
    pub cut_chain: bool,
    /// The IPv6 chain went on past [`MAX_EXT_HEADERS`].
    pub long_chain: bool,
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
    class: usize,
    ports_hidden: bool,
}

/// A parsed L4 header: ports for TCP and UDP, none for ICMP.
#[derive(Clone, Copy)]
enum L4 {
    /// `syn`: TCP with SYN set and ACK clear.
    Ports {
        sport: u16,
        dport: u16,
        syn: bool,
    },
    Icmp,
}

pub fn parse(frame: &[u8]) -> Parsed {
    let mut path = Path::default();
    let (probe, class) = match parse_frame(frame, &mut path) {
        Ok(ip) => (ip.probe(), ip.class),
        Err(Skip::NotIp) => (ParseProbe { verdict: ParseProbe::NOT_IP, ..ParseProbe::default() }, 0),
        Err(Skip::Malformed) => (ParseProbe { verdict: ParseProbe::MALFORMED, ..ParseProbe::default() }, 0),
    };
    Parsed { probe, class, path }
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
    let ip = Ip::new(FAMILY_V4, header.protocol, src);
    if header.fragment_offset.value() != 0 {
        // Linux reassembles IPv4 by protocol: a later fragment's protocol is the datagram's.
        path.non_first_fragment = true;
        return Ok(ip);
    }
    Ok(ip.with_l4(payload, header.more_fragments))
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
    let mut ip = Ip::new(FAMILY_V6, header.next_header, header.source);
    let mut first_fragment = false;
    // Extension headers are read by hand, not with Ipv6Extensions: that one insists on RFC 8200
    // order (hop-by-hop first, one of each), which the spec does not.
    while is_walked_ext(ip.proto) {
        if path.ext_headers == MAX_EXT_HEADERS {
            path.long_chain = true;
            ip.class = class_of(FAMILY_V6, ip.proto);
            ip.ports_hidden = true;
            return Ok(ip);
        }
        let after = if ip.proto == IpNumber::IPV6_FRAGMENTATION_HEADER {
            Ipv6FragmentHeader::from_slice(rest).ok().map(|(frag, after)| {
                (frag.next_header, after, Some((frag.fragment_offset.value(), frag.more_fragments)))
            })
        } else {
            Ipv6RawExtHeader::from_slice(rest).ok().map(|(ext, after)| (ext.next_header, after, None))
        };
        let Some((next, after, fragment)) = after else {
            // Cut by the datagram: class OTHER (proto stays the cut header's number).
            path.cut_chain = true;
            ip.class = class_of(FAMILY_V6, ip.proto);
            ip.ports_hidden = first_fragment;
            return Ok(ip);
        };
        path.ext_headers += 1;
        ip.proto = next;
        rest = after;
        match fragment {
            Some((offset, _)) if offset != 0 => {
                // Linux takes the upper protocol from the first fragment: this one's is a claim.
                path.non_first_fragment = true;
                ip.class = CLASS_OTHER;
                return Ok(ip);
            }
            Some((_, more)) => first_fragment |= more,
            None => {}
        }
    }
    Ok(ip.with_l4(rest, first_fragment))
}

/// The L4 header at the start of `payload` (the rest of the datagram, never past the frame), or
/// why there is none to read.
enum L4Read {
    Parsed(L4),
    /// TCP, UDP or the family's ICMP, but the header is cut or invalid.
    Cut,
    /// Any other protocol: nothing to read.
    None,
}

fn read_l4(family: u8, proto: IpNumber, payload: &[u8]) -> L4Read {
    let parsed = match proto {
        IpNumber::TCP => TcpHeader::from_slice(payload)
            .map(|(h, _)| L4::Ports { sport: h.source_port, dport: h.destination_port, syn: h.syn && !h.ack })
            .ok(),
        IpNumber::UDP => UdpHeader::from_slice(payload)
            .map(|(h, _)| L4::Ports { sport: h.source_port, dport: h.destination_port, syn: false })
            .ok(),
        // Only the 8-byte fixed part counts (etherparse's ICMPv4 parser wants more for
        // timestamp messages, the spec does not).
        IpNumber::ICMP if family == FAMILY_V4 => (payload.len() >= Icmpv4Header::MIN_LEN).then_some(L4::Icmp),
        IpNumber::IPV6_ICMP if family == FAMILY_V6 => (payload.len() >= Icmpv6Header::MIN_LEN).then_some(L4::Icmp),
        _ => return L4Read::None,
    };
    parsed.map_or(L4Read::Cut, L4Read::Parsed)
}

/// The class of `proto` over `family`.
pub fn class_of(family: u8, proto: IpNumber) -> usize {
    match proto {
        IpNumber::TCP => CLASS_TCP,
        IpNumber::UDP => CLASS_UDP,
        IpNumber::ICMP if family == FAMILY_V4 => CLASS_ICMP,
        IpNumber::IPV6_ICMP if family == FAMILY_V6 => CLASS_ICMP,
        _ => CLASS_OTHER,
    }
}

impl Ip {
    fn new(family: u8, proto: IpNumber, src: [u8; 16]) -> Self {
        Self { family, proto, src, l4: None, class: class_of(family, proto), ports_hidden: false }
    }

    /// The L4 header read from `payload`; a cut TCP/UDP header of a first fragment hides ports.
    fn with_l4(mut self, payload: &[u8], first_fragment: bool) -> Self {
        self.class = class_of(self.family, self.proto);
        match read_l4(self.family, self.proto, payload) {
            L4Read::Parsed(l4) => self.l4 = Some(l4),
            L4Read::Cut => self.ports_hidden = first_fragment && matches!(self.proto, IpNumber::TCP | IpNumber::UDP),
            L4Read::None => {}
        }
        self
    }

    fn probe(&self) -> ParseProbe {
        let (sport, dport, syn) = match self.l4 {
            Some(L4::Ports { sport, dport, syn }) => (sport, dport, syn),
            Some(L4::Icmp) | None => (0, 0, false),
        };
        let key = flow_key(ParseProbe::POLICY_ID, &PROBE_KEY, self.family, &self.src, dport);
        ParseProbe {
            verdict: ParseProbe::IP,
            family: self.family,
            proto: self.proto.0,
            has_l4: u8::from(self.l4.is_some()),
            ports_hidden: u8::from(self.ports_hidden),
            sport,
            dport,
            syn: u8::from(syn),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frames::{self, Expect};

    #[test]
    fn every_fixture_gets_its_expected_class() {
        for f in frames::fixtures() {
            let p = parse(&f.frame).probe;
            assert_eq!(p.verdict, f.expect.verdict(), "{}: {p:?}", f.name);
            if let Expect::Ip { l4, hidden } = f.expect {
                assert_eq!((p.has_l4 == 1, p.ports_hidden == 1), (l4, hidden), "{}: {p:?}", f.name);
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

    fn by_name(n: &str) -> frames::Fixture {
        frames::fixtures().into_iter().find(|f| f.name == n).expect("fixture")
    }

    #[test]
    fn thirty_two_extension_headers_are_walked_and_thirty_three_hide_the_ports() {
        let seven = parse(&by_name("v6_seven_exts_tcp").frame);
        assert_eq!((seven.probe.verdict, seven.probe.has_l4, seven.path.ext_headers), (ParseProbe::IP, 1, 7));
        let max = parse(&by_name("v6_32_dest_opts_udp").frame);
        assert_eq!((max.probe.verdict, max.probe.has_l4, max.path.ext_headers), (ParseProbe::IP, 1, MAX_EXT_HEADERS));
        let over = parse(&by_name("v6_33_dest_opts_udp").frame);
        assert_eq!((over.probe.verdict, over.probe.has_l4, over.probe.ports_hidden), (ParseProbe::IP, 0, 1));
        assert_eq!((over.path.ext_headers, over.path.long_chain, over.class), (MAX_EXT_HEADERS, true, CLASS_OTHER));
        assert_eq!(over.probe.proto, IpNumber::IPV6_DESTINATION_OPTIONS.0);
    }

    #[test]
    fn a_later_v6_fragment_claiming_tcp_is_class_other() {
        let lying = parse(&by_name("v6_non_first_fragment_claims_tcp").frame);
        assert_eq!((lying.probe.proto, lying.class, lying.probe.has_l4), (6, CLASS_OTHER, 0));
        // IPv4 keys reassembly on the protocol: its later fragments keep their class.
        let v4 = parse(&by_name("v4_non_first_fragment").frame);
        assert_eq!((v4.probe.proto, v4.class), (17, CLASS_UDP));
    }

    #[test]
    fn tiny_first_fragments_hide_their_ports_and_whole_datagrams_do_not() {
        for (name, hidden) in [
            ("v4_first_fragment_8_bytes_of_tcp", true),
            ("v4_first_fragment_doff_past_fragment", true),
            ("v6_first_fragment_7_bytes_of_udp", true),
            ("v6_first_fragment_cut_chain", true),
            ("v4_tcp_past_datagram", false),
            ("v4_udp_7_bytes", false),
            ("v6_atomic_fragment_cut_udp", false),
        ] {
            let p = parse(&by_name(name).frame);
            assert_eq!(
                (p.probe.verdict, p.probe.has_l4, p.probe.ports_hidden == 1),
                (ParseProbe::IP, 0, hidden),
                "{name}"
            );
        }
    }
}

//! Packet fixtures (in the spirit of katran's test fixtures): Ethernet frames built layer by
//! layer from etherparse's header types, then patched by hand where a case is malformed on
//! purpose (etherparse will not write those). [`fixtures`] is the named table the tests walk,
//! each entry with the class the parser must give it.
//!
//! Addresses come only from the benchmarking ranges 198.18.0.0/15 and 2001:db8::/32, MACs are
//! locally administered. Checksums are left as built (the parser never reads them), except the
//! IPv4 header checksum, which costs nothing to get right.

use etherparse::{
    ArpEthIpv4Packet, ArpOperation, EtherType, Ethernet2Header, IcmpEchoHeader, Icmpv4Header, Icmpv4Type, Icmpv6Header,
    Icmpv6Type, IpFragOffset, IpNumber, Ipv4Header, Ipv4Options, Ipv6FlowLabel, Ipv6FragmentHeader, Ipv6Header,
    Ipv6RawExtHeader, SingleVlanHeader, TcpHeader, UdpHeader, VlanId, VlanPcp,
};
use limiter_common::testing::ParseProbe;

pub const ETH_LEN: usize = 14;
pub const TAG_LEN: usize = 4;
pub const MAC_SRC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const MAC_DST: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
pub const V4_DST: [u8; 4] = [198, 19, 255, 1];
pub const V6_DST: [u8; 16] = v6(0xffff, 1);

/// A source in 198.18.0.0/15: `subnet` picks the /24 (198.18.0.0 up to 198.19.255.0).
pub const fn v4(subnet: u16, host: u8) -> [u8; 4] {
    [198, 18 + (subnet >> 8) as u8, subnet as u8, host]
}

/// A source in 2001:db8::/32: `subnet` is the third 16-bit group (so it picks the /48).
pub const fn v6(subnet: u16, host: u16) -> [u8; 16] {
    let s = subnet.to_be_bytes();
    let h = host.to_be_bytes();
    [0x20, 0x01, 0x0d, 0xb8, s[0], s[1], 0, 0, 0, 0, 0, 0, 0, 0, h[0], h[1]]
}

/// A VLAN tag: 802.1Q (TPID 0x8100) or 802.1ad (0x88a8), with its VLAN id.
#[derive(Clone, Copy, Debug)]
pub enum Tag {
    Q(u16),
    Ad(u16),
}

impl Tag {
    fn tpid(self) -> EtherType {
        match self {
            Tag::Q(_) => EtherType::VLAN_TAGGED_FRAME,
            Tag::Ad(_) => EtherType::PROVIDER_BRIDGING,
        }
    }

    fn vid(self) -> u16 {
        match self {
            Tag::Q(v) | Tag::Ad(v) => v,
        }
    }
}

/// An Ethernet II frame: any number of tags (the parser refuses a third), then `payload`.
pub fn ethernet(tags: &[Tag], ether_type: EtherType, payload: &[u8]) -> Vec<u8> {
    // Each TPID sits in the ethertype field of the header before it.
    let first = tags.first().map_or(ether_type, |t| t.tpid());
    let mut out = Ethernet2Header { source: MAC_SRC, destination: MAC_DST, ether_type: first }.to_bytes().to_vec();
    for (i, tag) in tags.iter().enumerate() {
        let inner = tags.get(i + 1).map_or(ether_type, |t| t.tpid());
        let header = SingleVlanHeader {
            pcp: VlanPcp::ZERO,
            drop_eligible_indicator: false,
            vlan_id: VlanId::try_new(tag.vid()).expect("VLAN ids are 12 bits"),
            ether_type: inner,
        };
        out.extend_from_slice(&header.to_bytes());
    }
    out.extend_from_slice(payload);
    out
}

/// An L4 header (with a little payload) and the protocol number that announces it.
#[derive(Clone, Debug)]
pub struct L4 {
    pub proto: IpNumber,
    pub bytes: Vec<u8>,
}

pub fn tcp(sport: u16, dport: u16) -> L4 {
    tcp_with_options(sport, dport, 0)
}

/// TCP with `options` bytes of NOP options (a multiple of 4, at most 40): data offset 5..=15.
pub fn tcp_with_options(sport: u16, dport: u16, options: usize) -> L4 {
    let mut header = TcpHeader::new(sport, dport, 0x0102_0304, 64_240);
    header.syn = true;
    header.set_options_raw(&vec![1u8; options]).expect("options are a multiple of 4, at most 40");
    let mut bytes = header.to_bytes().to_vec();
    bytes.extend_from_slice(b"data");
    L4 { proto: IpNumber::TCP, bytes }
}

/// The TCP flags a segment of a connection carries, for SYN-only policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment {
    Syn,
    SynAck,
    Ack,
    Rst,
    FinAck,
}

impl Segment {
    pub const ALL: [Segment; 5] = [Segment::Syn, Segment::SynAck, Segment::Ack, Segment::Rst, Segment::FinAck];
}

/// A TCP segment with `segment`'s flags and a little payload.
pub fn tcp_segment(sport: u16, dport: u16, segment: Segment) -> L4 {
    let mut header = TcpHeader::new(sport, dport, 0x0102_0304, 64_240);
    match segment {
        Segment::Syn => header.syn = true,
        Segment::SynAck => (header.syn, header.ack) = (true, true),
        Segment::Ack => header.ack = true,
        Segment::Rst => header.rst = true,
        Segment::FinAck => (header.fin, header.ack) = (true, true),
    }
    let mut bytes = header.to_bytes().to_vec();
    bytes.extend_from_slice(b"data");
    L4 { proto: IpNumber::TCP, bytes }
}

pub fn udp(sport: u16, dport: u16, payload: usize) -> L4 {
    let header = UdpHeader { source_port: sport, destination_port: dport, length: (8 + payload) as u16, checksum: 0 };
    let mut bytes = header.to_bytes().to_vec();
    bytes.resize(8 + payload, 0xab);
    L4 { proto: IpNumber::UDP, bytes }
}

pub fn icmpv4_echo() -> L4 {
    let echo = IcmpEchoHeader { id: 0x4242, seq: 1 };
    let mut bytes = Icmpv4Header::new(Icmpv4Type::EchoRequest(echo)).to_bytes().to_vec();
    bytes.extend_from_slice(b"ping");
    L4 { proto: IpNumber::ICMP, bytes }
}

pub fn icmpv6_echo() -> L4 {
    let echo = IcmpEchoHeader { id: 0x4242, seq: 1 };
    let mut bytes = Icmpv6Header::new(Icmpv6Type::EchoRequest(echo)).to_bytes().to_vec();
    bytes.extend_from_slice(b"ping");
    L4 { proto: IpNumber::IPV6_ICMP, bytes }
}

/// Arbitrary bytes under any protocol number (GRE, a cut header, ...).
pub fn raw(proto: IpNumber, bytes: &[u8]) -> L4 {
    L4 { proto, bytes: bytes.to_vec() }
}

/// How to build an IPv4 datagram around an [`L4`].
#[derive(Clone, Copy, Debug)]
pub struct V4 {
    pub src: [u8; 4],
    /// Bytes of options (NOPs), a multiple of 4, at most 40: IHL 5..=15.
    pub options: usize,
    /// Fragment offset in 8-byte units (0: the first or only fragment).
    pub frag_offset: u16,
    pub more_fragments: bool,
}

impl V4 {
    pub fn from(src: [u8; 4]) -> Self {
        Self { src, options: 0, frag_offset: 0, more_fragments: false }
    }

    pub fn datagram(&self, l4: &L4) -> Vec<u8> {
        let mut header = Ipv4Header::new(0, 64, l4.proto, self.src, V4_DST).expect("an empty payload fits");
        let options = Ipv4Options::try_from(&vec![1u8; self.options][..]);
        header.options = options.expect("options are a multiple of 4, at most 40");
        header.total_len = (header.header_len() + l4.bytes.len()) as u16;
        header.fragment_offset = IpFragOffset::try_new(self.frag_offset).expect("fragment offsets are 13 bits");
        header.more_fragments = self.more_fragments;
        header.dont_fragment = self.frag_offset == 0 && !self.more_fragments;
        header.header_checksum = header.calc_header_checksum();
        let mut out = header.to_bytes().to_vec();
        out.extend_from_slice(&l4.bytes);
        out
    }
}

/// An IPv6 extension header. `len` is the Hdr Ext Len field: the header is `(len + 1) * 8` bytes.
#[derive(Clone, Copy, Debug)]
pub enum Ext {
    HopByHop { len: u8 },
    Routing,
    Fragment { offset: u16, more: bool },
    DestOpts { len: u8 },
}

impl Ext {
    fn kind(self) -> IpNumber {
        match self {
            Ext::HopByHop { .. } => IpNumber::IPV6_HEADER_HOP_BY_HOP,
            Ext::Routing => IpNumber::IPV6_ROUTE_HEADER,
            Ext::Fragment { .. } => IpNumber::IPV6_FRAGMENTATION_HEADER,
            Ext::DestOpts { .. } => IpNumber::IPV6_DESTINATION_OPTIONS,
        }
    }

    fn to_bytes(self, next: IpNumber) -> Vec<u8> {
        match self {
            Ext::HopByHop { len } | Ext::DestOpts { len } => options_header(next, len),
            // Routing type 253 (RFC 4727, experimental) with no segments left: nodes skip it.
            Ext::Routing => raw_ext(next, &[253, 0, 0, 0, 0, 0]),
            Ext::Fragment { offset, more } => {
                let offset = IpFragOffset::try_new(offset).expect("fragment offsets are 13 bits");
                Ipv6FragmentHeader::new(next, offset, more, 0x5eed).to_bytes().to_vec()
            }
        }
    }
}

/// A hop-by-hop or destination options header of `(len + 1) * 8` bytes, one PadN option.
fn options_header(next: IpNumber, len: u8) -> Vec<u8> {
    let area = 6 + usize::from(len) * 8;
    assert!(area - 2 <= 255, "one PadN option covers at most 257 bytes: keep len <= 31");
    let mut options = vec![0u8; area];
    options[0] = 1; // PadN
    options[1] = (area - 2) as u8;
    raw_ext(next, &options)
}

fn raw_ext(next: IpNumber, payload: &[u8]) -> Vec<u8> {
    Ipv6RawExtHeader::new_raw(next, payload).expect("a valid extension header payload").to_bytes().to_vec()
}

/// An IPv6 datagram: `exts` chained in order, then `l4`.
pub fn ipv6(src: [u8; 16], exts: &[Ext], l4: &L4) -> Vec<u8> {
    let mut body = Vec::new();
    for (i, ext) in exts.iter().enumerate() {
        let next = exts.get(i + 1).map_or(l4.proto, |e| e.kind());
        body.extend_from_slice(&ext.to_bytes(next));
    }
    body.extend_from_slice(&l4.bytes);
    let header = Ipv6Header {
        traffic_class: 0,
        flow_label: Ipv6FlowLabel::ZERO,
        payload_length: body.len() as u16,
        next_header: exts.first().map_or(l4.proto, |e| e.kind()),
        hop_limit: 64,
        source: src,
        destination: V6_DST,
    };
    let mut out = header.to_bytes().to_vec();
    out.extend_from_slice(&body);
    out
}

pub fn arp_request() -> Vec<u8> {
    ArpEthIpv4Packet {
        operation: ArpOperation::REQUEST,
        sender_mac: MAC_SRC,
        sender_ipv4: v4(0, 1),
        target_mac: [0; 6],
        target_ipv4: V4_DST,
    }
    .to_bytes()
    .to_vec()
}

/// Overwrites a big-endian u16 at `at`: for lengths, ethertypes and fragment fields.
pub fn set_u16(bytes: &mut [u8], at: usize, value: u16) {
    bytes[at..at + 2].copy_from_slice(&value.to_be_bytes());
}

/// Lowercase hex, for failure messages that let a frame be replayed.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn patched(mut bytes: Vec<u8>, f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    f(&mut bytes);
    bytes
}

/// Sets the length field at `at` (which excludes `fixed` header bytes) one byte past the end.
fn one_past_the_end(datagram: &mut [u8], at: usize, fixed: usize) {
    let len = (datagram.len() - fixed + 1) as u16;
    set_u16(datagram, at, len);
}

/// What the parser must make of a fixture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    NotIp,
    Malformed,
    /// IP; `l4` says whether the L4 header is parsed (ports, or an ICMP header), `hidden`
    /// whether the datagram the stack will reassemble carries ports the parser cannot read.
    Ip {
        l4: bool,
        hidden: bool,
    },
}

impl Expect {
    /// The matching `ParseProbe` verdict.
    pub fn verdict(self) -> u32 {
        match self {
            Expect::NotIp => ParseProbe::NOT_IP,
            Expect::Malformed => ParseProbe::MALFORMED,
            Expect::Ip { .. } => ParseProbe::IP,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Fixture {
    pub name: &'static str,
    pub frame: Vec<u8>,
    pub expect: Expect,
    /// Where the network header starts (after the tags the parser accepts).
    pub l3: usize,
    /// Trailing bytes after the IP datagram (Ethernet padding).
    pub padding: usize,
}

impl Fixture {
    fn new(name: &'static str, expect: Expect, tags: &[Tag], ether_type: EtherType, payload: Vec<u8>) -> Self {
        let l3 = ETH_LEN + TAG_LEN * tags.len().min(2);
        // A datagram whose length field says less than the bytes after it: those are padding.
        let length = |at: usize, fixed: usize| {
            payload.get(at..at + 2).map(|b| fixed + usize::from(u16::from_be_bytes([b[0], b[1]])))
        };
        let datagram = match ether_type {
            EtherType::IPV4 => length(V4_TOTAL_LEN, 0),
            EtherType::IPV6 => length(V6_PAYLOAD_LEN, 40),
            _ => None,
        };
        let padding = datagram.map_or(0, |d| payload.len().saturating_sub(d));
        Self { name, frame: ethernet(tags, ether_type, &payload), expect, l3, padding }
    }

    /// An untagged IPv4 frame.
    fn v4(name: &'static str, expect: Expect, datagram: Vec<u8>) -> Self {
        Self::new(name, expect, &[], EtherType::IPV4, datagram)
    }

    /// An untagged IPv6 frame.
    fn v6(name: &'static str, expect: Expect, datagram: Vec<u8>) -> Self {
        Self::new(name, expect, &[], EtherType::IPV6, datagram)
    }

    /// Pads the frame with zeros to `len` bytes, as a NIC pads short frames to 60.
    fn padded(mut self, len: usize) -> Self {
        let extra = len.saturating_sub(self.frame.len());
        self.padding += extra;
        self.frame.resize(self.frame.len() + extra, 0);
        self
    }

    /// Cuts the frame to `len` bytes (a frame whose IP header runs off its end).
    fn cut(mut self, len: usize) -> Self {
        self.frame.truncate(len);
        self
    }

    /// What the frame cut to `len` bytes (at least an Ethernet header) must be: a cut inside
    /// a VLAN tag or the IP datagram is malformed, a cut in the padding changes nothing.
    pub fn expect_cut(&self, len: usize) -> Expect {
        assert!(len >= ETH_LEN && len <= self.frame.len(), "cut {len} outside {}..={}", ETH_LEN, self.frame.len());
        match self.expect {
            _ if len < self.l3 => Expect::Malformed,
            Expect::Ip { .. } if len < self.frame.len() - self.padding => Expect::Malformed,
            e => e,
        }
    }
}

const IP_L4: Expect = Expect::Ip { l4: true, hidden: false };
const IP_NO_L4: Expect = Expect::Ip { l4: false, hidden: false };
/// IP without L4 whose ports are hidden: dropped while port policies exist.
const IP_HIDDEN: Expect = Expect::Ip { l4: false, hidden: true };
const MALFORMED: Expect = Expect::Malformed;
const NOT_IP: Expect = Expect::NotIp;

/// Offsets inside an IPv4 / IPv6 header.
const V4_TOTAL_LEN: usize = 2;
const V4_PROTO: usize = 9;
const V6_PAYLOAD_LEN: usize = 4;

/// Every fixture, by name. Names are unique.
pub fn fixtures() -> Vec<Fixture> {
    let mut all = not_ip();
    all.extend(v4_fixtures());
    all.extend(v6_fixtures());
    all.extend(vlan_fixtures());
    all
}

fn not_ip() -> Vec<Fixture> {
    let v4_udp = V4::from(v4(0, 1)).datagram(&udp(1000, 53, 4));
    let mut tag_9100 = vec![0x00, 0x0a];
    tag_9100.extend_from_slice(&EtherType::IPV4.0.to_be_bytes());
    tag_9100.extend_from_slice(&v4_udp);
    let arp = EtherType::ARP;
    vec![
        Fixture::new("arp_request", NOT_IP, &[], arp, arp_request()).padded(60),
        Fixture::new("vlan_arp", NOT_IP, &[Tag::Q(10)], arp, arp_request()),
        Fixture::new("qinq_arp", NOT_IP, &[Tag::Ad(100), Tag::Q(10)], arp, arp_request()),
        Fixture::new("lldp", NOT_IP, &[], EtherType(0x88cc), vec![0x02, 0x07, 0x04, 0, 0, 0, 0, 0, 1]),
        // An 802.3 length field, not an ethertype.
        Fixture::new("ieee_802_3_llc", NOT_IP, &[], EtherType(0x0026), vec![0x42, 0x42, 0x03]),
        Fixture::new("ethernet_header_only", NOT_IP, &[], arp, vec![]),
        // 0x9100 (old QinQ) is not a tag the parser accepts: what follows is not looked at.
        Fixture::new("tpid_9100_is_not_a_tag", NOT_IP, &[], EtherType::VLAN_DOUBLE_TAGGED_FRAME, tag_9100),
    ]
}

fn v4_fixtures() -> Vec<Fixture> {
    use IpNumber as P;
    let src = V4::from(v4(0, 1));
    let options = V4 { options: 40, ..src };
    let first_frag = V4 { more_fragments: true, ..src };
    let later_frag = |frag_offset| V4 { frag_offset, ..src };
    let tcp_dgram = src.datagram(&tcp(40_000, 443));
    let tcp_with = |f: fn(&mut Vec<u8>)| patched(tcp_dgram.clone(), f);
    vec![
        Fixture::v4("v4_tcp", IP_L4, tcp_dgram.clone()),
        Fixture::v4("v4_udp", IP_L4, src.datagram(&udp(5353, 53, 32))),
        Fixture::v4("v4_udp_padded_to_60", IP_L4, src.datagram(&udp(5353, 53, 0))).padded(60),
        Fixture::v4("v4_icmp_echo", IP_L4, src.datagram(&icmpv4_echo())),
        Fixture::v4("v4_tcp_max_options", IP_L4, src.datagram(&tcp_with_options(1, 2, 40))),
        Fixture::v4("v4_ip_options_udp", IP_L4, options.datagram(&udp(123, 123, 48))),
        Fixture::v4("v4_ihl6_tcp", IP_L4, V4 { options: 4, ..src }.datagram(&tcp(80, 8080))),
        Fixture::v4("v4_first_fragment_udp", IP_L4, first_frag.datagram(&udp(7, 9, 64))),
        Fixture::v4("v4_non_first_fragment", IP_NO_L4, later_frag(185).datagram(&raw(P::UDP, &[0xee; 40]))),
        // A later fragment may be shorter than any L4 header: nothing to parse there.
        Fixture::v4("v4_non_first_fragment_tiny", IP_NO_L4, later_frag(1).datagram(&raw(P::TCP, &[0xee; 3]))),
        Fixture::v4(
            "v4_non_first_fragment_ip_options",
            IP_NO_L4,
            V4 { frag_offset: 7, ..options }.datagram(&raw(P::TCP, &[])),
        ),
        Fixture::v4("v4_gre", IP_NO_L4, src.datagram(&raw(P::GRE, &[0, 0, 0x08, 0]))),
        // ICMPv6 means nothing over IPv4: no L4 header is looked for.
        Fixture::v4("v4_proto_icmpv6", IP_NO_L4, src.datagram(&raw(P::IPV6_ICMP, &[]))),
        Fixture::v4("v4_ihl_4", MALFORMED, tcp_with(|d| d[0] = 0x44)),
        Fixture::v4("v4_ihl_0", MALFORMED, tcp_with(|d| d[0] = 0x40)),
        Fixture::v4("v4_version_6", MALFORMED, tcp_with(|d| d[0] = 0x65)),
        Fixture::v4("v4_total_len_below_ihl", MALFORMED, tcp_with(|d| set_u16(d, V4_TOTAL_LEN, 19))),
        Fixture::v4(
            "v4_total_len_below_ihl_options",
            MALFORMED,
            patched(options.datagram(&udp(1, 2, 0)), |d| set_u16(d, V4_TOTAL_LEN, 40)),
        ),
        Fixture::v4("v4_total_len_past_frame", MALFORMED, tcp_with(|d| one_past_the_end(d, V4_TOTAL_LEN, 0))),
        // IHL 15 and total length 60 agree, but the frame ends 20 bytes into the header.
        Fixture::v4(
            "v4_ihl_past_frame",
            MALFORMED,
            patched(src.datagram(&raw(P::UDP, &[])), |d| {
                d[0] = 0x4f;
                set_u16(d, V4_TOTAL_LEN, 60)
            }),
        ),
        Fixture::v4("v4_header_cut", MALFORMED, tcp_dgram.clone()).cut(ETH_LEN + 12),
        // Past the IP header, what the datagram does not hold is IP without L4, never malformed.
        // The frame holds the whole TCP header, the datagram only 12 bytes of it: the stack
        // drops such a datagram itself, so no port is hidden.
        Fixture::v4("v4_tcp_past_datagram", IP_NO_L4, tcp_with(|d| set_u16(d, V4_TOTAL_LEN, 32))),
        Fixture::v4("v4_tcp_doff_4", IP_NO_L4, tcp_with(|d| d[20 + 12] = 0x40)),
        Fixture::v4("v4_tcp_doff_past_datagram", IP_NO_L4, tcp_with(|d| d[20 + 12] = 0xf0)),
        Fixture::v4("v4_udp_7_bytes", IP_NO_L4, src.datagram(&raw(P::UDP, &[0, 53, 0, 53, 0, 7, 0]))),
        // The padding holds 20 bytes after the IP header: the datagram's end decides, not the frame's.
        Fixture::v4("v4_udp_7_bytes_padded", IP_NO_L4, src.datagram(&raw(P::UDP, &[0, 53, 0, 53, 0, 7, 0]))).padded(60),
        Fixture::v4("v4_icmp_4_bytes", IP_NO_L4, src.datagram(&raw(P::ICMP, &[8, 0, 0, 0]))),
        // Tiny first fragments (RFC 1858): the reassembled datagram has ports nobody read.
        Fixture::v4(
            "v4_first_fragment_8_bytes_of_tcp",
            IP_HIDDEN,
            first_frag.datagram(&raw(P::TCP, &tcp(1, 2).bytes[..8])),
        ),
        Fixture::v4(
            "v4_first_fragment_8_bytes_of_tcp_padded",
            IP_HIDDEN,
            first_frag.datagram(&raw(P::TCP, &tcp(1, 80).bytes[..8])),
        )
        .padded(60),
        Fixture::v4(
            "v4_first_fragment_doff_past_fragment",
            IP_HIDDEN,
            patched(first_frag.datagram(&tcp(1, 2)), |d| d[20 + 12] = 0xf0),
        ),
        Fixture::v4("v4_first_fragment_4_bytes_of_udp", IP_HIDDEN, first_frag.datagram(&raw(P::UDP, &[0, 53, 0, 53]))),
        Fixture::v4("v4_first_fragment_no_l4_bytes_tcp", IP_HIDDEN, first_frag.datagram(&raw(P::TCP, &[]))),
        // ICMP has no ports to hide.
        Fixture::v4("v4_first_fragment_4_bytes_of_icmp", IP_NO_L4, first_frag.datagram(&raw(P::ICMP, &[8, 0, 0, 0]))),
        // Changing only the protocol turns the TCP header into a valid UDP one: still IP.
        Fixture::v4("v4_tcp_bytes_as_udp", IP_L4, tcp_with(|d| d[V4_PROTO] = 17)),
    ]
}

fn v6_fixtures() -> Vec<Fixture> {
    use Ext::*;
    use IpNumber as P;
    let src = v6(1, 1);
    let hbh = HopByHop { len: 0 };
    let dst = DestOpts { len: 0 };
    let first = Fragment { offset: 0, more: true };
    let atomic = Fragment { offset: 0, more: false };
    let later = Fragment { offset: 100, more: true };
    let dsts_then = |n: usize, last: Ext| -> Vec<Ext> {
        let mut exts = vec![dst; n];
        exts.push(last);
        exts
    };
    let tcp_dgram = ipv6(src, &[], &tcp(40_000, 443));
    let tcp_with = |f: fn(&mut Vec<u8>)| patched(tcp_dgram.clone(), f);
    let udp_after_hbh = |f: fn(&mut Vec<u8>)| patched(ipv6(src, &[hbh], &udp(1, 2, 0)), f);
    vec![
        Fixture::v6("v6_tcp", IP_L4, tcp_dgram.clone()),
        Fixture::v6("v6_udp", IP_L4, ipv6(src, &[], &udp(5353, 53, 32))),
        Fixture::v6("v6_icmpv6_echo", IP_L4, ipv6(src, &[], &icmpv6_echo())),
        Fixture::v6("v6_tcp_max_options", IP_L4, ipv6(src, &[], &tcp_with_options(1, 2, 40))),
        Fixture::v6("v6_hop_by_hop_udp", IP_L4, ipv6(src, &[hbh], &udp(546, 547, 16))),
        Fixture::v6("v6_long_hop_by_hop_udp", IP_L4, ipv6(src, &[HopByHop { len: 31 }], &udp(546, 547, 16))),
        Fixture::v6("v6_routing_tcp", IP_L4, ipv6(src, &[Routing], &tcp(1, 2))),
        Fixture::v6("v6_dest_opts_tcp", IP_L4, ipv6(src, &[DestOpts { len: 2 }], &tcp(3, 4))),
        Fixture::v6("v6_first_fragment_udp", IP_L4, ipv6(src, &[first], &udp(7, 9, 64))),
        Fixture::v6("v6_four_exts_udp", IP_L4, ipv6(src, &[hbh, DestOpts { len: 1 }, Routing, first], &udp(5, 6, 12))),
        Fixture::v6("v6_five_exts_tcp", IP_L4, ipv6(src, &[hbh, dst, Routing, first, dst], &tcp(5, 6))),
        // MAX_EXT_HEADERS (6) extension headers are walked; the L4 header after them is read.
        Fixture::v6("v6_six_exts_tcp", IP_L4, ipv6(src, &[hbh, dst, Routing, first, dst, dst], &tcp(5, 6))),
        Fixture::v6(
            "v6_six_exts_last_non_first_fragment",
            IP_NO_L4,
            ipv6(src, &[hbh, dst, Routing, dst, dst, later], &raw(P::TCP, &[1; 8])),
        ),
        // Hop-by-hop is only allowed first by RFC 8200, but the parser skips it anywhere.
        Fixture::v6("v6_hop_by_hop_not_first", IP_L4, ipv6(src, &[dst, hbh], &udp(1, 2, 0))),
        Fixture::v6("v6_non_first_fragment", IP_NO_L4, ipv6(src, &[later], &raw(P::UDP, &[0xee; 24]))),
        Fixture::v6("v6_exts_then_non_first_fragment", IP_NO_L4, ipv6(src, &[hbh, Routing, later], &raw(P::TCP, &[]))),
        Fixture::v6("v6_no_next_header", IP_NO_L4, ipv6(src, &[], &raw(P::IPV6_NO_NEXT_HEADER, &[]))),
        // ICMP(v4) means nothing over IPv6, and AH is not a header the parser walks.
        Fixture::v6("v6_proto_icmpv4", IP_NO_L4, ipv6(src, &[], &raw(P::ICMP, &[8, 0, 0, 0, 0, 0, 0, 0]))),
        Fixture::v6("v6_auth_header", IP_NO_L4, ipv6(src, &[dst], &raw(P::AUTHENTICATION_HEADER, &[6, 4, 0, 0]))),
        Fixture::v6("v6_version_4", MALFORMED, tcp_with(|d| d[0] = 0x40)),
        Fixture::v6("v6_header_cut", MALFORMED, tcp_dgram.clone()).cut(ETH_LEN + 39),
        Fixture::v6("v6_payload_len_past_frame", MALFORMED, tcp_with(|d| one_past_the_end(d, V6_PAYLOAD_LEN, 40))),
        // Past the IPv6 header, what the datagram does not hold is IP without L4.
        Fixture::v6("v6_tcp_past_datagram", IP_NO_L4, tcp_with(|d| set_u16(d, V6_PAYLOAD_LEN, 12))),
        Fixture::v6("v6_tcp_doff_3", IP_NO_L4, tcp_with(|d| d[40 + 12] = 0x30)),
        Fixture::v6("v6_udp_cut", IP_NO_L4, ipv6(src, &[], &raw(P::UDP, &[0, 1, 0, 2]))),
        Fixture::v6("v6_icmpv6_cut", IP_NO_L4, ipv6(src, &[dst], &raw(P::IPV6_ICMP, &[128, 0]))),
        // Hdr Ext Len 255 announces 2048 bytes; the datagram has 16.
        Fixture::v6("v6_ext_len_past_datagram", IP_NO_L4, udp_after_hbh(|d| d[40 + 1] = 255)),
        // Hop-by-hop fits the frame, not the datagram (payload length 0, as in a jumbogram).
        Fixture::v6("v6_payload_len_0_with_ext", IP_NO_L4, udp_after_hbh(|d| set_u16(d, V6_PAYLOAD_LEN, 0))),
        Fixture::v6("v6_fragment_header_cut", IP_NO_L4, ipv6(src, &[], &raw(P::IPV6_FRAGMENTATION_HEADER, &[17, 0]))),
        // An atomic fragment (offset 0, M clear) is a whole datagram: a cut UDP header hides nothing.
        Fixture::v6("v6_atomic_fragment_cut_udp", IP_NO_L4, ipv6(src, &[atomic], &raw(P::UDP, &[0, 1, 0, 2]))),
        // Long chains: RFC 8200 sets no limit, so up to MAX_EXT_HEADERS (32) are walked.
        Fixture::v6("v6_seven_exts_tcp", IP_L4, ipv6(src, &[hbh, dst, Routing, first, dst, dst, dst], &tcp(5, 6))),
        Fixture::v6("v6_sixteen_hop_by_hop_udp", IP_L4, ipv6(src, &[hbh; 16], &udp(1, 2, 0))),
        Fixture::v6("v6_32_dest_opts_udp", IP_L4, ipv6(src, &[dst; 32], &udp(1, 53, 4))),
        Fixture::v6("v6_31_dest_opts_first_fragment_tcp", IP_L4, ipv6(src, &dsts_then(31, first), &tcp(1, 443))),
        // One more than MAX_EXT_HEADERS: whatever follows is not read, its ports are hidden.
        Fixture::v6("v6_33_dest_opts_udp", IP_HIDDEN, ipv6(src, &[dst; 33], &udp(1, 53, 4))),
        Fixture::v6(
            "v6_32_dest_opts_then_non_first_fragment",
            IP_HIDDEN,
            ipv6(src, &dsts_then(32, later), &raw(P::UDP, &[1; 8])),
        ),
        // A later fragment's next header is the sender's claim: class OTHER whatever it says.
        Fixture::v6("v6_non_first_fragment_claims_tcp", IP_NO_L4, ipv6(src, &[later], &tcp(1, 443))),
        // Tiny first fragments: Linux drops a first fragment without the 8 bytes of a UDP (or 20
        // of a TCP) header (RFC 7112), not one whose TCP options or extension chain run on.
        Fixture::v6(
            "v6_first_fragment_7_bytes_of_udp",
            IP_HIDDEN,
            ipv6(src, &[first], &raw(P::UDP, &[0, 1, 0, 53, 0, 9, 0])),
        ),
        Fixture::v6(
            "v6_first_fragment_doff_past_fragment",
            IP_HIDDEN,
            patched(ipv6(src, &[first], &tcp(1, 443)), |d| d[48 + 12] = 0xf0),
        ),
        // A destination-options header of 16 bytes, 8 of them in this fragment.
        Fixture::v6(
            "v6_first_fragment_cut_chain",
            IP_HIDDEN,
            ipv6(src, &[first], &raw(P::IPV6_DESTINATION_OPTIONS, &[17, 1, 1, 4, 0, 0, 0, 0])),
        ),
        Fixture::v6("v6_first_fragment_icmpv6_cut", IP_NO_L4, ipv6(src, &[first], &raw(P::IPV6_ICMP, &[128, 0]))),
    ]
}

fn vlan_fixtures() -> Vec<Fixture> {
    use Tag::{Ad, Q};
    let (ip4, ip6) = (EtherType::IPV4, EtherType::IPV6);
    let udp4 = V4::from(v4(2, 7)).datagram(&udp(1000, 53, 8));
    let tcp6 = ipv6(v6(2, 7), &[], &tcp(1000, 22));
    let icmp4 = V4::from(v4(2, 8)).datagram(&icmpv4_echo());
    let later4 = V4 { frag_offset: 3, ..V4::from(v4(2, 9)) }.datagram(&raw(IpNumber::UDP, &[1; 16]));
    let hbh6 = ipv6(v6(2, 9), &[Ext::HopByHop { len: 1 }], &udp(9, 9, 0));
    vec![
        Fixture::new("vlan_q_v4_udp", IP_L4, &[Q(10)], ip4, udp4.clone()),
        Fixture::new("vlan_ad_v4_icmp", IP_L4, &[Ad(20)], ip4, icmp4),
        Fixture::new("vlan_q_v6_tcp", IP_L4, &[Q(4095)], ip6, tcp6.clone()),
        Fixture::new("qinq_ad_q_v6_tcp", IP_L4, &[Ad(100), Q(10)], ip6, tcp6.clone()),
        Fixture::new("double_q_v4_udp", IP_L4, &[Q(1), Q(2)], ip4, udp4.clone()),
        Fixture::new("qinq_v4_non_first_fragment", IP_NO_L4, &[Ad(1), Q(2)], ip4, later4),
        Fixture::new("qinq_v6_hop_by_hop_udp", IP_L4, &[Ad(5), Ad(6)], ip6, hbh6),
        Fixture::new("three_vlan_tags", MALFORMED, &[Q(1), Q(2), Q(3)], ip4, udp4.clone()),
        Fixture::new("three_vlan_tags_ad", MALFORMED, &[Ad(1), Q(2), Ad(3)], ip6, tcp6),
        Fixture::new("vlan_tag_cut", MALFORMED, &[Q(10)], ip4, udp4.clone()).cut(ETH_LEN + 2),
        Fixture::new("second_vlan_tag_cut", MALFORMED, &[Ad(10), Q(11)], ip4, udp4.clone()).cut(ETH_LEN + TAG_LEN + 3),
        Fixture::new("vlan_v4_header_cut", MALFORMED, &[Q(10)], ip4, udp4).cut(ETH_LEN + TAG_LEN + 19),
    ]
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn names_are_unique_and_addresses_documentation_only() {
        let all = fixtures();
        let names: HashSet<_> = all.iter().map(|f| f.name).collect();
        assert_eq!(names.len(), all.len(), "duplicate fixture names");
        for f in &all {
            assert!(f.frame.len() >= ETH_LEN, "{}: shorter than an Ethernet header", f.name);
        }
        assert_eq!(v4(0x1ff, 9), [198, 19, 255, 9]);
        assert_eq!(&v6(7, 1)[..4], &[0x20, 0x01, 0x0d, 0xb8]);
    }

    #[test]
    fn builders_lay_headers_where_expected() {
        let frame = ethernet(&[Tag::Ad(100), Tag::Q(10)], EtherType::IPV4, &V4::from(v4(0, 1)).datagram(&tcp(1, 2)));
        assert_eq!(&frame[12..14], &[0x88, 0xa8]);
        assert_eq!(&frame[16..18], &[0x81, 0x00]);
        assert_eq!(&frame[20..22], &[0x08, 0x00]);
        assert_eq!(frame[22], 0x45);
        let d = ipv6(v6(1, 1), &[Ext::HopByHop { len: 0 }, Ext::Fragment { offset: 1, more: false }], &udp(1, 2, 0));
        assert_eq!((d[6], d[40], d[48]), (0, 44, 17));
        assert_eq!(u16::from_be_bytes([d[4], d[5]]), 8 + 8 + 8);
        assert_eq!(u16::from_be_bytes([d[50], d[51]]) >> 3, 1);
    }
}

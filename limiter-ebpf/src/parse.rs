//! Header parsing with explicit bounds checks, every loop bounded by a small constant.
//!
//! Accepts Ethernet with up to two VLAN tags (802.1Q, 802.1ad), IPv4 honouring IHL and total
//! length, IPv6 walking up to [`MAX_EXT_HEADERS`] hop-by-hop, routing, fragment and
//! destination-options headers, then TCP, UDP, ICMP and ICMPv6 headers.
//!
//! The rule: any IP packet whose source can be read is judged, at least against the policies
//! that need no port (its protocol class, then `any`). Only the frame and the IP header decide
//! whether a frame is judged at all:
//!
//! 1. **Malformed** (passes unjudged): a VLAN tag or the fixed IP header cut by the frame, IPv4
//!    version != 4, IHL < 5 or total length < IHL, IPv6 version != 6, or a datagram (IPv4 total
//!    length, IPv6 40 + payload length) longer than the frame. A later header that the
//!    datagram holds but the frame does not is the same case (the frame is shorter than its
//!    datagram). The stack drops all of these itself.
//! 2. **IP without L4** (`has_l4 == false`, judged by class): everything after the fixed IP
//!    header that the datagram does not hold. An L4 header the datagram's end cuts (TCP needs 20
//!    bytes and a data offset >= 5 that ends inside the datagram; UDP, ICMP over IPv4 and ICMPv6
//!    over IPv6 need 8), or an IPv6 extension header running past the datagram's end. Each is
//!    checked against the datagram's end before the frame's, so Ethernet padding never changes
//!    a verdict. The class comes from the protocol (`class_of`); `proto` is the last next
//!    header the parser could follow (for a cut chain, the number of the header that is cut,
//!    so class OTHER).
//! 3. **Ports hidden** (`ports_hidden`, judged by class; dropped by the limiter while a policy
//!    could miss it: any port policy, for class OTHER a TCP or UDP policy other than `any`, or
//!    a judging policy keyed on the port or SYN-only, `program/policy.rs`'s `hides_from_a_policy`): the datagram the
//!    stack will reassemble carries a port this parser cannot
//!    see. Tiny-fragment attacks (RFC 1858) split the L4 header over fragments so that the first
//!    one carries no port; Linux reassembles them and delivers the ports. Concretely:
//!    - an IPv4 first fragment (offset 0, MF set) of TCP or UDP whose L4 header is cut as in 2;
//!    - an IPv6 first fragment (a fragment header with offset 0 and M set) of TCP or UDP whose
//!      L4 header is cut as in 2 (Linux's RFC 7112 check, `ipv6frag_thdr_truncated`, wants
//!      only the 8 bytes of UDP or the 20 of TCP, so a data offset past the fragment passes it),
//!      or whose chain after that fragment header runs past the datagram's end (the upper
//!      protocol, and so whether a port follows, is unknown: class OTHER; Linux drops such a
//!      first fragment itself, but the limiter does not rely on the stack behind it);
//!    - an IPv6 chain longer than [`MAX_EXT_HEADERS`] (RFC 8200 sets no limit and Linux walks
//!      any length): class OTHER, `proto` the number of the first header not walked.
//!
//!    A packet that is not a fragment with a cut L4 header is not hidden: the stack drops it.
//! 4. IPv4 non-first fragments (offset != 0): no L4 header, class from the IP protocol field.
//!    Linux keys IPv4 reassembly on (source, destination, id, protocol), so the protocol a later
//!    fragment states is the one of the datagram it joins.
//! 5. IPv6 non-first fragments (a fragment header with offset != 0 ends the walk): no L4
//!    header, class OTHER. Linux keys IPv6 reassembly on (source, destination, id) and takes
//!    the upper protocol from the first fragment only, so the next header a later fragment
//!    states is the sender's free choice and must not choose the policy. `proto` still holds
//!    that stated next header (for the probe; nothing decides on it).
//!
//! 6. **BIG TCP** (Linux >= 5.19 for IPv6, 6.3 for IPv4): an aggregate over 64 KiB states an
//!    IPv4 total length of 0 or an IPv6 payload length of 0 (with or without an RFC 2675
//!    jumbo option) and takes its length from the skb. Only skb mode shows the program such a
//!    frame (GSO from a veth or tap peer; a driver's linear XDP frame is a page at most). A
//!    length of 0 on a frame holding 64 KiB or more of it is read that way: the datagram is
//!    the frame, judged on its headers like any other (it was malformed, so it passed unjudged:
//!    measured on veth, 119 of 165 frames of a bulk transfer carrying 18 of its 20 MB over
//!    IPv4, and under a port policy 191 of 225 IPv6 frames passed unmatched). A shorter frame
//!    stating 0 is what it was: IPv4 malformed, IPv6 a datagram of 40 bytes.
//!
//! At tc ingress (`crate::frame`, for `__sk_buff`) the rules are the same: headers are read
//! in the skb's linear part (the program pulls up to `frame::PULL_BYTES` into it first), and
//! a datagram's stated length is checked against the whole skb (`skb->len`), so paged data is
//! never mistaken for a short frame.
//!
//! [`MAX_EXT_HEADERS`] is 32: a legitimate chain has at most a handful (one of each kind, a
//! second destination-options header), and the bound only keeps the verifier's walk finite.

use core::mem::size_of;

use crate::frame::Frame;
use limiter_common::{
    key::{FAMILY_V4, FAMILY_V6},
    maps::{CLASS_ICMP, CLASS_OTHER, CLASS_TCP, CLASS_UDP},
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
    vlan::VlanHdr,
};

/// IPv6 extension headers walked; a longer chain hides its ports (module docs, rule 3).
pub const MAX_EXT_HEADERS: usize = 32;

/// The length a BIG TCP datagram is taken to have (rule 6): past any header the parser reads
/// (every offset it reads at is below [`MAX_L4_OFFSET`]), so only the frame's end cuts one.
const BIG_DATAGRAM: usize = 0x10000;

/// No L4 header starts further into a frame than this: XDP's linear frame is at most a page, so
/// an offset past it means the frame is shorter than its datagram (malformed). It also lets the
/// verifier see that packet offsets stay far below its 0xffff limit.
const MAX_L4_OFFSET: usize = 0x3fff;

// Ethertypes as they sit in memory (network order), compared without swapping.
const ETH_IPV4: u16 = 0x0800u16.to_be();
const ETH_IPV6: u16 = 0x86DDu16.to_be();
const ETH_8021Q: u16 = 0x8100u16.to_be();
const ETH_8021AD: u16 = 0x88A8u16.to_be();

pub const IPPROTO_HOPOPTS: u8 = 0;
pub const IPPROTO_ICMP: u8 = 1;
pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_ROUTING: u8 = 43;
pub const IPPROTO_FRAGMENT: u8 = 44;
pub const IPPROTO_ICMPV6: u8 = 58;
pub const IPPROTO_DSTOPTS: u8 = 60;

/// Why a frame is not judged: both pass.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    NotIp,
    Malformed,
}

/// What the limiter needs of an IP packet.
///
/// `repr(C)` with a `bool` first: `Result<Packet, Skip>` keeps its tag in a `bool`'s niche, and
/// at offset 0 the BTF LLVM emits for it (the return type of `walk_v6_chain`, a real call) is
/// a union whose members all start at 0, as the kernel requires. With the niche elsewhere the
/// kernel refused the object's whole BTF ("Invalid member bits_offset"): no line info in the
/// verifier's and bpftool's dumps, no typed map dumps.
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Packet {
    /// The L4 header was present and parsed: for TCP and UDP, the ports are valid.
    pub has_l4: bool,
    /// The datagram the stack will deliver carries a destination port this parser could not
    /// read: judged by its protocol class, or dropped where a policy could need the port.
    pub ports_hidden: bool,
    pub family: u8,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    /// A TCP segment with SYN set and ACK clear (a connection opening), read from the flags
    /// byte of the 20 bytes `has_l4` checked; false for anything else, TCP without L4 included.
    pub syn: bool,
    /// `CLASS_TCP`, `CLASS_UDP`, `CLASS_ICMP` or `CLASS_OTHER`.
    pub class: usize,
    /// The source address as two little-endian words (IPv4: low 32 bits of the first).
    pub src: [u64; 2],
    /// The destination address, laid out as `src`.
    pub dst: [u64; 2],
}

impl Packet {
    /// Nothing parsed yet.
    pub const EMPTY: Packet = Packet {
        has_l4: false,
        ports_hidden: false,
        family: 0,
        proto: 0,
        sport: 0,
        dport: 0,
        syn: false,
        class: CLASS_OTHER,
        src: [0; 2],
        dst: [0; 2],
    };

    /// A packet of `family` whose (next) protocol is `proto`: every field but the addresses
    /// set as the parse starts it (class OTHER, no L4 header, nothing hidden, no ports).
    #[inline(always)]
    fn start(&mut self, family: u8, proto: u8) {
        self.family = family;
        self.proto = proto;
        self.class = CLASS_OTHER;
        self.has_l4 = false;
        self.ports_hidden = false;
        self.sport = 0;
        self.dport = 0;
        self.syn = false;
    }
}

#[inline(always)]
fn ptr_at<T, F: Frame>(ctx: &F, offset: usize) -> Result<*const T, Skip> {
    let start = ctx.data();
    if start + offset + size_of::<T>() > ctx.data_end() {
        return Err(Skip::Malformed);
    }
    Ok((start + offset) as *const T)
}

/// Parses the frame into `pkt`, every field written (whatever it held) unless a skip comes back.
/// Written in place, not returned: the program hands it a map value, so that the IPv6
/// addresses, read a byte at a time, go straight there rather than through its stack.
#[inline(always)]
pub fn parse<F: Frame>(ctx: &F, pkt: &mut Packet) -> Result<(), Skip> {
    let eth: *const EthHdr = ptr_at(ctx, 0)?;
    let mut ethertype = unsafe { (*eth).ether_type };
    let mut off = EthHdr::LEN;
    // Two tags at most; a third is refused below.
    if ethertype == ETH_8021Q || ethertype == ETH_8021AD {
        let vlan: *const VlanHdr = ptr_at(ctx, off)?;
        ethertype = unsafe { (*vlan).ether_type };
        off += VlanHdr::LEN;
        if ethertype == ETH_8021Q || ethertype == ETH_8021AD {
            let vlan: *const VlanHdr = ptr_at(ctx, off)?;
            ethertype = unsafe { (*vlan).ether_type };
            off += VlanHdr::LEN;
            if ethertype == ETH_8021Q || ethertype == ETH_8021AD {
                return Err(Skip::Malformed);
            }
        }
    }
    if ethertype == ETH_IPV4 {
        parse_v4(ctx, off, pkt)
    } else if ethertype == ETH_IPV6 {
        parse_v6(ctx, off, pkt)
    } else {
        Err(Skip::NotIp)
    }
}

#[inline(always)]
fn parse_v4<F: Frame>(ctx: &F, l3: usize, pkt: &mut Packet) -> Result<(), Skip> {
    let ip: *const Ipv4Hdr = ptr_at(ctx, l3)?;
    let vihl = unsafe { (*ip).vihl };
    if vihl >> 4 != 4 {
        return Err(Skip::Malformed);
    }
    let ihl = usize::from(vihl & 0x0f) * 4;
    let stated = length(unsafe { (*ip).tot_len });
    // BIG TCP (rule 6): the datagram is the frame.
    let big = stated == 0 && beyond_64k(ctx, l3);
    // Without a branch (`stated` is 0 when big): fewer paths for the verifier to walk.
    let total = stated | (usize::from(big) * BIG_DATAGRAM);
    if ihl < Ipv4Hdr::LEN || total < ihl {
        return Err(Skip::Malformed);
    }
    let src = u32::from_ne_bytes(unsafe { (*ip).src_addr });
    let dst = u32::from_ne_bytes(unsafe { (*ip).dst_addr });
    let proto = unsafe { (*ip).proto };
    pkt.start(FAMILY_V4, proto);
    pkt.src = [u64::from(src), 0];
    pkt.dst = [u64::from(dst), 0];
    let frags = u16::from_be_bytes(unsafe { (*ip).frags });
    if frags & 0x1fff != 0 {
        // Not the first fragment: no L4 header here; the protocol is the datagram's (rule 4).
        pkt.class = class_of(FAMILY_V4, proto);
    } else {
        let first_fragment = frags & 0x2000 != 0;
        parse_l4(ctx, pkt, l3 + ihl, l3 + total, first_fragment)?;
    }
    if !big {
        datagram_fits(ctx, l3 + total)?;
    }
    Ok(())
}

/// A datagram's stated length (network order), bounded where the verifier sees it: the
/// verifiers of kernels before 6.? forget a byte swap's range (6.1's turns its result into an
/// unknown scalar, which it then refuses to add to a packet pointer). LLVM knows the bound and
/// would drop a plain mask, so the value goes through `black_box` first.
#[inline(always)]
fn length(be: [u8; 2]) -> usize {
    core::hint::black_box(usize::from(u16::from_be_bytes(be))) & 0xffff
}

/// The frame holds 64 KiB or more from `off` (the IP header, or IPv6's payload), more than a
/// stated length can cover: only an aggregate can (skb mode; no driver's linear XDP frame is
/// that long).
#[inline(always)]
fn beyond_64k<F: Frame>(ctx: &F, off: usize) -> bool {
    ctx.reaches(off + 0x10000)
}

/// The datagram must fit in the frame. Checked last on purpose: had it come first, LLVM would
/// treat the frame checks of later headers as implied by it and drop them, and the verifier
/// cannot follow that reasoning.
#[inline(always)]
fn datagram_fits<F: Frame>(ctx: &F, end: usize) -> Result<(), Skip> {
    if !ctx.reaches(end) {
        return Err(Skip::Malformed);
    }
    Ok(())
}

#[inline(always)]
fn parse_v6<F: Frame>(ctx: &F, l3: usize, pkt: &mut Packet) -> Result<(), Skip> {
    let ip: *const Ipv6Hdr = ptr_at(ctx, l3)?;
    if unsafe { (*ip).vcf[0] } >> 4 != 6 {
        return Err(Skip::Malformed);
    }
    let payload = length(unsafe { (*ip).payload_len });
    // BIG TCP and jumbograms (rule 6): the datagram is the frame.
    let big = payload == 0 && beyond_64k(ctx, l3 + Ipv6Hdr::LEN);
    let end = l3 + Ipv6Hdr::LEN + (payload | (usize::from(big) * BIG_DATAGRAM));
    let next = unsafe { (*ip).next_hdr };
    pkt.start(FAMILY_V6, next);
    // SAFETY: 16 bytes each, within the header `ptr_at` checked, into the packet's own fields.
    unsafe {
        let (src, dst) = (core::ptr::addr_of!((*ip).src_addr), core::ptr::addr_of!((*ip).dst_addr));
        core::ptr::copy_nonoverlapping(src.cast::<u8>(), pkt.src.as_mut_ptr().cast::<u8>(), 16);
        core::ptr::copy_nonoverlapping(dst.cast::<u8>(), pkt.dst.as_mut_ptr().cast::<u8>(), 16);
    }
    let walked = ctx.walk_v6(u64::from(next), (l3 + Ipv6Hdr::LEN) as u64, end as u64);
    unpack_walk(pkt, walked)?;
    if !big {
        datagram_fits(ctx, end)?;
    }
    Ok(())
}

/// The IPv6 walk ([`walk_v6_chain`]) of a frame whose next header after the fixed header is
/// `proto`, from `off`, the datagram ending at `end`, as a global function of the program:
/// [`pack_walk`]'s word. A frame's [`Frame::walk_v6`] calls the one for its hook.
///
/// Global, so the verifier walks it once for the program whatever the paths that reach it:
/// inlined, it carried every exit of the 32-step walk, each with its own offset range, through
/// the whole limiter and gave up past a million instructions; as a static function it was
/// walked again for every caller's state (a quarter of the limiter's count on kernel 7.3). A
/// global function takes scalars and the context, and returns one scalar: the packet's fields
/// the walk sets go back packed.
#[inline(always)]
pub fn walk_v6<F: Frame>(ctx: &F, proto: u64, off: u64, end: u64) -> u64 {
    let mut pkt = Packet::EMPTY;
    pkt.start(FAMILY_V6, proto as u8);
    // The caller's offset (at most 62: Ethernet, two tags, the fixed header) and the datagram's
    // end (below 0x20000), bounded again for the verifier, which knows nothing of them here:
    // past 0xffff it marks no packet pointer as checked.
    let (off, end) = ((off as usize) & MAX_L4_OFFSET, (end & 0x3ffff) as usize);
    pack_walk(walk_v6_chain(ctx, &mut pkt, off, end).map(|()| pkt))
}

const WALK_FAILED: u64 = 1 << 63;
const WALK_MALFORMED: u64 = 1 << 62;

/// What the walk sets of the packet, in one word: the next header (bits 0-7), the class (8-9),
/// has_l4, ports_hidden and syn (10-12), the source and destination ports (16-31, 32-47); or a
/// skip (bit 63; bit 62 set for malformed).
#[inline(always)]
fn pack_walk(walked: Result<Packet, Skip>) -> u64 {
    match walked {
        Ok(p) => {
            u64::from(p.proto)
                | ((p.class as u64) & 3) << 8
                | u64::from(p.has_l4) << 10
                | u64::from(p.ports_hidden) << 11
                | u64::from(p.syn) << 12
                | u64::from(p.sport) << 16
                | u64::from(p.dport) << 32
        }
        Err(Skip::Malformed) => WALK_FAILED | WALK_MALFORMED,
        Err(Skip::NotIp) => WALK_FAILED,
    }
}

/// Writes what the walk set ([`pack_walk`]'s word) into `pkt`.
#[inline(always)]
fn unpack_walk(pkt: &mut Packet, word: u64) -> Result<(), Skip> {
    if word & WALK_FAILED != 0 {
        return Err(if word & WALK_MALFORMED != 0 { Skip::Malformed } else { Skip::NotIp });
    }
    pkt.proto = word as u8;
    pkt.class = ((word >> 8) & 3) as usize;
    pkt.has_l4 = word & (1 << 10) != 0;
    pkt.ports_hidden = word & (1 << 11) != 0;
    pkt.syn = word & (1 << 12) != 0;
    pkt.sport = (word >> 16) as u16;
    pkt.dport = (word >> 32) as u16;
    Ok(())
}

/// Walks the extension headers from `off`; `pkt.proto` is the next header to read.
#[inline(always)]
fn walk_v6_chain<F: Frame>(ctx: &F, pkt: &mut Packet, mut off: usize, end: usize) -> Result<(), Skip> {
    // A first-fragment header was walked: what the datagram cannot show, the reassembly will.
    let mut first_fragment = false;
    for _ in 0..MAX_EXT_HEADERS {
        let nh = pkt.proto;
        if !is_extension_header(nh) {
            break;
        }
        // Every extension header is at least 8 bytes: next header, length, 6 more. The
        // datagram's end first (rule 2), then the frame's (a cut frame is malformed).
        if off + 8 > end {
            cut_chain(pkt, first_fragment);
            return Ok(());
        }
        let ext: *const [u8; 8] = ptr_at(ctx, off)?;
        let ext = unsafe { *ext };
        if nh == IPPROTO_FRAGMENT {
            off += 8;
            pkt.proto = ext[0];
            let offset_flags = u16::from_be_bytes([ext[2], ext[3]]);
            if offset_flags >> 3 != 0 {
                // Not the first fragment: no L4 header, and the stated next header is the
                // sender's choice (rule 5).
                pkt.class = CLASS_OTHER;
                return Ok(());
            }
            first_fragment |= offset_flags & 1 != 0;
        } else {
            off += (usize::from(ext[1]) + 1) * 8;
            if off > end {
                cut_chain(pkt, first_fragment);
                return Ok(());
            }
            pkt.proto = ext[0];
        }
        if off > MAX_L4_OFFSET {
            return Err(Skip::Malformed);
        }
    }
    if is_extension_header(pkt.proto) {
        // More than MAX_EXT_HEADERS: whatever follows is not read here (rule 3).
        pkt.class = CLASS_OTHER;
        pkt.ports_hidden = true;
        return Ok(());
    }
    parse_l4(ctx, pkt, off, end, first_fragment)
}

/// An extension header runs past the datagram's end: judged as IP of class OTHER (`proto` is
/// the cut header's number), hiding ports if a first fragment's reassembly will complete it.
#[inline(always)]
fn cut_chain(pkt: &mut Packet, first_fragment: bool) {
    pkt.class = CLASS_OTHER;
    pkt.ports_hidden = first_fragment;
}

#[inline(always)]
fn is_extension_header(nh: u8) -> bool {
    nh == IPPROTO_HOPOPTS || nh == IPPROTO_ROUTING || nh == IPPROTO_DSTOPTS || nh == IPPROTO_FRAGMENT
}

#[inline(always)]
fn class_of(family: u8, proto: u8) -> usize {
    match proto {
        IPPROTO_TCP => CLASS_TCP,
        IPPROTO_UDP => CLASS_UDP,
        IPPROTO_ICMP if family == FAMILY_V4 => CLASS_ICMP,
        IPPROTO_ICMPV6 if family == FAMILY_V6 => CLASS_ICMP,
        _ => CLASS_OTHER,
    }
}

/// Reads the L4 header at `l4`, which must end by `end` (the datagram's end). A header the
/// datagram cuts leaves the packet without L4 (rule 2), its ports hidden if the datagram is a
/// first fragment of TCP or UDP (rule 3).
#[inline(always)]
fn parse_l4<F: Frame>(ctx: &F, pkt: &mut Packet, l4: usize, end: usize, first_fragment: bool) -> Result<(), Skip> {
    pkt.class = class_of(pkt.family, pkt.proto);
    let need = match pkt.class {
        CLASS_TCP => 20,
        CLASS_UDP | CLASS_ICMP => 8,
        _ => return Ok(()),
    };
    // A cut header (rule 2): no L4, its ports hidden in a first fragment of TCP or UDP (rule 3).
    let hidden = first_fragment && pkt.class != CLASS_ICMP;
    if l4 + need > end {
        pkt.ports_hidden = hidden;
        return Ok(());
    }
    let hdr: *const [u8; 20] = match pkt.class {
        // Only the first 8 bytes are read for UDP and ICMP; check those alone.
        CLASS_TCP => ptr_at(ctx, l4)?,
        _ => ptr_at::<[u8; 8], F>(ctx, l4)?.cast(),
    };
    if pkt.class == CLASS_TCP {
        let doff = usize::from(unsafe { (*hdr)[12] } >> 4) * 4;
        if doff < 20 || l4 + doff > end {
            pkt.ports_hidden = hidden;
            return Ok(());
        }
        // Within the 20 bytes `ptr_at` checked: SYN (0x02) set, ACK (0x10) clear.
        pkt.syn = unsafe { (*hdr)[13] } & 0x12 == 0x02;
    }
    if pkt.class != CLASS_ICMP {
        let ports: *const [u8; 4] = hdr.cast();
        let p = unsafe { *ports };
        pkt.sport = u16::from_be_bytes([p[0], p[1]]);
        pkt.dport = u16::from_be_bytes([p[2], p[3]]);
    }
    pkt.has_l4 = true;
    Ok(())
}

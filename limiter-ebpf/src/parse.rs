//! Header parsing with explicit bounds checks, every loop bounded by a small constant.
//!
//! Accepts Ethernet with up to two VLAN tags (802.1Q, 802.1ad), IPv4 honouring IHL and total
//! length, IPv6 skipping up to [`MAX_EXT_HEADERS`] hop-by-hop, routing, fragment and
//! destination-options headers, then TCP, UDP, ICMP and ICMPv6 headers. A non-first fragment
//! carries no L4 header. Every header must lie inside both the frame and the IP datagram.

use core::mem::size_of;

use aya_ebpf::programs::XdpContext;
use limiter_common::{
    key::{FAMILY_V4, FAMILY_V6},
    maps::{CLASS_ICMP, CLASS_OTHER, CLASS_TCP, CLASS_UDP},
};
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
    vlan::VlanHdr,
};

/// IPv6 extension headers skipped before giving up on a chain (one of each kind and a spare).
pub const MAX_EXT_HEADERS: usize = 6;

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
#[derive(Clone, Copy)]
pub struct Packet {
    pub family: u8,
    pub proto: u8,
    /// `CLASS_TCP`, `CLASS_UDP`, `CLASS_ICMP` or `CLASS_OTHER`.
    pub class: usize,
    /// The L4 header was present and parsed: for TCP and UDP, the ports are valid.
    pub has_l4: bool,
    /// The datagram the stack will deliver carries a destination port this parser could not
    /// read: judged by its protocol class, and dropped while port policies exist.
    pub ports_hidden: bool,
    pub sport: u16,
    pub dport: u16,
    /// The source address as two little-endian words (IPv4: low 32 bits of the first).
    pub src: [u64; 2],
}

#[inline(always)]
fn ptr_at<T>(ctx: &XdpContext, offset: usize) -> Result<*const T, Skip> {
    let start = ctx.data();
    if start + offset + size_of::<T>() > ctx.data_end() {
        return Err(Skip::Malformed);
    }
    Ok((start + offset) as *const T)
}

#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Packet, Skip> {
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
        parse_v4(ctx, off)
    } else if ethertype == ETH_IPV6 {
        parse_v6(ctx, off)
    } else {
        Err(Skip::NotIp)
    }
}

#[inline(always)]
fn parse_v4(ctx: &XdpContext, l3: usize) -> Result<Packet, Skip> {
    let ip: *const Ipv4Hdr = ptr_at(ctx, l3)?;
    let vihl = unsafe { (*ip).vihl };
    if vihl >> 4 != 4 {
        return Err(Skip::Malformed);
    }
    let ihl = usize::from(vihl & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes(unsafe { (*ip).tot_len }));
    if ihl < Ipv4Hdr::LEN || total < ihl {
        return Err(Skip::Malformed);
    }
    let src = u32::from_ne_bytes(unsafe { (*ip).src_addr });
    let proto = unsafe { (*ip).proto };
    let mut pkt = Packet {
        family: FAMILY_V4,
        proto,
        class: CLASS_OTHER,
        has_l4: false,
        ports_hidden: false,
        sport: 0,
        dport: 0,
        src: [u64::from(src), 0],
    };
    let frag_offset = u16::from_be_bytes(unsafe { (*ip).frags }) & 0x1fff;
    let pkt = if frag_offset != 0 {
        pkt.class = class_of(FAMILY_V4, proto);
        pkt
    } else {
        parse_l4(ctx, pkt, l3 + ihl, l3 + total)?
    };
    datagram_fits(ctx, l3 + total)?;
    Ok(pkt)
}

/// The datagram must fit in the frame. Checked last on purpose: had it come first, LLVM would
/// treat the frame checks of later headers as implied by it and drop them, and the verifier
/// cannot follow that reasoning.
#[inline(always)]
fn datagram_fits(ctx: &XdpContext, end: usize) -> Result<(), Skip> {
    if ctx.data() + end > ctx.data_end() {
        return Err(Skip::Malformed);
    }
    Ok(())
}

#[inline(always)]
fn parse_v6(ctx: &XdpContext, l3: usize) -> Result<Packet, Skip> {
    let ip: *const Ipv6Hdr = ptr_at(ctx, l3)?;
    if unsafe { (*ip).vcf[0] } >> 4 != 6 {
        return Err(Skip::Malformed);
    }
    let end = l3 + Ipv6Hdr::LEN + usize::from(u16::from_be_bytes(unsafe { (*ip).payload_len }));
    let src: *const [u64; 2] = unsafe { core::ptr::addr_of!((*ip).src_addr) }.cast();
    let pkt = Packet {
        family: FAMILY_V6,
        proto: unsafe { (*ip).next_hdr },
        class: CLASS_OTHER,
        has_l4: false,
        ports_hidden: false,
        sport: 0,
        dport: 0,
        src: unsafe { core::ptr::read_unaligned(src) },
    };
    let pkt = walk_v6_chain(ctx, pkt, l3 + Ipv6Hdr::LEN, end)?;
    datagram_fits(ctx, end)?;
    Ok(pkt)
}

#[inline(always)]
fn walk_v6_chain(ctx: &XdpContext, mut pkt: Packet, mut off: usize, end: usize) -> Result<Packet, Skip> {
    for _ in 0..MAX_EXT_HEADERS {
        let nh = pkt.proto;
        if !is_extension_header(nh) {
            break;
        }
        // Every extension header is at least 8 bytes: next header, length, 6 more.
        let ext: *const [u8; 8] = ptr_at(ctx, off)?;
        if off + 8 > end {
            return Err(Skip::Malformed);
        }
        let ext = unsafe { *ext };
        pkt.proto = ext[0];
        if nh == IPPROTO_FRAGMENT {
            off += 8;
            if u16::from_be_bytes([ext[2], ext[3]]) >> 3 != 0 {
                // Not the first fragment: no L4 header here.
                pkt.class = class_of(FAMILY_V6, pkt.proto);
                return Ok(pkt);
            }
        } else {
            off += (usize::from(ext[1]) + 1) * 8;
        }
        if off > end {
            return Err(Skip::Malformed);
        }
    }
    if is_extension_header(pkt.proto) {
        // More than MAX_EXT_HEADERS: a chain this long is not worth following.
        return Err(Skip::Malformed);
    }
    parse_l4(ctx, pkt, off, end)
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

/// Reads the L4 header at `l4`, which must end by `end` (the datagram's end).
#[inline(always)]
fn parse_l4(ctx: &XdpContext, mut pkt: Packet, l4: usize, end: usize) -> Result<Packet, Skip> {
    pkt.class = class_of(pkt.family, pkt.proto);
    let need = match pkt.class {
        CLASS_TCP => 20,
        CLASS_UDP | CLASS_ICMP => 8,
        _ => return Ok(pkt),
    };
    let hdr: *const [u8; 20] = match pkt.class {
        // Only the first 8 bytes are read for UDP and ICMP; check those alone.
        CLASS_TCP => ptr_at(ctx, l4)?,
        _ => ptr_at::<[u8; 8]>(ctx, l4)?.cast(),
    };
    if l4 + need > end {
        return Err(Skip::Malformed);
    }
    if pkt.class == CLASS_TCP {
        let doff = usize::from(unsafe { (*hdr)[12] } >> 4) * 4;
        if doff < 20 || l4 + doff > end {
            return Err(Skip::Malformed);
        }
    }
    if pkt.class != CLASS_ICMP {
        let ports: *const [u8; 4] = hdr.cast();
        let p = unsafe { *ports };
        pkt.sport = u16::from_be_bytes([p[0], p[1]]);
        pkt.dport = u16::from_be_bytes([p[2], p[3]]);
    }
    pkt.has_l4 = true;
    Ok(pkt)
}

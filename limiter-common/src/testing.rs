//! Test-only layouts (the `testing` feature): what the test programs in limiter-ebpf's `bin/`
//! and the tests exchange through their maps. Nothing the limiter ships uses them.

/// The flood generator's settings (test and benchmark program `limiter_gen`): each run writes
/// `base + i` (i cycling through `count`) as 4 big-endian bytes at `src_offset` and fixes the
/// checksums at the given offsets (0: none).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GenConfig {
    pub base: u32,
    pub count: u32,
    pub src_offset: u32,
    pub ip_csum_offset: u32,
    pub l4_csum_offset: u32,
    pub _pad: u32,
}

/// The Internet checksum `hc` once the 4 bytes `old` it covers became `new` (RFC 1624 eqn. 3,
/// HC' = ~(~HC + ~m + m'), over the two 16-bit words that changed): how the flood generator
/// moves a frame to its next source, in the kernel program and in the packet-ring sender alike.
#[inline]
pub fn checksum_replacing(hc: u16, old: [u8; 4], new: [u8; 4]) -> u16 {
    let word = |b: [u8; 4], i: usize| u32::from(u16::from_be_bytes([b[i], b[i + 1]]));
    let mut sum = u32::from(!hc) + (!word(old, 0) & 0xffff) + (!word(old, 2) & 0xffff) + word(new, 0) + word(new, 2);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// What the parser made of one frame (test-only probe program).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParseProbe {
    /// One of `NOT_IP`, `MALFORMED`, `IP` (below).
    pub verdict: u32,
    pub family: u8,
    pub proto: u8,
    /// 1 when the L4 header was present and parsed (ports valid for TCP/UDP).
    pub has_l4: u8,
    /// 1 when the datagram carries a port the parser could not read (`Packet::ports_hidden`).
    pub ports_hidden: u8,
    pub sport: u16,
    pub dport: u16,
    /// 1 for a TCP segment with SYN set and ACK clear (`Packet::syn`).
    pub syn: u8,
    pub _pad2: [u8; 3],
    pub src: [u8; 16],
    /// Key words for the probe's fixed policy (id 1, /24 and /48, with dport).
    pub key: [u64; 3],
}

impl ParseProbe {
    pub const NOT_IP: u32 = 1;
    pub const MALFORMED: u32 = 2;
    pub const IP: u32 = 3;
    pub const POLICY_ID: u16 = 1;
    pub const V4_PREFIX: u8 = 24;
    pub const V6_PREFIX: u8 = 48;
}

const _: () = assert!(core::mem::size_of::<ParseProbe>() == 4 + 4 + 4 + 4 + 16 + 24, "ParseProbe has implicit padding");
const _: () = assert!(core::mem::size_of::<GenConfig>() == 6 * 4, "GenConfig has implicit padding");

#[cfg(feature = "user")]
mod pod {
    // SAFETY: both are repr(C), Copy, made only of integers, with explicit padding fields.
    unsafe impl aya::Pod for super::ParseProbe {}
    unsafe impl aya::Pod for super::GenConfig {}
}

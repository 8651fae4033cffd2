//! What the parser reads a frame through: XDP's `xdp_md` or tc's `__sk_buff`. The judgement is
//! the same at both hooks; only these three readings differ.

use aya_ebpf::{
    bindings::{__sk_buff, xdp_md},
    programs::{TcContext, XdpContext},
};

/// The parser's view of a frame: its readable bytes (`data..data_end`) and its whole length.
pub trait Frame {
    /// The first byte (the Ethernet header).
    fn data(&self) -> usize;
    /// The end of the bytes the program may read: headers must end before it.
    fn data_end(&self) -> usize;
    /// The frame's whole length: what byte policies charge, and what a datagram's stated length
    /// is checked against.
    fn len(&self) -> u64;

    /// Whether the frame reaches `end` bytes from its start: holds a datagram ending there.
    fn reaches(&self, end: usize) -> bool;

    /// The IPv6 extension-header walk (`parse::walk_v6`) through this hook's global function.
    fn walk_v6(&self, proto: u64, off: u64, end: u64) -> u64;
}

/// `parse::walk_v6` for XDP, a global function of the program (see there why).
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn limiter_walk_v6_xdp(ctx: *mut xdp_md, proto: u64, off: u64, end: u64) -> u64 {
    crate::parse::walk_v6(&XdpContext::new(ctx), proto, off, end)
}

/// `parse::walk_v6` for tc.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn limiter_walk_v6_tc(skb: *mut __sk_buff, proto: u64, off: u64, end: u64) -> u64 {
    crate::parse::walk_v6(&TcContext::new(skb), proto, off, end)
}

impl Frame for XdpContext {
    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }

    /// One linear buffer (the limiter does not load as multi-buffer XDP): all of it readable.
    #[inline(always)]
    fn len(&self) -> u64 {
        (XdpContext::data_end(self) - XdpContext::data(self)) as u64
    }

    /// A comparison of packet pointers, as the parser always made it.
    #[inline(always)]
    fn reaches(&self, end: usize) -> bool {
        XdpContext::data(self) + end <= XdpContext::data_end(self)
    }

    #[inline(always)]
    fn walk_v6(&self, proto: u64, off: u64, end: u64) -> u64 {
        limiter_walk_v6_xdp(self.ctx, proto, off, end)
    }
}

impl Frame for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }

    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }

    /// `skb->len`: the linear part and the pages, GSO aggregates whole.
    ///
    /// As the verifier sees it, XDP's length (a difference of packet pointers) is an unknown
    /// scalar, and `skb->len` a 32-bit one whose range it carried through every cost computed
    /// from it, into more states than the program may have (over 1M instructions, against
    /// 696k without the range). Adding the linear length (such a difference) and taking it
    /// away again hides that range; `black_box` keeps the compiler from folding the two.
    #[inline(always)]
    fn len(&self) -> u64 {
        let linear = || core::hint::black_box((TcContext::data_end(self) - TcContext::data(self)) as u64);
        u64::from(TcContext::len(self)).wrapping_add(linear()).wrapping_sub(linear())
    }

    #[inline(always)]
    fn reaches(&self, end: usize) -> bool {
        within(end as u64, u64::from(TcContext::len(self)))
    }

    #[inline(always)]
    fn walk_v6(&self, proto: u64, off: u64, end: u64) -> u64 {
        limiter_walk_v6_tc(self.skb.skb, proto, off, end)
    }
}

/// `end <= len`, in a function of its own (a BPF-to-BPF call): inlined, the comparison of two
/// scalars narrowed both in every state the verifier carried on (the datagram's end and the
/// skb's length), and the tc program went past its million instructions (measured: over 1M,
/// against 657k with the comparison hidden); called, only the result comes back.
#[inline(never)]
fn within(end: u64, len: u64) -> bool {
    end <= len
}

/// Headers an skb may hold outside its linear part are pulled into it, up to this many bytes:
/// Ethernet, two VLAN tags, IPv6 and a few extension headers, and TCP with options fit. A
/// header further in is read as XDP reads one past its frame: malformed, passed and counted.
pub const PULL_BYTES: u32 = 512;

/// Makes the first [`PULL_BYTES`] of the skb (or all of it, if shorter) readable in place. Only
/// an skb whose headers sit in its pages pays for it: drivers and the stack put at least the
/// headers in the linear part. Packet pointers taken before this are invalid after it; the
/// parser takes its own.
#[inline(always)]
pub fn pull_headers(ctx: &TcContext) {
    let len = TcContext::len(ctx);
    let want = if len < PULL_BYTES { len } else { PULL_BYTES };
    let linear = (TcContext::data_end(ctx) - TcContext::data(ctx)) as u32;
    if linear < want {
        // A failure (no memory) leaves the skb as it was: the parse then passes what it cannot
        // read, counted as malformed.
        let _ = ctx.pull_data(want);
    }
}

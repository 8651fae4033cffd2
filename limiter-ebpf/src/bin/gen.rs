//! The flood generator: run through BPF_PROG_TEST_RUN in live-frames mode (as xdp-trafficgen
//! does), each run rewrites the template frame's source address to the next of `count` sources
//! and transmits it (XDP_TX) out of the interface the run names. Test and benchmark use only.
//!
//! Live frames keep the program's edits between runs, so each run writes the whole 4-byte field
//! and updates the checksums from what is there (RFC 1624), never assuming the template.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::xdp_action::{XDP_ABORTED, XDP_TX},
    macros::{map, xdp},
    maps::{Array, PerCpuArray},
    programs::XdpContext,
};
use limiter_common::testing::{GenConfig, checksum_replacing};

#[map]
static GEN_CONFIG: Array<GenConfig> = Array::with_max_entries(1, 0);
/// The next source index, per CPU (each sending CPU walks the sources on its own).
#[map]
static GEN_NEXT: PerCpuArray<u32> = PerCpuArray::with_max_entries(1, 0);

/// Offsets are bounded so the verifier can follow them; templates are short.
const MAX_OFFSET: u32 = 128;

#[xdp]
pub fn limiter_gen(ctx: XdpContext) -> u32 {
    match generate(&ctx) {
        Some(()) => XDP_TX,
        None => XDP_ABORTED,
    }
}

#[inline(always)]
fn generate(ctx: &XdpContext) -> Option<()> {
    let cfg = GEN_CONFIG.get(0)?;
    let next = GEN_NEXT.get_ptr_mut(0)?;
    let index = unsafe { *next };
    let following = index + 1;
    unsafe { *next = if following >= cfg.count { 0 } else { following } };
    let new = (cfg.base.wrapping_add(index)).to_be_bytes();
    let old = replace(ctx, cfg.src_offset, new)?;
    for offset in [cfg.ip_csum_offset, cfg.l4_csum_offset] {
        if offset != 0 {
            fix_checksum(ctx, offset, old, new)?;
        }
    }
    Some(())
}

#[inline(always)]
fn field<const N: usize>(ctx: &XdpContext, offset: u32) -> Option<*mut [u8; N]> {
    if offset > MAX_OFFSET {
        return None;
    }
    let start = ctx.data() + offset as usize;
    if start + N > ctx.data_end() {
        return None;
    }
    Some(start as *mut [u8; N])
}

/// Writes `new` at `offset`, returning what was there.
#[inline(always)]
fn replace(ctx: &XdpContext, offset: u32, new: [u8; 4]) -> Option<[u8; 4]> {
    let p = field::<4>(ctx, offset)?;
    let old = unsafe { *p };
    unsafe { *p = new };
    Some(old)
}

/// Updates the checksum at `offset` for the source's change (RFC 1624).
#[inline(always)]
fn fix_checksum(ctx: &XdpContext, offset: u32, old: [u8; 4], new: [u8; 4]) -> Option<()> {
    let p = field::<2>(ctx, offset)?;
    let hc = u16::from_be_bytes(unsafe { *p });
    unsafe { *p = checksum_replacing(hc, old, new).to_be_bytes() };
    Some(())
}

limiter_ebpf::program_object!();

//! Benchmark baselines, measured beside the limiter in the same run:
//! - `bench_pass`: returns XDP_PASS, the cost of running any program at all;
//! - `bench_floor`: parse + one clock read + one per-CPU array access, the least a GCRA
//!   limiter can do per packet.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::xdp_action::XDP_PASS,
    helpers::bpf_ktime_get_ns,
    macros::{map, xdp},
    maps::PerCpuArray,
    programs::XdpContext,
};
use limiter_ebpf::parse::parse;

/// Resized at load to the bucket count under test (a power of two).
#[map]
static FLOOR_STATE: PerCpuArray<u64> = PerCpuArray::with_max_entries(1 << 20, 0);

#[unsafe(no_mangle)]
static FLOOR_MASK: u32 = (1 << 20) - 1;

#[xdp]
pub fn bench_pass(_ctx: XdpContext) -> u32 {
    XDP_PASS
}

#[xdp]
pub fn bench_floor(ctx: XdpContext) -> u32 {
    let Ok(pkt) = parse(&ctx) else {
        return XDP_PASS;
    };
    let mask = unsafe { core::ptr::read_volatile(&FLOOR_MASK) };
    let index = (pkt.src[0] ^ pkt.src[1]) as u32 & mask;
    if let Some(slot) = FLOOR_STATE.get_ptr_mut(index) {
        unsafe { *slot = bpf_ktime_get_ns() };
    }
    XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

//! Benchmark baselines, measured beside the limiter in the same run:
//! - `bench_pass`: returns XDP_PASS, the cost of running any program at all;
//! - `bench_drop`: counts and drops every frame: the baseline a flood costs at XDP, which the
//!   peers benchmark subtracts to show each system's own cost;
//! - `bench_floor`: parse + one clock read + one read-modify-write of a per-CPU array slot at a
//!   spread-out index: the least a GCRA limiter can do per packet.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    helpers::bpf_ktime_get_ns,
    macros::{map, xdp},
    maps::PerCpuArray,
    programs::XdpContext,
};
use limiter_ebpf::parse::{Packet, parse};

/// Resized at load to the bucket count under test (a power of two).
#[map]
static FLOOR_STATE: PerCpuArray<u64> = PerCpuArray::with_max_entries(1 << 20, 0);

#[unsafe(no_mangle)]
static FLOOR_MASK: u32 = (1 << 20) - 1;

/// Frames `bench_drop` saw, per CPU.
#[map]
static DROPPED: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

#[xdp]
pub fn bench_pass(_ctx: XdpContext) -> u32 {
    XDP_PASS
}

#[xdp]
pub fn bench_drop(_ctx: XdpContext) -> u32 {
    if let Some(n) = DROPPED.get_ptr_mut(0) {
        unsafe { *n += 1 };
    }
    XDP_DROP
}

#[xdp]
pub fn bench_floor(ctx: XdpContext) -> u32 {
    let mut pkt = Packet::EMPTY;
    if parse(&ctx, &mut pkt).is_err() {
        return XDP_PASS;
    }
    let mask = unsafe { core::ptr::read_volatile(&FLOOR_MASK) };
    // One multiply spreads sources over the buckets as any hash must (Fibonacci hashing);
    // without it neighbouring addresses would share cache lines and flatter the floor.
    let index = ((pkt.src[0] ^ pkt.src[1]).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32 & mask;
    // Read-modify-write, as any limiter must read its bucket's state before deciding.
    if let Some(slot) = FLOOR_STATE.get_ptr_mut(index) {
        let now = unsafe { bpf_ktime_get_ns() };
        unsafe { *slot = (*slot).max(now) + 1 };
    }
    XDP_PASS
}

limiter_ebpf::program_object!();

//! The limiter: per-source GCRA in XDP, as it ships. Refusal is XDP_DROP; anything the limiter
//! cannot judge, and any fault of its own, passes and is counted. Its maps and steps are in
//! `program/` (parse → policy → key → decide → act); here every shortcut of the key memo is on.
//!
//! The same judgement runs at tc ingress (tcx) for an interface whose XDP hook another program
//! holds: `limiter_tcx` and `limiter_lay_tcx`, the same code over `__sk_buff`. While a move
//! between the hooks has both hold it, what `limiter` judged bears a mark `limiter_tcx` lets by.
//!
//! Each body is `#[inline(always)]` into the section function the macro wraps it in: left to
//! LLVM, a body this large stays a call of its own, and every call's return costs several
//! nanoseconds on a CPU with return-thunk mitigations (8 ns of an admission here).
#![no_std]
#![no_main]

mod program;

use aya_ebpf::{
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use limiter_ebpf::memo::AllOn;

#[xdp]
#[inline(always)]
pub fn limiter(ctx: XdpContext) -> u32 {
    breakdown!();
    program::mark_in_handover(&ctx);
    program::limiter::<AllOn, _>(&ctx)
}

/// The layered judgement (`program::layers`), reached from `limiter` by tail call.
#[xdp]
#[inline(always)]
pub fn limiter_layers(ctx: XdpContext) -> u32 {
    breakdown!();
    program::limiter_layers(&ctx)
}

/// `limiter` at tc ingress: TC_ACT_SHOT for a refusal, TC_ACT_UNSPEC (the next program) else.
#[classifier]
#[inline(always)]
pub fn limiter_tcx(ctx: TcContext) -> i32 {
    breakdown!();
    program::limiter_tcx::<AllOn>(&ctx)
}

/// `limiter_layers` at tc ingress, reached from `limiter_tcx` by tail call.
#[classifier]
#[inline(always)]
pub fn limiter_lay_tcx(ctx: TcContext) -> i32 {
    breakdown!();
    program::tc_action(program::limiter_layers(&ctx))
}

limiter_ebpf::kernel_probes!();

/// With the `breakdown` feature, a call the verifier cannot rule out to a function whose frame
/// takes the chain past its 512 bytes (see Cargo.toml).
macro_rules! breakdown {
    () => {
        #[cfg(feature = "breakdown")]
        if unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() } == 1 {
            return breakdown_pad() as _;
        }
    };
}
use breakdown;

#[cfg(feature = "breakdown")]
#[inline(never)]
#[unsafe(no_mangle)]
extern "C" fn breakdown_pad() -> u32 {
    let mut pad = [0u64; 60];
    for (i, p) in pad.iter_mut().enumerate() {
        unsafe { core::ptr::write_volatile(p, i as u64) };
    }
    unsafe { core::ptr::read_volatile(&pad[7]) as u32 }
}

limiter_ebpf::program_object!();

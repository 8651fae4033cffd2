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
    program::mark_in_handover(&ctx);
    program::limiter::<AllOn, _>(&ctx)
}

/// The layered judgement (`program::layers`), reached from `limiter` by tail call.
#[xdp]
#[inline(always)]
pub fn limiter_layers(ctx: XdpContext) -> u32 {
    program::limiter_layers(&ctx)
}

/// `limiter` at tc ingress: TC_ACT_SHOT for a refusal, TC_ACT_UNSPEC (the next program) else.
#[classifier]
#[inline(always)]
pub fn limiter_tcx(ctx: TcContext) -> i32 {
    program::limiter_tcx::<AllOn>(&ctx)
}

/// `limiter_layers` at tc ingress, reached from `limiter_tcx` by tail call.
#[classifier]
#[inline(always)]
pub fn limiter_lay_tcx(ctx: TcContext) -> i32 {
    program::tc_action(program::limiter_layers(&ctx))
}

limiter_ebpf::program_object!();

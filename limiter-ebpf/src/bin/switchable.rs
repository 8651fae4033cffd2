//! Test-only: the limiter program (`program/`, compiled again here) with the key memo's
//! shortcuts read from globals the loader sets, so the benchmark can measure each against its
//! absence in one run and tests can time refusals on the precise clock. Same program and map
//! names as the shipped object, which has the shortcuts compiled in (`main.rs`).
#![no_std]
#![no_main]

#[path = "../program/mod.rs"]
mod program;

use aya_ebpf::{
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};
use limiter_ebpf::memo::Shortcuts;

/// 0 turns the key memo off (and with it the tick refusal): every packet hashes its key.
/// Read-only data, so the verifier drops the untaken branch.
#[unsafe(no_mangle)]
static USE_KEY_MEMO: u8 = 1;

/// 0 turns the tick refusal off (`limiter_common::tick`): a standing refusal is checked on the
/// precise clock on every packet.
#[unsafe(no_mangle)]
static USE_TICK_REFUSAL: u8 = 1;

/// The shortcuts as the loader set them.
struct AtLoad;

impl Shortcuts for AtLoad {
    #[inline(always)]
    fn key_memo() -> bool {
        unsafe { core::ptr::read_volatile(&USE_KEY_MEMO) != 0 }
    }

    #[inline(always)]
    fn tick_refusal() -> bool {
        unsafe { core::ptr::read_volatile(&USE_TICK_REFUSAL) != 0 }
    }
}

#[xdp]
#[inline(always)]
pub fn limiter(ctx: XdpContext) -> u32 {
    program::mark_in_handover(&ctx);
    program::limiter::<AtLoad, _>(&ctx)
}

/// The layered judgement (`program::layers`), reached from `limiter` by tail call.
#[xdp]
#[inline(always)]
pub fn limiter_layers(ctx: XdpContext) -> u32 {
    program::limiter_layers(&ctx)
}

/// `limiter` at tc ingress (tcx).
#[classifier]
#[inline(always)]
pub fn limiter_tcx(ctx: TcContext) -> i32 {
    program::limiter_tcx::<AtLoad>(&ctx)
}

/// `limiter_layers` at tc ingress, reached from `limiter_tcx` by tail call.
#[classifier]
#[inline(always)]
pub fn limiter_lay_tcx(ctx: TcContext) -> i32 {
    program::tc_action(program::limiter_layers(&ctx))
}

limiter_ebpf::kernel_probes!();
limiter_ebpf::program_object!();

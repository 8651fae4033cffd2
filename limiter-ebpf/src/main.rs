//! The limiter: per-source GCRA in XDP, as it ships. Refusal is XDP_DROP; anything the limiter
//! cannot judge, and any fault of its own, passes and is counted. Its maps and steps are in
//! `program/` (parse → policy → key → decide → act); here every shortcut of the key memo is on.
#![no_std]
#![no_main]

mod program;

use aya_ebpf::{macros::xdp, programs::XdpContext};
use limiter_ebpf::memo::AllOn;

#[xdp]
pub fn limiter(ctx: XdpContext) -> u32 {
    program::limiter::<AllOn>(&ctx)
}

/// The layered judgement (`program::layers`), reached from `limiter` by tail call.
#[xdp]
pub fn limiter_layers(ctx: XdpContext) -> u32 {
    program::limiter_layers(&ctx)
}

limiter_ebpf::program_object!();

//! The kernel side of the limiter, split the way a packet flows: [`parse`] the headers, build
//! the [`key`] (its hash and standing refusal from this CPU's [`memo`]), [`decide`] against the
//! bucket (a per-CPU one, or a shared one: [`scope`]).
//!
//! The programs and their maps live in the binaries: `main.rs`, the limiter, whose maps and steps
//! are in `program/` (not part of this library: each object that holds the limiter compiles it,
//! with its own maps); and the test programs in `bin/` (limiter-ebpf's `testing` feature):
//! `probe.rs`, `bench.rs`, `gen.rs`, and `switchable.rs`, the limiter with its memo's shortcuts
//! set at load.
#![no_std]
// The compare-and-exchange intrinsic (`scope::compare_exchange`): nightly, as the BPF build is.
#![cfg_attr(target_arch = "bpf", allow(internal_features), feature(core_intrinsics))]

pub mod decide;
pub mod frame;
pub mod key;
pub mod memo;
pub mod parse;
pub mod scope;

/// What every BPF object here needs besides its programs: the license the kernel checks before
/// allowing GPL-only helpers, and a panic handler (never reached: code that could panic does not
/// pass the verifier).
#[macro_export]
macro_rules! program_object {
    () => {
        #[cfg(not(test))]
        #[panic_handler]
        fn panic(_info: &core::panic::PanicInfo) -> ! {
            loop {}
        }

        #[unsafe(link_section = "license")]
        #[unsafe(no_mangle)]
        static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
    };
}

/// The kernel probe `limiter_common::maps::PROBE_CAS` the daemon loads before the limiter (one
/// compare-and-exchange on the stack: a kernel without BPF atomics, before 5.12, refuses it in
/// one line), in every object the daemon's loader opens: the shipped one and the test build.
/// Loaded, never attached.
#[macro_export]
macro_rules! kernel_probes {
    () => {
        #[aya_ebpf::macros::xdp]
        pub fn limiter_cas(_ctx: aya_ebpf::programs::XdpContext) -> u32 {
            let mut word = 0u64;
            // Through `black_box`, so the compiler keeps the exchange on a slot it cannot see through.
            let slot = core::hint::black_box(&raw mut word);
            // SAFETY: a stack slot of 8 aligned bytes, alive for the call.
            let _ = unsafe { $crate::scope::compare_exchange(slot, 0, 1) };
            aya_ebpf::bindings::xdp_action::XDP_PASS
        }
    };
}

//! The kernel side of the limiter, split the way a packet flows: [`parse`] the headers,
//! build the [`key`], [`decide`] against the bucket (a per-CPU one, or a shared one: [`scope`]). The programs themselves (and their maps)
//! live in the binaries: `main.rs` (the limiter), `bin/probe.rs` and `bin/bench.rs` (tests).
#![no_std]
// The compare-and-exchange intrinsic (`scope::compare_exchange`): nightly, as the BPF build is.
#![cfg_attr(target_arch = "bpf", allow(internal_features), feature(core_intrinsics))]

pub mod decide;
pub mod key;
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

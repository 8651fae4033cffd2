//! Shared by the kernel side (`limiter-ebpf`, built for bpfel-unknown-none) and userspace.
//!
//! Everything here is `no_std`, allocation-free and free of division on the per-packet path,
//! so the very same code is compiled into the XDP program and exercised by userspace tests.
#![no_std]

pub mod gcra;
pub mod key;
pub mod limits;
pub mod maps;
pub mod rows;
pub mod sample;
pub mod siphash;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tick;

pub use gcra::Gcra;
pub use key::FlowKey;
pub use siphash::{SipInit, SipKey};

//! The kernel side of the limiter, split the way a packet flows: [`parse`] the headers,
//! build the [`key`], [`decide`] against the bucket. The programs themselves (and their maps)
//! live in the binaries: `main.rs` (the limiter), `bin/probe.rs` and `bin/bench.rs` (tests).
#![no_std]

pub mod decide;
pub mod key;
pub mod parse;

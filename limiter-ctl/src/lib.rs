//! limiter-ctl: loads and drives the limiter's XDP program; the daemon and its CLI.
//!
//! Four rooms, their dependencies running one way (cli -> daemon -> kernel, config beside):
//!
//! - [`kernel`]: the handle on the XDP program and its maps ([`Limiter`]): load, adopt, pin,
//!   attach, rotate the salt, read and write the maps.
//! - `daemon`: the serve loop, the control socket's server side and wire types, stats,
//!   metrics, top.
//! - [`cli`]: the arguments, the human and JSON output, the control socket's client side.
//! - [`config`]: the policy model, rates, the validated state, the TOML file.
//!
//! The library exports what an embedder or the tests need: the kernel handle and the policy
//! types. The tests' extras (the probe, benchmark and generator objects, test runs, raw map
//! access) are behind the `testing` feature.

mod api;
pub mod cli;
pub mod config;
mod daemon;
pub mod kernel;

pub use kernel::{AttachMode, Limiter, ModeRequest};

/// Test-only: the BPF objects the tests and benchmarks load beside the limiter's own.
#[cfg(feature = "testing")]
pub mod objects {
    pub use crate::kernel::{BENCH, GEN, PROBE};
}

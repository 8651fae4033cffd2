//! limiter-ctl: loads and drives the limiter's XDP program; the daemon and its CLI.
//!
//! Seven rooms, their dependencies running one way (cli -> bouncer, client, api; bouncer ->
//! client, api, config; client -> api; daemon -> api, kernel, config; kernel -> config; api ->
//! config):
//!
//! - [`kernel`]: the handle on the XDP program and its maps ([`Limiter`]): load, adopt, pin,
//!   attach, rotate the salt, read and write the maps, the refusal stream, the bucket scan.
//! - `daemon`: the serve loop, the control socket's server side, stats, metrics, top.
//! - `api`: what the CLI and the daemon share: the control socket's requests and replies, and
//!   the daemon's start options.
//! - `cli`: the arguments, the human and JSON output.
//! - `client`: the control socket's client side (the CLI's and the bouncer's).
//! - `bouncer`: `limiter-ctl crowdsec`, the CrowdSec bouncer, a long-running client of the daemon.
//! - [`config`]: the policy model, rates, the validated state, the TOML file.
//!
//! [`main`] parses the command line in the CLI room and runs `limiter-ctl daemon` in the daemon
//! room: the CLI speaks to a daemon over the socket only.
//!
//! The library exports what an embedder or the tests need: the kernel handle and the policy
//! types. The tests' extras (the probe, benchmark and generator objects, test runs, raw map
//! access) are behind the `testing` feature.

mod api;
mod bouncer;
mod cli;
mod client;
pub mod config;
mod daemon;
pub mod kernel;
mod test_hook;

use std::process::ExitCode;

pub use kernel::{AttachMode, Hook, HookRequest, Limiter, ModeRequest, Placement, ProgRef, TcApiRequest, TcxPlace};

/// Test-only: the BPF objects the tests and benchmarks load (the limiter's own among them, for
/// `limiter-verify`).
#[cfg(feature = "testing")]
pub mod objects {
    pub use crate::kernel::{BENCH, GEN, LIMITER, PROBE};
}

/// `limiter-ctl`: the command its arguments name. The CLI runs its own commands; the daemon's it
/// hands back, to be run here in the daemon room and reported by the CLI.
pub fn main() -> ExitCode {
    match cli::main() {
        cli::Run::Done(code) => code,
        cli::Run::Daemon { options, socket } => match daemon::main(*options, &socket) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => cli::report_failure(&e, e.exit_code()),
        },
    }
}

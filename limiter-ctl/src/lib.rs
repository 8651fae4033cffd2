//! limiter-ctl: the daemon that loads and drives the limiter's XDP program, and its CLI.
//!
//! The library half is what the integration tests and benchmarks drive too, so they exercise
//! the same loading, configuration and counter-reading code the daemon runs.

pub mod cli;
pub mod config;
pub mod daemon;
pub mod error;
pub mod ipc;
pub mod limiter;
pub mod metrics;
pub mod objects;
pub mod pins;
pub mod policy;
pub mod rate;
pub mod salt;
pub mod show;
pub mod state;
pub mod stats;
pub mod sync;
pub mod top;

pub use error::Error;
pub use limiter::{AttachMode, Limiter, ModeRequest};

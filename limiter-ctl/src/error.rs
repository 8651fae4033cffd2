//! What can go wrong between userspace and the kernel, each saying what to do about it.

use std::io;

use aya::{EbpfError, maps::MapError, programs::ProgramError};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("loading the XDP program failed: {0} (run as root, or with CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON)")]
    Load(#[source] EbpfError),
    #[error("the kernel rejected the XDP program: {0}")]
    Verify(#[source] ProgramError),
    #[error("the BPF object has no {kind} named '{name}': the build is inconsistent, rebuild limiter-ctl")]
    Missing { kind: &'static str, name: String },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("interface '{0}' does not exist (see `ip link`)")]
    NoSuchInterface(String),
    #[error("attaching to {iface} in {mode} mode failed: {source}")]
    Attach {
        iface: String,
        mode: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error("detaching from {iface} failed: {source}")]
    Detach {
        iface: String,
        #[source]
        source: ProgramError,
    },
    #[error("the OS random number generator failed: {0}")]
    Salt(String),
    #[error("bucket count {0} is not a power of two between {min} and {max}", min = limiter_common::maps::MIN_BUCKETS, max = limiter_common::maps::MAX_BUCKETS)]
    Buckets(u32),
    #[error("test run failed: {0}")]
    TestRun(#[source] ProgramError),
    #[error(
        "cannot adopt the limiter pinned at {dir}: {why}; `limiter-ctl detach` removes it (and its state) so a new one can start"
    )]
    Adopt { dir: std::path::PathBuf, why: String },
    #[error("{0}")]
    Pins(String),
    #[error("a salt rotation is in progress: its grace period ends in {seconds_left} s; try again then")]
    RotationBusy { seconds_left: u64 },
    #[error("internal error: {0}")]
    Internal(String),
    #[error(transparent)]
    Io(#[from] io::Error),
}

/// Bad input from the operator: reported in one line with exit code 2, nothing changed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

//! How the daemon is started: `limiter-ctl daemon`'s flags, parsed by the CLI and run by the
//! daemon (`lib.rs` hands one to the other).

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use crate::{
    config::Rate,
    kernel::{GeometryRequest, Placement},
};

/// What `limiter-ctl daemon` was asked to do (its flags, parsed).
// Fields paired by what they configure (rustfmt would put each on a line of its own).
#[rustfmt::skip]
#[derive(Debug)]
pub(crate) struct Options {
    /// The interface to protect, how long to wait for it to appear, and how to attach to it (the
    /// hook, XDP's mode, the place at tcx).
    pub iface: String, pub wait_iface: Duration, pub placement: Placement,
    /// The policies and lists; loaded at start, re-read on SIGHUP, edited in place on every change.
    pub config: PathBuf,
    /// Watch the config file's directory and apply a changed file as SIGHUP does.
    pub watch_config: bool,
    /// Install (or replace) the policy "default", matching all traffic, at this rate and burst.
    pub rate: Option<Rate>, pub burst: Option<u64>,
    /// The bucket arrays asked for (`auto` resolved at start against the host), and where the
    /// maps and link are pinned.
    pub geometry: GeometryRequest, pub pin_dir: PathBuf,
    /// Where runtime state is kept: the expiring entries (bans), one file per interface.
    pub state_dir: PathBuf,
    /// The group whose processes may feed bans through the control socket (`--socket-group`).
    pub socket_group: Option<u32>,
    /// Log rates at this interval; draw a new salt this often (None: only on `salt rotate`).
    pub stats_every: Option<Duration>, pub rotate_every: Option<Duration>,
    /// The Prometheus endpoint; 1 in N refusals sampled for `top`, at most so many samples a
    /// second for the host (0: no cap).
    pub metrics: MetricsAt, pub sample_refusals: u32, pub samples_per_s: u32,
}

/// Where the Prometheus endpoint listens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MetricsAt {
    Off,
    At(SocketAddr),
    /// 127.0.0.1 on a port derived from the interface's name (`daemon::auto_metrics_port`):
    /// one daemon per interface, each on a port of its own without a flag per instance (the
    /// template unit uses it).
    Auto,
}

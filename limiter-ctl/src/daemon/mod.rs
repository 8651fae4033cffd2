//! The daemon room: `limiter-ctl daemon`. Validate the config, load the program, make its maps
//! say what the config says, attach, then serve the control socket until SIGINT or SIGTERM,
//! re-reading the config on SIGHUP (`serve`). Beside the loop: the wire types of the control
//! socket, shared with the CLI (`ipc`), the counters sampled once a second (`stats`), the
//! Prometheus endpoint (`metrics`) and the most-refused sources (`top`).
//!
//! Every change is validated whole before anything moves; then the kernel's maps are updated,
//! then the config file is written (atomically). If the write fails the maps are put back.
//! One log line per state change. The salt is drawn here and written to the kernel map only.
//!
//! It may use the kernel and config rooms, nothing of the CLI. Its one error type is [`Error`].

mod error;
pub(crate) mod ipc;
mod metrics;
mod serve;
pub(crate) mod stats;
pub(crate) mod top;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::io::unix::AsyncFd;
use tracing::{info, warn};

pub use error::{Error, Rollback};
use serve::{Daemon, Exit, bind};

use crate::{
    config::{self, Name, PolicyDef, Rate, State},
    kernel::{self, Limiter, MapView, ModeRequest, pins::PinDir},
};

/// What `limiter-ctl daemon` was asked to do (its flags, parsed).
// Fields paired by what they configure (rustfmt would put each on a line of its own).
#[rustfmt::skip]
#[derive(Debug)]
pub(crate) struct Options {
    /// The interface to protect, and how to attach to it.
    pub iface: String, pub mode: ModeRequest,
    /// The policies and lists; loaded at start, re-read on SIGHUP, rewritten on every change.
    pub config: PathBuf,
    /// Install (or replace) the policy "default", matching all traffic, at this rate and burst.
    pub rate: Option<Rate>, pub burst: Option<u64>,
    /// Buckets per generation and CPU, and where the maps and link are pinned.
    pub buckets: u32, pub pin_dir: PathBuf,
    /// Log rates at this interval; draw a new salt this often (None: only on `salt rotate`).
    pub stats_every: Option<Duration>, pub rotate_every: Option<Duration>,
    /// The Prometheus endpoint; 1 in N refusals sampled for `top`.
    pub metrics: Option<SocketAddr>, pub sample_refusals: u32,
}

/// The policy the daemon's `--rate` installs (matching everything).
const DEFAULT_POLICY: &str = "default";

pub(crate) async fn run(args: Options, socket: &Path) -> Result<(), Error> {
    // Everything the operator gave is checked before anything is loaded or bound.
    let file = config::load(&args.config).map_err(Error::File)?;
    let default_policy = args.rate.map(|rate| PolicyDef {
        name: Name::from_static(DEFAULT_POLICY),
        matches: Default::default(),
        rate,
        burst: args.burst,
        key: Default::default(),
        unit: Default::default(),
        mode: Default::default(),
    });
    // Byte policies must hold the largest frame the interface can carry.
    let max_frame = kernel::interface_mtu(&args.iface).map_or(config::DEFAULT_MAX_FRAME, config::max_frame_for_mtu);
    let desired = |ids: &BTreeMap<Name, u16>| -> Result<State, Error> {
        let state = State::build_for(&file, ids, max_frame)
            .map_err(|error| Error::Config { path: args.config.clone(), error })?;
        match &default_policy {
            Some(def) => state.with_policy(def.clone()).map_err(Error::DefaultPolicy),
            None => Ok(state),
        }
    };
    desired(&BTreeMap::new())?;
    if !kernel::interface_exists(&args.iface) {
        return Err(Error::NoSuchInterface(args.iface.clone()));
    }
    let listener = bind(socket)?;
    let shared = stats::Shared::default();
    if let Some(addr) = args.metrics {
        metrics::serve(addr, shared.clone()).await?;
        info!(address = %addr, "serving metrics at /metrics");
    }

    let pins = PinDir::new(&args.pin_dir, &args.iface);
    if let Some(note) = pins.prepare()? {
        info!(note, "bpffs");
    }
    let mut limiter = Limiter::open(args.buckets, Some(pins.clone()))?;
    // What the maps hold now: a pinned predecessor's state, or nothing.
    let before = if limiter.adopted() {
        limiter.read_view()?
    } else {
        limiter.set_salt(kernel::draw_salt()?)?;
        MapView::of(&State::default())
    };
    let state = desired(&before.ids())?;
    // An adopted limiter's buckets may hold TATs of its policies, which this daemon never saw.
    let longest_window = before.max_window().max(state.max_window());
    limiter.apply(&before, &MapView::of(&state))?;
    limiter.set_sampling(args.sample_refusals)?;
    // SAFETY: the ring owns its descriptor and keeps it open for as long as the AsyncFd lives.
    let refusals =
        unsafe { AsyncFd::register(limiter.take_refusals()?) }.map_err(|e| Error::RefusalRing(e.into_parts().1))?;
    // From here on a failure must not leave the program attached (only a crash does that).
    let attached = limiter.attach(&args.iface, args.mode)?;
    if let Some(reason) = &attached.fallback {
        warn!(iface = %args.iface, %reason, "native XDP unavailable, fell back to skb mode (slower: packets get an skb first)");
    }
    info!(
        iface = %args.iface,
        mode = %attached.mode,
        policies = state.policies().count(),
        buckets = args.buckets,
        config = %args.config.display(),
        socket = %socket.display(),
        pins = %pins.dir().display(),
        "{}",
        if attached.replaced { "adopted the pinned limiter: program replaced in place, buckets, counters and salt kept" } else { "attached" }
    );
    let mut daemon = Daemon::new(limiter, state, &args, shared, longest_window);
    let result = match daemon.start_up(&file) {
        Ok(()) => daemon.serve(listener, refusals, &args).await,
        Err(e) => Err(e),
    };
    let hand_over = matches!(result, Ok(Exit::HandOver));
    if let Err(e) = std::fs::remove_file(socket) {
        warn!(socket = %socket.display(), error = %e, "could not remove the control socket");
    }
    if hand_over {
        // Fail static on purpose: the next daemon adopts the program, its state and its salt.
        info!(iface = %args.iface, pins = %pins.dir().display(), "handing over: left attached and pinned for the next daemon");
    } else if let Some(iface) = daemon.detach()? {
        info!(iface = %iface, "detached");
    }
    result.map(|_| ())
}

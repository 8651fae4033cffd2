//! `limiter-ctl daemon`: validate the config, load the program, make its maps say what the
//! config says, attach, then serve the control socket until SIGINT or SIGTERM, re-reading the
//! config on SIGHUP.
//!
//! Every change is validated whole before anything moves; then the kernel's maps are updated,
//! then the config file is written (atomically). If the write fails the maps are put back.
//! One log line per state change. The salt is drawn here and written to the kernel map only.

use std::{
    collections::BTreeMap,
    io,
    os::unix::fs::{FileTypeExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::maps::{MapData, RingBuf};
use limiter_common::maps::{Counters, RefusalSample};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader, unix::AsyncFd},
    net::{UnixListener, UnixStream},
    signal::unix::{SignalKind, signal},
};
use tracing::{info, warn};

use crate::{
    Limiter,
    cli::DaemonArgs,
    config::{self, ConfigFile, PolicyDef},
    error::Usage,
    ipc::{MAX_REQUEST, PolicyStatus, Request, Response},
    metrics,
    pins::PinDir,
    policy::Name,
    salt,
    state::{self, Entry, State},
    stats,
    sync::MapView,
    top::Top,
};

/// The policy the daemon's `--rate` installs (matching everything).
pub const DEFAULT_POLICY: &str = "default";

pub async fn run(args: DaemonArgs, socket: &Path) -> anyhow::Result<()> {
    // Everything the operator gave is checked before anything is loaded or bound.
    let file = config::load(&args.config).map_err(|e| Usage(e.to_string()))?;
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
    let max_frame =
        crate::limiter::interface_mtu(&args.iface).map_or(state::DEFAULT_MAX_FRAME, state::max_frame_for_mtu);
    let desired = |ids: &BTreeMap<Name, u16>| -> Result<State, Usage> {
        let state = State::build_for(&file, ids, max_frame)
            .map_err(|e| Usage(format!("{}: {}", args.config.display(), e.0)))?;
        match &default_policy {
            Some(def) => state.with_policy(def.clone()).map_err(|e| Usage(format!("--rate/--burst: {}", e.0))),
            None => Ok(state),
        }
    };
    desired(&BTreeMap::new())?;
    if !crate::limiter::interface_exists(&args.iface) {
        return Err(Usage(format!("interface '{}' does not exist (see `ip link`)", args.iface)).into());
    }
    let listener = bind(socket)?;
    let shared = stats::Shared::default();
    if let Some(addr) = args.metrics.0 {
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
        limiter.set_salt(salt::draw()?)?;
        MapView::of(&State::default())?
    };
    let state = desired(&before.ids())?;
    // An adopted limiter's buckets may hold TATs of its policies, which this daemon never saw.
    let longest_window = before.max_window().max(state.max_window());
    limiter.apply(&before, &MapView::of(&state)?)?;
    limiter.set_sampling(args.sample_refusals)?;
    // SAFETY: the ring owns its descriptor and keeps it open for as long as the AsyncFd lives.
    let refusals = unsafe { AsyncFd::register(limiter.take_refusals()?) }
        .map_err(|e| anyhow::anyhow!("watching the refusal ring: {}", e.into_parts().1))?;
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
    let mut daemon = Daemon {
        limiter,
        state,
        config_path: args.config.clone(),
        iface: args.iface.clone(),
        mode: args.mode,
        shared,
        sampler: stats::Sampler::default(),
        occupancy: Arc::default(),
        scanning: Arc::default(),
        top: Top::new(args.sample_refusals.max(1)),
        longest_window,
    };
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
        info!(iface = %daemon.iface, pins = %pins.dir().display(), "handing over: left attached and pinned for the next daemon");
    } else if let Some(iface) = daemon.limiter.detach()? {
        info!(iface = %iface, "detached");
    }
    result.map(|_| ())
}

/// How the daemon leaves.
enum Exit {
    /// SIGINT, SIGTERM: detach and remove the pins.
    Detach,
    /// SIGUSR2: leave the program attached and pinned, for a new daemon to adopt (upgrades).
    HandOver,
}

/// Binds the control socket, refusing to take it from a running daemon.
fn bind(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        anyhow::bail!("another daemon is already listening on {}; stop it or pass --socket", path.display());
    }
    match std::fs::symlink_metadata(path) {
        // Left by a daemon that died: nothing answers on it.
        Ok(meta) if meta.file_type().is_socket() => {
            std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?
        }
        Ok(_) => anyhow::bail!("{} exists and is not a socket; remove it or pass --socket", path.display()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("checking {}", path.display())),
    }
    // Created 0755 at worst (no one else may write to it, so no one else may connect), then 0600.
    let listener = UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("restricting {} to root", path.display()))?;
    Ok(listener)
}

struct Daemon {
    limiter: Limiter,
    state: State,
    config_path: PathBuf,
    iface: String,
    mode: crate::limiter::ModeRequest,
    /// The latest snapshot, read by `stats` and the metrics endpoint.
    shared: stats::Shared,
    sampler: stats::Sampler,
    /// The last bucket occupancy measured (off the loop).
    occupancy: Arc<Mutex<Option<f64>>>,
    /// A scan is running: the next tick skips rather than start another beside it.
    scanning: Arc<AtomicBool>,
    top: Top,
    /// The longest burst window any policy had since the last rotation: the next rotation's
    /// grace must cover it (see `Limiter::rotate_salt`).
    longest_window: Duration,
}

/// How often the buckets are scanned for the occupancy gauge (it reads them all).
const OCCUPANCY_EVERY: Duration = Duration::from_secs(15);

/// Beyond the longest burst window, the old buckets are consulted this much longer.
const GRACE_MARGIN: Duration = Duration::from_millis(50);

impl Daemon {
    async fn serve(
        &mut self,
        listener: UnixListener,
        mut refusals: AsyncFd<RingBuf<MapData>>,
        args: &DaemonArgs,
    ) -> anyhow::Result<Exit> {
        let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut sighup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
        let mut sigusr2 = signal(SignalKind::user_defined2()).context("installing the SIGUSR2 handler")?;
        let mut stats = args.stats_every.map(tokio::time::interval);
        let mut last = (Instant::now(), self.total()?);
        let mut rotation =
            args.rotate_every.0.map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every));
        let mut second = tokio::time::interval(Duration::from_secs(1));
        let mut occupancy = tokio::time::interval(OCCUPANCY_EVERY);
        let mut if_index = crate::limiter::if_index(&self.iface);
        let (signal_name, exit) = loop {
            tokio::select! {
                _ = sigint.recv() => break ("SIGINT", Exit::Detach),
                _ = sigterm.recv() => break ("SIGTERM", Exit::Detach),
                _ = sigusr2.recv() => break ("SIGUSR2", Exit::HandOver),
                _ = sighup.recv() => self.reload(),
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        if let Err(e) = self.answer(stream).await {
                            warn!(error = %e, "control connection failed");
                        }
                    }
                    Err(e) => warn!(error = %e, "accepting a control connection failed"),
                },
                ready = refusals.readable_mut() => match ready {
                    Ok(mut guard) => {
                        let ring = guard.get_inner_mut();
                        while let Some(item) = ring.next() {
                            if let Some(sample) = parse_sample(&item) {
                                self.top.record(&sample);
                            }
                        }
                        guard.clear_ready();
                    }
                    Err(e) => warn!(error = %e, "reading the refusal ring failed"),
                },
                _ = tick(&mut rotation) => {
                    if let Err(e) = self.rotate() {
                        warn!(error = %e, "scheduled salt rotation skipped");
                    }
                }
                _ = second.tick() => {
                    if_index = self.watch_interface(if_index);
                    // A failed read costs one second of stats, never the attachment.
                    if let Err(e) = self.snapshot() {
                        warn!(error = %e, "reading the counters failed; stats are stale");
                    }
                }
                _ = occupancy.tick() => self.measure_occupancy(),
                _ = tick(&mut stats) => {
                    match self.total() {
                        Ok(total) => {
                            let now = (Instant::now(), total);
                            print_rates(&last, &now);
                            last = now;
                        }
                        Err(e) => warn!(error = %e, "reading the counters failed"),
                    }
                }
            }
        };
        info!(signal = signal_name, "stopping");
        Ok(exit)
    }

    fn start_up(&mut self, file: &ConfigFile) -> anyhow::Result<()> {
        self.snapshot()?;
        if self.state.to_config() != *file {
            self.save().context("writing the config")?;
        }
        Ok(())
    }

    /// Reads the counters into a new snapshot for `stats` and `/metrics`.
    fn snapshot(&mut self) -> Result<(), crate::Error> {
        let counters = self.limiter.counters()?;
        let occupancy = self.occupancy.lock().ok().and_then(|o| *o);
        let mode = self.limiter.attach_mode()?;
        let snapshot = self.sampler.sample(&self.state, counters, mode.as_str(), self.limiter.salt_age()?, occupancy);
        if let Ok(mut shared) = self.shared.write() {
            *shared = snapshot;
        }
        Ok(())
    }

    /// Scans the buckets on a blocking thread with its own map handle; the loop goes on.
    fn measure_occupancy(&self) {
        if self.scanning.swap(true, Ordering::AcqRel) {
            return;
        }
        let (buckets, config) = match (self.limiter.open_buckets(), self.limiter.config()) {
            (Ok(b), Ok(c)) => (b, c),
            (Err(e), _) | (_, Err(e)) => {
                self.scanning.store(false, Ordering::Release);
                return warn!(error = %e, "measuring bucket occupancy failed");
            }
        };
        let (count, out, scanning) = (self.limiter.buckets(), self.occupancy.clone(), self.scanning.clone());
        tokio::task::spawn_blocking(move || {
            let ratio = stats::occupancy(&buckets, config.generation & 1, count, crate::limiter::monotonic_ns());
            if let Ok(mut o) = out.lock() {
                *o = ratio;
            }
            scanning.store(false, Ordering::Release);
        });
    }

    /// Draws a new salt; for the longest burst window (plus a margin) packets are also judged
    /// against their old buckets, so a rotation hands out no fresh allowance.
    fn rotate(&mut self) -> Result<(), crate::Error> {
        // Every change folds its policies' windows in, so this covers the current ones too.
        let grace = self.longest_window + GRACE_MARGIN;
        self.limiter.rotate_salt(salt::draw()?, grace)?;
        // The new generation has seen only the current policies so far.
        self.longest_window = self.state.max_window();
        let generation = self.limiter.config()?.generation;
        info!(generation, grace_ms = grace.as_millis() as u64, "salt rotated");
        Ok(())
    }

    /// An interface that goes takes its XDP link with it; when it comes back (a new index),
    /// attach again.
    fn watch_interface(&mut self, known: Option<u32>) -> Option<u32> {
        let now = crate::limiter::if_index(&self.iface);
        match (known, now) {
            (Some(_), None) => {
                warn!(iface = %self.iface, "interface gone: the program went with it; waiting for it to come back")
            }
            (_, Some(index)) if known != Some(index) => match self.limiter.reattach(self.mode) {
                Ok(attached) => info!(iface = %self.iface, mode = %attached.mode, "interface re-created: reattached"),
                Err(e) => {
                    warn!(iface = %self.iface, error = %e, "reattaching failed; will retry");
                    return known;
                }
            },
            _ => {}
        }
        now
    }

    /// One request, one response. A client that stalls is dropped after a few seconds.
    async fn answer(&mut self, stream: UnixStream) -> io::Result<()> {
        let (read, mut write) = stream.into_split();
        let mut line = String::new();
        let mut reader = BufReader::new(read.take(MAX_REQUEST as u64));
        tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut line))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no request within 5 s"))??;
        let response = match serde_json::from_str::<Request>(&line) {
            Ok(request) => self.handle(request),
            Err(e) => Response::Usage { error: format!("unreadable request: {e}") },
        };
        let mut reply = serde_json::to_string(&response).map_err(io::Error::other)?;
        reply.push('\n');
        write.write_all(reply.as_bytes()).await
    }

    fn handle(&mut self, request: Request) -> Response {
        match request {
            Request::PolicySet { policy } => {
                let what = format!(
                    "name={} match={} rate={} burst={} key={} unit={} mode={}",
                    policy.name,
                    policy.matches,
                    policy.rate,
                    policy.burst_or_default(),
                    policy.key,
                    policy.unit.as_str(),
                    policy.mode.as_str()
                );
                let next = self.state.with_policy(policy);
                self.change(next, "policy set", what)
            }
            Request::PolicyRm { name } => {
                let next = self.state.without_policy(&name);
                self.change(next, "policy removed", format!("name={name}"))
            }
            Request::ListAdd { list, cidr } => {
                let next = self.state.with_net(list, cidr);
                self.change(next, "list entry added", format!("list={} cidr={cidr}", list.as_str()))
            }
            Request::ListRm { list, cidr } => {
                let next = self.state.without_net(list, cidr);
                self.change(next, "list entry removed", format!("list={} cidr={cidr}", list.as_str()))
            }
            Request::PolicyList => self.reply(self.statuses().map(|s| serde_json::to_value(s).unwrap_or_default())),
            Request::PolicyShow { name } => match self.state.policy(&name) {
                None => Response::Usage { error: format!("no policy named '{name}' (see `limiter-ctl policy list`)") },
                Some(entry) => self.reply(
                    self.limiter.counters().map(|c| serde_json::to_value(status(entry, &c)).unwrap_or_default()),
                ),
            },
            Request::ListShow { list } => {
                Response::Ok { data: serde_json::to_value(self.state.list(list)).unwrap_or_default() }
            }
            Request::Stats => match self.shared.read() {
                Ok(snapshot) => Response::Ok { data: serde_json::to_value(&*snapshot).unwrap_or_default() },
                Err(_) => Response::Failed { error: "the stats snapshot is unavailable".into() },
            },
            Request::Top { limit } => {
                Response::Ok { data: serde_json::to_value(self.top.report(&self.state, limit)).unwrap_or_default() }
            }
            Request::SaltRotate => match self.rotate() {
                Ok(()) => Response::Ok { data: serde_json::Value::Null },
                Err(e) => Response::Failed { error: e.to_string() },
            },
        }
    }

    fn reply(&self, data: Result<serde_json::Value, crate::Error>) -> Response {
        match data {
            Ok(data) => Response::Ok { data },
            Err(e) => Response::Failed { error: e.to_string() },
        }
    }

    fn statuses(&self) -> Result<Vec<PolicyStatus>, crate::Error> {
        let counters = self.limiter.counters()?;
        Ok(self.state.policies().map(|e| status(e, &counters)).collect())
    }

    /// Applies a validated change: kernel first, then the file; puts the kernel back if the
    /// file cannot be written.
    fn change(&mut self, next: Result<State, Usage>, event: &str, detail: String) -> Response {
        let next = match next {
            Ok(next) => next,
            Err(Usage(error)) => return Response::Usage { error },
        };
        match self.commit(next, true) {
            Ok(()) => {
                info!("{event} {detail}");
                Response::Ok { data: serde_json::Value::Null }
            }
            Err(error) => Response::Failed { error },
        }
    }

    /// Makes `next` the running state: the kernel maps, then (with `save`) the file. On a
    /// failure the maps are put back and the error says whether that worked.
    fn commit(&mut self, next: State, save: bool) -> Result<(), String> {
        if let Err(e) = self.limiter.sync(&self.state, &next) {
            let restored = self.limiter.sync(&next, &self.state);
            return Err(format!("updating the kernel maps failed: {e}{}", rollback_note(restored)));
        }
        if save && let Err(e) = config::save(&self.config_path, &next.to_config()) {
            let restored = self.limiter.sync(&next, &self.state);
            return Err(format!("{e}{}", rollback_note(restored)));
        }
        self.state = next;
        self.longest_window = self.longest_window.max(self.state.max_window());
        Ok(())
    }

    fn save(&self) -> Result<(), config::ConfigError> {
        config::save(&self.config_path, &self.state.to_config())
    }

    /// SIGHUP: re-read the file. A file that does not parse or validate changes nothing.
    fn reload(&mut self) {
        let path = self.config_path.display().to_string();
        let next = config::load(&self.config_path).map_err(|e| e.to_string()).and_then(|file: ConfigFile| {
            State::build_for(&file, &self.state.ids(), self.state.max_frame()).map_err(|e| format!("{path}: {}", e.0))
        });
        match next.and_then(|next| self.commit(next, false)) {
            Ok(()) => info!(config = %path, policies = self.state.policies().count(), "reloaded"),
            Err(error) => warn!(%error, "reload failed; keeping the running config"),
        }
    }

    fn total(&self) -> anyhow::Result<Counters> {
        let mut sum = Counters::default();
        self.limiter.counters()?.iter().for_each(|c| sum.add(c));
        Ok(sum)
    }
}

/// A policy as `policy list` and `policy show` report it: its burst resolved, its counters.
fn status(e: &Entry, counters: &[Counters]) -> PolicyStatus {
    PolicyStatus {
        id: e.id,
        def: PolicyDef { burst: Some(e.def.burst_or_default()), ..e.def.clone() },
        counters: counters.get(usize::from(e.id)).map(Into::into).unwrap_or_default(),
    }
}

/// The next tick of an optional interval; never, without one.
async fn tick(interval: &mut Option<tokio::time::Interval>) {
    match interval {
        Some(i) => {
            i.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// A ring record as a sample; records of another size are not ours.
fn parse_sample(bytes: &[u8]) -> Option<RefusalSample> {
    (bytes.len() == std::mem::size_of::<RefusalSample>())
        .then(|| unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<RefusalSample>()) })
}

fn rollback_note(restored: Result<(), crate::Error>) -> String {
    match restored {
        Ok(()) => "; nothing changed".into(),
        Err(e) => format!("; restoring the previous maps failed too ({e}): restart the daemon"),
    }
}

fn print_rates(prev: &(Instant, Counters), now: &(Instant, Counters)) {
    let secs = now.0.duration_since(prev.0).as_secs_f64().max(1e-3);
    let rate = |f: fn(&Counters) -> u64| ((f(&now.1).saturating_sub(f(&prev.1))) as f64 / secs).round() as u64;
    info!(
        admitted_per_s = rate(|c| c.admitted_packets),
        refused_per_s = rate(|c| c.refused_packets + c.denied_packets),
        passed_unjudged_per_s = rate(|c| c.not_ip + c.malformed + c.unmatched + c.allowed_packets + c.dry_run_packets),
        errors = now.1.errors,
        "stats"
    );
}

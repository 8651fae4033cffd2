//! The daemon's loop, which alone owns the daemon's state ([`Daemon`]): it waits on the
//! signals, the control socket's requests (`socket` reads them, `requests` answers them), the
//! pages of the bans that lists and saves ask for (`listing`), the config watch, the refusal stream, and its timers: scheduled salt rotations, the interface
//! check and the stats snapshot once a second, the bucket scan, the stats log line. Each event
//! is handled whole before the next.

use std::{
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use limiter_common::maps::Counters;
use tokio::{
    io::unix::AsyncFd,
    signal::unix::{SignalKind, signal},
};
use tracing::{info, warn};

use super::{
    Error,
    bans::{self, Bans},
    health::Health,
    listing, socket, stats,
    top::Top,
    watch::{self, ConfigWatch},
};
use crate::{
    api::{
        start::Options,
        stats::{Arrays, Reloads},
    },
    config::State,
    kernel::{self, Limiter, Placement},
};

/// The signals the daemon handles, installed first thing at start (see `daemon::run`): one that
/// arrives while the daemon starts is then handled by the loop, not by the default action
/// (SIGHUP's, SIGTERM's and SIGUSR1's: death). SIGUSR1 has no use: it is logged and ignored.
pub(super) struct Signals {
    pub sigint: tokio::signal::unix::Signal,
    pub sigterm: tokio::signal::unix::Signal,
    pub sighup: tokio::signal::unix::Signal,
    pub sigusr1: tokio::signal::unix::Signal,
    pub sigusr2: tokio::signal::unix::Signal,
}

impl Signals {
    pub(super) fn install() -> Result<Self, Error> {
        let install = |kind: SignalKind, signal_name: &'static str| {
            signal(kind).map_err(|source| Error::Signal { signal: signal_name, source })
        };
        Ok(Self {
            sigint: install(SignalKind::interrupt(), "SIGINT")?,
            sigterm: install(SignalKind::terminate(), "SIGTERM")?,
            sighup: install(SignalKind::hangup(), "SIGHUP")?,
            sigusr1: install(SignalKind::user_defined1(), "SIGUSR1")?,
            sigusr2: install(SignalKind::user_defined2(), "SIGUSR2")?,
        })
    }
}

/// The running daemon: the kernel handle and the state it enforces, and what the loop keeps
/// beside them. One `impl` per job: the loop (here), `requests`, `commit`, `reload`.
pub(super) struct Daemon {
    pub(super) limiter: Limiter,
    pub(super) state: State,
    pub(super) config_path: PathBuf,
    pub(super) iface: String,
    /// How to attach (re-attaching, or moving without --before/--after).
    pub(super) placement: Placement,
    /// The latest snapshot, read by `stats` and the metrics endpoint.
    pub(super) shared: stats::Shared,
    pub(super) sampler: stats::Sampler,
    /// The last bucket occupancy measured (off the loop).
    pub(super) occupancy: Arc<Mutex<Option<f64>>>,
    /// A scan is running: the next tick skips rather than start another beside it.
    pub(super) scanning: Arc<AtomicBool>,
    pub(super) top: Top,
    /// The longest burst window any policy had since the last rotation: the next rotation's
    /// grace must cover it (see `Limiter::rotate_salt`).
    pub(super) longest_window: Duration,
    /// Reloads applied and refused, for `/metrics`.
    pub(super) reloads: Reloads,
    /// What `/readyz` and `/livez` answer.
    pub(super) health: Health,
    /// The config file's text as last loaded, refused or written by the daemon (or why it could
    /// not be read): a watched change to the same (the daemon's own write, a ConfigMap resync)
    /// is no reload.
    pub(super) seen: Result<String, String>,
    /// The file's text the running rules were loaded from or last written as (None: there was
    /// no file). A file that says anything else holds a hand edit not yet applied, which a CLI
    /// change must not overwrite (see `catch_up`).
    pub(super) synced: Option<String>,
    /// The watch runs (`--watch-config`): the file is live, a hand edit is the operator's
    /// intent to apply.
    pub(super) watching: bool,
    /// From the watch: whether the file is being written (written to, not closed yet).
    pub(super) writing: Arc<watch::Flags>,
    /// `--rotate-every`, for `/metrics` (an alert compares the salt's age with it).
    pub(super) rotate_every: Option<Duration>,
    /// The interface lookup is failing (not "gone": it could not be asked); said once.
    pub(super) lookup_failing: bool,
    /// The bucket arrays the limiter was loaded with, for `stats`.
    pub(super) arrays: Arrays,
    /// The expiring entries (bans).
    pub(super) bans: Bans,
    /// Drawn at start, for `stats` (`Snapshot::instance`): another one is another daemon.
    pub(super) instance: u64,
}

/// An instance number from the process id and the time, when the random source fails.
fn fallback_instance() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    (nanos as u64) ^ (u64::from(std::process::id()) << 32)
}

/// How often the buckets are sampled for the occupancy gauge (`kernel::BucketScan`).
const OCCUPANCY_EVERY: Duration = Duration::from_secs(15);

/// Beyond the longest burst window, the old buckets are consulted this much longer.
const GRACE_MARGIN: Duration = Duration::from_millis(50);

impl Daemon {
    pub(super) fn new(
        limiter: Limiter,
        state: State,
        args: &Options,
        shared: stats::Shared,
        health: Health,
        longest_window: Duration,
        arrays: Arrays,
    ) -> Self {
        Self {
            limiter,
            state,
            config_path: args.config.clone(),
            iface: args.iface.clone(),
            placement: args.placement.clone(),
            shared,
            sampler: stats::Sampler::default(),
            occupancy: Arc::default(),
            scanning: Arc::default(),
            top: Top::new(args.sample_refusals.max(1), args.samples_per_s),
            longest_window,
            reloads: Reloads::default(),
            health,
            seen: Err(String::new()),
            synced: None,
            watching: false,
            writing: Arc::default(),
            rotate_every: args.rotate_every,
            lookup_failing: false,
            arrays,
            // Set by the start, once restored (`Bans::restore`).
            bans: Bans::new(None),
            // Never 0 (not known yet); a failing random source still tells restarts apart
            // by the process and the time.
            instance: getrandom::u64().unwrap_or_else(|_| fallback_instance()).max(1),
        }
    }

    /// The kernel handle, for the exit report.
    pub(super) fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    /// Runs the loop until a signal stops it.
    pub(super) async fn serve(
        &mut self,
        listener: socket::Control,
        mut refusals: AsyncFd<kernel::Refusals>,
        args: &Options,
        signals: Signals,
    ) -> Result<(), Error> {
        // Accepting stops when the loop ends and this guard goes.
        let (on_bans, mut bans_jobs) = listing::queue();
        let (_acceptor, mut jobs) = socket::spawn(listener, on_bans.clone());
        let Signals { mut sigint, mut sigterm, mut sighup, mut sigusr1, mut sigusr2 } = signals;
        let mut stats = args.stats_every.map(tokio::time::interval);
        let mut last = (Instant::now(), self.total()?);
        let mut rotation =
            args.rotate_every.map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every));
        let mut second = tokio::time::interval(Duration::from_secs(1));
        let mut occupancy = tokio::time::interval(OCCUPANCY_EVERY);
        let mut sweep = tokio::time::interval(bans::SWEEP_EVERY);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut if_index = kernel::if_index(&self.iface);
        let mut config_watch = if args.watch_config {
            match ConfigWatch::start(&self.config_path) {
                Ok(w) => {
                    info!(config = %self.config_path.display(), "watching the config file: a change applies as SIGHUP does");
                    Some(w)
                }
                Err(e) => {
                    warn!(error = %e, "not watching the config file: changes apply on SIGHUP or `limiter-ctl reload` only");
                    None
                }
            }
        } else {
            None
        };
        self.watching = config_watch.is_some();
        if let Some(w) = &config_watch {
            self.writing = w.writing();
        }
        if self.watching {
            // An edit made while the daemon started (waiting for its interface, say) raised no
            // event the watch could see.
            self.file_changed();
        }
        // SIGTERM, SIGINT and SIGUSR2 alike end the loop; the daemon then leaves the program
        // attached and pinned, enforcing, for the next daemon to adopt (a restart, an upgrade, a
        // pod replacement). `limiter-ctl detach` is the one way to take it off.
        let signal_name = loop {
            tokio::select! {
                _ = sigint.recv() => break "SIGINT",
                _ = sigterm.recv() => break "SIGTERM",
                _ = sigusr2.recv() => break "SIGUSR2",
                _ = sighup.recv() => {
                    // Logged and counted; nobody to answer.
                    let _ = self.reload("SIGHUP");
                }
                _ = sigusr1.recv() => ignored_usr1(),
                Some(job) = jobs.recv() => self.run(job),
                Some(job) = bans_jobs.recv() => job(&self.bans),
                _ = watch::settled(&mut config_watch) => self.file_changed(),
                ready = refusals.readable_mut() => match ready {
                    Ok(mut guard) => {
                        let top = &mut self.top;
                        guard.get_inner_mut().drain(|sample| top.record(sample));
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
                    self.health.beat();
                    if_index = self.watch_interface(if_index);
                    // A watched change the daemon could not read (out of descriptors, say) is
                    // not lost: it is read again each second until it reads as it did.
                    if config_watch.is_some() && self.seen.is_err() {
                        self.file_changed();
                    }
                    // A failed read costs one second of stats, never the attachment.
                    if let Err(e) = self.snapshot() {
                        warn!(error = %e, "reading the counters failed; stats are stale");
                    }
                }
                _ = occupancy.tick() => self.measure_occupancy(),
                _ = sweep.tick() => {
                    self.bans.sweep(&mut self.limiter);
                    self.bans.save_if_due(&on_bans);
                }
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
        // A save or a list waiting for a page is told the loop has ended.
        drop(bans_jobs);
        self.bans.save_now();
        Ok(())
    }

    /// Reads the counters into a new snapshot for `stats` and `/metrics`.
    pub(super) fn snapshot(&mut self) -> Result<(), kernel::Error> {
        let counters = self.limiter.counters()?;
        let occupancy = self.occupancy.lock().ok().and_then(|o| *o);
        let mode = self.limiter.attach_mode()?;
        let mut snapshot =
            self.sampler.sample(&self.state, counters, mode.as_str(), self.limiter.salt_age()?, occupancy);
        snapshot.reloads = self.reloads.clone();
        snapshot.attach_reason = self.limiter.why_tc().map(ToString::to_string);
        snapshot.attach_reason_code = self.limiter.why_tc().map(|r| r.code().to_string());
        snapshot.attach_api_reason = self.limiter.api_reason().map(ToString::to_string);
        snapshot.attach_api_reason_code = self.limiter.api_reason().map(|r| r.code().to_string());
        snapshot.rotate_every_s = self.rotate_every.map(|d| d.as_secs_f64());
        snapshot.geometry = Some(self.arrays);
        snapshot.bans = Some(self.bans.stats(self.limiter.ban_hits()?));
        snapshot.instance = self.instance;
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
        let scan = match self.limiter.bucket_scan() {
            Ok(scan) => scan,
            Err(e) => {
                self.scanning.store(false, Ordering::Release);
                return warn!(error = %e, "measuring bucket occupancy failed");
            }
        };
        let (out, scanning) = (self.occupancy.clone(), self.scanning.clone());
        tokio::task::spawn_blocking(move || {
            let ratio = scan.occupancy();
            if let Ok(mut o) = out.lock() {
                *o = ratio;
            }
            scanning.store(false, Ordering::Release);
        });
    }

    /// Draws a new salt; for the longest burst window (plus a margin) packets are also judged
    /// against their old buckets, so a rotation hands out no fresh allowance.
    pub(super) fn rotate(&mut self) -> Result<(), kernel::Error> {
        // Every change folds its policies' windows in, so this covers the current ones too.
        let grace = self.longest_window + GRACE_MARGIN;
        self.limiter.rotate_salt(kernel::draw_salt()?, grace)?;
        // The new generation has seen only the current policies so far.
        self.longest_window = self.state.max_window();
        let generation = self.limiter.read_config()?.generation;
        info!(generation, grace_ms = grace.as_millis() as u64, "salt rotated");
        Ok(())
    }

    /// An interface that goes takes its XDP link with it; when it comes back (a new index),
    /// attach again; so too when the limiter's filter at tc ingress was deleted. Only the kernel's "no such device", asked twice, is "gone": a lookup that
    /// fails otherwise (out of descriptors, say) changes nothing, so it can never cost the
    /// attachment.
    fn watch_interface(&mut self, known: Option<u32>) -> Option<u32> {
        let now = match kernel::lookup_index(&self.iface) {
            kernel::Lookup::Gone => kernel::lookup_index(&self.iface),
            found => found,
        };
        let now = match now {
            kernel::Lookup::Index(index) => Some(index),
            kernel::Lookup::Gone => None,
            kernel::Lookup::Unknown(errno) => {
                if !self.lookup_failing {
                    self.lookup_failing = true;
                    warn!(iface = %self.iface, error = %errno, "could not look the interface up; taking it as unchanged until the lookup works again");
                }
                return known;
            }
        };
        if std::mem::take(&mut self.lookup_failing) {
            info!(iface = %self.iface, "the interface lookup works again");
        }
        let again = match (known, now) {
            (Some(_), None) => {
                self.health.not_ready(format!("interface {} is gone; waiting for it to come back", self.iface));
                warn!(iface = %self.iface, "interface gone: the program went with it; waiting for it to come back");
                None
            }
            (_, Some(index)) if known != Some(index) => Some("interface re-created: reattached"),
            // A filter at tc ingress, unlike a link, can be deleted by another tool.
            _ => self.limiter.filter_gone().map(|found| {
                warn!(iface = %self.iface, %found, "the limiter's filter at tc ingress was deleted (`tc filter del`, or `tc qdisc del ... clsact`?): attaching it again");
                "the filter at tc ingress attached again"
            }),
        };
        match again.map(|done| (done, self.limiter.reattach(&self.placement))) {
            Some((done, Ok(attached))) => {
                self.health.ready();
                if let Some(reason) = &attached.fallback {
                    warn!(iface = %self.iface, %reason, "reattached, not as asked");
                }
                let why = attached.why_tc.as_ref().map(ToString::to_string).unwrap_or_default();
                info!(iface = %self.iface, hook = %attached.mode.hook(), mode = %attached.mode, why, "{done}")
            }
            Some((_, Err(e))) => {
                warn!(iface = %self.iface, error = %e, "reattaching failed; will retry");
                return known;
            }
            None => {}
        }
        now
    }

    fn total(&self) -> Result<Counters, kernel::Error> {
        let mut sum = Counters::default();
        self.limiter.counters()?.iter().for_each(|c| sum.add(c));
        Ok(sum)
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

/// SIGUSR1 has no use: said once per signal, and the daemon goes on.
fn ignored_usr1() {
    info!(
        signal = "SIGUSR1",
        "ignored: SIGUSR1 has no use in the daemon (SIGHUP reloads; SIGTERM, SIGINT and SIGUSR2 stop it)"
    );
}

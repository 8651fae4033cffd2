//! The daemon's loop: signals, the control socket's server side (one request, one response),
//! the refusal ring, scheduled salt rotations, interface watching and the once-a-second stats.
//!
//! The loop alone owns the daemon's state. Control connections are accepted and read in tasks
//! of their own (at most [`MAX_CONNECTIONS`] at once, each with a deadline to send its request
//! and one to take its answer); a request read whole goes to the loop as a [`Job`], which the
//! loop handles between its other events and answers. So no client, however slow, holds up the
//! loop, the stats tick, other clients or a signal.

use std::{
    io,
    os::unix::fs::{DirBuilderExt as _, FileTypeExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use limiter_common::maps::{Counters, RefusalSample};
use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader, unix::AsyncFd},
    net::{UnixListener, UnixStream},
    signal::unix::{SignalKind, signal},
    sync::{Semaphore, mpsc, oneshot},
};
use tracing::{error, info, warn};

use super::{
    Error, Options, Rollback,
    health::Health,
    ipc::{MAX_REQUEST, PolicyStatus, Reloaded, ReloadedFirst, Request, Response},
    stats,
    top::Top,
    watch::{self, ConfigWatch},
};
use crate::{
    config::{self, ConfigFile, Entry, PolicyDef, State},
    kernel::{self, Limiter, ModeRequest},
};

/// How the daemon leaves: on SIGTERM, SIGINT and SIGUSR2 alike it leaves the program attached
/// and pinned, enforcing, for the next daemon to adopt (a restart, an upgrade, a pod
/// replacement). `limiter-ctl detach` is the one way to take it off.
pub(super) enum Exit {
    HandOver,
}

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

/// Binds the control socket, refusing to take it from a running daemon. It is never reachable
/// by anyone else, whatever the umask: bound in a fresh 0700 directory of the daemon's own,
/// made 0600 there, and only then linked into place. (Bound in place, it would be open to all
/// between bind(2) and chmod(2) under a lax umask, and a connection made then stays open.)
pub(super) fn bind(path: &Path) -> Result<UnixListener, Error> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // Directories made here are 0755 even under umask 0: no one else may swap the socket.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|source| Error::CreateSocketDir { dir: dir.to_path_buf(), source })?;
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(Error::SocketTaken { path: path.to_path_buf() });
    }
    match std::fs::symlink_metadata(path) {
        // Left by a daemon that died: nothing answers on it.
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)
            .map_err(|source| Error::RemoveStaleSocket { path: path.to_path_buf(), source })?,
        Ok(_) => return Err(Error::NotASocket { path: path.to_path_buf() }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(Error::CheckSocket { path: path.to_path_buf(), source }),
    }
    let bind_err = |source| Error::Bind { path: path.to_path_buf(), source };
    // Removed on return, with the staged name in it: the socket lives on under `path`.
    let private = tempfile::Builder::new().prefix(".lmt").tempdir_in(dir).map_err(bind_err)?;
    let staged = private.path().join("s");
    let listener = UnixListener::bind(&staged).map_err(bind_err)?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))
        .map_err(|source| Error::RestrictSocket { path: path.to_path_buf(), source })?;
    // A link, not a rename: a socket another daemon bound there meanwhile is not replaced.
    std::fs::hard_link(&staged, path).map_err(|source| match source.kind() {
        io::ErrorKind::AlreadyExists => Error::SocketTaken { path: path.to_path_buf() },
        _ => bind_err(source),
    })?;
    Ok(listener)
}

/// Whether a peer may use the control socket: root, or the daemon's own user. The socket's
/// mode already keeps others out; this holds should the mode or its directory be loosened.
fn may_control(peer: Option<u32>) -> bool {
    peer.is_some_and(|uid| uid == 0 || uid == nix::unistd::geteuid().as_raw())
}

/// A warning a local user could cause thousands of times a second: logged at most once per
/// [`Throttled::EVERY`], saying how many were not.
#[derive(Default)]
pub(super) struct Throttled {
    last: Option<Instant>,
    quiet: u64,
}

impl Throttled {
    const EVERY: Duration = Duration::from_secs(10);

    /// Some(how many went unlogged since the last one) when this one is to be logged.
    pub(super) fn hit(&mut self) -> Option<u64> {
        match self.last {
            Some(last) if last.elapsed() < Self::EVERY => {
                self.quiet += 1;
                None
            }
            _ => {
                self.last = Some(Instant::now());
                Some(std::mem::take(&mut self.quiet))
            }
        }
    }
}

pub(super) struct Daemon {
    limiter: Limiter,
    state: State,
    config_path: PathBuf,
    iface: String,
    mode: ModeRequest,
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
    /// Reloads applied and refused, for `/metrics`.
    reloads: stats::Reloads,
    /// What `/readyz` and `/livez` answer.
    health: Health,
    /// The config file's text as last loaded, refused or written by the daemon (or why it could
    /// not be read): a watched change to the same (the daemon's own write, a ConfigMap resync)
    /// is no reload.
    seen: Result<String, String>,
    /// The file's text the running rules were loaded from or last written as (None: there was
    /// no file). A file that says anything else holds a hand edit not yet applied, which a CLI
    /// change must not overwrite (see `catch_up`).
    synced: Option<String>,
    /// The watch runs (`--watch-config`): the file is live, a hand edit is the operator's
    /// intent to apply.
    watching: bool,
    /// From the watch: whether the file is being written (written to, not closed yet).
    writing: Arc<watch::Flags>,
    /// `--rotate-every`, for `/metrics` (an alert compares the salt's age with it).
    rotate_every: Option<Duration>,
    /// The interface lookup is failing (not "gone": it could not be asked); said once.
    lookup_failing: bool,
}

/// Control connections served at once; one more is told so in one line and closed.
pub(crate) const MAX_CONNECTIONS: usize = 256;
/// A client has this long from connecting to send its whole request line.
const READ_DEADLINE: Duration = Duration::from_secs(2);
/// And this long to take its answer.
const WRITE_DEADLINE: Duration = Duration::from_secs(2);
/// A request the loop could not take up within this long of reading it is refused, not applied
/// (the CLI gives a request 30 s in all, and says on a timeout that it may still be applied).
const QUEUE_DEADLINE: Duration = Duration::from_secs(5);

/// A request read whole from a client, for the loop, and where its answer goes.
struct Job {
    request: Request,
    received: Instant,
    answer: oneshot::Sender<Response>,
}

/// How often the buckets are scanned for the occupancy gauge (it reads them all).
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
    ) -> Self {
        Self {
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
            reloads: stats::Reloads::default(),
            health,
            seen: Err(String::new()),
            synced: None,
            watching: false,
            writing: Arc::default(),
            rotate_every: args.rotate_every,
            lookup_failing: false,
        }
    }

    /// The kernel handle, for the exit report.
    pub(super) fn limiter(&self) -> &Limiter {
        &self.limiter
    }

    pub(super) async fn serve(
        &mut self,
        listener: UnixListener,
        mut refusals: AsyncFd<RingBuf<MapData>>,
        args: &Options,
        signals: Signals,
    ) -> Result<Exit, Error> {
        let (jobs_in, mut jobs) = mpsc::channel(MAX_CONNECTIONS);
        // Stops accepting when the loop ends (connections still open are dropped with the runtime).
        let _acceptor = AbortOnDrop(tokio::spawn(accept(listener, jobs_in)));
        let Signals { mut sigint, mut sigterm, mut sighup, mut sigusr1, mut sigusr2 } = signals;
        let mut stats = args.stats_every.map(tokio::time::interval);
        let mut last = (Instant::now(), self.total()?);
        let mut rotation =
            args.rotate_every.map(|every| tokio::time::interval_at(tokio::time::Instant::now() + every, every));
        let mut second = tokio::time::interval(Duration::from_secs(1));
        let mut occupancy = tokio::time::interval(OCCUPANCY_EVERY);
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
        let (signal_name, exit) = loop {
            tokio::select! {
                _ = sigint.recv() => break ("SIGINT", Exit::HandOver),
                _ = sigterm.recv() => break ("SIGTERM", Exit::HandOver),
                _ = sigusr2.recv() => break ("SIGUSR2", Exit::HandOver),
                _ = sighup.recv() => {
                    // Logged and counted; nobody to answer.
                    let _ = self.reload("SIGHUP");
                }
                _ = sigusr1.recv() => ignored_usr1(),
                Some(job) = jobs.recv() => self.run(job),
                _ = watch::settled(&mut config_watch) => self.file_changed(),
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

    /// `text`: the file's text `file` was loaded from (None: there was no file).
    pub(super) fn start_up(&mut self, file: &ConfigFile, text: Option<&str>) -> Result<(), Error> {
        self.snapshot()?;
        self.synced = text.map(str::to_string);
        // Written only if the rules differ (`--rate` installed or changed "default"): a file that
        // says the same in its own order, spelling and comments is the operator's, left alone.
        // A file edited since it was loaded is not overwritten: the start fails, saying so.
        if !self.state.to_config().same_rules(file) {
            let written = config::save(&self.config_path, &self.state.to_config(), text).map_err(Error::SaveConfig)?;
            self.synced = Some(written);
        }
        self.seen = match &self.synced {
            Some(text) => Ok(text.clone()),
            None => Err(config::Error::Missing { path: self.config_path.clone() }.to_string()),
        };
        Ok(())
    }

    /// Reads the counters into a new snapshot for `stats` and `/metrics`.
    fn snapshot(&mut self) -> Result<(), kernel::Error> {
        let counters = self.limiter.counters()?;
        let occupancy = self.occupancy.lock().ok().and_then(|o| *o);
        let mode = self.limiter.attach_mode()?;
        let mut snapshot =
            self.sampler.sample(&self.state, counters, mode.as_str(), self.limiter.salt_age()?, occupancy);
        snapshot.reloads = self.reloads.clone();
        snapshot.rotate_every_s = self.rotate_every.map(|d| d.as_secs_f64());
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
        let (buckets, config) = match (self.limiter.open_buckets(), self.limiter.read_config()) {
            (Ok(b), Ok(c)) => (b, c),
            (Err(e), _) | (_, Err(e)) => {
                self.scanning.store(false, Ordering::Release);
                return warn!(error = %e, "measuring bucket occupancy failed");
            }
        };
        let (count, out, scanning) = (self.limiter.buckets(), self.occupancy.clone(), self.scanning.clone());
        tokio::task::spawn_blocking(move || {
            let ratio = stats::occupancy(&buckets, config.generation & 1, count, kernel::monotonic_ns());
            if let Ok(mut o) = out.lock() {
                *o = ratio;
            }
            scanning.store(false, Ordering::Release);
        });
    }

    /// Draws a new salt; for the longest burst window (plus a margin) packets are also judged
    /// against their old buckets, so a rotation hands out no fresh allowance.
    fn rotate(&mut self) -> Result<(), kernel::Error> {
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
    /// attach again. Only the kernel's "no such device", asked twice, is "gone": a lookup that
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
        match (known, now) {
            (Some(_), None) => {
                self.health.not_ready(format!("interface {} is gone; waiting for it to come back", self.iface));
                warn!(iface = %self.iface, "interface gone: the program went with it; waiting for it to come back")
            }
            (_, Some(index)) if known != Some(index) => match self.limiter.reattach(self.mode) {
                Ok(attached) => {
                    self.health.ready();
                    info!(iface = %self.iface, mode = %attached.mode, "interface re-created: reattached")
                }
                Err(e) => {
                    warn!(iface = %self.iface, error = %e, "reattaching failed; will retry");
                    return known;
                }
            },
            _ => {}
        }
        now
    }

    /// Handles a request read whole and sends the answer to its connection's task. Once taken
    /// up it is applied whole or not at all (validated, then the maps, then the file, put back
    /// on a failure), whether or not its client is still there; a client that left gets no
    /// answer and the log says what was done.
    fn run(&mut self, job: Job) {
        let waited = job.received.elapsed();
        let response = if waited > QUEUE_DEADLINE {
            warn!(waited_ms = waited.as_millis() as u64, "a control request waited too long; refused, nothing changed");
            Response::Failed {
                error: format!("the daemon was busy for {} ms; nothing was changed; try again", waited.as_millis()),
            }
        } else {
            self.handle(job.request)
        };
        let _ = job.answer.send(response);
    }

    fn handle(&mut self, request: Request) -> Response {
        if !matches!(
            request,
            Request::PolicySet { .. } | Request::PolicyRm { .. } | Request::ListAdd { .. } | Request::ListRm { .. }
        ) {
            return self.answer(request);
        }
        // A change merges the running rules into the file: a hand edit not yet applied would be
        // undone. It is applied first, or the change refused.
        let reloaded = match self.catch_up() {
            Ok(reloaded) => reloaded,
            Err(error) => return Response::Failed { error },
        };
        match (self.answer(request), reloaded) {
            (Response::Ok { .. }, Some(reloaded_first)) => {
                Response::Ok { data: serde_json::to_value(ReloadedFirst { reloaded_first }).unwrap_or_default() }
            }
            // The reload stands (it was logged and counted as one): the answer says so.
            (Response::Usage { error }, Some(r)) => {
                Response::Usage { error: format!("{error}; {}", reloaded_note(&r)) }
            }
            (Response::Failed { error }, Some(r)) => {
                Response::Failed { error: format!("{error}; {}", reloaded_note(&r)) }
            }
            (response, None) => response,
        }
    }

    /// Before a change: whether the file still says what the running rules were loaded from or
    /// written as. If it holds a hand edit, with the watch on (the file is live) the edit is
    /// reloaded now, as the watch would a moment later (same checks, logged and counted), and
    /// returned; with the watch off (edits apply on reload only) the change is refused, and so
    /// it is when the reload is refused or the file cannot be read. A missing file holds nothing
    /// to lose: the change writes it afresh. The error is the client's one line.
    fn catch_up(&mut self) -> Result<Option<Reloaded>, String> {
        let path = self.config_path.display().to_string();
        let read = config::read(&self.config_path);
        match (&read, &self.synced) {
            (Err(config::Error::Missing { .. }), _) => return Ok(None),
            (Ok(text), Some(synced)) if text == synced => return Ok(None),
            (Ok(_), _) => {}
            (Err(e), _) => {
                warn!(config = %path, "a change refused: the config cannot be read: {e}; nothing changed");
                return Err(format!(
                    "{e}: not written, nothing was changed; fix the file (`limiter-ctl config check {path}`), then \
                     retry"
                ));
            }
        }
        if self.watching && self.writing.writing() {
            warn!(config = %path, "a change refused: the file is being written; nothing changed");
            return Err(format!(
                "{path} is being written (written to and not closed yet): not overwritten, nothing was changed; \
                 retry once it is saved"
            ));
        }
        if !self.watching {
            warn!(config = %path, "a change refused: the file holds a hand edit not yet applied; nothing changed");
            return Err(format!(
                "{path} was changed since the daemon last read or wrote it (a hand edit not yet applied): not \
                 overwritten, nothing was changed; apply the edit with `limiter-ctl reload` (`limiter-ctl config \
                 check {path}` first), then retry"
            ));
        }
        match self.reload_from(read, "a change found the file edited") {
            Ok(reloaded) => Ok(Some(reloaded)),
            Err(e) => Err(format!(
                "{path} was changed since the daemon last read or wrote it, and that edit is refused ({e}): not \
                 overwritten, nothing was changed; fix the file (`limiter-ctl config check {path}`), then retry"
            )),
        }
    }

    /// Answers a request on the running rules.
    fn answer(&mut self, request: Request) -> Response {
        match request {
            Request::PolicySet { name, edit } => {
                // Only the fields given change (see `PolicyEdit::apply`).
                let policy = match edit.apply(&name, self.state.policy(&name).map(|e| &e.def)) {
                    Ok(policy) => policy,
                    Err(error) => return Response::Usage { error: error.to_string() },
                };
                let what = policy.summary();
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
            Request::Reload => match self.reload("limiter-ctl reload") {
                Ok(reloaded) => Response::Ok { data: serde_json::to_value(reloaded).unwrap_or_default() },
                // A file refused is bad input (exit 2); a kernel that refused the maps, a failure.
                Err(e @ (Error::File(_) | Error::Config { .. })) => {
                    Response::Usage { error: format!("reload refused: {e}; the running config stays") }
                }
                Err(e) => Response::Failed { error: format!("reload failed: {e}") },
            },
            Request::SaltRotate => match self.rotate() {
                Ok(()) => Response::Ok { data: serde_json::Value::Null },
                Err(e) => Response::Failed { error: e.to_string() },
            },
        }
    }

    fn reply(&self, data: Result<serde_json::Value, kernel::Error>) -> Response {
        match data {
            Ok(data) => Response::Ok { data },
            Err(e) => Response::Failed { error: e.to_string() },
        }
    }

    fn statuses(&self) -> Result<Vec<PolicyStatus>, kernel::Error> {
        let counters = self.limiter.counters()?;
        Ok(self.state.policies().map(|e| status(e, &counters)).collect())
    }

    /// Applies a validated change: kernel first, then the file; puts the kernel back if the
    /// file cannot be written.
    fn change(&mut self, next: Result<State, config::Error>, event: &str, detail: String) -> Response {
        let next = match next {
            Ok(next) => next,
            Err(error) => return Response::Usage { error: error.to_string() },
        };
        match self.commit(next, true) {
            Ok(()) => {
                info!("{event} {detail}");
                Response::Ok { data: serde_json::Value::Null }
            }
            Err(error) => Response::Failed { error: error.to_string() },
        }
    }

    /// Makes `next` the running state: the kernel maps, then (with `save`) the file. On a
    /// failure the maps are put back and the error says whether that worked.
    fn commit(&mut self, next: State, save: bool) -> Result<(), Error> {
        if let Err(error) = self.limiter.sync(&self.state, &next) {
            let rollback = Rollback(self.limiter.sync(&next, &self.state).map_err(Box::new));
            return Err(Error::UpdateMaps { error: Box::new(error), rollback });
        }
        if save {
            match config::save(&self.config_path, &next.to_config(), self.synced.as_deref()) {
                Ok(written) => {
                    // The daemon's own write: the watch sees it, and must not apply it again.
                    self.seen = Ok(written.clone());
                    self.synced = Some(written);
                }
                Err(error) => {
                    let rollback = Rollback(self.limiter.sync(&next, &self.state).map_err(Box::new));
                    return Err(Error::SaveChange { error, rollback });
                }
            }
        }
        self.state = next;
        self.longest_window = self.longest_window.max(self.state.max_window());
        Ok(())
    }

    /// SIGHUP and `limiter-ctl reload`: re-read the file and make it the running config. A
    /// file that is missing, empty, not a regular file, unreadable, or does not parse or
    /// validate is refused, and so is one without rules while rules run, unless it says
    /// `policy = []`: nothing changes. Either way it is logged (a refusal as an error, naming
    /// the file and why) and counted for `/metrics`.
    fn reload(&mut self, trigger: &'static str) -> Result<Reloaded, Error> {
        self.reload_from(config::read(&self.config_path), trigger)
    }

    /// [`Daemon::reload`] of the file as `read` just now.
    fn reload_from(&mut self, read: Result<String, config::Error>, trigger: &'static str) -> Result<Reloaded, Error> {
        let config = self.config_path.display().to_string();
        // Whatever the outcome, these bytes have been judged: the watch need not see them again.
        self.seen = read.as_ref().map(Clone::clone).map_err(ToString::to_string);
        super::notify_reloading();
        let result = self.try_reload(read);
        super::notify_reloaded(&self.iface, result.is_ok());
        self.reloads.record(result.is_ok());
        if let Ok(mut shared) = self.shared.write() {
            shared.reloads = self.reloads.clone();
        }
        match &result {
            Ok(r) => info!(%config, trigger, policies = r.policies, allow = r.allow, deny = r.deny, "reloaded"),
            Err(e) => error!(%config, trigger, "reload refused: {e}; the running config stays"),
        }
        result
    }

    /// The watch saw the config's directory change and settle: bytes other than those last
    /// seen are reloaded as SIGHUP reloads them (validated, applied or refused whole, logged
    /// once, counted); the same bytes (the daemon's own write, a resync, a touch) are nothing.
    fn file_changed(&mut self) {
        // Read as a reload reads it (never blocking: a FIFO is refused, not waited on).
        let read = config::read(&self.config_path);
        if read.as_ref().map_err(ToString::to_string) == self.seen.as_ref().map_err(Clone::clone) {
            return;
        }
        let _ = self.reload_from(read, "config file changed");
    }

    fn try_reload(&mut self, read: Result<String, config::Error>) -> Result<Reloaded, Error> {
        let path = &self.config_path;
        let text = read.map_err(Error::File)?;
        let file = config::parse(path, &text).map_err(Error::File)?;
        let running = self.state.to_config();
        // An emptied file is far likelier an accident than a wish to drop all protection.
        if file.has_no_rules() && !running.has_no_rules() && !config::says_no_rules(&text) {
            return Err(Error::File(config::Error::NoRules { path: path.clone() }));
        }
        let next = State::build_for(&file, &self.state.ids(), self.state.max_frame())
            .map_err(|error| Error::Config { path: path.clone(), error })?;
        self.commit(next, false)?;
        self.synced = Some(text);
        Ok(Reloaded {
            config: self.config_path.clone(),
            policies: self.state.policies().count(),
            allow: file.allow.len(),
            deny: file.deny.len(),
        })
    }

    fn total(&self) -> Result<Counters, kernel::Error> {
        let mut sum = Counters::default();
        self.limiter.counters()?.iter().for_each(|c| sum.add(c));
        Ok(sum)
    }
}

/// What a change refused after its file's hand edit was reloaded adds: that reload stays.
fn reloaded_note(r: &Reloaded) -> String {
    format!(
        "{} had changed and was reloaded first ({} policies, {} allow and {} deny entries): that stays applied",
        r.config.display(),
        r.policies,
        r.allow,
        r.deny
    )
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
    (bytes.len() == std::mem::size_of::<RefusalSample>()).then(|| {
        // SAFETY: `bytes` holds exactly size_of::<RefusalSample>() bytes (checked above), read
        // unaligned; RefusalSample is a plain-old-data #[repr(C)] record, valid for any bytes.
        unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<RefusalSample>()) }
    })
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

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Accepts control connections from root or the daemon's own user, each served by a task of
/// its own, at most [`MAX_CONNECTIONS`] at once.
async fn accept(listener: UnixListener, jobs: mpsc::Sender<Job>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let (mut refused, mut failing) = (Throttled::default(), Throttled::default());
    loop {
        match listener.accept().await {
            Ok((stream, _)) if !may_control(stream.peer_cred().ok().map(|c| c.uid())) => {
                let peer = stream.peer_cred().ok(); // for the log line only
                refuse(&stream, "permission denied: the control socket serves root and the daemon's own user only");
                if let Some(unlogged) = refused.hit() {
                    warn!(
                        uid = peer.map(|c| c.uid()),
                        pid = peer.and_then(|c| c.pid()),
                        unlogged,
                        "control connection refused: the peer is neither root nor the daemon's user"
                    );
                }
            }
            Ok((stream, _)) => match slots.clone().try_acquire_owned() {
                Ok(slot) => {
                    let jobs = jobs.clone();
                    tokio::spawn(async move {
                        if let Err(e) = connection(stream, jobs).await {
                            warn!(error = %e, "control connection dropped");
                        }
                        drop(slot);
                    });
                }
                Err(_) => refuse_busy(&stream),
            },
            Err(e) => {
                if let Some(unlogged) = failing.hit() {
                    warn!(error = %e, unlogged, "accepting a control connection failed");
                }
                // Out of descriptors, most likely: give the open connections time to end.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One line to a client beyond [`MAX_CONNECTIONS`], without waiting: a fresh socket's buffer
/// holds it.
fn refuse_busy(stream: &UnixStream) {
    refuse(stream, &format!("the daemon is serving {MAX_CONNECTIONS} control connections already; try again"));
    warn!(max = MAX_CONNECTIONS, "control connection refused: too many open");
}

/// Tells a client in one line why it is refused, without waiting, and leaves it (the stream
/// closes when dropped).
fn refuse(stream: &UnixStream, why: &str) {
    if let Ok(mut line) = serde_json::to_string(&Response::Failed { error: why.to_string() }) {
        line.push('\n');
        let _ = stream.try_write(line.as_bytes());
    }
}

/// SIGUSR1 has no use: said once per signal, and the daemon goes on.
fn ignored_usr1() {
    info!(
        signal = "SIGUSR1",
        "ignored: SIGUSR1 has no use in the daemon (SIGHUP reloads; SIGTERM, SIGINT and SIGUSR2 stop it)"
    );
}

/// One connection: its request line within [`READ_DEADLINE`], to the loop, and the loop's
/// answer back within [`WRITE_DEADLINE`].
async fn connection(stream: UnixStream, jobs: mpsc::Sender<Job>) -> io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read.take(MAX_REQUEST as u64));
    let timed_out = |what: &str, deadline: Duration| {
        io::Error::new(io::ErrorKind::TimedOut, format!("{what} within {} s", deadline.as_secs()))
    };
    let read = tokio::time::timeout(READ_DEADLINE, reader.read_line(&mut line)).await;
    if read.map_err(|_| timed_out("no whole request", READ_DEADLINE))?? == 0 {
        // Connected and left without a word.
        return Ok(());
    }
    let response = match serde_json::from_str::<Request>(&line) {
        Ok(request) => {
            let (answer, answered) = oneshot::channel();
            let job = Job { request, received: Instant::now(), answer };
            // Either fails only when the loop has ended: the daemon is stopping.
            if jobs.send(job).await.is_err() {
                return Ok(());
            }
            match answered.await {
                Ok(response) => response,
                Err(_) => return Ok(()),
            }
        }
        Err(e) => Response::Usage { error: format!("unreadable request: {e}") },
    };
    let mut reply = serde_json::to_string(&response).map_err(io::Error::other)?;
    reply.push('\n');
    let written = tokio::time::timeout(WRITE_DEADLINE, write.write_all(reply.as_bytes())).await;
    written.map_err(|_| timed_out("the answer not taken", WRITE_DEADLINE))?
}

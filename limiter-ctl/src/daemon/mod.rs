//! The daemon room: `limiter-ctl daemon`. Validate the config, lock the interface's state
//! (`instance`), wait for the interface, claim it (one limiter per interface), load or adopt
//! the program, make its maps say what the config says, attach, tell systemd it is ready (this
//! file); then run the loop until SIGTERM, SIGINT or SIGUSR2 (SIGUSR1 is logged and ignored),
//! and leave the program attached and pinned for the next daemon. A start that fails takes away
//! what it made.
//!
//! The loop (`serve`) alone owns the running state (`serve::Daemon`); its other jobs each have
//! a file:
//! - `socket`: the control socket's server side: bind, accept, peer checks, a task per
//!   connection that reads its request and writes the loop's answer;
//! - `requests`: each request handled on the running rules;
//! - `commit`: a new state made the running one, the kernel's maps then the file, the maps put
//!   back if the file cannot be written;
//! - `instance`: one daemon per interface, whatever its pin directory (the state lock);
//! - `bans`: the expiring entries (bans): kept, swept when they expire, saved in the state
//!   directory;
//! - `listing`: work on the bans a page at a time: `ban-list` answers streamed to their client,
//!   and the saves' pages;
//! - `reload`: the config file re-read on SIGHUP, `limiter-ctl reload` and when it changes
//!   (`watch`), and a hand edit caught up with before a change.
//!
//! Beside the loop: the counters sampled once a second (`stats`), the Prometheus endpoint
//! (`metrics`), the probes (`health`), the most-refused sources (`top`), and rate-limited
//! warnings (`throttled`).
//!
//! Every change is validated whole before anything moves. One log line per state change. The
//! salt is drawn here and written to the kernel map only.
//!
//! It may use the api room (the wire types it answers with, the options it starts with), the
//! kernel and config rooms; nothing of the CLI. Its one error type is [`Error`].

mod bans;
mod commit;
mod error;
mod explain;
mod health;
mod instance;
mod listing;
mod metrics;
mod reload;
mod requests;
mod serve;
mod socket;
mod stats;
mod text004;
mod throttled;
mod top;
mod watch;

use std::{collections::BTreeMap, net::SocketAddr, path::Path, time::Duration};

use tokio::io::unix::AsyncFd;
use tracing::{info, warn};

pub use error::{Error, Rollback};
use health::Health;
use serve::{Daemon, Signals};
use socket::bind;

use crate::{
    api::{
        start::{MetricsAt, Options},
        stats::Arrays,
    },
    config::{self, BurstEdit, Name, PolicyEdit, State},
    kernel::{self, Limiter, MapView, pins::PinDir},
};

/// The port `--metrics auto` listens on for `iface`: 9465 + (FNV-1a-32 of the name mod 535),
/// 9465-9999. Deterministic, so Prometheus can be told it once; two names that land on the same
/// port make the second daemon fail at start, saying so (give one of them `--metrics`).
pub(crate) fn auto_metrics_port(iface: &str) -> u16 {
    let hash = iface.bytes().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193));
    9465 + (hash % 535) as u16
}

/// The policy the daemon's `--rate` installs (matching everything).
const DEFAULT_POLICY: &str = "default";

/// How often a missing interface is looked for while waiting.
const IFACE_POLL: Duration = Duration::from_millis(100);

/// Tells systemd (the unit is `Type=notify`) how the daemon is doing; nothing without
/// `$NOTIFY_SOCKET`. A failure to tell is logged, never fatal.
fn notify(states: &[sd_notify::NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        warn!(error = %e, "telling systemd (NOTIFY_SOCKET) failed");
    }
}

/// RELOADING=1 (with MONOTONIC_USEC, as systemd asks) as a reload begins.
fn notify_reloading() {
    let mut states = vec![sd_notify::NotifyState::Reloading];
    states.extend(sd_notify::NotifyState::monotonic_usec_now().ok());
    notify(&states);
}

/// READY=1 as a reload ends, applied or refused (the daemon runs on either way), and which.
fn notify_reloaded(iface: &str, applied: bool) {
    let outcome = if applied { "reload applied" } else { "reload refused, the running config stays" };
    let status = format!("enforcing on {iface}; {outcome}");
    notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&status)]);
}

/// Raises the soft limit on open files to the hard one (the unit sets both with LimitNOFILE=):
/// the metrics listener and the control socket cap their connections well below it, so the
/// descriptors the loop needs (reloads, the interface lookup, the config watch) are there.
/// A failure is logged, not fatal: the daemon runs as before.
fn reserve_descriptors() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => info!(from = soft, to = hard, "raised the soft open-files limit to the hard limit"),
            Err(e) => warn!(soft, hard, error = %e, "could not raise the soft open-files limit to the hard limit"),
        },
        Ok(_) => {}
        Err(e) => warn!(error = %e, "could not read the open-files limit"),
    }
}

/// What a start made, so a start that fails takes it away again.
#[derive(Default)]
struct Made {
    socket: bool,
    /// Pins of a limiter this start created (none was pinned here before).
    pins: bool,
}

/// `limiter-ctl daemon`: runs the daemon on a runtime of its own until it stops.
pub(crate) fn main(args: Options, socket: &Path) -> Result<(), Error> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(Error::Runtime)?;
    runtime.block_on(run(args, socket))
}

async fn run(args: Options, socket: &Path) -> Result<(), Error> {
    let mut signals = Signals::install()?;
    reserve_descriptors();
    // The bucket arrays: `auto` sized from the host's memory and possible CPUs.
    let host = kernel::HostSize::read().map_err(Error::HostSize)?;
    let geometry = args.geometry.resolve(&host);
    let arrays = Arrays::of(&geometry, host.cpus);
    // Everything the operator gave is checked before anything is loaded, bound or waited for.
    let (file, text) = config::load_with_text(&args.config).map_err(Error::File)?;
    // A file from before the format marker keeps its meaning: said once, here.
    if let Some(names) = text.as_deref().and_then(config::unversioned) {
        info!("note: {}", config::unversioned_note(&args.config, &names));
    }
    // --rate and --burst edit the policy `default` as `policy set default --rate .. --burst ..`
    // would: its other fields (a dry-run mode, a key) stay as the file has them.
    let default_name = Name::from_static(DEFAULT_POLICY);
    let default_edit = args.rate.map(|rate| PolicyEdit {
        rate: Some(rate),
        burst: args.burst.map(BurstEdit::Count),
        ..PolicyEdit::default()
    });
    let desired = |ids: &BTreeMap<Name, u16>, max_frame: u64| -> Result<State, Error> {
        let state = State::build_for(&file, ids, max_frame)
            .map_err(|error| Error::Config { path: args.config.clone(), error })?;
        match &default_edit {
            Some(edit) => edit
                .apply(&default_name, state.policy(&default_name).map(|e| &e.def))
                .and_then(|def| state.with_policy(def))
                .map_err(Error::DefaultPolicy),
            None => Ok(state),
        }
    };
    desired(&BTreeMap::new(), config::DEFAULT_MAX_FRAME)?;
    // One daemon per interface, whatever its --pin-dir: the lock on the interface's state,
    // before anything is bound or read (its bans above all), held until exit.
    let pins = PinDir::new(&args.pin_dir, &args.iface);
    let mut state_lock = instance::StateLock::take(&args.state_dir, &args.iface, pins.dir())?;
    // The metrics listener (and its probes) first, so /readyz can say what the daemon waits for.
    let (shared, health) = (stats::Shared::default(), Health::new());
    let metrics_addr = match args.metrics {
        MetricsAt::Off => None,
        MetricsAt::At(addr) => Some(addr),
        MetricsAt::Auto => Some(SocketAddr::from(([127, 0, 0, 1], auto_metrics_port(&args.iface)))),
    };
    if let Some(addr) = metrics_addr {
        metrics::serve(addr, shared.clone(), health.routes()).await?;
        info!(address = %addr, auto = args.metrics == MetricsAt::Auto, "serving metrics at /metrics, probes at /readyz and /livez");
    }
    health.not_ready(format!("waiting for interface {}", args.iface));
    if !wait_for_interface(&args.iface, args.wait_iface, &mut signals).await? {
        return Ok(());
    }
    // Byte policies must hold the largest frame the interface can carry.
    let max_frame = kernel::interface_mtu(&args.iface).map_or(config::DEFAULT_MAX_FRAME, config::max_frame_for_mtu);
    desired(&BTreeMap::new(), max_frame)?;

    // Nor another limiter on its hooks (a daemon under another --pin-dir and --state-dir, or
    // the program one left pinned): this one would judge every packet again.
    if let Some(other) = kernel::other_limiter(&args.iface, &pins) {
        return Err(kernel::Error::OtherLimiter(Box::new(other)).into());
    }
    // One daemon per pin directory: its lock, taken before anything is written (a live owner
    // makes this fail with its pid, having changed nothing), held until exit.
    let claim = pins.claim()?;
    if let Some(note) = claim.mounted() {
        info!(note, "bpffs");
    }
    let mut made = Made::default();
    health.not_ready(format!("loading and attaching the program on {}", args.iface));
    let probes = Probes { shared, health, metrics_addr, arrays };
    let started =
        start(&args, socket, &pins, (&file, text.as_deref()), |ids| desired(ids, max_frame), probes, &mut made).await;
    let (mut daemon, listener, refusals) = match started {
        Ok(started) => started,
        Err(e) => {
            // The limiter this start loaded is gone by now: unpinning releases its link.
            if made.pins
                && let Err(e) = pins.remove_pins()
            {
                warn!(error = %e, "removing the pins of the failed start");
            }
            if made.socket {
                let _ = std::fs::remove_file(socket);
            }
            claim.remove_created();
            return Err(e);
        }
    };
    state_lock.keep_dirs();
    let result = daemon.serve(listener, refusals, &args, signals).await;
    notify(&[sd_notify::NotifyState::Stopping]);
    if let Err(e) = std::fs::remove_file(socket) {
        warn!(socket = %socket.display(), error = %e, "could not remove the control socket");
    }
    // Fail static on purpose, whatever stopped the loop: the next daemon adopts the program, its
    // state and its salt; `limiter-ctl detach` is the one step that takes it off.
    let left = left_behind(daemon.limiter(), &pins, &args.iface, claim.mounted().is_some());
    result.and(left)
}

/// The exit report, checked rather than assumed: the pins are all there and the program on the
/// interface is this daemon's, so the next daemon adopts it. Anything else is an error that says
/// what happened; a check the kernel could not answer is a warning, not a failed stop.
fn left_behind(limiter: &Limiter, pins: &PinDir, iface: &str, mounted: bool) -> Result<(), Error> {
    if !pins.complete() {
        let dir = pins.dir().to_path_buf();
        tracing::error!(pins = %dir.display(), "the pins were removed while the daemon ran: the program leaves {iface} as this daemon exits");
        return Err(Error::PinsGone { dir });
    }
    if kernel::lookup_index(iface) == kernel::Lookup::Gone {
        warn!(iface, pins = %pins.dir().display(), "interface gone: left pinned; the next daemon attaches when it is back");
        return Ok(());
    }
    let ours = limiter.program_id().ok();
    // What runs at the limiter's hook: its own program (None), something else, or unknown (Err).
    let found = match limiter.hook() {
        Some(kernel::Hook::Tc) if limiter.attach_mode().ok() == Some(kernel::AttachMode::Netlink) => {
            match kernel::tc_filter::filters(iface) {
                Ok(filters) if filters.iter().any(|f| f.program_id().is_some() && f.program_id() == ours) => Ok(None),
                Ok(filters) => Ok(Some(format!("at tc ingress: {}", kernel::tc_filter::listed(&filters)))),
                Err(e) => Err(e.to_string()),
            }
        }
        Some(kernel::Hook::Tc) => match kernel::tcx::programs(iface) {
            Ok(chain) if chain.iter().any(|p| Some(p.id) == ours) => Ok(None),
            Ok(chain) => Ok(Some(format!("at tc ingress: {}", kernel::tcx::listed(&chain)))),
            Err(e) => Err(e.to_string()),
        },
        _ => match kernel::pins::xdp_program(iface) {
            Ok(Some(found)) if Some(found.id) == ours => Ok(None),
            Ok(found) => Ok(Some(found.map_or_else(|| "no XDP program".to_string(), |p| p.to_string()))),
            // Under systemd, the unit must allow AF_NETLINK.
            Err(e) => Err(format!("asking the kernel over rtnetlink failed: {e}")),
        },
    };
    match found {
        Ok(None) => {
            info!(iface, pins = %pins.dir().display(), "left attached and pinned, enforcing: the next daemon adopts it (buckets, counters and salt); `limiter-ctl detach --iface {iface}` takes it off");
            if mounted {
                warn!(
                    "the pins are on the bpffs this daemon mounted: if that mount goes (a mount namespace of the daemon's own), the program goes with it"
                );
            }
            Ok(())
        }
        // The pins are all there, so the link is too: only the check is missing. Not a failed
        // stop (systemd would mark the unit failed for a question it could not ask).
        Err(error) => {
            warn!(iface, pins = %pins.dir().display(), %error, "left pinned; could not check that the program is still attached: `bpftool net show dev {iface}` shows it");
            Ok(())
        }
        Ok(Some(found)) => {
            tracing::error!(iface, %found, "the program is not attached to {iface} any more");
            Err(Error::NotAttachedAtExit { iface: iface.into(), found })
        }
    }
}

/// Waits (up to `limit`) for `iface` to exist; says so once. False if SIGTERM or SIGINT came
/// first (`systemctl stop` while waiting at boot). Polled: the wait is for boot-time stragglers,
/// where a tenth of a second does not matter.
async fn wait_for_interface(iface: &str, limit: Duration, signals: &mut Signals) -> Result<bool, Error> {
    if kernel::interface_exists(iface) {
        return Ok(true);
    }
    if limit.is_zero() {
        return Err(Error::NoSuchInterface(iface.into()));
    }
    let wait = humantime::format_duration(limit).to_string();
    info!(iface, wait = %wait, "interface not there yet: waiting for it (--wait-iface)");
    notify(&[sd_notify::NotifyState::Status(&format!("waiting up to {wait} for interface {iface} to appear"))]);
    let deadline = tokio::time::Instant::now() + limit;
    while !kernel::interface_exists(iface) {
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::InterfaceNeverAppeared { iface: iface.into(), waited: wait });
        }
        tokio::select! {
            _ = tokio::time::sleep(IFACE_POLL) => {}
            _ = signals.sigterm.recv() => return Ok(stopped_waiting("SIGTERM")),
            _ = signals.sigint.recv() => return Ok(stopped_waiting("SIGINT")),
            _ = signals.sigusr2.recv() => return Ok(stopped_waiting("SIGUSR2")),
        }
    }
    info!(iface, "interface appeared");
    Ok(true)
}

fn stopped_waiting(signal: &str) -> bool {
    info!(signal, "stopping while waiting for the interface: nothing was attached");
    false
}

/// What the metrics listener reads: the snapshot, the probes' state, and where it listens.
struct Probes {
    shared: stats::Shared,
    health: Health,
    metrics_addr: Option<SocketAddr>,
    /// The bucket arrays, resolved: what the limiter is loaded with, and `stats` says.
    arrays: Arrays,
}

/// Binds the socket, loads (or adopts) the program, makes its maps say what the config says,
/// attaches, and tells systemd (and /readyz) it is ready. `made` says what it created.
async fn start(
    args: &Options,
    socket: &Path,
    pins: &PinDir,
    (file, text): (&config::ConfigFile, Option<&str>),
    desired: impl Fn(&BTreeMap<Name, u16>) -> Result<State, Error>,
    probes: Probes,
    made: &mut Made,
) -> Result<(Daemon, socket::Control, AsyncFd<kernel::Refusals>), Error> {
    let Probes { shared, health, metrics_addr, arrays } = probes;
    let listener = bind(socket, args.socket_group)?;
    made.socket = true;
    // A program the verifier refuses leaves its log beside the socket (the error names it).
    if let Some(dir) = socket.parent() {
        kernel::keep_verifier_logs_in(dir);
    }

    // A place at tc ingress naming a program that is not there (or, through netlink, a priority
    // another filter holds) is refused before anything is loaded (a pinned attachment keeps its
    // place: nothing to check then).
    if args.placement.hook == kernel::HookRequest::Tc && !pins.has_link() {
        kernel::tc_api::check_place(&args.iface, &args.placement.tcx, args.placement.tc_api)?;
    }
    let geometry = arrays.geometry();
    let mut limiter = Limiter::open_pinned(geometry, pins.clone())?;
    made.pins = !limiter.adopted() && limiter.replaces_incompatible().is_none();
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
    // The expiring entries (bans) in force before the program is attached: a restart keeps
    // each with the time it had left.
    let mut bans = bans::Bans::new(Some(bans::Bans::file_for(&args.state_dir, &args.iface)));
    bans.restore(&mut limiter, state.list(config::List::Allow))?;
    limiter.set_sampling_within(args.sample_refusals, args.samples_per_s)?;
    // SAFETY: the stream owns its descriptor (the ring's) and keeps it open for as long as the
    // AsyncFd lives.
    let refusals =
        unsafe { AsyncFd::register(limiter.refusals()?) }.map_err(|e| Error::RefusalRing(e.into_parts().1))?;
    let attached = limiter.attach_as(&args.iface, &args.placement)?;
    if let Some(error) = &attached.mode_unknown {
        warn!(iface = %args.iface, %error, mode = %attached.mode, "could not ask the kernel which mode the replaced limiter's link is in (rtnetlink): stats and metrics assume this one; under systemd, the unit must allow AF_NETLINK");
    }
    if let Some(reason) = &attached.fallback {
        warn!(iface = %args.iface, %reason, "native XDP unavailable, fell back to skb mode (slower: packets get an skb first)");
    }
    if let Some(repaired) = &attached.repaired {
        warn!(iface = %args.iface, "{repaired}");
    }
    if let Some(why) = &attached.lingering {
        warn!(iface = %args.iface, "{why}");
    }
    let event = match (attached.replaced, limiter.replaces_incompatible()) {
        (true, None) => "adopted the pinned limiter: program replaced in place, buckets, counters and salt kept",
        (_, Some(why)) => {
            warn!(iface = %args.iface, pins = %pins.dir().display(), reason = %why, "the pinned limiter could not be adopted");
            "replaced the pinned limiter in place: no gap, but its state could not be adopted, so buckets, counters and salt start afresh"
        }
        (false, None) => "attached",
    };
    info!(
        iface = %args.iface,
        hook = %attached.mode.hook(),
        mode = %attached.mode,
        policies = state.policies().count(),
        buckets = arrays.buckets,
        rows = arrays.rows,
        // Quoted (Debug): values with spaces stay one field for whoever reads the line.
        buckets_memory = ?format!("{} ({} CPUs)", kernel::bytes_text(arrays.buckets_bytes), arrays.cpus),
        host_buckets = arrays.host_buckets,
        host_rows = arrays.host_rows,
        host_buckets_memory = ?kernel::bytes_text(arrays.host_buckets_bytes),
        config = %args.config.display(),
        socket = %socket.display(),
        pins = %pins.dir().display(),
        "{event}"
    );
    if let Some(from) = attached.moved_from {
        info!(iface = %args.iface, from = %from, to = %attached.mode, "moved without a gap (--attach {}): attached at {} first, then released {}", attached.mode.hook(), attached.mode.hook(), from.hook());
    }
    if let Some(why) = &attached.why_tc {
        log_tc_api(&args.iface, &attached, why);
    }
    let mut daemon = Daemon::new(limiter, state, args, shared, health.clone(), longest_window, arrays);
    daemon.bans = bans;
    daemon.start_up(file, text)?;
    health.ready();
    let status = format!(
        "enforcing on {} ({}){}",
        args.iface,
        where_words(attached.mode),
        metrics_addr.map(|a| format!(", metrics at http://{a}/metrics")).unwrap_or_default()
    );
    // Ready only now: `systemctl start` returning means the program is attached.
    notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&status)]);
    Ok((daemon, listener, refusals))
}

/// The line saying the program judges at tc ingress, why there, and through which API and why:
/// `hook=tc api=netlink reason="tcx needs Linux 6.6; this kernel is 6.1.0-50-amd64"`.
pub(super) fn log_tc_api(iface: &str, attached: &kernel::Attached, why: &kernel::TcReason) {
    let (hook, api, why) = (attached.mode.hook(), attached.mode, why.to_string());
    match &attached.api_reason {
        // Quoted (Debug): values with spaces stay one field for whoever reads the line.
        Some(reason) => info!(
            iface,
            hook = %hook,
            api = %api,
            reason = ?reason.to_string(),
            why = ?why,
            "judging at tc ingress through a netlink filter on the clsact qdisc: after XDP and any tcx programs, \
             beside the other tc filters, in order of priority"
        ),
        None => {
            info!(iface, hook = %hook, api = %api, why = ?why, "judging at tc ingress (tcx): after XDP, beside the other programs there")
        }
    }
}

/// Where the program runs, in words: "native mode", "skb mode", "at tc ingress (tcx)", "at tc
/// ingress (netlink filter)".
fn where_words(mode: kernel::AttachMode) -> String {
    match mode {
        kernel::AttachMode::Tcx => "at tc ingress (tcx)".into(),
        kernel::AttachMode::Netlink => "at tc ingress (netlink filter)".into(),
        xdp => format!("{xdp} mode"),
    }
}

#[cfg(test)]
mod tests {
    use super::auto_metrics_port;

    #[test]
    fn the_auto_metrics_port_is_derived_from_the_name_alone() {
        // FNV-1a-32("eth0") = 0x67b1_9724 (computed apart, from the published constants).
        assert_eq!(auto_metrics_port("eth0"), 9465 + (0x67b1_9724_u32 % 535) as u16);
        assert_eq!(auto_metrics_port("eth0"), auto_metrics_port("eth0"));
        assert_ne!(auto_metrics_port("eth0"), auto_metrics_port("eth1"));
        for name in ["lo", "eth0", "ens3", "enp1s0f0", "enp1s0f1", "bond0.100", "a-very-long-name"] {
            assert!((9465..=9999).contains(&auto_metrics_port(name)), "{name}");
        }
    }
}

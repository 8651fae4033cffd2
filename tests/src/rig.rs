//! A daemon on a veth pair, ready to be flooded: the namespaces, the daemon's scratch directory
//! and pins, the daemon itself, and floods (full speed or paced, stoppable) with a capture of
//! what got through. Used by the policy, rotation and metrics tests.
//!
//! Fields drop in order: the daemon (SIGINT, if it still runs: it leaves its program attached
//! and pinned), then the scratch directory and pins (removing them detaches the program), then
//! the namespaces.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use limiter_common::maps::Counters;
use nix::sys::signal::Signal;

use crate::{
    bounds::{self, Judged, check_upper},
    capture::{Capture, Captured},
    cpu::flood_cpu,
    daemon::{Daemon, LEFT, Launch, Runner, SIGNAL_TIMEOUT, Scratch, Snapshot},
    flood::{Flow, FrameSpec, Frames, L4, Limits, PacketSocket, Report, Sources, Steer, Stream},
    netns::{End, TestNet},
    scrape,
};

pub const SEC: u64 = 1_000_000_000;

pub struct Rig {
    pub daemon: Daemon,
    pub scratch: Scratch,
    pub net: TestNet,
}

impl Rig {
    /// Namespaces, then the daemon attached natively in the receiver's with `extra` arguments.
    pub fn start(extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_with(Runner::NetOnly, extra)
    }

    /// [`Rig::start`], the daemon entering its namespace the way `runner` says.
    pub fn start_with(runner: Runner, extra: &[&str]) -> anyhow::Result<Self> {
        Self::start_launched(Launch { runner, ..Launch::default() }, extra)
    }

    /// [`Rig::start`], the daemon launched the way `launch` says.
    pub fn start_launched(launch: Launch, extra: &[&str]) -> anyhow::Result<Self> {
        let net = TestNet::new().context("test network")?;
        let scratch = Scratch::new().context("scratch directory")?;
        let mut daemon = Daemon::launch(&net.receiver, &scratch, extra, launch).context("starting the daemon")?;
        daemon.wait_attached(&net.receiver)?;
        Ok(Self { daemon, scratch, net })
    }

    /// A new daemon on the same config, socket and pins, with `extra` arguments (the old one
    /// must have exited); it adopts the pinned limiter the old one left, if any.
    pub fn restart(&mut self, extra: &[&str]) -> anyhow::Result<()> {
        self.restart_launched(Launch::default(), extra)
    }

    /// [`Rig::restart`], the daemon launched the way `launch` says.
    pub fn restart_launched(&mut self, launch: Launch, extra: &[&str]) -> anyhow::Result<()> {
        let mut daemon =
            Daemon::launch(&self.net.receiver, &self.scratch, extra, launch).context("restarting the daemon")?;
        daemon.wait_running(&self.net.receiver)?;
        self.daemon = daemon;
        Ok(())
    }

    /// SIGTERM, as `systemctl stop` and `restart` send: the daemon must exit 0, saying it left
    /// its program attached and pinned ([`LEFT`]); panics with everything it said otherwise.
    pub fn sigterm(&mut self) {
        self.daemon.signal(Signal::SIGTERM).expect("SIGTERM");
        let status = self.daemon.wait_exit(SIGNAL_TIMEOUT).expect("the daemon should exit on SIGTERM");
        let out = self.daemon.output();
        assert!(status.success(), "exit {status} on SIGTERM:\n{out}");
        assert!(out.contains(LEFT), "no '{LEFT}' line:\n{out}");
    }

    /// `systemctl restart`: [`Rig::sigterm`], then at once a new daemon with `extra`, which must
    /// adopt what the old one left. The old program stays in the pinned link until then; the
    /// new one swaps its own in, the pins the same files. Returns when it had adopted, its line
    /// and its program; panics if anything of that fails.
    pub fn restart_adopting(&mut self, extra: &[&str]) -> Adopted {
        let iface = self.net.receiver.iface.clone();
        let old = self.daemon.program().expect("the daemon's program");
        let pins = self.scratch.pinned(&iface).expect("pins");
        self.sigterm();
        let held = self.daemon.link().expect("the pinned link").map(|l| l.program);
        assert_eq!(held, Some(old), "the program left the pinned link with the daemon");
        assert_eq!(self.scratch.pinned(&iface).expect("pins"), pins, "the pins changed when the daemon stopped");
        let (daemon, line) =
            Daemon::adopt(&self.net.receiver, &self.scratch, extra).unwrap_or_else(|e| panic!("{e:#}"));
        let at = Instant::now();
        self.daemon = daemon;
        eprintln!("restarted: {line}");
        let program = self.daemon.program().expect("the new daemon's program");
        assert_ne!(program, old, "the new daemon's program is not in the link");
        assert_eq!(self.scratch.pinned(&iface).expect("pins"), pins, "adopting replaced pinned objects");
        Adopted { at, line, program, old }
    }

    /// `limiter-ctl ARGS...` against the daemon; panics with everything it said unless it exits 0.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        self.daemon.ctl_ok(args).unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// `policy show NAME --json`, parsed.
    pub fn show(&self, name: &str) -> serde_json::Value {
        let out = self.ctl_ok(&["policy", "show", name, "--json"]);
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("`policy show {name} --json` is not JSON ({e}): {out}"))
    }

    /// A policy's id, from `policy show NAME --json`.
    pub fn policy_id(&self, name: &str) -> u16 {
        let v = self.show(name);
        v["id"].as_u64().and_then(|id| u16::try_from(id).ok()).unwrap_or_else(|| panic!("no id in {v}"))
    }

    /// The daemon's kernel maps; panics if they cannot be read.
    pub fn snapshot(&self) -> Snapshot {
        self.daemon.maps().unwrap_or_else(|e| panic!("reading the daemon's maps: {e:#}"))
    }

    /// Frames of `l4` to `dport` from `src` to the receiver (of `src`'s family).
    pub fn spec(&self, src: IpAddr, dport: u16) -> FrameSpec {
        self.net.frames_to(src.is_ipv6(), dport)
    }

    /// Frames of `l4` to `port` from `src` (IPv4 or IPv6) to the receiver.
    pub fn stream(&self, l4: L4, port: u16, src: &str) -> Stream {
        let src: IpAddr = src.parse().unwrap_or_else(|e| panic!("source address {src:?}: {e}"));
        Stream { spec: self.spec(src, port), l4, sources: Sources::One(src) }
    }

    /// UDP to `dport` from `sources`.
    pub fn udp(&self, sources: Sources, dport: u16) -> Stream {
        let first = match &sources {
            Sources::One(a) => *a,
            Sources::Spoofed { prefix, .. } | Sources::Sweep(prefix) => prefix.addr,
        };
        Stream { spec: self.spec(first, dport), l4: L4::Udp, sources }
    }

    /// Starts a capture on the receiver, then `streams` (interleaved) from the sender's
    /// namespace on a thread pinned to [`flood_cpu`], at `per_sec` if given (else full speed),
    /// until `limits` ([`Limits::timed`] or [`Limits::counted`]; their CPU is ignored) or
    /// [`Flooding::stop`].
    pub fn start_flood(&self, streams: &[Stream], limits: Limits, per_sec: Option<f64>) -> anyhow::Result<Flooding> {
        let capture = Capture::start(&self.net.receiver)?;
        Ok(Flooding::start(&self.net.sender, streams, limits.on_cpu(flood_cpu()), per_sec, Some(capture)))
    }

    /// A flood run to its end (see [`Rig::start_flood`]).
    pub fn flood(&self, streams: &[Stream], limits: Limits, per_sec: Option<f64>) -> anyhow::Result<Run> {
        self.start_flood(streams, limits, per_sec)?.finish()
    }

    /// [`Rig::start_flood`] with every policy's per-CPU counters read first: the baseline of
    /// [`Rig::judged`] for the resulting [`Run`].
    pub fn start_counted_flood(
        &self,
        streams: &[Stream],
        limits: Limits,
        per_sec: Option<f64>,
    ) -> anyhow::Result<Flooding> {
        let counted = self.daemon.all_counters().context("reading the daemon's counters")?;
        let mut flooding = self.start_flood(streams, limits, per_sec)?;
        flooding.counted = Some(counted);
        Ok(flooding)
    }

    /// One UDP source flooding `port` at full speed until stopped, with the counters read first
    /// (see [`Rig::start_counted_flood`]), `warm_up` of it under way before this returns: the
    /// flow to count and the flood. Its time limit ([`SAFETY_NET`]) is far beyond any test's wait.
    pub fn flood_one_source(&self, source: IpAddr, port: u16, warm_up: Duration) -> anyhow::Result<(Flow, Flooding)> {
        self.flood_one_source_at(source, port, None, warm_up)
    }

    /// [`Rig::flood_one_source`], paced at `per_sec` if given.
    pub fn flood_one_source_at(
        &self,
        source: IpAddr,
        port: u16,
        per_sec: Option<f64>,
        warm_up: Duration,
    ) -> anyhow::Result<(Flow, Flooding)> {
        let stream = self.udp(Sources::One(source), port);
        let flooding = self.start_counted_flood(std::slice::from_ref(&stream), Limits::timed(safety_net()), per_sec)?;
        thread::sleep(warm_up);
        Ok((flow(&stream, source), flooding))
    }

    /// What policy `id` counted during `run` (from [`Rig::start_counted_flood`]), per CPU.
    pub fn judged(&self, run: &Run, id: u16) -> Judged {
        let counted = run.counted.as_ref().expect("judged: the run has no baseline (use Rig::start_counted_flood)");
        let now = self.daemon.counters(id).unwrap_or_else(|e| panic!("reading counters of policy {id}: {e:#}"));
        Judged::between(&counted[usize::from(id)], &now)
    }

    /// GET /metrics from `addr` on a thread in the receiver's namespace.
    pub fn scrape(&self, addr: SocketAddr) -> anyhow::Result<scrape::Response> {
        self.net.receiver.run(move || scrape::get(addr, "/metrics", Duration::from_secs(5)))?
    }
}

/// A restart that adopted ([`Rig::restart_adopting`]).
pub struct Adopted {
    /// When the new daemon had adopted (its line read, its program found).
    pub at: Instant,
    pub line: String,
    /// The new daemon's program, and the one it replaced.
    pub program: u32,
    pub old: u32,
}

/// A flood under way: its sender thread, its stop flag, and the capture (if any).
pub struct Flooding {
    stop: Arc<AtomicBool>,
    capture: Option<Capture>,
    /// Every policy's per-CPU counters before the flood, if [`Rig::start_counted_flood`] read them.
    counted: Option<Vec<Vec<Counters>>>,
    thread: Option<SenderThread>,
    /// Taken before the sender thread was started (before its first send).
    pub started: Instant,
}

/// The sender's thread: entering the namespace, then the flood.
type SenderThread = thread::JoinHandle<anyhow::Result<anyhow::Result<(Frames, Report)>>>;

impl Flooding {
    /// `streams` from `sender`'s namespace under `limits`, paced at `per_sec` if given.
    pub fn start(
        sender: &End,
        streams: &[Stream],
        limits: Limits,
        per_sec: Option<f64>,
        capture: Option<Capture>,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, iface, streams) = (stop.clone(), sender.iface.clone(), streams.to_vec());
        let started = Instant::now();
        let thread = sender.spawn(move || {
            let frames = Frames::mix(&streams)?;
            let steer = Steer { per_sec, stop: Some(&flag) };
            let report = frames.send_steered(&mut PacketSocket::open(&iface)?, &limits, &steer)?;
            Ok((frames, report))
        });
        Self { stop, capture, counted: None, thread: Some(thread), started }
    }

    /// Asks the sender to stop (it stops before its next frame).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Waits for the sender, then for the link to go quiet; the capture must have missed nothing.
    pub fn finish(mut self) -> anyhow::Result<Run> {
        let thread = self.thread.take().context("finished twice")?;
        let (frames, report) = thread.join().map_err(|_| anyhow::anyhow!("the flood thread panicked"))???;
        let captured = match self.capture.take() {
            Some(c) => c.finish()?,
            None => Captured::default(),
        };
        anyhow::ensure!(captured.drops == 0, "the capture dropped {} frames: counts are incomplete", captured.drops);
        Ok(Run { frames, report, captured, counted: self.counted.take() })
    }
}

impl Drop for Flooding {
    fn drop(&mut self) {
        // A test that fails mid-flood: stop the sender (it is bounded anyway) and let it end.
        self.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A finished flood and what the capture saw of it.
pub struct Run {
    pub frames: Frames,
    pub report: Report,
    pub captured: Captured,
    /// Every policy's per-CPU counters before the flood (from [`Rig::start_counted_flood`]).
    pub counted: Option<Vec<Vec<Counters>>>,
}

impl Run {
    /// Frames of `flow` that went out (exact: the sender goes round robin and retries).
    pub fn sent(&self, flow: &Flow) -> u64 {
        self.frames.sent_per_flow(self.report.sent).get(flow).copied().unwrap_or(0)
    }

    pub fn delivered(&self, flow: &Flow) -> u64 {
        self.captured.packets(|f| f == flow)
    }

    /// From before the first send to the last delivery.
    pub fn window(&self) -> Duration {
        bounds::window(&self.report, self.captured.last())
    }

    /// The capture missed nothing and saw nothing but the flood.
    pub fn check_capture(&self) {
        assert_eq!(self.captured.drops, 0, "the capture dropped frames: counts are incomplete");
        assert_eq!(self.captured.other, 0, "frames other than the flood's reached the receiver");
    }
}

/// A hand-over under way (a restart, an upgrade, a pod replacement, a crash and a restart): one
/// source flooding at full speed, counted from before it started, and beside it a source keeping
/// to its rate (paced at [`STEADY_SHARE`] of the policy's rate), both pinned to [`flood_cpu`].
pub struct HandOver {
    pub flood: Flow,
    pub steady: Flow,
    /// The policy's rate (the steady source sends at [`STEADY_SHARE`] of it).
    per_sec: f64,
    flooding: Flooding,
    steadily: Flooding,
}

/// The source keeping to its rate sends at this share of the policy's rate.
pub const STEADY_SHARE: f64 = 0.5;

impl Rig {
    /// [`Rig::flood_one_source`] from `flood` to `port`, and `steady` to `port + 1` paced at
    /// [`STEADY_SHARE`] of `per_sec` (the policy's rate), on the same CPU (so both are judged
    /// there), `warm_up` of both under way before this returns.
    pub fn start_hand_over(
        &self,
        flood: IpAddr,
        steady: IpAddr,
        port: u16,
        per_sec: f64,
        warm_up: Duration,
    ) -> anyhow::Result<HandOver> {
        self.start_paced_hand_over(flood, steady, port, per_sec, None, warm_up)
    }

    /// [`Rig::start_hand_over`], the flood paced at `flood_per_sec` if given (a slow machine
    /// keeps a paced flood's pace through a hand-over that takes minutes there).
    pub fn start_paced_hand_over(
        &self,
        flood: IpAddr,
        steady: IpAddr,
        port: u16,
        per_sec: f64,
        flood_per_sec: Option<f64>,
        warm_up: Duration,
    ) -> anyhow::Result<HandOver> {
        let (flood, flooding) = self.flood_one_source_at(flood, port, flood_per_sec, Duration::ZERO)?;
        let stream = self.udp(Sources::One(steady), port + 1);
        let limits = Limits::timed(safety_net()).on_cpu(flood_cpu());
        let steadily = Flooding::start(
            &self.net.sender,
            std::slice::from_ref(&stream),
            limits,
            Some(STEADY_SHARE * per_sec),
            None,
        );
        thread::sleep(warm_up);
        Ok(HandOver { flood, steady: flow(&stream, steady), per_sec, flooding, steadily })
    }
}

impl HandOver {
    /// Stops both senders and waits for them.
    pub fn finish(self) -> anyhow::Result<HandedOver> {
        self.flooding.stop();
        self.steadily.stop();
        let steady = self.steadily.finish()?.report;
        let run = self.flooding.finish()?;
        Ok(HandedOver { run, steady, flood: self.flood, steady_flow: self.steady, per_sec: self.per_sec })
    }
}

/// A finished [`HandOver`].
pub struct HandedOver {
    /// The flood's run; its capture saw both sources.
    pub run: Run,
    /// The steady sender's report.
    pub steady: Report,
    pub flood: Flow,
    pub steady_flow: Flow,
    per_sec: f64,
}

/// What a hand-over must keep, both ways, for the flood and the steady source of `hand_over`
/// (finished: `run`, `steady`). The policy's per-CPU counters, read before the floods (`before`,
/// through the first program) and after them (`after`, through the last), live in the pinned
/// maps every program shares, so:
/// - "0 unlimited packets": they count every frame sent, of both sources, exactly once as
///   admitted or refused (a frame that passed while no program was attached is counted by none;
///   counters that restarted would count fewer), and every admitted frame was delivered;
/// - the upper side: the flood got no more than one bucket's bound over the whole run, on the
///   CPU the sender is pinned to (no fresh burst at the hand-over);
/// - the lower side: the steady source, at half the rate, was never refused (every frame of it
///   delivered), and the flood got at least 90% of what an exact bucket, fresh at its start,
///   admits of the flood as it was offered, its stalls included ([`bounds::check_lower`]): a
///   limiter that refused everything after the hand-over fails both; and from `handed_over` (when
///   the new program was in place) to the end, the flood, its bucket spent, got at least 90% of
///   the rate over that time, less what the sender's stalls and the capture's lag can have cost
///   (a short tail after a long hand-over would hide in the whole run's 10%).
///
/// Returns what was judged.
#[track_caller]
pub fn check_hand_over(
    what: &str,
    done: &HandedOver,
    handed_over: Instant,
    before: &[Counters],
    after: &[Counters],
    limit: &limiter_common::Gcra,
) -> Judged {
    check_hand_over_with_fresh(what, done, handed_over, before, after, limit, 0)
}

/// [`check_hand_over`] for a hand-over that starts `fresh` buckets afresh, as a daemon that
/// cannot adopt the pinned state does (it replaces the program in place with fresh maps:
/// docs/OPERATIONS.md, "When it cannot adopt"): the upper side allows the flood one more burst
/// per fresh start. Each bucket admits at most `floor((t_i + capacity) / emission)` over its own
/// time `t_i`, so the run's `fresh + 1` buckets in turn admit at most the bound over the whole
/// window of a bucket with `fresh + 1` times the capacity. `before` and `after` must then count
/// every frame of the run across the programs' counters (the replaced program's read at the end,
/// plus the new one's, which start from zero).
#[track_caller]
pub fn check_hand_over_with_fresh(
    what: &str,
    done: &HandedOver,
    handed_over: Instant,
    before: &[Counters],
    after: &[Counters],
    limit: &limiter_common::Gcra,
    fresh: u64,
) -> Judged {
    let HandedOver { run, steady, flood, steady_flow, per_sec } = done;
    let judged = Judged::between(before, after);
    let (sent, delivered) = (run.sent(flood), run.delivered(flood));
    let steady_delivered = run.delivered(steady_flow);
    eprintln!(
        "{what}: flood {}; steady {steady}; {judged}; delivered {delivered} of the flood, {steady_delivered} of the \
         steady source",
        run.report
    );
    assert!(judged.total.refused_packets > 0, "{what}: nothing was refused, so nothing was measured: {judged}");
    assert_eq!(
        judged.total.admitted_packets + judged.total.refused_packets,
        sent + steady.sent,
        "{what}: admitted + refused vs sent by both sources over the whole run ({judged}): a frame not judged by \
         any program passed unlimited (or the counters restarted)"
    );
    assert_eq!(judged.total.admitted_packets, delivered + steady_delivered, "{what}: admitted vs delivered");
    let upper = limiter_common::Gcra { capacity: limit.capacity * (1 + fresh), ..*limit };
    let whole_run = match fresh {
        0 => format!("{what}: the flood, delivered over the whole run"),
        n => format!("{what}: the flood, delivered over the whole run with {n} fresh burst(s)"),
    };
    check_upper(&whole_run, delivered, &upper, &judged, run.window());
    // The steady source must have kept its pace through the hand-over, or "never refused" says
    // little: a paced sender catches up after a stall, so it falls behind only if stalled for long.
    let due = STEADY_SHARE * per_sec * steady.duration().as_secs_f64();
    assert!(
        steady.sent as f64 >= 0.9 * due,
        "{what}: the steady sender sent {} in {:?}, under 90% of the {due:.0} due at its pace ({steady}): the \
         machine could not keep the pace, so the run does not test the hand-over",
        steady.sent,
        steady.duration()
    );
    let across = format!("{what}: the source keeping to half the rate, across the hand-over");
    bounds::check_steady(&across, steady_delivered, limit, steady);
    bounds::check_lower(&format!("{what}: the flood over the whole run"), delivered, limit, &run.report);
    let end = run.report.last.expect("a flood records its end");
    let t = end.saturating_duration_since(handed_over);
    let got = run.captured.between(|f| f == flood, handed_over, end + Duration::from_secs(1));
    let rate_over = |d: Duration| limit.bound(bounds::nanos(d)) - limit.bound(0);
    let lost = bounds::stall_cost(limit, &run.report, 1) + rate_over(2 * CAPTURE_LAG);
    let least = rate_over(t).saturating_sub(lost);
    eprintln!("  {what}: the flood after the hand-over ({t:?}): {got} >= 90% of {least}");
    assert!(
        t >= Duration::from_millis(200),
        "{what}: the flood ran only {t:?} after the hand-over ({}): too short to test it (the sender stopped early)",
        run.report
    );
    assert!(
        got * 10 >= least * 9,
        "{what}: the flood got {got} in the {t:?} after the hand-over, under 90% of {least} (the rate over that \
         time less {lost} for the sender's stalls and the capture's lag): the new program refused what the rate \
         allows"
    );
    judged
}

/// The time limit of a flood a test stops itself: 60 s, far beyond any test's wait on this
/// machine, stretched on a slower one ([`crate::slowdown`]).
pub fn safety_net() -> Duration {
    crate::slowdown::stretch(Duration::from_secs(60))
}

/// Frames are timed when the capture reads them, a little after XDP passed them: at most this.
pub const CAPTURE_LAG: Duration = Duration::from_millis(50);

/// The flow of UDP frames from `src` in `stream`.
pub fn flow(stream: &Stream, src: IpAddr) -> Flow {
    stream.spec.flow(stream.l4, src)
}

/// The flow of a stream from one source ([`Sources::One`]); panics for any other.
pub fn flow_of(stream: &Stream) -> Flow {
    let Sources::One(src) = stream.sources else { panic!("not a stream from one source: {:?}", stream.sources) };
    flow(stream, src)
}

/// The metrics address a daemon listens on by default (inside its namespace).
pub const METRICS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9464);

pub use crate::bounds::total;

//! A daemon on a veth pair, ready to be flooded: the namespaces, the daemon's scratch directory
//! and pins, the daemon itself, and floods (full speed or paced, stoppable) with a capture of
//! what got through. Used by the rotation and metrics tests.
//!
//! Fields drop in order: the daemon (SIGINT: it detaches and unpins, if it still runs), then the
//! scratch directory and pins (a killed daemon's pins: removing them detaches its program), then
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

use crate::{
    bounds,
    capture::{Capture, Captured},
    cpu::flood_cpu,
    daemon::{Daemon, Runner, Scratch},
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
        let net = TestNet::new().context("test network")?;
        let scratch = Scratch::new().context("scratch directory")?;
        let mut daemon = Daemon::spawn_with(runner, &net.receiver, &scratch, extra).context("starting the daemon")?;
        daemon.wait_attached(&net.receiver)?;
        Ok(Self { daemon, scratch, net })
    }

    /// `limiter-ctl ARGS...` against the daemon; panics with everything it said unless it exits 0.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        self.daemon.ctl_ok(args).unwrap_or_else(|e| panic!("{e:#}"))
    }

    /// A policy's id, from `policy show NAME --json`.
    pub fn policy_id(&self, name: &str) -> u16 {
        let out = self.ctl_ok(&["policy", "show", name, "--json"]);
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("policy show {name} --json ({e}): {out}"));
        v["id"].as_u64().and_then(|id| u16::try_from(id).ok()).unwrap_or_else(|| panic!("no id in {v}"))
    }

    /// Frames of `l4` to `dport` from `src` to the receiver (of `src`'s family).
    pub fn spec(&self, src: IpAddr, dport: u16) -> FrameSpec {
        self.net.frames_to(src.is_ipv6(), dport)
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
    /// until `duration`, `packets` or [`Flooding::stop`].
    pub fn start_flood(
        &self,
        streams: &[Stream],
        duration: Duration,
        packets: u64,
        per_sec: Option<f64>,
    ) -> anyhow::Result<Flooding> {
        let capture = Capture::start(&self.net.receiver)?;
        Ok(Flooding::start(
            &self.net.sender,
            streams,
            Limits { packets, duration, cpu: Some(flood_cpu()) },
            per_sec,
            Some(capture),
        ))
    }

    /// A flood run to its end (see [`Rig::start_flood`]).
    pub fn flood(
        &self,
        streams: &[Stream],
        duration: Duration,
        packets: u64,
        per_sec: Option<f64>,
    ) -> anyhow::Result<Run> {
        self.start_flood(streams, duration, packets, per_sec)?.finish()
    }

    /// GET /metrics from `addr` on a thread in the receiver's namespace.
    pub fn scrape(&self, addr: SocketAddr) -> anyhow::Result<scrape::Response> {
        self.net.receiver.run(move || scrape::get(addr, "/metrics", Duration::from_secs(5)))?
    }
}

/// A flood under way: its sender thread, its stop flag, and the capture (if any).
pub struct Flooding {
    stop: Arc<AtomicBool>,
    capture: Option<Capture>,
    thread: Option<thread::JoinHandle<anyhow::Result<anyhow::Result<(Frames, Report)>>>>,
    /// Taken before the sender thread was started (before its first send).
    pub started: Instant,
}

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
        Self { stop, capture, thread: Some(thread), started }
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
        Ok(Run { frames, report, captured })
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
}

/// The flow of UDP frames from `src` in `stream`.
pub fn flow(stream: &Stream, src: IpAddr) -> Flow {
    stream.spec.flow(stream.l4, src)
}

/// The metrics address a daemon listens on by default (inside its namespace).
pub const METRICS: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9464);

/// Sums per-CPU counters.
pub fn total(per_cpu: &[Counters]) -> Counters {
    let mut sum = Counters::default();
    per_cpu.iter().for_each(|c| sum.add(c));
    sum
}

//! Side by side: this limiter, iptables hashlimit, an nftables meter and nothing, enforcing the
//! same per-source policy on the same floods, measured in the same run. Run with
//! `cargo xtask bench --peers` (as root; records BENCHMARKS.md and the plots in docs/bench/).
//!
//! Each run builds fresh namespaces, sets one system up on the receiver, floods it from the
//! sender with the flood generator (pinned to one CPU; on a veth pair the receiver's work
//! happens on that CPU too) and reads: packets the system saw and let through, kernel CPU time of
//! the whole machine, and the memory of the limiting state (this limiter: its maps as the kernel
//! charges them; netfilter: the slab and vmalloc memory the run added beyond what the same flood
//! added with no rules).
//!
//! The limiter runs as it ships: the release `limiter-ctl daemon` (build it first: `cargo build
//! --release -p limiter-ctl --bins`; `cargo xtask bench --peers` does) with its default flags,
//! its policy set through its socket with no scope given. Its cost is the machine's kernel time
//! plus the daemon's user time (its system time is already kernel time); the daemon's own share
//! (user + system) is reported beside it, and once more with no traffic over one period of its
//! bucket scan (15 s; with the floods, when the limiter at XDP is in the run). The bare XDP_DROP
//! run of the same workload is the cost of the flood itself; subtracting it gives each system's
//! net cost.
//!
//! The generator sends live frames where the kernel allows them, else through a packet ring
//! ([`limiter_tests::generator`]); the table says which. The rows of the limiter at XDP and of the
//! bare XDP_DROP need live frames (with the ring, each frame is an skb before XDP, which is not
//! what a NIC costs): on the packet ring their floods are left out, with a note.
//!
//! Options (after `--`), to run a subset quickly, e.g.
//! `cargo bench -p limiter-tests --bench peers -- --only limiter,xdp-drop --workloads one-source --runs 3 --seconds 3 --parts floods --out target/peers-x`:
//! - `--only SYSTEMS`: comma-separated systems (default all): limiter, limiter-tcx (the limiter
//!   at tc ingress, a bare XDP_PASS at XDP as under netfilter), hashlimit-raw, nft-raw,
//!   nft-ingress, hashlimit-input, nft-input, nothing, xdp-drop. Net costs need xdp-drop in the
//!   run; per-dropped costs also need nothing.
//! - `--workloads LIST`: one-source, one-source-1k, spoofed, churn, pair-one-source,
//!   pair-spoofed (default all). Every system enforces 5/s burst 5 per source except on
//!   one-source-1k: the one-source flood at 1000/s burst 100 (issue 16's harness); on the pair
//!   workloads, beside it, a cap of 1000/s burst 1000 over every source together (the pair
//!   OPERATIONS recommends; nftables: a `limit` rule after its meters). The boundary burst and
//!   the memory sweep use 5/s burst 5.
//! - `--runs N` (default 3), `--seconds S` (flood length, default 2).
//! - `--parts LIST`: floods, burst (the boundary burst), memory (the sweep); default all.
//! - `--quick`: a smoke run (1 run of 1 s, a short memory sweep).
//! - `--out DIR`: where the plots go (default target/peers; `cargo xtask bench --peers`: docs/bench).
//! - `--table FILE`: where the table goes (default target/peers.md; xtask records BENCHMARKS.md
//!   from it).
//! - `--images PREFIX`: show the plots in the table, next to their tables, as
//!   `![...](PREFIX/NAME.svg)` (xtask: docs/bench, relative to BENCHMARKS.md).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, Ipv6Addr, UdpSocket},
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail};
use limiter_common::Gcra;
use limiter_tests::{
    cpu::pin_current_thread,
    flood::{FrameSpec, Frames, L4, Limits, PacketSocket, Sources, cap},
    generator::{Generator, Sender, SourceRange},
    netns::TestNet,
    peers::{self, PORT, PerSource, Place, System},
    plot,
};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg, setsockopt, sockopt};
use opts::{Opts, POLICY, Workload, v4};
use table::{bound_shares, headline, mmm, note_left_out, optional, stats};

mod opts;
mod table;

const SENDER_CPU: usize = 1;
/// The systems of the boundary burst and the memory sweep: the algorithm, not where its rules
/// sit, decides both, so each peer appears once, at its best placement.
const EXTRAS: [System; 4] =
    [System::Limiter, System::Hashlimit(Place::Raw), System::Nftables(Place::Raw), System::Nothing];

/// The GCRA of a policy (per source), as the limiter computes its bound.
fn gcra(policy: PerSource) -> anyhow::Result<Gcra> {
    gcra_of(policy.rate_per_s, policy.burst)
}

/// The GCRA of `rate_per_s`, burst `burst`.
fn gcra_of(rate_per_s: u32, burst: u32) -> anyhow::Result<Gcra> {
    Gcra::new(u64::from(rate_per_s), 1_000_000_000, u64::from(burst), 1).map_err(|e| anyhow::anyhow!("{e}"))
}

fn spec(net: &TestNet, v6: bool) -> FrameSpec {
    net.frames_to(v6, PORT)
}

/// One run's measurements.
#[derive(Clone, Copy, Debug, Default)]
struct Run {
    sent: u64,
    offered: u64,
    admitted: u64,
    bound: u64,
    /// Kernel time of the whole machine, plus the limiter's daemon's user time.
    cpu: Duration,
    /// The limiter's daemon's CPU time (user + system) over the flood; None for the others.
    daemon: Option<Duration>,
    /// The wall time the CPU times were taken over (the flood, and the drain after it).
    window: Duration,
    seconds: f64,
    /// Kernel memory (slab + vmalloc) the run added.
    grew: i64,
    /// This limiter's maps, as the kernel charges them.
    maps: Option<i64>,
    keys: Option<u64>,
}

impl Run {
    fn cpu_per_million(&self) -> f64 {
        self.per_million(self.cpu)
    }

    /// [`Run::cpu_per_million`] less the daemon's share: what the kernel program alone costs.
    fn cpu_per_million_without_daemon(&self) -> f64 {
        self.per_million(self.cpu.saturating_sub(self.daemon.unwrap_or_default()))
    }

    /// The daemon's CPU s per million offered.
    fn daemon_per_million(&self) -> Option<f64> {
        Some(self.per_million(self.daemon?))
    }

    /// The daemon's CPU time over the flood, in percent of one core.
    fn daemon_share(&self) -> Option<f64> {
        Some(self.daemon?.as_secs_f64() / self.window.as_secs_f64().max(1e-9) * 100.0)
    }

    fn per_million(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() / (self.offered.max(1) as f64 / 1e6)
    }
}

/// The most the policy lets through for this flood: per key, the GCRA bound over the run or
/// what the key sent, whichever is smaller.
fn bound(gcra: &Gcra, sources: SourceRange, sent: u64, seconds: f64) -> u64 {
    let count = u64::from(sources.count);
    let per_key = |n: u64| n.min(gcra.bound((seconds * 1e9) as u64));
    let (each, extra) = (sent / count, sent % count);
    per_key(each + 1) * extra + per_key(each) * (count - extra)
}

/// One flood of `workload`, every system enforcing the workload's policy.
fn flood(system: System, workload: Workload, length: Duration) -> anyhow::Result<Run> {
    let policy = workload.policy();
    let gcra = gcra(policy)?;
    let net = TestNet::new()?;
    let sources = workload.sources();
    let generator = Generator::new(&spec(&net, sources.first.is_ipv6()), L4::Udp, sources)?;
    let memory_before = peers::kernel_memory()?;
    let receiver = peers::setup(system, &net, policy)?;
    let sender = net.sender.iface.clone();
    let daemon_before = receiver.daemon_cpu()?;
    let cpu_before = peers::busy_cpu()?;
    let window = Instant::now();
    let report = net.sender.run(move || -> anyhow::Result<_> {
        pin_current_thread(SENDER_CPU)?;
        // Bounded by time: the packet cap is far beyond what any machine sends in it.
        generator.send(&sender, cap(length), length)
    })??;
    // Let the receiver's queue drain, and the daemon read the last samples, before reading.
    std::thread::sleep(Duration::from_millis(100));
    let kernel = peers::busy_cpu()?.saturating_sub(cpu_before);
    let daemon = match (daemon_before, receiver.daemon_cpu()?) {
        (Some(before), Some(after)) => Some(after.since(before)),
        _ => None,
    };
    let window = window.elapsed();
    // The daemon's system time is in the machine's kernel time already: only its user time adds.
    let cpu = kernel + daemon.map_or(Duration::ZERO, |d| d.user);
    let counts = receiver.counts(&net.receiver)?;
    let keys = receiver.keys(&net.receiver)?;
    let grew = peers::kernel_memory()? as i64 - memory_before as i64;
    let maps = receiver.maps_memory()?;
    let seconds = report.duration().as_secs_f64();
    drop(receiver);
    Ok(Run {
        sent: report.sent,
        offered: counts.offered,
        admitted: counts.admitted,
        bound: match (system.limits(), policy.cap) {
            (false, _) => counts.offered,
            (true, None) => bound(&gcra, sources, report.sent, seconds),
            // The cap is one key over every source.
            (true, Some(cap)) => bound(&gcra, sources, report.sent, seconds).min(bound(
                &gcra_of(cap.rate_per_s, cap.burst)?,
                SourceRange { count: 1, ..sources },
                report.sent,
                seconds,
            )),
        },
        cpu,
        daemon: daemon.map(|d| d.total()),
        window,
        seconds,
        grew,
        maps,
        keys,
    })
}

/// How long the daemon is watched at rest: the period of its bucket scan (`OCCUPANCY_EVERY` in
/// limiter-ctl's daemon), so that one scan falls in the window.
const AT_REST: Duration = Duration::from_secs(15);

/// The limiter's daemon with its policy set and no traffic, from a settled start, over
/// [`AT_REST`]: its CPU time, and the wall time it was taken over.
fn at_rest(system: System) -> anyhow::Result<(peers::ProcessCpu, Duration)> {
    let net = TestNet::new()?;
    let receiver = peers::setup(system, &net, POLICY)?;
    let before = receiver.daemon_cpu()?.context("the system runs no daemon")?;
    let start = Instant::now();
    std::thread::sleep(AT_REST);
    let used = receiver.daemon_cpu()?.context("the system runs no daemon")?.since(before);
    Ok((used, start.elapsed()))
}

/// State memory: the limiter's maps; for netfilter what the run added beyond what the same
/// flood added with no state (`baseline`); nothing for the baselines.
fn state_memory(system: System, r: &Run, baseline: f64) -> Option<f64> {
    match system {
        System::Limiter | System::LimiterTcx => r.maps.map(|m| m as f64),
        System::Hashlimit(_) | System::Nftables(_) => Some(r.grew as f64 - baseline),
        _ => None,
    }
}

/// Two bursts of 4 x burst packets from one source, 10 ms apart across a second boundary.
/// Returns when what got through arrived (kernel receive timestamps), in seconds since the
/// sender started its clock.
fn boundary_burst(system: System) -> anyhow::Result<Vec<f64>> {
    let net = TestNet::new()?;
    // Bursts of a few frames, on time to the microsecond: the AF_PACKET sender (each live-frames
    // run sets up a page pool first, milliseconds that would blur the boundary).
    let frames = Frames::build(&spec(&net, false), &Sources::One(v4(198, 19, 0, 1)))?;
    let _receiver = peers::setup(system, &net, POLICY)?;
    let stop = Arc::new(AtomicBool::new(false));
    let listening = stop.clone();
    // The receiver reads on the other CPU; the kernel stamps each datagram as it arrives.
    let arrivals = net.receiver.spawn(move || -> anyhow::Result<Vec<f64>> {
        pin_current_thread(1 - SENDER_CPU)?;
        let socket = UdpSocket::bind(("0.0.0.0", PORT)).context("binding the receiver's socket")?;
        socket.set_read_timeout(Some(Duration::from_millis(50)))?;
        setsockopt(&socket, sockopt::ReceiveTimestampns, &true)?;
        let mut seen = Vec::new();
        let mut buf = [0u8; 2048];
        while !listening.load(Ordering::Relaxed) {
            let mut cmsg = nix::cmsg_space!(nix::sys::time::TimeSpec);
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let Ok(msg) = recvmsg::<()>(socket.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::empty()) else {
                continue;
            };
            for c in msg.cmsgs()? {
                if let ControlMessageOwned::ScmTimestampns(ts) = c {
                    seen.push(ts.tv_sec() as f64 + ts.tv_nsec() as f64 * 1e-9);
                }
            }
        }
        Ok(seen)
    });
    std::thread::sleep(Duration::from_millis(200));
    let burst = u64::from(POLICY.burst) * 4;
    let sender = net.sender.iface.clone();
    let start = net.sender.run(move || -> anyhow::Result<f64> {
        pin_current_thread(SENDER_CPU)?;
        let mut socket = PacketSocket::open(&sender)?;
        // Bounded in packets (a burst of exactly this many), and in time.
        let limits = Limits::counted(burst, Duration::from_secs(1));
        let (start, wall) = (Instant::now(), SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs_f64());
        wait_until(start + Duration::from_millis(990));
        frames.send(&mut socket, &limits)?;
        wait_until(start + Duration::from_millis(1000));
        frames.send(&mut socket, &limits)?;
        Ok(wall)
    })??;
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let seen = arrivals.join().map_err(|_| anyhow::anyhow!("the receiver thread panicked"))???;
    Ok(seen.into_iter().map(|t| t - start).collect())
}

/// Sleeps until shortly before `t`, then spins: the bursts go out on time to the microsecond.
fn wait_until(t: Instant) {
    let early = t.checked_sub(Duration::from_millis(2)).unwrap_or(t);
    if let Some(d) = early.checked_duration_since(Instant::now()) {
        std::thread::sleep(d);
    }
    while Instant::now() < t {
        std::hint::spin_loop();
    }
}

/// State memory as distinct sources grow (one run each, IPv6 /64 sources).
fn memory_sweep(system: System, sources: u32) -> anyhow::Result<Run> {
    let net = TestNet::new()?;
    let sources = SourceRange { first: IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2)), count: sources };
    let generator = Generator::new(&spec(&net, true), L4::Udp, sources)?;
    let before = peers::kernel_memory()?;
    let receiver = peers::setup(system, &net, POLICY)?;
    let sender = net.sender.iface.clone();
    // Two passes over the sources: every key gets state.
    let frames = u64::from(sources.count) * 2;
    let report = net.sender.run(move || -> anyhow::Result<_> {
        pin_current_thread(SENDER_CPU)?;
        generator.send(&sender, frames, Duration::from_secs(10))
    })??;
    std::thread::sleep(Duration::from_millis(100));
    let counts = receiver.counts(&net.receiver)?;
    let keys = receiver.keys(&net.receiver)?;
    let grew = peers::kernel_memory()? as i64 - before as i64;
    let maps = receiver.maps_memory()?;
    Ok(Run {
        sent: report.sent,
        offered: counts.offered,
        admitted: counts.admitted,
        grew,
        maps,
        keys,
        ..Run::default()
    })
}

fn main() -> anyhow::Result<()> {
    let opts = Opts::parse()?;
    let out_dir = opts.out.clone();
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "the peers benchmark creates namespaces and loads XDP: run it as root (sudo -E cargo xtask bench --peers)"
        );
    }
    let sender = Sender::chosen()?;
    eprintln!("peers: sender {sender}");
    // The floods' systems: on the packet ring, not those whose rows need live frames.
    let (floods, left_out): (Vec<System>, Vec<System>) =
        opts.systems.iter().partition(|s| !(sender.sender.skb_before_xdp() && s.needs_live_frames()));
    let left_out = note_left_out(&left_out, &sender);
    if let Some(note) = &left_out {
        eprintln!("peers: {note}");
    }
    // The boundary burst's bound (its policy is POLICY; each flood uses its workload's).
    let gcra = gcra(POLICY)?;
    let started = Instant::now();
    let mut runs: BTreeMap<(Workload, System), Vec<Run>> = BTreeMap::new();
    let rounds = if opts.floods { opts.runs } else { 0 };
    for round in 0..rounds {
        for &workload in &opts.workloads {
            for &system in &floods {
                let run = flood(system, workload, opts.flood)
                    .with_context(|| format!("{} / {}", system.name(), workload.name()))?;
                eprintln!("round {round}: {:<20} {:<30} {run:?}", system.name(), workload.name());
                runs.entry((workload, system)).or_default().push(run);
            }
        }
    }
    let selected = |s: &System| opts.systems.contains(s);
    let rest = match rounds > 0 && selected(&System::Limiter) {
        true => Some(at_rest(System::Limiter).context("the daemon at rest")?),
        false => None,
    };
    let mut bursts = BTreeMap::new();
    for system in EXTRAS.into_iter().filter(selected) {
        if opts.burst {
            bursts.insert(system, boundary_burst(system)?);
        }
    }
    let mut sweep: BTreeMap<System, Vec<(u32, Run)>> = BTreeMap::new();
    let sizes: &[u32] = match (opts.memory, opts.quick) {
        (false, _) => &[],
        (true, true) => &[1_000, 100_000],
        (true, false) => &[1_000, 10_000, 100_000, 1_000_000],
    };
    for &sources in sizes {
        for system in EXTRAS.into_iter().filter(selected) {
            let run = memory_sweep(system, sources)?;
            eprintln!("memory: {:<20} {sources:>8} sources {run:?}", system.name());
            sweep.entry(system).or_default().push((sources, run));
        }
    }
    let elapsed = started.elapsed();

    // The table.
    let mut md = String::new();
    // Which policy each part of the run enforced: a flood its workload's, the boundary burst and
    // the memory sweep POLICY. Grouped by policy, in the order of the run.
    let mut uses: Vec<(PerSource, Vec<String>)> = Vec::new();
    let parts = opts
        .workloads
        .iter()
        .filter(|_| rounds > 0)
        .map(|w| (w.policy(), format!("*{}*", w.name())))
        .chain((!bursts.is_empty()).then(|| (POLICY, "the boundary burst".to_string())))
        .chain((!sweep.is_empty()).then(|| (POLICY, "the memory sweep".to_string())));
    for (p, what) in parts {
        match uses.iter_mut().find(|(k, _)| *k == p) {
            Some((_, v)) => v.push(what),
            None => uses.push((p, vec![what])),
        }
    }
    if uses.is_empty() {
        uses.push((POLICY, Vec::new()));
    }
    let policies: Vec<String> = uses
        .iter()
        .map(|(p, what)| {
            let what = if what.is_empty() { String::new() } else { format!(" ({})", what.join(", ")) };
            let cap = p.cap.map_or(String::new(), |c| {
                format!(" and {} packets/s burst {} over every source together (nftables: a `limit` rule after the meters; hashlimit: one without a mode)", c.rate_per_s, c.burst)
            });
            format!("{} packets/s per source, burst {}{cap}{what}", p.rate_per_s, p.burst)
        })
        .collect();
    writeln!(
        md,
        "Policy for every system: {}; on UDP port {PORT} (IPv4 per address, IPv6 per /64). {rounds} runs each, median (min-max). Floods of up to {} s from the flood generator on CPU {SENDER_CPU}, sent by {}.\n",
        policies.join("; "),
        opts.flood.as_secs_f64(),
        sender.sender
    )?;
    if let Some(note) = &left_out {
        writeln!(md, "Note: {note}.\n")?;
    }
    // The floods' table (the boundary burst and the memory sweep have their own).
    if rounds > 0 {
        writeln!(
            md,
            "CPU: kernel time of the whole machine (system, irq and softirq, every CPU) over the flood and the 0.1 s after it; for the limiter, plus its daemon's user time (the release `limiter-ctl daemon` with its default flags, policy set through its socket; its system time is kernel time already). The daemon columns are its own user + system time over the same window. User time of the generator is left out for every system.\n"
        )?;
        writeln!(
            md,
            "| workload | system | sender | sent | offered (Mpps reached) | admitted | bound | admitted / bound | CPU s per M offered | net of XDP_DROP | net s per M dropped | daemon, % of a core | daemon CPU s per M offered | state memory (MiB) | keys held |"
        )?;
        writeln!(md, "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    }
    // Per workload and system: the net cost per million dropped, (median, min, max).
    let mut per_dropped_cost: BTreeMap<(Workload, System), (f64, f64, f64)> = BTreeMap::new();
    for &workload in opts.workloads.iter().filter(|_| opts.floods) {
        let median = |s: System, f: &dyn Fn(&Run) -> f64| {
            runs.get(&(workload, s)).map(|r| stats(&r.iter().map(f).collect::<Vec<_>>()).1)
        };
        // Without XDP_DROP (or "nothing") in the run, the net columns cannot be computed.
        let baseline = median(System::XdpDrop, &Run::cpu_per_million);
        let stateless = median(System::Nothing, &|r| r.grew as f64).unwrap_or(0.0);
        // What passing a packet up the stack costs, net: "nothing" passes them all.
        let pass_cost = baseline.and_then(|b| median(System::Nothing, &|r| r.cpu_per_million() - b)).map(|c| c / 1e6);
        for &system in &floods {
            let r = &runs[&(workload, system)];
            let col = |f: fn(&Run) -> f64| r.iter().map(f).collect::<Vec<_>>();
            let cpu = col(Run::cpu_per_million);
            let net: Vec<f64> = baseline.map_or(Vec::new(), |b| cpu.iter().map(|c| c - b).collect());
            // Net cost per dropped packet: the run's net CPU, less what its admitted packets cost
            // the stack, over what it dropped (only where it dropped at least a third: below that
            // the difference of two noisy totals swamps it).
            let per_dropped: Vec<f64> = r
                .iter()
                .filter(|r| system.limits() && (r.offered - r.admitted) * 3 >= r.offered)
                .filter_map(|r| {
                    let net_s = (r.cpu_per_million() - baseline?) * r.offered as f64 / 1e6;
                    Some((net_s - r.admitted as f64 * pass_cost?) / ((r.offered - r.admitted) as f64 / 1e6))
                })
                .collect();
            if !per_dropped.is_empty() {
                let (lo, med, hi) = stats(&per_dropped);
                per_dropped_cost.insert((workload, system), (med, lo, hi));
            }
            writeln!(
                md,
                "| {} | {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                workload.name(),
                system.name(),
                sender.sender,
                mmm(&col(|r| r.sent as f64), 0),
                mmm(&col(|r| r.offered as f64), 0),
                mmm(&col(|r| r.offered as f64 / r.seconds.max(1e-9) / 1e6), 2),
                mmm(&col(|r| r.admitted as f64), 0),
                mmm(&col(|r| r.bound as f64), 0),
                mmm(&col(|r| r.admitted as f64 / r.bound.max(1) as f64), 3),
                mmm(&cpu, 3),
                if system == System::XdpDrop || net.is_empty() { "-".into() } else { mmm(&net, 3) },
                if per_dropped.is_empty() { "-".into() } else { mmm(&per_dropped, 3) },
                optional(r, Run::daemon_share, 1),
                optional(r, Run::daemon_per_million, 4),
                {
                    let m: Vec<f64> =
                        r.iter().filter_map(|r| state_memory(system, r, stateless)).map(|b| b / 1048576.0).collect();
                    if m.is_empty() { "-".into() } else { mmm(&m, 1) }
                },
                r[0].keys.map_or("fixed".into(), |_| mmm(&col(|r| r.keys.unwrap_or(0) as f64), 0)),
            )?;
        }
    }
    if let Some((used, window)) = rest {
        writeln!(
            md,
            "\nThe daemon at rest (its policy set, no traffic) over {:.1} s, one period of its bucket scan: {:.2} % of a core (user {:.2} s, system {:.2} s).",
            window.as_secs_f64(),
            used.total().as_secs_f64() / window.as_secs_f64() * 100.0,
            used.user.as_secs_f64(),
            used.system.as_secs_f64()
        )?;
    }
    bound_shares(&mut md, &opts, &runs)?;
    let image = |alt: &str, name: &str| opts.images.as_ref().map(|p| format!("\n![{alt}]({p}/{name}.svg)\n"));
    if !bursts.is_empty() {
        if let Some(i) = image(
            "Two bursts across a second boundary: packets let through against the bound, per system",
            "boundary-burst",
        ) {
            md.push_str(&i);
        }
    }
    if !sweep.is_empty() {
        writeln!(md, "\nState memory as distinct sources grow (IPv6 /64 sources, each sent twice):\n")?;
        writeln!(md, "| distinct sources | system | offered | admitted | state memory (MiB) | keys held |")?;
        writeln!(md, "|---:|---|---:|---:|---:|---:|")?;
    }
    let stateless: BTreeMap<u32, f64> =
        sweep.get(&System::Nothing).into_iter().flatten().map(|(n, r)| (*n, r.grew as f64)).collect();
    let mut memory_points: Vec<(&str, Vec<plot::MemoryPoint>)> = Vec::new();
    for (system, points) in sweep.iter().filter(|(s, _)| s.limits()) {
        let mut line = Vec::new();
        for (sources, r) in points {
            let mib =
                state_memory(*system, r, stateless.get(sources).copied().unwrap_or(0.0)).unwrap_or(0.0) / 1048576.0;
            // A table holding clearly fewer keys than there were sources had stopped tracking.
            let full = r.keys.is_some_and(|k| k * 10 < u64::from(*sources) * 9);
            line.push(plot::MemoryPoint { sources: f64::from(*sources), mib, full });
            writeln!(
                md,
                "| {sources} | {} | {} | {} | {mib:.1} | {}{} |",
                system.name(),
                r.offered,
                r.admitted,
                r.keys.map_or("fixed".into(), |k| k.to_string()),
                if full { " (full)" } else { "" }
            )?;
        }
        memory_points.push((system.label(), line));
    }
    if !memory_points.is_empty() {
        if let Some(i) = image("State memory against distinct sources; hollow points: the table was full", "memory") {
            md.push_str(&i);
        }
    }
    let mut headline = headline(&runs, &per_dropped_cost)?;
    if per_dropped_cost.contains_key(&(Workload::OneSource, System::Limiter)) {
        if let Some(i) =
            image("Net CPU per million dropped packets, one source, per system and placement", "cpu-per-dropped")
        {
            headline.push_str(&i[1..]);
            headline.push('\n');
        }
    }
    writeln!(md, "\nMeasured in {:.0} s.", elapsed.as_secs_f64())?;
    // The first line names the sender: `cargo xtask bench --peers` records each sender's table
    // in a section of its own.
    let md = format!("Sender: {sender}.\n\n{headline}{md}");
    print!("{md}");

    std::fs::create_dir_all(&out_dir)?;
    if let Some(dir) = std::path::Path::new(&opts.table).parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&opts.table, &md).with_context(|| format!("writing {}", opts.table))?;
    let cpus = peers::cpus()?;
    // In System::ALL's order: the limiter, the best placements, then INPUT.
    let bars: Vec<plot::Bar> = System::ALL
        .into_iter()
        .filter_map(|s| {
            let (med, lo, hi) = per_dropped_cost.get(&(Workload::OneSource, s))?;
            Some((Workload::OneSource.name(), s.label(), *med, *lo, *hi))
        })
        .collect();
    // Only the plots this run has data for.
    if !bars.is_empty() {
        plot::cpu_per_dropped(&format!("{out_dir}/cpu-per-dropped.svg"), &bars, cpus)?;
    }
    // The bound, from a system's first packet let through.
    let bound_line: Vec<(f64, f64)> =
        (0..=800).map(|i| f64::from(i) * 1e-4).map(|t| (t, gcra.bound((t * 1e9) as u64) as f64)).collect();
    if !bursts.is_empty() {
        plot::boundary_burst(
            &format!("{out_dir}/boundary-burst.svg"),
            &bursts.iter().map(|(s, a)| (s.label(), a.clone())).collect::<Vec<_>>(),
            &bound_line,
        )?;
    }
    if !memory_points.is_empty() {
        plot::memory(&format!("{out_dir}/memory.svg"), &memory_points, cpus)?;
    }
    Ok(())
}

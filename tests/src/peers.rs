//! The systems the peers benchmark compares, each enforcing the same per-source policy on the
//! receiver end of a [`TestNet`]: this limiter, iptables `hashlimit`, an nftables meter, nothing
//! at all, and a bare XDP_DROP (the baseline subtracted to get each system's own cost).
//!
//! The veth receiver only takes the generator's XDP frames while it runs an XDP program, so the
//! netfilter systems and "nothing" get the bare XDP_PASS program: the same for all of them.
//!
//! The limiter runs as it ships: the release `limiter-ctl daemon` with its default flags (only
//! the paths a test needs: interface, socket, config, pins), its policy set through its socket as
//! an operator sets it, with no scope or geometry given; what it counted is read from its pinned
//! maps. Its CPU time is the bench's to count ([`Receiver::daemon_cpu`]).

use std::{io::Write as _, process::Stdio, time::Duration};

use anyhow::{Context as _, bail, ensure};
use aya::{
    Ebpf,
    maps::{MapData, PerCpuArray},
    programs::loaded_programs,
};

use crate::{
    daemon::{Daemon, Scratch},
    neighbour::xdp_pass,
    netns::{End, TestNet},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum System {
    Limiter,
    /// The limiter at tc ingress (tcx), as `--attach auto` puts it beside another XDP program.
    LimiterTcx,
    Hashlimit(Place),
    Nftables(Place),
    Nothing,
    XdpDrop,
}

/// Where a netfilter system's rules sit. `Input` is how they are commonly configured (after
/// routing); `Raw` is before conntrack and routing (iptables `-t raw PREROUTING`, nftables
/// `hook prerouting priority raw`); `Ingress` is nftables' `netdev` family on the receiving
/// device, before the IP stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Place {
    Ingress,
    Raw,
    Input,
}

impl System {
    pub const ALL: [System; 9] = [
        Self::Limiter,
        Self::LimiterTcx,
        Self::Hashlimit(Place::Raw),
        Self::Nftables(Place::Raw),
        Self::Nftables(Place::Ingress),
        Self::Hashlimit(Place::Input),
        Self::Nftables(Place::Input),
        Self::Nothing,
        Self::XdpDrop,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Limiter => "limiter (XDP)",
            Self::LimiterTcx => "limiter (tcx ingress)",
            Self::Hashlimit(Place::Raw) => "iptables hashlimit, raw PREROUTING",
            Self::Hashlimit(_) => "iptables hashlimit, INPUT (as commonly configured)",
            Self::Nftables(Place::Raw) => "nftables meter, prerouting priority raw",
            Self::Nftables(Place::Ingress) => "nftables meter, netdev ingress",
            Self::Nftables(Place::Input) => "nftables meter, input (as commonly configured)",
            Self::Nothing => "nothing",
            Self::XdpDrop => "bare XDP_DROP",
        }
    }

    /// A short name for plot legends.
    pub fn label(self) -> &'static str {
        match self {
            Self::Limiter => "limiter (XDP)",
            Self::LimiterTcx => "limiter tcx",
            Self::Hashlimit(Place::Raw) => "hashlimit raw",
            Self::Hashlimit(_) => "hashlimit INPUT",
            Self::Nftables(Place::Raw) => "nft raw",
            Self::Nftables(Place::Ingress) => "nft ingress",
            Self::Nftables(Place::Input) => "nft input",
            Self::Nothing => "nothing",
            Self::XdpDrop => "bare XDP_DROP",
        }
    }

    /// The name the peers bench's `--only` takes.
    pub fn short(self) -> &'static str {
        match self {
            Self::Limiter => "limiter",
            Self::LimiterTcx => "limiter-tcx",
            Self::Hashlimit(Place::Raw) => "hashlimit-raw",
            Self::Hashlimit(_) => "hashlimit-input",
            Self::Nftables(Place::Raw) => "nft-raw",
            Self::Nftables(Place::Ingress) => "nft-ingress",
            Self::Nftables(Place::Input) => "nft-input",
            Self::Nothing => "nothing",
            Self::XdpDrop => "xdp-drop",
        }
    }

    /// Whether the system enforces the policy (the others are baselines).
    pub fn limits(self) -> bool {
        matches!(self, Self::Limiter | Self::LimiterTcx | Self::Hashlimit(_) | Self::Nftables(_))
    }

    /// Whether the system is one of netfilter's.
    pub fn netfilter(self) -> bool {
        matches!(self, Self::Hashlimit(_) | Self::Nftables(_))
    }

    /// Whether its flood rows need live frames to mean what they say: an XDP program's cost
    /// where no skb exists yet, as behind a NIC. From the packet ring, every frame is an skb
    /// before XDP; the systems at tc ingress or in netfilter pay for one either way.
    pub fn needs_live_frames(self) -> bool {
        matches!(self, Self::Limiter | Self::XdpDrop)
    }
}

/// The policy every system enforces: per IPv4 address, per IPv6 /64, on UDP port [`PORT`];
/// with `cap`, an aggregate of every source beside it (the pair OPERATIONS recommends against a
/// spoofed flood).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerSource {
    pub rate_per_s: u32,
    pub burst: u32,
    pub cap: Option<Cap>,
}

/// An aggregate limit over every source together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cap {
    pub rate_per_s: u32,
    pub burst: u32,
}

pub const PORT: u16 = 9;

/// The names of the policies the limiter's daemon is given: per source, and the cap.
const POLICY_NAME: &str = "flood";
const CAP_NAME: &str = "flood-cap";

/// What a system holds for the run. Dropping it removes the XDP program; the netfilter rules
/// go with the namespace.
pub enum Receiver {
    /// The limiter's daemon; at tcx, with the bare XDP_PASS program the veth needs (`pass`).
    /// Dropped in this order: the daemon stops (SIGINT; it leaves its program pinned), the
    /// scratch directory's pins go (which detaches the program), then the XDP_PASS.
    Limiter {
        daemon: Daemon,
        scratch: Scratch,
        pass: Option<Ebpf>,
    },
    Xdp {
        ebpf: Ebpf,
        system: System,
    },
}

/// Packets the system saw (`offered`) and let through (`admitted`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub offered: u64,
    pub admitted: u64,
}

pub fn setup(system: System, net: &TestNet, policy: PerSource) -> anyhow::Result<Receiver> {
    let r = &net.receiver;
    match system {
        System::Limiter | System::LimiterTcx => {
            // At tcx the veth takes the generator's frames only with an XDP program on it: the
            // same bare XDP_PASS as netfilter's rows, so the limiter at tcx pays what netfilter
            // pays before it (the skb), and its own judgement. Attached first: the daemon finds
            // XDP taken, as it would beside another tool.
            let pass = match system {
                System::LimiterTcx => Some(xdp_pass(r, "bench_pass")?),
                _ => None,
            };
            let scratch = Scratch::new()?;
            // The harness turns the config watch off by default (for tests that count reloads);
            // the daemon as shipped watches its file, and pays for it.
            let mut extra = vec!["--watch-config=true"];
            if system == System::LimiterTcx {
                extra.extend(["--attach", "tcx"]);
            }
            let daemon = Daemon::start(r, &scratch, &extra)?;
            let (rate, burst) = (format!("{}/s", policy.rate_per_s), policy.burst.to_string());
            daemon.ctl_ok(&[
                "policy",
                "set",
                POLICY_NAME,
                "--match",
                &format!("udp:{PORT}"),
                "--rate",
                &rate,
                "--burst",
                &burst,
            ])?;
            if let Some(cap) = policy.cap {
                let (rate, burst) = (format!("{}/s", cap.rate_per_s), cap.burst.to_string());
                let matches = format!("udp:{PORT}");
                daemon.ctl_ok(&[
                    "policy", "set", CAP_NAME, "--match", &matches, "--key", "src/0,/0", "--rate", &rate, "--burst",
                    &burst,
                ])?;
            }
            settle(daemon.daemon_pid().as_raw())?;
            Ok(Receiver::Limiter { daemon, scratch, pass })
        }
        System::XdpDrop => Ok(Receiver::Xdp { ebpf: xdp_pass(r, "bench_drop")?, system }),
        System::Hashlimit(_) | System::Nftables(_) | System::Nothing => {
            let ebpf = xdp_pass(r, "bench_pass")?;
            match system {
                System::Hashlimit(place) => hashlimit(r, place, policy)?,
                System::Nftables(place) => nft(r, &nft_rules(place, Some(policy), &r.iface))?,
                _ => nft(r, &nft_rules(Place::Input, None, &r.iface))?,
            }
            Ok(Receiver::Xdp { ebpf, system })
        }
    }
}

/// iptables' hashlimit with its defaults for table size and expiry, as an operator gets it, in
/// the `filter` table's INPUT chain or the `raw` table's PREROUTING chain (`Ingress` is not
/// iptables').
fn hashlimit(end: &End, place: Place, p: PerSource) -> anyhow::Result<()> {
    let above = format!("{}/sec", p.rate_per_s);
    let burst = p.burst.to_string();
    let port = PORT.to_string();
    let (table, chain) = hashlimit_chain(place)?;
    for (tool, name, mask) in [("iptables-legacy", "lmt4", "32"), ("ip6tables-legacy", "lmt6", "64")] {
        // Counts what arrives, before hashlimit: with its table full it drops packets of new
        // sources without matching, so its own rule would not count them.
        run(end, tool, &["-w", "-t", "raw", "-A", "PREROUTING", "-p", "udp", "--dport", &port])?;
        let head = ["-w", "-t", table, "-A", chain, "-p", "udp", "--dport", &port];
        let limit = [
            "-m",
            "hashlimit",
            "--hashlimit-above",
            &above,
            "--hashlimit-burst",
            &burst,
            "--hashlimit-mode",
            "srcip",
            "--hashlimit-srcmask",
            mask,
            "--hashlimit-name",
            name,
            "-j",
            "DROP",
        ];
        run(end, tool, &[&head[..], &limit[..]].concat())?;
        if let Some(cap) = p.cap {
            // No --hashlimit-mode: one bucket for every source.
            let (above, burst, name) = (format!("{}/sec", cap.rate_per_s), cap.burst.to_string(), format!("{name}cap"));
            let limit = ["-m", "hashlimit", "--hashlimit-above", &above, "--hashlimit-burst", &burst];
            let limit = [&limit[..], &["--hashlimit-name", &name, "-j", "DROP"][..]].concat();
            run(end, tool, &[&head[..], &limit[..]].concat())?;
        }
        run(end, tool, &[&head[..], &["-j", "ACCEPT"][..]].concat())?;
    }
    Ok(())
}

fn hashlimit_chain(place: Place) -> anyhow::Result<(&'static str, &'static str)> {
    match place {
        Place::Input => Ok(("filter", "INPUT")),
        Place::Raw => Ok(("raw", "PREROUTING")),
        Place::Ingress => bail!("iptables has no ingress hook"),
    }
}

/// The nftables table and chain a placement's rules sit in: (family, chain).
fn nft_chain(place: Place) -> (&'static str, &'static str) {
    match place {
        Place::Input => ("inet", "input"),
        Place::Raw => ("inet", "prerouting"),
        Place::Ingress => ("netdev", "ingress"),
    }
}

/// The nftables ruleset: a count of what arrives, the meters (when limiting), then a counting
/// accept, in table `lmt` at the placement's hook (`iface`: the device for `netdev ingress`).
pub fn nft_rules(place: Place, policy: Option<PerSource>, iface: &str) -> String {
    let meters = policy.map_or(String::new(), |p| {
        let limit = format!("limit rate over {}/second burst {} packets", p.rate_per_s, p.burst);
        let cap = p.cap.map_or(String::new(), |c| {
            format!("udp dport {PORT} limit rate over {}/second burst {} packets counter drop\n", c.rate_per_s, c.burst)
        });
        format!(
            "udp dport {PORT} meter m4 {{ ip saddr {limit} }} counter drop\n\
             udp dport {PORT} meter m6 {{ ip6 saddr and ffff:ffff:ffff:ffff:: {limit} }} counter drop\n{cap}"
        )
    });
    let (family, chain) = nft_chain(place);
    let hook = match place {
        Place::Input => "hook input priority filter".to_string(),
        Place::Raw => "hook prerouting priority raw".to_string(),
        Place::Ingress => format!("hook ingress device \"{iface}\" priority filter"),
    };
    format!(
        "table {family} lmt {{\n chain {chain} {{\n type filter {hook}; policy accept;\nudp dport {PORT} counter\n{meters}udp dport {PORT} counter accept\n }}\n}}\n"
    )
}

fn nft(end: &End, rules: &str) -> anyhow::Result<()> {
    let mut child = end
        .command("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft")?;
    child.stdin.take().context("nft stdin")?.write_all(rules.as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(out.status.success(), "nft -f: {}\n{rules}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

fn run(end: &End, tool: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = end.command(tool).args(args).output().with_context(|| format!("running {tool}"))?;
    ensure!(out.status.success(), "{tool} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Receiver {
    pub fn counts(&self, end: &End) -> anyhow::Result<Counts> {
        match self {
            Self::Limiter { daemon, .. } => {
                // Read from its pins, exact now (`stats` answers from a snapshot taken once a
                // second).
                let maps = daemon.maps()?;
                // The id of the daemon's policy `name` in the kernel.
                let id_of = |name: &str| {
                    maps.rules
                        .view
                        .policies
                        .iter()
                        .find(|(_, (_, n))| n.split(|b| *b == 0).next() == Some(name.as_bytes()))
                        .map(|(id, _)| *id)
                };
                let id = id_of(POLICY_NAME)
                    .with_context(|| format!("the daemon has no policy {POLICY_NAME:?} in the kernel"))?;
                let c = maps.total(id);
                // A packet the cap refuses is counted there (the per-source layer counts it
                // overruled, or nothing when the cap's standing refusal dropped it).
                let cap = id_of(CAP_NAME).map_or(0, |id| maps.total(id).refused_packets);
                Ok(Counts { offered: c.admitted_packets + c.refused_packets + cap, admitted: c.admitted_packets })
            }
            Self::Xdp { ebpf, system: System::XdpDrop } => {
                let map = PerCpuArray::<&MapData, u64>::try_from(ebpf.map("DROPPED").context("DROPPED")?)?;
                let dropped: u64 = map.get(&0, 0)?.iter().sum();
                Ok(Counts { offered: dropped, admitted: 0 })
            }
            Self::Xdp { system: System::Hashlimit(place), .. } => {
                let (table, chain) = hashlimit_chain(*place)?;
                let mut c = Counts::default();
                for tool in ["iptables-legacy", "ip6tables-legacy"] {
                    let arrived =
                        rule_packets(&run(end, tool, &["-w", "-t", "raw", "-L", "PREROUTING", "-v", "-x", "-n"])?)?;
                    let rules = rule_packets(&run(end, tool, &["-w", "-t", table, "-L", chain, "-v", "-x", "-n"])?)?;
                    // Raw PREROUTING: count, limit(s), accept; INPUT: limit(s), accept.
                    let least = if table == "raw" { 3 } else { 2 };
                    ensure!(
                        !arrived.is_empty() && (least..=least + 1).contains(&rules.len()),
                        "{tool}: unexpected rules {arrived:?} {rules:?}"
                    );
                    c.offered += arrived[0];
                    c.admitted += rules[rules.len() - 1];
                }
                Ok(c)
            }
            Self::Xdp { system, .. } => {
                let (family, chain) = nft_chain(match system {
                    System::Nftables(place) => *place,
                    _ => Place::Input,
                });
                let counters = nft_counters(&run(end, "nft", &["-j", "list", "chain", family, "lmt", chain])?)?;
                let (offered, admitted) =
                    (*counters.first().context("no nft counters")?, *counters.last().context("no nft counters")?);
                Ok(Counts { offered, admitted })
            }
        }
    }

    /// Keys the system holds state for right now (None: fixed state, nothing to count).
    pub fn keys(&self, end: &End) -> anyhow::Result<Option<u64>> {
        match self {
            Self::Xdp { system: System::Hashlimit(_), .. } => {
                let mut n = 0;
                for name in ["ipt_hashlimit/lmt4", "ip6t_hashlimit/lmt6"] {
                    n += run(end, "cat", &[&format!("/proc/net/{name}")])?.lines().count() as u64;
                }
                Ok(Some(n))
            }
            Self::Xdp { system: System::Nftables(place), .. } => {
                let (family, _) = nft_chain(*place);
                let mut n = 0;
                for set in ["m4", "m6"] {
                    let json: serde_json::Value =
                        serde_json::from_str(&run(end, "nft", &["-j", "list", "meter", family, "lmt", set])?)?;
                    n += json["nftables"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|o| o["meter"]["elem"].as_array().or(o["set"]["elem"].as_array()))
                        .map(|e| e.len() as u64)
                        .sum::<u64>();
                }
                Ok(Some(n))
            }
            _ => Ok(None),
        }
    }
}

/// The packet counts of the rules in `iptables -L -v -x -n` output, in order.
fn rule_packets(listing: &str) -> anyhow::Result<Vec<u64>> {
    listing
        .lines()
        .skip(2)
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.split_whitespace().next().context("empty rule line")?.parse::<u64>().context("rule packets"))
        .collect()
}

/// The packet counts of the `counter` statements in `nft -j list chain` output, in rule order.
fn nft_counters(json: &str) -> anyhow::Result<Vec<u64>> {
    let v: serde_json::Value = serde_json::from_str(json).context("nft -j output")?;
    let mut out = Vec::new();
    for rule in v["nftables"].as_array().into_iter().flatten().filter_map(|o| o.get("rule")) {
        for stmt in rule["expr"].as_array().into_iter().flatten() {
            if let Some(n) = stmt["counter"]["packets"].as_u64() {
                out.push(n);
            }
        }
    }
    if out.is_empty() {
        bail!("no counters in nft output");
    }
    Ok(out)
}

/// The machine's CPUs (the `cpuN` lines of /proc/stat): busy time is summed over them, and the
/// limiter's per-CPU maps scale with them.
pub fn cpus() -> anyhow::Result<usize> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let n =
        stat.lines().filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit)).count();
    ensure!(n > 0, "no cpuN lines in /proc/stat");
    Ok(n)
}

/// Kernel CPU time of the whole machine (all CPUs: system, irq and softirq), from /proc/stat.
/// Everything a flood costs is kernel time (the generator's BPF_PROG_TEST_RUN calls, XDP, the
/// stack, netfilter), except the limiter's daemon's user time, which the bench adds from
/// [`Receiver::daemon_cpu`]; other user time is left out because on a shared machine it is
/// other work (the generator's included, the same for every system).
pub fn busy_cpu() -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("/proc/stat is empty")?;
    let f: Vec<u64> = line.split_whitespace().skip(1).map(|x| x.parse().unwrap_or(0)).collect();
    ensure!(f.len() >= 8, "unexpected /proc/stat: {line}");
    // user nice system idle iowait irq softirq steal
    let busy: u64 = f[2] + f[5] + f[6];
    Ok(Duration::from_nanos(busy.saturating_mul(1_000_000_000) / clock_ticks()?))
}

/// Kernel memory netfilter state comes from: every slab cache (objects in use x object size)
/// plus vmalloc. Netfilter tables allocate there; the difference over a run, against a run of
/// the same flood with no state, is what a system's state took.
pub fn kernel_memory() -> anyhow::Result<u64> {
    let slab = std::fs::read_to_string("/proc/slabinfo").context("reading /proc/slabinfo (needs root)")?;
    let mut bytes = 0u64;
    for line in slab.lines().skip(2) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() > 3 {
            bytes += f[1].parse::<u64>().unwrap_or(0) * f[3].parse::<u64>().unwrap_or(0);
        }
    }
    let info = std::fs::read_to_string("/proc/meminfo")?;
    let vmalloc = info
        .lines()
        .find(|l| l.starts_with("VmallocUsed:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    Ok(bytes + vmalloc * 1024)
}

/// The memory the kernel charges for a program's maps (`memlock` in each map's fdinfo).
fn maps_memory(program_map_ids: &[u32]) -> anyhow::Result<u64> {
    let mut total = 0;
    for id in program_map_ids {
        let map = MapData::from_id(*id).with_context(|| format!("opening map {id}"))?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&std::os::fd::AsFd::as_fd(map.fd()));
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
        let memlock = info.lines().find_map(|l| l.strip_prefix("memlock:")).context("no memlock in fdinfo")?;
        total += memlock.trim().parse::<u64>()?;
    }
    Ok(total)
}

impl Receiver {
    /// This limiter's maps, as the kernel charges them (fixed at load); None for the others.
    pub fn maps_memory(&self) -> anyhow::Result<Option<i64>> {
        match self {
            Self::Limiter { daemon, .. } => {
                let program = daemon.program()?;
                let info = loaded_programs()
                    .filter_map(Result::ok)
                    .find(|p| p.id() == program)
                    .with_context(|| format!("the daemon's program {program} is not loaded"))?;
                let ids = info.map_ids()?.unwrap_or_default();
                Ok(Some(maps_memory(&ids)? as i64))
            }
            Self::Xdp { .. } => Ok(None),
        }
    }

    /// The CPU time the limiter's daemon has used so far (None for the other systems).
    pub fn daemon_cpu(&self) -> anyhow::Result<Option<ProcessCpu>> {
        match self {
            Self::Limiter { daemon, .. } => Ok(Some(process_cpu(daemon.daemon_pid().as_raw())?)),
            Self::Xdp { .. } => Ok(None),
        }
    }
}

/// A process's CPU time, all its threads (those gone too), from /proc/PID/stat.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessCpu {
    pub user: Duration,
    /// Already in [`busy_cpu`]'s system time: the machine's figure includes it.
    pub system: Duration,
}

impl ProcessCpu {
    /// What it used since `before`.
    pub fn since(self, before: ProcessCpu) -> ProcessCpu {
        ProcessCpu { user: self.user.saturating_sub(before.user), system: self.system.saturating_sub(before.system) }
    }

    pub fn total(self) -> Duration {
        self.user + self.system
    }
}

/// The thread group's utime and stime (fields 14 and 15 of /proc/PID/stat, in clock ticks):
/// the sum over every thread, including those that exited.
pub fn process_cpu(pid: i32) -> anyhow::Result<ProcessCpu> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let (user, system) = stat_ticks(&stat).with_context(|| format!("unexpected {path}: {stat}"))?;
    let hz = clock_ticks()?;
    let time = |t: u64| Duration::from_nanos(t.saturating_mul(1_000_000_000) / hz);
    Ok(ProcessCpu { user: time(user), system: time(system) })
}

/// utime and stime, in clock ticks, from the text of /proc/PID/stat.
fn stat_ticks(stat: &str) -> Option<(u64, u64)> {
    // The command name is in parentheses and may hold spaces and ')': the fields follow the
    // last ')'. They start at field 3 (state): utime is field 14, stime 15.
    let (_, rest) = stat.rsplit_once(')')?;
    let mut f = rest.split_whitespace().skip(11);
    Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
}

/// How long a daemon must use no CPU to count as settled, and how long it may take.
const QUIET: Duration = Duration::from_millis(300);
const SETTLE_TIMEOUT: Duration = Duration::from_secs(5);

/// Waits until the daemon `pid` has used no CPU for [`QUIET`] (at most [`SETTLE_TIMEOUT`]): its
/// start done (the first bucket scan, which runs at once, the config file written and seen by
/// the watch), so that a flood's window counts the daemon at work, not starting. Its periodic
/// work after that (a bucket scan every 15 s) lands in a window as it would on a host.
fn settle(pid: i32) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + SETTLE_TIMEOUT;
    let mut last = process_cpu(pid)?;
    while std::time::Instant::now() < deadline {
        std::thread::sleep(QUIET);
        let now = process_cpu(pid)?;
        if now == last {
            return Ok(());
        }
        last = now;
    }
    eprintln!("peers: the daemon (pid {pid}) was still busy {SETTLE_TIMEOUT:?} after its start; measuring anyway");
    Ok(())
}

/// USER_HZ, the unit of /proc's CPU times.
fn clock_ticks() -> anyhow::Result<u64> {
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    ensure!(hz > 0, "sysconf(_SC_CLK_TCK) failed");
    Ok(hz as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_iptables_and_nft_counters() {
        let ipt = "Chain INPUT (policy ACCEPT 0 packets, 0 bytes)\n    pkts      bytes target     prot opt in     out     source               destination\n     120     7200 DROP       17   --  *      *       0.0.0.0/0            0.0.0.0/0            udp dpt:9 limit: above 5/sec\n       7      420 ACCEPT     17   --  *      *       0.0.0.0/0            0.0.0.0/0            udp dpt:9\n";
        assert_eq!(rule_packets(ipt).unwrap(), vec![120, 7]);
        let nft = r#"{"nftables":[{"metainfo":{}},{"chain":{}},{"rule":{"expr":[{"match":{}},{"counter":{"packets":5,"bytes":300}},{"drop":null}]}},{"rule":{"expr":[{"counter":{"packets":2,"bytes":120}},{"accept":null}]}}]}"#;
        assert_eq!(nft_counters(nft).unwrap(), vec![5, 2]);
        let policy = Some(PerSource { rate_per_s: 5, burst: 5, cap: None });
        assert!(nft_rules(Place::Input, policy, "veth0").contains("meter m6"));
        assert!(nft_rules(Place::Raw, policy, "veth0").contains("hook prerouting priority raw"));
        assert!(nft_rules(Place::Ingress, policy, "veth0").contains("table netdev lmt"));
        assert!(!nft_rules(Place::Raw, policy, "veth0").contains("limit rate over 1000/second"));
        let capped = policy.map(|p| PerSource { cap: Some(Cap { rate_per_s: 1000, burst: 1000 }), ..p });
        let rules = nft_rules(Place::Raw, capped, "veth0");
        let (meter, cap) = (rules.find("meter m6").unwrap(), rules.find("limit rate over 1000/second").unwrap());
        assert!(meter < cap && cap < rules.find("counter accept").unwrap(), "{rules}");
    }

    #[test]
    fn reads_a_process_cpu_time() {
        let stat = "4242 (a) b) S 1 4242 4242 0 -1 4194560 100 0 0 0 17 23 0 0 20 0 3 0 100 1000 10";
        assert_eq!(stat_ticks(stat), Some((17, 23)));
        assert_eq!(stat_ticks("4242 (x) S 1"), None);
        // Our own, while we work (syscalls: user and system time): it grows. On a shared
        // machine the CPU we get is not the wall time, so the work is bounded by time.
        let pid = std::process::id() as i32;
        let before = process_cpu(pid).unwrap();
        let spin = std::time::Instant::now();
        let mut used = ProcessCpu::default();
        while used.total() < Duration::from_millis(50) && spin.elapsed() < Duration::from_secs(10) {
            std::hint::black_box(std::fs::metadata("/proc/self").ok());
            used = process_cpu(pid).unwrap().since(before);
        }
        assert!(used.total() >= Duration::from_millis(50), "{used:?} in {:?} of spinning", spin.elapsed());
    }
}

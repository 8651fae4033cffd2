//! The systems the peers benchmark compares, each enforcing the same per-source policy on the
//! receiver end of a [`TestNet`]: this limiter, iptables `hashlimit`, an nftables meter, nothing
//! at all, and a bare XDP_DROP (the baseline subtracted to get each system's own cost).
//!
//! The veth receiver only takes the generator's XDP frames while it runs an XDP program, so the
//! netfilter systems and "nothing" get the bare XDP_PASS program: the same for all of them.

use std::{io::Write as _, process::Stdio, time::Duration};

use anyhow::{Context as _, bail, ensure};
use aya::{
    Ebpf, EbpfLoader,
    maps::{MapData, PerCpuArray},
    programs::{Xdp, XdpMode},
};
use limiter_ctl::{
    HookRequest, Limiter, ModeRequest, Placement,
    config::{PolicyDef, State},
    objects,
};

use crate::netns::{End, TestNet};

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
}

/// The policy every system enforces: per IPv4 address, per IPv6 /64, on UDP port [`PORT`].
#[derive(Clone, Copy, Debug)]
pub struct PerSource {
    pub rate_per_s: u32,
    pub burst: u32,
}

pub const PORT: u16 = 9;

/// What a system holds for the run. Dropping it removes the XDP program; the netfilter rules
/// go with the namespace.
pub enum Receiver {
    /// The limiter; at tcx, with the bare XDP_PASS program the veth needs (`pass`).
    Limiter {
        limiter: Limiter,
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
            // As the daemon runs it by default: its buckets, rows and refusal sampling.
            let mut limiter =
                Limiter::load_rows(limiter_common::maps::DEFAULT_BUCKETS, limiter_common::rows::DEFAULT_ROWS)?;
            limiter.set_salt(limiter_ctl::kernel::draw_salt()?)?;
            limiter.set_sampling(limiter_ctl::kernel::DEFAULT_SAMPLE_REFUSALS)?;
            let def = PolicyDef {
                name: "flood".parse()?,
                matches: "udp:9".parse()?,
                ..PolicyDef::any(format!("{}/s", policy.rate_per_s).parse()?, u64::from(policy.burst))
            };
            let state = State::default().with_policy(def).map_err(|e| anyhow::anyhow!("{e}"))?;
            limiter.sync(&State::default(), &state)?;
            let iface = r.iface.clone();
            if system == System::LimiterTcx {
                // The veth takes the generator's frames only with an XDP program on it: the
                // same bare XDP_PASS as netfilter's rows, so the limiter at tcx pays what
                // netfilter pays before it (the skb), and its own judgement.
                let pass = attach_bench(r, "bench_pass")?;
                let placement = Placement { hook: HookRequest::Tcx, ..Placement::default() };
                let limiter = r.run(move || -> anyhow::Result<Limiter> {
                    limiter.attach_as(&iface, &placement)?;
                    Ok(limiter)
                })??;
                return Ok(Receiver::Limiter { limiter, pass: Some(pass) });
            }
            let limiter = r.run(move || -> anyhow::Result<Limiter> {
                limiter.attach(&iface, ModeRequest::Native)?;
                Ok(limiter)
            })??;
            Ok(Receiver::Limiter { limiter, pass: None })
        }
        System::XdpDrop => Ok(Receiver::Xdp { ebpf: attach_bench(r, "bench_drop")?, system }),
        System::Hashlimit(_) | System::Nftables(_) | System::Nothing => {
            let ebpf = attach_bench(r, "bench_pass")?;
            match system {
                System::Hashlimit(place) => hashlimit(r, place, policy)?,
                System::Nftables(place) => nft(r, &nft_rules(place, Some(policy), &r.iface))?,
                _ => nft(r, &nft_rules(Place::Input, None, &r.iface))?,
            }
            Ok(Receiver::Xdp { ebpf, system })
        }
    }
}

fn attach_bench(end: &End, program: &'static str) -> anyhow::Result<Ebpf> {
    let mut ebpf = EbpfLoader::new().load(objects::BENCH)?;
    let prog: &mut Xdp = ebpf.program_mut(program).context("bench program")?.try_into()?;
    prog.load()?;
    let iface = end.iface.clone();
    end.run(move || -> anyhow::Result<Ebpf> {
        let prog: &mut Xdp = ebpf.program_mut(program).context("bench program")?.try_into()?;
        prog.attach(&iface, XdpMode::Driver)?;
        Ok(ebpf)
    })?
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
        format!(
            "udp dport {PORT} meter m4 {{ ip saddr {limit} }} counter drop\n\
             udp dport {PORT} meter m6 {{ ip6 saddr and ffff:ffff:ffff:ffff:: {limit} }} counter drop\n"
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
            Self::Limiter { limiter: l, .. } => {
                let c = crate::bounds::total(&l.counters()?);
                Ok(Counts { offered: c.admitted_packets + c.refused_packets, admitted: c.admitted_packets })
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
                    // Raw PREROUTING: count, limit, accept; INPUT: limit, accept.
                    let expected = if table == "raw" { 3 } else { 2 };
                    ensure!(
                        !arrived.is_empty() && rules.len() == expected,
                        "{tool}: unexpected rules {arrived:?} {rules:?}"
                    );
                    c.offered += arrived[0];
                    c.admitted += rules[expected - 1];
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
/// stack, netfilter); user time is left out because on a shared machine it is other work.
pub fn busy_cpu() -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    let line = stat.lines().next().context("/proc/stat is empty")?;
    let f: Vec<u64> = line.split_whitespace().skip(1).map(|x| x.parse().unwrap_or(0)).collect();
    ensure!(f.len() >= 8, "unexpected /proc/stat: {line}");
    // user nice system idle iowait irq softirq steal
    let busy: u64 = f[2] + f[5] + f[6];
    // USER_HZ is 100 on Linux.
    Ok(Duration::from_millis(busy * 10))
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
            Self::Limiter { limiter: l, .. } => {
                let ids = l.program()?.info()?.map_ids()?.unwrap_or_default();
                Ok(Some(maps_memory(&ids)? as i64))
            }
            Self::Xdp { .. } => Ok(None),
        }
    }
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
        let policy = Some(PerSource { rate_per_s: 5, burst: 5 });
        assert!(nft_rules(Place::Input, policy, "veth0").contains("meter m6"));
        assert!(nft_rules(Place::Raw, policy, "veth0").contains("hook prerouting priority raw"));
        assert!(nft_rules(Place::Ingress, policy, "veth0").contains("table netdev lmt"));
    }
}

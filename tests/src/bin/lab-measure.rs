//! `lab-measure NAME PORT PIN_DIR NIC[,NIC...] POLICY_ID`: the guest's side of a flood from the
//! host, in the VM lab's device tests (tests/kernels/devices/). It binds a UDP socket on PORT,
//! reads the daemon's counters pinned in PIN_DIR and each NIC's per-queue receive counts, prints
//! `LAB-SEND name=NAME` (the host floods on that line), counts what reaches the socket until
//! nothing arrived or was judged for [`QUIET`], and prints one `LAB-RESULT` line: what the
//! policies judged per CPU, what the NICs' queues received (one NIC's after another's), what
//! the socket got, and the window every admission fell in, by the guest's own clock: from
//! before `LAB-SEND` to the first read of policy POLICY_ID's counters that showed its last
//! admission (or the last arrival, when every admission arrived: on an active-backup bond the
//! inactive member's admissions never reach the socket).

use std::{
    collections::BTreeMap,
    io::Write as _,
    net::{Ipv4Addr, UdpSocket},
    path::Path,
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::maps::{Map, MapData, PerCpuArray};
use limiter_common::maps::{Counters, MAP_COUNTERS};
use limiter_tests::daemon::Snapshot;

/// The flood is over once nothing arrived for this long (the host's floods last seconds).
const QUIET: Duration = Duration::from_secs(3);
/// The host has this long to start its flood once it saw `LAB-SEND` (a busy machine's console).
const FIRST: Duration = Duration::from_secs(120);
/// How often the policy's admissions are read during the flood: the window's end is that
/// late at most.
const POLL: Duration = Duration::from_millis(5);

fn main() -> ExitCode {
    match measure() {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("LAB-RESULT-ERROR {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn measure() -> anyhow::Result<String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [name, port, pins, nics, id] = args.as_slice() else {
        anyhow::bail!("usage: lab-measure NAME PORT PIN_DIR NIC[,NIC...] POLICY_ID (got {args:?})");
    };
    let id: u32 = id.parse().with_context(|| format!("policy id {id}"))?;
    let path = Path::new(pins).join(MAP_COUNTERS);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    let counters: PerCpuArray<_, Counters> = PerCpuArray::try_from(Map::PerCpuArray(data))?;
    // The policy's admissions, and everything it judged.
    let read = || -> anyhow::Result<(u64, u64)> {
        let cpus = counters.get(&id, 0)?;
        Ok((cpus.iter().map(|c| c.admitted_packets).sum(), cpus.iter().map(Counters::packets).sum()))
    };
    let nics: Vec<&str> = nics.split(',').collect();
    let port: u16 = port.parse().with_context(|| format!("port {port}"))?;
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)).with_context(|| format!("binding UDP port {port}"))?;
    // Room for every admission of a flood, so the socket never drops while the test counts.
    nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::RcvBufForce, &(8 << 20))
        .context("SO_RCVBUFFORCE")?;
    socket.set_read_timeout(Some(POLL))?;
    let before = judged(Path::new(pins))?;
    let queues_before = queues(&nics)?;

    let start = Instant::now();
    println!("LAB-SEND name={name}");
    std::io::stdout().flush().context("stdout")?;
    let (mut delivered, mut last) = (0u64, None::<Instant>);
    // The admissions as last read, and the first read that showed them; the same for everything
    // the policy judged.
    let (admitted, judged_now) = read()?;
    let (mut seen, mut seen_at) = (admitted, None::<Instant>);
    let (mut judging, mut judged_at) = (judged_now, None::<Instant>);
    let mut polled = start;
    let mut buf = [0u8; 2048];
    let after = loop {
        match socket.recv_from(&mut buf) {
            Ok(_) => {
                delivered += 1;
                last = Some(Instant::now());
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => return Err(e).context("receiving"),
        }
        if polled.elapsed() >= POLL {
            let (admitted, judged_now) = read()?;
            polled = Instant::now();
            if admitted != seen {
                (seen, seen_at) = (admitted, Some(polled));
            }
            if judged_now != judging {
                (judging, judged_at) = (judged_now, Some(polled));
            }
        }
        let quiet = match last.max(judged_at) {
            Some(l) => l.elapsed() >= QUIET,
            None => start.elapsed() >= FIRST,
        };
        if !quiet {
            continue;
        }
        // Under emulation a receive queue can be served seconds late (7.3 here, once past this
        // quiet: its frames judged and admitted after the count stopped, never read): the count
        // ends only when the policy judged nothing since its last poll, read after everything.
        let after = judged(Path::new(pins))?;
        if read()?.1 == judging {
            break after;
        }
        judged_at = Some(Instant::now());
    };
    let queues_after = queues(&nics)?;

    let per_cpu: Vec<Counters> = after
        .iter()
        .zip(before.iter().chain(std::iter::repeat(&Counters::default())))
        .map(|(a, b)| since(a, b))
        .collect();
    let mut total = Counters::default();
    per_cpu.iter().for_each(|c| total.add(c));
    let cpus: Vec<String> = per_cpu.iter().map(|c| c.packets().to_string()).collect();
    let received: Vec<String> = queues_after
        .iter()
        .map(|(q, n)| n.saturating_sub(queues_before.get(q).copied().unwrap_or(0)).to_string())
        .collect();
    // Every admission was made before the read that first showed the last one; and before its
    // arrival, when every admission arrived.
    let every_one_arrived = total.admitted_packets == delivered;
    let end = match (seen_at, last) {
        (Some(s), Some(l)) if every_one_arrived => Some(s.min(l)),
        (s, l) => s.or(l),
    };
    let window = end.map_or(Duration::ZERO, |e| e.duration_since(start));
    Ok(format!(
        "LAB-RESULT name={name} admitted={} refused={} errors={} unjudged={} delivered={delivered} window_us={} \
         cpus={} queues={}",
        total.admitted_packets,
        total.refused_packets,
        total.errors,
        total.not_ip + total.malformed + total.unmatched,
        window.as_micros(),
        cpus.join("/"),
        received.join("/"),
    ))
}

/// Per CPU, what every policy judged (ids 1 and up) with what no policy judged (id 0's
/// `not_ip`, `malformed`, `unmatched`) beside it: a frame the parser missed shows there.
fn judged(pins: &Path) -> anyhow::Result<Vec<Counters>> {
    let snapshot = Snapshot::read(pins).with_context(|| format!("reading the maps pinned in {}", pins.display()))?;
    let mut per_cpu: Vec<Counters> = Vec::new();
    for (id, cpus) in snapshot.counters.iter().enumerate() {
        per_cpu.resize(per_cpu.len().max(cpus.len()), Counters::default());
        for (cpu, c) in cpus.iter().enumerate() {
            if id == 0 {
                let sum = &mut per_cpu[cpu];
                sum.not_ip += c.not_ip;
                sum.malformed += c.malformed;
                sum.unmatched += c.unmatched;
            } else {
                per_cpu[cpu].add(c);
            }
        }
    }
    Ok(per_cpu)
}

fn since(now: &Counters, before: &Counters) -> Counters {
    limiter_tests::bounds::since(now, before)
}

/// Each NIC's packets received per queue, one NIC's queues after another's.
fn queues(nics: &[&str]) -> anyhow::Result<BTreeMap<(usize, u32), u64>> {
    let mut all = BTreeMap::new();
    for (i, nic) in nics.iter().enumerate() {
        all.extend(nic_queues(nic)?.into_iter().map(|(q, n)| ((i, q), n)));
    }
    Ok(all)
}

/// `ethtool -S IFACE`'s packets received per queue: virtio_net's `rx_queue_N_packets` up to
/// 6.9; from 6.10 the queues' packet counts left `ethtool -S` (for netlink's queue stats), and
/// `rxN_xdp_packets`, what XDP ran on, is taken instead (the queue's packets under native XDP).
fn nic_queues(iface: &str) -> anyhow::Result<BTreeMap<u32, u64>> {
    let out = Command::new("ethtool").args(["-S", iface]).output().context("running ethtool -S")?;
    anyhow::ensure!(out.status.success(), "ethtool -S {iface}: {}", String::from_utf8_lossy(&out.stderr).trim());
    let text = String::from_utf8_lossy(&out.stdout);
    let per_queue = |counter: &str| -> BTreeMap<u32, u64> {
        let suffix = format!("_{counter}");
        text.lines()
            .filter_map(|l| {
                let (key, value) = l.trim().split_once(": ")?;
                let rest = key.strip_prefix("rx_queue_").or_else(|| key.strip_prefix("rx"))?;
                let queue = rest.strip_suffix(suffix.as_str())?.parse().ok()?;
                Some((queue, value.trim().parse().ok()?))
            })
            .collect()
    };
    let packets = per_queue("packets");
    Ok(if packets.is_empty() { per_queue("xdp_packets") } else { packets })
}

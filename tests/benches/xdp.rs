//! XDP microbenchmark: BPF_PROG_TEST_RUN nanoseconds per packet, all programs measured in the
//! same run and reported as ratios to the *floor* program (parse + one clock read + one per-CPU
//! array access: the least any GCRA limiter can do).
//!
//! Two workloads:
//! - *hot*: one frame repeated in the kernel (`repeat`), so caches are warm: the program's
//!   instruction cost;
//! - *random sources*: a different source address every packet over 2^17 sources and 2^20
//!   buckets, one test run each: the bucket is usually a cache miss, as under a spoofed flood.
//!   Each run's kernel-measured time includes a clock read of the test harness, the same for
//!   every program; the `net` column subtracts the bare XDP_PASS program to show the programs'
//!   own cost.
//!
//! - *two-CPU contention*: the same programs run at once on two CPUs (two threads pinned to CPUs
//!   0 and 1, each its own BPF_PROG_TEST_RUN), for both policy scopes: the cost of sharing one
//!   bucket (host scope) against keeping one per CPU (cpu scope), and of a per-source layer with
//!   a host-scope aggregate behind it (one bucket for every source), as `--contention` prints.
//!
//! Layered policies (issue 24) and SYN-only policies have rows of their own, each also reported
//! against the one-policy row it replaces, from the same run: 1, 2 and 4 layers admitting and
//! with the last layer refusing, and a SYN-only policy meeting established traffic (TCP ACKs).
//!
//! Host scope (the default for new policies) has rows of its own with its memo's shortcuts on
//! and off.
//!
//! Run with `cargo xtask bench` (records BENCHMARKS.md) or
//! `cargo bench -p limiter-tests --bench xdp -- [--out FILE] [--rounds N] [--only NAME_PART]...`
//! (`--only`: just the rows whose name contains one of the parts, with the two baselines and the
//! rows the compared ones among them are measured against).

use std::{fmt::Write as _, net::IpAddr, time::Instant};

use anyhow::{Context as _, bail, ensure};
use aya::{
    Ebpf, EbpfLoader,
    programs::{TestRun, TestRunOptions, Xdp},
};
use etherparse::EtherType;
use limiter_ctl::{
    Limiter,
    config::{List, PolicyDef, Scope, State},
    kernel::Geometry,
    objects,
};
use limiter_tests::{
    flood::FrameSpec,
    frames::{Segment, V4, ethernet, tcp_segment},
    kernel_programs::{XDP_DROP, XDP_PASS},
    microbench::{self, median},
    netns,
};
use rand::{SeedableRng, rngs::StdRng, seq::SliceRandom};

const BUCKETS: u32 = 1 << 20;
const SOURCES: usize = 1 << 17;
const HOT_REPEAT: u32 = 200_000;

struct Args {
    out: Option<String>,
    rounds: usize,
    scaling: bool,
    contention: bool,
    /// Only the rows whose name contains one of these (and the baselines); none: every row.
    only: Vec<String>,
}

fn args() -> anyhow::Result<Args> {
    let mut out = None;
    let mut rounds = 5;
    let mut scaling = false;
    let mut contention = false;
    let mut only = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = Some(it.next().context("--out needs a file")?),
            "--rounds" => rounds = it.next().context("--rounds needs a number")?.parse()?,
            "--scaling" => scaling = true,
            "--contention" => contention = true,
            "--only" => only.push(it.next().context("--only needs part of a row's name")?),
            "--bench" => {} // passed by `cargo bench`
            other => bail!(
                "unknown argument {other}; expected --out FILE, --rounds N, --scaling, --contention, --only NAME_PART"
            ),
        }
    }
    Ok(Args { out, rounds, scaling, contention, only })
}

/// One program under test and how to prepare it.
struct Subject {
    name: &'static str,
    what: &'static str,
    run: Box<dyn Fn(&[u8], u32) -> anyhow::Result<u32>>,
    /// Packets to push through once before measuring (the refuse path needs spent buckets).
    warm_all_sources: bool,
}

fn xdp_runner(ebpf: Ebpf, name: &'static str) -> anyhow::Result<Box<dyn Fn(&[u8], u32) -> anyhow::Result<u32>>> {
    Ok(Box::new(move |frame, repeat| {
        let prog: &Xdp = ebpf.program(name).context("program")?.try_into()?;
        run_timed(prog, frame, repeat)
    }))
}

fn limiter_runner(limiter: Limiter) -> Box<dyn Fn(&[u8], u32) -> anyhow::Result<u32>> {
    Box::new(move |frame, repeat| run_timed(limiter.program()?, frame, repeat))
}

/// Kernel-measured nanoseconds per run.
fn run_timed(prog: &Xdp, frame: &[u8], repeat: u32) -> anyhow::Result<u32> {
    let opts = TestRunOptions { data_in: Some(frame), repeat, ..TestRunOptions::default() };
    let result = prog.test_run(opts).context("BPF_PROG_TEST_RUN")?;
    Ok(result.duration.as_nanos() as u32)
}

fn bench_object(name: &'static str) -> anyhow::Result<Ebpf> {
    let mask = BUCKETS - 1;
    let mut ebpf = EbpfLoader::new()
        .map_max_entries("FLOOR_STATE", BUCKETS)
        .override_global("FLOOR_MASK", &mask, true)
        .load(objects::BENCH)?;
    let prog: &mut Xdp = ebpf.program_mut(name).context("program")?.try_into()?;
    prog.load()?;
    Ok(ebpf)
}

/// A limiter configured the way the daemon does it: `policies` as (match, rate, burst), then
/// `allow` entries.
/// A policy no benchmark run can exhaust: every packet takes the admit path.
const ADMIT_ALL: (&str, &str, u64) = ("any", "1000000000/s", 1_000_000_000);
/// A policy spent by each source's first packet: once warmed, every packet is refused.
const REFUSE: (&str, &str, u64) = ("any", "1/h", 1);

fn limiter(buckets: u32, policies: &[(&str, &str, u64)], allow: &[&str]) -> anyhow::Result<Limiter> {
    limiter_with(buckets, 1, policies, allow, Scope::Cpu)
}

/// [`limiter`] with the buckets split into `rows` count-min rows (same memory).
fn limiter_rows(buckets: u32, rows: u32, policies: &[(&str, &str, u64)], allow: &[&str]) -> anyhow::Result<Limiter> {
    limiter_with(buckets, rows, policies, allow, Scope::Cpu)
}

/// [`limiter`] with every policy of `scope`.
fn limiter_scoped(
    buckets: u32,
    policies: &[(&str, &str, u64)],
    allow: &[&str],
    scope: Scope,
) -> anyhow::Result<Limiter> {
    limiter_with(buckets, 1, policies, allow, scope)
}

fn limiter_with(
    buckets: u32,
    rows: u32,
    policies: &[(&str, &str, u64)],
    allow: &[&str],
    scope: Scope,
) -> anyhow::Result<Limiter> {
    configure(Limiter::load_rows(buckets, rows)?, policies, allow, scope)
}

/// [`limiter_rows`] with the per-CPU key memo off: every packet hashes its key (the A of an A/B).
fn limiter_without_memo(buckets: u32, rows: u32, policies: &[(&str, &str, u64)]) -> anyhow::Result<Limiter> {
    configure(Limiter::load_rows_without_key_memo(buckets, rows)?, policies, &[], Scope::Cpu)
}

/// [`limiter_rows`] with the tick refusal off: a standing refusal is checked on the precise
/// clock every packet (the A of an A/B).
fn limiter_without_tick(buckets: u32, rows: u32, policies: &[(&str, &str, u64)]) -> anyhow::Result<Limiter> {
    configure(Limiter::load_rows_without_tick_refusal(buckets, rows)?, policies, &[], Scope::Cpu)
}

/// A limiter of host-scope `policies`, with the per-CPU buckets as [`limiter`]'s and the host
/// array of [`BUCKETS`] in `host_rows` rows; its memo's shortcuts as given (both on: the shipped
/// program; otherwise its test build).
fn limiter_host(
    host_rows: u32,
    policies: &[(&str, &str, u64)],
    key_memo: bool,
    tick_refusal: bool,
) -> anyhow::Result<Limiter> {
    let geometry = Geometry { host_rows, ..Geometry::same(BUCKETS, 1) };
    let limiter = if key_memo && tick_refusal {
        Limiter::load_geometry(geometry)?
    } else {
        Limiter::load_switchable_geometry(geometry, key_memo, tick_refusal)?
    };
    configure(limiter, policies, &[], Scope::Host)
}

/// `limiter` sampling refusals as the daemon does by default (`--sample-refusals 256`).
fn sampled(mut limiter: Limiter) -> anyhow::Result<Limiter> {
    limiter.set_sampling(256)?;
    Ok(limiter)
}

fn configure(
    limiter: Limiter,
    policies: &[(&str, &str, u64)],
    allow: &[&str],
    scope: Scope,
) -> anyhow::Result<Limiter> {
    let defs = policies
        .iter()
        .map(|(matches, rate, burst)| {
            Ok(PolicyDef { matches: matches.parse()?, scope, ..PolicyDef::any(rate.parse()?, *burst) })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    configure_defs(limiter, defs, allow)
}

/// A limiter of 2^20 buckets with these policies (named in order, `p0`, `p1`, ...), as the
/// daemon sets them: overlapping ones are layers.
fn layered(defs: Vec<PolicyDef>) -> anyhow::Result<Limiter> {
    configure_defs(Limiter::load_rows(BUCKETS, 1)?, defs, &[])
}

/// A rate and burst no benchmark run can exhaust ([`ADMIT_ALL`]'s), and one spent by the
/// first packet.
const ADMITS: (&str, u64) = (ADMIT_ALL.1, ADMIT_ALL.2);
const REFUSES: (&str, u64) = ("1/h", 1);

/// A layer: `matches`, keyed on `key` (`src/0,/0`: one aggregate for every source), of `scope`.
fn layer(matches: &str, key: &str, scope: Scope, (rate, burst): (&str, u64)) -> anyhow::Result<PolicyDef> {
    Ok(PolicyDef { matches: matches.parse()?, key: key.parse()?, scope, ..PolicyDef::any(rate.parse()?, burst) })
}

fn configure_defs(mut limiter: Limiter, defs: Vec<PolicyDef>, allow: &[&str]) -> anyhow::Result<Limiter> {
    limiter.set_salt(limiter_ctl::kernel::draw_salt()?)?;
    let mut state = State::default();
    for (i, def) in defs.into_iter().enumerate() {
        state = state
            .with_policy(PolicyDef { name: format!("p{i}").parse()?, ..def })
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    for net in allow {
        state = state.with_net(List::Allow, net.parse()?).map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    limiter.sync(&State::default(), &state)?;
    Ok(limiter)
}

fn subjects() -> anyhow::Result<Vec<Subject>> {
    Ok(vec![
        Subject {
            name: "pass",
            what: "bare XDP_PASS",
            run: xdp_runner(bench_object("bench_pass")?, "bench_pass")?,
            warm_all_sources: false,
        },
        Subject {
            name: "floor",
            what: "parse + clock + one per-CPU array read-modify-write",
            run: xdp_runner(bench_object("bench_floor")?, "bench_floor")?,
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: admit",
            what: "policy matched, GCRA admits",
            run: limiter_runner(limiter(BUCKETS, &[ADMIT_ALL], &[])?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: refuse",
            what: "policy matched, GCRA refuses (XDP_DROP)",
            run: limiter_runner(limiter(BUCKETS, &[("any", "1/h", 1)], &[])?),
            warm_all_sources: true,
        },
        Subject {
            name: "limiter: refuse, no tick refusal",
            what: "as refuse, the standing refusal checked on the precise clock every packet (the tick refusal off)",
            run: limiter_runner(limiter_without_tick(BUCKETS, 1, &[("any", "1/h", 1)])?),
            warm_all_sources: true,
        },
        Subject {
            name: "limiter: refuse, sampling",
            what: "as refuse, 1 in 256 refusals sampled for `top` (the daemon's default)",
            run: limiter_runner(sampled(limiter(BUCKETS, &[("any", "1/h", 1)], &[])?)?),
            warm_all_sources: true,
        },
        Subject {
            name: "limiter: refuse, no key memo",
            what: "as refuse, every packet hashes its key (the memo off)",
            run: limiter_runner(limiter_without_memo(BUCKETS, 1, &[("any", "1/h", 1)])?),
            warm_all_sources: true,
        },
        Subject {
            name: "limiter: admit, no key memo",
            what: "as admit, every packet hashes its key (the memo off)",
            run: limiter_runner(limiter_without_memo(BUCKETS, 1, &[ADMIT_ALL])?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: refuse, 4 rows, no key memo",
            what: "as refuse, 4 rows, every packet hashes its key (the memo off)",
            run: limiter_runner(limiter_without_memo(BUCKETS, 4, &[("any", "1/h", 1)])?),
            warm_all_sources: true,
        },
        Subject {
            name: "limiter: admit, 2 rows",
            what: "as admit, --rows 2 (same memory)",
            run: limiter_runner(limiter_rows(BUCKETS, 2, &[ADMIT_ALL], &[])?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: admit, 3 rows",
            what: "as admit, --rows 3 (same memory)",
            run: limiter_runner(limiter_rows(BUCKETS, 3, &[ADMIT_ALL], &[])?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: admit, 4 rows",
            what: "as admit, --rows 4 (same memory)",
            run: limiter_runner(limiter_rows(BUCKETS, 4, &[ADMIT_ALL], &[])?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: refuse, 4 rows",
            what: "as refuse, --rows 4 (same memory)",
            run: limiter_runner(limiter_rows(BUCKETS, 4, &[("any", "1/h", 1)], &[])?),
            warm_all_sources: true,
        },
        Subject {
            name: "limiter: admit, host scope",
            what: "as admit, the bucket shared by all CPUs (read, then compare-and-exchange)",
            run: limiter_runner(limiter_scoped(BUCKETS, &[ADMIT_ALL], &[], Scope::Host)?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: refuse, host scope",
            what: "as refuse, the bucket shared by all CPUs (read only)",
            run: limiter_runner(limiter_scoped(BUCKETS, &[("any", "1/h", 1)], &[], Scope::Host)?),
            warm_all_sources: true,
        },
        Subject {
            name: "limiter: admit, host scope, 2 rows",
            what: "as admit, host scope in two rows (the default): both read, then each compare-and-exchanged",
            run: limiter_runner(limiter_host(2, &[ADMIT_ALL], true, true)?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: refuse, host scope, 2 rows",
            what: "as refuse, host scope in two rows (the default): both read",
            run: limiter_runner(limiter_host(2, &[REFUSE], true, true)?),
            warm_all_sources: true,
        },
        Subject {
            name: "limiter: refuse, host scope, no tick refusal",
            what: "as refuse, host scope, the standing refusal checked on the precise clock every packet",
            run: limiter_runner(limiter_host(1, &[REFUSE], true, false)?),
            warm_all_sources: true,
        },
        Subject {
            name: "limiter: refuse, host scope, no key memo",
            what: "as refuse, host scope, every packet hashes its key and reads its bucket (the memo off)",
            run: limiter_runner(limiter_host(1, &[REFUSE], false, false)?),
            warm_all_sources: true,
        },
        Subject {
            name: "limiter: admit, host scope, no key memo",
            what: "as admit, host scope, every packet hashes its key (the memo off)",
            run: limiter_runner(limiter_host(1, &[ADMIT_ALL], false, false)?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: no policy",
            what: "IP traffic no policy matches",
            run: limiter_runner(limiter(BUCKETS, &[], &[])?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: port policy, admit",
            what: "as admit, the policy found through the port table (udp:53) among 4 policies",
            // None of the others covers the frames: overlapping policies would be layers (issue
            // 24), and this row is the one-policy path.
            run: limiter_runner(limiter(
                BUCKETS,
                &[
                    ("udp:53", "1000000000/s", 1_000_000_000),
                    ("udp:54-60", "1/s", 1),
                    ("tcp", "1/s", 1),
                    ("icmp", "1/s", 1),
                ],
                &[],
            )?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: lists, admit",
            what: "as admit, with an allow list the sources are not on (one LPM lookup)",
            run: limiter_runner(limiter(BUCKETS, &[ADMIT_ALL], &["192.0.2.0/24", "2001:db8:ffff::/48"])?),
            warm_all_sources: false,
        },
    ])
}

/// What a row is measured on: the UDP frames (to port 53) of every other row, or TCP ACKs to
/// port 443 from the same sources (established traffic, which a SYN-only policy never judges).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Traffic {
    Udp,
    TcpAcks,
}

/// A row also reported against the row named `against`, measured in the same run. `expect` is
/// its verdict on its first frame once warmed, checked before measuring: a row that took
/// another path (one policy instead of a layer set, a SYN-only policy judging ACKs) would time
/// the wrong thing.
struct Compared {
    name: &'static str,
    what: &'static str,
    traffic: Traffic,
    against: &'static str,
    expect: u32,
    warm_all_sources: bool,
    limiter: Limiter,
}

fn compared() -> anyhow::Result<Vec<Compared>> {
    let per_source = |matches, rate| layer(matches, "src/32,/64", Scope::Cpu, rate);
    let aggregate = |matches, scope, rate| layer(matches, "src/0,/0", scope, rate);
    // One policy with a predicate the frames meet (their source port) still goes through the
    // layer set: the hand-over and one layer's look and commit, against the one-policy path.
    let one = |rate| -> anyhow::Result<_> {
        layered(vec![PolicyDef { sport: "40000".parse()?, ..per_source("udp:53", rate)? }])
    };
    // Per source, then an aggregate of every source, on the frames' udp:53.
    let two = |scope, last| -> anyhow::Result<_> {
        layered(vec![per_source("udp:53", ADMITS)?, aggregate("udp:53", scope, last)?])
    };
    // Judged in this order (exact port, its longer key first; range; protocol): the last is
    // `udp`'s aggregate.
    let four = |last| -> anyhow::Result<_> {
        layered(vec![
            per_source("udp:53", ADMITS)?,
            aggregate("udp:53", Scope::Cpu, ADMITS)?,
            per_source("udp:1-1023", ADMITS)?,
            aggregate("udp", Scope::Cpu, last)?,
        ])
    };
    let row = |name, what, against, expect, warm_all_sources, limiter| Compared {
        name,
        what,
        traffic: Traffic::Udp,
        against,
        expect,
        warm_all_sources,
        limiter,
    };
    let acks = |c: Compared| Compared { traffic: Traffic::TcpAcks, ..c };
    let syn_only = || layer("tcp:443,syn", "src/32,/64", Scope::Cpu, REFUSES);
    Ok(vec![
        row(
            "limiter: 1 layer, admit",
            "as admit, one udp:53 policy with a source port (40000) the frames have: judged through a layer set",
            "limiter: admit",
            XDP_PASS,
            false,
            one(ADMITS)?,
        ),
        row(
            "limiter: 2 layers, admit",
            "udp:53 per source, then udp:53 key src/0,/0 (aggregate), both scope cpu and admitting",
            "limiter: admit",
            XDP_PASS,
            false,
            two(Scope::Cpu, ADMITS)?,
        ),
        row(
            "limiter: 4 layers, admit",
            "as 2 layers, then udp:1-1023 per source and a udp aggregate, all admitting",
            "limiter: admit",
            XDP_PASS,
            false,
            four(ADMITS)?,
        ),
        row(
            "limiter: 2 layers, host aggregate, admit",
            "as 2 layers, the aggregate of scope host (the typical pair)",
            "limiter: admit",
            XDP_PASS,
            false,
            two(Scope::Host, ADMITS)?,
        ),
        row(
            "limiter: 1 layer, refuse",
            "as 1 layer, the layer refusing (spent)",
            "limiter: refuse",
            XDP_DROP,
            true,
            one(REFUSES)?,
        ),
        row(
            "limiter: 2 layers, last refuses",
            "as 2 layers, the aggregate refusing (spent): the per-source layer looked at, nothing written",
            "limiter: refuse",
            XDP_DROP,
            true,
            two(Scope::Cpu, REFUSES)?,
        ),
        row(
            "limiter: 4 layers, last refuses",
            "as 4 layers, the udp aggregate refusing (spent)",
            "limiter: refuse",
            XDP_DROP,
            true,
            four(REFUSES)?,
        ),
        row(
            "limiter: 2 layers, host aggregate refuses",
            "as 2 layers, host aggregate, the aggregate spent: a spread flood past its cap",
            "limiter: refuse",
            XDP_DROP,
            true,
            two(Scope::Host, REFUSES)?,
        ),
        acks(row(
            "limiter: no policy, TCP ACKs",
            "as no policy, TCP ACK segments to port 443",
            "limiter: no policy",
            XDP_PASS,
            false,
            limiter(BUCKETS, &[], &[])?,
        )),
        // Spent, and every source warmed: an ACK it judged would be refused (the check).
        acks(row(
            "limiter: SYN-only policy, TCP ACKs",
            "tcp:443,syn alone, TCP ACKs to 443: one-policy route, never judged",
            "limiter: no policy, TCP ACKs",
            XDP_PASS,
            true,
            layered(vec![syn_only()?])?,
        )),
        acks(row(
            "limiter: admit, TCP ACKs",
            "as admit, TCP ACKs to 443",
            "limiter: admit",
            XDP_PASS,
            false,
            limiter(BUCKETS, &[ADMIT_ALL], &[])?,
        )),
        acks(row(
            "limiter: SYN-only policy beside admit, TCP ACKs",
            "tcp:443,syn (spent) and any (admitting), TCP ACKs to 443: a layer set, judged by any alone",
            "limiter: admit, TCP ACKs",
            XDP_PASS,
            true,
            layered(vec![syn_only()?, per_source("any", ADMITS)?])?,
        )),
    ])
}

#[derive(Default, Clone)]
struct Sample {
    hot: Vec<f64>,
    random: Vec<f64>,
}

/// ns/packet of the admit path as bucket count and distinct sources grow: each cell cycles
/// through its sources (IPv6, one /64 each), one test run per packet, 2^20 packets.
fn scaling(spec: &FrameSpec) -> anyhow::Result<String> {
    const PACKETS: usize = 1 << 20;
    let bucket_counts = [1u32 << 10, 1 << 14, 1 << 18, 1 << 22];
    let source_counts = [1usize, 100, 10_000, 1_000_000];
    let mut rng = StdRng::seed_from_u64(0x5ca1e);
    let v6 = |i: u32| {
        let mut o = std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2).octets();
        o[4..8].copy_from_slice(&i.to_be_bytes());
        IpAddr::V6(o.into())
    };
    let spec = FrameSpec { dst: IpAddr::V6(netns::RECEIVER_V6), ..spec.clone() };
    let mut order: Vec<u32> = (0..1_000_000).collect();
    order.shuffle(&mut rng);
    let mut table = String::new();
    write!(table, "| buckets \\ distinct sources |")?;
    for n in source_counts {
        write!(table, " {n} |")?;
    }
    writeln!(table, "\n|---:|{}", "---:|".repeat(source_counts.len()))?;
    let frames: Vec<Vec<u8>> = order.iter().map(|i| spec.frame(v6(*i))).collect::<anyhow::Result<_>>()?;
    for buckets in bucket_counts {
        write!(table, "| 2^{} |", buckets.trailing_zeros())?;
        for sources in source_counts {
            let limiter = limiter(buckets, &[ADMIT_ALL], &[])?;
            let program = limiter.program()?;
            let mut total = 0u64;
            for i in 0..PACKETS {
                total += u64::from(run_timed(program, &frames[i % sources], 1)?);
            }
            write!(table, " {:.0} |", total as f64 / PACKETS as f64)?;
        }
        writeln!(table)?;
    }
    writeln!(
        table,
        "\nns/packet on the admit path (kernel-measured, one test run per packet, harness clock included as in the table above), {PACKETS} packets per cell."
    )?;
    Ok(table)
}

/// One workload of the contention table: ns/packet on each of two CPUs, alone (CPU 0 only) and
/// at once (both CPUs, started together), for a program of each scope.
fn contention(frames: &[Vec<u8>], rounds: usize) -> anyhow::Result<String> {
    use std::sync::Barrier;
    /// Each thread's share of one workload: `hot` repeats one frame (one key, one bucket) in the
    /// kernel; otherwise one test run per frame, every frame a different source.
    fn work(limiter: &Limiter, frames: &[Vec<u8>], hot: bool) -> anyhow::Result<f64> {
        let program = limiter.program()?;
        if hot {
            return Ok(f64::from(run_timed(program, &frames[0], HOT_REPEAT)?));
        }
        let total = frames.iter().map(|f| run_timed(program, f, 1).map(u64::from)).sum::<anyhow::Result<u64>>()?;
        Ok(total as f64 / frames.len() as f64)
    }
    let cases: [(&str, (&str, &str, u64), bool); 4] = [
        ("hot, admit (one key, every packet writes)", ADMIT_ALL, true),
        ("hot, refuse (one key, spent: every packet only reads)", ("any", "1/h", 1), true),
        ("random sources, admit", ADMIT_ALL, false),
        ("random sources, refuse", ("any", "1/h", 1), false),
    ];
    /// The layered variant's scope column.
    const PAIR: &str = "cpu per source + host aggregate";
    let mut table = String::new();
    writeln!(
        table,
        "| workload | scope | 1 CPU ns/pkt | 2 CPUs at once ns/pkt (CPU 0, CPU 1) | 2 CPUs / 1 CPU | refused by lost races |"
    )?;
    writeln!(table, "|---|---|---:|---:|---:|---:|")?;
    for (what, policy, hot) in cases {
        let refuse = policy != ADMIT_ALL;
        for scope in ["cpu", "host", PAIR] {
            let limiter = match scope {
                "cpu" => limiter_scoped(BUCKETS, &[policy], &[], Scope::Cpu)?,
                "host" => limiter_scoped(BUCKETS, &[policy], &[], Scope::Host)?,
                // The typical pair (docs/DESIGN.md, Layers): per source, scope cpu, admitting;
                // then every source's aggregate, scope host, refusing on the refuse workloads
                // (a spread flood past its cap): one shared bucket whatever the sources.
                _ => layered(vec![
                    layer("any", "src/32,/64", Scope::Cpu, ADMITS)?,
                    layer("any", "src/0,/0", Scope::Host, if refuse { REFUSES } else { ADMITS })?,
                ])?,
            };
            if refuse {
                // Spend every source's bucket first (on both CPUs: per-CPU buckets are per CPU).
                for cpu in [0, 1] {
                    limiter_tests::cpu::pin_current_thread(cpu)?;
                    for f in frames {
                        limiter.test_run(f)?;
                    }
                }
                limiter_tests::cpu::pin_current_thread(0)?;
            }
            let (mut alone, mut both) = (Vec::new(), [Vec::new(), Vec::new()]);
            let refused_before = limiter.counters()?.iter().map(|c| c.refused_packets).sum::<u64>();
            for _ in 0..rounds {
                alone.push(work(&limiter, frames, hot)?);
                let barrier = Barrier::new(2);
                let at_once: Vec<f64> = std::thread::scope(|s| {
                    let threads: Vec<_> = [0usize, 1]
                        .into_iter()
                        .map(|cpu| {
                            let (limiter, barrier) = (&limiter, &barrier);
                            s.spawn(move || -> anyhow::Result<f64> {
                                limiter_tests::cpu::pin_current_thread(cpu)?;
                                barrier.wait();
                                work(limiter, frames, hot)
                            })
                        })
                        .collect();
                    threads.into_iter().map(|t| t.join().expect("bench thread")).collect::<anyhow::Result<_>>()
                })?;
                both[0].push(at_once[0]);
                both[1].push(at_once[1]);
            }
            let refused = limiter.counters()?.iter().map(|c| c.refused_packets).sum::<u64>() - refused_before;
            let (one, b0, b1) = (median(&alone), median(&both[0]), median(&both[1]));
            writeln!(
                table,
                "| {what} | {scope} | {one:.1} | {:.1} ({b0:.1}, {b1:.1}) | {:.2}x | {} |",
                (b0 + b1) / 2.0,
                (b0 + b1) / 2.0 / one,
                if refuse { "(all refused)".to_string() } else { refused.to_string() }
            )?;
        }
    }
    writeln!(
        table,
        "\nKernel-measured ns/packet, medians of {rounds} rounds; hot: {HOT_REPEAT} repeats of one frame per thread; random: \
         {} sources, one test run each. \"refused by lost races\": admit-all packets refused because {} \
         compare-and-exchange tries in a row lost to the other CPU. \"{PAIR}\": two layers, `any` per source \
         (scope cpu, admitting) and `any` key src/0,/0 (scope host: one bucket for every source), admitting, or \
         on the refuse workloads spent.",
        frames.len(),
        limiter_common::maps::HOST_CAS_TRIES
    )?;
    Ok(table)
}

fn main() -> anyhow::Result<()> {
    let args = args()?;
    if !nix::unistd::geteuid().is_root() {
        bail!("the XDP benchmark loads BPF programs: run it as root (sudo -E cargo xtask bench)");
    }
    // Per-CPU state and a stable clock: stay on one CPU.
    limiter_tests::cpu::pin_current_thread(0).context("pinning to CPU 0")?;

    // 2^17 distinct sources in 198.18.0.0/15, in random order.
    let sources = microbench::shuffled_sources(0x6c696d, SOURCES);
    let spec = microbench::udp_spec();
    let frames = sources.iter().map(|&src| spec.frame(IpAddr::V4(src))).collect::<anyhow::Result<Vec<_>>>()?;
    // The same sources' established TCP traffic: ACK segments to port 443.
    let ack = tcp_segment(spec.sport, 443, Segment::Ack);
    let acks: Vec<Vec<u8>> =
        sources.iter().map(|src| ethernet(&[], EtherType::IPV4, &V4::from(src.octets()).datagram(&ack))).collect();
    let traffic = |t: Traffic| if t == Traffic::TcpAcks { &acks } else { &frames };

    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|o| name.contains(o.as_str()));
    let compared: Vec<Compared> = compared()?.into_iter().filter(|c| wanted(c.name)).collect();
    // The two baselines first, always: every ratio is to them; then the rows asked for and
    // those a compared row asked for is measured against.
    let mut subjects: Vec<(Subject, Traffic)> = subjects()?
        .into_iter()
        .enumerate()
        .filter(|(i, s)| *i < 2 || wanted(s.name) || compared.iter().any(|c| c.against == s.name))
        .map(|(_, s)| (s, Traffic::Udp))
        .collect();
    for (s, _) in subjects.iter().filter(|(s, _)| s.warm_all_sources) {
        for f in &frames {
            (s.run)(f, 1)?;
        }
    }
    // Each compared row warmed and checked here, then measured as any other row; its baseline's
    // index kept for the second table.
    let mut against = Vec::new();
    for c in compared {
        let frames = traffic(c.traffic);
        if c.warm_all_sources {
            for f in frames {
                c.limiter.test_run(f)?;
            }
        }
        let verdict = c.limiter.test_run(&frames[0])?;
        ensure!(verdict == c.expect, "{}: XDP action {verdict} on its first frame, expected {}", c.name, c.expect);
        let baseline = subjects.iter().position(|(s, _)| s.name == c.against).context(c.against)?;
        against.push((subjects.len(), baseline));
        let run = limiter_runner(c.limiter);
        subjects.push((Subject { name: c.name, what: c.what, run, warm_all_sources: false }, c.traffic));
    }
    let mut samples = vec![Sample::default(); subjects.len()];
    let started = Instant::now();
    for _ in 0..args.rounds {
        // Interleave programs within each round so drift on a noisy machine hits all alike.
        for ((s, t), sample) in subjects.iter().zip(samples.iter_mut()) {
            let frames = traffic(*t);
            sample.hot.push(f64::from((s.run)(&frames[0], HOT_REPEAT)?));
            let total: u64 = frames.iter().map(|f| (s.run)(f, 1).map(u64::from)).sum::<anyhow::Result<u64>>()?;
            sample.random.push(total as f64 / frames.len() as f64);
        }
    }
    let elapsed = started.elapsed();

    let floor = &samples[1];
    let pass = &samples[0];
    let (floor_hot, floor_rand, pass_rand) = (median(&floor.hot), median(&floor.random), median(&pass.random));
    let mut table = String::new();
    writeln!(
        table,
        "| program | what it does | hot ns/pkt | hot / floor | random-source ns/pkt | random / floor | net of bare pass / floor |"
    )?;
    writeln!(table, "|---|---|---:|---:|---:|---:|---:|")?;
    for ((s, _), sample) in subjects.iter().zip(&samples) {
        let (hot, rand) = (median(&sample.hot), median(&sample.random));
        writeln!(
            table,
            "| {} | {} | {:.1} | {:.2}x | {:.1} | {:.2}x | {:.2}x |",
            s.name,
            s.what,
            hot,
            hot / floor_hot,
            rand,
            rand / floor_rand,
            (rand - pass_rand) / (floor_rand - pass_rand),
        )?;
    }
    writeln!(
        table,
        "\n{} buckets per CPU, {} distinct IPv4 sources, {} rounds (medians), hot repeat {}; measured in {:.1} s on CPU 0.",
        BUCKETS,
        SOURCES,
        args.rounds,
        HOT_REPEAT,
        elapsed.as_secs_f64()
    )?;
    writeln!(table, "\n#### Layers and SYN-only policies, against one policy\n")?;
    writeln!(
        table,
        "| program | against | hot ns/pkt | hot / against | random-source ns/pkt | random / against | net of bare pass / against |"
    )?;
    writeln!(table, "|---|---|---:|---:|---:|---:|---:|")?;
    for (row, base) in against {
        let (s, b) = (&samples[row], &samples[base]);
        let (hot, rand, base_hot, base_rand) = (median(&s.hot), median(&s.random), median(&b.hot), median(&b.random));
        writeln!(
            table,
            "| {} | {} | {hot:.1} | {:.2}x | {rand:.1} | {:.2}x | {:.2}x |",
            subjects[row].0.name,
            subjects[base].0.name,
            hot / base_hot,
            rand / base_rand,
            (rand - pass_rand) / (base_rand - pass_rand),
        )?;
    }
    writeln!(
        table,
        "\nThe rows above, each against the row it is compared with (same run, medians). Layers: udp:53 per source \
         (src/32), a udp:53 aggregate (src/0), udp:1-1023 per source, a udp aggregate, judged in that order; \
         \"last refuses\": the last layer spent, the others admitting. TCP ACKs: the same sources, ACK segments to \
         port 443."
    )?;
    if args.contention {
        let contended = contention(&frames, args.rounds)?;
        writeln!(table, "\n#### Two-CPU contention, by scope\n\n{contended}")?;
        limiter_tests::cpu::pin_current_thread(0).context("pinning to CPU 0")?;
    }
    if args.scaling {
        let scaled = scaling(&spec)?;
        writeln!(table, "\n#### Scaling\n\n{scaled}")?;
    }
    print!("{table}");
    if let Some(out) = args.out {
        std::fs::write(&out, &table).with_context(|| format!("writing {out}"))?;
    }
    Ok(())
}

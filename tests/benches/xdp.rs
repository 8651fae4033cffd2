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
//!   bucket (host scope) against keeping one per CPU (cpu scope), as `--contention` prints.
//!
//! Run with `cargo xtask bench` (records BENCHMARKS.md) or
//! `cargo bench -p limiter-tests --bench xdp -- [--out FILE] [--rounds N]`.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr},
    time::Instant,
};

use anyhow::{Context as _, bail};
use aya::{
    Ebpf, EbpfLoader,
    programs::{TestRun, TestRunOptions, Xdp},
};
use limiter_ctl::{
    Limiter,
    config::{List, PolicyDef, Scope, State},
    objects,
};
use limiter_tests::{flood::FrameSpec, netns};
use rand::{SeedableRng, rngs::StdRng, seq::SliceRandom};

const BUCKETS: u32 = 1 << 20;
const SOURCES: usize = 1 << 17;
const HOT_REPEAT: u32 = 200_000;

struct Args {
    out: Option<String>,
    rounds: usize,
    scaling: bool,
    contention: bool,
}

fn args() -> anyhow::Result<Args> {
    let mut out = None;
    let mut rounds = 5;
    let mut scaling = false;
    let mut contention = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = Some(it.next().context("--out needs a file")?),
            "--rounds" => rounds = it.next().context("--rounds needs a number")?.parse()?,
            "--scaling" => scaling = true,
            "--contention" => contention = true,
            "--bench" => {} // passed by `cargo bench`
            other => bail!("unknown argument {other}; expected --out FILE, --rounds N, --scaling, --contention"),
        }
    }
    Ok(Args { out, rounds, scaling, contention })
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

/// `limiter` sampling refusals as the daemon does by default (`--sample-refusals 256`).
fn sampled(mut limiter: Limiter) -> anyhow::Result<Limiter> {
    limiter.set_sampling(256)?;
    Ok(limiter)
}

fn configure(
    mut limiter: Limiter,
    policies: &[(&str, &str, u64)],
    allow: &[&str],
    scope: Scope,
) -> anyhow::Result<Limiter> {
    limiter.set_salt(limiter_ctl::kernel::draw_salt()?)?;
    let mut state = State::default();
    for (i, (matches, rate, burst)) in policies.iter().enumerate() {
        state = state
            .with_policy(PolicyDef {
                name: format!("p{i}").parse()?,
                matches: matches.parse()?,
                scope,
                ..PolicyDef::any(rate.parse()?, *burst)
            })
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
            name: "limiter: no policy",
            what: "IP traffic no policy matches",
            run: limiter_runner(limiter(BUCKETS, &[], &[])?),
            warm_all_sources: false,
        },
        Subject {
            name: "limiter: port policy, admit",
            what: "as admit, the policy found through the port table (udp:53) among 4 policies",
            run: limiter_runner(limiter(
                BUCKETS,
                &[
                    ("udp:53", "1000000000/s", 1_000_000_000),
                    ("udp:50-60", "1/s", 1),
                    ("udp", "1/s", 1),
                    ("any", "1/s", 1),
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

#[derive(Default, Clone)]
struct Sample {
    hot: Vec<f64>,
    random: Vec<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
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
    let mut table = String::new();
    writeln!(
        table,
        "| workload | scope | 1 CPU ns/pkt | 2 CPUs at once ns/pkt (CPU 0, CPU 1) | 2 CPUs / 1 CPU | refused by lost races |"
    )?;
    writeln!(table, "|---|---|---:|---:|---:|---:|")?;
    for (what, policy, hot) in cases {
        for scope in [Scope::Cpu, Scope::Host] {
            let limiter = limiter_scoped(BUCKETS, &[policy], &[], scope)?;
            let refuse = policy != ADMIT_ALL;
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
                "| {what} | {} | {one:.1} | {:.1} ({b0:.1}, {b1:.1}) | {:.2}x | {} |",
                scope.as_str(),
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
         compare-and-exchange tries in a row lost to the other CPU.",
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

    let mut rng = StdRng::seed_from_u64(0x6c696d);
    // 2^17 distinct sources in 198.18.0.0/15, in random order.
    let base = u32::from(Ipv4Addr::new(198, 18, 0, 0));
    let mut offsets: Vec<u32> = (0..SOURCES as u32).collect();
    offsets.shuffle(&mut rng);
    let spec = FrameSpec {
        src_mac: netns::SENDER_MAC,
        dst_mac: netns::RECEIVER_MAC,
        dst: IpAddr::V4(netns::RECEIVER_V4),
        sport: 40_000,
        dport: 53,
        payload: 64,
    };
    let frames =
        offsets.iter().map(|o| spec.frame(IpAddr::V4(Ipv4Addr::from(base + o)))).collect::<anyhow::Result<Vec<_>>>()?;

    let subjects = subjects()?;
    for s in subjects.iter().filter(|s| s.warm_all_sources) {
        for f in &frames {
            (s.run)(f, 1)?;
        }
    }
    let mut samples = vec![Sample::default(); subjects.len()];
    let started = Instant::now();
    for _ in 0..args.rounds {
        // Interleave programs within each round so drift on a noisy machine hits all alike.
        for (s, sample) in subjects.iter().zip(samples.iter_mut()) {
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
    for (s, sample) in subjects.iter().zip(&samples) {
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

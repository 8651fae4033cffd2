//! Bans microbenchmark: what the per-packet lookup of bans costs as their number grows, by
//! BPF_PROG_TEST_RUN nanoseconds per packet of the shipped program, with 0, 10^4 and 10^6
//! single-address bans (IPv4, in `BANS_V4`) beside one admitting policy.
//!
//! Two workloads per count, as the XDP microbenchmark's (tests/benches/xdp.rs):
//! - *hot*: one frame repeated in the kernel (caches warm);
//! - *random sources*: a different source every packet over 2^17 sources, one test run each
//!   (the ban map's bucket is usually a cache miss, as under a spoofed flood).
//!
//! And two kinds of traffic: sources no ban covers (each packet looks up its address, misses,
//! and is judged by the policy: the cost bans add to every packet), and banned sources (the
//! lookup hits and the packet is dropped).
//!
//! Run with `cargo xtask bench --bans` (records BENCHMARKS.md between the `bench:bans`
//! markers) or `cargo bench -p limiter-tests --bench bans -- [--out FILE] [--rounds N]`.

use std::{
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr},
    time::Instant,
};

use anyhow::{Context as _, bail, ensure};
use aya::programs::{TestRun as _, TestRunOptions};
use ipnet::IpNet;
use limiter_common::maps::{ACL_DENY, Ban};
use limiter_ctl::{
    Limiter,
    config::{PolicyDef, State},
};
use limiter_tests::{
    kernel_programs::{XDP_DROP, XDP_PASS},
    microbench::{self, median},
};
use rand::{SeedableRng, rngs::StdRng, seq::SliceRandom};

const BUCKETS: u32 = 1 << 20;
const SOURCES: usize = 1 << 17;
const HOT_REPEAT: u32 = 200_000;
/// The ban counts measured.
const COUNTS: [u32; 3] = [0, 10_000, 1_000_000];
/// Bans are written in chunks of this many.
const CHUNK: usize = 10_000;

fn args() -> anyhow::Result<(Option<String>, usize)> {
    let (mut out, mut rounds) = (None, 5);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--out" => out = Some(it.next().context("--out needs a file")?),
            "--rounds" => rounds = it.next().context("--rounds needs a number")?.parse()?,
            "--bench" => {} // passed by `cargo bench`
            other => bail!("unknown argument {other}; expected --out FILE, --rounds N"),
        }
    }
    Ok((out, rounds))
}

/// Kernel-measured nanoseconds per run.
fn run_timed(limiter: &Limiter, frame: &[u8], repeat: u32) -> anyhow::Result<f64> {
    let opts = TestRunOptions { data_in: Some(frame), repeat, ..TestRunOptions::default() };
    Ok(limiter.program()?.test_run(opts).context("BPF_PROG_TEST_RUN")?.duration.as_nanos() as f64)
}

/// The banned addresses: `n` of 240.0.0.0/4 (reserved, never a real source), then the banned
/// sources the traffic uses.
fn banned(n: u32) -> impl Iterator<Item = Ipv4Addr> {
    (0..n).map(|i| Ipv4Addr::from(0xf000_0000 + i))
}

fn main() -> anyhow::Result<()> {
    let (out, rounds) = args()?;
    if !nix::unistd::geteuid().is_root() {
        bail!("the bans benchmark loads BPF programs: run it as root (sudo -E cargo xtask bench --bans)");
    }
    limiter_tests::cpu::pin_current_thread(0).context("pinning to CPU 0")?;
    let mut rng = StdRng::seed_from_u64(0x62616e);
    let spec = microbench::udp_spec();
    // Unbanned traffic: 2^17 sources of 198.18.0.0/15 in random order.
    let clean = microbench::shuffled_sources(0x62616e, SOURCES)
        .into_iter()
        .map(|src| spec.frame(IpAddr::V4(src)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut table = String::new();
    writeln!(
        table,
        "| bans (IPv4 addresses) | traffic | verdict | hot ns/pkt | random-source ns/pkt | random / 0 bans |"
    )?;
    writeln!(table, "|---:|---|---|---:|---:|---:|")?;
    let started = Instant::now();
    let mut zero = None;
    for count in COUNTS {
        let mut limiter = Limiter::load_rows(BUCKETS, 1)?;
        limiter.set_salt(limiter_ctl::kernel::draw_salt()?)?;
        let def = PolicyDef { name: "p0".parse()?, ..PolicyDef::any("1000000000/s".parse()?, 1_000_000_000) };
        let state = State::default().with_policy(def).map_err(|e| anyhow::anyhow!("{e}"))?;
        limiter.sync(&State::default(), &state)?;
        let deny = Ban { until_ns: u64::MAX, action: u32::from(ACL_DENY), origins: 0 };
        let addrs: Vec<Ipv4Addr> = banned(count).collect();
        let loading = Instant::now();
        for chunk in addrs.chunks(CHUNK) {
            let writes: Vec<(IpNet, Option<Ban>)> =
                chunk.iter().map(|a| (IpNet::from(IpAddr::V4(*a)), Some(deny))).collect();
            limiter.write_bans(&writes)?;
        }
        limiter.set_ban_flags([count > 0, false, false, false])?;
        eprintln!("{count} bans written in {:.2} s", loading.elapsed().as_secs_f64());
        let mut kinds = vec![("unbanned sources", clean.clone(), XDP_PASS)];
        if count > 0 {
            // Banned traffic: 2^17 of the banned addresses (all of them when fewer), random order.
            let mut hit: Vec<Ipv4Addr> = addrs.iter().copied().step_by((addrs.len() / SOURCES).max(1)).collect();
            hit.shuffle(&mut rng);
            let frames = hit.iter().map(|a| spec.frame(IpAddr::V4(*a))).collect::<anyhow::Result<Vec<_>>>()?;
            kinds.push(("banned sources", frames, XDP_DROP));
        }
        for (traffic, frames, expect) in kinds {
            let verdict = limiter.test_run(&frames[0])?;
            ensure!(verdict == expect, "{count} bans, {traffic}: XDP action {verdict}, expected {expect}");
            let (mut hot, mut random) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                hot.push(run_timed(&limiter, &frames[0], HOT_REPEAT)?);
                let mut total = 0.0;
                for f in &frames {
                    total += run_timed(&limiter, f, 1)?;
                }
                random.push(total / frames.len() as f64);
            }
            let (hot, random) = (median(&hot), median(&random));
            let base = *zero.get_or_insert(random);
            writeln!(
                table,
                "| {count} | {traffic} | {} | {hot:.1} | {random:.1} | {:.2}x |",
                if expect == XDP_DROP { "dropped" } else { "admitted" },
                random / base
            )?;
        }
    }
    writeln!(
        table,
        "\nThe shipped program with one admitting policy (scope cpu, {BUCKETS} buckets) and single-address bans in \
         `BANS_V4` (a hash map, no prealloc); {SOURCES} distinct sources per workload, {rounds} rounds (medians), \
         hot repeat {HOT_REPEAT}; measured in {:.1} s on CPU 0.",
        started.elapsed().as_secs_f64()
    )?;
    print!("{table}");
    if let Some(out) = out {
        std::fs::write(&out, &table).with_context(|| format!("writing {out}"))?;
    }
    Ok(())
}

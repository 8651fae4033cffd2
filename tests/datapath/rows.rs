//! Count-min rows end to end on a real veth pair: spoofed flooders spend their rows, then
//! innocent sources send one packet each; the share of innocents refused is measured against
//! theory, `(1 - (1 - 1/M)^K)^D` for K flooders and D rows of M buckets (the same memory
//! whatever D).
//!
//! The policy is 10 per minute, burst 5 (a 30 s window): a flooder sending 6+ packets keeps every
//! one of its rows spent for seconds after its last admission, so the innocents, sent within
//! milliseconds of the flood, meet the rows as the flood left them.

use std::net::Ipv4Addr;
use std::time::Duration;

use limiter_common::{
    FlowKey, SipKey,
    key::FAMILY_V4,
    maps::{CLASS_UDP, Counters, DEFAULT_BUCKETS},
    rows::{MAX_ROWS, row_len},
};
use limiter_ctl::{
    Limiter, ModeRequest,
    config::{PolicyDef, Rate, Scope},
    kernel::{Geometry, GeometryRequest, HostSize, compile},
};
use limiter_tests::{
    bounds::Judged,
    cpu::flood_cpu,
    flood::{Frames, Limits, PacketSocket, Prefix, Report, Sources},
    netns::TestNet,
    require_root,
};

const POLICY: u16 = 1;
const SALT: SipKey = SipKey { k0: 0x726f_7773_2d74_6573, k1: 0x7421_6c69_6d69_7465 };
/// How long a machine gets to offer each flooder its packets (and each innocent its one): far
/// more than the fastest and the slowest machines of this kind need.
const FLOOD_TIME: Duration = Duration::from_secs(10);
/// Each flooder is offered this many packets (burst 5, then refusals: its buckets are spent;
/// refusals write nothing, so more packets would change nothing).
const MIN_PER_FLOODER: u64 = 10;

/// What one run measured.
struct Loss {
    rows: u32,
    refused: u64,
    innocents: u64,
    theory: f64,
}

impl Loss {
    fn share(&self) -> f64 {
        self.refused as f64 / self.innocents as f64
    }
}

/// Floods `flooders` spoofed sources (198.19.0.0/16) at a fresh limiter of `buckets` split into
/// `rows` rows, then sends one packet from each of `innocents` others (198.18.0.0/16).
fn measure(net: &TestNet, buckets: u32, rows: u32, flooders: u32, innocents: u32) -> Loss {
    // Scope cpu: the per-CPU buckets, `buckets` in `rows` rows, are what is measured.
    measure_in(net, Geometry { rows, ..Geometry::same(buckets, 1) }, Scope::Cpu, flooders, innocents)
}

/// [`measure`] in the bucket arrays of `geometry`, under a policy of `scope`: the per-CPU
/// buckets' shape or the host-scope ones' is what the theory is computed for.
fn measure_in(net: &TestNet, geometry: Geometry, scope: Scope, flooders: u32, innocents: u32) -> Loss {
    let rate: Rate = "10/min".parse().expect("rate");
    let policy = compile::policy(&PolicyDef { scope, ..PolicyDef::any(rate, 5) }, POLICY).expect("policy");
    let mut limiter = Limiter::load_geometry(geometry).expect("loading the limiter");
    limiter.set_salt(SALT).expect("salt");
    limiter.set_policy(&policy).expect("policy");
    let mut config = limiter.config().expect("config");
    config.class_policy[CLASS_UDP] = policy.id;
    limiter.write_config(&config).expect("writing the config");
    let (buckets, rows) = match scope {
        Scope::Cpu => (geometry.buckets, geometry.rows),
        Scope::Host => (geometry.host_buckets, geometry.host_rows),
    };
    let iface = net.receiver.iface.clone();
    net.receiver
        .run(|| limiter.attach(&iface, ModeRequest::Native))
        .expect("entering the namespace")
        .expect("native XDP on veth");

    let spec = net.frames_to(false, 9);
    let flood = Sources::Spoofed { prefix: "198.19.0.0/16".parse::<Prefix>().expect("prefix"), count: flooders };
    let wanted = MIN_PER_FLOODER * u64::from(flooders);
    let report = send(net, &Frames::build(&spec, &flood).expect("frames"), Limits::counted(wanted, FLOOD_TIME));
    assert!(
        report.sent >= wanted,
        "the machine: its generator offered {} packets to {flooders} flooders in {FLOOD_TIME:?}, fewer than \
         {MIN_PER_FLOODER} each ({report}); the limiter is not at fault",
        report.sent
    );
    let before = limiter.counters_per_cpu(POLICY).expect("counters");
    let innocent = Sources::Spoofed { prefix: "198.18.0.0/16".parse::<Prefix>().expect("prefix"), count: innocents };
    let limits = Limits::counted(u64::from(innocents), FLOOD_TIME);
    let second = send(net, &Frames::build(&spec, &innocent).expect("frames"), limits);
    let after = limiter.counters_per_cpu(POLICY).expect("counters");
    let judged = Judged::between(&before, &after);
    let Counters { admitted_packets, refused_packets, .. } = judged.total;
    assert_eq!(second.sent, u64::from(innocents), "every innocent sends exactly one packet ({second})");
    assert_eq!(
        admitted_packets + refused_packets,
        u64::from(innocents),
        "the limiter judged {admitted_packets} + {refused_packets} innocent packets of {innocents} sent"
    );
    limiter.detach().expect("detach");
    Loss { rows, refused: refused_packets, innocents: u64::from(innocents), theory: theory(buckets, rows, flooders) }
}

/// The share of innocents refused, in theory: `(1 - (1 - 1/M)^K)^D` for `K` flooders and `D`
/// rows of `M` buckets.
fn theory(buckets: u32, rows: u32, flooders: u32) -> f64 {
    let m = f64::from(row_len(buckets, rows));
    (1.0 - (1.0 - 1.0 / m).powf(f64::from(flooders))).powi(rows as i32)
}

fn send(net: &TestNet, frames: &Frames, limits: Limits) -> Report {
    let iface = &net.sender.iface;
    net.sender
        .run(|| frames.send(&mut PacketSocket::open(iface)?, &limits.on_cpu(flood_cpu())))
        .expect("entering the namespace")
        .expect("sending")
}

/// The measured share within honest slack of theory: 5 binomial standard deviations plus 10%
/// of the expectation (the theory assumes independent, uniform row indexes; the salt is fixed)
/// plus one packet.
fn check_against_theory(loss: &Loss, what: &str) {
    let (expected, slack) = tolerance(loss.innocents, loss.theory);
    assert!(
        (loss.refused as f64 - expected).abs() <= slack,
        "{what}, {} rows: {} of {} innocents refused ({:.3}%); theory {:.3}% ({expected:.1}), allowed +-{slack:.1}",
        loss.rows,
        loss.refused,
        loss.innocents,
        100.0 * loss.share(),
        100.0 * loss.theory
    );
}

/// The expected count of `innocents` refused at the `theory` share, and the slack allowed around
/// it (see [`check_against_theory`]).
fn tolerance(innocents: u64, theory: f64) -> (f64, f64) {
    let expected = innocents as f64 * theory;
    (expected, 5.0 * (expected * (1.0 - theory)).sqrt() + 0.1 * expected + 1.0)
}

fn report(loss: &[Loss], what: &str) {
    for l in loss {
        eprintln!(
            "{what}, {} rows: {} of {} innocents refused ({:.3}%), theory {:.3}%",
            l.rows,
            l.refused,
            l.innocents,
            100.0 * l.share(),
            100.0 * l.theory
        );
    }
}

/// The second target: at the default memory (65,536 buckets) with 5,000 flooders, the
/// default rows lose at most a fifth of the innocents one row loses; every row count measures
/// as theory says.
#[test]
fn rows_spare_innocents_at_the_default_memory() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let buckets = limiter_common::maps::DEFAULT_BUCKETS;
    let loss: Vec<Loss> = (1..=4).map(|rows| measure(&net, buckets, rows, 5_000, 5_000)).collect();
    report(&loss, "65536 buckets, 5000 flooders");
    for l in &loss {
        check_against_theory(l, "65536 buckets, 5000 flooders");
    }
    let one = loss[0].share();
    let default = loss[limiter_common::rows::DEFAULT_ROWS as usize - 1].share();
    assert!(
        default <= one / 5.0,
        "{} rows refused {:.3}% of innocents, one row {:.3}%: more than a fifth",
        limiter_common::rows::DEFAULT_ROWS,
        100.0 * default,
        100.0 * one
    );
}

/// The first target: 20,000 flooders over 2^20 buckets; the default rows refuse at most
/// 0.1% of innocents (one row: about 1.9%).
#[test]
fn rows_spare_innocents_with_2_20_buckets() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let buckets = 1 << 20;
    let rows = limiter_common::rows::DEFAULT_ROWS;
    let loss = [measure(&net, buckets, 1, 20_000, 20_000), measure(&net, buckets, rows, 20_000, 20_000)];
    report(&loss, "2^20 buckets, 20000 flooders");
    for l in &loss {
        check_against_theory(l, "2^20 buckets, 20000 flooders");
    }
    assert!(loss[1].share() <= 0.001, "{rows} rows refused {:.3}% of innocents (> 0.1%)", 100.0 * loss[1].share());
}

/// Collateral at the daemon's defaults: a policy of the default scope (host) in the host-scope
/// buckets as `auto` sizes them on this machine, in the default host rows (two): 20,000 flooders
/// cost 20,000 innocents what theory says for that shape (0.009% at 2^22 buckets, against one
/// row's 0.48%), within issue 26's 0.1%, and no more than the innocents that share every row
/// with a flooder under the test's salt (computed from the shared key and row code).
#[test]
fn the_defaults_lose_innocents_as_theory_says_beside_20000_flooders() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let host = HostSize::read().expect("the host's memory and CPUs");
    let geometry = GeometryRequest::DEFAULT.resolve(&host);
    let default = PolicyDef::any("10/min".parse().expect("rate"), 5).scope;
    assert_eq!(default, Scope::Host, "a new policy's default scope");
    let loss = measure_in(&net, geometry, default, 20_000, 20_000);
    let what =
        format!("defaults ({} host buckets in {} rows), 20000 flooders", geometry.host_buckets, geometry.host_rows);
    report(std::slice::from_ref(&loss), &what);
    check_against_theory(&loss, &what);
    assert!(loss.share() <= 0.001, "{what}: refused {:.3}% of innocents (> 0.1%)", 100.0 * loss.share());
    // For these very keys (the test's salt), the innocents that share every row with a flooder:
    // all the kernel may refuse, and all it does refuse when every flooder's rows are spent.
    let rows = geometry.host_rows;
    assert!(rows >= 2, "the default host rows: {rows}");
    let len = row_len(geometry.host_buckets, rows);
    let (flood, innocent) = (Ipv4Addr::new(198, 19, 0, 0), Ipv4Addr::new(198, 18, 0, 0));
    let spent: std::collections::HashSet<u32> =
        (1..=20_000).flat_map(|n| rows_of(flood, n, rows, len).into_iter().take(rows as usize)).collect();
    let shared = (1..=20_000)
        .filter(|&n| rows_of(innocent, n, rows, len).iter().take(rows as usize).all(|b| spent.contains(b)))
        .count() as u64;
    eprintln!("{what}: {shared} innocents share every row with a flooder under the test's salt");
    assert!(
        loss.refused <= shared,
        "{what}: {} refused, but only {shared} share every row with a flooder",
        loss.refused
    );
}

/// The plot in docs/DESIGN.md: innocent loss against flooders for 1 to 4 rows at the default
/// memory, measured on veth beside theory; writes docs/rows-loss.svg and prints the table.
/// `sudo -E cargo test -p limiter-tests --test rows -- --ignored --nocapture plot`
#[test]
#[ignore]
fn plot_innocent_loss_against_flooders() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let buckets = DEFAULT_BUCKETS;
    let flooders = TABLE_FLOODERS;
    let mut series = Vec::new();
    eprintln!("| flooders | D = 1 | D = 2 | D = 3 | D = 4 |\n|---:|---:|---:|---:|---:|");
    let mut rows_table = vec![String::new(); flooders.len()];
    for rows in 1..=4u32 {
        let mut points = Vec::new();
        for (i, &k) in flooders.iter().enumerate() {
            let l = measure(&net, buckets, rows, k, 5_000);
            points.push((f64::from(k), 100.0 * l.share(), 100.0 * l.theory));
            rows_table[i] += &format!(" {:.2}% ({:.2}%) |", 100.0 * l.share(), 100.0 * l.theory);
        }
        series.push((format!("D = {rows}"), points));
    }
    for (k, row) in flooders.iter().zip(&rows_table) {
        eprintln!("| {k} |{row}");
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/rows-loss.svg");
    limiter_tests::plot::innocent_loss(
        path,
        "Innocent sources refused, 65,536 buckets split into D rows, 5,000 innocents",
        &series,
    )
    .expect("plot");
}

/// The flooder counts of DESIGN's rows table (and its plot).
const TABLE_FLOODERS: [u32; 6] = [1_000, 2_500, 5_000, 10_000, 15_000, 20_000];
/// The innocents of DESIGN's rows table.
const TABLE_INNOCENTS: u32 = 5_000;

/// The row buckets of the `n`-th host (from 1) of `prefix` under [`SALT`] and [`POLICY`] (key
/// src/32), as the kernel finds them: the key and hash are the shared code's
/// ([`FlowKey::row_buckets`]).
fn rows_of(prefix: Ipv4Addr, n: u32, rows: u32, len: u32) -> [u32; MAX_ROWS] {
    let mut addr = [0u8; 16];
    addr[..4].copy_from_slice(&Ipv4Addr::from(u32::from(prefix) + n).octets());
    FlowKey { addr, policy: POLICY, dport: 0, family: FAMILY_V4 }.row_buckets(&SALT, rows as usize, len)
}

/// DESIGN's rows table, computed (no kernel, fast): the sources and salt of the veth measurement
/// ([`measure`]: flooders 198.19.0.1.., innocents 198.18.0.1..), at the default memory, for each
/// flooder count of the table and D = 1..4. The flooders keep every one of their rows spent, so an
/// innocent is refused when each of its D row buckets is also a flooder's: that count, for the
/// very keys the kernel hashes, is held to theory `(1 - (1 - 1/M)^K)^D` within the tolerance of
/// [`check_against_theory`] (5 binomial standard deviations, 10% of the expectation, one more).
/// The table as published in docs/DESIGN.md is held to theory the same way, its bracketed theory
/// must be the formula's to the hundredth of a percent, and each measured cell must be the
/// computed one (the measurement is deterministic: fixed salt and sources).
#[test]
fn the_rows_table_agrees_with_theory() {
    let buckets = DEFAULT_BUCKETS;
    let (flood, innocent) = (Ipv4Addr::new(198, 19, 0, 0), Ipv4Addr::new(198, 18, 0, 0));
    let mut computed = vec![String::new(); TABLE_FLOODERS.len()];
    let mut predicted = std::collections::BTreeMap::new();
    for rows in 1..=MAX_ROWS as u32 {
        let len = row_len(buckets, rows);
        // Indexed as the generation's buckets: row r's bucket i is r x len + i.
        let mut spent = vec![false; buckets as usize];
        let mut flooders = 0;
        for (i, &k) in TABLE_FLOODERS.iter().enumerate() {
            for n in flooders + 1..=k {
                for &b in rows_of(flood, n, rows, len).iter().take(rows as usize) {
                    spent[b as usize] = true;
                }
            }
            flooders = k;
            let refused = (1..=TABLE_INNOCENTS)
                .filter(|&n| rows_of(innocent, n, rows, len).iter().take(rows as usize).all(|&b| spent[b as usize]))
                .count() as u64;
            let loss = Loss { rows, refused, innocents: u64::from(TABLE_INNOCENTS), theory: theory(buckets, rows, k) };
            predicted.insert((k, rows), format!("{:.2}% ({:.2}%)", 100.0 * loss.share(), 100.0 * loss.theory));
            computed[i] += &format!(" {} |", predicted[&(k, rows)]);
            check_against_theory(&loss, &format!("computed, {k} flooders"));
        }
    }
    eprintln!("computed for the veth measurement's keys:\n| flooders | D = 1 | D = 2 | D = 3 | D = 4 |");
    for (k, row) in TABLE_FLOODERS.iter().zip(&computed) {
        eprintln!("| {k} |{row}");
    }

    let design = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/DESIGN.md"))
        .expect("reading docs/DESIGN.md");
    let mut published = 0;
    for line in design.lines() {
        let cells: Vec<&str> = line.trim().trim_matches('|').split('|').map(str::trim).collect();
        let Some(k) = cells.first().and_then(|c| c.replace(',', "").parse::<u32>().ok()) else { continue };
        if !TABLE_FLOODERS.contains(&k) || cells.len() != 1 + MAX_ROWS {
            continue;
        }
        for (rows, cell) in (1..=MAX_ROWS as u32).zip(&cells[1..]) {
            let percent = |s: &str| -> f64 {
                s.trim().trim_end_matches('%').parse().unwrap_or_else(|e| panic!("DESIGN, {k} flooders: '{cell}': {e}"))
            };
            let (measured, bracket) = cell
                .split_once(" (")
                .map(|(m, t)| (percent(m), percent(t.trim_end_matches(')'))))
                .unwrap_or_else(|| panic!("DESIGN, {k} flooders, D = {rows}: '{cell}' is not 'M% (T%)'"));
            let theory = theory(buckets, rows, k);
            assert!(
                (bracket - 100.0 * theory).abs() < 0.006,
                "DESIGN, {k} flooders, D = {rows}: theory given as {bracket}%, the formula says {:.3}%",
                100.0 * theory
            );
            // The veth measurement is deterministic (fixed salt and sources, every flooder's rows
            // spent): it must be what the shared code predicts for those keys.
            assert_eq!(
                Some(*cell),
                predicted.get(&(k, rows)).map(String::as_str),
                "DESIGN, {k} flooders, D = {rows}: published, then computed for the measured keys; re-measure with \
                 `sudo -E cargo test -p limiter-tests --test rows -- --ignored --nocapture plot`"
            );
            let refused = (measured / 100.0 * f64::from(TABLE_INNOCENTS)).round() as u64;
            let loss = Loss { rows, refused, innocents: u64::from(TABLE_INNOCENTS), theory };
            check_against_theory(&loss, &format!("docs/DESIGN.md, {k} flooders"));
            published += 1;
        }
    }
    assert_eq!(published, TABLE_FLOODERS.len() * MAX_ROWS, "cells of the rows table found in docs/DESIGN.md");
}

//! Count-min rows end to end on a real veth pair: spoofed flooders spend their rows, then
//! innocent sources send one packet each; the share of innocents refused is measured against
//! theory, `(1 - (1 - 1/M)^K)^D` for K flooders and D rows of M buckets (the same memory
//! whatever D).
//!
//! The policy is 10 per minute, burst 5 (a 30 s window): a flooder sending 6+ packets keeps every
//! one of its rows spent for seconds after its last admission, so the innocents, sent within
//! milliseconds of the flood, meet the rows as the flood left them.

use std::time::Duration;

use limiter_common::{SipKey, maps::Counters, rows::row_len};
use limiter_ctl::{
    ModeRequest,
    config::{PolicySpec, Rate},
};
use limiter_tests::{
    bounds::Judged,
    cpu::flood_cpu,
    flood::{Frames, Limits, PacketSocket, Prefix, Report, Sources},
    kernel_programs::udp_limiter,
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
    let rate: Rate = "10/min".parse().expect("rate");
    let policy = PolicySpec::any(rate, 5).compile(POLICY).expect("policy");
    let mut limiter = udp_limiter(buckets, SALT, &policy).expect("loading the limiter");
    let mut config = limiter.config().expect("config");
    config.rows = rows;
    config.row_len = row_len(buckets, rows);
    limiter.write_config(&config).expect("writing the config");
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
    let m = f64::from(row_len(buckets, rows));
    let theory = (1.0 - (1.0 - 1.0 / m).powf(f64::from(flooders))).powi(rows as i32);
    Loss { rows, refused: refused_packets, innocents: u64::from(innocents), theory }
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
    let n = loss.innocents as f64;
    let expected = n * loss.theory;
    let slack = 5.0 * (expected * (1.0 - loss.theory)).sqrt() + 0.1 * expected + 1.0;
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

/// The plot in docs/DESIGN.md: innocent loss against flooders for 1 to 4 rows at the default
/// memory, measured on veth beside theory; writes docs/rows-loss.svg and prints the table.
/// `sudo -E cargo test -p limiter-tests --test rows -- --ignored --nocapture plot`
#[test]
#[ignore]
fn plot_innocent_loss_against_flooders() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let buckets = limiter_common::maps::DEFAULT_BUCKETS;
    let flooders = [1_000u32, 2_500, 5_000, 10_000, 15_000, 20_000];
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

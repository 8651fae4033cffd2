//! A flood costs the daemon almost nothing, and `top` still names the heaviest sources at once.
//!
//! The daemon runs with its default sampling of refusals (1 in 256, at most 256 samples a second
//! for the host: `--samples-per-s`), on the shared [`limiter_tests::rig`]. Floods come from the
//! flood generator ([`limiter_tests::generator`], on the fastest sender this machine offers),
//! pinned, and bounded by time; the tests say which sender and the rate it reached. The
//! daemon's CPU time is read from /proc (its threads, live and exited).

use std::time::{Duration, Instant};

use limiter_tests::{
    bounds::Judged,
    cpu::{ProcessCpu, flood_cpu, keep_off_flood_cpu, pin_current_thread},
    flood::{L4, Limits, Report, Sources, cap},
    generator::{Generator, SourceRange},
    policies::src,
    require_root,
    rig::{Flooding, Rig},
};
use serde_json::Value;

/// The most of a core the daemon may use under a flood, with the default sampling.
const MAX_DAEMON_SHARE: f64 = 0.01;
/// Refusals per second below which a run is no flood: the test would prove nothing. Above
/// 256 x 256 = 65,536 a second the default sampling (1 in 256) draws more than its budget of
/// 256 samples a second, so the budget is what holds the daemon's cost: this floor leaves room
/// above that for the slowest sender at half speed (the packet ring reaches 300,000+ frames a
/// second on the machines of this kind, live frames millions).
const MIN_REFUSALS_PER_S: f64 = 100_000.0;
/// The lighter flood of the ranking test, paced: at most a tenth of what the slowest sender
/// reaches, so the heavier one is heavier on every machine and sender.
const LIGHT_PER_S: f64 = 20_000.0;
/// The heavier flood of the ranking test, paced: ten times the lighter, and within what every
/// sender reaches on one CPU with room to spare. Unpaced, live frames reach millions a second
/// and keep the veth's receive NAPI running on the heavier flood's CPU, which then judges the
/// lighter flood's frames too: the lighter becomes a sliver of that CPU's sampled refusals, and
/// its estimate varies past any bound a test can hold (27,648 and 126,720 of 65,661 measured).
const HEAVY_PER_S: f64 = 10.0 * LIGHT_PER_S;
const FLOOD: Duration = Duration::from_secs(5);
/// `top`'s window (`limiter_ctl`'s daemon::top::WINDOW): its rates are refusals over it.
const TOP_WINDOW_S: f64 = 10.0;

/// One daemon, one source flooding as fast as the generator goes.
struct Cost {
    flood: Report,
    refused: u64,
    daemon: ProcessCpu,
    /// Over the same time as `daemon`.
    wall: Duration,
    /// `top --json` after the flood.
    top: Value,
}

impl Cost {
    fn share(&self) -> f64 {
        self.daemon.total.as_secs_f64() / self.wall.as_secs_f64()
    }

    fn refused_per_s(&self) -> f64 {
        self.refused as f64 / self.flood.duration().as_secs_f64()
    }

    fn samples(&self) -> u64 {
        entries(&self.top).iter().map(|e| e["samples"].as_u64().unwrap_or(0)).sum()
    }

    /// The refusals `top` estimates over its window.
    fn estimated(&self) -> f64 {
        entries(&self.top).iter().map(|e| e["refused_per_s"].as_f64().unwrap_or(0.0)).sum::<f64>() * TOP_WINDOW_S
    }
}

impl std::fmt::Display for Cost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "daemon {:.3}% of a core ({:?} in {:?}; live threads {:?}: {:?}); {:.0} refusals/s ({} refused; flood {}); top: \
             {} samples standing for {:.0} refusals",
            100.0 * self.share(),
            self.daemon.total,
            self.wall,
            self.daemon.threads_total(),
            self.daemon.threads,
            self.refused_per_s(),
            self.refused,
            self.flood,
            self.samples(),
            self.estimated(),
        )
    }
}

fn entries(top: &Value) -> &[Value] {
    top["entries"].as_array().map_or(&[], |v| v.as_slice())
}

/// A daemon started with `extra`, a policy refusing nearly all of one source's flood, and that
/// flood for [`FLOOD`]: what it cost the daemon.
fn flood_cost(extra: &[&str]) -> Cost {
    let rig = Rig::start(extra).expect("rig");
    rig.ctl_ok(&["policy", "set", "p", "--match", "udp", "--rate", "100/s", "--burst", "10"]);
    let id = rig.policy_id("p");
    let source = src("198.19.1.1");
    let generator =
        Generator::new(&rig.spec(source, 7000), L4::Udp, SourceRange::one(source)).expect("the flood generator");
    // The daemon's start (its first occupancy scan, the policy's apply) is behind it.
    std::thread::sleep(Duration::from_millis(500));
    let pid = rig.daemon.daemon_pid().as_raw();
    // Only its own work counted: not the receiver's softirqs, which this kernel would charge it.
    keep_off_flood_cpu(pid).expect("the daemon kept off the flood's CPU");
    let counters = rig.daemon.counters(id).expect("counters");
    let (before, start) = (ProcessCpu::read(pid).expect("the daemon's CPU time"), Instant::now());
    let sender = rig.net.sender.iface.clone();
    let flood = rig
        .net
        .sender
        .run(move || -> anyhow::Result<Report> {
            pin_current_thread(flood_cpu())?;
            generator.send(&sender, cap(FLOOD), FLOOD)
        })
        .expect("sender")
        .expect("flood");
    // The last samples drained.
    std::thread::sleep(Duration::from_millis(200));
    let (after, wall) = (ProcessCpu::read(pid).expect("the daemon's CPU time"), start.elapsed());
    let judged = Judged::between(&counters, &rig.daemon.counters(id).expect("counters"));
    let out = rig.ctl_ok(&["top", "--json"]);
    let top = serde_json::from_str(&out).unwrap_or_else(|e| panic!("top --json ({e}): {out}"));
    Cost { flood, refused: judged.total.refused_packets, daemon: after.since(&before), wall, top }
}

/// With the default sampling, a one-source flood at the generator's full speed (hundreds of
/// thousands of refusals a second at least) costs the daemon at most 1% of a core; the kernel
/// sent no more samples than the budget allows, and `top` still estimates the refusals right
/// (each sample weighs the draws the budget skipped). For the record, the same flood against
/// the old default (every 1-in-256 refusal, `--samples-per-s 0`).
#[test]
fn a_flood_costs_the_daemon_at_most_one_percent_of_a_core() {
    require_root!();
    let bounded = flood_cost(&[]);
    eprintln!("default sampling (1 in 256, at most 256 samples/s): {bounded}");
    let unbounded = flood_cost(&["--samples-per-s", "0"]);
    eprintln!("old default (1 in 256, no cap): {unbounded}");
    eprintln!(
        "daemon CPU: {:.3}% of a core with the budget, {:.3}% without, at {:.2} and {:.2} M refusals/s, sent by {}",
        100.0 * bounded.share(),
        100.0 * unbounded.share(),
        bounded.refused_per_s() / 1e6,
        unbounded.refused_per_s() / 1e6,
        bounded.flood.sender.unwrap_or("?")
    );

    let c = &bounded;
    assert!(
        c.refused_per_s() >= MIN_REFUSALS_PER_S,
        "no flood: {:.0} refusals/s, under the {MIN_REFUSALS_PER_S} this test needs to mean anything: {c}",
        c.refused_per_s()
    );
    assert!(
        c.share() <= MAX_DAEMON_SHARE,
        "the daemon used {:.3}% of a core under the flood, over {}%: {c}",
        100.0 * c.share(),
        100.0 * MAX_DAEMON_SHARE
    );
    // At most the host's budget (256 a second, split over the possible CPUs; the veth may judge
    // on either CPU) over the seconds the flood touched.
    let seconds = c.flood.duration().as_secs_f64().ceil() + 1.0;
    let cpus = aya::util::nr_cpus().expect("possible CPUs");
    let budget = limiter_ctl::kernel::per_cpu_budget(limiter_ctl::kernel::DEFAULT_SAMPLES_PER_S, cpus) as usize * cpus;
    assert!(c.samples() > 0, "no samples reached top: {c}");
    assert!(
        c.samples() as f64 <= budget as f64 * seconds,
        "{} samples, over the budget of {budget} a second: {c}",
        c.samples()
    );
    let (ratio, slack) = (c.estimated() / c.refused as f64, estimate_slack(c.samples()));
    assert!(
        (1.0 - slack..=1.0 + slack).contains(&ratio),
        "top estimates {:.0} refusals of {} ({ratio:.2}x, within {slack:.2} asked): {c}",
        c.estimated(),
        c.refused
    );
}

/// Two sources flood at different rates, each sender on its own CPU (the veth judges where its
/// receive NAPI runs, so both CPUs spend their budget on a mix of the two): `top`, asked from
/// the heavier flood's start, names the heavier one's prefix first within a second and from
/// then on, and estimates each one's refusals near what its policy counted. Each flood goes to
/// a port of its own under a policy of its own, so the counters tell the two apart.
#[test]
fn top_names_the_heavier_flood_first_within_a_second() {
    require_root!();
    let cpus = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).expect("affinity");
    let heavy_cpu = flood_cpu();
    let light_cpu = (0..heavy_cpu).rev().find(|&c| cpus.is_set(c).unwrap_or(false));
    let Some(light_cpu) = light_cpu else {
        panic!("this test needs two CPUs (the floods are judged on the CPU that sends them)");
    };
    let rig = Rig::start(&[]).expect("rig");
    for (name, port) in [("heavy", "7000"), ("light", "7001")] {
        let udp = format!("udp:{port}");
        rig.ctl_ok(&["policy", "set", name, "--match", &udp, "--rate", "100/s", "--burst", "10", "--key", "src/24"]);
    }
    let ids = [rig.policy_id("heavy"), rig.policy_id("light")];
    let counters = ids.map(|id| rig.daemon.counters(id).expect("counters"));
    let (heavy, light) = (src("198.19.1.1"), src("198.19.2.1"));
    let generator =
        Generator::new(&rig.spec(heavy, 7000), L4::Udp, SourceRange::one(heavy)).expect("the flood generator");

    // The lighter flood (a packet socket, paced) first, so `top` has something else to name when
    // the heavier one starts.
    let light_stream = rig.udp(Sources::One(light), 7001);
    let limits = Limits::timed(Duration::from_millis(3300)).on_cpu(light_cpu);
    let lightly =
        Flooding::start(&rig.net.sender, std::slice::from_ref(&light_stream), limits, Some(LIGHT_PER_S), None);
    std::thread::sleep(Duration::from_millis(300));
    let sender = rig.net.sender.iface.clone();
    let heavily = rig.net.sender.spawn(move || -> anyhow::Result<Report> {
        pin_current_thread(heavy_cpu)?;
        paced(&generator, &sender, HEAVY_PER_S, Duration::from_millis(2500))
    });
    // (when answered, the first prefix, the whole answer)
    let mut polls: Vec<(Instant, Option<String>, String)> = Vec::new();
    while !heavily.is_finished() {
        let out = rig.ctl_ok(&["top", "--json"]);
        let answered = Instant::now();
        let report: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("top --json ({e}): {out}"));
        let first = entries(&report).first().and_then(|e| e["prefix"].as_str()).map(str::to_string);
        polls.push((answered, first, out));
        std::thread::sleep(Duration::from_millis(50));
    }
    let heavy_run = heavily.join().expect("the heavier flood's thread").expect("sender").expect("flood");
    let light_run = lightly.finish().expect("the lighter flood");
    let out = rig.ctl_ok(&["top", "--json"]);
    let last: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("top --json ({e}): {out}"));
    let refused =
        |i: usize| Judged::between(&counters[i], &rig.daemon.counters(ids[i]).expect("counters")).total.refused_packets;
    let (heavy_refused, light_refused) = (refused(0), refused(1));

    let (heavy_net, light_net) = ("198.19.1.0/24", "198.19.2.0/24");
    let start = heavy_run.first.expect("the heavier flood's start");
    let end = heavy_run.last.expect("the heavier flood's end");
    let light_end = light_run.report.last.expect("the lighter flood's end");
    let at = |t: Instant| t.saturating_duration_since(start).as_secs_f64();
    let named: Vec<(f64, Option<&str>)> = polls.iter().map(|(t, p, _)| (at(*t), p.as_deref())).collect();
    let heavy_rate = heavy_refused as f64 / heavy_run.duration().as_secs_f64();
    let light_rate = light_refused as f64 / light_run.report.duration().as_secs_f64();
    eprintln!(
        "heavier {heavy_net}: {heavy_refused} refused, {heavy_rate:.0}/s ({heavy_run}); lighter {light_net}: \
         {light_refused} refused, {light_rate:.0}/s ({})",
        light_run.report
    );
    eprintln!("top's first prefix, by seconds since the heavier flood started: {named:?}");
    let first_named = polls.iter().find(|(t, p, _)| *t >= start && p.as_deref() == Some(heavy_net));
    eprintln!("named first after {:?} s", first_named.map(|(t, _, _)| at(*t)));
    eprintln!("after the floods: {out}");

    // The heavier is heavier, and both flooded while top was asked.
    assert!(
        heavy_rate >= 2.0 * light_rate,
        "the floods' refusal rates are too close for a ranking to mean anything: {heavy_rate:.0}/s vs {light_rate:.0}/s"
    );
    assert!(light_end > end, "the lighter flood ended before the heavier one: {}", light_run.report);
    let judged: Vec<&(Instant, Option<String>, String)> =
        polls.iter().filter(|(t, _, _)| *t >= start + Duration::from_secs(1) && *t <= end).collect();
    assert!(judged.len() >= 3, "top answered only {} times between 1 s into the flood and its end", judged.len());
    for (t, first, out) in judged {
        assert_eq!(first.as_deref(), Some(heavy_net), "{:.2} s into the heavier flood, top named: {out}", at(*t));
    }

    // Each prefix's estimate (weights x 256, over top's window) is near its refusals, within
    // what its samples can tell.
    for (net, refused) in [(heavy_net, heavy_refused), (light_net, light_refused)] {
        let e = entries(&last).iter().find(|e| e["prefix"] == net).unwrap_or_else(|| panic!("no {net} in {out}"));
        let estimate = e["refused_per_s"].as_f64().expect("refused_per_s") * TOP_WINDOW_S;
        let samples = e["samples"].as_u64().expect("samples");
        let slack = estimate_slack(samples);
        let ratio = estimate / refused as f64;
        assert!(
            (1.0 - slack..=1.0 + slack).contains(&ratio),
            "{net}: top estimates {estimate:.0} refusals of {refused} ({ratio:.2}x, from {samples} samples: within \
             {slack:.2} asked): {out}"
        );
    }
}

/// How far a prefix's estimate may stray from its refusals, relatively, when `samples` of them
/// reached `top`: 30%, or four standard errors where its samples are fewer. An estimate from K
/// samples has a relative standard error of about 1 / sqrt(K) (each sample a draw of 1 in 256,
/// or under the budget a reservoir's pick from its CPU's hits): the lighter flood, sharing the
/// heavier one's CPU when the veth's receive NAPI runs there, gets a tenth of that CPU's 128
/// samples a second over a flood of 2.5 s, and once strayed 31%. A weight or a window gone
/// wrong strays by whole factors.
fn estimate_slack(samples: u64) -> f64 {
    (4.0 / (samples.max(1) as f64).sqrt()).clamp(0.3, 0.8)
}

/// `generator`'s flood at `per_s` frames a second for `length`: a send of a 100 ms slot's frames
/// (each send has a fixed cost of milliseconds: live frames set up their pages), then a wait for
/// the slot's end; a slower sender just sends what it can in each.
fn paced(generator: &Generator, iface: &str, per_s: f64, length: Duration) -> anyhow::Result<Report> {
    const SLOT: Duration = Duration::from_millis(100);
    let per_slot = (per_s * SLOT.as_secs_f64()).ceil() as u64;
    let first = Instant::now();
    let mut report = Report { first: Some(first), ..Report::default() };
    let mut slot_end = first;
    while Instant::now() < first + length {
        slot_end = (slot_end + SLOT).max(Instant::now()).min(first + length);
        let slot = generator.send(iface, per_slot, slot_end.saturating_duration_since(Instant::now()).max(SLOT / 2))?;
        report.sent += slot.sent;
        report.sender = slot.sender;
        std::thread::sleep(slot_end.saturating_duration_since(Instant::now()));
    }
    report.last = Some(Instant::now());
    Ok(report)
}

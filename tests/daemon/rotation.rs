//! End to end: salt rotation without a fresh allowance, failing static when the daemon
//! dies, adoption by a restarted daemon, the salt kept secret, and the failure directions
//! (broken config, missing bpffs, interface re-created, a fault on the hot path).
//!
//! The daemon runs in the receiver's network namespace only ([`limiter_tests::daemon::Runner`]),
//! so its pins land on the machine's bpffs under the test's own `--pin-dir` and outlive a
//! SIGKILL; every test leaves nothing pinned or attached, also when it fails (the rig's drop
//! order: daemon, then pins, then namespaces).
//!
//! Bounds are `Gcra::bound` of the policy as this file computes it, summed over the CPUs that
//! judged the flood (the sender is pinned, so one), over the window from before the first send
//! to the last delivery; delivered frames are counted by a packet socket on the receiver's veth.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    process::Command,
    time::{Duration, Instant},
};

use limiter_common::{
    Gcra, SipInit,
    maps::{Config, Counters, GENERATIONS},
};
use limiter_ctl::{
    Limiter,
    config::{PolicyDef, Rate},
    kernel::compile,
};
use limiter_tests::{
    bounds::{Judged, check_lower, check_overload, check_upper, nanos, since, stall_cost},
    cpu::{flood_cpu, pin_current_thread},
    daemon::{
        ADOPTED, Ctl, Daemon, Runner, SIGNAL_TIMEOUT, Snapshot, program_counters, program_loaded, write_program_config,
        xdp_program_id,
    },
    flood::{DEFAULT_PAYLOAD, DEFAULT_SPORT, FrameSpec, Limits, Sources},
    kernel_programs::{XDP_DROP, XDP_PASS, udp_limiter},
    observe::{fresh_stats, metrics, value},
    policies::{gcra, src},
    require_root,
    rig::{METRICS, Rig, SEC, check_hand_over, flow, total},
};

/// Beyond the longest burst window, the daemon consults the old buckets this much longer.
const GRACE_MARGIN: Duration = Duration::from_millis(50);

// ---------------------------------------------------------------------------------------------
// a. Rotation grants no fresh allowance

/// A source sending steadily at 3x its rate across 20 scheduled rotations (every 150 ms, each
/// one while the source is over its limit: its bucket is full at every rotation) is delivered no
/// more than `B + r*t` (plus one emission) over the whole run; a design that reset the buckets
/// on rotation would have admitted up to `B` more per rotation. Each rotation's grace is the
/// burst window + 50 ms, and the generations alternate.
#[test]
fn twenty_rotations_grant_no_fresh_allowance() {
    require_root!();
    const RATE: u64 = 1000;
    const BURST: u64 = 50;
    const ROTATIONS: usize = 20;
    let limit = gcra(RATE, BURST);
    // Window 50 ms, grace 100 ms: shorter than the interval, so no scheduled rotation is refused.
    let window = Duration::from_nanos(limit.window_ns());
    let grace = window + GRACE_MARGIN;
    let mut rig = Rig::start(&[
        "--rate",
        "1000/s",
        "--burst",
        "50",
        "--rotate-every",
        "150ms",
        "--buckets",
        "1024",
        "--metrics",
        "off",
    ])
    .expect("rig");
    let id = rig.policy_id("default");
    let before = rig.daemon.counters(id).expect("counters");
    let stream = rig.udp(Sources::One(src("198.19.1.1")), 7000);
    let flow = flow(&stream, src("198.19.1.1"));

    let flooding = rig
        .start_flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_secs(30)), Some(3.0 * RATE as f64))
        .expect("flood");
    // One more than needed: the first may fall between taking `started` and the first send.
    let mut seen = 0;
    while seen < ROTATIONS + 1 {
        let (at, _) = rig
            .daemon
            .wait_for_timed(|l| l.contains("salt rotated"), Duration::from_secs(2))
            .unwrap_or_else(|e| panic!("waiting for rotation {}: {e:#}", seen + 1));
        seen += usize::from(at >= flooding.started);
    }
    // Stop inside the last rotation's grace: the source is mid-carry-over when the run ends.
    std::thread::sleep(grace / 2);
    flooding.stop();
    let run = flooding.finish().expect("flood");
    let after = rig.daemon.counters(id).expect("counters");
    rig.daemon.poll();
    let judged = Judged::between(&before, &after);
    let t = run.window();
    let first = run.report.first.expect("start");
    let end = first + t;
    let in_run = |l: &&(Instant, String)| l.0 >= first && l.0 <= end + Duration::from_millis(20);
    let rotations: Vec<&(Instant, String)> =
        rig.daemon.lines().iter().filter(in_run).filter(|l| l.1.contains("salt rotated")).collect();
    let rotated: Vec<&String> = rotations.iter().map(|l| &l.1).collect();
    let skipped = rig.daemon.lines().iter().filter(in_run).filter(|l| l.1.contains("rotation skipped")).count();
    let delivered = run.delivered(&flow);
    eprintln!("rotation: {}; {judged}; {} rotations during the run, {skipped} skipped", run.report, rotated.len());

    // The sender kept its 3x pace, on one CPU.
    let pps = run.report.pps();
    assert!(
        pps >= 2.5 * RATE as f64 && pps <= 3.5 * RATE as f64,
        "the sender paced at {}/s sent {pps:.0}/s, outside [2.5, 3.5] x {RATE}/s ({}): the machine could not keep \
         the pace, so the run does not test the limiter",
        3 * RATE,
        run.report
    );
    assert_eq!(judged.cpus, vec![flood_cpu()], "the flood was judged on other CPUs: {judged}");
    assert!(
        rotated.len() >= ROTATIONS,
        "only {} rotations happened during the run:\n{}",
        rotated.len(),
        rig.daemon.output()
    );
    assert_eq!(skipped, 0, "scheduled rotations were skipped (grace {grace:?} < 150 ms):\n{}", rig.daemon.output());
    // Each rotation switches generation and opens a grace of the burst window + 50 ms.
    let generations: Vec<u64> =
        rotated.iter().map(|l| field(l, "generation").unwrap_or_else(|| panic!("no generation in {l}"))).collect();
    assert!(
        generations.windows(2).all(|w| w[0] != w[1] && w[0] < 2 && w[1] < 2),
        "generations do not alternate: {generations:?}"
    );
    for l in &rotated {
        assert_eq!(field(l, "grace_ms"), Some(grace.as_millis() as u64), "grace in {l}");
    }

    // Every frame was judged, every admitted one delivered.
    assert_eq!(judged.total.admitted_packets + judged.total.refused_packets, run.sent(&flow), "judged vs sent");
    assert_eq!(judged.total.admitted_packets, delivered, "admitted vs delivered");
    assert_eq!(judged.total.errors, 0);
    let bound = limit.bound(nanos(t));
    // "B + r*t, plus one emission".
    let allowed = bound + 1;
    // The same arrivals (the paced schedule) through GCRA, with every bucket emptied at each
    // rotation (as logged), and without.
    let offered = run.sent(&flow);
    let resets: Vec<Duration> = rotations.iter().map(|l| l.0 - first).collect();
    let reset_design = simulate(&limit, offered, 3.0 * RATE as f64, &resets);
    let carried_design = simulate(&limit, offered, 3.0 * RATE as f64, &[]);
    eprintln!(
        "  delivered {delivered} over {t:?}; GCRA bound B + r*t = {bound} (+1 emission: {allowed}); \
         the same arrivals: {carried_design} without rotations, {reset_design} by a reset-on-rotate design \
         (bound + B per rotation: {}); offered {offered}",
        bound + rotated.len() as u64 * BURST
    );
    assert!(delivered <= allowed, "delivered {delivered} > B + r*t + 1 = {allowed} across {} rotations", rotated.len());
    assert!(
        delivered < reset_design && reset_design >= carried_design + (rotated.len() as u64 - 1) * BURST,
        "delivered {delivered}, a reset-on-rotate design {reset_design}: the run did not tell them apart"
    );
    // Nor does the carry-over refuse what the rate allows.
    check_lower("delivered across rotations", delivered, &limit, &run.report);
}

/// How many of `sent` arrivals, `per_sec` apart, GCRA admits when every bucket is emptied at
/// each of `resets` (offsets from the first arrival).
fn simulate(limit: &Gcra, sent: u64, per_sec: f64, resets: &[Duration]) -> u64 {
    // An arbitrary epoch: TAT 0 means "never used".
    const EPOCH: u64 = 1_000 * SEC;
    let (mut tat, mut admitted, mut next) = (0u64, 0u64, 0usize);
    for i in 0..sent {
        let at = Duration::from_secs_f64(i as f64 / per_sec);
        while next < resets.len() && resets[next] <= at {
            tat = 0;
            next += 1;
        }
        admitted += u64::from(limit.admit(&mut tat, EPOCH + nanos(at), 1));
    }
    admitted
}

/// The value of `key=N` in a log line.
fn field(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    line[at..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().ok()
}

/// `salt rotate` draws a new salt at once; asked again during the grace period (the longest
/// policy's burst window + 50 ms), it is refused with a message saying so and nothing changes;
/// once the grace is over it works again. `--rotate-every off` rotates only on demand.
#[test]
fn a_rotation_during_the_grace_period_is_refused() {
    require_root!();
    let mut rig = Rig::start(&["--rotate-every", "off", "--metrics", "off", "--buckets", "1024"]).expect("rig");
    let closed = rig.scrape(METRICS).expect_err("--metrics off, yet something answers on 127.0.0.1:9464");
    assert!(format!("{closed:#}").contains("refused"), "{closed:#}");
    // Burst windows of 1 s and 50 ms: the grace is the longer + 50 ms.
    rig.ctl_ok(&["policy", "set", "slow", "--match", "udp", "--rate", "100/s", "--burst", "100"]);
    rig.ctl_ok(&["policy", "set", "fast", "--match", "tcp", "--rate", "1000/s", "--burst", "50"]);
    let grace = Duration::from_secs(1) + GRACE_MARGIN;
    let config = |rig: &Rig| rig.daemon.maps().expect("maps").rules.config;
    let c0 = config(&rig);

    let out = rig.ctl_ok(&["salt", "rotate"]);
    assert_eq!(out.trim(), "salt rotated");
    let line = rig.daemon.wait_for(|l| l.contains("salt rotated"), SIGNAL_TIMEOUT).expect("log line");
    assert_eq!(field(&line, "grace_ms"), Some(grace.as_millis() as u64), "{line}");
    let c1 = config(&rig);
    assert_ne!(c1.generation, c0.generation, "the generation did not switch");
    assert_ne!(c1.salts[c1.generation as usize], c0.salts[c0.generation as usize], "the salt did not change");
    assert_eq!(
        c1.salts[c0.generation as usize], c0.salts[c0.generation as usize],
        "the old salt must stay for the grace"
    );
    let opened = c1.grace_until_ns.saturating_sub(c1.rotated_at_ns);
    assert!(
        opened >= nanos(grace) && opened <= nanos(grace) + 20_000_000,
        "grace until - rotated at = {opened} ns, expected {grace:?} to {grace:?} + 20 ms (the end is set after the switch)"
    );

    let refused = rig.daemon.ctl(&["salt", "rotate"]).expect("limiter-ctl");
    assert_eq!(refused.code, Some(1), "a rotation during the grace: {refused:?}");
    assert!(refused.stderr.contains("a salt rotation is in progress"), "{refused:?}");
    assert_eq!(refused.stderr_lines().len(), 1, "{refused:?}");
    assert_eq!(config(&rig), c1, "a refused rotation changed the config");

    std::thread::sleep(grace + Duration::from_millis(100));
    rig.ctl_ok(&["salt", "rotate"]);
    let c2 = config(&rig);
    assert_eq!(c2.generation, c0.generation, "the third rotation switches back");
    let current = |c: &Config| c.salts[c.generation as usize];
    assert!(current(&c2) != current(&c0) && current(&c2) != current(&c1), "the third rotation did not draw a new salt");
    rig.daemon.poll();
    let rotations = rig.daemon.lines().iter().filter(|l| l.1.contains("salt rotated")).count();
    assert_eq!(rotations, 2, "--rotate-every off: only the requested rotations:\n{}", rig.daemon.output());
}

// ---------------------------------------------------------------------------------------------
// b. Fail static, adopt, detach

/// SIGKILL mid-flood: the program stays attached and keeps enforcing (the flood's bucket is
/// spent, so while the daemon is dead it admits the rate, no more and not much less). Restarted
/// on the same pins, the daemon adopts: it says so, a new program is swapped into the same link
/// (same pinned link and maps, new program id, the old program unloaded) with the flood still
/// running, and buckets and counters carry on: no fresh burst for the flooding source, every
/// frame of the whole run judged by one program or the other, counters never reset; a source
/// keeping to half the rate beside the flood is never refused, and the flood gets its allowance
/// over the whole run. Then SIGKILL again and `limiter-ctl detach` leaves no program and no pins.
#[test]
fn sigkill_fails_static_and_a_restart_adopts_the_pinned_limiter() {
    require_root!();
    const RATE: u64 = 1000;
    const BURST: u64 = 400;
    /// A refusal came at most this long before a counter read (the flood is at full speed;
    /// this covers the sender being descheduled).
    const SLACK: Duration = Duration::from_millis(50);
    /// Frames are timed when the capture reads them, a little after XDP passed them.
    const CAPTURE_LAG: Duration = Duration::from_millis(50);
    let args = ["--rate", "1000/s", "--burst", "400", "--buckets", "1024", "--metrics", "off"];
    let limit = gcra(RATE, BURST);
    // A bucket found spent (a refusal just happened) admits no more than this in `t`.
    let spent = |t: Duration| limit.bound(nanos(t + SLACK)) - (BURST - 1);
    let mut rig = Rig::start(&args).expect("rig");
    let iface = rig.net.receiver.iface.clone();
    let id = rig.policy_id("default");
    let p1 = rig.daemon.program().expect("program");
    let pins = rig.scratch.pinned(&iface).expect("pins");
    assert!(
        pins.contains_key("link") && pins.contains_key("BUCKETS") && pins.contains_key("COUNTERS"),
        "pins: {pins:?}"
    );
    // The flood and a source at half the rate, stopped by the test (their time limit is a safety
    // net far beyond what the test waits).
    let hand_over = rig
        .start_hand_over(src("198.19.1.1"), src("198.19.1.2"), 7000, RATE as f64, Duration::from_millis(800))
        .expect("flood");
    let status = rig.daemon.kill().expect("SIGKILL");
    assert_eq!(status.code(), None, "the daemon should have died of SIGKILL: {status}");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(p1), "the program left with the daemon");
    assert_eq!(rig.scratch.pinned(&iface).expect("pins"), pins, "the pins changed when the daemon died");

    // Dead daemon: the program alone.
    let t0 = Instant::now();
    let c0 = program_counters(p1, id).expect("counters");
    std::thread::sleep(Duration::from_millis(700));
    let c1 = program_counters(p1, id).expect("counters");
    let t1 = Instant::now();
    let dead = Judged::between(&c0, &c1);
    eprintln!("dead daemon, {:?}: {dead}", t1 - t0);
    assert!(dead.total.refused_packets > 0, "nothing was refused while the daemon was dead: {dead}");

    // Restart on the same pins and config, the flood still running.
    let restart = Instant::now();
    let (daemon, line) =
        Daemon::adopt(&rig.net.receiver, &rig.scratch, &args).unwrap_or_else(|e| panic!("restarting: {e:#}"));
    rig.daemon = daemon;
    let adopted = Instant::now();
    eprintln!("restart took {:?}: {line}", adopted - restart);
    assert!(line.contains(ADOPTED) && line.contains("mode=native"), "{line}");
    let p2 = rig.daemon.program().expect("program");
    assert_ne!(p2, p1, "the restarted daemon's program is not in the link");
    assert_eq!(
        rig.scratch.pinned(&iface).expect("pins"),
        pins,
        "adopting replaced pinned objects (a new link or new maps)"
    );
    let c2 = program_counters(p2, id).expect("counters");
    let (was, is) = (total(&c1), total(&c2));
    assert!(
        is.admitted_packets >= was.admitted_packets && is.refused_packets >= was.refused_packets,
        "the counters were reset: {was:?} then {is:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(2);
    while program_loaded(p1) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!program_loaded(p1), "the replaced program {p1} is still loaded");

    std::thread::sleep(Duration::from_millis(700));
    let t3 = Instant::now();
    let done = hand_over.finish().expect("flood");
    let run = &done.run;
    let c4 = program_counters(p2, id).expect("counters");
    assert!(
        run.report.last.is_some_and(|end| end >= t3),
        "the flood ended before {t3:?} ({}): the sender stopped early, so the windows below would be wrong (the \
         machine's fault, not the limiter's)",
        run.report
    );

    // The flood's own frames (the counters also count the steady source's), by when the capture
    // read them: admitted from `LAG` before to the end of each span.
    let flood = |from: Instant, to: Instant| run.captured.between(|f| *f == done.flood, from, to);
    let spans = [("with the daemon dead", t1), ("from the kill to the end", t3)];
    for (what, end) in spans {
        let (got, t) = (flood(t0, end), end - t0);
        let most = spent(t + CAPTURE_LAG);
        eprintln!("  {what} ({t:?}): the flood got {got} <= {most} (a fresh burst would add up to {BURST})");
        assert!(got <= most, "{what}: the flood got {got} in {t:?}, more than a spent bucket allows ({most})");
        // Not much less either: a spent bucket still admits the rate, less what the sender's
        // stalls (anywhere in the flood) and the capture's lag at either end can have cost.
        let lost = stall_cost(&limit, &run.report, 1) + limit.bound(nanos(2 * CAPTURE_LAG)) - BURST;
        let least = limit.bound(nanos(t)).saturating_sub(BURST).saturating_sub(lost);
        eprintln!("  {what} ({t:?}): the flood got {got} >= 90% of {least}");
        assert!(
            got * 10 >= least * 9,
            "{what}: the flood got {got} in {t:?}, under 90% of {least} (the rate over that time less {lost} for \
             stalls and the capture's lag): the limiter refused what its rate allows ({})",
            run.report
        );
    }
    // The whole run: counters from before the flood, every frame judged by one program or the
    // other (no moment without one), every admitted frame delivered, both sides of the bound.
    let before = run.counted.as_ref().expect("baseline")[usize::from(id)].clone();
    check_hand_over("the whole run", &done, adopted, &before, &c4, &limit);
    let whole = total(&c4);
    assert_eq!(total(&program_counters(p2, 0).expect("counters")), Counters::default(), "traffic other than the flood");
    let listed = rig.ctl_ok(&["policy", "show", "default", "--json"]);
    let listed: serde_json::Value = serde_json::from_str(&listed).expect("json");
    assert_eq!(listed["counters"]["admitted_packets"].as_u64(), Some(whole.admitted_packets), "{listed}");
    assert_eq!(listed["counters"]["refused_packets"].as_u64(), Some(whole.refused_packets), "{listed}");

    // Fail static once more, then remove it by hand.
    rig.daemon.kill().expect("SIGKILL");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(p2));
    let out = rig.scratch.detach(&rig.net.receiver).expect("limiter-ctl detach");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains(&format!("removed {} pins", pins.len())), "{out:?}");
    assert!(out.stdout.contains(&format!("no XDP program is attached to {iface}")), "{out:?}");
    let link = rig.net.receiver.link_details().expect("ip link");
    assert!(!link.contains("xdp"), "an XDP program is still attached after detach:\n{link}");
    assert!(!rig.scratch.pin_dir(&iface).exists(), "pins left after detach: {:?}", rig.scratch.pinned(&iface));
}

// ---------------------------------------------------------------------------------------------
// c. The salt stays in the kernel map

/// The salt (read from the kernel's CONFIG map: SipHash's initial state, from which the key words
/// follow) appears nowhere the daemon writes or shows: not in its log, not in any CLI output
/// (stats, policy list/show, top, human and --json), not on /metrics, not in the config file,
/// not in its command line or environment; before and after rotations. Searched as hex (both
/// byte orders, any case, padded or not), decimal (unsigned and signed) and raw bytes (both
/// byte orders), for the key words and the kernel's state words alike.
#[test]
fn the_salt_appears_nowhere_but_the_kernel_map() {
    require_root!();
    let mut rig = Rig::start(&["--rotate-every", "off", "--buckets", "1024"]).expect("rig");
    rig.ctl_ok(&["policy", "set", "p", "--rate", "1000/s", "--burst", "100", "--key", "src/24"]);
    let mut salts: Vec<SipInit> = Vec::new();
    let mut hay: Vec<(String, Vec<u8>)> = Vec::new();
    for round in 0..3 {
        let config = rig.daemon.maps().expect("maps").rules.config;
        for s in config.salts {
            if s != SipInit::default() && !salts.contains(&s) {
                salts.push(s);
            }
        }
        // Traffic, so stats and top have something to say.
        let stream = rig.udp(Sources::Spoofed { prefix: "198.19.5.0/24".parse().expect("prefix"), count: 16 }, 7000);
        rig.flood(&[stream], Limits::timed(Duration::from_millis(300)), None).expect("flood");
        // A stats snapshot that covers the flood.
        fresh_stats(&rig);
        collect_outputs(&rig, &format!("round {round}"), &mut hay);
        if round < 2 {
            let out = rig.daemon.ctl(&["salt", "rotate"]).expect("salt rotate");
            hay.push((format!("round {round}: salt rotate"), format!("{}{}", out.stdout, out.stderr).into_bytes()));
            assert_eq!(out.code, Some(0), "{out:?}");
        }
    }
    let pid = rig.daemon.pid();
    rig.daemon.stop_ok();
    hay.push(("the daemon's log (stdout and stderr)".into(), rig.daemon.output().into_bytes()));
    assert_eq!(salts.len(), 3, "three distinct salts (the first and two rotations) should have been seen");
    eprintln!("searched {} outputs of daemon {pid} for {} salts", hay.len(), salts.len());

    let needles: Vec<(String, Vec<u8>)> = salts.iter().enumerate().flat_map(|(i, s)| salt_needles(i, s)).collect();
    // The search finds what it looks for: each form planted in text is found.
    for (what, needle) in &needles {
        let mut planted = b"salt=".to_vec();
        planted.extend_from_slice(needle);
        assert!(find(&planted, needle), "the search misses {what}");
    }
    let mut leaks = Vec::new();
    for (where_, text) in &hay {
        for (what, needle) in &needles {
            if find(text, needle) {
                leaks.push(format!("{what} in {where_}"));
            }
        }
    }
    assert!(leaks.is_empty(), "the salt leaked: {leaks:#?}");
}

/// Everything a user or another process can read off a running daemon, by name.
fn collect_outputs(rig: &Rig, round: &str, hay: &mut Vec<(String, Vec<u8>)>) {
    let commands: [&[&str]; 9] = [
        &["stats"],
        &["stats", "--json"],
        &["policy", "list"],
        &["policy", "list", "--json"],
        &["policy", "show", "p"],
        &["policy", "show", "p", "--json"],
        &["top"],
        &["top", "--json"],
        &["allow", "list", "--json"],
    ];
    for args in commands {
        let out = rig.daemon.ctl(args).expect("limiter-ctl");
        assert_eq!(out.code, Some(0), "{args:?}: {out:?}");
        hay.push((
            format!("{round}: limiter-ctl {}", args.join(" ")),
            format!("{}{}", out.stdout, out.stderr).into_bytes(),
        ));
    }
    for (name, text) in hay.iter().filter(|(n, _)| n.starts_with(&format!("{round}: limiter-ctl top"))) {
        let text = String::from_utf8_lossy(text);
        assert!(
            text.contains("198.19.5.0/24"),
            "{name} does not show the flood (so it showed nothing worth searching):\n{text}"
        );
    }
    let (response, _) = metrics(rig);
    hay.push((format!("{round}: /metrics"), response.body.into_bytes()));
    let config = std::fs::read(rig.scratch.config()).expect("config");
    hay.push((format!("{round}: the config file"), config));
    let pid = rig.daemon.pid();
    for file in ["cmdline", "environ"] {
        let bytes = std::fs::read(format!("/proc/{pid}/{file}")).unwrap_or_else(|e| panic!("/proc/{pid}/{file}: {e}"));
        hay.push((format!("{round}: /proc/{pid}/{file}"), bytes));
    }
}

/// Every form of the salt's words worth searching for.
fn salt_needles(index: usize, s: &SipInit) -> Vec<(String, Vec<u8>)> {
    // SipInit::new: v0 = k0 ^ "somepseu", v1 = k1 ^ "dorandom", v2 = k0 ^ "lygenera", v3 = k1 ^ "tedbytes".
    let k0 = s.v[0] ^ 0x736f_6d65_7073_6575;
    let k1 = s.v[1] ^ 0x646f_7261_6e64_6f6d;
    assert_eq!(s.v[2], k0 ^ 0x6c79_6765_6e65_7261, "the kernel's state is not SipHash's for one key");
    assert_eq!(s.v[3], k1 ^ 0x7465_6462_7974_6573, "the kernel's state is not SipHash's for one key");
    let words = [("k0", k0), ("k1", k1), ("v0", s.v[0]), ("v1", s.v[1]), ("v2", s.v[2]), ("v3", s.v[3])];
    let mut out = Vec::new();
    for (name, w) in words {
        let what = |form: &str| format!("salt {index} {name} as {form}");
        for (order, v) in [("big-endian", w), ("little-endian", w.swap_bytes())] {
            for (case, text) in [
                ("lower", format!("{v:x}")),
                ("lower padded", format!("{v:016x}")),
                ("upper", format!("{v:X}")),
                ("upper padded", format!("{v:016X}")),
            ] {
                // Short unpadded forms (a word with many leading zero bytes) would match by chance.
                if text.len() >= 12 {
                    out.push((what(&format!("{order} hex, {case}")), text.into_bytes()));
                }
            }
        }
        for (form, text) in [("decimal", w.to_string()), ("signed decimal", (w as i64).to_string())] {
            if text.trim_start_matches('-').len() >= 12 {
                out.push((what(form), text.into_bytes()));
            }
        }
        out.push((what("raw little-endian bytes"), w.to_le_bytes().to_vec()));
        out.push((what("raw big-endian bytes"), w.to_be_bytes().to_vec()));
    }
    out
}

/// Whether `needle` occurs in `hay`, ignoring ASCII case.
fn find(hay: &[u8], needle: &[u8]) -> bool {
    needle.len() <= hay.len() && hay.windows(needle.len()).any(|w| w.eq_ignore_ascii_case(needle))
}

// ---------------------------------------------------------------------------------------------
// d. Failure directions

/// A config that does not parse (or does not validate) at start, while a killed daemon's pinned
/// limiter enforces: the new daemon exits 2 naming the position, and leaves the pinned limiter
/// exactly as it was (same program, same rules and salt, same counters, same pins), still
/// enforcing.
#[test]
fn a_broken_config_at_start_leaves_the_pinned_limiter_untouched() {
    require_root!();
    let mut rig = Rig::start(&["--metrics", "off", "--buckets", "1024"]).expect("rig");
    let iface = rig.net.receiver.iface.clone();
    rig.ctl_ok(&["policy", "set", "p", "--match", "udp", "--rate", "1000/s", "--burst", "100"]);
    let id = rig.policy_id("p");
    let limit = gcra(1000, 100);
    let stream = rig.udp(Sources::One(src("198.19.1.1")), 7000);
    let flow = flow(&stream, src("198.19.1.1"));
    rig.flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(300)), None).expect("flood");
    let p1 = rig.daemon.program().expect("program");
    rig.daemon.kill().expect("SIGKILL");
    let before = Snapshot::read(&rig.scratch.pin_dir(&iface)).expect("maps");
    assert!(before.total(id).refused_packets > 0);
    let pins = rig.scratch.pinned(&iface).expect("pins");
    assert!(pins.contains_key("link"), "{pins:?}");

    let path = rig.scratch.config();
    for (what, text, line) in [
        ("a syntax error", "[[policy]\nname = \"p\"\n", 1),
        ("a bad rate", "[[policy]]\nname = \"p\"\nmatch = \"udp\"\nrate = \"10/d\"\n", 4),
    ] {
        let out =
            Daemon::refused_start(&rig.net.receiver, &rig.scratch, &["--metrics", "off", "--buckets", "1024"], text)
                .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        assert!(out.contains(&format!("{}:{line}:", path.display())), "{what}: no position in:\n{out}");
        assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(p1), "{what}: the program changed");
        assert_eq!(
            Snapshot::read(&rig.scratch.pin_dir(&iface)).expect("maps"),
            before,
            "{what}: the pinned maps changed"
        );
        assert_eq!(rig.scratch.pinned(&iface).expect("pins"), pins, "{what}: the pins changed");
    }

    // Still enforcing, unattended.
    let run = rig.flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(500)), None).expect("flood");
    let judged = Judged::between(&before.counters[usize::from(id)], &program_counters(p1, id).expect("counters"));
    eprintln!("after the failed starts: {}; {judged}", run.report);
    judged.check_against(&run.report);
    assert_eq!(judged.total.admitted_packets, run.delivered(&flow));
    check_upper("delivered", run.delivered(&flow), &limit, &judged, run.window());

    let out = rig.scratch.detach(&rig.net.receiver).expect("detach");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None, "{out:?}");
    assert!(!rig.scratch.pin_dir(&iface).exists());
}

/// With /sys/fs/bpf not a bpffs (under `ip netns exec`, the namespace's own /sys), the daemon
/// mounts bpffs there, says so, pins and enforces; its pins live in that private mount (not on
/// the machine's bpffs). On SIGINT it leaves the program pinned there and warns that the pins
/// go with that mount: they do, and the program leaves the interface with them.
#[test]
fn a_missing_bpffs_is_mounted_and_said() {
    require_root!();
    let mut rig = Rig::start_with(Runner::PrivateMounts, &["--rate", "1000/s", "--burst", "100", "--metrics", "off"])
        .expect("rig");
    let iface = rig.net.receiver.iface.clone();
    let out = rig.daemon.output();
    let said: Vec<&str> = out.lines().filter(|l| l.contains("mounted bpffs at /sys/fs/bpf")).collect();
    assert_eq!(said.len(), 1, "no 'mounted bpffs' line:\n{out}");
    assert!(
        !rig.scratch.pin_dir(&iface).exists(),
        "the daemon's pins should be in its private bpffs, not the machine's"
    );
    // ... where they are: the link and every map, on a bpffs at /sys/fs/bpf.
    let private = |args: &[&str]| {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--mount=/proc/{}/ns/mnt", rig.daemon.pid())).arg("--").args(args);
        Ctl::run(&mut cmd).and_then(Ctl::ok).unwrap_or_else(|e| panic!("in the daemon's mount namespace: {e:#}"))
    };
    assert_eq!(
        private(&["stat", "-f", "-c", "%T", "/sys/fs/bpf"]).trim(),
        "bpf_fs",
        "not bpffs in the daemon's mounts"
    );
    let dir = rig.scratch.pin_dir(&iface);
    let listed = private(&["ls", "-1", "--", &dir.to_string_lossy()]);
    let found: BTreeSet<&str> = listed.lines().collect();
    let expected: BTreeSet<&str> = limiter_ctl::kernel::map_names().chain(["link"]).collect();
    assert_eq!(found, expected, "the pins in the daemon's private bpffs under {}", dir.display());

    let limit = gcra(1000, 100);
    let id = rig.policy_id("default");
    let stream = rig.udp(Sources::One(src("198.19.1.1")), 7000);
    let run = rig.flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(500)), None).expect("flood");
    let judged = Judged::new(&rig.daemon.counters(id).expect("counters"));
    judged.check_against(&run.report);
    check_upper("delivered", run.delivered(&flow(&stream, src("198.19.1.1"))), &limit, &judged, run.window());

    rig.daemon.stop_ok();
    let out = rig.daemon.output();
    assert!(out.contains("the pins are on the bpffs this daemon mounted"), "no warning about the private pins:\n{out}");
    // The mount namespace went with the daemon, the bpffs with it, and the link with its pin.
    let deadline = Instant::now() + Duration::from_secs(5);
    while xdp_program_id(&rig.net.receiver).expect("ip link").is_some() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None, "the program outlived its private pins");
}

/// The interface removed (the program goes with it) and created again under the same name: the
/// daemon notices within about a second, attaches again, says so, and the flood that follows is
/// held to the bound. SIGINT then leaves it attached and pinned, and `detach` takes it off.
#[test]
fn a_recreated_interface_is_reattached_and_enforced() {
    require_root!();
    let mut rig =
        Rig::start(&["--rate", "1000/s", "--burst", "100", "--metrics", "off", "--buckets", "1024"]).expect("rig");
    let iface = rig.net.receiver.iface.clone();
    let id = rig.policy_id("default");
    let limit = gcra(1000, 100);
    let old_link = rig.scratch.pinned(&iface).expect("pins")["link"];

    rig.net.remove_veth().expect("removing the veth pair");
    rig.daemon.wait_for(|l| l.contains("interface gone"), Duration::from_secs(3)).unwrap_or_else(|e| panic!("{e:#}"));
    rig.net.add_veth().expect("re-creating the veth pair");
    let created = Instant::now();
    let (at, line) = rig
        .daemon
        .wait_for_timed(|l| l.contains("interface re-created: reattached"), Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("reattached {:?} after re-creation: {line}", at - created);
    assert!(
        at - created <= Duration::from_millis(1500),
        "reattaching took {:?} after the interface was re-created, over the bound of 1.5 s (the daemon checks \
         about once a second)",
        at - created
    );
    assert!(line.contains("mode=native"), "{line}");
    let program =
        xdp_program_id(&rig.net.receiver).expect("ip link").expect("no XDP program on the re-created interface");
    let pins = rig.scratch.pinned(&iface).expect("pins");
    assert!(pins.get("link").is_some_and(|&ino| ino != old_link), "the new link is not pinned afresh: {pins:?}");

    // Strays of the new link's start (IPv6 MLD reports) come from other sources: only the flood's
    // own flow is held to the bound.
    let stream = rig.udp(Sources::One(src("198.19.1.1")), 7000);
    let flow = flow(&stream, src("198.19.1.1"));
    let before = program_counters(program, id).expect("counters");
    let run = rig.flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(700)), None).expect("flood");
    let judged = Judged::between(&before, &program_counters(program, id).expect("counters"));
    eprintln!("after re-creation: {}; {judged}; delivered {}", run.report, run.delivered(&flow));
    check_overload(&run.report, 1000.0, 1);
    assert!(judged.total.refused_packets > 0, "nothing refused after re-creation: {judged}");
    assert!(judged.total.admitted_packets >= run.delivered(&flow));
    check_upper("delivered after re-creation", run.delivered(&flow), &limit, &judged, run.window());
    check_lower("delivered after re-creation", run.delivered(&flow), &limit, &run.report);

    rig.daemon.stop_ok();
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(program), "{}", rig.daemon.output());
    let out = rig.scratch.detach(&rig.net.receiver).expect("detach");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None);
    assert!(!rig.scratch.pin_dir(&iface).exists(), "{:?}", rig.scratch.pinned(&iface));
}

/// A fault on the hot path of a running daemon's program (its CONFIG map made to claim more
/// buckets than its bucket arrays hold): a flood passes whole (every frame delivered, none judged), each
/// frame counted as an error, which `stats` and /metrics report; with CONFIG put back, the same
/// flood is limited again.
#[test]
fn a_hot_path_fault_in_a_running_daemon_passes_and_is_reported() {
    require_root!();
    let rig =
        Rig::start(&["--rate", "1000/s", "--burst", "100", "--buckets", "1024", "--rotate-every", "off"]).expect("rig");
    let id = rig.policy_id("default");
    let program = rig.daemon.program().expect("program");
    let config = rig.daemon.maps().expect("maps").rules.config;
    // Both arrays: the default policy has the default scope, host (`host_mask`'s array).
    let mut broken = config;
    broken.bucket_mask = (1 << 20) - 1;
    broken.row_len = 1 << 20;
    broken.host_mask = (1 << 24) - 1;
    broken.host_row_len = 1 << 24;
    // Generation 1's half starts past either map's end, so no key's index can land inside.
    broken.generation = 1;
    write_program_config(program, &broken).expect("corrupting CONFIG");
    let stream = rig.udp(Sources::One(src("198.19.1.1")), 7000);
    let flow = flow(&stream, src("198.19.1.1"));
    let before = rig.daemon.all_counters().expect("counters");
    // Bounded in packets: every one of them must reach the capture.
    const FRAMES: u64 = 50_000;
    let limits = Limits::counted(FRAMES, Duration::from_secs(10));
    let run = rig.flood(std::slice::from_ref(&stream), limits, None).expect("flood");
    assert_eq!(
        run.report.sent,
        FRAMES,
        "the machine sent only {} of {FRAMES} packets in {:?} ({}): too slow to test the faulty program",
        run.report.sent,
        run.report.duration(),
        run.report
    );
    let after = rig.daemon.all_counters().expect("counters");
    let errors = Judged::between(&before[0], &after[0]).total.errors;
    let judged = Judged::between(&before[usize::from(id)], &after[usize::from(id)]);
    eprintln!("faulty: {}; errors {errors}; {judged}", run.report);
    assert_eq!(run.delivered(&flow), run.sent(&flow), "a faulty program must pass everything");
    assert_eq!(errors, run.sent(&flow), "every faulty frame counted as an error");
    assert_eq!(judged.total, Counters::default(), "nothing was judged by the policy");

    // A stats snapshot taken after the flood (the daemon takes one a second).
    let stats = fresh_stats(&rig);
    assert_eq!(stats["unjudged"]["errors"].as_u64(), Some(errors), "stats: {stats}");
    assert!(rig.ctl_ok(&["stats"]).contains(&format!("limiter errors: {errors}")));
    let (response, samples) = metrics(&rig);
    assert_eq!(value(&samples, "limiter_errors_total", &[]), errors, "/metrics:\n{}", response.body);

    write_program_config(program, &config).expect("restoring CONFIG");
    let run = rig.flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(300)), None).expect("flood");
    let last = rig.daemon.all_counters().expect("counters");
    let judged = Judged::between(&after[usize::from(id)], &last[usize::from(id)]);
    judged.check_against(&run.report);
    check_upper("delivered once repaired", run.delivered(&flow), &gcra(1000, 100), &judged, run.window());
}

/// A fault on the hot path (here: CONFIG says there are more buckets than the map holds, so the
/// bucket lookup fails) passes the packet and counts an error; it never drops. The same frame is
/// dropped once the config is right again and the source over its limit.
#[test]
fn a_hot_path_fault_passes_and_is_counted() {
    require_root!();
    const BUCKETS: u32 = 64;
    // BPF_PROG_TEST_RUN runs on the calling CPU; the counters are per CPU.
    pin_current_thread(flood_cpu()).expect("pinning");
    let rate: Rate = "1/s".parse().expect("rate");
    let policy = compile::policy(&PolicyDef::any(rate, 1), 1).expect("policy");
    let mut limiter =
        udp_limiter(BUCKETS, limiter_common::SipKey { k0: 1, k1: 2 }, &policy).expect("loading the limiter");
    let config = limiter.config().expect("config");
    let spec = FrameSpec {
        src_mac: [2, 0, 0, 0, 0, 2],
        dst_mac: [2, 0, 0, 0, 0, 1],
        dst: IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1)),
        sport: DEFAULT_SPORT,
        dport: 7000,
        payload: DEFAULT_PAYLOAD,
    };
    let frame = spec.frame(src("198.19.1.1")).expect("frame");
    let sum = |l: &Limiter| -> Vec<Counters> { l.counters().expect("counters") };

    // Sound: one admitted, then refused.
    assert_eq!(limiter.test_run(&frame).expect("test run"), XDP_PASS);
    assert_eq!(limiter.test_run(&frame).expect("test run"), XDP_DROP, "a source over its limit must be dropped");
    let sound = sum(&limiter);
    assert_eq!((sound[1].admitted_packets, sound[1].refused_packets, sound[0].errors), (1, 1, 0));

    // Corrupt: both arrays' masks and row lengths far beyond the maps (GENERATIONS x 64
    // entries each; the policy has the default scope, host, whose array is `host_mask`'s).
    let mut broken = config;
    broken.bucket_mask = (1 << 20) - 1;
    broken.row_len = 1 << 20;
    broken.host_mask = (1 << 20) - 1;
    broken.host_row_len = 1 << 20;
    // Generation 1's half starts past either map's end, so no key's index can land inside.
    broken.generation = 1;
    assert!(broken.bucket_mask + 1 > GENERATIONS * BUCKETS);
    limiter.write_config(&broken).expect("config");
    for i in 0..100 {
        assert_eq!(limiter.test_run(&frame).expect("test run"), XDP_PASS, "run {i} of a faulty program did not pass");
    }
    let faulty = sum(&limiter);
    assert_eq!(faulty[0].errors, 100, "errors: {:?}", faulty[0]);
    assert_eq!(since(&faulty[1], &sound[1]), Counters::default(), "a fault was counted as a judgement");
    let errors: u64 = faulty.iter().map(|c| c.errors).sum();
    assert_eq!(errors, 100, "errors are counted once, under id 0");

    // Repaired: judged again (and still over the limit, so dropped).
    limiter.write_config(&Config { ..config }).expect("config");
    assert_eq!(limiter.test_run(&frame).expect("test run"), XDP_DROP);
    assert_eq!(sum(&limiter)[0].errors, 100);
}

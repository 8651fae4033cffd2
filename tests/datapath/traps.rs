//! What a bucket holds never traps a source beyond one burst window of its own: the two kernel
//! cases of the report, end to end on a veth pair with the real daemon and program. Both were
//! refused without end before every policy's TATs shared one clock (0 of 20,000 admitted in
//! the first, 1988 of 5000 in the second).

use std::time::{Duration, Instant};

use limiter_common::Gcra;
use limiter_tests::{
    bounds::{check_lower_during, check_upper},
    flood::{L4, Limits, Sources},
    require_root,
    rig::{Rig, SEC, flow_of},
};

/// Long enough to see a rate of 1000/s well, short enough for a quick suite.
const FLOOD: Duration = Duration::from_secs(1);

/// A policy at 20,000/s with a burst of 2 s admits a flood from one source until its TAT runs
/// far ahead of now; lowered to 1000/s burst 100, the same source, still flooding, is refused
/// until the TAT it earned under the old rate is within the new window (the slot's hold keeps
/// that TAT credible: lowering it would hand a spent burst back to whoever shares the bucket),
/// then admitted at the new rate, with no fresh burst, and never refused for longer (nor, as
/// before every policy shared one clock, for the host's uptime).
#[test]
fn a_lowered_rate_holds_the_same_source_to_its_old_tat_then_admits_it_at_the_new_rate() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    rig.ctl_ok(&["policy", "set", "changing", "--match", "udp:7000", "--rate", "20000/s", "--burst", "40000"]);
    let old_t = Duration::from_micros(50);
    let stream = rig.stream(L4::Udp, 7000, "198.19.1.1");
    let flow = flow_of(&stream);
    let first = rig.flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(600)), None);
    let first = first.expect("the first flood");
    let ended = Instant::now();
    let filled = first.delivered(&flow);
    eprintln!("at 20000/s burst 40000: {}; delivered {filled}", first.report);

    rig.ctl_ok(&["policy", "set", "changing", "--match", "udp:7000", "--rate", "1000/s", "--burst", "100"]);
    let new = Gcra::new(1000, SEC, 100, 1).expect("valid");
    let window = Duration::from_nanos(new.window_ns());
    // How far ahead the old TAT ended (the flood ran over the old rate throughout: n x T from its
    // start), so how long into the second flood the hold lasts.
    let ahead = (old_t * filled as u32).saturating_sub(first.report.duration());
    let flooding = rig.start_counted_flood(std::slice::from_ref(&stream), Limits::timed(ahead + FLOOD), None);
    let flooding = flooding.expect("starting the second flood");
    let gap = flooding.started - ended;
    assert!(
        ahead > gap + window + Duration::from_millis(200),
        "the old bucket was {ahead:?} ahead at the first flood's end and {gap:?} passed before the second: not \
         beyond the new {window:?} window, so the machine was too slow to test this (first flood: {})",
        first.report
    );
    let run = flooding.finish().expect("the second flood");
    run.check_capture();
    let delivered = run.delivered(&flow);
    let judged = rig.judged(&run, rig.policy_id("changing"));
    // Refused until the old TAT is one window ahead, give or take how well `ahead` is known.
    let held = ahead - gap - window;
    let slack = Duration::from_millis(50);
    eprintln!("at 1000/s burst 100 (held {held:?} into the second flood): {}; delivered {delivered}", run.report);
    // `ended` was read once `flood` returned, which waits for the capture to drain after the
    // last frame (up to about 0.3 s on a busy machine), so the release may come that much before
    // `held` says: allowed on the upper side, never on the lower.
    let drain = Duration::from_millis(400);
    let released = run.window().saturating_sub(held.saturating_sub(drain));
    // No fresh burst: from the release on, one emission interval per packet, no more. Released
    // at once (the old clamp), it would get the burst and about 1000/s for the whole flood.
    let burstless = Gcra::new(1000, SEC, 1, 1).expect("valid");
    check_upper("after the change, from the release on", delivered, &burstless, &judged, released + slack);
    check_lower_during(
        "after the change, from the release on",
        delivered,
        &burstless,
        run.report.duration().saturating_sub(held + slack),
        &run.report,
        1,
    );
}

/// A byte policy at 10^7 B/s sees one frame from each of 60,000 sources; a 100/s packet policy
/// then takes its port. 5000 fresh sources sending one packet each are all admitted: what the
/// byte policy left in the buckets (its TATs, written under its own rate) holds nobody.
#[test]
fn a_packet_policy_after_a_byte_policy_admits_every_fresh_source() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    rig.ctl_ok(&["policy", "set", "bulk", "--match", "udp:7000", "--rate", "10000000/s", "--unit", "bytes"]);
    let many = rig.udp(Sources::Spoofed { prefix: "198.18.0.0/16".parse().expect("prefix"), count: 60_000 }, 7000);
    let seeded = rig.flood(&[many], Limits::counted(60_000, Duration::from_secs(30)), None).expect("the byte flood");
    eprintln!("byte policy seeded: {}", seeded.report);
    assert_eq!(seeded.report.sent, 60_000, "the seeding flood was cut short by its time limit: {}", seeded.report);

    rig.ctl_ok(&["policy", "rm", "bulk"]);
    rig.ctl_ok(&["policy", "set", "dns", "--match", "udp:7000", "--rate", "100/s", "--burst", "100"]);
    let fresh = rig.udp(Sources::Spoofed { prefix: "198.19.0.0/16".parse().expect("prefix"), count: 5000 }, 7000);
    // Paced, so the capture sees every frame.
    let run = rig
        .start_counted_flood(&[fresh], Limits::counted(5000, Duration::from_secs(30)), Some(20_000.0))
        .and_then(|f| f.finish())
        .expect("the fresh sources");
    run.check_capture();
    assert_eq!(run.report.sent, 5000, "the fresh sources were cut short by the time limit: {}", run.report);
    let judged = rig.judged(&run, rig.policy_id("dns"));
    eprintln!("fresh sources: {}; {judged}", run.report);
    let delivered = run.captured.packets(|_| true);
    assert_eq!(
        (judged.total.admitted_packets, judged.total.refused_packets, delivered),
        (5000, 0, 5000),
        "5000 fresh sources, one packet each, under 100/s burst 100: (admitted, refused, delivered)"
    );
}

//! Beside another tcx program loaded by the test (`neighbour`, which drops UDP to one port): the
//! limiter runs first at tcx ingress by default, after it with `--tcx-after neighbour`, before
//! it with `--tcx-before`, and the order is what the traffic says: what the neighbour drops
//! before the limiter never reaches the limiter's counters; after it, the neighbour sees only
//! what the limiter admitted. And the move from XDP to tcx (`limiter-ctl attach tcx`) under a
//! flood: no frame unjudged, and XDP free afterwards (xdp-filter then loads). The test programs
//! themselves are checked first, without the limiter.

use std::time::{Duration, Instant};

use aya::programs::links::LinkType;
use limiter_tests::{
    bounds::Judged,
    daemon::xdp_program_id,
    flood::Flow,
    neighbour::{Neighbour, Place},
    netns::TestNet,
    require_root,
    rig::Rig,
    xdp_filter::XdpFilter,
};

use super::*;

/// The port the neighbour drops.
pub(super) const NEIGHBOUR_PORT: u16 = 7100;
/// The port a second neighbour drops.
const SECOND_PORT: u16 = 7200;

/// The neighbour and the tally on their own (no limiter): the neighbour drops exactly what is
/// sent to its port and counts every flow, the tally after it sees exactly the rest; a program
/// placed before another runs before it.
#[test]
fn the_neighbour_drops_its_port_and_the_tally_counts_the_rest() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let neighbour = Neighbour::attach(&net.receiver, NEIGHBOUR_PORT, Place::First).expect("neighbour");
    let tally = Neighbour::tally(&net.receiver).expect("tally");
    let second = Neighbour::attach(&net.receiver, SECOND_PORT, Place::Before(tally.program)).expect("second");
    check_chain(&net.receiver, &[neighbour.program, second.program, tally.program]);
    let spec = |src: &str, port| limiter_tests::flood::Stream {
        spec: net.frames_to(false, port),
        l4: limiter_tests::flood::L4::Udp,
        sources: limiter_tests::flood::Sources::One(addr(src)),
    };
    let streams = [spec("198.19.1.1", NEIGHBOUR_PORT), spec("198.19.2.2", 7000), spec("198.19.3.3", SECOND_PORT)];
    let (run, _) = flood(&net, &streams, &tally);
    let [dropped, passed, second_dropped] = [&streams[0], &streams[1], &streams[2]].map(flow_of);
    let counts = neighbour.counts().expect("counts");
    for flow in [dropped, passed, second_dropped] {
        assert!(run.sent(&flow) > 0, "nothing sent of {flow:?}");
        assert_eq!(neighbour.flow(&flow).expect("flows"), run.sent(&flow), "the first neighbour's count of {flow:?}");
    }
    assert_eq!(counts.dropped, run.sent(&dropped), "the first neighbour's drops");
    assert_eq!(second.flow(&dropped).expect("flows"), 0, "the second saw what the first dropped");
    assert_eq!(second.counts().expect("counts").dropped, run.sent(&second_dropped), "the second's drops");
    assert_eq!(tally.flow(&passed).expect("flows"), run.sent(&passed), "the tally's count of the passed flow");
    assert_eq!(tally.flow(&dropped).expect("flows") + tally.flow(&second_dropped).expect("flows"), 0);
}

/// Flows for the order tests: 198.19.1.1 to [`NEIGHBOUR_PORT`] (the neighbour drops it),
/// 198.19.2.2 to 7000 (it passes every program but the limiter's refusals), and, with a second
/// neighbour, 198.19.3.3 to [`SECOND_PORT`].
fn order_streams(rig: &Rig, second: bool) -> Vec<Stream> {
    let mut streams = vec![udp(&rig.net, "198.19.1.1", NEIGHBOUR_PORT), udp(&rig.net, "198.19.2.2", 7000)];
    if second {
        streams.push(udp(&rig.net, "198.19.3.3", SECOND_PORT));
    }
    streams
}

/// One flood of [`order_streams`], counted: what was sent, what the limiter judged, what each
/// program saw of each flow.
pub(super) struct Ordered {
    pub run: limiter_tests::rig::Run,
    pub last: Instant,
    pub judged: Judged,
    pub flows: Vec<Flow>,
}

pub(super) fn flood_ordered(rig: &Rig, tally: &Neighbour, second: bool) -> Ordered {
    let id = rig.policy_id("default");
    let streams = order_streams(rig, second);
    let before = counters(rig, id);
    let (run, last) = flood(&rig.net, &streams, tally);
    let judged = Judged::between(&before, &counters(rig, id));
    Ordered { run, last, judged, flows: streams.iter().map(flow_of).collect() }
}

/// The limiter first, the neighbour after it: the limiter judged every frame, the neighbour's
/// port included; the neighbour saw exactly what the limiter admitted and dropped all of it
/// that was to its port; the flow to its port got through to nothing, the other was held to the
/// bound.
pub(super) fn check_limiter_first(what: &str, rig: &Rig, neighbour: &Neighbour, tally: &Neighbour) {
    let before = neighbour.counts().expect("counts");
    let Ordered { run, last, judged, flows } = flood_ordered(rig, tally, false);
    let (to_port, other) = (flows[0], flows[1]);
    let seen_port = neighbour.flow(&to_port).expect("flows");
    let seen_other = neighbour.flow(&other).expect("flows");
    let dropped = neighbour.counts().expect("counts").dropped - before.dropped;
    eprintln!("{what}: the neighbour saw {seen_port} to its port and {seen_other} of the other flow");
    let sent = run.sent(&to_port) + run.sent(&other);
    check_held(what, &judged, sent, &[seen_port, seen_other], &run, last);
    assert!(seen_port > 0 && seen_port < run.sent(&to_port), "{what}: the limiter did not hold the neighbour's port");
    assert_eq!(dropped, seen_port, "{what}: the neighbour's drops");
    assert_eq!(tally.flow(&to_port).expect("flows"), 0, "{what}: frames to the neighbour's port got through");
    assert_eq!(tally.flow(&other).expect("flows"), seen_other, "{what}: the tally vs the neighbour");
}

/// The neighbour at tcx first, then the daemon with `--attach tcx` and no order: the limiter
/// goes first ([limiter, neighbour]), and runs first.
#[test]
fn at_tcx_the_limiter_runs_first_by_default() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let neighbour = Neighbour::attach(&net.receiver, NEIGHBOUR_PORT, Place::First).expect("neighbour");
    let (rig, _) = start_daemon(net, &["--attach", "tcx"]);
    let tally = Neighbour::tally(&rig.net.receiver).expect("tally");
    assert_eq!(pinned_hook(&rig), LinkType::Tcx);
    let limiter = rig.daemon.program().expect("program");
    check_chain(&rig.net.receiver, &[limiter, neighbour.program, tally.program]);
    check_limiter_first("by default", &rig, &neighbour, &tally);
}

/// `--tcx-before neighbour`, the neighbour alone at tcx (by name: the tally, also a
/// `neighbour`, comes after the daemon): the limiter goes right before it, and runs first.
#[test]
fn tcx_before_puts_the_limiter_before_the_named_program() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let neighbour = Neighbour::attach(&net.receiver, NEIGHBOUR_PORT, Place::First).expect("neighbour");
    let (rig, _) = start_daemon(net, &["--attach", "tcx", "--tcx-before", "neighbour"]);
    let tally = Neighbour::tally(&rig.net.receiver).expect("tally");
    let limiter = rig.daemon.program().expect("program");
    check_chain(&rig.net.receiver, &[limiter, neighbour.program, tally.program]);
    check_limiter_first("--tcx-before neighbour", &rig, &neighbour, &tally);
}

/// `--tcx-after neighbour`: [neighbour, limiter]. What the neighbour drops never reaches the
/// limiter (its counters judged exactly the other flow); the neighbour saw every frame sent.
#[test]
fn tcx_after_runs_the_named_program_first() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let neighbour = Neighbour::attach(&net.receiver, NEIGHBOUR_PORT, Place::First).expect("neighbour");
    let (rig, _) = start_daemon(net, &["--attach", "tcx", "--tcx-after", "neighbour"]);
    let tally = Neighbour::tally(&rig.net.receiver).expect("tally");
    let limiter = rig.daemon.program().expect("program");
    check_chain(&rig.net.receiver, &[neighbour.program, limiter, tally.program]);

    let before = neighbour.counts().expect("counts");
    let Ordered { run, last, judged, flows } = flood_ordered(&rig, &tally, false);
    let (to_port, other) = (flows[0], flows[1]);
    let dropped = neighbour.counts().expect("counts").dropped - before.dropped;
    assert_eq!(neighbour.flow(&to_port).expect("flows"), run.sent(&to_port), "the neighbour first saw all of it");
    assert_eq!(dropped, run.sent(&to_port), "the neighbour's drops");
    assert_eq!(neighbour.flow(&other).expect("flows"), run.sent(&other), "the neighbour first saw all of it");
    let through = tally.flow(&other).expect("flows");
    // Judged exactly the other flow: nothing the neighbour dropped reached the limiter.
    check_held("--tcx-after neighbour", &judged, run.sent(&other), &[through], &run, last);
    assert_eq!(tally.flow(&to_port).expect("flows"), 0, "frames to the neighbour's port got through");
}

/// Two neighbours at tcx ([first, second]); `--tcx-before id:<second>` puts the limiter between
/// them. The first's port never reaches the limiter; the second's is judged, and the second sees
/// only what the limiter admitted.
#[test]
fn tcx_before_an_id_puts_the_limiter_between_two_programs() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let first = Neighbour::attach(&net.receiver, NEIGHBOUR_PORT, Place::First).expect("neighbour");
    let second = Neighbour::attach(&net.receiver, SECOND_PORT, Place::Last).expect("second neighbour");
    let before = format!("id:{}", second.program);
    let (rig, _) = start_daemon(net, &["--attach", "tcx", "--tcx-before", &before]);
    let tally = Neighbour::tally(&rig.net.receiver).expect("tally");
    let limiter = rig.daemon.program().expect("program");
    check_chain(&rig.net.receiver, &[first.program, limiter, second.program, tally.program]);

    let Ordered { run, last, judged, flows } = flood_ordered(&rig, &tally, true);
    let (to_first, other, to_second) = (flows[0], flows[1], flows[2]);
    assert_eq!(first.counts().expect("counts").dropped, run.sent(&to_first), "the first neighbour's drops");
    let seen = |f: &Flow| second.flow(f).expect("flows");
    assert_eq!(seen(&to_first), 0, "the second neighbour saw what the first dropped");
    let sent = run.sent(&other) + run.sent(&to_second);
    check_held("--tcx-before id:N", &judged, sent, &[seen(&other), seen(&to_second)], &run, last);
    assert!(seen(&to_second) > 0 && seen(&to_second) < run.sent(&to_second), "the limiter did not hold it");
    assert_eq!(second.counts().expect("counts").dropped, seen(&to_second), "the second neighbour's drops");
    assert_eq!(tally.flow(&other).expect("flows"), seen(&other), "the tally vs the second neighbour");
    assert_eq!(tally.flow(&to_second).expect("flows"), 0);
}

/// The move from XDP to tcx under a flood: the daemon takes XDP by default when it is free
/// (xdp-filter cannot load then); `limiter-ctl attach tcx` moves it while a flood and a steady
/// source run: its pinned link is then a tcx link, first at tcx ingress, XDP is free, no frame
/// passed unjudged, none was judged twice though both hooks held the program for a moment, and
/// the bound held across the move ([`check_hand_over`]); stats say tcx;
/// asked again, it says it is already there. Then xdp-filter loads and drops beside it.
#[test]
fn attach_tcx_moves_the_limiter_off_xdp_under_a_flood_with_no_gap() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let (mut rig, line) = start_daemon(net, &[]);
    assert_eq!(pinned_hook(&rig), LinkType::Xdp, "with XDP free, auto did not take XDP: {line}");
    let at_xdp = rig.daemon.program().expect("program");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(at_xdp));
    match XdpFilter::try_load(&rig.net.receiver).expect("running xdp-filter") {
        Ok(_) => panic!("xdp-filter loaded while the limiter held XDP"),
        Err(out) => eprintln!("xdp-filter load while the limiter holds XDP: {:?} {}", out.code, out.output.trim()),
    }
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(at_xdp), "xdp-filter's attempt moved XDP");
    let tally = Neighbour::tally(&rig.net.receiver).expect("tally");
    let id = rig.policy_id("default");
    let hand_over = start_hand_over(&rig, id, &tally, &[]);

    let watch = watch_move(&rig.net.receiver, 1);
    let started = Instant::now();
    let out = rig.ctl_ok(&["attach", "tcx"]);
    let handed_over = Instant::now();
    let overlap = watch.join().expect("the watch panicked").expect("watching the move");
    eprintln!("attach tcx ({:?}, both hooks for at most {overlap:?}): {}", handed_over - started, out.trim());
    let moved = rig.daemon.refind_program().expect("the daemon's program");
    assert_eq!(pinned_hook(&rig), LinkType::Tcx, "after `attach tcx`");
    assert_ne!(moved, at_xdp);
    check_chain(&rig.net.receiver, &[moved, tally.program]);
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None, "XDP is not free after the move");

    let done = hand_over.finish(&rig, id, &tally, handed_over, Duration::from_millis(1200));
    check_hand_over("the move from XDP to tcx", &done, handed_over);
    check_reported_mode(&rig, "tcx");
    let again = rig.daemon.ctl(&["attach", "tcx"]).expect("attach tcx again");
    assert_eq!(again.code, Some(0), "{again:?}");
    assert!(again.stdout.contains("tcx") || again.stderr.contains("tcx"), "{again:?}");
    assert_eq!(rig.daemon.refind_program().expect("program"), moved, "asked again, it moved again");

    let filter = XdpFilter::load(&rig.net.receiver).unwrap_or_else(|e| panic!("XDP is not free after the move: {e:#}"));
    filter.drop_udp_port(NEIGHBOUR_PORT).expect("xdp-filter port");
    let held = udp(&rig.net, "198.19.1.5", 7000);
    let filtered = udp(&rig.net, "198.19.1.5", NEIGHBOUR_PORT);
    let hits = filter.status().expect("status").port_hits(NEIGHBOUR_PORT);
    let before = counters(&rig, id);
    let tally_before = tally.flows().expect("tally");
    let (run, last) = flood(&rig.net, &[held.clone(), filtered.clone()], &tally);
    let tally_after = tally.flows().expect("tally");
    let judged = Judged::between(&before, &counters(&rig, id));
    let (held, filtered) = (flow_of(&held), flow_of(&filtered));
    let hits = filter.status().expect("status").port_hits(NEIGHBOUR_PORT) - hits;
    assert_eq!(hits, run.sent(&filtered), "xdp-filter's drops after the move");
    assert_eq!(flows_since(&tally_after, &tally_before, &filtered), 0, "frames to the filtered port got through");
    let through = flows_since(&tally_after, &tally_before, &held);
    check_held("after the move, beside xdp-filter", &judged, run.sent(&held), &[through], &run, last);
}

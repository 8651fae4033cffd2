//! Beside Debian's xdp-filter (xdp-tools), which holds the XDP hook alone on this kernel (its
//! libxdp dispatcher cannot load): the daemon with its defaults attaches at tcx ingress and says
//! so; both enforce on real veth traffic (what xdp-filter's rules name is dropped at XDP, never
//! reaching the limiter; what the limiter judges is held to its bound); a restart keeps tcx with
//! no gap; `detach` takes the limiter off with xdp-filter still dropping; unloading xdp-filter
//! leaves the limiter enforcing; and with the limiter at tcx first, xdp-filter then loads and
//! both enforce.

use std::time::{Duration, Instant};

use aya::programs::links::LinkType;
use limiter_tests::{
    bounds::Judged,
    daemon::{Daemon, LEFT, SIGNAL_TIMEOUT, xdp_program_id},
    flood::Flow,
    neighbour::Neighbour,
    netns::TestNet,
    require_root,
    rig::Rig,
    xdp_filter::{self, XdpFilter},
};
use nix::sys::signal::Signal;

use super::*;

/// The UDP port xdp-filter drops (`xdp-filter port 7100 --proto udp --mode dst`).
const FILTERED_PORT: u16 = 7100;
/// The source xdp-filter drops (`xdp-filter ip 198.19.9.9 --mode src`).
const FILTERED_SOURCE: &str = "198.19.9.9";

/// xdp-filter on a new namespace pair's receiver, dropping [`FILTERED_PORT`] and
/// [`FILTERED_SOURCE`].
fn filtered_net() -> (TestNet, XdpFilter) {
    let net = TestNet::new().expect("test network");
    let filter = XdpFilter::load(&net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("xdp-filter load: program {}; said: {}", filter.program, filter.load_output.trim());
    add_rules(&filter);
    (net, filter)
}

fn add_rules(filter: &XdpFilter) {
    filter.drop_udp_port(FILTERED_PORT).unwrap_or_else(|e| panic!("{e:#}"));
    filter.drop_source(addr(FILTERED_SOURCE)).unwrap_or_else(|e| panic!("{e:#}"));
}

/// Three flows interleaved at full speed: 198.19.1.1 to 7000 (the limiter's to hold), the same
/// source to [`FILTERED_PORT`] and [`FILTERED_SOURCE`] to 7000 (xdp-filter's to drop). Checks
/// that xdp-filter dropped all of its two (its hit counters == sent, none through to the tally)
/// and, when `limiter` says the policy's id, that the limiter judged exactly the first flow
/// (nothing xdp-filter dropped reached it) and held it to its bound; without, that the first
/// flow went through whole.
fn check_both_enforce(what: &str, net: &TestNet, filter: &XdpFilter, tally: &Neighbour, limiter: Option<(&Rig, u16)>) {
    let held = udp(net, "198.19.1.1", 7000);
    let by_port = udp(net, "198.19.1.1", FILTERED_PORT);
    let by_source = udp(net, FILTERED_SOURCE, 7000);
    let status = filter.status().expect("xdp-filter status");
    let before = limiter.map(|(rig, id)| counters(rig, id));
    let tally_before = tally.flows().expect("tally");
    let (run, last) = flood(net, &[held.clone(), by_port.clone(), by_source.clone()], tally);
    let after = filter.status().expect("xdp-filter status");
    let tally_after = tally.flows().expect("tally");
    let [held, by_port, by_source] = [&held, &by_port, &by_source].map(flow_of);
    let through = |f: &Flow| flows_since(&tally_after, &tally_before, f);
    let port_hits = after.port_hits(FILTERED_PORT) - status.port_hits(FILTERED_PORT);
    let source_hits = after.address_hits(addr(FILTERED_SOURCE)) - status.address_hits(addr(FILTERED_SOURCE));
    eprintln!("{what}: xdp-filter hits: port {port_hits}, source {source_hits}");
    assert!(run.sent(&by_port) > 0 && run.sent(&by_source) > 0, "{what}: the flood sent none of a flow");
    assert_eq!(port_hits, run.sent(&by_port), "{what}: xdp-filter's port rule vs sent to the port");
    assert_eq!(source_hits, run.sent(&by_source), "{what}: xdp-filter's source rule vs sent by the source");
    assert_eq!(through(&by_port), 0, "{what}: frames to the filtered port got past XDP");
    assert_eq!(through(&by_source), 0, "{what}: frames from the filtered source got past XDP");
    match limiter {
        Some((rig, id)) => {
            let judged = Judged::between(&before.unwrap_or_default(), &counters(rig, id));
            check_held(what, &judged, run.sent(&held), &[through(&held)], &run, last);
        }
        None => assert_eq!(through(&held), run.sent(&held), "{what}: with no limiter, the flow got through whole"),
    }
}

/// The limiter is at tcx: its pinned link is a tcx link, it is first at tcx ingress (then the
/// tally), and XDP is still xdp-filter's program, untouched.
#[track_caller]
fn check_at_tcx(rig: &Rig, filter: &XdpFilter, tally: &Neighbour) {
    assert_eq!(pinned_hook(rig), LinkType::Tcx, "the limiter's pinned link");
    let program = rig.daemon.program().expect("program");
    check_chain(&rig.net.receiver, &[program, tally.program]);
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(filter.program), "XDP changed hands");
}

/// xdp-filter on its own (no limiter): it loads natively on its own (no dispatcher here), says
/// where in `status`, drops exactly what its rules name at XDP (its hit counters == sent; none of
/// it reaches tc ingress) and nothing else; `unload` frees XDP.
#[test]
fn xdp_filter_alone_drops_what_its_rules_name() {
    require_root!();
    let (net, mut filter) = filtered_net();
    let tally = Neighbour::tally(&net.receiver).expect("tally");
    let status = filter.status().expect("status");
    assert_eq!(status.interfaces.get(&net.receiver.iface).map(String::as_str), Some("native"), "{status:?}");
    assert_eq!(status.ports.get(&FILTERED_PORT).map(|(m, _)| m.as_str()), Some("dst,udp"), "{status:?}");
    assert_eq!(status.addresses.get(&addr(FILTERED_SOURCE)).map(|(m, _)| m.as_str()), Some("src"), "{status:?}");
    check_both_enforce("xdp-filter alone", &net, &filter, &tally, None);
    filter.unload().unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(xdp_program_id(&net.receiver).expect("ip link"), None);
}

/// xdp-filter holds XDP; the daemon, started with its defaults (auto), attaches at tcx ingress,
/// says so at start (naming xdp-filter's program), in `stats`, `stats --json` and `/metrics`,
/// leaves xdp-filter's program in place, and both enforce.
#[test]
fn with_xdp_filter_holding_xdp_the_daemon_takes_tcx_and_both_enforce() {
    require_root!();
    let (net, filter) = filtered_net();
    let (rig, line) = start_daemon(net, &[]);
    let (mut rig, line) = (rig, line);
    assert!(line.contains("hook=tc mode=tcx"), "the start line does not say tcx: {line}");
    let why = rig.daemon.wait_for(|l| l.contains("judging at tc ingress"), Duration::from_secs(5));
    let why = why.unwrap_or_else(|e| panic!("no line saying why it judges at tcx: {e:#}"));
    assert!(
        why.contains(&format!("id {}", filter.program)) && why.contains(xdp_filter::PROGRAM_PREFIX),
        "the daemon does not name the program holding XDP ({} named {}*): {why}",
        filter.program,
        xdp_filter::PROGRAM_PREFIX
    );
    let tally = Neighbour::tally(&rig.net.receiver).expect("tally");
    check_at_tcx(&rig, &filter, &tally);
    check_reported_mode(&rig, "tcx");
    let stats = observe::stats(&rig);
    let why = stats["attach_reason"].as_str().unwrap_or_default();
    assert!(
        why.contains(&filter.program.to_string()) && why.contains(xdp_filter::PROGRAM_PREFIX),
        "stats --json does not say why auto chose tcx (the program holding XDP): {stats}"
    );

    let id = rig.policy_id("default");
    check_both_enforce("beside xdp-filter", &rig.net, &filter, &tally, Some((&rig, id)));
    assert_eq!(
        filter.status().expect("status").interfaces.get(&rig.net.receiver.iface).map(String::as_str),
        Some("native")
    );
}

/// A restart there (SIGTERM, a new daemon with the same defaults at once) under a flood: the old
/// daemon leaves its tcx link pinned, the new one adopts it (same link, its own program in it,
/// still first at tcx, XDP still xdp-filter's), and no frame passes unjudged in between
/// ([`check_hand_over`]); xdp-filter dropped every frame to its port throughout.
#[test]
fn a_restart_beside_xdp_filter_stays_at_tcx_with_no_gap() {
    require_root!();
    let (net, filter) = filtered_net();
    let (mut rig, _) = start_daemon(net, &[]);
    let tally = Neighbour::tally(&rig.net.receiver).expect("tally");
    check_at_tcx(&rig, &filter, &tally);
    let id = rig.policy_id("default");
    let link = rig.daemon.link().expect("link").expect("pinned link");
    let hits = filter.status().expect("status").port_hits(FILTERED_PORT);
    let dropped = udp(&rig.net, "198.19.1.3", FILTERED_PORT);
    let hand_over = start_hand_over(&rig, id, &tally, std::slice::from_ref(&dropped));

    rig.daemon.signal(Signal::SIGTERM).expect("SIGTERM");
    let status = rig.daemon.wait_exit(SIGNAL_TIMEOUT).expect("the daemon should exit on SIGTERM");
    let out = rig.daemon.output();
    assert!(status.success() && out.contains(LEFT), "exit {status} on SIGTERM:\n{out}");
    let args: Vec<&str> = ARGS.to_vec();
    let (daemon, line) = Daemon::adopt(&rig.net.receiver, &rig.scratch, &args).unwrap_or_else(|e| panic!("{e:#}"));
    let handed_over = Instant::now();
    rig.daemon = daemon;
    eprintln!("restarted: {line}");
    let now = rig.daemon.link().expect("link").expect("pinned link");
    assert_eq!((now.id, now.link_type), (link.id, LinkType::Tcx), "the new daemon did not adopt the tcx link");
    assert_ne!(now.program, link.program, "the new daemon's program is not in the link");
    check_at_tcx(&rig, &filter, &tally);

    let done = hand_over.finish(&rig, id, &tally, handed_over, Duration::from_millis(1200));
    check_hand_over("a restart at tcx beside xdp-filter", &done, handed_over);
    let hits = filter.status().expect("status").port_hits(FILTERED_PORT) - hits;
    let dropped = flow_of(&dropped);
    assert_eq!(hits, done.run.sent(&dropped), "xdp-filter's port rule vs sent to the port across the restart");
    assert_eq!(done.through(&dropped), 0, "frames to the filtered port got past XDP");
    check_reported_mode(&rig, "tcx");
}

/// `limiter-ctl detach` of the limiter at tcx (its daemon stopped first): its link and pins are
/// gone, tcx ingress holds only the test's tally, and xdp-filter still holds XDP and still drops
/// what its rules name, while the rest now goes through unlimited.
#[test]
fn detach_at_tcx_leaves_xdp_filter_dropping() {
    require_root!();
    let (net, filter) = filtered_net();
    let (mut rig, _) = start_daemon(net, &[]);
    let tally = Neighbour::tally(&rig.net.receiver).expect("tally");
    check_at_tcx(&rig, &filter, &tally);
    rig.daemon.stop_ok();
    let out = rig.scratch.detach(&rig.net.receiver).expect("detach");
    eprintln!("detach: {out:?}");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(!rig.scratch.pin_dir(&rig.net.receiver.iface).exists(), "detach left pins");
    check_chain(&rig.net.receiver, &[tally.program]);
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(filter.program), "detach touched XDP");
    check_both_enforce("after detach", &rig.net, &filter, &tally, None);
}

/// `xdp-filter unload` beside the limiter at tcx: XDP is free, the limiter stays at tcx (its
/// link, first at tcx ingress; stats still say tcx) and holds what it judges, now including what
/// xdp-filter dropped before.
#[test]
fn unloading_xdp_filter_leaves_the_limiter_enforcing_at_tcx() {
    require_root!();
    let (net, mut filter) = filtered_net();
    let (rig, _) = start_daemon(net, &[]);
    let tally = Neighbour::tally(&rig.net.receiver).expect("tally");
    check_at_tcx(&rig, &filter, &tally);
    let link = rig.daemon.link().expect("link").expect("pinned link");
    filter.unload().unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None);
    assert_eq!(rig.daemon.link().expect("link"), Some(link), "the limiter's link changed");
    check_chain(&rig.net.receiver, &[link.program, tally.program]);

    let id = rig.policy_id("default");
    let once = udp(&rig.net, "198.19.1.1", 7000);
    let unfiltered = udp(&rig.net, "198.19.1.4", FILTERED_PORT);
    let before = counters(&rig, id);
    let tally_before = tally.flows().expect("tally");
    let (run, last) = flood(&rig.net, &[once.clone(), unfiltered.clone()], &tally);
    let tally_after = tally.flows().expect("tally");
    let judged = Judged::between(&before, &counters(&rig, id));
    let (once, unfiltered) = (flow_of(&once), flow_of(&unfiltered));
    let through = |f: &Flow| flows_since(&tally_after, &tally_before, f);
    let sent = run.sent(&once) + run.sent(&unfiltered);
    let both = [through(&once), through(&unfiltered)];
    check_held("two sources, xdp-filter gone", &judged, sent, &both, &run, last);
    check_reported_mode(&rig, "tcx");
}

/// The limiter at tcx first (`--attach tcx`, XDP left free), then `xdp-filter load`: it loads
/// (XDP was free), the limiter's link is untouched, and both enforce.
#[test]
fn the_limiter_at_tcx_first_then_xdp_filter_loads_and_both_enforce() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let (rig, line) = start_daemon(net, &["--attach", "tcx"]);
    assert!(line.contains("hook=tc mode=tcx"), "the start line does not say tcx: {line}");
    assert_eq!(pinned_hook(&rig), LinkType::Tcx);
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None, "--attach tcx took XDP");
    let link = rig.daemon.link().expect("link").expect("pinned link");
    let tally = Neighbour::tally(&rig.net.receiver).expect("tally");

    let filter = XdpFilter::load(&rig.net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("xdp-filter load: {}", filter.load_output.trim());
    add_rules(&filter);
    assert_eq!(rig.daemon.link().expect("link"), Some(link), "xdp-filter's load touched the limiter's link");
    check_at_tcx(&rig, &filter, &tally);
    check_reported_mode(&rig, "tcx");
    let id = rig.policy_id("default");
    check_both_enforce("tcx first, then xdp-filter", &rig.net, &filter, &tally, Some((&rig, id)));
}

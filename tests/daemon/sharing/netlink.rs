//! The limiter at tc ingress through a netlink filter (a direct-action `bpf` filter on the
//! clsact qdisc), where the kernel has no tcx (before Linux 6.6; the test hook
//! `LIMITER_TEST_NO_TCX=1` makes the daemon act as there), or as asked (`--tc-api netlink`).
//! Beside another XDP program (the bench object's `bench_pass`) the daemon attaches there and
//! says why; the filter is the limiter's priority 1 and handle 0x4c494d, running its program,
//! whose pin stands where a link's would; it holds what it judges to the bound; SIGTERM leaves it
//! enforcing and a restart swaps the new program into the same filter with no gap; `detach`
//! deletes it and nothing else; the daemon puts it back when another tool deletes it; moves to
//! XDP and back judge each packet once; `--tcx-before`/`--tcx-after` map to the priorities right
//! before and after the named program's filter, and a place that cannot be had is refused.
//!
//! A filter runs after every tcx program, so what got through is counted by a tally that is a
//! filter too ([`Neighbour::filter_tally`], at a priority after the limiter's).

use std::time::{Duration, Instant};

use limiter_tests::{
    bounds::Judged,
    daemon::{ADOPTED, Daemon, LEFT, Launch, SIGNAL_TIMEOUT, xdp_program_id},
    neighbour::{Neighbour, Place, TALLY_PRIORITY, TcFilter, tc_filters, tcx_chain, xdp_pass},
    netns::{End, TestNet},
    observe, require_root,
    rig::Rig,
};
use nix::sys::signal::Signal;

use super::{
    neighbours::{NEIGHBOUR_PORT, Ordered, check_limiter_first, flood_ordered},
    *,
};

/// The test hook that makes the daemon act as on a kernel without tcx.
pub const NO_TCX: (&str, &str) = ("LIMITER_TEST_NO_TCX", "1");
/// The limiter's filter handle ("LIM").
pub const HANDLE: u32 = 0x004c_494d;

/// A daemon with [`ARGS`] and `extra` on `net`'s receiver, as on a kernel without tcx.
fn start(net: TestNet, extra: &[&str]) -> (Rig, String) {
    start_daemon_with(net, extra, &[NO_TCX])
}

/// The limiter is at tc ingress through its filter, at `priority`: the pinned "link" is its
/// program (a filter has no link), the filters at ingress are exactly the limiter's and `others`
/// (by priority), and no tcx link holds it.
#[track_caller]
fn check_at_filter(rig: &Rig, priority: u16, others: &[TcFilter]) {
    let program = rig.daemon.program().expect("program");
    let pinned = rig.daemon.link().expect("the pin").expect("nothing pinned");
    assert!(pinned.is_filter() && pinned.program == program, "the pin is not the filter's program: {pinned:?}");
    let limiter = TcFilter { priority, handle: HANDLE, kind: "bpf".into(), program: Some(program) };
    let mut want: Vec<TcFilter> = others.iter().cloned().chain([limiter]).collect();
    want.sort_by_key(|f| (f.priority, f.handle));
    assert_eq!(tc_filters(&rig.net.receiver).expect("tc filter show"), want, "the filters at tc ingress");
    let chain = tcx_chain(&rig.net.receiver).expect("tcx chain");
    assert!(!chain.contains(&program), "a tcx link holds the limiter too: {chain:?}");
}

/// How `tc` lists `neighbour`'s filter at `priority` on `end`.
#[track_caller]
fn filter_of(end: &End, neighbour: &Neighbour, priority: u16) -> TcFilter {
    let listed = tc_filters(end).expect("tc filter show");
    let found = listed.iter().find(|f| f.program == Some(neighbour.program) && f.priority == priority);
    found.cloned().unwrap_or_else(|| panic!("no filter of program {} at {priority}: {listed:?}", neighbour.program))
}

/// One UDP source flooding port 7000 for [`FLOOD`]: the limiter held it to its bound, judging
/// every frame of it (nothing else reached it).
#[track_caller]
fn check_holds(what: &str, rig: &Rig, tally: &Neighbour) {
    let id = rig.policy_id("default");
    let stream = udp(&rig.net, "198.19.1.1", 7000);
    let before = counters(rig, id);
    let tally_before = tally.flows().expect("tally");
    let (run, last) = flood(&rig.net, std::slice::from_ref(&stream), tally);
    let flow = flow_of(&stream);
    let through = flows_since(&tally.flows().expect("tally"), &tally_before, &flow);
    let judged = Judged::between(&before, &counters(rig, id));
    check_held(what, &judged, run.sent(&flow), &[through], &run, last);
}

/// Beside another program at XDP, on a kernel without tcx: the daemon with its defaults attaches
/// at tc ingress through a filter, and says where and why in one line (the holder of XDP, and
/// "tcx needs Linux 6.6"), in `stats`, `stats --json` and `/metrics`; XDP is left alone; the
/// filter holds what it judges to the bound.
#[test]
fn beside_another_xdp_program_without_tcx_it_judges_through_a_netlink_filter() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let _other = xdp_pass(&net.receiver, "bench_pass").expect("bench_pass at XDP");
    let at_xdp = xdp_program_id(&net.receiver).expect("ip link").expect("bench_pass attached");
    let (mut rig, line) = start(net, &[]);
    assert!(line.contains("hook=tc") && line.contains("mode=netlink"), "the start line: {line}");
    let why = rig.daemon.wait_for(|l| l.contains("judging at tc ingress"), Duration::from_secs(5));
    let why = why.unwrap_or_else(|e| panic!("no line saying where and why: {e:#}"));
    for said in ["api=netlink", "tcx needs Linux 6.6", &format!("id {at_xdp}"), "bench_pass"] {
        assert!(why.contains(said), "the line does not say {said}: {why}");
    }
    let tally = Neighbour::filter_tally(&rig.net.receiver).expect("tally");
    check_at_filter(&rig, 1, &[filter_of(&rig.net.receiver, &tally, TALLY_PRIORITY)]);
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(at_xdp), "XDP changed hands");
    check_reported_mode(&rig, "netlink");
    let stats = observe::stats(&rig);
    let api = stats["attach_api_reason"].as_str().unwrap_or_default();
    assert!(api.contains("tcx needs Linux 6.6"), "stats --json does not say why netlink: {stats}");
    assert!(stats["attach_reason"].as_str().unwrap_or_default().contains("bench_pass"), "{stats}");
    let (_, samples) = observe::metrics(&rig);
    assert_eq!(observe::gauge(&samples, "limiter_attach_netlink", &[("reason", "no_tcx")]), 1.0);
    check_holds("through netlink beside bench_pass", &rig, &tally);
}

/// SIGTERM leaves the filter in place, running the old program, enforcing with no daemon; the next
/// daemon adopts it: the same priority and handle, its own program swapped in (netlink's replace)
/// with no frame unjudged or judged twice under a flood ([`check_hand_over`]).
#[test]
fn through_netlink_sigterm_leaves_it_enforcing_and_a_restart_swaps_in_place() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let _other = xdp_pass(&net.receiver, "bench_pass").expect("bench_pass at XDP");
    let (mut rig, _) = start(net, &[]);
    let tally = Neighbour::filter_tally(&rig.net.receiver).expect("tally");
    let tally_filter = filter_of(&rig.net.receiver, &tally, TALLY_PRIORITY);
    check_at_filter(&rig, 1, std::slice::from_ref(&tally_filter));
    let old = rig.daemon.program().expect("program");
    let id = rig.policy_id("default");
    let hand_over = start_hand_over(&rig, id, &tally, &[]);

    rig.daemon.signal(Signal::SIGTERM).expect("SIGTERM");
    let status = rig.daemon.wait_exit(SIGNAL_TIMEOUT).expect("the daemon should exit on SIGTERM");
    let out = rig.daemon.output();
    assert!(status.success() && out.contains(LEFT), "exit {status} on SIGTERM:\n{out}");
    let left = tc_filters(&rig.net.receiver).expect("tc filter show");
    let limiter = TcFilter { priority: 1, handle: HANDLE, kind: "bpf".into(), program: Some(old) };
    assert_eq!(left, vec![limiter, tally_filter.clone()], "with no daemon, the filter is not the old program's");
    // A moment with no daemon at all: the filter judges on its own.
    std::thread::sleep(Duration::from_millis(300));
    let launch = Launch { env: environment(&[NO_TCX]), ..Launch::default() };
    let mut daemon = Daemon::launch(&rig.net.receiver, &rig.scratch, &ARGS, launch).expect("restart");
    let line = daemon.wait_adopted(&rig.net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    let handed_over = Instant::now();
    rig.daemon = daemon;
    eprintln!("restarted: {line}");
    assert!(line.contains(ADOPTED) && line.contains("mode=netlink"), "{line}");
    let new = rig.daemon.program().expect("program");
    assert_ne!(new, old, "the new daemon's program is not in the filter");
    check_at_filter(&rig, 1, std::slice::from_ref(&tally_filter));

    let done = hand_over.finish(&rig, id, &tally, handed_over, Duration::from_millis(1200));
    check_hand_over("a restart through netlink", &done, handed_over);
    check_reported_mode(&rig, "netlink");
}

/// `limiter-ctl detach` (the daemon stopped first) deletes the limiter's filter and its pins,
/// says so and what stays; the tally's filter and the XDP program stay; the flow then goes
/// through whole.
#[test]
fn detach_through_netlink_deletes_the_limiters_filter_only() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let _other = xdp_pass(&net.receiver, "bench_pass").expect("bench_pass at XDP");
    let at_xdp = xdp_program_id(&net.receiver).expect("ip link");
    let (mut rig, _) = start(net, &[]);
    let tally = Neighbour::filter_tally(&rig.net.receiver).expect("tally");
    let tally_filter = filter_of(&rig.net.receiver, &tally, TALLY_PRIORITY);
    check_at_filter(&rig, 1, std::slice::from_ref(&tally_filter));
    rig.daemon.stop_ok();
    let out = rig.scratch.detach(&rig.net.receiver).expect("detach");
    eprintln!("detach: {out:?}");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("removed the limiter's filter") && out.stdout.contains("stay"), "{out:?}");
    assert!(!rig.scratch.pin_dir(&rig.net.receiver.iface).exists(), "detach left pins");
    assert_eq!(tc_filters(&rig.net.receiver).expect("tc filter show"), vec![tally_filter], "detach");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), at_xdp, "detach touched XDP");
    let stream = udp(&rig.net, "198.19.1.1", 7000);
    let (run, _) = flood(&rig.net, std::slice::from_ref(&stream), &tally);
    assert_eq!(tally.flow(&flow_of(&stream)).expect("tally"), run.sent(&flow_of(&stream)), "after detach");
}

/// Another tool deletes the limiter's filter (`tc filter del`): within a few seconds the daemon
/// says so and attaches it again, at its priority, and it holds the bound again.
#[test]
fn a_deleted_filter_is_put_back_by_the_daemon() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let (mut rig, _) = start(net, &["--attach", "tc"]);
    check_at_filter(&rig, 1, &[]);
    let deleted = rig
        .net
        .receiver
        .command("tc")
        .args(["filter", "del", "dev", &rig.net.receiver.iface, "ingress", "pref", "1", "handle", "0x4c494d", "bpf"])
        .status()
        .expect("tc filter del");
    assert!(deleted.success(), "tc filter del: {deleted}");
    assert_eq!(tc_filters(&rig.net.receiver).expect("tc filter show"), vec![], "the filter was not deleted");
    let said = rig.daemon.wait_for(|l| l.contains("attached again"), Duration::from_secs(10));
    let said = said.unwrap_or_else(|e| panic!("the daemon did not put its filter back: {e:#}"));
    eprintln!("{said}");
    rig.daemon.refind_program().expect("program");
    check_at_filter(&rig, 1, &[]);
    let tally = Neighbour::filter_tally(&rig.net.receiver).expect("tally");
    check_holds("the filter put back", &rig, &tally);
}

/// Asked for (`--tc-api netlink`, on this kernel that has tcx): the limiter starts at tc ingress
/// through a filter and says it was asked; `attach xdp` moves it to XDP under a flood (its
/// filter deleted, XDP holding its program), `attach tc` back to a filter, each move with no
/// frame unjudged or judged twice ([`check_hand_over`]).
#[test]
fn asked_for_netlink_it_moves_to_xdp_and_back_with_no_gap() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let (mut rig, line) = start_daemon(net, &["--attach", "tc", "--tc-api", "netlink"]);
    assert!(line.contains("mode=netlink"), "{line}");
    let tally = Neighbour::filter_tally(&rig.net.receiver).expect("tally");
    let tally_filter = filter_of(&rig.net.receiver, &tally, TALLY_PRIORITY);
    check_at_filter(&rig, 1, std::slice::from_ref(&tally_filter));
    let stats = observe::stats(&rig);
    assert_eq!(stats["attach_api_reason"], "asked for (--tc-api netlink)", "{stats}");
    let id = rig.policy_id("default");

    for (to, mode) in [("xdp", "native"), ("tc", "netlink")] {
        let hand_over = start_hand_over(&rig, id, &tally, &[]);
        let out = rig.ctl_ok(&["attach", to]);
        let handed_over = Instant::now();
        eprintln!("attach {to}: {}", out.trim());
        let program = rig.daemon.refind_program().expect("the daemon's program");
        match to {
            "xdp" => {
                assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(program), "XDP");
                let filters = tc_filters(&rig.net.receiver).expect("tc filter show");
                assert_eq!(filters, vec![tally_filter.clone()], "the limiter's filter stayed");
            }
            _ => {
                assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None, "XDP is not free");
                check_at_filter(&rig, 1, std::slice::from_ref(&tally_filter));
            }
        }
        let done = hand_over.finish(&rig, id, &tally, handed_over, Duration::from_millis(1200));
        check_hand_over(&format!("the move to {to}"), &done, handed_over);
        check_reported_mode(&rig, mode);
    }
}

/// `--tcx-before neighbour` and `--tcx-after neighbour` through netlink, the neighbour a filter
/// at priority 10 dropping [`NEIGHBOUR_PORT`]: the limiter's filter goes at 9 and runs first
/// (the neighbour sees only what it admitted), then at 11 and runs after (what the neighbour
/// drops never reaches it).
#[test]
fn through_netlink_tcx_before_and_after_take_the_priorities_next_to_the_program() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let neighbour = Neighbour::attach(&net.receiver, NEIGHBOUR_PORT, Place::Filter(10)).expect("neighbour");
    let (mut rig, _) = start(net, &["--attach", "tc", "--tcx-before", "neighbour"]);
    // The tally (a `neighbour` too) after the daemon, so that the name named one program.
    let tally = Neighbour::filter_tally(&rig.net.receiver).expect("tally");
    let others = [filter_of(&rig.net.receiver, &neighbour, 10), filter_of(&rig.net.receiver, &tally, TALLY_PRIORITY)];
    check_at_filter(&rig, 9, &others);
    check_limiter_first("--tcx-before neighbour, through netlink", &rig, &neighbour, &tally);

    rig.daemon.stop_ok();
    let out = rig.scratch.detach(&rig.net.receiver).expect("detach");
    assert_eq!(out.code, Some(0), "{out:?}");
    drop(tally);
    let launch = Launch { env: environment(&[NO_TCX]), ..Launch::default() };
    let after = ["--attach", "tc", "--tcx-after", "neighbour"];
    let args: Vec<&str> = ARGS.iter().copied().chain(after).collect();
    rig.daemon = Daemon::launch(&rig.net.receiver, &rig.scratch, &args, launch).expect("daemon");
    rig.daemon.wait_attached(&rig.net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    let tally = Neighbour::filter_tally(&rig.net.receiver).expect("tally");
    check_at_filter(
        &rig,
        11,
        &[filter_of(&rig.net.receiver, &neighbour, 10), filter_of(&rig.net.receiver, &tally, TALLY_PRIORITY)],
    );

    let before = neighbour.counts().expect("counts");
    let seen_before = neighbour.flows().expect("flows");
    let Ordered { run, last, judged, flows } = flood_ordered(&rig, &tally, false);
    let (to_port, other) = (flows[0], flows[1]);
    let dropped = neighbour.counts().expect("counts").dropped - before.dropped;
    assert_eq!(dropped, run.sent(&to_port), "the neighbour's drops");
    let seen = flows_since(&neighbour.flows().expect("flows"), &seen_before, &other);
    assert_eq!(seen, run.sent(&other), "the neighbour first saw all of it");
    let through = tally.flow(&other).expect("flows");
    // Judged exactly the other flow: nothing the neighbour dropped reached the limiter.
    check_held("--tcx-after neighbour, through netlink", &judged, run.sent(&other), &[through], &run, last);
}

/// A place through netlink that cannot be had is refused in one line, exit 2, nothing attached:
/// first (priority 1) while another filter holds 1; right before a filter at priority 1; before a
/// program at tcx (which runs before every filter). Right after the filter at 1, it starts at 2.
#[test]
fn through_netlink_a_place_that_cannot_be_had_is_refused() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let neighbour = Neighbour::attach(&net.receiver, NEIGHBOUR_PORT, Place::Filter(1)).expect("neighbour");
    let at_tcx = Neighbour::attach(&net.receiver, 0, Place::First).expect("a program at tcx");
    let before_tcx = format!("id:{}", at_tcx.program);
    let before_first = format!("id:{}", neighbour.program);
    let cases: [(&[&str], &str); 3] = [
        (&["--attach", "tc"], "priority 1"),
        (&["--attach", "tc", "--tcx-before", &before_first], "no priority is left"),
        (&["--attach", "tc", "--tcx-before", &before_tcx], "runs at tcx"),
    ];
    let filters = tc_filters(&net.receiver).expect("tc filter show");
    for (extra, says) in cases {
        let error = refused_start(&net.receiver, extra, &[NO_TCX], 2);
        assert!(error.contains(says), "{extra:?}: {error}");
        assert_eq!(tc_filters(&net.receiver).expect("tc filter show"), filters, "{extra:?}: the filters changed");
    }
    let (rig, _) = start(net, &["--attach", "tc", "--tcx-after", &before_first]);
    check_at_filter(&rig, 2, &[filter_of(&rig.net.receiver, &neighbour, 1)]);
}

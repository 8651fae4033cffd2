//! A move between hooks cut short: the daemon SIGKILLs itself at each step of `limiter-ctl
//! attach` (the test hook `LIMITER_TEST_SIGKILL_AT`), from tc ingress to XDP and from XDP to tc
//! ingress, there through tcx or through a netlink filter (as on a kernel without tcx).
//! Killed at any step, the program left behind judges each packet once, whichever hooks still
//! hold it: a fresh source gets its burst, not half of it. The next start repairs what was left:
//! one hook holds the program (the old one if the new attachment was not renamed over it yet, the
//! new one after), no `link_next` is pinned, no filter of the limiter's is left beside a link, the
//! hand-over flag is cleared, `stats --json` and `attach` name the hook the program is really at,
//! and a fresh source gets its burst once.

use std::{os::unix::process::ExitStatusExt as _, path::Path, time::Duration};

use limiter_common::maps::Config;
use limiter_tests::{
    bounds,
    cpu::flood_cpu,
    daemon::{Daemon, Launch, Scratch, xdp_program_id},
    flood::Limits,
    neighbour::{Neighbour, tc_filters, tcx_chain},
    netns::TestNet,
    require_root,
    rig::Flooding,
};

use super::*;

/// The steps of a move, as the test hook names them: the flag set; the new hook attached (a link
/// held by the daemon only); pinned beside the old attachment (`link_next`; a filter's program is
/// pinned before the filter is made); renamed over it; the old one released.
const STEPS: [&str; 5] = ["move-flagged", "move-attached", "move-pinned", "move-renamed", "move-released"];
/// From this step on, the new attachment is the pinned one: the program is at the new hook.
const RENAMED: usize = 3;

/// How the limiter attaches at tc ingress in a run.
#[derive(Clone, Copy, PartialEq)]
enum Api {
    Tcx,
    /// A netlink filter, as on a kernel without tcx ([`super::netlink::NO_TCX`]).
    Netlink,
}

/// A policy whose burst a fresh source spends in a moment, at a rate that adds little to it.
const BURST_ARGS: [&str; 10] =
    ["--rate", "10/s", "--burst", "1000", "--buckets", "1024", "--metrics", "off", "--rotate-every", "off"];
const BURST: u64 = 1000;
/// What a fresh source sends, paced: three bursts' worth, in about 150 ms.
const SENT: u64 = 3000;
const PACE: f64 = 20_000.0;

#[test]
fn a_move_from_tcx_to_xdp_killed_at_any_step_judges_each_packet_once() {
    require_root!();
    for (i, step) in STEPS.iter().enumerate() {
        killed_at("tcx", "xdp", i, step, Api::Tcx);
    }
}

#[test]
fn a_move_from_xdp_to_tcx_killed_at_any_step_judges_each_packet_once() {
    require_root!();
    for (i, step) in STEPS.iter().enumerate() {
        killed_at("xdp", "tcx", i, step, Api::Tcx);
    }
}

#[test]
fn a_move_from_a_netlink_filter_to_xdp_killed_at_any_step_judges_each_packet_once() {
    require_root!();
    for (i, step) in STEPS.iter().enumerate() {
        killed_at("tc", "xdp", i, step, Api::Netlink);
    }
}

#[test]
fn a_move_from_xdp_to_a_netlink_filter_killed_at_any_step_judges_each_packet_once() {
    require_root!();
    for (i, step) in STEPS.iter().enumerate() {
        killed_at("xdp", "tc", i, step, Api::Netlink);
    }
}

/// Whether the next start says it repaired a move killed at `step` towards `to`: a `link_next`
/// left pinned (either way); and through netlink, a filter left beside a link: made before the
/// rename on the way to tc ingress, not yet deleted after it on the way back.
fn repaired(step: &str, to: &str, api: Api) -> bool {
    match (api, to) {
        (Api::Tcx, _) => step == "move-pinned",
        (Api::Netlink, "xdp") => ["move-pinned", "move-renamed"].contains(&step),
        (Api::Netlink, _) => ["move-pinned", "move-attached"].contains(&step),
    }
}

/// The daemon at `from`, asked to move `to` and killed at `step` (the `i`th); then restarted.
fn killed_at(from: &str, to: &str, i: usize, step: &str, api: Api) {
    let what = format!("{from} to {to}, killed at {step}");
    let no_tcx: &[(&str, &str)] = if api == Api::Netlink { &[super::netlink::NO_TCX] } else { &[] };
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch");
    let state = scratch.path().join("state");
    let args = |extra: &[&str]| -> Vec<String> {
        let state = state.to_str().expect("a UTF-8 path");
        BURST_ARGS.iter().chain(extra).chain(&["--state-dir", state]).map(|s| s.to_string()).collect()
    };
    let first_args = args(&["--attach", from]);
    let mut env = environment(no_tcx);
    env.push(("LIMITER_TEST_SIGKILL_AT".into(), step.into()));
    let launch = Launch { env, ..Launch::default() };
    let mut daemon = Daemon::launch(&net.receiver, &scratch, &strs(&first_args), launch).expect("daemon");
    daemon.wait_attached(&net.receiver).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    // A filter runs after every tcx program: what a filter lets through, a filter counts.
    let tally = match api {
        Api::Tcx => Neighbour::tally(&net.receiver),
        Api::Netlink => Neighbour::filter_tally(&net.receiver),
    }
    .expect("tally");

    let out = daemon.ctl(&["attach", to]).expect("running attach");
    let status = daemon.wait_exit(Duration::from_secs(10)).expect("the daemon should die");
    assert_eq!(status.signal(), Some(9), "{what}: not killed at its step ({status}): {out:?}\n{}", daemon.output());
    assert_ne!(out.code, Some(0), "{what}: attach answered as if done: {out:?}");
    let pins = scratch.pin_dir(&net.receiver.iface);
    eprintln!("{what}: pinned {:?}", scratch.pinned(&net.receiver.iface).expect("pins").keys());
    check_burst_once(&format!("{what}, before a restart"), &net, &tally, i, 0);

    let restart = args(&[]);
    let launch = Launch { env: environment(no_tcx), ..Launch::default() };
    let mut daemon = Daemon::launch(&net.receiver, &scratch, &strs(&restart), launch).expect("restart");
    let line = daemon.wait_adopted(&net.receiver).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    let at = if i >= RENAMED { to } else { from };
    eprintln!("{what}: restarted: {line}");
    let undone = daemon.output().contains("was cut short");
    let want = repaired(step, to, api);
    assert_eq!(undone, want, "{what}: the start says it repaired a move: {undone}\n{}", daemon.output());
    check_one_hook(&what, &net, &daemon, &pins, at, api, &tally);
    let (hook, mode) = match (at, api) {
        ("xdp", _) => ("xdp", "native"),
        (_, Api::Tcx) => ("tc", "tcx"),
        (_, Api::Netlink) => ("tc", "netlink"),
    };
    let stats: serde_json::Value =
        serde_json::from_str(&daemon.ctl_ok(&["stats", "--json"]).expect("stats")).expect("stats --json");
    assert_eq!(stats["attach_mode"], mode, "{what}: stats --json after the restart: {stats}");
    let again = daemon.ctl_ok(&["attach", at]).expect("attach again");
    assert!(again.contains(&format!("already at {hook} ({mode})")), "{what}: attach {at} says: {again}");
    check_burst_once(&format!("{what}, restarted"), &net, &tally, i, 1);
}

/// One hook holds the daemon's program, `at` ("xdp", or tc ingress through `api`); only its
/// attachment is pinned; beside the tally, nothing else is at tc ingress; the hand-over flag is
/// clear.
#[track_caller]
fn check_one_hook(what: &str, net: &TestNet, daemon: &Daemon, pins: &Path, at: &str, api: Api, tally: &Neighbour) {
    let link = daemon.link().expect("the pinned link").expect("no link pinned");
    let program = daemon.program().expect("program");
    assert_eq!(link.program, program, "{what}: the pinned link runs another program");
    let at_xdp = xdp_program_id(&net.receiver).expect("ip link");
    let chain = tcx_chain(&net.receiver).expect("tcx chain");
    let filters = tc_filters(&net.receiver).expect("tc filter show");
    let in_filter: Vec<Option<u32>> = filters.iter().map(|f| f.program).collect();
    eprintln!("{what}: link {link:?}; XDP {at_xdp:?}; tcx {chain:?}; filters {filters:?}");
    match (at, api) {
        ("xdp", _) => assert_eq!(at_xdp, Some(program), "{what}: XDP"),
        (_, Api::Tcx) => {
            assert_eq!(at_xdp, None, "{what}: a program still at XDP");
            assert_eq!(chain.first(), Some(&program), "{what}: not first at tcx: {chain:?}");
        }
        (_, Api::Netlink) => {
            assert_eq!(at_xdp, None, "{what}: a program still at XDP");
            assert!(link.is_filter(), "{what}: the pin is no filter's program: {link:?}");
        }
    }
    let (want_tcx, want_filters) = match (at, api) {
        (_, Api::Tcx) if at != "xdp" => (vec![program, tally.program], vec![]),
        (_, Api::Tcx) => (vec![tally.program], vec![]),
        (_, Api::Netlink) if at != "xdp" => (vec![], vec![Some(program), Some(tally.program)]),
        (_, Api::Netlink) => (vec![], vec![Some(tally.program)]),
    };
    assert_eq!(chain, want_tcx, "{what}: tcx ingress");
    assert_eq!(in_filter, want_filters, "{what}: the filters at tc ingress");
    assert!(!pins.join("link_next").exists(), "{what}: the unfinished move's link is still pinned");
    let flags = daemon.maps().expect("maps").rules.config.flags;
    assert_eq!(flags & Config::HANDOVER, 0, "{what}: the hand-over flag is still set");
}

/// A fresh source (198.19.`round`.`i + 1`) sends [`SENT`] frames at [`PACE`]: what reaches the
/// tally is its burst and the rate's worth over the run, judged once; judged at two hooks, it
/// would be about half of that. On a kernel that refuses the mark's helper ([`marks_judged`]),
/// a move killed while both hooks hold the program leaves both judging until the next start:
/// there, half (each frame XDP passes is charged again at tc), and no more than half the bound.
#[track_caller]
fn check_burst_once(what: &str, net: &TestNet, tally: &Neighbour, i: usize, round: usize) {
    let twice = !marks_judged() && at_both_hooks(net, tally);
    let source = format!("198.19.{}.{}", 10 + round, i + 1);
    let stream = udp(net, &source, 7000);
    let limits = Limits::counted(SENT, Duration::from_secs(5)).on_cpu(flood_cpu());
    let run = Flooding::start(&net.sender, std::slice::from_ref(&stream), limits, Some(PACE), None)
        .finish()
        .expect("sending");
    let last = settle(tally);
    assert_eq!(run.report.sent, SENT, "{what}: sent {}", run.report);
    let through = tally.flow(&limiter_tests::rig::flow_of(&stream)).expect("tally");
    let window = bounds::window(&run.report, Some(last));
    let most = limiter_tests::policies::gcra(10, BURST).bound(bounds::nanos(window));
    eprintln!("{what}: {through} of {SENT} from {source} through (burst {BURST}, at most {most} over {window:?})");
    if twice {
        // Two admissions per frame through, and one for a frame XDP passed and tc refused.
        let (least, most) = ((BURST - 1) / 2, most / 2);
        eprintln!("{what}: both hooks hold the program, and this kernel refuses the mark: judged twice");
        assert!(
            (least..=most).contains(&through),
            "{what}: {through} of {SENT} through, judged at both hooks: not half the burst ({least} to {most})"
        );
        return;
    }
    assert!(
        (BURST..=most).contains(&through),
        "{what}: {through} of {SENT} through, not the burst of {BURST} (at most {most}): judged twice, or not at all"
    );
}

/// Whether the limiter is at XDP and at tc ingress (tcx or a filter) at once, beside the tally.
fn at_both_hooks(net: &TestNet, tally: &Neighbour) -> bool {
    let at_xdp = xdp_program_id(&net.receiver).expect("ip link").is_some();
    let chain = tcx_chain(&net.receiver).expect("tcx chain");
    let filters = tc_filters(&net.receiver).expect("tc filter show");
    let at_tc = chain.iter().any(|p| *p != tally.program) || filters.iter().any(|f| f.program != Some(tally.program));
    at_xdp && at_tc
}

//! XDP refuses the program (issue 38). With its defaults the daemon falls back to tc ingress and
//! says why in one line: the log, `stats`, `stats --json` and `/metrics`
//! (`limiter_attach_tc{reason="xdp_refused"}`); the verifier's whole log goes to a file the line
//! names, never into `stats`. The verifier here accepts the program, so the test hook
//! `LIMITER_TEST_REJECT=xdp` stands for a kernel whose verifier rejects it (Debian 12's 6.1 did),
//! with that kernel's log. `--mode native` is native or nothing: a driver refusing native XDP (a
//! veth whose peer's MTU is past what XDP without fragments takes: ERANGE) fails the start, exit
//! 1, in one line naming XDP and the mode, and nothing is attached anywhere.

use std::time::Duration;

use limiter_tests::{
    daemon::xdp_program_id,
    neighbour::{tc_filters, tcx_chain},
    netns::TestNet,
    observe, require_root,
};

use super::{netlink::NO_TCX, *};

/// The test hook standing for a verifier that rejects the XDP program.
const REJECT_XDP: (&str, &str) = ("LIMITER_TEST_REJECT", "xdp");

/// Past what veth takes for an XDP program without fragments (a page, less its headroom).
const JUMBO: &str = "9000";

#[test]
fn when_xdp_refuses_the_program_it_judges_at_tc_ingress_and_says_why_in_one_line() {
    require_root!();
    for (env, mode) in [(&[REJECT_XDP][..], "tcx"), (&[REJECT_XDP, NO_TCX][..], "netlink")] {
        let (mut rig, line) = start_daemon_with(TestNet::new().expect("test network"), &[], env);
        assert!(line.contains("hook=tc") && line.contains(&format!("mode={mode}")), "{mode}: the start line: {line}");
        let why = rig.daemon.wait_for(|l| l.contains("judging at tc ingress"), Duration::from_secs(5));
        let why = why.unwrap_or_else(|e| panic!("{mode}: no line saying where and why: {e:#}"));
        eprintln!("{mode}: {why}");
        let reason = "math between pkt pointer and register with unbounded min value is not allowed";
        for said in ["XDP refused the program", "the kernel rejected the xdp program", reason] {
            assert!(why.contains(said), "{mode}: the line does not say {said}: {why}");
        }
        let named = why.split_once("the verifier's whole log: ").and_then(|(_, rest)| rest.split_once(')'));
        let log = named.unwrap_or_else(|| panic!("{mode}: the line does not name the log: {why}")).0;
        assert!(log.starts_with(&rig.scratch.path().display().to_string()), "{mode}: not beside the socket: {log}");
        let saved = std::fs::read_to_string(log).expect("the verifier's log");
        assert!(saved.contains("454: (0f) r5 += r3") && saved.contains("processed 147894 insns"), "{saved}");
        let out = rig.daemon.output();
        assert_eq!(out.lines().filter(|l| l.contains("XDP refused")).count(), 1, "{mode}: not one line:\n{out}");
        assert!(!out.contains("r5 += r3"), "{mode}: the verifier's log in the daemon's output:\n{out}");
        assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None, "{mode}: left at XDP");
        check_reported_mode(&rig, mode);

        let stats = observe::stats(&rig);
        let at = stats["attach_reason"].as_str().unwrap_or_default();
        assert!(at.starts_with("XDP refused the program (") && at.contains(reason), "{mode}: {stats}");
        assert!(!stats.to_string().contains("r5 += r3"), "{mode}: the verifier's log in stats: {stats}");
        assert_eq!(stats["attach_reason_code"], "xdp_refused", "{mode}: {stats}");
        let text = rig.ctl_ok(&["stats"]);
        let said: Vec<&str> = text.lines().filter(|l| l.contains("XDP refused the program")).collect();
        assert_eq!(said.len(), 1, "{mode}: `stats` does not say why in one line:\n{text}");
        let (_, samples) = observe::metrics(&rig);
        let series = observe::gauge(&samples, "limiter_attach_tc", &[("reason", "xdp_refused")]);
        assert_eq!(series, 1.0, "{mode}: limiter_attach_tc");
        let netlink = limiter_tests::scrape::one(&samples, "limiter_attach_netlink", &[]).ok();
        match mode {
            "netlink" => assert!(said[0].contains("tcx needs Linux 6.6"), "{mode}: {}", said[0]),
            _ => assert!(netlink.is_none(), "{mode}: limiter_attach_netlink at tcx: {netlink:?}"),
        }
    }
}

#[test]
fn with_mode_native_a_refusal_of_native_xdp_fails_the_start_in_one_line() {
    require_root!();
    let net = TestNet::new().expect("test network");
    net.sender.ip(["link", "set", "dev", &net.sender.iface, "mtu", JUMBO]).expect("the sender's MTU");
    net.receiver.ip(["link", "set", "dev", &net.receiver.iface, "mtu", JUMBO]).expect("the receiver's MTU");
    let error = refused_start(&net.receiver, &["--mode", "native"], &[], 1);
    assert!(error.contains("at XDP in native mode") && error.contains("os error 34"), "{error}");
    assert_eq!(xdp_program_id(&net.receiver).expect("ip link"), None, "left at XDP");
    assert!(tc_filters(&net.receiver).expect("tc filter show").is_empty(), "a filter at tc ingress");
    assert!(tcx_chain(&net.receiver).expect("tcx chain").is_empty(), "a program at tcx");
}

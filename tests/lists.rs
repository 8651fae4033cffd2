//! The allow and deny lists: allowed sources are never refused, denied ones always dropped, the
//! longest prefix wins, for traffic a policy matches and traffic none does.
//!
//! End to end through the real `limiter-ctl` (daemon and CLI) and the real XDP program on a veth
//! pair, on the shared [`limiter_tests::rig`], with policies as [`limiter_tests::policies`] sets
//! them and holds them to their bounds.

use std::{collections::BTreeMap, time::Duration};

use limiter_tests::{
    bounds::{check_bounds, check_overload},
    flood::{Flow, L4, Limits, Stream},
    policies::{Pol, PolicyRig as _, check_sent_all, list_json},
    require_root,
    rig::{Rig, flow_of},
};
use serde_json::Value;

/// Allowed sources are never refused (all delivered, counted as allowed), denied ones always
/// dropped (none delivered, counted as denied), IPv4 and IPv6, and the longest prefix wins both
/// ways: an allowed /24 inside a denied /16, an allowed /64 inside a denied /48. The lists apply
/// to traffic no policy matches too (ICMP here: the only policy is `udp`), counted under id 0.
#[test]
fn allow_and_deny_lists_with_longest_prefix_winning() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let pol = Pol::new("udp", "udp", 100, 10);
    rig.set_all(std::slice::from_ref(&pol));
    for (list, cidr) in [
        ("deny", "198.19.0.0/16"),
        ("allow", "198.19.10.0/24"),
        ("deny", "2001:db8:d::/48"),
        ("allow", "2001:db8:d:a::/64"),
    ] {
        rig.ctl_ok(&[list, "add", cidr]);
    }
    assert_eq!(list_json(&rig, "allow"), vec!["198.19.10.0/24", "2001:db8:d:a::/64"]);
    assert_eq!(list_json(&rig, "deny"), vec!["198.19.0.0/16", "2001:db8:d::/48"]);
    let acl = rig.snapshot().rules.acl();
    let expected: BTreeMap<String, &str> = [
        ("198.19.0.0/16", "deny"),
        ("198.19.10.0/24", "allow"),
        ("2001:db8:d::/48", "deny"),
        ("2001:db8:d:a::/64", "allow"),
    ]
    .into_iter()
    .map(|(n, a)| (n.to_string(), a))
    .collect();
    assert_eq!(acl, expected, "the kernel's tries");

    let s = |l4, src| rig.stream(l4, 7000, src);
    let allowed = [s(L4::Udp, "198.19.10.5"), s(L4::Udp, "2001:db8:d:a::5")];
    let denied = [s(L4::Udp, "198.19.20.5"), s(L4::Udp, "2001:db8:d:b::5")];
    let limited = [s(L4::Udp, "198.18.200.5"), s(L4::Udp, "2001:db8:e::5")];
    let unmatched_allowed = s(L4::IcmpEcho, "198.19.10.6");
    let unmatched_denied = s(L4::IcmpEcho, "2001:db8:d:c::6");
    let streams: Vec<Stream> =
        allowed.iter().chain(&denied).chain(&limited).chain([&unmatched_allowed, &unmatched_denied]).cloned().collect();
    // Bounded in packets: every allowed frame reaches the capture.
    const FRAMES: u64 = 40_000;
    let run = rig.counted_flood(&streams, Limits::counted(FRAMES, Duration::from_secs(10)));
    eprintln!("lists: {}", run.report);
    check_sent_all(&run, FRAMES, "the lists");
    check_overload(&run.report, 100.0, streams.len());
    let f = flow_of;
    for stream in allowed.iter().chain([&unmatched_allowed]) {
        assert_eq!(run.delivered(&f(stream)), run.sent(&f(stream)), "allowed {:?} was refused", f(stream));
    }
    for stream in denied.iter().chain([&unmatched_denied]) {
        assert!(run.sent(&f(stream)) > 0);
        assert_eq!(run.delivered(&f(stream)), 0, "denied {:?} got through", f(stream));
    }
    let groups: Vec<Vec<Flow>> = limited.iter().map(|s| vec![f(s)]).collect();
    let id = rig.policy_id("udp");
    rig.check_installed(&pol, id);
    let judged = rig.judged(&run, id);
    for group in &groups {
        let got = run.delivered(&group[0]);
        check_bounds(&format!("{:?}", group[0]), got, &pol.gcra(), judged.cpus.len(), run.window(), &run.report);
    }
    let sum = |streams: &[Stream]| streams.iter().map(|s| run.sent(&f(s))).sum::<u64>();
    let t = judged.total;
    assert_eq!(t.allowed_packets, sum(&allowed), "'udp' allowed count");
    assert_eq!(t.denied_packets, sum(&denied), "'udp' denied count");
    assert_eq!(t.admitted_packets + t.refused_packets, sum(&limited), "'udp' judged by rate");
    assert_eq!(t.admitted_packets, groups.iter().map(|g| run.delivered(&g[0])).sum::<u64>(), "admitted vs delivered");
    let none = rig.judged(&run, 0).total;
    assert_eq!(none.allowed_packets, run.sent(&f(&unmatched_allowed)), "id 0 allowed count");
    assert_eq!(none.denied_packets, run.sent(&f(&unmatched_denied)), "id 0 denied count");
    assert_eq!(none.unmatched, 0, "listed ICMP must not count as unmatched");
    // The CLI reports the same counters.
    let shown = rig.show("udp");
    assert_eq!(shown["counters"]["allowed_packets"], Value::from(t.allowed_packets), "{shown}");
    assert_eq!(shown["counters"]["denied_packets"], Value::from(t.denied_packets), "{shown}");
    run.check_capture();
}

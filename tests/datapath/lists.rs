//! The allow and deny lists: allowed sources are never refused, denied ones always dropped, the
//! longest prefix wins, for traffic a policy matches and traffic none does; every list decision
//! shows in `stats` and /metrics, also for traffic no policy matches.
//!
//! End to end through the real `limiter-ctl` (daemon and CLI) and the real XDP program on a veth
//! pair, on the shared [`limiter_tests::rig`], with policies as [`limiter_tests::policies`] sets
//! them and holds them to their bounds.

use std::{collections::BTreeMap, time::Duration};

use limiter_tests::{
    bounds::{check_bounds, check_overload},
    flood::{Flow, L4, Limits, Stream},
    observe::{fresh_stats, metrics, policy_stats, value},
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
        check_bounds(&format!("{:?}", group[0]), got, &pol.gcra(), &judged, run.window(), &run.report);
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

/// Every deny drop is visible, also where no policy matches: a deny-listed source sending to a
/// port no policy covers is dropped (none delivered), and `stats --json` (`denied`,
/// `no_policy.denied_packets`), the `stats` table (its "(no policy)" row and its "deny-listed"
/// total) and /metrics (`limiter_dropped_packets_total{reason="deny"}`) report exactly what was
/// sent, as the kernel counted it. A deny-listed source sending to a policy's port counts under
/// the policy too; an allow-listed one to no policy shows the same way (`allowed`).
#[test]
fn deny_drops_no_policy_matches_show_in_stats_and_metrics() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let pol = Pol::new("seven", "udp:7000", 100, 10);
    rig.set(&pol);
    rig.ctl_ok(&["deny", "add", "198.19.0.0/16"]);
    rig.ctl_ok(&["allow", "add", "198.18.7.0/24"]);
    let unmatched_denied = rig.stream(L4::Udp, 9999, "198.19.1.1");
    let matched_denied = rig.stream(L4::Udp, 7000, "198.19.1.2");
    let unmatched_allowed = rig.stream(L4::Udp, 9999, "198.18.7.1");
    let streams = [unmatched_denied.clone(), matched_denied.clone(), unmatched_allowed.clone()];
    let before = fresh_stats(&rig);
    let (_, samples) = metrics(&rig);
    let deny_before = value(&samples, "limiter_dropped_packets_total", &[("reason", "deny")]);
    let run = rig.counted_flood(&streams, Limits::timed(Duration::from_millis(300)));
    eprintln!("deny visibility: {}", run.report);
    let f = flow_of;
    let sent = |s: &Stream| run.sent(&f(s));
    let (nd, md, na) = (sent(&unmatched_denied), sent(&matched_denied), sent(&unmatched_allowed));
    assert!(nd > 0 && md > 0 && na > 0, "every stream sent something: {nd}, {md}, {na}");
    assert_eq!(run.delivered(&f(&unmatched_denied)), 0, "a denied source to no policy got through");
    assert_eq!(run.delivered(&f(&matched_denied)), 0, "a denied source to 'seven' got through");
    assert_eq!(run.delivered(&f(&unmatched_allowed)), na, "an allowed source to no policy was refused");
    let none = rig.judged(&run, 0).total;
    assert_eq!((none.denied_packets, none.allowed_packets), (nd, na), "the kernel's slot 0 (no policy)");
    assert_eq!(rig.judged(&run, rig.policy_id("seven")).total.denied_packets, md, "the kernel: 'seven' denied");

    let after = fresh_stats(&rig);
    let grew = |key: &str| after[key].as_u64().unwrap_or(0) - before[key].as_u64().unwrap_or(0);
    assert_eq!(grew("denied"), nd + md, "stats --json `denied` (every deny drop): {after}");
    assert_eq!(grew("allowed"), na, "stats --json `allowed`: {after}");
    let hits = |s: &Value, k: &str| s["no_policy"][k].as_u64().unwrap_or(0);
    assert_eq!(
        hits(&after, "denied_packets") - hits(&before, "denied_packets"),
        nd,
        "stats --json `no_policy.denied_packets`: {after}"
    );
    assert_eq!(hits(&after, "allowed_packets") - hits(&before, "allowed_packets"), na, "{after}");
    assert_eq!(policy_stats(&after, "seven")["totals"]["denied_packets"].as_u64(), Some(md), "{after}");

    let table = rig.ctl_ok(&["stats"]);
    let row: Vec<&str> = table
        .lines()
        .find(|l| l.trim_start().starts_with("(no policy)"))
        .unwrap_or_else(|| panic!("no '(no policy)' row in `stats`:\n{table}"))
        .split_whitespace()
        .collect();
    let (allowed, denied) = (hits(&after, "allowed_packets"), hits(&after, "denied_packets"));
    assert_eq!(row[row.len() - 2..], [allowed.to_string(), denied.to_string()], "the '(no policy)' row:\n{table}");
    let total = after["denied"].as_u64().unwrap_or(0);
    assert!(table.contains(&format!("{total} deny-listed")), "no '{total} deny-listed' in `stats`:\n{table}");

    let (_, samples) = metrics(&rig);
    let deny = value(&samples, "limiter_dropped_packets_total", &[("reason", "deny")]);
    assert_eq!(deny - deny_before, nd + md, "limiter_dropped_packets_total{{reason=\"deny\"}}");
    assert_eq!(deny, total, "/metrics and stats --json agree on deny drops");
    assert_eq!(
        value(&samples, "limiter_unjudged_packets_total", &[("reason", "allowed")]),
        after["allowed"].as_u64().unwrap_or(0)
    );
    let seven = value(&samples, "limiter_packets_total", &[("policy", "seven"), ("decision", "denied")]);
    assert_eq!(seven, md, "limiter_packets_total{{policy=\"seven\",decision=\"denied\"}}");
    run.check_capture();
}

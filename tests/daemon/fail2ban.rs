//! fail2ban feeding bans to the limiter through the action the package ships
//! (packaging/fail2ban/action.d/limiter.conf): Debian's fail2ban, started by the test without
//! systemd ([`limiter_tests::fail2ban`]), one jail over a log file the test writes, against the
//! real daemon and XDP program on a veth pair, checked on real traffic.

use std::{
    net::IpAddr,
    thread,
    time::{Duration, Instant},
};

use limiter_tests::{
    bans::Watch,
    daemon::limiter_ctl_binary,
    fail2ban::{Fail2ban, JAIL, Jail},
    require_root,
    rig::Rig,
};

/// A jail's failures get the source dropped at XDP within 2 s, and the ban lifts after its
/// bantime. Three sources send steadily: an IPv4 and an IPv6 one that fail2ban bans (the action
/// bans the one address, /32 or /128), and one it never bans, which must get through all along
/// (else a gap could be the sender's, not a ban). Measured: from writing the failure lines to
/// the last packet through, and from there to the first one back.
#[test]
fn failures_in_the_log_drop_the_source_at_xdp_until_the_bantime_is_over() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    const BANTIME: u64 = 4;
    let jail = Jail {
        limiter_ctl: limiter_ctl_binary().expect("the release limiter-ctl"),
        socket: rig.scratch.socket(),
        maxretry: 3,
        bantime: BANTIME as i64,
    };
    let f2b = Fail2ban::start(&jail).expect("starting fail2ban");
    let (v4, v6, bystander): (IpAddr, IpAddr, IpAddr) =
        ("198.18.0.9".parse().unwrap(), "2001:db8::9".parse().unwrap(), "198.18.0.10".parse().unwrap());
    let watch = Watch::start(&rig, &[v4, v6, bystander], Duration::from_secs(40)).expect("watching");
    thread::sleep(Duration::from_millis(500));
    // Two failures are below maxretry: no ban.
    f2b.fail(&v4.to_string(), 2).expect("writing failures");
    thread::sleep(Duration::from_millis(1500));
    let asked = Instant::now();
    f2b.fail(&v4.to_string(), 1).expect("writing failures");
    f2b.fail(&v6.to_string(), 3).expect("writing failures");
    f2b.wait_log(&format!("Ban {v4}"), Duration::from_secs(5)).expect("fail2ban bans the IPv4 source");
    f2b.wait_log(&format!("Ban {v6}"), Duration::from_secs(5)).expect("fail2ban bans the IPv6 source");
    // fail2ban logs the ban before its action has run: the list is read until it has both.
    let deadline = Instant::now() + Duration::from_secs(2);
    let listed = loop {
        let listed = rig.ctl_ok(&["deny", "list"]);
        if (listed.contains("198.18.0.9/32") && listed.contains("2001:db8::9/128")) || Instant::now() >= deadline {
            break listed;
        }
        thread::sleep(Duration::from_millis(20));
    };
    for net in ["198.18.0.9/32", "2001:db8::9/128"] {
        let line = listed.lines().find(|l| l.contains(net)).unwrap_or_else(|| panic!("{net} not listed:\n{listed}"));
        assert!(line.contains("fail2ban"), "{net} is not of origin fail2ban: {line}");
    }
    assert!(!listed.contains("198.18.0.10"), "the bystander was banned:\n{listed}");
    f2b.wait_log(&format!("Unban {v4}"), Duration::from_secs(BANTIME + 5)).expect("fail2ban unbans");
    f2b.wait_log(&format!("Unban {v6}"), Duration::from_secs(5)).expect("fail2ban unbans");
    // Long enough after the unban for the traffic to be seen back.
    thread::sleep(Duration::from_secs(1));
    let end = Instant::now();
    let watched = watch.finish().expect("the watch");
    watched.run.check_capture();
    let log = f2b.log();
    assert!(!log.contains("ERROR"), "an action failed:\n{log}");

    let start = asked - Duration::from_secs(2);
    let gap = watched.longest_gap(bystander, start, end);
    assert!(gap < Duration::from_millis(300), "the bystander went {gap:?} without a packet: the sender stalled");
    assert!(
        watched.delivered(v4, start, asked) > 100,
        "the IPv4 source was dropped before its third failure (two are below maxretry)"
    );
    for src in [v4, v6] {
        let seen = watched.ban(src, asked, Duration::from_millis(500)).unwrap_or_else(|| {
            panic!("{src}: its packets never stopped arriving\nfail2ban:\n{log}\ndaemon:\n{}", rig.daemon.output())
        });
        eprintln!("{src}: cut {:?} after its failures were written, back after {:?}", seen.cut, seen.back);
        assert!(seen.cut <= Duration::from_secs(2), "{src}: still got through {:?} after the failures", seen.cut);
        let back = seen.back.unwrap_or_else(|| panic!("{src}: not through again after the unban"));
        // Dark for the bantime (less the time fail2ban took to see the lines), back within 2 s
        // of its end (fail2ban checks its bans about once a second).
        assert!(
            back >= Duration::from_secs(BANTIME) - Duration::from_millis(200),
            "{src}: through again {back:?} after its failures, before the {BANTIME} s bantime"
        );
        assert!(back <= Duration::from_secs(BANTIME + 3), "{src}: still dropped {back:?} after its failures");
        let dark = watched.delivered(src, asked + seen.cut + Duration::from_millis(1), asked + back);
        assert_eq!(dark, 0);
    }
    let listed = rig.ctl_ok(&["deny", "list"]);
    assert!(!listed.contains("198.18.0.9") && !listed.contains("2001:db8::9"), "bans left after the unban:\n{listed}");
}

/// `bantime = -1` (permanent) bans without expiry: the entry goes to the daemon's config file as
/// a `deny add` without `--for` does, stays past any time, and `fail2ban-client unban` removes
/// it through the action's `deny rm`.
#[test]
fn a_permanent_ban_goes_to_the_config_file_until_unbanned() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let jail = Jail {
        limiter_ctl: limiter_ctl_binary().expect("the release limiter-ctl"),
        socket: rig.scratch.socket(),
        maxretry: 1,
        bantime: -1,
    };
    let f2b = Fail2ban::start(&jail).expect("starting fail2ban");
    f2b.fail("198.18.0.77", 1).expect("writing a failure");
    f2b.wait_log("Ban 198.18.0.77", Duration::from_secs(5)).expect("fail2ban bans");
    let deadline = Instant::now() + Duration::from_secs(5);
    let config = loop {
        let config = rig.scratch.config_file().expect("reading the config").unwrap_or_default();
        if config.contains("198.18.0.77/32") || Instant::now() >= deadline {
            break config;
        }
        thread::sleep(Duration::from_millis(50));
    };
    assert!(
        config.contains("198.18.0.77/32"),
        "the permanent ban is not in the config file:\n{config}\nfail2ban:\n{}",
        f2b.log()
    );
    assert_eq!(rig.snapshot().rules.acl().get("198.18.0.77/32"), Some(&"deny"), "the kernel's deny list");
    f2b.client(&["set", JAIL, "unbanip", "198.18.0.77"]).expect("unbanning");
    f2b.wait_log("Unban 198.18.0.77", Duration::from_secs(5)).expect("fail2ban unbans");
    let deadline = Instant::now() + Duration::from_secs(5);
    let config = loop {
        let config = rig.scratch.config_file().expect("reading the config").unwrap_or_default();
        if !config.contains("198.18.0.77") || Instant::now() >= deadline {
            break config;
        }
        thread::sleep(Duration::from_millis(50));
    };
    assert!(!config.contains("198.18.0.77"), "the unban left the entry in the config file:\n{config}");
    assert_eq!(rig.snapshot().rules.acl().get("198.18.0.77/32"), None, "the kernel's deny list after the unban");
    assert!(!f2b.log().contains("ERROR"), "the action failed:\n{}", f2b.log());
}

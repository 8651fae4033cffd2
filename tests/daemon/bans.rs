//! Bans: expiring allow and deny entries (`deny add CIDR --for D`, the socket's `ban-add`).
//! A ban drops its source at XDP from the moment the CLI returns and lets it through again
//! within a second of its expiry (real traffic on the veth pair); it survives a daemon restart
//! with the time it had left (and one that expired meanwhile is gone); bad input changes
//! nothing, exit 2; 100,000 bans go in and out in under 2 s each while another client's `stats`
//! is answered. (A million per family: ban_capacity.rs.)
//!
//! Through the real `limiter-ctl` (daemon and CLI) on the shared [`limiter_tests::rig`], the
//! daemon's state directory in the scratch directory (`--state-dir`).

use std::{
    thread,
    time::{Duration, Instant},
};

use limiter_tests::{
    ban_rig::{BanRig, addresses, args, ctl_with_input, deny_list, kernel_bans, raw_request, while_asking_stats},
    daemon::SIGNAL_TIMEOUT,
    flood::{L4, Limits},
    observe::fresh_stats,
    require_root,
    rig::Rig,
};

/// A test source the tests ban, and one beside it they never ban.
const BANNED: &str = "198.18.200.5";
const BYSTANDER: &str = "198.18.200.6";
const PORT: u16 = 4000;
/// Frames a second from each source while a test watches a ban (paced: every 2 ms).
const PER_SEC: f64 = 1000.0;

/// A ban with `--for 2s` drops its source's frames at XDP from when the CLI returns until its
/// deadline, and they pass again within 1 s of it; a source beside it passes throughout; the
/// entry leaves the kernel's map within 1 s of its expiry, and `stats` counts it added, then
/// expired.
#[test]
fn a_ban_drops_its_source_and_lifts_within_a_second_of_expiry() {
    require_root!();
    let rig = BanRig::start();
    let banned = rig.stream(L4::Udp, PORT, BANNED);
    let bystander = rig.stream(L4::Udp, PORT, BYSTANDER);
    let flooding = rig
        .start_flood(&[banned.clone(), bystander.clone()], Limits::timed(Duration::from_secs(8)), Some(2.0 * PER_SEC))
        .expect("starting the traffic");
    thread::sleep(Duration::from_millis(500));
    let asked = Instant::now();
    rig.ctl_ok(&["deny", "add", BANNED, "--for", "2s"]);
    let answered = Instant::now();
    let listed = deny_list(&rig);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!((listed[0]["cidr"].as_str(), listed[0]["origin"].as_str()), (Some("198.18.200.5/32"), Some("cli")));
    let left = listed[0]["expires_in_ms"].as_u64().expect("a time left");
    assert!((1000..=2000).contains(&left), "time left {left} ms of a 2 s ban");
    assert_eq!(kernel_bans(&rig, false), 1, "the ban in the kernel's map");
    // The entry leaves the map within 1 s of its expiry (at the latest, 2 s after the CLI was
    // answered).
    let expiry = answered + Duration::from_secs(2);
    let gone = loop {
        if kernel_bans(&rig, false) == 0 {
            break Instant::now();
        }
        assert!(
            Instant::now() < expiry + Duration::from_secs(3),
            "the ban is still in the kernel 3 s after its expiry"
        );
        thread::sleep(Duration::from_millis(20));
    };
    assert!(gone + Duration::from_millis(1) >= asked + Duration::from_secs(2), "removed before its expiry");
    assert!(gone <= expiry + Duration::from_secs(1), "removed {:?} after its expiry", gone - expiry);
    thread::sleep(Duration::from_millis(1500));
    flooding.stop();
    let run = flooding.finish().expect("the traffic");
    let (b, o) = (limiter_tests::rig::flow_of(&banned), limiter_tests::rig::flow_of(&bystander));
    let during = run.captured.between(|f| *f == b, answered, asked + Duration::from_secs(2));
    assert_eq!(during, 0, "frames of the banned source got through while the ban held");
    let first_after = run.captured.seen.iter().find(|s| s.flow == b && s.at >= asked + Duration::from_secs(2));
    let first_after = first_after.expect("the banned source's frames never passed again").at;
    assert!(
        first_after <= expiry + Duration::from_secs(1),
        "the banned source passed again {:?} after its expiry",
        first_after - expiry
    );
    let bystander_during = run.captured.between(|f| *f == o, answered, asked + Duration::from_secs(2));
    assert!(bystander_during as f64 > 0.5 * PER_SEC, "the bystander's frames during the ban: {bystander_during}");
    let s = fresh_stats(&rig);
    assert_eq!(s["bans"]["added"]["cli"], 1, "{s}");
    assert_eq!(s["bans"]["expired"]["cli"], 1, "{s}");
    assert_eq!(s["bans"]["active_v4"]["cli"], 0, "{s}");
    assert!(s["bans"]["dropped_packets"].as_u64().unwrap_or(0) > 0, "{s}");
    assert!(deny_list(&rig).is_empty(), "the expired ban is still listed");
}

/// An expiring entry is runtime state: the config file does not get it; the daemon saves it
/// in its state directory and a restarted daemon puts it back with the time it had left, while
/// one that expired during the restart is gone from the list and the kernel. Frames of the
/// source still banned are dropped after the restart.
#[test]
fn a_ban_survives_a_restart_with_its_time_left() {
    require_root!();
    let mut rig = BanRig::start();
    let state = rig.state.path().to_path_buf();
    rig.ctl_ok(&["deny", "add", BANNED, "--for", "60s", "--origin", "fail2ban"]);
    rig.ctl_ok(&["deny", "add", "2001:db8:77::5", "198.18.201.0/24", "--for", "1s", "--origin", "crowdsec"]);
    let file = rig.scratch.config_file().expect("reading the config file");
    assert!(!file.unwrap_or_default().contains("198.18.200.5"), "the ban was written to the config file");
    let before = deny_list(&rig);
    assert_eq!(before.len(), 3, "{before:?}");
    rig.daemon.stop_ok();
    let saved = std::fs::read_to_string(state.join(format!("bans-{}.json", rig.net.receiver.iface)))
        .expect("the bans saved in the state directory");
    assert!(saved.contains("198.18.200.5/32") && saved.contains("fail2ban"), "{saved}");
    thread::sleep(Duration::from_millis(1500));
    rig.restart(&args(&state)).expect("restarting");
    let after = deny_list(&rig);
    assert_eq!(after.len(), 1, "the 1 s bans should be gone after the restart: {after:?}");
    assert_eq!((after[0]["cidr"].as_str(), after[0]["origin"].as_str()), (Some("198.18.200.5/32"), Some("fail2ban")));
    let left = after[0]["expires_in_ms"].as_u64().expect("time left");
    let had = before.iter().find(|e| e["origin"] == "fail2ban").and_then(|e| e["expires_in_ms"].as_u64()).expect("had");
    assert!(left < had - 1000 && left > had - 30_000, "time left {left} ms after the restart; {had} ms before");
    assert_eq!(kernel_bans(&rig, false), 1, "IPv4 bans in the kernel after the restart");
    assert_eq!(kernel_bans(&rig, true), 0, "IPv6 bans in the kernel after the restart (expired meanwhile)");
    let banned = rig.stream(L4::Udp, PORT, BANNED);
    let run = rig
        .flood(std::slice::from_ref(&banned), Limits::counted(200, Duration::from_secs(2)), Some(PER_SEC))
        .expect("traffic");
    assert!(run.sent(&limiter_tests::rig::flow_of(&banned)) >= 200, "frames sent");
    assert_eq!(run.delivered(&limiter_tests::rig::flow_of(&banned)), 0, "the banned source's frames after the restart");
    // Removal by origin: another origin's removal leaves it; its own takes it out.
    rig.ctl_ok(&["deny", "rm", BANNED, "--origin", "crowdsec"]);
    assert_eq!(deny_list(&rig).len(), 1);
    rig.ctl_ok(&["deny", "rm", BANNED, "--origin", "fail2ban"]);
    assert!(deny_list(&rig).is_empty());
    assert_eq!(kernel_bans(&rig, false), 0);
    // An origin's removal never takes the operator's permanent entry of the same network
    // (fail2ban unbanning after its ban already expired); a plain `rm` does.
    let permanent = format!("{BANNED}/32");
    rig.ctl_ok(&["deny", "add", &permanent]);
    rig.ctl_ok(&["deny", "rm", BANNED, "--origin", "fail2ban"]);
    let kept = deny_list(&rig);
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0]["origin"].as_str(), Some("config"), "{kept:?}");
    rig.ctl_ok(&["deny", "rm", &permanent]);
    assert!(deny_list(&rig).is_empty());
    rig.daemon.interrupt(SIGNAL_TIMEOUT).expect("stopping");
}

/// Bad input (a malformed network, host bits, a zero, negative or unreadable duration, an
/// unknown origin, one bad line among good ones on standard input, a permanent entry or more
/// than 1,000 entries in one socket request) gets one line on stderr, exit 2, and changes
/// nothing: no entry listed, none in the kernel.
#[test]
fn bad_input_changes_nothing() {
    require_root!();
    let rig = BanRig::start();
    for args in [
        &["deny", "add", "198.18.0.5/33", "--for", "10s"][..],
        &["deny", "add", "198.18.0.5/24", "--for", "10s"],
        &["deny", "add", "010.1.1.1", "--for", "10s"],
        &["deny", "add", BANNED, "--for", "0"],
        &["deny", "add", BANNED, "--for", "0s"],
        &["deny", "add", BANNED, "--for", "-5s"],
        &["deny", "add", BANNED, "--for", "soon"],
        &["deny", "add", BANNED, "--for", "11000d"],
        &["deny", "add", BANNED, "--for", "10s", "--origin", "nginx"],
        &["deny", "add", BANNED, "--origin", "cli"],
        &["allow", "rm", BANNED],
    ] {
        let out = rig.daemon.ctl(args).expect("running limiter-ctl");
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        assert_eq!(out.stderr.trim().lines().count(), 1, "{args:?}: not one line: {:?}", out.stderr);
    }
    let lines = format!("{BANNED}\n198.18.200.7\n# a comment\n\n198.18.200.300\n198.18.200.8\n");
    let out = ctl_with_input(&rig, &["deny", "add", "--file", "-", "--for", "1m"], &lines);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("198.18.200.300"), "{out:?}");
    // Through the socket: a permanent entry is no ban, a batch of 1,001 is refused whole.
    for line in [
        r#"{"op":"ban-add","list":"deny","origin":"cli","entries":[{"cidr":"198.18.200.5/32","for_ms":null}]}"#
            .to_string(),
        r#"{"op":"ban-add","list":"deny","origin":"cli","entries":[{"cidr":"198.18.200.5/32","for_ms":0}]}"#
            .to_string(),
        format!(
            r#"{{"op":"ban-add","list":"deny","origin":"cli","entries":[{}]}}"#,
            (0..1001)
                .map(|i| format!(r#"{{"cidr":"198.18.{}.{}/32","for_ms":60000}}"#, i / 256, i % 256))
                .collect::<Vec<_>>()
                .join(",")
        ),
    ] {
        let answer = raw_request(&rig.scratch.socket(), &line);
        assert!(answer.contains(r#""status":"usage""#), "{answer}");
    }
    assert!(deny_list(&rig).is_empty(), "bad input left an entry");
    assert_eq!(kernel_bans(&rig, false), 0, "bad input left a ban in the kernel");
    // The same lines without the bad one go in whole.
    let good = lines.replace("198.18.200.300\n", "");
    let out = ctl_with_input(&rig, &["deny", "add", "--file", "-", "--for", "1m"], &good);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(kernel_bans(&rig, false), 3);
}

/// 100,000 bans from standard input reach the kernel in under 2 s, and as many removals take
/// them out in under 2 s, while another client's `stats` is answered all along.
#[test]
fn a_hundred_thousand_bans_go_in_and_out_in_under_two_seconds() {
    require_root!();
    let rig = BanRig::start();
    let list = addresses(100_000, false);
    let ((added, took), answers, longest) = while_asking_stats(&rig, || {
        let start = Instant::now();
        let out = ctl_with_input(&rig, &["deny", "add", "--file", "-", "--for", "10m", "--origin", "crowdsec"], &list);
        (out, start.elapsed())
    });
    assert_eq!(added.code, Some(0), "{added:?}");
    eprintln!("100,000 bans added in {took:?}; {answers} stats answers meanwhile, the longest wait {longest:?}");
    assert!(took < Duration::from_secs(2), "adding 100,000 bans took {took:?}");
    assert!(answers >= 5 && longest < Duration::from_millis(500), "{answers} stats answers, longest {longest:?}");
    assert_eq!(kernel_bans(&rig, false), 100_000);
    let s = fresh_stats(&rig);
    assert_eq!(s["bans"]["active_v4"]["crowdsec"], 100_000, "{s}");
    let ((removed, took), answers, longest) = while_asking_stats(&rig, || {
        let start = Instant::now();
        let out = ctl_with_input(&rig, &["deny", "rm", "--file", "-", "--origin", "crowdsec"], &list);
        (out, start.elapsed())
    });
    assert_eq!(removed.code, Some(0), "{removed:?}");
    eprintln!("100,000 bans removed in {took:?}; {answers} stats answers meanwhile, the longest wait {longest:?}");
    assert!(took < Duration::from_secs(2), "removing 100,000 bans took {took:?}");
    assert!(answers >= 5 && longest < Duration::from_millis(500), "{answers} stats answers, longest {longest:?}");
    assert_eq!(kernel_bans(&rig, false), 0);
}

/// A ban decides before the config file's lists: an allow ban lets one address of a denied
/// prefix through, a prefix ban (an LPM entry) drops its whole prefix, an IPv6 address ban drops
/// that address alone; removing the allow ban gives the address back to the config's deny.
#[test]
fn bans_decide_before_the_lists_for_prefixes_and_both_families() {
    require_root!();
    let rig = BanRig::start();
    rig.ctl_ok(&["deny", "add", "198.18.202.0/24"]);
    rig.ctl_ok(&["allow", "add", "198.18.202.7", "--for", "1m"]);
    rig.ctl_ok(&["deny", "add", "198.18.203.0/24", "2001:db8:77::9", "--for", "1m", "--origin", "crowdsec"]);
    let sources = ["198.18.202.7", "198.18.202.8", "198.18.203.9", "2001:db8:77::9", "2001:db8:77::10"];
    let delivered = |rig: &Rig| -> Vec<u64> {
        let streams: Vec<_> = sources.iter().map(|s| rig.stream(L4::Udp, PORT, s)).collect();
        let run =
            rig.flood(&streams, Limits::counted(1000, Duration::from_secs(3)), Some(2.0 * PER_SEC)).expect("traffic");
        streams.iter().map(|s| run.delivered(&limiter_tests::rig::flow_of(s))).collect()
    };
    let got = delivered(&rig);
    assert!(got[0] >= 190, "the allow ban inside a denied prefix: {got:?}");
    assert_eq!(got[1..4], [0, 0, 0], "the config's deny, the prefix ban, the IPv6 ban: {got:?}");
    assert!(got[4] >= 190, "the IPv6 neighbour of the banned address: {got:?}");
    rig.ctl_ok(&["allow", "rm", "198.18.202.7"]);
    let got = delivered(&rig);
    assert_eq!(got[0], 0, "without its allow ban the address is the config's deny's again: {got:?}");
    let s = fresh_stats(&rig);
    assert_eq!(
        (s["bans"]["active_v4"]["crowdsec"].as_u64(), s["bans"]["active_v6"]["crowdsec"].as_u64()),
        (Some(1), Some(1)),
        "{s}"
    );
}

//! What a ban may be, whoever asks (the CLI, fail2ban's origin, the CrowdSec bouncer's, a tool
//! on the socket): no ban covers an address the config file allows, none is broader than IPv4
//! /8 or IPv6 /32, and the refused entries of a batch are named, counted and logged once per
//! origin while the rest apply (and said by the CrowdSec bouncer, for its feed); the config
//! file itself may still deny what it allows. An IPv4-mapped network bans its IPv4 source;
//! durations are read exactly or refused; a saved file is judged like live input; `deny rm`
//! names the origin that holds a ban.
//!
//! Through the real `limiter-ctl` (daemon and CLI) on the shared rig, real traffic on the veth
//! pair, the daemon's state directory in the test's own ([`BanRig`]).

use std::time::Duration;

use limiter_tests::{
    ban_rig::{BanRig, deny_list, kernel_bans, kernel_v4_nets, probes, raw_request},
    crowdsec::{Answer, StandIn, decision, stand_in_key, start_bouncer},
    observe::fresh_stats,
    require_root,
    rig::Rig,
};
use serde_json::Value;

const PORT: u16 = 4100;

fn listed(rig: &Rig) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = deny_list(rig)
        .iter()
        .map(|e| (e["cidr"].as_str().unwrap_or("").to_string(), e["origin"].as_str().unwrap_or("").to_string()))
        .collect();
    out.sort();
    out
}

fn ban_add(rig: &Rig, origin: &str, cidrs: &[&str]) -> Value {
    let entries: Vec<String> = cidrs.iter().map(|c| format!(r#"{{"cidr":"{c}","for_ms":3600000}}"#)).collect();
    let line = format!(r#"{{"op":"ban-add","list":"deny","origin":"{origin}","entries":[{}]}}"#, entries.join(","));
    let answer = raw_request(&rig.scratch.socket(), &line);
    serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"))
}

/// A feed's full set holding `0.0.0.0/0`, `::/0`, a range over the allow-listed address and
/// the address itself: each refused with its reason, the one acceptable ban applied; probes
/// from the allow-listed sources all arrive, the banned one's none. The CLI's `--origin
/// crowdsec` is refused the same way (exit 2, one line); a batch with one refused entry applies
/// the rest (exit 3). Refusals are counted by origin in `stats`, logged in one WARN line per
/// origin. The operator's config file may deny the allow-listed address; an allow entry added
/// later lifts the bans it covers.
#[test]
fn no_ban_covers_the_allow_list_or_everyone() {
    require_root!();
    let mut rig = BanRig::start();
    rig.ctl_ok(&["allow", "add", "198.18.200.2/32", "2001:db8::2/128"]);
    let answer = ban_add(
        &rig,
        "crowdsec",
        &[
            "0.0.0.0/0",
            "::/0",
            "198.18.200.0/24",
            "198.18.200.2/32",
            "198.18.200.7/32",
            "2001:d00::/31",
            "2001:db8::/64",
        ],
    );
    assert_eq!(answer["status"], "ok", "{answer}");
    assert_eq!(answer["data"]["added"], 1, "{answer}");
    let refused: Vec<(&str, &str)> = answer["data"]["refused"]
        .as_array()
        .expect("refused entries")
        .iter()
        .map(|r| (r["cidr"].as_str().unwrap_or(""), r["reason"].as_str().unwrap_or("")))
        .collect();
    let cidrs: Vec<&str> = refused.iter().map(|r| r.0).collect();
    assert_eq!(cidrs, ["0.0.0.0/0", "::/0", "198.18.200.0/24", "198.18.200.2/32", "2001:d00::/31", "2001:db8::/64"]);
    assert!(refused[0].1.contains("broader"), "{refused:?}");
    assert!(refused[2].1.contains("198.18.200.2/32") && refused[2].1.contains("allow list"), "{refused:?}");
    assert_eq!(listed(&rig), [("198.18.200.7/32".to_string(), "crowdsec".to_string())]);
    assert_eq!(kernel_v4_nets(&rig), ["198.18.200.7/32"]);
    assert_eq!(probes(&rig, "198.18.200.2", PORT, 20), 20, "the allow-listed IPv4 source");
    assert_eq!(probes(&rig, "2001:db8::2", PORT, 20), 20, "the allow-listed IPv6 source");
    assert_eq!(probes(&rig, "198.18.200.7", PORT, 20), 0, "the banned source");
    // The CLI, any origin: refused alone (exit 2, one line), the rest of a batch applied (exit 3).
    let out = rig.daemon.ctl(&["deny", "add", "198.18.200.2", "--for", "10m", "--origin", "crowdsec"]).expect("ctl");
    assert_eq!(out.code, Some(2), "{out:?}");
    assert_eq!(out.stderr_lines().len(), 1, "{out:?}");
    assert!(out.stderr.starts_with("refused: 198.18.200.2/32: it covers 198.18.200.2/32"), "{out:?}");
    let out = rig.daemon.ctl(&["deny", "add", "198.18.200.2", "198.18.200.8", "--for", "10m"]).expect("ctl");
    assert_eq!(out.code, Some(3), "{out:?}");
    assert_eq!(out.stderr_lines().len(), 1, "{out:?}");
    assert!(listed(&rig).contains(&("198.18.200.8/32".to_string(), "cli".to_string())));
    let out = rig.daemon.ctl(&["deny", "add", "0.0.0.0/0", "--for", "10m", "--origin", "fail2ban"]).expect("ctl");
    assert_eq!(out.code, Some(2), "{out:?}");
    let s = fresh_stats(&rig);
    assert_eq!(s["bans"]["refused"]["crowdsec"], 7, "{s}");
    assert_eq!(s["bans"]["refused"]["cli"], 1, "{s}");
    assert_eq!(s["bans"]["refused"]["fail2ban"], 1, "{s}");
    // One WARN per origin, not one per entry or per batch.
    ban_add(&rig, "crowdsec", &["0.0.0.0/0"]);
    std::thread::sleep(Duration::from_millis(300));
    rig.daemon.poll();
    let warned = |origin: &str| {
        rig.daemon
            .output()
            .lines()
            .filter(|l| l.contains("bans refused") && l.contains(&format!("origin={origin}")))
            .count()
    };
    assert_eq!((warned("crowdsec"), warned("cli"), warned("fail2ban")), (1, 1, 1), "{}", rig.daemon.output());
    // The operator's config file denies what it allows, on purpose.
    rig.ctl_ok(&["deny", "add", "198.18.200.0/24"]);
    assert_eq!(probes(&rig, "198.18.200.2", PORT, 20), 20, "allow-listed: the longer allow entry decides");
    // An allow entry added later lifts the deny bans it covers.
    rig.ctl_ok(&["deny", "add", "198.18.201.9", "--for", "10m", "--origin", "fail2ban"]);
    rig.ctl_ok(&["allow", "add", "198.18.201.0/24"]);
    assert!(!listed(&rig).iter().any(|(c, _)| c == "198.18.201.9/32"), "{:?}", listed(&rig));
    assert_eq!(fresh_stats(&rig)["bans"]["refused"]["fail2ban"], 2);
    assert_eq!(probes(&rig, "198.18.201.9", PORT, 20), 20);
    rig.daemon.stop_ok();
    // Restarted with a saved ban the allow list covers: refused at restore as well.
    rig.restart_kept();
    assert!(!listed(&rig).iter().any(|(c, _)| c == "198.18.200.2/32"));
}

/// A feed reaching for everyone or the allow list is said where the feed's operator looks: the
/// CrowdSec bouncer (the release binary, against a stand-in LAPI) is given `0.0.0.0/0`, the
/// allow-listed address and an acceptable ban in one full set. The daemon applies the one and
/// counts the two; the bouncer logs one WARN line naming how many its rules left out and the
/// first with its reason, and says the batch applied.
#[test]
fn the_bouncer_says_which_bans_the_rules_left_out() {
    require_root!();
    let rig = BanRig::start();
    rig.ctl_ok(&["allow", "add", "198.18.200.2/32"]);
    let lapi = StandIn::start(
        vec![Answer::stream(
            &[
                decision(1, "Range", "0.0.0.0/0", r#""1h""#),
                decision(2, "Ip", "198.18.200.2", r#""1h""#),
                decision(3, "Ip", "198.18.200.7", r#""1h""#),
            ],
            &[],
        )],
        vec![Answer::stream(&[], &[])],
    )
    .expect("the stand-in LAPI");
    let (_dir, key_file) = stand_in_key().expect("the stand-in's key");
    let mut bouncer = start_bouncer(&rig.scratch.socket(), &lapi.url(), &key_file).expect("the bouncer");
    let since = std::time::Instant::now() - Duration::from_secs(60);
    let (_, said) = bouncer
        .wait_line(since, |l| l.contains("left out"), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert!(said.contains("WARN"), "{said}");
    assert!(said.contains("left out 2 ban(s)") && said.contains("left_out=2") && said.contains("of=3"), "{said}");
    assert!(said.contains("0.0.0.0/0") && said.contains("broader"), "the first, with its reason: {said}");
    bouncer
        .wait_line(since, |l| l.contains("bans applied"), Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(listed(&rig), [("198.18.200.7/32".to_string(), "crowdsec".to_string())]);
    assert_eq!(fresh_stats(&rig)["bans"]["refused"]["crowdsec"], 2);
    let lines = bouncer.output();
    assert_eq!(lines.lines().filter(|l| l.contains("left out")).count(), 1, "said once per batch:\n{lines}");
}

/// An IPv4-mapped address or range given to `deny add` or the socket bans its IPv4 source:
/// listed as IPv4, in the IPv4 maps, and the source's IPv4 packets are dropped.
#[test]
fn mapped_addresses_ban_their_ipv4_source() {
    require_root!();
    let rig = BanRig::start();
    rig.ctl_ok(&["deny", "add", "::ffff:198.18.200.3", "--for", "10m"]);
    let answer = ban_add(&rig, "crowdsec", &["::ffff:198.18.202.0/120"]);
    assert_eq!(answer["data"]["added"], 1, "{answer}");
    assert_eq!(
        listed(&rig),
        [("198.18.200.3/32".to_string(), "cli".to_string()), ("198.18.202.0/24".to_string(), "crowdsec".to_string())]
    );
    assert_eq!(kernel_v4_nets(&rig), ["198.18.200.3/32", "198.18.202.0/24"]);
    assert_eq!(kernel_bans(&rig, true), 0, "no IPv6 entry");
    assert_eq!(probes(&rig, "198.18.200.3", PORT, 20), 0);
    assert_eq!(probes(&rig, "198.18.202.77", PORT, 20), 0);
    assert_eq!(probes(&rig, "198.18.200.4", PORT, 20), 20, "a source beside it");
    rig.ctl_ok(&["deny", "rm", "::ffff:198.18.200.3"]);
    assert_eq!(probes(&rig, "198.18.200.3", PORT, 20), 20, "removed by its mapped form too");
}

/// `--for` is read exactly: a long fraction of an hour is (almost) an hour, never wrapped into
/// minutes; zero, negative, huge and unreadable durations are refused (exit 2, one line).
#[test]
fn durations_are_exact_or_refused() {
    require_root!();
    let rig = BanRig::start();
    rig.ctl_ok(&["deny", "add", "198.18.200.5", "--for", "0.99999999999999999999999999h"]);
    rig.ctl_ok(&["deny", "add", "198.18.200.6", "--for", "1.333h"]);
    let left = |cidr: &str| {
        deny_list(&rig).iter().find(|e| e["cidr"] == cidr).and_then(|e| e["expires_in_ms"].as_u64()).expect(cidr)
    };
    let a = left("198.18.200.5/32");
    assert!((3_590_000..=3_600_000).contains(&a), "{a} ms left of 0.999...h");
    let b = left("198.18.200.6/32");
    assert!((4_798_800 - 10_000..=4_798_800).contains(&b), "{b} ms left of 1.333h");
    for bad in ["0", "0.0s", "-1s", "-0.5h", "99999999999999999999999999999y", "1e3s", "3651d", "1h-5m", ".5h"] {
        let out = rig.daemon.ctl(&["deny", "add", "198.18.200.7", "--for", bad]).expect("ctl");
        assert_eq!(out.code, Some(2), "--for {bad}: {out:?}");
        assert_eq!(out.stderr_lines().len(), 1, "--for {bad}: {out:?}");
    }
    assert_eq!(deny_list(&rig).len(), 2);
}

/// A saved file is judged like live input at restore: an expiry of u64::MAX (longer than 10
/// years), `0.0.0.0/0`, an entry with host bits and one over the allow list are refused, said
/// in one WARN line with the counts; the valid entry is restored; none of the others reach the
/// kernel.
#[test]
fn a_saved_file_is_judged_like_live_input() {
    require_root!();
    let mut rig = BanRig::start();
    rig.ctl_ok(&["allow", "add", "198.18.200.2/32"]);
    rig.daemon.stop_ok();
    let in_a_minute = limiter_tests::observe::now_ms() + 60_000;
    let file = format!(
        r#"{{"version":1,"bans":[
            ["deny","fail2ban","198.18.200.5/32",{in_a_minute}],
            ["deny","crowdsec","198.18.200.6/32",18446744073709551615],
            ["deny","crowdsec","0.0.0.0/0",{in_a_minute}],
            ["deny","crowdsec","198.18.201.7/24",{in_a_minute}],
            ["deny","cli","198.18.200.2/32",{in_a_minute}]]}}"#
    );
    std::fs::write(rig.bans_file(), file).expect("writing the bans file");
    rig.restart_kept();
    rig.daemon.poll();
    assert_eq!(listed(&rig), [("198.18.200.5/32".to_string(), "fail2ban".to_string())]);
    assert_eq!(kernel_v4_nets(&rig), ["198.18.200.5/32"]);
    let out = rig.daemon.output();
    let warns: Vec<&str> = out.lines().filter(|l| l.contains("saved bans refused")).collect();
    assert_eq!(warns.len(), 1, "{out}");
    for part in ["refused=4", "longer than 10 years", "host bits", "broader", "allow list"] {
        assert!(warns[0].contains(part), "{part}: {}", warns[0]);
    }
    assert!(out.contains("restored=1"), "{out}");
}

/// `deny rm ADDR` without --origin, when only another origin's ban holds ADDR: exit 2, one
/// line naming that origin and the command that removes it; nothing removed.
#[test]
fn rm_names_the_origin_that_holds_a_ban() {
    require_root!();
    let rig = BanRig::start();
    rig.ctl_ok(&["deny", "add", "198.18.200.9", "--for", "10m", "--origin", "crowdsec"]);
    let out = rig.daemon.ctl(&["deny", "rm", "198.18.200.9"]).expect("ctl");
    assert_eq!(out.code, Some(2), "{out:?}");
    assert_eq!(out.stderr_lines().len(), 1, "{out:?}");
    assert!(out.stderr.contains("origin crowdsec"), "{out:?}");
    assert!(out.stderr.contains("limiter-ctl deny rm 198.18.200.9/32 --origin crowdsec"), "{out:?}");
    assert_eq!(listed(&rig).len(), 1);
    let out = rig.daemon.ctl(&["deny", "rm", "198.18.200.10"]).expect("ctl");
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("is not on the deny list"), "{out:?}");
    rig.ctl_ok(&["deny", "rm", "198.18.200.9", "--origin", "crowdsec"]);
    assert!(listed(&rig).is_empty());
}

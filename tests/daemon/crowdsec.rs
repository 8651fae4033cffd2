//! CrowdSec feeding bans to the limiter through `limiter-ctl crowdsec`, the bouncer: Debian's
//! crowdsec local API (LAPI), started by the test with a config of its own
//! ([`limiter_tests::crowdsec`]), decisions made with `cscli`, the bouncer run as the real
//! binary, against the real daemon and XDP program on a veth pair, checked on real traffic. What
//! a real LAPI never sends (garbage, unreadable decisions, answers of hundreds of MiB) comes
//! from a stand-in ([`limiter_tests::crowdsec::StandIn`]); a daemon whose ban list fails, from a
//! stand-in daemon socket.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::IpAddr,
    os::unix::net::UnixListener,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use limiter_tests::{
    bans::Watch,
    crowdsec::{self, Answer, Lapi, StandIn, decision},
    daemon::limiter_ctl_binary,
    require_root,
    rig::Rig,
    service::Service,
};

/// The bouncer, as an operator runs it, against the rig's daemon.
fn start_bouncer(rig: &Rig, lapi_url: &str, key_file: &Path) -> Service {
    crowdsec::start_bouncer(&rig.scratch.socket(), lapi_url, key_file).expect("starting the bouncer")
}

/// A bouncer registered with Debian's LAPI (`cscli bouncers add`), its key file, and the bouncer
/// started against it, its first poll done.
fn bouncer_of(rig: &Rig, lapi: &Lapi) -> (PathBuf, Service) {
    let key = lapi.add_bouncer("limiter-test").expect("adding the bouncer");
    let key_file = lapi.dir().join("bouncer.key");
    std::fs::write(&key_file, format!("{key}\n")).expect("writing the key");
    let mut bouncer = start_bouncer(rig, &lapi.url(), &key_file);
    bouncer
        .wait_line(Instant::now() - Duration::from_secs(60), |l| l.contains("decisions read"), Duration::from_secs(10))
        .expect("the bouncer's first poll");
    (key_file, bouncer)
}

fn stand_in_key() -> (tempfile::TempDir, PathBuf) {
    crowdsec::stand_in_key().expect("the stand-in's key file")
}

/// `cscli ARGS...`: when it was started (the decision is made at some point of its run, so
/// times measured from here include cscli's own), and how long it took.
fn decide(lapi: &Lapi, args: &[&str]) -> (Instant, Duration) {
    let started = Instant::now();
    lapi.cscli(args).unwrap_or_else(|e| panic!("{e:#}"));
    (started, started.elapsed())
}

/// The deny list's lines that name `net` (`deny list`).
fn listed(rig: &Rig, net: &str) -> Vec<String> {
    rig.ctl_ok(&["deny", "list"]).lines().filter(|l| l.split_whitespace().any(|w| w == net)).map(String::from).collect()
}

/// Waits up to `timeout` for `net` to be listed (or not) in the deny list.
fn wait_listed(rig: &Rig, net: &str, want: bool, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if listed(rig, net).is_empty() != want {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// The whole life of a bouncer against a real LAPI, on real traffic from five sources (four
/// the test bans, one never banned, which must get through all along):
/// - `cscli decisions add --ip A --duration 5s`: A is dropped within 2 s, and gets through
///   again once the 5 s are over (within 2 s of it);
/// - a 1 h ban on B, then `cscli decisions delete --ip B`: dropped within 2 s, back within 2 s
///   of the delete;
/// - a 1 h ban on C (IPv6), then the LAPI stopped for 5 s: C stays dropped all along (fail
///   static), the bouncer logs that it cannot reach the LAPI and retries; the LAPI back, a ban
///   on D is in force within the backoff's wait (at most 4 s here) and 2 s;
/// - the bouncer restarted: the full set again, applied idempotently (C still listed once,
///   of origin crowdsec), and E, whose decision was deleted while no bouncer ran, lifted.
#[test]
fn decisions_are_in_force_within_2s_until_they_end_and_survive_a_lapi_outage() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let mut lapi = Lapi::start().expect("starting the crowdsec LAPI");
    let (key_file, mut bouncer) = bouncer_of(&rig, &lapi);
    let [a, b, c, d, bystander]: [IpAddr; 5] =
        ["198.18.1.1", "198.18.1.2", "2001:db8::c", "198.18.1.4", "198.18.1.5"].map(|s| s.parse().unwrap());
    let watch = Watch::start(&rig, &[a, b, c, d, bystander], Duration::from_secs(60)).expect("watching");
    thread::sleep(Duration::from_millis(500));

    let (asked_a, took_a) = decide(&lapi, &["decisions", "add", "--ip", "198.18.1.1", "--duration", "5s"]);
    let (asked_b, _) = decide(&lapi, &["decisions", "add", "--ip", "198.18.1.2", "--duration", "1h"]);
    let (asked_c, _) = decide(&lapi, &["decisions", "add", "--ip", "2001:db8::c", "--duration", "1h"]);
    assert!(wait_listed(&rig, "198.18.1.2/32", true, Duration::from_secs(3)), "B never listed");
    let line = listed(&rig, "198.18.1.2/32").join("\n");
    assert!(line.contains("crowdsec"), "B is not of origin crowdsec: {line}");
    let (deleted_b, _) = decide(&lapi, &["decisions", "delete", "--ip", "198.18.1.2"]);
    assert!(wait_listed(&rig, "198.18.1.2/32", false, Duration::from_secs(3)), "B still listed after its delete");
    // A's 5 s run out meanwhile (the bouncer does nothing: the daemon expires it).
    assert!(wait_listed(&rig, "198.18.1.1/32", false, Duration::from_secs(8)), "A still listed after its 5 s");
    thread::sleep(Duration::from_millis(500));

    // The LAPI goes away for 5 s: C stays banned.
    lapi.stop();
    let stopped = Instant::now();
    bouncer
        .wait_line(stopped, |l| l.contains("cannot be reached") && l.contains("kept"), Duration::from_secs(5))
        .expect("the bouncer says the LAPI is unreachable");
    thread::sleep(Duration::from_secs(5));
    let failures = bouncer.lines_since(stopped).iter().filter(|l| l.contains("cannot be reached")).count();
    assert!(
        (2..=5).contains(&failures),
        "{failures} failed polls in 5 s: not a backoff of 1 s doubling\n{}",
        bouncer.output()
    );
    lapi.resume().expect("restarting the LAPI");
    let resumed = Instant::now();
    let (asked_d, _) = decide(&lapi, &["decisions", "add", "--ip", "198.18.1.4", "--duration", "1h"]);
    assert!(wait_listed(&rig, "198.18.1.4/32", true, Duration::from_secs(8)), "D never listed after the outage");
    let back_after = bouncer
        .wait_line(resumed, |l| l.contains("answers again"), Duration::from_secs(1))
        .map(|(at, _)| at.duration_since(resumed));
    thread::sleep(Duration::from_millis(500));
    let end = Instant::now();
    let watched = watch.finish().expect("the watch");
    watched.run.check_capture();

    let gap = watched.longest_gap(bystander, asked_a - Duration::from_millis(500), end);
    assert!(gap < Duration::from_millis(300), "the bystander went {gap:?} without a packet: the sender stalled");
    let dark = Duration::from_millis(500);
    let output = || format!("bouncer:\n{}\ndaemon:\n{}", bouncer.output(), rig.daemon.output());
    let seen_a = watched.ban(a, asked_a, dark).unwrap_or_else(|| panic!("A was never dropped\n{}", output()));
    let seen_b = watched.ban(b, asked_b, dark).unwrap_or_else(|| panic!("B was never dropped\n{}", output()));
    let seen_c = watched.ban(c, asked_c, dark).unwrap_or_else(|| panic!("C was never dropped\n{}", output()));
    let seen_d = watched.ban(d, asked_d, dark).unwrap_or_else(|| panic!("D was never dropped\n{}", output()));
    eprintln!(
        "cut after: A {:?}, B {:?}, C {:?}, D {:?} (the LAPI back {back_after:?}); A back after {:?} (5 s ban; cscli took {took_a:?}), \
         B back {:?} after its delete",
        seen_a.cut,
        seen_b.cut,
        seen_c.cut,
        seen_d.cut,
        seen_a.back,
        seen_b.back.map(|t| (asked_b + t).saturating_duration_since(deleted_b)),
    );
    for (name, seen) in [("A", seen_a), ("B", seen_b), ("C", seen_c)] {
        assert!(seen.cut <= Duration::from_secs(2), "{name}: still got through {:?} after its decision", seen.cut);
    }
    // The decision runs for 5 s from when cscli made it (within its run, `took_a`), the LAPI
    // counting from that second (it keeps times to the second: a decision made at 14.77 ends at
    // 19.00; the bouncer follows the LAPI's durations), so it ends between 4 and 5 s + `took_a`
    // after cscli started; the daemon lifts an entry within 1 s of its end.
    let a_back = seen_a.back.expect("A not through again after its 5 s");
    assert!(
        a_back >= Duration::from_millis(3980) && a_back <= took_a + Duration::from_secs(7),
        "A: through again {a_back:?} after cscli was started (it took {took_a:?}) for a 5 s decision"
    );
    let b_back =
        (asked_b + seen_b.back.expect("B not through again after its delete")).saturating_duration_since(deleted_b);
    assert!(b_back <= Duration::from_secs(2), "B: still dropped {b_back:?} after its delete");
    assert!(seen_c.back.is_none(), "C got through again (the LAPI outage lifted its ban?)");
    assert_eq!(watched.delivered(c, asked_c + seen_c.cut + Duration::from_millis(1), end), 0, "C through the outage");
    // The LAPI back: its next poll comes after the backoff's wait (1, 2, 4 s... capped at 30 s).
    assert!(seen_d.cut <= Duration::from_secs(6), "D: still got through {:?} after its decision", seen_d.cut);

    // A restarted bouncer reads the full set again: C stays, listed once, of origin crowdsec;
    // E, whose decision was deleted while no bouncer ran, is lifted.
    decide(&lapi, &["decisions", "add", "--ip", "198.18.1.6", "--duration", "1h"]);
    assert!(wait_listed(&rig, "198.18.1.6/32", true, Duration::from_secs(3)), "E never listed");
    bouncer.stop();
    decide(&lapi, &["decisions", "delete", "--ip", "198.18.1.6"]);
    let mut again = start_bouncer(&rig, &lapi.url(), &key_file);
    again
        .wait_line(Instant::now() - Duration::from_secs(60), |l| l.contains("decisions read"), Duration::from_secs(10))
        .expect("the restarted bouncer's first poll");
    thread::sleep(Duration::from_millis(500));
    assert!(
        wait_listed(&rig, "198.18.1.6/32", false, Duration::from_secs(3)),
        "E, deleted while no bouncer ran, still listed after the restart:\n{}",
        again.output()
    );
    let lines = listed(&rig, "2001:db8::c/128");
    assert_eq!(lines.len(), 1, "C after the restart: {lines:?}");
    assert!(lines[0].contains("crowdsec"), "{lines:?}");
    assert!(!again.output().contains("ERROR"), "the restarted bouncer logged an error:\n{}", again.output());
}

/// A LAPI answering garbage changes nothing: the stand-in LAPI (a real LAPI never sends
/// garbage) answers the first poll with a ban, then garbage of every kind. The ban stays in
/// force, each garbage answer costs one error line, the bouncer keeps polling, and asks for the
/// full set again after each.
#[test]
fn a_garbage_stream_logs_one_line_and_changes_nothing() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let garbage = |body: &[u8]| Answer::Body(body.to_vec());
    // After the first full set, a change (garbage), then the full set again after each failure.
    let lapi = StandIn::start(
        vec![
            Answer::stream(&[decision(7, "Ip", "198.18.2.7", r#""59m0s""#)], &[]),
            garbage(b"{}"),
            garbage(br#"{"new":[{"value":"x"}"#),
            Answer::Status(500),
            garbage(b"\xff\xfe\x00garbage\x01\x02\x03\x04\x05"),
            Answer::Raw(b"garbage that is not even HTTP\r\n\r\n".to_vec()),
        ],
        vec![garbage(b"not json!!\n")],
    )
    .expect("the stand-in LAPI");
    let (_dir, key_file) = stand_in_key();
    let mut bouncer = start_bouncer(&rig, &lapi.url(), &key_file);
    assert!(wait_listed(&rig, "198.18.2.7/32", true, Duration::from_secs(5)), "the first answer's ban never listed");
    let started = Instant::now();
    // Six garbage answers, with backoff: 1 + 2 + 4 + 8 s... take the first four.
    let deadline = started + Duration::from_secs(20);
    while bouncer.lines_since(started).iter().filter(|l| l.contains("ERROR")).count() < 4 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    let errors: Vec<String> = bouncer.lines_since(started).into_iter().filter(|l| l.contains("ERROR")).collect();
    assert!(errors.len() >= 4, "fewer than 4 error lines for the garbage answers:\n{}", bouncer.output());
    for e in &errors {
        assert!(e.contains("kept"), "an error line that does not say the bans are kept: {e}");
    }
    assert!(bouncer.exited().is_none(), "the bouncer stopped on garbage:\n{}", bouncer.output());
    let lines = listed(&rig, "198.18.2.7/32");
    assert_eq!(lines.len(), 1, "the ban after the garbage: {lines:?}");
    let full_sets = lapi.polls().iter().filter(|full| **full).count();
    assert!(full_sets >= 3, "the bouncer did not ask for the full set again after garbage: {:?}", lapi.polls());
    let all = rig.ctl_ok(&["deny", "list"]);
    assert_eq!(all.lines().filter(|l| l.contains("198.18.")).count(), 1, "garbage added entries:\n{all}");
}

/// Unreadable decisions change nothing. The stand-in LAPI bans A and B, then (after a failed
/// poll, so the full set is asked for) answers the review's full set: the same bans with their
/// `duration` a number (3600), not a Go duration. That set is refused whole, one ERROR line each
/// time it is asked for, and nothing is lifted: A and B stay listed and dropped on real traffic,
/// the bystander gets through. Then a change whose deleted decision for A is unreadable (its
/// value a number) beside a readable new ban on C: C is applied, A is not lifted, the change
/// costs one ERROR line, and the full set is asked for next.
#[test]
fn unreadable_decisions_lift_no_ban() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let [a, b, c, bystander]: [IpAddr; 4] =
        ["198.18.3.1", "2001:db8::3:2", "198.18.3.3", "198.18.3.9"].map(|s| s.parse().unwrap());
    let ab = |duration: &str| [decision(1, "Ip", "198.18.3.1", duration), decision(2, "Ip", "2001:db8::3:2", duration)];
    let nothing = Answer::stream(&[], &[]);
    let lapi = StandIn::start(vec![Answer::stream(&ab(r#""1h""#), &[])], vec![nothing.clone()]).expect("stand-in");
    let (_dir, key_file) = stand_in_key();
    let mut bouncer = start_bouncer(&rig, &lapi.url(), &key_file);
    for net in ["198.18.3.1/32", "2001:db8::3:2/128"] {
        assert!(wait_listed(&rig, net, true, Duration::from_secs(5)), "{net} never listed:\n{}", bouncer.output());
    }
    let watch = Watch::start(&rig, &[a, b, c, bystander], Duration::from_secs(40)).expect("watching");
    thread::sleep(Duration::from_millis(500));

    let started = Instant::now();
    lapi.play(vec![Answer::stream(&ab("3600"), &[])], vec![Answer::Status(503)]);
    let refusals = |bouncer: &Service| {
        bouncer.lines_since(started).into_iter().filter(|l| l.contains("unreadable decisions")).collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(12);
    while refusals(&bouncer).len() < 2 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    let refused = refusals(&bouncer);
    assert!(refused.len() >= 2, "the unreadable full set was not refused twice:\n{}", bouncer.output());
    for line in &refused {
        assert!(line.contains("ERROR") && line.contains("none of it is applied") && line.contains("kept"), "{line}");
        assert!(line.contains("new[0]: its duration is not text"), "the line does not say what is unreadable: {line}");
    }
    let sent: Vec<String> =
        bouncer.lines_since(started).into_iter().filter(|l| l.contains("bans applied added")).collect();
    assert_eq!(sent, Vec::<String>::new(), "the unreadable set changed the daemon's bans:\n{}", bouncer.output());
    for net in ["198.18.3.1/32", "2001:db8::3:2/128"] {
        assert_eq!(listed(&rig, net).len(), 1, "{net} lifted by the unreadable set:\n{}", bouncer.output());
    }

    // A change with an unreadable deletion of A, and C; the full set after it has C too.
    let polled = lapi.polls().len();
    let unreadable_delete = r#"{"duration":"-1s","id":1,"scope":"Ip","type":"ban","value":3232236289}"#.to_string();
    let mut abc = ab(r#""1h""#).to_vec();
    abc.push(decision(3, "Ip", "198.18.3.3", r#""1h""#));
    lapi.play(
        vec![Answer::stream(&ab(r#""1h""#), &[]), Answer::stream(&abc, &[])],
        vec![Answer::stream(&[decision(3, "Ip", "198.18.3.3", r#""1h""#)], &[unreadable_delete]), nothing],
    );
    assert!(wait_listed(&rig, "198.18.3.3/32", true, Duration::from_secs(12)), "C never listed:\n{}", bouncer.output());
    let deadline = Instant::now() + Duration::from_secs(5);
    while lapi.polls().len() < polled + 4 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    thread::sleep(Duration::from_millis(500));
    let end = Instant::now();
    let polls = lapi.polls();
    assert_eq!(
        polls.get(polled..polled + 3),
        Some(&[true, false, true][..]),
        "the full set not asked for after the change"
    );
    let skipped: Vec<String> =
        bouncer.lines_since(started).into_iter().filter(|l| l.contains("nothing lifted for them")).collect();
    assert_eq!(skipped.len(), 1, "not one line for the unreadable change:\n{}", bouncer.output());
    assert!(skipped[0].contains("ERROR") && skipped[0].contains("deleted[0]: its value is not text"), "{}", skipped[0]);
    for net in ["198.18.3.1/32", "2001:db8::3:2/128", "198.18.3.3/32"] {
        assert_eq!(listed(&rig, net).len(), 1, "{net} not listed at the end:\n{}", bouncer.output());
    }
    let watched = watch.finish().expect("the watch");
    watched.run.check_capture();
    for (name, src) in [("A", a), ("B", b)] {
        let through = watched.delivered(src, started, end);
        assert_eq!(through, 0, "{name}: {through} packets through while the unreadable decisions came");
    }
    let gap = watched.longest_gap(bystander, started, end);
    assert!(gap < Duration::from_millis(300), "the bystander went {gap:?} without a packet: the sender stalled");
    assert!(bouncer.exited().is_none(), "the bouncer stopped:\n{}", bouncer.output());
}

/// The peak resident memory of a process (VmHWM), in KiB.
fn peak_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the bouncer's /proc status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("a VmHWM line");
    line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("VmHWM in kB")
}

/// What an answer holds besides bans costs the bouncer nothing, whatever its size: the review's
/// `{"new":[0,0,0,...]}` of 8 MiB (which took 687 MB), 24 MiB (2.0 GB) and 256 MiB (an abort,
/// exit 134) leave the bouncer's peak resident memory under [`NO_BAN_PEAK_KIB`], and an answer
/// of 256 MiB of distinct bans, past the most it holds, is refused with its peak under
/// [`PEAK_KIB`] (docs/OPERATIONS.md, CrowdSec: the bouncer's memory). Each answer costs one
/// ERROR line; the bouncer keeps running, and its ban (A) stays in force on real traffic.
#[test]
fn hostile_answers_of_any_size_keep_the_bouncer_small_and_its_bans() {
    require_root!();
    /// What OPERATIONS documents: under 32 MiB for answers holding no ban, 400 MiB in all.
    const NO_BAN_PEAK_KIB: u64 = 32 * 1024;
    const PEAK_KIB: u64 = 400 * 1024;
    let rig = Rig::start(&[]).expect("starting the rig");
    let [a, bystander]: [IpAddr; 2] = ["198.18.6.1", "198.18.6.9"].map(|s| s.parse().unwrap());
    let zeros = |mib: usize| Answer::Repeated {
        head: br#"{"new":["#.to_vec(),
        item: b"0".to_vec(),
        count: (mib << 20) / 2 - 8,
        tail: b"]}".to_vec(),
    };
    let past_the_cap =
        Answer::ManyBans { head: br#"{"deleted":null,"new":["#.to_vec(), count: 2_129_921, tail: b"]}".to_vec() };
    let good = Answer::stream(&[decision(1, "Ip", "198.18.6.1", r#""1h""#)], &[]);
    let nothing = Answer::stream(&[], &[]);
    // Each hostile answer is a change; after each, the full set (the good one) is asked for.
    let lapi = StandIn::start(vec![good.clone()], vec![nothing.clone()]).expect("stand-in");
    let (_dir, key_file) = stand_in_key();
    let mut bouncer = start_bouncer(&rig, &lapi.url(), &key_file);
    let pid = bouncer.pid().expect("the bouncer's pid");
    assert!(wait_listed(&rig, "198.18.6.1/32", true, Duration::from_secs(5)), "A never listed:\n{}", bouncer.output());
    let watch = Watch::start(&rig, &[a, bystander], Duration::from_secs(90)).expect("watching");
    thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    lapi.play(vec![good.clone()], vec![zeros(8), zeros(24), zeros(256), nothing.clone()]);
    let said = |bouncer: &Service, what: &str| bouncer.lines_since(started).iter().filter(|l| l.contains(what)).count();
    let deadline = Instant::now() + Duration::from_secs(60);
    while said(&bouncer, "unreadable decisions") < 3 && Instant::now() < deadline && bouncer.exited().is_none() {
        thread::sleep(Duration::from_millis(20));
    }
    assert!(bouncer.exited().is_none(), "the bouncer stopped:\n{}", bouncer.output());
    let no_ban_peak = peak_kib(pid);
    assert!(no_ban_peak < NO_BAN_PEAK_KIB, "{no_ban_peak} KiB after answers holding no ban");
    assert_eq!(said(&bouncer, "unreadable decisions"), 3, "not one line per answer of zeros:\n{}", bouncer.output());

    lapi.play(vec![good], vec![past_the_cap, nothing]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while said(&bouncer, "more than 2129920 bans") < 1 && Instant::now() < deadline && bouncer.exited().is_none() {
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        said(&bouncer, "more than 2129920 bans"),
        1,
        "the answer past the cap not refused:\n{}",
        bouncer.output()
    );
    let peak = peak_kib(pid);
    thread::sleep(Duration::from_millis(1500));
    let end = Instant::now();
    let watched = watch.finish().expect("the watch");
    watched.run.check_capture();
    eprintln!(
        "the bouncer's peak: {no_ban_peak} KiB after the answers of zeros, {peak} KiB after the one past the cap"
    );
    assert!(bouncer.exited().is_none(), "the bouncer stopped:\n{}", bouncer.output());
    assert!(peak < PEAK_KIB, "{peak} KiB after an answer past the cap");
    assert_eq!(listed(&rig, "198.18.6.1/32").len(), 1, "A lifted:\n{}", bouncer.output());
    let through = watched.delivered(a, started, end);
    assert_eq!(through, 0, "A: {through} packets through while the hostile answers came");
    let gap = watched.longest_gap(bystander, started, end);
    assert!(gap < Duration::from_millis(300), "the bystander went {gap:?} without a packet: the sender stalled");
}

/// A restarted daemon gets back what it lost. A ban made with Debian's LAPI (`cscli decisions
/// add`) is in force; the daemon is killed (SIGKILL), its state file removed and its program
/// detached (all it held lost), and started again (`stats` names another instance): the bouncer
/// sees another daemon answer, compares the daemon's bans with its own and sends the ban again:
/// the source is dropped again within 3 s of the daemon running, on real traffic, and stays
/// dropped.
#[test]
fn a_restarted_daemon_that_lost_its_bans_gets_them_back() {
    require_root!();
    let mut rig = Rig::start(&[]).expect("starting the rig");
    let state = rig.scratch.path().join("state");
    let args = ["--state-dir", state.to_str().expect("a UTF-8 path")];
    rig.daemon.stop_ok();
    rig.restart(&args).expect("the daemon with its state in the scratch directory");
    let lapi = Lapi::start().expect("starting the crowdsec LAPI");
    let (_key_file, bouncer) = bouncer_of(&rig, &lapi);
    let [a, bystander]: [IpAddr; 2] = ["198.18.7.1", "198.18.7.9"].map(|s| s.parse().unwrap());
    decide(&lapi, &["decisions", "add", "--ip", "198.18.7.1", "--duration", "1h"]);
    assert!(wait_listed(&rig, "198.18.7.1/32", true, Duration::from_secs(5)), "A never listed");
    let watch = Watch::start(&rig, &[a, bystander], Duration::from_secs(40)).expect("watching");
    thread::sleep(Duration::from_millis(500));

    let instance = |rig: &Rig| {
        let stats: serde_json::Value = serde_json::from_str(&rig.ctl_ok(&["stats", "--json"])).expect("stats --json");
        stats["instance"].as_u64().unwrap_or(0)
    };
    let before = instance(&rig);
    rig.daemon.kill().expect("SIGKILL");
    let file = state.join(format!("bans-{}.json", rig.net.receiver.iface));
    std::fs::remove_file(&file).unwrap_or_else(|e| panic!("removing {}: {e}", file.display()));
    rig.scratch.detach(&rig.net.receiver).and_then(|ctl| ctl.ok()).expect("detaching the program");
    // From here nothing holds A's ban.
    let lost = Instant::now();
    rig.restart(&args).expect("restarting the daemon");
    let running = Instant::now();
    let after = instance(&rig);
    assert!(before != 0 && after != 0 && before != after, "stats names no new instance: {before}, then {after}");
    assert!(
        wait_listed(&rig, "198.18.7.1/32", true, Duration::from_secs(5)),
        "A not sent again after the daemon lost it:\n{}",
        bouncer.output()
    );
    thread::sleep(Duration::from_secs(3));
    let end = Instant::now();
    let watched = watch.finish().expect("the watch");
    watched.run.check_capture();
    assert!(watched.delivered(a, lost, running) > 0, "A was not through while the daemon was away: nothing was lost");
    let last = watched.arrivals(a).into_iter().rfind(|t| *t >= lost).unwrap_or(lost);
    let dark_after = last.saturating_duration_since(running);
    eprintln!(
        "the daemon took {:?} to start again; A dropped again {dark_after:?} after it ran",
        running.duration_since(lost)
    );
    assert!(dark_after < Duration::from_secs(3), "A got through until {dark_after:?} after the daemon ran again");
    assert_eq!(watched.delivered(a, running + Duration::from_secs(3), end), 0, "A through again later");
    let gap = watched.longest_gap(bystander, running, end);
    assert!(gap < Duration::from_secs(2), "the bystander went {gap:?} without a packet");
    assert!(
        bouncer.lines_since(lost).iter().any(|l| l.contains("compared with the daemon's bans: 1 sent again")),
        "no reconcile line:\n{}",
        bouncer.output()
    );
}

/// A reconcile that fails is said, with its cause, and tried again: the bouncer runs against a
/// stand-in daemon (a Unix socket answering as the daemon does) whose ban list fails, as the
/// review's did with a million IPv6 bans, where the bouncer said nothing. One ERROR line with
/// the daemon's own reason, a second listing within the backoff, and the bans still sent. No
/// root needed.
#[test]
fn a_failed_reconcile_is_said_and_tried_again() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("ctl.sock");
    let listener = UnixListener::bind(&socket).expect("binding the stand-in daemon");
    listener.set_nonblocking(true).expect("nonblocking");
    let (listings, added) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let stop = Arc::new(AtomicBool::new(false));
    let (l, a, done) = (listings.clone(), added.clone(), stop.clone());
    let daemon = thread::spawn(move || {
        while !done.load(Ordering::Relaxed) {
            let Ok((conn, _)) = listener.accept() else {
                thread::sleep(Duration::from_millis(10));
                continue;
            };
            let _ = conn.set_nonblocking(false);
            let mut line = String::new();
            let _ = BufReader::new(&conn).read_line(&mut line);
            let request: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            let answer = match request["op"].as_str() {
                Some("stats") => r#"{"status":"ok","data":{"instance":7}}"#.to_string(),
                Some("ban-list") => {
                    l.fetch_add(1, Ordering::Relaxed);
                    r#"{"status":"failed","error":"the answer not taken within 2 s"}"#.to_string()
                }
                Some("ban-add") => {
                    let n = request["entries"].as_array().map_or(0, Vec::len);
                    a.fetch_add(n, Ordering::Relaxed);
                    format!(r#"{{"status":"ok","data":{{"added":{n}}}}}"#)
                }
                _ => r#"{"status":"ok","data":{"removed":0,"cidrs":[]}}"#.to_string(),
            };
            let _ = (&conn).write_all(format!("{answer}\n").as_bytes());
        }
    });
    let lapi = StandIn::start(
        vec![Answer::stream(&[decision(1, "Ip", "198.18.5.1", r#""1h""#)], &[])],
        vec![Answer::stream(&[], &[])],
    )
    .expect("stand-in");
    let (_keys, key_file) = stand_in_key();
    let mut cmd = Command::new(limiter_ctl_binary().expect("the release limiter-ctl"));
    cmd.arg("--socket").arg(&socket).args(["crowdsec", "--lapi", &lapi.url(), "--key-file"]).arg(&key_file);
    let mut bouncer = Service::spawn("limiter-ctl crowdsec", &mut cmd).expect("starting the bouncer");
    let started = Instant::now() - Duration::from_secs(60);
    let (_, line) = bouncer
        .wait_line(started, |l| l.contains("listing the daemon's bans failed"), Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("the failed reconcile was not said: {e:#}"));
    assert!(line.contains("ERROR") && line.contains("the answer not taken within 2 s"), "{line}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while listings.load(Ordering::Relaxed) < 2 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    assert!(listings.load(Ordering::Relaxed) >= 2, "the listing was not tried again:\n{}", bouncer.output());
    assert_eq!(added.load(Ordering::Relaxed), 1, "the ban was not sent meanwhile:\n{}", bouncer.output());
    drop(bouncer);
    let _ = daemon.join();
}

/// Bad arguments stop the bouncer at once, before any poll: exit 2 and one line on stderr
/// naming what is wrong. No root, no LAPI, no daemon needed.
#[test]
fn bad_arguments_exit_2_with_one_line() {
    let bin = limiter_ctl_binary().expect("the release limiter-ctl");
    let dir = tempfile::tempdir().expect("temp dir");
    let good_key = dir.path().join("key");
    std::fs::write(&good_key, "0123456789abcdef\n").expect("writing");
    let two_lines = dir.path().join("two");
    std::fs::write(&two_lines, "abc\ndef\n").expect("writing");
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "").expect("writing");
    let missing = dir.path().join("missing");
    let path = |p: &Path| p.to_str().expect("UTF-8").to_owned();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--lapi".into(), "https://127.0.0.1:8080".into(), "--key-file".into(), path(&good_key)], "--lapi"),
        (vec!["--lapi".into(), "127.0.0.1:8080".into(), "--key-file".into(), path(&good_key)], "--lapi"),
        (vec!["--lapi".into(), "http://127.0.0.1:8080".into(), "--key-file".into(), path(&missing)], "missing"),
        (vec!["--lapi".into(), "http://127.0.0.1:8080".into(), "--key-file".into(), path(&empty)], "empty"),
        (vec!["--lapi".into(), "http://127.0.0.1:8080".into(), "--key-file".into(), path(&two_lines)], "two"),
        (
            vec![
                "--lapi".into(),
                "http://127.0.0.1:8080".into(),
                "--key-file".into(),
                path(&good_key),
                "--interval".into(),
                "0s".into(),
            ],
            "--interval",
        ),
        (vec!["--lapi".into(), "http://127.0.0.1:8080".into()], "--key-file"),
    ];
    for (args, names) in cases {
        let started = Instant::now();
        let out = Command::new(&bin).arg("crowdsec").args(&args).output().expect("running limiter-ctl");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: not one line: {stderr:?}");
        assert!(stderr.contains(names), "{args:?}: the line does not name {names}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}: wrote to stdout: {:?}", String::from_utf8_lossy(&out.stdout));
        assert!(started.elapsed() < Duration::from_secs(5), "{args:?}: took {:?}", started.elapsed());
    }
}

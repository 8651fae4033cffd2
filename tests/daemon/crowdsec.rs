//! CrowdSec feeding bans to the limiter through `limiter-ctl crowdsec`, the bouncer: Debian's
//! crowdsec local API (LAPI), started by the test with a config of its own
//! ([`limiter_tests::crowdsec`]), decisions made with `cscli`, the bouncer run as the real
//! binary, against the real daemon and XDP program on a veth pair, checked on real traffic.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, TcpListener},
    path::Path,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use limiter_tests::{
    bans::Watch, crowdsec::Lapi, daemon::limiter_ctl_binary, require_root, rig::Rig, service::Service,
};

/// The bouncer, as an operator runs it: the default poll interval (1 s).
fn start_bouncer(rig: &Rig, lapi_url: &str, key_file: &Path) -> Service {
    let mut cmd = Command::new(limiter_ctl_binary().expect("the release limiter-ctl"));
    cmd.arg("--socket").arg(rig.scratch.socket()).args(["crowdsec", "--lapi", lapi_url, "--key-file"]).arg(key_file);
    Service::spawn("limiter-ctl crowdsec", &mut cmd).expect("starting the bouncer")
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
    let key = lapi.add_bouncer("limiter-test").expect("adding the bouncer");
    let key_file = lapi.dir().join("bouncer.key");
    std::fs::write(&key_file, format!("{key}\n")).expect("writing the key");
    let mut bouncer = start_bouncer(&rig, &lapi.url(), &key_file);
    bouncer
        .wait_line(Instant::now() - Duration::from_secs(60), |l| l.contains("decisions read"), Duration::from_secs(10))
        .expect("the bouncer's first poll");
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

/// A LAPI answering garbage changes nothing: a stand-in for the LAPI (a plain HTTP server on
/// loopback, since a real LAPI never sends garbage) answers the first poll with a ban, then
/// garbage of every kind. The ban stays in force, each garbage answer costs one error line,
/// the bouncer keeps polling, and asks for the full set again after each.
#[test]
fn a_garbage_stream_logs_one_line_and_changes_nothing() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let server = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("binding");
    let url = format!("http://{}", server.local_addr().expect("local address"));
    let garbage: Vec<&'static [u8]> = vec![
        b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nnot json!!\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: 21\r\n\r\n{\"new\":[{\"value\":\"x\"}",
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n\xff\xfe\x00garbage\x01\x02\x03\x04\x05",
        b"garbage that is not even HTTP\r\n\r\n",
    ];
    let first =
        b"{\"deleted\":null,\"new\":[{\"duration\":\"59m0s\",\"id\":7,\"origin\":\"crowdsec\",\"scenario\":\"test\",\
                  \"scope\":\"Ip\",\"type\":\"ban\",\"value\":\"198.18.2.7\"}]}";
    let startups = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let (seen, done) = (startups.clone(), stop.clone());
    server.set_nonblocking(true).expect("nonblocking");
    let serving = thread::spawn(move || {
        let mut n = 0usize;
        while !done.load(Ordering::Relaxed) {
            let Ok((mut conn, _)) = server.accept() else {
                thread::sleep(Duration::from_millis(10));
                continue;
            };
            let _ = conn.set_nonblocking(false);
            let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
            let mut request = String::new();
            let mut reader = BufReader::new(conn.try_clone().expect("clone"));
            while reader.read_line(&mut request).is_ok_and(|n| n > 2) {}
            if request.contains("startup=true") {
                seen.fetch_add(1, Ordering::Relaxed);
            }
            let answer: Vec<u8> = if n == 0 {
                let mut a = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", first.len()).into_bytes();
                a.extend_from_slice(first);
                a
            } else {
                garbage[(n - 1) % garbage.len()].to_vec()
            };
            let _ = conn.write_all(&answer);
            let mut rest = Vec::new();
            let _ = conn.set_read_timeout(Some(Duration::from_millis(50)));
            let _ = conn.read_to_end(&mut rest);
            n += 1;
        }
    });
    let dir = tempfile::tempdir().expect("temp dir");
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, "0123456789abcdef\n").expect("writing the key");
    let mut bouncer = start_bouncer(&rig, &url, &key_file);
    assert!(wait_listed(&rig, "198.18.2.7/32", true, Duration::from_secs(5)), "the first answer's ban never listed");
    let started = Instant::now();
    // Six garbage answers, with backoff: 1 + 2 + 4 + 8 s... take the first four.
    let deadline = started + Duration::from_secs(20);
    while bouncer.lines_since(started).iter().filter(|l| l.contains("ERROR")).count() < 4 && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    let errors: Vec<String> = bouncer.lines_since(started).into_iter().filter(|l| l.contains("ERROR")).collect();
    assert!(errors.len() >= 4, "fewer than 4 error lines for the garbage answers:\n{}", bouncer.output());
    for e in &errors {
        assert!(e.contains("kept"), "an error line that does not say the bans are kept: {e}");
    }
    assert!(bouncer.exited().is_none(), "the bouncer stopped on garbage:\n{}", bouncer.output());
    let lines = listed(&rig, "198.18.2.7/32");
    assert_eq!(lines.len(), 1, "the ban after the garbage: {lines:?}");
    assert!(startups.load(Ordering::Relaxed) >= 3, "the bouncer did not ask for the full set again after garbage");
    let all = rig.ctl_ok(&["deny", "list"]);
    assert_eq!(all.lines().filter(|l| l.contains("198.18.")).count(), 1, "garbage added entries:\n{all}");
    drop(bouncer);
    let _ = serving.join();
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

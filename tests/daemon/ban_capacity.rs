//! Bans at capacity: the ban maps full (2^20 single addresses per family, 2,097,152 in all),
//! in one daemon's lifetime, the way the operator and the feeders use them. `deny list` (plain,
//! `--json`) and `allow list` answer whole within 5 s; the daemon's memory stays where it was
//! across five lists; `stats` waits less than 100 ms while the daemon lists, loads a million
//! bans or saves them all; `deny rm` of a permanent entry (fail2ban's unban with `bantime =
//! -1`) works; and a daemon killed in the middle of a million removals leaves the CLI saying
//! how many were applied and what to do.
//!
//! One test, for the cost of filling the maps (about 10 s per million) to be paid once.

use std::{
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant, SystemTime},
};

use limiter_common::maps::MAX_BANS;
use limiter_tests::{
    ban_rig::{BanRig, addresses, ctl_with_input, kernel_bans, raw_request, spawn_with_input, timing_stats},
    daemon::Ctl,
    flood::{L4, Limits},
    observe::stats,
    require_root,
    rig::flow_of,
};

/// Bans per family: what the maps hold.
const PER_FAMILY: u32 = MAX_BANS;
/// A source banned beside the others, and one never banned.
const BANNED: &str = "198.18.200.5";
const BYSTANDER: &str = "198.18.200.6";
/// A permanent entry (the config file's) removed while the maps are full.
const PERMANENT: &str = "198.18.200.9";
const PORT: u16 = 4000;
/// The longest a whole list may take, from starting the CLI to its exit (the issue's bound;
/// measured about 2 s here).
const LIST_TIME: Duration = Duration::from_secs(5);
/// The longest `stats` may wait while the daemon lists, loads or saves bans: the loop does
/// that work a page of 10,000 at a time (a few ms each), answering other clients between pages.
const STATS_WAIT: Duration = Duration::from_millis(100);
/// How much the daemon's resident memory may grow over five lists. A list holds one page at a
/// time, about 1.5 MB (10,000 entries, then their line), per connection; the allocator keeps
/// some of what is freed. A list built whole took 1.6 GB more and kept it.
const LIST_GROWTH_MB: f64 = 32.0;

#[test]
fn at_capacity_lists_answer_rm_works_memory_stays_and_stats_is_answered() {
    require_root!();
    let mut rig = BanRig::start();
    let total = 2 * PER_FAMILY as usize;
    let v4 = addresses(PER_FAMILY - 1, false);
    let out = ctl_with_input(&rig, &["deny", "add", "--file", "-", "--for", "30m"], &v4);
    assert_eq!(out.code, Some(0), "{out:?}");
    rig.ctl_ok(&["deny", "add", BANNED, "--for", "30m"]);
    // A load: the IPv6 million, while another client asks for stats.
    let v6 = addresses(PER_FAMILY, true);
    let ((out, took), waits) = timing_stats(&rig, || {
        let start = Instant::now();
        let out = ctl_with_input(&rig, &["deny", "add", "--file", "-", "--for", "30m"], &v6);
        (out, start.elapsed())
    });
    assert_eq!(out.code, Some(0), "{out:?}");
    eprintln!("{PER_FAMILY} IPv6 bans added in {took:?}");
    answered_meanwhile("a load", &waits);
    // A save of them all: once the saves the load made are over, one change (a ban renewed)
    // makes one more, watched from before the change to its file's rename.
    let file = rig.bans_file();
    settled(&file);
    let (saved, waits) = timing_stats(&rig, || {
        let before = modified(&file);
        let start = Instant::now();
        rig.ctl_ok(&["deny", "add", BANNED, "--for", "40m"]);
        while modified(&file) == before {
            assert!(start.elapsed() < Duration::from_secs(30), "no save within 30 s of a change");
            std::thread::sleep(Duration::from_millis(10));
        }
        start.elapsed()
    });
    eprintln!("{total} bans saved within {saved:?} of a change");
    answered_meanwhile("a save", &waits);
    assert_eq!((kernel_bans(&rig, false), kernel_bans(&rig, true)), (PER_FAMILY as usize, PER_FAMILY as usize));
    let (banned, bystander) = (rig.stream(L4::Udp, PORT, BANNED), rig.stream(L4::Udp, PORT, BYSTANDER));
    let run = rig
        .flood(&[banned.clone(), bystander.clone()], Limits::counted(400, Duration::from_secs(2)), Some(1000.0))
        .expect("traffic");
    assert_eq!(run.delivered(&flow_of(&banned)), 0, "the banned source's frames beside the full maps");
    assert!(run.delivered(&flow_of(&bystander)) >= 190, "the bystander's frames");

    // Five lists: each whole within LIST_TIME, stats answered meanwhile, the memory flat.
    let before = rss_mb(&rig);
    let mut after = Vec::new();
    let (mut times, mut waits) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let ((took, text), during) = timing_stats(&rig, || list_to_file(&rig, &["deny", "list"]));
        waits.extend(during);
        after.push(rss_mb(&rig));
        times.push(took);
        assert_eq!(text.lines().count(), 1 + total, "lines of `deny list` (a header, then an entry each)");
        let first = text.lines().nth(1).unwrap_or_default();
        assert!(first.starts_with(&format!("{BANNED}/32 ")) && first.contains(" cli "), "{first}");
    }
    waits.sort();
    eprintln!("deny list of {total} bans: {times:?}; RSS {before:.0} MB before, {after:.0?} MB after each");
    answered_meanwhile("lists", &waits);
    assert!(times.iter().all(|t| *t < LIST_TIME), "deny list took {times:?}");
    let grown = after.iter().fold(0.0_f64, |m, a| m.max(a - before));
    assert!(
        grown < LIST_GROWTH_MB,
        "the daemon grew {grown:.0} MB over five lists ({before:.0} MB before: {after:.0?})"
    );

    // A reader that takes nothing for 3 s (a pager): the CLI reads on, so the daemon, which
    // drops a client that takes nothing for 2 s, keeps sending.
    let bin = limiter_tests::daemon::limiter_ctl_binary().expect("limiter-ctl");
    let mut paged = Ctl::command(&bin, &rig.scratch.socket(), &["deny", "list"]);
    let paged = paged.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("running limiter-ctl");
    std::thread::sleep(Duration::from_secs(3));
    let out = paged.wait_with_output().expect("its output");
    assert!(out.status.success(), "deny list read 3 s late: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 1 + total, "deny list read 3 s late");

    // Counted, not parsed: the harness is a debug build, a parse of 300 MB would take half a
    // minute (the shape is the CLI's unit tests').
    let (took, text) = list_to_file(&rig, &["deny", "list", "--json"]);
    eprintln!("deny list --json of {total} bans: {took:?}");
    assert_eq!(text.matches(r#""cidr": "#).count(), total, "entries of `deny list --json`");
    assert!(text.starts_with("[\n  {\n") && text.ends_with("\n  }\n]\n"), "not a JSON array of objects");
    assert!(took < LIST_TIME, "deny list --json took {took:?}");
    let (took, text) = list_to_file(&rig, &["allow", "list"]);
    eprintln!("allow list beside {total} deny bans: {took:?}");
    assert_eq!(text.lines().count(), 1, "allow list: {text}");
    assert!(took < LIST_TIME, "allow list took {took:?}");

    // `rm` at this size: a permanent entry (fail2ban's unban with `bantime = -1`), a ban.
    rig.ctl_ok(&["deny", "add", &format!("{PERMANENT}/32")]);
    let start = Instant::now();
    rig.ctl_ok(&["deny", "rm", PERMANENT]);
    rig.ctl_ok(&["deny", "rm", BANNED]);
    eprintln!("two `deny rm` beside {total} bans: {:?}", start.elapsed());
    let permanent = raw_request(&rig.scratch.socket(), r#"{"op":"list-show","list":"deny"}"#);
    assert!(permanent.contains(r#""data":[]"#), "{permanent}");
    let ban = raw_request(&rig.scratch.socket(), r#"{"op":"ban-list","list":"deny","cidrs":["198.18.200.5/32"]}"#);
    assert_eq!(ban.trim(), r#"{"status":"ok","data":[]}"#);

    killed_amid_a_million_removals(&mut rig, &v4);
}

/// `stats` was answered all along (`waits`, shortest first), never after [`STATS_WAIT`].
fn answered_meanwhile(what: &str, waits: &[Duration]) {
    let at = |q: f64| waits.get(((waits.len() as f64 * q) as usize).min(waits.len().saturating_sub(1))).copied();
    let longest = waits.last().copied().unwrap_or_default();
    eprintln!(
        "{what}: {} stats answers meanwhile, waits median {:?}, p99 {:?}, longest {longest:?}",
        waits.len(),
        at(0.5).unwrap_or_default(),
        at(0.99).unwrap_or_default()
    );
    assert!(
        waits.len() >= 10 && longest < STATS_WAIT,
        "{what}: {} stats answers, the longest wait {longest:?}",
        waits.len()
    );
}

/// `limiter-ctl ARGS` with its output to a file: how long it took from start to exit, and
/// what it wrote. Panics unless it exits 0.
fn list_to_file(rig: &BanRig, args: &[&str]) -> (Duration, String) {
    let output = tempfile::NamedTempFile::new().expect("a file for the list");
    let bin = limiter_tests::daemon::limiter_ctl_binary().expect("limiter-ctl");
    let mut cmd: Command = Ctl::command(&bin, &rig.scratch.socket(), args);
    cmd.stdout(output.reopen().expect("the file")).stderr(Stdio::piped());
    let start = Instant::now();
    let out = cmd.output().expect("running limiter-ctl");
    let took = start.elapsed();
    assert!(out.status.success(), "limiter-ctl {args:?}: {}: {}", out.status, String::from_utf8_lossy(&out.stderr));
    (took, std::fs::read_to_string(output.path()).expect("the output"))
}

/// The daemon's resident memory, MB.
fn rss_mb(rig: &BanRig) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", rig.daemon.daemon_pid())).expect("its status");
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.split_whitespace().next());
    kb.and_then(|kb| kb.parse::<f64>().ok()).expect("VmRSS") / 1024.0
}

/// When a file was last written (None: it is not there).
fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Waits until the ban file has not been rewritten for 2.5 s: the saves in flight are over (at
/// most 30 s).
fn settled(path: &Path) {
    let start = Instant::now();
    let (mut last, mut since) = (modified(path), Instant::now());
    while since.elapsed() < Duration::from_millis(2500) {
        assert!(start.elapsed() < Duration::from_secs(30), "the ban file still rewritten after 30 s");
        std::thread::sleep(Duration::from_millis(50));
        if modified(path) != last {
            (last, since) = (modified(path), Instant::now());
        }
    }
}

/// A million removals (`deny rm --file - --origin cli`), the daemon killed (SIGKILL) midway:
/// the CLI exits 1 saying how many of its entries were applied, in whole requests of 1,000, and
/// to run it again. The kernel holds what that count says, but for the request in flight, which
/// the kill may have caught partway through its kernel writes; once restarted, the daemon has
/// it applied whole (its journal line) or not at all.
fn killed_amid_a_million_removals(rig: &mut BanRig, v4: &str) {
    let total = (PER_FAMILY - 1) as u64;
    let (child, writer) = spawn_with_input(rig, &["deny", "rm", "--file", "-", "--origin", "cli"], v4);
    let deadline = Instant::now() + Duration::from_secs(30);
    while stats(rig)["bans"]["active_v4"]["cli"].as_u64().is_some_and(|n| n > total - 100_000) {
        assert!(Instant::now() < deadline, "100,000 removals not done within 30 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    rig.daemon.kill().expect("killing the daemon");
    let out = child.wait_with_output().expect("the CLI's exit");
    writer.join().expect("the writer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("the CLI, its daemon killed midway: {}: {stderr}", out.status);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    let said = format!("of {total} entries, the first ");
    let done: u64 = stderr
        .split_once(&said)
        .and_then(|(_, rest)| rest.split_once(' '))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of what was applied: {stderr}"));
    assert!(done > 0 && done.is_multiple_of(1000), "{done} applied, in requests of 1,000: {stderr}");
    assert!(stderr.contains("run the same command again"), "{stderr}");
    let left = kernel_bans(rig, false) as u64;
    assert!(
        (total - done - 1000..=total - done).contains(&left),
        "{left} IPv4 bans left in the kernel, the CLI said {done} of {total} were removed: {stderr}"
    );
    rig.restart_kept();
    let left = kernel_bans(rig, false) as u64;
    assert!(
        left == total - done || left == total - done - 1000,
        "restarted: {left} IPv4 bans left in the kernel, the CLI said {done} of {total} were removed, the request \
         in flight whole or not at all: {stderr}"
    );
}

//! Hand edits of the config file against the running daemon: never lost to a CLI change, never
//! applied half-written, followed wherever the path leads (its directory removed and made again,
//! a symlink swapped in another directory), and a FIFO in the file's place never hangs a change.
//!
//! End to end through the real `limiter-ctl` (daemon and CLI), the real XDP program on a veth
//! pair and real files in the test's scratch directory.

use std::{
    io::Write as _,
    os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _, symlink},
    path::Path,
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use limiter_tests::{
    daemon::{Ctl, Daemon, Launch, Scratch},
    netns::{PREFIX, TestNet},
    policies::{Pol, PolicyRig as _, expected, list_json, reloads, running, toml, wait_running},
    require_root,
    rig::Rig,
};
use nix::sys::signal::Signal;

/// A change the watch applies is in force this long after it is whole (0.2 s debounce, slack
/// for a slow machine).
const APPLIED_WITHIN: Duration = Duration::from_secs(2);

/// `--watch-config=true` (the harness turns it off by default), no scheduled rotation.
const WATCHING: [&str; 3] = ["--rotate-every", "off", "--watch-config=true"];

/// Waits for `want` to run, within [`APPLIED_WITHIN`] of `since`; panics saying `what` if not.
fn applied(rig: &mut Rig, want: &[&Pol], since: Instant, what: &str) {
    let want = expected(want);
    let took = wait_running(rig, &want, since, APPLIED_WITHIN * 3);
    eprintln!("{what}: applied after {took:?}");
    rig.daemon.poll();
    let took = took.unwrap_or_else(|| {
        panic!("{what}: not applied; running {:?}, want {want:?}\n{}", running(rig), rig.daemon.output())
    });
    assert!(took <= APPLIED_WITHIN, "{what}: applied after {took:?}, more than {APPLIED_WITHIN:?}");
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The review's edit: `web` 60 -> 70/s and a new policy `dns`, written in place.
fn hand_edit(path: &Path) -> String {
    let before = read(path);
    assert!(before.contains("rate = \"60/s\""), "the test's own expectation:\n{before}");
    let edit = format!("{}\n{}", before.replace("rate = \"60/s\"", "rate = \"70/s\""), toml(&dns()));
    std::fs::write(path, &edit).expect("editing the config in place");
    edit
}

fn web() -> Pol {
    Pol::new("web", "tcp:80", 60, 6)
}

fn web70() -> Pol {
    Pol::new("web", "tcp:80", 70, 6)
}

fn dns() -> Pol {
    Pol::new("dns", "udp:53", 100, 10)
}

/// With the watch on, a CLI change that finds a hand edit the daemon has not applied yet (made
/// 50 ms before it, inside the watch's debounce) applies the edit first, as the watch would, then
/// the change on top: exit 0, a note on stderr saying so, the file holding both (the edit's
/// lines and the deny entry), the kernel running both, one reload counted.
#[test]
fn a_cli_change_applies_a_fresh_hand_edit_first() {
    require_root!();
    let mut rig = Rig::start(&WATCHING).expect("starting the rig");
    rig.set(&web());
    let applied_before = reloads(&rig, "applied");
    let path = rig.scratch.config();
    hand_edit(&path);
    thread::sleep(Duration::from_millis(50));
    let out = rig.daemon.ctl(&["deny", "add", "198.19.66.0/24"]).expect("limiter-ctl deny add");
    eprintln!("deny add: exit {:?}, stderr {:?}", out.code, out.stderr);
    assert_eq!(out.code, Some(0), "{out:?}");
    let text = read(&path);
    for line in ["rate = \"70/s\"", "name = \"dns\"", "\"198.19.66.0/24\""] {
        assert!(text.contains(line), "the file lost {line:?}:\n{text}");
    }
    assert!(!text.contains("60/s"), "the edit was undone:\n{text}");
    let note = out.stderr_lines();
    assert_eq!(note.len(), 1, "one note on stderr: {:?}", out.stderr);
    assert!(note[0].contains("reloaded it first") && note[0].contains(&path.display().to_string()), "{:?}", note[0]);
    assert_eq!(running(&rig), expected(&[&web70(), &dns()]), "the running policies");
    rig.check_installed(&web70(), rig.policy_id("web"));
    rig.check_installed(&dns(), rig.policy_id("dns"));
    assert_eq!(list_json(&rig, "deny"), vec!["198.19.66.0/24"]);
    assert_eq!(reloads(&rig, "applied"), applied_before + 1, "the edit, reloaded once");
    rig.daemon
        .wait_for(|l| l.contains("reloaded") && l.contains("a change found the file edited"), Duration::from_secs(5))
        .expect("the reload the change made first is logged");
    // The watch then finds the bytes the daemon wrote: nothing more to apply.
    let again = rig.daemon.ctl(&["deny", "add", "198.19.67.0/24"]).expect("limiter-ctl deny add");
    assert_eq!((again.code, again.stderr.as_str()), (Some(0), ""), "{again:?}");
}

/// With the watch off (edits apply on reload only), a CLI change that finds a hand edit not yet
/// applied is refused: exit 1, one line saying the file changed and to reload, a WARN in the
/// log; the file, the running policies, the lists and the kernel stay as they were. After
/// `limiter-ctl reload` the same change goes through, on top of the edit.
#[test]
fn with_the_watch_off_a_cli_change_refuses_to_overwrite_a_hand_edit() {
    require_root!();
    let mut rig = Rig::start(&["--rotate-every", "off"]).expect("starting the rig");
    rig.set(&web());
    let path = rig.scratch.config();
    let rules = rig.snapshot().rules;
    let edit = hand_edit(&path);
    thread::sleep(Duration::from_millis(50));
    let out = rig.daemon.ctl(&["deny", "add", "198.19.66.0/24"]).expect("limiter-ctl deny add");
    eprintln!("deny add: exit {:?}, stderr {:?}", out.code, out.stderr);
    assert_eq!(out.code, Some(1), "{out:?}");
    let lines = out.stderr_lines();
    assert_eq!(lines.len(), 1, "one line on stderr: {:?}", out.stderr);
    for needle in [path.display().to_string().as_str(), "was changed", "nothing was changed", "limiter-ctl reload"] {
        assert!(lines[0].contains(needle), "no {needle:?} in {:?}", lines[0]);
    }
    assert_eq!(read(&path), edit, "the hand edit was overwritten");
    assert_eq!(running(&rig), expected(&[&web()]), "the running policies changed");
    assert!(list_json(&rig, "deny").is_empty(), "the refused entry is listed");
    assert_eq!(rig.snapshot().rules, rules, "the kernel's rules changed");
    rig.daemon
        .wait_for(|l| l.contains("WARN") && l.contains("a change refused"), Duration::from_secs(5))
        .expect("the refusal is logged");

    rig.ctl_ok(&["reload"]);
    let out = rig.daemon.ctl(&["deny", "add", "198.19.66.0/24"]).expect("limiter-ctl deny add");
    assert_eq!((out.code, out.stderr.as_str()), (Some(0), ""), "{out:?}");
    let text = read(&path);
    for line in ["rate = \"70/s\"", "name = \"dns\"", "\"198.19.66.0/24\""] {
        assert!(text.contains(line), "the file lost {line:?}:\n{text}");
    }
    assert_eq!(running(&rig), expected(&[&web70(), &dns()]));
    assert_eq!(list_json(&rig, "deny"), vec!["198.19.66.0/24"]);
}

/// A FIFO put in the config's place (no writer on it) makes a CLI change fail at once, saying
/// so, instead of hanging the daemon on a blocking read: exit 1 within 5 s, `stats` answers, the
/// lists are unchanged, the FIFO is left alone, and SIGTERM stops the daemon.
#[test]
fn a_fifo_in_the_configs_place_fails_a_change_without_a_hang() {
    require_root!();
    let mut rig = Rig::start(&["--rotate-every", "off"]).expect("starting the rig");
    rig.set(&web());
    let path = rig.scratch.config();
    std::fs::remove_file(&path).expect("removing the config");
    nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR).expect("mkfifo");

    let started = Instant::now();
    let bin = limiter_tests::daemon::limiter_ctl_binary().expect("limiter-ctl");
    let mut child = Ctl::command(&bin, &rig.scratch.socket(), &["deny", "add", "198.19.66.0/24"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running limiter-ctl deny add");
    let deadline = Duration::from_secs(5);
    while child.try_wait().expect("waiting for limiter-ctl").is_none() && started.elapsed() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    let took = started.elapsed();
    if child.try_wait().expect("waiting for limiter-ctl").is_none() {
        child.kill().expect("killing limiter-ctl");
        let _ = child.wait();
        // Let a daemon blocked on the FIFO go (a writer that closes: end of file), for cleanup.
        if let Ok(mut writer) = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&path) {
            let _ = writer.flush();
        }
        panic!("`deny add` with a FIFO for the config did not answer within {deadline:?}");
    }
    let out = child.wait_with_output().expect("limiter-ctl's output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("deny add: {:?} after {took:?}: {stderr}", out.status.code());
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr:?}");
    for needle in ["a FIFO", "not a regular file", "nothing was changed"] {
        assert!(stderr.contains(needle), "no {needle:?} in {stderr:?}");
    }
    rig.ctl_ok(&["stats"]);
    assert!(list_json(&rig, "deny").is_empty(), "the refused entry is listed");
    assert_eq!(running(&rig), expected(&[&web()]));
    assert!(std::fs::symlink_metadata(&path).expect("the FIFO").file_type().is_fifo(), "the FIFO was replaced");
    rig.daemon.signal(Signal::SIGTERM).expect("SIGTERM");
    let status = rig.daemon.wait_exit(Duration::from_secs(10)).expect("the daemon must stop on SIGTERM");
    assert!(status.success(), "{status}\n{}", rig.daemon.output());
}

/// A daemon watching `config` (outside the scratch directory's own config path).
fn watching(config: &Path) -> Rig {
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch directory");
    let launch = Launch { config: Some(config.to_path_buf()), ..Launch::default() };
    let daemon = Daemon::launch(&net.receiver, &scratch, &WATCHING, launch).expect("spawning the daemon");
    let mut rig = Rig { daemon, scratch, net };
    rig.daemon.wait_attached(&rig.net.receiver).expect("the daemon must start");
    rig
}

/// The config's directory removed (`rm -rf`) and made again: the watch says the path is
/// broken, then follows it back: a file written in the new directory is applied within 2 s, and
/// so is a later edit of it in place.
#[test]
fn the_watch_follows_its_directory_removed_and_made_again() {
    require_root!();
    let dir = tempfile::Builder::new()
        .prefix(&format!("{PREFIX}{}-edits-", std::process::id()))
        .tempdir()
        .expect("a directory");
    let conf = dir.path().join("conf");
    std::fs::create_dir(&conf).expect("mkdir conf");
    let config = conf.join("limiter.toml");
    std::fs::write(&config, toml(&dns())).expect("writing the config");
    let mut rig = watching(&config);
    assert_eq!(running(&rig), expected(&[&dns()]));

    std::fs::remove_dir_all(&conf).expect("rm -rf conf");
    rig.daemon
        .wait_for(|l| l.contains("path is broken"), Duration::from_secs(5))
        .expect("the watch must say its path is broken");
    std::fs::create_dir(&conf).expect("mkdir conf again");
    let dns2 = Pol::new("dns", "udp:53", 300, 30);
    let written = Instant::now();
    std::fs::write(&config, toml(&dns2)).expect("writing the config again");
    applied(&mut rig, &[&dns2], written, "a file in the directory made again");
    rig.check_installed(&dns2, rig.policy_id("dns"));

    let dns3 = Pol::new("dns", "udp:53", 400, 40);
    let written = Instant::now();
    std::fs::write(&config, toml(&dns3)).expect("editing the config in place");
    applied(&mut rig, &[&dns3], written, "an edit in the directory made again");
}

/// The config reached through a symlink into another directory (`etc/limiter.toml ->
/// ../site/current/limiter.toml`, `current -> v1`): `current` swapped to `v2` is applied within
/// 2 s, and so is an edit of v2 in place; an edit of the old v1 applies nothing (one reload
/// counted for each change of v2, none for v1's).
#[test]
fn the_watch_follows_a_symlink_swapped_in_another_directory() {
    require_root!();
    let dir = tempfile::Builder::new()
        .prefix(&format!("{PREFIX}{}-edits-", std::process::id()))
        .tempdir()
        .expect("a directory");
    let at = |p: &str| dir.path().join(p);
    for d in ["etc", "site/v1", "site/v2"] {
        std::fs::create_dir_all(at(d)).expect("mkdir");
    }
    let v2 = Pol::new("dns", "udp:53", 200, 20);
    std::fs::write(at("site/v1/limiter.toml"), toml(&dns())).expect("v1");
    std::fs::write(at("site/v2/limiter.toml"), toml(&v2)).expect("v2");
    symlink("v1", at("site/current")).expect("current -> v1");
    symlink("../site/current/limiter.toml", at("etc/limiter.toml")).expect("etc/limiter.toml ->");
    let mut rig = watching(&at("etc/limiter.toml"));
    assert_eq!(running(&rig), expected(&[&dns()]));
    let base = reloads(&rig, "applied");

    let swapped = Instant::now();
    symlink("v2", at("site/current.new")).expect("current.new -> v2");
    std::fs::rename(at("site/current.new"), at("site/current")).expect("current.new -> current");
    applied(&mut rig, &[&v2], swapped, "current swapped to v2");

    let edited = Pol::new("dns", "udp:53", 300, 30);
    let at_edit = Instant::now();
    std::fs::write(at("site/v2/limiter.toml"), toml(&edited)).expect("editing v2");
    applied(&mut rig, &[&edited], at_edit, "an edit of v2");

    // v1 edited, then v2: once v2's edit runs, v1's (handled before it, in order) added nothing.
    std::fs::write(at("site/v1/limiter.toml"), toml(&Pol::new("dns", "udp:53", 900, 90))).expect("editing v1");
    let last = Pol::new("dns", "udp:53", 400, 40);
    let at_edit = Instant::now();
    std::fs::write(at("site/v2/limiter.toml"), toml(&last)).expect("editing v2 again");
    applied(&mut rig, &[&last], at_edit, "a second edit of v2");
    rig.check_installed(&last, rig.policy_id("dns"));
    assert_eq!(reloads(&rig, "applied"), base + 3, "one reload per change of v2, none for v1");
    assert_eq!(reloads(&rig, "refused"), 0);
}

/// A file written in two steps 1 s apart (open, first half, wait, the rest, close), starting
/// while the daemon's own last write still settles, is never applied half-written: throughout
/// the gap the daemon runs the old policies and logs no reload, and a CLI change is refused
/// ("being written") without touching the file; once closed, the whole is applied within 2 s,
/// as one reload, and the CLI change goes through.
#[test]
fn a_file_written_in_two_steps_is_applied_only_whole() {
    require_root!();
    let mut rig = Rig::start(&WATCHING).expect("starting the rig");
    let (a, b) = (Pol::new("a", "udp:7000", 100, 10), Pol::new("b", "udp:7001", 200, 20));
    rig.set_all(&[a.clone(), b.clone()]);
    // The daemon's own writes above are still settling as the writer starts (0.2 s): they too
    // must not make the daemon read the file while it is half-written.
    let old = expected(&[&a, &b]);
    let rules = rig.snapshot().rules;
    let applied_before = reloads(&rig, "applied");
    rig.daemon.poll();
    let logged = rig.daemon.lines().len();

    // The first half alone is a valid config: `a` changed, `b` gone.
    let (a2, b2) = (Pol::new("a", "udp:7000", 150, 15), Pol::new("b", "udp:7001", 250, 25));
    let mut file = std::fs::File::create(rig.scratch.config()).expect("opening the config for writing");
    file.write_all(toml(&a2).as_bytes()).expect("writing the first half");
    file.flush().expect("flushing the first half");
    let gap = Instant::now();
    // A CLI change meanwhile would reload the half: it is refused, the half left alone.
    let out = rig.daemon.ctl(&["deny", "add", "198.19.66.0/24"]).expect("limiter-ctl deny add");
    assert_eq!(out.code, Some(1), "a change while the file is half-written: {out:?}");
    assert!(out.stderr.contains("is being written"), "{:?}", out.stderr);
    assert_eq!(read(&rig.scratch.config()), toml(&a2), "the half-written file was overwritten");
    let mut polls = 0;
    while gap.elapsed() < Duration::from_secs(1) {
        assert_eq!(running(&rig), old, "the half-written file was applied after {:?}", gap.elapsed());
        polls += 1;
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(rig.snapshot().rules, rules, "the kernel's rules changed while the file was half-written");
    assert!(polls >= 5, "only {polls} polls in the gap");
    rig.daemon.poll();
    let during: Vec<&str> =
        rig.daemon.lines()[logged..].iter().map(|(_, l)| l.as_str()).filter(|l| l.contains("reload")).collect();
    assert!(during.is_empty(), "reloads logged while the file was half-written: {during:?}");

    file.write_all(toml(&b2).as_bytes()).expect("writing the rest");
    drop(file);
    let closed = Instant::now();
    applied(&mut rig, &[&a2, &b2], closed, "the whole file, once closed");
    rig.check_installed(&a2, rig.policy_id("a"));
    rig.check_installed(&b2, rig.policy_id("b"));
    assert_eq!(reloads(&rig, "applied"), applied_before + 1, "one reload, of the whole");
    rig.ctl_ok(&["deny", "add", "198.19.66.0/24"]);
    assert_eq!(list_json(&rig, "deny"), vec!["198.19.66.0/24"]);
}

//! Bans through a crash: a daemon killed (SIGKILL) right after a ban was applied restarts with
//! it (the kernel held it, so the files do), one killed amid a large removal restarts without
//! the removals already applied, and the temporary files a crash left in the state directory
//! are removed at start.
//!
//! Through the real `limiter-ctl` (daemon and CLI) on the shared rig, real traffic on the veth
//! pair, the daemon's state directory in the test's own ([`BanRig`]).

use std::{
    thread,
    time::{Duration, Instant},
};

use limiter_tests::{
    ban_rig::{BanRig, addresses, ctl_with_input, deny_list, kernel_bans, probes},
    observe::fresh_stats,
    require_root,
};

/// A 4 h ban of origin crowdsec applied, then the daemon killed within a few milliseconds of
/// the CLI's answer, right after another change (so no periodic snapshot has it): the restart
/// keeps it, with its origin and about 4 h left, and the source's frames stay dropped.
#[test]
fn a_ban_applied_just_before_a_sigkill_survives_it() {
    require_root!();
    let mut rig = BanRig::start();
    // Past the first second, so a change is saved as soon as it is made; then one change, so
    // the next periodic save is a second away.
    thread::sleep(Duration::from_millis(1200));
    rig.ctl_ok(&["deny", "add", "198.18.200.1", "198.18.200.2", "--for", "1h"]);
    thread::sleep(Duration::from_millis(400));
    rig.ctl_ok(&["deny", "add", "198.18.200.5", "--for", "4h", "--origin", "crowdsec"]);
    rig.daemon.kill().expect("SIGKILL");
    assert_eq!(kernel_bans(&rig, false), 3, "the kernel held the three bans when the daemon died");
    rig.restart_kept();
    let after = deny_list(&rig);
    assert_eq!(after.len(), 3, "{after:?}");
    let kept = after.iter().find(|e| e["cidr"] == "198.18.200.5/32").expect("the 4 h ban after the restart");
    assert_eq!(kept["origin"], "crowdsec");
    let left = kept["expires_in_ms"].as_u64().expect("time left");
    assert!(left > 4 * 3_600_000 - 60_000, "{left} ms left of a 4 h ban");
    assert_eq!(kernel_bans(&rig, false), 3);
    assert_eq!(probes(&rig, "198.18.200.5", 4200, 50), 0, "the banned source after the restart");
}

/// 200,000 bans, then their removal killed midway: the restart keeps none of the removals the
/// kernel had applied (at most the one request in flight, journaled but not yet in the kernel,
/// is applied by the restart), and the kernel agrees with the daemon's count.
#[test]
fn removals_applied_before_a_sigkill_stay_removed() {
    require_root!();
    let mut rig = BanRig::start();
    const N: usize = 200_000;
    let list = addresses(N as u32, false);
    let out = ctl_with_input(&rig, &["deny", "add", "--file", "-", "--for", "1h"], &list);
    assert_eq!(out.code, Some(0), "{out:?}");
    // A snapshot with all of them.
    thread::sleep(Duration::from_millis(1500));
    assert_eq!(kernel_bans(&rig, false), N);
    let bin = limiter_tests::daemon::limiter_ctl_binary().expect("limiter-ctl");
    let socket = rig.scratch.socket();
    let remover = thread::spawn(move || {
        let mut cmd =
            limiter_tests::daemon::Ctl::command(&bin, &socket, &["deny", "rm", "--file", "-", "--origin", "cli"]);
        cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null());
        let mut child = cmd.spawn().expect("running limiter-ctl");
        let mut stdin = child.stdin.take().expect("stdin");
        let _ = std::io::Write::write_all(&mut stdin, list.as_bytes());
        drop(stdin);
        child.wait().expect("limiter-ctl")
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while kernel_bans(&rig, false) > N * 3 / 4 {
        assert!(Instant::now() < deadline, "the removal never got a quarter through");
        thread::sleep(Duration::from_millis(5));
    }
    rig.daemon.kill().expect("SIGKILL");
    let _ = remover.join();
    let held = kernel_bans(&rig, false);
    assert!(held > 0, "the removal finished before the kill: nothing tested");
    rig.restart_kept();
    let active = fresh_stats(&rig)["bans"]["active_v4"]["cli"].as_u64().expect("active bans");
    assert!(
        active as usize <= held && active as usize + 1000 >= held,
        "{active} bans after the restart; the kernel held {held} when the daemon died"
    );
    assert_eq!(kernel_bans(&rig, false), active as usize, "the kernel after the restart");
}

/// The temporary files a crash leaves in the state directory (a snapshot half written, of this
/// interface or of a daemon before the journal) are removed at start; another interface's are
/// left to its own daemon.
#[test]
fn temporaries_left_by_a_crash_are_removed_at_start() {
    require_root!();
    let mut rig = BanRig::start();
    rig.ctl_ok(&["deny", "add", "198.18.200.5", "--for", "1h"]);
    rig.daemon.kill().expect("SIGKILL");
    let dir = rig.state.path().to_path_buf();
    let ours = dir.join(format!(".bans-{}.json.Xy12Ab", rig.net.receiver.iface));
    let legacy = dir.join(".bans6JfBQx");
    let theirs = dir.join(".bans-other0.json.Xy12Ab");
    for file in [&ours, &legacy, &theirs] {
        std::fs::write(file, vec![b'{'; 1 << 20]).expect("a temporary file");
    }
    rig.restart_kept();
    assert!(!ours.exists() && !legacy.exists(), "temporaries left: {:?}", std::fs::read_dir(&dir).map(|d| d.count()));
    assert!(theirs.exists(), "another interface's temporary was removed");
    assert_eq!(deny_list(&rig).len(), 1, "the ban itself survives");
}

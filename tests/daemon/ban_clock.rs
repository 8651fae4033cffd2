//! Expiry on one clock: the daemon's wall clock stepped an hour forward, then an hour back,
//! changes no ban (a 10-minute ban holds, a 3-second one lifts on time and is listed for what
//! it has left, an expired allow ban stops shadowing a deny prefix), nor does a restart under
//! the stepped clock bring back an expired one. An exact ban past its deadline opens no hole in
//! the prefix ban covering it, deny or allow, even before the daemon's sweep.
//!
//! Only the daemon's wall clock is stepped: it runs under Debian's libfaketime (LD_PRELOAD,
//! offsets read from a file the test rewrites; `CLOCK_MONOTONIC` left alone), so the host's
//! clock and the other tests on the machine are untouched. Real traffic on the veth pair.

use std::{
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use limiter_tests::{
    ban_rig::{BanRig, deny_list, kernel_bans, probes},
    daemon::Launch,
    flood::{L4, Limits},
    require_root,
    rig::{Rig, flow_of},
};

const PORT: u16 = 4300;
/// Debian's libfaketime (package libfaketime).
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// The daemon run with its wall clock offset by what `offsets` says (`+0`, `+1h`, `-1h`).
fn faked(offsets: &Path) -> Launch {
    assert!(Path::new(LIBFAKETIME).exists(), "{LIBFAKETIME} is missing: apt-get install libfaketime");
    let env = [
        ("LD_PRELOAD", LIBFAKETIME.into()),
        ("FAKETIME_TIMESTAMP_FILE", offsets.as_os_str().to_owned()),
        // Read on each call: a cached offset is kept until the faked clock passes the cache's
        // end, which a step back puts an hour away.
        ("FAKETIME_NO_CACHE", "1".into()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".into()),
    ];
    Launch { env: env.into_iter().map(|(k, v)| (k.to_string(), v)).collect(), ..Launch::default() }
}

fn step(offsets: &Path, offset: &str) {
    std::fs::write(offsets, format!("{offset}\n")).expect("writing the offset");
    // A second of sweeps on the stepped clock.
    thread::sleep(Duration::from_secs(1));
}

/// How far the daemon's wall clock is from the test's, as `list` shows it (`expires_at_ms` is
/// its wall clock plus the time left), to the second: proof the step took.
fn wall_offset_s(rig: &Rig) -> i64 {
    let list = deny_list(rig);
    let entry = list.iter().find(|e| e["cidr"] == "198.18.200.5/32").expect("the 10-minute ban");
    let (at, left) = (entry["expires_at_ms"].as_u64().expect("at"), entry["expires_in_ms"].as_u64().expect("left"));
    let daemon_now = at as i64 - left as i64;
    ((daemon_now - limiter_tests::observe::now_ms() as i64) as f64 / 1000.0).round() as i64
}

fn left_ms(rig: &Rig, cidr: &str) -> Option<u64> {
    deny_list(rig).iter().find(|e| e["cidr"] == cidr).and_then(|e| e["expires_in_ms"].as_u64())
}

/// The wall clock stepped forward an hour, then back an hour, then back to true: a 10-minute
/// ban holds throughout with its time left counting down as real time passes; a 3-second ban
/// lifts after 3 s and is no longer listed; an expired 3-second allow ban no longer lets a
/// source of a denied /24 through; a ban that expired while the daemon was stopped stays
/// expired after a restart under the stepped clock.
#[test]
fn wall_clock_steps_change_no_ban() {
    require_root!();
    let offsets_dir = tempfile::tempdir().expect("a directory");
    let offsets: PathBuf = offsets_dir.path().join("faketime");
    std::fs::write(&offsets, "+0\n").expect("writing the offset");
    let mut rig = BanRig::start_with(faked(&offsets));
    let start = Instant::now();
    rig.ctl_ok(&["deny", "add", "198.18.200.5", "198.18.201.0/24", "--for", "10m"]);
    let added = Instant::now();
    // The 10-minute ban's time left counts down with real time: its deadline lies between the
    // add asked and answered; `list` rounds up to the ms and answers within a second.
    let counts_down = |rig: &Rig, what: &str| {
        let most = 600_000 + 1 - added.elapsed().as_millis() as u64;
        let left = left_ms(rig, "198.18.200.5/32").expect(what);
        let least = 600_000 - 1_000 - start.elapsed().as_millis() as u64;
        assert!((least..=most).contains(&left), "{what}: {left} ms left, {least}..={most} expected");
    };
    rig.ctl_ok(&["deny", "add", "198.18.200.6", "--for", "3s"]);
    rig.ctl_ok(&["allow", "add", "198.18.201.7", "--for", "3s"]);
    assert_eq!(wall_offset_s(&rig), 0);
    step(&offsets, "+1h");
    assert_eq!(wall_offset_s(&rig), 3600, "the daemon's wall clock an hour forward");
    counts_down(&rig, "the 10-minute ban, an hour forward");
    assert_eq!(probes(&rig, "198.18.200.5", PORT, 20), 0, "the 10-minute ban, an hour forward");
    step(&offsets, "-1h");
    assert_eq!(wall_offset_s(&rig), -3600, "the daemon's wall clock an hour back");
    while start.elapsed() < Duration::from_millis(3600) {
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(left_ms(&rig, "198.18.200.6/32"), None, "the 3 s ban still listed, an hour back");
    assert_eq!(kernel_bans(&rig, false), 1, "only the 10-minute address ban left in the kernel");
    assert_eq!(probes(&rig, "198.18.200.6", PORT, 20), 20, "the 3 s ban lifted, an hour back");
    assert_eq!(probes(&rig, "198.18.201.7", PORT, 20), 0, "the expired allow ban still shadows the /24");
    // Expired while the daemon was stopped; restarted an hour back.
    rig.ctl_ok(&["deny", "add", "198.18.200.8", "--for", "2s"]);
    rig.daemon.stop_ok();
    thread::sleep(Duration::from_millis(2500));
    rig.restart_kept_with(faked(&offsets));
    assert_eq!(left_ms(&rig, "198.18.200.8/32"), None, "an expired ban came back after a restart, an hour back");
    assert_eq!(probes(&rig, "198.18.200.8", PORT, 20), 20);
    step(&offsets, "+0");
    counts_down(&rig, "the 10-minute ban at the end");
}

/// A 2 s exact deny ban inside a 1 h /24 deny ban, and a 2.13 s exact allow ban inside it too,
/// each source sending every 2 ms: after each exact ban's deadline its source's frames are
/// dropped by the /24 at once, not let through until the daemon's sweep takes the exact entry
/// out (up to 250 ms later); the allow ban let its source through before its deadline.
#[test]
fn an_expired_exact_ban_leaves_no_hole_in_its_prefix() {
    require_root!();
    let rig = BanRig::start();
    let (deny, allow) = ("198.18.200.5", "198.18.200.6");
    let streams = [rig.stream(L4::Udp, PORT, deny), rig.stream(L4::Udp, PORT, allow)];
    let flooding = rig.start_flood(&streams, Limits::timed(Duration::from_secs(5)), Some(1000.0)).expect("traffic");
    rig.ctl_ok(&["deny", "add", "198.18.200.0/24", "--for", "1h"]);
    rig.ctl_ok(&["deny", "add", deny, "--for", "2s"]);
    let deny_set = Instant::now();
    rig.ctl_ok(&["allow", "add", allow, "--for", "2.13s"]);
    let allow_set = Instant::now();
    thread::sleep(Duration::from_millis(3500));
    flooding.stop();
    let run = flooding.finish().expect("the traffic");
    let (d, a) = (flow_of(&streams[0]), flow_of(&streams[1]));
    // Frames in flight when a deadline passes: 20 ms of slack.
    let slack = Duration::from_millis(20);
    let after = |flow, from: Instant| run.captured.between(|f| *f == flow, from, Instant::now());
    assert_eq!(after(d, deny_set + Duration::from_secs(2) + slack), 0, "the deny ban's source after its deadline");
    assert_eq!(
        after(a, allow_set + Duration::from_millis(2130) + slack),
        0,
        "the allow ban's source after its deadline"
    );
    let allowed = run.captured.between(|f| *f == a, allow_set, allow_set + Duration::from_secs(2));
    assert!(allowed > 500, "the allow ban let {allowed} frames through in its 2 s");
}

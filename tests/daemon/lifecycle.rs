//! End to end: the daemon's life on the real kernel. A restart (SIGTERM, then a new daemon)
//! keeps enforcing with its state; READY=1 reaches systemd's socket only once the program is
//! attached; one daemon per interface (a second one refuses, naming the owner's pid, changing
//! nothing); `detach` refuses while the owner lives unless `--force`; a start that fails leaves
//! nothing behind and names the program that holds the interface; a late interface is waited
//! for; a pinned limiter that cannot be adopted is replaced in its link without a gap; the exit
//! report says what really happened.
//!
//! Each daemon runs in the receiver's network namespace only, so its pins land on the machine's
//! bpffs under the test's own `--pin-dir`; the rig's drop removes them (detaching the program).

use std::{
    collections::BTreeMap,
    os::unix::net::UnixDatagram,
    time::{Duration, Instant},
};

use aya::maps::{Map, MapData, PerCpuArray};
use limiter_common::{
    Gcra,
    maps::{Counters, MAP_COUNTERS},
};
use limiter_tests::{
    daemon::{
        Daemon, LEFT, Launch, SIGNAL_TIMEOUT, Scratch, Snapshot, program_counters, program_loaded, xdp_program_id,
    },
    netns::TestNet,
    policies::{gcra, src},
    require_root,
    rig::{HandOver, Rig, check_hand_over, total},
};
use nix::sys::signal::Signal;

/// The daemon's flags in these tests: one policy over everything, at a rate a flood exceeds.
const ARGS: [&str; 8] = ["--rate", "1000/s", "--burst", "400", "--buckets", "1024", "--metrics", "off"];

/// A daemon under [`ARGS`] and what the tests hold it to later: its interface, the policy's id
/// and GCRA, its program and its pins.
struct At {
    iface: String,
    id: u16,
    limit: Gcra,
    program: u32,
    pins: BTreeMap<String, u64>,
}

fn start_under_args() -> (Rig, At) {
    let rig = Rig::start(&ARGS).expect("rig");
    let iface = rig.net.receiver.iface.clone();
    let at = At {
        id: rig.policy_id("default"),
        limit: gcra(1000, 400),
        program: rig.daemon.program().expect("program"),
        pins: rig.scratch.pinned(&iface).expect("pins"),
        iface,
    };
    (rig, at)
}

/// Waits until `done` or `timeout`; whether it got there.
fn wait_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

// ---------------------------------------------------------------------------------------------
// Restart

/// `systemctl restart`: SIGTERM, then a new daemon at once, with a flood and a source keeping to
/// half the rate running throughout. The old daemon exits 0 saying it left the program attached
/// and pinned (and it did: same program, same pins); the new one adopts it (same link and maps,
/// its own program swapped in) with the salt and rules it had. Every frame of the whole run was
/// judged by one program or the other and the counters went on (admitted + refused == sent),
/// what got through stays within the GCRA bound over the whole run (no gap, no fresh burst), the
/// steady source was never refused and the flood got its allowance ([`check_hand_over`]).
#[test]
fn a_restart_keeps_enforcing_and_carries_the_state_over() {
    require_root!();
    let (mut rig, At { id, limit, program: p1, .. }) = start_under_args();
    let hand_over = start_hand_over(&rig);
    let rules = rig.snapshot().rules;

    let adopted = rig.restart_adopting(&ARGS);
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(adopted.program), "at XDP");
    let p2 = adopted.program;
    let kept = rig.snapshot().rules;
    assert_eq!(kept.config.salts, rules.config.salts, "the salt did not carry over");
    assert_eq!(kept.view, rules.view, "the rules did not carry over");
    assert!(wait_until(Duration::from_secs(2), || !program_loaded(p1)), "the replaced program {p1} is still loaded");

    std::thread::sleep(Duration::from_millis(700));
    let done = hand_over.finish().expect("flood");
    let before = done.run.counted.as_ref().expect("baseline")[usize::from(id)].clone();
    let after = program_counters(p2, id).expect("counters");
    check_hand_over("SIGTERM and a restart", &done, adopted.at, &before, &after, &limit);
}

/// A flood from 198.19.1.1 and a source keeping to half of [`ARGS`]'s rate from 198.19.1.2, half
/// a second of them under way.
fn start_hand_over(rig: &Rig) -> HandOver {
    rig.start_hand_over(src("198.19.1.1"), src("198.19.1.2"), 7000, 1000.0, Duration::from_millis(500))
        .expect("starting the floods")
}

// ---------------------------------------------------------------------------------------------
// Readiness

/// With NOTIFY_SOCKET set (as systemd does for Type=notify), the daemon sends READY=1 once,
/// with a STATUS= naming the interface, and when it arrives the program is on the interface.
/// Started while the interface does not exist yet (with --wait-iface), it first says it waits,
/// once, and sends no READY=1 until the interface is there and the program attached. A reload
/// (SIGHUP) is bracketed by RELOADING=1 and READY=1; a stop says STOPPING=1.
#[test]
fn ready_is_sent_only_once_the_program_is_attached() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch");
    let path = scratch.path().join("notify.sock");
    let notify = UnixDatagram::bind(&path).expect("binding the notify socket");
    notify.set_read_timeout(Some(Duration::from_millis(100))).expect("timeout");
    let recv = |timeout: Duration| -> Vec<String> {
        let deadline = Instant::now() + timeout;
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while Instant::now() < deadline {
            if let Ok(n) = notify.recv(&mut buf) {
                got.push(String::from_utf8_lossy(&buf[..n]).into_owned());
                if got.last().is_some_and(|m| m.lines().any(|l| l == "READY=1")) {
                    break;
                }
            }
        }
        got
    };

    net.remove_veth().expect("removing the veth pair");
    let launch = Launch { env: vec![("NOTIFY_SOCKET".into(), path.clone().into())], ..Launch::default() };
    let mut extra = ARGS.to_vec();
    extra.extend(["--wait-iface", "30s"]);
    let mut daemon = Daemon::launch(&net.receiver, &scratch, &extra, launch).expect("daemon");
    daemon.wait_for(|l| l.contains("waiting for it"), Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}"));
    let early = recv(Duration::from_secs(1));
    eprintln!("while waiting: {early:?}");
    assert!(early.iter().any(|m| m.contains("STATUS=waiting")), "no STATUS while waiting: {early:?}");
    assert!(!early.iter().any(|m| m.lines().any(|l| l == "READY=1")), "READY=1 before the interface existed");

    net.add_veth().expect("re-creating the veth pair");
    let messages = recv(Duration::from_secs(30));
    let ready = messages.iter().find(|m| m.lines().any(|l| l == "READY=1"));
    let ready = ready.unwrap_or_else(|| panic!("no READY=1 within 30 s: {messages:?}\n{}", daemon.output()));
    // The program must already be there when READY=1 is read.
    let program = xdp_program_id(&net.receiver).expect("ip link");
    eprintln!("READY: {ready:?}; program on the interface: {program:?}");
    assert!(program.is_some(), "READY=1 arrived but {} has no XDP program", net.receiver.iface);
    assert!(ready.contains(&format!("STATUS=enforcing on {}", net.receiver.iface)), "{ready:?}");
    daemon.wait_attached(&net.receiver).expect("attached line");
    assert_eq!(daemon.program().ok(), program, "READY=1 came with another program on the interface");
    let out = daemon.output();
    assert_eq!(out.matches("waiting for it").count(), 1, "the wait is logged once:\n{out}");

    // A reload is bracketed: RELOADING=1 (with the monotonic time systemd asks for), READY=1.
    daemon.signal(Signal::SIGHUP).expect("SIGHUP");
    let reload = recv(Duration::from_secs(10));
    eprintln!("reload: {reload:?}");
    let reloading = reload.iter().position(|m| m.lines().any(|l| l == "RELOADING=1"));
    let ready = reload.iter().rposition(|m| m.lines().any(|l| l == "READY=1"));
    assert!(matches!((reloading, ready), (Some(a), Some(b)) if a <= b), "RELOADING=1 then READY=1: {reload:?}");
    assert!(reload.iter().any(|m| m.contains("MONOTONIC_USEC=")), "{reload:?}");

    daemon.stop_ok();
    let last = recv(Duration::from_millis(500));
    assert!(last.iter().any(|m| m.contains("STOPPING=1")), "no STOPPING=1: {last:?}");
}

/// A missing interface that does not appear within --wait-iface: exit 1 (a supervisor retries),
/// saying so, and nothing left behind (no pins, no socket). Without --wait-iface: exit 2 at once.
#[test]
fn an_interface_that_never_appears_fails_the_start_cleanly() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch");
    net.remove_veth().expect("removing the veth pair");
    let mut extra = ARGS.to_vec();
    extra.extend(["--wait-iface", "1s"]);
    let started = Instant::now();
    let mut daemon = Daemon::spawn(&net.receiver, &scratch, &extra).expect("daemon");
    let status = daemon.wait_exit(Duration::from_secs(10)).expect("exit");
    let out = daemon.output();
    eprintln!("gave up after {:?}: {status}", started.elapsed());
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(out.contains("did not appear within 1s"), "{out}");
    assert!(started.elapsed() >= Duration::from_secs(1), "gave up before the wait was over");
    assert!(!scratch.pins().exists(), "pins left: {}", scratch.pins().display());
    assert!(!scratch.socket().exists(), "socket left");

    let mut daemon = Daemon::spawn(&net.receiver, &scratch, &ARGS).expect("daemon");
    let status = daemon.wait_exit(Duration::from_secs(10)).expect("exit");
    assert_eq!(status.code(), Some(2), "{}", daemon.output());
}

// ---------------------------------------------------------------------------------------------
// One owner per interface

/// A second daemon for the interface a live daemon owns (same pin directory, its own socket and
/// a config with other rules): exit 1 naming the owner's pid, and nothing changed: the same
/// program, the same maps (rules, salt, counters), the same pins, no socket of its own, and the
/// first daemon's socket still answering.
#[test]
fn a_second_daemon_refuses_an_owned_interface_and_changes_nothing() {
    require_root!();
    let rig = Rig::start(&ARGS).expect("rig");
    let iface = rig.net.receiver.iface.clone();
    let p1 = rig.daemon.program().expect("program");
    let before = rig.snapshot();
    let pins = rig.scratch.pinned(&iface).expect("pins");
    let other = Scratch::new().expect("scratch");
    std::fs::write(other.config(), "[[policy]]\nname = \"other\"\nmatch = \"udp\"\nrate = \"5/s\"\n").expect("config");
    let launch = Launch {
        socket: Some(other.socket()),
        config: Some(other.config()),
        pin_dir: Some(rig.scratch.pins().to_path_buf()),
        ..Launch::default()
    };
    let mut second = Daemon::launch(&rig.net.receiver, &rig.scratch, &ARGS, launch).expect("second daemon");
    let status = second.wait_exit(Duration::from_secs(30)).expect("the second daemon should exit");
    let out = second.output();
    eprintln!("second daemon: {status}\n{out}");
    assert_eq!(status.code(), Some(1), "{out}");
    let owner = rig.daemon.daemon_pid();
    assert!(out.contains(&format!("pid {owner}")), "the refusal does not name the owner (pid {owner}):\n{out}");
    assert!(!out.contains(" attached ") && !out.contains("adopted"), "{out}");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(p1), "the program changed");
    assert_eq!(rig.snapshot(), before, "the maps changed");
    assert_eq!(rig.scratch.pinned(&iface).expect("pins"), pins, "the pins changed");
    assert!(!other.socket().exists(), "the refused daemon created its socket");
    rig.ctl_ok(&["stats"]);
}

/// `limiter-ctl detach` while the owning daemon runs: exit 1, naming its pid and how to stop it,
/// nothing removed, the program enforcing. With --force: the daemon is stopped (it exits 0,
/// leaving the program pinned), then detached: no program, no pins.
#[test]
fn detach_refuses_while_the_owner_lives_unless_forced() {
    require_root!();
    let mut rig = Rig::start(&ARGS).expect("rig");
    let iface = rig.net.receiver.iface.clone();
    let p1 = rig.daemon.program().expect("program");
    let pins = rig.scratch.pinned(&iface).expect("pins");
    let owner = rig.daemon.daemon_pid();

    let out = rig.scratch.detach(&rig.net.receiver).expect("detach");
    eprintln!("detach: {out:?}");
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains(&format!("pid {owner}")) && out.stderr.contains("--force"), "{out:?}");
    assert_eq!(rig.scratch.pinned(&iface).expect("pins"), pins, "detach removed pins of a live daemon");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(p1));
    assert!(rig.daemon.is_running(), "the daemon stopped");
    rig.ctl_ok(&["stats"]);

    let out = rig.scratch.detach_with(&rig.net.receiver, &["--force"]).expect("detach --force");
    eprintln!("detach --force: {out:?}");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains(&format!("stopped the daemon that owned {iface} (pid {owner})")), "{out:?}");
    assert!(out.stdout.contains(&format!("no XDP program is attached to {iface}")), "{out:?}");
    let status = rig.daemon.wait_exit(SIGNAL_TIMEOUT).expect("the daemon should have exited");
    assert!(status.success(), "{status}: {}", rig.daemon.output());
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None);
    assert!(!rig.scratch.pin_dir(&iface).exists(), "{:?}", rig.scratch.pinned(&iface));
}

/// Another daemon's program holds the interface (a limiter under another --pin-dir and another
/// --state-dir): a start that asks for XDP (`--attach xdp`) fails with exit 1, naming that
/// program's id and where it is pinned, and leaves nothing behind: no pin directory, no pins,
/// no socket, no state directory; the program there is untouched.
#[test]
fn a_failed_start_leaves_nothing_and_names_the_program_in_the_way() {
    require_root!();
    let rig = Rig::start(&ARGS).expect("rig");
    let p1 = rig.daemon.program().expect("program");
    let other = Scratch::new().expect("scratch");
    let state = other.path().join("state");
    let state_arg = state.to_str().expect("a UTF-8 path");
    let xdp_only = [&ARGS[..], &["--attach", "xdp", "--state-dir", state_arg]].concat();
    let mut second = Daemon::spawn(&rig.net.receiver, &other, &xdp_only).expect("second daemon");
    let status = second.wait_exit(Duration::from_secs(30)).expect("the second daemon should exit");
    let out = second.output();
    eprintln!("second daemon: {status}\n{out}");
    assert_eq!(status.code(), Some(1), "{out}");
    let first_pins = rig.scratch.pin_dir(&rig.net.receiver.iface);
    assert!(
        out.contains(&format!("at XDP (program id {p1})")) && out.contains(&first_pins.display().to_string()),
        "the error does not name {p1} and {}:\n{out}",
        first_pins.display()
    );
    assert!(!other.pins().exists(), "the failed start left {}", other.pins().display());
    assert!(!other.socket().exists(), "the failed start left its socket");
    assert!(!state.exists(), "the failed start left its state directory");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(p1));
    rig.ctl_ok(&["stats"]);
}

// ---------------------------------------------------------------------------------------------
// The exit report, and a limiter that cannot be adopted

/// Pins removed under a running daemon (by hand): on SIGINT it does not claim to have left the
/// program enforcing; it exits 1 saying the pins were removed, and the program is indeed gone.
#[test]
fn the_exit_report_says_what_really_happened() {
    require_root!();
    let mut rig = Rig::start(&ARGS).expect("rig");
    let dir = rig.scratch.pin_dir(&rig.net.receiver.iface);
    std::fs::remove_dir_all(&dir).expect("removing the pins by hand");
    rig.daemon.signal(Signal::SIGINT).expect("SIGINT");
    let status = rig.daemon.wait_exit(SIGNAL_TIMEOUT).expect("exit");
    let out = rig.daemon.output();
    eprintln!("{status}\n{out}");
    assert_eq!(status.code(), Some(1), "{out}");
    assert!(!out.contains(LEFT), "claims to have left the program pinned:\n{out}");
    assert!(out.contains("pins were removed while the daemon ran"), "{out}");
    assert!(
        wait_until(Duration::from_secs(2), || xdp_program_id(&rig.net.receiver).is_ok_and(|p| p.is_none())),
        "a program is still attached"
    );
}

/// A pinned limiter the new daemon cannot adopt (here: another --buckets, as a release with
/// another map layout would be) is replaced in its link in one step, under a flood: the new
/// daemon says its state starts afresh, its program is in the same pinned link, its maps are
/// pinned in place of the old ones, and every frame of the run was judged by the old program or
/// the new one (their counters together == sent), each within its own GCRA bound.
#[test]
fn an_incompatible_pinned_limiter_is_replaced_without_a_gap() {
    require_root!();
    let (mut rig, At { iface, id, limit, program: p1, pins }) = start_under_args();
    // The old counters, held open: they outlive their pin and program for the final count.
    let dir = rig.scratch.pin_dir(&iface);
    let old = MapData::from_pin(dir.join(MAP_COUNTERS)).expect("old COUNTERS");
    let old: PerCpuArray<_, Counters> = PerCpuArray::try_from(Map::PerCpuArray(old)).expect("per-CPU array");
    let (flow, flooding) = rig.flood_one_source(src("198.19.1.1"), 7000, Duration::from_millis(500)).expect("flood");
    rig.daemon.stop_ok();

    let mut args = ARGS.to_vec();
    args[5] = "2048";
    let mut daemon = Daemon::spawn(&rig.net.receiver, &rig.scratch, &args).expect("daemon");
    let line = daemon.wait_replaced(&rig.net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    rig.daemon = daemon;
    eprintln!("{line}");
    let out = rig.daemon.output();
    assert!(out.contains("--buckets 1024"), "the reason is not said:\n{out}");
    let p2 = rig.daemon.program().expect("program");
    assert_ne!(p2, p1);
    let now = rig.scratch.pinned(&iface).expect("pins");
    assert_eq!(now.get("link"), pins.get("link"), "the link was not kept: {now:?}");
    assert_ne!(now.get(MAP_COUNTERS), pins.get(MAP_COUNTERS), "the old maps are still pinned: {now:?}");
    assert_eq!(now.keys().collect::<Vec<_>>(), pins.keys().collect::<Vec<_>>(), "pins");
    assert!(wait_until(Duration::from_secs(2), || !program_loaded(p1)), "the replaced program {p1} is still loaded");

    std::thread::sleep(Duration::from_millis(500));
    flooding.stop();
    let run = flooding.finish().expect("flood");
    let first = run.counted.as_ref().expect("baseline")[usize::from(id)].clone();
    let old_now: Vec<Counters> = old.get(&u32::from(id), 0).expect("old counters").iter().copied().collect();
    let new_id = rig.policy_id("default");
    let new_now = program_counters(p2, new_id).expect("new counters");
    let by_old = limiter_tests::bounds::Judged::between(&first, &old_now);
    let by_new = limiter_tests::bounds::Judged::new(&new_now);
    let (sent, delivered) = (run.sent(&flow), run.delivered(&flow));
    eprintln!("{}; old program {by_old}; new program {by_new}; delivered {delivered}", run.report);
    let admitted = by_old.total.admitted_packets + by_new.total.admitted_packets;
    let judged = admitted + by_old.total.refused_packets + by_new.total.refused_packets;
    assert_eq!(judged, sent, "judged by the old program or the new one vs sent: a frame passed unjudged");
    assert_eq!(admitted, delivered, "admitted vs delivered");
    assert!(by_new.total.refused_packets > 0, "the new program refused nothing");
    for (what, judged) in [("old program", &by_old), ("new program", &by_new)] {
        limiter_tests::bounds::check_upper(what, judged.total.admitted_packets, &limit, judged, run.window());
    }
    assert_eq!(total(&Snapshot::read(&dir).expect("maps").counters[usize::from(new_id)]), total(&new_now));
}

/// A pinned limiter whose buckets are split into another number of rows maps every key
/// elsewhere: the next daemon started with another `--rows` does not adopt it but replaces it,
/// saying why; the new CONFIG holds the new row count and row length.
#[test]
fn another_row_count_is_replaced_not_adopted() {
    require_root!();
    let mut rig = Rig::start(&ARGS).expect("rig");
    let config = rig.daemon.maps().expect("maps").rules.config;
    assert_eq!((config.rows, config.row_len), (4, 256), "the default: 4 rows of 1024 / 4");
    rig.daemon.stop_ok();
    let mut args = ARGS.to_vec();
    args.extend(["--rows", "2"]);
    let mut daemon = Daemon::spawn(&rig.net.receiver, &rig.scratch, &args).expect("daemon");
    let line = daemon.wait_replaced(&rig.net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    rig.daemon = daemon;
    eprintln!("{line}");
    let out = rig.daemon.output();
    assert!(out.contains("split into 4 rows") && out.contains("--rows 2"), "the reason is not said:\n{out}");
    let config = rig.daemon.maps().expect("maps").rules.config;
    assert_eq!((config.rows, config.row_len), (2, 512));
}

/// The bucket arrays: by default (`auto`) sized from this host's memory and possible CPUs, as
/// the formulas give them; numbers given are taken as they are. The start line, `stats` and
/// `stats --json` say the geometry and each array's memory.
#[test]
fn the_bucket_arrays_are_sized_from_the_host_unless_given() {
    use limiter_ctl::kernel::{HostSize, auto_buckets, auto_host_buckets, bytes_text};
    require_root!();
    let host = HostSize::read().expect("reading the host's size");
    let (buckets, host_buckets) = (auto_buckets(host.mem_total, host.cpus), auto_host_buckets(host.mem_total));
    eprintln!("{host:?}: buckets {buckets}, host buckets {host_buckets}");
    assert!(buckets.is_power_of_two() && (1 << 12..=1 << 16).contains(&buckets), "{buckets}");
    assert!(host_buckets.is_power_of_two() && (1 << 20..=1 << 22).contains(&host_buckets), "{host_buckets}");
    let cases: [(&[&str], [u32; 4]); 2] = [
        (&["--metrics", "off"], [buckets, 4, host_buckets, limiter_common::rows::DEFAULT_HOST_ROWS]),
        (
            &["--metrics", "off", "--buckets", "1024", "--rows", "2", "--host-buckets", "4096", "--host-rows", "1"],
            [1024, 2, 4096, 1],
        ),
    ];
    for (args, [b, r, hb, hr]) in cases {
        let rig = Rig::start(args).expect("rig");
        let start =
            rig.daemon.lines().iter().map(|(_, l)| l.as_str()).find(|l| l.contains(" attached")).unwrap_or_default();
        let cpu_bytes = u64::from(b) * 16 * u64::from(host.cpus);
        let host_bytes = u64::from(hb) * 16;
        for field in [
            format!(" buckets={b} "),
            format!(" rows={r} "),
            format!("host_buckets={hb} "),
            format!("host_rows={hr} "),
            format!("buckets_memory=\"{} ({} CPUs)\"", bytes_text(cpu_bytes), host.cpus),
            format!("host_buckets_memory=\"{}\"", bytes_text(host_bytes)),
        ] {
            assert!(start.contains(&field), "{args:?}: the start line lacks {field}: {start}");
        }
        let json: serde_json::Value = serde_json::from_str(&rig.ctl_ok(&["stats", "--json"])).expect("stats --json");
        let g = &json["geometry"];
        let got = ["buckets", "rows", "host_buckets", "host_rows", "cpus", "buckets_bytes", "host_buckets_bytes"]
            .map(|k| g[k].as_u64().unwrap_or_else(|| panic!("no {k} in {g}")));
        let want = [b.into(), r.into(), hb.into(), hr.into(), host.cpus.into(), cpu_bytes, host_bytes];
        assert_eq!(got, want, "{args:?}: `stats --json` geometry {g}");
        let text = rig.ctl_ok(&["stats"]);
        let rows = |n: u32| if n == 1 { "1 row".to_string() } else { format!("{n} rows") };
        let line = format!(
            "per-CPU buckets {b} in {} ({} over {} CPUs), host buckets {hb} in {} ({})",
            rows(r),
            bytes_text(cpu_bytes),
            host.cpus,
            rows(hr),
            bytes_text(host_bytes)
        );
        assert!(text.lines().any(|l| l == line), "{args:?}: `stats` lacks {line:?}:\n{text}");
    }
}

/// A VLAN's usual name has a dot (`eth0.10`), which bpffs refuses in a pin's name: the daemon
/// pins such an interface's limiter under its name with colons for dots, a restart adopts it,
/// and `detach --all` finds it by the interface's own name and takes it off.
#[test]
fn an_interface_named_with_a_dot_is_pinned_adopted_and_detached() {
    require_root!();
    let mut net = TestNet::new().expect("test network");
    let dotted = format!("lmt{}.v", std::process::id());
    let old = net.receiver.iface.clone();
    for step in
        [&["link", "set", &old, "down"][..], &["link", "set", &old, "name", &dotted], &["link", "set", &dotted, "up"]]
    {
        let mut args = vec!["-n", net.receiver.ns.as_str()];
        args.extend_from_slice(step);
        limiter_tests::netns::ip(args).expect("renaming the receiver's interface");
    }
    net.receiver.iface = dotted.clone();
    let scratch = Scratch::new().expect("scratch");
    let mut daemon = Daemon::start(&net.receiver, &scratch, &ARGS).expect("a daemon on the dotted interface");
    let pins = scratch.pin_dir(&dotted);
    assert!(pins.ends_with(dotted.replace('.', ":")) && pins.join("link").exists(), "{}", pins.display());
    let program = daemon.program().expect("program");
    assert_eq!(xdp_program_id(&net.receiver).expect("ip link"), Some(program));
    daemon.interrupt(SIGNAL_TIMEOUT).expect("SIGINT");

    let (mut again, line) = Daemon::adopt(&net.receiver, &scratch, &ARGS).expect("a restart adopting it");
    eprintln!("{line}");
    assert!(xdp_program_id(&net.receiver).expect("ip link").is_some(), "nothing attached after the restart");
    again.interrupt(SIGNAL_TIMEOUT).expect("SIGINT");

    let mut cmd =
        limiter_tests::daemon::net_command(&net.receiver, limiter_tests::daemon::limiter_ctl_binary().expect("bin"));
    cmd.args(["detach", "--all", "--pin-dir"]).arg(scratch.pins());
    let out = limiter_tests::daemon::Ctl::run(&mut cmd).expect("detach --all");
    eprintln!("{out:?}");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains(&dotted), "detach names the interface as it is: {out:?}");
    assert_eq!(xdp_program_id(&net.receiver).expect("ip link"), None, "{out:?}");
    assert!(!pins.exists(), "pins left: {}", pins.display());
}

//! The daemon as the systemd unit runs it. Under the restrictions packaging/limiter.service puts
//! on its service (address families, system calls, capabilities, no new privileges, umask...:
//! read from the unit file and applied by `limiter-sandbox`, since systemd is not PID 1 where
//! CI runs; limiter@.service has the same ones, tests/packaging/packaging.rs checks that), it starts,
//! serves its metrics, reloads (`limiter-ctl reload`, as ExecReload runs it, under the same
//! restrictions) and stops with exit 0 leaving its program attached and pinned, and the next
//! daemon adopts it. And a clean start logs no warning: the program's BTF loads, so the kernel
//! keeps it (`bpftool prog show` names a btf_id).
//!
//! And the CrowdSec bouncer under packaging/limiter-crowdsec.service's restrictions, its user
//! and group included, against a stand-in LAPI and the real daemon's socket.
//!
//! Each daemon runs in the receiver's network namespace only (pins on the machine's bpffs under
//! the test's own `--pin-dir`, removed when the scratch directory drops).

use std::{
    net::SocketAddr,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use limiter_tests::{
    crowdsec::{Answer, StandIn, decision},
    daemon::{Ctl, Daemon, LEFT, Launch, SIGNAL_TIMEOUT, Scratch, limiter_ctl_binary, xdp_program_id},
    netns::TestNet,
    require_root,
    rig::Rig,
    scrape,
    service::Service,
};
use nix::sys::signal::Signal;

/// A policy over everything, and the metrics endpoint (an AF_INET socket under the filter) on
/// the receiver namespace's loopback.
const ARGS: [&str; 8] = ["--rate", "1000/s", "--burst", "400", "--buckets", "1024", "--metrics", "127.0.0.1:9464"];
const METRICS: &str = "127.0.0.1:9464";

fn unit() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/limiter.service")
}

fn sandbox() -> &'static str {
    env!("CARGO_BIN_EXE_limiter-sandbox")
}

/// `limiter-sandbox UNIT -- PROGRAM ARGS...`
fn sandboxed(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(sandbox());
    cmd.arg(unit()).arg("--").arg(program);
    cmd
}

/// The harness's `nsenter --net=NS -- limiter-ctl ARGS...`, with limiter-sandbox between the two:
/// the namespace is entered first (the sandbox forbids setns), then the restrictions applied.
fn wrap_in_sandbox(cmd: Command) -> Command {
    let args: Vec<_> = cmd.get_args().map(ToOwned::to_owned).collect();
    let split = args.iter().position(|a| a == "--").expect("the harness runs nsenter ... -- limiter-ctl") + 1;
    let mut out = Command::new(cmd.get_program());
    out.args(&args[..split]).arg(sandbox()).arg(unit()).arg("--").args(&args[split..]);
    out
}

fn launch() -> Launch {
    Launch { wrap: Some(Box::new(wrap_in_sandbox)), ..Launch::default() }
}

/// Log lines at WARN or ERROR (the harness reads the text format: `<time>  WARN message`).
fn warnings(out: &str) -> Vec<&str> {
    out.lines().filter(|l| l.contains(" WARN ") || l.contains(" ERROR ") || l.starts_with("stderr: error")).collect()
}

/// Stops `daemon` as `systemctl stop` does (SIGTERM): exit 0, having checked and said that it
/// left its program attached and pinned.
#[track_caller]
fn stop(daemon: &mut Daemon, what: &str) -> String {
    daemon.signal(Signal::SIGTERM).expect("SIGTERM");
    let status = daemon.wait_exit(SIGNAL_TIMEOUT).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    let out = daemon.output();
    assert!(status.success(), "{what}: exit {status} on SIGTERM (systemd would mark the unit failed):\n{out}");
    assert!(out.contains(LEFT), "{what}: no '{LEFT}' line: the exit check did not run to the end:\n{out}");
    out
}

/// Under the unit's restrictions: start (attached, metrics served, the config file written),
/// `limiter-ctl reload` of a hand edit (exit 0, applied), SIGHUP, a `policy set` (the daemon
/// rewrites its file), then stop: exit 0, the same program still on the interface and the same
/// pins. A second sandboxed daemon adopts it and stops cleanly too, and a third, with another
/// row count, replaces it in its link. Nothing is logged at WARN or ERROR throughout (but the
/// designed warning of the replacement): a call the sandbox refuses shows up as one (or as a
/// failed start or stop).
#[test]
fn the_daemon_starts_reloads_and_stops_under_the_units_restrictions() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch");
    let iface = net.receiver.iface.clone();

    let mut daemon = Daemon::launch(&net.receiver, &scratch, &ARGS, launch()).expect("starting the daemon");
    daemon.wait_attached(&net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    let program = daemon.program().expect("program");
    let pins = scratch.pinned(&iface).expect("pins");
    assert!(!pins.is_empty(), "nothing pinned in {}", scratch.pin_dir(&iface).display());
    // --rate wrote the policy to the config file (a temp file renamed over it, owner kept).
    let written = scratch.config_file().expect("config").expect("the daemon wrote no config file");
    assert!(written.contains("name = \"default\""), "{written}");

    // The metrics, the bucket-occupancy gauge included: its scan reads the buckets through a
    // duplicate of the daemon's own descriptor, which needs no CAP_SYS_ADMIN (the unit grants
    // none). It is measured at start, then every 15 s; the snapshot it lands in, once a second.
    let addr: SocketAddr = METRICS.parse().expect("address");
    let deadline = Instant::now() + Duration::from_secs(5);
    let metrics = loop {
        let got = net.receiver.run(move || scrape::get(addr, "/metrics", Duration::from_secs(5))).expect("namespace");
        let got = got.unwrap_or_else(|e| panic!("scraping {METRICS}: {e:#}\n{}", daemon.output()));
        if got.body.contains("limiter_bucket_occupancy_ratio") || Instant::now() >= deadline {
            break got;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(metrics.body.contains("limiter_attach_mode{mode=\"native\"} 1"), "{}", metrics.body);
    assert!(metrics.body.contains("limiter_bucket_occupancy_ratio"), "no occupancy gauge:\n{}", metrics.body);

    // ExecReload: a hand edit, then `limiter-ctl reload` under the same restrictions.
    let edited = format!("{written}\n[[policy]]\nname = \"web\"\nmatch = \"tcp:80\"\nrate = \"150/s\"\nburst = 15\n");
    std::fs::write(scratch.config(), edited).expect("editing the config");
    let reload = Ctl::run(
        sandboxed(limiter_ctl_binary().expect("limiter-ctl")).arg("--socket").arg(scratch.socket()).arg("reload"),
    )
    .expect("running limiter-ctl reload");
    assert_eq!(reload.code, Some(0), "reload under the sandbox: {reload:?}\n{}", daemon.output());
    daemon.wait_for(|l| l.contains("reloaded"), SIGNAL_TIMEOUT).unwrap_or_else(|e| panic!("{e:#}"));
    let listed = daemon.ctl_ok(&["policy", "list", "--json"]).expect("policy list");
    assert!(listed.contains("\"web\""), "the reloaded policy is not listed: {listed}");
    daemon.signal(Signal::SIGHUP).expect("SIGHUP");
    daemon.wait_for(|l| l.contains("reloaded"), SIGNAL_TIMEOUT).unwrap_or_else(|e| panic!("SIGHUP: {e:#}"));
    // A change over the socket: the daemon rewrites the existing file (owner and mode kept).
    daemon
        .ctl_ok(&["policy", "set", "dns", "--match", "udp:53", "--rate", "100/s"])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let written = scratch.config_file().expect("config").expect("config file");
    assert!(written.contains("name = \"dns\"") && written.contains("name = \"web\""), "{written}");

    let out = stop(&mut daemon, "the first daemon");
    assert_eq!(xdp_program_id(&net.receiver).expect("ip link"), Some(program), "the program left with the daemon");
    assert_eq!(scratch.pinned(&iface).expect("pins"), pins, "the pins changed when the daemon stopped");
    assert_eq!(warnings(&out), Vec::<&str>::new(), "warnings under the sandbox:\n{out}");

    // `systemctl restart`: the next daemon, sandboxed alike, adopts it.
    let mut next = Daemon::launch(&net.receiver, &scratch, &ARGS, launch()).expect("starting the next daemon");
    next.wait_adopted(&net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    assert_ne!(next.program().expect("program"), program, "the new daemon's program is not in the link");
    assert_eq!(scratch.pinned(&iface).expect("pins"), pins, "adopting replaced pinned objects");
    let out = stop(&mut next, "the adopting daemon");
    assert_eq!(warnings(&out), Vec::<&str>::new(), "warnings under the sandbox:\n{out}");

    // A predecessor it cannot adopt (another row count) is replaced in its link; its config is
    // not readable, so the daemon asks the kernel (rtnetlink) which mode the link is in. The one
    // warning is the designed one, saying why it did not adopt.
    let mut args = ARGS.to_vec();
    args.extend(["--rows", "2"]);
    let mut replacing = Daemon::launch(&net.receiver, &scratch, &args, launch()).expect("starting a third daemon");
    replacing.wait_replaced(&net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    let out = stop(&mut replacing, "the replacing daemon");
    let unexpected: Vec<&str> =
        warnings(&out).into_iter().filter(|l| !l.contains("the pinned limiter could not be adopted")).collect();
    assert_eq!(unexpected, Vec::<&str>::new(), "warnings under the sandbox:\n{out}");
}

/// The sandbox is real: under it, a socket of a family the unit does not allow (AF_PACKET) is
/// refused, the capabilities, no-new-privileges and umask are the unit's, and a call the system
/// call filter removes fails with EPERM. A sandbox that applied nothing would pass the test above.
#[test]
fn the_sandbox_applies_the_units_restrictions() {
    require_root!();
    let python = |code: &str| {
        let out = sandboxed("python3").args(["-c", code]).output().expect("running python3 in the sandbox");
        assert!(out.status.success(), "{code}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    // AF_PACKET (17): not in RestrictAddressFamilies.
    let packet = python(
        "import socket\ntry:\n    socket.socket(17, socket.SOCK_RAW, 0); print('allowed')\nexcept OSError as e: print(e.errno)",
    );
    assert_eq!(packet, libc::EAFNOSUPPORT.to_string(), "AF_PACKET under the unit's RestrictAddressFamilies");
    // CapBnd: CAP_NET_ADMIN (12), CAP_PERFMON (38), CAP_BPF (39), as CapabilityBoundingSet says.
    let bounding = python("print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapBnd')][0])");
    assert_eq!(bounding, format!("{:016x}", (1u64 << 12) | (1 << 38) | (1 << 39)));
    let nnp = python("print([l.split()[1] for l in open('/proc/self/status') if l.startswith('NoNewPrivs')][0])");
    assert_eq!(nnp, "1");
    assert_eq!(python("import os\nprint(oct(os.umask(0)))"), "0o77");
    // setpriority(2) is in @resources, which the unit removes from the allow list.
    let nice = python(
        "import os\ntry:\n    os.setpriority(os.PRIO_PROCESS, 0, 1); print('allowed')\nexcept OSError as e: print(e.errno)",
    );
    assert_eq!(nice, libc::EPERM.to_string(), "setpriority under SystemCallFilter=~@resources");
}

/// A clean start and stop log nothing at WARN or ERROR (the kernel refusing the program's BTF
/// was a 45-line warning on every start), and the kernel keeps the program's BTF: `bpftool prog
/// show` names its btf_id (line info in verifier and bpftool dumps, typed map dumps).
#[test]
fn a_clean_start_logs_no_warning_and_the_kernel_keeps_the_programs_btf() {
    require_root!();
    let mut rig = Rig::start(&["--rate", "1000/s", "--metrics", "off"]).expect("rig");
    let program = rig.daemon.program().expect("program");
    let out = Command::new("bpftool")
        .args(["--json", "prog", "show", "id", &program.to_string()])
        .output()
        .expect("running bpftool (cargo xtask setup installs it)");
    assert!(out.status.success(), "bpftool: {}", String::from_utf8_lossy(&out.stderr));
    let info: serde_json::Value = serde_json::from_slice(&out.stdout).expect("bpftool --json");
    let btf = info["btf_id"].as_u64().unwrap_or(0);
    assert!(btf > 0, "the kernel keeps no BTF for program {program}: {info}");
    rig.daemon.stop_ok();
    let out = rig.daemon.output();
    assert!(out.contains(LEFT), "no '{LEFT}' line:\n{out}");
    assert_eq!(warnings(&out), Vec::<&str>::new(), "a clean start and stop warned:\n{out}");
}

/// The CrowdSec bouncer as its unit (packaging/limiter-crowdsec.service) runs it: under its
/// restrictions (a dynamic user in the feeders' group, here a number: no group is added to the
/// host; no capability, its address families and system call filter, its key as a credential
/// only it reads), against a stand-in LAPI and the real daemon's socket (`--socket-group`), it
/// bans what the LAPI decides, and logs nothing at WARN or ERROR. `/proc` shows the
/// restrictions are real: its uid and gid, no capability in any set, no new privileges, seccomp.
#[test]
fn the_bouncer_feeds_bans_under_its_units_restrictions() {
    require_root!();
    const FEEDERS: &str = "64998";
    let rig = Rig::start(&["--rotate-every", "off", "--metrics", "off", "--socket-group", FEEDERS]).expect("rig");
    // Reachable by the bouncer's user (0755): the unit's copy, its key, the binary, the credentials.
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let key = dir.path().join("key");
    std::fs::write(&key, "0123456789abcdef\n").expect("writing the key");
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).expect("chmod the key");
    let shipped =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/limiter-crowdsec.service"))
            .expect("the bouncer's unit");
    let unit = dir.path().join("limiter-crowdsec.service");
    let text = shipped
        .replace("Group=limiter-bans", &format!("Group={FEEDERS}"))
        .replace("/etc/crowdsec/bouncers/limiter.key", &key.display().to_string());
    assert_ne!(text, shipped.replace("Group=limiter-bans", &format!("Group={FEEDERS}")), "no LoadCredential= to point");
    std::fs::write(&unit, text).expect("writing the unit's copy");
    let bin = dir.path().join("limiter-ctl");
    std::fs::copy(limiter_ctl_binary().expect("limiter-ctl"), &bin).expect("copying limiter-ctl");
    let lapi = StandIn::start(
        vec![Answer::stream(
            &[decision(1, "Ip", "198.18.8.1", r#""1h""#), decision(2, "Range", "2001:db8:8::/64", r#""1h""#)],
            &[],
        )],
        vec![Answer::stream(&[], &[])],
    )
    .expect("the stand-in LAPI");
    let mut cmd = Command::new(sandbox());
    cmd.arg(&unit).arg("--").arg(&bin).arg("--socket").arg(rig.scratch.socket());
    cmd.args(["crowdsec", "--lapi", &lapi.url(), "--key-file", "%d/lapi-key"]);
    cmd.env("LIMITER_SANDBOX_CREDENTIALS", dir.path());
    let mut bouncer = Service::spawn("limiter-ctl crowdsec (sandboxed)", &mut cmd).expect("starting the bouncer");
    let deadline = Instant::now() + Duration::from_secs(10);
    let listed = loop {
        let listed = rig.ctl_ok(&["deny", "list"]);
        if (listed.contains("198.18.8.1/32") && listed.contains("2001:db8:8::/64")) || Instant::now() >= deadline {
            break listed;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        listed.contains("198.18.8.1/32") && listed.contains("2001:db8:8::/64"),
        "not banned:\n{listed}\n{}",
        bouncer.output()
    );
    let pid = bouncer.pid().expect("the bouncer's pid");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its /proc status");
    let field = |name: &str| {
        status.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.split_whitespace().next().unwrap_or("").to_string())
    };
    assert_eq!(field("Uid:").as_deref(), Some("61184"), "{status}");
    assert_eq!(field("Gid:").as_deref(), Some(FEEDERS), "{status}");
    for set in ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"] {
        assert_eq!(field(set).as_deref(), Some("0000000000000000"), "{set} {status}");
    }
    assert_eq!(field("NoNewPrivs:").as_deref(), Some("1"));
    assert_eq!(field("Seccomp:").as_deref(), Some("2"), "no seccomp filter");
    std::thread::sleep(Duration::from_secs(2));
    assert!(bouncer.exited().is_none(), "the bouncer stopped:\n{}", bouncer.output());
    let out = bouncer.output();
    assert_eq!(warnings(&out), Vec::<&str>::new(), "the bouncer warned under its sandbox:\n{out}");
    assert!(
        out.contains("compared with the daemon's bans"),
        "no reconcile (the ban list read) under the sandbox:\n{out}"
    );
}

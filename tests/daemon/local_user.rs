//! The running daemon attacked as a local user would: an unprivileged user (nobody, 65534)
//! holding a thousand connections to the metrics port, racing a start for the control socket,
//! or reaching the socket should its mode be loosened; the daemon out of descriptors; control
//! characters in the config; SIGUSR1 and SIGUSR2.
//!
//! Through the real `limiter-ctl` (daemon and CLI) on the shared [`limiter_tests::rig`]. The
//! unprivileged side is the system's python3 (/usr/bin/python3, not a shim on PATH that nobody
//! may not be able to read) run under `setpriv`.

use std::{
    io::{BufRead as _, BufReader},
    os::unix::fs::PermissionsExt as _,
    path::Path,
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use limiter_tests::{
    cpu::flood_cpu,
    daemon::{Ctl, Daemon, LEFT, Launch, SIGNAL_TIMEOUT, Scratch, limiter_ctl_binary, xdp_program_id},
    netns::{NETNS_DIR, TestNet},
    require_root,
    rig::{METRICS, Rig},
    scrape,
};
use nix::sys::signal::Signal;

const NOBODY: &str = "65534";
/// The daemon's cap on metrics connections, and how long one may take to send its headers
/// (docs/OPERATIONS.md, "Metrics").
const METRICS_CONNECTIONS: usize = 64;
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// `/usr/bin/python3 -c SCRIPT ARGS...` as nobody, pinned to the flood CPU, in the network
/// namespace `ns` if given.
fn as_nobody(ns: Option<&str>, script: &str, args: &[String]) -> Command {
    let mut cmd = match ns {
        Some(ns) => {
            let mut cmd = Command::new("nsenter");
            cmd.arg(format!("--net={}", Path::new(NETNS_DIR).join(ns).display())).arg("--").arg("taskset");
            cmd
        }
        None => Command::new("taskset"),
    };
    cmd.args(["-c", &flood_cpu().to_string(), "setpriv"])
        .args([&format!("--reuid={NOBODY}"), &format!("--regid={NOBODY}"), "--clear-groups"])
        .args(["/usr/bin/python3", "-c", script])
        .args(args);
    cmd
}

/// A python process as nobody, its stdout read line by line (each a JSON object).
struct Nobody {
    child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Nobody {
    fn spawn(mut cmd: Command) -> Self {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
        let lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        Self { child, lines }
    }

    /// Its next line, parsed (it prints each once it has something to say; every script is
    /// bounded in time).
    fn next(&mut self) -> serde_json::Value {
        let line = self.lines.next().expect("the script ended early").expect("reading the script's output");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    }

    fn wait(mut self) {
        let status = self.child.wait().expect("waiting for the script");
        assert!(status.success(), "the script failed: {status}");
    }
}

impl Drop for Nobody {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Opens N connections to 127.0.0.1:PORT (2 s to connect each), says how many and how long
/// that took, then watches them for HOLD seconds, sending nothing, and reports how long after
/// the last connect each was closed by the other side, and how many were still open.
const HOLD_METRICS: &str = r#"
import json, select, socket, sys, time
n, port, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
socks, failed, start = [], 0, time.monotonic()
for _ in range(n):
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("127.0.0.1", port))
        socks.append((s, time.monotonic()))
    except OSError:
        failed += 1
        s.close()
opened = time.monotonic()
print(json.dumps({"opened": len(socks), "failed": failed, "took": opened - start}), flush=True)
poll, by_fd = select.poll(), {}
for s, at in socks:
    s.setblocking(False)
    poll.register(s, select.POLLIN | select.POLLERR | select.POLLHUP)
    by_fd[s.fileno()] = (s, at)
closed, end = [], time.monotonic() + hold
while by_fd and time.monotonic() < end:
    for fd, _ in poll.poll(50):
        s, at = by_fd[fd]
        try:
            data = s.recv(4096)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if not data:
            closed.append(time.monotonic() - opened)
            poll.unregister(fd)
            del by_fd[fd]
print(json.dumps({"closed_after": closed, "still_open": len(by_fd)}), flush=True)
"#;

fn open_fds(pid: nix::unistd::Pid) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).expect("the daemon's /proc/PID/fd").count()
}

/// The inode of the pinned XDP link: a link destroyed and made again is a new pin.
fn link_pin(rig: &Rig) -> u64 {
    let pinned = rig.scratch.pinned(&rig.net.receiver.iface).expect("reading the pins");
    *pinned.get("link").unwrap_or_else(|| panic!("no link pinned: {pinned:?}"))
}

fn probe(rig: &Rig, path: &'static str) -> anyhow::Result<scrape::Response> {
    rig.net.receiver.run(move || scrape::get(METRICS, path, Duration::from_secs(2)))?
}

/// 1,100 connections from nobody to the metrics port, holding still: the daemon serves 64 and
/// closes the rest as it takes them, closes the 64 at their 5 s header deadline (none lasts
/// beyond 8 s after the last connect), and meanwhile keeps
/// its descriptors (at most 64 more than before), its control socket (`deny add` in under
/// 5 s), its reloads (a hand edit applied on SIGHUP) and its XDP link (same program, same
/// pinned link). Then the probes answer again.
#[test]
fn a_metrics_flood_from_nobody_costs_nothing_else() {
    require_root!();
    let mut rig = Rig::start(&["--rotate-every", "off"]).expect("starting the rig");
    let pid = rig.daemon.daemon_pid();
    let (program, link, fds) = (rig.daemon.program().expect("program"), link_pin(&rig), open_fds(pid));
    let args = ["1100".to_string(), METRICS.port().to_string(), "14".to_string()];
    let mut nobody = Nobody::spawn(as_nobody(Some(&rig.net.receiver.ns), HOLD_METRICS, &args));
    let opened = nobody.next();
    eprintln!("nobody connected to the metrics port: {opened}");
    assert!(opened["opened"].as_u64().unwrap_or(0) >= 1000, "{opened}");

    // Sampled over a second: whatever the daemon took up, it holds no more than the cap.
    let most = (0..10).map(|_| (open_fds(pid), thread::sleep(Duration::from_millis(100))).0).max().unwrap_or(0);
    eprintln!("the daemon's descriptors: {fds} before, at most {most} with the connections open");
    assert!(most <= fds + METRICS_CONNECTIONS + 8, "{most} descriptors open, {fds} before: the cap is 64");
    let started = Instant::now();
    rig.ctl_ok(&["deny", "add", "198.18.200.0/24"]);
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "`deny add` took {took:?} beside the metrics flood");
    let config = rig.scratch.config_file().expect("config").unwrap_or_default();
    let edited = format!("{config}\n[[policy]]\nname = \"by-hand\"\nmatch = \"udp:5353\"\nrate = \"10/s\"\n");
    std::fs::write(rig.scratch.config(), edited).expect("a hand edit");
    rig.daemon.signal(Signal::SIGHUP).expect("SIGHUP");
    rig.daemon.wait_for(|l| l.contains("reloaded") && l.contains("SIGHUP"), SIGNAL_TIMEOUT).expect("the reload");
    assert!(rig.ctl_ok(&["policy", "list"]).contains("by-hand"), "the hand edit was not applied");

    let done = nobody.next();
    nobody.wait();
    let closed: Vec<f64> =
        done["closed_after"].as_array().expect("closed_after").iter().filter_map(|v| v.as_f64()).collect();
    let mut by_second = [0usize; 16];
    closed.iter().for_each(|&s| by_second[(s as usize).min(15)] += 1);
    eprintln!(
        "closed by the daemon, by seconds after the last connect: {by_second:?}; still open: {}",
        done["still_open"]
    );
    assert_eq!(done["still_open"], 0, "connections the daemon never closed");
    // Those it served were taken up before the last connect: closed by their header deadline.
    let last = closed.iter().copied().fold(0.0, f64::max);
    let header = HEADER_TIMEOUT.as_secs_f64();
    assert!(last < header + 3.0, "a connection was closed {last} s after the last connect, deadline {header} s");
    rig.daemon.poll();
    let probes = (probe(&rig, "/livez").expect("GET /livez"), probe(&rig, "/readyz").expect("GET /readyz"));
    assert_eq!((probes.0.status, probes.1.status), (200, 200), "{probes:?}");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(program), "the program on the interface");
    assert_eq!(link_pin(&rig), link, "the XDP link was made again");
    let output = rig.daemon.output();
    assert!(!output.contains("interface gone") && !output.contains("reattached"), "{output}");
}

/// Out of descriptors (its limit lowered to what it holds, and control connections queued
/// behind it), the daemon cannot look its interface up: it says so once, and neither calls
/// the interface gone nor touches the XDP link; when descriptors are back it says so, and the
/// program and its pinned link are the same. A hand edit the watch saw but could not read
/// then is applied once descriptors are back.
#[test]
fn a_failed_interface_lookup_never_detaches() {
    require_root!();
    let args = ["--rotate-every", "off", "--metrics", "off", "--watch-config=true"];
    let mut rig = Rig::start(&args).expect("starting the rig");
    let pid = rig.daemon.daemon_pid();
    let (program, link) = (rig.daemon.program().expect("program"), link_pin(&rig));
    // The daemon reads the file once as its watch starts, before it serves the socket: an
    // answer means that read is done, so the edit below is the one it cannot read (lowered
    // sooner, the start's own read fails, and the same failure again is not logged twice).
    rig.ctl_ok(&["policy", "list"]);
    let mut old = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: prlimit writes `old`, valid for the call.
    let got = unsafe { libc::prlimit(pid.as_raw(), libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(got, 0, "prlimit: {}", std::io::Error::last_os_error());
    let tight = libc::rlimit { rlim_cur: open_fds(pid) as u64 + 2, rlim_max: old.rlim_max };
    // SAFETY: prlimit reads `tight`, valid for the call.
    let set = unsafe { libc::prlimit(pid.as_raw(), libc::RLIMIT_NOFILE, &tight, std::ptr::null_mut()) };
    assert_eq!(set, 0, "prlimit: {}", std::io::Error::last_os_error());
    // Idle connections take the last descriptors, and more wait in the backlog behind them
    // (each dropped at its 2 s read deadline, and the next taken).
    let held: Vec<_> =
        (0..8).map(|_| std::os::unix::net::UnixStream::connect(rig.scratch.socket()).expect("connecting")).collect();
    let failing = rig.daemon.wait_for(|l| l.contains("could not look the interface up"), Duration::from_secs(10));
    let edit = "[[policy]]\nname = \"by-hand\"\nmatch = \"udp:5353\"\nrate = \"10/s\"\n";
    std::fs::write(rig.scratch.config(), edit).expect("a hand edit");
    let unread =
        rig.daemon.wait_for(|l| l.contains("reload refused") && l.contains("changed"), Duration::from_secs(10));
    drop(held);
    // SAFETY: as above; the old limit back.
    let reset = unsafe { libc::prlimit(pid.as_raw(), libc::RLIMIT_NOFILE, &old, std::ptr::null_mut()) };
    assert_eq!(reset, 0, "prlimit: {}", std::io::Error::last_os_error());
    let failing = failing.expect("the daemon out of descriptors says its lookup fails");
    let unread = unread.expect("the edit could not be read while out of descriptors");
    eprintln!("{failing}\n{unread}");
    rig.daemon.wait_for(|l| l.contains("interface lookup works again"), Duration::from_secs(10)).expect("recovery");
    // Read again within a second of the descriptors being back (maybe already).
    let deadline = Instant::now() + Duration::from_secs(5);
    while !rig.ctl_ok(&["policy", "list"]).contains("by-hand") {
        assert!(Instant::now() < deadline, "the hand edit is not applied:\n{}", rig.daemon.output());
        thread::sleep(Duration::from_millis(50));
    }
    rig.daemon.poll();
    let output = rig.daemon.output();
    assert!(!output.contains("interface gone") && !output.contains("reattached"), "{output}");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(program), "the program on the interface");
    assert_eq!(link_pin(&rig), link, "the XDP link was made again");
    let stats = rig.ctl_ok(&["stats", "--json"]);
    assert!(stats.contains("attach_mode"), "{stats}");
}

/// Connects to the socket PATH in a tight loop until the file STOP exists, sending each
/// connection that gets through a request to allow everything; reports what it got.
const RACE_SOCKET: &str = r#"
import json, os, socket, sys
path, stop = sys.argv[1], sys.argv[2]
request = b'{"op":"list-add","list":"allow","cidr":"0.0.0.0/0"}\n'
tries, got_in, n = 0, [], 0
while True:
    n += 1
    if n % 256 == 0 and os.path.exists(stop):
        break
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except OSError:
        tries += 1
        s.close()
        continue
    try:
        s.settimeout(3)
        s.sendall(request)
        got_in.append(s.recv(4096).decode(errors="replace"))
    except OSError as e:
        got_in.append("connected, then " + str(e))
    s.close()
print(json.dumps({"tries": tries, "got_in": got_in}), flush=True)
"#;

/// Started ten times under umask 0 while nobody tries to connect in a tight loop, the control
/// socket never lets nobody in: not one connect succeeds, and no allow entry appears.
#[test]
fn the_control_socket_is_never_open_to_others() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch directory");
    let stop = scratch.path().join("stop");
    let args = [scratch.socket().display().to_string(), stop.display().to_string()];
    let nobody = Nobody::spawn(as_nobody(None, RACE_SOCKET, &args));
    let umask0 = || Launch {
        wrap: Some(Box::new(|cmd: Command| {
            let mut sh = Command::new("sh");
            sh.args(["-c", "umask 0 && exec \"$@\"", "sh"]).arg(cmd.get_program()).args(cmd.get_args());
            sh
        })),
        ..Launch::default()
    };
    for start in 0..10 {
        let mut daemon = Daemon::launch(&net.receiver, &scratch, &["--metrics", "off"], umask0()).expect("spawning");
        daemon.wait_running(&net.receiver).unwrap_or_else(|e| panic!("start {start}: {e:#}"));
        let mode = std::fs::metadata(scratch.socket()).expect("the socket").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "start {start}: socket mode {mode:o}");
        assert!(!daemon.ctl_ok(&["allow", "list"]).expect("allow list").contains("0.0.0.0/0"), "start {start}");
        daemon.stop_ok();
    }
    std::fs::write(&stop, "").expect("telling the script to stop");
    let mut nobody = nobody;
    let report = nobody.next();
    nobody.wait();
    eprintln!("nobody's connects: {} refused; got in: {}", report["tries"], report["got_in"]);
    assert!(report["tries"].as_u64().unwrap_or(0) > 100, "the loop hardly ran: {report}");
    assert_eq!(report["got_in"], serde_json::json!([]), "nobody got in");
    let config = scratch.config_file().expect("config").unwrap_or_default();
    assert!(!config.contains("0.0.0.0/0"), "{config}");
}

/// Connects to PATH COUNT times, each sending a request to allow everything, and reports the
/// answers.
const TRY_SOCKET: &str = r#"
import json, socket, sys
answers = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(3)
    s.connect(sys.argv[1])
    try:
        s.sendall(b'{"op":"list-add","list":"allow","cidr":"0.0.0.0/0"}\n')
    except OSError:
        pass
    answers.append(s.recv(4096).decode(errors="replace"))
    s.close()
print(json.dumps(answers), flush=True)
"#;

/// With the socket's mode loosened to 0666 by hand, nobody still gets nothing: each of 20
/// connections is refused in one line (SO_PEERCRED: neither root nor the daemon's user), one
/// warning is logged for all of them, nothing changes, and root is served as before.
#[test]
fn a_peer_that_is_neither_root_nor_the_daemon_is_refused() {
    require_root!();
    let mut rig = Rig::start(&["--rotate-every", "off", "--metrics", "off"]).expect("starting the rig");
    let socket = rig.scratch.socket();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).expect("chmod 0666");
    let before = rig.scratch.config_file().expect("config");
    let mut nobody = Nobody::spawn(as_nobody(None, TRY_SOCKET, &[socket.display().to_string(), "20".into()]));
    let answers = nobody.next();
    nobody.wait();
    let answers = answers.as_array().expect("answers").clone();
    assert_eq!(answers.len(), 20, "{answers:?}");
    for answer in &answers {
        let answer: serde_json::Value =
            serde_json::from_str(answer.as_str().unwrap_or_default()).unwrap_or_else(|e| panic!("{e}: {answer}"));
        assert_eq!(answer["status"], "failed", "{answer}");
        assert!(answer["error"].as_str().unwrap_or_default().contains("permission denied"), "{answer}");
    }
    let warned = rig.daemon.wait_for(|l| l.contains("control connection refused"), SIGNAL_TIMEOUT).expect("a warning");
    assert!(warned.contains("uid=65534"), "{warned}");
    assert!(!rig.ctl_ok(&["allow", "list"]).contains("0.0.0.0/0"), "nobody added an allow entry");
    assert_eq!(rig.scratch.config_file().expect("config"), before, "the config changed");
    rig.daemon.poll();
    let warnings = rig.daemon.lines().iter().filter(|(_, l)| l.contains("control connection refused")).count();
    assert_eq!(warnings, 1, "one warning for 20 refusals within 10 s:\n{}", rig.daemon.output());
}

/// The feeders' group (`--socket-group`, a number here: no group is added to the host) may
/// feed bans and read, and nothing else. The socket is 0660 and of that group; as a process of
/// uid 65534 and that group, the real `limiter-ctl` adds and removes a deny ban of origin
/// crowdsec and fail2ban, lists and reads stats; a policy change, an allow ban, a ban of origin
/// cli, a permanent entry and a reload are each refused in one line (exit 1), nothing changed.
/// nobody's own group gets nothing.
#[test]
fn the_socket_group_may_feed_bans_and_nothing_else() {
    require_root!();
    const FEEDERS: &str = "64999";
    let rig = Rig::start(&["--rotate-every", "off", "--metrics", "off", "--socket-group", FEEDERS]).expect("rig");
    let socket = rig.scratch.socket();
    let meta = std::fs::metadata(&socket).expect("the socket");
    assert_eq!(meta.permissions().mode() & 0o777, 0o660, "the socket's mode");
    assert_eq!(std::os::unix::fs::MetadataExt::gid(&meta).to_string(), FEEDERS, "the socket's group");
    // A copy nobody can run (the build tree may be closed to it), in the scratch directory (0755).
    let bin = rig.scratch.path().join("limiter-ctl");
    std::fs::copy(limiter_ctl_binary().expect("limiter-ctl"), &bin).expect("copying limiter-ctl");
    let before = rig.scratch.config_file().expect("config");
    let as_group = |group: &str, args: &[&str]| {
        let out = Command::new("setpriv")
            .args([&format!("--reuid={NOBODY}"), &format!("--regid={group}"), "--clear-groups"])
            .arg(&bin)
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .output()
            .expect("running limiter-ctl under setpriv");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for args in [
        &["deny", "add", "198.18.9.1", "--for", "10m", "--origin", "crowdsec"][..],
        &["deny", "add", "198.18.9.2", "--for", "10m", "--origin", "fail2ban"],
        &["deny", "rm", "198.18.9.2", "--origin", "fail2ban"],
        &["deny", "list"],
        &["stats"],
        &["policy", "list"],
    ] {
        let (code, _, stderr) = as_group(FEEDERS, args);
        assert_eq!(code, Some(0), "{args:?}: {stderr}");
    }
    let listed = rig.ctl_ok(&["deny", "list"]);
    assert!(listed.contains("198.18.9.1/32") && !listed.contains("198.18.9.2/32"), "{listed}");
    for args in [
        &["policy", "set", "web", "--match", "tcp:80", "--rate", "10/s"][..],
        &["allow", "add", "198.18.9.3", "--for", "10m", "--origin", "crowdsec"],
        &["deny", "add", "198.18.9.4", "--for", "10m"],
        &["deny", "rm", "198.18.9.1", "--origin", "cli"],
        &["deny", "add", "198.18.9.5/32"],
        &["reload"],
        &["salt", "rotate"],
    ] {
        let (code, _, stderr) = as_group(FEEDERS, args);
        assert_eq!(code, Some(1), "{args:?} let through: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains("the socket's group may only add and remove deny bans"), "{args:?}: {stderr}");
    }
    let (code, _, stderr) = as_group(NOBODY, &["stats"]);
    assert_eq!(code, Some(1), "nobody's own group let in: {stderr}");
    assert!(stderr.contains("permission denied"), "{stderr}");
    let listed = rig.ctl_ok(&["deny", "list"]);
    assert!(listed.contains("198.18.9.1/32"), "{listed}");
    for net in ["198.18.9.3", "198.18.9.4", "198.18.9.5"] {
        assert!(!listed.contains(net) && !rig.ctl_ok(&["allow", "list"]).contains(net), "{net} added:\n{listed}");
    }
    assert_eq!(rig.scratch.config_file().expect("config"), before, "the config changed");
    assert!(rig.ctl_ok(&["policy", "list"]).lines().all(|l| !l.contains("web")), "a policy was added");
}

/// Whether `text` holds a raw control character other than a newline or a tab.
fn raw_control(text: &str) -> bool {
    text.chars().any(|c| c.is_control() && c != '\n' && c != '\t')
}

/// A policy name carrying ESC (a colour sequence) and CR in the config file: `config check`,
/// `limiter-ctl reload` and the daemon's log line for the refusal each show it escaped
/// (`\u{1b}`, `\r`), never raw.
#[test]
fn control_characters_reach_neither_the_terminal_nor_the_log() {
    require_root!();
    let mut rig = Rig::start(&["--rotate-every", "off", "--metrics", "off"]).expect("starting the rig");
    let evil = "[[policy]]\nname = \"ev\\u001b[31mil\\rX\"\nmatch = \"any\"\nrate = \"10/s\"\n";
    std::fs::write(rig.scratch.config(), evil).expect("writing the config");
    let bin = limiter_ctl_binary().expect("limiter-ctl");
    let check =
        Ctl::run(Command::new(&bin).arg("config").arg("check").arg(rig.scratch.config())).expect("config check");
    assert_eq!(check.code, Some(2), "{check:?}");
    assert!(!raw_control(&check.stderr) && check.stderr.contains(r"ev\u{1b}[31mil\rX"), "{:?}", check.stderr);
    let reload = rig.daemon.ctl(&["reload"]).expect("reload");
    assert_eq!(reload.code, Some(2), "{reload:?}");
    assert!(!raw_control(&reload.stderr) && reload.stderr.contains(r"\u{1b}[31m"), "{:?}", reload.stderr);
    let refused = rig.daemon.wait_for(|l| l.contains("reload refused"), SIGNAL_TIMEOUT).expect("the refusal logged");
    assert!(!raw_control(&refused) && refused.contains(r"il\rX"), "{refused:?}");
    rig.daemon.poll();
    assert!(!raw_control(&rig.daemon.output()), "{:?}", rig.daemon.output());
}

/// SIGUSR1 (three of them) is logged and ignored: the daemon keeps serving and enforcing.
/// SIGUSR2 keeps its use: the daemon stops, exit 0, leaving the program attached and pinned.
#[test]
fn sigusr1_is_ignored_and_sigusr2_hands_over() {
    require_root!();
    let mut rig = Rig::start(&["--rotate-every", "off", "--metrics", "off"]).expect("starting the rig");
    let program = rig.daemon.program().expect("program");
    for _ in 0..3 {
        rig.daemon.signal(Signal::SIGUSR1).expect("SIGUSR1");
        rig.daemon.wait_for(|l| l.contains("SIGUSR1") && l.contains("ignored"), SIGNAL_TIMEOUT).expect("logged");
    }
    assert!(rig.daemon.is_running(), "the daemon died of SIGUSR1:\n{}", rig.daemon.output());
    rig.ctl_ok(&["deny", "add", "198.18.201.0/24"]);
    assert_eq!(rig.snapshot().rules.acl().get("198.18.201.0/24"), Some(&"deny"), "the kernel's deny list");
    rig.daemon.signal(Signal::SIGUSR2).expect("SIGUSR2");
    let status = rig.daemon.wait_exit(SIGNAL_TIMEOUT).expect("the daemon exits on SIGUSR2");
    assert!(status.success(), "{status}:\n{}", rig.daemon.output());
    assert!(rig.daemon.output().contains(LEFT), "{}", rig.daemon.output());
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(program), "the program left attached");
}

/// A daemon that never takes the connection (its backlog full): the CLI gives up within its
/// 30 s deadline, saying nothing was sent, instead of waiting forever in connect(2).
#[test]
fn the_cli_deadline_covers_the_connect() {
    use nix::sys::socket::{AddressFamily, Backlog, SockFlag, SockType, UnixAddr, bind, connect, listen, socket};
    let scratch = Scratch::new().expect("scratch directory");
    let socket_path = scratch.socket();
    let addr = UnixAddr::new(&socket_path).expect("address");
    let unix = |flags| socket(AddressFamily::Unix, SockType::Stream, flags, None).expect("socket");
    // A listener with a backlog of one that never accepts.
    let listener = unix(SockFlag::SOCK_CLOEXEC);
    bind(std::os::fd::AsRawFd::as_raw_fd(&listener), &addr).expect("bind");
    listen(&listener, Backlog::new(1).expect("backlog")).expect("listen");
    // Fill its backlog: non-blocking connects succeed until it is full.
    let mut queued = Vec::new();
    for _ in 0..64 {
        let fd = unix(SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC);
        match connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr) {
            Ok(()) => queued.push(fd),
            Err(_) => break,
        }
    }
    assert!(queued.len() < 64, "the backlog never filled");
    let socket = socket_path;
    let bin = limiter_ctl_binary().expect("limiter-ctl");
    let mut cli = Ctl::command(&bin, &socket, &["deny", "add", "198.18.202.0/24"]);
    let started = Instant::now();
    let mut child = cli.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("the CLI");
    let deadline = started + Duration::from_secs(45);
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    let took = started.elapsed();
    if matches!(child.try_wait(), Ok(None)) {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the CLI still waited after {took:?}");
    }
    let out = child.wait_with_output().expect("the CLI's output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("the CLI gave up after {took:?}: {}", stderr.trim());
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(took >= Duration::from_secs(29) && took < Duration::from_secs(40), "gave up after {took:?}");
    assert!(stderr.contains("did not take the connection") && stderr.contains("nothing was sent"), "{stderr}");
    drop((queued, listener));
}

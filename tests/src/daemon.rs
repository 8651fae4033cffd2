//! The real `limiter-ctl daemon` as a separate process in a test namespace, its CLI run against
//! its control socket, and its kernel maps read back: from its pins, decoded by the daemon's own
//! [`MapView`] ([`Snapshot`]), or through the program it attached (counters, buckets, config).
//!
//! Every daemon gets a [`Scratch`] of its own for the config file, the control socket and its
//! bpffs pins: tests never touch the defaults (`/etc/limiter/limiter.toml`,
//! `/run/limiter/ctl.sock`, `/sys/fs/bpf/limiter`), which belong to whatever limiter the machine
//! runs. Daemons are stopped with SIGINT by pid (on drop too, and when the test process dies);
//! a stopped daemon leaves its program attached and pinned, as a killed one does, and
//! [`Scratch`]'s drop removes the pins, which detaches the program (nothing holds it then).
//!
//! A daemon enters only the namespace's network namespace ([`Runner::NetOnly`], `nsenter
//! --net`): it shares the test's mount namespace, so its pins land on the machine's bpffs under
//! the scratch directory and outlive it when it is killed (fail static), for a restarted daemon
//! to adopt. [`Runner::PrivateMounts`] (`ip netns exec`) gives it a mount namespace and a /sys of
//! its own instead, where /sys/fs/bpf is not bpffs: the daemon must mount one, and its pins go
//! with it. [`Launch`] starts one any other way (another binary, socket or environment, or
//! wrapped in another command, such as a container's namespaces).

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Read},
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Once, mpsc},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use aya::{
    maps::{Array, Map, MapData, MapInfo, PerCpuArray},
    programs::{
        ProgramInfo,
        links::{FdLink, LinkType, PinnedLink},
        loaded_programs,
    },
};
use limiter_common::maps::{
    ACL_ALLOW, ACL_DENY, Config, Counters, MAP_BUCKETS, MAP_CONFIG, MAP_COUNTERS, MAP_LAYOUT, Policy,
};
use limiter_ctl::kernel::MapView;
use nix::{sys::signal::Signal, unistd::Pid};

use crate::{
    netns::{End, NETNS_DIR, PREFIX, Stale, stale},
    slowdown::stretch,
};

/// How long a daemon may take to load, attach and say so.
pub const ATTACH_TIMEOUT: Duration = Duration::from_secs(30);
/// The start of the line a daemon logs when it adopted a pinned limiter.
pub const ADOPTED: &str = "adopted the pinned limiter";
/// The start of the line a daemon logs when it took the place of a pinned limiter it could not
/// adopt (in its link, with fresh state).
pub const REPLACED: &str = "replaced the pinned limiter in place";
/// The start of the line a stopped daemon logs when it checked it left its program enforcing.
pub const LEFT: &str = "left attached and pinned";
/// How long a daemon gets to exit after SIGINT, or to log the outcome of a signal.
pub const SIGNAL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a daemon refusing its config at start gets to exit.
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(30);

/// `target/release/limiter-ctl`: the binary the package ships (`cargo xtask package` builds the
/// same one), found from the running test's `target/<profile>/deps/` directory. Not the debug
/// build next to the test: the tests hold what ships to its bounds (`cargo xtask test` builds the
/// release binary first).
pub fn limiter_ctl_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("finding the test executable")?;
    let target = exe.parent().and_then(Path::parent).and_then(Path::parent);
    let bin = target.map(|dir| dir.join("release").join("limiter-ctl"));
    match bin {
        Some(bin) if bin.is_file() => Ok(bin),
        _ => bail!(
            "the release limiter-ctl is not built (expected target/release/limiter-ctl beside {}): run `cargo build \
             --release -p limiter-ctl --bins` first, or `cargo xtask test`, which builds it",
            exe.display()
        ),
    }
}

/// A directory of our own under the system temp dir (`lmt-<pid>-...`) for the config and the
/// socket, and one of the same name on bpffs for the daemon's pins; both removed on drop. Mode
/// 0755, so an unprivileged process can reach the socket and meet the socket's own mode.
pub struct Scratch {
    dir: tempfile::TempDir,
    pins: PathBuf,
}

/// Where bpffs is mounted (the daemon mounts it there if it is not).
const BPFFS: &str = "/sys/fs/bpf";

impl Scratch {
    pub fn new() -> anyhow::Result<Self> {
        static SWEEP: Once = Once::new();
        SWEEP.call_once(remove_stale);
        let dir = tempfile::Builder::new()
            .prefix(&format!("{PREFIX}{}-", std::process::id()))
            .tempdir()
            .context("creating a scratch directory")?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("chmod 0755 {}", dir.path().display()))?;
        let name = dir.path().file_name().context("a temp dir has a name")?;
        let pins = Path::new(BPFFS).join(name);
        Ok(Self { dir, pins })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn config(&self) -> PathBuf {
        self.path().join("limiter.toml")
    }

    pub fn socket(&self) -> PathBuf {
        self.path().join("ctl.sock")
    }

    /// The daemon's `--pin-dir` (it pins under `<this>/<iface>/`).
    pub fn pins(&self) -> &Path {
        &self.pins
    }

    /// Where a daemon on `iface` pins its link and maps: `<pins>/<iface>/`.
    pub fn pin_dir(&self, iface: &str) -> PathBuf {
        self.pins.join(limiter_ctl::kernel::pin_dir_name(iface))
    }

    /// The pinned files under [`Scratch::pin_dir`] by name, with their inode numbers (a pin
    /// replaced by a new object gets a new inode); empty when nothing is pinned.
    pub fn pinned(&self, iface: &str) -> anyhow::Result<BTreeMap<String, u64>> {
        use std::os::unix::fs::MetadataExt as _;
        let dir = self.pin_dir(iface);
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
            Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
        };
        entries
            .map(|e| {
                let e = e?;
                Ok((e.file_name().to_string_lossy().into_owned(), e.metadata()?.ino()))
            })
            .collect()
    }

    /// `limiter-ctl detach --iface IFACE --pin-dir <pins>` run in `end`'s network namespace
    /// (where it can tell whether a program is still attached).
    pub fn detach(&self, end: &End) -> anyhow::Result<Ctl> {
        self.detach_with(end, &[])
    }

    /// [`Scratch::detach`] with more arguments (`--force`).
    pub fn detach_with(&self, end: &End, extra: &[&str]) -> anyhow::Result<Ctl> {
        let mut cmd = net_command(end, limiter_ctl_binary()?);
        cmd.args(["detach", "--iface", &end.iface]).arg("--pin-dir").arg(self.pins()).args(extra);
        Ctl::run(&mut cmd)
    }

    /// The config file's contents (None while it does not exist).
    pub fn config_file(&self) -> anyhow::Result<Option<String>> {
        match std::fs::read(self.config()) {
            Ok(bytes) => Ok(Some(String::from_utf8(bytes).context("the config is not UTF-8")?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", self.config().display())),
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // A daemon that stopped, or was killed, left its pins ("fail static"): removing them
        // releases the link, which detaches the program.
        remove_tree(&self.pins);
    }
}

fn remove_tree(path: &Path) {
    match std::fs::remove_dir_all(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => eprintln!("scratch: removing {}: {e}", path.display()),
    }
}

/// Removes scratch directories and pins of ours whose creating process is gone (a crashed run).
fn remove_stale() {
    for root in [std::env::temp_dir(), PathBuf::from(BPFFS)] {
        let Ok(leftovers) = stale(&root) else { continue };
        for Stale { path, pid, .. } in leftovers {
            eprintln!("scratch: removing {}, left behind by pid {pid} which is gone", path.display());
            remove_tree(&path);
        }
    }
}

/// How a daemon enters its namespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Runner {
    /// `nsenter --net=/run/netns/NS`: the network namespace only; mounts (and bpffs) are the
    /// test's own, so pins outlive the process.
    #[default]
    NetOnly,
    /// `ip netns exec NS`: a private mount namespace with the namespace's own /sys, on which
    /// /sys/fs/bpf is not bpffs; whatever the daemon mounts and pins there goes with it.
    PrivateMounts,
}

impl Runner {
    /// `program` to be run in `end`'s namespace this way (exec'd: the child's pid is the
    /// program's own, so signals sent to it reach the program).
    pub fn command(self, end: &End, program: impl AsRef<std::ffi::OsStr>) -> Command {
        match self {
            Self::PrivateMounts => end.command(program),
            Self::NetOnly => net_command(end, program),
        }
    }
}

/// `program` run in `end`'s network namespace only (`nsenter --net`, which execs it).
pub fn net_command(end: &End, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net={}", Path::new(NETNS_DIR).join(&end.ns).display())).arg("--").arg(program);
    cmd
}

/// What one CLI invocation did.
#[derive(Clone, Debug)]
pub struct Ctl {
    /// The exit code; None if a signal ended it.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Ctl {
    /// Runs `cmd` to completion, collecting its output.
    pub fn run(cmd: &mut Command) -> anyhow::Result<Self> {
        let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("running {cmd:?}"))?;
        Ok(Self {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// `limiter-ctl --socket SOCKET ARGS...`
    pub fn command(bin: &Path, socket: &Path, args: &[&str]) -> Command {
        let mut cmd = Command::new(bin);
        cmd.arg("--socket").arg(socket).args(args);
        cmd
    }

    pub fn stderr_lines(&self) -> Vec<&str> {
        self.stderr.lines().collect()
    }

    /// Its stdout if it exited 0; otherwise an error with everything it said.
    pub fn ok(self) -> anyhow::Result<String> {
        if self.code != Some(0) {
            bail!("exit {:?}; stderr: {}; stdout: {}", self.code, self.stderr.trim(), self.stdout.trim());
        }
        Ok(self.stdout)
    }
}

/// limiter-ctl running in a namespace, its stdout and stderr collected line by line (stderr
/// lines tagged `stderr: `). Dropping it kills the process (by its pid) if it is still running.
pub struct Daemon {
    child: Child,
    lines: mpsc::Receiver<(Instant, String)>,
    /// Every line collected so far, with when the harness read it.
    seen: Vec<(Instant, String)>,
    bin: PathBuf,
    socket: PathBuf,
    /// Where it pins its maps and link: [`Scratch::pin_dir`] of its interface.
    pins: PathBuf,
    /// The id of the XDP program it attached, once [`Daemon::wait_attached`] saw it.
    program: Option<u32>,
}

impl Daemon {
    /// `limiter-ctl --socket S daemon --iface IFACE --watch-config=false --config C --pin-dir P
    /// EXTRA...` (the release binary, [`limiter_ctl_binary`], in the default attach mode, auto)
    /// in `end`'s network namespace ([`Runner::NetOnly`]), with the socket, config and pins in
    /// `scratch`. Does not wait for it to attach.
    pub fn spawn(end: &End, scratch: &Scratch, extra: &[&str]) -> anyhow::Result<Self> {
        Self::spawn_with(Runner::NetOnly, end, scratch, extra)
    }

    /// [`Daemon::spawn`], entering the namespace the way `runner` says.
    pub fn spawn_with(runner: Runner, end: &End, scratch: &Scratch, extra: &[&str]) -> anyhow::Result<Self> {
        Self::launch(end, scratch, extra, Launch { runner, ..Launch::default() })
    }

    /// [`Daemon::spawn`], the way `launch` says.
    pub fn launch(end: &End, scratch: &Scratch, extra: &[&str], launch: Launch) -> anyhow::Result<Self> {
        let bin = match launch.bin {
            Some(bin) => bin,
            None => limiter_ctl_binary()?,
        };
        let socket = launch.socket.unwrap_or_else(|| scratch.socket());
        let mut cmd = launch.runner.command(end, &bin);
        cmd.arg("--socket").arg(&socket);
        // The watch off unless a test turns it on (`--watch-config=true` in `extra`, which comes
        // later and wins): tests of SIGHUP and `limiter-ctl reload` count the reloads their
        // writes cause, and the watch would add its own (tests/packaging/kubernetes.rs tests the watch).
        // No --mode: the default (auto) is what ships; on veth it attaches natively (tests that are
        // about a mode pass --mode in `extra`).
        cmd.args(["daemon", "--iface", &end.iface, "--watch-config=false"]);
        cmd.arg("--config").arg(launch.config.unwrap_or_else(|| scratch.config()));
        cmd.arg("--pin-dir").arg(launch.pin_dir.unwrap_or_else(|| scratch.pins().to_path_buf())).args(extra);
        if let Some(wrap) = launch.wrap {
            cmd = wrap(cmd);
        }
        cmd.envs(launch.env);
        // Should the test process die without dropping us, the daemon still stops (and unpins).
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| match libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGINT) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            });
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {} in {}", bin.display(), end.ns))?;
        let (tx, lines) = mpsc::channel();
        forward_lines(child.stdout.take(), "", tx.clone());
        forward_lines(child.stderr.take(), "stderr: ", tx);
        let pins = scratch.pin_dir(&end.iface);
        Ok(Self { child, lines, seen: Vec::new(), bin, socket, pins, program: None })
    }

    /// [`Daemon::spawn`], then [`Daemon::wait_attached`].
    pub fn start(end: &End, scratch: &Scratch, extra: &[&str]) -> anyhow::Result<Self> {
        let mut daemon = Self::spawn(end, scratch, extra)?;
        daemon.wait_attached(end)?;
        Ok(daemon)
    }

    /// [`Daemon::spawn`], then [`Daemon::wait_adopted`]: a restart on the pins a killed daemon
    /// left. Returns the daemon and its "adopted" line.
    pub fn adopt(end: &End, scratch: &Scratch, extra: &[&str]) -> anyhow::Result<(Self, String)> {
        let mut daemon = Self::spawn(end, scratch, extra)?;
        let line = daemon.wait_adopted(end)?;
        Ok((daemon, line))
    }

    /// Writes `config` to `scratch`'s config file and spawns a daemon on it ([`Daemon::spawn`]),
    /// which must refuse it: exit 2 within 30 s, having neither attached nor adopted, the file
    /// left as written. Returns everything the daemon said (stderr lines tagged `stderr: `).
    pub fn refused_start(end: &End, scratch: &Scratch, extra: &[&str], config: &str) -> anyhow::Result<String> {
        let path = scratch.config();
        std::fs::write(&path, config).with_context(|| format!("writing {}", path.display()))?;
        let mut daemon = Self::spawn(end, scratch, extra)?;
        let status = daemon.wait_exit(REFUSAL_TIMEOUT).context("the daemon should exit")?;
        let out = daemon.output();
        anyhow::ensure!(status.code() == Some(2), "exit status {status}, expected 2; output:\n{out}");
        anyhow::ensure!(!out.contains(ADOPTED) && !out.contains(" attached "), "the daemon attached:\n{out}");
        let now = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        anyhow::ensure!(now == config, "the file was rewritten:\n{now}");
        Ok(out)
    }

    /// Waits for the "attached" line, and finds the program on `end`'s interface. Returns the line.
    /// A daemon that adopted (or replaced) a pinned limiter instead fails this at once.
    pub fn wait_attached(&mut self, end: &End) -> anyhow::Result<String> {
        self.wait_started(end, " attached ")
    }

    /// Waits for the line saying it adopted a pinned limiter, and finds the program (its own,
    /// swapped into the pinned link) on `end`'s interface. Returns the line.
    pub fn wait_adopted(&mut self, end: &End) -> anyhow::Result<String> {
        self.wait_started(end, ADOPTED)
    }

    /// Waits for the line saying it replaced a pinned limiter it could not adopt.
    pub fn wait_replaced(&mut self, end: &End) -> anyhow::Result<String> {
        self.wait_started(end, REPLACED)
    }

    /// Waits for whichever start line it logs (attached afresh or adopted); returns it.
    pub fn wait_running(&mut self, end: &End) -> anyhow::Result<String> {
        let line = self.wait_for(is_start_line, ATTACH_TIMEOUT).context("waiting for the daemon to start")?;
        self.find_program(end, &line)?;
        self.wait_serving();
        Ok(line)
    }

    fn wait_started(&mut self, end: &End, want: &str) -> anyhow::Result<String> {
        let line = self.wait_for(is_start_line, ATTACH_TIMEOUT).with_context(|| format!("waiting for '{want}'"))?;
        anyhow::ensure!(line.contains(want), "expected a line with '{want}', the daemon said: {line}");
        self.find_program(end, &line)?;
        self.wait_serving();
        Ok(line)
    }

    /// Waits (at most 2 s) until the daemon answers on its socket. The start line comes before
    /// the rest of its start (the config file written, the watch's first read): an answer means
    /// that is done. Best effort: a daemon the harness cannot reach there (another `--socket`)
    /// is left to its test.
    fn wait_serving(&self) {
        let deadline = Instant::now() + stretch(Duration::from_secs(2));
        while Instant::now() < deadline && self.ctl_ok(&["policy", "list"]).is_err() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its program: the one in the link it pinned (at XDP or at tcx), or without a pinned link
    /// (pins only it sees, [`Runner::PrivateMounts`]) the XDP program on `end`'s interface.
    fn find_program(&mut self, end: &End, line: &str) -> anyhow::Result<()> {
        let program = match pinned_link(&self.pins)? {
            Some(link) => link.program,
            None => xdp_program_id(end)?
                .with_context(|| format!("the daemon said '{line}' but {} has no XDP program", end.iface))?,
        };
        self.program = Some(program);
        Ok(())
    }

    /// Finds its program again (after it moved to another hook, `limiter-ctl attach`): the one
    /// in its pinned link now. Returns its id.
    pub fn refind_program(&mut self) -> anyhow::Result<u32> {
        let link = pinned_link(&self.pins)?.with_context(|| format!("no link pinned in {}", self.pins.display()))?;
        self.program = Some(link.program);
        Ok(link.program)
    }

    /// The link it pinned, read now (None while none is pinned).
    pub fn link(&self) -> anyhow::Result<Option<PinnedLinkInfo>> {
        pinned_link(&self.pins)
    }

    /// The pid of the process the harness started (a wrapper, for a wrapped [`Launch`]).
    pub fn pid(&self) -> Pid {
        Pid::from_raw(self.child.id() as i32)
    }

    /// The pid of limiter-ctl itself: [`Daemon::pid`], or under a wrapper that forks (a pid
    /// namespace's `unshare --fork`), its descendant named limiter-ctl.
    pub fn daemon_pid(&self) -> Pid {
        let mut pid = self.child.id();
        for _ in 0..4 {
            if std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "limiter-ctl") {
                break;
            }
            let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
            match children.split_whitespace().next().and_then(|c| c.parse().ok()) {
                Some(child) => pid = child,
                None => break,
            }
        }
        Pid::from_raw(pid as i32)
    }

    pub fn program(&self) -> anyhow::Result<u32> {
        self.program.context("the daemon has not attached (call wait_attached first)")
    }

    /// `limiter-ctl --socket <this daemon's socket> ARGS...`
    pub fn ctl(&self, args: &[&str]) -> anyhow::Result<Ctl> {
        Ctl::run(&mut Ctl::command(&self.bin, &self.socket, args))
    }

    /// Like [`Daemon::ctl`], failing unless it exits 0; returns stdout.
    pub fn ctl_ok(&self, args: &[&str]) -> anyhow::Result<String> {
        self.ctl(args)?.ok().with_context(|| format!("limiter-ctl {}", args.join(" ")))
    }

    /// Sends `signal` to the daemon's pid ([`Daemon::daemon_pid`]).
    pub fn signal(&self, signal: Signal) -> anyhow::Result<()> {
        let pid = self.daemon_pid();
        nix::sys::signal::kill(pid, signal).with_context(|| format!("sending {signal} to {pid}"))
    }

    /// SIGKILL by pid (no chance to detach or unpin: what a crash or the OOM killer does), then
    /// the exit status, once reaped.
    pub fn kill(&mut self) -> anyhow::Result<ExitStatus> {
        self.signal(Signal::SIGKILL)?;
        self.wait_exit(Duration::from_secs(10))
    }

    /// The first line from now on matching `want`; fails (with the output so far) on timeout
    /// or exit.
    pub fn wait_for(&mut self, want: impl Fn(&str) -> bool, timeout: Duration) -> anyhow::Result<String> {
        self.wait_for_timed(want, timeout).map(|(_, line)| line)
    }

    /// [`Daemon::wait_for`], with when the line was read.
    pub fn wait_for_timed(
        &mut self,
        want: impl Fn(&str) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<(Instant, String)> {
        let timeout = stretch(timeout);
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((at, line)) => {
                    self.seen.push((at, line.clone()));
                    if want(&line) {
                        return Ok((at, line));
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    bail!("timed out after {timeout:?}; output:\n{}", self.output())
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.wait()?;
                    bail!("limiter-ctl exited ({status}); output:\n{}", self.output())
                }
            }
        }
    }

    /// SIGINT by pid, then the exit status.
    pub fn interrupt(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        self.signal(Signal::SIGINT)?;
        self.wait_exit(timeout)
    }

    /// SIGINT by pid; panics, with everything the daemon said, unless it exits 0 within
    /// [`SIGNAL_TIMEOUT`]. It leaves its program attached and pinned.
    #[track_caller]
    pub fn stop_ok(&mut self) {
        let pid = self.pid();
        let status = self.interrupt(SIGNAL_TIMEOUT).unwrap_or_else(|e| panic!("stopping limiter-ctl {pid}: {e:#}"));
        assert!(status.success(), "limiter-ctl exited with {status}; output:\n{}", self.output());
    }

    /// The exit status once the process exits (SIGKILL and an error if it does not in time);
    /// the rest of its output is collected.
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let timeout = stretch(timeout);
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                self.drain(Duration::from_secs(2));
                return Ok(status);
            }
            if Instant::now() >= deadline {
                self.child.kill().ok();
                self.child.wait().ok();
                bail!("limiter-ctl did not exit within {timeout:?}; output:\n{}", self.output());
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Collects output until the streams close (after exit) or `timeout`.
    fn drain(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while let Ok(line) = self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            self.seen.push(line);
        }
    }

    /// Collects whatever output has arrived, without waiting.
    pub fn poll(&mut self) {
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
    }

    /// Every line collected so far, with when the harness read it (a little after the daemon
    /// wrote it).
    pub fn lines(&self) -> &[(Instant, String)] {
        &self.seen
    }

    /// Everything it printed that a `wait_for`, `poll` or `wait_exit` has collected.
    pub fn output(&self) -> String {
        self.seen.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n")
    }

    /// Its kernel maps as it pinned them, read now (not under [`Runner::PrivateMounts`], whose
    /// pins only the daemon sees).
    pub fn maps(&self) -> anyhow::Result<Snapshot> {
        Snapshot::read(&self.pins)
    }

    /// The per-CPU counters of policy `id` (0: traffic no policy judged).
    pub fn counters(&self, id: u16) -> anyhow::Result<Vec<Counters>> {
        program_counters(self.program()?, id)
    }

    /// Every policy id's per-CPU counters.
    pub fn all_counters(&self) -> anyhow::Result<Vec<Vec<Counters>>> {
        read_counters(&program_maps(self.program()?)?)
    }

    /// The TATs of the current generation's buckets (`Config::generation`'s half of `BUCKETS`),
    /// per bucket, per CPU: CONFIG and BUCKETS opened once each.
    pub fn current_buckets(&self) -> anyhow::Result<Vec<Vec<u64>>> {
        let maps = program_maps(self.program()?)?;
        let config: Array<_, Config> = Array::try_from(map(&maps, MAP_CONFIG)?)?;
        let config = config.get(&0, 0)?;
        let buckets: PerCpuArray<_, u64> = PerCpuArray::try_from(map(&maps, MAP_BUCKETS)?)?;
        let count = config.bucket_mask + 1;
        let base = (config.generation & 1) * count;
        (base..base + count).map(|i| Ok(buckets.get(&i, 0)?.iter().copied().collect())).collect()
    }

    /// The TATs of both generations of the host-scope buckets (`HOST_BUCKETS`), in one read.
    pub fn host_buckets(&self) -> anyhow::Result<Vec<u64>> {
        let maps = program_maps(self.program()?)?;
        let buckets: Array<_, u64> = Array::try_from(map(&maps, limiter_common::maps::MAP_HOST_BUCKETS)?)?;
        buckets.iter().map(|v| Ok(v?)).collect()
    }
}

/// How long a daemon being dropped gets to stop on SIGINT before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(5);

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.is_running() && self.interrupt(STOP_GRACE).is_err() {
            // interrupt() already killed it if it would not stop.
            eprintln!("daemon {}: did not stop on SIGINT; killed", self.pid());
        }
    }
}

/// Whether a log line is one of those a daemon logs once it has attached (afresh, adopting, or
/// replacing).
fn is_start_line(line: &str) -> bool {
    line.contains(" attached iface=") || line.contains(ADOPTED) || line.contains(REPLACED)
}

/// How to start a daemon, beyond [`Daemon::spawn`]'s defaults.
#[derive(Default)]
pub struct Launch {
    pub runner: Runner,
    /// Another limiter-ctl binary (an installed package's).
    pub bin: Option<PathBuf>,
    /// Another control socket, config file or `--pin-dir` than the scratch directory's.
    pub socket: Option<PathBuf>,
    pub config: Option<PathBuf>,
    pub pin_dir: Option<PathBuf>,
    /// More environment (`NOTIFY_SOCKET`).
    pub env: Vec<(String, std::ffi::OsString)>,
    /// The command, wrapped in another that execs it in the end (a container's namespaces).
    #[allow(clippy::type_complexity)]
    pub wrap: Option<Box<dyn FnOnce(Command) -> Command>>,
}

fn forward_lines(stream: Option<impl Read + Send + 'static>, tag: &'static str, tx: mpsc::Sender<(Instant, String)>) {
    let Some(stream) = stream else { return };
    thread::spawn(move || {
        for line in BufReader::new(stream).lines().map_while(Result::ok) {
            if tx.send((Instant::now(), format!("{tag}{line}"))).is_err() {
                break;
            }
        }
    });
}

/// The id of the XDP program on `end`'s interface, from `ip -j -d link show`: the link's
/// `"xdp": {"mode": M, "prog": {"id": N, ...}, "attached": [{"mode": M, "prog": {...}}, ...]}`
/// (with programs in several modes only `attached` names them: the first one is taken).
pub fn xdp_program_id(end: &End) -> anyhow::Result<Option<u32>> {
    let json = end.ip(["-j", "-d", "link", "show", "dev", &end.iface])?;
    let links: Vec<serde_json::Value> = serde_json::from_str(&json).with_context(|| format!("ip -j link: {json}"))?;
    let Some(xdp) = links.iter().find_map(|l| l.get("xdp")) else { return Ok(None) };
    let id = xdp
        .get("prog")
        .or_else(|| xdp.pointer("/attached/0/prog"))
        .and_then(|p| p.get("id"))
        .and_then(serde_json::Value::as_u64)
        .with_context(|| format!("no program id in {xdp}"))?;
    Ok(Some(u32::try_from(id).with_context(|| format!("program id in {xdp}"))?))
}

/// A limiter's pinned link as the kernel describes it; at tc ingress through netlink (no link),
/// the program of its filter, pinned in the link's place.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PinnedLinkInfo {
    /// The link's id (0 for a filter's program).
    pub id: u32,
    /// The program in it.
    pub program: u32,
    /// `LinkType::Xdp` or `LinkType::Tcx`; `LinkType::Unspecified` for a filter's program.
    pub link_type: LinkType,
}

impl PinnedLinkInfo {
    /// Whether it is a filter's program (the limiter at tc ingress through netlink).
    pub fn is_filter(&self) -> bool {
        self.link_type == LinkType::Unspecified
    }
}

/// The link pinned at `<dir>/link` (`dir`: a [`Scratch::pin_dir`]), or the program pinned there
/// for a filter; None if nothing is pinned there.
pub fn pinned_link(dir: &Path) -> anyhow::Result<Option<PinnedLinkInfo>> {
    let path = dir.join("link");
    if !path.exists() {
        return Ok(None);
    }
    if limiter_ctl::kernel::pinned_is_program(&path).with_context(|| format!("opening {}", path.display()))? {
        let info = ProgramInfo::from_pin(&path).with_context(|| format!("program info of {}", path.display()))?;
        return Ok(Some(PinnedLinkInfo { id: 0, program: info.id(), link_type: LinkType::Unspecified }));
    }
    let link = FdLink::from(PinnedLink::from_pin(&path).with_context(|| format!("opening {}", path.display()))?);
    let info = link.info().with_context(|| format!("link info of {}", path.display()))?;
    let link_type = info.link_type().with_context(|| format!("link type of {}", path.display()))?;
    Ok(Some(PinnedLinkInfo { id: info.id(), program: info.program_id(), link_type }))
}

/// The maps of loaded program `program` (another process's), opened by id, by name.
fn program_maps(program: u32) -> anyhow::Result<BTreeMap<String, Map>> {
    let info = loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == program)
        .with_context(|| format!("no loaded program with id {program}"))?;
    let ids = info.map_ids()?.context("the kernel does not report a program's maps")?;
    ids.into_iter()
        .map(|id| {
            let name = MapInfo::from_id(id)?.name_as_str().unwrap_or_default().to_string();
            Ok((name, Map::from_map_data(MapData::from_id(id)?)?))
        })
        .collect()
}

/// The maps a daemon pinned in `dir` (its [`Scratch::pin_dir`]), opened by name. Read from the
/// pins, not through the program: the policy names are userspace's alone, the program has no
/// handle on them.
fn pinned_maps(dir: &Path) -> anyhow::Result<BTreeMap<String, Map>> {
    limiter_ctl::kernel::map_names()
        .map(|name| {
            let path = dir.join(name);
            let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
            Ok((name.to_string(), Map::from_map_data(data)?))
        })
        .collect()
}

fn map<'a>(maps: &'a BTreeMap<String, Map>, name: &str) -> anyhow::Result<&'a Map> {
    maps.get(name).with_context(|| format!("the program has no {name} map (it has {:?})", maps.keys()))
}

/// The per-CPU counters of policy `id` of loaded program `program`.
pub fn program_counters(program: u32, id: u16) -> anyhow::Result<Vec<Counters>> {
    let maps = program_maps(program)?;
    let m = map(&maps, MAP_COUNTERS)?;
    if map_value_size(m) == Some(OLDER_COUNTERS * 8) {
        let counters: PerCpuArray<_, [u64; OLDER_COUNTERS as usize]> = PerCpuArray::try_from(m)?;
        return Ok(counters.get(&u32::from(id), 0)?.iter().map(older).collect());
    }
    let counters: PerCpuArray<_, Counters> = PerCpuArray::try_from(m)?;
    Ok(counters.get(&u32::from(id), 0)?.iter().copied().collect())
}

/// The layout version of the maps pinned in `dir` (a [`Scratch::pin_dir`]), from its LAYOUT map.
pub fn pinned_layout(dir: &Path) -> anyhow::Result<u64> {
    let path = dir.join(MAP_LAYOUT);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    let layout: Array<_, u64> = Array::try_from(Map::Array(data))?;
    Ok(layout.get(&0, 0)?)
}

/// The counters map of loaded program `program`, held open: the map lives as long as this does,
/// so the counters of a program that a replacement unloaded (with its maps) stay readable.
pub fn hold_counters(program: u32) -> anyhow::Result<HeldCounters> {
    let mut maps = program_maps(program)?;
    let map = maps.remove(MAP_COUNTERS).with_context(|| format!("program {program} has no {MAP_COUNTERS} map"))?;
    // An older release's counters (layout 5 and before) lack the last field: its first 13.
    if map_value_size(&map) == Some(OLDER_COUNTERS * 8) {
        return Ok(HeldCounters::Older(PerCpuArray::try_from(map)?));
    }
    Ok(HeldCounters::Current(PerCpuArray::try_from(map)?))
}

/// How many u64 counters an older release's `Counters` held (before `overruled_packets`).
const OLDER_COUNTERS: u32 = 13;

fn map_value_size(map: &Map) -> Option<u32> {
    let data = match map {
        Map::PerCpuArray(data) => data,
        _ => return None,
    };
    data.info().ok().map(|info| info.value_size())
}

/// See [`hold_counters`].
pub enum HeldCounters {
    Current(PerCpuArray<MapData, Counters>),
    Older(PerCpuArray<MapData, [u64; OLDER_COUNTERS as usize]>),
}

impl HeldCounters {
    /// The per-CPU counters of policy `id`, read now.
    pub fn read(&self, id: u16) -> anyhow::Result<Vec<Counters>> {
        Ok(match self {
            Self::Current(map) => map.get(&u32::from(id), 0)?.iter().copied().collect(),
            Self::Older(map) => map.get(&u32::from(id), 0)?.iter().map(older).collect(),
        })
    }
}

/// An older release's counters (the fields before `overruled_packets`, in order).
fn older(v: &[u64; OLDER_COUNTERS as usize]) -> Counters {
    Counters {
        admitted_packets: v[0],
        admitted_bytes: v[1],
        refused_packets: v[2],
        refused_bytes: v[3],
        dry_run_packets: v[4],
        dry_run_bytes: v[5],
        allowed_packets: v[6],
        denied_packets: v[7],
        not_ip: v[8],
        malformed: v[9],
        unmatched: v[10],
        errors: v[11],
        unreadable_ports: v[12],
        overruled_packets: 0,
    }
}

/// What the daemon told the kernel: everything a command may change except the counters, as the
/// daemon itself reads it back ([`MapView`]: the active policies with their names, where each
/// class and port goes, the allow and deny entries), and the whole config.
#[derive(Clone, PartialEq)]
pub struct Rules {
    pub config: Config,
    pub view: MapView,
}

impl Rules {
    /// The same rules with the salt and when it was drawn cleared: a restarted daemon draws a
    /// new one.
    pub fn unsalted(&self) -> Self {
        let mut rules = self.clone();
        rules.config.salts = Default::default();
        rules.config.rotated_at_ns = 0;
        rules
    }

    /// The active policy with this id.
    pub fn policy(&self, id: u16) -> anyhow::Result<&Policy> {
        self.view.policies.get(&id).map(|(policy, _)| policy).with_context(|| {
            format!("no active policy {id} in the kernel: {:?}", self.view.policies.keys().collect::<Vec<_>>())
        })
    }

    /// The allow and deny entries, "ADDR/LEN" -> "allow" | "deny" (both families).
    pub fn acl(&self) -> BTreeMap<String, &'static str> {
        let action = |a| match a {
            ACL_ALLOW => "allow",
            ACL_DENY => "deny",
            _ => "unknown",
        };
        self.view.acl.iter().map(|(net, a)| (net.to_string(), action(*a))).collect()
    }
}

/// The view's port table has an entry for every port of every class: only those that lead to a
/// policy are shown.
impl std::fmt::Debug for Rules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ports: BTreeMap<usize, u16> =
            self.view.routes.ports.iter().enumerate().filter(|(_, id)| **id != 0).map(|(i, id)| (i, *id)).collect();
        let policies: BTreeMap<u16, (String, &Policy)> = self
            .view
            .policies
            .iter()
            .map(|(id, (policy, name))| {
                (*id, (String::from_utf8_lossy(name).trim_end_matches('\0').to_string(), policy))
            })
            .collect();
        f.debug_struct("Rules")
            .field("config", &self.config)
            .field("policies", &policies)
            .field("ports (class << 16 | port)", &ports)
            .field("acl", &self.acl())
            .finish()
    }
}

/// A daemon's kernel maps at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub rules: Rules,
    /// Per policy id, per CPU.
    pub counters: Vec<Vec<Counters>>,
}

impl Snapshot {
    /// The maps a daemon pinned in `dir` (its [`Scratch::pin_dir`]), whether it still runs or not.
    pub fn read(dir: &Path) -> anyhow::Result<Self> {
        let maps = pinned_maps(dir)?;
        let config: Array<_, Config> = Array::try_from(map(&maps, MAP_CONFIG)?)?;
        let view = MapView::read_maps(|name| maps.get(name))?;
        let rules = Rules { config: config.get(&0, 0)?, view };
        Ok(Self { rules, counters: read_counters(&maps)? })
    }

    /// The counters of policy `id`, summed over CPUs.
    pub fn total(&self, id: u16) -> Counters {
        self.counters.get(usize::from(id)).map_or_else(Counters::default, |c| crate::bounds::total(c))
    }
}

fn read_counters(maps: &BTreeMap<String, Map>) -> anyhow::Result<Vec<Vec<Counters>>> {
    let m = map(maps, MAP_COUNTERS)?;
    if map_value_size(m) == Some(OLDER_COUNTERS * 8) {
        let counters: PerCpuArray<_, [u64; OLDER_COUNTERS as usize]> = PerCpuArray::try_from(m)?;
        return counters.iter().map(|c| Ok(c?.iter().map(older).collect())).collect();
    }
    let counters: PerCpuArray<_, Counters> = PerCpuArray::try_from(m)?;
    counters.iter().map(|c| Ok(c?.iter().copied().collect())).collect()
}

/// Overwrites the CONFIG of loaded program `program` (another process's): for fault injection.
pub fn write_program_config(program: u32, config: &Config) -> anyhow::Result<()> {
    let mut maps = program_maps(program)?;
    let map = maps.remove(MAP_CONFIG).with_context(|| format!("the program has no {MAP_CONFIG} map"))?;
    let mut array: Array<_, Config> = Array::try_from(map)?;
    array.set(0, config, 0)?;
    Ok(())
}

/// Whether a program with this id is still loaded.
pub fn program_loaded(program: u32) -> bool {
    loaded_programs().filter_map(Result::ok).any(|p| p.id() == program)
}

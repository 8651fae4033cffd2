//! `cargo xtask demo`: the daemon protecting one end of a veth pair, a flood from the other.
//!
//! Builds limiter-ctl and limiter-flood (release), creates two namespaces joined by a veth pair
//! (named `lmt-<pid>-demo-r|s`, the prefix and pid convention the tests use, so either side's
//! leftovers from a crashed run are recognised and removed), starts the daemon on the receiver
//! side and streams its once-a-second stats, floods from the sender side, then stops the daemon
//! with SIGINT and compares offered, admitted and configured rates. Ctrl-C at any point stops the
//! children and removes the namespaces.

use std::{
    fs::File,
    io::{BufRead as _, BufReader},
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};

use crate::sh::{cargo, describe, exec, target_dir};

#[derive(clap::Args)]
pub struct Args {
    /// Sustained rate per source the daemon enforces (N/s, N/min, N/h).
    #[arg(long, default_value = "1000/s")]
    rate: String,
    /// Packets a source may send at once.
    #[arg(long, default_value_t = 100)]
    burst: u64,
    /// How long to flood, in seconds.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=60))]
    seconds: u64,
}

const PREFIX: &str = "lmt-";
const NETNS_DIR: &str = "/run/netns";
const RX_MAC: &str = "02:6c:6d:74:00:01";
const TX_MAC: &str = "02:6c:6d:74:00:02";
const RX_ADDR: &str = "198.18.0.1";
const TX_ADDR: &str = "198.18.0.2";
/// The discard port: nothing listens, the receiver's kernel just drops what gets through.
const DPORT: &str = "9";

/// Set by SIGINT/SIGTERM; every wait below polls it.
static STOP: AtomicBool = AtomicBool::new(false);

pub fn run(args: Args) -> anyhow::Result<()> {
    ensure!(
        crate::setup::is_root(),
        "the demo creates network namespaces and loads XDP: run `sudo -E cargo xtask demo`"
    );
    crate::setup::build()?;
    exec(cargo().args(["build", "--release", "-p", "limiter-ctl", "-p", "limiter-tests", "--bins"]))?;
    let release = target_dir().join("release");
    let (ctl, flood) = (release.join("limiter-ctl"), release.join("limiter-flood"));
    for bin in [&ctl, &flood] {
        ensure!(bin.is_file(), "{} was not built", bin.display());
    }
    catch_signals();
    remove_stale();
    let net = Net::create()?;
    demo(&args, &net, &ctl, &flood)
    // `net` drops here, on success and on error alike: the namespaces go.
}

fn demo(args: &Args, net: &Net, ctl: &Path, flood_bin: &Path) -> anyhow::Result<()> {
    let burst = args.burst.to_string();
    // The demo's daemon keeps its config and socket in a scratch directory, not /etc and /run.
    let scratch = ScratchDir::new()?;
    let mut daemon = Proc::spawn(
        "daemon",
        net.rx
            .command(ctl)
            .args(["daemon", "--iface", &net.rx.iface, "--rate", &args.rate, "--burst", &burst])
            .arg("--config")
            .arg(scratch.0.join("limiter.toml"))
            .arg("--socket")
            .arg(scratch.0.join("ctl.sock"))
            .args(["--metrics", "off"])
            .args(["--stats-every", "1s"]),
    )?;
    let stats = daemon.stream();
    wait_until("the daemon to attach", Duration::from_secs(60), || {
        daemon.exited()?;
        Ok(stats.attached())
    })?;

    let cpu = thread::available_parallelism().map_or(0, |n| n.get() - 1);
    let seconds = args.seconds.to_string();
    let mut flood = Proc::spawn(
        "flood",
        net.tx
            .command(flood_bin)
            .args(["--iface", &net.tx.iface, "--dst-mac", RX_MAC, "--dst", RX_ADDR, "--dport", DPORT])
            .args(["--src", TX_ADDR, "--duration", &seconds, "--count", "100000000", "--cpu", &cpu.to_string()]),
    )?;
    let flood_out = flood.stream();
    let started = Instant::now();
    wait_until("the flood to finish", Duration::from_secs(args.seconds + 30), || flood.finished())?;
    let ended = Instant::now();
    // One more stats interval, so the last whole second of the flood is reported.
    wait_until("the last stats line", Duration::from_millis(1500), || Ok(stats.last_at().is_some_and(|t| t > ended)))?;
    daemon.interrupt(Duration::from_secs(10))?;

    let offered = flood_out.lines().iter().find_map(|l| field(l, "pps")).context("the flood printed no summary")?;
    summary(args, offered, &stats.during(started, ended));
    Ok(())
}

fn summary(args: &Args, offered_pps: f64, admitted: &[f64]) {
    println!();
    println!("demo: one source offered {offered_pps:.0} packets/s for {} s", args.seconds);
    if admitted.is_empty() {
        println!("demo: no whole stats second fell inside the flood");
        return;
    }
    let mean = admitted.iter().sum::<f64>() / admitted.len() as f64;
    let shown: Vec<String> = admitted.iter().map(|a| format!("{a:.0}")).collect();
    println!("demo: the daemon admitted {mean:.0}/s ([{}] over whole seconds inside the flood)", shown.join(", "));
    println!(
        "demo: configured {} with burst {}; {:.2}% of the offered load got through",
        args.rate,
        args.burst,
        100.0 * mean / offered_pps.max(1.0)
    );
}

// ---------------------------------------------------------------------------------------------
// Processes

/// A child in its own process group (so Ctrl-C reaches only xtask, which then stops the
/// children in order); killed by its pid on drop if still running.
struct Proc {
    name: &'static str,
    child: Child,
}

impl Proc {
    fn spawn(name: &'static str, cmd: &mut Command) -> anyhow::Result<Self> {
        eprintln!("+ {}", describe(cmd));
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("could not start `{}`", describe(cmd)))?;
        Ok(Self { name, child })
    }

    /// Echoes the child's stdout as `name | line` and keeps what it parses.
    fn stream(&mut self) -> Output {
        let output = Output::default();
        if let Some(stdout) = self.child.stdout.take() {
            let (name, sink) = (self.name, output.clone());
            thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    println!("{name:>6} | {line}");
                    sink.push(line);
                }
            });
        }
        output
    }

    /// Fails if the child has exited (with its status).
    fn exited(&mut self) -> anyhow::Result<()> {
        match self.child.try_wait()? {
            Some(status) => bail!("{} exited early ({status})", self.name),
            None => Ok(()),
        }
    }

    /// True once the child exited successfully; an error if it failed.
    fn finished(&mut self) -> anyhow::Result<bool> {
        match self.child.try_wait()? {
            Some(status) if status.success() => Ok(true),
            Some(status) => bail!("{} failed ({status})", self.name),
            None => Ok(false),
        }
    }

    /// SIGINT by pid, then waits for a clean exit.
    fn interrupt(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let pid = i32::try_from(self.child.id())?;
        if unsafe { libc::kill(pid, libc::SIGINT) } != 0 {
            return Err(std::io::Error::last_os_error()).context(format!("SIGINT to {} ({pid})", self.name));
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                ensure!(status.success(), "{} exited with {status} after SIGINT", self.name);
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "{} did not exit within {timeout:?} of SIGINT", self.name);
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SIGINT first: the daemon detaches on it; SIGKILL if it does not go.
            if self.interrupt(Duration::from_secs(5)).is_err() {
                self.child.kill().ok();
                self.child.wait().ok();
            }
        }
    }
}

/// Lines a child printed, with when each arrived.
#[derive(Clone, Default)]
struct Output(Arc<Mutex<Vec<(Instant, String)>>>);

impl Output {
    fn push(&self, line: String) {
        if let Ok(mut lines) = self.0.lock() {
            lines.push((Instant::now(), line));
        }
    }

    fn lines(&self) -> Vec<String> {
        self.0.lock().map(|l| l.iter().map(|(_, s)| s.clone()).collect()).unwrap_or_default()
    }

    fn attached(&self) -> bool {
        self.lines().iter().any(|l| l.contains(" attached "))
    }

    fn last_at(&self) -> Option<Instant> {
        self.0.lock().ok()?.iter().rev().find(|(_, l)| l.contains(" stats ")).map(|(t, _)| *t)
    }

    /// admitted_per_s of the stats lines whose whole second lies inside [start, end].
    fn during(&self, start: Instant, end: Instant) -> Vec<f64> {
        let Ok(lines) = self.0.lock() else { return Vec::new() };
        lines
            .iter()
            .filter(|(t, l)| l.contains(" stats ") && *t >= start + Duration::from_secs(1) && *t <= end)
            .filter_map(|(_, l)| field(l, "admitted_per_s"))
            .collect()
    }
}

/// The number after `name=` in a log line (tracing quotes string fields: `name="1000"`).
fn field(line: &str, name: &str) -> Option<f64> {
    let start = line.find(&format!("{name}="))? + name.len() + 1;
    let value: String =
        line[start..].trim_start_matches('"').chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    value.parse().ok()
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if STOP.load(Ordering::Relaxed) {
            bail!("interrupted while waiting for {what}");
        }
        if done()? {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        thread::sleep(Duration::from_millis(20));
    }
}

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Ctrl-C and SIGTERM set STOP instead of killing xtask, so it can clean up.
fn catch_signals() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

// ---------------------------------------------------------------------------------------------
// Namespaces

/// One side: a namespace and its veth end.
struct Side {
    ns: String,
    iface: String,
}

impl Side {
    fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns]).arg(program);
        cmd
    }

    fn ip(&self, args: &[&str]) -> anyhow::Result<()> {
        ip(&[&["-n", &self.ns], args].concat())
    }
}

/// Receiver and sender namespaces joined by a veth pair; deleted on drop.
struct Net {
    rx: Side,
    tx: Side,
}

impl Net {
    fn create() -> anyhow::Result<Self> {
        let pid = std::process::id();
        let side = |s: char| Side { ns: format!("{PREFIX}{pid}-demo-{s}"), iface: format!("lmt{pid}d{s}") };
        let net = Self { rx: side('r'), tx: side('s') };
        // Dropping `net` on any error below removes what was made.
        let (rx, tx) = (&net.rx, &net.tx);
        for side in [rx, tx] {
            ip(&["netns", "add", &side.ns])?;
            sysctls(&side.ns, QUIET_IPV6)?;
        }
        rx.ip(&[
            "link", "add", &rx.iface, "address", RX_MAC, "type", "veth", "peer", "name", &tx.iface, "address", TX_MAC,
            "netns", &tx.ns,
        ])?;
        for (side, addr) in [(rx, RX_ADDR), (tx, TX_ADDR)] {
            side.ip(&["addr", "add", &format!("{addr}/15"), "dev", &side.iface])?;
            side.ip(&["link", "set", &side.iface, "up"])?;
        }
        // The receiver answers the flood with ICMP port unreachable: no ARP exchange for that.
        rx.ip(&["neigh", "replace", TX_ADDR, "lladdr", TX_MAC, "dev", &rx.iface, "nud", "permanent"])?;
        Ok(net)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in [&self.rx.ns, &self.tx.ns] {
            if Path::new(NETNS_DIR).join(ns).exists()
                && let Err(e) = ip(&["netns", "delete", ns])
            {
                eprintln!("demo: {e:#}");
            }
        }
    }
}

/// Keeps the link silent but for the flood, as the tests' fixture does: a stray packet from the
/// sender's kernel would pull the receiver's XDP onto another CPU, whose buckets (per CPU) hold
/// a fresh allowance, and the admitted rate would briefly show more than the configured one.
const QUIET_IPV6: &[(&str, &str)] = &[
    ("net/ipv6/conf/default/accept_dad", "0"),
    ("net/ipv6/conf/default/router_solicitations", "0"),
    ("net/ipv6/conf/default/addr_gen_mode", "1"),
    ("net/ipv6/conf/default/mldv1_unsolicited_report_interval", "1"),
    ("net/ipv6/conf/default/mldv2_unsolicited_report_interval", "1"),
];

/// Writes sysctls of namespace `ns` from a thread that joined it (`/proc/sys/net` follows the
/// writing thread's namespace).
fn sysctls(ns: &str, settings: &[(&str, &str)]) -> anyhow::Result<()> {
    let path = Path::new(NETNS_DIR).join(ns);
    let write = || -> anyhow::Result<()> {
        let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(std::io::Error::last_os_error()).context(format!("setns into {ns}"));
        }
        for (key, value) in settings {
            std::fs::write(Path::new("/proc/sys").join(key), value).with_context(|| format!("{ns}: sysctl {key}"))?;
        }
        Ok(())
    };
    thread::scope(|scope| scope.spawn(write).join()).map_err(|_| anyhow::anyhow!("the sysctl thread panicked"))?
}

/// Deletes namespaces of ours (`lmt-<pid>-...`) whose creating process is gone.
fn remove_stale() {
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else { return };
    for name in entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()) {
        let pid = name.strip_prefix(PREFIX).and_then(|r| r.split('-').next()).and_then(|p| p.parse::<u32>().ok());
        if let Some(pid) = pid.filter(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            eprintln!("demo: deleting {name}, left behind by pid {pid} which is gone");
            ip(&["netns", "delete", &name]).ok();
        }
    }
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let mut cmd = Command::new("ip");
    cmd.args(args);
    let out = cmd.output().with_context(|| format!("could not run `{}` (is iproute2 installed?)", describe(&cmd)))?;
    if !out.status.success() {
        bail!("`{}` failed: {}", describe(&cmd), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// A directory under the system temp dir, removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!("{PREFIX}{}-demo", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

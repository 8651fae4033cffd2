//! `limiter-demo` (run by `cargo xtask demo`): the daemon protecting one end of a veth pair, a
//! flood from the other.
//!
//! Creates the harness's two namespaces joined by a veth pair ([`TestNet`]: `lmt-<pid>-...`, so
//! a crashed run's leftovers are recognised and removed), starts `limiter-ctl daemon` on the
//! receiver side and streams its once-a-second stats, floods from the sender side with
//! `limiter-flood`, then stops the daemon with SIGINT and compares offered, admitted and
//! configured rates. Both programs are taken from this binary's own directory (`cargo build
//! --release -p limiter-ctl -p limiter-tests --bins` puts all three there). Ctrl-C or SIGTERM at
//! any point stops the children and removes the namespaces.

use std::{
    ffi::c_int,
    io::{BufRead as _, BufReader},
    os::unix::process::CommandExt as _,
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
use clap::Parser;
use limiter_tests::{
    cpu::flood_cpu,
    daemon::{Runner, Scratch},
    netns::{TestNet, mac_str},
};
use nix::{
    sys::signal::{SigHandler, Signal, kill, signal},
    unistd::Pid,
};

#[derive(Parser)]
#[command(name = "limiter-demo", about = "Two namespaces, the daemon on one side, a flood from the other")]
struct Args {
    /// Sustained rate per source the daemon enforces (N/s, N/min, N/h).
    #[arg(long, default_value = "1000/s")]
    rate: String,
    /// Packets a source may send at once.
    #[arg(long, default_value_t = 100)]
    burst: u64,
    /// How long to flood, in seconds.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=60))]
    seconds: u64,
    /// The limiter-ctl to run [default: the one next to this program].
    #[arg(long)]
    ctl: Option<PathBuf>,
}

/// The discard port: nothing listens, the receiver's kernel just drops what gets through.
const DPORT: u16 = 9;

/// Set by SIGINT/SIGTERM; every wait below polls it.
static STOP: AtomicBool = AtomicBool::new(false);

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let ctl = match &args.ctl {
        Some(path) => path.clone(),
        None => sibling("limiter-ctl")?,
    };
    let flood = sibling("limiter-flood")?;
    catch_signals()?;
    // Sweeps namespaces of crashed runs first; dropped at the end of `main`, on success and on
    // error alike, which deletes the namespaces.
    let net = TestNet::new()?;
    demo(&args, &net, &ctl, &flood)
}

/// `name`, built next to this binary.
fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let bin = exe.with_file_name(name);
    ensure!(
        bin.is_file(),
        "{} was not built (run `cargo build --release -p limiter-ctl -p limiter-tests --bins`, or `cargo xtask demo`)",
        bin.display()
    );
    Ok(bin)
}

fn demo(args: &Args, net: &TestNet, ctl: &Path, flood_bin: &Path) -> anyhow::Result<()> {
    let (rx, tx) = (&net.receiver, &net.sender);
    let burst = args.burst.to_string();
    // The demo's daemon keeps its config, socket and pins in a scratch directory, not /etc, /run
    // and /sys/fs/bpf/limiter; it gets a mount namespace (and so a bpffs) of its own.
    let scratch = Scratch::new()?;
    let mut daemon = Proc::spawn(
        "daemon",
        Runner::PrivateMounts
            .command(rx, ctl)
            .args(["daemon", "--iface", &rx.iface, "--rate", &args.rate, "--burst", &burst])
            .arg("--config")
            .arg(scratch.config())
            .arg("--socket")
            .arg(scratch.socket())
            .arg("--pin-dir")
            .arg(scratch.pins())
            .args(["--metrics", "off"])
            .args(["--stats-every", "1s"]),
    )?;
    let stats = daemon.stream();
    wait_until("the daemon to attach", Duration::from_secs(60), || {
        daemon.exited()?;
        Ok(stats.attached())
    })?;

    let seconds = args.seconds.to_string();
    let mut flood = Proc::spawn(
        "flood",
        tx.command(flood_bin)
            .args(["--iface", &tx.iface, "--dst-mac", &mac_str(&rx.mac), "--dst", &rx.v4.to_string()])
            .args(["--dport", &DPORT.to_string(), "--src", &tx.v4.to_string(), "--duration", &seconds])
            // Bounded by time: its packet cap is far beyond what the duration takes on any machine.
            .args(["--cpu", &flood_cpu().to_string()]),
    )?;
    let flood_out = flood.stream();
    let started = Instant::now();
    wait_until("the flood to finish", Duration::from_secs(args.seconds + 30), || flood.finished())?;
    let ended = Instant::now();
    // One more stats interval, so the last whole second of the flood is reported.
    wait_until("the last stats line", Duration::from_millis(1500), || Ok(stats.last_at().is_some_and(|t| t > ended)))?;
    daemon.interrupt(Duration::from_secs(10))?;

    let line =
        flood_out.lines().into_iter().find(|l| l.starts_with("flood ")).context("the flood printed no summary")?;
    let offered = field(&line, "pps").context("the flood's summary has no pps")?;
    let sender = word(&line, "sender").unwrap_or("unnamed");
    summary(args, offered, sender, &stats.during(started, ended));
    Ok(())
}

fn summary(args: &Args, offered_pps: f64, sender: &str, admitted: &[f64]) {
    println!();
    println!("demo: one source offered {offered_pps:.0} packets/s for {} s, sent by {sender}", args.seconds);
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

/// A child in its own process group (so Ctrl-C reaches only the demo, which then stops the
/// children in order); stopped by its pid on drop if still running, and sent SIGINT by the
/// kernel should the demo die first.
struct Proc {
    name: &'static str,
    child: Child,
}

impl Proc {
    fn spawn(name: &'static str, cmd: &mut Command) -> anyhow::Result<Self> {
        eprintln!("+ {}", describe(cmd));
        // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(|| match libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGINT) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            });
        }
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
        let pid = Pid::from_raw(i32::try_from(self.child.id())?);
        kill(pid, Signal::SIGINT).with_context(|| format!("SIGINT to {} ({pid})", self.name))?;
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

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program()).chain(cmd.get_args()).map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
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

/// The word after `name=` in a line.
fn word<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
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

extern "C" fn on_signal(_: c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Ctrl-C and SIGTERM set STOP instead of killing the demo, so it can clean up.
fn catch_signals() -> anyhow::Result<()> {
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { signal(sig, SigHandler::Handler(on_signal)) }.with_context(|| format!("catching {sig}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{field, word};

    #[test]
    fn field_reads_plain_and_quoted_numbers() {
        let line = "INFO stats admitted_per_s=995 refused_per_s=\"729982\"";
        assert_eq!(field(line, "admitted_per_s"), Some(995.0));
        assert_eq!(field(line, "refused_per_s"), Some(729_982.0));
        assert_eq!(field("flood sent=1 pps=716326.5", "pps"), Some(716_326.5));
        assert_eq!(field(line, "missing"), None);
        assert_eq!(word("flood sent=1 pps=2 sender=packet-ring sources=1", "sender"), Some("packet-ring"));
        assert_eq!(word("flood sent=1", "sender"), None);
    }
}

//! `cargo xtask test --stress`: the integration tests survive a slower or busier machine. It
//! runs them with the flood generator throttled to half its speed, then with a busy loop on
//! every core, then three times in a row, and prints per mode whether they passed, how long
//! they took and how fast the generator went (every flood appends its report to a log:
//! `target/stress/MODE.floods`).

use std::{
    fs,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::sh::{cargo, describe, exec, target_dir};

/// What the flood generators read (see `limiter_tests::flood`).
const THROTTLE_ENV: &str = "LIMITER_FLOOD_THROTTLE";
const FLOOD_LOG_ENV: &str = "LIMITER_FLOOD_LOG";

/// One way of stressing the machine.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Stress {
    HalfSpeed,
    BusyCores,
    Repeat(u32),
}

impl Stress {
    fn name(self) -> String {
        match self {
            Self::HalfSpeed => "generator at half speed".into(),
            Self::BusyCores => "busy loop on every core".into(),
            Self::Repeat(i) => format!("in a row, run {i} of 3"),
        }
    }

    fn file(self) -> String {
        match self {
            Self::HalfSpeed => "half-speed".into(),
            Self::BusyCores => "busy-cores".into(),
            Self::Repeat(i) => format!("repeat-{i}"),
        }
    }
}

struct Outcome {
    mode: Stress,
    passed: bool,
    took: Duration,
    floods: Floods,
}

/// Runs `targets` (limiter-tests' test targets) in every mode; fails if any mode failed.
pub fn run(targets: &[&str], filter: &[String]) -> anyhow::Result<()> {
    exec(&mut super::release_binary())?;
    exec(cargo().args(["test", "--package", "limiter-tests", "--no-run"]).args(super::test_args(targets)))?;
    let dir = target_dir().join("stress");
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let modes = [Stress::HalfSpeed, Stress::BusyCores, Stress::Repeat(1), Stress::Repeat(2), Stress::Repeat(3)];
    let mut outcomes = Vec::new();
    for mode in modes {
        let log = dir.join(format!("{}.floods", mode.file()));
        let _ = fs::remove_file(&log);
        // Every test binary runs, whatever fails first: the summary covers them all.
        let mut cmd = cargo();
        cmd.args(["test", "--package", "limiter-tests", "--no-fail-fast"]).args(super::test_args(targets));
        cmd.args(["--", "--test-threads=1"]);
        cmd.args(filter).env(FLOOD_LOG_ENV, &log).env_remove(THROTTLE_ENV);
        if mode == Stress::HalfSpeed {
            cmd.env(THROTTLE_ENV, "0.5");
        }
        eprintln!("\nstress: {} ({})", mode.name(), describe(&cmd));
        let busy = (mode == Stress::BusyCores).then(BusyCores::start);
        if let Some(b) = &busy {
            eprintln!("stress: {} busy loops running, one pinned to each CPU", b.threads.len());
        }
        let started = Instant::now();
        let status = cmd.status().with_context(|| format!("could not start `{}`", describe(&cmd)))?;
        let took = started.elapsed();
        drop(busy);
        let floods = Floods::read(&log);
        eprintln!(
            "stress: {}: {} in {took:.0?}; {floods}",
            mode.name(),
            if status.success() { "passed" } else { "FAILED" }
        );
        outcomes.push(Outcome { mode, passed: status.success(), took, floods });
    }
    summary(&outcomes);
    let failed: Vec<String> = outcomes.iter().filter(|o| !o.passed).map(|o| o.mode.name()).collect();
    if !failed.is_empty() {
        bail!("stress: the integration tests failed: {}", failed.join(", "));
    }
    Ok(())
}

fn summary(outcomes: &[Outcome]) {
    eprintln!("\nstress summary (integration tests, --test-threads=1):");
    eprintln!(
        "{:<26} {:>7} {:>9} {:>7} {:>11} {:>11} {:>11} {:>9}",
        "mode", "result", "duration", "floods", "median pps", "min pps", "max pps", "stalled"
    );
    for o in outcomes {
        let f = &o.floods;
        eprintln!(
            "{:<26} {:>7} {:>8.0}s {:>7} {:>11.0} {:>11.0} {:>11.0} {:>8.2}s",
            o.mode.name(),
            if o.passed { "pass" } else { "FAIL" },
            o.took.as_secs_f64(),
            f.full_speed.len(),
            f.median(),
            f.full_speed.first().copied().unwrap_or(0.0),
            f.full_speed.last().copied().unwrap_or(0.0),
            f.stalled
        );
    }
    let median = |m: Stress| outcomes.iter().find(|o| o.mode == m).map(|o| o.floods.median());
    if let (Some(half), Some(full)) = (median(Stress::HalfSpeed), median(Stress::Repeat(1)))
        && full > 0.0
    {
        eprintln!(
            "generator at half speed: median {half:.0} pps, {:.2} of the unthrottled run's {full:.0}",
            half / full
        );
    }
    eprintln!(
        "(pps: floods of the AF_PACKET sender at full speed, not paced, 0.2 s or longer; stalled: their total stalls)"
    );
}

/// What the floods of one mode did, from the log they appended to.
#[derive(Default)]
struct Floods {
    /// Packets per second of each unpaced AF_PACKET flood of 0.2 s or more, sorted.
    full_speed: Vec<f64>,
    /// All floods.
    all: usize,
    /// Seconds those floods stalled in all.
    stalled: f64,
}

impl Floods {
    fn read(path: &Path) -> Self {
        let text = fs::read_to_string(path).unwrap_or_default();
        let mut floods = Self::default();
        for line in text.lines() {
            floods.all += 1;
            let field = |name: &str| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
                    .map(|v| v.trim_end_matches('s'))
            };
            let num = |name: &str| field(name).and_then(|v| v.parse::<f64>().ok());
            if !line.starts_with("socket ") || field("paced").is_some() || num("seconds").unwrap_or(0.0) < 0.2 {
                continue;
            }
            if let Some(pps) = num("pps") {
                floods.full_speed.push(pps);
                floods.stalled += num("stalled").unwrap_or(0.0);
            }
        }
        floods.full_speed.sort_by(f64::total_cmp);
        floods
    }

    fn median(&self) -> f64 {
        self.full_speed.get(self.full_speed.len() / 2).copied().unwrap_or(0.0)
    }
}

impl std::fmt::Display for Floods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} floods, {} at full speed: median {:.0} pps (min {:.0}, max {:.0}), stalled {:.2} s",
            self.all,
            self.full_speed.len(),
            self.median(),
            self.full_speed.first().copied().unwrap_or(0.0),
            self.full_speed.last().copied().unwrap_or(0.0),
            self.stalled
        )
    }
}

/// A busy loop pinned to each CPU, as threads of this process: stopped and joined on drop, and
/// gone with the process if it dies (Ctrl-C included), so nothing outlives the command.
struct BusyCores {
    stop: Arc<AtomicBool>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl BusyCores {
    fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
        let threads = (0..cpus)
            .map(|cpu| {
                let stop = stop.clone();
                thread::spawn(move || {
                    pin(cpu);
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for BusyCores {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Pins the calling thread to `cpu` (best effort: an unpinned busy loop still loads the machine).
fn pin(cpu: usize) {
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            eprintln!("stress: could not pin a busy loop to CPU {cpu}: {}", std::io::Error::last_os_error());
        }
    }
}

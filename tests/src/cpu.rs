//! The limiter's state is per CPU: tests that count admissions pin the thread that drives
//! packets (BPF_PROG_TEST_RUN runs on the calling CPU; veth XDP runs where the sender sent).

use nix::{
    sched::{CpuSet, sched_setaffinity},
    unistd::Pid,
};

/// Pins the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> nix::Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu)?;
    sched_setaffinity(Pid::from_raw(0), &set)
}

/// Pins every thread of process `pid` to the CPUs this process may use but [`flood_cpu`] (the
/// threads it starts later inherit it from theirs). A test that measures a process's CPU time
/// under a flood needs it: on a kernel without IRQ time accounting (this one's config), softirq
/// work that interrupts a task is charged to that task, and the receiver's softirqs run on the
/// flood's CPU.
pub fn keep_off_flood_cpu(pid: i32) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let mut set = nix::sched::sched_getaffinity(Pid::from_raw(0)).context("this process's CPUs")?;
    set.unset(flood_cpu())?;
    anyhow::ensure!((0..CpuSet::count()).any(|c| set.is_set(c).unwrap_or(false)), "one CPU only: nowhere else to go");
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).with_context(|| format!("the threads of {pid}"))?;
    for task in tasks {
        let tid: i32 = task?.file_name().to_string_lossy().parse().context("a thread id")?;
        sched_setaffinity(Pid::from_raw(tid), &set).with_context(|| format!("pinning thread {tid} of {pid}"))?;
    }
    Ok(())
}

/// The CPU floods are pinned to: the last one this process may use (the harness's other threads
/// — receivers, the daemon, the CLI — are left the rest).
pub fn flood_cpu() -> usize {
    match nix::sched::sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count()).rev().find(|&c| set.is_set(c).unwrap_or(false)).unwrap_or(0),
        Err(_) => 0,
    }
}

/// The CPU time a process has used: all its threads, live and exited, in user and system time
/// (`/proc/PID/stat`'s utime + stime, in clock ticks: 10 ms on most kernels), and each live
/// thread's own to the nanosecond (`/proc/PID/task/TID/schedstat`), by `TID NAME`.
#[derive(Clone, Debug, Default)]
pub struct ProcessCpu {
    pub total: std::time::Duration,
    pub threads: std::collections::BTreeMap<String, std::time::Duration>,
}

impl ProcessCpu {
    pub fn read(pid: i32) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).with_context(|| format!("/proc/{pid}/stat"))?;
        // The fields after the command name (which may hold spaces and parentheses): state is
        // the 3rd field of the line, utime the 14th, stime the 15th.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).context("no command name in /proc/PID/stat")?;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks = |i: usize| -> anyhow::Result<u64> {
            fields.get(i).and_then(|f| f.parse().ok()).with_context(|| format!("/proc/{pid}/stat: field {}", i + 3))
        };
        // SAFETY: sysconf reads a constant.
        let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok().filter(|&h| h > 0).unwrap_or(100);
        let total = std::time::Duration::from_nanos((ticks(11)? + ticks(12)?) * 1_000_000_000 / hz);
        let mut threads = std::collections::BTreeMap::new();
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))?.flatten() {
            let dir = task.path();
            // A thread that exits meanwhile is left out (its time is in `total`).
            let (Ok(sched), Ok(comm)) =
                (std::fs::read_to_string(dir.join("schedstat")), std::fs::read_to_string(dir.join("comm")))
            else {
                continue;
            };
            if let Some(ns) = sched.split_whitespace().next().and_then(|n| n.parse().ok()) {
                let name = format!("{} {}", task.file_name().to_string_lossy(), comm.trim());
                threads.insert(name, std::time::Duration::from_nanos(ns));
            }
        }
        Ok(Self { total, threads })
    }

    /// What was used since `before` (threads that were there both times, and new ones).
    pub fn since(&self, before: &Self) -> Self {
        let threads = self
            .threads
            .iter()
            .map(|(t, d)| (t.clone(), d.saturating_sub(before.threads.get(t).copied().unwrap_or_default())))
            .collect();
        Self { total: self.total.saturating_sub(before.total), threads }
    }

    /// The live threads' time to the nanosecond.
    pub fn threads_total(&self) -> std::time::Duration {
        self.threads.values().sum()
    }
}

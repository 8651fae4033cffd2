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

/// The CPU floods are pinned to: the last one this process may use (the harness's other threads
/// — receivers, the daemon, the CLI — are left the rest).
pub fn flood_cpu() -> usize {
    match nix::sched::sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..CpuSet::count()).rev().find(|&c| set.is_set(c).unwrap_or(false)).unwrap_or(0),
        Err(_) => 0,
    }
}

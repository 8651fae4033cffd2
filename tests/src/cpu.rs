//! The limiter's state is per CPU: tests that count admissions pin the thread that drives
//! packets (BPF_PROG_TEST_RUN runs on the calling CPU; veth XDP runs where the sender sent).

use nix::{sched::{CpuSet, sched_setaffinity}, unistd::Pid};

/// Pins the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> nix::Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu)?;
    sched_setaffinity(Pid::from_raw(0), &set)
}

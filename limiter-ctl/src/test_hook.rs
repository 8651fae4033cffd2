//! Fault injection for the integration tests, in the binary that ships (the tests run the
//! release build): inert unless the environment names a step in [`SIGKILL_AT`], or sets
//! [`NO_TCX`] or [`REJECT`]. The daemon then SIGKILLs itself when it reaches that step, as a crash
//! or the OOM killer would kill it there, so a test can check what the next start makes of the
//! state left behind; or it acts as on a kernel without tcx (Linux before 6.6), so the tc ingress
//! fallback through netlink runs on a kernel that has tcx; or as on a kernel whose verifier
//! rejects the program of a hook (as Debian 12's 6.1 rejected the XDP program). Never set them
//! outside a test.

/// `LIMITER_TEST_SIGKILL_AT=STEP`: the step at which the daemon kills itself.
pub(crate) const SIGKILL_AT: &str = "LIMITER_TEST_SIGKILL_AT";

/// `LIMITER_TEST_NO_TCX=1`: the kernel is taken to have no tcx (`--tc-api auto` picks netlink).
pub(crate) const NO_TCX: &str = "LIMITER_TEST_NO_TCX";

/// Kills the process with SIGKILL here if [`SIGKILL_AT`] names `step`; else nothing.
pub(crate) fn sigkill_at(step: &str) {
    if std::env::var_os(SIGKILL_AT).is_some_and(|at| at == step) {
        eprintln!("{SIGKILL_AT}={step}: killing this process (SIGKILL), as a test asked");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

/// Whether [`NO_TCX`] asks the daemon to act as on a kernel without tcx.
pub(crate) fn pretend_no_tcx() -> bool {
    std::env::var_os(NO_TCX).is_some_and(|v| v == "1")
}

/// `LIMITER_TEST_REJECT=xdp` (or `tc`): the verifier is taken to reject that hook's program.
pub(crate) const REJECT: &str = "LIMITER_TEST_REJECT";

/// The verifier's log [`REJECT`] stands for: what Linux 6.1 said of the XDP program, several
/// lines, the reason last but for the statistics.
const REJECTED_LOG: &str = "0: R1=ctx() R10=fp0\n\
49: (dc) r5 = be16 r5\n\
454: (0f) r5 += r3\n\
math between pkt pointer and register with unbounded min value is not allowed\n\
processed 147894 insns (limit 1000000) max_states_per_insn 4 total_states 2230 peak_states 1204 mark_read 48\n";

/// The log the verifier is taken to give when [`REJECT`] names `hook`.
pub(crate) fn pretend_rejected(hook: crate::kernel::Hook) -> Option<&'static str> {
    std::env::var_os(REJECT).is_some_and(|h| h == hook.as_str()).then(|| {
        eprintln!("{REJECT}={hook}: the program taken as rejected by the verifier, as a test asked");
        REJECTED_LOG
    })
}

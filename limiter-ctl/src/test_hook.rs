//! Fault injection for the integration tests, in the binary that ships (the tests run the
//! release build): inert unless the environment names a step in [`SIGKILL_AT`], or sets
//! [`NO_TCX`]. The daemon then SIGKILLs itself when it reaches that step, as a crash or the OOM
//! killer would kill it there, so a test can check what the next start makes of the state left
//! behind; or it acts as on a kernel without tcx (Linux before 6.6), so the tc ingress fallback
//! through netlink runs on a kernel that has tcx. Never set them outside a test.

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

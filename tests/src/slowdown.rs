//! Waits stretched on a slower machine. The kernel matrix runs the scenario tests in a VM under
//! software emulation (tests/kernels/), where loading a program takes 30-60 s rather than a
//! second: [`SLOWDOWN_ENV`] says how many times slower the machine is, and every wait on the
//! daemon (its start, its exit, its answers and snapshots) and the time limits that are only a
//! safety net are stretched by it ([`stretch`]). Floods keep their durations, and what they
//! assert holds at any speed: they are held to what was actually sent, and when.

use std::{sync::OnceLock, time::Duration};

/// Environment variable: how many times slower than this machine the tests run (a whole
/// number, 1 by default).
pub const SLOWDOWN_ENV: &str = "LIMITER_TESTS_SLOWDOWN";

/// [`SLOWDOWN_ENV`]'s factor (1 when unset); panics on a value that is not a whole number from
/// 1 up, rather than wait the wrong time.
pub fn factor() -> u32 {
    static FACTOR: OnceLock<u32> = OnceLock::new();
    *FACTOR.get_or_init(|| match std::env::var(SLOWDOWN_ENV) {
        Err(_) => 1,
        Ok(v) => v
            .trim()
            .parse()
            .ok()
            .filter(|f| *f >= 1)
            .unwrap_or_else(|| panic!("{SLOWDOWN_ENV}={v:?}: expected a whole number of times slower, 1 or more")),
    })
}

/// `d` on this machine, as long as it takes on the machine [`SLOWDOWN_ENV`] describes.
pub fn stretch(d: Duration) -> Duration {
    d * factor()
}

//! Privileged tests need root. Outside CI they skip with a message when not root; under CI
//! (`CI` set to anything but `false`/`0`) a privileged test that cannot run fails.
//!
//! A privileged test starts with [`require_root!`](crate::require_root), which names the test
//! for it:
//!
//! ```ignore
//! #[test]
//! fn floods_are_held_to_the_bound() {
//!     require_root!();
//!     // ...
//! }
//! ```

/// Set by `cargo xtask test --offline-only`.
const NO_ROOT_ENV: &str = "LIMITER_TESTS_NO_ROOT";

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Returns true when the test may proceed; false (after saying why) when it must skip.
/// Panics under CI when it cannot run.
pub fn require(test: &str) -> bool {
    // `cargo xtask test --offline-only` selects only tests that need no root: one that asks
    // fails, so it is neither skipped unseen nor run as root there.
    if std::env::var_os(NO_ROOT_ENV).is_some() {
        panic!(
            "{test}: needs root, but {NO_ROOT_ENV} is set (`cargo xtask test --offline-only`): take it out of the \
             offline tests in xtask/src/test/catalogue.rs"
        );
    }
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if in_ci() {
        panic!("{test}: needs root (BPF, XDP, network namespaces) and CI must not skip it");
    }
    eprintln!("SKIP {test}: needs root; run `sudo -E cargo xtask test`");
    false
}

/// The first line of a privileged test: returns from it (skips) unless it may run, see
/// [`require`]. The test is named by its own path (`policy_fields::dry_run_...`), found from
/// a function declared where the macro is expanded, so no test spells its name.
#[macro_export]
macro_rules! require_root {
    () => {{
        fn here() {}
        let here = ::std::any::type_name_of_val(&here);
        if !$crate::privileged::require(here.strip_suffix("::here").unwrap_or(here)) {
            return;
        }
    }};
}

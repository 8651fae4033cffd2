//! Privileged tests need root. Outside CI they skip with a message when not root; under CI
//! (`CI` set to anything but `false`/`0`) a privileged test that cannot run fails.

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Returns true when the test may proceed; false (after saying why) when it must skip.
/// Panics under CI when it cannot run.
pub fn require(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    if in_ci() {
        panic!("{test}: needs root (BPF, XDP, network namespaces) and CI must not skip it");
    }
    eprintln!("SKIP {test}: needs root; run `sudo -E cargo xtask test`");
    false
}

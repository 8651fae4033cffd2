//! `cargo xtask test`: set up, then run every test. Integration tests run one at a time: they
//! pin CPUs and flood veth pairs, and on a 2-core machine parallel floods would measure each other.

use crate::sh::{cargo, exec};

#[derive(clap::Args)]
pub struct Args {
    /// Only run tests whose name contains this (passed to the test harness).
    filter: Option<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    if !crate::setup::is_root() {
        eprintln!(
            "test: not root: privileged tests will skip (under CI=true they fail). Use `sudo -E cargo xtask test`."
        );
    }
    let filter: Vec<String> = args.filter.into_iter().collect();
    // limiter-ebpf builds only for the BPF target (limiter-ctl's build.rs does that).
    exec(
        cargo()
            .args(["test", "--workspace", "--exclude", "limiter-tests", "--exclude", "limiter-ebpf", "--"])
            .args(&filter),
    )?;
    // The end-to-end tests run the real limiter-ctl binary; `cargo test` builds only harnesses.
    exec(cargo().args(["build", "--package", "limiter-ctl", "--bins"]))?;
    exec(cargo().args(["test", "--package", "limiter-tests", "--tests", "--", "--test-threads=1"]).args(&filter))?;
    // The benchmark must at least build.
    exec(cargo().args(["bench", "--package", "limiter-tests", "--no-run"]))?;
    Ok(())
}

//! `cargo xtask demo`: the daemon protecting one end of a veth pair, a flood from the other.
//!
//! Builds limiter-ctl, limiter-flood and limiter-demo (release), then execs limiter-demo
//! (tests/src/bin/limiter-demo.rs) with the arguments given here: it sets up the namespaces with
//! the test harness, runs the daemon and the flood, prints what was admitted, and cleans up, on
//! Ctrl-C too. It finds the other two binaries next to itself.

use std::{ffi::OsString, os::unix::process::CommandExt as _, process::Command};

use anyhow::{Context as _, ensure};

use crate::sh::{cargo, describe, exec, target_dir};

#[derive(clap::Args)]
#[command(disable_help_flag = true)]
pub struct Args {
    /// limiter-demo's arguments: --rate (1000/s), --burst (100), --seconds (5); --help for more.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<OsString>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let help = args.args.iter().any(|a| a == "-h" || a == "--help");
    ensure!(
        help || crate::setup::is_root(),
        "the demo creates network namespaces and loads XDP: run `sudo -E cargo xtask demo`"
    );
    crate::setup::build()?;
    exec(cargo().args(["build", "--release", "-p", "limiter-ctl", "-p", "limiter-tests", "--bins"]))?;
    let mut demo = Command::new(target_dir().join("release").join("limiter-demo"));
    demo.args(&args.args);
    eprintln!("+ {}", describe(&demo));
    // exec returns only if it failed.
    Err(demo.exec()).with_context(|| format!("could not run `{}`", describe(&demo)))
}

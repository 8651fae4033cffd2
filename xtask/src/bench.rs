//! `cargo xtask bench` (in progress).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("bench: not written yet")
}

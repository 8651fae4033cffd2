//! `cargo xtask demo` (in progress).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("demo: not written yet")
}

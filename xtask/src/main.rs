//! `cargo xtask setup|test|demo|bench|package`.

mod bench;
mod demo;
mod package;
mod setup;
mod sh;
mod test;
mod vm;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need (idempotent; seconds when all is there).
    Setup,
    /// Install what the selected tests need, then run them; by default every test: unit,
    /// BPF_PROG_TEST_RUN fixtures, differential, veth end to end... (`--group`: one group;
    /// `--offline-only`: those needing no root; `--stress`: the integration tests at half
    /// generator speed, on busy cores, three times).
    Test(test::Args),
    /// Two namespaces, the daemon on one side, a flood from the other: admitted/refused per second.
    Demo(demo::Args),
    /// Microbenchmarks (BPF_PROG_TEST_RUN ns/packet) as ratios to the floor program.
    Bench(bench::Args),
    /// The Debian package (release binary, man page, completions, systemd unit) via cargo-deb.
    Package(package::Args),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Setup => setup::run(),
        Task::Test(args) => test::run(args),
        Task::Demo(args) => demo::run(args),
        Task::Bench(args) => bench::run(args),
        Task::Package(args) => package::run(args),
    }
}

//! `cargo xtask bench`: runs the XDP microbenchmark and records its table in BENCHMARKS.md,
//! with the command, the date and the machine, between the `bench:xdp` markers.

use std::{fs, process::Command};

use anyhow::Context as _;

use crate::sh::{cargo, exec, output, workspace_root};

#[derive(clap::Args)]
pub struct Args {
    /// Rounds per program (medians are reported).
    #[arg(long, default_value_t = 7)]
    rounds: u32,
    /// Print the table without touching BENCHMARKS.md.
    #[arg(long)]
    no_record: bool,
}

const BEGIN: &str = "<!-- bench:xdp begin -->";
const END: &str = "<!-- bench:xdp end -->";

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::setup::run()?;
    let table_path = workspace_root().join("target/bench-xdp.md");
    exec(cargo()
        .args(["bench", "--package", "limiter-tests", "--bench", "xdp", "--"])
        .args(["--rounds", &args.rounds.to_string(), "--out"])
        .arg(&table_path))?;
    if args.no_record {
        return Ok(());
    }
    let table = fs::read_to_string(&table_path).with_context(|| format!("reading {}", table_path.display()))?;
    let section = format!(
        "{BEGIN}\nCommand: `sudo -E cargo xtask bench --rounds {}` on {} ({}; {} CPUs; kernel {}).\n\n{}{END}",
        args.rounds,
        output(Command::new("date").args(["-u", "+%Y-%m-%d"])).unwrap_or_default().trim(),
        cpu_model(),
        output(&mut Command::new("nproc")).unwrap_or_default().trim(),
        output(Command::new("uname").arg("-r")).unwrap_or_default().trim(),
        table
    );
    let path = workspace_root().join("BENCHMARKS.md");
    let doc = fs::read_to_string(&path).unwrap_or_default();
    let updated = match (doc.find(BEGIN), doc.find(END)) {
        (Some(b), Some(e)) if e > b => format!("{}{section}{}", &doc[..b], &doc[e + END.len()..]),
        _ => format!("{doc}\n{section}\n"),
    };
    fs::write(&path, updated).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("bench: recorded in {}", path.display());
    Ok(())
}

fn cpu_model() -> String {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string()))
        .unwrap_or_else(|| "unknown CPU".into())
}

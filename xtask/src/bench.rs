//! `cargo xtask bench`: runs the XDP microbenchmark (with its scaling and two-CPU contention
//! tables) and records it in
//! BENCHMARKS.md, with the command, the date and the machine, between the `bench:xdp` markers.
//! Then the bans microbenchmark (the lookup cost at 0, 10^4 and 10^6 bans), between the
//! `bench:bans` markers; `--bans` runs it alone.
//! `--peers` runs the comparison with iptables hashlimit and nftables instead (minutes), records
//! it between the `bench:peers` markers and writes its plots to docs/bench/.

use std::{fs, process::Command};

use anyhow::{Context as _, bail};

use crate::sh::{cargo, exec, output, workspace_root};

#[derive(clap::Args)]
pub struct Args {
    /// Rounds per program (medians are reported).
    #[arg(long, default_value_t = 7)]
    rounds: u32,
    /// Print the table without touching BENCHMARKS.md.
    #[arg(long)]
    no_record: bool,
    /// Compare with iptables hashlimit and an nftables meter on veth floods instead.
    #[arg(long)]
    peers: bool,
    /// With --peers: one short run of each (a smoke test; not recorded).
    #[arg(long)]
    quick: bool,
    /// Only the bans microbenchmark: the lookup cost at 0, 10^4 and 10^6 bans (about a minute).
    #[arg(long, conflicts_with = "peers")]
    bans: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::setup::build()?;
    if args.peers {
        return peers(&args);
    }
    if args.bans {
        return bans(&args);
    }
    let table_path = workspace_root().join("target/bench-xdp.md");
    exec(
        cargo()
            .args(["bench", "--package", "limiter-tests", "--bench", "xdp", "--"])
            .args(["--rounds", &args.rounds.to_string(), "--scaling", "--contention", "--out"])
            .arg(&table_path),
    )?;
    if !args.no_record {
        record("xdp", &format!("sudo -E cargo xtask bench --rounds {}", args.rounds), &table_path)?;
    }
    bans(&args)
}

/// The bans microbenchmark (tests/benches/bans.rs), recorded between the `bench:bans` markers.
fn bans(args: &Args) -> anyhow::Result<()> {
    let table_path = workspace_root().join("target/bench-bans.md");
    let rounds = args.rounds.min(5).to_string();
    exec(
        cargo()
            .args(["bench", "--package", "limiter-tests", "--bench", "bans", "--"])
            .args(["--rounds", &rounds, "--out"])
            .arg(&table_path),
    )?;
    if args.no_record {
        return Ok(());
    }
    record("bans", &format!("sudo -E cargo xtask bench --bans --rounds {rounds}"), &table_path)
}

fn peers(args: &Args) -> anyhow::Result<()> {
    crate::setup::apt(&["iptables", "nftables"])?;
    // The limiter runs as it ships there: the release daemon, which the bench starts.
    exec(cargo().args(["build", "--release", "--package", "limiter-ctl", "--bins"]))?;
    // The plots go to docs/bench (shown in BENCHMARKS.md), the table to target/ (recorded from there).
    let out = workspace_root().join(if args.quick { "target/peers" } else { "docs/bench" });
    let table = workspace_root().join("target/bench-peers.md");
    let mut cmd = cargo();
    cmd.args(["bench", "--package", "limiter-tests", "--bench", "peers", "--", "--out"])
        .arg(&out)
        .arg("--table")
        .arg(&table);
    if args.quick {
        cmd.arg("--quick");
    } else {
        // The plots in BENCHMARKS.md next to their tables (paths relative to it).
        cmd.args(["--images", "docs/bench"]);
    }
    exec(&mut cmd)?;
    if args.no_record || args.quick {
        return Ok(());
    }
    // The bench's first line names the generator's sender. Live frames give the recorded
    // comparison (an XDP program's cost before any skb, as behind a NIC); a machine that refuses
    // them records its table in a section of its own rather than over that one.
    let text = fs::read_to_string(&table).with_context(|| format!("reading {}", table.display()))?;
    let section = match text.lines().next().and_then(|l| l.strip_prefix("Sender: ")) {
        Some(s) if s.starts_with("live-frames") => "peers",
        Some(s) if s.starts_with("packet-ring") => "peers-packet-ring",
        _ => bail!("{}: the peers bench's table does not start with the line naming its sender", table.display()),
    };
    record(section, "sudo -E cargo xtask bench --peers", &table)
}

/// Puts `table` into BENCHMARKS.md between the `bench:NAME` markers, with the command, the date
/// and the machine.
fn record(name: &str, command: &str, table_path: &std::path::Path) -> anyhow::Result<()> {
    let (begin, end) = (format!("<!-- bench:{name} begin -->"), format!("<!-- bench:{name} end -->"));
    let table = fs::read_to_string(table_path).with_context(|| format!("reading {}", table_path.display()))?;
    let section = format!(
        "{begin}\nCommand: `{command}` on {} ({}; {} CPUs; kernel {}).\n\n{}{end}",
        output(Command::new("date").args(["-u", "+%Y-%m-%d"])).unwrap_or_default().trim(),
        cpu_model(),
        output(&mut Command::new("nproc")).unwrap_or_default().trim(),
        output(Command::new("uname").arg("-r")).unwrap_or_default().trim(),
        table
    );
    let path = workspace_root().join("BENCHMARKS.md");
    let doc = fs::read_to_string(&path).unwrap_or_default();
    let updated = match (doc.find(&begin), doc.find(&end)) {
        (Some(b), Some(e)) if e > b => format!("{}{section}{}", &doc[..b], &doc[e + end.len()..]),
        _ => format!("{doc}\n{section}\n"),
    };
    fs::write(&path, updated).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("bench: recorded in {}", path.display());
    Ok(())
}

fn cpu_model() -> String {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

//! The command line, defined once with clap (completions and the man page derive from it).

use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::{limiter::ModeRequest, rate::Rate};

#[derive(Debug, Parser)]
#[command(name = "limiter-ctl", version, about = "Host-level flood limiter: per-source GCRA in XDP")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Load the XDP limiter on an interface and keep it there until SIGINT or SIGTERM.
    Daemon(DaemonArgs),
}

#[derive(Debug, Args)]
pub struct DaemonArgs {
    /// Interface to protect.
    #[arg(long, value_name = "IFACE")]
    pub iface: String,
    /// Sustained rate per source: N/s, N/min or N/h.
    #[arg(long, value_name = "RATE")]
    pub rate: Rate,
    /// Packets a source may send at once after being quiet [default: one second's worth of the rate].
    #[arg(long, value_name = "N", value_parser = parse_burst)]
    pub burst: Option<u64>,
    /// Buckets per CPU (a power of two from 16 to 16777216); memory is buckets x 16 bytes x CPUs.
    #[arg(long, value_name = "N", default_value_t = limiter_common::maps::DEFAULT_BUCKETS, value_parser = parse_buckets)]
    pub buckets: u32,
    /// XDP attach mode: auto tries native and falls back to skb with a warning.
    #[arg(long, value_enum, default_value_t = ModeRequest::Auto)]
    pub mode: ModeRequest,
    /// Print admitted and refused packets per second at this interval (e.g. 1s); off by default.
    #[arg(long, value_name = "DURATION", value_parser = parse_interval)]
    pub stats_every: Option<Duration>,
}

impl DaemonArgs {
    pub fn burst(&self) -> u64 {
        self.burst.unwrap_or_else(|| self.rate.per_sec().ceil().max(1.0) as u64)
    }
}

fn parse_burst(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("invalid burst '{s}': expected a whole number from 1")),
    }
}

fn parse_buckets(s: &str) -> Result<u32, String> {
    s.parse::<u32>()
        .ok()
        .and_then(|n| crate::limiter::check_buckets(n).ok())
        .ok_or_else(|| {
            format!(
                "invalid bucket count '{s}': expected a power of two from {} to {}",
                limiter_common::maps::MIN_BUCKETS,
                limiter_common::maps::MAX_BUCKETS
            )
        })
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let err = || format!("invalid interval '{s}': expected seconds such as 1s or 5s");
    let n: u64 = s.strip_suffix('s').unwrap_or(s).parse().map_err(|_| err())?;
    if n == 0 {
        return Err(err());
    }
    Ok(Duration::from_secs(n))
}

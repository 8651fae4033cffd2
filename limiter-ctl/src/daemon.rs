//! `limiter-ctl daemon`: load, configure, attach, then wait for a signal and detach.
//!
//! One line per state change on stdout (through `tracing`). The salt is drawn here and written
//! to the kernel map only.

use std::time::Instant;

use anyhow::Context as _;
use limiter_common::maps::Counters;
use tokio::signal::unix::{SignalKind, signal};
use tracing::{info, warn};

use crate::{
    Limiter,
    cli::DaemonArgs,
    policy::PolicySpec,
    salt,
};

/// The policy id the daemon's command-line rate is installed under.
pub const DEFAULT_POLICY_ID: u16 = 1;

pub async fn run(args: DaemonArgs) -> anyhow::Result<()> {
    let spec = PolicySpec::any(args.rate, args.burst());
    let policy = spec
        .compile(DEFAULT_POLICY_ID)
        .map_err(|e| crate::error::Usage(format!("--rate {} --burst {}: {e}", spec.rate, spec.burst)))?;
    if !crate::limiter::interface_exists(&args.iface) {
        return Err(crate::error::Usage(format!("interface '{}' does not exist (see `ip link`)", args.iface)).into());
    }

    let mut limiter = Limiter::load(args.buckets)?;
    limiter.set_salt(salt::draw()?)?;
    limiter.set_policy(&policy)?;
    limiter.set_default_policy(DEFAULT_POLICY_ID)?;
    let attached = limiter.attach(&args.iface, args.mode)?;
    if let Some(reason) = &attached.fallback {
        warn!(iface = %args.iface, %reason, "native XDP unavailable, fell back to skb mode (slower: packets get an skb first)");
    }
    info!(
        iface = %args.iface,
        mode = %attached.mode,
        rate = %spec.rate,
        burst = spec.burst,
        buckets = args.buckets,
        "attached"
    );

    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut stats = args.stats_every.map(tokio::time::interval);
    let mut last = (Instant::now(), total(&limiter)?);
    let signal_name = loop {
        tokio::select! {
            _ = sigint.recv() => break "SIGINT",
            _ = sigterm.recv() => break "SIGTERM",
            _ = async { stats.as_mut().expect("guarded").tick().await }, if stats.is_some() => {
                let now = (Instant::now(), total(&limiter)?);
                print_rates(&last, &now);
                last = now;
            }
        }
    };
    info!(signal = signal_name, "stopping");
    if let Some(iface) = limiter.detach()? {
        info!(iface = %iface, "detached");
    }
    Ok(())
}

fn total(limiter: &Limiter) -> anyhow::Result<Counters> {
    let mut sum = Counters::default();
    limiter.counters()?.iter().for_each(|c| sum.add(c));
    Ok(sum)
}

fn print_rates(prev: &(Instant, Counters), now: &(Instant, Counters)) {
    let secs = now.0.duration_since(prev.0).as_secs_f64().max(1e-3);
    let rate = |f: fn(&Counters) -> u64| (f(&now.1).saturating_sub(f(&prev.1))) as f64 / secs;
    info!(
        admitted_per_s = format!("{:.0}", rate(|c| c.admitted_packets)),
        refused_per_s = format!("{:.0}", rate(|c| c.refused_packets)),
        passed_unjudged_per_s = format!("{:.0}", rate(|c| c.not_ip + c.malformed + c.unmatched)),
        errors = now.1.errors,
        "stats"
    );
}

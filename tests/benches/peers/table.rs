//! The tables and claims the bench writes, from its runs.

use std::{collections::BTreeMap, fmt::Write as _};

use limiter_tests::{
    generator::Choice,
    peers::{Place, System},
};

use crate::{
    Run,
    opts::{Opts, POLICY, POLICY_1K, Workload},
};

/// `mmm` of a figure only some systems have ("-" for the others).
pub(crate) fn optional(runs: &[Run], f: fn(&Run) -> Option<f64>, digits: usize) -> String {
    let v: Option<Vec<f64>> = runs.iter().map(f).collect();
    match v {
        Some(v) if !v.is_empty() => mmm(&v, digits),
        _ => "-".into(),
    }
}

pub(crate) fn stats(v: &[f64]) -> (f64, f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

pub(crate) fn mmm(v: &[f64], digits: usize) -> String {
    let (lo, med, hi) = stats(v);
    format!("{med:.digits$} ({lo:.digits$}-{hi:.digits$})")
}

/// The line saying which flood rows `sender` cannot give (those needing live frames), if any.
pub(crate) fn note_left_out(left_out: &[System], sender: &Choice) -> Option<String> {
    let names: Vec<&str> = left_out.iter().map(|s| s.name()).collect();
    (!names.is_empty()).then(|| {
        format!(
            "left out of the floods: {} (their rows need live frames, the cost before any skb exists as behind a NIC; this machine's sender is {sender})",
            names.join(", ")
        )
    })
}

/// The share of the bound each limiting system admitted on the many-source workloads, side by
/// side: every system's figure from the same run (the defaults' goal is stated against them).
pub(crate) fn bound_shares(
    md: &mut String,
    opts: &Opts,
    runs: &BTreeMap<(Workload, System), Vec<Run>>,
) -> anyhow::Result<()> {
    let many: Vec<Workload> = opts.workloads.iter().copied().filter(|w| opts.floods && !w.one_source()).collect();
    let systems: Vec<System> =
        opts.systems.iter().copied().filter(|s| s.limits() && runs.keys().any(|k| k.1 == *s)).collect();
    if many.is_empty() || systems.is_empty() {
        return Ok(());
    }
    writeln!(
        md,
        "\nShare of the bound admitted with many sources (1: every source got all the policy allows it; below: innocent refusals of shared buckets or a full table; above: over-admission), median (min-max):\n"
    )?;
    let names: Vec<&str> = systems.iter().map(|s| s.label()).collect();
    writeln!(md, "| workload | {} |", names.join(" | "))?;
    writeln!(md, "|---|{}", "---:|".repeat(systems.len()))?;
    for w in many {
        let cells: Vec<String> = systems
            .iter()
            .map(|s| {
                runs.get(&(w, *s)).map_or("-".into(), |r| {
                    mmm(&r.iter().map(|r| r.admitted as f64 / r.bound.max(1) as f64).collect::<Vec<_>>(), 3)
                })
            })
            .collect();
        writeln!(md, "| {} | {} |", w.name(), cells.join(" | "))?;
    }
    Ok(())
}

/// The claims, in the order the docs make them. From the one-source flood at [`POLICY`] (nearly
/// every packet dropped): the limiter's net cost per million dropped against the cheapest
/// netfilter placement, then against INPUT as commonly configured; the same against the cheapest
/// placement on the one-source flood at the policy ([`POLICY_1K`]); then, for each
/// one-source flood, the limiter's end-to-end cost against a bare XDP_DROP on the same flood.
/// Empty when the run lacks the systems a line needs.
pub(crate) fn headline(
    runs: &BTreeMap<(Workload, System), Vec<Run>>,
    per_dropped: &BTreeMap<(Workload, System), (f64, f64, f64)>,
) -> anyhow::Result<String> {
    let mut md = String::new();
    let cost = |w: Workload, s: System| per_dropped.get(&(w, s)).map(|c| c.0);
    // The netfilter placements with a cost on the workload, cheapest first.
    let netfilter = |w: Workload| {
        let mut v: Vec<(System, f64)> =
            System::ALL.into_iter().filter(|s| s.netfilter()).filter_map(|s| Some((s, cost(w, s)?))).collect();
        v.sort_by(|a, b| a.1.total_cmp(&b.1));
        v
    };
    let w = Workload::OneSource;
    let others = netfilter(w);
    if let (Some(limiter), false) = (cost(w, System::Limiter), others.is_empty()) {
        writeln!(
            md,
            "One source flooding at {}/s burst {} (nearly every packet dropped), net CPU s per million dropped (median; the limiter's daemon included):\n",
            POLICY.rate_per_s, POLICY.burst
        )?;
        writeln!(md, "| system | net CPU s per M dropped | limiter cheaper by |")?;
        writeln!(md, "|---|---:|---:|")?;
        writeln!(md, "| {} | {limiter:.3} | - |", System::Limiter.name())?;
        for (s, c) in &others {
            writeln!(md, "| {} | {c:.3} | {:.1}x |", s.name(), c / limiter)?;
        }
        let tcx = cost(w, System::LimiterTcx);
        if let Some(c) = tcx {
            writeln!(md, "| {} | {c:.3} | {:.1}x |", System::LimiterTcx.name(), c / limiter)?;
        }
        let (best, best_cost) = others[0];
        write!(md, "\nAgainst netfilter at its best placement ({}): **{:.1}x**", best.name(), best_cost / limiter)?;
        for s in [System::Hashlimit(Place::Input), System::Nftables(Place::Input)] {
            if let Some(c) = cost(w, s) {
                write!(md, "; against {}: {:.1}x", s.name(), c / limiter)?;
            }
        }
        writeln!(md, ".\n")?;
        if let Some(c) = tcx {
            writeln!(
                md,
                "At tcx ingress (beside another XDP program), the skb already made: the limiter costs **{:.1}x** its cost at XDP, and netfilter at its best placement costs {:.1}x the limiter at tcx.\n",
                c / limiter,
                best_cost / c
            )?;
        }
    }
    let w = Workload::OneSource1k;
    if let (Some(limiter), Some(&(best, best_cost))) = (cost(w, System::Limiter), netfilter(w).first()) {
        writeln!(
            md,
            "One source flooding at {}/s burst {} (the issue's harness), net CPU s per million dropped (median): the limiter {limiter:.3}, {} {best_cost:.3}; against netfilter at its best placement: **{:.1}x**.\n",
            POLICY_1K.rate_per_s,
            POLICY_1K.burst,
            best.name(),
            best_cost / limiter
        )?;
    }
    for w in [Workload::PairOneSource, Workload::PairSpoofed] {
        let Some(limiter) = cost(w, System::Limiter) else { continue };
        let nft = System::ALL.into_iter().filter(|s| matches!(s, System::Nftables(_)));
        let mut nft: Vec<(System, f64)> = nft.filter_map(|s| Some((s, cost(w, s)?))).collect();
        nft.sort_by(|a, b| a.1.total_cmp(&b.1));
        if let Some(&(best, best_cost)) = nft.first() {
            writeln!(
                md,
                "The recommended pair (per source and an aggregate cap), *{}*, net CPU s per million dropped (median; the limiter's daemon included): the limiter {limiter:.3}, {} {best_cost:.3}; against nftables at its best placement: **{:.1}x**.\n",
                w.name(),
                best.name(),
                best_cost / limiter
            )?;
        }
    }
    for w in Workload::ALL.into_iter().filter(|w| w.one_source()) {
        let median =
            |s: System, f: fn(&Run) -> f64| runs.get(&(w, s)).map(|r| stats(&r.iter().map(f).collect::<Vec<_>>()));
        let (Some(l), Some(d)) =
            (median(System::Limiter, Run::cpu_per_million), median(System::XdpDrop, Run::cpu_per_million))
        else {
            continue;
        };
        write!(
            md,
            "End to end, a refused packet costs the limiter **{:.2}x** a bare XDP_DROP, its daemon included (CPU s per million offered, {}: {:.3} ({:.3}-{:.3}) against {:.3} ({:.3}-{:.3}))",
            l.1 / d.1,
            w.claim(),
            l.1,
            l.0,
            l.2,
            d.1,
            d.0,
            d.2
        )?;
        let share = runs.get(&(w, System::Limiter)).map(|r| optional(r, Run::daemon_share, 1));
        if let (Some(k), Some(share)) = (median(System::Limiter, Run::cpu_per_million_without_daemon), share) {
            write!(
                md,
                "; without the daemon's share, {:.2}x ({:.3}); the daemon used {share} % of a core",
                k.1 / d.1,
                k.1
            )?;
        }
        writeln!(md, ".\n")?;
    }
    Ok(md)
}

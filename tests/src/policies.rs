//! Policies as the end-to-end tests set them through the real CLI, and what those tests do with
//! the shared [`Rig`]: [`Pol`] is a policy's CLI arguments with the GCRA the test computes for it
//! from the same numbers (so a daemon that compiled them wrong cannot move the bound);
//! [`PolicyRig`] sets policies, floods with every policy's counters read first and the capture
//! checked, and holds a policy to its bound. [`gcra`] and [`src`] are a policy and an address
//! written as literals, for tests that set them in-process.
//!
//! What got through is counted by an AF_PACKET capture on the receiver's veth end
//! ([`crate::capture`]), which sees exactly the frames XDP passed; what was sent is exact too
//! ([`crate::flood::Frames::sent_per_flow`]). Delivered counts are held to `Gcra::bound` of the
//! policy as [`Pol::gcra`] computes it, per CPU that judged the policy's packets (see
//! [`crate::bounds`]); the policy the kernel holds is checked to be that same GCRA. Floods are
//! bounded by time ([`Limits::timed`]; a few by the packet count that is their point, with a time
//! limit too) and pinned to one CPU; bounds are held to what was sent and when, whatever the
//! machine's speed.

use std::net::IpAddr;

use limiter_common::{
    Gcra,
    maps::{Counters, MAX_FRAME_WEIGHT, Policy},
};
use nix::sys::signal::Signal;
use serde_json::Value;

use crate::{
    bounds::check_bounds,
    daemon::{Rules, SIGNAL_TIMEOUT},
    flood::{Flow, Limits, Stream},
    rig::{Flooding, METRICS, Rig, Run, SEC},
    scrape,
};

/// A policy as a test sets it: the CLI arguments, and the GCRA the test expects for it, computed
/// here from the same numbers (so a daemon that compiled them wrong cannot move the bound).
#[derive(Clone, Debug)]
pub struct Pol {
    pub name: &'static str,
    pub matches: &'static str,
    pub per_sec: u64,
    pub burst: u64,
    pub key: Option<&'static str>,
    pub bytes: bool,
    pub dry_run: bool,
    /// Scope cpu (`--scope cpu`) rather than the default, host: for tests that read the per-CPU
    /// buckets.
    pub cpu: bool,
}

impl Pol {
    pub fn new(name: &'static str, matches: &'static str, per_sec: u64, burst: u64) -> Self {
        Self { name, matches, per_sec, burst, key: None, bytes: false, dry_run: false, cpu: false }
    }

    pub fn key(self, key: &'static str) -> Self {
        Self { key: Some(key), ..self }
    }

    pub fn bytes(self) -> Self {
        Self { bytes: true, ..self }
    }

    pub fn dry_run(self) -> Self {
        Self { dry_run: true, ..self }
    }

    pub fn cpu(self) -> Self {
        Self { cpu: true, ..self }
    }

    /// Every field given (`policy set` changes only the fields given): setting a `Pol` over an
    /// existing policy makes it exactly this one, but for its scope (given only when cpu).
    pub fn args(&self) -> Vec<String> {
        let mut args: Vec<String> = ["policy", "set", self.name, "--match", self.matches].map(String::from).to_vec();
        args.extend(["--rate".into(), format!("{}/s", self.per_sec), "--burst".into(), self.burst.to_string()]);
        args.extend(["--key".into(), self.key.unwrap_or("src/32,/64").into()]);
        args.extend(["--unit".into(), if self.bytes { "bytes" } else { "packets" }.into()]);
        args.push(if self.dry_run { "--dry-run" } else { "--enforce" }.into());
        // Scope only when cpu: a new policy is host, and tests add `--scope` flags of their own.
        if self.cpu {
            args.extend(["--scope".into(), "cpu".into()]);
        }
        args
    }

    pub fn gcra(&self) -> Gcra {
        let max_weight = if self.bytes { MAX_FRAME_WEIGHT } else { 1 };
        Gcra::new(self.per_sec, SEC, self.burst, max_weight).expect("the test's policies are valid")
    }
}

/// What the policy tests do with the shared [`Rig`]: sets its [`Pol`]s, floods with every policy's
/// counters read first and the capture checked, and holds a policy to its bound.
pub trait PolicyRig {
    fn set(&self, pol: &Pol);
    fn set_all(&self, pols: &[Pol]);
    fn hup(&mut self, outcome: &str);
    fn check_installed(&self, pol: &Pol, id: u16);
    fn counted_flood(&self, streams: &[Stream], limits: Limits) -> Run;
    fn check_policy(&self, pol: &Pol, run: &Run, groups: &[Vec<Flow>]);
    fn check_unjudged(&self, unmatched: u64, run: &Run);
}

impl PolicyRig for Rig {
    fn set(&self, pol: &Pol) {
        let args = pol.args();
        self.ctl_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    }

    fn set_all(&self, pols: &[Pol]) {
        pols.iter().for_each(|p| self.set(p));
    }

    /// SIGHUP, then waits for the log line saying `outcome`.
    fn hup(&mut self, outcome: &str) {
        self.daemon.signal(Signal::SIGHUP).expect("SIGHUP");
        let line = self.daemon.wait_for(|l| l.contains("reload"), SIGNAL_TIMEOUT);
        let line = line.unwrap_or_else(|e| panic!("no '{outcome}' after SIGHUP: {e:#}"));
        assert!(line.contains(outcome), "after SIGHUP expected '{outcome}', got: {line}");
    }

    /// The kernel holds `pol` under `id`: the GCRA [`Pol::gcra`] computed, with its flags.
    fn check_installed(&self, pol: &Pol, id: u16) {
        let rules: Rules = self.snapshot().rules;
        let kernel = rules.policy(id).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(kernel.gcra, pol.gcra(), "policy '{}' (id {id}) in the kernel", pol.name);
        assert_eq!(kernel.flags & Policy::BYTES != 0, pol.bytes, "'{}' byte flag", pol.name);
        assert_eq!(kernel.flags & Policy::DRY_RUN != 0, pol.dry_run, "'{}' dry-run flag", pol.name);
        assert_eq!(kernel.flags & Policy::SCOPE_HOST == 0, pol.cpu, "'{}' scope flag", pol.name);
        let syn = pol.matches.ends_with(",syn");
        assert_eq!(kernel.flags & Policy::SYN_ONLY != 0, syn, "'{}' SYN-only flag", pol.name);
    }

    /// A flood of `streams` (interleaved) under `limits`, with every policy's counters read
    /// before it and a capture running from before it to after the link went quiet, which must
    /// have seen all of it and nothing else.
    fn counted_flood(&self, streams: &[Stream], limits: Limits) -> Run {
        let flooding = self.start_counted_flood(streams, limits, None);
        finish(flooding.unwrap_or_else(|e| panic!("starting the flood: {e:#}")))
    }

    /// The policy's counters and its deliveries: each group of flows (one expected bucket) within
    /// the bound, every frame sent to it judged, every admitted one delivered.
    fn check_policy(&self, pol: &Pol, run: &Run, groups: &[Vec<Flow>]) {
        let sent: u64 = groups.iter().flatten().map(|f| run.sent(f)).sum();
        let id = self.policy_id(pol.name);
        self.check_installed(pol, id);
        let judged = self.judged(run, id);
        eprintln!("  '{}' (id {id}): {judged}", pol.name);
        let window = run.window();
        for group in groups {
            let got = group.iter().map(|f| run.delivered(f)).sum();
            let what = format!("'{}' {group:?}", pol.name);
            check_bounds(&what, got, &pol.gcra(), &judged, window, &run.report);
        }
        let t = judged.total;
        assert_eq!(
            t.admitted_packets + t.refused_packets + t.dry_run_packets,
            sent,
            "'{}': judged vs sent to it",
            pol.name
        );
        let delivered: u64 = groups.iter().flatten().map(|f| run.delivered(f)).sum();
        assert_eq!(t.admitted_packets, delivered, "'{}': admitted vs delivered", pol.name);
        assert!(t.refused_packets > 0, "'{}' refused nothing: the flood did not test it", pol.name);
        assert_eq!(t.errors, 0, "'{}': the program reported internal errors", pol.name);
    }

    /// What no policy judged: exactly `unmatched` frames, no internal errors, nothing else.
    fn check_unjudged(&self, unmatched: u64, run: &Run) {
        let none = self.judged(run, 0).total;
        let expected = Counters { unmatched, ..Counters::default() };
        assert_eq!(none, expected, "traffic no policy judged (anything else reached XDP?)");
        run.check_capture();
    }
}

/// A flood bounded in packets sent all of them within its time limit; if not, the machine was
/// too slow (it is never the limiter: it cannot slow the sender).
pub fn check_sent_all(run: &Run, frames: u64, what: &str) {
    assert_eq!(
        run.report.sent,
        frames,
        "the machine sent only {} of {frames} packets in {:?} ({}): too slow to test {what}",
        run.report.sent,
        run.report.duration(),
        run.report
    );
}

/// The largest frame of `flow` the capture saw (the most one arrival weighs in bytes).
pub fn big_frame_len(run: &Run, flow: &Flow) -> u64 {
    run.captured.seen.iter().filter(|s| s.flow == *flow).map(|s| s.len).max().unwrap_or(1)
}

/// Waits for the flood, then for the link to go quiet; checks the capture is complete and holds
/// nothing but the flood.
pub fn finish(flooding: Flooding) -> Run {
    let run = flooding.finish().unwrap_or_else(|e| panic!("flood: {e:#}"));
    run.check_capture();
    run
}

/// `allow|deny list --json`: the networks listed, in order.
pub fn list_json(rig: &Rig, list: &str) -> Vec<String> {
    let out = rig.ctl_ok(&[list, "list", "--json"]);
    let entries: Vec<serde_json::Value> =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("`{list} list --json` ({e}): {out}"));
    entries
        .iter()
        .map(|e| e["cidr"].as_str().unwrap_or_else(|| panic!("`{list} list --json`: no cidr in {e}")).to_string())
        .collect()
}

/// A policy as TOML (one `[[policy]]` table), its scope said (a file without `version = 2`
/// reads a policy without it as scope cpu).
pub fn toml(p: &Pol) -> String {
    format!(
        "[[policy]]\nname = \"{}\"\nmatch = \"{}\"\nrate = \"{}/s\"\nburst = {}\nscope = \"{}\"\n\n",
        p.name,
        p.matches,
        p.per_sec,
        p.burst,
        if p.cpu { "cpu" } else { "host" }
    )
}

/// `policy list --json` as (name, rate) pairs, sorted: what the daemon runs.
pub fn running(rig: &Rig) -> Vec<(String, String)> {
    let mut v: Vec<_> = policies_json(rig)
        .iter()
        .map(|d| {
            (d["name"].as_str().unwrap_or_default().to_string(), d["rate"].as_str().unwrap_or_default().to_string())
        })
        .collect();
    v.sort();
    v
}

/// What [`running`] says while exactly `pols` run.
pub fn expected(pols: &[&Pol]) -> Vec<(String, String)> {
    let mut v: Vec<_> = pols.iter().map(|p| (p.name.to_string(), format!("{}/s", p.per_sec))).collect();
    v.sort();
    v
}

/// Polls [`running`] until it says `want`: the time it took from `since`, or None after `limit`.
pub fn wait_running(
    rig: &Rig,
    want: &[(String, String)],
    since: std::time::Instant,
    limit: std::time::Duration,
) -> Option<std::time::Duration> {
    while since.elapsed() < limit {
        if running(rig) == want {
            return Some(since.elapsed());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    None
}

/// `limiter_config_reloads_total{result}` from the rig's daemon's `/metrics`.
pub fn reloads(rig: &Rig, result: &str) -> u64 {
    let response = rig.scrape(METRICS).expect("scraping /metrics");
    let samples = scrape::parse(&response.body).expect("parsing /metrics");
    scrape::one(&samples, "limiter_config_reloads_total", &[("result", result)])
        .and_then(|s| s.u64())
        .unwrap_or_else(|e| panic!("{e:#}\n{}", response.body))
}

/// `policy list --json`, parsed.
pub fn policies_json(rig: &Rig) -> Vec<Value> {
    let out = rig.ctl_ok(&["policy", "list", "--json"]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("`policy list --json` ({e}): {out}"))
}

/// GCRA at `per_sec` a second with a burst of `burst`, one unit per packet: a policy a test sets
/// in-process.
pub fn gcra(per_sec: u64, burst: u64) -> Gcra {
    Gcra::new(per_sec, SEC, burst, 1).expect("the test's policies are valid")
}

/// An address written in a test.
pub fn src(s: &str) -> IpAddr {
    s.parse().expect("the test's addresses parse")
}

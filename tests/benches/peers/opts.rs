//! What to run: the options, and the workloads with their policies.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};
use limiter_tests::{
    generator::SourceRange,
    peers::{Cap, PerSource, System},
};

pub(crate) const POLICY: PerSource = PerSource { rate_per_s: 5, burst: 5, cap: None };
/// The policy issue 16 measured the refusal cost with: one source at 1000/s, burst 100.
pub(crate) const POLICY_1K: PerSource = PerSource { rate_per_s: 1000, burst: 100, cap: None };
/// The pair OPERATIONS recommends (issue 39): [`POLICY`] per source, and a cap of 1000/s burst
/// 1000 over every source together.
pub(crate) const PAIR: PerSource = PerSource { cap: Some(Cap { rate_per_s: 1000, burst: 1000 }), ..POLICY };

/// What to run (the options in the module doc).
#[derive(Clone, Debug)]
pub(crate) struct Opts {
    pub(crate) systems: Vec<System>,
    pub(crate) workloads: Vec<Workload>,
    pub(crate) runs: usize,
    pub(crate) flood: Duration,
    pub(crate) floods: bool,
    pub(crate) burst: bool,
    pub(crate) memory: bool,
    pub(crate) quick: bool,
    pub(crate) out: String,
    pub(crate) table: String,
    pub(crate) images: Option<String>,
}

impl Opts {
    pub(crate) fn parse() -> anyhow::Result<Opts> {
        let mut o = Opts {
            systems: System::ALL.to_vec(),
            workloads: Workload::ALL.to_vec(),
            runs: 3,
            flood: Duration::from_secs(2),
            floods: true,
            burst: true,
            memory: true,
            quick: false,
            out: "target/peers".into(),
            table: "target/peers.md".into(),
            images: None,
        };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            let mut value = || args.next().with_context(|| format!("{a} needs a value"));
            match a.as_str() {
                "--only" => {
                    o.systems = list(&value()?, |n| System::ALL.into_iter().find(|s| s.short() == n))?;
                }
                "--workloads" => {
                    o.workloads = list(&value()?, |n| Workload::ALL.into_iter().find(|w| w.short() == n))?;
                }
                "--runs" => o.runs = value()?.parse().context("--runs N")?,
                "--seconds" => o.flood = Duration::from_secs_f64(value()?.parse().context("--seconds S")?),
                "--parts" => {
                    let parts = value()?;
                    let parts: Vec<&str> = parts.split(',').collect();
                    for p in &parts {
                        ensure!(["floods", "burst", "memory"].contains(p), "--parts: unknown part {p:?}");
                    }
                    (o.floods, o.burst, o.memory) =
                        (parts.contains(&"floods"), parts.contains(&"burst"), parts.contains(&"memory"));
                }
                "--quick" => o.quick = true,
                "--out" => o.out = value()?,
                "--table" => o.table = value()?,
                "--images" => o.images = Some(value()?),
                // cargo bench passes --bench to every harness-less bench.
                "--bench" => {}
                _ => bail!("unknown option {a:?} (see the doc comment of tests/benches/peers/main.rs)"),
            }
        }
        if o.quick {
            (o.runs, o.flood) = (1, Duration::from_secs(1));
        }
        ensure!(o.runs >= 1 && !o.flood.is_zero(), "--runs and --seconds must be positive");
        Ok(o)
    }
}

/// A comma-separated list of names, each looked up by `find`.
pub(crate) fn list<T>(names: &str, find: impl Fn(&str) -> Option<T>) -> anyhow::Result<Vec<T>> {
    names.split(',').map(|n| find(n).with_context(|| format!("unknown name {n:?}"))).collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Workload {
    OneSource,
    /// The one-source flood at the issue's policy ([`POLICY_1K`]).
    OneSource1k,
    Spoofed,
    Churn,
    /// One source against the pair ([`PAIR`]).
    PairOneSource,
    /// 65,536 spoofed sources against the pair: the cap refuses most.
    PairSpoofed,
}

impl Workload {
    pub(crate) const ALL: [Workload; 6] =
        [Self::OneSource, Self::OneSource1k, Self::Spoofed, Self::Churn, Self::PairOneSource, Self::PairSpoofed];

    pub(crate) fn short(self) -> &'static str {
        match self {
            Self::OneSource => "one-source",
            Self::OneSource1k => "one-source-1k",
            Self::Spoofed => "spoofed",
            Self::Churn => "churn",
            Self::PairOneSource => "pair-one-source",
            Self::PairSpoofed => "pair-spoofed",
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::OneSource => "one source",
            Self::OneSource1k => "one source, 1000/s burst 100",
            Self::Spoofed => "65,536 spoofed sources",
            Self::Churn => "1,000,000 sources (key churn)",
            Self::PairOneSource => "one source, per source + aggregate cap",
            Self::PairSpoofed => "65,536 spoofed sources, per source + aggregate cap",
        }
    }

    /// The policy every system enforces on this workload's floods.
    pub(crate) fn policy(self) -> PerSource {
        match self {
            Self::OneSource1k => POLICY_1K,
            Self::OneSource | Self::Spoofed | Self::Churn => POLICY,
            Self::PairOneSource | Self::PairSpoofed => PAIR,
        }
    }

    /// One source flooding: nearly every packet dropped.
    pub(crate) fn one_source(self) -> bool {
        matches!(self, Self::OneSource | Self::OneSource1k | Self::PairOneSource)
    }

    /// The one-source flood as the claims name it, with its policy.
    pub(crate) fn claim(self) -> String {
        let p = self.policy();
        let issue = match self {
            Self::OneSource1k => ", the issue's harness",
            Self::PairOneSource => ", beside an aggregate cap",
            _ => "",
        };
        format!("one source at {}/s burst {}{issue}", p.rate_per_s, p.burst)
    }

    pub(crate) fn sources(self) -> SourceRange {
        match self {
            Self::OneSource | Self::OneSource1k | Self::PairOneSource => {
                SourceRange { first: v4(198, 19, 0, 1), count: 1 }
            }
            Self::Spoofed | Self::PairSpoofed => SourceRange { first: v4(198, 19, 0, 0), count: 1 << 16 },
            Self::Churn => {
                SourceRange { first: IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2)), count: 1_000_000 }
            }
        }
    }
}

pub(crate) fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

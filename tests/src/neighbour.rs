//! Another tcx program on the interface, loaded by the test: `neighbour`
//! (limiter-ebpf/src/bin/neighbour.rs), attached at tc ingress of a namespace's veth end through
//! a tcx link, in a given place in the chain. It counts every packet it runs on, and each IPv4
//! UDP flow's, and drops (TC_ACT_SHOT) IPv4 UDP to the port it was loaded with; anything else
//! goes on to the next program. So its counters say what reached it, and its drops what no
//! program after it sees.
//!
//! [`Neighbour::tally`] is one that drops nothing, last in the chain: it counts per flow what the
//! programs before it let through. A limiter at tcx is judged by it, not by a capture
//! ([`crate::capture`]): an AF_PACKET tap sees a frame after XDP but before tc ingress, so it sees
//! what tcx then drops.
//!
//! Dropping a [`Neighbour`] detaches and unloads it (its link and program are the object's).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
};

use anyhow::Context as _;
use aya::{
    Ebpf, EbpfLoader,
    maps::{PerCpuArray, PerCpuHashMap},
    programs::{LinkOrder, ProgramId, SchedClassifier, TcAttachType, tc::TcAttachOptions},
};
use limiter_ctl::kernel::NEIGHBOUR;

use crate::{
    flood::{Flow, L4},
    netns::End,
};

/// Its name as the kernel (and `bpftool prog`, and `--tcx-before`) shows it.
pub const NAME: &str = "neighbour";

/// Where in the tcx ingress chain to attach it.
#[derive(Clone, Copy, Debug)]
pub enum Place {
    First,
    Last,
    Before(u32),
    After(u32),
}

/// What it counted, summed over CPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Every packet it ran on.
    pub seen: u64,
    /// Those it dropped (UDP to its port).
    pub dropped: u64,
}

impl Counts {
    /// What it counted since `before`.
    pub fn since(&self, before: &Counts) -> Counts {
        Counts { seen: self.seen - before.seen, dropped: self.dropped - before.dropped }
    }
}

/// The neighbour loaded and attached at tcx ingress of one interface.
pub struct Neighbour {
    ebpf: Ebpf,
    /// Its program id.
    pub program: u32,
    /// The UDP destination port it drops.
    pub drop_port: u16,
}

impl Neighbour {
    /// Loads it to drop UDP to `drop_port` and attaches it at tcx ingress of `end`'s interface,
    /// at `place` (resolved in `end`'s namespace).
    pub fn attach(end: &End, drop_port: u16, place: Place) -> anyhow::Result<Self> {
        let mut ebpf = EbpfLoader::new()
            .override_global("DROP_PORT", &drop_port, true)
            .load(NEIGHBOUR)
            .context("loading the neighbour object")?;
        let program: &mut SchedClassifier = ebpf
            .program_mut(NAME)
            .context("no program 'neighbour' in the object")?
            .try_into()
            .context("'neighbour' is not a classifier")?;
        program.load().context("loading the neighbour program (verifier)")?;
        let id = program.info().context("the neighbour's program info")?.id();
        let order = match place {
            Place::First => LinkOrder::first(),
            Place::Last => LinkOrder::last(),
            // SAFETY: an id the caller read from the kernel; a wrong one makes the attach fail.
            Place::Before(p) => LinkOrder::before_program_id(unsafe { ProgramId::new(p) }),
            Place::After(p) => LinkOrder::after_program_id(unsafe { ProgramId::new(p) }),
        };
        let iface = end.iface.clone();
        end.run(|| program.attach_with_options(&iface, TcAttachType::Ingress, TcAttachOptions::TcxOrder(order)))?
            .with_context(|| format!("attaching the neighbour at tcx ingress of {iface} in {} ({place:?})", end.ns))?;
        Ok(Self { ebpf, program: id, drop_port })
    }

    /// One that drops nothing, last at tcx ingress of `end`'s interface: it counts what every
    /// program before it let through.
    pub fn tally(end: &End) -> anyhow::Result<Self> {
        Self::attach(end, 0, Place::Last)
    }

    /// Packets of each IPv4 UDP flow it ran on (dropped or not), summed over CPUs.
    pub fn flows(&self) -> anyhow::Result<BTreeMap<Flow, u64>> {
        let map = self.ebpf.map("NEIGHBOUR_FLOWS").context("no NEIGHBOUR_FLOWS map")?;
        let flows: PerCpuHashMap<_, u64, u64> = PerCpuHashMap::try_from(map)?;
        flows
            .iter()
            .map(|entry| {
                let (key, per_cpu) = entry?;
                let src = IpAddr::V4(Ipv4Addr::from((key >> 32) as u32));
                let flow = Flow { src, l4: L4::Udp, dport: key as u16 };
                Ok((flow, per_cpu.iter().sum()))
            })
            .collect()
    }

    /// Packets of `flow` it ran on (an IPv4 UDP flow; 0 for any other).
    pub fn flow(&self, flow: &Flow) -> anyhow::Result<u64> {
        Ok(self.flows()?.get(flow).copied().unwrap_or(0))
    }

    /// Its counters now, summed over CPUs.
    pub fn counts(&self) -> anyhow::Result<Counts> {
        let map = self.ebpf.map("NEIGHBOUR_COUNTS").context("no NEIGHBOUR_COUNTS map")?;
        let counts: PerCpuArray<_, u64> = PerCpuArray::try_from(map)?;
        let sum = |i: u32| -> anyhow::Result<u64> { Ok(counts.get(&i, 0)?.iter().sum()) };
        Ok(Counts { seen: sum(0)?, dropped: sum(1)? })
    }
}

/// The program ids at tcx ingress of `end`'s interface, in the order they run.
pub fn tcx_chain(end: &End) -> anyhow::Result<Vec<u32>> {
    let iface = end.iface.clone();
    let (_, programs) = end
        .run(|| SchedClassifier::query_tcx(&iface, TcAttachType::Ingress))?
        .with_context(|| format!("querying tcx ingress of {iface} in {}", end.ns))?;
    Ok(programs.iter().map(|p| p.id()).collect())
}

/// The names of the programs at tcx ingress of `end`'s interface, in order (for messages).
pub fn tcx_names(end: &End) -> anyhow::Result<Vec<String>> {
    let iface = end.iface.clone();
    let (_, programs) = end
        .run(|| SchedClassifier::query_tcx(&iface, TcAttachType::Ingress))?
        .with_context(|| format!("querying tcx ingress of {iface} in {}", end.ns))?;
    Ok(programs.iter().map(|p| format!("{} ({})", p.name_as_str().unwrap_or("?"), p.id())).collect())
}

//! Another tc program on the interface, loaded by the test: `neighbour`
//! (limiter-ebpf/src/bin/neighbour.rs), attached at tc ingress of a namespace's veth end through
//! a tcx link, in a given place in the chain, or through netlink, as a filter on the clsact qdisc
//! at a given priority. It counts every packet it runs on, and each IPv4 UDP flow's, and drops
//! (TC_ACT_SHOT) IPv4 UDP to the port it was loaded with; anything else goes on to the next
//! program. So its counters say what reached it, and its drops what no program after it sees.
//!
//! [`Neighbour::tally`] is one that drops nothing, last in the chain: it counts per flow what the
//! programs before it let through. A limiter at tcx is judged by it, not by a capture
//! ([`crate::capture`]): an AF_PACKET tap sees a frame after XDP but before tc ingress, so it sees
//! what tcx then drops.
//!
//! A limiter attached through a netlink filter runs after every tcx program: it is judged by
//! [`Neighbour::filter_tally`], a filter at a priority after the limiter's.
//!
//! Dropping a [`Neighbour`] detaches and unloads it (its link or filter, and its program, are the
//! object's). Also here: what the filters at tc ingress are ([`tc_filters`], as `tc` lists
//! them), and another XDP program ([`xdp_pass`]).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
};

use anyhow::Context as _;
use aya::{
    Ebpf, EbpfLoader,
    maps::{PerCpuArray, PerCpuHashMap},
    programs::{
        LinkOrder, ProgramId, SchedClassifier, TcAttachType, Xdp, XdpMode,
        tc::{self, NlOptions, TcAttachOptions, TcError},
    },
};
use limiter_ctl::kernel::{BENCH, NEIGHBOUR};

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
    /// Through netlink: a filter on the clsact qdisc at this priority (lower runs earlier),
    /// after every tcx program.
    Filter(u16),
}

/// The priority of [`Neighbour::filter_tally`]: after the limiter's filter (1, or next to a
/// neighbour's), as the kernel's first automatic priority is.
pub const TALLY_PRIORITY: u16 = 49152;

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
    /// Where its filter is, when it is one: deleted from there (netlink answers in the namespace
    /// it is asked in).
    filter_at: Option<End>,
}

impl Drop for Neighbour {
    fn drop(&mut self) {
        let Some(end) = self.filter_at.take() else { return };
        // Its namespace gone (the test's network dropped first), the filter went with it.
        if !std::path::Path::new(crate::netns::NETNS_DIR).join(&end.ns).exists() {
            return;
        }
        let ebpf = &mut self.ebpf;
        let unloaded = end.run(move || {
            let program: Option<&mut SchedClassifier> = ebpf.program_mut(NAME).and_then(|p| p.try_into().ok());
            program.map(SchedClassifier::unload)
        });
        if !matches!(unloaded, Ok(Some(Ok(())))) {
            eprintln!("warning: the neighbour's filter on {} may be left: {unloaded:?}", end.iface);
        }
    }
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
        let options = match place {
            Place::First => TcAttachOptions::TcxOrder(LinkOrder::first()),
            Place::Last => TcAttachOptions::TcxOrder(LinkOrder::last()),
            // SAFETY: an id the caller read from the kernel; a wrong one makes the attach fail.
            Place::Before(p) => TcAttachOptions::TcxOrder(LinkOrder::before_program_id(unsafe { ProgramId::new(p) })),
            Place::After(p) => TcAttachOptions::TcxOrder(LinkOrder::after_program_id(unsafe { ProgramId::new(p) })),
            Place::Filter(priority) => TcAttachOptions::Netlink(NlOptions { priority, ..NlOptions::default() }),
        };
        let iface = end.iface.clone();
        if matches!(place, Place::Filter(_)) {
            match end.run(|| tc::qdisc_add_clsact(&iface))? {
                Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(nix::libc::EEXIST) => {}
                other => other.with_context(|| format!("adding clsact to {iface} in {}", end.ns))?,
            }
        }
        end.run(|| program.attach_with_options(&iface, TcAttachType::Ingress, options))?
            .with_context(|| format!("attaching the neighbour at tc ingress of {iface} in {} ({place:?})", end.ns))?;
        let filter_at = matches!(place, Place::Filter(_)).then(|| end.clone());
        Ok(Self { ebpf, program: id, drop_port, filter_at })
    }

    /// One that drops nothing, last at tcx ingress of `end`'s interface: it counts what every
    /// program before it let through.
    pub fn tally(end: &End) -> anyhow::Result<Self> {
        Self::attach(end, 0, Place::Last)
    }

    /// One that drops nothing, through netlink, at [`TALLY_PRIORITY`]: it counts what a limiter's
    /// filter (and every tcx program) let through.
    pub fn filter_tally(end: &End) -> anyhow::Result<Self> {
        Self::attach(end, 0, Place::Filter(TALLY_PRIORITY))
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

/// A filter at tc ingress, as `tc -j filter show dev IFACE ingress` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcFilter {
    pub priority: u16,
    pub handle: u32,
    /// `bpf`, `u32`, ...
    pub kind: String,
    /// The program a `bpf` filter runs.
    pub program: Option<u32>,
}

/// The filters at tc ingress of `end`'s interface, by priority, as `tc` (iproute2) lists them: an
/// entry with `options` is a filter, one without is its classifier's own.
pub fn tc_filters(end: &End) -> anyhow::Result<Vec<TcFilter>> {
    let out = end.command("tc").args(["-j", "filter", "show", "dev", &end.iface, "ingress"]).output()?;
    anyhow::ensure!(out.status.success(), "tc filter show: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let entries: Vec<serde_json::Value> = if text.trim().is_empty() {
        Vec::new()
    } else {
        serde_json::from_str(&text).with_context(|| format!("tc -j: {text}"))?
    };
    let mut filters = Vec::new();
    for entry in entries.iter().filter(|e| e.get("options").is_some()) {
        let options = &entry["options"];
        let handle = options["handle"].as_str().with_context(|| format!("no handle in {entry}"))?;
        let handle = u32::from_str_radix(handle.trim_start_matches("0x"), 16).with_context(|| format!("{entry}"))?;
        filters.push(TcFilter {
            priority: u16::try_from(entry["pref"].as_u64().with_context(|| format!("no pref in {entry}"))?)?,
            handle,
            kind: entry["kind"].as_str().unwrap_or_default().to_string(),
            program: options.pointer("/prog/id").and_then(serde_json::Value::as_u64).map(|id| id as u32),
        });
    }
    filters.sort_by_key(|f| (f.priority, f.handle));
    Ok(filters)
}

/// Another XDP program on `end`'s interface, in native mode: `program` of the bench object
/// (`bench_pass` passes everything). Dropping the object detaches it.
pub fn xdp_pass(end: &End, program: &'static str) -> anyhow::Result<Ebpf> {
    let mut ebpf = EbpfLoader::new().load(BENCH)?;
    let prog: &mut Xdp = ebpf.program_mut(program).context("bench program")?.try_into()?;
    prog.load()?;
    let iface = end.iface.clone();
    end.run(move || -> anyhow::Result<Ebpf> {
        let prog: &mut Xdp = ebpf.program_mut(program).context("bench program")?.try_into()?;
        prog.attach(&iface, XdpMode::Driver)?;
        Ok(ebpf)
    })?
}

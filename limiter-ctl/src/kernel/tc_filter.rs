//! tc ingress through netlink, where the kernel has no tcx (before Linux 6.6) or when asked
//! (`--tc-api netlink`): the limiter's tc program in a direct-action `bpf` filter on the
//! interface's clsact qdisc, with the handle [`HANDLE`] and a priority of its own (1: before
//! every other filter, unless `--tcx-before`/`--tcx-after` name one: right before or after it).
//!
//! A filter is no bpf_link: the kernel holds it, not a descriptor. So it outlives the daemon
//! (fail static) without a pin, and can be replaced in place (the same priority and handle, a
//! new program: no gap); but anyone with CAP_NET_ADMIN can delete it (`tc filter del`, `tc qdisc
//! del ... clsact`), and a daemon killed between attaching one and recording it leaves it behind.
//! The limiter's filters are found by what they run: a program named `limiter_tcx`; its own are
//! those whose program uses its pinned maps (no other limiter shares them).

use std::{collections::BTreeMap, fmt};

use aya::programs::{
    Link as _, TcAttachType, loaded_programs,
    tc::{self, SchedClassifierLink, TcError},
};
use limiter_common::maps::PROGRAM_TCX;
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
};

use super::{Error, TcxPlace, host::if_index, rtnl, tcx};

/// The limiter's filter handle: "LIM" in ASCII (`tc filter show` prints `handle 0x4c494d`).
pub const HANDLE: u32 = 0x004c_494d;
/// The limiter's priority when it runs first (lower runs earlier; 1 is the earliest).
pub const FIRST: u16 = 1;
/// Filters at ingress of a clsact qdisc hang under this parent (TC_H_CLSACT:TC_H_MIN_INGRESS).
const INGRESS: TcHandle = TcHandle { major: 0xffff, minor: TcHandle::MIN_INGRESS };

/// A filter at tc ingress, as the kernel lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcFilter {
    pub priority: u16,
    pub handle: u32,
    /// The classifier: `bpf`, `u32`, `flower`, `matchall`, ...
    pub kind: String,
    /// What a `bpf` filter runs.
    pub program: Option<FilterProgram>,
}

/// The program a `bpf` filter runs: its id, its name as the kernel keeps it, and its maps' ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FilterProgram {
    pub id: u32,
    pub name: String,
    pub maps: Vec<u32>,
}

impl TcFilter {
    /// Whether it runs a limiter's tc program (this one's, or another limiter's).
    pub fn is_limiter(&self) -> bool {
        self.program.as_ref().is_some_and(|p| p.name == PROGRAM_TCX)
    }

    /// Whether it runs a limiter program using the map `map` (a limiter's config map: its own).
    pub fn uses_map(&self, map: u32) -> bool {
        self.is_limiter() && self.program.as_ref().is_some_and(|p| p.maps.contains(&map))
    }

    pub fn program_id(&self) -> Option<u32> {
        self.program.as_ref().map(|p| p.id)
    }
}

impl fmt::Display for TcFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "priority {} handle {:#x}: {}", self.priority, self.handle, self.kind)?;
        match &self.program {
            Some(p) => write!(f, " program id {} '{}'", p.id, p.name),
            None => Ok(()),
        }
    }
}

/// The filters at tc ingress of `iface` (none without a clsact qdisc), by priority then handle.
pub(crate) fn filters(iface: &str) -> Result<Vec<TcFilter>, Error> {
    let found = dump(iface)?;
    let ids: Vec<u32> = found.iter().filter_map(|f| f.program).collect();
    let mut programs = programs(&ids);
    Ok(found
        .into_iter()
        .map(|Listed { priority, handle, kind, program }| TcFilter {
            priority,
            handle,
            kind,
            program: program
                .map(|id| programs.remove(&id).unwrap_or(FilterProgram { id, name: String::new(), maps: vec![] })),
        })
        .collect())
}

/// A filter as the dump lists it: its program by id only.
pub(crate) struct Listed {
    pub priority: u16,
    pub handle: u32,
    pub kind: String,
    pub program: Option<u32>,
}

/// The filters at tc ingress of `iface`, as the kernel lists them (cheap: one netlink dump).
pub(crate) fn dump(iface: &str) -> Result<Vec<Listed>, Error> {
    let failed = |error| Error::TcFilterQuery { iface: iface.into(), error };
    let Some(index) = if_index(iface) else { return Ok(Vec::new()) };
    let mut ask = TcMessage::default();
    ask.header.index = index as i32;
    ask.header.parent = INGRESS;
    let answer = rtnl::ask(RouteNetlinkMessage::GetTrafficFilter(ask), true).map_err(failed)?;
    let mut found: Vec<Listed> = answer
        .into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewTrafficFilter(m) => Some(m),
            _ => None,
        })
        // Handle 0: the classifier's own entry, listed before its filters.
        .filter(|m| u32::from(m.header.handle) != 0)
        .map(|m| Listed {
            priority: (m.header.info >> 16) as u16,
            handle: u32::from(m.header.handle),
            kind: m
                .attributes
                .iter()
                .find_map(|a| match a {
                    TcAttribute::Kind(k) => Some(k.clone()),
                    _ => None,
                })
                .unwrap_or_default(),
            program: m.attributes.iter().find_map(|a| match a {
                TcAttribute::Options(options) => options.iter().find_map(|o| match o {
                    TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => Some(*id),
                    _ => None,
                }),
                _ => None,
            }),
        })
        .collect();
    found.sort_by_key(|f| (f.priority, f.handle));
    Ok(found)
}

/// The name and maps of each program of `ids` (those the kernel still has).
fn programs(ids: &[u32]) -> BTreeMap<u32, FilterProgram> {
    if ids.is_empty() {
        return BTreeMap::new();
    }
    loaded_programs()
        .filter_map(Result::ok)
        .filter(|p| ids.contains(&p.id()))
        .map(|p| {
            let name = p.name_as_str().unwrap_or_default().to_string();
            let maps = p.map_ids().ok().flatten().unwrap_or_default();
            (p.id(), FilterProgram { id: p.id(), name, maps })
        })
        .collect()
}

/// The priority the limiter's new filter takes at `place`: [`FIRST`], or right before or after
/// the filter running the program named. Refused, saying why, when that priority is another
/// filter's (sharing one would leave the order within it to the classifier), or out of range.
pub(crate) fn priority_for(iface: &str, place: &TcxPlace) -> Result<u16, Error> {
    let present = filters(iface)?;
    let taken = |priority: u16| present.iter().find(|f| f.priority == priority);
    let refuse = |priority: u16, why: String| Error::TcPriority { iface: iface.into(), priority, why };
    let (priority, at) = match place {
        TcxPlace::First => (FIRST, "first".to_string()),
        TcxPlace::Before(prog) | TcxPlace::After(prog) => {
            let before = matches!(place, TcxPlace::Before(_));
            let named = |f: &&TcFilter| f.program.as_ref().is_some_and(|p| prog.names(p.id, &p.name));
            let found: Vec<&TcFilter> = present.iter().filter(named).collect();
            let target = match found.as_slice() {
                [one] => *one,
                [] => return unnamed(iface, prog, before, &present),
                many => {
                    let ids = many.iter().filter_map(|f| f.program_id()).map(|i| format!("id:{i}")).collect::<Vec<_>>();
                    return Err(Error::AmbiguousTcxProgram {
                        iface: iface.into(),
                        prog: prog.to_string(),
                        ids: ids.join(", "),
                    });
                }
            };
            let next =
                if before { target.priority.checked_sub(1).filter(|p| *p > 0) } else { target.priority.checked_add(1) };
            let at = format!("{} {prog} ({target})", if before { "right before" } else { "right after" });
            match next {
                Some(priority) => (priority, at),
                None => return Err(refuse(target.priority, format!("no priority is left {at}"))),
            }
        }
    };
    match taken(priority) {
        Some(other) => Err(refuse(priority, format!("the limiter's filter would go {at}, but {other} holds it"))),
        None => Ok(priority),
    }
}

/// A program named by `--tcx-before`/`--tcx-after` that no filter runs: at tcx (which runs before
/// every filter), `after` it is where a filter is anyway ([`FIRST`]); else refused.
fn unnamed(iface: &str, prog: &tcx::ProgRef, before: bool, present: &[TcFilter]) -> Result<u16, Error> {
    let at_tcx = tcx::programs(iface).unwrap_or_default().iter().any(|p| prog.names(p.id, &p.name));
    match (at_tcx, before) {
        (true, false) => priority_for(iface, &TcxPlace::First),
        (true, true) => Err(Error::TcxBeforeFilter { iface: iface.into(), prog: prog.to_string() }),
        (false, _) => {
            Err(Error::NoSuchTcxProgram { iface: iface.into(), prog: prog.to_string(), chain: listed(present) })
        }
    }
}

/// The filters in words, for an error: "priority 1 handle 0x1: u32, ..." or "nothing".
pub(crate) fn listed(filters: &[TcFilter]) -> String {
    if filters.is_empty() {
        return "no filter".into();
    }
    filters.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// Adds the clsact qdisc to `iface` unless it has one (tc filters hang under it; other tools'
/// too, so the limiter never removes it).
pub(crate) fn ensure_clsact(iface: &str) -> Result<(), Error> {
    match tc::qdisc_add_clsact(iface) {
        Ok(()) => Ok(()),
        Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(nix::libc::EEXIST) => Ok(()),
        Err(source) => Err(Error::Clsact { iface: iface.into(), source }),
    }
}

/// Deletes the filter at `priority` and [`HANDLE`] of `iface`'s ingress.
pub(crate) fn delete(iface: &str, priority: u16) -> Result<(), Error> {
    let failed = |source| Error::Detach { iface: iface.into(), source };
    let link = SchedClassifierLink::attached(iface, TcAttachType::Ingress, priority, HANDLE.into(), None)
        .map_err(|e| Error::Detach { iface: iface.into(), source: TcError::IoError(e).into() })?;
    link.detach().map_err(failed)
}

/// The link aya hands back for a filter it made: kept as it is, for the kernel holds the filter
/// and dropping the link would delete it (the daemon leaves it when it exits: fail static).
pub(super) fn keep(link: SchedClassifierLink) {
    std::mem::forget(link);
}

//! Which policies judge which packets: policies may overlap, and a packet is judged by every
//! policy that covers it (its match, then its predicates: SYN-only, source ports, destination
//! prefix), in a documented order. Here the policies are sorted into candidate lists, one per
//! protocol class and one per stretch of destination ports whose covering policies differ
//! ([`Layering::of`]); the kernel room compiles them into routes and layer sets.
//!
//! Also the checks on a layering: at most [`MAX_CANDIDATES`] policies share a list, and at most
//! [`MAX_LAYERS`] of a list can all meet one packet ([`Layering::check`]); and the warnings for
//! a layer whose allowance another layer never lets it use ([`Layering::warnings`]).

use std::{cmp::Reverse, collections::BTreeSet};

use limiter_common::maps::{MAX_CANDIDATES, MAX_LAYERS};

use super::{
    Error,
    def::PolicyDef,
    policy::{Match, Name, Ports, Proto, Unit},
};

/// The protocol classes a layering has lists for, in the kernel's class order.
pub const CLASSES: [Proto; 4] = [Proto::Tcp, Proto::Udp, Proto::Icmp, Proto::Any];

/// A stretch of destination ports of TCP or UDP whose covering policies differ from the
/// protocol's: the ports `lo..=hi` and, in judging order, the ids of the policies covering them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortStretch {
    pub proto: Proto,
    pub lo: u16,
    pub hi: u16,
    pub ids: Vec<u16>,
}

/// The candidate lists of a set of policies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layering {
    /// For each class of [`CLASSES`] (the last: neither TCP, UDP nor ICMP), the policies its
    /// packets meet without a port policy, in judging order.
    pub classes: [Vec<u16>; 4],
    /// Stretches of ports with port policies, ascending, disjoint.
    pub ports: Vec<PortStretch>,
}

/// A policy as the layering sees it.
struct Candidate<'a> {
    id: u16,
    def: &'a PolicyDef,
}

/// How specific a match's destination is: exact port, then range, then protocol, then any.
fn tier(m: &Match) -> u8 {
    match (m.proto, m.ports) {
        (_, Some(Ports::Exact(_))) => 0,
        (_, Some(Ports::Range(..))) => 1,
        (Proto::Any, None) => 3,
        (_, None) => 2,
    }
}

/// The judging order: most specific destination match first; then per source before aggregate
/// (the longer key prefix first, IPv4 then IPv6); then by name.
fn order(c: &Candidate) -> (u8, Reverse<u8>, Reverse<u8>, Name) {
    let k = c.def.key;
    (tier(&c.def.matches), Reverse(k.v4_prefix), Reverse(k.v6_prefix), c.def.name.clone())
}

fn sorted(mut list: Vec<&Candidate>) -> Vec<u16> {
    list.sort_by_key(|c| order(c));
    list.iter().map(|c| c.id).collect()
}

impl Layering {
    /// The candidate lists of `policies` (id, definition).
    pub fn of<'a>(policies: impl IntoIterator<Item = (u16, &'a PolicyDef)>) -> Self {
        let all: Vec<Candidate> = policies.into_iter().map(|(id, def)| Candidate { id, def }).collect();
        let class_list = |proto: Proto| {
            sorted(
                all.iter()
                    .filter(|c| c.def.matches.ports.is_none())
                    .filter(|c| c.def.matches.proto == proto || c.def.matches.proto == Proto::Any)
                    .collect(),
            )
        };
        let classes = CLASSES.map(class_list);
        let mut ports = Vec::new();
        for proto in [Proto::Tcp, Proto::Udp] {
            let port_policies: Vec<&Candidate> =
                all.iter().filter(|c| c.def.matches.proto == proto && c.def.matches.ports.is_some()).collect();
            // Where the covering policies can change: each port policy's first port and the
            // one after its last.
            let mut cuts = BTreeSet::new();
            for c in &port_policies {
                let (lo, hi) = span(c.def.matches.ports);
                cuts.insert(u32::from(lo));
                cuts.insert(u32::from(hi) + 1);
            }
            let cuts: Vec<u32> = cuts.into_iter().collect();
            for pair in cuts.windows(2) {
                let (lo, hi) = (pair[0] as u16, (pair[1] - 1) as u16);
                let covering: Vec<&Candidate> = port_policies
                    .iter()
                    .copied()
                    .filter(|c| {
                        let (a, b) = span(c.def.matches.ports);
                        a <= lo && hi <= b
                    })
                    .chain(all.iter().filter(|c| {
                        c.def.matches.ports.is_none()
                            && (c.def.matches.proto == proto || c.def.matches.proto == Proto::Any)
                    }))
                    .collect();
                if covering.iter().any(|c| c.def.matches.ports.is_some()) {
                    ports.push(PortStretch { proto, lo, hi, ids: sorted(covering) });
                }
            }
        }
        Self { classes, ports }
    }

    /// Every list with what its traffic is called (for errors and warnings).
    pub fn lists(&self) -> impl Iterator<Item = (String, &Vec<u16>)> {
        let classes = CLASSES.iter().zip(&self.classes).map(|(p, ids)| {
            let what = if *p == Proto::Any { "other IP traffic".to_string() } else { p.as_str().to_string() };
            (what, ids)
        });
        let ports = self.ports.iter().map(|s| {
            let what = if s.lo == s.hi {
                format!("{}:{}", s.proto.as_str(), s.lo)
            } else {
                format!("{}:{}-{}", s.proto.as_str(), s.lo, s.hi)
            };
            (what, &s.ids)
        });
        classes.chain(ports)
    }

    /// Refuses a layering the kernel cannot judge: more than [`MAX_CANDIDATES`] policies on one
    /// list, or more than [`MAX_LAYERS`] of one list that can all meet one packet.
    pub fn check<'a>(&self, def: impl Fn(u16) -> Option<&'a PolicyDef>) -> Result<(), Error> {
        let names = |ids: &[u16]| ids.iter().filter_map(|&id| def(id)).map(|d| d.name.clone()).collect::<Vec<_>>();
        for (what, ids) in self.lists() {
            if ids.len() > MAX_CANDIDATES {
                return Err(Error::TooManyCandidates { traffic: what, names: names(ids), max: MAX_CANDIDATES });
            }
            let defs: Vec<&PolicyDef> = ids.iter().filter_map(|&id| def(id)).collect();
            for v6 in [false, true] {
                let most = largest_meeting(&defs, v6);
                if most.len() > MAX_LAYERS {
                    let names = most.iter().map(|&i| defs[i].name.clone()).collect();
                    return Err(Error::TooManyLayers { traffic: what, names, max: MAX_LAYERS });
                }
            }
        }
        Ok(())
    }

    /// Layers whose allowance another layer never lets them use: every packet `b` judges also
    /// meets `a`, which groups at least `b`'s sources into one key, with a smaller burst or a
    /// lower rate in the same unit. One line each, naming both.
    pub fn warnings<'a>(&self, def: impl Fn(u16) -> Option<&'a PolicyDef>) -> Vec<String> {
        let mut out = BTreeSet::new();
        for (_, ids) in self.lists() {
            let defs: Vec<&PolicyDef> = ids.iter().filter_map(|&id| def(id)).collect();
            for b in &defs {
                for a in &defs {
                    if a.name == b.name || !covers(a, b) || a.unit != b.unit {
                        continue;
                    }
                    let unit = if a.unit == Unit::Bytes { " bytes" } else { "" };
                    let (ab, bb) = (a.burst_or_default(), b.burst_or_default());
                    if ab < bb {
                        out.insert(format!(
                            "policy '{}' can never pass its burst of {bb}{unit}: every packet it judges also meets \
                             policy '{}' ({}, key {}), whose burst is {ab}{unit}",
                            b.name, a.name, a.matches, a.key
                        ));
                    }
                    // Rates compared as count per period, without rounding: a/pa < b/pb.
                    let (ar, br) = (a.rate, b.rate);
                    if u128::from(ar.count) * u128::from(br.period_ns) < u128::from(br.count) * u128::from(ar.period_ns)
                    {
                        out.insert(format!(
                            "policy '{}' can never reach its rate of {}: every packet it judges also meets policy \
                             '{}' ({}, key {}), whose rate is {}",
                            b.name, b.rate, a.name, a.matches, a.key, a.rate
                        ));
                    }
                }
            }
        }
        out.into_iter().collect()
    }
}

/// The ports a port match covers.
fn span(ports: Option<Ports>) -> (u16, u16) {
    match ports {
        Some(Ports::Exact(p)) => (p, p),
        Some(Ports::Range(lo, hi)) => (lo, hi),
        None => (0, u16::MAX),
    }
}

/// Whether some packet of the family meets both policies' predicates (their matches already
/// share the list's traffic). Source port ranges and destination prefixes each overlap pairwise
/// only where they share a point, so policies that pairwise overlap all meet one packet.
fn overlap(a: &PolicyDef, b: &PolicyDef, v6: bool) -> bool {
    a.sport.overlaps(&b.sport) && a.dst.overlaps(&b.dst, v6)
}

/// The largest group of `defs` that can all meet one packet of the family (indexes into `defs`;
/// at most [`MAX_CANDIDATES`] of them, so every subset is tried).
fn largest_meeting(defs: &[&PolicyDef], v6: bool) -> Vec<usize> {
    let n = defs.len().min(MAX_CANDIDATES);
    let mut best = Vec::new();
    for subset in 1u32..(1 << n) {
        let members: Vec<usize> = (0..n).filter(|i| subset & (1 << i) != 0).collect();
        if members.len() <= best.len() {
            continue;
        }
        let all_meet = members.iter().all(|&i| defs[i].dst.admits_family(v6))
            && members.iter().all(|&i| members.iter().all(|&j| i >= j || overlap(defs[i], defs[j], v6)));
        if all_meet {
            best = members;
        }
    }
    best
}

/// Whether every packet `b` judges also meets `a` under a key that groups at least `b`'s
/// sources: `a`'s predicates are no narrower, its key prefixes no longer, and it keys on the
/// destination port only if `b` does. (Both are on one list, so `a`'s match covers `b`'s
/// traffic there.)
fn covers(a: &PolicyDef, b: &PolicyDef) -> bool {
    let m = |d: &PolicyDef| d.matches;
    // `a`'s ports hold `b`'s: no port match, or a span over `b`'s (both are on one list, so of
    // one protocol where both have ports).
    let (a_lo, a_hi) = span(m(a).ports);
    let (b_lo, b_hi) = span(m(b).ports);
    let tier_ok =
        tier(&m(a)) >= tier(&m(b)) && (m(a).ports.is_none() || (m(b).ports.is_some() && a_lo <= b_lo && b_hi <= a_hi));
    let syn_ok = !m(a).syn || m(b).syn;
    let sport_ok = match (a.sport.0, b.sport.0) {
        (None, _) => true,
        (Some((lo, hi)), Some((l, h))) => lo <= l && h <= hi,
        (Some(_), None) => false,
    };
    let dst_ok = |x: Option<bool>| x.unwrap_or(true);
    let v4_ok = dst_ok(a.dst.v4.map(|n| b.dst.v4.is_some_and(|m| n.contains(&m))));
    let v6_ok = dst_ok(a.dst.v6.map(|n| b.dst.v6.is_some_and(|m| n.contains(&m))));
    let dst_family_ok =
        a.dst.is_any() || (b.dst.v4.is_none() || a.dst.v4.is_some()) && (b.dst.v6.is_none() || a.dst.v6.is_some());
    let key_ok =
        a.key.v4_prefix <= b.key.v4_prefix && a.key.v6_prefix <= b.key.v6_prefix && (!a.key.dport || b.key.dport);
    tier_ok && syn_ok && sport_ok && v4_ok && v6_ok && dst_family_ok && !b.dst.is_any() | a.dst.is_any() && key_ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Rate;

    fn def(name: &str, m: &str) -> PolicyDef {
        PolicyDef {
            name: name.parse().unwrap(),
            matches: m.parse().unwrap(),
            ..PolicyDef::any("10/s".parse().unwrap(), 10)
        }
    }

    fn layering(defs: &[PolicyDef]) -> Layering {
        Layering::of(defs.iter().enumerate().map(|(i, d)| (i as u16 + 1, d)))
    }

    #[test]
    fn every_covering_policy_is_a_candidate_in_order() {
        let mut agg = def("agg", "udp:9999");
        agg.key = "src/0,/0".parse().unwrap();
        let defs =
            [def("any", "any"), def("udp", "udp"), def("range", "udp:9000-9999"), def("per-source", "udp:9999"), agg];
        let l = layering(&defs);
        assert_eq!(l.classes[0], vec![1], "tcp: any only");
        assert_eq!(l.classes[1], vec![2, 1], "udp: udp, then any");
        assert_eq!(l.classes[3], vec![1]);
        let at = |port: u16| {
            l.ports.iter().find(|s| s.proto == Proto::Udp && s.lo <= port && port <= s.hi).map(|s| s.ids.clone())
        };
        assert_eq!(at(9999), Some(vec![4, 5, 3, 2, 1]), "exact (per source, then aggregate), range, protocol, any");
        assert_eq!(at(9000), Some(vec![3, 2, 1]));
        assert_eq!(at(8999), None, "no port policy: the protocol's list");
        assert!(matches!(l.check(|id| defs.get(usize::from(id) - 1)), Err(Error::TooManyLayers { .. })), "five layers");
    }

    #[test]
    fn predicates_that_cannot_meet_do_not_count_as_layers() {
        let mut defs: Vec<PolicyDef> = (0..6)
            .map(|i| {
                let mut d = def(&format!("r{i}"), "udp");
                d.sport = format!("{}", [53, 123, 389, 1900, 11211, 19][i]).parse().unwrap();
                d
            })
            .collect();
        defs.push(def("udp-all", "udp"));
        let l = layering(&defs);
        l.check(|id| defs.get(usize::from(id) - 1)).unwrap();
        let mut v4 = def("v4", "udp");
        v4.dst = "198.18.0.2/32".parse().unwrap();
        let mut v6 = def("v6", "udp");
        v6.dst = "2001:db8::2/128".parse().unwrap();
        let defs = [v4, v6, def("a", "udp"), def("b", "any"), def("c", "any")];
        layering(&defs).check(|id| defs.get(usize::from(id) - 1)).unwrap();
        let nine: Vec<PolicyDef> = (0..9).map(|i| def(&format!("p{i}"), "udp")).collect();
        assert!(matches!(
            layering(&nine).check(|id| nine.get(usize::from(id) - 1)),
            Err(Error::TooManyCandidates { .. })
        ));
    }

    #[test]
    fn an_aggregate_below_a_per_source_burst_is_a_warning() {
        let per_source = PolicyDef { burst: Some(100), ..def("per-source", "udp:9999") };
        let agg = PolicyDef {
            key: "src/0,/0".parse().unwrap(),
            burst: Some(50),
            rate: Rate { count: 5, period_ns: 1_000_000_000 },
            ..def("agg", "udp:9999")
        };
        let defs = [per_source, agg];
        let w = layering(&defs).warnings(|id| defs.get(usize::from(id) - 1));
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("'per-source'") && w[0].contains("'agg'"), "{w:?}");
        // An aggregate on a range over a per-source exact port covers it too.
        let exact = PolicyDef { burst: Some(100), ..def("dns", "udp:53") };
        let range = PolicyDef { key: "src/0,/0".parse().unwrap(), burst: Some(50), ..def("low", "udp:1-1023") };
        let defs = [exact, range];
        let w = layering(&defs).warnings(|id| defs.get(usize::from(id) - 1));
        assert!(w.iter().any(|w| w.contains("'dns'") && w.contains("'low'") && w.contains("burst")), "{w:?}");
        // A finer layer never limits a coarser one's use: nothing to say the other way round.
        let fine = PolicyDef { key: "src/32".parse().unwrap(), burst: Some(5), ..def("fine", "udp") };
        let coarse = PolicyDef { key: "src/24".parse().unwrap(), burst: Some(50), ..def("coarse", "udp") };
        let defs = [fine, coarse];
        assert!(layering(&defs).warnings(|id| defs.get(usize::from(id) - 1)).is_empty());
    }
}

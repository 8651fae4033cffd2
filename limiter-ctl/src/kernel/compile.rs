//! The validated state (`config::State`) in the kernel's terms: a policy record per policy
//! ([`policy`], [`record`]) and the routing of packets to them ([`routes`]). What each field of
//! a policy means to the XDP program is said here, and only here.

use std::collections::BTreeMap;

use limiter_common::{
    Gcra,
    gcra::GcraError,
    key::prefix_mask_words,
    maps::{
        CLASS_OTHER, CLASS_TCP, CLASS_UDP, CLASSES, Config, LAYERED, LEASE_NS, LayerSet, MAX_LAYERS, MAX_LEASE,
        PORT_POLICY_ENTRIES, Policy,
    },
};

use crate::config::{Entry, List, Mode, PolicyDef, Proto, Scope, State, Unit};

/// The kernel record of policy `def` under `id`; an error if its rate and burst cannot be
/// represented. A validated state's entries compile with [`record`].
pub fn policy(def: &PolicyDef, id: u16) -> Result<Policy, GcraError> {
    Ok(record(def, def.gcra()?, id))
}

/// The kernel record of a validated policy.
pub fn entry(e: &Entry) -> Policy {
    record(&e.def, e.gcra, e.id)
}

/// The kernel record of `def`, judged by `gcra`, under `id`.
pub fn record(def: &PolicyDef, gcra: Gcra, id: u16) -> Policy {
    let mut flags = Policy::ACTIVE;
    if def.unit == Unit::Bytes {
        flags |= Policy::BYTES;
    }
    if def.mode == Mode::DryRun {
        flags |= Policy::DRY_RUN;
    }
    if def.key.dport {
        flags |= Policy::KEY_DPORT;
    }
    if def.scope == Scope::Host {
        flags |= Policy::SCOPE_HOST;
    }
    if def.matches.syn {
        flags |= Policy::SYN_ONLY;
    }
    if def.rate.count == 0 {
        flags |= Policy::DENY;
    }
    let (sport_lo, sport_hi) = def.sport.0.unwrap_or((0, u16::MAX));
    if def.sport.0.is_some() {
        flags |= Policy::SPORT;
    }
    // Destination prefixes as the program reads addresses: the network-order bytes loaded as
    // little-endian words (`Packet::dst`), masked the same way.
    let (mut dst_v4, mut dst_v4_mask, mut dst_v6, mut dst_v6_mask) = (0, 0, [0; 2], [0; 2]);
    if let Some(net) = def.dst.v4 {
        flags |= Policy::DST_V4;
        dst_v4_mask = u64::from(u32::from_le_bytes(net.netmask().octets()));
        dst_v4 = u64::from(u32::from_le_bytes(net.network().octets()));
    }
    if let Some(net) = def.dst.v6 {
        flags |= Policy::DST_V6;
        let words = |b: [u8; 16]| {
            let (lo, hi) = b.split_at(8);
            [
                u64::from_le_bytes(lo.try_into().unwrap_or_default()),
                u64::from_le_bytes(hi.try_into().unwrap_or_default()),
            ]
        };
        dst_v6_mask = words(net.netmask().octets());
        dst_v6 = words(net.network().octets());
    }
    Policy {
        gcra,
        // The slot's, set when it is stored (`kernel::maps::store_policy`).
        hold_until_ns: 0,
        v6_mask: prefix_mask_words(def.key.v6_prefix),
        v4_mask: prefix_mask_words(def.key.v4_prefix)[0],
        flags,
        id,
        v4_prefix: def.key.v4_prefix,
        v6_prefix: def.key.v6_prefix,
        sport_lo,
        sport_hi,
        lease: lease(def),
        dst_v4,
        dst_v4_mask,
        dst_v6,
        dst_v6_mask,
    }
}

/// How many units a CPU of an aggregate reserves at once (`limiter_common::maps::Lease`): about
/// `LEASE_NS` worth of its rate, at most `MAX_LEASE` and a quarter of its burst. Only a
/// host-scope policy of one key per family (`src/0,/0`, no `+dport`) counting packets has one: a
/// lease serves one key per CPU, and a per-source policy's keys are many.
pub fn lease(def: &PolicyDef) -> u32 {
    let aggregate = def.scope == Scope::Host
        && def.unit == Unit::Packets
        && def.key.v4_prefix == 0
        && def.key.v6_prefix == 0
        && !def.key.dport;
    if !aggregate || def.rate.count == 0 {
        return 0;
    }
    let per_lease = u128::from(LEASE_NS) * u128::from(def.rate.count) / u128::from(def.rate.period_ns.max(1));
    let cap = u128::from(MAX_LEASE).min(u128::from(def.burst_or_default() / 4));
    let units = per_lease.min(cap) as u32;
    if units > 1 { units } else { 0 }
}

/// Where each packet class goes: what `PORT_POLICY`, `Config::class_policy` and `LAYER_SETS`
/// hold. A route is a policy id (the only policy that covers the packets), or, with `LAYERED`,
/// the index of the layer set listing the candidates; 0: none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routes {
    /// `class * 65536 + port` -> route, for TCP then UDP (0: the class's route).
    pub ports: Vec<u16>,
    pub class_policy: [u16; CLASSES],
    /// The layer sets, each candidate list in judging order, 0-terminated.
    pub sets: Vec<LayerSet>,
}

impl Routes {
    pub fn has_ports(&self) -> bool {
        self.ports.iter().any(|&id| id != 0)
    }

    /// The policy ids a route leads to.
    pub fn candidates(&self, route: u16) -> Vec<u16> {
        if route & LAYERED == 0 {
            return if route == 0 { vec![] } else { vec![route] };
        }
        self.sets
            .get(usize::from(route & !LAYERED))
            .map_or_else(Vec::new, |set| set.ids.iter().copied().take_while(|&id| id != 0).collect())
    }

    /// `Config::HIDDEN_DROP` bits: the classes whose datagrams that hide their ports are
    /// dropped (docs/DESIGN.md, Hidden ports). While any port policy exists, all of them (the
    /// datagram might be meant for it, RFC 1858); a datagram whose protocol is hidden too
    /// (class other) when tcp or udp has its own route; and any class one of whose candidates
    /// reads what is hidden: the destination port (in its key), the flags (SYN-only) or the
    /// source port.
    pub fn hidden_drop(&self, policy: impl Fn(u16) -> Option<Policy>) -> u32 {
        let needs_ports = |route: u16| {
            self.candidates(route).into_iter().filter_map(&policy).any(|p| {
                p.flags & Policy::ACTIVE != 0 && p.flags & (Policy::KEY_DPORT | Policy::SYN_ONLY | Policy::SPORT) != 0
            })
        };
        let other = self.class_policy[CLASS_OTHER];
        let mut bits = 0;
        for class in 0..CLASSES {
            let drop = self.has_ports()
                || (class == CLASS_OTHER
                    && (self.class_policy[CLASS_TCP] != other || self.class_policy[CLASS_UDP] != other))
                || needs_ports(self.class_policy[class]);
            if drop {
                bits |= Config::HIDDEN_DROP << class;
            }
        }
        bits
    }
}

/// The routing of a validated state: each class's candidate list, and each stretch of ports
/// whose list differs (`config::Layering`), as routes; lists of two or more become layer sets,
/// and so does a list of one policy with a source port or destination predicate.
pub fn routes(state: &State) -> Routes {
    let layering = state.layering();
    let mut sets: Vec<LayerSet> = Vec::new();
    let records: BTreeMap<u16, Policy> = state.policies().map(|e| (e.id, entry(e))).collect();
    let mut route = |ids: &[u16]| -> u16 { route_of(ids, &records, &mut sets) };
    let mut class_policy = [0u16; CLASSES];
    for (class, ids) in layering.classes.iter().enumerate() {
        class_policy[class] = route(ids);
    }
    let mut ports = vec![0u16; PORT_POLICY_ENTRIES as usize];
    for stretch in &layering.ports {
        let class = if stretch.proto == Proto::Tcp { CLASS_TCP } else { CLASS_UDP };
        let r = route(&stretch.ids);
        for port in stretch.lo..=stretch.hi {
            ports[(class << 16) | usize::from(port)] = r;
        }
    }
    Routes { ports, class_policy, sets }
}

/// The route of the candidates `ids`, by their kernel records: none, one policy judging alone,
/// or a layer set (shared by identical lists), whose `not_syn` route is that of the candidates
/// without the SYN-only ones, and which is `plain` when none of them has a predicate.
fn route_of(ids: &[u16], records: &BTreeMap<u16, Policy>, sets: &mut Vec<LayerSet>) -> u16 {
    let flags = |id: &u16| records.get(id).map_or(0, |p| p.flags);
    // The program's one-policy path checks only SYN-only: a policy with a source port or
    // destination predicate judges through a layer set even alone, and so does an aggregate
    // with a lease and a policy of rate 0 (only the layers' program keeps leases and denies).
    let alone = |id: &u16| {
        records.get(id).is_some_and(|p| p.flags & (Policy::SPORT | Policy::DST | Policy::DENY) == 0 && p.lease == 0)
    };
    match ids {
        [] => 0,
        [one] if alone(one) => *one,
        many => {
            let mut set = LayerSet::default();
            for (slot, id) in set.ids.iter_mut().zip(many) {
                *slot = *id;
            }
            if let Some(index) = sets.iter().position(|s| s.ids == set.ids) {
                return LAYERED | index as u16;
            }
            if many.len() <= MAX_LAYERS && many.iter().all(|id| flags(id) & Policy::PREDICATES == 0) {
                set.plain = many.len() as u16;
            }
            let index = sets.len();
            sets.push(set);
            let rest: Vec<u16> = many.iter().copied().filter(|id| flags(id) & Policy::SYN_ONLY == 0).collect();
            sets[index].not_syn =
                if rest.len() == many.len() { LAYERED | index as u16 } else { route_of(&rest, records, sets) };
            LAYERED | index as u16
        }
    }
}

/// The allow and deny entries as the tries hold them: each network with its action.
pub fn acl(state: &State) -> impl Iterator<Item = (ipnet::IpNet, u8)> + '_ {
    use limiter_common::maps::{ACL_ALLOW, ACL_DENY};
    let allow = state.list(List::Allow).iter().map(|n| (*n, ACL_ALLOW));
    allow.chain(state.list(List::Deny).iter().map(|n| (*n, ACL_DENY)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Rate;

    fn with(defs: &[(&str, &str)]) -> State {
        let rate: Rate = "10/s".parse().unwrap();
        let defs = defs.iter().map(|(name, m)| PolicyDef {
            name: name.parse().unwrap(),
            matches: m.parse().unwrap(),
            ..PolicyDef::any(rate, 10)
        });
        defs.fold(State::default(), |s, def| s.with_policy(def).unwrap())
    }

    fn id(s: &State, name: &str) -> u16 {
        s.policy(&name.parse().unwrap()).unwrap().id
    }

    /// `s` with policy `name` given the source ports `sport`.
    fn with_sport(s: &State, name: &str, sport: &str) -> State {
        let def = s.policy(&name.parse().unwrap()).unwrap().def.clone();
        s.with_policy(PolicyDef { sport: sport.parse().unwrap(), ..def }).unwrap()
    }

    /// The layer set `route` leads to.
    fn set_of(r: &Routes, route: u16) -> LayerSet {
        assert_ne!(route & LAYERED, 0, "a set");
        r.sets[usize::from(route & !LAYERED)]
    }

    #[test]
    fn every_covering_policy_is_routed_in_order() {
        let s = with(&[("any", "any"), ("udp", "udp"), ("range", "udp:50-60"), ("dns", "udp:53"), ("web", "tcp:80")]);
        let r = routes(&s);
        let udp = |p: usize| r.candidates(r.ports[(CLASS_UDP << 16) | p]);
        let ids = |names: &[&str]| names.iter().map(|n| id(&s, n)).collect::<Vec<_>>();
        assert_eq!(udp(53), ids(&["dns", "range", "udp", "any"]));
        assert_eq!(udp(54), ids(&["range", "udp", "any"]));
        assert_eq!(r.ports[(CLASS_UDP << 16) | 61], 0, "no port policy: the class's route");
        assert_eq!(r.candidates(r.class_policy[CLASS_UDP]), ids(&["udp", "any"]));
        assert_eq!(r.class_policy[CLASS_TCP], id(&s, "any"), "one candidate: the policy itself, no set");
        assert_eq!(r.class_policy[CLASS_OTHER], id(&s, "any"));
        assert_eq!(r.candidates(r.ports[(CLASS_TCP << 16) | 80]), ids(&["web", "any"]));
        assert!(r.has_ports());
        let alone = routes(&with(&[("any", "any")]));
        assert!(!alone.has_ports() && alone.sets.is_empty());
        // Identical lists share one set.
        assert_eq!(r.ports[(CLASS_UDP << 16) | 55], r.ports[(CLASS_UDP << 16) | 50]);
        assert!(r.sets.iter().all(|set| set.ids[1] != 0), "a set has two candidates or more");
        assert!(
            r.sets.iter().enumerate().all(|(i, set)| set.not_syn == LAYERED | i as u16),
            "no SYN-only policy: a packet that is no SYN takes the same route"
        );
        // Alone, a policy with a source port or destination predicate still takes a set.
        let refl = with_sport(&with(&[("refl", "udp")]), "refl", "123");
        let r = routes(&refl);
        assert_eq!(r.class_policy[CLASS_UDP], LAYERED);
        assert_eq!(r.candidates(r.class_policy[CLASS_UDP]), vec![id(&refl, "refl")]);
        // So does a policy of rate 0, which denies what it judges.
        let deny = with(&[("deny", "udp:11211")]);
        let def =
            PolicyDef { rate: "0/s".parse().unwrap(), ..deny.policy(&"deny".parse().unwrap()).unwrap().def.clone() };
        let deny = deny.with_policy(def.clone()).unwrap();
        let r = routes(&deny);
        assert_eq!(r.candidates(r.ports[(CLASS_UDP << 16) | 11211]), vec![id(&deny, "deny")]);
        assert_ne!(r.ports[(CLASS_UDP << 16) | 11211] & LAYERED, 0);
        assert_ne!(policy(&def, 1).unwrap().flags & Policy::DENY, 0);
    }

    /// A SYN-only policy is routed like any other, beside the policies that cover its traffic:
    /// its predicate is checked in the program, per candidate.
    #[test]
    fn syn_only_policies_take_their_routes() {
        let s = with(&[("any", "any"), ("opens", "tcp:443,syn"), ("tcp-opens", "tcp,syn"), ("udp", "udp")]);
        let r = routes(&s);
        let ids = |names: &[&str]| names.iter().map(|n| id(&s, n)).collect::<Vec<_>>();
        assert_eq!(r.candidates(r.ports[(CLASS_TCP << 16) | 443]), ids(&["opens", "tcp-opens", "any"]));
        // Not a SYN: the same route without the SYN-only policies, here `any` alone (the
        // one-policy path).
        let set = &r.sets[usize::from(r.ports[(CLASS_TCP << 16) | 443] & !LAYERED)];
        assert_eq!(set.not_syn, id(&s, "any"));
        assert_eq!(r.candidates(r.class_policy[CLASS_TCP]), ids(&["tcp-opens", "any"]));
        assert_eq!(r.class_policy[CLASS_OTHER], id(&s, "any"));
        let flags = |name: &str| entry(s.policy(&name.parse().unwrap()).unwrap()).flags;
        assert_ne!(flags("opens") & Policy::SYN_ONLY, 0);
        assert_ne!(flags("tcp-opens") & Policy::SYN_ONLY, 0);
        assert_eq!(flags("any") & Policy::SYN_ONLY, 0);
    }

    /// A set is plain (its candidates taken unread) exactly when none of them has a predicate;
    /// a set beside a SYN-only policy is not, and its route for the rest may be.
    #[test]
    fn sets_without_predicates_are_plain() {
        let s = with(&[("any", "any"), ("udp", "udp"), ("dns", "udp:53"), ("opens", "tcp,syn"), ("web", "tcp:80")]);
        let r = routes(&s);
        let set = |route: u16| set_of(&r, route);
        let dns = set(r.ports[(CLASS_UDP << 16) | 53]);
        assert_eq!(usize::from(dns.plain), r.candidates(r.ports[(CLASS_UDP << 16) | 53]).len());
        assert_eq!(dns.plain, 3);
        let tcp = set(r.class_policy[CLASS_TCP]);
        assert_eq!(tcp.plain, 0, "a SYN-only candidate: each candidate read");
        let web = set(r.ports[(CLASS_TCP << 16) | 80]);
        assert_eq!(web.plain, 0);
        assert_eq!(set(web.not_syn).plain, 2, "without the SYN-only policy, web and any are plain");
        // A source port predicate makes its sets read each candidate, and leaves the others.
        let r = routes(&with_sport(&s, "dns", "123"));
        assert_eq!(set_of(&r, r.ports[(CLASS_UDP << 16) | 53]).plain, 0);
        assert_eq!(set_of(&r, r.class_policy[CLASS_UDP]).plain, 2);
    }

    /// Datagrams hiding their ports are dropped where a candidate would read what is hidden.
    #[test]
    fn hidden_ports_drop_where_a_candidate_needs_them() {
        let rate: Rate = "10/s".parse().unwrap();
        let plain = PolicyDef { matches: "udp".parse().unwrap(), ..PolicyDef::any(rate, 10) };
        let refl = PolicyDef { name: "refl".parse().unwrap(), sport: "123".parse().unwrap(), ..plain.clone() };
        let bits = |defs: &[PolicyDef]| {
            let s = defs.iter().cloned().fold(State::default(), |s, d| s.with_policy(d).unwrap());
            let view = crate::kernel::MapView::of(&s);
            view.routes.hidden_drop(|id| view.policies.get(&id).map(|(p, _)| *p))
        };
        assert_eq!(bits(std::slice::from_ref(&plain)), Config::HIDDEN_DROP << CLASS_OTHER, "udp has its own route");
        let with_sport = bits(&[plain.clone(), refl]);
        assert_ne!(with_sport & (Config::HIDDEN_DROP << CLASS_UDP), 0, "the source port is hidden too");
        assert_eq!(with_sport & (Config::HIDDEN_DROP << CLASS_TCP), 0);
    }

    #[test]
    fn each_field_lands_in_the_kernel_policy() {
        let rate = Rate { count: 10, period_ns: 1_000_000_000 };
        // Scope cpu: no flag, so each other field's flag shows alone.
        let plain = PolicyDef { scope: Scope::Cpu, ..PolicyDef::any(rate, 5) };
        let cpu = policy(&plain, 3).unwrap();
        assert_eq!((cpu.flags, cpu.id, cpu.v4_prefix, cpu.v6_prefix), (Policy::ACTIVE, 3, 32, 64));
        let host = policy(&PolicyDef { scope: Scope::Host, ..plain.clone() }, 3).unwrap();
        assert_eq!(host.flags, cpu.flags | Policy::SCOPE_HOST);
        assert_eq!(host.gcra, cpu.gcra);
        let dry = policy(&PolicyDef { mode: Mode::DryRun, ..plain.clone() }, 3).unwrap();
        assert_eq!(dry.flags, cpu.flags | Policy::DRY_RUN);
        let bytes = policy(&PolicyDef { unit: Unit::Bytes, burst: Some(70_000), ..plain.clone() }, 3).unwrap();
        assert_eq!(bytes.flags, cpu.flags | Policy::BYTES);
        let key = PolicyDef { key: "src/24,/56+dport".parse().unwrap(), ..plain.clone() };
        let keyed = policy(&key, 3).unwrap();
        assert_eq!(keyed.flags, cpu.flags | Policy::KEY_DPORT);
        assert_eq!((keyed.v4_prefix, keyed.v6_prefix, keyed.v4_mask), (24, 56, prefix_mask_words(24)[0]));
        let syn = policy(&PolicyDef { matches: "tcp:443,syn".parse().unwrap(), ..plain.clone() }, 3).unwrap();
        assert_eq!(syn.flags, cpu.flags | Policy::SYN_ONLY);
        let sport = policy(&PolicyDef { sport: "1024-2047".parse().unwrap(), ..plain.clone() }, 3).unwrap();
        assert_eq!((sport.flags, sport.sport_lo, sport.sport_hi), (cpu.flags | Policy::SPORT, 1024, 2047));
        let dst = PolicyDef { dst: "198.18.0.0/24,2001:db8::/32".parse().unwrap(), ..plain.clone() };
        let dst = policy(&dst, 3).unwrap();
        assert_eq!(dst.flags, cpu.flags | Policy::DST_V4 | Policy::DST_V6);
        // As the program loads addresses: network-order bytes read as little-endian words.
        assert_eq!(dst.dst_v4, u64::from(u32::from_le_bytes([198, 18, 0, 0])));
        assert_eq!(dst.dst_v4_mask, u64::from(u32::from_le_bytes([255, 255, 255, 0])));
        assert_eq!(dst.dst_v6, [u64::from_le_bytes([0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0]), 0]);
        assert_eq!(dst.dst_v6_mask, [u64::from_le_bytes([255, 255, 255, 255, 0, 0, 0, 0]), 0]);
        // A validated entry compiles to what its definition does.
        let state = State::default().with_policy(key.clone()).unwrap();
        let e = state.policy(&key.name).unwrap();
        assert_eq!(entry(e), policy(&key, e.id).unwrap());
    }
}

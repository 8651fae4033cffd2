//! The validated state (`config::State`) in the kernel's terms: a policy record per policy
//! ([`policy`], [`record`]) and the routing of packets to them ([`routes`]). What each field of
//! a policy means to the XDP program is said here, and only here.

use limiter_common::{
    Gcra,
    gcra::GcraError,
    key::prefix_mask_words,
    maps::{CLASS_ICMP, CLASS_OTHER, CLASS_TCP, CLASS_UDP, CLASSES, PORT_POLICY_ENTRIES, Policy},
};

use crate::config::{Entry, List, Mode, PolicyDef, Ports, Proto, Scope, State, Unit};

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
    }
}

/// Where each packet class goes: what `PORT_POLICY` and `Config::class_policy` hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routes {
    /// `class * 65536 + port` -> policy id, for TCP then UDP.
    pub ports: Vec<u16>,
    pub class_policy: [u16; CLASSES],
}

impl Routes {
    pub fn has_ports(&self) -> bool {
        self.ports.iter().any(|&id| id != 0)
    }
}

/// The routing of a validated state (whose matches do not clash): a packet goes to its exact
/// port's policy, else its port range's, else its protocol's, else `any`'s.
pub fn routes(state: &State) -> Routes {
    let mut ports = vec![0u16; PORT_POLICY_ENTRIES as usize];
    let index = |proto: Proto, port: u16| {
        let class = if proto == Proto::Tcp { CLASS_TCP } else { CLASS_UDP };
        (class << 16) | usize::from(port)
    };
    // Ranges first, then exact ports over them: an exact port wins.
    for e in state.policies() {
        if let Some(Ports::Range(lo, hi)) = e.def.matches.ports {
            for port in lo..=hi {
                ports[index(e.def.matches.proto, port)] = e.id;
            }
        }
    }
    for e in state.policies() {
        if let Some(Ports::Exact(port)) = e.def.matches.ports {
            ports[index(e.def.matches.proto, port)] = e.id;
        }
    }
    let proto_policy = |proto| {
        state.policies().find(|e| e.def.matches.proto == proto && e.def.matches.ports.is_none()).map_or(0, |e| e.id)
    };
    let any = proto_policy(Proto::Any);
    let or_any = |id: u16| if id == 0 { any } else { id };
    let mut class_policy = [0u16; CLASSES];
    class_policy[CLASS_TCP] = or_any(proto_policy(Proto::Tcp));
    class_policy[CLASS_UDP] = or_any(proto_policy(Proto::Udp));
    class_policy[CLASS_ICMP] = or_any(proto_policy(Proto::Icmp));
    class_policy[CLASS_OTHER] = any;
    Routes { ports, class_policy }
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

    #[test]
    fn precedence_is_port_then_range_then_protocol_then_any() {
        let s = with(&[("any", "any"), ("udp", "udp"), ("range", "udp:50-60"), ("dns", "udp:53"), ("web", "tcp:80")]);
        let r = routes(&s);
        let udp = |p: usize| r.ports[(CLASS_UDP << 16) | p];
        assert_eq!(udp(53), id(&s, "dns"));
        assert_eq!(udp(54), id(&s, "range"));
        assert_eq!(udp(61), 0, "falls through to the protocol");
        assert_eq!(r.class_policy[CLASS_UDP], id(&s, "udp"));
        assert_eq!(r.class_policy[CLASS_TCP], id(&s, "any"));
        assert_eq!(r.class_policy[CLASS_ICMP], id(&s, "any"));
        assert_eq!(r.class_policy[CLASS_OTHER], id(&s, "any"));
        assert_eq!(r.ports[(CLASS_TCP << 16) | 80], id(&s, "web"));
        assert!(r.has_ports());
        assert!(!routes(&with(&[("any", "any")])).has_ports());
    }

    /// A SYN-only policy is routed like any other: its predicate is checked in the program, which
    /// falls through to `class_policy` (the protocol's, `any` folded in) when it fails.
    #[test]
    fn syn_only_policies_take_their_routes() {
        let s = with(&[("any", "any"), ("opens", "tcp:443,syn"), ("tcp-opens", "tcp,syn"), ("udp", "udp")]);
        let r = routes(&s);
        assert_eq!(r.ports[(CLASS_TCP << 16) | 443], id(&s, "opens"));
        assert_eq!(r.class_policy[CLASS_TCP], id(&s, "tcp-opens"));
        assert_eq!(r.class_policy[CLASS_OTHER], id(&s, "any"));
        let flags = |name: &str| entry(s.policy(&name.parse().unwrap()).unwrap()).flags;
        assert_ne!(flags("opens") & Policy::SYN_ONLY, 0);
        assert_ne!(flags("tcp-opens") & Policy::SYN_ONLY, 0);
        assert_eq!(flags("any") & Policy::SYN_ONLY, 0);
    }

    #[test]
    fn each_field_lands_in_the_kernel_policy() {
        let rate = Rate { count: 10, period_ns: 1_000_000_000 };
        let plain = PolicyDef::any(rate, 5);
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
        // A validated entry compiles to what its definition does.
        let state = State::default().with_policy(key.clone()).unwrap();
        let e = state.policy(&key.name).unwrap();
        assert_eq!(entry(e), policy(&key, e.id).unwrap());
    }
}

//! The daemon's desired state (policies with their ids, allow and deny lists), validated as a
//! whole before anything changes: each policy representable, no more layers on one packet and
//! no more of anything than the kernel can hold. The kernel room compiles it into what the XDP
//! program reads (`kernel::compile`).

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use limiter_common::{
    Gcra,
    limits::{MAX_ACL_ENTRIES, MAX_FRAME_WEIGHT, MAX_POLICIES},
};

use super::{
    Error,
    def::PolicyDef,
    file::ConfigFile,
    layers::Layering,
    policy::{List, Name, Proto, Unit},
};

#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub id: u16,
    pub def: PolicyDef,
    /// The definition's rate and burst as the kernel judges them (see [`PolicyDef::gcra`]).
    pub gcra: Gcra,
}

#[derive(Clone, Debug, PartialEq)]
pub struct State {
    policies: BTreeMap<Name, Entry>,
    allow: BTreeSet<IpNet>,
    deny: BTreeSet<IpNet>,
    /// The largest frame the program can meet (bytes): a byte policy's burst must hold it, or
    /// such frames would be refused forever.
    max_frame: u64,
}

/// The largest frame on an Ethernet interface with a 1500-byte MTU and two VLAN tags: what a
/// byte policy's burst must hold when the interface is not known.
pub const DEFAULT_MAX_FRAME: u64 = 1500 + L2_OVERHEAD;
/// Ethernet header and two VLAN tags.
pub const L2_OVERHEAD: u64 = 14 + 8;

impl Default for State {
    fn default() -> Self {
        Self { policies: BTreeMap::new(), allow: BTreeSet::new(), deny: BTreeSet::new(), max_frame: DEFAULT_MAX_FRAME }
    }
}

/// The largest frame XDP can meet on an interface of this MTU (a byte policy charges at most
/// `MAX_FRAME_WEIGHT` for one frame).
pub fn max_frame_for_mtu(mtu: u64) -> u64 {
    (mtu + L2_OVERHEAD).min(MAX_FRAME_WEIGHT)
}

/// The longest burst window of these policies' GCRAs.
pub fn longest_window<'a>(gcras: impl Iterator<Item = &'a Gcra>) -> std::time::Duration {
    std::time::Duration::from_nanos(gcras.map(|g| g.window_ns()).max().unwrap_or(0))
}

impl State {
    /// Test-only: [`State::build_for`] an interface of a 1500-byte MTU.
    #[cfg(any(test, feature = "testing"))]
    pub fn build(config: &ConfigFile, ids: &BTreeMap<Name, u16>) -> Result<State, Error> {
        Self::build_for(config, ids, DEFAULT_MAX_FRAME)
    }

    /// Validates a whole config, for an interface whose largest frame is `max_frame` bytes.
    /// Policies named in `ids` keep those ids (and so their buckets and counters); new names
    /// take free ones.
    pub fn build_for(config: &ConfigFile, ids: &BTreeMap<Name, u16>, max_frame: u64) -> Result<State, Error> {
        let mut state = State { max_frame, ..State::default() };
        for net in &config.allow {
            state.add_net(List::Allow, *net)?;
        }
        for net in &config.deny {
            state.add_net(List::Deny, *net)?;
        }
        let mut seen = BTreeSet::new();
        for def in &config.policies {
            if !seen.insert(def.name.clone()) {
                return Err(Error::DefinedTwice(def.name.clone()));
            }
        }
        // Names that keep their ids first, so new names cannot take them.
        let (kept, new): (Vec<_>, Vec<_>) = config.policies.iter().partition(|d| ids.contains_key(&d.name));
        for def in kept.into_iter().chain(new) {
            let id = ids.get(&def.name).map_or_else(|| state.free_id(), |id| Ok(*id))?;
            state.insert(def.clone(), id)?;
        }
        state.check_matches()?;
        Ok(state)
    }

    /// The longest burst window of any policy: how long a TAT can stay ahead of now, so how
    /// long a salt rotation must keep consulting the old buckets.
    pub fn max_window(&self) -> std::time::Duration {
        longest_window(self.policies.values().map(|e| &e.gcra))
    }

    pub fn ids(&self) -> BTreeMap<Name, u16> {
        self.policies.iter().map(|(n, e)| (n.clone(), e.id)).collect()
    }

    pub fn to_config(&self) -> ConfigFile {
        ConfigFile {
            allow: self.allow.iter().copied().collect(),
            deny: self.deny.iter().copied().collect(),
            policies: self.policies.values().map(|e| e.def.clone()).collect(),
        }
    }

    pub fn policies(&self) -> impl Iterator<Item = &Entry> {
        self.policies.values()
    }

    pub fn policy(&self, name: &Name) -> Option<&Entry> {
        self.policies.get(name)
    }

    pub fn list(&self, list: List) -> &BTreeSet<IpNet> {
        match list {
            List::Allow => &self.allow,
            List::Deny => &self.deny,
        }
    }

    /// Creates or replaces a policy; a replaced policy keeps its id, so its buckets and counters.
    pub fn with_policy(&self, def: PolicyDef) -> Result<State, Error> {
        let mut next = self.clone();
        let id = self.policies.get(&def.name).map_or_else(|| self.free_id(), |e| Ok(e.id))?;
        next.insert(def, id)?;
        next.check_matches()?;
        Ok(next)
    }

    pub fn without_policy(&self, name: &Name) -> Result<State, Error> {
        let mut next = self.clone();
        next.policies.remove(name).ok_or_else(|| Error::NoSuchPolicy(name.clone()))?;
        Ok(next)
    }

    pub fn with_net(&self, list: List, net: IpNet) -> Result<State, Error> {
        let mut next = self.clone();
        next.add_net(list, net)?;
        Ok(next)
    }

    pub fn without_net(&self, list: List, net: IpNet) -> Result<State, Error> {
        let net = super::field::unmapped(net);
        let mut next = self.clone();
        let set = match list {
            List::Allow => &mut next.allow,
            List::Deny => &mut next.deny,
        };
        if !set.remove(&net) {
            return Err(Error::NotOnList { net, list });
        }
        Ok(next)
    }

    /// The largest frame byte policies must hold (see [`State::build_for`]).
    pub fn max_frame(&self) -> u64 {
        self.max_frame
    }

    fn insert(&mut self, def: PolicyDef, id: u16) -> Result<(), Error> {
        let burst = def.burst_or_default();
        if def.unit == Unit::Bytes && burst < self.max_frame {
            return Err(Error::BurstBelowFrame { name: def.name.clone(), burst, max_frame: self.max_frame });
        }
        let gcra = def.gcra().map_err(|error| Error::Policy { name: def.name.clone(), error })?;
        self.policies.insert(def.name.clone(), Entry { id, def, gcra });
        Ok(())
    }

    fn free_id(&self) -> Result<u16, Error> {
        let used: BTreeSet<u16> = self.policies.values().map(|e| e.id).collect();
        (1..MAX_POLICIES as u16).find(|id| !used.contains(id)).ok_or(Error::TooManyPolicies { max: MAX_POLICIES - 1 })
    }

    fn add_net(&mut self, list: List, net: IpNet) -> Result<(), Error> {
        let net = super::field::unmapped(net);
        if net.trunc() != net {
            return Err(Error::HostBits { net });
        }
        let (this, other) = match list {
            List::Allow => (&mut self.allow, &self.deny),
            List::Deny => (&mut self.deny, &self.allow),
        };
        if other.contains(&net) {
            let other = match list {
                List::Allow => List::Deny,
                List::Deny => List::Allow,
            };
            return Err(Error::OnOtherList { net, other });
        }
        this.insert(net);
        let family = |n: &IpNet| matches!(n, IpNet::V4(_));
        let same_family = self.allow.iter().chain(&self.deny).filter(|n| family(n) == family(&net)).count();
        if same_family > MAX_ACL_ENTRIES as usize {
            return Err(Error::TooManyListEntries { max: MAX_ACL_ENTRIES });
        }
        Ok(())
    }

    /// Checks the layering (`config::layers`): at most 8 policies share one traffic, at most 4
    /// can all meet one packet; and that source ports are asked only of TCP and UDP policies.
    fn check_matches(&self) -> Result<(), Error> {
        for e in self.policies.values() {
            if !e.def.sport.is_any() && !matches!(e.def.matches.proto, Proto::Tcp | Proto::Udp) {
                return Err(Error::SportWithoutPorts { name: e.def.name.clone(), matches: e.def.matches });
            }
        }
        self.layering().check(|id| self.by_id(id))
    }

    /// The candidate lists of the policies (`config::layers`).
    pub fn layering(&self) -> Layering {
        Layering::of(self.policies.values().map(|e| (e.id, &e.def)))
    }

    /// What the config check and the daemon say about the state without refusing it: layers
    /// whose allowance another layer never lets them use.
    pub fn warnings(&self) -> Vec<String> {
        self.layering().warnings(|id| self.by_id(id))
    }

    fn by_id(&self, id: u16) -> Option<&PolicyDef> {
        self.policies.values().find(|e| e.id == id).map(|e| &e.def)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def(name: &str, m: &str) -> PolicyDef {
        let (name, matches) = (name.parse().unwrap(), m.parse().unwrap());
        PolicyDef { name, matches, burst: None, ..PolicyDef::any("10/s".parse().unwrap(), 1) }
    }

    fn with(defs: &[(&str, &str)]) -> Result<State, Error> {
        defs.iter().try_fold(State::default(), |s, (n, m)| s.with_policy(def(n, m)))
    }

    fn id(s: &State, name: &str) -> u16 {
        s.policy(&name.parse().unwrap()).unwrap().id
    }

    #[test]
    fn overlapping_policies_layer_up_to_four_on_a_packet() {
        // Once refused as clashes: now layers.
        with(&[("a", "udp:53"), ("b", "udp:53"), ("c", "udp"), ("d", "any")]).unwrap();
        with(&[("a", "tcp:443"), ("b", "tcp:443,syn"), ("c", "tcp:1-1000")]).unwrap();
        let err =
            with(&[("a", "udp:53"), ("b", "udp:53"), ("c", "udp:50-60"), ("d", "udp"), ("e", "any")]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("'a'") && text.contains("'e'") && text.contains("udp:53"), "{text}");
        assert_eq!(
            text,
            "policies 'a', 'b', 'c', 'd' and 'e' can all judge one packet (udp:53): at most 4 policies may (narrow one with --sport or --dst, or remove one)"
        );
        // Source ports that cannot meet do not add up.
        let refl = |name: &str, port: &str| PolicyDef { sport: port.parse().unwrap(), ..def(name, "udp") };
        let s = with(&[("a", "udp"), ("b", "any")]).unwrap();
        let s = ["53", "123", "389", "1900", "11211"]
            .iter()
            .enumerate()
            .fold(s, |s, (i, p)| s.with_policy(refl(&format!("r{i}"), p)).unwrap());
        assert_eq!(s.policies().count(), 7);
        // A source port asks for a protocol that has ports.
        let err = State::default().with_policy(PolicyDef { sport: "53".parse().unwrap(), ..def("x", "icmp") });
        assert!(err.unwrap_err().to_string().contains("--sport needs a tcp or udp match"));
    }

    #[test]
    fn replacing_keeps_the_id_and_removing_frees_it() {
        let s = with(&[("a", "any"), ("b", "udp")]).unwrap();
        let (a, b) = (id(&s, "a"), id(&s, "b"));
        let s = s.with_policy(def("a", "tcp")).unwrap();
        assert_eq!(id(&s, "a"), a);
        let s = s.without_policy(&"a".parse().unwrap()).unwrap();
        let s = s.with_policy(def("c", "icmp")).unwrap();
        assert_eq!(id(&s, "c"), a, "the lowest free id is reused");
        assert_eq!(id(&s, "b"), b);
        assert!(s.without_policy(&"zzz".parse().unwrap()).is_err());
    }

    #[test]
    fn rebuilding_from_a_config_keeps_ids_by_name() {
        let s = with(&[("a", "any"), ("b", "udp"), ("c", "tcp")]).unwrap();
        let mut config = s.to_config();
        config.policies.retain(|d| d.name.as_str() != "a");
        config.policies.insert(0, def("new", "icmp"));
        let t = State::build(&config, &s.ids()).unwrap();
        assert_eq!(id(&t, "b"), id(&s, "b"));
        assert_eq!(id(&t, "c"), id(&s, "c"));
        assert!(![id(&t, "b"), id(&t, "c")].contains(&id(&t, "new")));
    }

    #[test]
    fn lists_reject_host_bits_and_contradictions() {
        let s = State::default();
        let net = |t: &str| t.parse::<IpNet>().unwrap();
        assert!(s.with_net(List::Allow, net("198.18.0.5/24")).unwrap_err().to_string().contains("198.18.0.0/24"));
        let s = s.with_net(List::Allow, net("198.18.0.0/24")).unwrap();
        assert!(s.with_net(List::Deny, net("198.18.0.0/24")).unwrap_err().to_string().contains("allow list"));
        let s = s.with_net(List::Deny, net("2001:db8::/32")).unwrap();
        assert_eq!(s.to_config().deny, vec![net("2001:db8::/32")]);
        assert!(s.without_net(List::Allow, net("198.18.1.0/24")).is_err());
    }

    #[test]
    fn a_byte_policy_burst_must_hold_the_largest_frame() {
        let bytes = |burst: Option<u64>| PolicyDef {
            unit: Unit::Bytes,
            burst,
            rate: "1000000/s".parse().unwrap(),
            ..def("bulk", "udp")
        };
        let err = State::default().with_policy(bytes(Some(1000))).unwrap_err().to_string();
        assert!(err.contains("1522") && err.contains("'bulk'") && !err.contains('\n'), "{err}");
        State::default().with_policy(bytes(Some(1522))).unwrap();
        State::default().with_policy(bytes(None)).unwrap();
        // A jumbo-frame interface needs a larger burst; the cap is the largest weight charged.
        let config = ConfigFile { policies: vec![bytes(Some(1522))], ..ConfigFile::default() };
        let jumbo = max_frame_for_mtu(9000);
        assert_eq!(jumbo, 9022);
        assert!(State::build_for(&config, &BTreeMap::new(), jumbo).unwrap_err().to_string().contains("9022"));
        assert_eq!(max_frame_for_mtu(65_536), MAX_FRAME_WEIGHT);
        // Packet policies are not concerned.
        State::default().with_policy(PolicyDef { burst: Some(1), ..def("p", "tcp") }).unwrap();
    }

    #[test]
    fn policies_are_bounded() {
        let mut s = State::default();
        for i in 1..MAX_POLICIES {
            s = s.with_policy(def(&format!("p{i}"), &format!("tcp:{i}"))).unwrap();
        }
        assert!(s.with_policy(def("one-too-many", "udp")).unwrap_err().to_string().contains("too many"));
    }
}

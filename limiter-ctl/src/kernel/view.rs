//! Bringing the kernel's maps from one state to another, touching only what differs (a diff,
//! not a lock: the daemon's loop is the only writer).
//!
//! A [`MapView`] is what the maps say, in the terms that matter for a diff: it is computed from
//! a [`State`], or read back from the maps of a pinned limiter a restarted daemon adopts.

use std::{collections::BTreeMap, net::IpAddr};

use aya::maps::{Array, LpmTrie, Map, MapData, PerCpuArray, PerCpuValues, lpm_trie::Key};
use ipnet::IpNet;
use limiter_common::maps::{
    Config, Counters, LayerSet, MAP_ACL_V4, MAP_ACL_V6, MAP_CONFIG, MAP_COUNTERS, MAP_LAYER_SETS, MAP_POLICIES,
    MAP_POLICY_NAMES, MAP_PORT_POLICY, MAX_POLICIES, POLICY_NAME_LEN, Policy,
};

use super::{
    Error, Limiter,
    compile::{self, Routes},
};
use crate::config::{Name, State, longest_window};

type NameBytes = [u8; POLICY_NAME_LEN];

#[derive(Clone, Debug, PartialEq)]
pub struct MapView {
    /// Active policies by id, with their names.
    pub policies: BTreeMap<u16, (Policy, NameBytes)>,
    pub routes: Routes,
    pub acl: BTreeMap<IpNet, u8>,
}

fn name_bytes(name: &Name) -> NameBytes {
    let mut b = [0u8; POLICY_NAME_LEN];
    let s = name.as_str().as_bytes();
    b[..s.len().min(POLICY_NAME_LEN)].copy_from_slice(&s[..s.len().min(POLICY_NAME_LEN)]);
    b
}

impl MapView {
    pub fn of(state: &State) -> Self {
        let policies = state.policies().map(|e| (e.id, (compile::entry(e), name_bytes(&e.def.name)))).collect();
        Self { policies, routes: compile::routes(state), acl: compile::acl(state).collect() }
    }

    /// The longest burst window of the policies in this view.
    pub fn max_window(&self) -> std::time::Duration {
        longest_window(self.policies.values().map(|(p, _)| &p.gcra))
    }

    /// Policy ids by name, for keeping ids (and so buckets and counters) across a restart.
    pub fn ids(&self) -> BTreeMap<Name, u16> {
        self.policies
            .iter()
            .filter_map(|(id, (_, name))| {
                let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
                let name = std::str::from_utf8(&name[..len]).ok()?.parse().ok()?;
                Some((name, *id))
            })
            .collect()
    }

    /// What the maps say, each map found by name through `map`.
    pub(super) fn read<'a>(map: impl Fn(&'static str) -> Option<&'a Map>) -> Result<Self, Error> {
        let map = |name| map(name).ok_or(Error::Missing { kind: "map", name });
        fn array<'m, V: aya::Pod>(map: &'m Map, name: &'static str) -> Result<Array<&'m MapData, V>, Error> {
            Array::try_from(map).map_err(|source| Error::Map { name, source })
        }
        let policies_map = array::<Policy>(map(MAP_POLICIES)?, MAP_POLICIES)?;
        let names = array::<NameBytes>(map(MAP_POLICY_NAMES)?, MAP_POLICY_NAMES)?;
        let mut policies = BTreeMap::new();
        for id in 1..MAX_POLICIES {
            let mut p = policies_map.get(&id, 0).map_err(|source| Error::Map { name: MAP_POLICIES, source })?;
            // The hold is the slot's, not the policy's: `store_policy` carries it over.
            p.hold_until_ns = 0;
            if p.flags & Policy::ACTIVE != 0 {
                let name = names.get(&id, 0).map_err(|source| Error::Map { name: MAP_POLICY_NAMES, source })?;
                policies.insert(id as u16, (p, name));
            }
        }
        let ports = array::<u16>(map(MAP_PORT_POLICY)?, MAP_PORT_POLICY)?;
        let ports = ports
            .iter()
            .collect::<Result<Vec<u16>, _>>()
            .map_err(|source| Error::Map { name: MAP_PORT_POLICY, source })?;
        let config = array::<Config>(map(MAP_CONFIG)?, MAP_CONFIG)?;
        let config = config.get(&0, 0).map_err(|source| Error::Map { name: MAP_CONFIG, source })?;
        let mut acl = BTreeMap::new();
        read_acl::<[u8; 4]>(map(MAP_ACL_V4)?, MAP_ACL_V4, &mut acl)?;
        read_acl::<[u8; 16]>(map(MAP_ACL_V6)?, MAP_ACL_V6, &mut acl)?;
        let sets = array::<LayerSet>(map(MAP_LAYER_SETS)?, MAP_LAYER_SETS)?;
        let mut sets =
            sets.iter().collect::<Result<Vec<_>, _>>().map_err(|source| Error::Map { name: MAP_LAYER_SETS, source })?;
        // The sets in use come first; the rest of the array is zeros.
        while sets.last().is_some_and(|s| s.ids[0] == 0) {
            sets.pop();
        }
        let routes = Routes { ports, class_policy: config.class_policy, sets };
        Ok(MapView { policies, routes, acl })
    }
}

/// Adds the entries of one allow/deny trie to `acl`.
fn read_acl<K>(trie: &Map, name: &'static str, acl: &mut BTreeMap<IpNet, u8>) -> Result<(), Error>
where
    K: aya::Pod,
    IpAddr: From<K>,
{
    let trie: LpmTrie<_, K, u8> = LpmTrie::try_from(trie).map_err(|source| Error::Map { name, source })?;
    for item in trie.iter() {
        let (key, action) = item.map_err(|source| Error::Map { name, source })?;
        let net = IpNet::new(IpAddr::from(key.data()), key.prefix_len() as u8)
            .map_err(|error| Error::AclEntry { map: name, error })?;
        acl.insert(net, action);
    }
    Ok(())
}

impl Limiter {
    /// Makes the maps say what `new` says, given that they say what `old` says.
    pub fn sync(&mut self, old: &State, new: &State) -> Result<(), Error> {
        self.apply(&MapView::of(old), &MapView::of(new))
    }

    /// Applies the difference between two views. The order keeps packets in flight consistent:
    /// policies exist before routes lead to them, list entries exist before their flag is set,
    /// and routes leave a policy before it is deactivated.
    pub fn apply(&mut self, old: &MapView, new: &MapView) -> Result<(), Error> {
        // A plain set (`LayerSet::plain`) that changes loses its shortcut before any policy
        // does: a policy edited to gain a predicate is then never taken unread.
        let mut sets = self.array_mut::<LayerSet>(MAP_LAYER_SETS)?;
        for (i, was) in old.routes.sets.iter().enumerate() {
            if was.plain != 0 && new.routes.sets.get(i) != Some(was) {
                let unplain = LayerSet { plain: 0, ..*was };
                sets.set(i as u32, unplain, 0).map_err(|source| Error::Map { name: MAP_LAYER_SETS, source })?;
            }
        }
        for (id, (policy, name)) in &new.policies {
            let before = old.policies.get(id);
            if before.map(|b| &b.0) != Some(policy) {
                self.store_policy(policy)?;
            }
            if before.map(|b| &b.1) != Some(name) {
                self.set_policy_name(*id, name)?;
                if before.is_some() {
                    // The id changed hands: the new policy starts its own counts.
                    self.zero_counters(*id)?;
                }
            }
        }
        for (net, action) in &new.acl {
            if old.acl.get(net) != Some(action) {
                self.acl_insert(*net, *action)?;
            }
        }
        // Layer sets before the routes that lead to them (a set rewritten in place may judge a
        // packet in flight by the new list a moment early, as a port entry rewritten does).
        let mut sets = self.array_mut::<LayerSet>(MAP_LAYER_SETS)?;
        let zero = LayerSet::default();
        for i in 0..new.routes.sets.len().max(old.routes.sets.len()) {
            let (was, is) = (old.routes.sets.get(i).unwrap_or(&zero), new.routes.sets.get(i).unwrap_or(&zero));
            if was != is && i < new.routes.sets.len() {
                sets.set(i as u32, is, 0).map_err(|source| Error::Map { name: MAP_LAYER_SETS, source })?;
            }
        }
        let mut table = self.array_mut::<u16>(MAP_PORT_POLICY)?;
        for (i, (&was, &is)) in old.routes.ports.iter().zip(&new.routes.ports).enumerate() {
            if was != is {
                table.set(i as u32, is, 0).map_err(|source| Error::Map { name: MAP_PORT_POLICY, source })?;
            }
        }
        let mut config = self.read_config()?;
        config.class_policy = new.routes.class_policy;
        config.flags &= !(Config::HAS_PORT_POLICIES | Config::HAS_ACL_V4 | Config::HAS_ACL_V6 | HIDDEN_DROP_ALL);
        if new.routes.has_ports() {
            config.flags |= Config::HAS_PORT_POLICIES;
        }
        config.flags |= new.routes.hidden_drop(|id| new.policies.get(&id).map(|(p, _)| *p));
        if new.acl.keys().any(|n| matches!(n, IpNet::V4(_))) {
            config.flags |= Config::HAS_ACL_V4;
        }
        if new.acl.keys().any(|n| matches!(n, IpNet::V6(_))) {
            config.flags |= Config::HAS_ACL_V6;
        }
        self.store_config(&config)?;
        for net in old.acl.keys().filter(|n| !new.acl.contains_key(n)) {
            self.acl_remove(*net)?;
        }
        // Sets no route leads to any more, after the routes left them.
        if old.routes.sets.len() > new.routes.sets.len() {
            let mut sets = self.array_mut::<LayerSet>(MAP_LAYER_SETS)?;
            for i in new.routes.sets.len()..old.routes.sets.len() {
                sets.set(i as u32, zero, 0).map_err(|source| Error::Map { name: MAP_LAYER_SETS, source })?;
            }
        }
        for id in old.policies.keys().filter(|id| !new.policies.contains_key(id)) {
            self.store_policy(&Policy { id: *id, ..Policy::default() })?;
            self.set_policy_name(*id, &[0; POLICY_NAME_LEN])?;
            self.zero_counters(*id)?;
        }
        Ok(())
    }

    /// What the maps say now (for adopting a pinned limiter).
    pub fn read_view(&self) -> Result<MapView, Error> {
        MapView::read(|name| self.ebpf.map(name))
    }

    fn set_policy_name(&mut self, id: u16, name: &NameBytes) -> Result<(), Error> {
        self.array_mut::<NameBytes>(MAP_POLICY_NAMES)?
            .set(u32::from(id), name, 0)
            .map_err(|source| Error::Map { name: MAP_POLICY_NAMES, source })
    }

    fn acl_insert(&mut self, net: IpNet, action: u8) -> Result<(), Error> {
        let prefix = u32::from(net.prefix_len());
        match net {
            IpNet::V4(n) => {
                self.acl_trie_mut::<[u8; 4]>(MAP_ACL_V4)?.insert(&Key::new(prefix, n.network().octets()), action, 0)
            }
            IpNet::V6(n) => {
                self.acl_trie_mut::<[u8; 16]>(MAP_ACL_V6)?.insert(&Key::new(prefix, n.network().octets()), action, 0)
            }
        }
        .map_err(|source| Error::Map { name: acl_map_name(net), source })
    }

    fn acl_remove(&mut self, net: IpNet) -> Result<(), Error> {
        let prefix = u32::from(net.prefix_len());
        match net {
            IpNet::V4(n) => self.acl_trie_mut::<[u8; 4]>(MAP_ACL_V4)?.remove(&Key::new(prefix, n.network().octets())),
            IpNet::V6(n) => self.acl_trie_mut::<[u8; 16]>(MAP_ACL_V6)?.remove(&Key::new(prefix, n.network().octets())),
        }
        .map_err(|source| Error::Map { name: acl_map_name(net), source })
    }

    fn acl_trie_mut<K: aya::Pod>(&mut self, name: &'static str) -> Result<LpmTrie<&mut MapData, K, u8>, Error> {
        LpmTrie::try_from(self.map_mut(name)?).map_err(|source| Error::Map { name, source })
    }

    fn zero_counters(&mut self, id: u16) -> Result<(), Error> {
        let zeros = per_cpu_zeros::<Counters>()?;
        let mut counters = PerCpuArray::<_, Counters>::try_from(self.map_mut(MAP_COUNTERS)?)
            .map_err(|source| Error::Map { name: MAP_COUNTERS, source })?;
        counters.set(u32::from(id), zeros, 0).map_err(|source| Error::Map { name: MAP_COUNTERS, source })
    }
}

/// Every class's `Config::HIDDEN_DROP` bit.
const HIDDEN_DROP_ALL: u32 = 0xf * Config::HIDDEN_DROP;

fn per_cpu_zeros<T: aya::Pod + Default>() -> Result<PerCpuValues<T>, Error> {
    let cpus = aya::util::nr_cpus().map_err(|(what, error)| Error::Cpus { what, error })?;
    PerCpuValues::try_from(vec![T::default(); cpus]).map_err(Error::PerCpuValues)
}

fn acl_map_name(net: IpNet) -> &'static str {
    match net {
        IpNet::V4(_) => MAP_ACL_V4,
        IpNet::V6(_) => MAP_ACL_V6,
    }
}

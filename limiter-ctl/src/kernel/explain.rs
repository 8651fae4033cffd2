//! What the program would do now with a packet of given fields (`limiter-ctl explain`): its
//! route, list entries and policies read from the maps as the program reads them
//! (`limiter-ebpf`'s `program::policy` and `program::layers`), each policy's buckets read for
//! the packet's key and judged by `limiter-common`'s code. Reads only: no bucket, memo or
//! counter is written, and the salt stays here.

use std::net::IpAddr;

use aya::maps::{HashMap, LpmTrie, MapData, MapError, lpm_trie::Key};
use limiter_common::{
    gcra::{self, CLOCK_SHIFT, Gcra},
    key::{FAMILY_V4, FAMILY_V6, FlowKey, key_hash, v4_word, v6_meta_word},
    maps::{
        Ban, CLASS_TCP, CLASS_UDP, Config, LAYERED, LayerSet, MAP_ACL_V4, MAP_ACL_V6, MAP_BAN_NETS_V4, MAP_BAN_NETS_V6,
        MAP_BANS_V4, MAP_BANS_V6, MAP_BUCKETS, MAP_HOST_BUCKETS, MAP_LAYER_SETS, MAP_POLICIES, MAP_PORT_POLICY,
        MAX_CANDIDATES, MAX_FRAME_WEIGHT, MAX_LAYERS, Policy,
    },
    rows::{MAX_ROWS, judge_rows, row_index, row_indexes},
};

use super::{Error, Limiter, host};

/// The packet asked about. Without `dport`, the ports of TCP and UDP are unknown: the port
/// entries are not consulted (the protocol's route is), and a source-port predicate fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    pub src: IpAddr,
    /// The destination (for destination predicates); None: fails every such predicate.
    pub dst: Option<IpAddr>,
    /// `CLASS_TCP`, `CLASS_UDP`, `CLASS_ICMP`.
    pub class: usize,
    pub dport: Option<u16>,
    pub sport: Option<u16>,
    /// A TCP SYN without ACK (a connection opening).
    pub syn: bool,
}

/// What the maps say of a probe, in the program's order.
#[derive(Clone, Debug)]
pub struct Reading {
    /// The clock (the program's: monotonic ns) the buckets were judged at.
    pub now_ns: u64,
    /// The list verdict the program takes first: a live ban's action and deadline, else the
    /// config lists' action (no deadline).
    pub listed: Option<Listed>,
    /// The policies that judge the packet, in the order the program judges them.
    pub layers: Vec<Layer>,
    /// Candidates of the packet's route whose predicates do not hold (or inactive ones).
    pub passed_over: Vec<u16>,
    /// The per-CPU buckets of a generation, and the host-scope ones.
    pub buckets: u32,
    pub host_buckets: u32,
    /// A salt rotation's grace is running: the previous salt's buckets count too.
    pub rotating: bool,
}

/// An allow or deny verdict taken before any policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listed {
    /// `ACL_ALLOW` or `ACL_DENY`.
    pub action: u8,
    /// A ban's (the daemon's expiring entries), rather than the config file's lists'.
    pub ban: bool,
    /// The ban's deadline (monotonic ns).
    pub until_ns: Option<u64>,
}

/// One policy's judgement of the probe.
#[derive(Clone, Debug)]
pub struct Layer {
    pub policy: Policy,
    /// The key the source falls into under this policy.
    pub key: FlowKey,
    /// What one arrival of the probe weighs (1; a byte policy: a full-size frame).
    pub weight: u64,
    /// The key's buckets: one [`Look`] for a host-scope policy; one per possible CPU for a
    /// per-CPU one; none for a rate of 0 (refuses everything).
    pub looks: Vec<Look>,
}

/// A key's rows as one copy of the buckets holds them, judged.
#[derive(Clone, Debug)]
pub struct Look {
    pub rows: Vec<Row>,
    pub admit: bool,
    /// From now, when the next arrival is admitted (0: now) and when the whole burst is back.
    pub retry_ns: u64,
    pub full_ns: u64,
}

/// One row's bucket for the key.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    /// Its index within its generation (the previous salt's row, during a rotation, when that one
    /// counts).
    pub bucket: u32,
    /// How far ahead of now its TAT counts (ns): what is spent.
    pub ahead_ns: u64,
    /// The policy id that last wrote it (0: never).
    pub owner: u8,
}

impl Limiter {
    /// The program's view of `probe` now, read from the maps.
    pub(crate) fn explain(&self, probe: &Probe) -> Result<Reading, Error> {
        let cfg = self.read_config()?;
        let policies = self.array::<Policy>(MAP_POLICIES)?;
        let policy =
            |id: u16| policies.get(&u32::from(id), 0).map_err(|source| Error::Map { name: MAP_POLICIES, source });
        let now_ns = host::monotonic_ns();
        let family = if probe.src.is_ipv4() { FAMILY_V4 } else { FAMILY_V6 };
        let geometry = self.geometry();
        let mut reading = Reading {
            now_ns,
            listed: self.listed(&cfg, probe.src, now_ns)?,
            layers: Vec::new(),
            passed_over: Vec::new(),
            buckets: geometry.buckets,
            host_buckets: geometry.host_buckets,
            rotating: now_ns < cfg.grace_until_ns,
        };
        let mut route = self.route(&cfg, probe)?;
        if route & LAYERED != 0 {
            let sets = self.array::<LayerSet>(MAP_LAYER_SETS)?;
            let set = sets
                .get(&u32::from(route & !LAYERED), 0)
                .map_err(|source| Error::Map { name: MAP_LAYER_SETS, source })?;
            if !probe.syn {
                route = set.not_syn;
            }
            if route & LAYERED != 0 {
                let set = sets
                    .get(&u32::from(route & !LAYERED), 0)
                    .map_err(|source| Error::Map { name: MAP_LAYER_SETS, source })?;
                for id in set.ids.into_iter().take(MAX_CANDIDATES).take_while(|&id| id != 0) {
                    let p = policy(id)?;
                    if p.flags & Policy::ACTIVE != 0 && predicates_hold(&p, probe) && reading.layers.len() < MAX_LAYERS
                    {
                        reading.layers.push(self.judge(&cfg, &p, family, probe, now_ns)?);
                    } else {
                        reading.passed_over.push(id);
                    }
                }
                return Ok(reading);
            }
        }
        if route != 0 {
            // Alone, a policy's only predicate the program checks is SYN-only (userspace routes
            // any other through a layer set).
            let p = policy(route)?;
            if p.flags & Policy::ACTIVE != 0 && (p.flags & Policy::SYN_ONLY == 0 || probe.syn) {
                reading.layers.push(self.judge(&cfg, &p, family, probe, now_ns)?);
            } else {
                reading.passed_over.push(route);
            }
        }
        Ok(reading)
    }

    /// The packet's route: its port's entry (when the port is known), else its protocol's.
    fn route(&self, cfg: &Config, probe: &Probe) -> Result<u16, Error> {
        if let Some(dport) = probe.dport
            && cfg.flags & Config::HAS_PORT_POLICIES != 0
            && (probe.class == CLASS_TCP || probe.class == CLASS_UDP)
        {
            let index = (probe.class as u32) << 16 | u32::from(dport);
            let id = self
                .array::<u16>(MAP_PORT_POLICY)?
                .get(&index, 0)
                .map_err(|source| Error::Map { name: MAP_PORT_POLICY, source })?;
            if id != 0 {
                return Ok(id);
            }
        }
        Ok(cfg.class_policy[probe.class & 3])
    }

    /// The lists' verdict as the program takes it: a live ban on the exact address, else the
    /// longest banned prefix's if live, else the longest config-list prefix's.
    fn listed(&self, cfg: &Config, src: IpAddr, now_ns: u64) -> Result<Option<Listed>, Error> {
        let err = |name| move |source| Error::Map { name, source };
        let live = |ban: Option<Ban>| ban.filter(|b| b.until_ns == 0 || now_ns < b.until_ns).map(|b| b.action as u8);
        let ([exact, net], has_exact, has_net) = match src {
            IpAddr::V4(a) => (
                self.bans_of([MAP_BANS_V4, MAP_BAN_NETS_V4], a.octets())?,
                Config::HAS_BANS_V4,
                Config::HAS_BAN_NETS_V4,
            ),
            IpAddr::V6(a) => (
                self.bans_of([MAP_BANS_V6, MAP_BAN_NETS_V6], a.octets())?,
                Config::HAS_BANS_V6,
                Config::HAS_BAN_NETS_V6,
            ),
        };
        let exact = exact.filter(|_| cfg.flags & has_exact != 0);
        let net = net.filter(|_| cfg.flags & has_net != 0);
        for ban in [exact, net] {
            if let Some(action) = live(ban) {
                let until_ns = ban.map(|b| b.until_ns).filter(|&u| u != 0);
                return Ok(Some(Listed { action, ban: true, until_ns }));
            }
        }
        let acl = match src {
            IpAddr::V4(a) if cfg.flags & Config::HAS_ACL_V4 != 0 => {
                let trie: LpmTrie<&MapData, [u8; 4], u8> =
                    LpmTrie::try_from(self.map(MAP_ACL_V4)?).map_err(err(MAP_ACL_V4))?;
                trie.get(&Key::new(32, a.octets()), 0).ok()
            }
            IpAddr::V6(a) if cfg.flags & Config::HAS_ACL_V6 != 0 => {
                let trie: LpmTrie<&MapData, [u8; 16], u8> =
                    LpmTrie::try_from(self.map(MAP_ACL_V6)?).map_err(err(MAP_ACL_V6))?;
                trie.get(&Key::new(128, a.octets()), 0).ok()
            }
            _ => None,
        };
        Ok(acl.map(|action| Listed { action, ban: false, until_ns: None }))
    }

    /// The entries of an address (`N` bytes) in the ban maps named: the exact map's, and the
    /// longest prefix's.
    fn bans_of<const N: usize>(&self, names: [&'static str; 2], key: [u8; N]) -> Result<[Option<Ban>; 2], Error> {
        let err = |name| move |source| Error::Map { name, source };
        let absent = |r: Result<Ban, MapError>, name| match r {
            Ok(b) => Ok(Some(b)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(err(name)(e)),
        };
        let exact: HashMap<&MapData, [u8; N], Ban> = HashMap::try_from(self.map(names[0])?).map_err(err(names[0]))?;
        let nets: LpmTrie<&MapData, [u8; N], Ban> = LpmTrie::try_from(self.map(names[1])?).map_err(err(names[1]))?;
        Ok([absent(exact.get(&key, 0), names[0])?, absent(nets.get(&Key::new(N as u32 * 8, key), 0), names[1])?])
    }

    /// `policy`'s judgement of the probe: its key, and that key's rows in each copy of its
    /// buckets, judged at `now_ns` as the program judges them (a rotation's previous salt
    /// included).
    fn judge(&self, cfg: &Config, policy: &Policy, family: u8, probe: &Probe, now_ns: u64) -> Result<Layer, Error> {
        let key = key_of(policy, probe);
        let weight = if policy.flags & Policy::BYTES != 0 { MAX_FRAME_WEIGHT.min(1514) } else { 1 };
        let mut layer = Layer { policy: *policy, key, weight, looks: Vec::new() };
        if policy.flags & Policy::DENY != 0 {
            return Ok(layer);
        }
        let generation = (cfg.generation & 1) as usize;
        let policies = self.array::<Policy>(MAP_POLICIES)?;
        // The program's claim (`program::buckets::claim`): a failed read claims all.
        let claim = |id: u8| match policies.get(&u32::from(id), 0) {
            Ok(p) => {
                gcra::claim(if p.flags & Policy::ACTIVE != 0 { p.gcra.capacity } else { 0 }, p.hold_until_ns, now_ns)
            }
            Err(_) => Gcra::LIMIT,
        };
        let words = key.words();
        let hashes =
            [key_hash(&cfg.salts[generation], family, &words), key_hash(&cfg.salts[generation ^ 1], family, &words)];
        let rotating = now_ns < cfg.grace_until_ns;
        let copies: Vec<[(u32, u64); MAX_ROWS]> = if policy.flags & Policy::SCOPE_HOST != 0 {
            let buckets = self.array::<u64>(MAP_HOST_BUCKETS)?;
            let read = |g: usize| -> Result<[(u32, u64); MAX_ROWS], Error> {
                let mut out = [(0, 0); MAX_ROWS];
                for (i, &index) in host_buckets(cfg, g, hashes[g ^ generation]).iter().enumerate() {
                    let value =
                        buckets.get(&index, 0).map_err(|source| Error::Map { name: MAP_HOST_BUCKETS, source })?;
                    out[i] = (index - base(g, cfg.host_mask), value);
                }
                Ok(out)
            };
            vec![later_rows(
                read(generation)?,
                rotating.then(|| read(generation ^ 1)).transpose()?,
                policy,
                now_ns,
                &claim,
            )]
        } else {
            let buckets = self.per_cpu::<u64>(MAP_BUCKETS)?;
            let (rows, len) = (rows_of(cfg.rows, MAX_ROWS), row_len(cfg.row_len, cfg.bucket_mask));
            let read = |g: usize| -> Result<Vec<[(u32, u64); MAX_ROWS]>, Error> {
                let mut per_cpu: Vec<[(u32, u64); MAX_ROWS]> = Vec::new();
                let idx = row_indexes(hashes[g ^ generation], rows, len);
                for (i, &index) in idx.iter().enumerate().take(rows) {
                    let values = buckets
                        .get(&(index + base(g, cfg.bucket_mask)), 0)
                        .map_err(|source| Error::Map { name: MAP_BUCKETS, source })?;
                    per_cpu.resize(values.len(), [(0, 0); MAX_ROWS]);
                    for (cpu, &value) in values.iter().enumerate() {
                        per_cpu[cpu][i] = (index, value);
                    }
                }
                Ok(per_cpu)
            };
            let current = read(generation)?;
            let previous = if rotating { Some(read(generation ^ 1)?) } else { None };
            current
                .into_iter()
                .enumerate()
                .map(|(cpu, rows)| later_rows(rows, previous.as_ref().map(|p| p[cpu]), policy, now_ns, &claim))
                .collect()
        };
        let rows = if policy.flags & Policy::SCOPE_HOST != 0 {
            rows_of(cfg.host_rows, 2)
        } else {
            rows_of(cfg.rows, MAX_ROWS)
        };
        for copy in copies {
            layer.looks.push(look(policy, &copy, rows, now_ns, weight, &claim));
        }
        Ok(layer)
    }
}

impl Limiter {
    /// The buckets (within the current generation) of each key in `keys`, one per row, of the
    /// host-scope array (`host`) or the per-CPU one: to tell which keys share a key's buckets.
    pub(crate) fn key_buckets(&self, keys: &[FlowKey], host: bool) -> Result<Vec<Vec<u32>>, Error> {
        let cfg = self.read_config()?;
        let generation = (cfg.generation & 1) as usize;
        Ok(keys
            .iter()
            .map(|key| {
                let hash = key_hash(&cfg.salts[generation], key.family, &key.words());
                if host {
                    host_buckets(&cfg, 0, hash)
                } else {
                    let rows = rows_of(cfg.rows, MAX_ROWS);
                    row_indexes(hash, rows, row_len(cfg.row_len, cfg.bucket_mask))[..rows].to_vec()
                }
            })
            .collect())
    }
}

/// The key of `probe`'s source under `policy`: the words the program builds from the address
/// words it loads, masked by the policy's masks (`limiter_ebpf::key::key_words`).
pub fn key_of(policy: &Policy, probe: &Probe) -> FlowKey {
    let dport = if policy.flags & Policy::KEY_DPORT != 0 { probe.dport.unwrap_or(0) } else { 0 };
    match probe.src {
        IpAddr::V4(a) => {
            let word = u64::from(u32::from_le_bytes(a.octets()));
            FlowKey::from_words(FAMILY_V4, &[v4_word(word & policy.v4_mask, policy.id, dport), 0, 0])
        }
        IpAddr::V6(a) => {
            let [lo, hi] = v6_words(a);
            let words = [lo & policy.v6_mask[0], hi & policy.v6_mask[1], v6_meta_word(policy.id, dport)];
            FlowKey::from_words(FAMILY_V6, &words)
        }
    }
}

/// An IPv6 address as the two little-endian words the program loads.
fn v6_words(a: std::net::Ipv6Addr) -> [u64; 2] {
    let o = a.octets();
    let word =
        |i: usize| u64::from_le_bytes([o[i], o[i + 1], o[i + 2], o[i + 3], o[i + 4], o[i + 5], o[i + 6], o[i + 7]]);
    [word(0), word(8)]
}

/// The predicates of a policy judging among layers (`program::policy::predicates_hold`).
fn predicates_hold(policy: &Policy, probe: &Probe) -> bool {
    let flags = policy.flags;
    if flags & Policy::SYN_ONLY != 0 && !probe.syn {
        return false;
    }
    if flags & Policy::SPORT != 0 && !probe.sport.is_some_and(|s| (policy.sport_lo..=policy.sport_hi).contains(&s)) {
        return false;
    }
    if flags & Policy::DST == 0 {
        return true;
    }
    match probe.dst {
        Some(IpAddr::V4(d)) if flags & Policy::DST_V4 != 0 => {
            let word = u64::from(u32::from_le_bytes(d.octets()));
            word & policy.dst_v4_mask == policy.dst_v4
        }
        Some(IpAddr::V6(d)) if flags & Policy::DST_V6 != 0 => {
            let [lo, hi] = v6_words(d);
            lo & policy.dst_v6_mask[0] == policy.dst_v6[0] && hi & policy.dst_v6_mask[1] == policy.dst_v6[1]
        }
        _ => false,
    }
}

/// A row count as the program reads it (0 reads as 1), at most `max`.
fn rows_of(rows: u32, max: usize) -> usize {
    (rows as usize).clamp(1, max)
}

/// A per-CPU row's length as the program reads it (0: the whole generation).
fn row_len(row_len: u32, mask: u32) -> u32 {
    if row_len == 0 { mask.wrapping_add(1) } else { row_len }
}

/// The first bucket of generation `g` of an array of `mask + 1` buckets per generation.
fn base(g: usize, mask: u32) -> u32 {
    (g as u32 & 1) * mask.wrapping_add(1)
}

/// The host-scope buckets of a key hash in generation `g` (`program::buckets::host_index`, and
/// `program::host_rows::buckets_of` with two rows).
fn host_buckets(cfg: &Config, g: usize, hash: u64) -> Vec<u32> {
    let buckets = cfg.host_mask.wrapping_add(1);
    if cfg.host_rows > 1 {
        let len = if cfg.host_row_len == 0 { buckets >> 1 } else { cfg.host_row_len };
        (0..2).map(|row| base(g, cfg.host_mask) + row_index(hash, row, len)).collect()
    } else {
        vec![base(g, cfg.host_mask) + row_index(hash, 0, buckets)]
    }
}

/// Each row's bucket and value, the previous generation's where a rotation's grace carries it
/// over (`gcra::later`).
fn later_rows(
    current: [(u32, u64); MAX_ROWS],
    previous: Option<[(u32, u64); MAX_ROWS]>,
    policy: &Policy,
    now_ns: u64,
    claim: &impl Fn(u8) -> u64,
) -> [(u32, u64); MAX_ROWS] {
    let Some(previous) = previous else { return current };
    let mut out = current;
    for (i, row) in out.iter_mut().enumerate() {
        if gcra::later(current[i].1, previous[i].1, now_ns, policy.gcra.capacity, claim) != current[i].1 {
            *row = previous[i];
        }
    }
    out
}

/// A key's rows judged for one arrival of `weight` at `now_ns` (`rows::judge_rows`), with when
/// the next is admitted and when the burst is whole again, if nothing else arrives.
fn look(
    policy: &Policy,
    copy: &[(u32, u64); MAX_ROWS],
    rows: usize,
    now_ns: u64,
    weight: u64,
    claim: &impl Fn(u8) -> u64,
) -> Look {
    let values: [u64; MAX_ROWS] = std::array::from_fn(|i| copy[i].1);
    let now = now_ns.wrapping_shl(CLOCK_SHIFT);
    let g = &policy.gcra;
    let admit = judge_rows(g, policy.id as u8, &values, rows, now_ns, weight, claim).admit;
    let aheads: Vec<u64> = values[..rows].iter().map(|&v| gcra::credible_ahead(v, now, g.capacity, claim)).collect();
    let least = aheads.iter().copied().min().unwrap_or(0);
    let units = |u: u64| u.div_ceil(1 << CLOCK_SHIFT);
    Look {
        rows: (0..rows)
            .map(|i| Row { bucket: copy[i].0, ahead_ns: units(aheads[i]), owner: gcra::owner(values[i]) })
            .collect(),
        admit,
        retry_ns: units((least + g.cost(weight)).saturating_sub(g.capacity)),
        full_ns: units(least),
    }
}

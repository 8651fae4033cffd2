//! The ban maps (the daemon's expiring entries): single addresses in hash maps (`BANS_V4`,
//! `BANS_V6`), prefixes in LPM tries (`BAN_NETS_V4`, `BAN_NETS_V6`), each value a [`Ban`] with
//! its monotonic deadline; the flags in `Config` that make the program consult them; and the
//! packets they decided (`BAN_HITS`).

use std::net::IpAddr;

use aya::maps::{HashMap, LpmTrie, MapData, MapError, PerCpuArray, lpm_trie::Key};
use ipnet::IpNet;
use limiter_common::maps::{
    BAN_HIT_ALLOWED, BAN_HIT_DENIED, Ban, Config, MAP_BAN_HITS, MAP_BAN_NETS_V4, MAP_BAN_NETS_V6, MAP_BANS_V4,
    MAP_BANS_V6,
};

use super::{Error, Limiter};

/// Which of the four ban maps hold entries, in the order of [`BanMap::ALL`].
pub type BanPresence = [bool; 4];

/// One of the four ban maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BanMap {
    ExactV4,
    ExactV6,
    NetsV4,
    NetsV6,
}

impl BanMap {
    pub const ALL: [BanMap; 4] = [BanMap::ExactV4, BanMap::ExactV6, BanMap::NetsV4, BanMap::NetsV6];

    /// The map that holds `net`: a single address goes to its family's hash map.
    pub fn of(net: &IpNet) -> Self {
        match net {
            IpNet::V4(n) if n.prefix_len() == 32 => Self::ExactV4,
            IpNet::V6(n) if n.prefix_len() == 128 => Self::ExactV6,
            IpNet::V4(_) => Self::NetsV4,
            IpNet::V6(_) => Self::NetsV6,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    fn name(self) -> &'static str {
        match self {
            Self::ExactV4 => MAP_BANS_V4,
            Self::ExactV6 => MAP_BANS_V6,
            Self::NetsV4 => MAP_BAN_NETS_V4,
            Self::NetsV6 => MAP_BAN_NETS_V6,
        }
    }

    fn flag(self) -> u32 {
        match self {
            Self::ExactV4 => Config::HAS_BANS_V4,
            Self::ExactV6 => Config::HAS_BANS_V6,
            Self::NetsV4 => Config::HAS_BAN_NETS_V4,
            Self::NetsV6 => Config::HAS_BAN_NETS_V6,
        }
    }
}

/// A missing key is no error for a removal: the entry is gone either way.
fn absent_ok(result: Result<(), MapError>) -> Result<(), MapError> {
    match result {
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(nix::libc::ENOENT) => Ok(()),
        Err(MapError::KeyNotFound | MapError::ElementNotFound) => Ok(()),
        other => other,
    }
}

impl Limiter {
    /// Writes each network's ban (`Some`) or removes it (`None`), in order; stops at the first
    /// failure (the caller puts back what it had written).
    pub fn write_bans(&mut self, writes: &[(IpNet, Option<Ban>)]) -> Result<(), Error> {
        for map in BanMap::ALL {
            let mut ours = writes.iter().filter(|(n, _)| BanMap::of(n) == map).peekable();
            if ours.peek().is_none() {
                continue;
            }
            let name = map.name();
            let err = |source| Error::Map { name, source };
            match map {
                BanMap::ExactV4 | BanMap::ExactV6 => {
                    let data = self.map_mut(name)?;
                    if map == BanMap::ExactV4 {
                        let mut hash: HashMap<&mut MapData, [u8; 4], Ban> = HashMap::try_from(data).map_err(err)?;
                        for (net, ban) in ours {
                            let IpAddr::V4(a) = net.addr() else { continue };
                            match ban {
                                Some(ban) => hash.insert(a.octets(), ban, 0),
                                None => absent_ok(hash.remove(&a.octets())),
                            }
                            .map_err(err)?;
                        }
                    } else {
                        let mut hash: HashMap<&mut MapData, [u8; 16], Ban> = HashMap::try_from(data).map_err(err)?;
                        for (net, ban) in ours {
                            let IpAddr::V6(a) = net.addr() else { continue };
                            match ban {
                                Some(ban) => hash.insert(a.octets(), ban, 0),
                                None => absent_ok(hash.remove(&a.octets())),
                            }
                            .map_err(err)?;
                        }
                    }
                }
                BanMap::NetsV4 => {
                    let mut trie: LpmTrie<&mut MapData, [u8; 4], Ban> =
                        LpmTrie::try_from(self.map_mut(name)?).map_err(err)?;
                    for (net, ban) in ours {
                        let IpNet::V4(n) = net else { continue };
                        let key = Key::new(u32::from(n.prefix_len()), n.network().octets());
                        match ban {
                            Some(ban) => trie.insert(&key, ban, 0),
                            None => absent_ok(trie.remove(&key)),
                        }
                        .map_err(err)?;
                    }
                }
                BanMap::NetsV6 => {
                    let mut trie: LpmTrie<&mut MapData, [u8; 16], Ban> =
                        LpmTrie::try_from(self.map_mut(name)?).map_err(err)?;
                    for (net, ban) in ours {
                        let IpNet::V6(n) = net else { continue };
                        let key = Key::new(u32::from(n.prefix_len()), n.network().octets());
                        match ban {
                            Some(ban) => trie.insert(&key, ban, 0),
                            None => absent_ok(trie.remove(&key)),
                        }
                        .map_err(err)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Sets the `Config` flags that make the program consult the ban maps that hold entries
    /// (an empty map costs one branch, not a lookup).
    pub fn set_ban_flags(&mut self, present: BanPresence) -> Result<(), Error> {
        let mut config = self.read_config()?;
        let mut flags = config.flags & !Config::HAS_BANS;
        for map in BanMap::ALL.into_iter().filter(|m| present[m.index()]) {
            flags |= map.flag();
        }
        if flags != config.flags {
            config.flags = flags;
            self.store_config(&config)?;
        }
        Ok(())
    }

    /// Every network in the ban maps with its entry (what a predecessor left, for a restarted
    /// daemon to match with its file).
    pub fn ban_entries(&self) -> Result<Vec<(IpNet, Ban)>, Error> {
        let mut bans = Vec::new();
        let err = |name| move |source| Error::Map { name, source };
        let v4: HashMap<&MapData, [u8; 4], Ban> =
            HashMap::try_from(self.map(MAP_BANS_V4)?).map_err(err(MAP_BANS_V4))?;
        for entry in v4.iter() {
            let (key, ban) = entry.map_err(err(MAP_BANS_V4))?;
            bans.push((IpNet::from(IpAddr::from(key)), ban));
        }
        let v6: HashMap<&MapData, [u8; 16], Ban> =
            HashMap::try_from(self.map(MAP_BANS_V6)?).map_err(err(MAP_BANS_V6))?;
        for entry in v6.iter() {
            let (key, ban) = entry.map_err(err(MAP_BANS_V6))?;
            bans.push((IpNet::from(IpAddr::from(key)), ban));
        }
        let t4: LpmTrie<&MapData, [u8; 4], Ban> =
            LpmTrie::try_from(self.map(MAP_BAN_NETS_V4)?).map_err(err(MAP_BAN_NETS_V4))?;
        for entry in t4.iter() {
            let (key, ban) = entry.map_err(err(MAP_BAN_NETS_V4))?;
            let net = IpNet::new(IpAddr::from(key.data()), key.prefix_len() as u8)
                .map_err(|error| Error::AclEntry { map: MAP_BAN_NETS_V4, error })?;
            bans.push((net, ban));
        }
        let t6: LpmTrie<&MapData, [u8; 16], Ban> =
            LpmTrie::try_from(self.map(MAP_BAN_NETS_V6)?).map_err(err(MAP_BAN_NETS_V6))?;
        for entry in t6.iter() {
            let (key, ban) = entry.map_err(err(MAP_BAN_NETS_V6))?;
            let net = IpNet::new(IpAddr::from(key.data()), key.prefix_len() as u8)
                .map_err(|error| Error::AclEntry { map: MAP_BAN_NETS_V6, error })?;
            bans.push((net, ban));
        }
        Ok(bans)
    }

    /// Packets a ban denied and allowed since the maps were created, summed over CPUs.
    pub fn ban_hits(&self) -> Result<(u64, u64), Error> {
        let map: PerCpuArray<&MapData, u64> = PerCpuArray::try_from(self.map(MAP_BAN_HITS)?)
            .map_err(|source| Error::Map { name: MAP_BAN_HITS, source })?;
        let sum = |i: u32| -> Result<u64, Error> {
            let values = map.get(&i, 0).map_err(|source| Error::Map { name: MAP_BAN_HITS, source })?;
            Ok(values.iter().sum())
        };
        Ok((sum(BAN_HIT_DENIED)?, sum(BAN_HIT_ALLOWED)?))
    }
}

//! Expiring allow and deny entries (bans): `deny add --for`, fail2ban's action, the CrowdSec
//! bouncer. Runtime state, not the operator's config file: they come and go by the thousand, on
//! the tools' schedule, and an operator's file should say what the operator wrote.
//!
//! Kept here by (network, list, origin) with a deadline on the ban clock (`clock`: the kernel's
//! monotonic one); in the kernel one entry per network (`kernel::bans`): single addresses in
//! hash maps, prefixes in LPM tries, each with the same deadline, past which the program ignores
//! it (expiry is exact there). A sweep every [`SWEEP_EVERY`] takes expired entries out of the
//! maps. What may be banned at all (`rules`) is checked for every origin, at restore too. Kept
//! across restarts in the state directory (`store`): each change journaled before the kernel
//! gets it, a snapshot at most once per [`SAVE_EVERY`] and at stop.
//!
//! When several entries cover one network (different origins, or both lists), the kernel holds
//! one: a deny entry wins over an allow entry, and the latest expiry of that list is its
//! deadline.

mod clock;
mod pages;
mod restore;
mod rules;
mod snapshot;
mod store;

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use ipnet::IpNet;
use limiter_common::maps::{ACL_ALLOW, ACL_DENY, Ban, MAX_BAN_NETS, MAX_BANS};
use tracing::{debug, warn};

use self::{
    rules::{AllowList, Refusal},
    store::Store,
};
use super::listing::{self, Loop};
use crate::{
    api::{ipc::MAX_BATCH, stats::BanStats},
    config::{self, List, Origin},
    kernel::{BanMap, BanPresence, Limiter},
};

/// How often expired entries are taken out of the kernel (the kernel ignores them from their
/// deadline on; this frees the slots and updates the counts).
pub(super) const SWEEP_EVERY: Duration = Duration::from_millis(250);
/// A snapshot of a changed set of bans is written at most this often (and at stop); each change
/// is in the journal before that.
const SAVE_EVERY: Duration = Duration::from_secs(1);
/// Expired entries taken out per sweep: a million expiring at once cost a few seconds of
/// sweeps, not one long stall of the loop (the kernel ignores them meanwhile).
const SWEEP_MAX: usize = 20_000;
const MS: u64 = 1_000_000;

/// An entry's key: its network, list and origin; also where a page of entries ends and the
/// next starts (`pages`).
pub(super) type Key = (IpNet, List, Origin);

/// Why a batch was refused (bad input: nothing changed) or failed (the kernel refused it: put
/// back as it was).
pub(super) enum BanError {
    Usage(String),
    Failed(String),
}

/// What a batch did: how many entries are in force from it, and the ones refused, with why.
pub(super) struct Added {
    pub added: usize,
    pub refused: Vec<(IpNet, Refusal)>,
}

/// Active bans by family (0: IPv4, 1: IPv6) and origin, and the totals since start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct BanCounts {
    pub active: [[u64; 3]; 2],
    pub added: [u64; 3],
    pub expired: [u64; 3],
    /// Entries refused by the rules (`rules`), live or at restore.
    pub refused: [u64; 3],
}

pub(super) struct Bans {
    /// Each entry's deadline on the ban clock.
    entries: BTreeMap<Key, u64>,
    /// The same entries by deadline, for the sweep.
    deadlines: BTreeSet<(u64, IpNet, List, Origin)>,
    /// Networks in each kernel map ([`BanMap::index`]), for its capacity and its flag.
    nets: [usize; 4],
    counts: BanCounts,
    /// The config file's allow list, which no deny ban may cover.
    allow: AllowList,
    /// Origins whose refusals were said (once each; later ones are counted, and at debug).
    said: [bool; 3],
    /// None: not kept (tests of the daemon's parts).
    store: Option<Store>,
    /// Changed since the last snapshot.
    dirty: bool,
    last_saved: Instant,
}

fn family(net: &IpNet) -> usize {
    usize::from(matches!(net, IpNet::V6(_)))
}

fn capacity(map: BanMap) -> usize {
    match map {
        BanMap::ExactV4 | BanMap::ExactV6 => MAX_BANS as usize,
        BanMap::NetsV4 | BanMap::NetsV6 => MAX_BAN_NETS as usize,
    }
}

/// Every key of one network, in order.
fn net_range(net: IpNet) -> std::ops::RangeInclusive<Key> {
    (net, List::Allow, Origin::Cli)..=(net, List::Deny, Origin::Crowdsec)
}

/// The deadline `for_ms` from `now_ns`.
fn deadline(now_ns: u64, for_ms: u64) -> u64 {
    now_ns.saturating_add(for_ms.saturating_mul(MS))
}

impl Bans {
    /// No bans, kept in `path` (None: not kept, for tests of the daemon's parts).
    pub(super) fn new(path: Option<PathBuf>) -> Self {
        Self {
            entries: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            nets: [0; 4],
            counts: BanCounts::default(),
            allow: AllowList::default(),
            said: [false; 3],
            store: path.map(Store::new),
            dirty: false,
            last_saved: Instant::now(),
        }
    }

    /// The snapshot file of the bans of `iface` under `state_dir` (its journals beside it).
    pub(super) fn file_for(state_dir: &Path, iface: &str) -> PathBuf {
        state_dir.join(format!("bans-{iface}.json"))
    }

    /// What `stats` and `/metrics` say of the bans, with the packets they decided.
    /// The entries covering `addr` (each of its prefixes), longest first: network, list,
    /// origin and time left (ns).
    pub(super) fn covering(&self, addr: std::net::IpAddr) -> Vec<(IpNet, List, Origin, u64)> {
        let now = clock::now_ns();
        let longest = if addr.is_ipv4() { 32 } else { 128 };
        (0..=longest)
            .rev()
            .filter_map(|len| IpNet::new(addr, len).ok().map(|n| n.trunc()))
            .flat_map(|net| self.entries.range(net_range(net)))
            .filter(|(_, at)| **at > now)
            .map(|(&(net, list, origin), &at)| (net, list, origin, at - now))
            .collect()
    }

    pub(super) fn stats(&self, (dropped_packets, allowed_packets): (u64, u64)) -> BanStats {
        let by_origin = |values: &[u64; 3]| Origin::ALL.iter().map(|o| (o.to_string(), values[o.index()])).collect();
        let c = &self.counts;
        BanStats {
            active_v4: by_origin(&c.active[0]),
            active_v6: by_origin(&c.active[1]),
            added: by_origin(&c.added),
            expired: by_origin(&c.expired),
            refused: by_origin(&c.refused),
            dropped_packets,
            allowed_packets,
        }
    }

    fn presence(&self) -> BanPresence {
        self.nets.map(|n| n > 0)
    }

    /// What the kernel should hold for `net`: deny over allow, the latest deadline of that list,
    /// and the origins of that list's entries.
    fn effective(&self, net: IpNet) -> Option<(List, u64, u32)> {
        let mut lists = [None::<(u64, u32)>; 2];
        for ((_, list, origin), &at) in self.entries.range(net_range(net)) {
            let slot = &mut lists[usize::from(*list == List::Deny)];
            let (latest, origins) = slot.unwrap_or((0, 0));
            *slot = Some((latest.max(at), origins | 1 << origin.index()));
        }
        match lists {
            [_, Some((at, o))] => Some((List::Deny, at, o)),
            [Some((at, o)), None] => Some((List::Allow, at, o)),
            [None, None] => None,
        }
    }

    fn kernel_ban(&self, net: IpNet) -> Option<Ban> {
        self.effective(net).map(|(list, at, origins)| Ban {
            // Never 0, which the kernel reads as "no deadline".
            until_ns: at.max(1),
            action: u32::from(if list == List::Deny { ACL_DENY } else { ACL_ALLOW }),
            origins,
        })
    }

    fn has_net(&self, net: IpNet) -> bool {
        self.entries.range(net_range(net)).next().is_some()
    }

    /// Sets one entry (None: removes it), keeping the index and the counts; returns what it was.
    fn put(&mut self, key: Key, at: Option<u64>) -> Option<u64> {
        let (net, list, origin) = key;
        let had_net = self.has_net(net);
        let old = match at {
            Some(at) => self.entries.insert(key, at),
            None => self.entries.remove(&key),
        };
        if let Some(old) = old {
            self.deadlines.remove(&(old, net, list, origin));
        }
        if let Some(at) = at {
            self.deadlines.insert((at, net, list, origin));
        }
        let active = &mut self.counts.active[family(&net)][origin.index()];
        match (old.is_some(), at.is_some()) {
            (false, true) => *active += 1,
            (true, false) => *active = active.saturating_sub(1),
            _ => {}
        }
        let map = BanMap::of(&net).index();
        match (had_net, self.has_net(net)) {
            (false, true) => self.nets[map] += 1,
            (true, false) => self.nets[map] = self.nets[map].saturating_sub(1),
            _ => {}
        }
        old
    }

    /// Journals a change of one list and origin (before the kernel gets it); one that cannot
    /// be journaled makes a snapshot due.
    fn journal(&mut self, list: List, origin: Origin, set: &[(IpNet, Option<u64>)]) {
        if let Some(store) = self.store.as_mut()
            && !store.append(list, origin, set)
        {
            self.dirty = true;
        }
    }

    /// Brings the kernel to what the entries say for `nets`, given that it held what they said
    /// before the changes in `undo` (key and former deadline), in that order; on a failure, puts
    /// the entries (and their journal) and the kernel back.
    fn commit(
        &mut self,
        limiter: &mut Limiter,
        nets: &[IpNet],
        undo: Vec<(Key, Option<u64>)>,
        before: BanPresence,
    ) -> Result<(), String> {
        let writes: Vec<(IpNet, Option<Ban>)> = nets.iter().map(|n| (*n, self.kernel_ban(*n))).collect();
        let after = self.presence();
        let either = std::array::from_fn(|i| before[i] || after[i]);
        // Flags on before the entries they lead to, off after the last one goes.
        let result = limiter
            .set_ban_flags(either)
            .and_then(|()| limiter.write_bans(&writes))
            .and_then(|()| limiter.set_ban_flags(after));
        let Err(e) = result else {
            self.dirty = true;
            return Ok(());
        };
        for &(key, old) in undo.iter().rev() {
            self.put(key, old);
        }
        // Undone in the journal too (a batch is of one list and origin).
        if let Some(&((_, list, origin), _)) = undo.first() {
            let set: Vec<(IpNet, Option<u64>)> = undo.iter().rev().map(|((n, ..), old)| (*n, *old)).collect();
            self.journal(list, origin, &set);
        }
        let back: Vec<(IpNet, Option<Ban>)> = nets.iter().map(|n| (*n, self.kernel_ban(*n))).collect();
        let restored = limiter.write_bans(&back).and_then(|()| limiter.set_ban_flags(before));
        Err(match restored {
            Ok(()) => format!("{e}; nothing changed"),
            Err(again) => format!(
                "{e}; putting the kernel's bans back failed too ({again}): the next change or restart restores them"
            ),
        })
    }

    /// Counts refused entries, and says them once per origin (each at debug).
    fn refuse(&mut self, list: List, origin: Origin, refused: &[(IpNet, Refusal)]) {
        let Some((first, why)) = refused.first() else { return };
        self.counts.refused[origin.index()] += refused.len() as u64;
        for (net, why) in refused {
            debug!(list = list.as_str(), %origin, %net, reason = %why, "ban refused");
        }
        if !std::mem::replace(&mut self.said[origin.index()], true) {
            warn!(list = list.as_str(), %origin, refused = refused.len(), first = %first, reason = %why, "bans refused: {first}: {why}; the rest of the batch applied. Said once per origin: later refusals of {origin} are counted (stats, limiter_bans_refused_total) and logged at debug");
        }
    }

    /// Adds (or extends, or shortens) the entries of a batch. Bad input (host bits, a duration
    /// out of range, a batch too large or beyond capacity) refuses it whole; an entry the rules
    /// refuse (`rules::check`) is left out and reported, the rest applied whole or not at all.
    /// IPv4-mapped networks are taken as the IPv4 network ([`config::unmapped`]).
    pub(super) fn add(
        &mut self,
        limiter: &mut Limiter,
        list: List,
        origin: Origin,
        batch: &[(IpNet, u64)],
    ) -> Result<Added, BanError> {
        if batch.len() > MAX_BATCH {
            return Err(BanError::Usage(format!(
                "{} entries in one request: at most {MAX_BATCH} (send more in several requests)",
                batch.len()
            )));
        }
        let mut ok = Vec::with_capacity(batch.len());
        let mut refused = Vec::new();
        for &(net, for_ms) in batch {
            let net = config::unmapped(net);
            rules::usage(net, for_ms).map_err(BanError::Usage)?;
            match rules::check(list, net, &self.allow) {
                Ok(()) => ok.push((net, for_ms)),
                Err(why) => refused.push((net, why)),
            }
        }
        let mut new_nets = [0usize; 4];
        let mut seen = HashSet::new();
        for (net, _) in &ok {
            if !self.has_net(*net) && seen.insert(*net) {
                new_nets[BanMap::of(net).index()] += 1;
            }
        }
        for map in BanMap::ALL {
            let (now, more) = (self.nets[map.index()], new_nets[map.index()]);
            if now + more > capacity(map) {
                let what = match map {
                    BanMap::ExactV4 => "IPv4 addresses",
                    BanMap::ExactV6 => "IPv6 addresses",
                    BanMap::NetsV4 => "IPv4 prefixes",
                    BanMap::NetsV6 => "IPv6 prefixes",
                };
                return Err(BanError::Usage(format!(
                    "too many bans: at most {} {what} (with {now} in force, {more} more asked); nothing changed",
                    capacity(map)
                )));
            }
        }
        self.refuse(list, origin, &refused);
        if ok.is_empty() {
            return Ok(Added { added: 0, refused });
        }
        let before = self.presence();
        let now = clock::now_ns();
        let mut undo = Vec::with_capacity(ok.len());
        let mut set = Vec::with_capacity(ok.len());
        for &(net, for_ms) in &ok {
            let key = (net, list, origin);
            let at = deadline(now, for_ms);
            undo.push((key, self.put(key, Some(at))));
            set.push((net, Some(at)));
        }
        self.journal(list, origin, &set);
        let nets: Vec<IpNet> = seen_order(ok.iter().map(|(n, _)| *n));
        self.commit(limiter, &nets, undo, before).map_err(BanError::Failed)?;
        self.counts.added[origin.index()] += ok.len() as u64;
        Ok(Added { added: ok.len(), refused })
    }

    /// Removes the entries of `origin` for these networks; returns the networks that had one.
    pub(super) fn remove(
        &mut self,
        limiter: &mut Limiter,
        list: List,
        origin: Origin,
        nets: &[IpNet],
    ) -> Result<Vec<IpNet>, BanError> {
        if nets.len() > MAX_BATCH {
            return Err(BanError::Usage(format!(
                "{} entries in one request: at most {MAX_BATCH} (send more in several requests)",
                nets.len()
            )));
        }
        let before = self.presence();
        let mut undo = Vec::new();
        let mut removed = Vec::new();
        for net in seen_order(nets.iter().map(|n| config::unmapped(*n))) {
            let key = (net, list, origin);
            if let Some(old) = self.put(key, None) {
                undo.push((key, Some(old)));
                removed.push(net);
            }
        }
        if removed.is_empty() {
            return Ok(removed);
        }
        let set: Vec<(IpNet, Option<u64>)> = removed.iter().map(|n| (*n, None)).collect();
        self.journal(list, origin, &set);
        self.commit(limiter, &removed, undo, before).map_err(BanError::Failed)?;
        Ok(removed)
    }

    /// Takes the expired entries out (at most [`SWEEP_MAX`] a call). Not journaled: at restore
    /// their deadlines are past as well.
    pub(super) fn sweep(&mut self, limiter: &mut Limiter) {
        let now = clock::now_ns();
        let due: Vec<(u64, IpNet, List, Origin)> =
            self.deadlines.iter().take_while(|(at, ..)| *at <= now).take(SWEEP_MAX).copied().collect();
        if due.is_empty() {
            return;
        }
        let before = self.presence();
        let mut undo = Vec::with_capacity(due.len());
        for &(at, net, list, origin) in &due {
            self.put((net, list, origin), None);
            undo.push(((net, list, origin), Some(at)));
        }
        let nets = seen_order(due.iter().map(|d| d.1));
        let store = self.store.take();
        let result = self.commit(limiter, &nets, undo, before);
        self.store = store;
        match result {
            Ok(()) => {
                for (_, _, _, origin) in &due {
                    self.counts.expired[origin.index()] += 1;
                }
            }
            // Kept, to be tried again at the next sweep; the kernel ignores them meanwhile.
            Err(error) => warn!(%error, "removing expired bans from the kernel failed; will retry"),
        }
    }

    /// Takes the config file's allow list (at start and after each change of the config), and
    /// lifts the deny bans it now covers, as if they were refused at entry.
    pub(super) fn set_allow_list(&mut self, limiter: &mut Limiter, allow: &BTreeSet<IpNet>) {
        let added: Vec<IpNet> = allow.difference(self.allow.nets()).copied().collect();
        self.allow = AllowList::new(allow);
        if added.is_empty() || self.entries.is_empty() {
            return;
        }
        let covered: BTreeSet<Key> = self
            .entries
            .keys()
            .filter(|(net, list, _)| *list == List::Deny && rules::check(List::Deny, *net, &self.allow).is_err())
            .copied()
            .collect();
        for origin in Origin::ALL {
            let nets: Vec<IpNet> = covered.iter().filter(|k| k.2 == origin).map(|k| k.0).collect();
            for chunk in nets.chunks(MAX_BATCH) {
                let refused: Vec<(IpNet, Refusal)> = chunk
                    .iter()
                    .filter_map(|n| rules::check(List::Deny, *n, &self.allow).err().map(|why| (*n, why)))
                    .collect();
                match self.remove(limiter, List::Deny, origin, chunk) {
                    Ok(_) => self.refuse(List::Deny, origin, &refused),
                    Err(BanError::Usage(error) | BanError::Failed(error)) => {
                        warn!(%origin, %error, "lifting the bans the allow list now covers failed; the next change of the allow list tries again")
                    }
                }
            }
        }
    }

    /// Writes a snapshot off the loop when the bans changed and the last one is old enough (a
    /// failed write is tried again each second until one works). Its writer takes the entries
    /// from the loop a page at a time (`loop_`): a copy of them all at once would hold the loop
    /// for a tenth of a second per million.
    pub(super) fn save_if_due(&mut self, loop_: &Loop) {
        let Some(store) = self.store.as_ref() else { return };
        if store.failing() {
            self.dirty = true;
        }
        if !self.dirty || self.last_saved.elapsed() < SAVE_EVERY || store.busy() {
            return;
        }
        self.dirty = false;
        self.last_saved = Instant::now();
        let loop_ = loop_.clone();
        let pages = move |after| listing::blocking_on(&loop_, move |bans: &Bans| bans.saved_page(after));
        if let Some(store) = self.store.as_mut()
            && !store.save(pages)
        {
            self.dirty = true;
        }
    }

    /// Writes a snapshot now (at stop, the loop ended), after any in flight, if the bans
    /// changed since the last one began (or it failed): else the files already hold them.
    pub(super) fn save_now(&mut self) {
        let Some(mut store) = self.store.take() else { return };
        let changed = self.dirty;
        store.save_now(changed, |after| Some(self.saved_page(after)));
        self.store = Some(store);
    }
}

/// Each network once, in first-seen order.
fn seen_order(nets: impl Iterator<Item = IpNet>) -> Vec<IpNet> {
    let mut seen = HashSet::new();
    nets.filter(|n| seen.insert(*n)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    /// Several entries on one network make one kernel entry: deny over allow, the latest
    /// deadline of that list, the origins of that list; the counts follow entries by family and
    /// origin, and the networks per kernel map follow the first and last entry of each.
    #[test]
    fn one_kernel_entry_per_network_deny_first_latest_expiry() {
        let mut bans = Bans::new(None);
        let (a, p, v6) = (net("198.18.0.5/32"), net("198.18.1.0/24"), net("2001:db8::5/128"));
        bans.put((a, List::Allow, Origin::Cli), Some(9_000));
        assert_eq!(bans.effective(a), Some((List::Allow, 9_000, 0b001)));
        bans.put((a, List::Deny, Origin::Fail2ban), Some(5_000));
        bans.put((a, List::Deny, Origin::Crowdsec), Some(7_000));
        assert_eq!(bans.effective(a), Some((List::Deny, 7_000, 0b110)), "deny wins, at its latest expiry");
        assert_eq!(bans.kernel_ban(a).map(|b| (b.until_ns, b.origins)), Some((7_000, 0b110)));
        assert_eq!(bans.put((a, List::Deny, Origin::Crowdsec), Some(6_000)), Some(7_000), "a renewal replaces");
        assert_eq!(bans.effective(a), Some((List::Deny, 6_000, 0b110)));
        bans.put((p, List::Deny, Origin::Cli), Some(1_000));
        bans.put((v6, List::Deny, Origin::Crowdsec), Some(1_000));
        assert_eq!(bans.nets, [1, 1, 1, 0], "exact v4, exact v6, prefixes v4, prefixes v6");
        assert_eq!(bans.counts.active, [[2, 1, 1], [0, 0, 1]]);
        assert_eq!(bans.deadlines.len(), 5);
        bans.put((a, List::Deny, Origin::Fail2ban), None);
        bans.put((a, List::Deny, Origin::Crowdsec), None);
        assert_eq!(bans.effective(a), Some((List::Allow, 9_000, 0b001)), "the allow entry is left");
        bans.put((a, List::Allow, Origin::Cli), None);
        assert_eq!(bans.effective(a), None);
        assert_eq!(bans.nets, [0, 1, 1, 0]);
        assert_eq!(bans.counts.active, [[1, 0, 0], [0, 0, 1]]);
        assert_eq!(bans.deadlines.len(), 2);
        // Removing what is not there changes nothing.
        assert_eq!(bans.put((a, List::Deny, Origin::Cli), None), None);
        assert_eq!(bans.counts.active, [[1, 0, 0], [0, 0, 1]]);
    }

    #[test]
    fn deadlines_are_as_far_ahead_as_asked() {
        assert_eq!(deadline(5_000_000_000, 2_000), 7_000_000_000);
        assert_eq!(deadline(5, u64::MAX), u64::MAX);
    }
}

//! Expiring allow and deny entries (bans): `deny add --for`, fail2ban's action, the CrowdSec
//! bouncer. Runtime state, not the operator's config file: they come and go by the thousand, on
//! the tools' schedule, and an operator's file should say what the operator wrote.
//!
//! Kept here by (network, list, origin) with a wall-clock expiry; in the kernel one entry per
//! network (`kernel::bans`): single addresses in hash maps, prefixes in LPM tries, each with a
//! monotonic deadline past which the program ignores it (expiry is exact there). A sweep every
//! [`SWEEP_EVERY`] takes expired entries out of the maps. Saved to a file in the state
//! directory (`--state-dir`, one file per interface) at most once per [`SAVE_EVERY`] and at
//! stop, written whole to a temporary file then renamed over the old; read back at start, so a
//! restart keeps each entry with the time it had left (wall clock: a reboot's time counts too).
//!
//! When several entries cover one network (different origins, or both lists), the kernel holds
//! one: a deny entry wins over an allow entry, and the latest expiry of that list is its
//! deadline.

use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    io::Write as _,
    ops::Bound,
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ipnet::IpNet;
use limiter_common::maps::{ACL_ALLOW, ACL_DENY, Ban, MAX_BAN_NETS, MAX_BANS};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::listing::{self, Loop, PAGE};
use crate::{
    api::{
        ipc::{BanStatus, MAX_BATCH, MAX_FOR_MS},
        stats::BanStats,
    },
    config::{List, Origin},
    kernel::{self, BanMap, BanPresence, Limiter},
};

/// How often expired entries are taken out of the kernel (the kernel ignores them from their
/// deadline on; this frees the slots and updates the counts).
pub(super) const SWEEP_EVERY: Duration = Duration::from_millis(250);
/// A changed set of bans is saved at most this often (and at stop).
const SAVE_EVERY: Duration = Duration::from_secs(1);
/// Expired entries taken out per sweep: a million expiring at once cost a few seconds of
/// sweeps, not one long stall of the loop (the kernel ignores them meanwhile).
const SWEEP_MAX: usize = 20_000;
/// The file's format.
const FILE_VERSION: u32 = 1;

/// An entry's key; also where a page of entries ends and the next starts (`listing`).
pub(super) type Key = (IpNet, List, Origin);

/// Why a batch was refused (bad input: nothing changed) or failed (the kernel refused it: put
/// back as it was).
pub(super) enum BanError {
    Usage(String),
    Failed(String),
}

/// Active bans by family (0: IPv4, 1: IPv6) and origin, and the totals since start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct BanCounts {
    pub active: [[u64; 3]; 2],
    pub added: [u64; 3],
    pub expired: [u64; 3],
}

/// The clock pair a batch is applied with: wall-clock ms (expiries are kept in it) and the
/// monotonic ns the kernel's deadlines are in.
#[derive(Clone, Copy)]
struct Clock {
    wall_ms: u64,
    mono_ns: u64,
}

impl Clock {
    fn now() -> Self {
        let wall_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        Self { wall_ms, mono_ns: kernel::monotonic_ns() }
    }

    /// The monotonic deadline of a wall-clock expiry (one already past: now). Never 0, which
    /// the kernel reads as "no deadline".
    fn deadline_ns(&self, expires_ms: u64) -> u64 {
        let left_ns = expires_ms.saturating_sub(self.wall_ms).saturating_mul(1_000_000);
        self.mono_ns.saturating_add(left_ns).max(1)
    }
}

/// One saved entry: list, origin, network, expiry (ms since the epoch).
#[derive(Debug, Serialize, Deserialize)]
struct Saved(List, Origin, #[serde(deserialize_with = "crate::config::net_serde::deserialize")] IpNet, u64);

/// The file: its entries a `Vec` read back, pages fetched as they are written ([`Pages`]).
#[derive(Serialize, Deserialize)]
struct SavedFile<B> {
    version: u32,
    bans: B,
}

pub(super) struct Bans {
    entries: BTreeMap<Key, u64>,
    /// The same entries by expiry, for the sweep.
    deadlines: BTreeSet<(u64, IpNet, List, Origin)>,
    /// Networks in each kernel map ([`BanMap::index`]), for its capacity and its flag.
    nets: [usize; 4],
    counts: BanCounts,
    path: Option<PathBuf>,
    dirty: bool,
    last_saved: Instant,
    /// A save runs off the loop: the next waits for it.
    saving: Arc<AtomicBool>,
    /// The last save failed: said once, and again when saving works again (not once a second).
    failing: Arc<AtomicBool>,
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

impl Bans {
    /// No bans, saved to `path` (None: not saved, for tests of the daemon's parts).
    pub(super) fn new(path: Option<PathBuf>) -> Self {
        Self {
            entries: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            nets: [0; 4],
            counts: BanCounts::default(),
            path,
            dirty: false,
            last_saved: Instant::now(),
            saving: Arc::default(),
            failing: Arc::default(),
        }
    }

    /// The file of the bans of `iface` under `state_dir`.
    pub(super) fn file_for(state_dir: &Path, iface: &str) -> PathBuf {
        state_dir.join(format!("bans-{iface}.json"))
    }

    /// What `stats` and `/metrics` say of the bans, with the packets they decided.
    pub(super) fn stats(&self, (dropped_packets, allowed_packets): (u64, u64)) -> BanStats {
        let by_origin = |values: &[u64; 3]| Origin::ALL.iter().map(|o| (o.to_string(), values[o.index()])).collect();
        let c = &self.counts;
        BanStats {
            active_v4: by_origin(&c.active[0]),
            active_v6: by_origin(&c.active[1]),
            added: by_origin(&c.added),
            expired: by_origin(&c.expired),
            dropped_packets,
            allowed_packets,
        }
    }

    fn presence(&self) -> BanPresence {
        self.nets.map(|n| n > 0)
    }

    /// What the kernel should hold for `net`: deny over allow, the latest expiry of that list.
    fn effective(&self, net: IpNet) -> Option<(List, u64)> {
        let (mut allow, mut deny) = (None::<u64>, None::<u64>);
        for ((_, list, _), &expires) in self.entries.range(net_range(net)) {
            let slot = if *list == List::Deny { &mut deny } else { &mut allow };
            *slot = Some(slot.map_or(expires, |e| e.max(expires)));
        }
        deny.map(|e| (List::Deny, e)).or(allow.map(|e| (List::Allow, e)))
    }

    fn kernel_ban(&self, net: IpNet, clock: Clock) -> Option<Ban> {
        self.effective(net).map(|(list, expires)| Ban {
            until_ns: clock.deadline_ns(expires),
            action: u32::from(if list == List::Deny { ACL_DENY } else { ACL_ALLOW }),
            _pad: 0,
        })
    }

    fn has_net(&self, net: IpNet) -> bool {
        self.entries.range(net_range(net)).next().is_some()
    }

    /// Sets one entry (None: removes it), keeping the index and the counts; returns what it was.
    fn put(&mut self, key: Key, expires: Option<u64>) -> Option<u64> {
        let (net, list, origin) = key;
        let had_net = self.has_net(net);
        let old = match expires {
            Some(e) => self.entries.insert(key, e),
            None => self.entries.remove(&key),
        };
        if let Some(old) = old {
            self.deadlines.remove(&(old, net, list, origin));
        }
        if let Some(e) = expires {
            self.deadlines.insert((e, net, list, origin));
        }
        let active = &mut self.counts.active[family(&net)][origin.index()];
        match (old.is_some(), expires.is_some()) {
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

    /// Brings the kernel to what the entries say for `nets`, given that it held what they said
    /// before the changes in `undo` (key and former expiry), in that order; on a failure, puts
    /// the entries and the kernel back.
    fn commit(
        &mut self,
        limiter: &mut Limiter,
        nets: &[IpNet],
        undo: Vec<(Key, Option<u64>)>,
        before: BanPresence,
    ) -> Result<(), String> {
        let clock = Clock::now();
        let writes: Vec<(IpNet, Option<Ban>)> = nets.iter().map(|n| (*n, self.kernel_ban(*n, clock))).collect();
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
        for (key, old) in undo.into_iter().rev() {
            self.put(key, old);
        }
        let back: Vec<(IpNet, Option<Ban>)> = nets.iter().map(|n| (*n, self.kernel_ban(*n, clock))).collect();
        let restored = limiter.write_bans(&back).and_then(|()| limiter.set_ban_flags(before));
        Err(match restored {
            Ok(()) => format!("{e}; nothing changed"),
            Err(again) => format!(
                "{e}; putting the kernel's bans back failed too ({again}): the next change or restart restores them"
            ),
        })
    }

    /// Adds (or extends, or shortens) the entries of a batch, whole or not at all.
    pub(super) fn add(
        &mut self,
        limiter: &mut Limiter,
        list: List,
        origin: Origin,
        batch: &[(IpNet, u64)],
    ) -> Result<usize, BanError> {
        if batch.len() > MAX_BATCH {
            return Err(BanError::Usage(format!(
                "{} entries in one request: at most {MAX_BATCH} (send more in several requests)",
                batch.len()
            )));
        }
        let mut new_nets = [0usize; 4];
        let mut seen = HashSet::new();
        for (net, for_ms) in batch {
            if net.trunc() != *net {
                return Err(BanError::Usage(format!(
                    "{net} has host bits set: the network is {} (nothing changed)",
                    net.trunc()
                )));
            }
            if *for_ms == 0 || *for_ms > MAX_FOR_MS {
                return Err(BanError::Usage(format!(
                    "invalid duration for {net}: {for_ms} ms; expected more than 0 and at most 10 years (nothing changed)"
                )));
            }
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
        let before = self.presence();
        let now = Clock::now();
        let mut undo = Vec::with_capacity(batch.len());
        for (net, for_ms) in batch {
            let key = (*net, list, origin);
            let old = self.put(key, Some(now.wall_ms.saturating_add(*for_ms)));
            undo.push((key, old));
        }
        let nets: Vec<IpNet> = seen_order(batch.iter().map(|(n, _)| *n));
        self.commit(limiter, &nets, undo, before).map_err(BanError::Failed)?;
        self.counts.added[origin.index()] += batch.len() as u64;
        Ok(batch.len())
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
        for net in seen_order(nets.iter().copied()) {
            let key = (net, list, origin);
            if let Some(old) = self.put(key, None) {
                undo.push((key, Some(old)));
                removed.push(net);
            }
        }
        if removed.is_empty() {
            return Ok(removed);
        }
        self.commit(limiter, &removed, undo, before).map_err(BanError::Failed)?;
        Ok(removed)
    }

    /// Takes the expired entries out (at most [`SWEEP_MAX`] a call).
    pub(super) fn sweep(&mut self, limiter: &mut Limiter) {
        let now = Clock::now().wall_ms;
        let due: Vec<(u64, IpNet, List, Origin)> =
            self.deadlines.iter().take_while(|(e, ..)| *e <= now).take(SWEEP_MAX).copied().collect();
        if due.is_empty() {
            return;
        }
        let before = self.presence();
        let mut undo = Vec::with_capacity(due.len());
        for &(expires, net, list, origin) in &due {
            self.put((net, list, origin), None);
            undo.push(((net, list, origin), Some(expires)));
        }
        let nets = seen_order(due.iter().map(|d| d.1));
        match self.commit(limiter, &nets, undo, before) {
            Ok(()) => {
                for (_, _, _, origin) in &due {
                    self.counts.expired[origin.index()] += 1;
                }
            }
            // Kept, to be tried again at the next sweep; the kernel ignores them meanwhile.
            Err(error) => warn!(%error, "removing expired bans from the kernel failed; will retry"),
        }
    }

    /// A page of the entries after `after` (None: from the first), in order: of the first `max`
    /// looked at, those `keep` takes; and where the next page starts (None: there is none).
    /// One page costs the loop a few milliseconds whatever the number of bans.
    fn page<T>(
        &self,
        after: Option<Key>,
        max: usize,
        mut keep: impl FnMut(Key, u64) -> Option<T>,
    ) -> (Vec<T>, Option<Key>) {
        let rest = match after {
            Some(key) => self.entries.range((Bound::Excluded(key), Bound::Unbounded)),
            None => self.entries.range(..),
        };
        let (mut out, mut last, mut seen) = (Vec::new(), None, 0);
        for (&key, &expires) in rest.take(max) {
            (seen, last) = (seen + 1, Some(key));
            out.extend(keep(key, expires));
        }
        (out, if seen < max { None } else { last })
    }

    /// A page of the entries of a list in force, with their time left (`ban-list`, `listing`).
    pub(super) fn list_page(&self, list: List, after: Option<Key>, max: usize) -> (Vec<BanStatus>, Option<Key>) {
        let now = Clock::now().wall_ms;
        self.page(after, max, |key, expires| status(key, expires, now).filter(|_| key.1 == list))
    }

    /// The entries of a list in force for these networks, whatever their origin.
    pub(super) fn list_of(&self, list: List, nets: &[IpNet]) -> Vec<BanStatus> {
        let now = Clock::now().wall_ms;
        seen_order(nets.iter().copied())
            .into_iter()
            .flat_map(|net| self.entries.range(net_range(net)))
            .filter(|((_, l, _), _)| *l == list)
            .filter_map(|(&key, &expires)| status(key, expires, now))
            .collect()
    }

    /// Reads the saved bans back and makes the kernel hold them (and nothing else: entries a
    /// predecessor left that the file does not have are removed). An unreadable file is set
    /// aside (`.bad`) and said, and the daemon starts without bans: refusing to start would
    /// leave the host unprotected for a file that only held expiring entries.
    pub(super) fn restore(&mut self, limiter: &mut Limiter) -> Result<(), kernel::Error> {
        let now = Clock::now();
        let mut expired = 0usize;
        if let Some(path) = self.path.clone() {
            match read_file(&path) {
                Ok(None) => {}
                Ok(Some(saved)) => {
                    for Saved(list, origin, net, expires) in saved {
                        if expires <= now.wall_ms {
                            expired += 1;
                        } else if net.trunc() == net && self.nets[BanMap::of(&net).index()] < capacity(BanMap::of(&net))
                        {
                            self.put((net, list, origin), Some(expires));
                        }
                    }
                }
                Err(error) => {
                    let aside = path.with_extension("json.bad");
                    let moved = std::fs::rename(&path, &aside).is_ok();
                    warn!(file = %path.display(), %error, set_aside = moved.then(|| aside.display().to_string()), "the saved bans could not be read: starting without them");
                }
            }
        }
        // What the kernel holds that the entries do not say: a predecessor's, since expired or
        // removed.
        let stale: Vec<(IpNet, Option<Ban>)> =
            limiter.ban_keys()?.into_iter().filter(|n| !self.has_net(*n)).map(|n| (n, None)).collect();
        let present = self.presence();
        let nets: Vec<IpNet> = seen_order(self.entries.keys().map(|k| k.0));
        let writes: Vec<(IpNet, Option<Ban>)> = nets.iter().map(|n| (*n, self.kernel_ban(*n, now))).collect();
        limiter.set_ban_flags(std::array::from_fn(|i| present[i] || !stale.is_empty()))?;
        limiter.write_bans(&writes)?;
        limiter.write_bans(&stale)?;
        limiter.set_ban_flags(present)?;
        if !self.entries.is_empty() || expired > 0 || !stale.is_empty() {
            info!(
                restored = self.entries.len(),
                expired_meanwhile = expired,
                removed_stale = stale.len(),
                file = ?self.path.as_ref().map(|p| p.display().to_string()),
                "bans restored with the time they had left"
            );
        }
        self.dirty = expired > 0;
        Ok(())
    }

    /// Saves the bans off the loop when they changed and the last save is old enough. The
    /// writer takes them from the loop a page at a time (`loop_`): a copy of them all at once
    /// would hold the loop for a tenth of a second per million. A change made meanwhile makes
    /// the next save.
    pub(super) fn save_if_due(&mut self, loop_: &Loop) {
        // A failed save is tried again (once a second) until one works.
        if self.failing.load(Ordering::Acquire) {
            self.dirty = true;
        }
        if !self.dirty || self.last_saved.elapsed() < SAVE_EVERY || self.saving.load(Ordering::Acquire) {
            return;
        }
        let Some(path) = self.path.clone() else { return };
        self.dirty = false;
        self.last_saved = Instant::now();
        self.saving.store(true, Ordering::Release);
        let (saving, failing, loop_) = (self.saving.clone(), self.failing.clone(), loop_.clone());
        let unsaved = self.saving.clone();
        let spawned = listing::in_background("bans-save", move || {
            let pages = |after| listing::blocking_on(&loop_, move |bans: &Bans| bans.saved_page(after));
            match write_file(&path, pages) {
                // The daemon is stopping: it saves them itself (`save_now`).
                Err(WriteError::Stopped) => {}
                Err(WriteError::Failed(error)) if !failing.swap(true, Ordering::AcqRel) => {
                    warn!(file = %path.display(), %error, "saving the bans failed; a restart would lose them (retried while they change, said again when it works)")
                }
                Err(WriteError::Failed(_)) => {}
                Ok(()) if failing.swap(false, Ordering::AcqRel) => {
                    info!(file = %path.display(), "saving the bans works again")
                }
                Ok(()) => {}
            }
            saving.store(false, Ordering::Release);
        });
        if !spawned {
            warn!("no thread for saving the bans; tried again in a second");
            unsaved.store(false, Ordering::Release);
            self.dirty = true;
        }
    }

    /// Saves the bans now (at stop, the loop ended), after any save in flight.
    pub(super) fn save_now(&mut self) {
        let Some(path) = self.path.clone() else { return };
        if !self.dirty {
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.saving.load(Ordering::Acquire) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        match write_file(&path, |after| Some(self.saved_page(after))) {
            Ok(()) => self.dirty = false,
            Err(error) => warn!(file = %path.display(), %error, "saving the bans at stop failed"),
        }
    }

    /// A page of the entries as the file holds them.
    fn saved_page(&self, after: Option<Key>) -> (Vec<Saved>, Option<Key>) {
        self.page(after, PAGE, |(net, list, origin), expires| Some(Saved(list, origin, net, expires)))
    }
}

/// An entry in force as `ban-list` reports it (None: expired, not swept yet).
fn status((net, _, origin): Key, expires: u64, now: u64) -> Option<BanStatus> {
    (expires > now).then(|| BanStatus { cidr: net, origin, expires_at_ms: expires, expires_in_ms: expires - now })
}

/// Each network once, in first-seen order.
fn seen_order(nets: impl Iterator<Item = IpNet>) -> Vec<IpNet> {
    let mut seen = HashSet::new();
    nets.filter(|n| seen.insert(*n)).collect()
}

/// The saved bans; None when there is no file.
fn read_file(path: &Path) -> Result<Option<Vec<Saved>>, String> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let file: SavedFile<Vec<Saved>> = serde_json::from_slice(&text).map_err(|e| e.to_string())?;
    if file.version != FILE_VERSION {
        return Err(format!("format version {} (this daemon reads {FILE_VERSION})", file.version));
    }
    Ok(Some(file.bans))
}

/// Why a save was not made.
#[derive(Debug, thiserror::Error)]
enum WriteError {
    /// The loop that hands out the pages ended: the daemon is stopping.
    #[error("the daemon stopped during the save")]
    Stopped,
    #[error("{0}")]
    Failed(String),
}

/// Writes the bans whole, page by page as `pages` hands them out (after a key, the next page
/// and where the one after starts): a temporary file beside the old, synced, renamed over it (a
/// crash leaves the old file or the new, never half of one). The directory is made 0700.
fn write_file(
    path: &Path,
    pages: impl FnMut(Option<Key>) -> Option<(Vec<Saved>, Option<Key>)>,
) -> Result<(), WriteError> {
    let failed = |e: &dyn std::fmt::Display| WriteError::Failed(e.to_string());
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| WriteError::Failed(format!("creating {}: {e}", dir.display())))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".bans")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .tempfile_in(dir)
        .map_err(|e| failed(&e))?;
    let bans = listing::Seq::new(listing::Pages::new(pages));
    {
        let mut out = std::io::BufWriter::new(tmp.as_file_mut());
        serde_json::to_writer(&mut out, &SavedFile { version: FILE_VERSION, bans: &bans }).map_err(|e| failed(&e))?;
        out.write_all(b"\n").and_then(|()| out.flush()).map_err(|e| failed(&e))?;
    }
    if bans.into_inner().stopped {
        return Err(WriteError::Stopped);
    }
    tmp.as_file().sync_all().map_err(|e| failed(&e))?;
    tmp.persist(path).map_err(|e| failed(&e.error))?;
    // The rename itself, durable.
    if let Ok(d) = std::fs::OpenOptions::new().read(true).custom_flags(0).open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    /// Several entries on one network make one kernel entry: deny over allow, the latest
    /// expiry of that list; the counts follow entries by family and origin, and the networks
    /// per kernel map follow the first and last entry of each.
    #[test]
    fn one_kernel_entry_per_network_deny_first_latest_expiry() {
        let mut bans = Bans::new(None);
        let (a, p, v6) = (net("198.18.0.5/32"), net("198.18.1.0/24"), net("2001:db8::5/128"));
        bans.put((a, List::Allow, Origin::Cli), Some(9_000));
        assert_eq!(bans.effective(a), Some((List::Allow, 9_000)));
        bans.put((a, List::Deny, Origin::Fail2ban), Some(5_000));
        bans.put((a, List::Deny, Origin::Crowdsec), Some(7_000));
        assert_eq!(bans.effective(a), Some((List::Deny, 7_000)), "deny wins, at its latest expiry");
        assert_eq!(bans.put((a, List::Deny, Origin::Crowdsec), Some(6_000)), Some(7_000), "a renewal replaces");
        assert_eq!(bans.effective(a), Some((List::Deny, 6_000)));
        bans.put((p, List::Deny, Origin::Cli), Some(1_000));
        bans.put((v6, List::Deny, Origin::Crowdsec), Some(1_000));
        assert_eq!(bans.nets, [1, 1, 1, 0], "exact v4, exact v6, prefixes v4, prefixes v6");
        assert_eq!(bans.counts.active, [[2, 1, 1], [0, 0, 1]]);
        assert_eq!(bans.deadlines.len(), 5);
        bans.put((a, List::Deny, Origin::Fail2ban), None);
        bans.put((a, List::Deny, Origin::Crowdsec), None);
        assert_eq!(bans.effective(a), Some((List::Allow, 9_000)), "the allow entry is left");
        bans.put((a, List::Allow, Origin::Cli), None);
        assert_eq!(bans.effective(a), None);
        assert_eq!(bans.nets, [0, 1, 1, 0]);
        assert_eq!(bans.counts.active, [[1, 0, 0], [0, 0, 1]]);
        assert_eq!(bans.deadlines.len(), 2);
        // Removing what is not there changes nothing.
        assert_eq!(bans.put((a, List::Deny, Origin::Cli), None), None);
        assert_eq!(bans.counts.active, [[1, 0, 0], [0, 0, 1]]);
    }

    /// A wall-clock expiry becomes a monotonic deadline the same distance ahead; one already
    /// past is due now; never 0 (no deadline, to the kernel).
    #[test]
    fn deadlines_are_as_far_ahead_as_the_expiry() {
        let clock = Clock { wall_ms: 1_000_000, mono_ns: 5_000_000_000 };
        assert_eq!(clock.deadline_ns(1_002_000), 7_000_000_000);
        assert_eq!(clock.deadline_ns(999_000), 5_000_000_000);
        assert_eq!(Clock { wall_ms: 10, mono_ns: 0 }.deadline_ns(5), 1);
        assert_eq!(clock.deadline_ns(u64::MAX), u64::MAX);
    }

    /// A list comes in pages that end where the next starts, each of at most `max` entries
    /// looked at, the other list's and the expired skipped: every entry in force once, in
    /// order. `list_of` gives a network's entries of every origin, once.
    #[test]
    fn a_list_pages_through_every_entry_once() {
        let mut bans = Bans::new(None);
        let later = Clock::now().wall_ms + 60_000;
        let addr = |i: u32| IpNet::from(std::net::IpAddr::from(std::net::Ipv4Addr::from(0xc612_0000 + i)));
        for i in 0..25 {
            let list = if i % 5 == 0 { List::Allow } else { List::Deny };
            bans.put((addr(i), list, Origin::Cli), Some(later));
        }
        bans.put((addr(3), List::Deny, Origin::Crowdsec), Some(later));
        bans.put((addr(100), List::Deny, Origin::Cli), Some(1));
        let (mut listed, mut after, mut pages) = (Vec::new(), None, 0);
        loop {
            let (page, next) = bans.list_page(List::Deny, after, 7);
            listed.extend(page.iter().map(|b| (b.cidr, b.origin)));
            pages += 1;
            match next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        let mut want: Vec<_> = (0..25).filter(|i| i % 5 != 0).map(|i| (addr(i), Origin::Cli)).collect();
        want.insert(3, (addr(3), Origin::Crowdsec));
        assert_eq!(listed, want);
        assert_eq!(pages, 4, "27 entries, 7 looked at a page");
        let of = bans.list_of(List::Deny, &[addr(3), addr(0), addr(3), addr(100)]);
        let of: Vec<_> = of.iter().map(|b| (b.cidr, b.origin)).collect();
        assert_eq!(of, [(addr(3), Origin::Cli), (addr(3), Origin::Crowdsec)], "allow's and the expired left out");
    }

    /// The file is written page by page and holds every entry; a save whose pages stop coming
    /// (the daemon stopping) leaves the old file as it was, and no other; another version is
    /// refused.
    #[test]
    fn the_file_reads_back_what_was_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = Bans::file_for(dir.path(), "eth0");
        assert!(read_file(&path).unwrap().is_none(), "no file: no bans, no error");
        let mut bans = Bans::new(None);
        bans.put((net("198.18.0.5/32"), List::Deny, Origin::Fail2ban), Some(1_700_000_000_000));
        bans.put((net("2001:db8::/48"), List::Allow, Origin::Cli), Some(1_800_000_000_000));
        bans.put((net("198.18.0.6/32"), List::Deny, Origin::Cli), Some(1_750_000_000_000));
        let one = |after| Some(bans.page(after, 1, |(net, list, origin), e| Some(Saved(list, origin, net, e))));
        write_file(&path, one).unwrap();
        let read = || -> Vec<_> {
            read_file(&path).unwrap().unwrap().into_iter().map(|Saved(l, o, n, e)| (l, o, n, e)).collect()
        };
        let want = vec![
            (List::Deny, Origin::Fail2ban, net("198.18.0.5/32"), 1_700_000_000_000),
            (List::Deny, Origin::Cli, net("198.18.0.6/32"), 1_750_000_000_000),
            (List::Allow, Origin::Cli, net("2001:db8::/48"), 1_800_000_000_000),
        ];
        assert_eq!(read(), want);
        bans.put((net("198.18.0.5/32"), List::Deny, Origin::Fail2ban), None);
        let mut fetched = 0;
        let stopping = |after| {
            fetched += 1;
            (fetched < 2).then(|| bans.page(after, 1, |(net, list, origin), e| Some(Saved(list, origin, net, e))))
        };
        assert!(matches!(write_file(&path, stopping), Err(WriteError::Stopped)));
        assert_eq!(read(), want, "the old file stays");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "a temporary file left");
        std::fs::write(&path, r#"{"version":2,"bans":[]}"#).unwrap();
        assert!(read_file(&path).unwrap_err().contains("version 2"));
        std::fs::write(&path, r#"{"version":1,"bans":[["deny","cli","010.0.0.1/32",1]]}"#).unwrap();
        assert!(read_file(&path).is_err(), "a lax network is refused as the socket refuses it");
    }
}

//! Where bans live between runs, in the state directory: a snapshot, `bans-IFACE.json`, and a
//! journal of the changes since, `bans-IFACE.journal.N`.
//!
//! Every change is appended to the journal before the kernel gets it (one write, no sync: a
//! killed process loses nothing the kernel has, since the page cache keeps what it wrote), so
//! after a crash the files hold at least what the kernel held, and each removal the kernel
//! applied. A snapshot, written whole at most once a second (a temporary file, synced, renamed
//! over the old), names the first journal that follows it, begun as the snapshot starts; the
//! journals before it are then deleted. At start: the snapshot, then each journal from the one
//! it names, in order. A record sets entries to a deadline or removes them (absolute values, not
//! steps), so a journal replayed over a snapshot newer than some of its records still ends where
//! the daemon was.
//!
//! That is what lets a snapshot be written off the loop without a copy of the bans: its writer,
//! on a thread of lower CPU priority, takes them a page at a time from the loop (`listing`),
//! which changes them between pages. Each entry's line in the snapshot is where it stood when
//! its page was taken, and every change since the snapshot began is in the journal it names, so
//! replaying that journal over it ends where the daemon was, whatever the pages caught.
//!
//! Deadlines are on the ban clock (`clock`): each file carries the [`Stamp`] of the boot they
//! are on.

use std::{
    collections::{BTreeMap, HashSet},
    fs::File,
    io::{BufRead as _, BufReader, Write as _},
    os::unix::fs::OpenOptionsExt as _,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{
    Key,
    clock::{self, Stamp},
    pages::Page,
    snapshot::{Net, WriteError, dir_of, make_dir, read_snapshot, write_snapshot},
};
use crate::{
    config::{List, Origin},
    daemon::listing,
};

/// One line of a journal.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Record {
    /// The boot the deadlines of the records after it are on: each journal's first line.
    Clock(Stamp),
    /// Entries of one list and origin set to a deadline, or removed (null).
    Set { list: List, origin: Origin, set: Vec<(Net, Option<u64>)> },
}

/// What the files hold.
#[derive(Default)]
pub(super) struct Loaded {
    /// The entries, their deadlines carried onto this boot's clock (some may be past).
    pub entries: BTreeMap<Key, u64>,
    /// Every network the files name, removed ones included: a kernel entry of another network
    /// is one the files never heard of.
    pub named: HashSet<IpNet>,
    /// The snapshot is of version 1 (wall-clock expiries): rewritten soon, in version 2.
    pub legacy: bool,
}

pub(super) struct Store {
    /// The snapshot.
    path: PathBuf,
    /// The journal being appended to (None: none open, or the last append failed: the next
    /// snapshot brings the files level again).
    journal: Option<File>,
    generation: u64,
    /// A snapshot is being written off the loop: the next waits for it.
    saving: Arc<AtomicBool>,
    /// The last write failed: said once, and again when writing works again.
    failing: Arc<AtomicBool>,
}

impl Store {
    pub fn new(path: PathBuf) -> Self {
        Self { path, journal: None, generation: 0, saving: Arc::default(), failing: Arc::default() }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn dir(&self) -> &Path {
        dir_of(&self.path)
    }

    fn name(&self) -> String {
        self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
    }

    /// `bans-IFACE.journal.` (the snapshot's name without `.json`).
    fn journal_prefix(&self) -> String {
        format!("{}.journal.", self.name().trim_end_matches(".json"))
    }

    fn journal_path(&self, generation: u64) -> PathBuf {
        self.dir().join(format!("{}{generation}", self.journal_prefix()))
    }

    /// The journals in the directory, by generation.
    fn journals(&self) -> Vec<u64> {
        let prefix = self.journal_prefix();
        let mut found: Vec<u64> = std::fs::read_dir(self.dir())
            .into_iter()
            .flatten()
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                crate::config::decimal(name.strip_prefix(&prefix)?)
            })
            .collect();
        found.sort_unstable();
        found
    }

    /// Reads the snapshot and replays the journals after it, onto `here`'s clock; removes the
    /// temporary files a crash left and the journals a snapshot already holds. An unreadable
    /// snapshot is set aside (`.bad`) and said; its journals are still replayed.
    pub fn load(&mut self, here: &Stamp) -> Loaded {
        self.remove_temporaries();
        let mut loaded = Loaded::default();
        let first = match read_snapshot(&self.path) {
            Ok(None) => 0,
            Ok(Some(snapshot)) => {
                loaded.legacy = snapshot.clock.is_none();
                for (list, origin, Net(net), at) in snapshot.bans {
                    let deadline = match &snapshot.clock {
                        Some(stamp) => stamp.carry(at, here),
                        None => clock::from_wall(at, here),
                    };
                    loaded.named.insert(net);
                    loaded.entries.insert((net, list, origin), deadline);
                }
                snapshot.journal
            }
            Err(error) => {
                let aside = self.path.with_extension("json.bad");
                let moved = std::fs::rename(&self.path, &aside).is_ok();
                warn!(file = %self.path.display(), %error, set_aside = moved.then(|| aside.display().to_string()), "the saved bans could not be read: starting without them (the journal after them, and the kernel's, are still taken)");
                0
            }
        };
        let journals = self.journals();
        for &generation in &journals {
            let path = self.journal_path(generation);
            if generation < first {
                let _ = std::fs::remove_file(&path);
            } else if let Err(error) = replay(&path, here, &mut loaded) {
                warn!(file = %path.display(), %error, "the bans journal ends in a line that cannot be read (a write cut short): the changes before it are kept");
            }
        }
        self.generation = journals.last().map_or(first, |g| g + 1).max(first);
        loaded
    }

    /// Removes the temporary files of this interface's snapshots (and of the daemons before
    /// journals, `.bansXXXXXX`) that a crash left half written.
    fn remove_temporaries(&self) {
        let ours = format!(".{}.", self.name());
        let legacy =
            |n: &str| n.len() == 11 && n.starts_with(".bans") && n[5..].bytes().all(|b| b.is_ascii_alphanumeric());
        for entry in std::fs::read_dir(self.dir()).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(&ours) || legacy(&name) {
                match std::fs::remove_file(entry.path()) {
                    Ok(()) => info!(file = %entry.path().display(), "removed a temporary file a crash left"),
                    Err(error) => {
                        warn!(file = %entry.path().display(), %error, "removing a temporary file a crash left failed")
                    }
                }
            }
        }
    }

    /// Opens a new journal (the next generation), its first line the clock. False (and said
    /// once) if it cannot be written: the current one, if any, stays.
    pub fn begin(&mut self) -> bool {
        let generation = self.generation.max(1);
        let path = self.journal_path(generation);
        let opened = make_dir(self.dir()).and_then(|()| {
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .mode(0o600)
                .open(&path)
                .map_err(|e| e.to_string())?;
            write_record(&mut file, &Record::Clock(Stamp::now()))?;
            Ok(file)
        });
        match opened {
            Ok(file) => {
                self.journal = Some(file);
                self.generation = generation + 1;
                true
            }
            Err(error) => {
                self.said_failed(&path, &error);
                false
            }
        }
    }

    /// Appends a change (before the kernel gets it). False when it could not be written (said
    /// once): the caller has a snapshot written soon.
    pub fn append(&mut self, list: List, origin: Origin, set: &[(IpNet, Option<u64>)]) -> bool {
        let Some(file) = self.journal.as_mut() else { return false };
        let record = Record::Set { list, origin, set: set.iter().map(|(n, d)| (Net(*n), *d)).collect() };
        match write_record(file, &record) {
            Ok(()) => true,
            Err(error) => {
                // A line cut short: nothing more goes after it.
                self.journal = None;
                let path = self.journal_path(self.generation.saturating_sub(1));
                self.said_failed(&path, &error);
                false
            }
        }
    }

    fn said_failed(&self, path: &Path, error: &str) {
        if !self.failing.swap(true, Ordering::AcqRel) {
            warn!(file = %path.display(), %error, "saving the bans failed; a restart would lose the latest changes (retried each second, said again when it works)");
        }
    }

    /// Whether a snapshot is being written, or the last write failed.
    pub fn busy(&self) -> bool {
        self.saving.load(Ordering::Acquire)
    }

    pub fn failing(&self) -> bool {
        self.failing.load(Ordering::Acquire)
    }

    /// Writes a snapshot off the loop, on a thread of lower CPU priority that takes the entries
    /// page by page from `pages` (after a key, the next page; None once the loop has ended): a
    /// new journal is begun first, which the snapshot names; once it is in place the journals
    /// before are deleted. False when no thread could be made (nothing written: try again).
    pub fn save(&mut self, pages: impl FnMut(Option<Key>) -> Option<Page> + Send + 'static) -> bool {
        let first = if self.begin() { self.generation - 1 } else { self.generation.saturating_sub(1) };
        self.saving.store(true, Ordering::Release);
        let (saving, failing) = (self.saving.clone(), self.failing.clone());
        let (path, journals) = (self.path.clone(), self.journal_files_before(first));
        let spawned = listing::in_background("bans-save", move || {
            finish_save(&path, write_snapshot(&path, pages, first), &journals, &failing);
            saving.store(false, Ordering::Release);
        });
        if !spawned {
            warn!("no thread for saving the bans; tried again in a second");
            self.saving.store(false, Ordering::Release);
        }
        spawned
    }

    /// Writes a snapshot now (at stop, the loop ended), after any in flight; it names no
    /// journal of this run. Not when nothing `changed` since the last snapshot began and that
    /// one worked: the snapshot and the journals it names hold the bans already (one cut short
    /// by the stop left the old snapshot and every journal after it), and a stop that changes
    /// nothing leaves the files as they were.
    pub fn save_now(&mut self, changed: bool, pages: impl FnMut(Option<Key>) -> Option<Page>) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.busy() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if !changed && !self.busy() && !self.failing() {
            return;
        }
        self.journal = None;
        let first = self.generation;
        let journals = self.journal_files_before(first);
        finish_save(&self.path, write_snapshot(&self.path, pages, first), &journals, &self.failing);
    }

    /// The journal files older than generation `first`.
    fn journal_files_before(&self, first: u64) -> Vec<PathBuf> {
        self.journals().into_iter().filter(|g| *g < first).map(|g| self.journal_path(g)).collect()
    }
}

fn finish_save(path: &Path, written: Result<(), WriteError>, journals: &[PathBuf], failing: &AtomicBool) {
    match written {
        // Its journals stay: the snapshot at stop takes them over.
        Err(WriteError::Stopped) => {}
        Ok(()) => {
            for journal in journals {
                let _ = std::fs::remove_file(journal);
            }
            if failing.swap(false, Ordering::AcqRel) {
                info!(file = %path.display(), "saving the bans works again");
            }
        }
        Err(WriteError::Failed(error)) => {
            if !failing.swap(true, Ordering::AcqRel) {
                warn!(file = %path.display(), %error, "saving the bans failed; a restart would lose the latest changes (retried each second, said again when it works)");
            }
        }
    }
}

fn write_record(file: &mut File, record: &Record) -> Result<(), String> {
    let mut line = serde_json::to_vec(record).map_err(|e| e.to_string())?;
    line.push(b'\n');
    file.write_all(&line).map_err(|e| e.to_string())
}

/// Applies a journal's records to `loaded`, in order; an error at the first line that does not
/// read (the records before it applied).
fn replay(path: &Path, here: &Stamp, loaded: &mut Loaded) -> Result<(), String> {
    let file = File::open(path).map_err(|e| e.to_string())?;
    let mut stamp = here.clone();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| e.to_string())?;
        let record: Record = serde_json::from_str(&line).map_err(|e| format!("line {}: {e}", i + 1))?;
        match record {
            Record::Clock(s) => stamp = s,
            Record::Set { list, origin, set } => {
                for (Net(net), deadline) in set {
                    loaded.named.insert(net);
                    match deadline {
                        Some(at) => loaded.entries.insert((net, list, origin), stamp.carry(at, here)),
                        None => loaded.entries.remove(&(net, list, origin)),
                    };
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::daemon::bans::Bans;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn here() -> Stamp {
        Stamp::now()
    }

    /// A snapshot then its journal read back as the daemon left them: entries set, renewed and
    /// removed after the snapshot included; the temporaries a crash left are removed.
    #[tokio::test]
    async fn the_files_read_back_where_the_daemon_was() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bans-eth0.json");
        let (a, b, c) = (net("198.18.0.5/32"), net("2001:db8::/48"), net("198.18.1.0/24"));
        let mut store = Store::new(path.clone());
        assert!(store.load(&here()).entries.is_empty(), "no files: no bans");
        assert!(store.begin());
        assert!(store.append(List::Deny, Origin::Fail2ban, &[(a, Some(10)), (b, Some(20))]));
        let mut bans = Bans::new(None);
        bans.put((a, List::Deny, Origin::Fail2ban), Some(10));
        bans.put((b, List::Deny, Origin::Fail2ban), Some(20));
        store.save_now(true, |after| Some(bans.saved_page(after)));
        assert!(store.journals().is_empty(), "the journal the snapshot holds is deleted");
        let mut store = Store::new(path.clone());
        std::fs::write(dir.path().join(".bans-eth0.json.AbC123"), "half").unwrap();
        std::fs::write(dir.path().join(".bans6JfBQx"), "half").unwrap();
        std::fs::write(dir.path().join(".bans-eth1.json.AbC123"), "another interface's").unwrap();
        let loaded = store.load(&here());
        assert_eq!(loaded.entries.len(), 2);
        assert!(!dir.path().join(".bans-eth0.json.AbC123").exists() && !dir.path().join(".bans6JfBQx").exists());
        assert!(dir.path().join(".bans-eth1.json.AbC123").exists(), "another interface's temporary is left");
        assert!(store.begin());
        assert!(store.append(List::Deny, Origin::Fail2ban, &[(a, None), (b, Some(30))]));
        assert!(store.append(List::Allow, Origin::Cli, &[(c, Some(40))]));
        // Killed here: no snapshot since.
        drop(store);
        let loaded = Store::new(path.clone()).load(&here());
        let got: Vec<_> = loaded.entries.into_iter().collect();
        assert_eq!(got, vec![((c, List::Allow, Origin::Cli), 40), ((b, List::Deny, Origin::Fail2ban), 30)]);
        assert!(loaded.named.contains(&a), "a removed network is still named");
    }

    /// A journal cut short in its last line keeps the lines before it; a snapshot of another
    /// version, or unreadable, is set aside and its journals still taken.
    #[tokio::test]
    async fn cut_lines_and_bad_snapshots() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bans-eth0.json");
        let a = net("198.18.0.5/32");
        let mut store = Store::new(path.clone());
        store.load(&here());
        assert!(store.begin());
        assert!(store.append(List::Deny, Origin::Cli, &[(a, Some(10))]));
        let journal = store.journal_path(1);
        drop(store);
        let mut f = std::fs::OpenOptions::new().append(true).open(&journal).unwrap();
        f.write_all(br#"{"set":{"list":"deny","orig"#).unwrap();
        std::fs::write(&path, r#"{"version":3,"bans":[]}"#).unwrap();
        let loaded = Store::new(path.clone()).load(&here());
        assert_eq!(loaded.entries.len(), 1);
        assert!(path.with_extension("json.bad").exists());
        std::fs::write(&path, r#"{"version":1,"bans":[["deny","cli","010.0.0.1/32",1]]}"#).unwrap();
        assert!(read_snapshot(&path).is_err(), "a lax network is refused as the socket refuses it");
    }

    /// A version 1 snapshot (wall-clock expiries) is read once, each expiry as its time left.
    #[test]
    fn version_1_expiries_become_time_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bans-eth0.json");
        let now = here();
        let expires = now.wall_ms + 60_000;
        std::fs::write(&path, format!(r#"{{"version":1,"bans":[["deny","fail2ban","198.18.0.5/32",{expires}]]}}"#))
            .unwrap();
        let loaded = Store::new(path).load(&now);
        assert!(loaded.legacy, "to be rewritten in version 2");
        let deadline = loaded.entries[&(net("198.18.0.5/32"), List::Deny, Origin::Fail2ban)];
        assert_eq!(deadline, now.mono_ns + 60_000_000_000);
    }

    /// A snapshot written page by page while the bans change between its pages (as the loop
    /// changes them between the writer's requests), each change journaled as the daemon does:
    /// the snapshot and the journal it names read back as the bans ended, whatever each page
    /// caught. A save whose pages stop coming (the daemon stopping) leaves the old snapshot and
    /// the journals, and no temporary file.
    #[test]
    fn a_snapshot_taken_page_by_page_and_its_journal_end_where_the_bans_did() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bans-eth0.json");
        let addr = |i: u32| IpNet::from(IpAddr::from(Ipv4Addr::from(0xc612_0000 + i)));
        let set = |bans: &mut Bans, store: &mut Store, i: u32, at: Option<u64>| {
            bans.put((addr(i), List::Deny, Origin::Cli), at);
            assert!(store.append(List::Deny, Origin::Cli, &[(addr(i), at)]));
        };
        let mut store = Store::new(path.clone());
        store.load(&here());
        assert!(store.begin());
        let mut bans = Bans::new(None);
        for i in 0..10 {
            set(&mut bans, &mut store, i, Some(100 + u64::from(i)));
        }
        // The save begins the journal its snapshot names, then takes pages of 3.
        assert!(store.begin());
        let first = store.generation - 1;
        let mut taken = 0;
        let pages = |after: Option<Key>| {
            match taken {
                // Behind the writer (renewed, removed) and ahead of it (removed, renewed, added).
                1 => {
                    set(&mut bans, &mut store, 1, Some(500));
                    set(&mut bans, &mut store, 5, None);
                    set(&mut bans, &mut store, 20, Some(600));
                }
                2 => {
                    set(&mut bans, &mut store, 0, None);
                    set(&mut bans, &mut store, 8, Some(700));
                }
                _ => {}
            }
            taken += 1;
            Some(bans.page(after, 3, |key, at| Some((key, at))))
        };
        write_snapshot(&path, pages, first).unwrap();
        assert!(taken >= 3, "the changes came between pages");
        let journals: Vec<PathBuf> = store.journal_files_before(first);
        finish_save(&path, Ok(()), &journals, &store.failing);
        set(&mut bans, &mut store, 9, Some(800));
        // Killed here.
        drop(store);
        let loaded = Store::new(path.clone()).load(&here());
        let want: Vec<(Key, u64)> = bans.saved_page(None).0;
        assert_eq!(loaded.entries.into_iter().collect::<Vec<_>>(), want);
        assert_eq!(Store::new(path.clone()).journals(), [first], "the journal before the snapshot deleted");

        let before = std::fs::read(&path).unwrap();
        let mut taken = 0;
        let stopping = |after: Option<Key>| {
            taken += 1;
            (taken < 2).then(|| bans.page(after, 3, |key, at| Some((key, at))))
        };
        assert!(matches!(write_snapshot(&path, stopping, first + 1), Err(WriteError::Stopped)));
        assert_eq!(std::fs::read(&path).unwrap(), before, "the old snapshot stays");
        let names: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert!(!names.iter().any(|n| n.starts_with('.')), "no temporary file left: {names:?}");
    }
}

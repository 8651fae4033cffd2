//! Following the config file (`--watch-config`, on by default), with inotify through the
//! `notify` crate.
//!
//! The path is followed as the operator named it, not the inode it led to at start: every
//! directory it is looked up through is watched (each ancestor, and past a symlink, those its
//! target leads through: the [`Route`]). So the file's directory removed and made again, a
//! symlink on the way swapped (`current -> v1` to `v2`, a Kubernetes ConfigMap's `..data`), an
//! editor's save-by-rename are all seen, and once they settle the watch is re-armed on where the
//! path leads now.
//!
//! The file itself counts once written whole: closed after a write (IN_CLOSE_WRITE), renamed
//! into place (IN_MOVED_TO), removed, or made whole at once (a symlink, a hard link); never on a
//! write alone (IN_MODIFY), so a file written in steps, however far apart, is not applied
//! half-written. Such events settle for [`QUIET`] (at most [`MAX_DELAY`] after the first) before
//! the loop reads the file. What to do with the bytes (nothing when they are the ones last seen)
//! is the loop's: see `Daemon::file_changed`.

use std::{
    collections::{BTreeSet, VecDeque},
    ffi::OsString,
    os::unix::fs::MetadataExt as _,
    path::{Component, Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use notify::{
    Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher as _,
    event::{AccessKind, AccessMode, ModifyKind},
};
use tokio::{
    sync::mpsc,
    time::{Duration, Instant},
};
use tracing::{info, warn};

/// A change is read once the watch has been quiet this long...
const QUIET: Duration = Duration::from_millis(200);
/// ...or this long after its first event, however busy it stays.
const MAX_DELAY: Duration = Duration::from_secs(1);

/// Symlinks followed before giving up (as the kernel's MAXSYMLINKS).
const MAX_LINKS: usize = 40;

pub(super) struct ConfigWatch {
    /// The config's path as named, made absolute.
    config: PathBuf,
    /// Dropping it stops the watch (its thread and inotify descriptor).
    _watcher: RecommendedWatcher,
    /// Where the path led when the watcher was made.
    route: Route,
    /// What the watcher saw beyond waking the loop.
    flags: Arc<Flags>,
    /// Handed to each new watcher's event handler.
    wake: mpsc::Sender<()>,
    events: mpsc::Receiver<()>,
    /// The first event of the burst not yet settled, and when it settles.
    pending: Option<(Instant, Instant)>,
}

impl ConfigWatch {
    /// Watches the route to `config`. The error says which directory could not be watched.
    pub(super) fn start(config: &Path) -> Result<Self, String> {
        let config = std::path::absolute(config).map_err(|e| format!("{}: {e}", config.display()))?;
        // Events only wake the loop; one waiting is as good as many.
        let (wake, events) = mpsc::channel(1);
        let route = Route::of(&config);
        let flags = Arc::new(Flags::default());
        let watcher = arm(&route, wake.clone(), flags.clone())?;
        Ok(Self { config, _watcher: watcher, route, flags, wake, events, pending: None })
    }

    /// True while the file has been written to and not closed since: it may be half-written.
    pub(super) fn writing(&self) -> Arc<Flags> {
        self.flags.clone()
    }

    /// Returns once a change has settled, the watch re-armed on where the path leads now.
    /// Cancel-safe: the burst's timing is kept in `self`.
    pub(super) async fn settled(&mut self) {
        loop {
            match self.pending {
                None => match self.events.recv().await {
                    Some(()) => self.note(),
                    // Never: `self.wake` keeps the channel open.
                    None => std::future::pending().await,
                },
                Some((_, due)) => tokio::select! {
                    _ = tokio::time::sleep_until(due) => {
                        self.pending = None;
                        self.rearm();
                        // Half-written (an event before the writer opened it settled now): its
                        // close comes next, and is read then.
                        if !self.flags.writing() {
                            return;
                        }
                    }
                    got = self.events.recv() => match got {
                        Some(()) => self.note(),
                        None => std::future::pending().await,
                    },
                },
            }
        }
    }

    fn note(&mut self) {
        let now = Instant::now();
        let first = self.pending.map_or(now, |(first, _)| first);
        self.pending = Some((first, (now + QUIET).min(first + MAX_DELAY)));
    }

    /// A new watcher when something on the way changed or the path leads elsewhere. What
    /// changed before it was armed is not missed: the loop reads the file next.
    fn rearm(&mut self) {
        let route = Route::of(&self.config);
        if !self.flags.moved.swap(false, Ordering::AcqRel) && route == self.route {
            return;
        }
        match arm(&route, self.wake.clone(), self.flags.clone()) {
            Ok(watcher) => {
                let dirs: Vec<String> = route.dirs.iter().map(|(d, _)| d.display().to_string()).collect();
                match &route.file {
                    Some(file) => info!(
                        config = %self.config.display(), file = %file.display(), watching = %dirs.join(" "),
                        "the config's path leads elsewhere now: watching it there"
                    ),
                    None => warn!(
                        config = %self.config.display(), watching = %dirs.join(" "),
                        "the config's path is broken (a directory on the way is gone): watching for it to come back"
                    ),
                }
                if route.file != self.route.file {
                    // Another file: what was written to the old one says nothing of it.
                    self.flags.writing.store(false, Ordering::Release);
                }
                self._watcher = watcher;
                self.route = route;
            }
            // The old watcher stays; the next event tries again.
            Err(e) => {
                self.flags.moved.store(true, Ordering::Release);
                warn!(error = %e, "the config's path leads elsewhere now, but it could not be watched there")
            }
        }
    }
}

/// A watcher on each directory of `route`, waking `wake` on what [`relevant`] says. A directory
/// gone since the route was traced is skipped: its parent, watched, sees it come back.
fn arm(route: &Route, wake: mpsc::Sender<()>, flags: Arc<Flags>) -> Result<RecommendedWatcher, String> {
    let interest = route.clone();
    let handler = move |event: notify::Result<Event>| match event {
        Ok(event) => match relevant(&event, &interest) {
            Relevant::No => {}
            Relevant::Writing => flags.writing.store(true, Ordering::Release),
            Relevant::File => {
                flags.writing.store(false, Ordering::Release);
                let _ = wake.try_send(());
            }
            Relevant::Way => {
                flags.moved.store(true, Ordering::Release);
                let _ = wake.try_send(());
            }
        },
        Err(e) => {
            warn!(error = %e, "watching the config file");
            // Whatever was lost, the watch is made again and the file read again.
            flags.moved.store(true, Ordering::Release);
            let _ = wake.try_send(());
        }
    };
    let fail = |dir: &Path, e: notify::Error| format!("watching {}: {e}", dir.display());
    let mut watcher = notify::recommended_watcher(handler).map_err(|e| fail(Path::new("/"), e))?;
    for (dir, _) in &route.dirs {
        match watcher.watch(dir, RecursiveMode::NonRecursive) {
            Ok(()) => {}
            Err(e) if matches!(e.kind, notify::ErrorKind::PathNotFound) => {}
            Err(e) => return Err(fail(dir, e)),
        }
    }
    Ok(watcher)
}

/// Where the config's path leads: what to watch, and which events there matter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Route {
    /// The directories the path is looked up in, resolved, each with its (device, inode): one
    /// made again at the same path is another directory, to watch anew.
    dirs: Vec<(PathBuf, (u64, u64))>,
    /// What is crossed on the way (directories, symlinks, and the first one missing): one made,
    /// removed or renamed changes where the path leads.
    way: BTreeSet<PathBuf>,
    /// The file it leads to (or would, once made); None when the way is broken before it.
    file: Option<PathBuf>,
}

enum Step {
    Root,
    Up,
    Name(OsString),
}

fn steps(path: &Path) -> impl Iterator<Item = Step> + '_ {
    path.components().filter_map(|c| match c {
        Component::RootDir => Some(Step::Root),
        Component::ParentDir => Some(Step::Up),
        Component::Normal(name) => Some(Step::Name(name.to_os_string())),
        Component::CurDir | Component::Prefix(_) => None,
    })
}

impl Route {
    /// Looks `config` (absolute) up one name at a time, as the kernel does, following symlinks.
    fn of(config: &Path) -> Self {
        let mut route = Self::default();
        let mut todo: VecDeque<Step> = steps(config).collect();
        let mut dir = PathBuf::from("/");
        let mut links = 0;
        while let Some(step) = todo.pop_front() {
            let name = match step {
                Step::Root => {
                    dir = PathBuf::from("/");
                    continue;
                }
                Step::Up => {
                    dir.pop();
                    continue;
                }
                Step::Name(name) => name,
            };
            if !route.dirs.iter().any(|(d, _)| *d == dir) {
                match std::fs::metadata(&dir) {
                    Ok(meta) => route.dirs.push((dir.clone(), (meta.dev(), meta.ino()))),
                    Err(_) => break,
                }
            }
            let path = dir.join(&name);
            let last = todo.iter().all(|s| !matches!(s, Step::Name(_)));
            let meta = std::fs::symlink_metadata(&path);
            match &meta {
                Ok(meta) if meta.file_type().is_symlink() && links < MAX_LINKS => {
                    links += 1;
                    route.way.insert(path.clone());
                    let Ok(target) = std::fs::read_link(&path) else { break };
                    for step in steps(&target).collect::<Vec<_>>().into_iter().rev() {
                        todo.push_front(step);
                    }
                }
                Ok(meta) if meta.is_dir() && !last => {
                    route.way.insert(path.clone());
                    dir = path;
                }
                _ if last => {
                    route.file = Some(path);
                    break;
                }
                // Missing, or not a directory where one is needed: the way is broken here.
                _ => {
                    route.way.insert(path);
                    break;
                }
            }
        }
        route
    }
}

/// Whether `event` may change what the config's path holds: something on the way made,
/// removed or renamed; the file closed after a write, renamed, removed, or made whole at once.
/// Opening, reading, writing without closing yet, and attribute changes are not.
fn relevant(event: &Event, route: &Route) -> Relevant {
    if event.need_rescan() {
        return Relevant::Way;
    }
    let on_way =
        matches!(event.kind, EventKind::Create(_) | EventKind::Remove(_) | EventKind::Modify(ModifyKind::Name(_)));
    if on_way && event.paths.iter().any(|p| route.way.contains(p)) {
        return Relevant::Way;
    }
    let whole = |path: &PathBuf| match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write))
        | EventKind::Modify(ModifyKind::Name(_))
        | EventKind::Remove(_) => true,
        // A regular file created is being written: it counts once closed. Anything else made
        // there (a symlink, a FIFO, a directory, a hard link to a whole file) is whole at once.
        EventKind::Create(_) => std::fs::symlink_metadata(path).is_ok_and(|m| !m.is_file() || m.nlink() > 1),
        _ => false,
    };
    let Some(file) = &route.file else { return Relevant::No };
    if event.paths.iter().any(|p| p == file && whole(p)) {
        Relevant::File
    } else if matches!(event.kind, EventKind::Modify(ModifyKind::Data(_))) && event.paths.contains(file) {
        Relevant::Writing
    } else {
        Relevant::No
    }
}

/// Shared by the watch and its watcher's handler.
#[derive(Debug, Default)]
pub(super) struct Flags {
    /// Something on the way was made, removed or renamed: a directory removed and made again may
    /// come back with the same inode number, yet its watch is gone: the watch is made again.
    moved: AtomicBool,
    /// The file was written to and not closed since.
    writing: AtomicBool,
}

impl Flags {
    /// The file has been written to and not closed since: it may be half-written.
    pub(super) fn writing(&self) -> bool {
        self.writing.load(Ordering::Acquire)
    }
}

/// What an event means for the watch.
#[derive(Debug, PartialEq, Eq)]
enum Relevant {
    No,
    /// The file may hold something new.
    File,
    /// The file is being written: not whole until closed.
    Writing,
    /// Where the path leads may have changed: the watch is made again.
    Way,
}

/// Waits for the watch to settle; never, without one.
pub(super) async fn settled(watch: &mut Option<ConfigWatch>) {
    match watch {
        Some(w) => w.settled().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use notify::event::{CreateKind, DataChange, MetadataKind, RemoveKind, RenameMode};

    use super::*;

    fn names(route: &Route) -> Vec<PathBuf> {
        route.dirs.iter().map(|(d, _)| d.clone()).collect()
    }

    /// `path`'s ancestors, from the root.
    fn ancestors(path: &Path) -> Vec<PathBuf> {
        let mut all: Vec<PathBuf> = path.ancestors().map(Path::to_path_buf).collect();
        all.reverse();
        all
    }

    #[test]
    fn a_plain_path_is_watched_from_the_root_down() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        std::fs::create_dir(base.join("etc")).unwrap();
        let config = base.join("etc/limiter.toml");
        let route = Route::of(&config);
        assert_eq!(names(&route), ancestors(&base.join("etc")));
        assert_eq!(route.file.as_deref(), Some(config.as_path()), "a file not made yet is still the file");
        assert!(route.way.contains(&base.join("etc")) && route.way.contains(&base));

        // The directory removed: the way is broken there, its parent watched to see it back.
        std::fs::remove_dir(base.join("etc")).unwrap();
        let broken = Route::of(&config);
        assert_eq!(names(&broken), ancestors(&base));
        assert_eq!(broken.file, None);
        assert!(broken.way.contains(&base.join("etc")));
        // Made again: the same route (maybe the same inode number too: see `ConfigWatch::moved`).
        std::fs::create_dir(base.join("etc")).unwrap();
        assert_eq!(names(&Route::of(&config)), names(&route));
    }

    #[test]
    fn symlinks_are_followed_where_they_lead_now() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        for d in ["etc", "site/v1", "site/v2"] {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        symlink("v1", base.join("site/current")).unwrap();
        symlink("../site/current/limiter.toml", base.join("etc/limiter.toml")).unwrap();
        let config = base.join("etc/limiter.toml");
        let route = Route::of(&config);
        assert_eq!(route.file, Some(base.join("site/v1/limiter.toml")));
        for crossed in ["etc/limiter.toml", "site", "site/current", "site/v1"] {
            assert!(route.way.contains(&base.join(crossed)), "{crossed}: {route:?}");
        }
        for watched in ["etc", "site", "site/v1"] {
            assert!(names(&route).contains(&base.join(watched)), "{watched}: {route:?}");
        }
        // `current` swapped to v2: the route leads there, and no longer through v1.
        symlink("v2", base.join("site/next")).unwrap();
        std::fs::rename(base.join("site/next"), base.join("site/current")).unwrap();
        let swapped = Route::of(&config);
        assert_eq!(swapped.file, Some(base.join("site/v2/limiter.toml")));
        assert!(!names(&swapped).contains(&base.join("site/v1")), "{swapped:?}");
    }

    #[test]
    fn a_configmap_volume_is_followed_through_data() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        std::fs::create_dir(base.join("..2026_12_04")).unwrap();
        std::fs::write(base.join("..2026_12_04/limiter.toml"), "").unwrap();
        symlink("..2026_12_04", base.join("..data")).unwrap();
        symlink("..data/limiter.toml", base.join("limiter.toml")).unwrap();
        let route = Route::of(&base.join("limiter.toml"));
        assert_eq!(route.file, Some(base.join("..2026_12_04/limiter.toml")));
        assert!(route.way.contains(&base.join("..data")) && route.way.contains(&base.join("limiter.toml")));
        assert_eq!(names(&route).last(), Some(&base.join("..2026_12_04")));
        // A loop ends.
        symlink("loop", base.join("loop")).unwrap();
        assert_eq!(Route::of(&base.join("loop/limiter.toml")).file, None);
    }

    #[test]
    fn only_a_whole_write_of_the_file_or_a_change_on_the_way_counts() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().canonicalize().unwrap();
        let config = base.join("limiter.toml");
        std::fs::write(&config, "").unwrap();
        let route = Route::of(&config);
        let way = |kind: EventKind, path: &Path| relevant(&Event::new(kind).add_path(path.to_path_buf()), &route);
        let on = |kind: EventKind, path: &Path| matches!(way(kind, path), Relevant::File | Relevant::Way);
        let file = config.as_path();
        assert_eq!(way(EventKind::Modify(ModifyKind::Data(DataChange::Any)), file), Relevant::Writing, "a write alone");
        assert!(!on(EventKind::Modify(ModifyKind::Metadata(MetadataKind::Any)), file));
        assert!(!on(EventKind::Access(AccessKind::Open(AccessMode::Any)), file));
        assert!(!on(EventKind::Access(AccessKind::Close(AccessMode::Read)), file));
        assert!(!on(EventKind::Create(CreateKind::File), file), "a regular file made: written next");
        assert!(on(EventKind::Access(AccessKind::Close(AccessMode::Write)), file));
        assert!(on(EventKind::Modify(ModifyKind::Name(RenameMode::To)), file));
        assert!(on(EventKind::Remove(RemoveKind::File), file));
        // Beside it (the daemon's own temporary file, an editor's swap file): nothing.
        let beside = base.join(".limiter.toml.swp");
        assert!(!on(EventKind::Access(AccessKind::Close(AccessMode::Write)), &beside));
        assert!(!on(EventKind::Modify(ModifyKind::Name(RenameMode::To)), &beside));
        // The directory on the way: made, removed, renamed.
        assert_eq!(way(EventKind::Remove(RemoveKind::Folder), &base), Relevant::Way);
        assert_eq!(way(EventKind::Create(CreateKind::Folder), &base), Relevant::Way);
        assert_eq!(way(EventKind::Access(AccessKind::Close(AccessMode::Write)), file), Relevant::File);
        assert!(on(EventKind::Modify(ModifyKind::Name(RenameMode::From)), &base));
        assert!(!on(EventKind::Modify(ModifyKind::Metadata(MetadataKind::Any)), &base));
        // A symlink made in its place is whole at once.
        std::fs::remove_file(&config).unwrap();
        symlink("elsewhere.toml", &config).unwrap();
        assert!(on(EventKind::Create(CreateKind::File), file));
        assert_eq!(
            relevant(&Event::new(EventKind::Other).set_flag(notify::event::Flag::Rescan), &route),
            Relevant::Way
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_settles_once_quiet_or_at_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let mut watch = ConfigWatch::start(&dir.path().join("limiter.toml")).unwrap();
        let tx = watch.wake.clone();
        let start = Instant::now();
        // An event every 100 ms for 3 s: never quiet, so the cap decides.
        let sender = tokio::spawn(async move {
            for _ in 0..30 {
                let _ = tx.try_send(());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        watch.settled().await;
        assert_eq!(start.elapsed(), MAX_DELAY);
        sender.abort();
        let _ = sender.await;
        // Quiet after one event: settles QUIET later.
        while watch.events.try_recv().is_ok() {}
        let at = Instant::now();
        watch.wake.try_send(()).unwrap();
        watch.settled().await;
        assert_eq!(at.elapsed(), QUIET);
    }
}

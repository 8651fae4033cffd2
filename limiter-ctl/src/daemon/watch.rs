//! Following the config file (`--watch-config`, on by default): its directory is watched
//! (inotify, through the `notify` crate), not its inode, so a write in place, an editor's
//! rename and kubelet's ConfigMap swap (`limiter.toml -> ..data/limiter.toml`, `..data`
//! renamed over by a new timestamped directory) are all seen. A burst of events settles for
//! [`QUIET`] (at most [`MAX_DELAY`] after the first) before the loop reads the file, so an
//! editor's partial writes are not applied one by one. What to do with the bytes (nothing when
//! they are the ones last seen) is the loop's: see `Daemon::file_changed`.

use std::path::{Path, PathBuf};

use notify::{
    Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher as _,
    event::{AccessKind, AccessMode},
};
use tokio::{
    sync::mpsc,
    time::{Duration, Instant},
};
use tracing::warn;

/// A change is read once the directory has been quiet this long...
const QUIET: Duration = Duration::from_millis(200);
/// ...or this long after its first event, however busy the directory stays.
const MAX_DELAY: Duration = Duration::from_secs(1);

pub(super) struct ConfigWatch {
    /// Dropping it stops the watch (its thread and inotify descriptor).
    _watcher: RecommendedWatcher,
    events: mpsc::Receiver<()>,
    /// The first event of the burst not yet settled, and when it settles.
    pending: Option<(Instant, Instant)>,
}

impl ConfigWatch {
    /// Watches the directory of `config`, and that of the file it resolves to when that lies
    /// outside it (a symlink to elsewhere). The error says which directory could not be watched.
    pub(super) fn start(config: &Path) -> Result<Self, String> {
        // Events only wake the loop; one waiting is as good as many.
        let (tx, events) = mpsc::channel(1);
        let handler = move |event: notify::Result<Event>| match event {
            Ok(event) if relevant(&event) => {
                let _ = tx.try_send(());
            }
            Ok(_) => {}
            Err(e) => warn!(error = %e, "watching the config file's directory"),
        };
        let fail = |dir: &Path, e: notify::Error| format!("watching {}: {e}", dir.display());
        let mut watcher = notify::recommended_watcher(handler).map_err(|e| fail(Path::new("."), e))?;
        for dir in dirs(config) {
            watcher.watch(&dir, RecursiveMode::NonRecursive).map_err(|e| fail(&dir, e))?;
        }
        Ok(Self { _watcher: watcher, events, pending: None })
    }

    /// Returns once a change has settled. Cancel-safe: the burst's timing is kept in `self`.
    pub(super) async fn settled(&mut self) {
        loop {
            match self.pending {
                None => match self.events.recv().await {
                    Some(()) => self.arm(),
                    // The watcher's thread is gone: nothing will come.
                    None => std::future::pending().await,
                },
                Some((_, due)) => tokio::select! {
                    _ = tokio::time::sleep_until(due) => {
                        self.pending = None;
                        return;
                    }
                    got = self.events.recv() => match got {
                        Some(()) => self.arm(),
                        None => std::future::pending().await,
                    },
                },
            }
        }
    }

    fn arm(&mut self) {
        let now = Instant::now();
        let first = self.pending.map_or(now, |(first, _)| first);
        self.pending = Some((first, (now + QUIET).min(first + MAX_DELAY)));
    }
}

/// Opening or reading a file (the daemon's own reads among them) changes nothing.
fn relevant(event: &Event) -> bool {
    match event.kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

/// The directories to watch: the config's own, and its resolved file's when elsewhere.
fn dirs(config: &Path) -> Vec<PathBuf> {
    let parent = |p: &Path| match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let own = parent(config);
    let mut dirs = vec![own.clone()];
    let own = own.canonicalize().unwrap_or(own);
    if let Ok(resolved) = config.canonicalize() {
        let theirs = parent(&resolved);
        if !theirs.starts_with(&own) {
            dirs.push(theirs);
        }
    }
    dirs
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
    use super::*;

    #[test]
    fn a_configmap_target_inside_the_directory_adds_no_watch() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("..2026_12_04");
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("limiter.toml"), "").unwrap();
        std::os::unix::fs::symlink("..2026_12_04", dir.path().join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/limiter.toml", dir.path().join("limiter.toml")).unwrap();
        assert_eq!(dirs(&dir.path().join("limiter.toml")), vec![dir.path().to_path_buf()]);
        let elsewhere = tempfile::tempdir().unwrap();
        std::fs::write(elsewhere.path().join("site.toml"), "").unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("site.toml"), dir.path().join("other.toml")).unwrap();
        let found = dirs(&dir.path().join("other.toml"));
        assert_eq!(found.len(), 2, "{found:?}");
        assert_eq!(found[1], elsewhere.path().canonicalize().unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_settles_once_quiet_or_at_the_cap() {
        let (tx, events) = mpsc::channel(1);
        let watcher = notify::recommended_watcher(|_: notify::Result<Event>| {}).unwrap();
        let mut watch = ConfigWatch { _watcher: watcher, events, pending: None };
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
        let (tx, events) = mpsc::channel(1);
        watch.events = events;
        let at = Instant::now();
        tx.try_send(()).unwrap();
        watch.settled().await;
        assert_eq!(at.elapsed(), QUIET);
    }
}

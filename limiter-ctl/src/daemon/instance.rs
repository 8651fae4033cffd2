//! One daemon per interface, whatever its `--pin-dir`: the lock on the interface's state,
//! `<state-dir>/<iface>.lock` (flock), taken before the state file is read and held for the
//! daemon's life, so a second daemon never reads or replaces the first's bans. The file says who
//! holds it (pid, pin directory) for the refusal to name. Daemons under another state directory
//! too are caught by the check of the interface's hooks (`kernel::other_limiter`), and those
//! under the same pin directory by that directory's own lock (`kernel::pins`).

use std::{
    fs::{DirBuilder, File, OpenOptions},
    io::{Read as _, Write as _},
    os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
};

use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
};

use super::Error;
use crate::kernel::pins::{Owner, lock_owner, same_inode};

/// The lock on an interface's state. Dropped (the daemon stopping, or failing to start), it
/// removes its file, then lets go; a SIGKILL leaves the file, which the next daemon locks again.
/// A start that fails also takes away the directories it made for it.
pub(super) struct StateLock {
    path: PathBuf,
    lock: Flock<File>,
    /// The directories made for the lock, until the daemon runs ([`StateLock::keep_dirs`]).
    created: Vec<PathBuf>,
}

/// Who holds a state lock, as its file says.
#[derive(Debug)]
pub struct Holder {
    pub owner: Owner,
    /// The pin directory the holder named (`<pin-dir>/<iface>`).
    pub pins: Option<PathBuf>,
}

impl StateLock {
    /// Takes the lock of `iface` in `state_dir` (made, 0700, if missing), writing in it this
    /// daemon's pid and its pin directory `pins`; held by a live daemon: an error naming it.
    pub(super) fn take(state_dir: &Path, iface: &str, pins: &Path) -> Result<Self, Error> {
        let path = state_dir.join(format!("{iface}.lock"));
        let failed = |error| Error::StateLock { path: path.clone(), error };
        let created = state_dir.ancestors().take_while(|d| !d.exists()).map(Path::to_path_buf).collect();
        DirBuilder::new().recursive(true).mode(0o700).create(state_dir).map_err(failed)?;
        // The holder removes the file as it stops: whoever locked the removed one locks anew.
        for _ in 0..3 {
            // Not truncated: until it holds the lock, the holder's words in it are not its own.
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(&path)
                .map_err(failed)?;
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) if same_inode(&lock, &path) => {
                    let mut lock = StateLock { path: path.clone(), lock, created };
                    lock.write_holder(pins).map_err(failed)?;
                    return Ok(lock);
                }
                Ok(_) => {}
                Err((file, Errno::EWOULDBLOCK)) => {
                    let holder = Holder { owner: lock_owner(&path), pins: recorded_pins(file) };
                    return Err(Error::InstanceRunning { iface: iface.into(), lock: path, holder, ours: pins.into() });
                }
                Err((_, errno)) => return Err(failed(errno.into())),
            }
        }
        Err(failed(Errno::EAGAIN.into()))
    }

    /// The daemon runs: the state directory stays, whatever happens to the lock.
    pub(super) fn keep_dirs(&mut self) {
        self.created.clear();
    }

    fn write_holder(&mut self, pins: &Path) -> std::io::Result<()> {
        let file: &mut File = &mut self.lock;
        file.set_len(0)?;
        write!(file, "pid {}\npins {}\n", std::process::id(), pins.display())
    }
}

impl Drop for StateLock {
    fn drop(&mut self) {
        // Still held here: nobody locks the file between its removal and the release.
        let _ = std::fs::remove_file(&self.path);
        for dir in &self.created {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// The pin directory a holder wrote in its lock file.
fn recorded_pins(mut file: File) -> Option<PathBuf> {
    let mut text = String::new();
    file.read_to_string(&mut text).ok()?;
    text.lines().find_map(|l| l.strip_prefix("pins ")).map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_taker_is_refused_naming_the_first_and_the_file_goes_with_the_lock() {
        let dir = tempfile::tempdir().expect("temp dir");
        let state = dir.path().join("state");
        let first = StateLock::take(&state, "eth0", Path::new("/sys/fs/bpf/a/eth0")).expect("first");
        let lock = state.join("eth0.lock");
        let text = std::fs::read_to_string(&lock).expect("lock file");
        assert_eq!(text, format!("pid {}\npins /sys/fs/bpf/a/eth0\n", std::process::id()));
        match StateLock::take(&state, "eth0", Path::new("/sys/fs/bpf/b/eth0")) {
            Err(Error::InstanceRunning { iface, holder, .. }) => {
                assert_eq!(iface, "eth0");
                assert_eq!(holder.owner, Owner(Some(std::process::id())));
                assert_eq!(holder.pins.as_deref(), Some(Path::new("/sys/fs/bpf/a/eth0")));
            }
            Err(other) => panic!("refused for another reason: {other}"),
            Ok(_) => panic!("a second lock was granted"),
        }
        assert_eq!(std::fs::read_to_string(&lock).expect("lock file"), text, "the refused taker wrote to it");
        let other = StateLock::take(&state, "eth1", Path::new("/p/eth1")).expect("another interface is free");
        drop(first);
        assert!(!lock.exists(), "the lock file stayed");
        assert!(state.exists(), "the directory went while another lock holds a file there");
        drop(StateLock::take(&state, "eth0", Path::new("/p/eth0")).expect("free again once dropped"));
        drop(other);
        // The directories a lock made go with it, unless its daemon ran.
        let fresh = dir.path().join("made/state");
        drop(StateLock::take(&fresh, "eth0", Path::new("/p/eth0")).expect("a lock where nothing was"));
        assert!(!dir.path().join("made").exists(), "the directories made for a start that failed stayed");
        let mut kept = StateLock::take(&fresh, "eth0", Path::new("/p/eth0")).expect("again");
        kept.keep_dirs();
        drop(kept);
        assert!(fresh.exists(), "the state directory of a daemon that ran went with its lock");
    }
}

//! `limiter-ctl detach`: a limiter's attachment and pins taken off an interface (or every
//! interface pinned under a root), with no daemon: what is left at the hook is said after.

use std::{
    fs::File,
    io,
    path::Path,
    time::{Duration, Instant},
};

use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
};

use super::{
    Error, Hook,
    handover::RELEASE,
    pinned::{Pinned, PinnedAt, config_map_id},
    pins::{PinDir, XdpProgram, lock_owner, xdp_program},
    tc_filter::{self, HANDLE, TcFilter},
};

/// How long `detach --force` waits for the owning daemon to exit after SIGTERM.
const OWNER_EXIT: Duration = Duration::from_secs(15);

/// `limiter-ctl detach`: unpins a limiter's link and maps, so the program leaves the interface.
/// Refuses while a live daemon owns the interface (holds the pin directory's lock), naming it;
/// with `force`, sends that daemon SIGTERM (it leaves the program attached and pinned, and
/// exits), waits for its lock, then detaches.
pub(crate) fn detach(root: &Path, iface: &str, force: bool) -> Result<String, Error> {
    let pins = PinDir::new(root, iface);
    if !pins.dir().exists() {
        return Ok(format!("nothing pinned for {iface} under {}\n", root.display()));
    }
    let mut report = String::new();
    let open = || {
        File::open(pins.dir()).map_err(|error| Error::PinFile {
            doing: "opening",
            path: pins.dir().to_path_buf(),
            error,
        })
    };
    let _lock = match Flock::lock(open()?, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => lock,
        Err((_, Errno::EWOULDBLOCK)) => {
            let owner = lock_owner(pins.dir());
            let Some(pid) = owner.0.filter(|_| force) else {
                return Err(Error::DetachOwned { iface: iface.into(), dir: pins.dir().to_path_buf(), owner });
            };
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGTERM)
                .map_err(|error| Error::StopOwner { pid, error })?;
            report.push_str(&format!("stopped the daemon that owned {iface} (pid {pid})\n"));
            wait_for_lock(pins.dir(), pid)?
        }
        Err((_, error)) => return Err(Error::Lock { dir: pins.dir().to_path_buf(), error }),
    };
    // Which hook the limiter is at, asked before it goes (unreadable: taken as XDP, as before tc).
    let at = Pinned::read(&pins.link()).ok();
    // Its filters at tc ingress go first: unpinning their program would not remove them.
    let filters = match config_map_id(&pins) {
        Some(config) => remove_filters(iface, config)?,
        None => Vec::new(),
    };
    let removed = pins.remove()?;
    report.push_str(&format!("removed {} pins from {}\n", removed.len(), pins.dir().display()));
    match at {
        Some(PinnedAt { filter: true, .. }) => report.push_str(&filter_after_release(iface, &filters)),
        Some(PinnedAt { hook: Hook::Tc, program, .. }) => report.push_str(&tcx_after_release(iface, program)),
        Some(PinnedAt { hook: Hook::Xdp, .. }) | None => report.push_str(&xdp_after_release(iface)),
    }
    Ok(report)
}

/// What is at XDP once the limiter's XDP link is released, in a line.
fn xdp_after_release(iface: &str) -> String {
    match still_attached_after_release(iface) {
        Ok(Some(program)) => {
            format!(
                "an XDP program is still attached to {iface}: another tool holds it ({program}); `bpftool net` shows it\n"
            )
        }
        Ok(None) => format!("no XDP program is attached to {iface}\n"),
        // The pins are gone all the same: only the check is missing, and the report says so.
        Err(e) => format!(
            "could not check whether an XDP program is still attached to {iface} (asking the kernel over netlink \
             failed: {e}); `ip link show dev {iface}` shows it\n"
        ),
    }
}

/// What is at tc ingress once the limiter's tcx link (running `program`) is released, in a line:
/// the other programs there stay, in their order.
fn tcx_after_release(iface: &str, program: u32) -> String {
    // Released from a workqueue, a moment after the unpin (see `still_attached_after_release`).
    if !super::handover::wait_left(iface, Hook::Tc, program) {
        return format!(
            "the limiter's program (id {program}) is still at tc ingress of {iface}: a process holds its link \
             (`bpftool link` shows it)\n"
        );
    }
    match super::tcx::programs(iface) {
        Ok(chain) if chain.is_empty() => format!("the limiter left tc ingress of {iface}; no program is there\n"),
        Ok(chain) => format!(
            "the limiter left tc ingress of {iface}; the other programs there stay: {}\n",
            super::tcx::listed(&chain)
        ),
        Err(e) => format!(
            "could not check that the limiter left tc ingress of {iface} ({e}); `bpftool net show dev {iface}` shows \
             it\n"
        ),
    }
}

/// Deletes the limiter's filters at tc ingress of `iface` (those whose program uses the config
/// map `config`); returns them.
fn remove_filters(iface: &str, config: u32) -> Result<Vec<TcFilter>, Error> {
    let ours: Vec<TcFilter> =
        tc_filter::filters(iface)?.into_iter().filter(|f| f.uses_map(config) && f.handle == HANDLE).collect();
    for filter in &ours {
        tc_filter::delete(iface, filter.priority)?;
    }
    Ok(ours)
}

/// What is at tc ingress once the limiter's filters (`removed`) are deleted, in a line: the other
/// filters there stay, as does the clsact qdisc.
fn filter_after_release(iface: &str, removed: &[TcFilter]) -> String {
    let gone = match removed {
        [] => format!(
            "the limiter's filter was not at tc ingress of {iface} (deleted by another tool, or the interface re-created)"
        ),
        _ => format!("removed the limiter's filter from tc ingress of {iface} ({})", tc_filter::listed(removed)),
    };
    match tc_filter::filters(iface) {
        Ok(left) if left.is_empty() => format!("{gone}; no filter is there (the clsact qdisc stays)\n"),
        Ok(left) => format!("{gone}; the other filters there stay: {}\n", tc_filter::listed(&left)),
        Err(e) => format!("{gone}; could not list what stays ({e}): `tc filter show dev {iface} ingress` shows it\n"),
    }
}

/// The lock on `dir`, once `pid` has let go of it (within [`OWNER_EXIT`]).
fn wait_for_lock(dir: &Path, pid: u32) -> Result<Flock<File>, Error> {
    let start = Instant::now();
    loop {
        let file =
            File::open(dir).map_err(|error| Error::PinFile { doing: "opening", path: dir.to_path_buf(), error })?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Ok(lock),
            Err((_, Errno::EWOULDBLOCK)) if start.elapsed() < OWNER_EXIT => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err((_, Errno::EWOULDBLOCK)) => return Err(Error::OwnerStayed { pid, waited: OWNER_EXIT }),
            Err((_, error)) => return Err(Error::Lock { dir: dir.to_path_buf(), error }),
        }
    }
}

/// `limiter-ctl detach --all`: [`detach`] for every interface pinned under `root`. Goes on past
/// a failure; the error says how many failed and the first reason.
pub(crate) fn detach_all(root: &Path, force: bool) -> Result<String, Error> {
    let entries = match std::fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(format!("nothing pinned under {}\n", root.display()));
        }
        Err(error) => return Err(Error::PinFile { doing: "listing", path: root.to_path_buf(), error }),
    };
    let mut ifaces: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| super::pins::iface_of(&e.file_name().to_string_lossy()))
        .collect();
    ifaces.sort();
    let (mut report, mut failed) = (String::new(), Vec::new());
    for iface in &ifaces {
        match detach(root, iface, force) {
            Ok(r) => report.push_str(&r),
            Err(e) => failed.push(e),
        }
    }
    if ifaces.is_empty() {
        report.push_str(&format!("nothing pinned under {}\n", root.display()));
    }
    let count = failed.len();
    match failed.into_iter().next() {
        None => Ok(report),
        Some(first) => Err(Error::DetachSome { report, failed: count, of: ifaces.len(), first: Box::new(first) }),
    }
}

/// The XDP program still attached once the kernel has had time to release ours, if any. The
/// kernel frees an unpinned link from a workqueue, a moment after the unlink returns, so one
/// query right away can still see it; a daemon that holds the link keeps it for good.
fn still_attached_after_release(iface: &str) -> io::Result<Option<XdpProgram>> {
    let start = Instant::now();
    loop {
        match xdp_program(iface)? {
            Some(program) if start.elapsed() >= RELEASE => return Ok(Some(program)),
            Some(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
            None => return Ok(None),
        }
    }
}

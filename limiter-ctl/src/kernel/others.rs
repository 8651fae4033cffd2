//! Another limiter on the interface: the limiter's program at XDP or tc ingress (in the tcx chain,
//! or in a filter) that is not this pin directory's (another daemon's, under another
//! `--pin-dir`, running or left pinned). Beside it this daemon's program would judge every
//! packet again, so a start that finds one refuses, saying where it is pinned and which daemon
//! runs it. This pin directory's own are the programs of its pins (`link`, and the `link_next`
//! of a move cut short), and any filter whose program uses its pinned maps (a move cut short
//! leaves one the next start deletes): this daemon's to adopt or repair, so a restart never finds
//! itself in the way.

use std::{
    fmt,
    path::{Path, PathBuf},
};

use limiter_common::maps::{PROGRAM, PROGRAM_TCX};

use super::{
    Hook,
    pinned::{Pinned, config_map_id},
    pins::{BPFFS, Owner, PinDir, lock_owner, xdp_program},
    tc_filter, tcx,
};

/// A limiter's program at a hook of the interface that is not this pin directory's.
#[derive(Debug)]
pub struct OtherLimiter {
    pub iface: String,
    pub hook: Hook,
    /// At tc ingress: a filter (through netlink), not a tcx link.
    pub filter: bool,
    pub program: u32,
    /// The pin directory whose link runs it, if it was found on bpffs.
    pub dir: Option<PathBuf>,
    /// The daemon holding that directory's lock (None: no daemon this one can see).
    pub owner: Owner,
}

/// How deep below a bpffs root a pin directory's link is looked for (`<root>/limiter/eth0/link`
/// is 3 down), and how many entries are looked at in all.
const DEPTH: usize = 4;
const ENTRIES: usize = 10_000;

/// The limiter at a hook of `iface` that is not the one pinned in `pins` (whose links, `link`
/// and the `link_next` of a move cut short, this daemon adopts), if there is one. A hook the
/// kernel does not answer for is taken as free: attaching there says what is wrong.
pub(crate) fn other_limiter(iface: &str, pins: &PinDir) -> Option<OtherLimiter> {
    let ours: Vec<u32> =
        [pins.link(), pins.link_next()].iter().filter_map(|p| Pinned::read(p).ok()).map(|l| l.program).collect();
    let theirs = |hook, id, name: &str, limiter| (name == limiter && !ours.contains(&id)).then_some((hook, id, false));
    let at_xdp = xdp_program(iface).ok().flatten().and_then(|p| theirs(Hook::Xdp, p.id, p.name.as_deref()?, PROGRAM));
    let at_tcx = || tcx::programs(iface).ok()?.iter().find_map(|p| theirs(Hook::Tc, p.id, &p.name, PROGRAM_TCX));
    let config = config_map_id(pins);
    let in_filter = || {
        let filters = tc_filter::filters(iface).ok()?;
        let other = |f: &&tc_filter::TcFilter| f.is_limiter() && !config.is_some_and(|c| f.uses_map(c));
        let id = filters.iter().find(other)?.program_id()?;
        (!ours.contains(&id)).then_some((Hook::Tc, id, true))
    };
    let (hook, program, filter) = at_xdp.or_else(at_tcx).or_else(in_filter)?;
    let dir = pinned_at(program, &roots(pins));
    let owner = dir.as_deref().map_or(Owner(None), lock_owner);
    Some(OtherLimiter { iface: iface.into(), hook, filter, program, dir, owner })
}

/// Where pins are looked for: bpffs's usual mount, and the root of this daemon's `--pin-dir`
/// when it is elsewhere.
fn roots(pins: &PinDir) -> Vec<PathBuf> {
    let mut roots = vec![PathBuf::from(BPFFS)];
    if let Some(root) = pins.dir().parent().filter(|r| !r.starts_with(BPFFS)) {
        roots.push(root.to_path_buf());
    }
    roots
}

/// The directory whose pinned attachment (`link`, or `link_next`) runs `program`, looked for at most
/// [`DEPTH`] down from each root, at most [`ENTRIES`] entries in all.
fn pinned_at(program: u32, roots: &[PathBuf]) -> Option<PathBuf> {
    let mut dirs: Vec<(PathBuf, usize)> = roots.iter().map(|r| (r.clone(), 0)).collect();
    let mut left = ENTRIES;
    while let Some((dir, depth)) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            left = left.checked_sub(1)?;
            let Ok(kind) = entry.file_type() else { continue };
            let path = entry.path();
            if kind.is_dir() && depth < DEPTH {
                dirs.push((path, depth + 1));
            } else if kind.is_file() && is_link_name(&path) && Pinned::read(&path).is_ok_and(|p| p.program == program) {
                return Some(dir);
            }
        }
    }
    None
}

fn is_link_name(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n == "link" || n == "link_next")
}

impl fmt::Display for OtherLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self { iface, hook, program, .. } = self;
        let at = match (hook, self.filter) {
            (Hook::Xdp, _) => "XDP (",
            (Hook::Tc, false) => "tc ingress (tcx, ",
            (Hook::Tc, true) => "tc ingress (a netlink filter, ",
        };
        write!(f, "another limiter already judges on {iface}, at {at}program id {program}), ")?;
        let Some(dir) = &self.dir else {
            return write!(
                f,
                "pinned outside the places looked in ({BPFFS}); nothing was changed. One limiter per interface, or \
                 every packet is judged twice: `bpftool link` shows its link (`tc filter show dev {iface} ingress` \
                 its filter); take it off with `limiter-ctl detach --iface {iface} --pin-dir DIR` where DIR holds it"
            );
        };
        match self.owner.0 {
            Some(pid) => write!(f, "pinned at {} and run by the daemon pid {pid}", dir.display())?,
            None => write!(f, "pinned at {} with no daemon running it (left enforcing)", dir.display())?,
        }
        write!(f, "; nothing was changed. {}", take_off_advice(iface, dir))
    }
}

/// What to do about another limiter pinned in `dir` (`<root>/<iface>`), in a sentence.
pub(crate) fn take_off_advice(iface: &str, dir: &Path) -> String {
    let root = dir.parent().unwrap_or(dir).display();
    format!(
        "One limiter per interface, or every packet is judged twice: take that one off (`limiter-ctl detach --iface \
         {iface} --pin-dir {root} --force`), or run this daemon with `--pin-dir {root}` once that one is stopped, to \
         adopt its program"
    )
}

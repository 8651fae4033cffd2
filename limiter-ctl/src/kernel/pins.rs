//! Where a limiter's maps and its attachment are pinned on bpffs (`<root>/<iface>/`), so the program
//! keeps enforcing when its daemon dies, and a restarted daemon can adopt it, state and all.
//!
//! One owner per pin directory: a daemon holds an exclusive `flock` on the directory itself for
//! its whole life ([`PinDir::claim`]); `detach` takes the same lock. The kernel drops the lock
//! when the process dies, however it dies, and every process sharing the host's bpffs (a
//! container's too) sees it; `/proc/locks` names the holder.

use std::{
    fs::File,
    io,
    mem::size_of,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use aya::maps::{MapInfo, MapType};
use limiter_common::maps::{
    Ban, Config, Counters, GENERATIONS, LAYER_TASK_BYTES, LAYOUT_VERSION, LayerSet, MAP_ACL_V4, MAP_ACL_V6,
    MAP_BAN_HITS, MAP_BAN_NETS_V4, MAP_BAN_NETS_V6, MAP_BANS_V4, MAP_BANS_V6, MAP_BUCKETS, MAP_CONFIG, MAP_COUNTERS,
    MAP_HOST_BUCKETS, MAP_JUMPS, MAP_JUMPS_TCX, MAP_LAYER_SETS, MAP_LAYER_TASK, MAP_LAYOUT, MAP_POLICIES,
    MAP_POLICY_NAMES, MAP_PORT_POLICY, MAX_ACL_ENTRIES, MAX_BAN_NETS, MAX_BANS, MAX_LAYER_SETS, MAX_POLICIES,
    POLICY_NAME_LEN, PORT_POLICY_ENTRIES, Policy,
};

use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
};

use super::{Error, Geometry, Incompatible, MapShape, host::if_index};

pub(crate) const DEFAULT_ROOT: &str = "/sys/fs/bpf/limiter";
pub(super) const BPFFS: &str = "/sys/fs/bpf";
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const LINK: &str = "link";
/// A move's new link, pinned here until it is renamed over [`LINK`]. (No dot: bpffs refuses
/// names with one.)
const LINK_NEXT: &str = "link_next";

#[derive(Clone, Debug)]
pub(crate) struct PinDir {
    dir: PathBuf,
}

/// The name of `iface`'s pin directory: bpffs refuses names with a dot, which a VLAN's usual
/// name has (`eth0.10`), and no interface name holds a colon (the kernel refuses it), so each dot
/// becomes a colon, one to one ([`iface_of`] reads it back).
pub fn dir_name(iface: &str) -> String {
    iface.replace('.', ":")
}

/// The interface whose pins a directory named `dir_name` holds.
pub fn iface_of(dir_name: &str) -> String {
    dir_name.replace(':', ".")
}

impl PinDir {
    pub fn new(root: &Path, iface: &str) -> Self {
        Self { dir: root.join(dir_name(iface)) }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn map(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn link(&self) -> PathBuf {
        self.dir.join(LINK)
    }

    /// Where a move pins its new link before renaming it over [`PinDir::link`].
    pub fn link_next(&self) -> PathBuf {
        self.dir.join(LINK_NEXT)
    }

    /// A limiter was left here (its link is pinned): adopt it.
    pub fn has_link(&self) -> bool {
        self.link().exists()
    }

    /// Makes the directory (on bpffs, mounting bpffs at `/sys/fs/bpf` if it is not) and takes
    /// the exclusive lock on it, before anything is written there: a live owner makes this fail
    /// naming its pid, having changed nothing. The claim says which directories it created, so
    /// a start that fails can take them away again.
    pub fn claim(&self) -> Result<Claim, Error> {
        let mut created: Vec<PathBuf> =
            self.dir.ancestors().take_while(|d| !d.exists()).map(Path::to_path_buf).collect();
        let mounted = self.prepare().inspect_err(|_| {
            // Not bpffs (or not creatable): take back the directories made on the way.
            for dir in &created {
                let _ = std::fs::remove_dir(dir);
            }
        })?;
        // A detach that holds the lock removes the directory; whoever locked the old inode must
        // lock the new directory instead. Three rounds: a detach that keeps racing is a bug.
        for _ in 0..3 {
            let file = File::open(&self.dir).map_err(|error| Error::PinFile {
                doing: "opening",
                path: self.dir.clone(),
                error,
            })?;
            match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) if same_inode(&lock, &self.dir) => return Ok(Claim { _lock: lock, created, mounted }),
                Ok(_) => {
                    std::fs::create_dir_all(&self.dir).map_err(|error| Error::PinFile {
                        doing: "creating",
                        path: self.dir.clone(),
                        error,
                    })?;
                    created.clear();
                }
                Err((_, Errno::EWOULDBLOCK)) => {
                    return Err(Error::Owned { dir: self.dir.clone(), owner: lock_owner(&self.dir) });
                }
                Err((_, error)) => return Err(Error::Lock { dir: self.dir.clone(), error }),
            }
        }
        Err(Error::Lock { dir: self.dir.clone(), error: Errno::EAGAIN })
    }

    /// Makes the directory, on bpffs. When `/sys/fs/bpf` is not mounted, mounts it; says so.
    pub fn prepare(&self) -> Result<Option<String>, Error> {
        let mut note = None;
        if self.dir.starts_with(BPFFS) && !is_bpffs(Path::new(BPFFS)) {
            mount_bpffs()?;
            note = Some(format!("mounted bpffs at {BPFFS}"));
        }
        std::fs::create_dir_all(&self.dir).map_err(|error| Error::PinFile {
            doing: "creating",
            path: self.dir.clone(),
            error,
        })?;
        if !is_bpffs(&self.dir) {
            return Err(Error::NotBpffs { dir: self.dir.clone() });
        }
        Ok(note)
    }

    /// Checks that the maps pinned here are the ones this build creates, in `geometry`.
    pub fn check_compatible(&self, geometry: Geometry) -> Result<(), Error> {
        for (map, kind, key, value, entries) in expected_maps(geometry.buckets, geometry.host_buckets) {
            let info = MapInfo::from_pin(self.map(map))
                .map_err(|error| self.adopt_error(Incompatible::Unreadable { map, error }))?;
            let found = MapShape {
                kind: info.map_type().ok(),
                key: info.key_size(),
                value: info.value_size(),
                entries: info.max_entries(),
            };
            let needs = MapShape { kind: Some(kind), key, value, entries };
            if found != needs {
                return Err(self.adopt_error(Incompatible::Shape { map, found, needs }));
            }
        }
        Ok(())
    }

    pub fn check_rows(&self, found: u32, needs: u32) -> Result<(), Error> {
        if found == needs { Ok(()) } else { Err(self.adopt_error(Incompatible::Rows { found, needs })) }
    }

    pub fn check_host_rows(&self, found: u32, needs: u32) -> Result<(), Error> {
        if found == needs { Ok(()) } else { Err(self.adopt_error(Incompatible::HostRows { found, needs })) }
    }

    pub fn check_layout(&self, version: u64) -> Result<(), Error> {
        if version == LAYOUT_VERSION { Ok(()) } else { Err(self.adopt_error(Incompatible::Layout { found: version })) }
    }

    /// Whether the link and every map are pinned here.
    pub fn complete(&self) -> bool {
        self.has_link() && map_names().all(|m| self.map(m).exists())
    }

    /// Unpins the link (detaching the program unless a live daemon still holds it) and every map;
    /// returns what was removed. The directory goes too.
    pub fn remove(&self) -> Result<Vec<PathBuf>, Error> {
        let removed = self.remove_pins()?;
        match std::fs::remove_dir(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(Error::PinDirBusy { dir: self.dir.clone(), error }),
        }
        Ok(removed)
    }

    /// [`PinDir::remove`], keeping the directory (whose lock the caller holds).
    pub fn remove_pins(&self) -> Result<Vec<PathBuf>, Error> {
        let mut removed = Vec::new();
        let links = [self.link(), self.link_next()];
        for path in links.into_iter().chain(map_names().map(|m| self.map(m))) {
            match std::fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(error) => return Err(Error::PinFile { doing: "removing", path, error }),
            }
        }
        Ok(removed)
    }

    fn adopt_error(&self, why: Incompatible) -> Error {
        Error::Adopt { dir: self.dir.clone(), why }
    }
}

/// A daemon's hold on its pin directory: the lock, released when this is dropped or the process
/// dies.
#[derive(Debug)]
pub(crate) struct Claim {
    _lock: Flock<File>,
    /// The directories the claim made (the interface's, and those above it that were missing).
    created: Vec<PathBuf>,
    /// Set when bpffs had to be mounted first: what was done.
    mounted: Option<String>,
}

impl Claim {
    pub fn mounted(&self) -> Option<&str> {
        self.mounted.as_deref()
    }

    /// Removes the directories the claim made, if they are empty: what a failed start does last.
    pub fn remove_created(&self) {
        for dir in &self.created {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Who holds the lock on a pin directory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner(pub Option<u32>);

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(pid) => write!(f, "pid {pid}"),
            None => f.write_str("a process whose pid is not visible from here (another pid namespace)"),
        }
    }
}

/// Whether the locked descriptor is still the directory at `path` (not one removed meanwhile).
pub(crate) fn same_inode(lock: &File, path: &Path) -> bool {
    match (lock.metadata(), std::fs::metadata(path)) {
        (Ok(held), Ok(now)) => held.dev() == now.dev() && held.ino() == now.ino(),
        _ => false,
    }
}

/// The pid holding an flock on `path`, from `/proc/locks` (lines like `1: FLOCK ADVISORY WRITE
/// 1234 00:1c:5678 0 EOF`: the device as hex major:minor, then the inode).
pub(crate) fn lock_owner(path: &Path) -> Owner {
    let Ok(meta) = std::fs::metadata(path) else { return Owner(None) };
    let want = (nix::sys::stat::major(meta.dev()), nix::sys::stat::minor(meta.dev()), meta.ino());
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    Owner(locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // Waiters are listed with "->"; the holder line has the pid in the fifth field.
        let [_, "FLOCK", _, _, pid, at, ..] = fields.as_slice() else { return None };
        let mut parts = at.split(':');
        let major = u64::from_str_radix(parts.next()?, 16).ok()?;
        let minor = u64::from_str_radix(parts.next()?, 16).ok()?;
        let inode = parts.next()?.parse::<u64>().ok()?;
        ((major, minor, inode) == want).then(|| pid.parse::<u32>().ok().filter(|&p| p > 0)).flatten()
    }))
}

/// The names of every map of the limiter object, all pinned.
pub fn map_names() -> impl Iterator<Item = &'static str> {
    expected_maps(0, 0).into_iter().map(|m| m.0)
}

/// Each map's name, type, key size, value size and entries, as this build creates it with
/// `buckets` per-CPU and `host_buckets` host-scope buckets per generation.
fn expected_maps(buckets: u32, host_buckets: u32) -> [(&'static str, MapType, u32, u32, u32); 19] {
    let size = |n: usize| n as u32;
    [
        (MAP_CONFIG, MapType::Array, 4, size(size_of::<Config>()), 1),
        (MAP_POLICIES, MapType::Array, 4, size(size_of::<Policy>()), MAX_POLICIES),
        (MAP_PORT_POLICY, MapType::Array, 4, 2, PORT_POLICY_ENTRIES),
        (MAP_LAYER_SETS, MapType::Array, 4, size(size_of::<LayerSet>()), MAX_LAYER_SETS),
        (MAP_JUMPS, MapType::ProgramArray, 4, 4, 1),
        (MAP_JUMPS_TCX, MapType::ProgramArray, 4, 4, 1),
        (MAP_LAYER_TASK, MapType::PerCpuArray, 4, LAYER_TASK_BYTES, 1),
        (MAP_BUCKETS, MapType::PerCpuArray, 4, 8, GENERATIONS * buckets),
        (MAP_HOST_BUCKETS, MapType::Array, 4, 8, GENERATIONS * host_buckets),
        (MAP_COUNTERS, MapType::PerCpuArray, 4, size(size_of::<Counters>()), MAX_POLICIES),
        (MAP_ACL_V4, MapType::LpmTrie, 8, 1, MAX_ACL_ENTRIES),
        (MAP_ACL_V6, MapType::LpmTrie, 20, 1, MAX_ACL_ENTRIES),
        (MAP_BANS_V4, MapType::Hash, 4, size(size_of::<Ban>()), MAX_BANS),
        (MAP_BANS_V6, MapType::Hash, 16, size(size_of::<Ban>()), MAX_BANS),
        (MAP_BAN_NETS_V4, MapType::LpmTrie, 8, size(size_of::<Ban>()), MAX_BAN_NETS),
        (MAP_BAN_NETS_V6, MapType::LpmTrie, 20, size(size_of::<Ban>()), MAX_BAN_NETS),
        (MAP_BAN_HITS, MapType::PerCpuArray, 4, 8, 2),
        (MAP_POLICY_NAMES, MapType::Array, 4, size(POLICY_NAME_LEN), MAX_POLICIES),
        (MAP_LAYOUT, MapType::Array, 4, 8, 1),
    ]
}

// The magic's type is the C library's `fsword_t`: i64 here, i32 on some targets.
#[allow(clippy::useless_conversion)]
fn is_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|s| i64::from(s.filesystem_type().0) == BPF_FS_MAGIC)
}

fn mount_bpffs() -> Result<(), Error> {
    std::fs::create_dir_all(BPFFS).ok();
    nix::mount::mount(Some("bpf"), BPFFS, Some("bpf"), nix::mount::MsFlags::empty(), None::<&str>)
        .map_err(Error::MountBpffs)
}

/// An XDP program attached to an interface, as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XdpProgram {
    /// 0 if the kernel did not say.
    pub id: u32,
    /// The program's name (None without the privilege to look it up).
    pub name: Option<String>,
    /// "native", "skb", "hw" or "multi".
    pub mode: &'static str,
}

impl std::fmt::Display for XdpProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "XDP program id {}", self.id)?;
        if let Some(name) = &self.name {
            write!(f, " named '{name}'")?;
        }
        write!(f, ", {} mode", self.mode)
    }
}

/// The XDP program attached to `iface` in this network namespace, if any (none when the
/// interface does not exist). The kernel answers over rtnetlink: an error (a sandbox without
/// AF_NETLINK, say) means the answer is unknown, never that nothing is attached.
pub(crate) fn xdp_program(iface: &str) -> io::Result<Option<XdpProgram>> {
    let Some(index) = if_index(iface) else { return Ok(None) };
    let Some((id, mode)) = query_xdp(index)? else { return Ok(None) };
    let name = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == id)
        .and_then(|p| p.name_as_str().map(str::to_string));
    Ok(Some(XdpProgram { id, name, mode }))
}

fn query_xdp(index: u32) -> io::Result<Option<(u32, &'static str)>> {
    use netlink_packet_route::{
        RouteNetlinkMessage,
        link::{LinkAttribute, LinkMessage, LinkXdp, XdpAttached},
    };

    let mut link = LinkMessage::default();
    link.header.index = index;
    let answer = super::rtnl::ask(RouteNetlinkMessage::GetLink(link), false)?;
    let Some(RouteNetlinkMessage::NewLink(link)) = answer.into_iter().next() else {
        return Ok(None);
    };
    let Some(xdp) = link.attributes.iter().find_map(|a| match a {
        LinkAttribute::Xdp(xdp) => Some(xdp),
        _ => None,
    }) else {
        return Ok(None);
    };
    let mode = xdp.iter().find_map(|x| match x {
        LinkXdp::Attached(XdpAttached::None) => Some(None),
        LinkXdp::Attached(XdpAttached::Driver) => Some(Some("native")),
        LinkXdp::Attached(XdpAttached::SocketBuffer) => Some(Some("skb")),
        LinkXdp::Attached(XdpAttached::Hardware) => Some(Some("hw")),
        LinkXdp::Attached(_) => Some(Some("multi")),
        _ => None,
    });
    let id = xdp.iter().find_map(|x| match x {
        LinkXdp::ProgId(id) | LinkXdp::DrvProgId(id) | LinkXdp::SkbProgId(id) | LinkXdp::HwProgId(id) if *id != 0 => {
            Some(*id)
        }
        _ => None,
    });
    Ok(match (mode.flatten(), id) {
        (None, None) => None,
        (mode, id) => Some((id.unwrap_or(0), mode.unwrap_or("native"))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holder_of_a_directory_lock_is_found_in_proc_locks() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert_eq!(lock_owner(dir.path()), Owner(None), "nobody holds it yet");
        let held = Flock::lock(File::open(dir.path()).expect("open"), FlockArg::LockExclusiveNonblock).expect("lock");
        assert_eq!(lock_owner(dir.path()), Owner(Some(std::process::id())));
        // A second open file description is refused while the first holds it, as a second daemon is.
        let again = Flock::lock(File::open(dir.path()).expect("open"), FlockArg::LockExclusiveNonblock);
        assert!(matches!(again, Err((_, Errno::EWOULDBLOCK))), "a second lock was granted");
        drop(held);
        assert_eq!(lock_owner(dir.path()), Owner(None), "released with the descriptor");
        assert_eq!(Owner(Some(42)).to_string(), "pid 42");
    }
}

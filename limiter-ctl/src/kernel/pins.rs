//! Where a limiter's maps and XDP link are pinned on bpffs (`<root>/<iface>/`), so the program
//! keeps enforcing when its daemon dies, and a restarted daemon can adopt it, state and all.

use std::{
    io,
    mem::size_of,
    path::{Path, PathBuf},
};

use aya::maps::{MapInfo, MapType};
use limiter_common::maps::{
    Config, Counters, GENERATIONS, LAYOUT_VERSION, MAP_ACL_V4, MAP_ACL_V6, MAP_BUCKETS, MAP_CONFIG, MAP_COUNTERS,
    MAP_LAYOUT, MAP_POLICIES, MAP_POLICY_NAMES, MAP_PORT_POLICY, MAX_ACL_ENTRIES, MAX_POLICIES, POLICY_NAME_LEN,
    PORT_POLICY_ENTRIES, Policy,
};

use super::{Error, Incompatible, MapShape, host::if_index};

pub(crate) const DEFAULT_ROOT: &str = "/sys/fs/bpf/limiter";
pub(super) const BPFFS: &str = "/sys/fs/bpf";
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const LINK: &str = "link";

#[derive(Clone, Debug)]
pub(crate) struct PinDir {
    dir: PathBuf,
}

impl PinDir {
    pub fn new(root: &Path, iface: &str) -> Self {
        Self { dir: root.join(iface) }
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

    /// A limiter was left here (its link is pinned): adopt it.
    pub fn has_link(&self) -> bool {
        self.link().exists()
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

    /// Checks that the maps pinned here are the ones this build creates, with `buckets` buckets.
    pub fn check_compatible(&self, buckets: u32) -> Result<(), Error> {
        for (map, kind, key, value, entries) in expected_maps(buckets) {
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

    pub fn check_layout(&self, version: u64) -> Result<(), Error> {
        if version == LAYOUT_VERSION { Ok(()) } else { Err(self.adopt_error(Incompatible::Layout { found: version })) }
    }

    /// Unpins the link (detaching the program unless a live daemon still holds it) and every map;
    /// returns what was removed.
    pub fn remove(&self) -> Result<Vec<PathBuf>, Error> {
        let mut removed = Vec::new();
        for path in std::iter::once(self.link()).chain(map_names().map(|m| self.map(m))) {
            match std::fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(error) => return Err(Error::PinFile { doing: "removing", path, error }),
            }
        }
        match std::fs::remove_dir(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(error) => return Err(Error::PinDirBusy { dir: self.dir.clone(), error }),
        }
        Ok(removed)
    }

    fn adopt_error(&self, why: Incompatible) -> Error {
        Error::Adopt { dir: self.dir.clone(), why }
    }
}

/// The names of every map of the limiter object, all pinned.
pub fn map_names() -> impl Iterator<Item = &'static str> {
    expected_maps(0).into_iter().map(|m| m.0)
}

/// Each map's name, type, key size, value size and entries, as this build creates it.
fn expected_maps(buckets: u32) -> [(&'static str, MapType, u32, u32, u32); 9] {
    let size = |n: usize| n as u32;
    [
        (MAP_CONFIG, MapType::Array, 4, size(size_of::<Config>()), 1),
        (MAP_POLICIES, MapType::Array, 4, size(size_of::<Policy>()), MAX_POLICIES),
        (MAP_PORT_POLICY, MapType::Array, 4, 2, PORT_POLICY_ENTRIES),
        (MAP_BUCKETS, MapType::PerCpuArray, 4, 8, GENERATIONS * buckets),
        (MAP_COUNTERS, MapType::PerCpuArray, 4, size(size_of::<Counters>()), MAX_POLICIES),
        (MAP_ACL_V4, MapType::LpmTrie, 8, 1, MAX_ACL_ENTRIES),
        (MAP_ACL_V6, MapType::LpmTrie, 20, 1, MAX_ACL_ENTRIES),
        (MAP_POLICY_NAMES, MapType::Array, 4, size(POLICY_NAME_LEN), MAX_POLICIES),
        (MAP_LAYOUT, MapType::Array, 4, 8, 1),
    ]
}

fn is_bpffs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|s| s.filesystem_type().0 as i64 == BPF_FS_MAGIC)
}

fn mount_bpffs() -> Result<(), Error> {
    std::fs::create_dir_all(BPFFS).ok();
    nix::mount::mount(Some("bpf"), BPFFS, Some("bpf"), nix::mount::MsFlags::empty(), None::<&str>)
        .map_err(Error::MountBpffs)
}

/// `limiter-ctl detach`: unpins a limiter's link and maps. The program leaves the interface
/// unless a running daemon still holds it, which the report says.
pub(crate) fn detach(root: &Path, iface: &str) -> Result<String, Error> {
    let pins = PinDir::new(root, iface);
    if !pins.dir().exists() {
        return Ok(format!("nothing pinned for {iface} under {}\n", root.display()));
    }
    let removed = pins.remove()?;
    let mut report = format!("removed {} pins from {}\n", removed.len(), pins.dir().display());
    if still_attached_after_release(iface) {
        report.push_str(&format!(
            "an XDP program is still attached to {iface}: a running limiter daemon (or another tool) holds it; stop the daemon to detach it\n"
        ));
    } else {
        report.push_str(&format!("no XDP program is attached to {iface}\n"));
    }
    Ok(report)
}

/// Whether an XDP program is still attached once the kernel has had time to release ours. The
/// kernel frees an unpinned link from a workqueue, a moment after the unlink returns, so one
/// query right away can still see it; a daemon that holds the link keeps it for good.
fn still_attached_after_release(iface: &str) -> bool {
    const RELEASE: std::time::Duration = std::time::Duration::from_secs(2);
    let start = std::time::Instant::now();
    while xdp_attached(iface) {
        if start.elapsed() >= RELEASE {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

/// Whether the interface has any XDP program attached (in any mode, through a link or not):
/// the kernel's own answer to RTM_GETLINK, its IFLA_XDP attributes.
pub(crate) fn xdp_attached(iface: &str) -> bool {
    if_index(iface).is_some_and(|index| query_xdp(index).unwrap_or(false))
}

fn query_xdp(index: u32) -> io::Result<bool> {
    use netlink_packet_core::{NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload};
    use netlink_packet_route::{
        RouteNetlinkMessage,
        link::{LinkAttribute, LinkMessage, LinkXdp, XdpAttached},
    };
    use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    let mut link = LinkMessage::default();
    link.header.index = index;
    let mut request =
        NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::from(RouteNetlinkMessage::GetLink(link)));
    request.header.flags = NLM_F_REQUEST;
    request.header.sequence_number = 1;
    request.finalize();
    let mut buf = vec![0; request.buffer_len()];
    request.serialize(&mut buf);
    socket.send(&buf, 0)?;
    let (reply, _) = socket.recv_from_full()?;
    let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&reply).map_err(io::Error::other)?;
    let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) = reply.payload else {
        return Ok(false);
    };
    Ok(link.attributes.iter().any(|a| match a {
        LinkAttribute::Xdp(xdp) => xdp.iter().any(|x| match x {
            LinkXdp::Attached(mode) => *mode != XdpAttached::None,
            LinkXdp::ProgId(id) => *id != 0,
            _ => false,
        }),
        _ => false,
    }))
}

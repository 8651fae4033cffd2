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

use crate::Error;

pub const DEFAULT_ROOT: &str = "/sys/fs/bpf/limiter";
const BPFFS: &str = "/sys/fs/bpf";
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const LINK: &str = "link";

#[derive(Clone, Debug)]
pub struct PinDir {
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
        std::fs::create_dir_all(&self.dir).map_err(|e| Error::Pins(format!("creating {}: {e}", self.dir.display())))?;
        if !is_bpffs(&self.dir) {
            return Err(Error::Pins(format!(
                "{} is not on a BPF filesystem; mount one (mount -t bpf bpf {BPFFS}) or choose --pin-dir under it",
                self.dir.display()
            )));
        }
        Ok(note)
    }

    /// Checks that the maps pinned here are the ones this build creates, with `buckets` buckets.
    pub fn check_compatible(&self, buckets: u32) -> Result<(), Error> {
        for (name, kind, key, value, entries) in expected_maps(buckets) {
            let info = MapInfo::from_pin(self.map(name))
                .map_err(|e| self.adopt_error(format!("map {name} is not readable ({e})")))?;
            let found = (info.map_type().ok(), info.key_size(), info.value_size(), info.max_entries());
            if found != (Some(kind), key, value, entries) {
                let hint = if name == MAP_BUCKETS && found.3 != entries {
                    format!(
                        " (it was pinned with --buckets {}; start with that, or detach first)",
                        found.3 / GENERATIONS
                    )
                } else {
                    " (pinned by another version of limiter)".into()
                };
                return Err(self.adopt_error(format!(
                    "map {name} is {:?} key {} value {} entries {}, this build needs {kind:?} key {key} value {value} entries {entries}{hint}",
                    found.0, found.1, found.2, found.3
                )));
            }
        }
        Ok(())
    }

    pub fn check_layout(&self, version: u64) -> Result<(), Error> {
        if version == LAYOUT_VERSION {
            Ok(())
        } else {
            Err(self.adopt_error(format!("its maps are layout version {version}, this build uses {LAYOUT_VERSION}")))
        }
    }

    /// Unpins the link (detaching the program unless a live daemon still holds it) and every map;
    /// returns what was removed.
    pub fn remove(&self) -> Result<Vec<PathBuf>, Error> {
        let mut removed = Vec::new();
        for path in std::iter::once(self.link()).chain(map_names().map(|m| self.map(m))) {
            match std::fs::remove_file(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::Pins(format!("removing {}: {e}", path.display()))),
            }
        }
        match std::fs::remove_dir(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(Error::Pins(format!(
                    "removing {}: {e} (is something else pinned there?)",
                    self.dir.display()
                )));
            }
        }
        Ok(removed)
    }

    fn adopt_error(&self, why: String) -> Error {
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
    nix::mount::mount(Some("bpf"), BPFFS, Some("bpf"), nix::mount::MsFlags::empty(), None::<&str>).map_err(|e| {
        Error::Pins(format!(
            "bpffs is not mounted at {BPFFS} and mounting it failed ({e}); mount it with `mount -t bpf bpf {BPFFS}`"
        ))
    })
}

/// `limiter-ctl detach`: unpins a limiter's link and maps. The program leaves the interface
/// unless a running daemon still holds it, which the report says.
pub fn detach(root: &Path, iface: &str) -> Result<String, Error> {
    let pins = PinDir::new(root, iface);
    if !pins.dir().exists() {
        return Ok(format!("nothing pinned for {iface} under {}\n", root.display()));
    }
    let removed = pins.remove()?;
    let mut report = format!("removed {} pins from {}\n", removed.len(), pins.dir().display());
    if xdp_attached(iface) {
        report.push_str(&format!(
            "an XDP program is still attached to {iface}: a running limiter daemon (or another tool) holds it; stop the daemon to detach it\n"
        ));
    } else {
        report.push_str(&format!("no XDP program is attached to {iface}\n"));
    }
    Ok(report)
}

/// Whether the interface has any XDP program attached, as iproute2 reports it.
pub fn xdp_attached(iface: &str) -> bool {
    std::process::Command::new("ip")
        .args(["-d", "link", "show", "dev", iface])
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("prog/xdp"))
}

//! The snapshot file, `bans-IFACE.json`: every entry with its deadline, the [`Stamp`] of the
//! boot they are on, and the first journal after it (`store`). Written whole, page by page as
//! they come, to a temporary file that is renamed over the old; read whole at start.

use std::{fs::File, io::Write as _, os::unix::fs::DirBuilderExt as _, path::Path};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::{Key, clock::Stamp, pages::Page};
use crate::{
    config::{List, Origin},
    daemon::listing,
};

/// The snapshot's format: 2 has deadlines on the ban clock with their [`Stamp`]; 1 (read
/// once, at the upgrade) had wall-clock expiries.
pub(super) const FILE_VERSION: u32 = 2;

/// A network in a file: written as text, read through the config's strict parser.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Net(pub(super) IpNet);

impl Serialize for Net {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Net {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::config::net_serde::deserialize(d).map(Net)
    }
}

/// The snapshot file: its entries a `Vec` read back, a [`listing::Seq`] of pages as written.
#[derive(Serialize, Deserialize)]
pub(super) struct Snapshot<B = Vec<(List, Origin, Net, u64)>> {
    pub(super) version: u32,
    /// The boot its deadlines are on (absent in version 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) clock: Option<Stamp>,
    /// The first journal that follows it.
    #[serde(default)]
    pub(super) journal: u64,
    /// List, origin, network, deadline (version 1: wall-clock expiry, ms since the epoch).
    pub(super) bans: B,
}

/// Why a snapshot was not written.
#[derive(Debug, thiserror::Error)]
pub(super) enum WriteError {
    /// The loop that hands out the pages ended: the daemon is stopping (and writes its own).
    #[error("the daemon stopped during the save")]
    Stopped,
    #[error("{0}")]
    Failed(String),
}

pub(super) fn dir_of(path: &Path) -> &Path {
    path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// The state directory, made 0700 if missing.
pub(super) fn make_dir(dir: &Path) -> Result<(), String> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("creating {}: {e}", dir.display()))
}

/// The snapshot; None when there is none.
pub(super) fn read_snapshot(path: &Path) -> Result<Option<Snapshot>, String> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let snapshot: Snapshot = serde_json::from_slice(&text).map_err(|e| e.to_string())?;
    match snapshot.version {
        1 if snapshot.clock.is_none() => Ok(Some(snapshot)),
        FILE_VERSION if snapshot.clock.is_some() => Ok(Some(snapshot)),
        v => Err(format!("format version {v} (this daemon reads 1 and {FILE_VERSION})")),
    }
}

/// Writes the snapshot whole, page by page as `pages` hands them out: a temporary file beside
/// the old (`.bans-IFACE.json.XXXXXX`), synced, renamed over it (a crash leaves the old file or
/// the new, never half of one, and the next start removes the temporary). The directory is made
/// 0700.
pub(super) fn write_snapshot(
    path: &Path,
    pages: impl FnMut(Option<Key>) -> Option<Page>,
    journal: u64,
) -> Result<(), WriteError> {
    let failed = |e: &dyn std::fmt::Display| WriteError::Failed(e.to_string());
    let dir = dir_of(path);
    make_dir(dir).map_err(WriteError::Failed)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .tempfile_in(dir)
        .map_err(|e| failed(&e))?;
    let mut pages = pages;
    let lines = listing::Pages::new(move |after| {
        let (entries, next) = pages(after)?;
        Some((
            entries.into_iter().map(|((net, list, origin), at)| (list, origin, Net(net), at)).collect::<Vec<_>>(),
            next,
        ))
    });
    let snapshot =
        Snapshot { version: FILE_VERSION, clock: Some(Stamp::now()), journal, bans: listing::Seq::new(lines) };
    {
        let mut out = std::io::BufWriter::new(tmp.as_file_mut());
        serde_json::to_writer(&mut out, &snapshot).map_err(|e| failed(&e))?;
        out.write_all(b"\n").and_then(|()| out.flush()).map_err(|e| failed(&e))?;
    }
    if snapshot.bans.into_inner().stopped {
        return Err(WriteError::Stopped);
    }
    tmp.as_file().sync_all().map_err(|e| failed(&e))?;
    tmp.persist(path).map_err(|e| failed(&e.error))?;
    // The rename itself, durable.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

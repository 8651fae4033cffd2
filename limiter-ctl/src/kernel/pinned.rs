//! What the pin directory's `link` (and a move's `link_next`) holds: a bpf_link at XDP or at tcx,
//! or, at tc ingress through netlink (which makes no link), the program the limiter's filter
//! runs. One name for both, so a move renames its new attachment over the old one in one step
//! whatever their kinds. Which of the two a pin is, is asked of the kernel's descriptor, as
//! bpftool does (`/proc/self/fd/N` reads `anon_inode:bpf_link` or `anon_inode:bpf-prog`).

use std::path::Path;

use aya::programs::{
    ProgramInfo,
    links::{FdLink, LinkType, PinnedLink},
};
use limiter_common::maps::MAP_CONFIG;

use super::{Error, Hook, pins::PinDir, sys};

/// A pin of the limiter's attachment, opened.
pub(super) enum Pinned {
    /// A bpf_link at `hook`, this descriptor a reference to it.
    Link { hook: Hook, fd: FdLink },
    /// The program of a filter at tc ingress (its id); the kernel holds the filter.
    Filter { program: u32 },
}

impl Pinned {
    /// Opens the pin at `path`: a link (its hook read from the kernel's link info) or a program.
    pub(super) fn open(path: &Path) -> Result<Self, Error> {
        let opening = |error| Error::OpenPinnedLink { path: path.to_path_buf(), error };
        let program = sys::pinned_is_program(path).map_err(|errno| Error::PinFile {
            doing: "opening",
            path: path.to_path_buf(),
            error: errno.into(),
        })?;
        if program {
            let info = ProgramInfo::from_pin(path)
                .map_err(|error| Error::PinnedProgram { path: path.to_path_buf(), error: Box::new(error) })?;
            return Ok(Self::Filter { program: info.id() });
        }
        let link = FdLink::from(PinnedLink::from_pin(path).map_err(opening)?);
        let hook = match link.info().and_then(|i| i.link_type()).map_err(opening)? {
            LinkType::Xdp => Hook::Xdp,
            LinkType::Tcx => Hook::Tc,
            other => return Err(Error::PinnedLinkType { path: path.to_path_buf(), found: format!("{other:?}") }),
        };
        Ok(Self::Link { hook, fd: link })
    }

    /// Its hook and program id, the descriptor closed again (a held descriptor would keep a
    /// link alive past its unpinning).
    pub(super) fn read(path: &Path) -> Result<PinnedAt, Error> {
        Ok(match Self::open(path)? {
            Self::Filter { program } => PinnedAt { hook: Hook::Tc, program, filter: true },
            Self::Link { hook, fd } => {
                let info = fd.info().map_err(|error| Error::OpenPinnedLink { path: path.to_path_buf(), error })?;
                PinnedAt { hook, program: info.program_id(), filter: false }
            }
        })
    }
}

/// Where a pinned attachment is: its hook, its program, and whether it is a filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PinnedAt {
    pub hook: Hook,
    pub program: u32,
    pub filter: bool,
}

/// The id the kernel gave the config map pinned in `pins` (the limiter's filters are those whose
/// program uses it), if it is pinned.
pub(crate) fn config_map_id(pins: &PinDir) -> Option<u32> {
    aya::maps::MapInfo::from_pin(pins.map(MAP_CONFIG)).ok().map(|m| m.id())
}

/// Removes a pin, if it is there.
pub(super) fn remove_pin(path: &Path, doing: &'static str) -> Result<(), Error> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(Error::PinFile { doing, path: path.to_path_buf(), error }),
    }
}

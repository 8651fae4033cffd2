//! Attaching the program to an interface, in place of a pinned predecessor when there is one,
//! and detaching it.

use std::fmt;

use aya::programs::{
    ProgramError, XdpMode,
    links::{FdLink, PinnedLink},
    xdp::{XdpLink, XdpLinkId},
};
use limiter_common::maps::Config;

use super::{
    Error, Limiter, interface_exists,
    pins::{PinDir, map_names, xdp_program},
};

/// The attach mode an operator asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeRequest {
    /// Native (driver) mode, falling back to skb mode with a warning.
    #[default]
    Auto,
    Native,
    Skb,
}

/// The mode the program runs in once attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    Native,
    Skb,
}

impl AttachMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Skb => "skb",
        }
    }

    fn xdp_mode(self) -> XdpMode {
        match self {
            Self::Native => XdpMode::Driver,
            Self::Skb => XdpMode::Skb,
        }
    }
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the program got attached.
#[derive(Debug)]
pub struct Attached {
    pub mode: AttachMode,
    /// Why native mode was not used, when auto fell back to skb mode.
    pub fallback: Option<String>,
    /// The program replaced a pinned predecessor in place (no moment unprotected).
    pub replaced: bool,
    /// Why `mode` is an assumption: replacing a predecessor whose config is not ours, the kernel
    /// could not be asked which mode its link has.
    pub mode_unknown: Option<String>,
}

/// The XDP link, held by the program (unpinned) or pinned on bpffs (outlives the process).
enum Held {
    Program(XdpLinkId),
    Pinned(PinnedLink),
}

pub(super) struct Link {
    iface: String,
    held: Held,
}

impl Limiter {
    /// Attaches to `iface`. With pins: a pinned predecessor's link gets this program swapped in
    /// atomically (its attach mode stays); otherwise a new link is made and pinned. A program
    /// loaded in place of one it could not adopt ([`Limiter::replaces_incompatible`]) then pins
    /// its own maps where the predecessor's were.
    pub fn attach(&mut self, iface: &str, mode: ModeRequest) -> Result<Attached, Error> {
        let attached = self.attach_link(iface, mode)?;
        if self.stale.is_some() {
            self.pin_maps()?;
        }
        if !attached.replaced || self.stale.is_some() {
            // A fresh config: record the mode the link was made in (or, replacing, found in).
            self.record_mode(attached.mode)?;
        }
        Ok(attached)
    }

    fn attach_link(&mut self, iface: &str, mode: ModeRequest) -> Result<Attached, Error> {
        if !interface_exists(iface) {
            return Err(Error::NoSuchInterface(iface.into()));
        }
        if let Some(path) = self.pins.as_ref().map(PinDir::link).filter(|p| p.exists()) {
            match self.replace_in_pinned_link(&path) {
                Ok(id) => {
                    self.link = Some(Link { iface: iface.into(), held: Held::Program(id) });
                    let (mode, mode_unknown) = if self.stale.is_some() {
                        // The predecessor's config is not readable as ours: ask the kernel.
                        match xdp_program(iface) {
                            Ok(Some(p)) if p.mode == "skb" => (AttachMode::Skb, None),
                            Ok(_) => (AttachMode::Native, None),
                            Err(e) => (AttachMode::Native, Some(e.to_string())),
                        }
                    } else {
                        (self.attach_mode()?, None)
                    };
                    return Ok(Attached { mode, fallback: None, replaced: true, mode_unknown });
                }
                // Defunct: its interface went away (re-created since?). Start a new link.
                Err(_) => std::fs::remove_file(&path).map_err(|error| Error::PinFile {
                    doing: "removing the stale",
                    path: path.clone(),
                    error,
                })?,
            }
        }
        let (id, attached) = self.attach_new(iface, mode).map_err(|e| match xdp_program(iface) {
            // Most often another tool's program (or a limiter under another --pin-dir): say which.
            Ok(Some(holder)) => Error::Occupied { iface: iface.into(), holder: Box::new(holder), source: Box::new(e) },
            Ok(None) | Err(_) => e,
        })?;
        let held = match &self.pins {
            None => Held::Program(id),
            Some(pins) => {
                let path = pins.link();
                let link = self.xdp_mut()?.take_link(id).map_err(|source| Error::Attach {
                    iface: iface.into(),
                    mode: attached.mode.as_str(),
                    source,
                })?;
                let fd = FdLink::try_from(link).map_err(Error::NotBpfLink)?;
                Held::Pinned(fd.pin(&path).map_err(|error| Error::PinLink { path: path.clone(), error })?)
            }
        };
        self.link = Some(Link { iface: iface.into(), held });
        Ok(attached)
    }

    fn record_mode(&mut self, mode: AttachMode) -> Result<(), Error> {
        let mut config = self.read_config()?;
        config.flags =
            (config.flags & !Config::ATTACHED_SKB) | if mode == AttachMode::Skb { Config::ATTACHED_SKB } else { 0 };
        self.store_config(&config)
    }

    /// Pins every map in the pin directory, in place of whatever is pinned under its name.
    fn pin_maps(&mut self) -> Result<(), Error> {
        let Some(pins) = self.pins.clone() else { return Ok(()) };
        for name in map_names() {
            let path = pins.map(name);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => return Err(Error::PinFile { doing: "removing the replaced", path, error }),
            }
            self.map(name)?.pin(&path).map_err(|error| Error::PinMap { path: path.clone(), error })?;
        }
        Ok(())
    }

    /// How the program is attached, as recorded in the kernel's config when the link was made
    /// (so it survives reattaching and adoption).
    pub fn attach_mode(&self) -> Result<AttachMode, Error> {
        Ok(if self.read_config()?.flags & Config::ATTACHED_SKB != 0 { AttachMode::Skb } else { AttachMode::Native })
    }

    fn replace_in_pinned_link(&mut self, path: &std::path::Path) -> Result<XdpLinkId, Error> {
        let pinned =
            PinnedLink::from_pin(path).map_err(|error| Error::OpenPinnedLink { path: path.to_path_buf(), error })?;
        let link = XdpLink::try_from(FdLink::from(pinned))
            .map_err(|error| Error::PinnedLinkNotXdp { path: path.to_path_buf(), error })?;
        self.xdp_mut()?.attach_to_link(link).map_err(|source| Error::Attach {
            iface: "(pinned link)".into(),
            mode: "replace",
            source,
        })
    }

    fn attach_new(&mut self, iface: &str, mode: ModeRequest) -> Result<(XdpLinkId, Attached), Error> {
        let first = match mode {
            ModeRequest::Auto | ModeRequest::Native => AttachMode::Native,
            ModeRequest::Skb => AttachMode::Skb,
        };
        let program = self.xdp_mut()?;
        match program.attach(iface, first.xdp_mode()) {
            Ok(id) => Ok((id, Attached { mode: first, fallback: None, replaced: false, mode_unknown: None })),
            Err(native_err) if mode == ModeRequest::Auto => {
                let reason = error_chain(&native_err);
                let id = program.attach(iface, XdpMode::Skb).map_err(|source| Error::Attach {
                    iface: iface.into(),
                    mode: "skb",
                    source,
                })?;
                Ok((
                    id,
                    Attached { mode: AttachMode::Skb, fallback: Some(reason), replaced: false, mode_unknown: None },
                ))
            }
            Err(source) => Err(Error::Attach { iface: iface.into(), mode: first.as_str(), source }),
        }
    }

    /// Attaches again after the interface was re-created (the old link died with it).
    pub fn reattach(&mut self, mode: ModeRequest) -> Result<Attached, Error> {
        let Some(link) = self.link.take() else {
            return Err(Error::NotAttached);
        };
        self.drop_link(link.held, &link.iface, false)?;
        self.attach(&link.iface, mode)
    }

    /// Detaches from the interface and removes the pins: the next start begins afresh.
    /// (Dropping a `Limiter` without this leaves a pinned program attached: fail static.)
    pub fn detach(&mut self) -> Result<Option<String>, Error> {
        let Some(link) = self.link.take() else {
            return Ok(None);
        };
        self.drop_link(link.held, &link.iface, true)?;
        if let Some(pins) = &self.pins {
            pins.remove()?;
        }
        Ok(Some(link.iface))
    }

    fn drop_link(&mut self, held: Held, iface: &str, detach: bool) -> Result<(), Error> {
        let pin = self.pins.as_ref().map(PinDir::link);
        // Unpinning first: then closing our descriptor destroys the link.
        if let Some(path) = pin.filter(|p| p.exists()) {
            std::fs::remove_file(&path).map_err(|error| Error::PinFile {
                doing: "removing",
                path: path.clone(),
                error,
            })?;
        }
        match held {
            Held::Pinned(p) => drop(FdLink::from(p)),
            Held::Program(id) => {
                let result = self.xdp_mut()?.detach(id);
                if detach {
                    result.map_err(|source| Error::Detach { iface: iface.into(), source })?;
                }
            }
        }
        Ok(())
    }
}

fn error_chain(e: &ProgramError) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

//! Attaching the program to an interface, at XDP or at tc ingress (tcx), in place of a pinned
//! predecessor when there is one; moving it from one hook to the other without a gap; and
//! detaching it.

use std::path::Path;

use aya::programs::{
    TcAttachType, XdpMode,
    links::{FdLink, LinkType, PinnedLink},
    tc::{SchedClassifierLink, TcAttachOptions},
    xdp::{XdpLink, XdpLinkId},
};
use limiter_common::maps::Config;

use super::{
    AttachMode, Attached, Error, Hook, HookRequest, Limiter, ModeRequest, Placement,
    handover::IN_FLIGHT,
    interface_exists,
    pins::{PinDir, map_names, xdp_program},
    tcx::{self, TcxPlace},
};
use crate::test_hook::sigkill_at;

/// The limiter's link: held here, and pinned too (at [`PinDir::link`]) when it has pins, so it
/// outlives the process.
pub(super) struct Link {
    pub(super) iface: String,
    pub(super) hook: Hook,
    fd: FdLink,
    why_tcx: Option<String>,
}

impl Limiter {
    /// Attaches to `iface` at XDP in `mode` ([`Limiter::attach_as`]).
    pub fn attach(&mut self, iface: &str, mode: ModeRequest) -> Result<Attached, Error> {
        self.attach_as(iface, &Placement { hook: HookRequest::Xdp, mode, tcx: TcxPlace::First })
    }

    /// Attaches to `iface` as `want` says. With pins: a move a predecessor did not finish is
    /// undone first ([`handover`](super::handover)); a pinned predecessor's link gets this
    /// program swapped in atomically (its hook, XDP mode and tcx place stay), then an explicit
    /// hook other than that link's is moved to ([`Limiter::move_to`]); otherwise a new link is
    /// made and pinned. A program loaded in place of one it could not adopt
    /// ([`Limiter::replaces_incompatible`]) then pins its own maps where the predecessor's were.
    pub fn attach_as(&mut self, iface: &str, want: &Placement) -> Result<Attached, Error> {
        let undone = self.undo_move()?;
        let mut attached = self.attach_link(iface, want)?;
        if self.stale.is_some() {
            self.pin_maps()?;
        }
        // The mode the link was made in, or found in: never what a move cut short recorded.
        self.record_mode(attached.mode)?;
        attached.lingering = self.end_handover(iface, undone)?;
        attached.undone = undone.map(|(hook, _)| hook);
        match want.hook.explicit() {
            Some(hook) if hook != attached.mode.hook() => {
                let why = format!("asked for (--attach {hook})");
                let moved = self.move_to(hook, want, why)?;
                Ok(Attached { replaced: attached.replaced, undone: attached.undone, ..moved })
            }
            _ => Ok(attached),
        }
    }

    /// A move cut short between pinning its new link beside the old one and renaming it over
    /// it left two links pinned: the new one goes, so the program stays where its link is.
    /// Returns that link's hook and program, to wait for it to leave.
    fn undo_move(&self) -> Result<Option<(Hook, u32)>, Error> {
        let Some(pins) = &self.pins else { return Ok(None) };
        let next = pins.link_next();
        if !next.exists() {
            return Ok(None);
        }
        let found = pinned_link(&next).ok();
        remove_pin(&next, "removing the unfinished move's")?;
        Ok(found)
    }

    fn attach_link(&mut self, iface: &str, want: &Placement) -> Result<Attached, Error> {
        if !interface_exists(iface) {
            return Err(Error::NoSuchInterface(iface.into()));
        }
        let mut defunct = None;
        if let Some(pins) = self.pins.clone() {
            let path = pins.link();
            if path.exists() {
                let (hook, link) = open_pinned(&path)?;
                self.load_hook(hook)?;
                match self.swap_into(&path, hook, link) {
                    Ok(fd) => return self.took_over(iface, hook, fd),
                    // Defunct: its interface went away (re-created since?). A new link, at the
                    // same hook unless another is asked for.
                    Err(_) => {
                        remove_pin(&path, "removing the stale")?;
                        defunct = Some(hook);
                    }
                }
            }
        }
        let (fd, attached) = self.attach_new(iface, want, defunct)?;
        let fd = match &self.pins {
            None => fd,
            Some(pins) => {
                let path = pins.link();
                FdLink::from(fd.pin(&path).map_err(|error| Error::PinLink { path: path.clone(), error })?)
            }
        };
        self.link =
            Some(Link { iface: iface.into(), hook: attached.mode.hook(), fd, why_tcx: attached.why_tcx.clone() });
        Ok(attached)
    }

    /// The pinned predecessor's link now runs this program: its hook and mode are the link's.
    fn took_over(&mut self, iface: &str, hook: Hook, fd: FdLink) -> Result<Attached, Error> {
        let (mode, mode_unknown, why_tcx) = match hook {
            Hook::Tcx => (AttachMode::Tcx, None, Some("kept at tcx ingress, where the pinned limiter was".to_string())),
            Hook::Xdp => match self.attach_mode() {
                Ok(recorded) if self.stale.is_none() && recorded.hook() == Hook::Xdp => (recorded, None, None),
                // The predecessor's config is not readable as ours: ask the kernel.
                _ => match xdp_program(iface) {
                    Ok(Some(p)) if p.mode == "skb" => (AttachMode::Skb, None, None),
                    Ok(_) => (AttachMode::Native, None, None),
                    Err(e) => (AttachMode::Native, Some(e.to_string()), None),
                },
            },
        };
        self.link = Some(Link { iface: iface.into(), hook, fd, why_tcx: why_tcx.clone() });
        Ok(Attached { replaced: true, mode_unknown, why_tcx, ..Attached::new(mode) })
    }

    /// A new link (not pinned yet) at the hook `want` asks for; under auto, at tcx if `keep` (the
    /// hook of a pinned link whose interface went away) says so, else XDP when it is free, tcx
    /// when another program holds it (or XDP refuses the program).
    fn attach_new(&mut self, iface: &str, want: &Placement, keep: Option<Hook>) -> Result<(FdLink, Attached), Error> {
        match (want.hook, keep) {
            (HookRequest::Xdp, _) => self.attach_xdp(iface, want.mode),
            (HookRequest::Tcx, _) => self.attach_tcx(iface, &want.tcx, "asked for (--attach tcx)".into()),
            (HookRequest::Auto, Some(Hook::Tcx)) => {
                self.attach_tcx(iface, &want.tcx, "kept at tcx ingress, where the pinned limiter was".into())
            }
            (HookRequest::Auto, Some(Hook::Xdp) | None) => {
                // Another program holds XDP: it is left alone, the limiter judges after it.
                if let Ok(Some(holder)) = xdp_program(iface) {
                    return self.attach_tcx(iface, &want.tcx, format!("another program holds XDP ({holder})"));
                }
                match self.attach_xdp(iface, want.mode) {
                    Ok(attached) => Ok(attached),
                    Err(xdp) => {
                        let why = match &xdp {
                            Error::Occupied { holder, .. } => format!("another program holds XDP ({holder})"),
                            other => format!("XDP refused the program ({})", chain(other)),
                        };
                        self.attach_tcx(iface, &want.tcx, why).map_err(|tcx| Error::NoHook {
                            iface: iface.into(),
                            xdp: chain(&xdp),
                            tcx: chain(&tcx),
                        })
                    }
                }
            }
        }
    }

    fn attach_xdp(&mut self, iface: &str, mode: ModeRequest) -> Result<(FdLink, Attached), Error> {
        self.load_hook(Hook::Xdp)?;
        let (id, attached) = self.attach_xdp_in(iface, mode).map_err(|e| match xdp_program(iface) {
            // Most often another tool's program (or a limiter under another --pin-dir): say which.
            Ok(Some(holder)) => Error::Occupied { iface: iface.into(), holder: Box::new(holder), source: Box::new(e) },
            Ok(None) | Err(_) => e,
        })?;
        let program = self.xdp_mut()?;
        let link = program.take_link(id).map_err(|source| Error::Attach {
            iface: iface.into(),
            mode: attached.mode.as_str(),
            source,
        })?;
        Ok((FdLink::try_from(link).map_err(Error::NotBpfLink)?, attached))
    }

    fn attach_xdp_in(&mut self, iface: &str, mode: ModeRequest) -> Result<(XdpLinkId, Attached), Error> {
        let first = match mode {
            ModeRequest::Auto | ModeRequest::Native => AttachMode::Native,
            ModeRequest::Skb => AttachMode::Skb,
        };
        let xdp_mode = |m| if m == AttachMode::Skb { XdpMode::Skb } else { XdpMode::Driver };
        let program = self.xdp_mut()?;
        match program.attach(iface, xdp_mode(first)) {
            Ok(id) => Ok((id, Attached::new(first))),
            Err(native_err) if mode == ModeRequest::Auto => {
                let reason = chain(&native_err);
                let id = program.attach(iface, XdpMode::Skb).map_err(|source| Error::Attach {
                    iface: iface.into(),
                    mode: "skb",
                    source,
                })?;
                Ok((id, Attached { fallback: Some(reason), ..Attached::new(AttachMode::Skb) }))
            }
            Err(source) => Err(Error::Attach { iface: iface.into(), mode: first.as_str(), source }),
        }
    }

    fn attach_tcx(&mut self, iface: &str, place: &TcxPlace, why: String) -> Result<(FdLink, Attached), Error> {
        self.load_hook(Hook::Tcx)?;
        let order = tcx::link_order(iface, place)?;
        let failed = |source| Error::Attach { iface: iface.into(), mode: "tcx", source };
        let program = self.tcx_mut()?;
        let id = program
            .attach_with_options(iface, TcAttachType::Ingress, TcAttachOptions::TcxOrder(order))
            .map_err(failed)?;
        let link = program.take_link(id).map_err(failed)?;
        let fd = FdLink::try_from(link).map_err(Error::NotBpfLink)?;
        Ok((fd, Attached { why_tcx: Some(why), ..Attached::new(AttachMode::Tcx) }))
    }

    /// Swaps this program into the pinned link `link` of `hook` (BPF_LINK_UPDATE: the hook, its
    /// mode and its place stay); the link is then held here too.
    fn swap_into(&mut self, path: &Path, hook: Hook, link: FdLink) -> Result<FdLink, Error> {
        let invalid = |error| Error::PinnedLinkInvalid { path: path.to_path_buf(), error };
        let replace = |source| Error::Attach { iface: "(pinned link)".into(), mode: "replace", source };
        match hook {
            Hook::Xdp => {
                let program = self.xdp_mut()?;
                let id = program.attach_to_link(XdpLink::try_from(link).map_err(invalid)?).map_err(replace)?;
                FdLink::try_from(program.take_link(id).map_err(replace)?).map_err(invalid)
            }
            Hook::Tcx => {
                let program = self.tcx_mut()?;
                let id =
                    program.attach_to_link(SchedClassifierLink::try_from(link).map_err(invalid)?).map_err(replace)?;
                FdLink::try_from(program.take_link(id).map_err(replace)?).map_err(invalid)
            }
        }
    }

    /// Moves the program to `hook` without a gap: verified for it first (the slow step, while
    /// one hook judges); then, under [`Config::HANDOVER`] (both hooks hold it, each packet is
    /// judged once), attached there, the new link pinned in place of the old one, the old one
    /// released; the flag is cleared once the old hook has left. Already at `hook`: nothing
    /// changes (`moved_from` is None). On a failure the program stays where it was.
    pub fn move_to(&mut self, hook: Hook, want: &Placement, why: String) -> Result<Attached, Error> {
        let Some(link) = &self.link else { return Err(Error::NotAttached) };
        let from = self.attach_mode()?;
        if link.hook == hook {
            return Ok(Attached { why_tcx: link.why_tcx.clone(), ..Attached::new(from) });
        }
        let iface = link.iface.clone();
        self.load_hook(hook)?;
        self.set_handover(true)?;
        // What the XDP program judged before it saw the flag passes tc ingress before tc judges.
        std::thread::sleep(IN_FLIGHT);
        sigkill_at("move-flagged");
        let moved = self.switch_link(&iface, hook, want, why, from);
        // The link let go of: the old one, or on a failure the new one (if it was made).
        let released = if moved.is_ok() { from.hook() } else { hook };
        let ended = self.end_handover(&iface, self.hook_program_id(released).ok().map(|p| (released, p)));
        let mut attached = moved?;
        attached.lingering = ended?;
        Ok(attached)
    }

    /// The steps of [`Limiter::move_to`] that change the hooks: attached at `hook`, the mode
    /// recorded, the new link pinned over the old one ([`pin_over`]), the old one released.
    fn switch_link(
        &mut self,
        iface: &str,
        hook: Hook,
        want: &Placement,
        why: String,
        from: AttachMode,
    ) -> Result<Attached, Error> {
        let (fd, mut attached) = match hook {
            Hook::Xdp => self.attach_xdp(iface, want.mode)?,
            Hook::Tcx => self.attach_tcx(iface, &want.tcx, why)?,
        };
        sigkill_at("move-attached");
        // Recorded before the pin names the new link, and put back if pinning fails.
        self.record_mode(attached.mode)?;
        let fd = match &self.pins {
            Some(pins) => pin_over(pins, fd).inspect_err(|_| {
                // Best effort: the error said is the pin's.
                let _ = self.record_mode(from);
            })?,
            None => fd,
        };
        sigkill_at("move-renamed");
        let old = self.link.replace(Link { iface: iface.into(), hook, fd, why_tcx: attached.why_tcx.clone() });
        // Closing the old link's last descriptor (its pin is gone) releases it.
        drop(old);
        sigkill_at("move-released");
        attached.moved_from = Some(from);
        Ok(attached)
    }

    /// Attaches again after the interface was re-created (the old link died with it), at the
    /// hook it was at; at tcx, first if the program it was placed against is not there (yet).
    /// On a failure the dead link is kept, for the next try.
    pub fn reattach(&mut self, want: &Placement) -> Result<Attached, Error> {
        let Some(link) = &self.link else { return Err(Error::NotAttached) };
        let (iface, hook) = (link.iface.clone(), link.hook);
        if let Some(pins) = &self.pins {
            remove_pin(&pins.link(), "removing the defunct")?;
        }
        let why_tcx = link.why_tcx.clone();
        // Auto may go to tcx if another program took XDP on the new interface first.
        let want = Placement {
            hook: match (hook, want.hook) {
                (Hook::Xdp, HookRequest::Auto) => HookRequest::Auto,
                (Hook::Xdp, _) => HookRequest::Xdp,
                (Hook::Tcx, _) => HookRequest::Tcx,
            },
            ..want.clone()
        };
        let (fd, mut attached) = match self.attach_new(&iface, &want, None) {
            Err(e @ (Error::NoSuchTcxProgram { .. } | Error::AmbiguousTcxProgram { .. })) => {
                let first = Placement { tcx: TcxPlace::First, ..want.clone() };
                let (fd, mut attached) = self.attach_new(&iface, &first, None)?;
                attached.fallback = Some(format!("attached first at tcx ingress: {e}"));
                (fd, attached)
            }
            other => other?,
        };
        let fd = match &self.pins {
            None => fd,
            Some(pins) => {
                let path = pins.link();
                FdLink::from(fd.pin(&path).map_err(|error| Error::PinLink { path: path.clone(), error })?)
            }
        };
        if attached.mode == AttachMode::Tcx && hook == Hook::Tcx {
            attached.why_tcx = why_tcx.or(attached.why_tcx);
        }
        let hook = attached.mode.hook();
        self.link = Some(Link { iface, hook, fd, why_tcx: attached.why_tcx.clone() });
        self.record_mode(attached.mode)?;
        Ok(attached)
    }

    /// Detaches from the interface and removes the pins: the next start begins afresh.
    /// (Dropping a `Limiter` without this leaves a pinned program attached: fail static.)
    pub fn detach(&mut self) -> Result<Option<String>, Error> {
        let Some(link) = self.link.take() else {
            return Ok(None);
        };
        // Unpinning first: then closing our descriptor destroys the link.
        if let Some(pins) = &self.pins {
            remove_pin(&pins.link(), "removing")?;
        }
        drop(link.fd);
        if let Some(pins) = &self.pins {
            pins.remove()?;
        }
        Ok(Some(link.iface))
    }

    /// The hook the program is attached at, if it is.
    pub fn hook(&self) -> Option<Hook> {
        self.link.as_ref().map(|l| l.hook)
    }

    /// Why the program runs at tcx ingress, when it does.
    pub fn why_tcx(&self) -> Option<&str> {
        self.link.as_ref().and_then(|l| l.why_tcx.as_deref())
    }

    fn record_mode(&mut self, mode: AttachMode) -> Result<(), Error> {
        let mut config = self.read_config()?;
        config.flags = (config.flags & !(Config::ATTACHED_SKB | Config::ATTACHED_TCX))
            | match mode {
                AttachMode::Native => 0,
                AttachMode::Skb => Config::ATTACHED_SKB,
                AttachMode::Tcx => Config::ATTACHED_TCX,
            };
        self.store_config(&config)
    }

    /// Pins every map in the pin directory, in place of whatever is pinned under its name.
    fn pin_maps(&mut self) -> Result<(), Error> {
        let Some(pins) = self.pins.clone() else { return Ok(()) };
        for name in map_names() {
            let path = pins.map(name);
            remove_pin(&path, "removing the replaced")?;
            self.map(name)?.pin(&path).map_err(|error| Error::PinMap { path: path.clone(), error })?;
        }
        Ok(())
    }

    /// How the program is attached: at its link's hook; at XDP, in the mode recorded in the
    /// kernel's config when the link was made (so it survives reattaching and adoption). Not
    /// attached (yet): as recorded.
    pub fn attach_mode(&self) -> Result<AttachMode, Error> {
        let flags = self.read_config()?.flags;
        let hook = self.hook().unwrap_or(if flags & Config::ATTACHED_TCX != 0 { Hook::Tcx } else { Hook::Xdp });
        Ok(match hook {
            Hook::Tcx => AttachMode::Tcx,
            Hook::Xdp if flags & Config::ATTACHED_SKB != 0 => AttachMode::Skb,
            Hook::Xdp => AttachMode::Native,
        })
    }
}

/// The link pinned at `path`, and its hook (read from the kernel's link info).
fn open_pinned(path: &Path) -> Result<(Hook, FdLink), Error> {
    let opening = |error| Error::OpenPinnedLink { path: path.to_path_buf(), error };
    let link = FdLink::from(PinnedLink::from_pin(path).map_err(opening)?);
    let hook = match link.info().and_then(|i| i.link_type()).map_err(opening)? {
        LinkType::Xdp => Hook::Xdp,
        LinkType::Tcx => Hook::Tcx,
        other => return Err(Error::PinnedLinkType { path: path.to_path_buf(), found: format!("{other:?}") }),
    };
    Ok((hook, link))
}

/// The hook and program id of the link pinned at `path`, the descriptor closed again (a held
/// descriptor would keep the link alive past its unpinning).
pub(super) fn pinned_link(path: &Path) -> Result<(Hook, u32), Error> {
    let (hook, link) = open_pinned(path)?;
    let info = link.info().map_err(|error| Error::OpenPinnedLink { path: path.to_path_buf(), error })?;
    Ok((hook, info.program_id()))
}

/// Pins `link` in place of the link pinned in `pins`: under a temporary name first, then renamed
/// over it, so the pin always names a live link. The old link's pin goes; a descriptor keeps it.
fn pin_over(pins: &PinDir, link: FdLink) -> Result<FdLink, Error> {
    let (next, path) = (pins.link_next(), pins.link());
    // On a failure the new link is dropped with its descriptor: it detaches, the old stays.
    let pinned = link.pin(&next).map_err(|error| Error::PinLink { path: next.clone(), error })?;
    sigkill_at("move-pinned");
    if let Err(error) = std::fs::rename(&next, &path) {
        let _ = std::fs::remove_file(&next);
        return Err(Error::PinFile { doing: "renaming the new link over", path, error });
    }
    Ok(FdLink::from(pinned))
}

/// Removes a pin, if it is there.
fn remove_pin(path: &Path, doing: &'static str) -> Result<(), Error> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(Error::PinFile { doing, path: path.to_path_buf(), error }),
    }
}

/// An error and its causes, each after a colon, in one line.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

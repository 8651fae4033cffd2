//! Attaching the program to an interface, at XDP or at tc ingress (through a tcx link, or a
//! netlink filter where the kernel has no tcx: `tc_api`, `tc_filter`), in place of a pinned
//! predecessor when there is one; and detaching it. Moving it from one hook to the other, and
//! what a start repairs of a move cut short: `moves`.

use std::path::Path;

use aya::programs::{
    TcAttachType, XdpMode,
    links::FdLink,
    tc::{NlOptions, SchedClassifierLink, TcAttachOptions},
    xdp::{XdpLink, XdpLinkId},
};
use limiter_common::maps::Config;

use super::{
    AttachMode, Attached, Error, Hook, HookRequest, Limiter, ModeRequest, Placement, TcReason, interface_exists,
    pinned::{Pinned, config_map_id, remove_pin},
    pins::{PinDir, map_names, xdp_program},
    tc_api::{self, ApiReason, TcApi},
    tc_filter::{self, HANDLE},
    tcx::{self, TcxPlace},
};

/// The limiter's attachment: held here, and pinned too (at [`PinDir::link`]) when it has pins,
/// so it outlives the process.
pub(super) struct Link {
    pub(super) iface: String,
    pub(super) held: Held,
    pub(super) why_tc: Option<TcReason>,
    pub(super) api_reason: Option<ApiReason>,
}

/// What attaches the program: a bpf_link (XDP or tcx), or a filter at tc ingress, which the
/// kernel holds (its handle is [`HANDLE`]; the pin is its program's).
pub(super) enum Held {
    Link { hook: Hook, fd: FdLink },
    Filter { priority: u16 },
}

impl Held {
    pub(super) fn hook(&self) -> Hook {
        match self {
            Self::Link { hook, .. } => *hook,
            Self::Filter { .. } => Hook::Tc,
        }
    }

    /// Lets go of it: a link is released with its last descriptor (its pin gone), a filter is
    /// deleted. Never on drop: a daemon that exits leaves its attachment (fail static).
    pub(super) fn release(self, iface: &str) -> Result<(), Error> {
        match self {
            Self::Link { fd, .. } => {
                drop(fd);
                Ok(())
            }
            Self::Filter { priority } => tc_filter::delete(iface, priority),
        }
    }
}

/// Where a new attachment is pinned (None: no pins), and the test hook a move calls at its steps
/// ([`crate::test_hook::sigkill_at`]; a start passes [`no_step`]).
#[derive(Clone, Copy)]
pub(super) struct Pin<'a> {
    pub(super) at: Option<&'a Path>,
    pub(super) step: fn(&str),
}

/// The steps of a start, which no test hook stops at.
pub(super) fn no_step(_: &str) {}

impl Limiter {
    /// Attaches to `iface` at XDP in `mode` ([`Limiter::attach_as`]).
    pub fn attach(&mut self, iface: &str, mode: ModeRequest) -> Result<Attached, Error> {
        self.attach_as(iface, &Placement { hook: HookRequest::Xdp, mode, ..Placement::default() })
    }

    /// Attaches to `iface` as `want` says. With pins: what a move cut short left is repaired
    /// first (`moves`); a pinned predecessor's attachment gets this program swapped in
    /// atomically (its hook, XDP mode, tc API and place stay), then an explicit hook other than
    /// that one is moved to ([`Limiter::move_to`]); otherwise a new attachment is made and pinned.
    /// A program loaded in place of one it could not adopt ([`Limiter::replaces_incompatible`])
    /// then pins its own maps where the predecessor's were.
    pub fn attach_as(&mut self, iface: &str, want: &Placement) -> Result<Attached, Error> {
        let repaired = self.repair(iface)?;
        let mut attached = self.attach_link(iface, want)?;
        if self.stale.is_some() {
            self.pin_maps()?;
        }
        // The mode the link was made in, or found in: never what a move cut short recorded.
        self.record_mode(attached.mode)?;
        let released = repaired.as_ref().and_then(|r| r.released);
        attached.lingering = self.end_handover(iface, released)?;
        attached.repaired = repaired.map(|r| r.said);
        match want.hook.explicit() {
            Some(hook) if hook != attached.mode.hook() => {
                let moved = self.move_to(hook, want, TcReason::Asked)?;
                Ok(Attached { replaced: attached.replaced, repaired: attached.repaired, ..moved })
            }
            _ => Ok(attached),
        }
    }

    fn attach_link(&mut self, iface: &str, want: &Placement) -> Result<Attached, Error> {
        if !interface_exists(iface) {
            return Err(Error::NoSuchInterface(iface.into()));
        }
        let mut defunct = None;
        if let Some(pins) = self.pins.clone() {
            let path = pins.link();
            if path.exists() {
                let pinned = Pinned::open(&path)?;
                let hook = match &pinned {
                    Pinned::Link { hook, .. } => *hook,
                    Pinned::Filter { .. } => Hook::Tc,
                };
                self.load_hook(hook)?;
                let swapped = match pinned {
                    Pinned::Link { hook, fd } => self.swap_into(&path, hook, fd).map(|fd| Held::Link { hook, fd }).ok(),
                    Pinned::Filter { program } => {
                        self.swap_filter(iface, &pins, program)?.map(|priority| Held::Filter { priority })
                    }
                };
                match swapped {
                    Some(held) => return self.took_over(iface, held),
                    // Defunct: its interface went away (re-created since?), or its filter was
                    // deleted. A new attachment, at the same hook unless another is asked for.
                    None => {
                        remove_pin(&path, "removing the stale")?;
                        defunct = Some(hook);
                    }
                }
            }
        }
        let path = self.pins.as_ref().map(PinDir::link);
        let (held, attached) = self.attach_new(iface, want, defunct, Pin { at: path.as_deref(), step: no_step })?;
        self.set_link(iface, held, &attached);
        Ok(attached)
    }

    pub(super) fn set_link(&mut self, iface: &str, held: Held, attached: &Attached) {
        let (why_tc, api_reason) = (attached.why_tc.clone(), attached.api_reason.clone());
        self.link = Some(Link { iface: iface.into(), held, why_tc, api_reason });
    }

    /// The pinned predecessor's attachment now runs this program: its hook and mode are its own.
    fn took_over(&mut self, iface: &str, held: Held) -> Result<Attached, Error> {
        let (mode, mode_unknown, why_tc, api_reason) = match &held {
            Held::Filter { .. } => {
                (AttachMode::Netlink, None, Some(TcReason::Kept), Some(tc_api::no_tcx().unwrap_or(ApiReason::Kept)))
            }
            Held::Link { hook: Hook::Tc, .. } => (AttachMode::Tcx, None, Some(TcReason::Kept), None),
            Held::Link { hook: Hook::Xdp, .. } => match self.attach_mode() {
                Ok(recorded) if self.stale.is_none() && recorded.hook() == Hook::Xdp => (recorded, None, None, None),
                // The predecessor's config is not readable as ours: ask the kernel.
                _ => match xdp_program(iface) {
                    Ok(Some(p)) if p.mode == "skb" => (AttachMode::Skb, None, None, None),
                    Ok(_) => (AttachMode::Native, None, None, None),
                    Err(e) => (AttachMode::Native, Some(e.to_string()), None, None),
                },
            },
        };
        let attached = Attached { replaced: true, mode_unknown, why_tc, api_reason, ..Attached::new(mode) };
        self.set_link(iface, held, &attached);
        Ok(attached)
    }

    /// A new attachment (pinned as `pin` says) at the hook `want` asks for; under auto, at tc
    /// ingress if `keep` (the hook of a pinned attachment that went away) says so, else XDP when
    /// it is free, tc ingress when another program holds it (or XDP refuses the program, unless
    /// `--mode native` asked for native or nothing).
    pub(super) fn attach_new(
        &mut self,
        iface: &str,
        want: &Placement,
        keep: Option<Hook>,
        pin: Pin<'_>,
    ) -> Result<(Held, Attached), Error> {
        match (want.hook, keep) {
            (HookRequest::Xdp, _) => self.attach_xdp(iface, want.mode, pin),
            (HookRequest::Tc, _) => self.attach_tc(iface, want, TcReason::Asked, pin),
            (HookRequest::Auto, Some(Hook::Tc)) => self.attach_tc(iface, want, TcReason::Kept, pin),
            (HookRequest::Auto, Some(Hook::Xdp) | None) => {
                // Another program holds XDP: it is left alone, the limiter judges after it.
                if let Ok(Some(holder)) = xdp_program(iface) {
                    return self.attach_tc(iface, want, TcReason::XdpHeld(holder.to_string()), pin);
                }
                match self.attach_xdp(iface, want.mode, pin) {
                    Ok(attached) => Ok(attached),
                    Err(xdp) => {
                        let why = match &xdp {
                            Error::Occupied { holder, .. } => TcReason::XdpHeld(holder.to_string()),
                            // Native or nothing: slower at tc ingress is not what was asked.
                            _ if want.mode == ModeRequest::Native => return Err(xdp),
                            other => TcReason::XdpRefused(chain(other)),
                        };
                        self.attach_tc(iface, want, why, pin).map_err(|tc| Error::NoHook {
                            iface: iface.into(),
                            xdp: chain(&xdp),
                            tc: chain(&tc),
                        })
                    }
                }
            }
        }
    }

    pub(super) fn attach_xdp(
        &mut self,
        iface: &str,
        mode: ModeRequest,
        pin: Pin<'_>,
    ) -> Result<(Held, Attached), Error> {
        self.load_hook(Hook::Xdp)?;
        let (id, attached) = self.attach_xdp_in(iface, mode).map_err(|e| match xdp_program(iface) {
            // Most often another tool's program (or a limiter under another --pin-dir): say which.
            Ok(Some(holder)) => Error::Occupied { iface: iface.into(), holder: Box::new(holder), source: Box::new(e) },
            Ok(None) | Err(_) => e,
        })?;
        let program = self.xdp_mut()?;
        let link = program.take_link(id).map_err(|source| Error::Attach {
            hook: Hook::Xdp,
            iface: iface.into(),
            mode: attached.mode.as_str(),
            source,
        })?;
        let fd = FdLink::try_from(link).map_err(Error::NotBpfLink)?;
        Ok((pin_link(Hook::Xdp, fd, pin)?, attached))
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
                    hook: Hook::Xdp,
                    iface: iface.into(),
                    mode: "skb",
                    source,
                })?;
                Ok((id, Attached { fallback: Some(reason), ..Attached::new(AttachMode::Skb) }))
            }
            Err(source) => Err(Error::Attach { hook: Hook::Xdp, iface: iface.into(), mode: first.as_str(), source }),
        }
    }

    /// At tc ingress, through the API `want.tc_api` gives on this kernel ([`tc_api::choose`]).
    pub(super) fn attach_tc(
        &mut self,
        iface: &str,
        want: &Placement,
        why: TcReason,
        pin: Pin<'_>,
    ) -> Result<(Held, Attached), Error> {
        self.load_hook(Hook::Tc)?;
        let (api, api_reason) = tc_api::choose(want.tc_api);
        let (held, mode) = match api {
            TcApi::Tcx => (self.attach_tcx(iface, &want.tcx, pin)?, AttachMode::Tcx),
            TcApi::Netlink => (self.attach_filter(iface, &want.tcx, pin)?, AttachMode::Netlink),
        };
        Ok((held, Attached { why_tc: Some(why), api_reason, ..Attached::new(mode) }))
    }

    fn attach_tcx(&mut self, iface: &str, place: &TcxPlace, pin: Pin<'_>) -> Result<Held, Error> {
        let order = tcx::link_order(iface, place)?;
        let failed = |source| match tc_api::no_tcx() {
            Some(why) => Error::NoTcx { iface: iface.into(), why: why.to_string() },
            None => Error::Attach { hook: Hook::Tc, iface: iface.into(), mode: "tcx", source },
        };
        let program = self.tcx_mut()?;
        let id = program
            .attach_with_options(iface, TcAttachType::Ingress, TcAttachOptions::TcxOrder(order))
            .map_err(failed)?;
        let link = program.take_link(id).map_err(failed)?;
        pin_link(Hook::Tc, FdLink::try_from(link).map_err(Error::NotBpfLink)?, pin)
    }

    /// A filter at tc ingress, at the priority `place` gives ([`tc_filter::priority_for`]), on a
    /// clsact qdisc (added if missing). Its program is pinned first: a daemon killed between the
    /// two steps leaves a pin naming a filter that is not there (the next start attaches anew),
    /// never a filter nothing names.
    fn attach_filter(&mut self, iface: &str, place: &TcxPlace, pin: Pin<'_>) -> Result<Held, Error> {
        let priority = tc_filter::priority_for(iface, place)?;
        tc_filter::ensure_clsact(iface)?;
        if let Some(path) = pin.at {
            self.tcx_mut()?.pin(path).map_err(|error| Error::PinLink { path: path.to_path_buf(), error })?;
            (pin.step)("move-pinned");
        }
        let failed = |source| Error::Attach { hook: Hook::Tc, iface: iface.into(), mode: "netlink", source };
        let program = self.tcx_mut()?;
        let options = NlOptions { priority, handle: HANDLE.into(), classid: None };
        let attached = program
            .attach_with_options(iface, TcAttachType::Ingress, TcAttachOptions::Netlink(options))
            .and_then(|id| program.take_link(id));
        match attached {
            Ok(link) => tc_filter::keep(link),
            Err(source) => {
                if let Some(path) = pin.at {
                    remove_pin(path, "removing the pin of a filter not made")?;
                }
                return Err(failed(source));
            }
        }
        (pin.step)("move-attached");
        Ok(Held::Filter { priority })
    }

    /// Swaps this program into the pinned link `link` of `hook` (BPF_LINK_UPDATE: the hook, its
    /// mode and its place stay); the link is then held here too.
    fn swap_into(&mut self, path: &Path, hook: Hook, link: FdLink) -> Result<FdLink, Error> {
        let invalid = |error| Error::PinnedLinkInvalid { path: path.to_path_buf(), error };
        let replace = |source| Error::Attach { hook, iface: "(pinned link)".into(), mode: "replace", source };
        match hook {
            Hook::Xdp => {
                let program = self.xdp_mut()?;
                let id = program.attach_to_link(XdpLink::try_from(link).map_err(invalid)?).map_err(replace)?;
                FdLink::try_from(program.take_link(id).map_err(replace)?).map_err(invalid)
            }
            Hook::Tc => {
                let program = self.tcx_mut()?;
                let id =
                    program.attach_to_link(SchedClassifierLink::try_from(link).map_err(invalid)?).map_err(replace)?;
                FdLink::try_from(program.take_link(id).map_err(replace)?).map_err(invalid)
            }
        }
    }

    /// Swaps this program into the limiter's filter at tc ingress of `iface` (the one running
    /// `program`, the pinned one, or a program using the pinned maps), in place: the same priority
    /// and handle, so no packet goes unjudged. Its priority; None if no such filter is there.
    fn swap_filter(&mut self, iface: &str, pins: &PinDir, program: u32) -> Result<Option<u16>, Error> {
        let config = config_map_id(pins);
        let ours = |f: &tc_filter::TcFilter| {
            f.handle == HANDLE && (f.program_id() == Some(program) || config.is_some_and(|c| f.uses_map(c)))
        };
        let Some(found) = tc_filter::filters(iface)?.into_iter().find(ours) else { return Ok(None) };
        let replace = |source| Error::Attach { hook: Hook::Tc, iface: iface.into(), mode: "netlink replace", source };
        let classifier = self.tcx_mut()?;
        // Built where it is used: dropped, the link would delete the filter.
        let id = match SchedClassifierLink::attached(iface, TcAttachType::Ingress, found.priority, HANDLE.into(), None)
        {
            Ok(link) => classifier.attach_to_link(link).map_err(replace)?,
            Err(_) => return Ok(None),
        };
        tc_filter::keep(classifier.take_link(id).map_err(replace)?);
        // The pin names the program the filter runs now: pinned beside, renamed over.
        let next = pins.link_next();
        classifier.pin(&next).map_err(|error| Error::PinLink { path: next.clone(), error })?;
        std::fs::rename(&next, pins.link()).map_err(|error| Error::PinFile {
            doing: "renaming the new program's pin over",
            path: pins.link(),
            error,
        })?;
        Ok(Some(found.priority))
    }

    /// Detaches from the interface and removes the pins: the next start begins afresh.
    /// (Dropping a `Limiter` without this leaves a pinned program attached: fail static.)
    pub fn detach(&mut self) -> Result<Option<String>, Error> {
        let Some(link) = self.link.take() else {
            return Ok(None);
        };
        // A filter goes first (a pin naming none is harmless); a link is unpinned first, then
        // closing our descriptor destroys it.
        if let Held::Filter { priority } = link.held {
            tc_filter::delete(&link.iface, priority)?;
        }
        if let Some(pins) = &self.pins {
            remove_pin(&pins.link(), "removing")?;
        }
        drop(link.held);
        if let Some(pins) = &self.pins {
            pins.remove()?;
        }
        Ok(Some(link.iface))
    }

    /// The hook the program is attached at, if it is.
    pub fn hook(&self) -> Option<Hook> {
        self.link.as_ref().map(|l| l.held.hook())
    }

    /// Why the program runs at tc ingress, when it does.
    pub fn why_tc(&self) -> Option<&TcReason> {
        self.link.as_ref().and_then(|l| l.why_tc.as_ref())
    }

    /// Why it runs there through netlink rather than tcx, when it does.
    pub fn api_reason(&self) -> Option<&ApiReason> {
        self.link.as_ref().and_then(|l| l.api_reason.as_ref())
    }

    /// The limiter's filter at tc ingress, if it is attached through one and the filter is not
    /// there running its program any more (deleted by another tool: `tc qdisc del ... clsact`):
    /// what is at its priority instead, in words. None while it is there, or unknown.
    pub fn filter_gone(&self) -> Option<String> {
        let link = self.link.as_ref()?;
        let Held::Filter { priority } = link.held else { return None };
        let program = self.hook_program_id(Hook::Tc).ok()?;
        let filters = tc_filter::dump(&link.iface).ok()?;
        match filters.iter().find(|f| f.priority == priority && f.handle == HANDLE) {
            Some(f) if f.program == Some(program) => None,
            Some(other) => Some(match other.program {
                Some(id) => format!("priority {priority} handle {HANDLE:#x} runs program id {id}"),
                None => format!("priority {priority} handle {HANDLE:#x} runs no BPF program"),
            }),
            None => Some(format!("nothing at priority {priority} handle {HANDLE:#x}")),
        }
    }

    pub(super) fn record_mode(&mut self, mode: AttachMode) -> Result<(), Error> {
        let mut config = self.read_config()?;
        config.flags = (config.flags & !(Config::ATTACHED_SKB | Config::ATTACHED_TCX))
            | match mode {
                AttachMode::Native => 0,
                AttachMode::Skb => Config::ATTACHED_SKB,
                AttachMode::Tcx | AttachMode::Netlink => Config::ATTACHED_TCX,
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

    /// How the program is attached: at tc ingress, as its attachment is (a tcx link or a
    /// filter); at XDP, in the mode recorded in the kernel's config when the link was made (so it
    /// survives reattaching and adoption). Not attached (yet): as recorded.
    pub fn attach_mode(&self) -> Result<AttachMode, Error> {
        let flags = self.read_config()?.flags;
        let xdp = if flags & Config::ATTACHED_SKB != 0 { AttachMode::Skb } else { AttachMode::Native };
        Ok(match self.link.as_ref().map(|l| &l.held) {
            Some(Held::Filter { .. }) => AttachMode::Netlink,
            Some(Held::Link { hook: Hook::Tc, .. }) => AttachMode::Tcx,
            Some(Held::Link { hook: Hook::Xdp, .. }) => xdp,
            None if flags & Config::ATTACHED_TCX != 0 => AttachMode::Tcx,
            None => xdp,
        })
    }
}

/// A new link at `hook`, pinned where `pin` says (between the two steps, the daemon alone holds
/// it: killed there, it goes with the daemon).
fn pin_link(hook: Hook, fd: FdLink, pin: Pin<'_>) -> Result<Held, Error> {
    (pin.step)("move-attached");
    let fd = match pin.at {
        None => fd,
        Some(path) => FdLink::from(fd.pin(path).map_err(|error| Error::PinLink { path: path.to_path_buf(), error })?),
    };
    if pin.at.is_some() {
        (pin.step)("move-pinned");
    }
    Ok(Held::Link { hook, fd })
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

//! Moving the program from one hook to the other without a gap, attaching it again when its
//! interface was re-created, and what a start repairs of a move cut short.
//!
//! A move pins its new attachment beside the old one (`link_next`), renames it over `link`, then
//! lets go of the old one. A link held only by the daemon's descriptor dies with the daemon; a
//! filter at tc ingress does not (the kernel holds it). So the next start removes a `link_next`
//! it finds, and, when `link` is a link (XDP or tcx), deletes any filter of this limiter's at tc
//! ingress (whose program uses its pinned maps): a move to tc ingress cut short before its rename,
//! or one from there cut short before it deleted the filter, left it.

use super::{
    AttachMode, Attached, Error, Hook, HookRequest, Limiter, Placement, TcReason,
    attach::{Pin, no_step},
    handover::IN_FLIGHT,
    pinned::{Pinned, PinnedAt, config_map_id, remove_pin},
    pins::PinDir,
    tc_filter,
    tcx::TcxPlace,
};
use crate::test_hook::sigkill_at;

/// What a start repaired of a move cut short: in a sentence, and the hook and program let go of
/// (to wait for it to leave before the hand-over flag is cleared).
pub(super) struct Repaired {
    pub(super) said: String,
    pub(super) released: Option<(Hook, u32)>,
}

impl Limiter {
    /// Moves the program to `hook` without a gap: verified for it first (the slow step, while
    /// one hook judges); then, under [`Config::HANDOVER`](limiter_common::maps::Config::HANDOVER)
    /// (both hooks hold it, each packet is judged once), attached there, the new attachment
    /// pinned in place of the old one, the old one released; the flag is cleared once the old
    /// hook has left. Already at `hook`: nothing changes (`moved_from` is None). On a failure the
    /// program stays where it was.
    pub fn move_to(&mut self, hook: Hook, want: &Placement, why: TcReason) -> Result<Attached, Error> {
        let Some(link) = &self.link else { return Err(Error::NotAttached) };
        let from = self.attach_mode()?;
        if link.held.hook() == hook {
            let (why_tc, api_reason) = (link.why_tc.clone(), link.api_reason.clone());
            return Ok(Attached { why_tc, api_reason, ..Attached::new(from) });
        }
        let iface = link.iface.clone();
        self.load_hook(hook)?;
        self.set_handover(true)?;
        // What the XDP program judged before it saw the flag passes tc ingress before tc judges.
        std::thread::sleep(IN_FLIGHT);
        sigkill_at("move-flagged");
        let moved = self.switch_link(&iface, hook, want, why, from);
        // The hook let go of: the old one, or on a failure the new one (if it was attached).
        let released = if moved.is_ok() { from.hook() } else { hook };
        let ended = self.end_handover(&iface, self.hook_program_id(released).ok().map(|p| (released, p)));
        let mut attached = moved?;
        attached.lingering = ended?;
        Ok(attached)
    }

    /// The steps of [`Limiter::move_to`] that change the hooks: attached at `hook` and pinned at
    /// `link_next` (a link is attached first, a filter's program pinned first), the mode recorded,
    /// renamed over `link`, the old attachment released.
    fn switch_link(
        &mut self,
        iface: &str,
        hook: Hook,
        want: &Placement,
        why: TcReason,
        from: AttachMode,
    ) -> Result<Attached, Error> {
        let pins = self.pins.clone();
        let next = pins.as_ref().map(PinDir::link_next);
        let pin = Pin { at: next.as_deref(), step: sigkill_at };
        let (held, mut attached) = match hook {
            Hook::Xdp => self.attach_xdp(iface, want.mode, pin)?,
            Hook::Tc => self.attach_tc(iface, want, why, pin)?,
        };
        // Recorded before the pin names the new attachment, and put back if that fails.
        let named = self.record_mode(attached.mode).and_then(|()| match &pins {
            Some(pins) => std::fs::rename(pins.link_next(), pins.link()).map_err(|error| Error::PinFile {
                doing: "renaming the new attachment over",
                path: pins.link(),
                error,
            }),
            None => Ok(()),
        });
        if let Err(e) = named {
            // Best effort: the error said is the first one.
            let _ = self.record_mode(from);
            let _ = held.release(iface);
            if let Some(next) = &next {
                let _ = remove_pin(next, "removing the new attachment's");
            }
            return Err(e);
        }
        sigkill_at("move-renamed");
        let old = self.link.take();
        self.set_link(iface, held, &attached);
        // The old attachment's pin is gone: closing a link's last descriptor releases it, a filter
        // is deleted (when that fails, end_handover finds it still there and says so).
        if let Some(old) = old {
            let _ = old.held.release(iface);
        }
        sigkill_at("move-released");
        attached.moved_from = Some(from);
        Ok(attached)
    }

    /// Attaches again after the interface was re-created (the old attachment died with it), or
    /// its filter was deleted, at the hook it was at; at tc ingress, first if the program it was
    /// placed against is not there (yet). On a failure the dead attachment is kept, for the next
    /// try.
    pub fn reattach(&mut self, want: &Placement) -> Result<Attached, Error> {
        let Some(link) = &self.link else { return Err(Error::NotAttached) };
        let (iface, hook) = (link.iface.clone(), link.held.hook());
        if let Some(pins) = &self.pins {
            remove_pin(&pins.link(), "removing the defunct")?;
        }
        let why_tc = link.why_tc.clone();
        // Auto may go to tc ingress if another program took XDP on the new interface first.
        let want = Placement {
            hook: match (hook, want.hook) {
                (Hook::Xdp, HookRequest::Auto) => HookRequest::Auto,
                (Hook::Xdp, _) => HookRequest::Xdp,
                (Hook::Tc, _) => HookRequest::Tc,
            },
            ..want.clone()
        };
        let path = self.pins.as_ref().map(PinDir::link);
        let pin = || Pin { at: path.as_deref(), step: no_step };
        let (held, mut attached) = match self.attach_new(&iface, &want, None, pin()) {
            Err(e) if e.is_bad_input() => {
                let first = Placement { tcx: TcxPlace::First, ..want.clone() };
                let (held, mut attached) = self.attach_new(&iface, &first, None, pin())?;
                attached.fallback = Some(format!("attached first at tc ingress: {e}"));
                (held, attached)
            }
            other => other?,
        };
        if attached.mode.hook() == Hook::Tc && hook == Hook::Tc {
            attached.why_tc = why_tc.or(attached.why_tc);
        }
        self.set_link(&iface, held, &attached);
        self.record_mode(attached.mode)?;
        Ok(attached)
    }

    /// Repairs what a move cut short left ([module docs](self)): a `link_next` is removed (the
    /// move is undone: the program stays where `link` is); at a link, this limiter's filters at
    /// tc ingress are deleted.
    pub(super) fn repair(&self, iface: &str) -> Result<Option<Repaired>, Error> {
        let Some(pins) = &self.pins else { return Ok(None) };
        let current = Pinned::read(&pins.link()).ok();
        let mut repaired = None;
        let next = pins.link_next();
        if next.exists() {
            let found = Pinned::read(&next).ok();
            remove_pin(&next, "removing the unfinished move's")?;
            // Beside a filter's program, a program pinned there was an adoption's, not a move's.
            if let Some(found) = found.filter(|f| !(f.filter && current.is_some_and(|c| c.filter))) {
                let hook = found.hook;
                let what = if found.filter { "filter" } else { "link" };
                repaired = Some(Repaired {
                    said: format!(
                        "a move to {hook} was cut short (its daemon killed half way): undone, its {what} at {hook} \
                         removed; `limiter-ctl attach {hook}` moves the program"
                    ),
                    released: (!found.filter).then_some((hook, found.program)),
                });
            }
        }
        let Some(at @ PinnedAt { filter: false, .. }) = current else { return Ok(repaired) };
        let Some(config) = config_map_id(pins) else { return Ok(repaired) };
        let left = tc_filter::filters(iface).unwrap_or_default().into_iter().filter(|f| f.uses_map(config));
        for filter in left.filter(|f| f.handle == tc_filter::HANDLE) {
            tc_filter::delete(iface, filter.priority)?;
            let said = format!(
                "a move between XDP and tc ingress was cut short (its daemon killed half way): the filter it left at \
                 tc ingress ({filter}) was removed; the program is at {}",
                at.hook
            );
            let released = filter.program_id().map(|p| (Hook::Tc, p));
            match &mut repaired {
                Some(r) => r.released = r.released.or(released),
                None => repaired = Some(Repaired { said, released }),
            }
        }
        Ok(repaired)
    }
}

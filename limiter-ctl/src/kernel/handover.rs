//! Both hooks at once, judging each packet once. A move between XDP and tc ingress attaches the
//! new hook before it lets go of the old one, so for a moment both hold the program; and a move
//! cut short (the daemon killed between its steps) can leave both links pinned until the next
//! start. Under [`Config::HANDOVER`] the XDP program marks what it judges (in the packet's
//! metadata) and the tc program lets marked packets by: the buckets are shared, so a packet is
//! charged once whichever hooks run. The flag is set before the second hook is attached and
//! cleared once the hook let go of has left (its link is freed a moment after its last
//! reference).
//!
//! The next start repairs what a move cut short left (`moves`): the new attachment, pinned
//! beside the old one (`link_next`) before it was renamed over it, is removed (the move is
//! undone: the program stays where its link was), a filter of the limiter's left at tc ingress
//! beside a link is deleted, and once what was let go of has left its hook the flag is cleared.

use std::time::{Duration, Instant};

use limiter_common::maps::Config;

use super::{Error, Hook, Limiter, pins::xdp_program, tc_filter, tcx};

/// How long a released link may take to leave its hook (the kernel frees it from a workqueue).
pub(super) const RELEASE: Duration = Duration::from_secs(2);

/// How long a packet the XDP program passed may still be on its way to tc ingress (a CPU's
/// backlog): the flag is set that long before the second hook is attached, and stays set that
/// long after the released hook has left.
pub(super) const IN_FLIGHT: Duration = Duration::from_millis(50);

impl Limiter {
    /// Whether [`Config::HANDOVER`] is set.
    pub(super) fn in_handover(&self) -> Result<bool, Error> {
        Ok(self.read_config()?.flags & Config::HANDOVER != 0)
    }

    /// Sets or clears [`Config::HANDOVER`].
    pub(super) fn set_handover(&mut self, on: bool) -> Result<(), Error> {
        let mut config = self.read_config()?;
        config.flags = if on { config.flags | Config::HANDOVER } else { config.flags & !Config::HANDOVER };
        self.store_config(&config)
    }

    /// Ends a hand-over: once `released` (a hook and the program its link ran) has left
    /// `iface`, and what it marked has had time to pass, clears [`Config::HANDOVER`]. If it is
    /// still there after [`RELEASE`] (another process holds its link), the flag stays set, so
    /// the two hooks still judge each packet once; says so.
    pub(super) fn end_handover(&mut self, iface: &str, released: Option<(Hook, u32)>) -> Result<Option<String>, Error> {
        if let Some((hook, program)) = released
            && !wait_left(iface, hook, program)
        {
            return Ok(Some(format!(
                "the released {hook} attachment (program id {program}) is still on {iface}: a process holds its link \
                 (`bpftool link` shows it), or its filter could not be deleted (`tc filter show dev {iface} ingress`); \
                 both hooks run, each packet judged once (the XDP program marks what it judged)"
            )));
        }
        if self.in_handover()? {
            std::thread::sleep(IN_FLIGHT);
            self.set_handover(false)?;
        }
        Ok(None)
    }
}

/// Waits (at most [`RELEASE`]) until program `id` is not at `hook` of `iface`; whether it left.
/// A question the kernel does not answer counts as gone: the flag cannot stay set for good on
/// a guess.
pub(super) fn wait_left(iface: &str, hook: Hook, id: u32) -> bool {
    let start = Instant::now();
    loop {
        let there = match hook {
            Hook::Xdp => xdp_program(iface).is_ok_and(|p| p.is_some_and(|p| p.id == id)),
            Hook::Tc => {
                tcx::programs(iface).is_ok_and(|chain| chain.iter().any(|p| p.id == id))
                    || tc_filter::filters(iface).is_ok_and(|f| f.iter().any(|f| f.program_id() == Some(id)))
            }
        };
        if !there {
            return true;
        }
        if start.elapsed() >= RELEASE {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

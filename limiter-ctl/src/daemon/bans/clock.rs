//! The one clock of bans: `CLOCK_MONOTONIC`, the kernel's (`bpf_ktime_get_ns`), which no one
//! can step. A ban's deadline is a point on it, the same number in the daemon, in its files and
//! in the kernel's entry, so expiry, the sweep and the time `list` shows agree, whatever the
//! wall clock does: it is not read for expiry at all.
//!
//! The monotonic clock starts again at each boot, so the files say which boot their deadlines
//! are on (a [`Stamp`]). Within that boot they stand as written, across any number of daemon
//! restarts. Across a reboot nothing links the two clocks but the wall clock: a ban keeps the
//! time it had left at the stamp, less the wall-clock time since, and never more than it had
//! left (a wall clock set back cannot lengthen it; one set forward can only shorten it).

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::kernel;

/// The kernel's boot id (a random UUID drawn at each boot).
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// Now, on the ban clock (monotonic ns).
pub(super) fn now_ns() -> u64 {
    kernel::monotonic_ns()
}

/// Now, on the wall clock (ms since the Unix epoch): for display, and to cross a reboot.
pub(super) fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Which boot a file's deadlines are on, and where both clocks stood when it was written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Stamp {
    pub boot_id: String,
    pub mono_ns: u64,
    pub wall_ms: u64,
}

impl Stamp {
    pub fn now() -> Self {
        let boot_id = std::fs::read_to_string(BOOT_ID).map(|s| s.trim().to_string()).unwrap_or_default();
        Self { boot_id, mono_ns: now_ns(), wall_ms: wall_ms() }
    }

    /// `deadline`, a point on the clock of the boot this stamp was taken in, on the clock of
    /// `here` (now). An unknown boot id is never taken for this boot.
    pub fn carry(&self, deadline: u64, here: &Stamp) -> u64 {
        if !self.boot_id.is_empty() && self.boot_id == here.boot_id {
            return deadline;
        }
        let left_ns = deadline.saturating_sub(self.mono_ns);
        let since_ns = here.wall_ms.saturating_sub(self.wall_ms).saturating_mul(1_000_000);
        here.mono_ns.saturating_add(left_ns.saturating_sub(since_ns))
    }
}

/// A wall-clock expiry (ms since the epoch, as the files of version 1 kept them) on the ban
/// clock of `here`: read once, at the upgrade from such a file.
pub(super) fn from_wall(expires_ms: u64, here: &Stamp) -> u64 {
    here.mono_ns.saturating_add(expires_ms.saturating_sub(here.wall_ms).saturating_mul(1_000_000))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(boot: &str, mono_s: u64, wall_s: u64) -> Stamp {
        Stamp { boot_id: boot.into(), mono_ns: mono_s * 1_000_000_000, wall_ms: wall_s * 1000 }
    }

    const S: u64 = 1_000_000_000;

    /// Within a boot a deadline stands, whatever the wall clock says; across a reboot the time
    /// left at the stamp less the wall-clock time since, never more than was left.
    #[test]
    fn deadlines_cross_restarts_as_written_and_reboots_by_time_left() {
        let then = stamp("a", 100, 1_000_000);
        // Same boot: as written, even with the wall clock stepped an hour either way.
        for wall in [1_000_000 - 3600, 1_000_000, 1_000_000 + 3600] {
            assert_eq!(then.carry(700 * S, &stamp("a", 200, wall)), 700 * S);
        }
        // Another boot, 60 s of wall clock later: 600 s were left, 540 s are.
        assert_eq!(then.carry(700 * S, &stamp("b", 5, 1_000_060)), 545 * S);
        // The wall clock set back across the reboot: no more than was left.
        assert_eq!(then.carry(700 * S, &stamp("b", 5, 1_000_000 - 3600)), 605 * S);
        // Set far forward: expired (now).
        assert_eq!(then.carry(700 * S, &stamp("b", 5, 2_000_000)), 5 * S);
        // An unknown boot id is another boot.
        assert_eq!(stamp("", 100, 1_000_000).carry(700 * S, &stamp("", 5, 1_000_000)), 605 * S);
    }

    #[test]
    fn a_wall_clock_expiry_becomes_its_time_left() {
        let here = stamp("a", 10, 1_000);
        assert_eq!(from_wall(1_030_000, &here), 40 * S);
        assert_eq!(from_wall(0, &here), 10 * S, "past: now");
        assert_eq!(from_wall(u64::MAX, &here), u64::MAX, "saturates (refused later as too long)");
    }
}

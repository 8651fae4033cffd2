//! The verdict for a packet once its policy and bucket are known, and the counting of it.

use limiter_common::maps::{Counters, MAX_FRAME_WEIGHT, Policy};

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Admit,
    Refuse,
    /// Dry-run: would have been refused, passes.
    WouldRefuse,
}

#[inline(always)]
pub fn decide(policy: &Policy, tat: &mut u64, now_ns: u64, frame_len: u64) -> Verdict {
    let weight = if policy.flags & Policy::BYTES != 0 {
        if frame_len > MAX_FRAME_WEIGHT { MAX_FRAME_WEIGHT } else { frame_len }
    } else {
        1
    };
    if policy.gcra.admit(tat, now_ns, weight) {
        Verdict::Admit
    } else if policy.flags & Policy::DRY_RUN != 0 {
        Verdict::WouldRefuse
    } else {
        Verdict::Refuse
    }
}

#[inline(always)]
pub fn count(c: &mut Counters, verdict: Verdict, frame_len: u64) {
    match verdict {
        Verdict::Admit => {
            c.admitted_packets += 1;
            c.admitted_bytes += frame_len;
        }
        Verdict::Refuse => {
            c.refused_packets += 1;
            c.refused_bytes += frame_len;
        }
        Verdict::WouldRefuse => {
            c.dry_run_packets += 1;
            c.dry_run_bytes += frame_len;
        }
    }
}

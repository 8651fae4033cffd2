//! The verdict for a packet once its policy and bucket are known, and the counting of it.

use limiter_common::{
    maps::{Counters, MAX_FRAME_WEIGHT, Policy},
    rows::{MAX_ROWS, judge_rows, judge_rows_by},
};

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Admit,
    Refuse,
    /// Dry-run: would have been refused, passes.
    WouldRefuse,
}

/// Judges a packet of `frame_len` bytes against the source's buckets, one in each of `rows`
/// rows (see `limiter_common::rows`; one row is `limiter_common::gcra`'s single bucket).
/// Returns the verdict and each row's new value, if it changes. `claim(id)` is policy `id`'s
/// claim now (`limiter_common::gcra::claim`).
#[inline(always)]
pub fn decide(
    policy: &Policy,
    values: &[u64; MAX_ROWS],
    rows: usize,
    now_ns: u64,
    frame_len: u64,
    claim: impl Fn(u8) -> u64,
) -> (Verdict, [Option<u64>; MAX_ROWS]) {
    decide_units(policy, values, rows, now_ns, weight(policy, frame_len), claim)
}

/// What a frame of `frame_len` bytes weighs under `policy`: its length (capped) for a byte
/// policy, else 1.
#[inline(always)]
pub fn weight(policy: &Policy, frame_len: u64) -> u64 {
    if policy.flags & Policy::BYTES != 0 {
        if frame_len > MAX_FRAME_WEIGHT { MAX_FRAME_WEIGHT } else { frame_len }
    } else {
        1
    }
}

/// [`decide`] for `weight` units at once (an aggregate's lease reserves several).
#[inline(always)]
pub fn decide_units(
    policy: &Policy,
    values: &[u64; MAX_ROWS],
    rows: usize,
    now_ns: u64,
    weight: u64,
    claim: impl Fn(u8) -> u64,
) -> (Verdict, [Option<u64>; MAX_ROWS]) {
    // Policy ids are below MAX_POLICIES (256): they fit a bucket's owner byte.
    let j = judge_rows(&policy.gcra, policy.id as u8, values, rows, now_ns, weight, claim);
    (if j.admit { Verdict::Admit } else { refusal(policy) }, j.store)
}

/// [`decide_units`] with each row's new value written over `values` where it changes, each
/// row's credible distance ahead from `ahead(value)` (`rows::judge_rows_by`): the verdict.
#[inline(always)]
pub fn decide_in_place(
    policy: &Policy,
    values: &mut [u64; MAX_ROWS],
    rows: usize,
    now_ns: u64,
    weight: u64,
    ahead: impl Fn(u64) -> u64,
) -> Verdict {
    // Policy ids are below MAX_POLICIES (256): they fit a bucket's owner byte.
    if judge_rows_by(&policy.gcra, policy.id as u8, values, rows, now_ns, weight, ahead) {
        Verdict::Admit
    } else {
        refusal(policy)
    }
}

/// The verdict for a packet the policy refuses (dry-run: would refuse).
#[inline(always)]
pub fn refusal(policy: &Policy) -> Verdict {
    if policy.flags & Policy::DRY_RUN != 0 { Verdict::WouldRefuse } else { Verdict::Refuse }
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

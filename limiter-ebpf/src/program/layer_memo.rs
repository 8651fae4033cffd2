//! The layered route's memo: each CPU's last layered refusal that wrote nothing, and how long it
//! stands. A flood that one layer refuses (a source past its own rate, or a spread flood past an
//! aggregate's cap) is refused again in the main program, without the tail call into
//! `limiter_layers` and without judging the layers before it, as the one-policy path's key memo
//! does (`limiter_ebpf::memo`): the same standing refusal, checked against the tick counter or
//! the precise clock.
//!
//! Why the verdict is the full judgement's: a packet passes only if every layer it meets admits
//! it, so a layer whose refusal stands drops it, whatever the others say. The memo serves a
//! packet only when the refusing layer `L` would judge it now: the same layer set, `L` still in
//! it at the same place, active, its predicates holding (userspace lets no more than
//! `MAX_LAYERS` meet one packet, so `layers::pick` takes it), the same key under the same salt,
//! parameters and bucket geometry. `L`'s rows only move forward meanwhile (a refusal writes
//! nothing; an admission, of this CPU or another, only raises a row, with a TAT its writer's
//! claim covers), so a refusal that stood on its reading stands until its end.
//!
//! What it counts: the refusal under `L`, and nothing under the layers before it, which it does
//! not judge. A full judgement counts a refusal under the first layer that refuses and
//! "overruled" under those before it, which admitted; whether they would admit now, the memo
//! cannot say without judging them (a source past its own rate under a spent aggregate: the
//! full judgement counts it the per-source layer's). So verdicts, admissions and the total of
//! refusals are the full judgement's; which layer a refusal is counted under, and "overruled",
//! are of the layers that judged it (docs/DESIGN.md, Layers).

use aya_ebpf::helpers::bpf_ktime_get_ns;
use limiter_common::maps::{Config, MAX_CANDIDATES, Policy};
use limiter_ebpf::{
    decide::{Verdict, count},
    key::key_words,
    memo::{self, KeyMemo, Shortcuts},
    parse::Packet,
};

use super::{CONFIG, LAYER_MEMO, LAYER_SETS, LAYER_TASK, POLICIES, act, buckets, policy::predicates_hold};

/// The last layered refusal on this CPU: the refusing layer's key memo (its key, hash, salt and
/// how long the refusal stands), the layer set and the layer.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct LayerMemo {
    pub key: KeyMemo,
    /// The layer set's index in `LAYER_SETS` (the route without `LAYERED`).
    pub set: u32,
    /// The refusing layer's policy id, and its index among the set's candidates.
    pub id: u32,
    pub at: u32,
    _pad: u32,
}

// docs/DESIGN.md's map table gives its size.
const _: () = assert!(core::mem::size_of::<LayerMemo>() == 128);

/// Whether the memo's standing refusal drops `pkt`, routed to layer set `set`: then it is
/// counted (under the refusing layer) and sampled.
#[inline(always)]
pub fn refused<S: Shortcuts>(cfg: &Config, pkt: &Packet, set: u16, frame_len: u64) -> bool {
    if !S::key_memo() {
        return false;
    }
    let Some(m) = LAYER_MEMO.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: a map value, valid for the program's run; only this CPU touches it.
    let m = unsafe { &mut *m };
    let set = u32::from(set);
    if m.key.refused_until_ns == 0 || m.set != set {
        return false;
    }
    let (Some(policy), Some(candidates)) = (POLICIES.get(m.id), LAYER_SETS.get(set)) else {
        return false;
    };
    let candidates = &candidates.ids;
    let at = (m.at as usize) & (MAX_CANDIDATES - 1);
    if candidates[at] != policy.id || policy.flags & Policy::ACTIVE == 0 || !predicates_hold(policy, pkt) {
        return false;
    }
    let words = key_words(pkt, policy);
    if m.key.get(&cfg.salts[(cfg.generation & 1) as usize], pkt.family, &words).is_none() {
        return false;
    }
    let host = policy.flags & Policy::SCOPE_HOST != 0;
    if !memo::refusal_stands::<S>(&mut m.key, cfg, policy, buckets::memo_rows(cfg, host), host) {
        return false;
    }
    // Counted under the one layer judged: the layers before it were not, and count nothing.
    act::bump(u32::from(policy.id), |c| count(c, Verdict::Refuse, frame_len));
    act::sample(cfg, pkt, policy, Verdict::Refuse);
    true
}

/// Records a refusal by layer `policy` of the task in this CPU's `LAYER_TASK` that wrote
/// nothing (its look's, or its commit's), its key's `hash` under the current salt.
#[inline(always)]
pub fn remember(policy: &Policy, hash: u64) {
    layer_memo_remember(u64::from(policy.id), hash);
}

/// [`remember`], out of line: a global function, which the verifier walks once, rather than
/// once for each state of each of its two callers. The rows are read again, then the clock, as
/// `memo::remember` wants them (they can only have moved forward since the judgement); a
/// refusal that cannot be said to stand (a rotation's grace, a byte policy, a row beyond the
/// window, a lost race rather than a refusal) records none.
#[inline(never)]
#[unsafe(no_mangle)]
extern "C" fn layer_memo_remember(id: u64, hash: u64) -> u64 {
    let (Some(m), Some(t), Some(cfg)) = (LAYER_MEMO.get_ptr_mut(0), LAYER_TASK.get(0), CONFIG.get(0)) else {
        return 0;
    };
    // SAFETY: a map value, valid for the program's run; only this CPU touches it.
    let m = unsafe { &mut *m };
    m.key.refused_until_ns = 0;
    let Some(policy) = POLICIES.get((id & 0xff) as u32) else {
        return 0;
    };
    let host = policy.flags & Policy::SCOPE_HOST != 0;
    let Some(at) = index_in(t.set, policy.id) else {
        return 0;
    };
    let Some(values) = buckets::key_rows(cfg, policy, hash) else {
        return 0;
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let words = key_words(&t.pkt, policy);
    m.key.set(&cfg.salts[(cfg.generation & 1) as usize], t.pkt.family, &words, hash);
    memo::remember(&mut m.key, cfg, policy, &values, buckets::memo_rows(cfg, host), now, Verdict::Refuse, host);
    m.set = t.set;
    m.id = u32::from(policy.id);
    m.at = at;
    0
}

/// Policy `id`'s index among the candidates of layer set `set`.
#[inline(always)]
fn index_in(set: u32, id: u16) -> Option<u32> {
    let candidates = &LAYER_SETS.get(set)?.ids;
    let mut i = 0;
    while i < MAX_CANDIDATES {
        if candidates[i] == id {
            return Some(i as u32);
        }
        i += 1;
    }
    None
}

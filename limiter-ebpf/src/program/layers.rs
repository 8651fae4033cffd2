//! Layers: a packet whose route is a layer set is judged by every candidate whose predicates
//! hold (at most `MAX_LAYERS`, in the set's order), and passes only if each admits it. A
//! refusal charges no layer that admitted: the layers are first judged without a write, and
//! only when none refuses are the admitting ones written, host-scope layers first (by
//! compare-and-exchange, which may find its bucket changed since the look), then per-CPU ones
//! (only this CPU writes them: the values their look computed). A host-scope layer that loses its race and now refuses leaves
//! the layers written before it charged for a packet that was dropped: at most one charge per
//! layer per lost race (docs/DESIGN.md, Layers).
//!
//! The judgement runs in its own program, `limiter_layers` (`limiter_lay_tcx` at tc), reached by a tail call (`JUMPS`, `JUMPS_TCX`),
//! one layer's look or one host-scope layer's commit per run, the packet and what was decided so far in this CPU's
//! `LAYER_TASK`: the verifier walks one judgement per program, where one program walking them
//! all (one inlined judgement per layer and step) goes past its million instructions and its
//! 512 bytes of stack.

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    helpers::bpf_ktime_get_ns,
};
use limiter_common::{
    maps::{Config, LAYER_TASK_BYTES, MAX_CANDIDATES, MAX_LAYERS, Policy},
    rows::MAX_ROWS,
};
use limiter_ebpf::{
    decide::{Verdict, count, refusal},
    key::key_words,
    memo,
    parse::Packet,
};

use super::{
    CONFIG, Hook, LAYER_HASHES, LAYER_SETS, LAYER_TASK, POLICIES, act, buckets, layer_memo, policy::predicates_hold,
};

/// The packet handed to `limiter_layers`, and what its runs have decided so far, in this CPU's
/// slot of `LAYER_TASK` (pinned with the other maps, so a program of the next daemon that
/// takes over `JUMPS` reads what this one wrote).
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Task {
    pub pkt: Packet,
    pub frame_len: u64,
    /// The clock at the first look: per-CPU layers are judged by it (only this CPU writes
    /// their buckets, and an earlier clock only admits less).
    pub now: u64,
    /// The layer set's index in `LAYER_SETS`.
    pub set: u32,
    /// Layers that judge the packet (set by the first run).
    pub n: u32,
    /// The first layer that refused; `MAX_LAYERS`: none.
    pub refused: u32,
    /// The next run's step: `0..n` looks at layer `step`; from `n`, the commit of the
    /// `step - n`th host-scope layer of `order`.
    pub step: u32,
    /// Each layer's key hash, policy id and verdict (`ADMIT`, `REFUSE`, `WOULD_REFUSE`).
    pub hashes: [u64; MAX_LAYERS],
    pub ids: [u16; MAX_LAYERS],
    pub verdicts: [u8; MAX_LAYERS],
    /// The host-scope layers that admitted, in order: each commits by compare-and-exchange.
    pub order: [u8; MAX_LAYERS],
    /// How many of `order` there are.
    pub hosts: u32,
    /// Per-CPU layers: which rows their look would write (bit per row), the rows' buckets and
    /// their new values, written when the packet passes.
    pub rows_written: [u32; MAX_LAYERS],
    pub rows_idx: [[u32; MAX_ROWS]; MAX_LAYERS],
    pub rows_val: [[u64; MAX_ROWS]; MAX_LAYERS],
}

// Userspace checks the pinned map's value size against this.
const _: () = assert!(core::mem::size_of::<Task>() == LAYER_TASK_BYTES as usize);

const ADMIT: u8 = 1;
const REFUSE: u8 = 2;
const WOULD_REFUSE: u8 = 3;

#[inline(always)]
fn code(v: Verdict) -> u8 {
    match v {
        Verdict::Admit => ADMIT,
        Verdict::Refuse => REFUSE,
        Verdict::WouldRefuse => WOULD_REFUSE,
    }
}

#[inline(always)]
fn verdict(code: u8) -> Verdict {
    match code {
        ADMIT => Verdict::Admit,
        REFUSE => Verdict::Refuse,
        _ => Verdict::WouldRefuse,
    }
}

/// Judges a packet through the layer set `set` (its route without `LAYERED`): hands it to
/// `limiter_layers`. Returns only when the tail call fails (the limiter's fault: passed).
#[inline(always)]
pub fn hand_over<H: Hook>(ctx: &H, pkt: &Packet, set: u16, frame_len: u64) -> u32 {
    let Some(task) = LAYER_TASK.get_ptr_mut(0) else {
        return act::fault();
    };
    // SAFETY: a map value, valid for the program's run; only this CPU touches it.
    unsafe {
        (*task).pkt = *pkt;
        (*task).frame_len = frame_len;
        (*task).set = u32::from(set);
        (*task).step = 0;
        H::jumps().tail_call(ctx, 0);
    }
    act::fault()
}

/// One run of `limiter_layers`: the first picks the layers; each looks at one layer, or commits
/// one host-scope layer, then hands on to the next run; the last writes the per-CPU layers'
/// rows, counts the outcome and returns the XDP action.
#[inline(always)]
pub fn run<H: Hook>(ctx: &H) -> u32 {
    let (Some(task), Some(cfg)) = (LAYER_TASK.get_ptr_mut(0), CONFIG.get(0)) else {
        return act::fault();
    };
    // SAFETY: a map value, valid for the program's run; only this CPU touches it.
    let t = unsafe { &mut *task };
    if t.step == 0 {
        if !pick(t) {
            return act::unmatched();
        }
        t.now = unsafe { bpf_ktime_get_ns() };
    }
    let n = t.n as usize;
    let mut step = t.step as usize;
    if n == 0 || n > MAX_LAYERS || step >= n + MAX_LAYERS {
        return act::fault();
    }
    let frame_len = t.frame_len;
    if step < n {
        // The look at layer `step`: judged, nothing written.
        // Opaque to the compiler, so the mask stays: knowing `step < n <= MAX_LAYERS`, it
        // dropped it in the tc program, and the verifier, which does not follow `n`, refused
        // the rows' write as out of the task's bounds.
        let k = core::hint::black_box(step) & (MAX_LAYERS - 1);
        let Some(policy) = POLICIES.get(u32::from(t.ids[k])) else {
            return act::fault();
        };
        let generation = (cfg.generation & 1) as usize;
        let words = key_words(&t.pkt, policy);
        // SAFETY: a map value, valid for the program's run; only this CPU touches it.
        let memo = LAYER_HASHES.get_ptr_mut(u32::from(policy.id)).map(|m| unsafe { &mut *m });
        let hash = memo::hash(memo, &cfg.salts[generation], t.pkt.family, &words);
        t.hashes[k] = hash;
        if policy.flags & (Policy::SCOPE_HOST | Policy::DENY) == Policy::SCOPE_HOST && step + 1 == n && {
            order(t);
            t.hosts == 0
        } {
            // The last layer, of host scope, with no host-scope layer before it to commit: no
            // later layer can refuse the packet, so its look is its commit, in this run (the
            // commit's code below: one site of it for the verifier to walk).
            t.verdicts[k] = ADMIT;
            t.order[0] = k as u8;
            t.hosts = 1;
            step = n;
        } else {
            let v = if policy.flags & Policy::DENY != 0 {
                refusal(policy)
            } else if policy.flags & Policy::SCOPE_HOST != 0 {
                match buckets::host_scope_layer(cfg, t.pkt.family, policy, &words, hash, frame_len, false, t.now) {
                    Some(v) => v,
                    None => return act::fault(),
                }
            } else {
                let Some(look) = buckets::per_cpu_look(cfg, t.pkt.family, policy, &words, hash, frame_len, t.now)
                else {
                    return act::fault();
                };
                let mut written = 0;
                let mut i = 0;
                while i < MAX_ROWS {
                    t.rows_idx[k][i] = look.idx[i];
                    if let Some(value) = look.store[i] {
                        t.rows_val[k][i] = value;
                        written |= 1 << i;
                    }
                    i += 1;
                }
                t.rows_written[k] = written;
                look.verdict
            };
            t.verdicts[k] = code(v);
            if v == Verdict::Refuse {
                t.refused = k as u32;
                t.n = k as u32 + 1;
                if policy.flags & Policy::DENY == 0 {
                    layer_memo::remember(policy, hash);
                }
                return settle(cfg, t);
            }
            if step + 1 == n {
                order(t);
                if t.hosts == 0 {
                    return pass(cfg, t);
                }
            }
            return next(ctx, t, step);
        }
    }
    // The commit of the `step - n`th host-scope layer that admitted: a layer that now refuses
    // stops it; a dry-run one that now would refuse is counted so, and passes.
    let j = step - n;
    let k = t.order[j & (MAX_LAYERS - 1)] as usize & (MAX_LAYERS - 1);
    let Some(policy) = POLICIES.get(u32::from(t.ids[k])) else {
        return act::fault();
    };
    let words = key_words(&t.pkt, policy);
    match buckets::host_scope_layer(cfg, t.pkt.family, policy, &words, t.hashes[k], frame_len, true, t.now) {
        Some(Verdict::Refuse) => {
            t.verdicts[k] = REFUSE;
            t.refused = k as u32;
            layer_memo::remember(policy, t.hashes[k]);
            return settle(cfg, t);
        }
        Some(Verdict::WouldRefuse) => t.verdicts[k] = WOULD_REFUSE,
        _ => {}
    }
    if j + 1 >= t.hosts as usize {
        return pass(cfg, t);
    }
    next(ctx, t, step)
}

/// Hands the task on to the run of its next step.
#[inline(always)]
fn next<H: Hook>(ctx: &H, t: &mut Task, step: usize) -> u32 {
    t.step = step as u32 + 1;
    // SAFETY: `ctx` is this program's context.
    unsafe { H::jumps().tail_call(ctx, 0) };
    act::fault()
}

/// Every layer admitted (or, in dry-run, would refuse) and the host-scope ones are written:
/// writes the rows of the per-CPU layers that admitted, then counts.
#[inline(always)]
fn pass(cfg: &Config, t: &Task) -> u32 {
    let mut k = 0;
    while k < MAX_LAYERS && k < t.n as usize {
        if t.verdicts[k] == ADMIT {
            let written = t.rows_written[k];
            let mut i = 0;
            while i < MAX_ROWS {
                if written & (1 << i) != 0 {
                    buckets::write_bucket(t.rows_idx[k][i], t.rows_val[k][i]);
                }
                i += 1;
            }
        }
        k += 1;
    }
    settle(cfg, t)
}

/// The layers: each candidate of the task's set whose predicates hold, in the set's order, at
/// most `MAX_LAYERS` (userspace allows no more to meet one packet); the first `plain` without
/// a look at their policies (`LayerSet::plain`). False: none.
#[inline(always)]
fn pick(t: &mut Task) -> bool {
    let Some(set) = LAYER_SETS.get(t.set) else {
        return false;
    };
    let plain = usize::from(set.plain);
    let set = &set.ids;
    let mut n = 0;
    let mut i = 0;
    while i < MAX_CANDIDATES && n < MAX_LAYERS {
        let id = set[i];
        i += 1;
        if id == 0 {
            break;
        }
        // A plain set's candidates are active and have no predicate: each judges, unread.
        let judges = i <= plain
            || POLICIES
                .get(u32::from(id))
                .is_some_and(|policy| policy.flags & Policy::ACTIVE != 0 && predicates_hold(policy, &t.pkt));
        if judges {
            t.ids[n] = id;
            t.verdicts[n] = 0;
            t.rows_written[n] = 0;
            n += 1;
        }
    }
    t.n = n as u32;
    t.refused = MAX_LAYERS as u32;
    n > 0
}

/// The commit's list: the host-scope layers that admitted, in order (their compare-and-exchange
/// may lose a race and refuse, so they commit before any per-CPU layer is written).
#[inline(always)]
fn order(t: &mut Task) {
    let mut m = 0;
    let mut k = 0;
    while k < MAX_LAYERS {
        if k < t.n as usize && t.verdicts[k] == ADMIT {
            let host = POLICIES.get(u32::from(t.ids[k])).is_some_and(|p| p.flags & Policy::SCOPE_HOST != 0);
            if host {
                t.order[m & (MAX_LAYERS - 1)] = k as u8;
                m += 1;
            }
        }
        k += 1;
    }
    t.hosts = m as u32;
}

/// Counts the outcome under each layer and turns it into the XDP action. Refused by the task's
/// first refusing layer: counted (and sampled) there, and as overruled under every other layer
/// judged. Passed: each layer counts its own verdict (admitted, or would-refuse in dry-run).
#[inline(always)]
fn settle(cfg: &Config, t: &Task) -> u32 {
    let refused = t.refused as usize;
    let mut k = 0;
    while k < MAX_LAYERS && k < t.n as usize {
        let id = t.ids[k];
        let v = verdict(t.verdicts[k]);
        if refused >= MAX_LAYERS {
            act::bump(u32::from(id), |c| count(c, v, t.frame_len));
        } else if k == refused {
            act::bump(u32::from(id), |c| count(c, Verdict::Refuse, t.frame_len));
        } else {
            act::bump(u32::from(id), |c| c.overruled_packets += 1);
        }
        if (refused >= MAX_LAYERS && v == Verdict::WouldRefuse) || k == refused {
            if let Some(policy) = POLICIES.get(u32::from(id)) {
                act::sample(cfg, &t.pkt, policy, if k == refused { Verdict::Refuse } else { v });
            }
        }
        k += 1;
    }
    if refused >= MAX_LAYERS { XDP_PASS } else { XDP_DROP }
}

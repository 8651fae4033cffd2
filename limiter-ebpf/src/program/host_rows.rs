//! Host scope in two count-min rows (`Config::host_rows` > 1): a key's allowance is kept in its
//! bucket in each row of `HOST_BUCKETS`, judged by the least spent, every CPU reading and
//! writing the same rows. The protocol is `limiter_ebpf::scope::judge_rows`'s (its proof there):
//! read both rows, then the clock, judge; a refusal writes nothing; an admission
//! compare-and-exchanges row 0 then row 1 from the values read, each write strictly changing its
//! row (the new TAT where the judgement raises it, else the value read + `TICK`); a lost exchange
//! reads and judges again, at most [`TRIES`] times, and when every try lost, refuses.
//!
//! Two rows, not up to four as per-CPU buckets: two is the host default and the most it allows
//! (`--host-rows 1|2`; docs/DESIGN.md, "The defaults"), and written for two, straight, the
//! judgement stays small enough for the verifier beside the rest of the program. The state of a
//! judgement lives in this CPU's scratch (`HOST_ROWS`), not on the stack, and each step runs out
//! of line with no arguments: the verifier walks it once for every path that reaches it (its
//! entry state is the same), where inlined, or fed the caller's values, it was walked once per
//! path and branch and went past its million instructions.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use limiter_common::{
    gcra::{CLOCK_SHIFT, TICK, ahead_units, credible_ahead},
    key::key_hash,
    maps::{Config, Policy},
    rows::{MAX_ROWS, row_index},
};
use limiter_ebpf::{
    decide::{Verdict, refusal},
    memo::{self, Shortcuts},
    scope,
};

use super::{CONFIG, HOST_BUCKETS, HOST_ROWS, KEY_MEMO, POLICIES, act, buckets};

/// The rows the kernel judges at host scope when `Config::host_rows` is above one.
pub const ROWS: usize = limiter_common::rows::MAX_HOST_ROWS as usize;

/// A host-scope judgement in two rows: the key, its rows' buckets, what the last try read, and
/// each row's credible distance ahead. This CPU's alone (`HOST_ROWS`).
#[repr(C)]
pub struct HostRows {
    words: [u64; 3],
    hash: u64,
    /// What the packet costs (`decide::weight`, or a lease's units).
    units: u64,
    frame_len: u64,
    /// The last try's clock (ns).
    now: u64,
    /// What the last try read of each row (current generation); the rest stay 0 (the memo
    /// reads `MAX_ROWS`, and an array on the stack would cost a call to memset).
    values: [u64; MAX_ROWS],
    /// Each row's credible distance ahead at the last try's clock, the previous generation's
    /// row's if further during a salt rotation ([`ahead_of`]).
    ahead: [u64; ROWS],
    /// Each row's bucket: current generation, and the previous one's (read during a rotation).
    idx: [u32; ROWS],
    old_idx: [u32; ROWS],
    policy: u16,
    /// `values` and `now` hold a reading the next try judges instead of reading again: the
    /// inline try's ([`admit_at_once`]) that did not admit and wrote nothing.
    preread: u8,
    family: u8,
    /// Write on admission (else a layer's look: judged, nothing written).
    commit: u8,
    /// Record the verdict in the key memo ([`alone`]).
    remember: u8,
    /// `old_idx` holds the previous generation's buckets.
    rotating: u8,
    _pad: u8,
}

// docs/DESIGN.md's map table gives its size.
const _: () = assert!(core::mem::size_of::<HostRows>() == 128);

/// What a try or the judgement came to, across the out-of-line calls (a register, not a struct).
const ADMIT: u64 = 0;
const REFUSE: u64 = 1;
const WOULD_REFUSE: u64 = 2;
/// A try lost an exchange: read and judge again.
const LOST: u64 = 3;
/// A lookup failed (the limiter's fault: the packet passes).
const FAILED: u64 = 4;

/// A host-scope policy judged alone (`program::limiter`, `Config::host_rows` > 1): the memo's
/// standing refusal, else the key's two rows; counted and turned into the XDP action.
#[inline(always)]
pub fn alone<S: Shortcuts>(cfg: &Config, family: u8, policy: &Policy, words: &[u64; 3], frame_len: u64) -> u32 {
    let generation = (cfg.generation & 1) as usize;
    let mut memo = buckets::key_memo::<S>();
    let hash = memo::hash(memo.as_deref_mut(), &cfg.salts[generation], family, words);
    if let Some(m) = memo.as_deref_mut() {
        if memo::refusal_stands::<S>(m, cfg, policy, ROWS, true) {
            return act::act(cfg, family, policy, words, refusal(policy), frame_len);
        }
    }
    let units = limiter_ebpf::decide::weight(policy, frame_len);
    let idx = buckets_of(cfg, cfg.generation, hash);
    let at_once = admit_at_once(cfg, policy, idx, units);
    if let AtOnce::Admitted = at_once {
        if let Some(m) = memo {
            // What `memo::remember` records for an admission: no refusal stands.
            m.refused_until_ns = 0;
        }
        return act::act(cfg, family, policy, words, Verdict::Admit, frame_len);
    }
    let Some(s) = stage(policy, family, words, hash, idx, units, frame_len, true, memo.is_some()) else {
        return act::fault();
    };
    if let AtOnce::Read(v0, v1, now_ns) = at_once {
        s.values[0] = v0;
        s.values[1] = v1;
        s.now = now_ns;
        s.preread = 1;
    }
    host_rows_finish(tries())
}

/// What the inline try came to.
enum AtOnce {
    Admitted,
    /// Not admitted, nothing written: its reading of the rows and the clock (ns), which the
    /// first try out of line judges (a refusal costs one reading).
    Read(u64, u64, u64),
    /// A lookup failed or an exchange was lost: out of line, reading again.
    Again,
}

/// The common admission, inline: one try of [`attempt`]'s (both rows read, then the clock;
/// both exchanged) that admits. Anything else goes out of line ([`settle`]): a refusal, a TAT
/// beyond the window or a rotation comes back as its reading, nothing written, for the first
/// try there to judge; a lost exchange (row 0 perhaps written, as by a lost try of `attempt`),
/// to read again. Inline, because each call out and back costs several nanoseconds here (the
/// return thunk of the CPU's mitigations), which was most of what an admission cost beyond the
/// floor.
#[inline(always)]
fn admit_at_once(cfg: &Config, policy: &Policy, idx: [u32; ROWS], units: u64) -> AtOnce {
    let (Some(b0), Some(b1)) = (HOST_BUCKETS.get_ptr_mut(idx[0]), HOST_BUCKETS.get_ptr_mut(idx[1])) else {
        return AtOnce::Again;
    };
    // SAFETY: map values of 8 aligned bytes, valid for the program's run.
    let (v0, v1) = unsafe { (scope::load(b0), scope::load(b1)) };
    let now_ns = unsafe { bpf_ktime_get_ns() };
    let now = now_ns.wrapping_shl(CLOCK_SHIFT);
    let (a0, a1) = (ahead_units(v0, now), ahead_units(v1, now));
    let capacity = policy.gcra.capacity;
    if now_ns < cfg.grace_until_ns || a0 > capacity || a1 > capacity {
        return AtOnce::Read(v0, v1, now_ns);
    }
    let Some([n0, n1]) = raised(policy, units, now, [v0, v1], [a0, a1]) else {
        return AtOnce::Read(v0, v1, now_ns);
    };
    // SAFETY: as above.
    if unsafe { scope::compare_exchange(b0, v0, n0).is_ok() && scope::compare_exchange(b1, v1, n1).is_ok() } {
        AtOnce::Admitted
    } else {
        AtOnce::Again
    }
}

/// The judgement of one try over both rows' values `v` and their credible distances ahead `a`
/// at `now` (clock units): the rows' new values on an admission (the new TAT where it raises a
/// row, else the value read + `TICK`, so every write changes its row), None on a refusal.
#[inline(always)]
fn raised(policy: &Policy, units: u64, now: u64, v: [u64; ROWS], a: [u64; ROWS]) -> Option<[u64; ROWS]> {
    let least = if a[0] < a[1] { a[0] } else { a[1] };
    let next = least.saturating_add(policy.gcra.cost(units));
    if next > policy.gcra.capacity {
        return None;
    }
    // Policy ids are below MAX_POLICIES (256): they fit a bucket's owner byte.
    let value = now.wrapping_add(next) | u64::from(policy.id as u8);
    let raise = |i: usize| if a[i] < next && value != v[i] { value } else { v[i].wrapping_add(TICK) };
    Some([raise(0), raise(1)])
}

/// A host-scope layer's look (`commit` false) or commit, or an aggregate's lease reservation,
/// in the key's two rows: the verdict; None on a failed lookup.
#[inline(always)]
pub fn judge(
    cfg: &Config,
    family: u8,
    policy: &Policy,
    words: &[u64; 3],
    hash: u64,
    units: u64,
    commit: bool,
) -> Option<Verdict> {
    stage(policy, family, words, hash, buckets_of(cfg, cfg.generation, hash), units, 0, commit, false)?;
    match host_rows_judged() {
        ADMIT => Some(Verdict::Admit),
        REFUSE => Some(Verdict::Refuse),
        WOULD_REFUSE => Some(Verdict::WouldRefuse),
        // Every try lost a race: refused, which never lets a key over its bound.
        LOST => Some(refusal(policy)),
        _ => None,
    }
}

/// Writes the judgement's inputs into this CPU's scratch, and returns it. None when it cannot
/// be had.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn stage(
    policy: &Policy,
    family: u8,
    words: &[u64; 3],
    hash: u64,
    idx: [u32; ROWS],
    units: u64,
    frame_len: u64,
    commit: bool,
    remember: bool,
) -> Option<&'static mut HostRows> {
    let Some(s) = HOST_ROWS.get_ptr_mut(0) else {
        return None;
    };
    // SAFETY: a map value, valid for the program's run; only this CPU touches it.
    let s = unsafe { &mut *s };
    s.words = *words;
    s.hash = hash;
    s.units = units;
    s.frame_len = frame_len;
    s.policy = policy.id;
    s.preread = 0;
    s.family = family;
    s.commit = u8::from(commit);
    s.remember = u8::from(remember);
    s.idx = idx;
    s.rotating = 0;
    Some(s)
}

/// The verdict for a judgement's `code` remembered in the key memo (when staged so) and counted:
/// the XDP action.
#[inline(never)]
#[unsafe(no_mangle)]
extern "C" fn host_rows_finish(code: u64) -> u32 {
    let (Some(s), Some(cfg)) = (HOST_ROWS.get_ptr_mut(0), CONFIG.get(0)) else {
        return act::fault();
    };
    // SAFETY: as in `stage`.
    let s = unsafe { &mut *s };
    let Some(policy) = POLICIES.get(u32::from(s.policy)) else {
        return act::fault();
    };
    let verdict = match code {
        ADMIT => Verdict::Admit,
        REFUSE => Verdict::Refuse,
        WOULD_REFUSE => Verdict::WouldRefuse,
        // Every try lost a race: refused, which never lets a key over its bound.
        LOST => refusal(policy),
        _ => return act::fault(),
    };
    if s.remember != 0 {
        if let Some(m) = KEY_MEMO.get_ptr_mut(0) {
            // SAFETY: a map value, valid for the program's run; only this CPU touches it.
            // Every try lost: the last try's values admitted, so no refusal stands on them.
            memo::remember(unsafe { &mut *m }, cfg, policy, &s.values, ROWS, s.now, verdict, true);
        }
    }
    act::act(cfg, s.family, policy, &s.words, verdict, s.frame_len)
}

/// The staged key's rows judged (a code), out of line: a layer's look or commit, or a lease's
/// reservation ([`judge`]).
#[inline(never)]
#[unsafe(no_mangle)]
extern "C" fn host_rows_judged() -> u64 {
    tries()
}

/// Tries of one judgement before it refuses: twice one row's (`HOST_CAS_TRIES`). Two CPUs
/// admitting one key as fast as they can (BPF_PROG_TEST_RUN on both, `layers`' racing test)
/// lose about one try in 25 here, a try writing two rows taking longer than one; 4 tries then
/// refused a policy far under its rate about once in 300,000 packets, 8 make it about once in
/// 10^11.
const TRIES: u32 = 8;

/// Tries on the staged key's rows until one does not lose a race, at most [`TRIES`]: a
/// code.
#[inline(always)]
fn tries() -> u64 {
    let mut code = LOST;
    let mut tries = 0;
    while tries < TRIES && code == LOST {
        tries += 1;
        code = host_rows_attempt();
    }
    code
}

/// During a salt rotation, the staged key's bucket in each row of the previous generation (read,
/// never written: every write goes to the current generation), found once per judgement, by the
/// first try that reads a clock within the grace. Out of line, so that SipHash's state for the
/// previous salt stays off the try's frame.
#[inline(never)]
#[unsafe(no_mangle)]
extern "C" fn host_rows_locate_previous() -> u64 {
    let (Some(s), Some(cfg)) = (HOST_ROWS.get_ptr_mut(0), CONFIG.get(0)) else {
        return 0;
    };
    // SAFETY: as in `stage`.
    let s = unsafe { &mut *s };
    let previous = ((cfg.generation & 1) ^ 1) as usize;
    let old_hash = key_hash(&cfg.salts[previous & 1], s.family, &s.words);
    s.old_idx = buckets_of(cfg, previous as u32, old_hash);
    s.rotating = 1;
    0
}

/// One try: both rows read, then the clock; judged by the least spent; on an admission (when
/// committing) row 0 then row 1 compare-and-exchanged. A code.
#[inline(never)]
#[unsafe(no_mangle)]
extern "C" fn host_rows_attempt() -> u64 {
    let Some(s) = HOST_ROWS.get_ptr_mut(0) else {
        return FAILED;
    };
    // SAFETY: as in `stage`.
    let s = unsafe { &mut *s };
    let Some(policy) = POLICIES.get(u32::from(s.policy)) else {
        return FAILED;
    };
    let (Some(b0), Some(b1)) = (HOST_BUCKETS.get_ptr_mut(s.idx[0]), HOST_BUCKETS.get_ptr_mut(s.idx[1])) else {
        return FAILED;
    };
    let (v0, v1, now_ns) = if s.preread != 0 {
        // The inline try's reading, taken in this order too.
        s.preread = 0;
        (s.values[0], s.values[1], s.now)
    } else {
        // SAFETY: map values of 8 aligned bytes, valid for the program's run.
        let (v0, v1) = unsafe { (scope::load(b0), scope::load(b1)) };
        s.values[0] = v0;
        s.values[1] = v1;
        // The clock after the rows, on every try: a TAT another CPU wrote was written at an
        // earlier time than this one, so no CPU judges a newer TAT with an older clock (a
        // ghost, idle).
        let now_ns = unsafe { bpf_ktime_get_ns() };
        s.now = now_ns;
        (v0, v1, now_ns)
    };
    if s.rotating == 0 && CONFIG.get(0).is_some_and(|cfg| now_ns < cfg.grace_until_ns) {
        host_rows_locate_previous();
    }
    let (now, capacity) = (now_ns.wrapping_shl(CLOCK_SHIFT), policy.gcra.capacity);
    let (mut a0, mut a1) = (ahead_units(v0, now), ahead_units(v1, now));
    if a0 > capacity || a1 > capacity || s.rotating != 0 {
        // A TAT beyond the policy's window (a ghost of the clock's wrap, or owed to another
        // policy's claim), or a rotation: the full rules, out of line. Within the window a
        // TAT's distance is credible as it is (`gcra::credible_ahead`).
        host_rows_ahead_of(0);
        host_rows_ahead_of(1);
        // SAFETY: this CPU's scratch, just written by `ahead_of`.
        (a0, a1) = unsafe { (core::ptr::read_volatile(&s.ahead[0]), core::ptr::read_volatile(&s.ahead[1])) };
    }
    let Some([n0, n1]) = raised(policy, s.units, now, [v0, v1], [a0, a1]) else {
        return if policy.flags & Policy::DRY_RUN != 0 { WOULD_REFUSE } else { REFUSE };
    };
    if s.commit == 0 {
        return ADMIT;
    }
    // SAFETY: as above.
    if unsafe { scope::compare_exchange(b0, v0, n0) }.is_err() {
        return LOST;
    }
    // SAFETY: as above.
    if unsafe { scope::compare_exchange(b1, v1, n1) }.is_err() {
        return LOST;
    }
    ADMIT
}

/// Row `row`'s credible distance ahead at the try's clock (`gcra::credible_ahead`), the previous
/// generation's row's if further during a rotation (`gcra::later`'s rule), written to the
/// scratch: out of line, and through memory rather than returned, so the paths through its
/// branches (the claims' lookups) leave the try in one state.
#[inline(never)]
#[unsafe(no_mangle)]
extern "C" fn host_rows_ahead_of(row: u64) -> u64 {
    let (Some(s), Some(cfg)) = (HOST_ROWS.get_ptr_mut(0), CONFIG.get(0)) else {
        return 0;
    };
    // SAFETY: as in `stage`.
    let s = unsafe { &mut *s };
    let Some(policy) = POLICIES.get(u32::from(s.policy)) else {
        return 0;
    };
    let i = (row & 1) as usize;
    let now_ns = s.now;
    let now = now_ns.wrapping_shl(CLOCK_SHIFT);
    let capacity = policy.gcra.capacity;
    let mut ahead = credible_ahead(s.values[i], now, capacity, |id| buckets::claim(id, now_ns));
    if s.rotating != 0 && now_ns < cfg.grace_until_ns {
        if let Some(old) = HOST_BUCKETS.get_ptr_mut(s.old_idx[i]) {
            // SAFETY: a map value of 8 aligned bytes, valid for the program's run.
            let previous = credible_ahead(unsafe { scope::load(old) }, now, capacity, |id| buckets::claim(id, now_ns));
            if previous > ahead {
                ahead = previous;
            }
        }
    }
    // SAFETY: this CPU's scratch.
    unsafe { core::ptr::write_volatile(&mut s.ahead[i], ahead) };
    0
}

/// The buckets of the key of `hash`, one in each row of `generation` (its low bit) of
/// `HOST_BUCKETS`.
#[inline(always)]
pub(super) fn buckets_of(cfg: &Config, generation: u32, hash: u64) -> [u32; ROWS] {
    let buckets = cfg.host_mask.wrapping_add(1);
    // A row is `Config::host_row_len` long, or half the generation's buckets.
    let len = if cfg.host_row_len == 0 { buckets >> 1 } else { cfg.host_row_len };
    let base = (generation & 1) * buckets;
    [base + row_index(hash, 0, len), base + row_index(hash, 1, len)]
}

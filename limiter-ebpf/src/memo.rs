//! The memo path: each CPU's last key, its hash, and how long its last refusal stands
//! ([`KeyMemo`]). A flood from one source skips SipHash on every packet after its first
//! ([`hash`]), and, while its refusal stands, its buckets too ([`refusal_stands`]): the refusal
//! is checked against the precise clock, or, for a key flooding beyond any rate a client keeps
//! to, against the tick counter alone (`limiter_common::tick`). [`remember`] records what a full
//! judgement decided. See docs/DESIGN.md, "A flood from one source: the key memo".

use aya_ebpf::helpers::{bpf_jiffies64, bpf_ktime_get_ns};
use limiter_common::{
    key::key_hash,
    maps::{Config, Policy},
    rows::{self, MAX_ROWS},
    siphash::SipInit,
    tick::Streak,
};

use crate::decide::Verdict;

/// The memo's two shortcuts. Both are on in the shipped program ([`AllOn`], compiled in); the
/// test program `limiter-switchable` reads them from globals set at load, so the benchmark can
/// measure each against its absence and tests can time refusals exactly.
pub trait Shortcuts {
    /// The key memo itself: hash and standing refusal of the last key.
    fn key_memo() -> bool;
    /// A flooding key refused for the rest of the tick without the clock (needs the memo).
    fn tick_refusal() -> bool;
}

/// The shipped program's shortcuts: all on.
pub struct AllOn;

impl Shortcuts for AllOn {
    #[inline(always)]
    fn key_memo() -> bool {
        true
    }

    #[inline(always)]
    fn tick_refusal() -> bool {
        true
    }
}

/// The last key a CPU hashed and its keyed hash: a flood from one source (what a refusal costs
/// most often) skips SipHash on every packet after its first. Exact, never a guess: the memo
/// holds whole key words, the family and the salt's first state word (64 secret bits that
/// change with every salt), and it serves only an identical key under the identical salt.
///
/// It also holds how long the key's last refusal stands (`refused_until_ns`, 0: none; see
/// docs/DESIGN.md, Decide): set only when that refusal wrote nothing, so while every packet
/// this CPU judges is the same key refused from the memo, its buckets cannot change (per CPU)
/// or only rise (host scope: other CPUs' admissions), and the exact GCRA would refuse each of
/// them until then. Any other key replaces the memo. A key
/// that floods beyond what any source keeping to its rate could send within one tick is
/// refused for the rest of that tick without reading the clock (`streak`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct KeyMemo {
    pub words: [u64; 3],
    /// `SipInit::v[0]` of the salt the hash was taken under.
    pub salt: u64,
    pub family: u64,
    pub hash: u64,
    pub refused_until_ns: u64,
    /// The policy's parameters and the bucket geometry (`Config::bucket_mask | row_len << 32`,
    /// or the host array's, and the rows with the scope: [`geometry`]) when `refused_until_ns`
    /// was set: a change to either voids it.
    pub emission: u64,
    pub capacity: u64,
    pub shape: u64,
    pub rows: u64,
    /// The key's refusals in the current tick, and whether the rest of the tick's packets of
    /// it may be refused without the clock (`limiter_common::tick`; reset with each standing
    /// refusal the full judgement sets).
    pub streak: Streak,
}

impl KeyMemo {
    /// The memoised hash when the memo is for this key and salt.
    #[inline(always)]
    pub fn get(&self, salt: &SipInit, family: u8, words: &[u64; 3]) -> Option<u64> {
        if self.salt == salt.v[0]
            && self.family == u64::from(family)
            && self.words[0] == words[0]
            && self.words[1] == words[1]
            && self.words[2] == words[2]
        {
            Some(self.hash)
        } else {
            None
        }
    }

    #[inline(always)]
    pub fn set(&mut self, salt: &SipInit, family: u8, words: &[u64; 3], hash: u64) {
        // Only what a miss must change (a spoofed flood misses every packet): the parameters
        // below are read only with a standing refusal, which is set with them.
        self.words = *words;
        self.salt = salt.v[0];
        self.family = u64::from(family);
        self.hash = hash;
        self.refused_until_ns = 0;
    }
}

/// The key's hash under `salt`, from the memo when the last packet this CPU judged had the same
/// key (a flood from one source), else SipHash (then memoised). No memo: SipHash.
#[inline(always)]
pub fn hash(memo: Option<&mut KeyMemo>, salt: &SipInit, family: u8, words: &[u64; 3]) -> u64 {
    let Some(memo) = memo else {
        return key_hash(salt, family, words);
    };
    if let Some(hash) = memo.get(salt, family, words) {
        return hash;
    }
    let hash = key_hash(salt, family, words);
    memo.set(salt, family, words, hash);
    hash
}

/// Whether the memoised key's last refusal still stands for this packet (the memo holds this
/// packet's key: [`hash`] was asked first), under the same policy parameters, scope (`host`:
/// `HOST_BUCKETS`, else this CPU's `BUCKETS`) and that array's geometry: then the packet is
/// refused without reading its buckets.
///
/// Host scope: other CPUs write the key's rows between this CPU's packets, but only an admission
/// writes (a refusal writes nothing), and an admission only raises a row it counts as ahead (the
/// clock is read after the rows, so no reader takes a live TAT for a ghost: `scope`). A refusal
/// that stands on this CPU's reading of the rows stands on any later reading, until its end.
#[inline(always)]
pub fn refusal_stands<S: Shortcuts>(m: &mut KeyMemo, cfg: &Config, policy: &Policy, rows: usize, host: bool) -> bool {
    let (shape, rows) = geometry(cfg, rows, host);
    if m.refused_until_ns == 0
        || m.emission != policy.gcra.emission
        || m.capacity != policy.gcra.capacity
        || m.shape != shape
        || m.rows != rows
        || policy.flags & Policy::BYTES != 0
    {
        return false;
    }
    // The tick counter before the clock: the refusal the clock confirms falls in it.
    let tick = if S::tick_refusal() { unsafe { bpf_jiffies64() } } else { 0 };
    if S::tick_refusal() && m.streak.skips(tick) {
        return true;
    }
    let now = unsafe { bpf_ktime_get_ns() };
    // Wrapping: `now` before the end of the standing refusal.
    if (m.refused_until_ns.wrapping_sub(now) as i64) > 0 {
        if S::tick_refusal() {
            m.streak.confirm(tick, &policy.gcra);
        }
        return true;
    }
    false
}

/// Records what a full judgement at `now_ns` decided over the key's buckets (`values`, as read,
/// in `HOST_BUCKETS` when `host`): until when its refusal stands, 0 for an admission, a byte
/// policy (the cost depends on the frame) or during a salt rotation (the previous generation's
/// buckets count too).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn remember(
    m: &mut KeyMemo,
    cfg: &Config,
    policy: &Policy,
    values: &[u64; MAX_ROWS],
    rows: usize,
    now_ns: u64,
    verdict: Verdict,
    host: bool,
) {
    let until = if verdict == Verdict::Admit || now_ns < cfg.grace_until_ns || policy.flags & Policy::BYTES != 0 {
        0
    } else {
        rows::refused_until(&policy.gcra, values, rows, now_ns)
    };
    m.refused_until_ns = until;
    if until != 0 {
        // Field by field, volatile: LLVM makes a call to `memset` of a zeroed struct (even of
        // plain stores of its fields), which the verifier walks again for every state that
        // reaches it.
        unsafe {
            core::ptr::write_volatile(&mut m.streak.tick, 0);
            core::ptr::write_volatile(&mut m.streak.refusals, 0);
            core::ptr::write_volatile(&mut m.streak.skip_tick, 0);
        }
        m.emission = policy.gcra.emission;
        m.capacity = policy.gcra.capacity;
        (m.shape, m.rows) = geometry(cfg, rows, host);
    }
}

/// The bucket geometry a memo refusal was computed under: the array's mask and row length, and
/// its rows with the scope (bit 32: `HOST_BUCKETS`), so a refusal of one scope or shape never
/// answers for another (a policy switched to the other scope keeps its parameters).
#[inline(always)]
fn geometry(cfg: &Config, rows: usize, host: bool) -> (u64, u64) {
    let shape = if host {
        u64::from(cfg.host_mask) | u64::from(cfg.host_row_len) << 32
    } else {
        u64::from(cfg.bucket_mask) | u64::from(cfg.row_len) << 32
    };
    (shape, rows as u64 | u64::from(host) << 32)
}

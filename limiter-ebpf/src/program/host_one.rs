//! Host scope in one row (`Config::host_rows` <= 1): a key's bucket in `HOST_BUCKETS` judged by
//! a global function ([`host_one_judge`]), which the verifier walks once for the program,
//! whatever the paths that reach it. Its inputs and outputs go through this CPU's scratch
//! (`HOST_ONE`): a global function takes scalars and returns one. Each try of
//! `scope::judge_shared`'s compare-and-exchange loop calls it; inlined, or as a closure the
//! compiler left out of line (a static function, walked again for every caller's state), the
//! judgement took a quarter of the tc program's million instructions on kernel 7.3.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use limiter_common::{gcra, key::key_hash, rows::MAX_ROWS};
use limiter_ebpf::{
    decide::{Verdict, decide_units},
    scope,
};

use super::{CONFIG, HOST_BUCKETS, HOST_ONE, POLICIES, buckets::claim, buckets::host_index};

/// A one-row judgement: the key and what it costs, then what the last try judged.
#[repr(C)]
pub struct HostOne {
    words: [u64; 3],
    units: u64,
    /// The value the last try judged (the previous generation's carried over in a rotation).
    pub value: u64,
    /// The bucket's new value, when `stored`.
    store: u64,
    /// The last try's clock (ns).
    pub now: u64,
    policy: u16,
    family: u8,
    stored: u8,
    /// The last try's verdict ([`ADMIT`]...), or [`FAILED`].
    code: u8,
    _pad: [u8; 3],
}

const ADMIT: u8 = 0;
const REFUSE: u8 = 1;
const WOULD_REFUSE: u8 = 2;
/// A lookup failed: the limiter's fault, the packet passes.
const FAILED: u8 = 3;

/// Writes the judgement's key into this CPU's scratch; None when it cannot be had.
#[inline(always)]
pub fn stage(policy_id: u8, family: u8, words: &[u64; 3], units: u64) -> Option<&'static mut HostOne> {
    let s = HOST_ONE.get_ptr_mut(0)?;
    // SAFETY: a map value, valid for the program's run; only this CPU touches it.
    let s = unsafe { &mut *s };
    s.words = *words;
    s.units = units;
    s.policy = u16::from(policy_id);
    s.family = family;
    s.code = FAILED;
    Some(s)
}

impl HostOne {
    /// One try against the bucket holding `current`: the verdict and the bucket's new value, if
    /// it changes (`scope::judge_shared`'s judgement). A failed lookup reads as an admission
    /// that writes nothing: [`HostOne::failed`] tells it apart.
    #[inline(always)]
    pub fn judge(&mut self, current: u64) -> (Verdict, Option<u64>) {
        let verdict = match host_one_judge(current) as u8 {
            REFUSE => Verdict::Refuse,
            WOULD_REFUSE => Verdict::WouldRefuse,
            ADMIT => Verdict::Admit,
            _ => return (Verdict::Admit, None),
        };
        // SAFETY: written by `host_one_judge` just now, this CPU's alone.
        let (stored, store) =
            unsafe { (core::ptr::read_volatile(&self.stored), core::ptr::read_volatile(&self.store)) };
        (verdict, (stored != 0).then_some(store))
    }

    /// The last try could not judge (a lookup failed).
    #[inline(always)]
    pub fn failed(&self) -> bool {
        // SAFETY: as in `judge`.
        unsafe { core::ptr::read_volatile(&self.code) == FAILED }
    }
}

/// The staged key's bucket holding `current`, judged: the verdict code, written with the new
/// value, the value judged and the clock to the scratch.
#[inline(never)]
#[unsafe(no_mangle)]
extern "C" fn host_one_judge(current: u64) -> u64 {
    let (Some(s), Some(cfg)) = (HOST_ONE.get_ptr_mut(0), CONFIG.get(0)) else {
        return u64::from(FAILED);
    };
    // SAFETY: as in `stage`.
    let s = unsafe { &mut *s };
    let Some(policy) = POLICIES.get(u32::from(s.policy)) else {
        s.code = FAILED;
        return u64::from(FAILED);
    };
    // The clock is read after the bucket, on every try: a TAT another CPU wrote was written at
    // an earlier time than this one, so no CPU judges a newer TAT with an older clock (which
    // would read it further ahead than its writer's claim: a ghost, idle).
    let now = unsafe { bpf_ktime_get_ns() };
    let mut value = current;
    if now < cfg.grace_until_ns {
        // Salt rotation: the key's bucket under the previous salt may be further ahead (never
        // written: every write goes to the current generation).
        let previous = ((cfg.generation & 1) ^ 1) as usize;
        let old_hash = key_hash(&cfg.salts[previous & 1], s.family, &s.words);
        if let Some(old) = HOST_BUCKETS.get_ptr_mut(host_index(cfg, previous, old_hash)) {
            // SAFETY: a map value of 8 aligned bytes, valid for the program's run.
            value = gcra::later(current, unsafe { scope::load(old) }, now, policy.gcra.capacity, |id| claim(id, now));
        }
    }
    let values = [value; MAX_ROWS];
    let (verdict, store) = decide_units(policy, &values, 1, now, s.units, |id| claim(id, now));
    s.value = value;
    s.now = now;
    s.stored = u8::from(store[0].is_some());
    s.store = store[0].unwrap_or(0);
    s.code = match verdict {
        Verdict::Admit => ADMIT,
        Verdict::Refuse => REFUSE,
        Verdict::WouldRefuse => WOULD_REFUSE,
    };
    u64::from(s.code)
}

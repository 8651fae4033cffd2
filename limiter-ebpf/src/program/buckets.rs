//! The decide step: the verdict for a key of `family` (its `words`) under `policy`, against its
//! buckets, for a frame of `len` bytes; None on a failed lookup. Per-CPU scope ([`per_cpu`])
//! reads the key's row buckets in `BUCKETS` (unless the memo's standing refusal answers first);
//! host scope ([`host`]), its bucket in each row of `HOST_BUCKETS` (`Config::host_rows`), shared
//! by every CPU (`limiter_ebpf::scope`). During a salt rotation the previous generation's buckets are read
//! too and a later TAT carries over.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use limiter_common::{
    gcra,
    key::{key_hash, row0_index},
    maps::{Config, LEASE_NS, Lease, Policy},
    rows::{MAX_ROWS, row_indexes},
};
use limiter_ebpf::{
    decide::{Verdict, decide as judge, refusal, weight},
    memo::{self, KeyMemo, Shortcuts},
    scope,
};

use super::{BUCKETS, HOST_BUCKETS, KEY_MEMO, LEASES, POLICIES, host_one, host_rows};

/// A per-CPU policy: the memo's standing refusal, else the key's bucket in each row, judged
/// and written back where it changes; the memo then records how long a refusal stands.
#[inline(always)]
pub fn per_cpu<S: Shortcuts>(cfg: &Config, family: u8, policy: &Policy, words: &[u64; 3], len: u64) -> Option<Verdict> {
    let generation = (cfg.generation & 1) as usize;
    let (rows, _) = row_shape(cfg);
    let mut memo = key_memo::<S>();
    let hash = memo::hash(memo.as_deref_mut(), &cfg.salts[generation], family, words);
    if let Some(m) = memo.as_deref_mut() {
        if memo::refusal_stands::<S>(m, cfg, policy, rows, false) {
            return Some(refusal(policy));
        }
    }
    let (verdict, values, now) = per_cpu_rows(cfg, family, policy, words, hash, len)?;
    if let Some(m) = memo {
        memo::remember(m, cfg, policy, &values, rows, now, verdict, false);
    }
    Some(verdict)
}

/// A host-scope layer (`program::layers`), its key's `hash` under the current salt; written
/// only when `commit`. `now`: the layers' clock, read when their judgement began, which a lease
/// is held to (a clock read costs more than the rest of a leased admission).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub fn host_scope_layer(
    cfg: &Config,
    family: u8,
    policy: &Policy,
    words: &[u64; 3],
    hash: u64,
    len: u64,
    commit: bool,
    now: u64,
) -> Option<Verdict> {
    if policy.lease > 1 {
        return leased(cfg, family, policy, words, hash, len, commit, now);
    }
    host_layer(cfg, family, policy, words, hash, len, commit)
}

/// An aggregate with a lease (`limiter_common::maps::Lease`): a unit of this CPU's lease for the
/// key admits without touching the shared bucket (spent only when `commit`); with none left, the
/// look judges the shared bucket for one unit, and the commit reserves `policy.lease` units at
/// once (else one, as without a lease). The lease is held to the layers' clock `now`: it is
/// taken out until `now + LEASE_NS` and spent while a later packet's `now` is before that.
/// The shared bucket is judged on its own clock, read after it (`scope`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn leased(
    cfg: &Config,
    family: u8,
    policy: &Policy,
    words: &[u64; 3],
    hash: u64,
    len: u64,
    commit: bool,
    now: u64,
) -> Option<Verdict> {
    let lease = LEASES.get_ptr_mut(u32::from(policy.id))?;
    // SAFETY: a map value, valid for the program's run; only this CPU touches it.
    let lease = unsafe { &mut *lease };
    if lease.units > 0 && lease.hash == hash && lease.emission == policy.gcra.emission && now < lease.until_ns {
        if commit {
            lease.units -= 1;
        }
        return Some(Verdict::Admit);
    }
    if !commit {
        return host_layer(cfg, family, policy, words, hash, len, false);
    }
    let units = u64::from(policy.lease);
    let reserved = if cfg.host_rows > 1 {
        host_rows::judge(cfg, family, policy, words, hash, units, true)?
    } else {
        let bucket = HOST_BUCKETS.get_ptr_mut(host_index(cfg, (cfg.generation & 1) as usize, hash))?;
        host_one_shared(bucket, policy, family, words, units)?
    };
    if reserved == Verdict::Admit {
        *lease = Lease { hash, emission: policy.gcra.emission, units: units - 1, until_ns: now + LEASE_NS };
        return Some(Verdict::Admit);
    }
    host_layer(cfg, family, policy, words, hash, len, true)
}

/// A per-CPU key's rows, judged: the verdict, each row's bucket and its new value where it
/// changes.
pub struct RowsLook {
    pub verdict: Verdict,
    pub idx: [u32; MAX_ROWS],
    pub store: [Option<u64>; MAX_ROWS],
}

/// The key's bucket in each row (the previous salt's too during a rotation) judged at `now`,
/// nothing written; None on a failed lookup.
#[inline(always)]
pub fn per_cpu_look(
    cfg: &Config,
    family: u8,
    policy: &Policy,
    words: &[u64; 3],
    hash: u64,
    len: u64,
    now: u64,
) -> Option<RowsLook> {
    let generation = (cfg.generation & 1) as usize;
    let (rows, row_len) = row_shape(cfg);
    let current = bucket_rows(cfg, generation, hash, rows, row_len);
    let mut values = read_rows(&current, rows)?;
    if now < cfg.grace_until_ns {
        // Salt rotation: each of the source's rows under the previous salt may be further ahead.
        let old_hash = key_hash(&cfg.salts[generation ^ 1], family, words);
        let previous = bucket_rows(cfg, generation ^ 1, old_hash, rows, row_len);
        let old = read_rows(&previous, rows)?;
        let mut i = 0;
        while i < MAX_ROWS && i < rows {
            values[i] = gcra::later(values[i], old[i], now, policy.gcra.capacity, |id| claim(id, now));
            i += 1;
        }
    }
    let (verdict, store) = judge(policy, &values, rows, now, len, |id| claim(id, now));
    Some(RowsLook { verdict, idx: current, store })
}

/// Writes a row's bucket (`BUCKETS`, this CPU's copy).
#[inline(always)]
pub fn write_bucket(index: u32, value: u64) {
    if let Some(bucket) = BUCKETS.get_ptr_mut(index) {
        unsafe { *bucket = value };
    }
}

/// The key's bucket in each row judged (the previous salt's too during a rotation) and written
/// back where it changes: the verdict, the values read and the clock. (The one-policy path's
/// own copy of [`per_cpu_look`]: sharing it through a returned struct costs that path stack
/// it does not have.)
#[inline(always)]
fn per_cpu_rows(
    cfg: &Config,
    family: u8,
    policy: &Policy,
    words: &[u64; 3],
    hash: u64,
    len: u64,
) -> Option<(Verdict, [u64; MAX_ROWS], u64)> {
    let generation = (cfg.generation & 1) as usize;
    let (rows, row_len) = row_shape(cfg);
    let current = bucket_rows(cfg, generation, hash, rows, row_len);
    let now = unsafe { bpf_ktime_get_ns() };
    let mut values = read_rows(&current, rows)?;
    if now < cfg.grace_until_ns {
        // Salt rotation: each of the source's rows under the previous salt may be further ahead.
        let old_hash = key_hash(&cfg.salts[generation ^ 1], family, words);
        let previous = bucket_rows(cfg, generation ^ 1, old_hash, rows, row_len);
        let old = read_rows(&previous, rows)?;
        let mut i = 0;
        while i < MAX_ROWS && i < rows {
            values[i] = gcra::later(values[i], old[i], now, policy.gcra.capacity, |id| claim(id, now));
            i += 1;
        }
    }
    let (verdict, store) = judge(policy, &values, rows, now, len, |id| claim(id, now));
    write_rows(&current, rows, &store);
    Some((verdict, values, now))
}

/// A host-scope policy: the memo's standing refusal, else the key's bucket in `HOST_BUCKETS`,
/// one for every CPU, read plainly and written only by compare-and-exchange when the judgement
/// changes it (`limiter_ebpf::scope`; with more than one row, [`host_rows`]); the memo then
/// records how long a refusal stands. Sound at
/// host scope too (`memo::refusal_stands`): other CPUs write the bucket meanwhile, but only
/// admissions write, and they only raise it. During a salt rotation the old generation's bucket
/// is read too and a later TAT carries over, as for per-CPU buckets; it is never written (every
/// write goes to the current generation).
#[inline(always)]
pub fn host<S: Shortcuts>(cfg: &Config, family: u8, policy: &Policy, words: &[u64; 3], len: u64) -> Option<Verdict> {
    let generation = (cfg.generation & 1) as usize;
    let mut memo = key_memo::<S>();
    let hash = memo::hash(memo.as_deref_mut(), &cfg.salts[generation], family, words);
    if let Some(m) = memo.as_deref_mut() {
        if memo::refusal_stands::<S>(m, cfg, policy, 1, true) {
            return Some(refusal(policy));
        }
    }
    let bucket = HOST_BUCKETS.get_ptr_mut(host_index(cfg, generation, hash))?;
    let s = host_one::stage(policy.id as u8, family, words, weight(policy, len))?;
    // SAFETY: a map value of 8 aligned bytes, valid for the program's run.
    let verdict = unsafe { scope::judge_shared(bucket, refusal(policy), |current| s.judge(current)) };
    if s.failed() {
        return None;
    }
    if let Some(m) = memo {
        // What the last try judged, and its clock: what the memo keeps of a refusal. Every try
        // lost a race: the last try's value admitted, so no refusal stands on it.
        let values = [s.value; MAX_ROWS];
        memo::remember(m, cfg, policy, &values, 1, s.now, verdict, true);
    }
    Some(verdict)
}

/// A host-scope policy for the key of `hash` (under the current salt): judged, and, when
/// `commit`, written by compare-and-exchange ([`host`]). Without `commit` it only reads: a
/// layer's look (`program::layers`), which a later commit may find changed by another CPU.
#[inline(always)]
pub fn host_layer(
    cfg: &Config,
    family: u8,
    policy: &Policy,
    words: &[u64; 3],
    hash: u64,
    len: u64,
    commit: bool,
) -> Option<Verdict> {
    if cfg.host_rows > 1 {
        return host_rows::judge(cfg, family, policy, words, hash, weight(policy, len), commit);
    }
    let generation = (cfg.generation & 1) as usize;
    let bucket = HOST_BUCKETS.get_ptr_mut(host_index(cfg, generation, hash))?;
    if !commit {
        let s = host_one::stage(policy.id as u8, family, words, weight(policy, len))?;
        // SAFETY: a map value of 8 aligned bytes, valid for the program's run.
        let (verdict, _) = s.judge(unsafe { scope::load(bucket) });
        return if s.failed() { None } else { Some(verdict) };
    }
    host_one_shared(bucket, policy, family, words, weight(policy, len))
}

/// `bucket` (one row) judged for `units` and written by compare-and-exchange
/// (`scope::judge_shared`), each try by `host_one`; None on a failed lookup.
#[inline(always)]
fn host_one_shared(bucket: *mut u64, policy: &Policy, family: u8, words: &[u64; 3], units: u64) -> Option<Verdict> {
    let s = host_one::stage(policy.id as u8, family, words, units)?;
    // SAFETY: a map value of 8 aligned bytes, valid for the program's run.
    let verdict = unsafe { scope::judge_shared(bucket, refusal(policy), |current| s.judge(current)) };
    if s.failed() { None } else { Some(verdict) }
}

/// This CPU's key memo, None when `S` turns it off.
#[inline(always)]
pub(super) fn key_memo<S: Shortcuts>() -> Option<&'static mut KeyMemo> {
    if !S::key_memo() {
        return None;
    }
    // SAFETY: a map value, valid for the program's run; only this CPU touches it.
    KEY_MEMO.get_ptr_mut(0).map(|m| unsafe { &mut *m })
}

/// The key's bucket in `HOST_BUCKETS` for `generation`, from the key's hash under that
/// generation's salt: one index over the generation's whole half (`Config::host_mask + 1`
/// buckets, sized apart from the per-CPU ones), laid out as `BUCKETS` is. One row (with more, [`host_rows`]).
#[inline(always)]
pub(super) fn host_index(cfg: &Config, generation: usize, hash: u64) -> u32 {
    let base = (generation as u32) * cfg.host_mask.wrapping_add(1);
    base + row0_index(hash, cfg.host_mask)
}

/// The rows a key memo of this scope records and checks (`memo::refusal_stands`): the host
/// array's (one, or `host_rows::ROWS`), or the per-CPU array's.
#[inline(always)]
pub(super) fn memo_rows(cfg: &Config, host: bool) -> usize {
    match host {
        true if cfg.host_rows > 1 => host_rows::ROWS,
        true => 1,
        false => row_shape(cfg).0,
    }
}

/// The current generation's rows of the key of `hash` under `policy`'s scope, as they are now
/// (the rest 0); None on a failed lookup. For the layered route's memo (`layer_memo`).
#[inline(always)]
pub(super) fn key_rows(cfg: &Config, policy: &Policy, hash: u64) -> Option<[u64; MAX_ROWS]> {
    let generation = (cfg.generation & 1) as usize;
    if policy.flags & Policy::SCOPE_HOST == 0 {
        let (rows, row_len) = row_shape(cfg);
        return read_rows(&bucket_rows(cfg, generation, hash, rows, row_len), rows);
    }
    let mut values = [0; MAX_ROWS];
    if cfg.host_rows > 1 {
        let idx = host_rows::buckets_of(cfg, cfg.generation, hash);
        let mut i = 0;
        while i < host_rows::ROWS {
            // SAFETY: a map value of 8 aligned bytes, valid for the program's run.
            values[i] = unsafe { scope::load(HOST_BUCKETS.get_ptr_mut(idx[i])?) };
            i += 1;
        }
    } else {
        // SAFETY: as above.
        values[0] = unsafe { scope::load(HOST_BUCKETS.get_ptr_mut(host_index(cfg, generation, hash))?) };
    }
    Some(values)
}

/// The number of rows and their length (a zero `rows` or `row_len` reads as one row of all).
#[inline(always)]
fn row_shape(cfg: &Config) -> (usize, u32) {
    let rows = if cfg.rows == 0 {
        1
    } else if cfg.rows as usize > MAX_ROWS {
        MAX_ROWS
    } else {
        cfg.rows as usize
    };
    let len = if cfg.row_len == 0 { cfg.bucket_mask.wrapping_add(1) } else { cfg.row_len };
    (rows, len)
}

/// The source's bucket in each row of `generation`, from its hash under that generation's salt.
#[inline(always)]
fn bucket_rows(cfg: &Config, generation: usize, hash: u64, rows: usize, len: u32) -> [u32; MAX_ROWS] {
    let base = (generation as u32) * (cfg.bucket_mask + 1);
    let mut idx = row_indexes(hash, rows, len);
    let mut i = 0;
    while i < MAX_ROWS {
        idx[i] += base;
        i += 1;
    }
    idx
}

/// The buckets' values; None on a failed lookup (an index beyond the map).
#[inline(always)]
fn read_rows(idx: &[u32; MAX_ROWS], rows: usize) -> Option<[u64; MAX_ROWS]> {
    // Each entry read or 0, none first zeroed (`row_indexes` says why).
    let mut found = true;
    let values = core::array::from_fn(|i| match BUCKETS.get_ptr(idx[i]) {
        _ if i >= rows => 0,
        Some(v) => unsafe { *v },
        None => {
            found = false;
            0
        }
    });
    found.then_some(values)
}

/// Writes the rows whose value changes (read above, so the lookups succeed).
#[inline(always)]
fn write_rows(idx: &[u32; MAX_ROWS], rows: usize, store: &[Option<u64>; MAX_ROWS]) {
    let mut i = 0;
    while i < MAX_ROWS && i < rows {
        if let Some(v) = store[i] {
            if let Some(bucket) = BUCKETS.get_ptr_mut(idx[i]) {
                unsafe { *bucket = v };
            }
        }
        i += 1;
    }
}

/// Policy `id`'s claim at `now_ns` (`limiter_common::gcra::claim`): its window while active, or
/// what is left of its hold. Asked only for a TAT beyond the reader's own window (is it owed to a
/// live source of its writer, or a ghost of the clock's wrap?). A failed lookup claims all.
#[inline(always)]
pub(super) fn claim(id: u8, now_ns: u64) -> u64 {
    match POLICIES.get(u32::from(id)) {
        Some(p) => {
            let capacity = if p.flags & Policy::ACTIVE != 0 { p.gcra.capacity } else { 0 };
            gcra::claim(capacity, p.hold_until_ns, now_ns)
        }
        None => gcra::Gcra::LIMIT,
    }
}

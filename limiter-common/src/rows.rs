//! Count-min rows: a key's allowance is kept in `D` buckets, one in each of `D` rows, and the
//! packet is judged by the least spent of them.
//!
//! The bucket memory of a generation (`N` buckets) is split into `D` rows of `N / D` buckets
//! (the few left over when `D` does not divide `N` go unused). One SipHash output of the key gives
//! the `D` indexes ([`row_indexes`]): row `i` takes the high 32 bits of `hash x MIX[i]` (a
//! multiply by an odd constant, a bijection of the 64-bit hash, so each is uniform when the hash
//! is), scaled to the row's length by a multiply and a shift, never a division.
//!
//! Judging ([`judge_rows`]), for a key with buckets `v_0 .. v_{D-1}`:
//! - admitted when the row with the earliest TAT admits it (GCRA admission is monotone in the
//!   TAT, so: when any of its rows admits it);
//! - then every row whose TAT is behind the new TAT is raised to it (conservative update); rows
//!   further ahead are left alone;
//! - each row counts as [`crate::gcra::credible_ahead`] says (a TAT beyond both the reader's
//!   window and its writer's claim is a ghost of the clock's wrap, and counts as idle);
//! - refused, nothing is written.
//!
//! Why a key never exceeds its own bound: every one of a key's rows holds a TAT at least the one
//! exact per-key GCRA would hold for that key (writes only raise, and a row counts as idle only
//! when no source can be owed its TAT), so the earliest of them
//! admits only what the exact GCRA would. Why an innocent survives: it is refused only when
//! *every* one of its `D` rows is spent, i.e. shared with some flooder in each row. With `K`
//! flooders kept spent and rows of `M = N / D`, that is `(1 - (1 - 1/M)^K)^D`.

use crate::gcra::{CLOCK_SHIFT, Gcra, ahead_units, credible_ahead};

/// At most this many rows (the kernel's loop bound).
pub const MAX_ROWS: usize = 4;
/// The default number of rows (chosen by measurement: docs/DESIGN.md, "Count-min rows").
pub const DEFAULT_ROWS: u32 = 4;
/// The rows of the host-scope buckets: two. The loss is `(1 - e^(-K D / N))^D` (docs/DESIGN.md,
/// "Per bucket: collisions, and rows"): two rows refuse fewer innocents than one up to about
/// 0.48 N flooding keys (past which more rows refuse more), where four stop helping past
/// about N / 3; host-scope arrays are sized from RAM (2^20 to 2^22 buckets), so realistic floods
/// stay well below both. The kernel judges them by `limiter_ebpf::scope::judge_rows`'s protocol.
pub const DEFAULT_HOST_ROWS: u32 = 2;
/// At most this many rows in the host-scope buckets (the kernel judges one or two there:
/// `limiter-ebpf`'s `program::host_rows`).
pub const MAX_HOST_ROWS: u32 = 2;

/// Odd multipliers, one per row: row `i`'s 32-bit hash is the high half of `hash x MIX[i]`.
const MIX: [u64; MAX_ROWS] =
    [0x9e37_79b9_7f4a_7c15, 0xc2b2_ae3d_27d4_eb4f, 0x1656_67b1_9e37_79f9, 0xd6e8_feb8_6659_fd93];

/// The length of each row when `buckets` are split into `rows` rows (userspace, once).
pub const fn row_len(buckets: u32, rows: u32) -> u32 {
    if rows <= 1 { buckets } else { buckets / rows }
}

/// Row `row`'s bucket (an index into the generation's `rows x len` buckets) for a key hash:
/// the place of the hash's high bits in the row, moved on by the slot in its low bits
/// (`key::key_hash`), wrapping to the row's start. Rows shorter than a slot group ignore the slot.
#[inline(always)]
pub fn row_index(hash: u64, row: usize, len: u32) -> u32 {
    let slot_mask = (1u64 << crate::key::SLOT_BITS) - 1;
    let h = ((hash & !slot_mask).wrapping_mul(MIX[row & (MAX_ROWS - 1)]) >> 32) as u32;
    let slot = if u64::from(len) > slot_mask { (hash & slot_mask) as u32 } else { 0 };
    let mut at = ((u64::from(h) * u64::from(len)) >> 32) as u32 + slot;
    if at >= len {
        at -= len;
    }
    (row as u32) * len + at
}

/// The buckets of a key hash in each of `rows` rows of `len` (entries past `rows` are 0).
#[inline(always)]
pub fn row_indexes(hash: u64, rows: usize, len: u32) -> [u32; MAX_ROWS] {
    // Each entry computed, none first zeroed: LLVM makes a call to `memset` of a zeroed array,
    // which the verifier walks again for every state that reaches it.
    core::array::from_fn(|i| if i < rows { row_index(hash, i, len) } else { 0 })
}

/// What judging one arrival against a key's rows decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowsJudgement {
    pub admit: bool,
    /// Each row's new value, when it changes (only an admission changes any).
    pub store: [Option<u64>; MAX_ROWS],
}

/// Judges one arrival against the first `rows` of `values` (a key's buckets, one per row) by the
/// rules in the module's documentation. Arguments as [`Gcra::judge`]; `claim` may be asked once
/// per row.
#[inline(always)]
pub fn judge_rows(
    gcra: &Gcra,
    me: u8,
    values: &[u64; MAX_ROWS],
    rows: usize,
    now_ns: u64,
    weight: u64,
    claim: impl Fn(u8) -> u64,
) -> RowsJudgement {
    let now = now_ns.wrapping_shl(CLOCK_SHIFT);
    let mut store = [None; MAX_ROWS];
    // The least any row counts ahead: the row that admits first. (Recomputed below rather than
    // kept in an array: an array on the BPF stack is zeroed by a call to memset, which costs
    // more than the arithmetic on this path.)
    let mut least = u64::MAX;
    let mut i = 0;
    while i < MAX_ROWS && i < rows {
        let ahead = credible_ahead(values[i], now, gcra.capacity, &claim);
        if ahead < least {
            least = ahead;
        }
        i += 1;
    }
    let next = least.saturating_add(gcra.cost(weight));
    if next > gcra.capacity {
        return RowsJudgement { admit: false, store };
    }
    // Conservative update: every row behind the new TAT is raised to it (and owned by `me`);
    // rows further ahead keep what they hold.
    let value = now.wrapping_add(next) | u64::from(me);
    let mut i = 0;
    while i < MAX_ROWS && i < rows {
        if credible_ahead(values[i], now, gcra.capacity, &claim) < next {
            store[i] = Some(value);
        }
        i += 1;
    }
    RowsJudgement { admit: true, store }
}

/// [`judge_rows`], each row's new value written over `values` where it changes (an admission;
/// a refusal leaves them all): true when admitted. For a caller short of stack (the kernel's
/// host scope keeps the values it read beside the values it writes, and no more).
#[inline(always)]
pub fn judge_rows_in_place(
    gcra: &Gcra,
    me: u8,
    values: &mut [u64; MAX_ROWS],
    rows: usize,
    now_ns: u64,
    weight: u64,
    claim: impl Fn(u8) -> u64,
) -> bool {
    let now = now_ns.wrapping_shl(CLOCK_SHIFT);
    judge_rows_by(gcra, me, values, rows, now_ns, weight, |v| credible_ahead(v, now, gcra.capacity, &claim))
}

/// [`judge_rows_in_place`] with each row's [`credible_ahead`] at `now_ns` given by `ahead(value)`
/// (asked twice per row, rather than kept: the kernel's host scope judges each try out of line,
/// in the few bytes of stack the verifier leaves a called function).
#[inline(always)]
pub fn judge_rows_by(
    gcra: &Gcra,
    me: u8,
    values: &mut [u64; MAX_ROWS],
    rows: usize,
    now_ns: u64,
    weight: u64,
    ahead: impl Fn(u64) -> u64,
) -> bool {
    let now = now_ns.wrapping_shl(CLOCK_SHIFT);
    let mut least = u64::MAX;
    let mut i = 0;
    while i < MAX_ROWS && i < rows {
        let a = ahead(values[i]);
        if a < least {
            least = a;
        }
        i += 1;
    }
    let next = least.saturating_add(gcra.cost(weight));
    if next > gcra.capacity {
        return false;
    }
    let value = now.wrapping_add(next) | u64::from(me);
    let mut i = 0;
    while i < MAX_ROWS && i < rows {
        if ahead(values[i]) < next {
            values[i] = value;
        }
        i += 1;
    }
    true
}

/// Until when (ns, exclusive) the exact GCRA keeps refusing packets of weight 1 from a key
/// whose rows hold `values`, if they stay as they are, after [`judge_rows`] refused one at
/// `now_ns`; 0 when it cannot say (a row is beyond the policy's window, where the answer depends
/// on its writer's claim). A refusal stands while every row's TAT is more than
/// `capacity - cost` ahead of now (docs/DESIGN.md, Decide).
#[inline(always)]
pub fn refused_until(gcra: &Gcra, values: &[u64; MAX_ROWS], rows: usize, now_ns: u64) -> u64 {
    let now = now_ns.wrapping_shl(CLOCK_SHIFT);
    let threshold = gcra.capacity.saturating_sub(gcra.cost(1));
    let mut least = u64::MAX;
    let mut i = 0;
    while i < MAX_ROWS && i < rows {
        let ahead = ahead_units(values[i], now);
        if ahead > gcra.capacity || ahead <= threshold {
            return 0;
        }
        if ahead < least {
            least = ahead;
        }
        i += 1;
    }
    if least == u64::MAX {
        return 0;
    }
    // Refused at `now + d` iff `(d << CLOCK_SHIFT) < least - threshold`: d below the ceiling.
    let span = (least - threshold + (1 << CLOCK_SHIFT) - 1) >> CLOCK_SHIFT;
    now_ns.wrapping_add(span)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{vec, vec::Vec};

    use rand::{Rng, SeedableRng, rngs::StdRng};

    use super::*;
    use crate::gcra::OWNER_MASK;

    const SEC: u64 = 1_000_000_000;

    /// `max over runs i..=j of (admitted weight) * period - (a_j - a_i) * count - burst * period`
    /// for unit weights: <= 0 iff the log keeps `floor((t + tau)/T) + 1` in every interval.
    fn max_excess(log: &[u64], gcra: &Gcra) -> i128 {
        let (e, cap) = (i128::from(gcra.emission), i128::from(gcra.capacity));
        let unit = 1i128 << CLOCK_SHIFT;
        let (mut before, mut min_x, mut worst) = (0i128, i128::MAX, i128::MIN);
        for &a in log {
            min_x = min_x.min(before * e - i128::from(a) * unit);
            before += 1;
            worst = worst.max(before * e - i128::from(a) * unit - min_x - cap);
        }
        worst
    }

    /// A table of `rows x len` buckets shared by every key.
    struct Table {
        rows: usize,
        buckets: Vec<u64>,
    }

    impl Table {
        fn new(rows: usize, len: u32) -> Self {
            Self { rows, buckets: vec![0; rows * len as usize] }
        }
        fn judge(
            &mut self,
            gcra: &Gcra,
            me: u8,
            idx: &[u32; MAX_ROWS],
            now: u64,
            owner_cap: impl Fn(u8) -> u64,
        ) -> bool {
            let mut values = [0u64; MAX_ROWS];
            for r in 0..self.rows {
                values[r] = self.buckets[idx[r] as usize];
            }
            let j = judge_rows(gcra, me, &values, self.rows, now, 1, owner_cap);
            for (&i, store) in idx.iter().zip(j.store).take(self.rows) {
                if let Some(v) = store {
                    self.buckets[i as usize] = v;
                }
            }
            j.admit
        }
        fn spent(&self, gcra: &Gcra, idx: &[u32; MAX_ROWS], now: u64) -> bool {
            (0..self.rows).all(|r| {
                let a = ahead_units(self.buckets[idx[r] as usize], now << CLOCK_SHIFT);
                a + gcra.cost(1) > gcra.capacity
            })
        }
    }

    #[test]
    fn indexes_fall_in_their_rows_and_spread_evenly() {
        let mut rng = StdRng::seed_from_u64(0x0505);
        for rows in 1..=MAX_ROWS {
            for buckets in [16u32, 1 << 10, 65_536, 1 << 24] {
                let len = row_len(buckets, rows as u32);
                for _ in 0..2000 {
                    let idx = row_indexes(rng.random(), rows, len);
                    for r in 0..rows {
                        assert!(
                            idx[r] >= r as u32 * len && idx[r] < (r as u32 + 1) * len,
                            "row {r} of {rows}: {idx:?}"
                        );
                    }
                }
            }
        }
        // Pairs of rows are independent: two random hashes that collide in row 0 collide in row r
        // about as often as any two hashes do (1/len), not more.
        let len = 64u32;
        for rows in 2..=MAX_ROWS {
            let hashes: Vec<u64> = (0..4000).map(|_| rng.random()).collect();
            let idx: Vec<[u32; MAX_ROWS]> = hashes.iter().map(|&h| row_indexes(h, rows, len)).collect();
            let (mut both, mut first) = (0u64, 0u64);
            for a in 0..idx.len() {
                for b in a + 1..idx.len() {
                    if idx[a][0] == idx[b][0] {
                        first += 1;
                        both += (1..rows).filter(|&r| idx[a][r] == idx[b][r]).count() as u64;
                    }
                }
            }
            let rate = both as f64 / (first as f64 * (rows - 1) as f64);
            assert!((rate - 1.0 / len as f64).abs() < 0.3 / len as f64, "{rows} rows: {rate} vs {}", 1.0 / len as f64);
        }
    }

    /// The in-place judgement is the judgement: the same verdict, and the values it leaves are
    /// the stores where there are any, the values read elsewhere.
    #[test]
    fn judging_in_place_is_judging() {
        let mut rng = StdRng::seed_from_u64(0x1b1a);
        for _ in 0..50_000 {
            let gcra = Gcra::new(rng.random_range(1..=10_000), SEC, rng.random_range(1..=20), 1).unwrap();
            let rows = rng.random_range(1..=MAX_ROWS);
            let now: u64 = rng.random_range(SEC..1u64 << 50);
            let mut values = [0u64; MAX_ROWS];
            for v in values.iter_mut().take(rows) {
                let ahead = rng.random_range(0..=gcra.capacity * 2) & !OWNER_MASK;
                *v = match rng.random_range(0..4) {
                    0 => 0,
                    1 => (now << CLOCK_SHIFT).wrapping_sub(ahead) | 1,
                    _ => (now << CLOCK_SHIFT).wrapping_add(ahead) | rng.random_range(1..=2u64),
                };
            }
            let claim = |id: u8| if id == 2 { gcra.capacity * 3 / 2 } else { gcra.capacity };
            let j = judge_rows(&gcra, 1, &values, rows, now, 1, claim);
            let mut in_place = values;
            assert_eq!(judge_rows_in_place(&gcra, 1, &mut in_place, rows, now, 1, claim), j.admit);
            for i in 0..MAX_ROWS {
                assert_eq!(in_place[i], j.store[i].unwrap_or(values[i]), "row {i} of {rows}: {values:?} {j:?}");
            }
        }
    }

    #[test]
    fn one_row_is_the_single_bucket_gcra() {
        let mut rng = StdRng::seed_from_u64(0x1);
        let gcra = Gcra::new(10, SEC, 5, 1).unwrap();
        let (mut single, mut row) = (0u64, Table::new(1, 1));
        let mut now = rng.random_range(0..u64::MAX / 2);
        for _ in 0..10_000 {
            now += rng.random_range(0..SEC / 5);
            let a = gcra.admit(&mut single, now, 1);
            let b = row.judge(&gcra, 1, &[0; MAX_ROWS], now, |_| 0);
            assert_eq!(a, b);
            assert_eq!(single, row.buckets[0]);
        }
    }

    /// Many keys forced into shared rows (tiny rows, many keys), random schedules, one to four
    /// rows: every admission is one the exact per-key GCRA (run over the key's own admissions)
    /// also makes, so every key keeps its own bound; and a key the exact GCRA would admit is
    /// refused only when all its rows are spent.
    #[test]
    fn shared_rows_keep_each_keys_bound_and_refuse_only_when_all_rows_are_spent() {
        let mut rng = StdRng::seed_from_u64(0x0c0_4417);
        let mut refused_innocent = 0u64;
        for round in 0..400 {
            let rows = rng.random_range(1..=MAX_ROWS);
            let len = rng.random_range(1..=8u32);
            let keys = rng.random_range(2..=40usize);
            let count = rng.random_range(1..=1000u64);
            let burst = [1u64, 2, 5, 20][rng.random_range(0..4)];
            let gcra = Gcra::new(count, SEC, burst, 1).unwrap();
            let t_ns = SEC as f64 / count as f64;
            let mut table = Table::new(rows, len);
            let idx: Vec<[u32; MAX_ROWS]> = (0..keys).map(|_| row_indexes(rng.random(), rows, len)).collect();
            // Each key offers 0.2x to 20x the rate; some are idle most of the time.
            let gaps: Vec<f64> = (0..keys).map(|_| t_ns / rng.random_range(0.2..20.0)).collect();
            let start: u64 = rng.random_range(0..u64::MAX / 2);
            let mut next: Vec<u64> = (0..keys).map(|k| start + (gaps[k] * rng.random_range(0.0..3.0)) as u64).collect();
            let mut exact = vec![0u64; keys];
            let mut logs: Vec<Vec<u64>> = vec![Vec::new(); keys];
            for _ in 0..4000 {
                let (k, &now) = next.iter().enumerate().min_by_key(|(_, t)| **t).unwrap();
                let spent_before = table.spent(&gcra, &idx[k], now);
                // The exact per-key GCRA over the key's own admissions (a shadow bucket that
                // moves only when the rows admit).
                let shadow = gcra.judge(1, exact[k], now, 1, |_| 0);
                let own = shadow.admit;
                let admitted = table.judge(&gcra, 1, &idx[k], now, |_| 0);
                if admitted {
                    exact[k] = shadow.store.unwrap_or(exact[k]);
                    logs[k].push(now - start);
                    assert!(own, "round {round}: key {k} admitted where its own GCRA refuses");
                } else if own {
                    // The exact GCRA admits, the rows refuse: only when every row is spent.
                    assert!(spent_before, "round {round}: key {k} refused with a row unspent");
                    refused_innocent += 1;
                } else {
                    assert!(spent_before);
                }
                // Admission matches "some row can take it".
                assert_eq!(admitted, !spent_before, "round {round}: key {k}");
                next[k] = now + (gaps[k] * rng.random_range(0.0..2.0)) as u64 + 1;
            }
            for (k, log) in logs.iter().enumerate() {
                let excess = max_excess(log, &gcra);
                assert!(excess <= 0, "round {round}: key {k} over its bound by {excess} units ({rows} rows of {len})");
            }
        }
        // The schedules do force collateral (so the refusal clause was exercised).
        assert!(refused_innocent > 1000, "only {refused_innocent} collateral refusals");
    }

    /// Keys of several policies (different rates and windows) sharing rows: each key keeps its
    /// own policy's bound, whatever the others leave in the shared rows.
    #[test]
    fn keys_of_several_policies_in_shared_rows_keep_their_bounds() {
        let mut rng = StdRng::seed_from_u64(0xabc);
        for round in 0..300 {
            let rows = rng.random_range(1..=MAX_ROWS);
            let len = rng.random_range(1..=4u32);
            let pols: Vec<Gcra> = (0..3)
                .map(|_| {
                    Gcra::new(rng.random_range(1..=10_000), SEC, [1u64, 5, 100][rng.random_range(0..3)], 1).unwrap()
                })
                .collect();
            let caps: Vec<u64> = pols.iter().map(|g| g.capacity).collect();
            let owner_cap = |o: u8| caps.get(usize::from(o).wrapping_sub(1)).copied().unwrap_or(0);
            let keys = rng.random_range(2..=12usize);
            let pol_of: Vec<usize> = (0..keys).map(|_| rng.random_range(0..3)).collect();
            let idx: Vec<[u32; MAX_ROWS]> = (0..keys).map(|_| row_indexes(rng.random(), rows, len)).collect();
            let gaps: Vec<f64> = (0..keys)
                .map(|k| SEC as f64 / pols[pol_of[k]].bound(SEC) as f64 / rng.random_range(0.3..20.0))
                .collect();
            let mut table = Table::new(rows, len);
            let start: u64 = rng.random_range(0..u64::MAX / 2);
            let mut next: Vec<u64> = vec![start; keys];
            let mut logs: Vec<Vec<u64>> = vec![Vec::new(); keys];
            for _ in 0..3000 {
                let (k, &now) = next.iter().enumerate().min_by_key(|(_, t)| **t).unwrap();
                let p = pol_of[k];
                if table.judge(&pols[p], p as u8 + 1, &idx[k], now, owner_cap) {
                    logs[k].push(now - start);
                }
                next[k] = now + (gaps[k] * rng.random_range(0.0..2.0)) as u64 + 1;
            }
            for (k, log) in logs.iter().enumerate() {
                let excess = max_excess(log, &pols[pol_of[k]]);
                assert!(excess <= 0, "round {round}: key {k} (policy {}) over its bound by {excess}", pol_of[k] + 1);
            }
        }
    }

    /// Salt rotation: carrying each row over (the later of the old and new bucket) grants no
    /// fresh allowance to a key that had spent its rows.
    #[test]
    fn rotation_carries_every_row_over() {
        let mut rng = StdRng::seed_from_u64(0x707);
        let gcra = Gcra::new(10, SEC, 5, 1).unwrap();
        for rows in 1..=MAX_ROWS {
            let len = 64;
            let mut old = Table::new(rows, len);
            let mut new = Table::new(rows, len);
            let (h_old, h_new): (u64, u64) = (rng.random(), rng.random());
            let (io, inew) = (row_indexes(h_old, rows, len), row_indexes(h_new, rows, len));
            let now = 1000 * SEC;
            let spent = (0..100).filter(|_| old.judge(&gcra, 1, &io, now, |_| 0)).count();
            assert_eq!(spent, 5);
            // During grace the kernel judges the later of each row's two buckets.
            let mut values = [0u64; MAX_ROWS];
            for r in 0..rows {
                values[r] = crate::gcra::later(
                    new.buckets[inew[r] as usize],
                    old.buckets[io[r] as usize],
                    now + SEC / 100,
                    gcra.capacity,
                    |_| gcra.capacity,
                );
            }
            let j = judge_rows(&gcra, 1, &values, rows, now + SEC / 100, 1, |_| 0);
            assert!(!j.admit, "{rows} rows: a rotation handed out a fresh allowance");
            for (&i, store) in inew.iter().zip(j.store).take(rows) {
                if let Some(v) = store {
                    new.buckets[i as usize] = v;
                }
            }
        }
    }

    /// The sweep behind the default: innocent loss under a flood of spoofed sources, each kept
    /// spent, for D = 1..4 at fixed memory, beside `(1 - (1 - D/N)^K)^D`. Run with
    /// `cargo test -p limiter-common --release -- --ignored --nocapture innocent_loss_sweep`.
    #[test]
    #[ignore]
    fn innocent_loss_sweep() {
        let gcra = Gcra::new(10, SEC, 5, 1).unwrap();
        let mut rng = StdRng::seed_from_u64(15);
        std::println!("| buckets | flooders | D | measured | theory |");
        std::println!("|---|---|---|---|---|");
        for buckets in [65_536u32, 1 << 20] {
            for flooders in [1_000usize, 5_000, 20_000, 50_000] {
                for rows in 1..=MAX_ROWS {
                    let len = row_len(buckets, rows as u32);
                    let mut table = Table::new(rows, len);
                    let mut now = 100 * SEC;
                    // Each flooder far over its rate: 10 packets within a millisecond spend its
                    // burst of 5 (its rows stay spent while it keeps flooding).
                    let idx: Vec<[u32; MAX_ROWS]> =
                        (0..flooders).map(|_| row_indexes(rng.random(), rows, len)).collect();
                    for _ in 0..10 {
                        for i in &idx {
                            table.judge(&gcra, 1, i, now, |_| 0);
                        }
                        now += 100_000;
                    }
                    let innocents = 20_000;
                    let refused = (0..innocents)
                        .filter(|_| !table.judge(&gcra, 1, &row_indexes(rng.random(), rows, len), now, |_| 0))
                        .count();
                    let m = len as f64;
                    let theory = (1.0 - (1.0 - 1.0 / m).powf(flooders as f64)).powi(rows as i32);
                    std::println!(
                        "| {buckets} | {flooders} | {rows} | {:.3}% | {:.3}% |",
                        100.0 * refused as f64 / innocents as f64,
                        100.0 * theory
                    );
                }
            }
        }
    }

    /// The standing refusal the kernel's memo serves is exact: every arrival before its end is
    /// refused by the full judgement, writing nothing, and the first at its end is admitted.
    #[test]
    fn a_standing_refusal_ends_exactly_when_the_full_judgement_admits() {
        let mut rng = StdRng::seed_from_u64(0x16);
        let mut checked = 0;
        for _ in 0..20_000 {
            let count = rng.random_range(1..=2000u64);
            let period = rng.random_range(1..=3u64) * SEC;
            let burst = rng.random_range(1..=20u64);
            let gcra = Gcra::new(count, period, burst, 1).unwrap();
            let rows = rng.random_range(1..=MAX_ROWS);
            let now: u64 = rng.random_range(SEC..1u64 << 47);
            let now_u = now << CLOCK_SHIFT;
            let mut values = [0u64; MAX_ROWS];
            for v in values.iter_mut().take(rows) {
                // Mostly spent rows near the threshold, some beyond the window, owners 1 or 2.
                let ahead = rng.random_range(0..=gcra.capacity + gcra.capacity / 8) & !OWNER_MASK;
                *v = now_u.wrapping_add(ahead) | rng.random_range(1..=2u64);
            }
            let owner_cap = |id: u8| if id == 2 { gcra.capacity * 2 } else { 0 };
            let j = judge_rows(&gcra, 1, &values, rows, now, 1, owner_cap);
            let until = if j.admit { 0 } else { refused_until(&gcra, &values, rows, now) };
            if until == 0 {
                continue;
            }
            checked += 1;
            let span = until - now;
            for d in [0, span / 2, span.saturating_sub(1), rng.random_range(0..span)] {
                let j = judge_rows(&gcra, 1, &values, rows, now + d, 1, owner_cap);
                assert!(!j.admit && j.store == [None; MAX_ROWS], "refused at +{d} of {span}: {j:?}");
            }
            let j = judge_rows(&gcra, 1, &values, rows, until, 1, owner_cap);
            assert!(j.admit, "admitted at the end ({span} ns): {j:?}");
        }
        assert!(checked > 1000, "only {checked} standing refusals drawn");
    }
}

//! The tick refusal: when a key's standing refusal may be kept without reading the clock.
//!
//! The precise clock (`bpf_ktime_get_ns`) is most of what a refusal from the key memo costs (a
//! helper call, about 35 ns on the benchmark VM against 1 ns for the whole memo compare). The
//! kernel's tick counter (`bpf_jiffies64`, a plain load) is free but coarse: it only says that
//! the current tick has not ended yet. So the clock is skipped only for a key that has *shown*
//! it is flooding: within one tick (an *epoch*: the time the tick counter keeps one value), its
//! packets refused on the precise clock must already be more than any source keeping to the
//! policy could send in that time. Then the rest of the epoch's packets of that key are refused
//! without the clock.
//!
//! Why a source that keeps to its rate is never refused this way: a source the policy's GCRA
//! admits in full (emission interval `T`, burst window `B x T`) sends at most
//! `floor((D + (B - 1) T) / T) + 1` packets in any `D`, so `n` packets in one epoch of length
//! `D` mean `n x T <= D + B x T`. An epoch lasts one tick (at most 10 ms: Linux's lowest `HZ` is
//! 100) plus however late the tick counter advances (a running CPU forces the update after 5
//! stalled ticks); [`SLACK_NS`] (64 ms) is taken as that longest epoch. Skipping needs
//! `n x T >= B x T + SLACK`, which no such source reaches.
//!
//! What a flooding key sees: a refusal that may outlast its exact end by the rest of the epoch
//! (at most one tick, normally). The key's buckets are not touched while it is refused, so the
//! admissions it is owed are made at once when the next epoch's first packet is judged in full:
//! the schedule does not slip while the delay is below the policy's tolerance `(B - 1) x T`. The
//! upper bound is untouched: a skip only ever refuses, and every admission is judged on the
//! precise clock.

use crate::gcra::{CLOCK_SHIFT, Gcra};

/// The longest a tick counter value is taken to last (ns): one tick at `HZ` = 100 (10 ms) plus
/// the 5 ticks a running CPU waits before it forces a stalled update, rounded up.
pub const SLACK_NS: u64 = 64_000_000;

/// A key's refusals in the current epoch (part of the per-CPU key memo).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Streak {
    /// The tick counter value of the epoch being counted.
    pub tick: u64,
    /// Refusals of the key confirmed on the precise clock in that epoch (counting stops once
    /// enough: `refusals x T` then stays below `B x T + SLACK + T`, which fits 64 bits).
    pub refusals: u64,
    /// The epoch whose remaining packets of the key are refused without the clock; 0: none
    /// (the tick counter starts near 2^32 and only grows, so it is never 0).
    pub skip_tick: u64,
}

impl Streak {
    /// Whether the key's packet may be refused without the clock: it is still the epoch in
    /// which the key proved it floods. `tick` is the counter read now.
    #[inline(always)]
    pub fn skips(&self, tick: u64) -> bool {
        self.skip_tick == tick
    }

    /// Counts a refusal the precise clock confirmed; `tick` is the counter read *before* that
    /// clock, so the refusal happened within the epoch `tick` names.
    #[inline(always)]
    pub fn confirm(&mut self, tick: u64, gcra: &Gcra) {
        if tick != self.tick {
            *self = Self { tick, refusals: 0, skip_tick: 0 };
        }
        if self.skip_tick == 0 {
            self.refusals += 1;
            if self.refusals * gcra.emission >= gcra.capacity.saturating_add(SLACK_NS << CLOCK_SHIFT) {
                self.skip_tick = tick;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use rand::{Rng, SeedableRng, rngs::StdRng};

    use super::*;

    const MS: u64 = 1_000_000;

    /// Epoch starts up to `until`: one tick of 1-10 ms each, now and then one that lasts up to 6
    /// ticks (an update that came late, as when the CPU keeping time is stalled): at most 60 ms,
    /// under SLACK_NS.
    fn epochs(rng: &mut StdRng, until: u64) -> Vec<u64> {
        let tick = rng.random_range(1..=10) * MS;
        let mut starts = std::vec![0];
        let mut last = 0;
        while last < until {
            last += if rng.random_range(0..10) == 0 { rng.random_range(1..=6 * tick) } else { tick };
            starts.push(last);
        }
        starts
    }

    /// The tick counter at `t` (epoch `i` is counter value `BASE + i`).
    fn counter(starts: &[u64], t: u64) -> u64 {
        const BASE: u64 = 4_294_892_296;
        BASE + starts.partition_point(|&s| s <= t) as u64 - 1
    }

    fn random_gcra(rng: &mut StdRng) -> Gcra {
        let per_s = [1u64, 5, 10, 100, 1000, 10_000, 1_000_000][rng.random_range(0..7)];
        let burst = [1u64, 2, 5, 100, 1000][rng.random_range(0..5)];
        Gcra::new(per_s, 1_000_000_000, burst, 1).expect("representable")
    }

    /// Even if every packet of a source that keeps to its rate is refused (by state others left
    /// in its buckets), it never earns a skip.
    #[test]
    fn a_source_that_keeps_to_its_rate_never_skips() {
        let mut rng = StdRng::seed_from_u64(0x71c4);
        for case in 0..500 {
            let gcra = random_gcra(&mut rng);
            let starts = epochs(&mut rng, 2_000 * MS);
            let mut steps = 0;
            // The densest sequence the GCRA admits in full, with random extra gaps.
            let mut bucket = 0u64;
            let mut t = 1;
            let mut streak = Streak::default();
            let step = (gcra.emission >> CLOCK_SHIFT).max(1);
            // 2 s, or 20,000 steps for the fast rates (still hundreds of epochs).
            while t < 2_000 * MS && steps < 20_000 {
                steps += 1;
                if gcra.admit(&mut bucket, t, 1) {
                    let tick = counter(&starts, t);
                    assert!(!streak.skips(tick), "case {case}: {gcra:?} skipped a conforming packet at {t}");
                    streak.confirm(tick, &gcra);
                    assert_eq!(streak.skip_tick, 0, "case {case}: {gcra:?}: a conforming source earned a skip at {t}");
                    t += if rng.random_range(0..4) == 0 { rng.random_range(0..=step * 3) } else { 0 };
                } else {
                    t += rng.random_range(1..=step.max(2) / 2 + 1);
                }
            }
        }
    }

    /// A flood earns the skip within an epoch after `(B x T + SLACK) / T` refusals, keeps it for
    /// that epoch only, and must earn it again in the next.
    #[test]
    fn a_flood_skips_for_the_rest_of_its_epoch_only() {
        let mut rng = StdRng::seed_from_u64(0xf100d);
        for _ in 0..200 {
            let gcra = random_gcra(&mut rng);
            let need = (gcra.capacity + (SLACK_NS << CLOCK_SHIFT)).div_ceil(gcra.emission);
            let mut streak = Streak::default();
            let tick = 4_294_892_296 + rng.random_range(0..1000);
            for i in 1..=need {
                assert!(!streak.skips(tick), "skipped after {} of {need}", i - 1);
                streak.confirm(tick, &gcra);
            }
            assert!(streak.skips(tick), "{gcra:?}: no skip after {need} refusals in one epoch");
            assert!(!streak.skips(tick + 1), "the skip outlived its epoch");
            streak.confirm(tick + 1, &gcra);
            assert!(need == 1 || !streak.skips(tick + 1), "the next epoch skipped without counting");
        }
    }
}

//! The refusal sampler's draw: which refusals go to the `REFUSALS` ring (`limiter-ctl top`).
//!
//! A per-CPU xorshift64 state stepped once per refusal, instead of `bpf_get_prandom_u32` (a
//! helper call: about 15 ns of a 40 ns refusal on the benchmark VM). The samples only rank
//! prefixes for an operator, so statistical quality is what matters, not secrecy: the state is
//! seeded from the kernel's generator on a CPU's first refusal and never leaves the CPU.
//!
//! A draw that hits is then held to the CPU's budget (`Config::sample_budget` samples per
//! [`SAMPLE_WINDOW_NS`], [`hit`]): at a flood's rate 1 in N is still thousands of samples a
//! second, each a ring record and a wakeup of the daemon. Only a hit reads the clock. Between
//! two samples sent, the hits form a reservoir of one: the sample sent is one of them drawn
//! uniformly, carrying their count as its weight. Sending the first hit after the budget allows
//! would favour the sparse sources of a bursty mix (a hit after a long gap is more often the
//! first after any moment); a uniform draw keeps `weight x N` an unbiased estimate per source.

use crate::maps::{RefusalSample, SAMPLE_WINDOW_NS};

/// Each CPU's sampler: the draw's state, the budget's window and the reservoir, one map value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sampler {
    /// The xorshift64 state ([`draw`]); 0 until the CPU's first refusal.
    pub state: u64,
    pub window: Window,
    /// The reservoir's sample: one of `window.pending` hits, each as likely.
    pub candidate: RefusalSample,
    pub _pad: u32,
}

/// The budget's window and the hits waiting since the last sample sent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    /// When the current window opened (monotonic ns).
    pub start_ns: u64,
    /// Samples sent in the current window.
    pub taken: u32,
    /// Hits since the last sample sent (the reservoir's size).
    pub pending: u32,
}

/// What to do with a hit ([`hit`]): make it the reservoir's sample, then send the reservoir's
/// sample with this weight (0: not yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hit {
    pub replace: bool,
    pub send: u32,
}

/// Steps the generator (xorshift64, period 2^64 - 1 over non-zero states) and says whether this
/// refusal is sampled: one in `mask + 1` (a power of two). A zero state is seeded with `seed`
/// (forced non-zero) first.
#[inline(always)]
pub fn draw(state: &mut u64, seed: u32, mask: u32) -> bool {
    let mut x = *state;
    if x == 0 {
        x = u64::from(seed) << 32 | 0x9e37_79b9;
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    // The high half: xorshift's low bits are its weakest.
    (x >> 32) as u32 & mask == 0
}

/// A fresh 32 bits from the generator (a hit's reservoir draw): the state is already seeded.
#[inline(always)]
pub fn next(state: &mut u64) -> u32 {
    let mut x = *state | 1;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    (x >> 32) as u32
}

/// A hit of [`draw`] at `now_ns`, held to `budget` samples per window (0: no cap), with `random`
/// a fresh draw ([`next`]). The hit joins the reservoir: it replaces the reservoir's sample with
/// probability 1 / (hits waiting), so each waiting hit is as likely to be the one sent. The
/// reservoir is sent when the budget allows, its weight the hits it stands for.
///
/// Within a window, a quarter of the budget (and one) may go at once, so a short burst of
/// refusals is seen whole and a new flood at once, and the rest is paced evenly over the
/// window. Hits waiting for more than two windows are dropped rather than sent as a later
/// flood's. No division: it runs in the XDP program (on hits only). No overflow: `taken` and
/// `budget` are u32 and elapsed is under a window (1e9), so every product is under 2^63.
#[inline(always)]
pub fn hit(w: &mut Window, now_ns: u64, budget: u32, random: u32) -> Hit {
    if budget == 0 {
        return Hit { replace: true, send: 1 };
    }
    let mut elapsed = now_ns.wrapping_sub(w.start_ns);
    if elapsed >= SAMPLE_WINDOW_NS {
        if elapsed >= 2 * SAMPLE_WINDOW_NS {
            w.pending = 0;
        }
        w.start_ns = now_ns;
        w.taken = 0;
        elapsed = 0;
    }
    let pending = w.pending.saturating_add(1);
    w.pending = pending;
    // random < 2^32 / pending, without the division.
    let replace = (u64::from(random) * u64::from(pending)) >> 32 == 0;
    let burst = budget >> 2;
    let allowed = u64::from(burst) * SAMPLE_WINDOW_NS + u64::from(budget - burst) * elapsed;
    if w.taken >= budget || u64::from(w.taken) * SAMPLE_WINDOW_NS > allowed {
        return Hit { replace, send: 0 };
    }
    w.taken += 1;
    w.pending = 0;
    Hit { replace, send: pending }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One in `mask + 1` over many draws, for every sampling rate the CLI accepts, whatever the
    /// seed (0 included), and no run of misses far beyond what chance allows.
    #[test]
    fn samples_one_in_n() {
        for (seed, shift) in [(0u32, 0u32), (1, 1), (0xdead_beef, 4), (7, 8), (u32::MAX, 12)] {
            let mask = (1u32 << shift) - 1;
            let mut state = 0u64;
            let draws = 1u64 << 22;
            let (mut hits, mut gap, mut longest) = (0u64, 0u64, 0u64);
            for _ in 0..draws {
                if draw(&mut state, seed, mask) {
                    hits += 1;
                    gap = 0;
                } else {
                    gap += 1;
                    longest = longest.max(gap);
                }
            }
            let expected = draws >> shift;
            // Five standard deviations of a binomial count.
            let tolerance = 5 * (expected as f64).sqrt() as u64 + 5;
            assert!(hits.abs_diff(expected) <= tolerance, "1 in {}: {hits} of {draws}, expected {expected}", mask + 1);
            // P(a gap of 30 x N) = e^-30 per draw: never in 2^22 draws.
            assert!(longest < 30 * u64::from(mask + 1), "1 in {}: {longest} misses in a row", mask + 1);
            assert_ne!(state, 0);
        }
    }
}

#[cfg(test)]
mod budget_tests {
    extern crate std;
    use std::{collections::BTreeMap, vec::Vec};

    use super::*;

    const W: u64 = SAMPLE_WINDOW_NS;
    const BOOT: u64 = 5 * W;

    /// Hits at `times`, each from `source(i)`, through a reservoir: what was sent, as (time,
    /// source, weight, the window's start).
    fn run(
        budget: u32,
        times: impl Iterator<Item = u64>,
        source: impl Fn(usize) -> u32,
    ) -> (Vec<(u64, u32, u32, u64)>, Window) {
        let (mut w, mut state, mut candidate) = (Window::default(), 0x1234_5678_9abc_def0u64, None);
        let mut sent = Vec::new();
        for (i, t) in times.enumerate() {
            let h = hit(&mut w, t, budget, next(&mut state));
            if h.replace {
                candidate = Some(source(i));
            }
            if h.send > 0 {
                sent.push((t, candidate.expect("a sample in the reservoir"), h.send, w.start_ns));
            }
        }
        (sent, w)
    }

    fn every(gap: u64, span: u64) -> impl Iterator<Item = u64> {
        (0..span / gap).map(move |i| BOOT + i * gap)
    }

    #[test]
    fn no_budget_sends_every_hit_at_weight_one() {
        let (sent, w) = run(0, every(1_000, W), |i| i as u32);
        assert_eq!(sent.len() as u64, W / 1_000);
        assert!(sent.iter().enumerate().all(|(i, &(_, s, w, _))| w == 1 && s == i as u32));
        assert_eq!(w, Window::default(), "no budget: the window is never touched");
    }

    /// Whatever the budget and however fast the hits, at most `budget` samples in any window
    /// the sampler opened, and their weights add up to every hit (nothing is lost or counted
    /// twice while hits keep coming).
    #[test]
    fn at_most_the_budget_per_window_and_weights_add_up_to_every_hit() {
        for budget in [1u32, 2, 3, 4, 7, 128, 256, 10_000] {
            for gap in [997u64, 100_000, 3_000_000] {
                let span = 5 * W + W / 3;
                let hit_count = span / gap;
                let (sent, w) = run(budget, every(gap, span), |i| i as u32);
                let mut windows: BTreeMap<u64, u32> = BTreeMap::new();
                for &(t, _, _, start) in &sent {
                    assert!(
                        t >= start && t - start < W,
                        "budget {budget}, gap {gap}: sent at {t} in the window of {start}"
                    );
                    *windows.entry(start).or_default() += 1;
                }
                assert!(windows.values().all(|&n| n <= budget), "budget {budget}, gap {gap}: {windows:?}");
                assert!(windows.keys().zip(windows.keys().skip(1)).all(|(a, b)| b - a >= W), "{windows:?}");
                let weights: u64 = sent.iter().map(|&(_, _, w, _)| u64::from(w)).sum();
                assert_eq!(weights + u64::from(w.pending), hit_count, "budget {budget}, gap {gap}");
                // Each sample is one of the hits it stands for.
                let mut first = 0u64;
                for &(_, s, weight, _) in &sent {
                    assert!((first..first + u64::from(weight)).contains(&u64::from(s)), "budget {budget}, gap {gap}");
                    first += u64::from(weight);
                }
                if hit_count <= u64::from(budget) {
                    assert_eq!(sent.len() as u64, hit_count, "under the budget, every hit is sent");
                }
            }
        }
    }

    /// A flood far over the budget: a quarter at once, then the rest spread over the window, so
    /// each quarter of the window after the first holds about a quarter of the paced samples.
    #[test]
    fn a_flood_over_the_budget_is_sampled_across_the_whole_window() {
        let budget = 128u32;
        let (sent, _) = run(budget, every(100, W), |i| i as u32);
        assert_eq!(sent.len(), budget as usize);
        // The first paced sample is due W / 96 (10 ms) in.
        let burst = sent.iter().filter(|&&(t, ..)| t < BOOT + W / 200).count();
        assert_eq!(burst, (budget / 4 + 1) as usize, "the burst");
        for q in 0..4 {
            let (from, to) = (BOOT + (q * W / 4).max(W / 200), BOOT + (q + 1) * W / 4);
            let n = sent.iter().filter(|&&(t, ..)| t >= from && t < to).count();
            assert!((23..=25).contains(&n), "quarter {q}: {n} samples");
        }
        // Each paced sample stands for the hits since the one before it.
        let (t, _, w, _) = sent[sent.len() - 1];
        let (t0, ..) = sent[sent.len() - 2];
        assert_eq!(u64::from(w), (t - t0) / 100);
    }

    /// The case a first-hit-after-the-deadline sampler gets wrong: a sparse steady source and a
    /// dense bursty one on one CPU, far over the budget. Each one's weights add up to its hits
    /// within a few percent.
    #[test]
    fn weights_estimate_each_source_of_a_bursty_mix() {
        // Source 0: a hit every 20 us (a third of the hits). Source 1: bursts of 1,000 hits
        // 100 ns apart every 10 ms: a moment picked at random falls in a burst 1% of the time.
        let mut hits: Vec<(u64, u32)> = (0..250_000u64).map(|i| (BOOT + i * 20_000, 0)).collect();
        for b in 0..500u64 {
            hits.extend((0..1_000u64).map(|i| (BOOT + b * 10_000_000 + 3_333 + i * 100, 1)));
        }
        hits.sort();
        let truth = [250_000u64, 500_000];
        let (sent, w) = run(128, hits.iter().map(|h| h.0), |i| hits[i].1);
        let mut estimate = [0u64; 2];
        for &(_, s, weight, _) in &sent {
            estimate[s as usize] += u64::from(weight);
        }
        estimate[hits[hits.len() - 1].1 as usize] += u64::from(w.pending);
        let counts = [0, 1].map(|s| sent.iter().filter(|x| x.1 == s).count());
        for s in 0..2 {
            let ratio = estimate[s] as f64 / truth[s] as f64;
            assert!((0.85..=1.15).contains(&ratio), "source {s}: {estimate:?} for {truth:?} ({counts:?} samples)");
        }
    }

    /// The clock is read only on hits: a window opens at the first hit after the last closed,
    /// hits waiting long ago are dropped rather than sent as a later flood's, and a clock that
    /// seems to go back opens a new window rather than stalling. Counts saturate.
    #[test]
    fn windows_open_on_hits_and_stale_hits_are_dropped() {
        let mut w = Window::default();
        assert_eq!(hit(&mut w, BOOT, 1, 0), Hit { replace: true, send: 1 });
        assert_eq!(hit(&mut w, BOOT + 10, 1, 0).send, 0);
        // 1 in 2: a random number under half of 2^32 replaces.
        assert_eq!(hit(&mut w, BOOT + 20, 1, u32::MAX / 2), Hit { replace: true, send: 0 });
        assert_eq!(hit(&mut w, BOOT + 30, 1, u32::MAX / 2), Hit { replace: false, send: 0 });
        assert_eq!(hit(&mut w, BOOT + W + 5, 1, u32::MAX).send, 4, "within two windows: sent");
        assert_eq!(hit(&mut w, BOOT + W + 6, 1, 0).send, 0);
        assert_eq!(hit(&mut w, BOOT + 10 * W, 1, u32::MAX), Hit { replace: true, send: 1 }, "much later: dropped");
        assert_eq!(hit(&mut w, BOOT + 3 * W, 1, u32::MAX).send, 1, "a clock behind the window opens a new one");
        w.pending = u32::MAX;
        w.taken = 1;
        assert_eq!(hit(&mut w, BOOT + 3 * W + 1, 1, 0).send, 0);
        assert_eq!(hit(&mut w, BOOT + 4 * W + 1, 1, 0).send, u32::MAX);
        // The largest budget cannot overflow the pacing.
        let mut w = Window { start_ns: BOOT, taken: u32::MAX / 2, pending: 0 };
        assert_eq!(hit(&mut w, BOOT + W - 1, u32::MAX, 0).send, 1);
        w.taken = u32::MAX - 1;
        assert_eq!(hit(&mut w, BOOT + W - 1, u32::MAX, 0).send, 0, "paced: the last of the budget is the window's end");
    }
}

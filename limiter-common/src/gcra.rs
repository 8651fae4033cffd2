//! GCRA (generic cell rate algorithm) on one shared clock.
//!
//! A policy of `count` per `period` with burst `B` has emission interval `T = period / count` and
//! tolerance `tau = (B - 1) * T`; in any interval of length `t` it admits at most
//! `floor((t + tau) / T) + 1` units of weight ([`Gcra::bound`] gives it in the rounded units).
//!
//! One clock for every bucket. All policies share one bucket array, so a bucket may hold what
//! another policy, an older rate of the same policy, or a reused id wrote. Every TAT is therefore
//! kept in the same units ([`CLOCK_SHIFT`]: 2^-8 ns) whatever the rate, and every bucket says who
//! wrote it: a `u64` bucket holds
//!
//! ```text
//!   bits 63..8  the theoretical arrival time (TAT) in whole ns (clock units, a multiple of TICK)
//!   bits  7..0  the id of the policy that wrote it (0: never written)
//! ```
//!
//! Precision. `T` is kept in 2^-8 ns per unit of weight and rounded *up*; a packet's cost
//! (`T x weight`) is rounded up to a whole ns ([`TICK`]): the limiter never admits more than the
//! published rate. The rounding costs at most 1 ns per packet: under 1/1000 of the rate for packet
//! policies up to 10^6 packets/s per key (under 1/100 up to 10^7); for byte policies up to
//! 2.5 x 10^8 bytes/s (2 Gbit/s) per key with frames that cost 1000 ns or more (64-byte frames up
//! to 6.4 x 10^7 bytes/s), under 1/100 up to 2.5 x 10^9 bytes/s with 1500-byte frames. A TAT's
//! range matters more than sub-ns precision: see Wrap.
//!
//! Wrap. `now << CLOCK_SHIFT` wraps every 2^56 ns (2.28 years): only the distance from now
//! matters. The kernel's clock (`CLOCK_MONOTONIC`) starts at boot, so no TAT can be older than
//! the host's uptime, and a TAT read back wrong after a wrap (a "ghost") needs an uptime over
//! 2.28 years and a bucket idle for as long; even then [`credible_ahead`] discards it unless it
//! falls inside its writer's claim (below).
//!
//! Claims. A TAT ahead of now says "some source may still be owed nothing until then". Whoever
//! wrote it last (the owner byte) had admitted within its own window, so the TAT is at most
//! the writer's window ahead of the time it was written, and so is every TAT it covers (a write
//! only raises a bucket). The kernel asks, per owner id, for its *claim*: how far ahead of now a
//! TAT that policy wrote can legitimately be, `max(its window if active, its hold)`, where the
//! hold is set by userspace whenever a policy's window shrinks (a rate edit, a removal, an id
//! handed to another policy) to the old window from the change on (`maps::Policy::hold_until_ns`).
//! So a claim never shrinks faster than time passes, and no live TAT is ever beyond its writer's
//! claim. What a reader does with what it finds:
//! - idle or never written: a fresh bucket;
//! - ahead within its own window: ordinary GCRA, whoever wrote it (the TAT only grows, so the
//!   writer's bound holds too, and the reader takes the bucket over when it admits);
//! - ahead beyond its own window and within the writer's claim: refused, nothing written (a live
//!   source of the writer, or the policy's own TAT from before its rate was lowered, may be
//!   owed nothing until then: lowering it would hand that source a spent burst back);
//! - ahead beyond the writer's claim: no source can be owed that (a ghost of the clock's wrap):
//!   idle.
//!
//! Only admissions write, and only raise a bucket (or replace a ghost): a refusal never writes,
//! so a flood over its rate only reads. Whatever a bucket holds, a reader whose source keeps to
//! its rate is refused for at most one burst window of its own, except while the bucket is
//! inside the claim of another policy that wrote it: collateral that ends at most one window of
//! that writer after it last wrote (edits and removals do not extend it), and that never lets
//! anyone over its own bound.

/// Clock units per ns: `2^CLOCK_SHIFT`.
pub const CLOCK_SHIFT: u32 = 8;
/// Stored TATs and per-packet costs are multiples of this many clock units (1 ns); the bits
/// below hold the writer's policy id.
pub const TICK: u64 = 1 << 8;
/// The bits of a bucket that hold the writer's policy id.
pub const OWNER_MASK: u64 = TICK - 1;

/// Parameters of one GCRA policy, as the XDP program reads them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gcra {
    /// Emission interval per unit of weight, in clock units (packets: a multiple of [`TICK`]).
    pub emission: u64,
    /// `burst x emission` (rounded up to a [`TICK`]): how far ahead of now a TAT may be after
    /// an admission.
    pub capacity: u64,
}

/// Why a rate cannot be represented.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GcraError {
    ZeroCount,
    ZeroPeriod,
    ZeroBurst,
    /// More than [`Gcra::MAX_RATE_PER_SEC`] units per second.
    RateTooHigh,
    /// `burst * T` (or `max_weight * T`) does not fit the clock's range.
    WindowTooLong,
}

impl core::fmt::Display for GcraError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Self::ZeroCount => "the rate's count must be at least 1",
            Self::ZeroPeriod => "the rate's period must be longer than 0",
            Self::ZeroBurst => "the burst must be at least 1",
            Self::RateTooHigh => "the rate is above 10^12 per second",
            Self::WindowTooLong => {
                "the burst window (burst / rate) is longer than 19 hours; lower the burst or raise the rate"
            }
        })
    }
}

impl core::error::Error for GcraError {}

/// What judging one arrival decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Judgement {
    pub admit: bool,
    /// The bucket's new value, when it changes (only an admission changes it).
    pub store: Option<u64>,
}

impl Gcra {
    /// Every capacity, claim and per-packet cost stays at or below this (2^46 ns, 19.5 hours),
    /// 1/1024 of the clock's wrap, so a distance above it can only mean "behind now".
    pub const LIMIT: u64 = 1 << 54;
    pub const MAX_RATE_PER_SEC: u64 = 1_000_000_000_000;

    /// Parameters for `count` units per `period_ns`, burst `burst` units, with per-packet weights
    /// up to `max_weight` (1 for packets, the largest frame for bytes).
    #[cfg(not(target_arch = "bpf"))]
    pub fn new(count: u64, period_ns: u64, burst: u64, max_weight: u64) -> Result<Self, GcraError> {
        if count == 0 {
            return Err(GcraError::ZeroCount);
        }
        if period_ns == 0 {
            return Err(GcraError::ZeroPeriod);
        }
        if burst == 0 {
            return Err(GcraError::ZeroBurst);
        }
        if u128::from(count) * 1_000_000_000 > u128::from(Self::MAX_RATE_PER_SEC) * u128::from(period_ns) {
            return Err(GcraError::RateTooHigh);
        }
        let tick = u128::from(TICK);
        let fine = (u128::from(period_ns) << CLOCK_SHIFT).div_ceil(u128::from(count));
        // One packet costs a whole number of ticks: for packets, T itself is; for bytes, each
        // frame's cost is rounded up, and the capacity too, so a frame as large as the burst fits.
        let (emission, capacity) = if max_weight <= 1 {
            let emission = fine.div_ceil(tick) * tick;
            (emission, emission * u128::from(burst))
        } else {
            (fine, (fine * u128::from(burst)).div_ceil(tick) * tick)
        };
        let limit = u128::from(Self::LIMIT);
        if capacity > limit || emission * u128::from(max_weight.max(1)) > limit {
            return Err(GcraError::WindowTooLong);
        }
        Ok(Self { emission: emission as u64, capacity: capacity as u64 })
    }

    /// The clock units one arrival of `weight` costs: `T x weight`, rounded up to a [`TICK`].
    #[inline(always)]
    pub fn cost(&self, weight: u64) -> u64 {
        (self.emission * weight + (TICK - 1)) & !OWNER_MASK
    }

    /// Judges one arrival of `weight` units at `now_ns` by policy `me` (1..=255) against the
    /// bucket `value` (see the module's rules). `claim(id)` is policy `id`'s claim in clock units
    /// at `now_ns` ([`credible_ahead`]); it is asked only when the TAT is beyond `me`'s window.
    /// `weight` must not exceed the `max_weight` the parameters were built for.
    #[inline(always)]
    pub fn judge(&self, me: u8, value: u64, now_ns: u64, weight: u64, claim: impl FnOnce(u8) -> u64) -> Judgement {
        let now = now_ns.wrapping_shl(CLOCK_SHIFT);
        let next = credible_ahead(value, now, self.capacity, claim) + self.cost(weight);
        if next > self.capacity {
            return Judgement { admit: false, store: None };
        }
        Judgement { admit: true, store: Some(now.wrapping_add(next) | u64::from(me)) }
    }

    /// [`Gcra::judge`] for a bucket only this policy (id 1, no hold) uses: updates it, says
    /// whether the arrival is admitted. For simulations and tests.
    #[inline(always)]
    pub fn admit(&self, bucket: &mut u64, now_ns: u64, weight: u64) -> bool {
        let capacity = self.capacity;
        let j = self.judge(1, *bucket, now_ns, weight, |o| if o == 1 { capacity } else { 0 });
        if let Some(v) = j.store {
            *bucket = v;
        }
        j.admit
    }

    /// How far ahead of now a TAT can be (the burst window), in ns, rounded up.
    pub fn window_ns(&self) -> u64 {
        self.capacity.div_ceil(1 << CLOCK_SHIFT)
    }

    /// The most weight these parameters admit in any interval of `interval_ns`, per bucket:
    /// `floor((t + tau) / T) + 1` in the rounded units (for packets, where `T` is exact in ticks).
    #[cfg(not(target_arch = "bpf"))]
    pub fn bound(&self, interval_ns: u64) -> u64 {
        let t = u128::from(interval_ns) << CLOCK_SHIFT;
        ((t + u128::from(self.capacity)) / u128::from(self.emission)) as u64
    }
}

/// How far a bucket's TAT is ahead of `now` (clock units, already shifted), 0 when the bucket
/// is idle (behind now) or was never written.
#[inline(always)]
pub fn ahead_units(value: u64, now: u64) -> u64 {
    let ahead = (value & !OWNER_MASK).wrapping_sub(now);
    if value & OWNER_MASK == 0 || ahead > Gcra::LIMIT { 0 } else { ahead }
}

/// How far ahead of `now` (clock units, already shifted) a bucket counts for a reader whose
/// window is `capacity`: its TAT's distance, except that a TAT beyond both the reader's window
/// and its writer's claim (`claim(owner)`, clock units, plus [`CLOCK_SKEW`]) counts as idle: no source can be owed
/// that, since a claim never shrinks faster than time passes (the module's rules). `claim` is
/// asked only for a TAT beyond the reader's window.
#[inline(always)]
pub fn credible_ahead(value: u64, now: u64, capacity: u64, claim: impl FnOnce(u8) -> u64) -> u64 {
    let ahead = ahead_units(value, now);
    if ahead > capacity && ahead > claim(owner(value)).saturating_add(CLOCK_SKEW) { 0 } else { ahead }
}

/// How far two CPUs' reads of the kernel's clock may disagree (clock units, 1 ms: far above
/// what a synchronised TSC shows): a TAT that far past its writer's claim still counts, so a
/// reader whose clock lags the writer's never takes a live TAT for a ghost.
pub const CLOCK_SKEW: u64 = 1_000_000 << CLOCK_SHIFT;

/// A policy's claim in clock units at `now_ns` (see the module's rules): its window while it is
/// active (`capacity`, 0 if not), or what is left of its hold (`hold_until_ns`, monotonic ns)
/// if that is longer. Never above [`Gcra::LIMIT`].
#[inline(always)]
pub fn claim(capacity: u64, hold_until_ns: u64, now_ns: u64) -> u64 {
    let left = hold_until_ns.saturating_sub(now_ns);
    let held = if left >= Gcra::LIMIT >> CLOCK_SHIFT { Gcra::LIMIT } else { left << CLOCK_SHIFT };
    if held > capacity { held } else { capacity }
}

/// Added to every hold: a program that read a policy's old entry before userspace replaced it
/// may still be judging with it (XDP programs run for microseconds).
pub const HOLD_MARGIN_NS: u64 = 1_000_000;

/// The hold a policy slot must carry once its entry is replaced by one whose claim may be
/// smaller (a lowered rate, a removal, the id handed to another policy), given the old entry's
/// `capacity` (0 if it was not active), its `hold_until_ns`, and `now_ns` read *after* the new
/// entry became visible (userspace writes it first with an unbounded hold, `u64::MAX`, then
/// this one): the old claim, from now on. Every TAT the old entry let a source earn is then
/// within the slot's claim until it is reached, so no reader takes it for a ghost.
pub fn hold_after(capacity: u64, hold_until_ns: u64, now_ns: u64) -> u64 {
    if capacity == 0 {
        return hold_until_ns;
    }
    let window = capacity.div_ceil(1 << CLOCK_SHIFT);
    hold_until_ns.max(now_ns.saturating_add(window).saturating_add(HOLD_MARGIN_NS))
}

/// How far a bucket's TAT is ahead of `now_ns`, in ns (rounded up); 0 when idle or never written.
pub fn ahead_ns(value: u64, now_ns: u64) -> u64 {
    ahead_units(value, now_ns.wrapping_shl(CLOCK_SHIFT)).div_ceil(1 << CLOCK_SHIFT)
}

/// The policy id that last wrote a bucket (0: never written).
#[inline(always)]
pub fn owner(value: u64) -> u8 {
    (value & OWNER_MASK) as u8
}

/// The bucket a rotation's grace carries over: of a source's bucket under the current salt and
/// under the previous one, the one further ahead of now as a reader with window `capacity` counts
/// it ([`credible_ahead`]), so a rotation grants no fresh allowance and a ghost left in the old
/// generation holds nobody.
#[inline(always)]
pub fn later(current: u64, previous: u64, now_ns: u64, capacity: u64, claim: impl Fn(u8) -> u64) -> u64 {
    let now = now_ns.wrapping_shl(CLOCK_SHIFT);
    if credible_ahead(previous, now, capacity, &claim) > credible_ahead(current, now, capacity, &claim) {
        previous
    } else {
        current
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{vec, vec::Vec};

    use rand::{Rng, SeedableRng, rngs::StdRng};

    use super::*;

    const SEC: u64 = 1_000_000_000;
    const WRAP_NS: u64 = 1 << (64 - CLOCK_SHIFT);

    /// Checks the published bound over an admission log with exact rational arithmetic:
    /// every run i..=j of admissions satisfies (j - i + 1) <= floor((a_j - a_i) * count / period) + burst.
    /// Equivalently X_j - min(X_i) <= (burst - 1) * period with X_k = k * period - a_k * count.
    fn max_excess(log: &[u64], count: u64, period: u64, burst: u64) -> i128 {
        let (count, period, burst) = (count as i128, period as i128, burst as i128);
        let mut min_x = i128::MAX;
        let mut worst = i128::MIN;
        for (k, &a) in log.iter().enumerate() {
            let x = k as i128 * period - a as i128 * count;
            min_x = min_x.min(x);
            worst = worst.max(x - min_x - (burst - 1) * period);
        }
        worst
    }

    /// The same for weighted admissions `(time, weight)` against the parameters' own rounded
    /// bound: in every run i..=j, the weight admitted <= (a_j - a_i + capacity) / emission.
    fn weighted_excess(log: &[(u64, u64)], gcra: &Gcra) -> i128 {
        // W_j - W_{i-1} <= ((a_j - a_i) * 2^s + cap) / e  <=>  X_j - min_{i<=j} X'_i <= cap
        // with X_j = W_j * e - a_j * 2^s and X'_i = W_{i-1} * e - a_i * 2^s.
        let (e, cap) = (i128::from(gcra.emission), i128::from(gcra.capacity));
        let unit = 1i128 << CLOCK_SHIFT;
        let (mut before, mut min_x, mut worst) = (0i128, i128::MAX, i128::MIN);
        for &(a, w) in log {
            min_x = min_x.min(before * e - i128::from(a) * unit);
            before += i128::from(w);
            worst = worst.max(before * e - i128::from(a) * unit - min_x - cap);
        }
        worst
    }

    /// A policy from one per hour to 10^12 per second, packets or bytes.
    #[derive(Clone, Copy, Debug)]
    struct Pol {
        count: u64,
        period: u64,
        burst: u64,
        max_weight: u64,
        gcra: Gcra,
    }

    impl Pol {
        /// The exact emission interval per unit of weight, in ns.
        fn t_ns(&self) -> f64 {
            self.period as f64 / self.count as f64
        }
        /// A weight this policy can meet.
        fn weight(&self, rng: &mut StdRng) -> u64 {
            if self.max_weight == 1 { 1 } else { rng.random_range(64..=self.max_weight.min(self.burst)) }
        }
    }

    fn random_policy(rng: &mut StdRng) -> Pol {
        loop {
            let period = [SEC, 60 * SEC, 3600 * SEC][rng.random_range(0..3)];
            let bytes = rng.random_bool(0.4);
            let max_count = (Gcra::MAX_RATE_PER_SEC as u128 * period as u128 / SEC as u128) as f64;
            let count = 10f64.powf(rng.random_range(0.0..max_count.log10())) as u64;
            let (max_weight, burst) = if bytes {
                (1500, rng.random_range(1500..200_000))
            } else {
                (1, [1, 2, 5, 100, 10_000][rng.random_range(0..5)])
            };
            if let Ok(gcra) = Gcra::new(count.max(1), period, burst, max_weight) {
                return Pol { count: count.max(1), period, burst, max_weight, gcra };
            }
        }
    }

    fn random_packet_rate(rng: &mut StdRng) -> (u64, u64, u64) {
        // From one per hour to 10^9 per second, on a log scale.
        let period = [SEC, 60 * SEC, 3600 * SEC][rng.random_range(0..3)];
        let exp = rng.random_range(0.0..(period as f64).log10());
        let count = (10f64.powf(exp) as u64).clamp(1, period);
        let burst = [1, 2, 5, 100, 10_000][rng.random_range(0..5)];
        (count, period, burst)
    }

    #[test]
    fn bound_holds_over_random_schedules() {
        let mut rng = StdRng::seed_from_u64(0x6c696d69);
        let mut arrivals = 0u64;
        for _ in 0..200 {
            let (count, period, burst) = random_packet_rate(&mut rng);
            let Ok(gcra) = Gcra::new(count, period, burst, 1) else { continue };
            let exact_t = period as f64 / count as f64;
            // Offer between 0.5x and 20x the rate, with jittered gaps and idle spells.
            let mean_gap = (exact_t / rng.random_range(0.5..20.0)).max(1.0);
            let mut now: u64 = rng.random_range(0..u64::MAX / 2);
            let mut log = Vec::new();
            let mut tat = 0u64;
            for _ in 0..1000 {
                now += (mean_gap * rng.random_range(0.0..2.0)) as u64;
                if rng.random_ratio(1, 200) {
                    now += (exact_t * burst as f64 * rng.random_range(0.0..3.0)) as u64;
                }
                if gcra.admit(&mut tat, now, 1) {
                    log.push(now);
                }
                arrivals += 1;
            }
            let excess = max_excess(&log, count, period, burst);
            assert!(excess <= 0, "{count}/{period}ns burst {burst}: bound exceeded ({excess})");
        }
        assert!(arrivals >= 100_000);
    }

    #[test]
    fn client_keeping_to_the_rate_is_never_refused() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..300 {
            let (count, period, burst) = random_packet_rate(&mut rng);
            let Ok(gcra) = Gcra::new(count, period, burst, 1) else { continue };
            let min_gap = period.div_ceil(count); // whole ns, never shorter than the exact T
            let mut now = rng.random_range(0..u64::MAX / 2);
            let mut tat = 0;
            for i in 0..1000 {
                now += min_gap + if rng.random_bool(0.5) { 0 } else { rng.random_range(0..min_gap) };
                assert!(gcra.admit(&mut tat, now, 1), "{count}/{period}ns b{burst}: refused #{i}");
            }
        }
    }

    #[test]
    fn rate_is_exact_within_a_thousandth() {
        // Packets: T of 1000 ns or more (up to 10^6/s per source), and 4 ns exactly.
        for (count, period) in [
            (1, 3600 * SEC),
            (3, SEC),
            (100, 60 * SEC),
            (250_000_000, SEC),
            (1_000_000, SEC),
            (999_983, SEC),
            (123_456, 3600 * SEC),
        ] {
            let gcra = Gcra::new(count, period, 1, 1).unwrap();
            let exact = period as f64 * f64::from(1u32 << CLOCK_SHIFT) / count as f64;
            let err = (gcra.emission as f64 - exact) / exact;
            assert!((0.0..=0.001).contains(&err), "{count}/{period}: error {err}");
            // Over a long flood the admitted count is within 0.1% of rate x time.
            let t = 10 * period;
            let admitted = gcra.bound(t) as f64;
            let ideal = (10 * count) as f64;
            assert!(admitted <= ideal + 1.0 && admitted >= ideal * 0.999, "{admitted} vs {ideal}");
        }
        // Bytes: up to 2.5 x 10^8 bytes/s, each frame's cost within 0.1% when it costs 1000 ns
        // or more (64-byte frames up to 6.4 x 10^7 bytes/s), and never below the exact cost.
        for count in [1u64, 1000, 1_000_000, 64_000_000, 250_000_000] {
            let gcra = Gcra::new(count, SEC, 1500, 1500).unwrap();
            for w in [64u64, 65, 577, 1500].into_iter().filter(|&w| w * SEC >= 1000 * count) {
                let exact = w as f64 * SEC as f64 * f64::from(1u32 << CLOCK_SHIFT) / count as f64;
                let err = (gcra.cost(w) as f64 - exact) / exact;
                assert!((0.0..=0.001).contains(&err), "{count} B/s, {w} B: error {err}");
            }
        }
    }

    /// The check in the background reading: ~10,865 requests at a mean of 3/s against
    /// 100 per minute over one simulated hour.
    #[test]
    fn published_check_one_hour_at_3_per_second() {
        let mut rng = StdRng::seed_from_u64(10_865);
        let burst = 5; // floor((10 s + tau) / 0.6 s) + 1 = 21
        let gcra = Gcra::new(100, 60 * SEC, burst, 1).unwrap();
        let mut now = 0u64;
        let mut offered = 0;
        let mut log = Vec::new();
        let mut tat = 0;
        while now < 3600 * SEC {
            // Poisson arrivals, mean 3/s.
            let u: f64 = rng.random_range(f64::MIN_POSITIVE..1.0);
            now += (-u.ln() / 3.0 * SEC as f64) as u64;
            offered += 1;
            if gcra.admit(&mut tat, now, 1) {
                log.push(now);
            }
        }
        assert!((10_500..11_200).contains(&offered), "offered {offered}");
        assert!(log.len() <= 6001, "admitted {} > 6001", log.len());
        assert!(log.len() >= 5900, "admitted only {}", log.len());
        let mut busiest = 0;
        let mut lo = 0;
        for hi in 0..log.len() {
            while log[hi] - log[lo] >= 10 * SEC {
                lo += 1;
            }
            busiest = busiest.max(hi - lo + 1);
        }
        assert!(busiest <= 21, "busiest 10 s held {busiest}");
        assert_eq!(gcra.bound(10 * SEC), 21);
        assert!(max_excess(&log, 100, 60 * SEC, burst) <= 0);
    }

    #[test]
    fn clock_stepping_back_gives_no_second_allowance() {
        let gcra = Gcra::new(10, SEC, 10, 1).unwrap();
        let mut tat = 0;
        let t0 = 1000 * SEC;
        let first = (0..100).filter(|_| gcra.admit(&mut tat, t0, 1)).count();
        assert_eq!(first, 10);
        // Two CPUs' clocks may disagree by far less than CLOCK_SKEW.
        let again = (0..100).filter(|_| gcra.admit(&mut tat, t0 - 900_000, 1)).count();
        assert_eq!(again, 0);
    }

    #[test]
    fn later_picks_the_bucket_further_ahead_across_the_wrap() {
        let gcra = Gcra::new(10, SEC, 3, 1).unwrap();
        for now in [100 * SEC, WRAP_NS - 1, WRAP_NS + 5, u64::MAX - SEC] {
            let (mut spent, mut used) = (0, 0);
            while gcra.admit(&mut spent, now, 1) {}
            assert!(gcra.admit(&mut used, now, 1));
            let mine = |o: u8| if o == 1 { gcra.capacity } else { 0 };
            let c = gcra.capacity;
            assert_eq!(later(0, spent, now, c, mine), spent);
            assert_eq!(later(spent, 0, now, c, mine), spent);
            assert_eq!(later(used, spent, now, c, mine), spent);
            assert_eq!(later(spent, used, now, c, mine), spent);
            // Carrying the later TAT over keeps a spent bucket spent.
            let mut carried = later(0, spent, now, c, mine);
            assert!(!gcra.admit(&mut carried, now, 1), "at {now}");
        }
    }

    #[test]
    fn weights_charge_their_size() {
        // 1000 bytes/s, burst 1500 bytes.
        let gcra = Gcra::new(1000, SEC, 1500, 1500).unwrap();
        let mut tat = 0;
        let now = 50 * SEC;
        assert!(gcra.admit(&mut tat, now, 1000));
        assert!(!gcra.admit(&mut tat, now, 600));
        assert!(gcra.admit(&mut tat, now, 500));
        assert!(!gcra.admit(&mut tat, now, 1));
        assert!(gcra.admit(&mut tat, now + SEC, 1000));
    }

    #[test]
    fn survives_the_clock_wrapping() {
        let gcra = Gcra::new(1_000_000_000, SEC, 4, 1).unwrap();
        let mut tat = 0;
        let mut admitted = 0;
        for now in [WRAP_NS - 3, WRAP_NS - 1, WRAP_NS, WRAP_NS + 1] {
            admitted += (0..10).filter(|_| gcra.admit(&mut tat, now, 1)).count() as u64;
        }
        // A wrong wrap would either refuse everything after it or hand out a fresh burst.
        assert!(admitted >= 4 && admitted <= gcra.bound(4), "{admitted} > {}", gcra.bound(4));
    }

    #[test]
    fn rejects_what_it_cannot_represent() {
        assert_eq!(Gcra::new(0, SEC, 1, 1), Err(GcraError::ZeroCount));
        assert_eq!(Gcra::new(1, 0, 1, 1), Err(GcraError::ZeroPeriod));
        assert_eq!(Gcra::new(1, SEC, 0, 1), Err(GcraError::ZeroBurst));
        assert_eq!(Gcra::new(u64::MAX, SEC, 1, 1), Err(GcraError::RateTooHigh));
        // 19 hours fit, 20 do not.
        assert!(Gcra::new(1, 3600 * SEC, 19, 1).is_ok());
        assert_eq!(Gcra::new(1, 3600 * SEC, 20, 1), Err(GcraError::WindowTooLong));
        assert!(Gcra::new(Gcra::MAX_RATE_PER_SEC, SEC, 1_000_000, 65_535).is_ok());
    }

    /// A source keeping to `pol`'s rate from `start`: arrivals `gap` apart (each at least the
    /// rounded cost of its weight, in whole ns), with random weights.
    fn compliant_arrivals(rng: &mut StdRng, pol: &Pol, start: u64, n: usize) -> Vec<(u64, u64)> {
        let mut at = start;
        (0..n)
            .map(|i| {
                let w = pol.weight(rng);
                if i > 0 {
                    // The rounded cost: the rate the limiter publishes is never above it.
                    let gap = pol.gcra.cost(w).div_ceil(TICK) + 1;
                    at = at.wrapping_add(gap + rng.random_range(0..=gap / 4));
                }
                (at, w)
            })
            .collect()
    }

    /// Two or three policies whose sources collide on one bucket, all active at once, each
    /// offering 0.5x to 20x its rate: every source stays within its own bound (no reader lowers a
    /// TAT another live policy may still own), whatever the mix of rates, units and windows.
    #[test]
    fn colliding_policies_each_keep_their_bound() {
        let mut rng = StdRng::seed_from_u64(0xc0111de);
        for round in 0..300 {
            let n = rng.random_range(2..=3usize);
            let pols: Vec<Pol> = (0..n).map(|_| random_policy(&mut rng)).collect();
            let caps: Vec<u64> = pols.iter().map(|p| p.gcra.capacity).collect();
            let owner_cap = |o: u8| caps.get(usize::from(o).wrapping_sub(1)).copied().unwrap_or(0);
            let mut now: u64 = rng.random_range(0..=u64::MAX);
            let mut bucket = 0u64;
            let mut logs: Vec<Vec<(u64, u64)>> = vec![Vec::new(); n];
            let mut next: Vec<u64> = (0..n).map(|_| now).collect();
            let start = now;
            let gaps: Vec<f64> =
                pols.iter().map(|p| p.t_ns() * p.max_weight as f64 / rng.random_range(0.5..20.0)).collect();
            for _ in 0..3000 {
                // The next arrival of whichever source is due first.
                let (k, &at) = next.iter().enumerate().min_by_key(|(_, t)| t.wrapping_sub(start)).unwrap();
                now = at;
                let w = pols[k].weight(&mut rng);
                let j = pols[k].gcra.judge(k as u8 + 1, bucket, now, w, owner_cap);
                if let Some(v) = j.store {
                    bucket = v;
                }
                if j.admit {
                    logs[k].push((now.wrapping_sub(start), w));
                }
                next[k] = now.wrapping_add((gaps[k] * rng.random_range(0.0..2.0)) as u64 + 1);
            }
            for (k, log) in logs.iter().enumerate() {
                let excess = weighted_excess(log, &pols[k].gcra);
                assert!(
                    excess <= 0,
                    "round {round}: source of policy {} ({:?}) over its bound by {excess}",
                    k + 1,
                    pols[k]
                );
            }
        }
    }

    /// A bucket left idle for any time up to several wraps of the clock holds its next reader
    /// (the same policy) for at most one burst window.
    #[test]
    fn an_idle_bucket_heals_within_one_window_at_any_age() {
        let mut rng = StdRng::seed_from_u64(0x1d1e);
        for _ in 0..2000 {
            let pol = random_policy(&mut rng);
            let mut bucket = 0u64;
            let t0: u64 = rng.random_range(0..=u64::MAX);
            // Spend the bucket.
            while pol.gcra.judge(1, bucket, t0, 1, |_| 0).admit {
                bucket = pol.gcra.judge(1, bucket, t0, 1, |_| 0).store.unwrap();
            }
            let idle = match rng.random_range(0..3) {
                0 => rng.random_range(0..4 * WRAP_NS),
                1 => WRAP_NS * rng.random_range(1..4) - rng.random_range(0..=pol.gcra.window_ns()),
                _ => WRAP_NS / 2 + rng.random_range(0..WRAP_NS / 2),
            };
            let start = t0.wrapping_add(idle);
            let grace = pol.gcra.window_ns() + (pol.t_ns() * pol.max_weight as f64) as u64 + 2;
            for (at, w) in compliant_arrivals(&mut rng, &pol, start, 50) {
                let j = pol.gcra.judge(1, bucket, at, w, |_| 0);
                if let Some(v) = j.store {
                    bucket = v;
                }
                let late = at.wrapping_sub(start);
                assert!(j.admit || late < grace, "{pol:?}: idle {idle} ns, then refused {late} ns on (grace {grace})");
            }
        }
    }

    /// A policy at 10^6/s burst 10^6 (a 1 s window) lowered to 1000/s burst 100: its source,
    /// which spent the old burst, waits out what it earned under the old rate (the slot's hold
    /// keeps that TAT credible), then is admitted at the new rate; without the hold the old TAT
    /// would read as a ghost and hand it (and whoever it shares the bucket with) a fresh burst.
    #[test]
    fn a_lowered_rate_waits_out_the_old_tat_then_admits_at_the_new_rate() {
        let old = Gcra::new(1_000_000, SEC, 1_000_000, 1).unwrap();
        let new = Gcra::new(1000, SEC, 100, 1).unwrap();
        let mut bucket = 0;
        let edit = 3 * 86_400 * SEC;
        while old.judge(1, bucket, edit, 1, |_| old.capacity).admit {
            bucket = old.judge(1, bucket, edit, 1, |_| old.capacity).store.unwrap();
        }
        let hold = hold_after(old.capacity, 0, edit);
        let (mut now, mut first, mut admitted) = (edit, None, 0u64);
        for _ in 0..200_000 {
            now += 10_000; // 100,000/s for 2 s
            let j = new.judge(1, bucket, now, 1, |_| claim(new.capacity, hold, now));
            if let Some(v) = j.store {
                bucket = v;
                first.get_or_insert(now);
                admitted += 1;
            }
        }
        let first = first.expect("never admitted");
        // Admitted once the old TAT (1 s ahead) is within the new window (0.1 s), no sooner.
        let due = edit + SEC - new.window_ns() + new.cost(1).div_ceil(TICK);
        assert!((due..=due + 20_000).contains(&first), "first admission {} ns after the edit", first - edit);
        assert!((1095..=new.bound(now - first)).contains(&admitted), "admitted {admitted}");
        // The same without the hold: the old TAT reads as a ghost at once.
        assert!(new.judge(1, bucket_after(&old, edit), edit + 1000, 1, |_| new.capacity).admit);
    }

    fn bucket_after(gcra: &Gcra, at: u64) -> u64 {
        let mut b = 0;
        while gcra.admit(&mut b, at, 1) {}
        b
    }
}

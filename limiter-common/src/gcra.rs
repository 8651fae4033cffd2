//! GCRA (generic cell rate algorithm) on integer nanoseconds.
//!
//! One `u64` per bucket, the theoretical arrival time (TAT). A policy of `count` per `period`
//! with burst `B` has emission interval `T = period / count` and tolerance `tau = (B - 1) * T`;
//! in any interval of length `t` it admits at most `floor((t + tau) / T) + 1` units of weight.
//!
//! Precision. `T` is kept in fixed point, in units of `2^-shift` ns, with `shift` the smallest
//! that makes `T` at least [`Gcra::MIN_EMISSION`] units, so rounding costs at most 1/1024 of the
//! rate at any rate (1/hour and 10^9/s alike). `T` is rounded *up*: the limiter never admits more
//! than the published bound, and a client whose gaps (in whole ns) are never shorter than the
//! exact `T` is never refused.
//!
//! Clock. TATs live in the same fixed-point units, modulo 2^64: `now << shift` wraps after
//! 2^(64-shift) ns. Only the distance from now matters, and a legitimate TAT is never more than
//! `capacity` ahead of now, so anything further ahead is clamped to `capacity` (a TAT from a
//! tighter old policy, or a clock that stepped back, cannot yield a fresh allowance) and anything
//! behind now, or 0 (never used), counts as an idle bucket. A bucket left idle for half a wrap
//! period or more (2^63 units: 292 years at shift 0, 104 days at shift 10) may look ahead of now
//! and is then held for at most one burst window (`capacity`), never longer.

/// Parameters of one GCRA policy, as the XDP program reads them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gcra {
    /// Emission interval per unit of weight, in 2^-shift ns.
    pub emission: u64,
    /// `burst * emission`: how far ahead of now a TAT may be after an admission.
    pub capacity: u64,
    /// Fixed-point shift applied to `now` (ns).
    pub shift: u32,
    pub _pad: u32,
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
                "burst x emission interval is longer than 146 years; lower the burst or raise the rate"
            }
        })
    }
}

impl core::error::Error for GcraError {}

impl Gcra {
    /// Emission intervals are kept at least this many fixed-point units (rounding <= 1/1024).
    pub const MIN_EMISSION: u64 = 1024;
    /// Largest fixed-point shift: allows `T` down to 2^-10 ns.
    pub const MAX_SHIFT: u32 = 20;
    /// Every TAT distance stays below this, so sums of two never overflow.
    pub const LIMIT: u64 = 1 << 62;
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
        let mut shift = 0;
        let emission = loop {
            let scaled = u128::from(period_ns) << shift;
            let emission = scaled.div_ceil(u128::from(count));
            if emission >= u128::from(Self::MIN_EMISSION) || shift == Self::MAX_SHIFT {
                break emission;
            }
            shift += 1;
        };
        let limit = u128::from(Self::LIMIT);
        let capacity = emission * u128::from(burst);
        if capacity > limit || emission * u128::from(max_weight.max(1)) > limit {
            return Err(GcraError::WindowTooLong);
        }
        Ok(Self { emission: emission as u64, capacity: capacity as u64, shift, _pad: 0 })
    }

    /// Judges one arrival of `weight` units at `now_ns` against the bucket's `tat`, updating it
    /// when admitted. `weight` must not exceed the `max_weight` the parameters were built for.
    #[inline(always)]
    pub fn admit(&self, tat: &mut u64, now_ns: u64, weight: u64) -> bool {
        let now = now_ns.wrapping_shl(self.shift);
        let mut ahead = tat.wrapping_sub(now);
        if *tat == 0 || (ahead as i64) < 0 {
            // Never used, or behind now: the bucket is idle.
            ahead = 0;
        } else if ahead > self.capacity {
            ahead = self.capacity;
        }
        let next = ahead + self.emission * weight;
        if next > self.capacity {
            return false;
        }
        // 0 means "never used"; one unit later is the conservative side.
        let new_tat = now.wrapping_add(next);
        *tat = if new_tat == 0 { 1 } else { new_tat };
        true
    }

    /// How far ahead of now a TAT can be (the burst window), in ns, rounded up.
    pub fn window_ns(&self) -> u64 {
        let unit = 1u64 << self.shift;
        self.capacity.div_ceil(unit)
    }

    /// The later of two TATs of the same clock (0: never used). Salt rotation carries a source's
    /// TAT from its old bucket to its new one with this, so a rotation grants no fresh allowance.
    #[inline(always)]
    pub fn later(a: u64, b: u64) -> u64 {
        if a == 0 || (b != 0 && (b.wrapping_sub(a) as i64) > 0) { b } else { a }
    }

    /// The most weight these parameters admit in any interval of `interval_ns`, per bucket:
    /// `floor((t + tau) / T) + 1` in the rounded units.
    #[cfg(not(target_arch = "bpf"))]
    pub fn bound(&self, interval_ns: u64) -> u64 {
        let t = u128::from(interval_ns) << self.shift;
        ((t + u128::from(self.capacity)) / u128::from(self.emission)) as u64
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::vec::Vec;

    use rand::{Rng, SeedableRng, rngs::StdRng};

    use super::*;

    const SEC: u64 = 1_000_000_000;

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

    fn random_rate(rng: &mut StdRng) -> (u64, u64, u64) {
        // From one per hour to 10^9 per second, on a log scale.
        let period = [SEC, 60 * SEC, 3600 * SEC][rng.random_range(0..3)];
        let max_count = period; // 10^9/s
        let exp = rng.random_range(0.0..(max_count as f64).log10());
        let count = (10f64.powf(exp) as u64).clamp(1, max_count);
        let burst = [1, 2, 5, 100, 10_000][rng.random_range(0..5)];
        (count, period, burst)
    }

    #[test]
    fn bound_holds_over_random_schedules() {
        let mut rng = StdRng::seed_from_u64(0x6c696d69);
        let mut arrivals = 0u64;
        for _ in 0..200 {
            let (count, period, burst) = random_rate(&mut rng);
            let gcra = Gcra::new(count, period, burst, 1).expect("valid rate");
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
            let (count, period, burst) = random_rate(&mut rng);
            let gcra = Gcra::new(count, period, burst, 1).expect("valid rate");
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
        for (count, period) in [
            (1, 3600 * SEC),
            (3, SEC),
            (100, 60 * SEC),
            (333_333_333, SEC),
            (999_999_937, SEC),
            (1_000_000_000, SEC),
            (700_000_000, SEC),
            (123_456, 3600 * SEC),
        ] {
            let gcra = Gcra::new(count, period, 1, 1).unwrap();
            let exact = period as f64 * f64::from(1u32 << gcra.shift) / count as f64;
            let err = (gcra.emission as f64 - exact) / exact;
            assert!((0.0..=0.001).contains(&err), "{count}/{period}: error {err}");
            // Over a long flood the admitted count is within 0.1% of rate x time.
            let t = 10 * period;
            let admitted = gcra.bound(t) as f64;
            let ideal = (10 * count) as f64;
            assert!(admitted <= ideal + 1.0 && admitted >= ideal * 0.999, "{admitted} vs {ideal}");
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
        let again = (0..100).filter(|_| gcra.admit(&mut tat, t0 - 2 * SEC, 1)).count();
        assert_eq!(again, 0);
    }

    #[test]
    fn later_picks_the_later_tat_across_the_wrap() {
        assert_eq!(Gcra::later(0, 5), 5);
        assert_eq!(Gcra::later(5, 0), 5);
        assert_eq!(Gcra::later(5, 7), 7);
        assert_eq!(Gcra::later(7, 5), 7);
        assert_eq!(Gcra::later(u64::MAX - 1, 3), 3, "3 is 5 units after the wrap");
        // Carrying the later TAT over keeps a spent bucket spent.
        let gcra = Gcra::new(10, SEC, 3, 1).unwrap();
        let (mut old, now) = (0, 100 * SEC);
        while gcra.admit(&mut old, now, 1) {}
        let mut new = Gcra::later(0, old);
        assert!(!gcra.admit(&mut new, now, 1));
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
    fn survives_the_fixed_point_clock_wrapping() {
        let gcra = Gcra::new(1_000_000_000, SEC, 4, 1).unwrap(); // shift 10: wraps every 2^54 ns
        assert_eq!(gcra.shift, 10);
        let wrap = 1u64 << 54;
        let mut tat = 0;
        let mut admitted = 0;
        for now in [wrap - 3, wrap - 1, wrap, wrap + 1] {
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
        assert_eq!(Gcra::new(1, 3600 * SEC, 2_000_000, 1), Err(GcraError::WindowTooLong));
        assert!(Gcra::new(1, 3600 * SEC, 1_000_000, 1).is_ok());
    }
}

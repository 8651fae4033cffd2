//! Host scope shares one bucket between CPUs, so what a flood writes is what it costs (every
//! write moves the cache line to the writing CPU). GCRA writes on admission; a refusal writes
//! only to clamp a stale TAT, and that once: after it, the TAT is within the reader's window.
//! Checked here over random policies, random starting buckets (idle, spent, stale, written by
//! another policy, active or not) and floods far over the rate.

use limiter_common::{Gcra, gcra::CLOCK_SHIFT};
use rand::{Rng, SeedableRng, rngs::StdRng};

const SEC: u64 = 1_000_000_000;

#[test]
fn a_flood_writes_on_admission_and_clamps_at_most_once() {
    let mut rng = StdRng::seed_from_u64(0xf100d);
    let mut floods = 0;
    for _ in 0..3000 {
        let count = rng.random_range(1..=1_000_000u64);
        let period = [SEC, 60 * SEC, 3600 * SEC][rng.random_range(0..3)];
        let burst = rng.random_range(1..=1000u64);
        let Ok(gcra) = Gcra::new(count, period, burst, 1) else { continue };
        let other = Gcra::new(rng.random_range(1..=1000u64), SEC, rng.random_range(1..=10_000u64), 1).unwrap();
        let other_active = rng.random_bool(0.5);
        let owner_capacity = |o: u8| if o == 2 && other_active { other.capacity } else { 0 };
        let mut now: u64 = rng.random_range(0..=u64::MAX / 2);
        // Whatever the bucket holds when the flood starts.
        let far = rng.random_range(0..=(1u64 << 50)) << CLOCK_SHIFT;
        let owner = rng.random_range(0..=2u64);
        let mut bucket = (now << CLOCK_SHIFT).wrapping_add(far) & !0xff | owner;
        // A flood: arrivals 1 to 20 times denser than the rate allows, 2000 of them.
        let t_ns = (period / count).max(1);
        let (mut admitted, mut refusing_writes, mut refused) = (0u64, 0u64, 0u64);
        for _ in 0..2000 {
            now = now.wrapping_add(rng.random_range(0..=t_ns));
            let j = gcra.judge(1, bucket, now, 1, owner_capacity);
            match (j.admit, j.store) {
                (true, Some(v)) => {
                    admitted += 1;
                    bucket = v;
                }
                (true, None) => panic!("an admission that writes nothing"),
                (false, Some(v)) => {
                    refused += 1;
                    refusing_writes += 1;
                    bucket = v;
                }
                (false, None) => refused += 1,
            }
        }
        assert!(
            refusing_writes <= 1,
            "{count}/{period} ns burst {burst}: {refusing_writes} refusals wrote (of {refused}; {admitted} admitted)"
        );
        floods += 1;
    }
    assert!(floods > 2000, "only {floods} floods");
}

//! Host scope shares one bucket between CPUs, so what a flood writes is what it costs (every
//! write moves the cache line to the writing CPU). Only admissions write: a refusal never does,
//! whatever the bucket held when the flood began (idle, spent, a ghost of the clock's wrap,
//! written by another policy, active or not, held or not). Checked here over random policies,
//! random starting buckets and floods far over the rate.

use limiter_common::{
    Gcra,
    gcra::{CLOCK_SHIFT, claim},
};
use rand::{Rng, SeedableRng, rngs::StdRng};

const SEC: u64 = 1_000_000_000;

#[test]
fn a_flood_writes_only_on_admission() {
    let mut rng = StdRng::seed_from_u64(0xf100d);
    let mut floods = 0;
    let (mut admitted, mut refused) = (0u64, 0u64);
    for _ in 0..3000 {
        let count = rng.random_range(1..=1_000_000u64);
        let period = [SEC, 60 * SEC, 3600 * SEC][rng.random_range(0..3)];
        let burst = rng.random_range(1..=1000u64);
        let Ok(gcra) = Gcra::new(count, period, burst, 1) else { continue };
        let other = Gcra::new(rng.random_range(1..=1000u64), SEC, rng.random_range(1..=10_000u64), 1).unwrap();
        let other_active = rng.random_bool(0.5);
        let mut now: u64 = rng.random_range(0..=u64::MAX / 2);
        let hold = if rng.random_bool(0.3) { now + rng.random_range(0..100 * SEC) } else { 0 };
        let claims = |o: u8, now: u64| match o {
            1 => claim(gcra.capacity, 0, now),
            2 => claim(if other_active { other.capacity } else { 0 }, hold, now),
            _ => 0,
        };
        // Whatever the bucket holds when the flood starts.
        let far = rng.random_range(0..=(1u64 << 50)) << CLOCK_SHIFT;
        let owner = rng.random_range(0..=2u64);
        let bucket0 = (now << CLOCK_SHIFT).wrapping_add(far) & !0xff | owner;
        let mut bucket = bucket0;
        // A flood: arrivals 1 to 20 times denser than the rate allows, 2000 of them.
        let t_ns = (period / count).max(1);
        for _ in 0..2000 {
            now = now.wrapping_add(rng.random_range(0..=t_ns));
            let j = gcra.judge(1, bucket, now, 1, |o| claims(o, now));
            match (j.admit, j.store) {
                (true, Some(v)) => {
                    admitted += 1;
                    bucket = v;
                }
                (true, None) => panic!("an admission that writes nothing"),
                (false, Some(v)) => panic!("{count}/{period} ns burst {burst}: a refusal wrote {v:x} over {bucket0:x}"),
                (false, None) => refused += 1,
            }
        }
        floods += 1;
    }
    assert!(floods > 2000, "only {floods} floods");
    assert!(refused > admitted / 10, "the floods were not over their rate: {admitted} admitted, {refused} refused");
}

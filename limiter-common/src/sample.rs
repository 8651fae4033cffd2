//! The refusal sampler's draw: which refusals go to the `REFUSALS` ring (`limiter-ctl top`).
//!
//! A per-CPU xorshift64 state stepped once per refusal, instead of `bpf_get_prandom_u32` (a
//! helper call: about 15 ns of a 40 ns refusal on the benchmark VM). The samples only rank
//! prefixes for an operator, so statistical quality is what matters, not secrecy: the state is
//! seeded from the kernel's generator on a CPU's first refusal and never leaves the CPU.

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

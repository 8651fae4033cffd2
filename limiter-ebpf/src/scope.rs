//! Host scope: one bucket array shared by every CPU (`HOST_BUCKETS`), so a key gets one
//! allowance for the whole host however its packets are spread over CPUs.
//!
//! A packet reads its bucket with a plain load and judges it exactly as a per-CPU bucket
//! (`limiter_common::gcra`). Only when the judgement changes the bucket (an admission) does it
//! write, and then with an atomic compare-and-exchange
//! (`BPF_ATOMIC | BPF_CMPXCHG`, which LLVM emits for the BPF target from CPU v3, or with the
//! `alu32` feature; the kernel accepts it since 5.12). A refusal writes nothing, so a flood over
//! its rate only reads the bucket's cache line and costs no bouncing between CPUs.
//!
//! If the exchange finds the bucket changed (another CPU wrote it between the read and the
//! write), the packet is judged again against what it found, at most
//! [`HOST_CAS_TRIES`] times in all; when every try lost the race it is refused (see
//! [`judge_shared`]).

#[cfg(not(target_arch = "bpf"))]
use core::sync::atomic::{AtomicU64, Ordering::SeqCst};

use limiter_common::maps::HOST_CAS_TRIES;

use crate::decide::Verdict;

/// Reads a shared bucket (a plain 64-bit load: a naturally aligned load is never torn).
///
/// # Safety
/// `slot` points to 8 aligned bytes that stay valid for the call (a map value).
#[inline(always)]
pub unsafe fn load(slot: *mut u64) -> u64 {
    unsafe { core::ptr::read_volatile(slot) }
}

/// Replaces the shared bucket's `expected` value with `new` in one atomic step. On a lost race,
/// returns the value another CPU left there.
///
/// The BPF target spec leaves out `compare_exchange` on Rust's atomic types, so the kernel build
/// calls the intrinsic behind it, which LLVM lowers to `BPF_ATOMIC | BPF_CMPXCHG` (r0 holds the
/// expected value in, the found value out).
///
/// # Safety
/// As [`load`].
#[inline(always)]
pub unsafe fn compare_exchange(slot: *mut u64, expected: u64, new: u64) -> Result<(), u64> {
    #[cfg(target_arch = "bpf")]
    // SAFETY: `slot` is a map value of 8 aligned bytes that lives as long as the program.
    let (seen, done) = unsafe {
        use core::intrinsics::{AtomicOrdering::SeqCst, atomic_cxchg};
        atomic_cxchg::<u64, { SeqCst }, { SeqCst }>(slot, expected, new)
    };
    #[cfg(not(target_arch = "bpf"))]
    // SAFETY: as above (the kernel uses the branch above; host tests use this one).
    let (seen, done) = match unsafe { AtomicU64::from_ptr(slot) }.compare_exchange(expected, new, SeqCst, SeqCst) {
        Ok(seen) => (seen, true),
        Err(seen) => (seen, false),
    };
    if done { Ok(()) } else { Err(seen) }
}

/// Judges a packet against the shared bucket `slot`: `judge(current)` returns the verdict and
/// the bucket's new value, if it changes, for the bucket's current value. The new value is
/// written only if the bucket still holds what was judged; otherwise the packet is judged again
/// against the newer value. After [`HOST_CAS_TRIES`] lost races the packet gets `exhausted`
/// (a refusal): each lost race means another CPU admitted against this very bucket
/// within the same few hundred nanoseconds, so the key is busy far beyond any rate a client keeps
/// to, and refusing never lets it over its bound, where admitting without a write would.
///
/// # Safety
/// As [`load`].
#[inline(always)]
pub unsafe fn judge_shared(
    slot: *mut u64,
    exhausted: Verdict,
    mut judge: impl FnMut(u64) -> (Verdict, Option<u64>),
) -> Verdict {
    let mut current = unsafe { load(slot) };
    for _ in 0..HOST_CAS_TRIES {
        let (verdict, store) = judge(current);
        let Some(new) = store else {
            return verdict;
        };
        match unsafe { compare_exchange(slot, current, new) } {
            Ok(()) => return verdict,
            Err(seen) => current = seen,
        }
    }
    exhausted
}

/// The retry loop under real concurrency (the host's compare-and-exchange stands in for BPF's):
/// threads judging one shared bucket as fast as they can never admit more than one allowance
/// over the time they ran.
#[cfg(test)]
mod tests {
    extern crate std;

    use std::{sync::Barrier, thread, time::Instant, vec::Vec};

    use limiter_common::Gcra;

    use super::*;

    #[test]
    fn threads_sharing_a_bucket_get_one_allowance() {
        let threads = thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8);
        // 100,000/s, burst 50: contended enough that races are lost, slow enough to count.
        let gcra = Gcra::new(100_000, 1_000_000_000, 50, 1).unwrap();
        let mut bucket = 0u64;
        let slot = &mut bucket as *mut u64 as usize;
        let barrier = Barrier::new(threads);
        let clock = Instant::now();
        let now = || clock.elapsed().as_nanos() as u64 + 1_000_000_000;
        let start = now();
        let per_thread: Vec<(u64, u64)> = thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        let (mut admitted, mut lost) = (0u64, 0u64);
                        for _ in 0..200_000 {
                            // SAFETY: `bucket` outlives the scope; every access is atomic.
                            let v = unsafe {
                                judge_shared(slot as *mut u64, Verdict::WouldRefuse, |current| {
                                    // As the kernel does: the clock after the bucket, every try.
                                    let j = gcra.judge(1, current, now(), 1, |_| 0);
                                    (if j.admit { Verdict::Admit } else { Verdict::Refuse }, j.store)
                                })
                            };
                            match v {
                                Verdict::Admit => admitted += 1,
                                Verdict::WouldRefuse => lost += 1,
                                Verdict::Refuse => {}
                            }
                        }
                        (admitted, lost)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let elapsed = now() - start;
        let admitted: u64 = per_thread.iter().map(|p| p.0).sum();
        let lost: u64 = per_thread.iter().map(|p| p.1).sum();
        let bound = gcra.bound(elapsed);
        std::eprintln!("{threads} threads, {elapsed} ns: admitted {admitted} <= {bound}, {lost} refused by lost races");
        assert!(admitted <= bound, "{threads} threads admitted {admitted} > one allowance {bound} over {elapsed} ns");
        // Not a lower bound on the rate (the threads share the machine with whatever else runs):
        // the burst at least, so the loop does not refuse everything.
        assert!(admitted >= 50, "{threads} threads admitted only {admitted}");
    }
}

//! The refusal stream: 1 in N refusals, sampled by the program into its `REFUSALS` ring within
//! a budget of samples per second, for `limiter-ctl top`. The daemon waits on the stream's
//! descriptor and drains it when readable.

use std::os::fd::{AsRawFd, RawFd};

use aya::maps::{MapData, RingBuf};
use limiter_common::maps::{Config, MAP_REFUSALS, RefusalSample};

use super::{Error, Limiter};

/// The daemon's default sampling of refusals for `limiter-ctl top` (`--sample-refusals`).
pub const DEFAULT_SAMPLE_REFUSALS: u32 = 256;
/// The daemon's default budget of samples per second for the whole host (`--samples-per-s`):
/// what bounds the daemon's cost under a flood of any rate (each sample is a ring record and,
/// when the daemon has caught up, a wakeup), and still a few hundred samples a second to rank
/// sources by.
pub const DEFAULT_SAMPLES_PER_S: u32 = 256;

/// The per-CPU budget (`Config::sample_budget`) of `per_s` samples a second for the host (0: no
/// cap): shared evenly by the `cpus` possible CPUs, at least 1 each.
pub fn per_cpu_budget(per_s: u32, cpus: usize) -> u32 {
    if per_s == 0 { 0 } else { (per_s / u32::try_from(cpus.max(1)).unwrap_or(u32::MAX)).max(1) }
}

/// The sampled refusals, as the program sends them: readable (its descriptor polls readable)
/// when samples wait, [`Refusals::drain`] takes them.
pub struct Refusals(RingBuf<MapData>);

impl Refusals {
    /// Hands every sample waiting to `each`, oldest first, until none is left; records of
    /// another size are not ours and are skipped.
    pub fn drain(&mut self, mut each: impl FnMut(&RefusalSample)) {
        while let Some(item) = self.0.next() {
            if let Some(sample) = parse_sample(&item) {
                each(&sample);
            }
        }
    }
}

impl AsRawFd for Refusals {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl Limiter {
    /// Samples 1 in `one_in` refusals (a power of two; 0: none) into the `REFUSALS` ring, within
    /// the default budget ([`DEFAULT_SAMPLES_PER_S`]): what the daemon ships.
    pub fn set_sampling(&mut self, one_in: u32) -> Result<(), Error> {
        self.set_sampling_within(one_in, DEFAULT_SAMPLES_PER_S)
    }

    /// Samples 1 in `one_in` refusals (a power of two; 0: none) into the `REFUSALS` ring, at
    /// most `per_s` a second for the host (0: no cap), split evenly over the possible CPUs.
    pub fn set_sampling_within(&mut self, one_in: u32, per_s: u32) -> Result<(), Error> {
        let cpus = aya::util::nr_cpus().map_err(|(what, error)| Error::Cpus { what, error })?;
        let mut config = self.read_config()?;
        config.flags &= !Config::SAMPLE_REFUSALS;
        if one_in > 0 {
            config.flags |= Config::SAMPLE_REFUSALS;
            config.sample_mask = one_in.next_power_of_two() - 1;
        }
        config.sample_budget = per_cpu_budget(per_s, cpus);
        self.store_config(&config)
    }

    /// The stream of sampled refusals, for the daemon to drain (it can be taken once).
    pub(crate) fn refusals(&mut self) -> Result<Refusals, Error> {
        let map = self.ebpf.take_map(MAP_REFUSALS).ok_or(Error::Missing { kind: "map", name: MAP_REFUSALS })?;
        RingBuf::try_from(map).map(Refusals).map_err(|source| Error::Map { name: MAP_REFUSALS, source })
    }
}

/// A ring record as a sample; records of another size are not ours.
fn parse_sample(bytes: &[u8]) -> Option<RefusalSample> {
    (bytes.len() == std::mem::size_of::<RefusalSample>()).then(|| {
        // SAFETY: `bytes` holds exactly size_of::<RefusalSample>() bytes (checked above), read
        // unaligned; RefusalSample is a plain-old-data #[repr(C)] record, valid for any bytes.
        unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<RefusalSample>()) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_of_the_sample_size_is_a_sample_and_any_other_is_skipped() {
        let mut addr = [0; 16];
        addr[..4].copy_from_slice(&[198, 18, 5, 0]);
        let sample =
            RefusalSample { addr, policy: 3, dport: 53, family: 4, prefix_len: 24, dry_run: 1, _pad: 0, weight: 7 };
        // SAFETY: RefusalSample is a plain-old-data #[repr(C)] record; its bytes are read only.
        let bytes = unsafe {
            std::slice::from_raw_parts((&raw const sample).cast::<u8>(), std::mem::size_of::<RefusalSample>())
        };
        assert_eq!(parse_sample(bytes), Some(sample));
        // Unaligned: the ring gives no alignment guarantee.
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(bytes);
        assert_eq!(parse_sample(&shifted[1..]), Some(sample));
        assert!(parse_sample(&bytes[1..]).is_none());
        assert!(parse_sample(&shifted).is_none());
    }

    #[test]
    fn the_hosts_budget_is_split_over_the_cpus_at_least_one_each() {
        assert_eq!(per_cpu_budget(256, 2), 128);
        assert_eq!(per_cpu_budget(256, 64), 4);
        assert_eq!(per_cpu_budget(256, 256), 1);
        assert_eq!(per_cpu_budget(256, 1024), 1);
        assert_eq!(per_cpu_budget(256, 3), 85);
        assert_eq!(per_cpu_budget(0, 2), 0, "0: no cap");
        assert_eq!(per_cpu_budget(u32::MAX, 0), u32::MAX);
    }
}

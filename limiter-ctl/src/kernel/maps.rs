//! Reading and writing the program's maps: its config, policies, counters, the refusal ring
//! and the buckets.

use std::os::fd::AsFd as _;

use aya::maps::{Map, MapData, PerCpuArray, RingBuf};
use limiter_common::{
    gcra,
    maps::{Config, Counters, MAP_BUCKETS, MAP_COUNTERS, MAP_POLICIES, MAP_REFUSALS, MAX_POLICIES, Policy},
};

use super::{Error, Limiter, host};

/// The daemon's default sampling of refusals for `limiter-ctl top` (`--sample-refusals`).
pub const DEFAULT_SAMPLE_REFUSALS: u32 = 256;

impl Limiter {
    /// Samples 1 in `one_in` refusals (a power of two; 0: none) into the `REFUSALS` ring.
    pub fn set_sampling(&mut self, one_in: u32) -> Result<(), Error> {
        let mut config = self.read_config()?;
        config.flags &= !Config::SAMPLE_REFUSALS;
        if one_in > 0 {
            config.flags |= Config::SAMPLE_REFUSALS;
            config.sample_mask = one_in.next_power_of_two() - 1;
        }
        self.store_config(&config)
    }

    /// The ring of sampled refusals, for the daemon to drain (it can be taken once).
    pub(crate) fn take_refusals(&mut self) -> Result<RingBuf<MapData>, Error> {
        let map = self.ebpf.take_map(MAP_REFUSALS).ok_or(Error::Missing { kind: "map", name: MAP_REFUSALS })?;
        RingBuf::try_from(map).map_err(|source| Error::Map { name: MAP_REFUSALS, source })
    }

    /// A handle of its own on the buckets, for scanning them off the daemon's loop.
    pub(crate) fn open_buckets(&self) -> Result<PerCpuArray<MapData, u64>, Error> {
        let Map::PerCpuArray(data) = self.map(MAP_BUCKETS)? else {
            return Err(Error::NotPerCpu(MAP_BUCKETS));
        };
        // A duplicate of our own descriptor: reopening the map by id would need CAP_SYS_ADMIN.
        let fd = data.fd().as_fd().try_clone_to_owned()?;
        let data = MapData::from_fd(fd).map_err(|source| Error::Map { name: MAP_BUCKETS, source })?;
        PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(|source| Error::Map { name: MAP_BUCKETS, source })
    }

    /// Writes a policy slot (an inactive `policy` removes it), carrying the slot's claim over
    /// (`limiter_common::gcra`, "Claims"): when the new entry's window is shorter than the old
    /// one's (a lowered rate, a removal, the id handed to another policy), the slot holds the old
    /// window from the change on, so every TAT the old entry let a source earn still counts
    /// until it is reached. The new entry goes in first with an unbounded hold, and the hold is
    /// then cut to its end measured after that write: a packet judged with the old entry in
    /// between reads its clock before that end.
    pub(super) fn store_policy(&mut self, policy: &Policy) -> Result<(), Error> {
        let id = u32::from(policy.id);
        let mut map = self.array_mut::<Policy>(MAP_POLICIES)?;
        let old = map.get(&id, 0).map_err(|source| Error::Map { name: MAP_POLICIES, source })?;
        let old_capacity = if old.flags & Policy::ACTIVE != 0 { old.gcra.capacity } else { 0 };
        let new_capacity = if policy.flags & Policy::ACTIVE != 0 { policy.gcra.capacity } else { 0 };
        let mut entry = Policy { hold_until_ns: old.hold_until_ns, ..*policy };
        if new_capacity < old_capacity {
            entry.hold_until_ns = u64::MAX;
            map.set(id, entry, 0).map_err(|source| Error::Map { name: MAP_POLICIES, source })?;
            entry.hold_until_ns = gcra::hold_after(old_capacity, old.hold_until_ns, host::monotonic_ns());
        }
        map.set(id, entry, 0).map_err(|source| Error::Map { name: MAP_POLICIES, source })
    }

    /// Counters per policy id (index 0: traffic no policy judged), summed over CPUs.
    pub fn counters(&self) -> Result<Vec<Counters>, Error> {
        let map = self.per_cpu::<Counters>(MAP_COUNTERS)?;
        (0..MAX_POLICIES)
            .map(|id| {
                let per_cpu = map.get(&id, 0).map_err(|source| Error::Map { name: MAP_COUNTERS, source })?;
                let mut sum = Counters::default();
                per_cpu.iter().for_each(|c| sum.add(c));
                Ok(sum)
            })
            .collect()
    }
}

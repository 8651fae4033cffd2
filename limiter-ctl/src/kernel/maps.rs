//! Reading and writing the program's maps: its policies, the counters, and a scan of the
//! buckets. (Its config is read and written in `load`; the refusal ring is `refusals`.)

use std::os::fd::AsFd as _;

use aya::maps::{Array, Map, MapData, PerCpuArray};
use limiter_common::{
    gcra,
    maps::{Counters, MAP_BUCKETS, MAP_COUNTERS, MAP_HOST_BUCKETS, MAP_POLICIES, MAX_POLICIES, Policy},
};

use super::{Error, Geometry, Limiter, host};

/// The current generation's buckets, on handles of their own: the scan reads a sample of the
/// per-CPU buckets (every CPU's value of each) and of the host-scope ones, so the daemon runs it on a thread of
/// its own, off its loop.
pub struct BucketScan {
    buckets: PerCpuArray<MapData, u64>,
    /// The current generation's first bucket, and how many it has.
    first: u32,
    count: u32,
    host: Array<MapData, u64>,
    host_first: u32,
    host_count: u32,
}

/// At most this many host-scope buckets are read per scan, evenly spaced (each read is a
/// system call, about 1 us: the host array may hold millions, sized for a million sources, and
/// the daemon's share of a core stays far below 1% at rest). The fraction of a sample of 16,384
/// is within 0.8% of the whole array's (two standard deviations, at worst).
const HOST_SAMPLE: u32 = 1 << 14;
/// The same for the per-CPU buckets: each read returns every CPU's value.
const CPU_SAMPLE: u32 = 1 << 13;

impl BucketScan {
    /// The fraction of the buckets whose TAT is ahead of now (every bucket that can refuse a
    /// packet: all policies share one clock, whoever wrote the bucket): of the per-CPU buckets
    /// (over CPUs) or of the host-scope ones, whichever is higher, the array closer to being
    /// swamped. None when a read fails.
    pub fn occupancy(&self) -> Option<f64> {
        let now_ns = host::monotonic_ns();
        let (mut ahead, mut total) = (0u64, 0u64);
        let step = (self.count / CPU_SAMPLE).max(1);
        for index in (self.first..self.first + self.count).step_by(step as usize) {
            let values = self.buckets.get(&index, 0).ok()?;
            for &value in values.iter() {
                total += 1;
                ahead += u64::from(gcra::ahead_ns(value, now_ns) > 0);
            }
        }
        let step = (self.host_count / HOST_SAMPLE).max(1);
        let (mut host_ahead, mut host_total) = (0u64, 0u64);
        for index in (self.host_first..self.host_first + self.host_count).step_by(step as usize) {
            let value = self.host.get(&index, 0).ok()?;
            host_total += 1;
            host_ahead += u64::from(gcra::ahead_ns(value, now_ns) > 0);
        }
        let ratio = |a: u64, t: u64| (t > 0).then(|| a as f64 / t as f64);
        match (ratio(ahead, total), ratio(host_ahead, host_total)) {
            (Some(cpu), Some(host)) => Some(cpu.max(host)),
            (one, other) => one.or(other),
        }
    }
}

impl Limiter {
    /// A scan of the current generation's buckets, to run off the daemon's loop.
    pub(crate) fn bucket_scan(&self) -> Result<BucketScan, Error> {
        let Map::PerCpuArray(data) = self.map(MAP_BUCKETS)? else {
            return Err(Error::NotPerCpu(MAP_BUCKETS));
        };
        // A duplicate of our own descriptor: reopening the map by id would need CAP_SYS_ADMIN.
        let fd = data.fd().as_fd().try_clone_to_owned()?;
        let data = MapData::from_fd(fd).map_err(|source| Error::Map { name: MAP_BUCKETS, source })?;
        let buckets =
            PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(|source| Error::Map { name: MAP_BUCKETS, source })?;
        let Map::Array(data) = self.map(MAP_HOST_BUCKETS)? else {
            return Err(Error::NotArray(MAP_HOST_BUCKETS));
        };
        let fd = data.fd().as_fd().try_clone_to_owned()?;
        let data = MapData::from_fd(fd).map_err(|source| Error::Map { name: MAP_HOST_BUCKETS, source })?;
        let host = Array::try_from(Map::Array(data)).map_err(|source| Error::Map { name: MAP_HOST_BUCKETS, source })?;
        let generation = self.read_config()?.generation & 1;
        let Geometry { buckets: count, host_buckets: host_count, .. } = self.geometry();
        Ok(BucketScan {
            buckets,
            first: generation * count,
            count,
            host,
            host_first: generation * host_count,
            host_count,
        })
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

//! What the kernel handle asks of the host: interfaces, and the clock the XDP program reads.

use limiter_common::{
    maps::{MAX_BUCKETS, MIN_BUCKETS},
    rows::MAX_ROWS,
};
use nix::time::{ClockId, clock_gettime};

use super::Error;

pub(crate) fn check_buckets(buckets: u32) -> Result<u32, Error> {
    if buckets.is_power_of_two() && (MIN_BUCKETS..=MAX_BUCKETS).contains(&buckets) {
        Ok(buckets)
    } else {
        Err(Error::Buckets(buckets))
    }
}

pub(crate) fn check_rows(rows: u32) -> Result<u32, Error> {
    if (1..=MAX_ROWS as u32).contains(&rows) { Ok(rows) } else { Err(Error::Rows(rows)) }
}

/// The interface's index, or None when there is no such interface.
pub(crate) fn if_index(iface: &str) -> Option<u32> {
    nix::net::if_::if_nametoindex(iface).ok().filter(|&index| index != 0)
}

pub(crate) fn interface_exists(iface: &str) -> bool {
    if_index(iface).is_some()
}

/// The interface's MTU, if it exists in this network namespace.
pub(crate) fn interface_mtu(iface: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/sys/class/net/{iface}/mtu")).ok()?.trim().parse().ok()
}

/// CLOCK_MONOTONIC in ns: the clock the XDP program reads (bpf_ktime_get_ns).
pub(crate) fn monotonic_ns() -> u64 {
    // CLOCK_MONOTONIC cannot fail on Linux; a zero would read as "long ago", never as a panic.
    let ts = clock_gettime(ClockId::CLOCK_MONOTONIC).unwrap_or(nix::sys::time::TimeSpec::new(0, 0));
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

//! What the kernel handle asks of the host: interfaces, and the clock the XDP program reads.

use limiter_common::{
    maps::{MAX_BUCKETS, MIN_BUCKETS},
    rows::{MAX_HOST_ROWS, MAX_ROWS},
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

/// A row count for the host-scope buckets, 1 or 2 (the kernel judges no more there).
pub(crate) fn check_host_rows(rows: u32) -> Result<u32, Error> {
    if (1..=MAX_HOST_ROWS).contains(&rows) { Ok(rows) } else { Err(Error::HostRows(rows)) }
}

/// The interface's index, or None when there is no such interface (or it could not be asked:
/// see [`lookup_index`] where the difference matters).
pub(crate) fn if_index(iface: &str) -> Option<u32> {
    match lookup_index(iface) {
        Lookup::Index(index) => Some(index),
        Lookup::Gone | Lookup::Unknown(_) => None,
    }
}

/// What asking the kernel for an interface's index found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    Index(u32),
    /// The kernel said there is no such device (ENODEV): definite.
    Gone,
    /// The question could not be asked (out of descriptors or buffers, interrupted...): says
    /// nothing about the interface, so nothing may be done on it.
    Unknown(nix::errno::Errno),
}

/// The interface's index, telling "no such device" from a failure to ask. The question needs a
/// socket for its ioctl, so a process out of descriptors gets EMFILE here, not an answer.
/// (Asked directly: glibc's if_nametoindex, out of descriptors, reports whatever its fallbacks
/// left in errno, often ENOENT.)
pub(crate) fn lookup_index(iface: &str) -> Lookup {
    classify(name_to_index(iface))
}

/// SIOCGIFINDEX on a datagram socket of our own, as if_nametoindex(3) does.
fn name_to_index(iface: &str) -> nix::Result<u32> {
    use std::os::fd::AsRawFd as _;

    use nix::{
        errno::Errno,
        libc,
        sys::socket::{AddressFamily, SockFlag, SockType, socket},
    };
    // A name that cannot be an interface's (empty, too long, a NUL in it) names none.
    if iface.is_empty() || iface.len() >= libc::IFNAMSIZ || iface.contains('\0') {
        return Err(Errno::ENODEV);
    }
    let fd = socket(AddressFamily::Inet, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)?;
    // SAFETY: ifreq is plain old data, valid all zero.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (to, from) in request.ifr_name.iter_mut().zip(iface.bytes()) {
        *to = from as libc::c_char;
    }
    // SAFETY: SIOCGIFINDEX reads the NUL-terminated name and writes the index into `request`,
    // which lives across the call.
    Errno::result(unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFINDEX, &mut request) })?;
    // SAFETY: the kernel filled the union's index on success.
    let index = unsafe { request.ifr_ifru.ifru_ifindex };
    u32::try_from(index).map_err(|_| Errno::ENODEV)
}

fn classify(result: nix::Result<u32>) -> Lookup {
    match result {
        Ok(0) | Err(nix::errno::Errno::ENODEV) => Lookup::Gone,
        Ok(index) => Lookup::Index(index),
        Err(errno) => Lookup::Unknown(errno),
    }
}

/// Whether the interface exists (false also when the kernel could not be asked).
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

#[cfg(test)]
mod tests {
    use nix::errno::Errno;

    use super::{Lookup, classify, lookup_index};

    #[test]
    fn only_no_such_device_means_gone() {
        assert_eq!(classify(Ok(3)), Lookup::Index(3));
        assert_eq!(classify(Err(Errno::ENODEV)), Lookup::Gone);
        for transient in [Errno::EMFILE, Errno::ENFILE, Errno::ENOBUFS, Errno::ENOMEM, Errno::EINTR, Errno::EAGAIN] {
            assert_eq!(classify(Err(transient)), Lookup::Unknown(transient), "{transient}");
        }
        assert_eq!(lookup_index("lo"), Lookup::Index(1));
        assert_eq!(lookup_index("no-such-iface0"), Lookup::Gone);
    }
}

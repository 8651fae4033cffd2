//! The shape of the bucket arrays a limiter is loaded with: the per-CPU buckets (`BUCKETS`, for
//! policies of scope cpu) and the host-scope buckets (`HOST_BUCKETS`, shared by every CPU), each
//! with its count-min rows.

use limiter_common::rows::MAX_HOST_ROWS;

/// Buckets per generation (a power of two) and rows, for each of the two arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Per-CPU buckets per generation (`BUCKETS`): memory is this x 16 B x CPUs.
    pub buckets: u32,
    /// Count-min rows of the per-CPU buckets.
    pub rows: u32,
    /// Host-scope buckets per generation (`HOST_BUCKETS`): memory is this x 16 B, once.
    pub host_buckets: u32,
    /// Count-min rows of the host-scope buckets.
    pub host_rows: u32,
}

impl Geometry {
    /// Both arrays of `buckets`, split into `rows` rows (the tests' usual shape); the host-scope
    /// array into at most `MAX_HOST_ROWS` of them.
    pub const fn same(buckets: u32, rows: u32) -> Self {
        let host_rows = if rows > MAX_HOST_ROWS { MAX_HOST_ROWS } else { rows };
        Self { buckets, rows, host_buckets: buckets, host_rows }
    }
}

/// Bytes a bucket takes in one array: a TAT (8 B) in each of the two salt generations.
pub const BUCKET_BYTES: u64 = 16;

/// `--host-buckets auto`: at most 1/256 of the host's memory, within these bounds. The floor
/// holds a million active sources at rows 2 (under N/3 keys per row, where a row stops helping);
/// the cap, 64 MiB, is what a small VM can spare and far more sources than one host meets.
pub const HOST_AUTO_MIN: u32 = 1 << 20;
pub const HOST_AUTO_MAX: u32 = 1 << 22;
/// The share of memory `--host-buckets auto` may take: 1/256.
pub const HOST_AUTO_SHARE: u64 = 256;

/// `--buckets auto` (per CPU, for policies of scope cpu): at most 1/512 of the host's memory over
/// all possible CPUs, within these bounds (the cap is the old fixed default, 65,536).
pub const CPU_AUTO_MIN: u32 = 1 << 12;
pub const CPU_AUTO_MAX: u32 = 1 << 16;
/// The share of memory `--buckets auto` may take: 1/512.
pub const CPU_AUTO_SHARE: u64 = 512;

/// The largest power of two N with `N x per_bucket <= budget`, clamped to `[min, max]`.
fn largest_fitting(budget: u64, per_bucket: u64, min: u32, max: u32) -> u32 {
    let fits = budget / per_bucket.max(1);
    // Largest power of two <= fits (0 when nothing fits: the floor then applies).
    let n = if fits == 0 { 0 } else { 1u64 << (63 - fits.leading_zeros()) };
    n.clamp(u64::from(min), u64::from(max)) as u32
}

/// `--host-buckets auto` on a host of `mem_total` bytes: the largest power of two N with
/// 16 B x N <= mem_total / 256, clamped to [2^20, 2^22].
pub fn auto_host_buckets(mem_total: u64) -> u32 {
    largest_fitting(mem_total / HOST_AUTO_SHARE, BUCKET_BYTES, HOST_AUTO_MIN, HOST_AUTO_MAX)
}

/// `--buckets auto` on a host of `mem_total` bytes and `cpus` possible CPUs: the largest power of
/// two N with 16 B x N x cpus <= mem_total / 512, clamped to [2^12, 2^16].
pub fn auto_buckets(mem_total: u64, cpus: u32) -> u32 {
    largest_fitting(mem_total / CPU_AUTO_SHARE, BUCKET_BYTES * u64::from(cpus.max(1)), CPU_AUTO_MIN, CPU_AUTO_MAX)
}

/// A bucket count as a flag gives it: `auto` (sized from the host) or a number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BucketCount {
    Auto,
    Exactly(u32),
}

impl std::fmt::Display for BucketCount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Exactly(n) => write!(f, "{n}"),
        }
    }
}

/// The geometry the daemon's flags ask for, resolved against the host by [`GeometryRequest::resolve`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GeometryRequest {
    pub buckets: BucketCount,
    pub rows: u32,
    pub host_buckets: BucketCount,
    pub host_rows: u32,
}

/// What the host has that the automatic sizes depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostSize {
    /// MemTotal, in bytes.
    pub mem_total: u64,
    /// Possible CPUs: a per-CPU array has a slot for each, online or not.
    pub cpus: u32,
}

/// Reading the host's size failed: what was read, and why.
#[derive(Debug, thiserror::Error)]
pub enum HostSizeError {
    #[error("reading {path} (to size the buckets; give --buckets and --host-buckets a number instead): {source}")]
    Read { path: &'static str, source: std::io::Error },
    #[error(
        "{path} does not say {what} as expected (found {found:?}); give --buckets and --host-buckets a number instead"
    )]
    Unreadable { path: &'static str, what: &'static str, found: String },
}

pub const MEMINFO: &str = "/proc/meminfo";
pub const POSSIBLE_CPUS: &str = "/sys/devices/system/cpu/possible";

impl HostSize {
    /// Reads MemTotal from /proc/meminfo and the possible CPUs from sysfs.
    pub fn read() -> Result<Self, HostSizeError> {
        let read =
            |path: &'static str| std::fs::read_to_string(path).map_err(|source| HostSizeError::Read { path, source });
        let meminfo = read(MEMINFO)?;
        let mem_total = mem_total(&meminfo).ok_or_else(|| HostSizeError::Unreadable {
            path: MEMINFO,
            what: "MemTotal in kB",
            found: meminfo.lines().find(|l| l.starts_with("MemTotal")).unwrap_or("no MemTotal line").to_string(),
        })?;
        let possible = read(POSSIBLE_CPUS)?;
        let cpus = cpu_count(&possible).ok_or_else(|| HostSizeError::Unreadable {
            path: POSSIBLE_CPUS,
            what: "a CPU list (0-3,8)",
            found: possible.trim().to_string(),
        })?;
        Ok(Self { mem_total, cpus })
    }
}

/// MemTotal from /proc/meminfo's text, in bytes (`MemTotal:  24576000 kB`).
pub fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:"))?;
    let mut words = line.split_whitespace();
    let kb: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB") && words.next().is_none()).then_some(kb)?.checked_mul(1024).filter(|&b| b > 0)
}

/// How many CPUs a sysfs CPU list names (`0-3,8,10-11` is 7); None for anything else.
pub fn cpu_count(list: &str) -> Option<u32> {
    let mut count = 0u32;
    for part in list.trim().split(',') {
        let (low, high) = part.split_once('-').unwrap_or((part, part));
        let (low, high): (u32, u32) = (low.parse().ok()?, high.parse().ok()?);
        count = count.checked_add(high.checked_sub(low)?.checked_add(1)?)?;
    }
    Some(count)
}

impl GeometryRequest {
    /// What the daemon runs without flags: both arrays `auto`, their default rows.
    pub const DEFAULT: Self = Self {
        buckets: BucketCount::Auto,
        rows: limiter_common::rows::DEFAULT_ROWS,
        host_buckets: BucketCount::Auto,
        host_rows: limiter_common::rows::DEFAULT_HOST_ROWS,
    };

    /// The geometry on this host: `auto` sized from `host`, numbers as given.
    pub fn resolve(&self, host: &HostSize) -> Geometry {
        let pick = |count: BucketCount, auto: u32| match count {
            BucketCount::Auto => auto,
            BucketCount::Exactly(n) => n,
        };
        Geometry {
            buckets: pick(self.buckets, auto_buckets(host.mem_total, host.cpus)),
            rows: self.rows,
            host_buckets: pick(self.host_buckets, auto_host_buckets(host.mem_total)),
            host_rows: self.host_rows,
        }
    }
}

impl Geometry {
    /// Bytes of the per-CPU array (`BUCKETS`) on `cpus` possible CPUs.
    pub fn cpu_bytes(&self, cpus: u32) -> u64 {
        u64::from(self.buckets) * BUCKET_BYTES * u64::from(cpus)
    }

    /// Bytes of the host-scope array (`HOST_BUCKETS`).
    pub fn host_bytes(&self) -> u64 {
        u64::from(self.host_buckets) * BUCKET_BYTES
    }
}

/// Bytes in binary units, as memory is read: `64 MiB`, `1.5 GiB`, `512 KiB`.
pub fn bytes_text(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 { format!("{value:.0} {}", UNITS[unit]) } else { format!("{value:.1} {}", UNITS[unit]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn host_auto_is_a_256th_of_memory_within_its_bounds() {
        // 16 B x 2^20 = 16 MiB = 4 GiB / 256: exactly the floor.
        assert_eq!(auto_host_buckets(4 * GIB), 1 << 20);
        assert_eq!(auto_host_buckets(8 * GIB), 1 << 21);
        assert_eq!(auto_host_buckets(16 * GIB), 1 << 22);
        // Just under a power of two's need: the one below.
        assert_eq!(auto_host_buckets(16 * GIB - 1), 1 << 21);
        // Clamped: a small VM still gets the floor, a large host the cap.
        assert_eq!(auto_host_buckets(GIB), HOST_AUTO_MIN);
        assert_eq!(auto_host_buckets(0), HOST_AUTO_MIN);
        assert_eq!(auto_host_buckets(256 * GIB), HOST_AUTO_MAX);
        assert_eq!(auto_host_buckets(u64::MAX), HOST_AUTO_MAX);
        // This test machine's size (24 GiB, MemTotal a little under).
        assert_eq!(auto_host_buckets(24 * GIB - 300 * (1 << 20)), 1 << 22);
        for mem in [0, 1, GIB, 3 * GIB, 5 * GIB, 17 * GIB, 1 << 50] {
            let n = auto_host_buckets(mem);
            assert!(n.is_power_of_two() && (HOST_AUTO_MIN..=HOST_AUTO_MAX).contains(&n), "{mem}: {n}");
            // Within the share, unless the floor forced it.
            assert!(n == HOST_AUTO_MIN || u64::from(n) * BUCKET_BYTES <= mem / 256, "{mem}: {n}");
            // And the largest that is: twice as many would not fit (unless capped).
            assert!(n == HOST_AUTO_MAX || u64::from(n) * 2 * BUCKET_BYTES > mem / 256, "{mem}: {n}");
        }
    }

    #[test]
    fn cpu_auto_is_a_512th_of_memory_over_the_cpus_within_its_bounds() {
        // 1 GiB a CPU: 2 MiB a CPU = 2^17 buckets, capped at 2^16.
        for (cpus, mem) in [(2, 4 * GIB), (16, 16 * GIB), (64, 64 * GIB), (256, 256 * GIB)] {
            assert_eq!(auto_buckets(mem, cpus), 1 << 16, "{cpus} CPUs, {mem} B");
        }
        // 256 MiB a CPU: 512 KiB a CPU = 2^15.
        assert_eq!(auto_buckets(64 * GIB, 256), 1 << 15);
        assert_eq!(auto_buckets(16 * GIB, 256), 1 << 13);
        // The floor: 2^12 on a host too small for it.
        assert_eq!(auto_buckets(GIB, 256), CPU_AUTO_MIN);
        assert_eq!(auto_buckets(0, 1), CPU_AUTO_MIN);
        // No CPU count reads as one (never a division by zero).
        assert_eq!(auto_buckets(4 * GIB, 0), auto_buckets(4 * GIB, 1));
        for cpus in [1, 2, 3, 7, 64, 4096] {
            for mem in [GIB / 2, 2 * GIB, 24 * GIB, 1 << 42] {
                let n = auto_buckets(mem, cpus);
                assert!(n.is_power_of_two() && (CPU_AUTO_MIN..=CPU_AUTO_MAX).contains(&n), "{cpus} {mem}: {n}");
                let bytes = |n: u32| u64::from(n) * BUCKET_BYTES * u64::from(cpus);
                assert!(n == CPU_AUTO_MIN || bytes(n) <= mem / 512, "{cpus} {mem}: {n}");
                assert!(n == CPU_AUTO_MAX || bytes(n * 2) > mem / 512, "{cpus} {mem}: {n}");
            }
        }
    }

    #[test]
    fn the_host_is_read_from_meminfo_and_the_possible_cpus() {
        assert_eq!(mem_total("MemTotal:       24576000 kB\nMemFree: 1 kB\n"), Some(24_576_000 * 1024));
        assert_eq!(mem_total("MemFree: 1 kB\nMemTotal: 4 kB\n"), Some(4096));
        for bad in ["", "MemTotal: 12\n", "MemTotal: x kB\n", "MemTotal: 12 MB\n", "MemTotal: 0 kB\n", "Mem: 4 kB"] {
            assert_eq!(mem_total(bad), None, "{bad:?}");
        }
        assert_eq!(cpu_count("0\n"), Some(1));
        assert_eq!(cpu_count("0-1\n"), Some(2));
        assert_eq!(cpu_count("0-3,8,10-11"), Some(7));
        for bad in ["", "\n", "0-", "3-1", "a", "0,,1", "0-1-2"] {
            assert_eq!(cpu_count(bad), None, "{bad:?}");
        }
        // This host: what the kernel says, and a per-CPU map is sized the same way.
        let host = HostSize::read().unwrap();
        assert!(host.mem_total > 0 && host.cpus >= 1, "{host:?}");
        assert_eq!(host.cpus as usize, aya::util::nr_cpus().unwrap());
    }

    #[test]
    fn a_request_resolves_auto_and_keeps_numbers() {
        let host = HostSize { mem_total: 24 * GIB, cpus: 2 };
        let auto =
            GeometryRequest { buckets: BucketCount::Auto, rows: 4, host_buckets: BucketCount::Auto, host_rows: 2 };
        let g = auto.resolve(&host);
        assert_eq!(g, Geometry { buckets: 1 << 16, rows: 4, host_buckets: 1 << 22, host_rows: 2 });
        assert_eq!((g.cpu_bytes(host.cpus), g.host_bytes()), (2 << 20, 64 << 20));
        let fixed =
            GeometryRequest { buckets: BucketCount::Exactly(1024), host_buckets: BucketCount::Exactly(16), ..auto };
        assert_eq!(fixed.resolve(&host), Geometry { buckets: 1024, rows: 4, host_buckets: 16, host_rows: 2 });
        assert_eq!(bytes_text(64 << 20), "64 MiB");
        assert_eq!(bytes_text(3 << 29), "1.5 GiB");
        assert_eq!(bytes_text(512), "512 B");
        assert_eq!(bytes_text(16 << 10), "16 KiB");
    }
}

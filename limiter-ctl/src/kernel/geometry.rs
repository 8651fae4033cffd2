//! The shape of the bucket arrays a limiter is loaded with: the per-CPU buckets (`BUCKETS`, for
//! policies of scope cpu) and the host-scope buckets (`HOST_BUCKETS`, shared by every CPU), each
//! with its count-min rows.

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
    /// Both arrays of `buckets`, split into `rows` rows (the tests' usual shape).
    pub const fn same(buckets: u32, rows: u32) -> Self {
        Self { buckets, rows, host_buckets: buckets, host_rows: rows }
    }
}

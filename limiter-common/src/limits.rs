//! What the kernel side can hold, which userspace validates a config against before anything
//! moves: the maps are sized by these (see `maps`, which re-exports them), and the XDP program
//! caps a frame's weight at [`MAX_FRAME_WEIGHT`].

/// Entries per allow/deny trie (each family).
pub const MAX_ACL_ENTRIES: u32 = 16_384;
/// Expiring single addresses (bans) per family: the exact-address hash maps `BANS_V4` and
/// `BANS_V6` (2^20, over a million each). Allocated per entry (BPF_F_NO_PREALLOC): an empty
/// map costs its bucket array only.
pub const MAX_BANS: u32 = 1 << 20;
/// Expiring prefixes (bans shorter than one address) per family, in `BAN_NETS_V4`/`_V6`.
pub const MAX_BAN_NETS: u32 = MAX_ACL_ENTRIES;
/// Policy ids are 1..MAX_POLICIES; 0 means none.
pub const MAX_POLICIES: u32 = 256;
/// Byte-mode weights are capped here (a frame larger than this is charged this much).
pub const MAX_FRAME_WEIGHT: u64 = 65_535;

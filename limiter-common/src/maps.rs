//! The maps the XDP program and userspace share: their names, sizes and value layouts.
//!
//! Layout (per interface):
//! ```text
//! - `CONFIG`      Array[1] of [`Config`]: salt(s), bucket mask, per-protocol fallback policies.
//! - `POLICIES`    Array[MAX_POLICIES] of [`Policy`]; id 0 is "no policy".
//! - `PORT_POLICY` Array[2 * 65536] of u16 routes, indexed `class * 65536 + dport`
//!                 (TCP, then UDP); 0 falls through to the protocol's route. A route is a
//!                 policy id, or, with [`LAYERED`] set, an index into `LAYER_SETS`.
//! - `LAYER_SETS`  Array[MAX_LAYER_SETS] of [u16; MAX_CANDIDATES]: the policies a route's
//!                 packets may meet, in judging order, 0-terminated. Each candidate whose
//!                 predicates hold judges the packet (at most [`MAX_LAYERS`] do).
//! - `BUCKETS`     PerCpuArray[GENERATIONS * buckets] of u64 TATs; generation g uses
//!                 `g * buckets .. (g + 1) * buckets`, split into `Config::rows` rows of
//!                 `Config::row_len` (see `rows`).
//! - `HOST_BUCKETS` Array[GENERATIONS * buckets] of u64 TATs, laid out like `BUCKETS` (one row)
//!                 but one copy for the whole host: the buckets of policies with
//!                 [`Policy::SCOPE_HOST`], written only by atomic compare-and-exchange.
//! - `COUNTERS`    PerCpuArray[MAX_POLICIES] of [`Counters`]; index 0 holds what belongs to no
//!                 policy (not IP, malformed, unmatched, internal errors).
//! - `POLICY_NAMES` Array[MAX_POLICIES] of [u8; 32], and `LAYOUT` Array[1] of u64: userspace
//!                 only, pinned with the rest so a restarted daemon can adopt the state.
//! - `ACL_V4`, `ACL_V6` LPM tries of source prefixes to [`ACL_ALLOW`] or [`ACL_DENY`]; the
//!                 longest prefix decides. Consulted only while `Config::HAS_ACL_*` is set, so an
//!                 empty list costs one branch.
//! - `BANS_V4`, `BANS_V6` hash maps of single source addresses to a [`Ban`] (an action and its
//!                 deadline); `BAN_NETS_V4`, `BAN_NETS_V6` LPM tries of source prefixes to a
//!                 [`Ban`]. The daemon's expiring entries (bans), consulted before the tries
//!                 above and only while `Config::HAS_BANS_*` / `HAS_BAN_NETS_*` is set: one hash
//!                 lookup whatever the number of bans.
//! ```
//!
//! Finding a packet's policy is two array reads whatever the number of policies; a route with
//! several candidates adds one more.

// The maps' sizes and the frame weight cap, beside the layouts they size.
pub use crate::limits::{MAX_ACL_ENTRIES, MAX_BAN_NETS, MAX_BANS, MAX_FRAME_WEIGHT, MAX_POLICIES};
use crate::{gcra::Gcra, siphash::SipInit};

pub const PROGRAM: &str = "limiter";
/// The layered judgement, reached from [`PROGRAM`] by tail call through `JUMPS`.
pub const PROGRAM_LAYERS: &str = "limiter_layers";
/// The same judgement at tc ingress (tcx), for an interface whose XDP hook another program holds:
/// `__sk_buff` in place of `xdp_md`, TC_ACT_SHOT for a refusal, TC_ACT_UNSPEC (the next program
/// runs) for a pass.
pub const PROGRAM_TCX: &str = "limiter_tcx";
/// [`PROGRAM_LAYERS`] at tc ingress, reached from [`PROGRAM_TCX`] through `JUMPS_TCX` (a
/// program array holds programs of one type only). At most 15 characters: the kernel's name.
pub const PROGRAM_LAYERS_TCX: &str = "limiter_lay_tcx";
/// A probe, loaded (never attached) before the limiter: one compare-and-exchange, which the
/// host-scope buckets need (BPF atomics, Linux 5.12). A kernel that refuses it cannot run the
/// limiter, and the daemon says so.
pub const PROBE_CAS: &str = "limiter_cas";
/// The limiter's global (read-only data, set at load): 0 where the kernel refuses
/// `bpf_xdp_adjust_meta` to XDP programs, so the program never calls it.
pub const GLOBAL_MARK_IN_META: &str = "MARK_IN_META";
pub const MAP_CONFIG: &str = "CONFIG";
pub const MAP_POLICIES: &str = "POLICIES";
pub const MAP_PORT_POLICY: &str = "PORT_POLICY";
pub const MAP_LAYER_SETS: &str = "LAYER_SETS";
/// ProgramArray[1]: [`PROGRAM_LAYERS`] at index 0. Pinned: a program array's entries are
/// cleared when no process or pin holds it, and the attached program must keep reaching it.
pub const MAP_JUMPS: &str = "JUMPS";
/// ProgramArray[1]: [`PROGRAM_LAYERS_TCX`] at index 0, pinned as `JUMPS` is.
pub const MAP_JUMPS_TCX: &str = "JUMPS_TCX";
/// PerCpuArray[1] of the layered judgement's task ([`LAYER_TASK_BYTES`]): the packet handed
/// to [`PROGRAM_LAYERS`] and its progress. Pinned with `JUMPS`, so the two programs that
/// meet across a daemon's upgrade share it.
pub const MAP_LAYER_TASK: &str = "LAYER_TASK";
/// The size of the layered judgement's task (limiter-ebpf's `program::layers::Task`).
pub const LAYER_TASK_BYTES: u32 = 352;
pub const MAP_BUCKETS: &str = "BUCKETS";
pub const MAP_COUNTERS: &str = "COUNTERS";
/// The shared (not per-CPU) bucket array of host-scope policies.
pub const MAP_HOST_BUCKETS: &str = "HOST_BUCKETS";
pub const MAP_ACL_V4: &str = "ACL_V4";
pub const MAP_ACL_V6: &str = "ACL_V6";
pub const MAP_BANS_V4: &str = "BANS_V4";
pub const MAP_BANS_V6: &str = "BANS_V6";
pub const MAP_BAN_NETS_V4: &str = "BAN_NETS_V4";
pub const MAP_BAN_NETS_V6: &str = "BAN_NETS_V6";
/// PerCpuArray[2] of u64: packets a ban decided, [`BAN_HIT_DENIED`] and [`BAN_HIT_ALLOWED`]
/// (also counted as denied or allowed in `COUNTERS`).
pub const MAP_BAN_HITS: &str = "BAN_HITS";
pub const BAN_HIT_DENIED: u32 = 0;
pub const BAN_HIT_ALLOWED: u32 = 1;
/// Userspace only: each policy id's name, so a restarted daemon keeps ids (and so buckets and
/// counters) by name.
pub const MAP_POLICY_NAMES: &str = "POLICY_NAMES";
/// Userspace only: [`LAYOUT_VERSION`] of the pinned maps, checked before adopting them.
pub const MAP_LAYOUT: &str = "LAYOUT";
/// A sample of refusals ([`RefusalSample`]), for `limiter-ctl top`.
pub const MAP_REFUSALS: &str = "REFUSALS";
pub const REFUSALS_BYTES: u32 = 256 * 1024;

/// Bumped whenever a shared struct or map changes meaning; pinned maps of another version are
/// not adopted.
pub const LAYOUT_VERSION: u64 = 10;
pub const POLICY_NAME_LEN: usize = 32;

/// ACL values: allowed sources bypass limiting; denied ones are always dropped.
pub const ACL_ALLOW: u8 = 1;
pub const ACL_DENY: u8 = 2;

/// An expiring allow or deny entry (a ban), as `BANS_*` and `BAN_NETS_*` hold it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ban {
    /// CLOCK_MONOTONIC ns (`bpf_ktime_get_ns`) from which the entry is ignored: expiry is exact
    /// in the kernel, whenever the daemon removes it. 0: no deadline.
    pub until_ns: u64,
    /// [`ACL_ALLOW`] or [`ACL_DENY`].
    pub action: u32,
    /// Userspace only: which origins' entries this one stands for (bit `1 << i` for the daemon's
    /// i-th origin), so a restarted daemon can adopt an entry its file lacks. The program never
    /// reads it: it was padding, which daemons before it wrote as 0 ("not known"), so the
    /// layout keeps its version.
    pub origins: u32,
}

/// The window of `Config::sample_budget`.
pub const SAMPLE_WINDOW_NS: u64 = 1_000_000_000;

/// Two sets of buckets, so a salt rotation can judge against the old and the new.
pub const GENERATIONS: u32 = 2;
pub const DEFAULT_BUCKETS: u32 = 65_536;
pub const MIN_BUCKETS: u32 = 1 << 4;
pub const MAX_BUCKETS: u32 = 1 << 24;

/// Protocol classes: port tables exist for the first two.
pub const CLASS_TCP: usize = 0;
pub const CLASS_UDP: usize = 1;
pub const CLASS_ICMP: usize = 2;
pub const CLASS_OTHER: usize = 3;
pub const CLASSES: usize = 4;
pub const PORT_CLASSES: u32 = 2;
pub const PORT_POLICY_ENTRIES: u32 = PORT_CLASSES * 65_536;

/// A route's candidates (`LAYER_SETS`), and the route of its packets that are not connection
/// openings.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerSet {
    /// The policies, in judging order, 0-terminated.
    pub ids: [u16; MAX_CANDIDATES],
    /// The route of a packet that is not a TCP SYN: the same candidates without the SYN-only
    /// ones (0: none; a policy id; or `LAYERED` and a set). Established traffic beside a SYN-only
    /// policy so meets only what judges it, on the one-policy path when that is one policy.
    pub not_syn: u16,
    /// How many of the candidates judge every packet of the route, when none has a predicate
    /// (SYN-only, source port, destination): the program takes them without reading each
    /// policy. 0: it reads each candidate and checks its predicates.
    pub plain: u16,
    pub _pad: [u16; 2],
}

/// A route (in `PORT_POLICY` or `Config::class_policy`) with this bit set names a layer set
/// (its low bits index `LAYER_SETS`) rather than one policy.
pub const LAYERED: u16 = 1 << 15;
/// Candidates a layer set lists (0-terminated when fewer).
pub const MAX_CANDIDATES: usize = 8;
/// Policies that judge any one packet: userspace refuses a state where more could cover one.
pub const MAX_LAYERS: usize = 4;
/// Layer sets: distinct candidate lists, at most one per elementary port interval of each
/// port class plus one per protocol class, which MAX_POLICIES policies cannot exceed.
pub const MAX_LAYER_SETS: u32 = 4 * MAX_POLICIES + 8;

/// What the XDP program puts in a packet's metadata (its first 4 bytes) under
/// [`Config::HANDOVER`]: judged at XDP, not to be judged again at tc ingress.
pub const JUDGED_MARK: u32 = 0x6a75_6467;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Config {
    /// The salt of each bucket generation, folded into SipHash's initial state. Never logged or
    /// printed (Debug hides it).
    pub salts: [SipInit; GENERATIONS as usize],
    /// Salt rotation: until then, a packet's bucket in the other generation (under the other
    /// salt) is consulted too, and a later TAT there carries over.
    pub grace_until_ns: u64,
    /// When the current salt was drawn (monotonic ns; userspace only, for metrics).
    pub rotated_at_ns: u64,
    /// Buckets per generation minus one; the bucket count is a power of two.
    pub bucket_mask: u32,
    /// The current generation (0 or 1): its salt and its half of `BUCKETS`.
    pub generation: u32,
    /// The route (policy id, or layer set with [`LAYERED`]) for each protocol class when no
    /// port entry matches, with `any` already folded in (0: traffic of that class passes
    /// untouched).
    pub class_policy: [u16; CLASSES],
    pub flags: u32,
    /// With `SAMPLE_REFUSALS`: a refusal is drawn when `random & sample_mask == 0` (then held to
    /// `sample_budget`).
    pub sample_mask: u32,
    /// Count-min rows (1..=`rows::MAX_ROWS`; 0 reads as 1): each generation's buckets are split
    /// into this many rows of `row_len`, and a key has one bucket in each.
    pub rows: u32,
    /// Buckets per row: `(bucket_mask + 1) / rows` (0 reads as `bucket_mask + 1`).
    pub row_len: u32,
    /// Host-scope buckets (`HOST_BUCKETS`) per generation minus one: sized apart from the
    /// per-CPU ones (`bucket_mask`), since they are paid for once, not once per CPU.
    pub host_mask: u32,
    /// Count-min rows of the host-scope buckets (1..=`rows::MAX_ROWS`; 0 reads as 1), of
    /// `host_row_len` buckets each (0 reads as `host_mask + 1`).
    pub host_rows: u32,
    pub host_row_len: u32,
    /// With `SAMPLE_REFUSALS`: at most this many samples per CPU in each [`SAMPLE_WINDOW_NS`]
    /// (0: no cap), so the daemon's cost is bounded whatever the flood's rate.
    pub sample_budget: u32,
}

impl Config {
    /// At least one port entry is set: TCP/UDP packets consult `PORT_POLICY`.
    pub const HAS_PORT_POLICIES: u32 = 1 << 0;
    /// The IPv4 allow/deny trie has entries.
    pub const HAS_ACL_V4: u32 = 1 << 1;
    /// The IPv6 allow/deny trie has entries.
    pub const HAS_ACL_V6: u32 = 1 << 2;
    /// Send a sample of refusals (1 in `sample_mask + 1`) to `REFUSALS`.
    pub const SAMPLE_REFUSALS: u32 = 1 << 3;
    /// `BANS_V4` (exact IPv4 bans) has entries.
    pub const HAS_BANS_V4: u32 = 1 << 8;
    /// `BANS_V6` (exact IPv6 bans) has entries.
    pub const HAS_BANS_V6: u32 = 1 << 9;
    /// `BAN_NETS_V4` (IPv4 prefix bans) has entries.
    pub const HAS_BAN_NETS_V4: u32 = 1 << 10;
    /// `BAN_NETS_V6` (IPv6 prefix bans) has entries.
    pub const HAS_BAN_NETS_V6: u32 = 1 << 11;
    /// Any ban map has entries.
    pub const HAS_BANS: u32 = Self::HAS_BANS_V4 | Self::HAS_BANS_V6 | Self::HAS_BAN_NETS_V4 | Self::HAS_BAN_NETS_V6;
    /// A datagram of class `c` that hides its ports is dropped when bit `HIDDEN_DROP << c` is
    /// set: userspace sets it where a policy could need what is hidden (docs/DESIGN.md,
    /// Hidden ports).
    pub const HIDDEN_DROP: u32 = 1 << 4;
    /// Both hooks may hold the program (a move between them is under way, or was cut short):
    /// the XDP program puts [`JUDGED_MARK`] in the metadata of what it passes, and the tc program
    /// passes what bears it unjudged, so a packet is judged once whichever hooks run.
    pub const HANDOVER: u32 = 1 << 12;
    /// Userspace only: the program was attached in skb (generic) mode.
    pub const ATTACHED_SKB: u32 = 1 << 16;
    /// Userspace only: the program was attached at tc ingress (tcx), not XDP.
    pub const ATTACHED_TCX: u32 = 1 << 17;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    pub gcra: Gcra,
    /// Until when (monotonic ns) this slot's claim stays at least its old window after the slot
    /// was lowered, removed or reused (`gcra::hold_after`): TATs the old entry let sources earn
    /// keep counting until they are reached. 0: no hold.
    pub hold_until_ns: u64,
    /// Prefix masks as the little-endian words the program ANDs with the address words.
    pub v6_mask: [u64; 2],
    pub v4_mask: u64,
    pub flags: u32,
    pub id: u16,
    /// The prefix lengths the masks keep (reported with refusal samples).
    pub v4_prefix: u8,
    pub v6_prefix: u8,
    /// With [`Policy::SPORT`]: the source ports the policy judges, inclusive.
    pub sport_lo: u16,
    pub sport_hi: u16,
    /// Host scope, one key (an aggregate): how many units a CPU reserves from the shared bucket
    /// at once ([`Lease`]); 0 or 1: none, every admission writes the shared bucket.
    pub lease: u32,
    /// With [`Policy::DST_V4`] / [`Policy::DST_V6`]: the destination prefix the policy judges
    /// in that family, as masked address words and their masks (laid out like the source's
    /// words, `Packet::dst`). A policy with a destination prefix in one family only judges no
    /// packet of the other.
    pub dst_v4: u64,
    pub dst_v4_mask: u64,
    pub dst_v6: [u64; 2],
    pub dst_v6_mask: [u64; 2],
}

impl Policy {
    pub const ACTIVE: u32 = 1 << 0;
    /// Charge each frame's length instead of 1.
    pub const BYTES: u32 = 1 << 1;
    /// Pass everything, count what would have been refused.
    pub const DRY_RUN: u32 = 1 << 2;
    /// The destination port is part of the key.
    pub const KEY_DPORT: u32 = 1 << 3;
    /// Host scope: one allowance per key for the whole host, in `HOST_BUCKETS` (shared by every
    /// CPU, updated by compare-and-exchange), instead of one per CPU in `BUCKETS`.
    pub const SCOPE_HOST: u32 = 1 << 4;
    /// A predicate, checked after the policy is selected: the policy judges only TCP segments
    /// with SYN set and ACK clear (connection openings). Any other packet it would have judged
    /// is judged as if the policy were absent: by its protocol's policy, else `any`'s, else by
    /// none. A new bit: records written before it existed never set it, so the layout keeps its
    /// version.
    pub const SYN_ONLY: u32 = 1 << 5;
    /// A predicate: the policy judges only sources ports `sport_lo..=sport_hi`.
    pub const SPORT: u32 = 1 << 6;
    /// A predicate: the policy judges only IPv4 destinations within `dst_v4`/`dst_v4_mask`.
    pub const DST_V4: u32 = 1 << 7;
    /// A predicate: the policy judges only IPv6 destinations within `dst_v6`/`dst_v6_mask`.
    pub const DST_V6: u32 = 1 << 8;
    /// Any destination predicate: a packet of a family without one is not judged.
    pub const DST: u32 = Self::DST_V4 | Self::DST_V6;
    /// A rate of 0: every packet the policy judges is refused, no bucket read.
    pub const DENY: u32 = 1 << 9;
    /// Every predicate bit.
    pub const PREDICATES: u32 = Self::SYN_ONLY | Self::SPORT | Self::DST;
}

/// A CPU's reservation of an aggregate's allowance (`LEASES`, per CPU, by policy id): units
/// charged to the shared bucket at once, spent by this CPU's packets without touching it, so an
/// aggregate admitting on every CPU moves its shared line once per [`Policy::lease`] units
/// rather than once per packet. Held at most [`LEASE_NS`]: an admission spends a unit charged
/// at most that long before it, so a layer's bound over `t` is at most its bound over
/// `t + LEASE_NS` (docs/DESIGN.md, Layers).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lease {
    /// The key's hash under the salt it was reserved with.
    pub hash: u64,
    /// The policy's emission interval when reserved: a changed policy voids the lease.
    pub emission: u64,
    /// Units left.
    pub units: u64,
    /// Monotonic ns after which the units left are forfeit.
    pub until_ns: u64,
}

/// How long a lease lives, and so how much of the rate a CPU reserves at once (`Policy::lease`
/// is about this long's worth of units).
pub const LEASE_NS: u64 = 100_000;
/// The most units a lease holds.
pub const MAX_LEASE: u32 = 64;

/// Host scope: how many times a packet tries to compare-and-exchange its bucket before it is
/// refused. Each failed try means another CPU admitted against the bucket in between, so the loop is bounded and refusing keeps every key within its bound.
pub const HOST_CAS_TRIES: u32 = 4;

/// Per-CPU counters, one set per policy id (0: traffic no policy judged).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub admitted_packets: u64,
    pub admitted_bytes: u64,
    pub refused_packets: u64,
    pub refused_bytes: u64,
    /// Dry-run policies: passed, but would have been refused.
    pub dry_run_packets: u64,
    pub dry_run_bytes: u64,
    pub allowed_packets: u64,
    pub denied_packets: u64,
    pub not_ip: u64,
    pub malformed: u64,
    /// IP traffic no policy matched (passed untouched).
    pub unmatched: u64,
    /// The limiter's own faults (a failed map lookup): always passed.
    pub errors: u64,
    /// TCP/UDP (or a protocol hidden behind too long an IPv6 extension chain) whose destination
    /// port could not be read although the datagram carries one (a first fragment too short to
    /// hold its L4 header, RFC 1858; more than `MAX_EXT_HEADERS` IPv6 extension headers),
    /// dropped whatever the policy's mode while a policy could need the port: any port policy
    /// exists; the protocol is unknown and `tcp` or `udp` has a policy other than `any`; or the
    /// policy that would judge it keys on the port (its key would be port 0's, a second
    /// allowance beside the real port's) or is SYN-only (the flags are hidden too). Otherwise it is judged by its class, under the very
    /// key of the datagram it starts (docs/DESIGN.md, Hidden ports).
    pub unreadable_ports: u64,
    /// Layers: packets this policy judged (and admitted, or would have refused) that another
    /// layer refused. Not in [`Counters::packets`]: the refusing layer counts the packet. Last,
    /// so the counters of layout 5 and before are this struct's first fields.
    pub overruled_packets: u64,
}

impl Counters {
    pub fn add(&mut self, o: &Self) {
        self.admitted_packets += o.admitted_packets;
        self.admitted_bytes += o.admitted_bytes;
        self.refused_packets += o.refused_packets;
        self.refused_bytes += o.refused_bytes;
        self.dry_run_packets += o.dry_run_packets;
        self.dry_run_bytes += o.dry_run_bytes;
        self.overruled_packets += o.overruled_packets;
        self.allowed_packets += o.allowed_packets;
        self.denied_packets += o.denied_packets;
        self.not_ip += o.not_ip;
        self.malformed += o.malformed;
        self.unmatched += o.unmatched;
        self.errors += o.errors;
        self.unreadable_ports += o.unreadable_ports;
    }

    /// Every packet the program saw lands in exactly one of these.
    pub fn packets(&self) -> u64 {
        self.admitted_packets
            + self.refused_packets
            + self.dry_run_packets
            + self.allowed_packets
            + self.denied_packets
            + self.not_ip
            + self.malformed
            + self.unmatched
            + self.errors
            + self.unreadable_ports
    }
}

/// One sampled refusal: the key's prefix (never more of the address than the policy keys on).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefusalSample {
    /// The masked source address (network order; IPv4 in the first 4 bytes).
    pub addr: [u8; 16],
    pub policy: u16,
    pub dport: u16,
    pub family: u8,
    pub prefix_len: u8,
    /// 1 when the policy is dry-run (the packet passed).
    pub dry_run: u8,
    pub _pad: u8,
    /// The refusals this sample stands for, in units of the 1-in-N draw: the draw's hits on its
    /// CPU that `Config::sample_budget` kept from the ring since that CPU's last sample, and
    /// this one (`sample::take`). Refusals estimated: `weight x N`.
    pub weight: u32,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: all are repr(C), Copy, made only of integers, with explicit padding fields.
    unsafe impl aya::Pod for super::Config {}
    unsafe impl aya::Pod for super::Policy {}
    unsafe impl aya::Pod for super::Counters {}
    unsafe impl aya::Pod for super::RefusalSample {}
    unsafe impl aya::Pod for super::Lease {}
    unsafe impl aya::Pod for super::LayerSet {}
    unsafe impl aya::Pod for super::Ban {}
}

#[cfg(test)]
mod tests {
    use core::mem::size_of;

    use super::*;

    #[test]
    fn layouts_have_no_implicit_padding() {
        assert_eq!(size_of::<Config>(), 2 * 32 + 8 + 8 + 4 + 4 + 8 + 4 + 4 + 4 + 4 + 4 * 4);
        assert_eq!(size_of::<Policy>(), 16 + 8 + 16 + 8 + 4 + 2 + 2 + 4 + 4 + 8 + 8 + 16 + 16);
        assert_eq!(size_of::<Counters>(), 14 * 8);
        assert_eq!(size_of::<RefusalSample>(), 16 + 2 + 2 + 4 + 4);
        assert_eq!(size_of::<Ban>(), 8 + 4 + 4);
    }
}

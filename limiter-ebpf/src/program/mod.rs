//! The limiter program: its maps and its steps, parse → policy → key → decide → act
//! ([`limiter`]); a packet several policies cover is judged by each (`layers`). Anything it
//! cannot judge, and any fault of its own, passes and is counted.
//!
//! One judgement, two hooks ([`Hook`]): XDP (`xdp_md`) and tc ingress through tcx
//! (`__sk_buff`), for an interface whose XDP another program holds. The steps speak XDP's two
//! actions; the tc entry points turn them into TC_ACT_SHOT and TC_ACT_UNSPEC ([`tc_action`]).
//!
//! Not part of limiter-ebpf's library: the shipped object (`main.rs`, every shortcut on) and the
//! test object `limiter-switchable` (`bin/switchable.rs`, shortcuts set at load) each compile it,
//! so each holds its own maps, under the same names.

mod act;
mod buckets;
mod host_one;
mod host_rows;
mod layer_memo;
mod layers;
mod policy;

use aya_ebpf::{
    EbpfContext,
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC, xdp_action::XDP_DROP},
    helpers::bpf_xdp_adjust_meta,
    macros::map,
    maps::{Array, HashMap, LpmTrie, PerCpuArray, ProgramArray, RingBuf},
    programs::{TcContext, XdpContext},
};
use limiter_common::{
    maps::{
        Ban, Config, Counters, DEFAULT_BUCKETS, GENERATIONS, JUDGED_MARK, LayerSet, Lease, MAX_ACL_ENTRIES,
        MAX_BAN_NETS, MAX_BANS, MAX_LAYER_SETS, MAX_POLICIES, POLICY_NAME_LEN, PORT_POLICY_ENTRIES, Policy,
        REFUSALS_BYTES,
    },
    sample::Sampler,
};
use limiter_ebpf::{
    frame::{Frame, pull_headers},
    key::key_words,
    memo::{KeyMemo, Shortcuts},
    parse::parse,
};

use self::policy::Selected;

/// The kernel's flag for a hash map allocated per entry (include/uapi/linux/bpf.h).
const BPF_F_NO_PREALLOC: u32 = 1;

#[map]
static CONFIG: Array<Config> = Array::with_max_entries(1, 0);
#[map]
static POLICIES: Array<Policy> = Array::with_max_entries(MAX_POLICIES, 0);
#[map]
static PORT_POLICY: Array<u16> = Array::with_max_entries(PORT_POLICY_ENTRIES, 0);
#[map]
static LAYER_SETS: Array<LayerSet> = Array::with_max_entries(MAX_LAYER_SETS, 0);
/// Resized at load to GENERATIONS x the bucket count the operator chose.
#[map]
static BUCKETS: PerCpuArray<u64> = PerCpuArray::with_max_entries(GENERATIONS * DEFAULT_BUCKETS, 0);
/// Host-scope policies' buckets: one copy shared by every CPU, same size and generations as
/// `BUCKETS` (resized at load with it).
#[map]
static HOST_BUCKETS: Array<u64> = Array::with_max_entries(GENERATIONS * DEFAULT_BUCKETS, 0);
#[map]
static COUNTERS: PerCpuArray<Counters> = PerCpuArray::with_max_entries(MAX_POLICIES, 0);
#[map]
static ACL_V4: LpmTrie<[u8; 4], u8> = LpmTrie::with_max_entries(MAX_ACL_ENTRIES, 0);
#[map]
static ACL_V6: LpmTrie<[u8; 16], u8> = LpmTrie::with_max_entries(MAX_ACL_ENTRIES, 0);
/// Bans of single addresses (the daemon's expiring entries): one hash lookup whatever their
/// number. Allocated per entry (BPF_F_NO_PREALLOC), so memory follows the bans in use.
#[map]
static BANS_V4: HashMap<[u8; 4], Ban> = HashMap::with_max_entries(MAX_BANS, BPF_F_NO_PREALLOC);
#[map]
static BANS_V6: HashMap<[u8; 16], Ban> = HashMap::with_max_entries(MAX_BANS, BPF_F_NO_PREALLOC);
/// Bans of prefixes (shorter than one address).
#[map]
static BAN_NETS_V4: LpmTrie<[u8; 4], Ban> = LpmTrie::with_max_entries(MAX_BAN_NETS, 0);
#[map]
static BAN_NETS_V6: LpmTrie<[u8; 16], Ban> = LpmTrie::with_max_entries(MAX_BAN_NETS, 0);
/// Packets a ban denied and allowed, per CPU (`limiter_common::maps::MAP_BAN_HITS`).
#[map]
static BAN_HITS: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);
// Read and written by userspace only; defined here so they are created and pinned with the rest.
#[map]
static POLICY_NAMES: Array<[u8; POLICY_NAME_LEN]> = Array::with_max_entries(MAX_POLICIES, 0);
#[map]
static LAYOUT: Array<u64> = Array::with_max_entries(1, 0);
#[map]
static REFUSALS: RingBuf = RingBuf::with_byte_size(REFUSALS_BYTES, 0);
/// Each CPU's last key and its hash (`KeyMemo`). Not pinned: a cache, empty after a reload.
#[map]
static KEY_MEMO: PerCpuArray<KeyMemo> = PerCpuArray::with_max_entries(1, 0);
/// Each CPU's host-scope rows being judged (`buckets::HostRows`): off the stack, which the
/// rows' arrays would push past 512 B beside the program's own frame. Not pinned: scratch.
#[map]
static HOST_ROWS: PerCpuArray<host_rows::HostRows> = PerCpuArray::with_max_entries(1, 0);
/// Each CPU's parsed packet, written and read back between the parse and the judgement.
#[map]
static PACKET: PerCpuArray<limiter_ebpf::parse::Packet> = PerCpuArray::with_max_entries(1, 0);
/// Each CPU's one-row host-scope judgement being made (`host_one::HostOne`). Not pinned: scratch.
#[map]
static HOST_ONE: PerCpuArray<host_one::HostOne> = PerCpuArray::with_max_entries(1, 0);
/// Each CPU's packet handed to the layered judgement (`layers::Task`), and its progress.
#[map]
static LAYER_TASK: PerCpuArray<layers::Task> = PerCpuArray::with_max_entries(1, 0);
/// Each CPU's leases of aggregates' allowances, by policy id (`limiter_common::maps::Lease`).
/// Not pinned: a lease lost with a reload forfeits at most its units left.
#[map]
static LEASES: PerCpuArray<Lease> = PerCpuArray::with_max_entries(MAX_POLICIES, 0);
/// Each CPU's last key of each layer (by policy id) and its hash: a layer's key repeated (one
/// source's flow, or an aggregate's one key) skips SipHash (`memo::hash`). Not pinned: a cache.
#[map]
static LAYER_HASHES: PerCpuArray<KeyMemo> = PerCpuArray::with_max_entries(MAX_POLICIES, 0);
/// Each CPU's last layered refusal and how long it stands (`layer_memo::LayerMemo`). Not
/// pinned: a cache, empty after a reload.
#[map]
static LAYER_MEMO: PerCpuArray<layer_memo::LayerMemo> = PerCpuArray::with_max_entries(1, 0);
/// `limiter_layers` at index 0, set by userspace after loading: where a layered packet goes.
#[map]
static JUMPS: ProgramArray = ProgramArray::with_max_entries(1, 0);
/// `JUMPS` for the tc programs: a program array holds programs of one type only.
#[map]
static JUMPS_TCX: ProgramArray = ProgramArray::with_max_entries(1, 0);
/// Each CPU's refusal sampler: the draw's state and the budget's window
/// (`limiter_common::sample::Sampler`). Not pinned: reseeded, its window reopened, after a reload.
#[map]
static SAMPLER: PerCpuArray<Sampler> = PerCpuArray::with_max_entries(1, 0);

/// Where the judgement runs: what it reads the frame through, and where its tail call goes.
pub trait Hook: Frame + EbpfContext {
    /// The program array holding this hook's `limiter_layers`.
    fn jumps() -> &'static ProgramArray;
}

impl Hook for XdpContext {
    #[inline(always)]
    fn jumps() -> &'static ProgramArray {
        &JUMPS
    }
}

impl Hook for TcContext {
    #[inline(always)]
    fn jumps() -> &'static ProgramArray {
        &JUMPS_TCX
    }
}

/// The XDP action the judgement returns, as tcx's: a refusal is TC_ACT_SHOT; anything else
/// goes on to the next program in the chain (TC_ACT_UNSPEC), never TC_ACT_OK, which would skip
/// the programs after the limiter.
#[inline(always)]
pub fn tc_action(xdp: u32) -> i32 {
    if xdp == XDP_DROP { TC_ACT_SHOT as i32 } else { TC_ACT_UNSPEC }
}

/// The layered judgement's program body (`layers`), reached by tail call.
#[inline(always)]
pub fn limiter_layers<H: Hook>(ctx: &H) -> u32 {
    layers::run(ctx)
}

/// The tc program's body: headers an skb holds in its pages are pulled in first. What the XDP
/// program judged already (both hooks attached, [`Config::HANDOVER`]) goes on unjudged.
#[inline(always)]
pub fn limiter_tcx<S: Shortcuts>(ctx: &TcContext) -> i32 {
    if judged_at_xdp(ctx) {
        return TC_ACT_UNSPEC;
    }
    pull_headers(ctx);
    tc_action(limiter::<S, TcContext>(ctx))
}

/// Under [`Config::HANDOVER`], marks the packet judged before it is: what the XDP program
/// passes then goes by the tc program unjudged (see [`judged_at_xdp`]); what it drops, nobody
/// sees. Marked on the way in, not out: one test where the program starts, not one on each of
/// its ways out, which the verifier would walk for every state that reaches them.
#[inline(always)]
pub fn mark_in_handover(ctx: &XdpContext) {
    if CONFIG.get(0).is_some_and(|c| c.flags & Config::HANDOVER != 0) {
        mark_judged(ctx);
    }
}

/// 0 when the kernel refuses `bpf_xdp_adjust_meta` to XDP programs (some do: the loader probes
/// and sets it, `MARK_IN_META`): the program then never calls it, as if every driver kept no
/// metadata. Read-only data, so the verifier drops the untaken branch, helper call and all.
#[unsafe(no_mangle)]
static MARK_IN_META: u8 = 1;

/// [`JUDGED_MARK`] in four bytes of metadata before the frame. A driver that keeps no metadata
/// refuses the room (or the kernel the helper, [`MARK_IN_META`]): the packet is then judged at
/// tc ingress too, the strict side.
#[inline(always)]
fn mark_judged(ctx: &XdpContext) {
    // SAFETY: a plain read of the loader's constant.
    if unsafe { core::ptr::read_volatile(&MARK_IN_META) } == 0 {
        return;
    }
    // SAFETY: the helper checks the room it makes; the packet pointers are read after it.
    if unsafe { bpf_xdp_adjust_meta(ctx.ctx, -(MARK_LEN as i32)) } != 0 {
        return;
    }
    let (meta, data) = (ctx.metadata(), ctx.data());
    if meta + MARK_LEN <= data {
        // SAFETY: within the metadata, checked just above.
        unsafe { core::ptr::write_unaligned(meta as *mut u32, JUDGED_MARK) };
    }
}

/// Whether the packet bears the XDP program's [`JUDGED_MARK`] while both hooks may judge: only
/// then, so metadata some other XDP program leaves is never taken for it otherwise.
#[inline(always)]
fn judged_at_xdp(ctx: &TcContext) -> bool {
    let skb = ctx.skb.skb;
    // SAFETY: fields of the context the kernel hands the program.
    let (meta, data) = unsafe { ((*skb).data_meta as usize, (*skb).data as usize) };
    // SAFETY: within the metadata, checked first.
    meta + MARK_LEN <= data
        && unsafe { core::ptr::read_unaligned(meta as *const u32) } == JUDGED_MARK
        && CONFIG.get(0).is_some_and(|c| c.flags & Config::HANDOVER != 0)
}

/// The metadata the mark takes (the kernel wants a multiple of 4).
const MARK_LEN: usize = 4;

/// The program's body, with the memo's shortcuts `S`, at hook `H`: an XDP action.
#[inline(always)]
pub fn limiter<S: Shortcuts, H: Hook>(ctx: &H) -> u32 {
    let frame_len = ctx.len();
    // Parsed into this CPU's scratch, and read from there after a helper call: the verifier
    // knows nothing of a map value's contents, so every way through the parse (each with its
    // own constants) meets the rest of the program as one state, instead of walking it again
    // (on kernel 7.3 the limiter went from 822k instructions to under half that).
    let Some(slot) = PACKET.get_ptr_mut(0) else {
        return act::fault();
    };
    // SAFETY: a map value, valid for the program's run; only this CPU touches it.
    if let Err(skip) = parse(ctx, unsafe { &mut *slot }) {
        return act::skipped(skip);
    }
    let Some(cfg) = CONFIG.get(0) else {
        return act::fault();
    };
    // SAFETY: as above.
    let pkt: &limiter_ebpf::parse::Packet = unsafe { &*slot };
    let policy = match policy::select(cfg, pkt) {
        Selected::Judge(policy) => policy,
        Selected::Layers(set) => {
            if layer_memo::refused::<S>(cfg, pkt, set, frame_len) {
                return XDP_DROP;
            }
            return layers::hand_over(ctx, pkt, set, frame_len);
        }
        Selected::Done(action) => return action,
    };
    let words = key_words(pkt, policy);
    let verdict = if policy.flags & Policy::SCOPE_HOST != 0 {
        if cfg.host_rows > 1 {
            // Out of line, and the program's last step (`host_rows`).
            return host_rows::alone::<S>(cfg, pkt.family, policy, &words, frame_len);
        }
        buckets::host::<S>(cfg, pkt.family, policy, &words, frame_len)
    } else {
        buckets::per_cpu::<S>(cfg, pkt.family, policy, &words, frame_len)
    };
    let Some(verdict) = verdict else {
        return act::fault();
    };
    act::act(cfg, pkt.family, policy, &words, verdict, frame_len)
}

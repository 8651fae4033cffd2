//! The limiter: per-source GCRA in XDP. Refusal is XDP_DROP; anything the limiter cannot judge,
//! and any fault of its own, passes and is counted.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    helpers::{bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_ns},
    macros::{map, xdp},
    maps::{Array, LpmTrie, PerCpuArray, RingBuf, lpm_trie::Key},
    programs::XdpContext,
};
use limiter_common::{
    FlowKey, gcra,
    key::FAMILY_V4,
    key::{key_hash, row0_index},
    maps::{
        ACL_ALLOW, CLASS_OTHER, CLASS_TCP, CLASS_UDP, Config, Counters, DEFAULT_BUCKETS, GENERATIONS, MAX_ACL_ENTRIES,
        MAX_POLICIES, POLICY_NAME_LEN, PORT_POLICY_ENTRIES, Policy, REFUSALS_BYTES, RefusalSample,
    },
    rows::{self, MAX_ROWS, row_indexes},
    sample,
    tick::Streak,
};
use limiter_ebpf::{
    decide::{Verdict, count, decide},
    key::{KeyMemo, key_words},
    parse::{Packet, Skip, parse},
    scope,
};

#[map]
static CONFIG: Array<Config> = Array::with_max_entries(1, 0);
#[map]
static POLICIES: Array<Policy> = Array::with_max_entries(MAX_POLICIES, 0);
#[map]
static PORT_POLICY: Array<u16> = Array::with_max_entries(PORT_POLICY_ENTRIES, 0);
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
/// Each CPU's refusal sampler state (`limiter_common::sample`). Not pinned: reseeded after a
/// reload.
#[map]
static SAMPLER: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// 0 turns the key memo off (the benchmark sets it, to measure the memo against no memo in the
/// same run); read-only data, so the verifier drops the untaken branch.
#[unsafe(no_mangle)]
static USE_KEY_MEMO: u8 = 1;

/// 0 turns the tick refusal off (`limiter_common::tick`: a flooding key refused for the rest of
/// the tick without reading the clock); for the benchmark and the exact-timing tests.
#[unsafe(no_mangle)]
static USE_TICK_REFUSAL: u8 = 1;

#[xdp]
pub fn limiter(ctx: XdpContext) -> u32 {
    let frame_len = (ctx.data_end() - ctx.data()) as u64;
    match parse(&ctx) {
        Ok(pkt) => judge(&pkt, frame_len),
        Err(skip) => {
            bump(0, |c| match skip {
                Skip::NotIp => c.not_ip += 1,
                Skip::Malformed => c.malformed += 1,
            });
            XDP_PASS
        }
    }
}

#[inline(always)]
fn judge(pkt: &Packet, frame_len: u64) -> u32 {
    let Some(cfg) = CONFIG.get(0) else {
        return fault();
    };
    let Some(id) = policy_id(cfg, pkt) else {
        return fault();
    };
    if cfg.flags & (Config::HAS_ACL_V4 | Config::HAS_ACL_V6) != 0 {
        if let Some(action) = acl(cfg, pkt) {
            // Counted under the policy the packet would have met, so hits show per policy.
            return if action == ACL_ALLOW {
                bump(u32::from(id), |c| c.allowed_packets += 1);
                XDP_PASS
            } else {
                bump(u32::from(id), |c| c.denied_packets += 1);
                XDP_DROP
            };
        }
    }
    if pkt.ports_hidden && hides_from_a_policy(cfg, pkt) {
        bump(0, |c| c.unreadable_ports += 1);
        return XDP_DROP;
    }
    if id == 0 {
        return unmatched();
    }
    let Some(policy) = POLICIES.get(u32::from(id)) else {
        return fault();
    };
    if policy.flags & Policy::ACTIVE == 0 {
        return unmatched();
    }
    let words = key_words(pkt, policy);
    if policy.flags & Policy::SCOPE_HOST != 0 {
        let Some(verdict) = judge_host(cfg, pkt, policy, &words, frame_len) else {
            return fault();
        };
        return act(cfg, pkt, policy, &words, verdict, frame_len);
    }
    let generation = (cfg.generation & 1) as usize;
    let (rows, len) = row_shape(cfg);
    let memo = key_memo();
    let hash = current_hash(cfg, generation, pkt.family, &words, memo);
    if let Some(m) = memo {
        // SAFETY: a map value, valid for the program's run; only this CPU touches it.
        let m = unsafe { &mut *m };
        if m.refused_until_ns != 0
            && m.emission == policy.gcra.emission
            && m.capacity == policy.gcra.capacity
            && m.shape == shape(cfg)
            && m.rows == rows as u64
            && policy.flags & Policy::BYTES == 0
        {
            // The tick counter before the clock: the refusal the clock confirms falls in it.
            let tick = if tick_refusal() { unsafe { bpf_jiffies64() } } else { 0 };
            if tick_refusal() && m.streak.skips(tick) {
                return act(cfg, pkt, policy, &words, refusal(policy), frame_len);
            }
            let now = unsafe { bpf_ktime_get_ns() };
            // Wrapping: `now` before the end of the standing refusal.
            if (m.refused_until_ns.wrapping_sub(now) as i64) > 0 {
                if tick_refusal() {
                    m.streak.confirm(tick, &policy.gcra);
                }
                return act(cfg, pkt, policy, &words, refusal(policy), frame_len);
            }
        }
    }
    let current = bucket_rows(cfg, generation, hash, rows, len);
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(mut values) = read_rows(&current, rows) else {
        return fault();
    };
    if now < cfg.grace_until_ns {
        // Salt rotation: each of the source's rows under the previous salt may be further ahead.
        let old_hash = key_hash(&cfg.salts[generation ^ 1], pkt.family, &words);
        let previous = bucket_rows(cfg, generation ^ 1, old_hash, rows, len);
        let Some(old) = read_rows(&previous, rows) else {
            return fault();
        };
        let mut i = 0;
        while i < MAX_ROWS && i < rows {
            values[i] = gcra::later(values[i], old[i], now, policy.gcra.capacity, |id| claim(id, now));
            i += 1;
        }
    }
    let (verdict, store) = decide(policy, &values, rows, now, frame_len, |id| claim(id, now));
    write_rows(&current, rows, &store);
    if let Some(m) = memo {
        // SAFETY: as above.
        let m = unsafe { &mut *m };
        let until = if verdict == Verdict::Admit || now < cfg.grace_until_ns {
            0
        } else {
            refused_until(policy, &values, rows, now)
        };
        m.refused_until_ns = until;
        if until != 0 {
            m.streak = Streak::default();
            m.emission = policy.gcra.emission;
            m.capacity = policy.gcra.capacity;
            m.shape = shape(cfg);
            m.rows = rows as u64;
        }
    }
    act(cfg, pkt, policy, &words, verdict, frame_len)
}

/// The bucket geometry a memo refusal was computed under (with the rows).
#[inline(always)]
fn shape(cfg: &Config) -> u64 {
    u64::from(cfg.bucket_mask) | u64::from(cfg.row_len) << 32
}

/// The verdict for a packet the policy refuses (dry-run: would refuse).
#[inline(always)]
fn refusal(policy: &Policy) -> Verdict {
    if policy.flags & Policy::DRY_RUN != 0 { Verdict::WouldRefuse } else { Verdict::Refuse }
}

/// Until when a refusal stands (`limiter_common::rows::refused_until`), 0 for a byte policy
/// (the cost depends on the frame).
#[inline(always)]
fn refused_until(policy: &Policy, values: &[u64; MAX_ROWS], rows: usize, now_ns: u64) -> u64 {
    if policy.flags & Policy::BYTES != 0 {
        return 0;
    }
    rows::refused_until(&policy.gcra, values, rows, now_ns)
}

/// Counts the verdict (and samples a refusal), and turns it into the XDP action.
#[inline(always)]
fn act(cfg: &Config, pkt: &Packet, policy: &Policy, words: &[u64; 3], verdict: Verdict, frame_len: u64) -> u32 {
    bump(u32::from(policy.id), |c| count(c, verdict, frame_len));
    if verdict != Verdict::Admit && cfg.flags & Config::SAMPLE_REFUSALS != 0 {
        sample_refusal(cfg, pkt, policy, words, verdict);
    }
    if verdict == Verdict::Refuse { XDP_DROP } else { XDP_PASS }
}

/// A host-scope policy: the key's bucket in `HOST_BUCKETS`, one for every CPU, read plainly and
/// written only by compare-and-exchange when the judgement changes it (`limiter_ebpf::scope`).
/// During a salt rotation the old generation's bucket is read too and a later TAT carries over,
/// as for per-CPU buckets; it is never written (every write goes to the current generation).
/// None on a failed lookup.
#[inline(always)]
fn judge_host(cfg: &Config, pkt: &Packet, policy: &Policy, words: &[u64; 3], frame_len: u64) -> Option<Verdict> {
    let generation = (cfg.generation & 1) as usize;
    let hash = current_hash(cfg, generation, pkt.family, words, key_memo());
    let bucket = HOST_BUCKETS.get_ptr_mut(host_index(cfg, generation, hash))?;
    let exhausted = if policy.flags & Policy::DRY_RUN != 0 { Verdict::WouldRefuse } else { Verdict::Refuse };
    // SAFETY: a map value of 8 aligned bytes, valid for the program's run.
    Some(unsafe {
        scope::judge_shared(bucket, exhausted, |current| {
            // The clock is read after the bucket, on every try: a TAT another CPU wrote was
            // written at an earlier time than this one, so no CPU judges a newer TAT with an
            // older clock (which would read it further ahead than its writer's claim: a ghost, idle).
            let now = bpf_ktime_get_ns();
            let mut value = current;
            if now < cfg.grace_until_ns {
                // Salt rotation: the key's bucket under the previous salt may be further ahead
                // (never written: every write goes to the current generation).
                let old_hash = key_hash(&cfg.salts[generation ^ 1], pkt.family, words);
                if let Some(old) = HOST_BUCKETS.get_ptr_mut(host_index(cfg, generation ^ 1, old_hash)) {
                    value = gcra::later(current, scope::load(old), now, policy.gcra.capacity, |id| claim(id, now));
                }
            }
            // One row: the host array is not split (count-min rows are for per-CPU buckets).
            let mut values = [0u64; MAX_ROWS];
            values[0] = value;
            let (verdict, store) = decide(policy, &values, 1, now, frame_len, |id| claim(id, now));
            (verdict, store[0])
        })
    })
}

/// The key's bucket in `HOST_BUCKETS` for `generation`, from the key's hash under that
/// generation's salt: one index over the generation's whole half, laid out as `BUCKETS` is.
#[inline(always)]
fn host_index(cfg: &Config, generation: usize, hash: u64) -> u32 {
    let base = (generation as u32) * (cfg.bucket_mask + 1);
    base + row0_index(hash, cfg.bucket_mask)
}

/// This CPU's key memo, None when turned off.
#[inline(always)]
fn key_memo() -> Option<*mut KeyMemo> {
    if unsafe { core::ptr::read_volatile(&USE_KEY_MEMO) } == 0 {
        return None;
    }
    KEY_MEMO.get_ptr_mut(0)
}

/// Whether the tick refusal is on (read-only data: the verifier drops the untaken branch).
#[inline(always)]
fn tick_refusal() -> bool {
    let on = unsafe { core::ptr::read_volatile(&USE_TICK_REFUSAL) };
    on != 0
}

/// The key's hash under the current generation's salt, from this CPU's memo when the last
/// packet it judged had the same key (a flood from one source), else SipHash (then memoised).
#[inline(always)]
fn current_hash(cfg: &Config, generation: usize, family: u8, words: &[u64; 3], memo: Option<*mut KeyMemo>) -> u64 {
    let salt = &cfg.salts[generation];
    let Some(memo) = memo else {
        return key_hash(salt, family, words);
    };
    // SAFETY: a map value, valid for the program's run; only this CPU touches it.
    let memo = unsafe { &mut *memo };
    if let Some(hash) = memo.get(salt, family, words) {
        return hash;
    }
    let hash = key_hash(salt, family, words);
    memo.set(salt, family, words, hash);
    hash
}

/// Sends one refusal in `sample_mask + 1` to userspace: the key's prefix, nothing finer.
#[inline(always)]
fn sample_refusal(cfg: &Config, pkt: &Packet, policy: &Policy, words: &[u64; 3], verdict: Verdict) {
    let Some(state) = SAMPLER.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: a map value, valid for the program's run; only this CPU touches it. The kernel's
    // generator is asked only to seed a CPU's first draw.
    let state = unsafe { &mut *state };
    let seed = if *state == 0 { unsafe { bpf_get_prandom_u32() } } else { 0 };
    if !sample::draw(state, seed, cfg.sample_mask) {
        return;
    }
    let mut sample = RefusalSample {
        policy: policy.id,
        family: pkt.family,
        dry_run: u8::from(verdict == Verdict::WouldRefuse),
        ..RefusalSample::default()
    };
    let key = FlowKey::from_words(pkt.family, words);
    sample.addr = key.addr;
    sample.dport = key.dport;
    sample.prefix_len = if pkt.family == FAMILY_V4 { policy.v4_prefix } else { policy.v6_prefix };
    // A full ring drops the sample, never the packet's verdict.
    let _ = REFUSALS.output::<RefusalSample>(&sample, 0);
}

/// The number of rows and their length (a zero `rows` or `row_len` reads as one row of all).
#[inline(always)]
fn row_shape(cfg: &Config) -> (usize, u32) {
    let rows = if cfg.rows == 0 {
        1
    } else if cfg.rows as usize > MAX_ROWS {
        MAX_ROWS
    } else {
        cfg.rows as usize
    };
    let len = if cfg.row_len == 0 { cfg.bucket_mask.wrapping_add(1) } else { cfg.row_len };
    (rows, len)
}

/// The source's bucket in each row of `generation`, from its hash under that generation's salt.
#[inline(always)]
fn bucket_rows(cfg: &Config, generation: usize, hash: u64, rows: usize, len: u32) -> [u32; MAX_ROWS] {
    let base = (generation as u32) * (cfg.bucket_mask + 1);
    let mut idx = row_indexes(hash, rows, len);
    let mut i = 0;
    while i < MAX_ROWS {
        idx[i] += base;
        i += 1;
    }
    idx
}

/// The buckets' values; None on a failed lookup (an index beyond the map).
#[inline(always)]
fn read_rows(idx: &[u32; MAX_ROWS], rows: usize) -> Option<[u64; MAX_ROWS]> {
    let mut values = [0u64; MAX_ROWS];
    let mut i = 0;
    while i < MAX_ROWS && i < rows {
        values[i] = unsafe { *BUCKETS.get_ptr(idx[i])? };
        i += 1;
    }
    Some(values)
}

/// Writes the rows whose value changes (read above, so the lookups succeed).
#[inline(always)]
fn write_rows(idx: &[u32; MAX_ROWS], rows: usize, store: &[Option<u64>; MAX_ROWS]) {
    let mut i = 0;
    while i < MAX_ROWS && i < rows {
        if let Some(v) = store[i] {
            if let Some(bucket) = BUCKETS.get_ptr_mut(idx[i]) {
                unsafe { *bucket = v };
            }
        }
        i += 1;
    }
}

/// The packet's policy id (0: none): exact port or range, then protocol, then `any`, all folded
/// by userspace into two array reads. None on a failed lookup.
#[inline(always)]
fn policy_id(cfg: &Config, pkt: &Packet) -> Option<u16> {
    if pkt.has_l4 && cfg.flags & Config::HAS_PORT_POLICIES != 0 && (pkt.class == CLASS_TCP || pkt.class == CLASS_UDP) {
        let index = (pkt.class as u32) << 16 | u32::from(pkt.dport);
        let id = *PORT_POLICY.get(index)?;
        if id != 0 {
            return Some(id);
        }
    }
    Some(cfg.class_policy[pkt.class & 3])
}

/// A datagram that hides its port (or, past the extension headers walked, its protocol) might
/// be meant for a policy that cannot see it: a port policy (RFC 1858), or, when even the
/// protocol is unknown, a TCP or UDP policy other than `any`. And the policy that would judge
/// it must not key on the port: its key would be port 0's, a second allowance beside the one of
/// the port the stack delivers it to. Such datagrams are dropped, whatever the policy's mode
/// (like a port policy's); otherwise they are judged like any packet of their class, under the
/// very key of the datagram they start.
#[inline(always)]
fn hides_from_a_policy(cfg: &Config, pkt: &Packet) -> bool {
    let judged_by = cfg.class_policy[pkt.class & 3];
    let any = cfg.class_policy[CLASS_OTHER];
    cfg.flags & Config::HAS_PORT_POLICIES != 0
        || (pkt.class == CLASS_OTHER && (cfg.class_policy[CLASS_TCP] != any || cfg.class_policy[CLASS_UDP] != any))
        || match POLICIES.get(u32::from(judged_by)) {
            // For class OTHER, `judged_by` is `any`, which is then also the TCP and UDP policy.
            Some(p) => p.flags & (Policy::ACTIVE | Policy::KEY_DPORT) == Policy::ACTIVE | Policy::KEY_DPORT,
            // Id 0 (no policy) reads as an inactive entry; a failed lookup cannot happen for
            // an id below MAX_POLICIES, and is not a reason to drop.
            None => false,
        }
}

/// The allow/deny verdict for the packet's source, if a listed prefix covers it.
#[inline(always)]
fn acl(cfg: &Config, pkt: &Packet) -> Option<u8> {
    if pkt.family == FAMILY_V4 {
        if cfg.flags & Config::HAS_ACL_V4 == 0 {
            return None;
        }
        ACL_V4.get(Key::new(32, (pkt.src[0] as u32).to_le_bytes())).copied()
    } else {
        if cfg.flags & Config::HAS_ACL_V6 == 0 {
            return None;
        }
        let mut addr = [0u8; 16];
        addr[..8].copy_from_slice(&pkt.src[0].to_le_bytes());
        addr[8..].copy_from_slice(&pkt.src[1].to_le_bytes());
        ACL_V6.get(Key::new(128, addr)).copied()
    }
}

/// Policy `id`'s claim at `now_ns` (`limiter_common::gcra::claim`): its window while active, or
/// what is left of its hold. Asked only for a TAT beyond the reader's own window (is it owed to a
/// live source of its writer, or a ghost of the clock's wrap?). A failed lookup claims all.
#[inline(always)]
fn claim(id: u8, now_ns: u64) -> u64 {
    match POLICIES.get(u32::from(id)) {
        Some(p) => {
            let capacity = if p.flags & Policy::ACTIVE != 0 { p.gcra.capacity } else { 0 };
            gcra::claim(capacity, p.hold_until_ns, now_ns)
        }
        None => gcra::Gcra::LIMIT,
    }
}

/// IP traffic no policy covers passes untouched.
#[inline(always)]
fn unmatched() -> u32 {
    bump(0, |c| c.unmatched += 1);
    XDP_PASS
}

/// The limiter's own fault: never drop because of it.
#[inline(always)]
fn fault() -> u32 {
    bump(0, |c| c.errors += 1);
    XDP_PASS
}

#[inline(always)]
fn bump(index: u32, f: impl FnOnce(&mut Counters)) {
    if let Some(c) = COUNTERS.get_ptr_mut(index) {
        f(unsafe { &mut *c });
    }
}

limiter_ebpf::program_object!();

//! The limiter: per-source GCRA in XDP. Refusal is XDP_DROP; anything the limiter cannot judge,
//! and any fault of its own, passes and is counted.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    helpers::bpf_ktime_get_ns,
    macros::{map, xdp},
    maps::{Array, PerCpuArray},
    programs::XdpContext,
};
use limiter_common::{
    key::bucket_of,
    maps::{
        CLASS_TCP, CLASS_UDP, Config, Counters, DEFAULT_BUCKETS, GENERATIONS, MAX_POLICIES,
        PORT_POLICY_ENTRIES, Policy,
    },
};
use limiter_ebpf::{
    decide::{Verdict, count, decide},
    key::key_words,
    parse::{Skip, parse},
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
#[map]
static COUNTERS: PerCpuArray<Counters> = PerCpuArray::with_max_entries(MAX_POLICIES, 0);

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
fn judge(pkt: &limiter_ebpf::parse::Packet, frame_len: u64) -> u32 {
    let Some(cfg) = CONFIG.get(0) else {
        return fault();
    };
    let mut id = 0u16;
    if pkt.has_l4 && cfg.flags & Config::HAS_PORT_POLICIES != 0 && (pkt.class == CLASS_TCP || pkt.class == CLASS_UDP) {
        let index = (pkt.class as u32) << 16 | u32::from(pkt.dport);
        match PORT_POLICY.get(index) {
            Some(p) => id = *p,
            None => return fault(),
        }
    }
    if id == 0 {
        id = cfg.class_policy[pkt.class & 3];
    }
    if id == 0 {
        bump(0, |c| c.unmatched += 1);
        return XDP_PASS;
    }
    let Some(policy) = POLICIES.get(u32::from(id)) else {
        return fault();
    };
    if policy.flags & Policy::ACTIVE == 0 {
        bump(0, |c| c.unmatched += 1);
        return XDP_PASS;
    }
    let words = key_words(pkt, policy);
    let base = cfg.generation.wrapping_mul(cfg.bucket_mask + 1);
    let index = base + bucket_of(&cfg.salt, &words, cfg.bucket_mask);
    let Some(tat) = BUCKETS.get_ptr_mut(index) else {
        return fault();
    };
    let now = unsafe { bpf_ktime_get_ns() };
    let verdict = decide(policy, unsafe { &mut *tat }, now, frame_len);
    bump(u32::from(id), |c| count(c, verdict, frame_len));
    if verdict == Verdict::Refuse { XDP_DROP } else { XDP_PASS }
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

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

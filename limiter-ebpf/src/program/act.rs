//! The act step: count the verdict (and sample a refusal) and turn it into the XDP action; and
//! the counting of packets no policy judged.

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
};
use limiter_common::{
    FlowKey,
    key::FAMILY_V4,
    maps::{Config, Counters, Policy, RefusalSample},
    sample,
};
use limiter_ebpf::{
    decide::{Verdict, count},
    key::key_words,
    parse::{Packet, Skip},
};

use super::{COUNTERS, REFUSALS, SAMPLER};

/// Counts the verdict (and samples a refusal), and turns it into the XDP action.
#[inline(always)]
pub fn act(cfg: &Config, family: u8, policy: &Policy, words: &[u64; 3], verdict: Verdict, frame_len: u64) -> u32 {
    bump(u32::from(policy.id), |c| count(c, verdict, frame_len));
    if verdict != Verdict::Admit && cfg.flags & Config::SAMPLE_REFUSALS != 0 {
        sample_refusal(cfg, family, policy, words, verdict);
    }
    if verdict == Verdict::Refuse { XDP_DROP } else { XDP_PASS }
}

/// Samples a layer's refusal (`program::layers`), its key words taken again.
#[inline(always)]
pub fn sample(cfg: &Config, pkt: &Packet, policy: &Policy, verdict: Verdict) {
    if cfg.flags & Config::SAMPLE_REFUSALS != 0 {
        sample_refusal(cfg, pkt.family, policy, &key_words(pkt, policy), verdict);
    }
}

/// Sends one refusal in `sample_mask + 1` to userspace, within the CPU's budget
/// (`sample::hit`: a uniform one of the hits since the last sample sent, weighed by their count):
/// the key's prefix, nothing finer.
#[inline(always)]
fn sample_refusal(cfg: &Config, family: u8, policy: &Policy, words: &[u64; 3], verdict: Verdict) {
    let Some(sampler) = SAMPLER.get_ptr_mut(0) else {
        return;
    };
    // SAFETY: a map value, valid for the program's run; only this CPU touches it. The kernel's
    // generator is asked only to seed a CPU's first draw.
    let sampler = unsafe { &mut *sampler };
    let seed = if sampler.state == 0 { unsafe { bpf_get_prandom_u32() } } else { 0 };
    if !sample::draw(&mut sampler.state, seed, cfg.sample_mask) {
        return;
    }
    // Only a hit reads the clock and draws again: the refusal path keeps its cost.
    let random = sample::next(&mut sampler.state);
    let hit = sample::hit(&mut sampler.window, unsafe { bpf_ktime_get_ns() }, cfg.sample_budget, random);
    let sample = &mut sampler.candidate;
    if hit.replace {
        let key = FlowKey::from_words(family, words);
        sample.addr = key.addr;
        sample.dport = key.dport;
        sample.policy = policy.id;
        sample.family = family;
        sample.prefix_len = if family == FAMILY_V4 { policy.v4_prefix } else { policy.v6_prefix };
        sample.dry_run = u8::from(verdict == Verdict::WouldRefuse);
    }
    if hit.send > 0 {
        sample.weight = hit.send;
        // A full ring drops the sample, never the packet's verdict.
        let _ = REFUSALS.output::<RefusalSample>(sample, 0);
    }
}

/// A frame the parser could not judge (not IP, or malformed) passes, counted.
#[inline(always)]
pub fn skipped(skip: Skip) -> u32 {
    bump(0, |c| match skip {
        Skip::NotIp => c.not_ip += 1,
        Skip::Malformed => c.malformed += 1,
    });
    XDP_PASS
}

/// IP traffic no policy covers passes untouched.
#[inline(always)]
pub fn unmatched() -> u32 {
    bump(0, |c| c.unmatched += 1);
    XDP_PASS
}

/// The limiter's own fault: never drop because of it.
#[inline(always)]
pub fn fault() -> u32 {
    bump(0, |c| c.errors += 1);
    XDP_PASS
}

#[inline(always)]
pub fn bump(index: u32, f: impl FnOnce(&mut Counters)) {
    if let Some(c) = COUNTERS.get_ptr_mut(index) {
        f(unsafe { &mut *c });
    }
}

//! Test-only: runs the limiter's parser and key builder and records what they derived, so the
//! differential test can compare it with an independent userspace parser.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::xdp_action::XDP_PASS,
    macros::{map, xdp},
    maps::Array,
    programs::XdpContext,
};
use limiter_common::{maps::Policy, testing::ParseProbe};
use limiter_ebpf::{
    key::key_words,
    parse::{Packet, Skip, parse},
};

#[map]
static PROBE: Array<ParseProbe> = Array::with_max_entries(1, 0);
#[map]
static PROBE_POLICY: Array<Policy> = Array::with_max_entries(1, 0);

#[xdp]
pub fn limiter_probe(ctx: XdpContext) -> u32 {
    let mut rec = ParseProbe::default();
    let mut pkt = Packet::EMPTY;
    match parse(&ctx, &mut pkt) {
        Err(Skip::NotIp) => rec.verdict = ParseProbe::NOT_IP,
        Err(Skip::Malformed) => rec.verdict = ParseProbe::MALFORMED,
        Ok(()) => {
            rec.verdict = ParseProbe::IP;
            rec.family = pkt.family;
            rec.proto = pkt.proto;
            rec.has_l4 = u8::from(pkt.has_l4);
            rec.ports_hidden = u8::from(pkt.ports_hidden);
            rec.sport = pkt.sport;
            rec.dport = pkt.dport;
            rec.syn = u8::from(pkt.syn);
            let mut src = [0u8; 16];
            src[0..8].copy_from_slice(&pkt.src[0].to_le_bytes());
            src[8..16].copy_from_slice(&pkt.src[1].to_le_bytes());
            rec.src = src;
            if let Some(policy) = PROBE_POLICY.get(0) {
                rec.key = key_words(&pkt, policy);
            }
        }
    }
    if let Some(slot) = PROBE.get_ptr_mut(0) {
        unsafe { *slot = rec };
    }
    XDP_PASS
}

limiter_ebpf::program_object!();

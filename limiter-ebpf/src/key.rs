//! The key words for a packet under a policy (layout: `limiter_common::key`).

use limiter_common::{
    key::{FAMILY_V4, v4_word, v6_meta_word},
    maps::Policy,
};

use crate::parse::Packet;

/// IPv4 keys use `[0]` alone; IPv6 keys all three words.
#[inline(always)]
pub fn key_words(pkt: &Packet, policy: &Policy) -> [u64; 3] {
    let dport = if policy.flags & Policy::KEY_DPORT != 0 { pkt.dport } else { 0 };
    if pkt.family == FAMILY_V4 {
        [v4_word(pkt.src[0] & policy.v4_mask, policy.id, dport), 0, 0]
    } else {
        [pkt.src[0] & policy.v6_mask[0], pkt.src[1] & policy.v6_mask[1], v6_meta_word(policy.id, dport)]
    }
}

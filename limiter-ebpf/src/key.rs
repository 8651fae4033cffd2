//! The key words for a packet under a policy (see `limiter_common::key` for the layout).

use limiter_common::{
    key::{FAMILY_V4, meta_word},
    maps::Policy,
};

use crate::parse::Packet;

#[inline(always)]
pub fn key_words(pkt: &Packet, policy: &Policy) -> [u64; 3] {
    let (m0, m1) = if pkt.family == FAMILY_V4 {
        (policy.v4_mask, 0)
    } else {
        (policy.v6_mask[0], policy.v6_mask[1])
    };
    let dport = if policy.flags & Policy::KEY_DPORT != 0 { pkt.dport } else { 0 };
    [pkt.src[0] & m0, pkt.src[1] & m1, meta_word(policy.id, dport, pkt.family)]
}

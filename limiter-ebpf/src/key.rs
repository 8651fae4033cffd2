//! The key words for a packet under a policy (layout: `limiter_common::key`).

use limiter_common::{
    key::{FAMILY_V4, v4_word, v6_meta_word},
    maps::Policy,
    siphash::SipInit,
    tick::Streak,
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

/// The last key a CPU hashed and its keyed hash: a flood from one source (what a refusal costs
/// most often) skips SipHash on every packet after its first. Exact, never a guess: the memo
/// holds whole key words, the family and the salt's first state word (64 secret bits that
/// change with every salt), and it serves only an identical key under the identical salt.
///
/// It also holds how long the key's last refusal stands (`refused_until_ns`, 0: none; see
/// docs/DESIGN.md, Decide): set only when that refusal wrote nothing, so while every packet
/// this CPU judges is the same key refused from the memo, its buckets cannot change, and the
/// exact GCRA would refuse each of them until then. Any other key replaces the memo. A key
/// that floods beyond what any source keeping to its rate could send within one tick is
/// refused for the rest of that tick without reading the clock (`streak`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct KeyMemo {
    pub words: [u64; 3],
    /// `SipInit::v[0]` of the salt the hash was taken under.
    pub salt: u64,
    pub family: u64,
    pub hash: u64,
    pub refused_until_ns: u64,
    /// The policy's parameters and the bucket geometry (`Config::bucket_mask | row_len << 32`,
    /// and the rows) when `refused_until_ns` was set: a change to either voids it.
    pub emission: u64,
    pub capacity: u64,
    pub shape: u64,
    pub rows: u64,
    /// The key's refusals in the current tick, and whether the rest of the tick's packets of
    /// it may be refused without the clock (`limiter_common::tick`; reset with each standing
    /// refusal the full judgement sets).
    pub streak: Streak,
}

impl KeyMemo {
    /// The memoised hash when the memo is for this key and salt.
    #[inline(always)]
    pub fn get(&self, salt: &SipInit, family: u8, words: &[u64; 3]) -> Option<u64> {
        if self.salt == salt.v[0]
            && self.family == u64::from(family)
            && self.words[0] == words[0]
            && self.words[1] == words[1]
            && self.words[2] == words[2]
        {
            Some(self.hash)
        } else {
            None
        }
    }

    #[inline(always)]
    pub fn set(&mut self, salt: &SipInit, family: u8, words: &[u64; 3], hash: u64) {
        // Only what a miss must change (a spoofed flood misses every packet): the parameters
        // below are read only with a standing refusal, which is set with them.
        self.words = *words;
        self.salt = salt.v[0];
        self.family = u64::from(family);
        self.hash = hash;
        self.refused_until_ns = 0;
    }
}

//! A source's key: its address masked to the policy's prefix, the policy id, and optionally the
//! destination port, hashed under the salt into a bucket index.
//!
//! The hashed bytes ([`FlowKey::bytes`]) are, as little-endian words:
//! - IPv4, 8 bytes: `addr[0..4] | policy << 32 | dport << 48`;
//! - IPv6, 24 bytes: `addr[0..8]`, `addr[8..16]`, `policy | dport << 16 | 6 << 32`.
//!
//! IPv4 fits one word, which saves two SipHash rounds per packet. The lengths differ, so an IPv4
//! and an IPv6 key never hash alike except by collision.
//!
//! Policies side by side: the policy id is hashed but for its low [`SLOT_BITS`] bits, which ride
//! in the hash's low bits instead ([`key_hash`]), and a row's bucket is the hash's place in the
//! row plus that slot (`rows::row_index`). So policies whose ids differ only there (ids 8k to
//! 8k + 7: layers made together) keep one source's buckets side by side, most often in one cache
//! line: a packet through several per-source layers of one key shape misses the cache once, not
//! once a layer. No two policies share an allowance except by collision still: two keys meet in
//! a row only when their places differ by exactly their slots' difference, as likely as any
//! other pair of places.

use crate::{
    rows::{MAX_ROWS, row_index, row_indexes},
    siphash::{SipInit, SipKey, hash_bytes, hash_words},
};

pub const FAMILY_V4: u8 = 4;
pub const FAMILY_V6: u8 = 6;

/// A key as userspace describes it; [`FlowKey::bytes`] is what gets hashed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    /// Source address masked to the prefix, in network byte order; IPv4 in the first 4 bytes.
    pub addr: [u8; 16],
    pub policy: u16,
    /// Destination port (host order) when the policy keys on it, else 0.
    pub dport: u16,
    pub family: u8,
}

impl FlowKey {
    /// The hashed bytes and how many of them there are (8 for IPv4, 24 for IPv6).
    pub fn bytes(&self) -> ([u8; 24], usize) {
        let mut b = [0u8; 24];
        if self.family == FAMILY_V4 {
            b[0..4].copy_from_slice(&self.addr[0..4]);
            b[4..6].copy_from_slice(&self.policy.to_le_bytes());
            b[6..8].copy_from_slice(&self.dport.to_le_bytes());
            (b, 8)
        } else {
            b[0..16].copy_from_slice(&self.addr);
            b[16..18].copy_from_slice(&self.policy.to_le_bytes());
            b[18..20].copy_from_slice(&self.dport.to_le_bytes());
            b[20] = FAMILY_V6;
            (b, 24)
        }
    }

    /// The bytes as the three words the probe program records (IPv4: one word, then zeros).
    pub fn words(&self) -> [u64; 3] {
        let (b, _) = self.bytes();
        [le_word(&b[0..8]), le_word(&b[8..16]), le_word(&b[16..24])]
    }

    /// The key the kernel's words (as [`FlowKey::words`] lays them out) stand for: the one
    /// decoder of the layout, used by the kernel for refusal samples and by the tests.
    #[inline(always)]
    pub fn from_words(family: u8, words: &[u64; 3]) -> Self {
        let mut addr = [0u8; 16];
        let (policy, dport) = if family == FAMILY_V4 {
            addr[0..4].copy_from_slice(&(words[0] as u32).to_le_bytes());
            ((words[0] >> 32) as u16, (words[0] >> 48) as u16)
        } else {
            addr[0..8].copy_from_slice(&words[0].to_le_bytes());
            addr[8..16].copy_from_slice(&words[1].to_le_bytes());
            (words[2] as u16, (words[2] >> 16) as u16)
        };
        Self { addr, policy, dport, family }
    }

    /// The bucket this key lands in with one row, computed over [`FlowKey::bytes`] by the
    /// byte-wise SipHash, independently of the word-wise code the kernel runs.
    pub fn bucket(&self, salt: &SipKey, bucket_mask: u32) -> u32 {
        self.row_buckets(salt, 1, bucket_mask.wrapping_add(1))[0]
    }

    /// The key's bucket in each of `rows` rows of `len` buckets (entries past `rows` are 0).
    pub fn row_buckets(&self, salt: &SipKey, rows: usize, len: u32) -> [u32; MAX_ROWS] {
        let (b, n) = FlowKey { policy: self.policy & !SLOT_MASK, ..*self }.bytes();
        row_indexes(with_slot(hash_bytes(salt, &b[..n]), self.policy), rows, len)
    }
}

/// The IPv4 key word from the address word as loaded from the packet (already masked).
#[inline(always)]
pub fn v4_word(addr: u64, policy: u16, dport: u16) -> u64 {
    addr | (u64::from(policy) << 32) | (u64::from(dport) << 48)
}

/// The third IPv6 key word.
#[inline(always)]
pub fn v6_meta_word(policy: u16, dport: u16) -> u64 {
    u64::from(policy) | (u64::from(dport) << 16) | (u64::from(FAMILY_V6) << 32)
}

/// The policy id's low bits that are a key's slot, not hashed (the module's documentation).
pub const SLOT_BITS: u32 = 3;
const SLOT_MASK: u16 = (1 << SLOT_BITS) - 1;

/// The keyed hash of key words as the kernel builds them (IPv4: `words[0]` alone), its policy's
/// slot in its low bits; the rows' indexes all come from it (`rows::row_indexes`).
#[inline(always)]
pub fn key_hash(salt: &SipInit, family: u8, words: &[u64; 3]) -> u64 {
    let slot = u64::from(SLOT_MASK);
    if family == FAMILY_V4 {
        let policy = (words[0] >> 32) as u16;
        with_slot(hash_words(salt, &[words[0] & !(slot << 32)]), policy)
    } else {
        let policy = words[2] as u16;
        with_slot(hash_words(salt, &[words[0], words[1], words[2] & !slot]), policy)
    }
}

/// `hash` with `policy`'s slot in its low bits.
#[inline(always)]
pub fn with_slot(hash: u64, policy: u16) -> u64 {
    (hash & !u64::from(SLOT_MASK)) | u64::from(policy & SLOT_MASK)
}

/// The bucket for key words with one row of `bucket_mask + 1` buckets.
#[inline(always)]
pub fn bucket_of(salt: &SipInit, family: u8, words: &[u64; 3], bucket_mask: u32) -> u32 {
    row0_index(key_hash(salt, family, words), bucket_mask)
}

/// [`bucket_of`] from the key's hash.
#[inline(always)]
pub fn row0_index(hash: u64, bucket_mask: u32) -> u32 {
    row_index(hash, 0, bucket_mask.wrapping_add(1))
}

/// The mask for a prefix of `prefix_len` bits, as the two little-endian words the XDP program
/// ANDs with the address words it loads from the packet.
pub fn prefix_mask_words(prefix_len: u8) -> [u64; 2] {
    let mut bytes = [0u8; 16];
    let mut bits = usize::from(prefix_len.min(128));
    for b in bytes.iter_mut() {
        let take = bits.min(8);
        *b = if take == 0 { 0 } else { 0xffu8 << (8 - take) };
        bits -= take;
    }
    [le_word(&bytes[0..8]), le_word(&bytes[8..16])]
}

/// Eight bytes as a little-endian word (`b` is 8 bytes long).
fn le_word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(b);
    u64::from_le_bytes(w)
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng, rngs::StdRng};

    use super::*;

    #[test]
    fn masks_keep_exactly_the_prefix() {
        for len in 0..=128u8 {
            let m = prefix_mask_words(len);
            assert_eq!(m[0].count_ones() + m[1].count_ones(), u32::from(len));
            let mut bytes = [0u8; 16];
            bytes[0..8].copy_from_slice(&m[0].to_le_bytes());
            bytes[8..16].copy_from_slice(&m[1].to_le_bytes());
            // Leading ones in network bit order.
            assert_eq!(u128::from_be_bytes(bytes).leading_ones(), u32::from(len));
        }
    }

    #[test]
    fn kernel_words_hash_like_the_key_bytes() {
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..10_000 {
            let salt = SipKey { k0: rng.random(), k1: rng.random() };
            let family = if rng.random_bool(0.5) { FAMILY_V4 } else { FAMILY_V6 };
            let mut addr: [u8; 16] = rng.random();
            if family == FAMILY_V4 {
                addr[4..].fill(0);
            }
            let key = FlowKey { addr, policy: rng.random(), dport: rng.random(), family };
            // The words the kernel builds from what it loads from the packet.
            let (lo, hi) = (le_word(&addr[0..8]), le_word(&addr[8..16]));
            let words = if family == FAMILY_V4 {
                [v4_word(lo, key.policy, key.dport), 0, 0]
            } else {
                [lo, hi, v6_meta_word(key.policy, key.dport)]
            };
            assert_eq!(words, key.words());
            assert_eq!(FlowKey::from_words(family, &words), key, "decoding the words");
            let mask = (1 << rng.random_range(4..24)) - 1;
            assert_eq!(bucket_of(&SipInit::new(&salt), family, &words, mask), key.bucket(&salt, mask));
            let rows = rng.random_range(1..=MAX_ROWS);
            let len = crate::rows::row_len(mask + 1, rows as u32);
            let hash = key_hash(&SipInit::new(&salt), family, &words);
            assert_eq!(row_indexes(hash, rows, len), key.row_buckets(&salt, rows, len));
        }
    }

    #[test]
    fn families_and_policies_are_kept_apart() {
        let v4 = FlowKey {
            addr: [198, 18, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            policy: 1,
            dport: 0,
            family: FAMILY_V4,
        };
        let v6 = FlowKey { family: FAMILY_V6, ..v4 };
        assert_ne!(v4.bytes(), v6.bytes());
        assert_ne!(v4.bytes(), FlowKey { policy: 2, ..v4 }.bytes());
    }

    #[test]
    fn policies_of_one_slot_group_keep_a_key_s_buckets_side_by_side() {
        let salt = SipKey { k0: 7, k1: 11 };
        let key = |addr: [u8; 4], policy| {
            let mut a = [0u8; 16];
            a[..4].copy_from_slice(&addr);
            FlowKey { addr: a, policy, dport: 0, family: FAMILY_V4 }
        };
        let (rows, len) = (4, 1 << 14);
        let mut apart = 0;
        for i in 0..=255u8 {
            let at = |policy| key([198, 18, 1, i], policy).row_buckets(&salt, rows, len);
            let (p9, p10, p16) = (at(9), at(10), at(16));
            for r in 0..rows {
                // Next to each other in the row (or wrapped to its start).
                let next = if p9[r] + 1 == (r as u32 + 1) * len { r as u32 * len } else { p9[r] + 1 };
                assert_eq!(p10[r], next, "ids 9 and 10 share a slot group");
                // Another group hashes apart: side by side only by chance.
                apart += usize::from(p16[r].abs_diff(p9[r]) > 7);
            }
        }
        assert!(apart > 1000, "ids 9 and 16 fell side by side in {} of 1024 rows", 1024 - apart);
    }
}

//! A source's key: its address masked to the policy's prefix, the policy id, and optionally the
//! destination port, hashed under the salt into a bucket index.
//!
//! The key is three little-endian words, i.e. the bytes of [`FlowKey`]:
//! `addr[0..8]`, `addr[8..16]`, then `policy | dport << 16 | family << 32`. IPv4 addresses fill
//! `addr[0..4]`. The policy id and family are part of the hashed bytes, so no two policies and no
//! IPv4/IPv6 pair ever share an allowance except by a hash collision.

use crate::siphash::{SipKey, hash_words};

pub const FAMILY_V4: u8 = 4;
pub const FAMILY_V6: u8 = 6;

/// The hashed key, laid out exactly as the words the XDP program feeds to SipHash.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    /// Source address masked to the prefix, in network byte order; IPv4 in the first 4 bytes.
    pub addr: [u8; 16],
    pub policy: u16,
    /// Destination port (host order) when the policy keys on it, else 0.
    pub dport: u16,
    pub family: u8,
    pub _pad: [u8; 3],
}

impl FlowKey {
    pub fn words(&self) -> [u64; 3] {
        let mut w = [0u64; 3];
        let mut meta = [0u8; 8];
        meta[0..2].copy_from_slice(&self.policy.to_le_bytes());
        meta[2..4].copy_from_slice(&self.dport.to_le_bytes());
        meta[4] = self.family;
        w[0] = le_word(&self.addr[0..8]);
        w[1] = le_word(&self.addr[8..16]);
        w[2] = u64::from_le_bytes(meta);
        w
    }

    pub fn bucket(&self, salt: &SipKey, bucket_mask: u32) -> u32 {
        bucket_of(salt, &self.words(), bucket_mask)
    }
}

fn le_word(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    u64::from_le_bytes(a)
}

/// The third key word, built the way [`FlowKey::words`] lays it out.
#[inline(always)]
pub fn meta_word(policy: u16, dport: u16, family: u8) -> u64 {
    u64::from(policy) | (u64::from(dport) << 16) | (u64::from(family) << 32)
}

/// The bucket a key lands in. `bucket_mask` is the bucket count minus one (a power of two).
#[inline(always)]
pub fn bucket_of(salt: &SipKey, words: &[u64; 3], bucket_mask: u32) -> u32 {
    (hash_words(salt, words) as u32) & bucket_mask
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_keep_exactly_the_prefix() {
        let addr = [0xffu8; 16];
        for len in 0..=128u8 {
            let m = prefix_mask_words(len);
            let kept = m[0].count_ones() + m[1].count_ones();
            assert_eq!(kept, u32::from(len));
            let w = [le_word(&addr[0..8]) & m[0], le_word(&addr[8..16]) & m[1]];
            let bytes: [u8; 16] = {
                let mut b = [0u8; 16];
                b[0..8].copy_from_slice(&w[0].to_le_bytes());
                b[8..16].copy_from_slice(&w[1].to_le_bytes());
                b
            };
            // Leading ones in network bit order.
            let lead = u128::from_be_bytes(bytes).leading_ones();
            assert_eq!(lead, u32::from(len));
        }
    }

    #[test]
    fn meta_word_matches_the_struct_layout() {
        let k = FlowKey { addr: [1; 16], policy: 0xabcd, dport: 53, family: FAMILY_V6, _pad: [0; 3] };
        assert_eq!(k.words()[2], meta_word(0xabcd, 53, FAMILY_V6));
        assert_eq!(core::mem::size_of::<FlowKey>(), 24);
    }
}

//! Keyed SipHash-1-3 (one compression round per word, three finalization rounds).
//!
//! The XDP program hashes a fixed number of 64-bit words ([`hash_words`]), which unrolls into
//! straight-line code the verifier accepts; [`hash_bytes`] is the general form for userspace and
//! shares the same rounds, so both are checked against the `siphasher` crate.

/// A 128-bit SipHash key: the limiter's secret salt.
#[repr(C)]
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct SipKey {
    pub k0: u64,
    pub k1: u64,
}

// Never print a salt, even by accident through `{:?}`.
impl core::fmt::Debug for SipKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("SipKey(<secret>)")
    }
}

/// The key folded into SipHash's initial state. The kernel keeps this form of the salt, which
/// saves four constants and XORs per packet; it is as secret as the salt itself.
#[repr(C)]
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct SipInit {
    pub v: [u64; 4],
}

impl SipInit {
    pub const fn new(key: &SipKey) -> Self {
        Self {
            v: [
                key.k0 ^ 0x736f_6d65_7073_6575,
                key.k1 ^ 0x646f_7261_6e64_6f6d,
                key.k0 ^ 0x6c79_6765_6e65_7261,
                key.k1 ^ 0x7465_6462_7974_6573,
            ],
        }
    }
}

impl core::fmt::Debug for SipInit {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("SipInit(<secret>)")
    }
}

struct State([u64; 4]);

impl State {
    #[inline(always)]
    fn round(&mut self) {
        let v = &mut self.0;
        v[0] = v[0].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(13);
        v[1] ^= v[0];
        v[0] = v[0].rotate_left(32);
        v[2] = v[2].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(16);
        v[3] ^= v[2];
        v[0] = v[0].wrapping_add(v[3]);
        v[3] = v[3].rotate_left(21);
        v[3] ^= v[0];
        v[2] = v[2].wrapping_add(v[1]);
        v[1] = v[1].rotate_left(17);
        v[1] ^= v[2];
        v[2] = v[2].rotate_left(32);
    }

    #[inline(always)]
    fn compress(&mut self, m: u64) {
        self.0[3] ^= m;
        self.round();
        self.0[0] ^= m;
    }

    #[inline(always)]
    fn finish(mut self, len: usize, tail: u64) -> u64 {
        self.compress(((len as u64 & 0xff) << 56) | tail);
        self.0[2] ^= 0xff;
        self.round();
        self.round();
        self.round();
        self.0[0] ^ self.0[1] ^ self.0[2] ^ self.0[3]
    }
}

/// SipHash-1-3 of `N * 8` bytes given as little-endian words.
#[inline(always)]
pub fn hash_words<const N: usize>(init: &SipInit, words: &[u64; N]) -> u64 {
    let mut s = State(init.v);
    let mut i = 0;
    while i < N {
        s.compress(words[i]);
        i += 1;
    }
    s.finish(N * 8, 0)
}

/// SipHash-1-3 of arbitrary bytes (userspace; the kernel uses [`hash_words`]).
pub fn hash_bytes(key: &SipKey, bytes: &[u8]) -> u64 {
    let mut s = State(SipInit::new(key).v);
    let mut chunks = bytes.chunks_exact(8);
    for chunk in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(chunk);
        s.compress(u64::from_le_bytes(w));
    }
    let mut tail = 0u64;
    for (i, b) in chunks.remainder().iter().enumerate() {
        tail |= u64::from(*b) << (8 * i);
    }
    s.finish(bytes.len(), tail)
}

#[cfg(test)]
mod tests {
    extern crate std;
    use core::hash::Hasher as _;
    use std::vec::Vec;

    use rand::{Rng, SeedableRng, rngs::StdRng};
    use siphasher::sip::SipHasher13;

    use super::*;

    fn reference(key: &SipKey, bytes: &[u8]) -> u64 {
        let mut h = SipHasher13::new_with_keys(key.k0, key.k1);
        h.write(bytes);
        h.finish()
    }

    #[test]
    fn bytes_match_siphasher_on_random_keys_and_inputs() {
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..20_000 {
            let key = SipKey { k0: rng.random(), k1: rng.random() };
            let len = rng.random_range(0..80);
            let bytes: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            assert_eq!(hash_bytes(&key, &bytes), reference(&key, &bytes), "len {len}");
        }
    }

    #[test]
    fn words_match_siphasher_on_random_keys_and_inputs() {
        let mut rng = StdRng::seed_from_u64(2);
        for _ in 0..20_000 {
            let key = SipKey { k0: rng.random(), k1: rng.random() };
            let w2: [u64; 2] = rng.random();
            let w3: [u64; 3] = rng.random();
            let bytes2: Vec<u8> = w2.iter().flat_map(|w| w.to_le_bytes()).collect();
            let bytes3: Vec<u8> = w3.iter().flat_map(|w| w.to_le_bytes()).collect();
            let w1: [u64; 1] = [w2[0]];
            let init = SipInit::new(&key);
            assert_eq!(hash_words(&init, &w1), reference(&key, &bytes2[..8]));
            assert_eq!(hash_words(&init, &w2), reference(&key, &bytes2));
            assert_eq!(hash_words(&init, &w3), reference(&key, &bytes3));
        }
    }

    #[test]
    fn debug_never_shows_the_key() {
        let key = SipKey { k0: 0x1234_5678_9abc_def0, k1: 42 };
        let shown = std::format!("{key:?} {:?}", SipInit::new(&key));
        assert!(!shown.contains("1234") && !shown.contains("42"), "{shown}");
    }
}

//! What the BPF_PROG_TEST_RUN microbenchmarks (`benches/xdp.rs`, `benches/bans.rs`) share: their
//! frame, their random sources and their median.

use std::net::{IpAddr, Ipv4Addr};

use rand::{SeedableRng, rngs::StdRng, seq::SliceRandom};

use crate::{flood::FrameSpec, netns};

/// The microbenchmarks' UDP frames: to the receiver's port 53, 64 bytes of payload.
pub fn udp_spec() -> FrameSpec {
    FrameSpec {
        src_mac: netns::SENDER_MAC,
        dst_mac: netns::RECEIVER_MAC,
        dst: IpAddr::V4(netns::RECEIVER_V4),
        sport: 40_000,
        dport: 53,
        payload: 64,
    }
}

/// `count` distinct sources of 198.18.0.0/15 (at most 2^17) in a random order drawn from `seed`:
/// one after another, each a different bucket, as a spoofed flood reaches them.
pub fn shuffled_sources(seed: u64, count: usize) -> Vec<Ipv4Addr> {
    let base = u32::from(Ipv4Addr::new(198, 18, 0, 0));
    let mut offsets: Vec<u32> = (0..count.min(1 << 17) as u32).collect();
    offsets.shuffle(&mut StdRng::seed_from_u64(seed));
    offsets.into_iter().map(|o| Ipv4Addr::from(base + o)).collect()
}

/// The median of `v` (the upper one of an even count); NaN for none.
pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

//! The BPF objects built by build.rs from limiter-ebpf, embedded in the binary.

/// The limiter's XDP program (`limiter`) and its maps.
pub static LIMITER: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter"));
/// Test-only: the parser and key builder, recording what they derived (`limiter_probe`).
pub static PROBE: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter-probe"));
/// Benchmark baselines: `bench_pass` and `bench_floor`.
pub static BENCH: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter-bench"));
/// The flood generator (`limiter_gen`), for BPF_PROG_TEST_RUN live frames.
pub static GEN: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter-gen"));

//! The BPF objects built by build.rs from limiter-ebpf, embedded in the binary.

/// The limiter's XDP program (`limiter`) and its maps.
pub static LIMITER: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter"));
/// Test-only: the parser and key builder, recording what they derived (`limiter_probe`).
#[cfg(feature = "testing")]
pub static PROBE: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter-probe"));
/// Test-only: the limiter with its memo's shortcuts set at load (`USE_KEY_MEMO`,
/// `USE_TICK_REFUSAL`), for the benchmark's A/B rows and exact-timing tests.
#[cfg(feature = "testing")]
pub static SWITCHABLE: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter-switchable"));
/// Test-only: the benchmark baselines `bench_pass`, `bench_drop` and `bench_floor`.
#[cfg(feature = "testing")]
pub static BENCH: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter-bench"));
/// Test-only: the flood generator (`limiter_gen`), for BPF_PROG_TEST_RUN live frames.
#[cfg(feature = "testing")]
pub static GEN: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter-gen"));
/// Test-only: another tcx program (`neighbour`) the sharing tests load beside the limiter at tc
/// ingress: counts what it sees, drops UDP to the port its loader sets (`DROP_PORT`).
#[cfg(feature = "testing")]
pub static NEIGHBOUR: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/limiter-neighbour"));

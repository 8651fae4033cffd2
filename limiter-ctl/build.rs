//! Builds the XDP programs (limiter-ebpf's binaries) with the nightly toolchain and bpf-linker,
//! into OUT_DIR, where `src/objects.rs` embeds them. `cargo xtask setup` installs the tools.
use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    let root_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../limiter-ebpf");
    println!("cargo:rerun-if-changed={}", concat!(env!("CARGO_MANIFEST_DIR"), "/../limiter-common/src"));
    // aya-build relays the inner cargo's stderr as warnings: keep it to what matters.
    // SAFETY: build scripts are single-threaded here.
    unsafe { std::env::set_var("CARGO_TERM_QUIET", "true") };
    let package = aya_build::Package { name: "limiter-ebpf", root_dir, ..Default::default() };
    aya_build::build_ebpf([package], aya_build::Toolchain::default()).context(
        "building the XDP programs failed; run `cargo xtask setup` to install bpf-linker and the nightly rust-src",
    )
}

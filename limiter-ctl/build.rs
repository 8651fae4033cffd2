//! Builds the XDP programs (limiter-ebpf's binaries) with the nightly toolchain and bpf-linker,
//! into OUT_DIR, where `src/kernel/objects.rs` embeds them. `cargo xtask setup` installs the
//! tools. Only the limiter itself unless this build has the `testing` feature (limiter-tests):
//! then the test programs too (limiter-ebpf's bins that require its own `testing` feature).
use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    commit();
    let root_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../limiter-ebpf");
    println!("cargo:rerun-if-changed={}", concat!(env!("CARGO_MANIFEST_DIR"), "/../limiter-common/src"));
    // aya-build relays the inner cargo's stderr as warnings: keep it to what matters.
    // SAFETY: build scripts are single-threaded here.
    unsafe { std::env::set_var("CARGO_TERM_QUIET", "true") };
    let features: &[&str] = if std::env::var_os("CARGO_FEATURE_TESTING").is_some() { &["testing"] } else { &[] };
    let package = aya_build::Package { name: "limiter-ebpf", root_dir, features, ..Default::default() };
    aya_build::build_ebpf([package], aya_build::Toolchain::default()).context(
        "building the XDP programs failed; run `cargo xtask setup` to install bpf-linker and the nightly rust-src",
    )
}

/// `LIMITER_COMMIT` for `limiter_build_info`: the short hash of HEAD, "unknown" outside a git
/// checkout (a source tarball) or without git. Re-run when HEAD or the branch it names moves.
fn commit() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=LIMITER_COMMIT={commit}");
    for file in ["HEAD".to_string()].into_iter().chain(git(&["symbolic-ref", "-q", "HEAD"])) {
        // Only files that exist: cargo re-runs a script whose watched file is missing every time
        // (a packed ref is not a file).
        let path = git(&["rev-parse", "--path-format=absolute", "--git-path", &file]);
        if let Some(path) = path.filter(|p| std::path::Path::new(p).is_file()) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}

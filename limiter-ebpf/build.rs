use which::which;

/// The BPF link step needs bpf-linker (`cargo xtask setup` installs it). Rebuild when it changes.
fn main() {
    match which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(_) => println!("cargo:warning=bpf-linker not found; run `cargo xtask setup`"),
    }
}

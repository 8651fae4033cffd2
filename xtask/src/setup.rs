//! Installs what the build and the tests need, checking first so a second run takes seconds.
//! Each [`Need`] is one thing a test (or a task) needs: `cargo xtask setup` provides them all,
//! `cargo xtask test` only those of the tests it selected (xtask/src/test/catalogue.rs says
//! which test needs what).

use std::{collections::BTreeSet, path::Path, process::Command};

use anyhow::{Context as _, bail};

use crate::sh::{exec, output, probe};

const BPF_LINKER_VERSION: &str = "0.13.0";
const LLVM_MAJOR: &str = "22";
const CARGO_DEB_VERSION: &str = "3.8.0";
/// tests/packaging/manifests.rs: the Kubernetes manifests against the schemas this release
/// bundles (offline, strict).
const KUBERNETES_VALIDATE_VERSION: &str = "1.37.0";

/// One thing to install or mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Need {
    /// Building anything of limiter-ctl (its build.rs compiles the XDP program): nightly
    /// rust-src for -Z build-std, LLVM 22 and bpf-linker 0.13 built against it.
    Toolchain,
    /// Loading the program and running it in network namespaces: root, iproute2 and a mounted
    /// bpffs.
    Kernel,
    /// `cargo xtask package` and what tests/packaging/packaging.rs calls on its package:
    /// cargo-deb, which strips with binutils, and dpkg-dev.
    Package,
    /// `systemd-analyze` (`verify` and `security` of the units; limiter-sandbox expands the
    /// unit's system call groups with `syscall-filter`).
    Systemd,
    /// `man`, to render the man pages.
    Man,
    /// bash, fish and zsh, to run the completion scripts in the shells they are for.
    Shells,
    /// Debian's `prometheus` and `promtool`: the rules, the exposition, a real scrape.
    Prometheus,
    /// `ethtool`, to turn a veth's GRO and TSO on and off.
    Ethtool,
    /// `bpftool prog show`: the program's btf_id.
    Bpftool,
    /// python3: system calls made under the unit's restrictions, an unprivileged local user.
    Python,
    /// kubernetes-validate (pip), with the Kubernetes schemas it bundles.
    KubernetesValidate,
    /// Debian's xdp-tools (`xdp-filter`, `xdp-loader`): another XDP program holding the
    /// interface, for the tests of sharing it (tests/daemon/sharing/).
    XdpTools,
    /// Debian's fail2ban (`fail2ban-server`, `fail2ban-client`), run by the test without
    /// systemd, with a config directory of its own (tests/daemon/fail2ban.rs).
    Fail2ban,
    /// Debian's libfaketime: a daemon whose wall clock alone is stepped (tests/daemon/ban_clock.rs).
    Faketime,
    /// Debian's crowdsec binaries (`crowdsec`, `cscli`), extracted from the package into
    /// [`CROWDSEC_ROOT`] (not installed: see [`crowdsec`]), for tests/daemon/crowdsec.rs.
    CrowdSec,
    /// The kernel matrix's VM lab (tests/kernels/matrix.rs): QEMU and debootstrap, and the lab's
    /// cache (Debian's kernels, a root filesystem with them installed, an image) under
    /// /var/cache/limiter-vm, built or brought up to date by [`crate::vm`].
    VmLab,
}

/// Where `cargo xtask setup` extracts Debian's crowdsec package (`usr/bin/crowdsec`,
/// `usr/bin/cscli` under `root/`), and keeps the .deb so a second extraction needs no network.
/// tests/src/crowdsec.rs reads the same path.
pub const CROWDSEC_ROOT: &str = "/var/cache/limiter-tests/crowdsec";

impl Need {
    pub const ALL: [Need; 16] = [
        Need::Toolchain,
        Need::Kernel,
        Need::Package,
        Need::Systemd,
        Need::Man,
        Need::Shells,
        Need::Prometheus,
        Need::Ethtool,
        Need::Bpftool,
        Need::Python,
        Need::KubernetesValidate,
        Need::XdpTools,
        Need::Fail2ban,
        Need::Faketime,
        Need::CrowdSec,
        Need::VmLab,
    ];

    /// Its Debian packages.
    fn apt(self) -> &'static [&'static str] {
        match self {
            Need::Toolchain => &["llvm-22-dev", "libpolly-22-dev"],
            Need::Kernel => &["iproute2"],
            Need::Package => &["dpkg-dev", "binutils"],
            Need::Systemd => &["systemd"],
            Need::Man => &["man-db"],
            Need::Shells => &["bash", "fish", "zsh"],
            Need::Prometheus => &["prometheus"],
            Need::Ethtool => &["ethtool"],
            Need::Bpftool => &["bpftool"],
            Need::Python | Need::KubernetesValidate => &["python3"],
            Need::XdpTools => &["xdp-tools"],
            Need::Fail2ban => &["fail2ban"],
            Need::Faketime => &["libfaketime"],
            // dpkg-deb, to extract the package (dpkg is on every Debian system).
            Need::CrowdSec => &["dpkg"],
            // mkfs.ext4 -d makes the images; the archive's keys check the lab's apt sources.
            Need::VmLab => &["qemu-system-x86", "debootstrap", "e2fsprogs", "debian-archive-keyring"],
        }
    }
}

/// Everything: `cargo xtask setup`.
pub fn run() -> anyhow::Result<()> {
    provide(&Need::ALL.into_iter().collect())?;
    eprintln!("setup: ready");
    Ok(())
}

/// Installs what `needs` hold that is missing: the Debian packages in one go, then what builds
/// on them (bpf-linker on LLVM, kubernetes-validate on python3).
pub fn provide(needs: &BTreeSet<Need>) -> anyhow::Result<()> {
    let has = |n: Need| needs.contains(&n);
    if has(Need::Toolchain) {
        rust_src()?;
    }
    let mut packages: Vec<&str> = needs.iter().flat_map(|n| n.apt().iter().copied()).collect();
    packages.sort_unstable();
    packages.dedup();
    if !packages.is_empty() {
        apt(&packages)?;
    }
    if has(Need::Toolchain) {
        bpf_linker()?;
    }
    if has(Need::Package) {
        cargo_deb()?;
    }
    if has(Need::KubernetesValidate) {
        kubernetes_validate()?;
    }
    if has(Need::Kernel) {
        bpffs()?;
    }
    if has(Need::CrowdSec) {
        crowdsec()?;
    }
    if has(Need::VmLab) {
        crate::vm::provide()?;
    }
    Ok(())
}

/// What the demo and the benchmarks need: the eBPF toolchain, iproute2 and a mounted bpffs.
pub fn build() -> anyhow::Result<()> {
    provide(&[Need::Toolchain, Need::Kernel].into_iter().collect())
}

fn rust_src() -> anyhow::Result<()> {
    let sysroot = output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]));
    let Some(sysroot) = sysroot else {
        exec(Command::new("rustup").args(["toolchain", "install", "nightly", "--profile", "minimal"]))?;
        return exec(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]));
    };
    let core = Path::new(sysroot.trim()).join("lib/rustlib/src/rust/library/core");
    if core.is_dir() {
        eprintln!("setup: nightly rust-src present");
        return Ok(());
    }
    exec(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))
}

/// Installs the Debian packages that are missing (checking first: quick when all are there).
pub fn apt(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| {
            output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
                .is_none_or(|s| !s.contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        eprintln!("setup: {} present", packages.join(", "));
        return Ok(());
    }
    if !is_root() {
        bail!("missing Debian packages {}: run `sudo cargo xtask setup`", missing.join(" "));
    }
    let install = |missing: &[&str]| {
        exec(
            Command::new("apt-get")
                .args(["install", "-y", "--no-install-recommends"])
                .args(missing)
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )
    };
    if install(&missing).is_err() {
        // A fresh machine has no package lists yet.
        exec(Command::new("apt-get").arg("update").env("DEBIAN_FRONTEND", "noninteractive"))?;
        install(&missing)?;
    }
    Ok(())
}

fn bpf_linker() -> anyhow::Result<()> {
    let version = output(Command::new("bpf-linker").arg("--version")).unwrap_or_default();
    if version.contains(BPF_LINKER_VERSION) {
        eprintln!("setup: bpf-linker {BPF_LINKER_VERSION} present");
        return Ok(());
    }
    let prefix = format!("/usr/lib/llvm-{LLVM_MAJOR}");
    let path = format!("{prefix}/bin:{}", std::env::var("PATH").unwrap_or_default());
    exec(
        Command::new("cargo")
            .args(["install", "--locked", &format!("bpf-linker@{BPF_LINKER_VERSION}")])
            .args(["--no-default-features", "--features", &format!("llvm-{LLVM_MAJOR}")])
            .env("LLVM_PREFIX", &prefix)
            .env("PATH", path),
    )
    .context("building bpf-linker against LLVM 22 failed")
}

/// cargo-deb, for `cargo xtask package`; any installed version will do (a build takes minutes).
pub fn cargo_deb() -> anyhow::Result<()> {
    if let Some(version) = output(Command::new("cargo").args(["deb", "--version"])) {
        eprintln!("setup: {} present", version.trim());
        return Ok(());
    }
    exec(Command::new("cargo").args(["install", "--locked", &format!("cargo-deb@{CARGO_DEB_VERSION}")]))
        .context("installing cargo-deb failed")
}

/// kubernetes-validate from PyPI, for tests/packaging/manifests.rs: pip into the Python that `python3`
/// is (Debian's marks itself externally managed, hence the retry that says so).
fn kubernetes_validate() -> anyhow::Result<()> {
    let version = output(Command::new("python3").args(["-m", "kubernetes_validate", "--version"])).unwrap_or_default();
    if version.contains(KUBERNETES_VALIDATE_VERSION) {
        eprintln!("setup: kubernetes-validate {KUBERNETES_VALIDATE_VERSION} present");
        return Ok(());
    }
    if !probe(Command::new("python3").args(["-m", "pip", "--version"])) {
        apt(&["python3-pip"])?;
    }
    let spec = format!("kubernetes-validate=={KUBERNETES_VALIDATE_VERSION}");
    let pip = || {
        let mut cmd = Command::new("python3");
        cmd.args(["-m", "pip", "install", "--quiet", &spec]);
        cmd
    };
    exec(&mut pip())
        .or_else(|_| exec(pip().arg("--break-system-packages")))
        .context("installing kubernetes-validate (pip) failed")
}

/// Debian's crowdsec, extracted under [`CROWDSEC_ROOT`]. Not `apt-get install`: its postinst
/// registers with CrowdSec's central API, and offline that fails and leaves dpkg half-configured,
/// which breaks every later apt install. The tests run only its local API, with a config of
/// their own (tests/src/crowdsec.rs), so the binaries are all they need.
fn crowdsec() -> anyhow::Result<()> {
    let dir = Path::new(CROWDSEC_ROOT);
    let root = dir.join("root");
    if ["crowdsec", "cscli"].iter().all(|b| root.join("usr/bin").join(b).is_file()) {
        eprintln!("setup: crowdsec present in {}", root.display());
        return Ok(());
    }
    if !is_root() {
        bail!("crowdsec is not extracted in {}: run `sudo cargo xtask setup`", root.display());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // The .deb is kept: extracting again (an interrupted run) needs no network.
    let deb = match debs_in(dir)?.pop() {
        Some(deb) => deb,
        None => {
            // As root into a root-owned directory: apt's _apt sandbox could not write there (it
            // warns, then downloads unsandboxed anyway).
            let download = || {
                exec(
                    Command::new("apt-get")
                        .args(["-o", "APT::Sandbox::User=root", "download", "crowdsec"])
                        .current_dir(dir),
                )
            };
            if download().is_err() {
                // A fresh machine has no package lists yet.
                exec(Command::new("apt-get").arg("update").env("DEBIAN_FRONTEND", "noninteractive"))?;
                download()?;
            }
            debs_in(dir)?
                .pop()
                .with_context(|| format!("`apt-get download crowdsec` left no .deb in {}", dir.display()))?
        }
    };
    // Extracted beside, then renamed: an interrupted extraction is never taken for a complete one.
    let partial = dir.join("root.partial");
    let _ = std::fs::remove_dir_all(&partial);
    let _ = std::fs::remove_dir_all(&root);
    exec(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&partial))?;
    std::fs::rename(&partial, &root)
        .with_context(|| format!("renaming {} to {}", partial.display(), root.display()))?;
    eprintln!("setup: extracted {} into {}", deb.display(), root.display());
    Ok(())
}

/// The crowdsec .deb files in `dir`, sorted by name (the last the newest version, as a rule).
fn debs_in(dir: &Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
    let mut debs = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry.with_context(|| format!("reading {}", dir.display()))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if name.starts_with("crowdsec_") && name.ends_with(".deb") {
            debs.push(path);
        }
    }
    debs.sort();
    Ok(debs)
}

fn bpffs() -> anyhow::Result<()> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    if mounts.lines().any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf") && l.contains(" bpf ")) {
        eprintln!("setup: bpffs mounted at /sys/fs/bpf");
        return Ok(());
    }
    if !is_root() {
        eprintln!("setup: bpffs is not mounted at /sys/fs/bpf; as root: mount -t bpf bpf /sys/fs/bpf");
        return Ok(());
    }
    std::fs::create_dir_all("/sys/fs/bpf").ok();
    if !probe(Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"])) {
        bail!("mounting bpffs at /sys/fs/bpf failed: is this kernel built with CONFIG_BPF_SYSCALL?");
    }
    eprintln!("setup: mounted bpffs at /sys/fs/bpf");
    Ok(())
}

pub fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

//! The VM lab of the kernel matrix (tests/kernels/matrix.rs boots it through `limiter_tests::vm`):
//! Debian's own kernels, each the current one of a suite, booted under QEMU on a Debian root
//! filesystem. Everything lives in one cache directory ([`cache_dir`]), built once and checked in
//! seconds afterwards:
//!
//! - `apt/`: an apt configuration of the lab's own, holding the suites whose kernels the lab
//!   boots (the host's sources are neither used nor changed) ([`apt`]);
//! - `debs/`: the kernels' packages as downloaded; `debootstrap/`: the root filesystem's;
//! - `rootfs/`: the root filesystem, the kernels installed into it with their initrds, and the
//!   lab's init; `rootfs.img`: the same as an ext4 image, which each boot uses as a snapshot
//!   ([`rootfs`]);
//! - `kernels/RELEASE/{vmlinuz,initrd.img}`: what QEMU boots;
//! - `lab.json`: the manifest the tests read (the image, and per suite its kernel);
//! - `stamps/`: what each step was made from. A step whose inputs changed (this recipe: the
//!   packages, the init, the initramfs settings; or the kernels picked) is done again, with the
//!   steps that build on it; the others are kept.
//!
//! The kernels are picked once, each suite's current `linux-image-amd64` (the archive drops old
//! versions, so none is pinned), and kept; `LIMITER_VM_REFRESH=1` picks them again.

mod apt;
mod rootfs;

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail};
use serde_json::{Value, json};

use crate::setup::is_root;

/// Environment variable: the lab's cache directory, instead of [`DEFAULT_CACHE`] (to build a
/// second one from nothing beside the first). `limiter_tests::vm` reads the same.
pub const CACHE_ENV: &str = "LIMITER_VM_CACHE";
pub const DEFAULT_CACHE: &str = "/var/cache/limiter-vm";
/// Environment variable: set (to anything but empty or 0), pick each suite's kernel again.
const REFRESH_ENV: &str = "LIMITER_VM_REFRESH";

/// The suites whose current kernel the lab holds: the matrix's (Debian 12's 6.1, its backports'
/// 6.12, and the newest Debian ships, in trixie-backports) and bullseye's 5.10, below the minimum.
pub const SUITES: [&str; 4] = ["bookworm", "bookworm-backports", "trixie-backports", "bullseye"];

pub const MIRROR: &str = "http://deb.debian.org/debian";

pub fn cache_dir() -> PathBuf {
    std::env::var_os(CACHE_ENV).filter(|v| !v.is_empty()).map_or_else(|| PathBuf::from(DEFAULT_CACHE), PathBuf::from)
}

/// The lab's directory and the places in it.
pub struct Lab {
    pub dir: PathBuf,
}

impl Lab {
    fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    pub fn debs(&self) -> PathBuf {
        self.path("debs")
    }

    pub fn rootfs(&self) -> PathBuf {
        self.path("rootfs")
    }

    pub fn image(&self) -> PathBuf {
        self.path("rootfs.img")
    }

    /// Where QEMU finds a kernel and its initrd.
    pub fn boot_files(&self, release: &str) -> (PathBuf, PathBuf) {
        let dir = self.path("kernels").join(release);
        (dir.join("vmlinuz"), dir.join("initrd.img"))
    }

    fn manifest(&self) -> PathBuf {
        self.path("lab.json")
    }

    fn stamp_path(&self, step: &str) -> PathBuf {
        self.path("stamps").join(step)
    }

    /// Whether `step` was last done from `inputs` (and finished).
    pub fn stamped(&self, step: &str, inputs: &str) -> bool {
        fs::read_to_string(self.stamp_path(step)).is_ok_and(|s| s == inputs)
    }

    /// Records that `step` was done from `inputs`.
    pub fn stamp(&self, step: &str, inputs: &str) -> anyhow::Result<()> {
        write_atomic(&self.stamp_path(step), inputs.as_bytes())
    }

    /// Forgets `step` (it is being redone: interrupted, it must not look done).
    pub fn unstamp(&self, step: &str) -> anyhow::Result<()> {
        match fs::remove_file(self.stamp_path(step)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("removing {}", self.stamp_path(step).display()))
            }
            _ => Ok(()),
        }
    }
}

/// One package file of a kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct Deb {
    pub package: String,
    pub version: String,
    /// Its file name in the archive's pool (and in `debs/`).
    pub file: String,
    pub size: u64,
}

/// A suite's kernel: its release (`uname -r`) and the packages that make it.
#[derive(Clone, Debug, PartialEq)]
pub struct Pick {
    pub suite: String,
    pub release: String,
    /// The version of its image package.
    pub version: String,
    pub debs: Vec<Deb>,
}

impl Pick {
    /// What installing it depends on, for its step's stamp.
    fn inputs(&self) -> String {
        let debs: Vec<&str> = self.debs.iter().map(|d| d.file.as_str()).collect();
        format!("{} {} {}\n", self.suite, self.release, debs.join(" "))
    }

    fn to_json(&self, lab: &Lab) -> Value {
        let (vmlinuz, initrd) = lab.boot_files(&self.release);
        let debs: Vec<Value> = self
            .debs
            .iter()
            .map(|d| json!({"package": d.package, "version": d.version, "file": d.file, "size": d.size}))
            .collect();
        json!({
            "suite": self.suite, "release": self.release, "version": self.version,
            "vmlinuz": vmlinuz, "initrd": initrd, "debs": debs,
        })
    }

    fn from_json(v: &Value) -> Option<Self> {
        let s = |v: &Value, k: &str| v[k].as_str().map(str::to_owned);
        let debs = v["debs"]
            .as_array()?
            .iter()
            .map(|d| {
                Some(Deb {
                    package: s(d, "package")?,
                    version: s(d, "version")?,
                    file: s(d, "file")?,
                    size: d["size"].as_u64()?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Self { suite: s(v, "suite")?, release: s(v, "release")?, version: s(v, "version")?, debs })
    }
}

/// Builds what is missing or stale of the lab (`cargo xtask setup`, and `cargo xtask test` for
/// the kernel matrix), saying what it does; seconds when all is there.
pub fn provide() -> anyhow::Result<()> {
    let lab = Lab { dir: cache_dir() };
    let refresh = std::env::var(REFRESH_ENV).is_ok_and(|v| !matches!(v.trim(), "" | "0"));
    let recipe = rootfs::Recipe::new()?;
    let known = read_manifest(&lab);
    if !refresh
        && let Some(picks) = &known
        && ready(&lab, &recipe, picks)
    {
        let kernels: Vec<String> = picks.iter().map(|p| format!("{} ({})", p.release, p.suite)).collect();
        eprintln!("setup: VM lab ready in {}: {}", lab.dir.display(), kernels.join(", "));
        return Ok(());
    }
    if !is_root() {
        bail!("the VM lab in {} is missing or stale: run `sudo -E cargo xtask setup`", lab.dir.display());
    }
    eprintln!("setup: building the VM lab in {} (what is there and current is kept)", lab.dir.display());
    fs::create_dir_all(&lab.dir).with_context(|| format!("creating {}", lab.dir.display()))?;
    let apt = apt::Apt::new(&lab)?;
    let picks = pick(&apt, known.filter(|_| !refresh).unwrap_or_default())?;
    for p in &picks {
        apt.download(p, &lab.debs())?;
    }
    rootfs::build(&lab, &recipe)?;
    for p in &picks {
        rootfs::install_kernel(&lab, &recipe, p)?;
    }
    rootfs::prune(&lab, &picks)?;
    rootfs::image(&lab, &recipe, &picks)?;
    write_manifest(&lab, &picks)?;
    eprintln!("setup: VM lab ready in {}", lab.dir.display());
    Ok(())
}

/// Each suite's kernel: the one `known` has, else the suite's current one (the archive asked).
fn pick(apt: &apt::Apt, known: Vec<Pick>) -> anyhow::Result<Vec<Pick>> {
    let mut updated = false;
    SUITES
        .iter()
        .map(|suite| match known.iter().find(|p| p.suite == *suite) {
            Some(p) => Ok(p.clone()),
            None => {
                if !updated {
                    apt.update()?;
                    updated = true;
                }
                let p = apt.resolve(suite)?;
                eprintln!("setup: {suite}: kernel {} (package {})", p.release, p.version);
                Ok(p)
            }
        })
        .collect()
}

/// Every step done from this recipe and these kernels, and the files the tests use there.
fn ready(lab: &Lab, recipe: &rootfs::Recipe, picks: &[Pick]) -> bool {
    SUITES.iter().all(|s| picks.iter().any(|p| p.suite == *s))
        && lab.stamped(rootfs::IMAGE_STEP, &recipe.image_inputs(picks))
        && lab.image().is_file()
        && picks.iter().all(|p| {
            let (vmlinuz, initrd) = lab.boot_files(&p.release);
            vmlinuz.is_file() && initrd.is_file()
        })
}

fn read_manifest(lab: &Lab) -> Option<Vec<Pick>> {
    let text = fs::read_to_string(lab.manifest()).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    v["kernels"].as_array()?.iter().map(Pick::from_json).collect()
}

/// `lab.json`: what `limiter_tests::vm` reads (the image, each suite's kernel and boot files).
fn write_manifest(lab: &Lab, picks: &[Pick]) -> anyhow::Result<()> {
    let kernels: Vec<Value> = picks.iter().map(|p| p.to_json(lab)).collect();
    let v = json!({"image": lab.image(), "kernels": kernels});
    let text = serde_json::to_string_pretty(&v).context("writing the lab's manifest")?;
    write_atomic(&lab.manifest(), text.as_bytes())
}

/// Writes `path` whole or not at all (a temporary file beside it, renamed).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = partial(path);
    fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// `PATH.partial`: where a file or tree is made before it is renamed into place, so an
/// interrupted run never leaves a half-made one under the real name.
pub fn partial(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".partial");
    PathBuf::from(p)
}

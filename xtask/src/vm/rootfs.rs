//! The lab's root filesystem: a minimal Debian of the host's own release (the test binaries built
//! here run in it, on its C library), made by debootstrap, with the tools the tests call; each
//! kernel installed into it with its modules and an initrd of its own; the lab's init
//! ([`INIT`]); and the whole as an ext4 image.

use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use super::{Lab, MIRROR, Pick, partial, write_atomic};
use crate::sh::{describe, exec};

pub const IMAGE_STEP: &str = "image";
const ROOTFS_STEP: &str = "rootfs";

/// What the tests call inside the VM (besides what every Debian has: coreutils, util-linux's
/// nsenter, mount), and what making an initrd takes.
const INCLUDE: [&str; 9] =
    ["iproute2", "ethtool", "procps", "kmod", "udev", "initramfs-tools", "busybox", "zstd", "xz-utils"];

/// The modules an initrd needs to mount the root filesystem (a virtio disk, ext4); the rest load
/// from the root filesystem once it is mounted.
const INITRD_MODULES: &str = "virtio_pci\nvirtio_blk\next4\n";
/// The initrds: those modules only, gzip (which every kernel here can unpack).
const INITRAMFS_CONF: &str = "MODULES=list\nCOMPRESS=gzip\n";

/// The image's size (a sparse file: only what the tree holds is written).
const IMAGE_SIZE: &str = "4G";

/// The init every boot runs (`init=/sbin/lab-init`). `limiter_tests::vm` reads its markers:
/// `LAB-BEGIN kernel=RELEASE cpus=N` once the payload disk is mounted, `LAB-EXIT status=N` when
/// its `run` ended.
pub const INIT: &str = r#"#!/bin/sh
# The VM lab's init (written by `cargo xtask setup`, xtask/src/vm/rootfs.rs): mounts what the
# limiter and its tests need, loads the drivers of QEMU's virtio devices (no udev runs here),
# runs the payload disk's `run`, says its exit status, and powers off.
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
# The initrd moved its /proc, /sys, /dev and /run here: what is mounted is kept.
mnt() { mountpoint -q "$2" || mount -t "$1" "$1" "$2"; }
mnt proc /proc
mnt sysfs /sys
mnt devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mnt devpts /dev/pts
mnt tmpfs /dev/shm
mnt tmpfs /run
mnt tmpfs /tmp
mnt bpf /sys/fs/bpf
mnt cgroup2 /sys/fs/cgroup
cat /sys/bus/virtio/devices/*/modalias 2>/dev/null | sort -u | xargs -r modprobe -q -a 2>/dev/null
# Before 5.11 BPF maps are charged to the locked-memory limit.
ulimit -l unlimited
ip link set lo up
mkdir -p /lab
mount -o ro /dev/vdb /lab
echo "LAB-BEGIN kernel=$(uname -r) cpus=$(nproc)"
cd /tmp
/lab/run
echo "LAB-EXIT status=$?"
sync
echo o > /proc/sysrq-trigger
sleep 10
"#;

/// What the lab is made of, beside the kernels picked.
pub struct Recipe {
    /// The root filesystem's suite: the host's Debian release.
    suite: String,
}

impl Recipe {
    pub fn new() -> anyhow::Result<Self> {
        Ok(Self { suite: host_release()? })
    }

    fn rootfs_inputs(&self) -> String {
        format!("suite {}\nmirror {MIRROR}\ninclude {}\n", self.suite, INCLUDE.join(","))
    }

    fn kernel_inputs(&self, pick: &Pick) -> String {
        format!("{}initrd modules {INITRD_MODULES:?} conf {INITRAMFS_CONF:?}\n{}", self.rootfs_inputs(), pick.inputs())
    }

    /// What the image is made from: the root filesystem, every kernel in it, the init.
    pub fn image_inputs(&self, picks: &[Pick]) -> String {
        let kernels: String = picks.iter().map(|p| self.kernel_inputs(p)).collect();
        format!("{kernels}size {IMAGE_SIZE}\ninit {INIT}")
    }
}

/// The host's Debian release (`VERSION_CODENAME` of /etc/os-release).
fn host_release() -> anyhow::Result<String> {
    let text = fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    let field = |k: &str| {
        text.lines().find_map(|l| l.strip_prefix(k)?.strip_prefix('=')).map(|v| v.trim_matches('"').to_string())
    };
    match (field("ID").as_deref(), field("VERSION_CODENAME")) {
        (Some("debian"), Some(codename)) if !codename.is_empty() => Ok(codename),
        (id, _) => bail!(
            "the VM lab's root filesystem is the host's Debian release (the test binaries built here run in it), \
             and this host is {}: build on Debian",
            id.unwrap_or("of no known distribution")
        ),
    }
}

/// The root filesystem by debootstrap (its packages kept in `debootstrap/` for the next time),
/// unless it was made from this recipe. A new one has no kernels: their steps are forgotten.
pub fn build(lab: &Lab, recipe: &Recipe) -> anyhow::Result<()> {
    let inputs = recipe.rootfs_inputs();
    let root = lab.rootfs();
    if lab.stamped(ROOTFS_STEP, &inputs) && root.is_dir() {
        eprintln!("setup: root filesystem present ({})", recipe.suite);
        return Ok(());
    }
    lab.unstamp(ROOTFS_STEP)?;
    lab.unstamp(IMAGE_STEP)?;
    forget_kernels(lab)?;
    let cache = lab.dir.join("debootstrap");
    fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let fresh = partial(&root);
    remove_tree(&fresh)?;
    exec(
        Command::new("debootstrap")
            .args(["--variant=minbase", &format!("--include={}", INCLUDE.join(","))])
            .arg(format!("--cache-dir={}", cache.display()))
            .arg(&recipe.suite)
            .arg(&fresh)
            .arg(MIRROR),
    )
    .context("debootstrap failed")?;
    remove_tree(&root)?;
    fs::rename(&fresh, &root).with_context(|| format!("renaming {} to {}", fresh.display(), root.display()))?;
    lab.stamp(ROOTFS_STEP, &inputs)
}

fn forget_kernels(lab: &Lab) -> anyhow::Result<()> {
    let Ok(entries) = fs::read_dir(lab.dir.join("stamps")) else { return Ok(()) };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("kernel-") {
            lab.unstamp(&name)?;
        }
    }
    Ok(())
}

/// Installs `pick` into the root filesystem (its packages extracted, not configured: a newer
/// kernel's packages depend on a newer `linux-base` than the root filesystem's release has),
/// its module index and initrd made in a chroot, its kernel and initrd copied to
/// `kernels/RELEASE/`; unless that was done from the same packages and settings.
pub fn install_kernel(lab: &Lab, recipe: &Recipe, pick: &Pick) -> anyhow::Result<()> {
    let (step, inputs) = (format!("kernel-{}", pick.release), recipe.kernel_inputs(pick));
    let (vmlinuz, initrd) = lab.boot_files(&pick.release);
    if lab.stamped(&step, &inputs) && vmlinuz.is_file() && initrd.is_file() {
        eprintln!("setup: kernel {} ({}) present", pick.release, pick.suite);
        return Ok(());
    }
    lab.unstamp(&step)?;
    lab.unstamp(IMAGE_STEP)?;
    let root = lab.rootfs();
    let conf = root.join("etc/initramfs-tools");
    write_if_changed(&conf.join("conf.d/lab-vm"), INITRAMFS_CONF)?;
    write_if_changed(&conf.join("modules"), INITRD_MODULES)?;
    for deb in &pick.debs {
        extract(&lab.debs().join(&deb.file), &root)?;
    }
    let rel = &pick.release;
    let boot = root.join("boot");
    let modules = root.join("usr/lib/modules").join(rel);
    // 7.x packages the kernel and its config beside the modules; mkinitramfs reads /boot.
    for name in ["vmlinuz", "config", "System.map"] {
        let (to, from) = (boot.join(format!("{name}-{rel}")), modules.join(name));
        if !to.exists() && from.exists() {
            fs::copy(&from, &to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        }
    }
    exec(Command::new("chroot").arg(&root).args(["depmod", rel]))?;
    exec(Command::new("chroot").arg(&root).args(["mkinitramfs", "-o", &format!("/boot/initrd.img-{rel}"), rel]))?;
    for (from, to) in
        [(boot.join(format!("vmlinuz-{rel}")), &vmlinuz), (boot.join(format!("initrd.img-{rel}")), &initrd)]
    {
        let bytes = fs::read(&from).with_context(|| format!("reading {}", from.display()))?;
        write_atomic(to, &bytes)?;
    }
    lab.stamp(&step, &inputs)
}

/// `dpkg-deb --fsys-tarfile DEB | tar -x --keep-directory-symlink -C ROOT`: not `dpkg -x`, which
/// replaces the merged /usr's `/lib` symlink with a directory.
fn extract(deb: &Path, root: &Path) -> anyhow::Result<()> {
    let mut unpack = Command::new("dpkg-deb");
    unpack.arg("--fsys-tarfile").arg(deb).stdout(Stdio::piped());
    let mut tar = Command::new("tar");
    tar.args(["-x", "--keep-directory-symlink", "-C"]).arg(root);
    eprintln!("+ {} | {}", describe(&unpack), describe(&tar));
    let mut from = unpack.spawn().with_context(|| format!("could not start `{}`", describe(&unpack)))?;
    let stdout = from.stdout.take().context("dpkg-deb's output")?;
    let extracted = tar.stdin(stdout).status().with_context(|| format!("could not start `{}`", describe(&tar)));
    let unpacked = from.wait().with_context(|| format!("waiting for `{}`", describe(&unpack)))?;
    let extracted = extracted?;
    if !unpacked.success() || !extracted.success() {
        bail!("extracting {} into {} failed (dpkg-deb {unpacked}, tar {extracted})", deb.display(), root.display());
    }
    Ok(())
}

/// Removes the kernels of the root filesystem and of `kernels/` that are not picked (a suite
/// moved on): the image would carry them for nothing.
pub fn prune(lab: &Lab, picks: &[Pick]) -> anyhow::Result<()> {
    let root = lab.rootfs();
    let kept = |release: &str| picks.iter().any(|p| p.release == release);
    let Ok(installed) = fs::read_dir(root.join("usr/lib/modules")) else { return Ok(()) };
    for entry in installed.flatten() {
        let release = entry.file_name().to_string_lossy().into_owned();
        if kept(&release) {
            continue;
        }
        eprintln!("setup: removing kernel {release}, no longer picked");
        remove_tree(&entry.path())?;
        remove_tree(&lab.dir.join("kernels").join(&release))?;
        for name in ["vmlinuz", "config", "System.map", "initrd.img"] {
            let path = root.join("boot").join(format!("{name}-{release}"));
            fs::remove_file(&path).or_else(not_found).with_context(|| format!("removing {}", path.display()))?;
        }
        lab.unstamp(&format!("kernel-{release}"))?;
        lab.unstamp(IMAGE_STEP)?;
    }
    Ok(())
}

/// The init written into the root filesystem, then the image made of it (`mkfs.ext4 -d`),
/// unless it was made from the same root filesystem, kernels and init.
pub fn image(lab: &Lab, recipe: &Recipe, picks: &[Pick]) -> anyhow::Result<()> {
    let init = lab.rootfs().join("sbin/lab-init");
    write_if_changed(&init, INIT)?;
    fs::set_permissions(&init, fs::Permissions::from_mode(0o755))
        .with_context(|| format!("chmod 0755 {}", init.display()))?;
    let inputs = recipe.image_inputs(picks);
    let image = lab.image();
    if lab.stamped(IMAGE_STEP, &inputs) && image.is_file() {
        eprintln!("setup: image present");
        return Ok(());
    }
    lab.unstamp(IMAGE_STEP)?;
    let fresh = partial(&image);
    exec(
        Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "labroot", "-d"])
            .arg(lab.rootfs())
            .arg(&fresh)
            .arg(IMAGE_SIZE),
    )?;
    fs::rename(&fresh, &image).with_context(|| format!("renaming {} to {}", fresh.display(), image.display()))?;
    lab.stamp(IMAGE_STEP, &inputs)
}

fn write_if_changed(path: &Path, text: &str) -> anyhow::Result<()> {
    if fs::read_to_string(path).ok().as_deref() == Some(text) {
        return Ok(());
    }
    write_atomic(path, text.as_bytes())
}

fn remove_tree(path: &Path) -> anyhow::Result<()> {
    fs::remove_dir_all(path).or_else(not_found).with_context(|| format!("removing {}", path.display()))
}

fn not_found(e: std::io::Error) -> std::io::Result<()> {
    if e.kind() == std::io::ErrorKind::NotFound { Ok(()) } else { Err(e) }
}

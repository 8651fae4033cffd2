//! Booting a kernel of the VM lab with a payload, for the kernel matrix (tests/kernels/matrix.rs).
//!
//! `cargo xtask setup` builds the lab (xtask/src/vm/): Debian's kernels, each the current one of
//! a suite, and a root filesystem image holding them, under [`cache_dir`], described by its
//! `lab.json`. A boot ([`Vm::run`]) runs QEMU under software emulation (this machine's KVM does
//! not boot Debian's kernels) on a snapshot of that image, with a second disk made for the run
//! from a [`Payload`] directory and mounted read-only at `/lab`: the lab's init runs `/lab/run`,
//! prints its exit status and powers off. The serial console is streamed to this process's
//! stderr as it comes (a boot takes minutes; [`say`]) and collected; a boot that overruns its
//! time is killed.
//!
//! The console's markers, from the lab's init: `LAB-BEGIN kernel=RELEASE cpus=N` once the payload
//! is mounted, `LAB-EXIT status=N` when `run` ended ([`Outcome`]).
//!
//! A [`Vm`] holds what QEMU is given: CPUs, memory, and arguments of the test's own, for the
//! devices a test adds (a virtio NIC with several queues on a tap of the host's, say:
//! `-netdev tap,id=n0,ifname=TAP,script=no,downscript=no,queues=4 -device
//! virtio-net-pci,netdev=n0,mq=on,vectors=10`); the init loads the drivers of virtio devices.

use std::{
    ffi::OsString,
    io::{BufRead as _, BufReader, Read},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde_json::Value;

use crate::netns::{PREFIX, describe};

/// Environment variable: the lab's cache directory, instead of [`DEFAULT_CACHE`]
/// (xtask/src/vm/ reads the same).
pub const CACHE_ENV: &str = "LIMITER_VM_CACHE";
pub const DEFAULT_CACHE: &str = "/var/cache/limiter-vm";

pub fn cache_dir() -> PathBuf {
    std::env::var_os(CACHE_ENV).filter(|v| !v.is_empty()).map_or_else(|| PathBuf::from(DEFAULT_CACHE), PathBuf::from)
}

/// One kernel of the lab: a suite's, as `lab.json` describes it.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub suite: String,
    /// `uname -r`.
    pub release: String,
    /// Its Debian package's version.
    pub version: String,
    pub vmlinuz: PathBuf,
    pub initrd: PathBuf,
}

/// The lab as `cargo xtask setup` built it.
#[derive(Clone, Debug)]
pub struct Lab {
    pub image: PathBuf,
    pub kernels: Vec<Kernel>,
}

impl Lab {
    /// Reads `lab.json` in [`cache_dir`]; fails, saying how to build the lab, if it is not there.
    pub fn open() -> anyhow::Result<Self> {
        let path = cache_dir().join("lab.json");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!("reading {}: the VM lab is not built; run `sudo -E cargo xtask setup`", path.display())
        })?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
        let s = |v: &Value, k: &str| {
            v[k].as_str().map(str::to_owned).with_context(|| format!("{}: no {k}", path.display()))
        };
        let kernels = v["kernels"]
            .as_array()
            .with_context(|| format!("{}: no kernels", path.display()))?
            .iter()
            .map(|k| {
                Ok(Kernel {
                    suite: s(k, "suite")?,
                    release: s(k, "release")?,
                    version: s(k, "version")?,
                    vmlinuz: s(k, "vmlinuz")?.into(),
                    initrd: s(k, "initrd")?.into(),
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self { image: s(&v, "image")?.into(), kernels })
    }

    /// The kernel of `suite`.
    pub fn kernel(&self, suite: &str) -> anyhow::Result<&Kernel> {
        self.kernels.iter().find(|k| k.suite == suite).with_context(|| {
            let have: Vec<&str> = self.kernels.iter().map(|k| k.suite.as_str()).collect();
            format!("the VM lab has no kernel of {suite} (it has {have:?}): run `sudo -E cargo xtask setup`")
        })
    }

    /// A VM of `suite`'s kernel with the defaults of [`Vm`].
    pub fn vm(&self, suite: &str) -> anyhow::Result<Vm> {
        Ok(Vm::new(self.kernel(suite)?.clone(), self.image.clone()))
    }
}

/// What a VM is given besides its kernel and the lab's image.
#[derive(Clone, Debug)]
pub struct Vm {
    pub kernel: Kernel,
    image: PathBuf,
    pub cpus: u32,
    pub memory_mb: u32,
    /// How long the whole boot may take before QEMU is killed.
    pub timeout: Duration,
    /// More QEMU arguments (devices: NICs on taps, their queues).
    pub qemu_args: Vec<OsString>,
    /// More kernel command line parameters.
    pub append: Vec<String>,
    /// A network namespace (under /run/netns) QEMU runs in: the taps it creates are made there,
    /// out of the host's way, and go with QEMU.
    pub netns: Option<String>,
}

/// How long a VM may run after `run` ended (the init syncs and powers off).
const POWER_OFF: Duration = Duration::from_secs(60);

impl Vm {
    /// Two CPUs and 2 GiB, 15 minutes at most.
    pub fn new(kernel: Kernel, image: PathBuf) -> Self {
        Self {
            kernel,
            image,
            cpus: 2,
            memory_mb: 2048,
            timeout: Duration::from_secs(15 * 60),
            qemu_args: Vec::new(),
            append: Vec::new(),
            netns: None,
        }
    }

    /// The QEMU command for a boot with the payload image `payload`.
    fn command(&self, payload: &Path) -> Command {
        // `ip netns exec` execs QEMU: the child's pid is QEMU's own, which `Console` kills.
        let mut cmd = match &self.netns {
            Some(ns) => crate::netns::netns_command(ns, "qemu-system-x86_64"),
            None => Command::new("qemu-system-x86_64"),
        };
        cmd.args(["-accel", "tcg,thread=multi", "-cpu", "max", "-no-reboot", "-nic", "none"]);
        cmd.args(["-display", "none", "-monitor", "none", "-serial", "stdio"]);
        cmd.args(["-m", &self.memory_mb.to_string(), "-smp", &self.cpus.to_string()]);
        cmd.arg("-kernel").arg(&self.kernel.vmlinuz).arg("-initrd").arg(&self.kernel.initrd);
        let mut append = "root=/dev/vda rw console=ttyS0 init=/sbin/lab-init quiet panic=-1".to_string();
        for a in &self.append {
            append.push(' ');
            append.push_str(a);
        }
        cmd.arg("-append").arg(append);
        // Root first (vda), the payload second (vdb, which the init mounts); the root image is
        // never written: each boot writes to a snapshot of its own.
        cmd.arg("-drive").arg(drive(&self.image, "snapshot=on"));
        cmd.arg("-drive").arg(drive(payload, "readonly=on"));
        // Entropy, so nothing in the guest waits for its pool to fill (5.10 would).
        cmd.args(["-device", "virtio-rng-pci"]);
        cmd.args(&self.qemu_args);
        cmd
    }

    /// Boots with `payload` at `/lab` and waits until the VM powers off (at most
    /// [`Vm::timeout`]): the console and what the markers said. Fails if QEMU does not start,
    /// the boot overruns its time, or the VM ends without `LAB-EXIT` (its console tail said).
    pub fn run(&self, payload: &Payload) -> anyhow::Result<Outcome> {
        self.run_watching(payload, |_| {})
    }

    /// [`Vm::run`], calling `on_line` with each console line as it comes (QEMU's own tagged
    /// `qemu: `): the host can act on what the guest says while it runs (a guest's `LAB-SEND`
    /// asking for a flood from the tap's side). The console is read on other threads, so a
    /// slow `on_line` delays only what the host sees, never the guest.
    ///
    /// A guest kernel that panics before the lab's init begins (no `LAB-BEGIN`), or on an `int3`
    /// trap at any time, boots once more, said on the console: under multi-threaded software
    /// emulation a vCPU sometimes runs code another vCPU's kernel is patching in place (text_poke's
    /// breakpoints: `int3` in `ktime_get` at boot with 7.3, in `bpf_dispatcher_xdp_func` as an
    /// XDP program was attached with 6.12), a fault of the emulator's that says nothing of the
    /// limiter. A second such panic stands.
    pub fn run_watching(&self, payload: &Payload, mut on_line: impl FnMut(&str)) -> anyhow::Result<Outcome> {
        match self.boot(payload, &mut on_line) {
            Err(e) if e.downcast_ref::<EmulatorFault>().is_some() => {
                say(&format!("[vm {}] {e:#}; booting once more", self.kernel.release));
                self.boot(payload, &mut on_line)
            }
            outcome => outcome,
        }
    }

    /// One boot of [`Vm::run_watching`].
    fn boot(&self, payload: &Payload, on_line: &mut impl FnMut(&str)) -> anyhow::Result<Outcome> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{PREFIX}{}-vm-", std::process::id()))
            .tempdir()
            .context("a temporary directory for the payload's image")?;
        let image = payload.image(dir.path())?;
        let mut cmd = self.command(&image);
        let tag = format!("vm {}", self.kernel.release);
        say(&format!("[{tag}] + {}", describe(&cmd)));
        let started = Instant::now();
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("could not start `{}` (is qemu-system-x86 installed?)", describe(&cmd)))?;
        let (tx, lines) = mpsc::channel();
        forward(child.stdout.take(), "", &tag, started, tx.clone());
        forward(child.stderr.take(), "qemu: ", &tag, started, tx);
        let mut console = Console { child, lines, seen: Vec::new() };
        let deadline = started + self.timeout;
        let mut exit = None;
        while exit.is_none() {
            match console.next(deadline) {
                Next::Line(line) => {
                    on_line(&line);
                    exit = line.strip_prefix("LAB-EXIT status=").map(|s| s.trim().parse::<i32>());
                }
                Next::Ended if console.emulator_fault() => {
                    return Err(EmulatorFault(console.tail()).into());
                }
                Next::Ended => bail!("the VM ended without LAB-EXIT:\n{}", console.tail()),
                Next::TimedOut => {
                    console.kill();
                    bail!("the VM did not finish within {:?}; killed:\n{}", self.timeout, console.tail());
                }
            }
        }
        let ran = started.elapsed();
        // Powering off: the console's end, then the process.
        let off = Instant::now() + POWER_OFF;
        while let Next::Line(_) = console.next(off) {}
        console.kill();
        let status =
            exit.and_then(Result::ok).with_context(|| format!("a LAB-EXIT without a status:\n{}", console.tail()))?;
        Outcome::read(std::mem::take(&mut console.seen), status, ran)
    }
}

/// The guest's kernel panicked before the lab's init began, or on a code-patching trap: its
/// console's tail.
#[derive(Debug)]
struct EmulatorFault(String);

impl std::fmt::Display for EmulatorFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the guest's kernel panicked before the lab began, or on an int3 trap:\n{}", self.0)
    }
}

impl std::error::Error for EmulatorFault {}

/// A disk for QEMU: `-drive file=PATH,if=virtio,format=raw,OPTION`.
fn drive(path: &Path, option: &str) -> OsString {
    let mut d = OsString::from("file=");
    // A comma in a path would end QEMU's option: doubled, it is a comma.
    d.push(path.to_string_lossy().replace(',', ",,"));
    d.push(format!(",if=virtio,format=raw,{option}"));
    d
}

/// The console of a running VM: its lines (QEMU's own stderr among them, tagged), and the
/// process, killed (by its pid: our child) on drop.
struct Console {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

enum Next {
    Line(String),
    Ended,
    TimedOut,
}

impl Console {
    fn next(&mut self, deadline: Instant) -> Next {
        match self.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                self.seen.push(line.clone());
                Next::Line(line)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Next::TimedOut,
            Err(mpsc::RecvTimeoutError::Disconnected) => Next::Ended,
        }
    }

    fn kill(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }

    /// Whether the kernel panicked before the lab's init began, or on an `int3` trap.
    fn emulator_fault(&self) -> bool {
        let has = |text: &str| self.seen.iter().any(|l| l.contains(text));
        let begun = self.seen.iter().any(|l| l.starts_with("LAB-BEGIN "));
        has("Kernel panic - not syncing") && (!begun || has("Oops: int3"))
    }

    /// The last lines, for an error.
    fn tail(&self) -> String {
        self.seen[self.seen.len().saturating_sub(60)..].join("\n")
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends each line of `stream` (carriage returns of the serial line dropped) to `tx`, tagged
/// with `tag`, and echoes it to stderr as `[vm RELEASE +SECONDS] LINE`, timed from `started`.
fn forward(
    stream: Option<impl Read + Send + 'static>,
    tag: &'static str,
    vm: &str,
    started: Instant,
    tx: mpsc::Sender<String>,
) {
    let Some(stream) = stream else { return };
    let vm = vm.to_string();
    thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut buf = Vec::new();
        // Bytes, not UTF-8 lines: a console may carry anything.
        while reader.read_until(b'\n', &mut buf).is_ok_and(|n| n > 0) {
            let line = format!("{tag}{}", String::from_utf8_lossy(&buf).trim_end_matches(['\r', '\n']));
            buf.clear();
            say(&format!("[{vm} +{}s] {line}", started.elapsed().as_secs()));
            if tx.send(line).is_err() {
                break;
            }
        }
    });
}

/// Writes `text` and a newline to this process's stderr as it comes: past the test harness's
/// capture of `eprintln!` (which holds a passing test's output back, its threads' too), so a
/// boot that takes minutes is seen as it goes, and results are shown whether the test passes.
pub fn say(text: &str) {
    use std::io::Write as _;
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(text.as_bytes()).and_then(|()| err.write_all(b"\n"));
}

/// What a boot said.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The running kernel's release, from `LAB-BEGIN`.
    pub release: String,
    /// Its CPUs, from `LAB-BEGIN`.
    pub cpus: u32,
    /// `run`'s exit status, from `LAB-EXIT`.
    pub status: i32,
    /// The console between `LAB-BEGIN` and `LAB-EXIT`: what `run` printed, and the kernel's
    /// messages meanwhile.
    pub output: Vec<String>,
    /// The whole console, QEMU's own messages included (tagged `qemu: `).
    pub console: Vec<String>,
    /// From QEMU's start to `LAB-EXIT`.
    pub took: Duration,
}

impl Outcome {
    fn read(console: Vec<String>, status: i32, took: Duration) -> anyhow::Result<Self> {
        let begin = console
            .iter()
            .position(|l| l.starts_with("LAB-BEGIN "))
            .with_context(|| format!("no LAB-BEGIN on the console:\n{}", console.join("\n")))?;
        let field = |k: &str| console[begin].split_whitespace().find_map(|w| w.strip_prefix(k)).map(str::to_owned);
        let release = field("kernel=").with_context(|| format!("no kernel= in {}", console[begin]))?;
        let cpus =
            field("cpus=").and_then(|c| c.parse().ok()).with_context(|| format!("no cpus= in {}", console[begin]))?;
        let end = console.iter().rposition(|l| l.starts_with("LAB-EXIT ")).unwrap_or(console.len());
        let output = console[begin + 1..end.max(begin + 1)].to_vec();
        Ok(Self { release, cpus, status, output, console, took })
    }

    /// The lines of `run`'s output that start with `prefix`, without it.
    pub fn lines_after<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> {
        self.output.iter().filter_map(move |l| l.strip_prefix(prefix))
    }
}

/// A directory that becomes the VM's `/lab` (read-only): files copied in where the test wants
/// them, and `run`, the script the VM runs.
pub struct Payload {
    dir: tempfile::TempDir,
}

impl Payload {
    /// A payload whose `run` is `script` (a shell script: `#!/bin/sh` is put first).
    pub fn new(script: &str) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{PREFIX}{}-payload-", std::process::id()))
            .tempdir()
            .context("a temporary directory for the payload")?;
        let payload = Self { dir };
        let run = payload.dir.path().join("run");
        std::fs::write(&run, format!("#!/bin/sh\n{script}")).with_context(|| format!("writing {}", run.display()))?;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("chmod 0755 {}", run.display()))?;
        Ok(payload)
    }

    /// Copies the file `from` to `at` (a path under `/lab`), with its mode.
    pub fn add(&self, from: &Path, at: &str) -> anyhow::Result<()> {
        let to = self.dir.path().join(at);
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        std::fs::copy(from, &to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        Ok(())
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The directory as an ext4 image in `dir` (`mkfs.ext4 -d`), with room to spare.
    fn image(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        let image = dir.join("payload.img");
        let mb = size(self.path())?.div_ceil(1 << 20) * 5 / 4 + 32;
        let mut cmd = Command::new("mkfs.ext4");
        cmd.args(["-q", "-F", "-L", "labpayload", "-d"]).arg(self.path()).arg(&image).arg(format!("{mb}M"));
        let out = cmd.output().with_context(|| format!("could not start `{}` (e2fsprogs)", describe(&cmd)))?;
        if !out.status.success() {
            bail!("`{}` failed: {}", describe(&cmd), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(image)
    }
}

/// The bytes of the files under `path`.
fn size(path: &Path) -> anyhow::Result<u64> {
    let meta = std::fs::symlink_metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if !meta.is_dir() {
        return Ok(meta.len());
    }
    let mut total = 0;
    for entry in std::fs::read_dir(path).with_context(|| format!("listing {}", path.display()))? {
        total += size(&entry.with_context(|| format!("listing {}", path.display()))?.path())?;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_markers_give_the_kernel_and_what_run_printed() {
        let console: Vec<String> = [
            "qemu: warning",
            "Loading",
            "LAB-BEGIN kernel=6.1.0-50-amd64 cpus=2",
            "a",
            "b",
            "LAB-EXIT status=3",
            "off",
        ]
        .map(String::from)
        .to_vec();
        let out = Outcome::read(console, 3, Duration::from_secs(1)).expect("read");
        assert_eq!((out.release.as_str(), out.cpus, out.status), ("6.1.0-50-amd64", 2, 3));
        assert_eq!(out.output, ["a", "b"]);
        assert!(Outcome::read(vec!["LAB-EXIT status=0".into()], 0, Duration::ZERO).is_err(), "no LAB-BEGIN");
    }
}

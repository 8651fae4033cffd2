//! Debian's `xdp-filter` (xdp-tools) on a test namespace's interface: another tool holding the
//! XDP hook, as on hosts that run one, for the tests of sharing the interface
//! (tests/daemon/sharing/).
//!
//! It is the real binary, run in the namespace's network namespace only (`nsenter --net`, as
//! the daemon is: [`crate::daemon::net_command`]), so its pins land on the machine's bpffs
//! (`/sys/fs/bpf/xdp-filter/`), where its later commands find them. On this kernel libxdp's
//! dispatcher cannot load (BPF_PROG_TYPE_EXT gets EPERM): xdp-filter says "Compatibility check
//! for dispatcher program failed" and falls back to owning the XDP hook alone, its program
//! (`xdpfilt_*`) attached natively. [`XdpFilter::load`] checks that it is.
//!
//! xdp-filter keeps one set of rule maps for every interface it is loaded on, pinned under
//! `/sys/fs/bpf/xdp-filter/`: two tests using it at once would share their rules. So an
//! [`XdpFilter`] holds an exclusive lock ([`LOCK`], flock) from before its load until it is
//! dropped, and under it first unloads what a crashed run of ours left (an interface name of
//! ours, `lmt<pid>n...`, whose pid is gone): each test starts with no rules but its own. On drop
//! it unloads (the last unload removes the pinned maps and rules; if the namespace went first,
//! it removes those pins itself), then releases the lock.

use std::{collections::BTreeMap, fs::File, net::IpAddr, path::Path, process::Stdio};

use anyhow::{Context as _, bail};
use nix::fcntl::{Flock, FlockArg};

use crate::{
    daemon::{net_command, xdp_program_id},
    netns::{End, NETNS_DIR},
};

/// The binary (Debian's xdp-tools; `cargo xtask setup` installs it).
pub const XDP_FILTER: &str = "xdp-filter";
/// Where xdp-filter pins its programs and rule maps.
pub const PIN_DIR: &str = "/sys/fs/bpf/xdp-filter";
/// Held while a test's xdp-filter is loaded: one user of xdp-filter's shared rules at a time.
pub const LOCK: &str = "/run/lock/limiter-tests-xdp-filter.lock";
/// The start of the name of every program xdp-filter attaches (`xdpfilt_alw_all`, ...).
pub const PROGRAM_PREFIX: &str = "xdpfilt_";
/// libxdp's own directory on bpffs (its lock, and a dispatcher's pins where one loads): made by
/// the first xdp-filter command, and left empty by the last unload on this kernel.
pub const LIBXDP_DIR: &str = "/sys/fs/bpf/xdp";

/// xdp-filter loaded on one interface (a namespace's veth end), unloaded on drop.
pub struct XdpFilter {
    end: End,
    loaded: bool,
    /// [`LIBXDP_DIR`] was not there before this load: it goes with it, if left empty.
    made_libxdp_dir: bool,
    /// The program xdp-filter attached (its id, from `ip link`).
    pub program: u32,
    /// What `xdp-filter load` printed (stdout and stderr).
    pub load_output: String,
    _lock: Flock<File>,
}

/// What one xdp-filter command did.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub code: Option<i32>,
    /// stdout and stderr, in that order.
    pub output: String,
}

impl Outcome {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// Runs `xdp-filter ARGS...` in `end`'s network namespace, whatever its exit status.
pub fn run(end: &End, args: &[&str]) -> anyhow::Result<Outcome> {
    let mut cmd = net_command(end, XDP_FILTER);
    cmd.args(args);
    let out = cmd.stdin(Stdio::null()).output().with_context(|| {
        format!("running {XDP_FILTER} {} (is xdp-tools installed? `cargo xtask setup`)", args.join(" "))
    })?;
    let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Ok(Outcome { code: out.status.code(), output })
}

/// `xdp-filter ARGS...` in `end`'s network namespace; fails with everything it said unless it
/// exits 0, else returns what it printed.
pub fn run_ok(end: &End, args: &[&str]) -> anyhow::Result<String> {
    let out = run(end, args)?;
    if !out.success() {
        bail!("`{XDP_FILTER} {}` in {} exited {:?}: {}", args.join(" "), end.ns, out.code, out.output.trim());
    }
    Ok(out.output)
}

impl XdpFilter {
    /// `xdp-filter load --verbose --mode native IFACE` (policy allow: only what a rule names is
    /// dropped; verbose, so [`XdpFilter::load_output`] says whether it fell back from the
    /// dispatcher), then checks its program holds `end`'s XDP hook.
    pub fn load(end: &End) -> anyhow::Result<Self> {
        match Self::try_load(end)? {
            Ok(filter) => Ok(filter),
            Err(out) => {
                bail!("`{XDP_FILTER} load` on {} in {} exited {:?}: {}", end.iface, end.ns, out.code, out.output)
            }
        }
    }

    /// [`XdpFilter::load`], returning what xdp-filter said when it refuses to load (another XDP
    /// program holds the interface) instead of failing. Errors are the harness's own.
    pub fn try_load(end: &End) -> anyhow::Result<Result<Self, Outcome>> {
        let lock = lock()?;
        remove_stale(end)?;
        let made_libxdp_dir = !Path::new(LIBXDP_DIR).exists();
        let out = run(end, &["load", "--verbose", "--mode", "native", &end.iface])?;
        if !out.success() {
            remove_libxdp_dir(made_libxdp_dir);
            return Ok(Err(out));
        }
        // From here on, dropping `filter` unloads it.
        let mut filter =
            Self { end: end.clone(), loaded: true, made_libxdp_dir, program: 0, load_output: out.output, _lock: lock };
        filter.program = attached(end)?.with_context(|| {
            format!("`{XDP_FILTER} load` exited 0 but {} has no XDP program: {}", end.iface, filter.load_output)
        })?;
        Ok(Ok(filter))
    }

    /// Drops IPv4 or IPv6 UDP to destination port `port`: `xdp-filter port PORT --proto udp
    /// --mode dst`.
    pub fn drop_udp_port(&self, port: u16) -> anyhow::Result<()> {
        run_ok(&self.end, &["port", &port.to_string(), "--proto", "udp", "--mode", "dst"]).map(drop)
    }

    /// Drops everything from `addr`: `xdp-filter ip ADDR --mode src`.
    pub fn drop_source(&self, addr: IpAddr) -> anyhow::Result<()> {
        run_ok(&self.end, &["ip", &addr.to_string(), "--mode", "src"]).map(drop)
    }

    /// `xdp-filter status`, parsed.
    pub fn status(&self) -> anyhow::Result<Status> {
        let text = run_ok(&self.end, &["status"])?;
        Status::parse(&text).with_context(|| format!("reading `{XDP_FILTER} status`:\n{text}"))
    }

    /// `xdp-filter unload IFACE`; then no XDP program is left on the interface.
    pub fn unload(&mut self) -> anyhow::Result<()> {
        run_ok(&self.end, &["unload", &self.end.iface])?;
        self.loaded = false;
        if let Some(id) = xdp_program_id(&self.end)? {
            bail!("`{XDP_FILTER} unload {}` exited 0 but XDP program {id} is still attached", self.end.iface);
        }
        Ok(())
    }

    pub fn is_loaded(&self) -> bool {
        self.loaded
    }
}

impl Drop for XdpFilter {
    fn drop(&mut self) {
        if !self.loaded {
            remove_libxdp_dir(self.made_libxdp_dir);
            return;
        }
        // The namespace may have gone first (a test's rig owning it dropped before this), its
        // interface and the attachment with it: only the pins are left, removed by hand.
        if Path::new(NETNS_DIR).join(&self.end.ns).exists()
            && let Err(e) = run_ok(&self.end, &["unload", &self.end.iface])
        {
            eprintln!("xdp-filter: {e:#}");
        }
        if let Err(e) = forget(&self.end.iface) {
            eprintln!("xdp-filter: {e:#}");
        }
        remove_libxdp_dir(self.made_libxdp_dir);
    }
}

/// Removes [`LIBXDP_DIR`] when this harness made it (`made`) and it is empty: a test leaves
/// nothing on the machine's bpffs. Not empty (a dispatcher pinned there since), it stays.
fn remove_libxdp_dir(made: bool) {
    if made && let Err(e) = std::fs::remove_dir(LIBXDP_DIR) {
        eprintln!("xdp-filter: leaving {LIBXDP_DIR}: {e}");
    }
}

/// Removes what xdp-filter pinned for `iface` if it is still there (an unload removes it), and
/// its whole pin directory, rules and all, once no interface is left in it.
fn forget(iface: &str) -> anyhow::Result<()> {
    let programs = Path::new(PIN_DIR).join("programs");
    let mine = programs.join(iface);
    if mine.exists() {
        std::fs::remove_dir_all(&mine).with_context(|| format!("removing {}", mine.display()))?;
    }
    let left = match std::fs::read_dir(&programs) {
        Ok(entries) => entries.count(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(e).with_context(|| format!("listing {}", programs.display())),
    };
    if left == 0 && Path::new(PIN_DIR).exists() {
        std::fs::remove_dir_all(PIN_DIR).with_context(|| format!("removing {PIN_DIR}"))?;
    }
    Ok(())
}

/// The XDP program on `end`'s interface if it is xdp-filter's (its id), None if there is none;
/// an error if another program holds the hook.
pub fn attached(end: &End) -> anyhow::Result<Option<u32>> {
    let Some(id) = xdp_program_id(end)? else { return Ok(None) };
    let details = end.link_details()?;
    anyhow::ensure!(
        details.contains(&format!("id {id} name {PROGRAM_PREFIX}")),
        "XDP program {id} on {} is not xdp-filter's ({PROGRAM_PREFIX}*): {details}",
        end.iface
    );
    Ok(Some(id))
}

/// What `xdp-filter status` says: its aggregate action counters (every interface it is on),
/// where it is loaded, and each rule with its hit counter.
#[derive(Clone, Debug, Default)]
pub struct Status {
    /// Per XDP action (`XDP_DROP`, `XDP_PASS`, ...), packets.
    pub actions: BTreeMap<String, u64>,
    /// The interfaces it is loaded on, with the mode (`native`).
    pub interfaces: BTreeMap<String, String>,
    /// Port rules: port -> (mode, e.g. `dst,udp`; hits).
    pub ports: BTreeMap<u16, (String, u64)>,
    /// Address rules: address -> (mode, e.g. `src`; hits).
    pub addresses: BTreeMap<IpAddr, (String, u64)>,
}

impl Status {
    /// Packets xdp-filter dropped (every interface).
    pub fn dropped(&self) -> u64 {
        self.actions.get("XDP_DROP").copied().unwrap_or(0)
    }

    /// Hits of the port rule for `port` (0 without one).
    pub fn port_hits(&self, port: u16) -> u64 {
        self.ports.get(&port).map_or(0, |(_, hits)| *hits)
    }

    /// Hits of the address rule for `addr` (0 without one).
    pub fn address_hits(&self, addr: IpAddr) -> u64 {
        self.addresses.get(&addr).map_or(0, |(_, hits)| *hits)
    }

    /// Reads the text of `xdp-filter status` (xdp-tools 1.3):
    ///
    /// ```text
    /// Aggregate per-action statistics:
    ///   XDP_DROP                                      3 pkts           0 KiB
    /// Loaded on interfaces:
    ///                                            Enabled features
    /// xdpfilt_alw_all
    ///   vh_d0 (native mode)                      tcp,udp,ipv6,ipv4,ethernet,allow
    /// Filtered ports:
    ///                                            Mode             Hit counter
    ///   7000                                     dst,udp          3
    /// Filtered IP addresses:
    ///   198.18.9.9                               src              0
    /// ```
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let mut status = Self::default();
        let mut section = "";
        for line in text.lines() {
            let trimmed = line.trim();
            if trimmed.ends_with(':') && !line.starts_with(' ') {
                section = trimmed;
                continue;
            }
            let words: Vec<&str> = trimmed.split_whitespace().collect();
            if words.is_empty() || trimmed.starts_with("Enabled features") || trimmed.starts_with("Mode") {
                continue;
            }
            let number = |s: &str| s.parse::<u64>().with_context(|| format!("not a number in {line:?}"));
            match section {
                "Aggregate per-action statistics:" if words.len() >= 3 && words[2] == "pkts" => {
                    status.actions.insert(words[0].to_string(), number(words[1])?);
                }
                "Loaded on interfaces:" if line.starts_with("  ") => {
                    let mode = trimmed.split_once(" (").and_then(|(_, m)| m.split_once(" mode)")).map(|(m, _)| m);
                    let mode = mode.with_context(|| format!("no mode in {line:?}"))?;
                    status.interfaces.insert(words[0].to_string(), mode.to_string());
                }
                "Filtered ports:" if words.len() == 3 => {
                    let port = words[0].parse().with_context(|| format!("not a port in {line:?}"))?;
                    status.ports.insert(port, (words[1].to_string(), number(words[2])?));
                }
                "Filtered IP addresses:" if words.len() == 3 => {
                    let addr = words[0].parse().with_context(|| format!("not an address in {line:?}"))?;
                    status.addresses.insert(addr, (words[1].to_string(), number(words[2])?));
                }
                _ => {}
            }
        }
        anyhow::ensure!(status.actions.contains_key("XDP_DROP"), "no XDP_DROP counter");
        Ok(status)
    }
}

/// The exclusive lock on [`LOCK`], waited for.
fn lock() -> anyhow::Result<Flock<File>> {
    let path = Path::new(LOCK);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| e).with_context(|| format!("flock {}", path.display()))
}

/// Unloads what a crashed run of ours left in xdp-filter's pins: an interface name of ours
/// (`lmt<pid>n<n><side>`, [`crate::netns::TestNet`]) whose pid is gone. Its interface went with
/// its namespace; the pinned program and the shared rules stay until removed. With no interface
/// left, the whole pin directory goes (its maps hold the crashed run's rules).
fn remove_stale(end: &End) -> anyhow::Result<()> {
    let programs = Path::new(PIN_DIR).join("programs");
    let entries = match std::fs::read_dir(&programs) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", programs.display())),
    };
    let mut left = 0;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        match owner_pid(&name) {
            Some(pid) if !Path::new(&format!("/proc/{pid}")).exists() => {
                eprintln!("xdp-filter: removing {}, left by pid {pid} which is gone", entry.path().display());
                std::fs::remove_dir_all(entry.path())
                    .with_context(|| format!("removing {}", entry.path().display()))?;
            }
            _ => left += 1,
        }
    }
    if left == 0 {
        // No interface holds the maps: they are a crashed run's, rules and all.
        std::fs::remove_dir_all(PIN_DIR).with_context(|| format!("removing {PIN_DIR}"))?;
    } else {
        let status = run_ok(end, &["status"]).unwrap_or_default();
        eprintln!("xdp-filter: already loaded elsewhere ({left} interface(s)); its rules are shared:\n{status}");
    }
    Ok(())
}

/// The pid in an interface name of ours: `lmt<pid>n<n><side>` ([`crate::netns::TestNet`]).
fn owner_pid(iface: &str) -> Option<u32> {
    iface.strip_prefix("lmt")?.split_once('n')?.0.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_reads_counters_interfaces_and_rules() {
        let text = "CURRENT XDP-FILTER STATUS:\n\nAggregate per-action statistics:\n  XDP_ABORTED                                   0 pkts           0 KiB\n  XDP_DROP                                      3 pkts           0 KiB\n  XDP_PASS                                      5 pkts           0 KiB\n\nLoaded on interfaces:\n                                           Enabled features\nxdpfilt_alw_all\n  hb25r (native mode)                      tcp,udp,ipv6,ipv4,ethernet,allow\n\nFiltered ports:\n                                           Mode             Hit counter\n  7000                                     dst,udp          3\n\nFiltered IP addresses:\n                                           Mode             Hit counter\n  198.18.9.9                               src              0\n\nFiltered MAC addresses:\n                                           Mode             Hit counter\n\n";
        let s = Status::parse(text).unwrap();
        assert_eq!(s.dropped(), 3);
        assert_eq!(s.actions["XDP_PASS"], 5);
        assert_eq!(s.interfaces["hb25r"], "native");
        assert_eq!(s.ports[&7000], ("dst,udp".to_string(), 3));
        assert_eq!(s.port_hits(7000), 3);
        assert_eq!(s.address_hits("198.18.9.9".parse().unwrap()), 0);
        assert_eq!(s.addresses.len(), 1);
        assert!(Status::parse("nothing").is_err());
    }

    #[test]
    fn owner_pid_reads_only_our_interface_names() {
        assert_eq!(owner_pid("lmt1234n0r"), Some(1234));
        assert_eq!(owner_pid("eth0"), None);
        assert_eq!(owner_pid("lmtxn0r"), None);
    }
}

//! Two network namespaces joined by a veth pair, built with iproute2 the way xdp-tools' namespace
//! tests do, and deleted on drop (also when a test fails or panics).
//!
//! Names carry the creating process's pid (`lmt-<pid>-<n>-r`), so a later run can tell a crashed
//! run's leftovers (pid gone) from a live run's namespaces and delete only the former.

use std::{
    ffi::OsStr,
    fs::File,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Once,
        atomic::{AtomicU32, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use crate::flood::{DEFAULT_PAYLOAD, DEFAULT_SPORT, FrameSpec};
use anyhow::{Context as _, bail};
use nix::sched::{CloneFlags, setns};

/// Every namespace this harness (and `cargo xtask demo`) creates starts with this.
pub const PREFIX: &str = "lmt-";
/// iproute2 keeps named namespaces here (bind mounts of /proc/PID/ns/net).
pub const NETNS_DIR: &str = "/run/netns";

pub const RECEIVER_V4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
pub const SENDER_V4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 2);
pub const V4_PREFIX_LEN: u8 = 15;
pub const RECEIVER_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
pub const SENDER_V6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2);
pub const V6_PREFIX_LEN: u8 = 64;
/// Locally administered (0x02) MACs; unique per namespace is enough, so they are fixed.
pub const RECEIVER_MAC: [u8; 6] = [0x02, 0x6c, 0x6d, 0x74, 0x00, 0x01];
pub const SENDER_MAC: [u8; 6] = [0x02, 0x6c, 0x6d, 0x74, 0x00, 0x02];

/// One side of the pair: its namespace, its veth end and that end's addresses.
#[derive(Clone, Debug)]
pub struct End {
    pub ns: String,
    pub iface: String,
    pub mac: [u8; 6],
    pub v4: Ipv4Addr,
    pub v6: Ipv6Addr,
}

/// Receiver and sender namespaces joined by a veth pair; both namespaces go away on drop.
#[derive(Debug)]
pub struct TestNet {
    pub receiver: End,
    pub sender: End,
}

impl TestNet {
    /// Creates the namespaces and the veth pair, configures addresses, brings links up, turns
    /// rp_filter off on the receiver and waits (bounded) for both ends to be operationally up.
    pub fn new() -> anyhow::Result<Self> {
        static SWEEP: Once = Once::new();
        SWEEP.call_once(|| {
            if let Err(e) = remove_stale() {
                eprintln!("netns: removing stale namespaces failed: {e:#}");
            }
        });
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed) % 1000;
        let pid = std::process::id();
        // Interface names must fit IFNAMSIZ (15): "lmt" + pid (<= 7 digits) + "n" + n (<= 3) + 1.
        let end = |side: char, mac, v4, v6| End {
            ns: format!("{PREFIX}{pid}-{n}-{side}"),
            iface: format!("lmt{pid}n{n}{side}"),
            mac,
            v4,
            v6,
        };
        let net = Self {
            receiver: end('r', RECEIVER_MAC, RECEIVER_V4, RECEIVER_V6),
            sender: end('s', SENDER_MAC, SENDER_V4, SENDER_V6),
        };
        // From here on, dropping `net` deletes whatever part of it exists.
        net.build().with_context(|| format!("setting up namespaces {} and {}", net.receiver.ns, net.sender.ns))?;
        Ok(net)
    }

    fn build(&self) -> anyhow::Result<()> {
        let (r, s) = (&self.receiver, &self.sender);
        for end in [r, s] {
            ip(["netns", "add", &end.ns])?;
            end.run(quiet_ipv6)??;
            end.ip(["link", "set", "lo", "up"])?;
        }
        // Spoofed sources arrive on an interface the reply would not leave by: rp_filter drops them.
        r.run(|| -> anyhow::Result<()> {
            for conf in ["all", "default"] {
                sysctl(&format!("net/ipv4/conf/{conf}/rp_filter"), "0")?;
            }
            Ok(())
        })??;
        self.add_veth()
    }

    /// The veth pair with its names, MACs and addresses, permanent neighbours (no ARP or
    /// neighbour discovery, ever), up. Also re-creates it after [`TestNet::remove_veth`]: the
    /// receiver's end then has a new interface index.
    pub fn add_veth(&self) -> anyhow::Result<()> {
        let (r, s) = (&self.receiver, &self.sender);
        ip([
            "-n",
            &r.ns,
            "link",
            "add",
            &r.iface,
            "address",
            &mac_str(&r.mac),
            "type",
            "veth",
            "peer",
            "name",
            &s.iface,
            "address",
            &mac_str(&s.mac),
            "netns",
            &s.ns,
        ])?;
        for end in [r, s] {
            end.ip(["addr", "add", &format!("{}/{V4_PREFIX_LEN}", end.v4), "dev", &end.iface])?;
            end.ip(["addr", "add", &format!("{}/{V6_PREFIX_LEN}", end.v6), "dev", &end.iface, "nodad"])?;
            end.ip(["link", "set", &end.iface, "up"])?;
        }
        for (end, peer) in [(r, s), (s, r)] {
            for addr in [IpAddr::from(peer.v4), IpAddr::from(peer.v6)] {
                end.ip([
                    "neigh",
                    "replace",
                    &addr.to_string(),
                    "lladdr",
                    &mac_str(&peer.mac),
                    "dev",
                    &end.iface,
                    "nud",
                    "permanent",
                ])?;
            }
        }
        for end in [r, s] {
            end.wait_up(Duration::from_secs(5))?;
        }
        Ok(())
    }

    /// Frames from the sender's MAC to the receiver's, to its IPv4 or IPv6 address and `dport`,
    /// from the default source port with the default payload.
    pub fn frames_to(&self, v6: bool, dport: u16) -> FrameSpec {
        FrameSpec {
            src_mac: self.sender.mac,
            dst_mac: self.receiver.mac,
            dst: self.receiver.addr(v6),
            sport: DEFAULT_SPORT,
            dport,
            payload: DEFAULT_PAYLOAD,
        }
    }

    /// Deletes the veth pair (from the receiver's side: both ends go).
    pub fn remove_veth(&self) -> anyhow::Result<()> {
        self.receiver.ip(["link", "del", "dev", &self.receiver.iface])?;
        Ok(())
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for ns in [&self.receiver.ns, &self.sender.ns] {
            if let Err(e) = delete_netns(ns) {
                eprintln!("netns: {e:#}");
            }
        }
    }
}

/// The kernels on either side must send nothing once the fixture is up: a stray packet would be
/// counted by the limiter, and would pull the receiver's NAPI (and so XDP) onto whatever CPU
/// sent it. So: no DAD, no router solicitations, no link-local addresses, and the MLD reports
/// that joining the solicited-node groups still causes are all sent within a few ms of link-up
/// (the retransmission comes up to one "unsolicited report interval" later: 1 s by default).
fn quiet_ipv6() -> anyhow::Result<()> {
    for conf in ["all", "default"] {
        sysctl(&format!("net/ipv6/conf/{conf}/accept_dad"), "0")?;
        sysctl(&format!("net/ipv6/conf/{conf}/router_solicitations"), "0")?;
        sysctl(&format!("net/ipv6/conf/{conf}/addr_gen_mode"), "1")?;
        sysctl(&format!("net/ipv6/conf/{conf}/mldv1_unsolicited_report_interval"), "1")?;
        sysctl(&format!("net/ipv6/conf/{conf}/mldv2_unsolicited_report_interval"), "1")?;
    }
    Ok(())
}

impl End {
    /// Runs `f` on a new thread inside this namespace and returns its result. Borrows are fine:
    /// the thread is scoped. Interface indexes and netlink requests there see this namespace.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
        run_in(&self.ns, f)
    }

    /// Like [`End::run`], but the thread outlives the call (for receivers and floods that run
    /// while the test does something else).
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> thread::JoinHandle<anyhow::Result<T>> {
        spawn_in(&self.ns, f)
    }

    /// `program` to be run inside this namespace (`ip netns exec` execs it: the child's pid is
    /// the program's own, so signals sent to it reach the program).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        netns_command(&self.ns, program)
    }

    pub fn ip<const N: usize>(&self, args: [&str; N]) -> anyhow::Result<String> {
        let mut full = vec!["-n", self.ns.as_str()];
        full.extend(args);
        ip(full)
    }

    pub fn addr(&self, v6: bool) -> IpAddr {
        if v6 { self.v6.into() } else { self.v4.into() }
    }

    /// `ip -d link show` of this end's interface, e.g. to see whether an XDP program is attached.
    pub fn link_details(&self) -> anyhow::Result<String> {
        self.ip(["-d", "link", "show", "dev", &self.iface])
    }

    fn wait_up(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let state = self.ip(["-j", "link", "show", "dev", &self.iface])?;
            if state.contains("\"operstate\":\"UP\"") {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!("{} in {} not up after {timeout:?}: {state}", self.iface, self.ns);
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Moves the calling thread into namespace `ns` (for good: use a dedicated thread).
pub fn enter(ns: &str) -> anyhow::Result<()> {
    let path = Path::new(NETNS_DIR).join(ns);
    let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    setns(&file, CloneFlags::CLONE_NEWNET).with_context(|| format!("setns into {ns}"))
}

/// Runs `f` on a scoped thread inside namespace `ns`. A panic in `f` propagates.
pub fn run_in<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
    thread::scope(|scope| {
        let handle = scope.spawn(|| enter(ns).map(|()| f()));
        match handle.join() {
            Ok(result) => result,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Runs `f` on a new thread inside namespace `ns`.
pub fn spawn_in<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> thread::JoinHandle<anyhow::Result<T>> {
    let ns = ns.to_string();
    thread::spawn(move || enter(&ns).map(|()| f()))
}

pub fn netns_command(ns: &str, program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", ns]).arg(program);
    cmd
}

/// Runs `ip ARGS`; fails with the command line and ip's own message.
pub fn ip<I, S>(args: I) -> anyhow::Result<String>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut cmd = Command::new("ip");
    cmd.args(args);
    let line = describe(&cmd);
    let out = cmd.output().with_context(|| format!("could not run `{line}` (is iproute2 installed?)"))?;
    if !out.status.success() {
        bail!("`{line}` failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program()).chain(cmd.get_args()).map(|a| a.to_string_lossy()).collect::<Vec<_>>().join(" ")
}

/// Writes a sysctl of the calling thread's network namespace (`/proc/sys/net` follows the
/// opening thread's namespace).
pub fn sysctl(key: &str, value: &str) -> anyhow::Result<()> {
    let path = Path::new("/proc/sys").join(key);
    std::fs::write(&path, value).with_context(|| format!("writing {value} to {}", path.display()))
}

pub fn mac_str(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

fn delete_netns(ns: &str) -> anyhow::Result<()> {
    if Path::new(NETNS_DIR).join(ns).exists() {
        ip(["netns", "delete", ns])?;
    }
    Ok(())
}

/// The pid a namespace name of ours carries (`lmt-<pid>-...`).
pub fn owner_pid(ns: &str) -> Option<u32> {
    ns.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
}

/// A leftover of ours: a directory entry named after a process (`lmt-<pid>-...`) that is gone.
#[derive(Clone, Debug)]
pub struct Stale {
    pub name: String,
    pub path: PathBuf,
    pub pid: u32,
}

/// The entries of `dir` left behind by a process of ours that is gone (a crashed or killed run).
pub fn stale(dir: &Path) -> std::io::Result<impl Iterator<Item = Stale>> {
    Ok(std::fs::read_dir(dir)?.flatten().filter_map(|entry| {
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = owner_pid(&name)?;
        (!Path::new(&format!("/proc/{pid}")).exists()).then(|| Stale { name, path: entry.path(), pid })
    }))
}

/// Deletes namespaces of ours whose creating process is gone (a crashed or killed run).
pub fn remove_stale() -> anyhow::Result<()> {
    let leftovers = match stale(Path::new(NETNS_DIR)) {
        Ok(leftovers) => leftovers,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).context(format!("listing {NETNS_DIR}")),
    };
    for Stale { name, pid, .. } in leftovers {
        eprintln!("netns: deleting {name}, left behind by pid {pid} which is gone");
        delete_netns(&name)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pid_reads_only_our_names() {
        assert_eq!(owner_pid("lmt-1234-0-r"), Some(1234));
        assert_eq!(owner_pid("lmt-77-demo-s"), Some(77));
        assert_eq!(owner_pid("lmt-x-0-r"), None);
        assert_eq!(owner_pid("other-1234-0-r"), None);
    }

    #[test]
    fn interface_names_fit_ifnamsiz() {
        let longest = format!("lmt{}n{}r", 4_194_304, 999);
        assert!(longest.len() <= 15, "{longest}");
    }
}

//! What the ban tests share (tests/daemon/bans.rs, ban_capacity.rs, ban_rules.rs,
//! ban_crashes.rs, ban_clock.rs): a [`BanRig`] whose daemon keeps its bans in a state directory
//! of the test's own, one such test at a time per test binary; probes from a source; the
//! kernel's ban maps read from their pins; `deny list --json`; the CLI fed a list on its
//! standard input; one raw request on the socket; test addresses by the million; and another
//! client asking `stats` all along while a test does something long.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::unix::net::UnixStream,
    path::Path,
    process::Stdio,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use aya::maps::{HashMap, LpmTrie, Map, MapData};
use limiter_common::maps::{Ban, MAP_BAN_NETS_V4, MAP_BANS_V4, MAP_BANS_V6};
use serde_json::Value;

use crate::{
    daemon::{Ctl, Launch},
    flood::{L4, Limits},
    rig::{Rig, flow_of},
};

/// One test of a target at a time, whatever `--test-threads` says (`cargo xtask test` runs them
/// one by one anyway): the timings asserted must not share the CPUs with a million bans being
/// loaded beside them.
static SERIAL: Mutex<()> = Mutex::new(());

/// A rig whose daemon keeps its runtime state in a directory of the test's own, holding the
/// target's lock ([`SERIAL`]). Fields drop in order: the daemon stops (saving its bans), then
/// the state directory goes, then the next test may start.
pub struct BanRig {
    pub rig: Rig,
    pub state: tempfile::TempDir,
    _serial: MutexGuard<'static, ()>,
}

impl std::ops::Deref for BanRig {
    type Target = Rig;

    fn deref(&self) -> &Rig {
        &self.rig
    }
}

impl std::ops::DerefMut for BanRig {
    fn deref_mut(&mut self) -> &mut Rig {
        &mut self.rig
    }
}

/// The daemon's arguments: its state in `state`, no rotation, no metrics endpoint.
pub fn args(state: &Path) -> Vec<&str> {
    vec!["--rotate-every", "off", "--metrics", "off", "--state-dir", state.to_str().expect("a UTF-8 path")]
}

impl BanRig {
    pub fn start() -> Self {
        Self::start_with(Launch::default())
    }

    /// [`BanRig::start`], the daemon launched the way `launch` says (more environment, a wrapper).
    pub fn start_with(launch: Launch) -> Self {
        let serial = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let state = tempfile::Builder::new().prefix("limiter-state").tempdir().expect("a state directory");
        let rig = Rig::start_launched(launch, &args(state.path())).expect("starting the rig");
        Self { rig, state, _serial: serial }
    }

    /// A new daemon on the same state directory (the old one must have exited).
    pub fn restart_kept(&mut self) {
        self.restart_kept_with(Launch::default());
    }

    /// [`BanRig::restart_kept`], the daemon launched the way `launch` says.
    pub fn restart_kept_with(&mut self, launch: Launch) {
        let state = self.state.path().to_path_buf();
        self.rig.restart_launched(launch, &args(&state)).expect("restarting");
    }

    /// The snapshot file of the rig's interface in the state directory.
    pub fn bans_file(&self) -> std::path::PathBuf {
        self.state.path().join(format!("bans-{}.json", self.rig.net.receiver.iface))
    }
}

/// `n` UDP frames from `src` to `port`, paced at 500/s: how many arrived.
pub fn probes(rig: &Rig, src: &str, port: u16, n: u64) -> u64 {
    let stream = rig.stream(L4::Udp, port, src);
    let run = rig
        .flood(std::slice::from_ref(&stream), Limits::counted(n, Duration::from_secs(5)), Some(500.0))
        .expect("probes");
    assert_eq!(run.sent(&flow_of(&stream)), n, "probes sent from {src}");
    run.delivered(&flow_of(&stream))
}

/// Entries in the pinned exact-address ban map of one family.
pub fn kernel_bans(rig: &Rig, v6: bool) -> usize {
    let pin = rig.scratch.pin_dir(&rig.net.receiver.iface).join(if v6 { MAP_BANS_V6 } else { MAP_BANS_V4 });
    let data = MapData::from_pin(&pin).unwrap_or_else(|e| panic!("opening {}: {e}", pin.display()));
    if v6 {
        let map: HashMap<_, [u8; 16], Ban> = HashMap::try_from(Map::HashMap(data)).expect("a hash map");
        map.keys().count()
    } else {
        let map: HashMap<_, [u8; 4], Ban> = HashMap::try_from(Map::HashMap(data)).expect("a hash map");
        map.keys().count()
    }
}

/// The pinned IPv4 ban maps' entries (exact and prefixes), as text (`198.18.0.5/32`).
pub fn kernel_v4_nets(rig: &Rig) -> Vec<String> {
    let pins = rig.scratch.pin_dir(&rig.net.receiver.iface);
    let open = |name: &str| {
        let pin = pins.join(name);
        MapData::from_pin(&pin).unwrap_or_else(|e| panic!("opening {}: {e}", pin.display()))
    };
    let exact: HashMap<_, [u8; 4], Ban> = HashMap::try_from(Map::HashMap(open(MAP_BANS_V4))).expect("a hash map");
    let mut nets: Vec<String> = exact.keys().map(|k| format!("{}/32", Ipv4Addr::from(k.expect("a key")))).collect();
    let trie: LpmTrie<_, [u8; 4], Ban> = LpmTrie::try_from(Map::LpmTrie(open(MAP_BAN_NETS_V4))).expect("a trie");
    nets.extend(trie.keys().map(|k| {
        let k = k.expect("a key");
        format!("{}/{}", Ipv4Addr::from(k.data()), k.prefix_len())
    }));
    nets.sort();
    nets
}

/// `deny list --json`, parsed.
pub fn deny_list(rig: &Rig) -> Vec<Value> {
    let out = rig.ctl_ok(&["deny", "list", "--json"]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("deny list --json ({e}): {out}"))
}

/// `limiter-ctl ARGS` started with `input` on its standard input (fed by a thread of its own);
/// the caller waits for it ([`ctl_with_input`] does).
pub fn spawn_with_input(rig: &Rig, args: &[&str], input: &str) -> (std::process::Child, thread::JoinHandle<()>) {
    let bin = crate::daemon::limiter_ctl_binary().expect("limiter-ctl");
    let mut cmd = Ctl::command(&bin, &rig.scratch.socket(), args);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("running limiter-ctl");
    let mut stdin = child.stdin.take().expect("stdin");
    let text = input.to_string();
    let writer = thread::spawn(move || {
        let _ = stdin.write_all(text.as_bytes());
    });
    (child, writer)
}

/// `limiter-ctl ARGS` with `input` on its standard input.
pub fn ctl_with_input(rig: &Rig, args: &[&str], input: &str) -> Ctl {
    let (child, writer) = spawn_with_input(rig, args, input);
    let out = child.wait_with_output().expect("limiter-ctl's output");
    writer.join().expect("the writer");
    Ctl {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// One request line on the socket, its answer line.
pub fn raw_request(socket: &Path, line: &str) -> String {
    let mut stream = UnixStream::connect(socket).expect("connecting");
    stream.write_all(line.as_bytes()).and_then(|()| stream.write_all(b"\n")).expect("writing");
    let mut answer = String::new();
    BufReader::new(stream).read_line(&mut answer).expect("reading");
    answer
}

/// `n` addresses, one per line: IPv4 from 240.0.0.0 (reserved, never a real source) or IPv6
/// in 2001:db8:b::/48.
pub fn addresses(n: u32, v6: bool) -> String {
    let mut out = String::with_capacity(n as usize * 24);
    for i in 0..n {
        let addr: IpAddr = if v6 {
            Ipv6Addr::new(0x2001, 0xdb8, 0xb, 0, 0, 0, (i >> 16) as u16, i as u16).into()
        } else {
            Ipv4Addr::from(0xf000_0000 + i).into()
        };
        out.push_str(&addr.to_string());
        out.push('\n');
    }
    out
}

/// How long the client asking `stats` pauses between answers: any stall of the daemon longer
/// than this shows in its waits, and it leaves the 2 CPUs to the work it watches (asking
/// without a pause, it took a third of a list's time).
const STATS_EVERY: Duration = Duration::from_millis(5);

/// Another client asking `stats` in a loop (every [`STATS_EVERY`]) while `work` runs: how many
/// answers it got meanwhile, and the longest wait for one.
pub fn while_asking_stats<T>(rig: &Rig, work: impl FnOnce() -> T) -> (T, usize, Duration) {
    let (result, waits) = timing_stats(rig, work);
    (result, waits.len(), waits.last().copied().unwrap_or_default())
}

/// [`while_asking_stats`], with every wait, shortest first.
pub fn timing_stats<T>(rig: &Rig, work: impl FnOnce() -> T) -> (T, Vec<Duration>) {
    /// Stops the asker however `work` ends (a failed assertion too), before the rig goes.
    struct Stop(Arc<AtomicBool>, Option<thread::JoinHandle<Vec<Duration>>>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
            if let Some(asker) = self.1.take() {
                let _ = asker.join();
            }
        }
    }
    let (socket, flag) = (rig.scratch.socket(), Arc::new(AtomicBool::new(false)));
    let stop = flag.clone();
    let asker = thread::spawn(move || {
        let mut waits = Vec::new();
        while !flag.load(Ordering::Relaxed) {
            let start = Instant::now();
            let answer = raw_request(&socket, r#"{"op":"stats"}"#);
            assert!(answer.contains(r#""status":"ok""#), "{answer}");
            waits.push(start.elapsed());
            thread::sleep(STATS_EVERY);
        }
        waits
    });
    let mut guard = Stop(stop, Some(asker));
    let result = work();
    guard.0.store(true, Ordering::Relaxed);
    let mut waits = guard.1.take().map(|a| a.join().expect("the stats client")).unwrap_or_default();
    waits.sort();
    (result, waits)
}

//! What a DaemonSet relies on, on the real kernel: a config mounted the way kubelet mounts a
//! ConfigMap volume (read-only, `limiter.toml -> ..data/limiter.toml`, `..data ->
//! ..<timestamp>`) and swapped the way kubelet swaps it is followed live, and the probes on the
//! metrics listener say what the daemon is doing.
//!
//! kubelet's swap (atomic_writer.go): a new timestamped directory with the files, a symlink
//! `..data_tmp` to it, `..data_tmp` renamed over `..data`, the old directory removed.

use std::{
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    thread,
    time::{Duration, Instant},
};

use limiter_tests::{
    daemon::{Daemon, Launch, Scratch},
    flood::{L4, Limits},
    netns::{PREFIX, TestNet},
    policies::{Pol, PolicyRig as _, expected, policies_json, reloads, running, toml, wait_running},
    require_root,
    rig::{METRICS, Rig, flow_of},
    scrape,
};

/// The promise: a valid change is in force this long after the swap.
const APPLIED_WITHIN: Duration = Duration::from_secs(2);

/// A ConfigMap volume: `writable` is kubelet's side (the host path it writes), `mounted` the
/// container's read-only bind mount of it, unmounted on drop (then the directory goes). Not
/// under the daemon's [`Scratch`], whose drop could not remove a mount.
struct ConfigMapVolume {
    writable: PathBuf,
    mounted: PathBuf,
    _dir: tempfile::TempDir,
}

impl ConfigMapVolume {
    fn new(first: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{PREFIX}{}-cm-", std::process::id()))
            .tempdir()
            .expect("a directory for the volume");
        let writable = dir.path().join("kubelet");
        let mounted = dir.path().join("etc-limiter");
        std::fs::create_dir(&writable).expect("kubelet's directory");
        std::fs::create_dir(&mounted).expect("the mount point");
        let volume = Self { writable, mounted, _dir: dir };
        volume.swap(first);
        symlink("..data/limiter.toml", volume.writable.join("limiter.toml")).expect("limiter.toml -> ..data/");
        mount(&["--bind", path(&volume.writable), path(&volume.mounted)]);
        mount(&["-o", "remount,bind,ro", path(&volume.mounted)]);
        volume
    }

    fn config(&self) -> PathBuf {
        self.mounted.join("limiter.toml")
    }

    /// Publishes `text` as kubelet does; returns when `..data` points at it.
    fn swap(&self, text: &str) {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let stamp = format!("..2026_12_04_13_00_00.{:09}", NEXT.fetch_add(1, Ordering::Relaxed));
        let dir = self.writable.join(&stamp);
        std::fs::create_dir(&dir).expect("the timestamped directory");
        std::fs::write(dir.join("limiter.toml"), text).expect("writing the new limiter.toml");
        let old = std::fs::read_link(self.writable.join("..data")).ok();
        symlink(&stamp, self.writable.join("..data_tmp")).expect("..data_tmp");
        std::fs::rename(self.writable.join("..data_tmp"), self.writable.join("..data")).expect("..data_tmp -> ..data");
        if let Some(old) = old {
            std::fs::remove_dir_all(self.writable.join(old)).expect("removing the old directory");
        }
    }
}

impl Drop for ConfigMapVolume {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("--lazy").arg(&self.mounted).status();
    }
}

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

fn mount(args: &[&str]) {
    let status = Command::new("mount").args(args).status().expect("running mount");
    assert!(status.success(), "mount {args:?}: {status}");
}

fn names(rig: &Rig) -> Vec<String> {
    policies_json(rig).iter().map(|d| d["name"].as_str().unwrap_or_default().to_string()).collect()
}

/// A read-only ConfigMap volume whose policies are not sorted by name starts the daemon (the
/// file untouched); kubelet's swap is in force (listed, in the kernel, enforced) within 2 s; an
/// invalid swap is refused (logged once, counted) and the running policies stay; two swaps in a
/// row end on the last; `policy set` on the read-only file fails and changes nothing.
#[test]
fn a_configmap_volume_is_followed_live() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch directory");
    let zeta = Pol::new("zeta", "udp:7001", 300, 30);
    let alpha = Pol::new("alpha", "udp:7000", 100, 10);
    let first = format!("# not sorted by name\n\n{}{}", toml(&zeta), toml(&alpha));
    let volume = ConfigMapVolume::new(&first);
    assert!(std::fs::write(volume.config(), "x").is_err(), "the mounted config is writable: not read-only");
    let launch = Launch { config: Some(volume.config()), ..Launch::default() };
    let daemon = Daemon::launch(&net.receiver, &scratch, &["--rotate-every", "off", "--watch-config=true"], launch)
        .expect("spawning");
    let mut rig = Rig { daemon, scratch, net };
    rig.daemon.wait_attached(&rig.net.receiver).expect("the daemon must start on a read-only, unsorted config");
    assert_eq!(names(&rig), ["alpha", "zeta"]);
    assert_eq!(std::fs::read_to_string(volume.config()).expect("reading"), first, "the file changed");
    let applied = reloads(&rig, "applied");

    // A valid swap: alpha faster, zeta gone, beta new.
    let alpha2 = Pol::new("alpha", "udp:7000", 400, 40);
    let beta = Pol::new("beta", "udp:7002", 200, 20);
    let swapped = Instant::now();
    volume.swap(&format!("{}{}", toml(&beta), toml(&alpha2)));
    let took = wait_running(&rig, &expected(&[&alpha2, &beta]), swapped, APPLIED_WITHIN * 3);
    eprintln!("swap to applied: {took:?}");
    let took = took
        .unwrap_or_else(|| panic!("the swap was not applied; running {:?}\n{}", running(&rig), rig.daemon.output()));
    assert!(took <= APPLIED_WITHIN, "the swap took {took:?} to apply (more than {APPLIED_WITHIN:?})");
    rig.check_installed(&alpha2, rig.policy_id("alpha"));
    rig.check_installed(&beta, rig.policy_id("beta"));
    assert_eq!(reloads(&rig, "applied"), applied + 1, "one swap, one reload");
    let stream = rig.stream(L4::Udp, 7000, "198.19.1.1");
    let run = rig.counted_flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(500)));
    rig.check_policy(&alpha2, &run, &[vec![flow_of(&stream)]]);

    // An invalid swap: refused, counted, logged once; the running policies stay.
    let listed = rig.ctl_ok(&["policy", "list", "--json"]);
    let rules = rig.snapshot().rules;
    let refused = reloads(&rig, "refused");
    let swapped = Instant::now();
    volume.swap("[[policy]\nname = \"alpha\"\n");
    while reloads(&rig, "refused") == refused && swapped.elapsed() < APPLIED_WITHIN * 3 {
        thread::sleep(Duration::from_millis(20));
    }
    eprintln!("swap to refused: {:?}", swapped.elapsed());
    assert_eq!(
        reloads(&rig, "refused"),
        refused + 1,
        "the invalid swap was not refused (once)\n{}",
        rig.daemon.output()
    );
    assert!(rig.daemon.is_running(), "the daemon exited:\n{}", rig.daemon.output());
    assert_eq!(rig.snapshot().rules, rules, "the kernel rules changed on a refused file");
    assert_eq!(rig.ctl_ok(&["policy", "list", "--json"]), listed, "`policy list` changed on a refused file");

    // Two swaps in a row: the last one runs, and stays.
    let alpha3 = Pol::new("alpha", "udp:7000", 500, 50);
    let alpha4 = Pol::new("alpha", "udp:7000", 600, 60);
    let swapped = Instant::now();
    volume.swap(&toml(&alpha3));
    volume.swap(&format!("{}{}", toml(&alpha4), toml(&zeta)));
    let want = expected(&[&alpha4, &zeta]);
    let took =
        wait_running(&rig, &want, swapped, APPLIED_WITHIN * 3).unwrap_or_else(|| panic!("running {:?}", running(&rig)));
    eprintln!("double swap to applied: {took:?}");
    assert!(took <= APPLIED_WITHIN, "the double swap took {took:?}");
    // Past the watch's longest settling (1 s): nothing older comes after it.
    thread::sleep(Duration::from_millis(1500));
    assert_eq!(running(&rig), want, "a double swap must end on the last one");
    rig.check_installed(&alpha4, rig.policy_id("alpha"));

    // `policy set` cannot write the read-only file: it fails, and nothing changes.
    let rules = rig.snapshot().rules;
    let out = rig.daemon.ctl(&["policy", "set", "alpha", "--rate", "1/s"]).expect("running limiter-ctl");
    assert_ne!(out.code, Some(0), "policy set on a read-only config succeeded: {out:?}");
    assert_eq!(rig.snapshot().rules, rules, "a failed policy set changed the kernel rules");
    assert_eq!(running(&rig), want, "a failed policy set changed the running policies");
    rig.daemon.poll();
    let refusals = rig.daemon.output().lines().filter(|l| l.contains("reload refused")).count();
    assert_eq!(refusals, 1, "one refused file, one log line:\n{}", rig.daemon.output());
}

/// The daemon's own writes (`policy set` rewrites its file) are no reload: the watch sees the
/// write and finds the bytes it wrote. And `--watch-config=false` leaves a changed file alone.
#[test]
fn own_writes_are_not_reloaded_and_the_watch_can_be_turned_off() {
    require_root!();
    let mut rig = Rig::start(&["--rotate-every", "off", "--watch-config=true"]).expect("starting the rig");
    let applied = reloads(&rig, "applied");
    for rate in [100, 200, 300] {
        rig.set(&Pol::new("dns", "udp:53", rate, 10));
    }
    // A hand edit still applies. It is also the barrier for the writes above: the watch
    // handles the directory's events in order, so once the edit's reload is counted, any reload
    // the daemon's own writes caused has been counted too (no sleep to wait them out).
    let text = toml(&Pol::new("dns", "udp:53", 700, 70));
    let edited = Instant::now();
    std::fs::write(rig.scratch.config(), &text).expect("editing");
    let took = wait_running(&rig, &[("dns".into(), "700/s".into())], edited, APPLIED_WITHIN * 3)
        .expect("the edit was not applied");
    eprintln!("edit in place to applied: {took:?}");
    assert!(took <= APPLIED_WITHIN);
    while reloads(&rig, "applied") == applied && edited.elapsed() < APPLIED_WITHIN * 3 {
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(reloads(&rig, "applied"), applied + 1, "the daemon reloaded its own writes (or not the edit)");
    assert_eq!(reloads(&rig, "refused"), 0);

    // A FIFO in its place is refused without a wait (opened non-blocking): the loop answers.
    let refused = reloads(&rig, "refused");
    std::fs::remove_file(rig.scratch.config()).expect("removing the config");
    nix::unistd::mkfifo(&rig.scratch.config(), nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR)
        .expect("mkfifo");
    let swapped = Instant::now();
    while reloads(&rig, "refused") == refused && swapped.elapsed() < APPLIED_WITHIN * 3 {
        thread::sleep(Duration::from_millis(20));
    }
    assert!(reloads(&rig, "refused") > refused, "a FIFO was not refused\n{}", rig.daemon.output());
    assert_eq!(running(&rig), [("dns".to_string(), "700/s".to_string())], "a refused FIFO changed the policies");
    std::fs::remove_file(rig.scratch.config()).expect("removing the FIFO");
    std::fs::write(rig.scratch.config(), &text).expect("restoring the config");

    rig.daemon.stop_ok();
    rig.restart(&["--rotate-every", "off", "--watch-config=false"]).expect("restarting without the watch");
    std::fs::write(rig.scratch.config(), toml(&Pol::new("dns", "udp:53", 900, 90))).expect("editing");
    thread::sleep(APPLIED_WITHIN);
    assert_eq!(running(&rig), [("dns".to_string(), "700/s".to_string())], "--watch-config=false applied an edit");
    rig.hup("reloaded");
    assert_eq!(running(&rig), [("dns".to_string(), "900/s".to_string())], "SIGHUP must still apply it");
}

/// `/readyz` says 503 and why while the daemon waits for its interface, 200 once attached;
/// `/livez` says 200 throughout.
#[test]
fn probes_say_ready_only_once_attached() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch directory");
    std::fs::write(scratch.config(), toml(&Pol::new("dns", "udp:53", 100, 10))).expect("config");
    let late = format!("{}x", net.receiver.iface);
    let extra = ["--iface", late.as_str(), "--wait-iface", "60s", "--mode", "auto"];
    let mut daemon = Daemon::spawn(&net.receiver, &scratch, &extra).expect("spawning");
    let get =
        |p: &'static str| net.receiver.run(move || scrape::get(METRICS, p, Duration::from_secs(5))).and_then(|r| r);
    daemon.wait_for(|l| l.contains("waiting for it"), Duration::from_secs(30)).expect("waiting for the interface");
    let ready = get("/readyz").expect("GET /readyz while waiting");
    assert_eq!(ready.status, 503, "{ready:?}");
    assert!(ready.body.contains(&format!("waiting for interface {late}")), "{:?}", ready.body);
    assert_eq!(ready.body.lines().count(), 1, "one line: {:?}", ready.body);
    assert_eq!(get("/livez").expect("GET /livez while waiting").status, 200);

    let made = Command::new("ip")
        .args(["-n", &net.receiver.ns, "link", "add", &late, "type", "veth", "peer", "name", &format!("{late}p")])
        .status()
        .expect("ip link add");
    assert!(made.success());
    daemon.wait_for(|l| l.contains("attached"), Duration::from_secs(30)).expect("attached once the interface came");
    let ready = get("/readyz").expect("GET /readyz");
    assert_eq!((ready.status, ready.body.as_str()), (200, "ready\n"));
    let live = get("/livez").expect("GET /livez");
    assert_eq!(live.status, 200, "{live:?}");
    daemon.stop_ok();
}

//! Sharing the interface with other programs (issue 25): the limiter at tcx ingress beside
//! Debian's xdp-filter at XDP (`xdp_filter`), beside another tcx program in a chosen order, and
//! moved from XDP to tcx under a flood (`neighbours`); at tc ingress through a netlink filter, as
//! on a kernel without tcx (issue 38: `netlink`); at tc ingress because XDP refused the program,
//! and why said in one line (`refused`); a move cut short by a SIGKILL at each of its
//! steps (`interrupted`); and never beside another limiter (`instances`).
//!
//! What got through is counted by a tally ([`Neighbour::tally`]: a tcx program the test puts
//! last in the chain, counting per flow what every program before it let through), not by a
//! packet capture: an AF_PACKET tap sees a frame before tc ingress runs, so it would count what
//! the limiter at tcx then drops. What xdp-filter dropped at XDP reaches neither the tally nor
//! the limiter, and its own counters (`xdp-filter status`) say how many it dropped. Floods are
//! bounded in time, pinned to one CPU ([`flood_cpu`]), and every count is held to what was sent.

mod instances;
mod interrupted;
mod neighbours;
mod netlink;
mod refused;
mod xdp_filter;

use std::{
    collections::BTreeMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use aya::programs::links::LinkType;
use limiter_common::{Gcra, maps::Counters};
use limiter_tests::{
    bounds::{self, Judged, check_lower, check_upper},
    cpu::flood_cpu,
    daemon::{Daemon, Launch, Scratch},
    flood::{Flow, L4, Limits, Report, Sources, Stream},
    neighbour::{Neighbour, tcx_names},
    netns::{End, TestNet},
    observe,
    policies::{gcra, src},
    rig::{Flooding, Rig, Run, STEADY_SHARE, flow_of},
};

/// The daemon's flags in these tests: one policy ("default") over everything, per source, at a
/// rate a flood exceeds.
pub const ARGS: [&str; 6] = ["--rate", "1000/s", "--burst", "400", "--buckets", "1024"];
/// [`ARGS`]'s rate, per second.
pub const RATE: f64 = 1000.0;

/// The GCRA of [`ARGS`]'s policy, computed here.
pub fn limit() -> Gcra {
    gcra(1000, 400)
}

/// How long each flood runs.
pub const FLOOD: Duration = Duration::from_secs(2);

/// A daemon started on `net`'s receiver with `extra` arguments ([`ARGS`] come first), its start
/// line waited for, wrapped in a [`Rig`] (which owns `net` from then on).
pub fn start_daemon(net: TestNet, extra: &[&str]) -> (Rig, String) {
    start_daemon_with(net, extra, &[])
}

/// [`start_daemon`] with more environment (a test hook: [`netlink::NO_TCX`]).
pub fn start_daemon_with(net: TestNet, extra: &[&str], env: &[(&str, &str)]) -> (Rig, String) {
    let scratch = Scratch::new().expect("scratch directory");
    let args: Vec<&str> = ARGS.iter().copied().chain(extra.iter().copied()).collect();
    let launch = Launch { env: environment(env), ..Launch::default() };
    let mut daemon = Daemon::launch(&net.receiver, &scratch, &args, launch).expect("starting the daemon");
    let line = daemon.wait_attached(&net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("daemon: {line}");
    (Rig { daemon, scratch, net }, line)
}

/// A daemon with [`ARGS`] and `extra` (and `env`) on `end` that must refuse to start: it exits
/// with `code` and says why in exactly one error line, which is returned.
#[track_caller]
pub fn refused_start(end: &End, extra: &[&str], env: &[(&str, &str)], code: i32) -> String {
    let scratch = Scratch::new().expect("scratch directory");
    let args: Vec<&str> = ARGS.iter().copied().chain(extra.iter().copied()).collect();
    let launch = Launch { env: environment(env), ..Launch::default() };
    let mut daemon = Daemon::launch(end, &scratch, &args, launch).expect("starting the daemon");
    let status = daemon.wait_exit(Duration::from_secs(30)).expect("the daemon should exit");
    let out = daemon.output();
    eprintln!("{extra:?}: {status}\n{out}");
    assert_eq!(status.code(), Some(code), "{extra:?}: {out}");
    let errors: Vec<&str> = out.lines().filter(|l| l.contains("error")).collect();
    assert_eq!(errors.len(), 1, "{extra:?}: not one error line:\n{out}");
    errors[0].to_string()
}

/// `env` as [`Launch::env`] takes it.
pub fn environment(env: &[(&str, &str)]) -> Vec<(String, std::ffi::OsString)> {
    env.iter().map(|(k, v)| (k.to_string(), v.into())).collect()
}

/// The hook of the link the daemon pinned (and that link's program is the daemon's).
#[track_caller]
pub fn pinned_hook(rig: &Rig) -> LinkType {
    let link = rig.daemon.link().expect("reading the pinned link").expect("the daemon pinned no link");
    assert_eq!(Some(link.program), rig.daemon.program().ok(), "the pinned link holds another program");
    link.link_type
}

/// UDP from `source` to `port` (the receiver's IPv4 address).
pub fn udp(net: &TestNet, source: &str, port: u16) -> Stream {
    let source = src(source);
    Stream { spec: net.frames_to(source.is_ipv6(), port), l4: L4::Udp, sources: Sources::One(source) }
}

/// `streams` (interleaved) at full speed from the sender's namespace, pinned to [`flood_cpu`],
/// for [`FLOOD`], with no capture; returns once the receiver's side went quiet (`tally`
/// unchanged for a while), with when it last changed (a bound on the last delivery).
pub fn flood(net: &TestNet, streams: &[Stream], tally: &Neighbour) -> (Run, Instant) {
    let limits = Limits::timed(FLOOD).on_cpu(flood_cpu());
    let run = Flooding::start(&net.sender, streams, limits, None, None).finish().expect("flood");
    eprintln!("flood: {}", run.report);
    let last = settle(tally);
    (run, last)
}

/// Waits until `tally` saw nothing new for 200 ms (at most 5 s); when it last saw something.
pub fn settle(tally: &Neighbour) -> Instant {
    let quiet = Duration::from_millis(200);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut seen = tally.counts().expect("tally").seen;
    let mut changed = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(10));
        let now = tally.counts().expect("tally").seen;
        if now != seen {
            (seen, changed) = (now, Instant::now());
        } else if changed.elapsed() >= quiet {
            return changed;
        }
        assert!(Instant::now() < deadline, "the receiver never went quiet after the flood");
    }
}

/// The per-CPU counters of policy `id`, from the daemon's pins (whichever hook judges).
pub fn counters(rig: &Rig, id: u16) -> Vec<Counters> {
    rig.snapshot().counters.get(usize::from(id)).cloned().unwrap_or_default()
}

/// What `tally` counted of each flow since `before`.
pub fn flows_since(now: &BTreeMap<Flow, u64>, before: &BTreeMap<Flow, u64>, flow: &Flow) -> u64 {
    now.get(flow).copied().unwrap_or(0) - before.get(flow).copied().unwrap_or(0)
}

/// The limiter held each source to its bound: every frame sent to it judged (and nothing else
/// reached it: `judged` counts exactly `judged_sent`), what it admitted got through (`through`,
/// one count per source, each its own bucket) and no more, and each source's share within [90%
/// of the allowance over the flood, the bound over the window to `last`].
#[track_caller]
pub fn check_held(what: &str, judged: &Judged, judged_sent: u64, through: &[u64], run: &Run, last: Instant) {
    let all: u64 = through.iter().sum();
    eprintln!("  {what}: {judged}; {through:?} through; {judged_sent} sent to it");
    let t = judged.total;
    assert_eq!(t.admitted_packets + t.refused_packets, judged_sent, "{what}: judged vs sent to the limiter");
    assert_eq!(t.admitted_packets, all, "{what}: admitted vs through");
    assert_eq!(t.errors, 0, "{what}: the program reported internal errors");
    assert!(t.refused_packets > 0, "{what}: nothing was refused, so nothing was measured");
    let window = bounds::window(&run.report, Some(last));
    for (i, got) in through.iter().enumerate() {
        let what = format!("{what}, source {i}");
        check_upper(&what, *got, &limit(), judged, window);
        check_lower(&what, *got, &limit(), &run.report);
    }
}

/// `stats --json`, its text and `/metrics` all say the limiter is at `mode`.
#[track_caller]
pub fn check_reported_mode(rig: &Rig, mode: &str) {
    let stats = observe::fresh_stats(rig);
    assert_eq!(stats["attach_mode"], mode, "stats --json: {stats}");
    let text = rig.ctl_ok(&["stats"]);
    assert!(text.contains(mode), "`stats` does not say {mode}:\n{text}");
    let (_, samples) = observe::metrics(rig);
    assert_eq!(observe::gauge(&samples, "limiter_attach_mode", &[("mode", mode)]), 1.0, "limiter_attach_mode");
    let modes = limiter_tests::scrape::one(&samples, "limiter_attach_mode", &[]).map(|s| s.labels.len()).ok();
    assert_eq!(modes, Some(1), "more than one limiter_attach_mode");
}

/// A hand-over at tcx (a restart, a move from XDP) under way: a flood at full speed and a source
/// keeping to [`STEADY_SHARE`] of the rate, both pinned to [`flood_cpu`], with the policy's
/// counters (from the pins) and the tally read before they started.
pub struct HandOver {
    pub flood: Flow,
    pub steady: Flow,
    /// Flows sent with the flood that the limiter never judges (another program drops them).
    pub others: Vec<Flow>,
    flooding: Flooding,
    steadily: Flooding,
    before: Vec<Counters>,
    tally_before: BTreeMap<Flow, u64>,
}

/// A finished [`HandOver`], counted.
pub struct HandedOver {
    pub flood: Flow,
    pub steady_flow: Flow,
    pub run: Run,
    pub steady: Report,
    /// What the tally counted of each flow over the run.
    pub tally: BTreeMap<Flow, u64>,
    /// What the tally counted of the flood from the hand-over to the end.
    pub flood_after: u64,
    /// The tally went quiet after this.
    pub last: Instant,
    pub judged: Judged,
}

/// Starts a [`HandOver`] of policy `id`: the flood from 198.19.1.1 to port 7000 with `others`
/// interleaved, and 198.19.1.2 to port 7001 at [`STEADY_SHARE`] of [`RATE`]; half a second of
/// them under way before this returns.
pub fn start_hand_over(rig: &Rig, id: u16, tally: &Neighbour, others: &[Stream]) -> HandOver {
    let before = counters(rig, id);
    let tally_before = tally.flows().expect("tally");
    let flood = udp(&rig.net, "198.19.1.1", 7000);
    let steady = udp(&rig.net, "198.19.1.2", 7001);
    let streams: Vec<Stream> = std::iter::once(flood.clone()).chain(others.iter().cloned()).collect();
    let limits = Limits::timed(Duration::from_secs(60)).on_cpu(flood_cpu());
    let flooding = Flooding::start(&rig.net.sender, &streams, limits.clone(), None, None);
    let steadily =
        Flooding::start(&rig.net.sender, std::slice::from_ref(&steady), limits, Some(STEADY_SHARE * RATE), None);
    std::thread::sleep(Duration::from_millis(500));
    HandOver {
        flood: flow_of(&flood),
        steady: flow_of(&steady),
        others: others.iter().map(flow_of).collect(),
        flooding,
        steadily,
        before,
        tally_before,
    }
}

impl HandOver {
    /// Runs on for `after` past `handed_over` (when the new program was in place), stops both
    /// senders, waits for quiet and counts.
    pub fn finish(self, rig: &Rig, id: u16, tally: &Neighbour, handed_over: Instant, after: Duration) -> HandedOver {
        let at_hand_over = tally.flows().expect("tally");
        std::thread::sleep(after.saturating_sub(handed_over.elapsed()));
        self.flooding.stop();
        self.steadily.stop();
        let steady = self.steadily.finish().expect("steady sender").report;
        let run = self.flooding.finish().expect("flood");
        let last = settle(tally);
        let now = tally.flows().expect("tally");
        let tally_run: BTreeMap<Flow, u64> =
            now.keys().map(|f| (*f, flows_since(&now, &self.tally_before, f))).collect();
        let flood_after = flows_since(&now, &at_hand_over, &self.flood);
        let judged = Judged::between(&self.before, &counters(rig, id));
        HandedOver {
            flood: self.flood,
            steady_flow: self.steady,
            run,
            steady,
            tally: tally_run,
            flood_after,
            last,
            judged,
        }
    }
}

impl HandedOver {
    pub fn through(&self, flow: &Flow) -> u64 {
        self.tally.get(flow).copied().unwrap_or(0)
    }
}

/// What a hand-over at tcx must keep ([`limiter_tests::rig::check_hand_over`]'s checks, with
/// the tally in place of the capture): every frame of both sources judged by one program or the
/// other (admitted + refused == sent: none passed unjudged, the counters went on), every admitted
/// frame through; the flood within one bucket's bound over the whole run (no fresh burst); the
/// steady source never refused; the flood given at least 90% of its allowance over the run, and
/// of the rate from the hand-over (`handed_over`) to the end.
///
/// A move between hooks attaches the new hook before it releases the old one: for a moment both
/// hold the program, and still each frame is judged once (the XDP program marks what it judged,
/// the tc program lets it by): judged == sent exactly, admitted == what got through. On a kernel
/// that refuses the mark's helper ([`marks_judged`]), what XDP passed in that moment is judged
/// again at tc: judged exceeds sent by those frames (none left unjudged), and admitted exceeds
/// what got through by at most them.
#[track_caller]
pub fn check_hand_over(what: &str, done: &HandedOver, handed_over: Instant) {
    let HandedOver { run, steady, judged, .. } = done;
    let (sent, through) = (run.sent(&done.flood), done.through(&done.flood));
    let steady_through = done.through(&done.steady_flow);
    eprintln!(
        "{what}: flood {}; steady {steady}; {judged}; {through} of the flood through, {steady_through} of the steady \
         source",
        run.report
    );
    assert!(judged.total.refused_packets > 0, "{what}: nothing was refused, so nothing was measured: {judged}");
    let l = limit();
    let judged_all = judged.total.admitted_packets + judged.total.refused_packets;
    let (admitted, delivered) = (judged.total.admitted_packets, through + steady_through);
    if marks_judged() {
        assert_eq!(
            judged_all,
            sent + steady.sent,
            "{what}: admitted + refused vs sent by both sources over the whole run ({judged}): fewer, frames judged \
             by no program passed unlimited (or the counters restarted); more, frames were judged twice"
        );
        assert_eq!(admitted, delivered, "{what}: admitted vs through");
    } else {
        let twice = judged_all.checked_sub(sent + steady.sent).unwrap_or_else(|| {
            panic!(
                "{what}: {judged_all} judged of {} sent by both sources ({judged}): frames judged by no program passed \
                 unlimited (or the counters restarted)",
                sent + steady.sent
            )
        });
        eprintln!("  {what}: this kernel refuses the mark: {twice} frames judged at both hooks in the move");
        assert!(
            admitted >= delivered && admitted - delivered <= twice,
            "{what}: admitted {admitted}, through {delivered}: only a frame judged twice may be admitted and not \
             get through ({twice} were)"
        );
    }
    let window = bounds::window(&run.report, Some(done.last));
    check_upper(&format!("{what}: the flood over the whole run"), through, &limit(), judged, window);
    let due = STEADY_SHARE * RATE * steady.duration().as_secs_f64();
    assert!(
        steady.sent as f64 >= 0.9 * due,
        "{what}: the steady sender sent {} in {:?}, under 90% of the {due:.0} due ({steady}): the machine could not \
         keep the pace, so the run does not test the hand-over",
        steady.sent,
        steady.duration()
    );
    let across = format!("{what}: the source keeping to half the rate, across the hand-over");
    bounds::check_steady(&across, steady_through, &l, steady);
    check_lower(&format!("{what}: the flood over the whole run"), through, &limit(), &run.report);
    let end = run.report.last.expect("a flood records its end");
    let t = end.saturating_duration_since(handed_over);
    let rate_over = |d: Duration| l.bound(bounds::nanos(d)) - l.bound(0);
    let least = rate_over(t).saturating_sub(bounds::stall_cost(&l, &run.report, 1));
    eprintln!("  {what}: the flood after the hand-over ({t:?}): {} >= 90% of {least}", done.flood_after);
    assert!(t >= Duration::from_millis(200), "{what}: the flood ran only {t:?} after the hand-over");
    assert!(
        done.flood_after * 10 >= least * 9,
        "{what}: the flood got {} in the {t:?} after the hand-over, under 90% of {least}: the new program refused \
         what the rate allows",
        done.flood_after
    );
}

/// Whether this kernel lets the XDP program mark what it judged, for the tc program to let by
/// (`bpf_xdp_adjust_meta`, probed as the daemon probes it). Where it refuses the helper, the
/// limiter loads without the mark, and while both hooks hold it both judge what XDP passed.
pub fn marks_judged() -> bool {
    limiter_ctl::kernel::features::xdp_metadata()
}

/// The programs at tcx ingress of `end` are `want`, in that order (ids), and say which if not.
#[track_caller]
pub fn check_chain(end: &End, want: &[u32]) {
    let chain = limiter_tests::neighbour::tcx_chain(end).expect("tcx chain");
    assert_eq!(chain, want, "tcx ingress of {} runs {:?}", end.iface, tcx_names(end).unwrap_or_default());
}

/// Watches `end`'s hooks through a move from XDP to tcx, from another thread: returns (once XDP
/// is free, or after 30 s) the longest both hooks can have held a limiter: from the last look
/// that saw nothing new at tcx ingress (beyond the `before` programs there) to the first that
/// saw XDP free.
pub fn watch_move(end: &End, before: usize) -> std::thread::JoinHandle<anyhow::Result<Duration>> {
    let end = end.clone();
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut not_yet = Instant::now();
        let mut attached = None;
        loop {
            let looked = Instant::now();
            if attached.is_none() {
                if limiter_tests::neighbour::tcx_chain(&end)?.len() > before {
                    attached = Some(not_yet);
                } else {
                    not_yet = looked;
                }
            }
            if let Some(since) = attached
                && limiter_tests::daemon::xdp_program_id(&end)?.is_none()
            {
                return Ok(Instant::now() - since);
            }
            anyhow::ensure!(Instant::now() < deadline, "no move from XDP to tcx within 30 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    })
}

/// An address written in a test.
pub fn addr(s: &str) -> IpAddr {
    src(s)
}

/// Arguments built as strings, as the harness takes them.
pub fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

//! The kernel matrix's scenario (issue 38): what must hold on every kernel the limiter supports,
//! with the release daemon on a veth pair. It runs here on this machine's kernel (the matrix's
//! host column), and in a VM on each of Debian's kernels through tests/kernels/matrix.rs, where
//! loading a program takes 30-60 s under emulation: so the daemon starts four times in all, and
//! each start tests what it can.
//!
//! - With its defaults, at native XDP: a per-source policy with a host-wide aggregate, a
//!   SYN-only policy, a ban and a salt rotation, each on real traffic; then SIGTERM and a restart that adopts the
//!   pinned program with no gap under a paced flood, and `detach`.
//! - In skb mode (`--attach xdp --mode skb`): a flood held to B + R t beside a source keeping to
//!   its rate, never refused.
//! - Beside another XDP program: the defaults put the limiter at tc ingress (tcx from 6.6, tc
//!   clsact before), where it judges every frame the other program passes.
//!
//! Every flood is bounded in time and held to what was actually sent, and when, so the
//! assertions hold on a machine 50 times slower; waits on the daemon are stretched there
//! ([`limiter_tests::slowdown`]).

use std::{
    path::Path,
    time::{Duration, Instant},
};

use aya::{
    EbpfLoader,
    programs::{Xdp, XdpMode},
};
use limiter_ctl::objects;
use limiter_tests::{
    bounds::{Judged, check_lower, check_overload, check_steady, check_upper},
    cpu::flood_cpu,
    daemon::{Daemon, Scratch, program_counters, xdp_program_id},
    flood::{L4, Limits, Sources, Stream},
    netns::TestNet,
    observe::fresh_stats,
    policies::{Pol, PolicyRig as _, src},
    receiver::{Receiver, udp_drops},
    require_root,
    rig::{Flooding, Rig, STEADY_SHARE, check_hand_over, flow_of},
    slowdown::stretch,
    transfer,
};

/// How long each flood that is not a hand-over runs.
const FLOOD: Duration = Duration::from_secs(1);
/// The policy the bounded floods are held to: its rate and burst. A flood paced at
/// [`OVERLOAD`] times the rate offers far more than it admits, at a pace the slowest machine of
/// the matrix keeps.
const RATE: u64 = 200;
const BURST: u64 = 50;
const OVERLOAD: f64 = 10.0;

/// The daemon's flags: its defaults, but for a state directory of the test's own (bans live
/// there).
fn args(state: &Path) -> Vec<String> {
    vec!["--state-dir".into(), state.display().to_string()]
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// `stats --json`'s `attach_mode`.
fn attach_mode(rig: &Rig) -> String {
    let stats = fresh_stats(rig);
    stats["attach_mode"].as_str().unwrap_or_else(|| panic!("no attach_mode in stats: {stats}")).to_string()
}

// ---------------------------------------------------------------------------------------------
// The defaults: native XDP

/// With its defaults on a veth pair, the daemon attaches at native XDP; on real traffic there a
/// per-source policy with a host-wide aggregate holds each source and their sum, a SYN-only
/// policy holds a SYN flood while a bulk transfer's other segments pass unjudged, and a ban
/// (`deny add --for`) drops its source while it lasts and not after. SIGTERM exits 0, leaving
/// the program enforcing; a new daemon adopts it with a paced flood and a source keeping to half
/// the rate running throughout, every frame judged and the flood held to B + R t over the whole
/// run (no gap, no fresh burst); after a last SIGTERM, `detach` leaves nothing behind.
#[test]
fn the_defaults_attach_natively_enforce_layers_syn_bans_and_rotation_and_a_restart_adopts() {
    require_root!();
    let state = tempfile::Builder::new().prefix("limiter-state").tempdir().expect("a state directory");
    let args = args(state.path());
    let mut rig = Rig::start(&strs(&args)).expect("starting the daemon with its defaults");
    assert_eq!(attach_mode(&rig), "native", "the defaults on a veth pair");
    layers(&rig);
    syn_only(&rig);
    ban(&rig);
    rotation(&rig);
    restart(&mut rig, &args);
}

/// A per-source policy (100/s) and an aggregate of every source (150/s, scope host) on one port:
/// two sources flooding it are each held to the per-source bound and together to the
/// aggregate's, which they fill (together they may have 200/s of the per-source layer).
fn layers(rig: &Rig) {
    let per_source = Pol::new("persource", "udp:7100", 100, 10);
    let aggregate = Pol::new("aggregate", "udp:7100", 150, 15).key("src/0,/0");
    rig.set_all(&[per_source.clone(), aggregate.clone()]);
    let (ps, agg) = (rig.policy_id("persource"), rig.policy_id("aggregate"));
    rig.check_installed(&per_source, ps);
    rig.check_installed(&aggregate, agg);
    let streams = [rig.stream(L4::Udp, 7100, "198.19.7.1"), rig.stream(L4::Udp, 7100, "198.19.7.2")];
    let run = rig.counted_flood(&streams, Limits::timed(FLOOD));
    eprintln!("layers: {}", run.report);
    check_overload(&run.report, 100.0, streams.len());
    let (ps_judged, agg_judged) = (rig.judged(&run, ps), rig.judged(&run, agg));
    eprintln!("  persource {ps_judged}; aggregate {agg_judged}");
    let window = run.window();
    let mut both = 0;
    for s in &streams {
        let got = run.delivered(&flow_of(s));
        check_upper(&format!("persource, {:?}", s.sources), got, &per_source.gcra(), &ps_judged, window);
        both += got;
    }
    check_upper("aggregate, both sources", both, &aggregate.gcra(), &agg_judged, window);
    check_lower("aggregate, both sources", both, &aggregate.gcra(), &run.report);
    let t = agg_judged.total;
    assert_eq!(t.admitted_packets, both, "what the aggregate (the last layer) admitted vs what was delivered");
    assert!(t.refused_packets > 0, "the aggregate refused nothing: the flood did not test it ({agg_judged})");
    assert_eq!(t.errors + ps_judged.total.errors, 0, "the program reported internal errors");
    for name in ["persource", "aggregate"] {
        rig.ctl_ok(&["policy", "rm", name]);
    }
}

/// A SYN-only policy (`tcp:PORT,syn`) holds a SYN flood from one source to its bound, every SYN
/// judged; a bulk transfer to the same port meets it with its SYN only.
fn syn_only(rig: &Rig) {
    let pol = Pol::new("opens", "tcp:7200,syn", 100, 10);
    rig.set(&pol);
    let id = rig.policy_id("opens");
    let streams = [rig.stream(L4::TcpSyn, 7200, "198.19.7.3")];
    let run = rig.counted_flood(&streams, Limits::timed(FLOOD));
    eprintln!("SYN flood: {}", run.report);
    check_overload(&run.report, 100.0, 1);
    rig.check_policy(&pol, &run, &[vec![flow_of(&streams[0])]]);

    const BYTES: u64 = 4 << 20;
    let before = rig.snapshot().total(id);
    let (read, took) = transfer::bulk(&rig.net, false, 7200, BYTES, stretch(Duration::from_secs(20)));
    let judged = rig.snapshot().total(id).packets() - before.packets();
    eprintln!("a transfer under 'opens': {read} bytes in {took:?}; 'opens' judged {judged}");
    assert_eq!(read, BYTES, "a transfer under a SYN-only policy read {read} of {BYTES} bytes in {took:?}");
    assert!(
        (1..=2).contains(&judged),
        "'opens' judged {judged} packets of one connection: only its SYN should meet it"
    );
    rig.ctl_ok(&["policy", "rm", "opens"]);
}

/// How long the ban lasts: far longer than the flood that tests it, on any machine.
const BAN: Duration = Duration::from_secs(10);

/// A ban (`deny add SRC --for`) drops every frame its source sends while it lasts, and none of
/// the source beside it; once it expired (gone from `deny list`), the source's frames pass.
fn ban(rig: &Rig) {
    let (banned, bystander) = ("198.19.7.4", "198.19.7.5");
    let streams = [rig.stream(L4::Udp, 7300, banned), rig.stream(L4::Udp, 7300, bystander)];
    let (b, o) = (flow_of(&streams[0]), flow_of(&streams[1]));
    rig.ctl_ok(&["deny", "add", banned, "--for", &format!("{}s", BAN.as_secs())]);
    let answered = Instant::now();
    let run = rig.flood(&streams, Limits::timed(FLOOD), Some(2.0 * RATE as f64)).expect("the flood");
    eprintln!("under the ban: {}", run.report);
    let ended = run.report.last.expect("a flood records its end");
    assert!(
        ended < answered + BAN,
        "the flood ended {:?} after the ban was answered, past its {BAN:?}: the machine was too slow to test it",
        ended - answered
    );
    assert!(run.sent(&b) > 0, "the banned source sent nothing");
    assert_eq!(run.delivered(&b), 0, "frames of the banned source got through ({} sent)", run.sent(&b));
    assert_eq!(run.delivered(&o), run.sent(&o), "the source beside the ban lost frames");

    let deadline = answered + BAN + stretch(Duration::from_secs(5));
    while !rig.ctl_ok(&["deny", "list", "--json"]).trim().trim_matches(['[', ']']).trim().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the ban is still listed {:?} after it was set for {BAN:?}",
            answered.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let run = rig.flood(&streams, Limits::timed(FLOOD / 2), Some(2.0 * RATE as f64)).expect("the flood");
    eprintln!("after the ban: {}", run.report);
    assert!(run.sent(&b) > 0, "the banned source sent nothing");
    assert_eq!(run.delivered(&b), run.sent(&b), "the source's frames after its ban expired");
}

/// `salt rotate` switches the program to a new salt (the kernel's config: another generation,
/// another salt in it), and a flood after it is held to its policy's bound, every frame judged:
/// the keys hashed with the new salt find their buckets.
fn rotation(rig: &Rig) {
    let pol = Pol::new("rotated", "udp:7400", 100, 10);
    rig.set(&pol);
    let config = || rig.daemon.maps().expect("the program's maps").rules.config;
    let before = config();
    rig.ctl_ok(&["salt", "rotate"]);
    let after = config();
    assert_ne!(after.generation, before.generation, "salt rotate: the generation did not switch");
    assert_ne!(
        after.salts[after.generation as usize], before.salts[before.generation as usize],
        "salt rotate: the salt in force did not change"
    );
    let streams = [rig.stream(L4::Udp, 7400, "198.19.7.6")];
    let run = rig.counted_flood(&streams, Limits::timed(FLOOD));
    eprintln!("after a rotation: {}", run.report);
    check_overload(&run.report, 100.0, 1);
    rig.check_policy(&pol, &run, &[vec![flow_of(&streams[0])]]);
    rig.ctl_ok(&["policy", "rm", "rotated"]);
}

/// SIGTERM, then a new daemon at once, with a flood paced at [`OVERLOAD`] times the rate and a
/// source at half the rate running throughout: the old daemon exits 0 leaving its program
/// attached and pinned, the new one adopts it (its own program in the pinned link), and
/// [`check_hand_over`] holds over the whole run. Then SIGTERM again, and `detach`.
fn restart(rig: &mut Rig, args: &[String]) {
    let pol = Pol::new("handover", "udp:7000-7001", RATE, BURST);
    rig.set(&pol);
    let id = rig.policy_id("handover");
    let iface = rig.net.receiver.iface.clone();
    let hand_over = rig
        .start_paced_hand_over(
            src("198.19.1.1"),
            src("198.19.1.2"),
            7000,
            RATE as f64,
            Some(OVERLOAD * RATE as f64),
            Duration::from_millis(500),
        )
        .expect("starting the floods");

    let adopted = rig.restart_adopting(&strs(args));
    std::thread::sleep(Duration::from_millis(700));
    let done = hand_over.finish().expect("flood");
    let before = done.run.counted.as_ref().expect("baseline")[usize::from(id)].clone();
    let after = program_counters(adopted.program, id).expect("counters");
    check_hand_over("SIGTERM and a restart", &done, adopted.at, &before, &after, &pol.gcra());

    rig.sigterm();
    let detached = rig.scratch.detach(&rig.net.receiver).expect("limiter-ctl detach");
    assert_eq!(detached.code, Some(0), "detach: {detached:?}");
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None, "a program is still attached after detach");
    assert!(rig.scratch.pinned(&iface).expect("pins").is_empty(), "pins are left after detach");
}

// ---------------------------------------------------------------------------------------------
// skb mode

/// `--attach xdp --mode skb`: the program runs in generic mode, a flood paced far over the rate
/// is held to B + R t and gets its allowance, and a source keeping to half the rate beside it is
/// never refused.
#[test]
fn skb_mode_holds_a_flood_to_the_bound_and_never_refuses_a_source_within_its_rate() {
    require_root!();
    let rig = Rig::start(&["--attach", "xdp", "--mode", "skb"]).expect("starting the daemon in skb mode");
    assert_eq!(attach_mode(&rig), "skb");
    let link = rig.net.receiver.link_details().expect("ip link");
    assert!(link.contains("xdpgeneric"), "no generic XDP program on the interface:\n{link}");
    let pol = Pol::new("flood", "udp:7400-7401", RATE, BURST);
    rig.set(&pol);
    let id = rig.policy_id("flood");
    let flooding = rig
        .start_paced_hand_over(
            src("198.19.4.1"),
            src("198.19.4.2"),
            7400,
            RATE as f64,
            Some(OVERLOAD * RATE as f64),
            FLOOD,
        )
        .expect("starting the floods");
    let done = flooding.finish().expect("flood");
    let before = done.run.counted.as_ref().expect("baseline")[usize::from(id)].clone();
    let after = rig.daemon.counters(id).expect("counters");
    // Nothing is handed over: the run is held as one from the flood's first frame.
    let first = done.run.report.first.expect("a flood records its start");
    check_hand_over("skb mode", &done, first, &before, &after, &pol.gcra());
}

// ---------------------------------------------------------------------------------------------
// Beside another XDP program: tc ingress

/// The release of the running kernel, as (major, minor).
fn kernel_version() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("reading the kernel's release");
    let mut parts = release.trim().split(['.', '-', '+']).map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// Another XDP program (the bare XDP_PASS one) holds the interface: the daemon, with its
/// defaults (`--attach auto`), goes to tc ingress (tcx from 6.6; tc clsact through netlink
/// before it), leaving the other program at XDP. There it judges every frame that program
/// passes: a flood is held to B + R t and gets its allowance, a source keeping to half the rate
/// loses nothing, and what it admitted is what reached the socket.
#[test]
fn beside_another_xdp_program_the_defaults_judge_at_tc_ingress() {
    require_root!();
    let net = TestNet::new().expect("test network");
    // Dropped last (declared first): it holds bench_pass at XDP until the daemon is gone.
    let mut ebpf = EbpfLoader::new().load(objects::BENCH).expect("loading the bench object");
    let pass: &mut Xdp = ebpf.program_mut("bench_pass").expect("bench_pass").try_into().expect("an XDP program");
    pass.load().expect("loading bench_pass");
    let iface = net.receiver.iface.clone();
    net.receiver.run(|| pass.attach(&iface, XdpMode::Driver)).expect("namespace").expect("attaching bench_pass");
    let other = xdp_program_id(&net.receiver).expect("ip link").expect("bench_pass at XDP");

    let scratch = Scratch::new().expect("scratch directory");
    let mut daemon = Daemon::spawn(&net.receiver, &scratch, &[]).expect("starting the daemon");
    let line = daemon.wait_attached(&net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("daemon: {line}");
    let rig = Rig { daemon, scratch, net };
    let mode = attach_mode(&rig);
    let version = kernel_version();
    if version >= (6, 6) {
        assert_eq!(mode, "tcx", "beside another XDP program on {version:?}, which has tcx");
    } else {
        assert_eq!(mode, "netlink", "beside another XDP program on {version:?}, which has no tcx: not a clsact filter");
    }
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), Some(other), "the other program left XDP");

    let pol = Pol::new("flood", "udp:7500", RATE, BURST);
    rig.set(&pol);
    let id = rig.policy_id("flood");
    let receiver = Receiver::start_on(&rig.net.receiver, 7500).expect("a UDP receiver");
    let udp = |source: &str| -> Stream {
        Stream { spec: rig.net.frames_to(false, 7500), l4: L4::Udp, sources: Sources::One(src(source)) }
    };
    let (flood, steady) = (udp("198.19.5.1"), udp("198.19.5.2"));
    let before = rig.snapshot().counters[usize::from(id)].clone();
    let limits = Limits::timed(FLOOD).on_cpu(flood_cpu());
    let pace = |share: f64| Some(share * RATE as f64);
    let flooding = Flooding::start(&rig.net.sender, std::slice::from_ref(&flood), limits.clone(), pace(OVERLOAD), None);
    let steadily = Flooding::start(&rig.net.sender, std::slice::from_ref(&steady), limits, pace(STEADY_SHARE), None);
    let (flooded, steadied) = (flooding.finish().expect("flood"), steadily.finish().expect("steady source"));
    let delivered = receiver.finish().expect("the receiver");
    let judged = Judged::between(&before, &rig.snapshot().counters[usize::from(id)]);
    let drops = udp_drops(&rig.net.receiver).expect("UDP drops");
    let (sent, steady_sent) = (flooded.report.sent, steadied.report.sent);
    let (got, steady_got) = (delivered.from(&src("198.19.5.1")), delivered.from(&src("198.19.5.2")));
    eprintln!(
        "at {mode}: flood {}; steady {}; {judged}; delivered {got} of the flood, {steady_got} of the steady source \
         (socket drops {drops})",
        flooded.report, steadied.report
    );
    let t = judged.total;
    assert_eq!(t.admitted_packets + t.refused_packets, sent + steady_sent, "judged vs sent: a frame passed unjudged");
    assert_eq!(drops, 0, "the socket dropped datagrams: the counts are incomplete");
    assert_eq!(t.admitted_packets, got + steady_got, "admitted vs delivered");
    assert!(t.refused_packets > 0, "nothing was refused: {judged}");
    check_upper("the flood at tc ingress", got, &pol.gcra(), &judged, delivered.window(&flooded.report));
    check_lower("the flood at tc ingress", got, &pol.gcra(), &flooded.report);
    check_steady("the source keeping to half the rate, at tc ingress", steady_got, &pol.gcra(), &steadied.report);
}

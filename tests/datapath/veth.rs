//! End to end on a real veth pair: the XDP program attached natively to the receiver's end, a
//! real flood from the sender's namespace, a UDP socket counting what gets through.
//!
//! Bounds: see `limiter_tests::bounds` (per-CPU GCRA bounds over the flood's window).

use std::{
    collections::BTreeMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::anyhow;

use limiter_common::{FlowKey, Gcra, SipKey, key::FAMILY_V4, maps::Counters};
use limiter_ctl::{
    Limiter, ModeRequest,
    config::{PolicyDef, Rate},
    kernel::compile,
};
use limiter_tests::{
    bounds::{Judged, check_bounds, check_overload, first},
    cpu::flood_cpu,
    daemon::{Daemon, Scratch},
    flood::{Frames, Limits, PacketSocket, Prefix, Report, Sources},
    kernel_programs::{Shape, udp_limiter, udp_limiter_shaped},
    netns::{End, TestNet},
    receiver::{Receiver, udp_drops},
    require_root,
};

const POLICY: u16 = 1;
/// A fixed salt, so the test can predict every source's bucket.
const SALT: SipKey = SipKey { k0: 0x6c69_6d69_7465_7221, k1: 0x7665_7468_2d74_6573 };
/// Every flood here lasts this long (bounded by time: [`Limits::timed`]).
const FLOOD_TIME: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------------------------------
// Tests

/// One source floods at the sender's top speed; the limiter (one row, no sampling) lets through
/// its allowance and no more, and every admitted packet reaches the socket.
#[test]
fn single_source_flood_is_held_to_the_bound() {
    single_source_flood(Shape::ONE_ROW);
}

/// [`single_source_flood_is_held_to_the_bound`] with the limiter as the daemon runs it by
/// default: 4 count-min rows, 1 in 256 refusals sampled into the ring.
#[test]
fn single_source_flood_is_held_to_the_bound_in_the_daemons_shape() {
    single_source_flood(Shape::DAEMON);
}

fn single_source_flood(shape: Shape) {
    require_root!();
    let net = TestNet::new().expect("test network");
    let (rate, burst) = ("1000/s", 100);
    let policy = policy(rate, burst).expect("policy");
    let mut limiter = udp_limiter_shaped(64, shape, SALT, &policy).expect("loading the limiter");
    let gcra = policy.gcra;
    let config = limiter.config().expect("config");
    assert_eq!(config.rows, shape.rows, "{shape:?}: rows in the kernel's config");
    let sampling = config.flags & limiter_common::maps::Config::SAMPLE_REFUSALS != 0;
    assert_eq!(sampling, shape.sample_refusals > 0, "{shape:?}: refusal sampling in the kernel's config");
    attach_native(&net, &mut limiter);
    let receiver = Receiver::start(&net.receiver).expect("UDP receiver");

    let report = flood(&net, Sources::One(net.sender.v4.into()), receiver.port).expect("flood");
    let delivered = receiver.finish().expect("receiver");
    let per_cpu = limiter.counters_per_cpu(POLICY).expect("counters");
    let counters_read = Instant::now();
    let drops = udp_drops(&net.receiver).expect("UDP drop counters");
    let judged = Judged::new(&per_cpu);
    eprintln!("single source, {shape:?}: {report}; {judged}; delivered {} (socket drops {drops})", delivered.total());

    check_overload(&report, per_sec(rate), 1);
    assert_quiet(&limiter);
    assert_eq!(delivered.sources(), vec![IpAddr::from(net.sender.v4)], "datagrams from unexpected sources");
    judged.check_against(&report);
    let window = delivered.window(&report);
    check_bounds("delivered", delivered.total(), &gcra, &judged, window, &report);
    judged.check_admitted(&gcra, counters_read - first(&report), &report);
    let admitted = judged.total.admitted_packets;
    assert_eq!(
        admitted,
        delivered.total() + drops,
        "the limiter admitted {admitted} but the socket received {} and the UDP stack dropped {drops}",
        delivered.total()
    );
    limiter.detach().expect("detach");
}

/// 64 spoofed sources over 64 buckets: sources whose keys hash to the same bucket (predicted
/// from the known salt) share one allowance, and each bucket is held to the bound.
#[test]
fn spoofed_sources_share_allowances_by_predicted_bucket() {
    require_root!();
    const BUCKETS: u32 = 64;
    const SOURCES: u32 = 64;
    let net = TestNet::new().expect("test network");
    // A low rate: each bucket gets a sliver of the flood, and must still be overloaded.
    let (rate, burst) = ("100/s", 10);
    let (mut limiter, gcra) = load_limiter(BUCKETS, rate, burst).expect("loading the limiter");
    attach_native(&net, &mut limiter);
    let prefix: Prefix = "198.19.0.0/16".parse().expect("prefix");
    let sources = Sources::Spoofed { prefix, count: SOURCES };
    let groups = predicted_groups(&sources.addresses().expect("sources"), BUCKETS);
    let largest = groups.values().map(Vec::len).max().unwrap_or(0);
    assert!(
        largest >= 2 && groups.len() < SOURCES as usize,
        "the fixed salt should make some of {SOURCES} sources collide in {BUCKETS} buckets"
    );
    let receiver = Receiver::start(&net.receiver).expect("UDP receiver");

    let report = flood(&net, sources, receiver.port).expect("flood");
    let delivered = receiver.finish().expect("receiver");
    let per_cpu = limiter.counters_per_cpu(POLICY).expect("counters");
    let drops = udp_drops(&net.receiver).expect("UDP drop counters");
    let judged = Judged::new(&per_cpu);
    eprintln!(
        "spoofed: {report}; {judged}; delivered {} from {} sources in {} buckets (largest group {largest}, socket drops {drops})",
        delivered.total(),
        delivered.per_source.len(),
        groups.len()
    );

    // Every source, so even a bucket of one, gets MIN_OVERLOAD times the rate.
    check_overload(&report, per_sec(rate), SOURCES as usize);
    assert_quiet(&limiter);
    judged.check_against(&report);
    check_touched_buckets(&limiter, &groups, &judged, BUCKETS);
    let window = delivered.window(&report);
    for (bucket, members) in &groups {
        let got: u64 = members.iter().map(|a| delivered.from(a)).sum();
        let what = format!("bucket {bucket} ({} sources)", members.len());
        check_bounds(&what, got, &gcra, &judged, window, &report);
    }
    let strays: Vec<IpAddr> =
        delivered.sources().into_iter().filter(|a| !groups.values().any(|m| m.contains(a))).collect();
    assert!(strays.is_empty(), "datagrams from sources that were not sent: {strays:?}");
    assert_eq!(judged.total.admitted_packets, delivered.total() + drops, "admitted vs delivered + socket drops");
    limiter.detach().expect("detach");
}

/// The real daemon in the receiver's namespace: it attaches natively, holds a flood to its
/// configured rate, and on SIGINT exits 0 leaving the program attached and pinned (and says
/// so); `limiter-ctl detach` then leaves no XDP program behind.
#[test]
fn daemon_limits_a_flood_and_leaves_it_enforcing_on_sigint() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch directory");
    let (rate, burst) = ("1000/s", 100);
    let iface = net.receiver.iface.clone();
    let mut daemon = Daemon::spawn(&net.receiver, &scratch, &["--rate", rate, "--burst", &burst.to_string()])
        .expect("starting limiter-ctl");
    let attached = daemon.wait_attached(&net.receiver).expect("attached line");
    assert!(attached.contains("mode=native"), "the daemon did not attach natively: {attached}");
    assert!(attached.contains(&format!("iface={iface}")), "{attached}");
    let link = net.receiver.link_details().expect("ip link");
    // The same check as after exit, which must see the program while it is there.
    assert!(link.contains("xdp"), "ip -d link shows no XDP program while the daemon runs:\n{link}");

    let receiver = Receiver::start(&net.receiver).expect("UDP receiver");
    let report = flood(&net, Sources::One(net.sender.v4.into()), receiver.port).expect("flood");
    let delivered = receiver.finish().expect("receiver");
    let per_cpu = daemon.counters(POLICY).expect("the daemon's counters");
    let counters_read = Instant::now();
    let drops = udp_drops(&net.receiver).expect("UDP drop counters");
    let judged = Judged::new(&per_cpu);
    eprintln!("daemon: {report}; {judged}; delivered {} (socket drops {drops})", delivered.total());

    let gcra = policy(rate, burst).expect("policy").gcra;
    check_overload(&report, per_sec(rate), 1);
    judged.check_against(&report);
    check_bounds("delivered", delivered.total(), &gcra, &judged, delivered.window(&report), &report);
    judged.check_admitted(&gcra, counters_read - first(&report), &report);
    let admitted = judged.total.admitted_packets;
    // The daemon judges every protocol; the fixture keeps the link free of anything but the flood.
    assert_eq!(admitted, delivered.total() + drops, "admitted vs delivered + socket drops");

    // Stopped, the daemon leaves the program enforcing; `detach` takes it off.
    daemon.stop_ok();
    let out = daemon.output();
    assert!(out.contains(" stopping ") && out.contains("SIGINT"), "no 'stopping' line:\n{out}");
    assert!(out.contains(limiter_tests::daemon::LEFT), "no 'left attached and pinned' line:\n{out}");
    let link = net.receiver.link_details().expect("ip link");
    assert!(link.contains("xdp"), "the program left with the daemon:\n{link}");
    let detached = scratch.detach(&net.receiver).expect("limiter-ctl detach");
    assert_eq!(detached.code, Some(0), "{detached:?}");
    let link = net.receiver.link_details().expect("ip link");
    assert!(!link.contains("xdp"), "an XDP program is still attached after detach:\n{link}");
}

/// The daemon in its default mode (auto) on an interface without native XDP: a bridge (no driver
/// hook), the receiver's veth end its port. Auto tries native, falls back to skb mode and says
/// why; the program is attached in generic mode, and frames the bridge passes up to the host
/// meet it there (on the CPU that sent them: veth without XDP hands them to that CPU's backlog).
/// The flood is held to its bound, on the pinned CPU, and gets at least 90% of its allowance.
#[test]
fn auto_mode_falls_back_to_skb_on_a_bridge_and_still_limits() {
    require_root!();
    let net = TestNet::new().expect("test network");
    // Same length as the veth end's name (IFNAMSIZ), its last letter swapped.
    let name = format!("{}b", &net.receiver.iface[..net.receiver.iface.len() - 1]);
    let bridge = End { iface: name.clone(), ..net.receiver.clone() };
    for args in [
        ["link", "add", name.as_str(), "type", "bridge"].as_slice(),
        &["link", "set", &net.receiver.iface, "master", &name],
        &["link", "set", &name, "up"],
    ] {
        let mut full = vec!["-n", net.receiver.ns.as_str()];
        full.extend(args);
        limiter_tests::netns::ip(full).unwrap_or_else(|e| panic!("ip {args:?}: {e:#}"));
    }
    let scratch = Scratch::new().expect("scratch directory");
    let (rate, burst) = ("1000/s", 100);
    let mut daemon =
        Daemon::spawn(&bridge, &scratch, &["--rate", rate, "--burst", &burst.to_string(), "--metrics", "off"])
            .expect("starting limiter-ctl");
    let attached = daemon.wait_attached(&bridge).unwrap_or_else(|e| panic!("{e:#}"));
    daemon.poll();
    let out = daemon.output();
    assert!(attached.contains("mode=skb"), "auto mode on a bridge did not fall back to skb: {attached}\n{out}");
    assert!(out.contains("fell back to skb mode"), "the fallback is not said:\n{out}");
    let link = bridge.link_details().expect("ip link");
    assert!(link.contains("xdpgeneric"), "no generic XDP program on the bridge:\n{link}");
    let shown = daemon.ctl_ok(&["policy", "show", "default", "--json"]).expect("policy show");
    let shown: serde_json::Value = serde_json::from_str(&shown).expect("policy show --json");
    let id = shown["id"].as_u64().and_then(|id| u16::try_from(id).ok()).expect("a policy id");

    let before = daemon.counters(id).expect("counters");
    let spec = net.frames_to(false, 9);
    let frames = Frames::build(&spec, &Sources::One(net.sender.v4.into())).expect("frames");
    let limits = Limits::timed(Duration::from_secs(1)).on_cpu(flood_cpu());
    let iface = &net.sender.iface;
    let report = net.sender.run(|| frames.send(&mut PacketSocket::open(iface)?, &limits)).expect("namespace");
    let report = report.expect("flood");
    let judged = Judged::between(&before, &daemon.counters(id).expect("counters"));
    let read = Instant::now();
    eprintln!("skb mode on a bridge: {report}; {judged}");
    let gcra = policy(rate, burst).expect("policy").gcra;
    check_overload(&report, per_sec(rate), 1);
    judged.check_against(&report);
    judged.check_admitted(&gcra, read - first(&report), &report);
}

// ---------------------------------------------------------------------------------------------
// The limiter, loaded in-process

fn policy(rate: &str, burst: u64) -> anyhow::Result<limiter_common::maps::Policy> {
    let rate: Rate = rate.parse()?;
    // Scope cpu: these tests predict and read the per-CPU buckets.
    let spec = PolicyDef { scope: limiter_ctl::config::Scope::Cpu, ..PolicyDef::any(rate, burst) };
    compile::policy(&spec, POLICY).map_err(|e| anyhow!("{rate} burst {burst}: {e}"))
}

/// Packets per second of a rate written in this file.
fn per_sec(rate: &str) -> f64 {
    rate.parse::<Rate>().expect("the test's rates parse").per_sec()
}

/// The limiter with the known salt and one policy for UDP only: anything else on the link (there
/// should be nothing) passes unjudged and cannot blur the admitted count.
fn load_limiter(buckets: u32, rate: &str, burst: u64) -> anyhow::Result<(Limiter, Gcra)> {
    let policy = policy(rate, burst)?;
    Ok((udp_limiter(buckets, SALT, &policy)?, policy.gcra))
}

/// Attaches from inside the receiver's namespace: interface names and indexes are per namespace.
fn attach_native(net: &TestNet, limiter: &mut Limiter) {
    let iface = &net.receiver.iface;
    let attached = net.receiver.run(|| limiter.attach(iface, ModeRequest::Native)).expect("entering the namespace");
    let attached = attached.unwrap_or_else(|e| panic!("native XDP on veth {iface} failed: {e}"));
    assert_eq!(attached.mode, limiter_ctl::AttachMode::Native);
}

/// The bucket each source lands in under [`SALT`], with the sources that share it.
fn predicted_groups(sources: &[IpAddr], buckets: u32) -> BTreeMap<u32, Vec<IpAddr>> {
    let mut groups: BTreeMap<u32, Vec<IpAddr>> = BTreeMap::new();
    for &src in sources {
        let IpAddr::V4(v4) = src else { panic!("this test floods IPv4 only") };
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(&v4.octets());
        let key = FlowKey { addr, policy: POLICY, dport: 0, family: FAMILY_V4 };
        groups.entry(key.bucket(&SALT, buckets - 1)).or_default().push(src);
    }
    groups
}

/// The buckets holding a TAT are exactly the predicted ones: the test's key and hash agree with
/// the kernel's (generation 0 is the only one in use).
fn check_touched_buckets(limiter: &Limiter, groups: &BTreeMap<u32, Vec<IpAddr>>, judged: &Judged, buckets: u32) {
    for bucket in 0..buckets {
        let tats = limiter.bucket(bucket).expect("reading a bucket");
        let touched: Vec<usize> = (0..tats.len()).filter(|&cpu| tats[cpu] != 0).collect();
        if groups.contains_key(&bucket) {
            assert!(!touched.is_empty(), "bucket {bucket} was predicted for {:?} but holds no TAT", groups[&bucket]);
        } else {
            assert!(touched.is_empty(), "bucket {bucket} was predicted for no source but CPUs {touched:?} used it");
        }
        assert!(touched.iter().all(|c| judged.cpus.contains(c)), "bucket {bucket} used on CPUs {touched:?}");
    }
}

/// Nothing but the flood reached the program: the fixture keeps both kernels silent, and a
/// stray packet would also have pulled XDP onto whichever CPU sent it.
fn assert_quiet(limiter: &Limiter) {
    let unjudged = limiter.counters_per_cpu(0).expect("counters");
    let packets: Vec<u64> = unjudged.iter().map(Counters::packets).collect();
    assert!(packets.iter().all(|&p| p == 0), "packets other than the UDP flood reached XDP, per CPU: {unjudged:?}");
}

// ---------------------------------------------------------------------------------------------
// Traffic

/// A bounded single-CPU flood of UDP to `port` on the receiver, from the sender's namespace.
fn flood(net: &TestNet, sources: Sources, port: u16) -> anyhow::Result<Report> {
    let spec = net.frames_to(false, port);
    let frames = Frames::build(&spec, &sources)?;
    let limits = Limits::timed(FLOOD_TIME).on_cpu(flood_cpu());
    let iface = &net.sender.iface;
    net.sender.run(|| frames.send(&mut PacketSocket::open(iface)?, &limits))?
}

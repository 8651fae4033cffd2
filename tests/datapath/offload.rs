//! What the program is shown in skb (generic) mode when the kernel aggregates packets, measured
//! on a veth pair against what the sender sent (docs/DESIGN.md, "Fragments and aggregates"):
//!
//! - GRO: Linux skips GRO on a device with a generic XDP program (`netif_elide_gro`), so with
//!   GRO turned on at the receiving end the program still judges every segment.
//! - GSO from the peer: a veth hands its peer's TSO/GSO packets over whole, and generic XDP runs
//!   on them whole: a packet policy counts an aggregate of up to 64 KiB (about 45 TCP segments,
//!   or 64 UDP datagrams) as one packet. Measured here, so the documented limit stays true.
//! - BIG TCP: aggregates over 64 KiB state an IPv4 total length (or IPv6 payload length) of 0;
//!   they are judged on their headers (here, by a port policy) instead of passing unjudged as
//!   malformed (IPv4) or missing their port (IPv6).
//!
//! Every transfer is bounded by bytes and time and its sender pinned to [`flood_cpu`].

use std::{
    net::{SocketAddr, UdpSocket},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use limiter_common::{Gcra, maps::Counters};
use limiter_tests::{
    bounds::{nanos, since, total},
    capture::Capture,
    cpu::{flood_cpu, pin_current_thread},
    netns::End,
    require_root,
    rig::{Rig, SEC},
    snmp::Snmp,
};

const PORT: u16 = 5001;
/// What one transfer sends, at most, and for how long at most (TCP's window grows to BIG TCP's
/// sizes within the first few MiB).
const BYTES: u64 = 64 << 20;
const LIMIT: Duration = Duration::from_secs(10);
/// Frames a transfer may send that the program does not judge under the port, or judges beyond
/// them: none are expected (every frame the sender sends goes to the port).
const SLACK: u64 = 4;
/// Linux's BIG TCP sizes for the sender (bytes): aggregates up to this, over 64 KiB.
const BIG: u32 = 185_000;

/// The daemon in skb mode with one policy, `tcp:PORT`, that refuses nothing.
fn rig() -> (Rig, u16) {
    let rig = Rig::start(&["--mode", "skb"]).expect("starting the rig in skb mode");
    let details = rig.net.receiver.link_details().expect("ip link show");
    assert!(details.contains("xdpgeneric"), "the program must be attached in skb mode: {details}");
    let matches = format!("tcp:{PORT}");
    rig.ctl_ok(&["policy", "set", "bulk", "--match", &matches, "--rate", "1000000000/s", "--burst", "1000000000"]);
    let id = rig.policy_id("bulk");
    (rig, id)
}

/// `ethtool ARGS...` in `end`'s namespace.
fn ethtool(end: &End, args: &[&str]) -> String {
    let out = end.command("ethtool").args(args).output().expect("running ethtool (cargo xtask setup installs it)");
    assert!(out.status.success(), "ethtool {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Sets `u32` link attributes (`IFLA_*` number, value) on `end`'s interface over rtnetlink:
/// iproute2 before 6.3 cannot set `gso_ipv4_max_size`.
fn set_link_u32(end: &End, attrs: &[(u16, u32)]) -> anyhow::Result<()> {
    let iface = end.iface.clone();
    let attrs = attrs.to_vec();
    end.run(move || -> anyhow::Result<()> {
        let name = std::ffi::CString::new(iface.clone())?;
        // SAFETY: a valid NUL-terminated name.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if index == 0 {
            bail!("no interface {iface} in this namespace");
        }
        let mut body = Vec::new();
        // struct ifinfomsg: family, pad, type, index, flags, change.
        body.extend_from_slice(&[0u8, 0]);
        body.extend_from_slice(&0u16.to_ne_bytes());
        body.extend_from_slice(&(index as i32).to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        for (kind, value) in attrs {
            body.extend_from_slice(&8u16.to_ne_bytes());
            body.extend_from_slice(&kind.to_ne_bytes());
            body.extend_from_slice(&value.to_ne_bytes());
        }
        let mut msg = Vec::new();
        msg.extend_from_slice(&(16 + body.len() as u32).to_ne_bytes());
        msg.extend_from_slice(&libc::RTM_NEWLINK.to_ne_bytes());
        msg.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16).to_ne_bytes());
        msg.extend_from_slice(&1u32.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(&body);
        // SAFETY: plain socket calls on a descriptor this function owns and closes.
        unsafe {
            let fd = libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE);
            if fd < 0 {
                return Err(std::io::Error::last_os_error()).context("opening an rtnetlink socket");
            }
            let sent = libc::send(fd, msg.as_ptr().cast(), msg.len(), 0);
            let mut reply = [0u8; 4096];
            let got = libc::recv(fd, reply.as_mut_ptr().cast(), reply.len(), 0);
            let err = std::io::Error::last_os_error();
            libc::close(fd);
            if sent < 0 || got < 20 {
                return Err(err).context("talking to rtnetlink");
            }
            let code = i32::from_ne_bytes([reply[16], reply[17], reply[18], reply[19]]);
            if code != 0 {
                return Err(std::io::Error::from_raw_os_error(-code)).context(format!("RTM_NEWLINK on {iface}"));
            }
        }
        Ok(())
    })?
}

const IFLA_GSO_MAX_SIZE: u16 = 41;
const IFLA_GSO_IPV4_MAX_SIZE: u16 = 63;

/// A TCP bulk transfer from the sender to `PORT` on the receiver (`v6`: over IPv6), at most
/// [`BYTES`] and [`LIMIT`]: the bytes the receiver read.
fn transfer(rig: &Rig, v6: bool) -> u64 {
    limiter_tests::transfer::bulk(&rig.net, v6, PORT, BYTES, LIMIT).0
}

/// What one transfer did: segments the sender's TCP sent, frames the receiving veth counted,
/// and what the program counted under the policy and under no policy.
struct Measured {
    received: u64,
    segments: u64,
    frames: u64,
    /// Segments sent again (see [`retrans_segs`]).
    resent: u64,
    policy: Counters,
    none: Counters,
    /// The longest frame a packet tap on the receiver saw.
    longest: u64,
}

/// No IP datagram with a stated length is longer than this frame (Ethernet, IPv6 header, and
/// the largest payload length).
const LONGEST_STATED: u64 = 14 + 40 + 65_535;

fn out_segs(end: &End) -> u64 {
    Snmp::read(end).and_then(|s| s.get("Tcp:", "OutSegs")).expect("reading Tcp: OutSegs")
}

fn link_stat(end: &End, dir: &str, name: &str) -> u64 {
    let json = end.ip(["-s", "-j", "link", "show", "dev", &end.iface]).expect("ip -s link show");
    let v: serde_json::Value = serde_json::from_str(&json).expect("ip -j is JSON");
    v[0]["stats64"][dir][name].as_u64().unwrap_or_else(|| panic!("no {dir} {name} in {json}"))
}

fn rx_packets(end: &End) -> u64 {
    link_stat(end, "rx", "packets")
}

/// Segments the sender's TCP sent again. OutSegs counts them again too, so a frame lost on the
/// way (a full queue on a loaded machine, wherever it is counted) is a segment without a frame
/// of its own, and TCP resends every segment lost before the transfer ends.
fn retrans_segs(end: &End) -> u64 {
    Snmp::read(end).and_then(|s| s.get("Tcp:", "RetransSegs")).expect("reading Tcp: RetransSegs")
}

fn measure(rig: &Rig, id: u16, v6: bool) -> Measured {
    let net = &rig.net;
    let read = || {
        let all = rig.daemon.all_counters().expect("reading the daemon's counters");
        (total(&all[0]), total(&all[usize::from(id)]))
    };
    let capture = Capture::start(&net.receiver).expect("capturing on the receiver");
    let (s0, f0, d0, (n0, p0)) = (out_segs(&net.sender), rx_packets(&net.receiver), retrans_segs(&net.sender), read());
    let received = transfer(rig, v6);
    // The sender's last segments (the FIN's ACK) reach the program within a softirq; a loaded
    // machine may take longer than that, so wait (bounded) until the frame count settles.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut frames = rx_packets(&net.receiver);
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = rx_packets(&net.receiver);
        if now == frames || Instant::now() > deadline {
            break;
        }
        frames = now;
    }
    let (s1, d1, (n1, p1)) = (out_segs(&net.sender), retrans_segs(&net.sender), read());
    // Only the longest frame is read from the capture: a frame it dropped (full socket on a
    // loaded machine) takes nothing from that.
    let captured = capture.finish().expect("capture");
    let m = Measured {
        received,
        segments: s1 - s0,
        frames: frames - f0,
        resent: d1 - d0,
        policy: since(&p1, &p0),
        none: since(&n1, &n0),
        longest: captured.longest,
    };
    eprintln!(
        "IPv{}: received {} bytes; the sender's TCP sent {} segments, the receiving veth counted {} frames \
         ({} segments resent); the longest {} bytes; policy judged {} packets ({} bytes, {:.0} per packet); unjudged {:?}",
        if v6 { 6 } else { 4 },
        m.received,
        m.segments,
        m.frames,
        m.resent,
        m.longest,
        m.policy.packets(),
        m.policy.admitted_bytes,
        m.policy.admitted_bytes as f64 / m.policy.packets().max(1) as f64,
        m.none
    );
    assert!(m.received >= 1 << 20, "the transfer must move at least 1 MiB: {} bytes", m.received);
    m
}

/// GRO turned on at the receiving veth, offloads off at the sender (so the wire carries
/// segments): Linux elides GRO under a generic XDP program, and the policy judges every segment.
#[test]
fn skb_mode_judges_every_segment_with_gro_on() {
    require_root!();
    let (rig, id) = rig();
    let net = &rig.net;
    ethtool(&net.sender, &["-K", &net.sender.iface, "tso", "off", "gso", "off"]);
    ethtool(&net.receiver, &["-K", &net.receiver.iface, "gro", "on"]);
    let features = ethtool(&net.receiver, &["-k", &net.receiver.iface]);
    assert!(features.contains("generic-receive-offload: on"), "GRO must be on at the receiver: {features}");
    for v6 in [false, true] {
        let m = measure(&rig, id, v6);
        let judged = m.policy.packets();
        // Frames, not the sender's OutSegs, bound what is judged from above: OutSegs leaves out
        // retransmissions (a loaded machine's backlog may drop a frame).
        assert!(
            m.frames + m.resent + SLACK >= m.segments,
            "with GRO on, every segment must arrive as a frame of its own: {} frames, {} segments ({} resent)",
            m.frames,
            m.segments,
            m.resent
        );
        assert!(
            judged + SLACK >= m.frames && judged <= m.frames + SLACK,
            "every frame must be judged: {judged} judged, {} frames",
            m.frames
        );
        assert_eq!(m.none.malformed, 0, "nothing is malformed: {:?}", m.none);
    }
}

/// The sender's TSO on (veth's default): its aggregates cross the pair whole and the program
/// judges each as one packet (bytes are charged in full). This is the limit docs/DESIGN.md
/// states for skb mode behind a veth or tap; the numbers here are the ones it quotes.
#[test]
fn skb_mode_judges_a_peers_gso_aggregate_as_one_packet() {
    require_root!();
    let (rig, id) = rig();
    for v6 in [false, true] {
        let m = measure(&rig, id, v6);
        let judged = m.policy.packets();
        assert!(judged >= 1 && judged * 4 < m.segments, "aggregates: {judged} judged for {} segments", m.segments);
        assert!(judged + SLACK >= m.frames, "every frame the veth received is judged: {judged} of {}", m.frames);
        assert!(m.policy.admitted_bytes >= m.received, "every byte is charged: {:?}", m.policy);
    }
}

/// BIG TCP (aggregates over 64 KiB, stating length 0) is judged by the port policy, not passed
/// as malformed (IPv4) or without its port (IPv6).
#[test]
fn big_tcp_aggregates_are_judged_in_skb_mode() {
    require_root!();
    let (rig, id) = rig();
    set_link_u32(&rig.net.sender, &[(IFLA_GSO_MAX_SIZE, BIG), (IFLA_GSO_IPV4_MAX_SIZE, BIG)])
        .expect("turning BIG TCP on at the sender (Linux >= 6.3)");
    for v6 in [false, true] {
        let m = measure(&rig, id, v6);
        let judged = m.policy.packets();
        assert!(
            m.none.malformed == 0 && m.none.unmatched <= SLACK,
            "no aggregate passes unjudged (malformed, or unmatched without its port): {:?}",
            m.none
        );
        assert!(m.longest > LONGEST_STATED, "BIG TCP must be on: the longest frame was {} bytes", m.longest);
        assert!(judged + SLACK >= m.frames, "every frame the veth received is judged: {judged} of {}", m.frames);
        assert!(m.policy.admitted_bytes >= m.received, "every byte is charged: {:?}", m.policy);
    }
}

/// `UDP_SEGMENT` (linux/udp.h): the datagram size a UDP GSO send is cut into.
const UDP_SEGMENT: libc::c_int = 103;
/// The UDP GSO sender: 64 datagrams of 100 bytes per send, a send every 4 ms for 1 s at most.
const SEGMENT: usize = 100;
const PER_SEND: usize = 64;
const SENDS: u64 = 250;

/// A UDP GSO sender behind the veth: each of its sends crosses the pair whole, and a packet
/// policy counts it as one packet, so `udp:PORT` at 100/s burst 100 lets through up to 64 times
/// its bound (the limit docs/DESIGN.md states for skb mode; native mode on veth has none of it).
#[test]
fn skb_mode_counts_a_udp_gso_send_as_one_packet() {
    require_root!();
    let rig = Rig::start(&["--mode", "skb"]).expect("starting the rig in skb mode");
    let net = &rig.net;
    let matches = format!("udp:{PORT}");
    rig.ctl_ok(&["policy", "set", "dns", "--match", &matches, "--rate", "100/s", "--burst", "100"]);
    let id = rig.policy_id("dns");
    let dst = SocketAddr::new(net.receiver.addr(false), PORT);
    let socket = net.receiver.run(move || UdpSocket::bind(dst)).expect("namespace").expect("binding");
    socket.set_read_timeout(Some(Duration::from_secs(1))).expect("timeout");
    // Room for every datagram of a second's sends, should the reader fall behind.
    let room: libc::c_int = 32 << 20;
    // SAFETY: a valid socket and a c_int option value.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&raw const room).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_RCVBUFFORCE: {}", std::io::Error::last_os_error());
    // Reads until a second passes without a datagram (bounded by the sender's time, plus that).
    let reader = net.receiver.spawn(move || {
        let (mut buf, mut n) = ([0u8; 2048], 0u64);
        while socket.recv(&mut buf).is_ok() {
            n += 1;
        }
        n
    });
    let read = || rig.daemon.all_counters().expect("counters")[usize::from(id)].clone();
    let before = read();
    let (start, sends) = net
        .sender
        .run(move || -> std::io::Result<(Instant, u64)> {
            pin_current_thread(flood_cpu()).map_err(std::io::Error::from)?;
            let socket = UdpSocket::bind("0.0.0.0:0")?;
            let size = SEGMENT as libc::c_int;
            // SAFETY: a valid socket and a c_int option value.
            let rc = unsafe {
                libc::setsockopt(
                    socket.as_raw_fd(),
                    libc::SOL_UDP,
                    UDP_SEGMENT,
                    (&raw const size).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc != 0 {
                return Err(std::io::Error::last_os_error());
            }
            socket.connect(dst)?;
            let (payload, start, mut n) = (vec![0x75u8; SEGMENT * PER_SEND], Instant::now(), 0u64);
            while n < SENDS && start.elapsed() < Duration::from_secs(1) {
                let due = start + Duration::from_millis(4 * n);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
                socket.send(&payload)?;
                n += 1;
            }
            Ok((start, n))
        })
        .expect("namespace")
        .expect("sending with UDP GSO");
    let window = start.elapsed();
    let delivered = reader.join().expect("the reader panicked").expect("namespace");
    let per_cpu: Vec<Counters> = read().iter().zip(&before).map(|(a, b)| since(a, b)).collect();
    let cpus = per_cpu.iter().filter(|c| c.packets() > 0).count().max(1) as u64;
    let policy = total(&per_cpu);
    let bound = cpus * Gcra::new(100, SEC, 100, 1).expect("100/s burst 100").bound(nanos(window));
    eprintln!(
        "udp:{PORT} 100/s burst 100 in skb mode: {sends} GSO sends of {PER_SEND} datagrams; {delivered} datagrams \
         delivered; policy admitted {} refused {} on {cpus} CPU(s); bound {bound} over {window:?}",
        policy.admitted_packets, policy.refused_packets
    );
    assert!(policy.admitted_packets <= bound, "the policy keeps its own count within the bound: {policy:?}");
    assert!(
        delivered > 10 * bound && delivered <= policy.admitted_packets * PER_SEND as u64,
        "each admitted send delivers up to {PER_SEND} datagrams: {delivered} delivered, bound {bound}, {policy:?}"
    );
}

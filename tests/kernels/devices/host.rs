//! The host's side of the device tests: a network namespace of the test's own that QEMU runs in
//! (so the taps it creates for the guest's NICs are made there, and go with QEMU), and the floods
//! sent from it into the taps: one source, many flows (source ports), untagged, with one VLAN
//! tag, or two (QinQ), into one tap or alternating over two (a bond's members), each bounded
//! in packets and time and paced.

use std::{
    io,
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use anyhow::Context as _;
use limiter_tests::{
    cpu::flood_cpu,
    flood::{FrameSpec, Frames, L4, Limits, PacketSocket, Report, Sources, Steer, Stream, Transmit},
    netns::{PREFIX, ip, run_in},
};

/// The guest NICs' MACs (QEMU's `mac=`): the multiqueue NIC's, then the bond members'; a bond
/// takes its first member's. And the host side's, which the frames claim.
pub const GUEST_MACS: [[u8; 6]; TAPS] =
    [[0x02, 0x6c, 0x6d, 0x74, 0x10, 0x01], [0x02, 0x6c, 0x6d, 0x74, 0x11, 0x01], [0x02, 0x6c, 0x6d, 0x74, 0x11, 0x02]];
pub const TAPS: usize = 3;
const HOST_MAC: [u8; 6] = [0x02, 0x6c, 0x6d, 0x74, 0x10, 0x02];
/// How many flows (source ports) the one source spreads its flood over: the tap's flow hash
/// puts them on the guest's queues, each queue's interrupt on a CPU of its own.
const FLOWS: u16 = 16;
/// A tap queue's room (its `txqueuelen`): a guest stalled for a second by the emulation still
/// finds every frame of a paced flood waiting.
const TAP_QUEUE: &str = "10000";

/// The namespace and the taps' names in it; the namespace is deleted on drop, whatever happened.
pub struct HostNet {
    pub ns: String,
    pub taps: [String; TAPS],
}

impl HostNet {
    pub fn new() -> anyhow::Result<Self> {
        let pid = std::process::id();
        // `lmt-<pid>-...`: a run killed before its drop is swept by the next (netns::remove_stale).
        let net = Self { ns: format!("{PREFIX}{pid}-dev"), taps: std::array::from_fn(|i| format!("lmt{pid}t{i}")) };
        ip(["netns", "add", &net.ns])?;
        run_in(&net.ns, quiet)??;
        Ok(net)
    }

    /// The taps up (QEMU made them when it started), with room for a stalled guest's backlog.
    pub fn taps_up(&self) -> anyhow::Result<()> {
        for tap in &self.taps {
            ip(["-n", &self.ns, "link", "set", "dev", tap, "txqueuelen", TAP_QUEUE, "up"])?;
        }
        Ok(())
    }

    /// What `taps` dropped on their way to the guest so far (their queues full, or detached):
    /// `ip -s`, since the host's /sys shows the host's namespace only.
    fn dropped(&self, taps: &[usize]) -> anyhow::Result<u64> {
        let mut sum = 0;
        for &t in taps {
            let json = ip(["-n", &self.ns, "-j", "-s", "link", "show", "dev", &self.taps[t]])?;
            let v: serde_json::Value = serde_json::from_str(&json).context("`ip -j -s link` is not JSON")?;
            sum += v[0]["stats64"]["tx"]["dropped"]
                .as_u64()
                .with_context(|| format!("no tx dropped count for {} in {json}", self.taps[t]))?;
        }
        Ok(sum)
    }

    /// Sends `flood` into its taps, from a thread in the namespace pinned to the flood CPU: paced
    /// at `per_sec` for `duration` at most. Returns the report and what the taps dropped meanwhile.
    pub fn send(&self, flood: &Flood, per_sec: f64, duration: Duration) -> anyhow::Result<(Report, u64)> {
        let frames = Frames::mix(&flood.streams())?;
        let dropped = self.dropped(&flood.taps)?;
        let taps: Vec<String> = flood.taps.iter().map(|&t| self.taps[t].clone()).collect();
        let tags = flood.tags.clone();
        let report = run_in(&self.ns, move || -> anyhow::Result<Report> {
            let sockets = taps.iter().map(|t| PacketSocket::open(t)).collect::<anyhow::Result<_>>()?;
            let mut tx = Tagged { members: sockets, next: 0, tags, buf: Vec::new() };
            let steer = Steer { per_sec: Some(per_sec), stop: None };
            // Bounded in packets (what the pace sends in `duration`) and in time.
            let packets = (per_sec * duration.as_secs_f64()).ceil() as u64 + 1;
            frames.send_steered(&mut tx, &Limits::counted(packets, duration).on_cpu(flood_cpu()), &steer)
        })??;
        Ok((report, self.dropped(&flood.taps)?.saturating_sub(dropped)))
    }
}

impl Drop for HostNet {
    fn drop(&mut self) {
        // Deleting the namespace deletes the tap in it, should QEMU still hold it.
        if let Err(e) = ip(["netns", "delete", &self.ns]) {
            eprintln!("devices: deleting {}: {e:#}", self.ns);
        }
    }
}

/// Nothing of the host's own on the tap: no IPv6 autoconfiguration, no router solicitations.
fn quiet() -> anyhow::Result<()> {
    for conf in ["all", "default"] {
        limiter_tests::netns::sysctl(&format!("net/ipv6/conf/{conf}/disable_ipv6"), "1")?;
    }
    Ok(())
}

/// One flood the guest asks for by name.
#[derive(Clone, Debug)]
pub struct Flood {
    pub src: Ipv4Addr,
    pub dst: [u8; 4],
    pub dport: u16,
    /// The tags between the MACs and the EtherType, outermost first: TPID, VLAN id.
    tags: Vec<u8>,
    /// The taps it goes into, frame after frame in turn, and the MAC the frames are for.
    taps: Vec<usize>,
    dst_mac: [u8; 6],
}

impl Flood {
    /// Into the multiqueue NIC's tap, with `tags` ((TPID, VLAN id), outermost first).
    pub fn new(src: Ipv4Addr, dst: [u8; 4], dport: u16, tags: &[(u16, u16)]) -> Self {
        let tags = tags.iter().flat_map(|&(tpid, vid)| [tpid.to_be_bytes(), vid.to_be_bytes()].concat()).collect();
        Self { src, dst, dport, tags, taps: vec![0], dst_mac: GUEST_MACS[0] }
    }

    /// Over both of the bond's members in turn, to the bond's MAC (its first member's).
    pub fn over_bond(src: Ipv4Addr, dst: [u8; 4], dport: u16) -> Self {
        Self { src, dst, dport, tags: Vec::new(), taps: vec![1, 2], dst_mac: GUEST_MACS[1] }
    }

    /// One stream per flow: the same source and destination, source ports apart.
    fn streams(&self) -> Vec<Stream> {
        (0..FLOWS)
            .map(|i| Stream {
                spec: FrameSpec {
                    src_mac: HOST_MAC,
                    dst_mac: self.dst_mac,
                    dst: IpAddr::V4(self.dst.into()),
                    sport: 40_000 + i,
                    dport: self.dport,
                    payload: limiter_tests::flood::DEFAULT_PAYLOAD,
                },
                l4: L4::Udp,
                sources: Sources::One(IpAddr::V4(self.src)),
            })
            .collect()
    }
}

/// A transmitter that puts `tags` after each frame's MACs and sends it through its members in
/// turn (a frame refused for lack of room is sent again through the next).
struct Tagged<T> {
    members: Vec<T>,
    next: usize,
    tags: Vec<u8>,
    buf: Vec<u8>,
}

impl<T: Transmit> Transmit for Tagged<T> {
    fn transmit(&mut self, frame: &[u8]) -> io::Result<()> {
        let i = self.next;
        self.next = (i + 1) % self.members.len().max(1);
        let member = self.members.get_mut(i).ok_or_else(|| io::Error::other("no tap to send through"))?;
        if self.tags.is_empty() {
            return member.transmit(frame);
        }
        let (macs, rest) = frame.split_at(12.min(frame.len()));
        self.buf.clear();
        self.buf.extend_from_slice(macs);
        self.buf.extend_from_slice(&self.tags);
        self.buf.extend_from_slice(rest);
        member.transmit(&self.buf)
    }

    fn sender(&self) -> Option<&'static str> {
        self.members.first().and_then(Transmit::sender)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in tap: what it was given to send.
    #[derive(Default)]
    struct Sink(Vec<Vec<u8>>);

    impl Transmit for Sink {
        fn transmit(&mut self, frame: &[u8]) -> io::Result<()> {
            self.0.push(frame.to_vec());
            Ok(())
        }
    }

    #[test]
    fn tags_go_after_the_macs_and_frames_alternate_over_the_members() {
        let flood = Flood::new(Ipv4Addr::new(198, 18, 20, 9), [198, 18, 18, 1], 7600, &[(0x88a8, 20), (0x8100, 30)]);
        let mut tx = Tagged { members: vec![Sink::default(), Sink::default()], next: 0, tags: flood.tags, buf: vec![] };
        let frame: Vec<u8> = (0u8..40).collect();
        for _ in 0..3 {
            tx.transmit(&frame).expect("a stand-in never refuses");
        }
        let (a, b) = (&tx.members[0].0, &tx.members[1].0);
        assert_eq!((a.len(), b.len()), (2, 1), "frames in turn over the members");
        let sent = &a[0];
        assert_eq!(sent.len(), frame.len() + 8);
        assert_eq!(&sent[..12], &frame[..12], "the MACs first");
        assert_eq!(&sent[12..20], &[0x88, 0xa8, 0, 20, 0x81, 0x00, 0, 30], "802.1ad 20, then 802.1Q 30");
        assert_eq!(&sent[20..], &frame[12..], "then the frame's EtherType and the rest");
    }
}

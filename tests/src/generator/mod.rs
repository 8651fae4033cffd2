//! The flood generator every fast flood of the tests, the demo and the benches goes through: one
//! template frame whose source address moves to the next of `count` sources at each frame, sent
//! out of one interface as fast as the machine goes, bounded by time.
//!
//! Two senders, and the generator picks one once per process ([`Sender::chosen`]):
//! - **live frames** ([`live`]): the `limiter_gen` XDP program run through BPF_PROG_TEST_RUN with
//!   `BPF_F_TEST_XDP_LIVE_FRAMES`, as xdp-trafficgen does. Everything happens in the kernel and
//!   the receiver's XDP program sees the frame before any skb exists, as behind a NIC. The
//!   fastest, but some machines of this kind refuse it (EPERM, whoever asks).
//! - **a packet ring** ([`ring`]): an AF_PACKET socket with a TX ring that bypasses the qdisc. It
//!   works wherever raw sockets do; each frame is an skb, which the receiving veth turns back into
//!   an XDP buffer, so it is slower, and a receiver's cost per frame includes that skb.
//!
//! [`SENDER_ENV`] forces one: `ring` tests the fallback on a machine that allows live frames
//! (`cargo xtask test` runs the flood tests under it too), `live` fails where they are refused.

pub mod live;
pub mod ring;

use std::{
    fmt,
    net::IpAddr,
    sync::OnceLock,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use limiter_common::testing::{GenConfig, checksum_replacing};

use crate::flood::{FrameSpec, L4, Report, Throttle, log_flood};

/// Environment variable: which sender floods use. `auto` (the default): live frames where the
/// kernel allows them, the packet ring otherwise; `live` or `ring`: that one, or fail.
pub const SENDER_ENV: &str = "LIMITER_FLOOD_SENDER";

/// How frames leave the generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Sender {
    /// BPF_PROG_TEST_RUN with live frames ([`live`]).
    LiveFrames,
    /// AF_PACKET with a TX ring and qdisc bypass ([`ring`]).
    PacketRing,
}

impl Sender {
    pub const ALL: [Sender; 2] = [Self::LiveFrames, Self::PacketRing];

    /// The name reports, logs and tables use.
    pub fn name(self) -> &'static str {
        match self {
            Self::LiveFrames => "live-frames",
            Self::PacketRing => "packet-ring",
        }
    }

    /// Whether the receiver sees an skb before its XDP program runs (a veth builds an XDP
    /// buffer back from it): only live frames reach XDP as a NIC's frames do.
    pub fn skb_before_xdp(self) -> bool {
        self == Self::PacketRing
    }

    /// The sender this process uses: what [`SENDER_ENV`] asks for ([`Choice::asked`]). Decided
    /// once, on the first call (whichever namespace the caller is in: both probes use only the
    /// loopback device).
    pub fn chosen() -> anyhow::Result<Choice> {
        static CHOSEN: OnceLock<Result<Choice, String>> = OnceLock::new();
        let asked = || Choice::asked(&std::env::var(SENDER_ENV).unwrap_or_default()).map_err(|e| format!("{e:#}"));
        CHOSEN.get_or_init(asked).clone().map_err(anyhow::Error::msg)
    }
}

impl fmt::Display for Sender {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The sender a process floods with, and why.
#[derive(Clone, Debug)]
pub struct Choice {
    pub sender: Sender,
    /// What decided it: `asked for`, `live frames refused: BPF_PROG_TEST_RUN: EPERM: ...`...
    pub why: String,
}

impl fmt::Display for Choice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.sender, self.why)
    }
}

impl Choice {
    /// The sender `asked` names: `auto` (or nothing) for live frames where the kernel allows
    /// them, else the packet ring; `live` or `ring` for that one. Each is probed first; an error
    /// names what the machine lacks, in one line.
    pub fn asked(asked: &str) -> anyhow::Result<Choice> {
        let probe = |allowed: fn() -> anyhow::Result<()>| move || allowed().map_err(|e| format!("{e:#}"));
        decide(asked, probe(live::allowed), probe(ring::allowed))
    }
}

/// The choice [`Choice::asked`] makes, from what probing each sender said (probed only if
/// needed: a refused live-frames probe costs nothing, a granted ring one a socket).
fn decide(
    asked: &str,
    live: impl FnOnce() -> Result<(), String>,
    ring: impl FnOnce() -> Result<(), String>,
) -> anyhow::Result<Choice> {
    match asked.trim() {
        "" | "auto" => match live() {
            Ok(()) => Ok(Choice { sender: Sender::LiveFrames, why: "the kernel allows live frames".into() }),
            Err(l) => match ring() {
                Ok(()) => Ok(Choice { sender: Sender::PacketRing, why: format!("live frames refused: {l}") }),
                Err(r) => {
                    bail!("this machine can send no flood: live frames refused ({l}), packet ring refused ({r})")
                }
            },
        },
        "live" => {
            live().map_err(|l| anyhow::anyhow!("asked for live frames, but they are refused: {l}"))?;
            Ok(Choice { sender: Sender::LiveFrames, why: "asked for".into() })
        }
        "ring" => {
            ring().map_err(|r| anyhow::anyhow!("asked for the packet ring, but it is refused: {r}"))?;
            Ok(Choice { sender: Sender::PacketRing, why: "asked for".into() })
        }
        other => bail!("unknown sender {other:?} (from {SENDER_ENV} or --sender): expected auto, live or ring"),
    }
}
/// Which sources the frames come from: `count` consecutive values of 4 bytes of the address.
/// IPv4: the whole address, from `first`. IPv6: bytes 4..8, so each source is its own /64
/// (the limiter's default IPv6 key) and a million sources are a million keys.
#[derive(Clone, Copy, Debug)]
pub struct SourceRange {
    pub first: IpAddr,
    pub count: u32,
}

impl SourceRange {
    pub fn one(source: IpAddr) -> Self {
        Self { first: source, count: 1 }
    }

    /// The `i`-th source (what frame `i` carries).
    pub fn nth(&self, i: u32) -> IpAddr {
        match self.first {
            IpAddr::V4(a) => IpAddr::V4(u32::from(a).wrapping_add(i).into()),
            IpAddr::V6(a) => {
                let mut o = a.octets();
                let v = u32::from_be_bytes([o[4], o[5], o[6], o[7]]).wrapping_add(i);
                o[4..8].copy_from_slice(&v.to_be_bytes());
                IpAddr::V6(o.into())
            }
        }
    }
}

const ETH: usize = 14;
const V4: usize = 20;
const V6: usize = 40;

/// The frame of the first source, and where each sender rewrites it for the next ones: the
/// source's 4 varying bytes and the checksums over them (RFC 1624, from what the frame holds).
#[derive(Clone, Debug)]
pub struct Template {
    pub frame: Vec<u8>,
    pub sources: SourceRange,
    src_offset: usize,
    /// Checksums covering the source: IPv4's header; UDP's, TCP's and ICMPv6's pseudo-header.
    checksums: Vec<usize>,
}

impl Template {
    pub fn new(spec: &FrameSpec, l4: L4, sources: SourceRange) -> anyhow::Result<Self> {
        ensure!(sources.count > 0, "at least one source");
        let mut frame = spec.frame_of(l4, sources.first)?;
        let v4 = sources.first.is_ipv4();
        let (src_offset, l3) = if v4 { (ETH + 12, V4) } else { (ETH + 8 + 4, V6) };
        let mut checksums = if v4 { vec![ETH + 10] } else { vec![] };
        match (l4, v4) {
            // UDP over IPv4 may go without a checksum: cheaper, and nothing to keep right.
            (L4::Udp, true) => frame[ETH + l3 + 6..ETH + l3 + 8].fill(0),
            (L4::Udp, false) => checksums.push(ETH + l3 + 6),
            (L4::TcpSyn, _) => checksums.push(ETH + l3 + 16),
            // ICMP's checksum covers no pseudo-header; ICMPv6's does.
            (L4::IcmpEcho, true) => {}
            (L4::IcmpEcho, false) => checksums.push(ETH + l3 + 2),
        }
        Ok(Self { frame, sources, src_offset, checksums })
    }

    /// The live-frames program's settings for this template.
    pub fn gen_config(&self) -> anyhow::Result<GenConfig> {
        let word = |i: usize| u32::try_from(i).context("offset");
        let checksum = |n: usize| self.checksums.get(n).map_or(Ok(0), |&o| word(o));
        Ok(GenConfig {
            base: self.base(),
            count: self.sources.count,
            src_offset: word(self.src_offset)?,
            ip_csum_offset: checksum(0)?,
            l4_csum_offset: checksum(1)?,
            _pad: 0,
        })
    }

    fn base(&self) -> u32 {
        let b = &self.frame[self.src_offset..self.src_offset + 4];
        u32::from_be_bytes([b[0], b[1], b[2], b[3]])
    }

    /// Writes the frame of source `i` (of [`SourceRange::nth`]) into `out`, which holds
    /// `frame.len()` bytes.
    pub fn write_nth(&self, i: u32, out: &mut [u8]) {
        out.copy_from_slice(&self.frame);
        let at = self.src_offset;
        let (old, new) = (self.base().to_be_bytes(), self.base().wrapping_add(i).to_be_bytes());
        out[at..at + 4].copy_from_slice(&new);
        for &c in &self.checksums {
            let hc = u16::from_be_bytes([self.frame[c], self.frame[c + 1]]);
            out[c..c + 2].copy_from_slice(&checksum_replacing(hc, old, new).to_be_bytes());
        }
    }
}

/// A flood generator: the template and the sender of this process.
pub struct Generator {
    engine: Engine,
    choice: Choice,
}

enum Engine {
    Live(live::LiveFrames),
    Ring(ring::PacketRing),
}

impl Generator {
    /// A generator of `l4` frames like `spec` builds, from `sources`, on the process's sender
    /// ([`Sender::chosen`]).
    pub fn new(spec: &FrameSpec, l4: L4, sources: SourceRange) -> anyhow::Result<Self> {
        Self::with(Sender::chosen()?, spec, l4, sources)
    }

    /// [`Generator::new`] on the sender `choice` names.
    pub fn with(choice: Choice, spec: &FrameSpec, l4: L4, sources: SourceRange) -> anyhow::Result<Self> {
        let template = Template::new(spec, l4, sources)?;
        let engine = match choice.sender {
            Sender::LiveFrames => Engine::Live(live::LiveFrames::new(template)?),
            Sender::PacketRing => Engine::Ring(ring::PacketRing::new(template)?),
        };
        Ok(Self { engine, choice })
    }

    pub fn sender(&self) -> Sender {
        self.choice.sender
    }

    /// The sender and why it was chosen.
    pub fn choice(&self) -> &Choice {
        &self.choice
    }

    /// Sends out of `iface` (in the calling thread's namespace; pin the thread first) until
    /// `max_time` is up, or `frames` are sent if that comes first: a flood bounded by time passes
    /// [`crate::flood::cap`]`(max_time)`, one whose count is its point (every source so many
    /// times) the count. Returns what was handed to the interface; `report.sender` names the
    /// sender. Slowed down by [`crate::flood::THROTTLE_ENV`], reported to
    /// [`crate::flood::FLOOD_LOG_ENV`].
    pub fn send(&self, iface: &str, frames: u64, max_time: Duration) -> anyhow::Result<Report> {
        let throttle = Throttle::from_env();
        let first = Instant::now();
        let sent = match &self.engine {
            Engine::Live(e) => e.send(iface, frames, first + max_time, max_time, throttle),
            Engine::Ring(e) => e.send(iface, frames, first + max_time, throttle),
        }
        .with_context(|| format!("flooding with the {} sender", self.sender()))?;
        if sent == 0 {
            bail!("the {} sender sent nothing in {max_time:?}", self.sender());
        }
        let report = Report {
            sent,
            first: Some(first),
            last: Some(Instant::now()),
            throttled: throttle.map(|t| t.fraction),
            sender: Some(self.sender().name()),
            ..Report::default()
        };
        log_flood(&report);
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::flood::tests::spec;

    #[test]
    fn the_ring_is_chosen_where_live_frames_are_refused_and_a_machine_with_neither_says_so() {
        let ok = || Ok(());
        let eperm = || Err("BPF_PROG_TEST_RUN: EPERM: Operation not permitted".to_string());
        let never = || -> Result<(), String> { panic!("probed a sender the choice did not need") };
        assert_eq!(decide("", ok, never).unwrap().sender, Sender::LiveFrames);
        let c = decide("auto", eperm, ok).unwrap();
        assert_eq!(c.sender, Sender::PacketRing);
        assert!(c.to_string().contains("live frames refused: BPF_PROG_TEST_RUN: EPERM"), "{c}");
        assert_eq!(decide(" ring ", never, ok).unwrap().sender, Sender::PacketRing);
        assert_eq!(decide("live", ok, never).unwrap().sender, Sender::LiveFrames);
        let neither = decide("auto", eperm, || Err("PACKET_TX_RING: EPERM".into())).unwrap_err().to_string();
        assert!(
            !neither.contains('\n') && neither.contains("EPERM") && neither.contains("PACKET_TX_RING"),
            "{neither}"
        );
        assert!(decide("live", eperm, ok).unwrap_err().to_string().contains("EPERM"));
        assert!(decide("fast", ok, ok).is_err());
    }

    /// The rewritten frame of source i is the frame built for that source from scratch, but for
    /// IPv4 UDP's checksum, which the template leaves out (0: none).
    #[test]
    fn the_nth_frame_is_the_frame_built_for_the_nth_source() {
        let v4 = IpAddr::V4(Ipv4Addr::new(198, 19, 255, 250));
        let v6 = IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0xfffe, 0, 0, 0, 2));
        for (first, dst) in [(v4, IpAddr::V4(Ipv4Addr::new(198, 18, 0, 1))), (v6, "2001:db8::1".parse().unwrap())] {
            for l4 in [L4::Udp, L4::TcpSyn, L4::IcmpEcho] {
                let sources = SourceRange { first, count: 300 };
                let t = Template::new(&spec(dst), l4, sources).unwrap();
                let mut out = vec![0; t.frame.len()];
                for i in [0, 1, 5, 6, 255, 299] {
                    t.write_nth(i, &mut out);
                    let mut expected = spec(dst).frame_of(l4, sources.nth(i)).unwrap();
                    if l4 == L4::Udp && first.is_ipv4() {
                        expected[ETH + V4 + 6..ETH + V4 + 8].fill(0);
                    }
                    assert_eq!(out, expected, "{l4:?} from {first}, source {i} ({})", sources.nth(i));
                }
            }
        }
    }
}

//! Counting what XDP let through, independently of the limiter's own counters: an AF_PACKET
//! socket on the receiver's veth end sees every frame the program passed and none it dropped
//! (XDP runs before any packet tap). Each frame is parsed back into its [`Flow`] and timed on
//! arrival, whatever its protocol, and whether or not anything in the stack would accept it.

use std::{
    io,
    net::IpAddr,
    os::fd::{AsRawFd, OwnedFd},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, anyhow};
use etherparse::{Icmpv4Type, Icmpv6Type, NetSlice, SlicedPacket, TransportSlice};

use crate::{
    flood::{self, Flow, L4},
    netns::End,
};

/// Room for every frame a test's flood can put through before the reader catches up.
const RCVBUF: libc::c_int = 64 << 20;
/// After [`Capture::finish`], reading stops once nothing arrived for this long...
const QUIET: Duration = Duration::from_millis(200);
/// ...or after this long in any case.
const MAX_DRAIN: Duration = Duration::from_secs(5);

/// One frame that got through.
#[derive(Clone, Copy, Debug)]
pub struct Seen {
    pub at: Instant,
    pub flow: Flow,
    /// The whole frame, Ethernet header included: what a byte-mode policy charges.
    pub len: u64,
}

/// Everything the capture saw.
#[derive(Clone, Debug, Default)]
pub struct Captured {
    pub seen: Vec<Seen>,
    /// Frames that were not one of the flood's (not IP, or not UDP/TCP/ICMP echo).
    pub other: u64,
    /// Frames the kernel dropped because the socket was full (must be 0 for the counts to hold).
    pub drops: u64,
    /// The longest frame seen, of any kind.
    pub longest: u64,
}

impl Captured {
    pub fn packets(&self, pred: impl Fn(&Flow) -> bool) -> u64 {
        self.seen.iter().filter(|s| pred(&s.flow)).count() as u64
    }

    pub fn bytes(&self, pred: impl Fn(&Flow) -> bool) -> u64 {
        self.seen.iter().filter(|s| pred(&s.flow)).map(|s| s.len).sum()
    }

    /// Frames of `flows` that arrived in `[from, to)`.
    pub fn between(&self, flows: impl Fn(&Flow) -> bool, from: Instant, to: Instant) -> u64 {
        self.seen.iter().filter(|s| flows(&s.flow) && s.at >= from && s.at < to).count() as u64
    }

    /// When the last frame arrived.
    pub fn last(&self) -> Option<Instant> {
        self.seen.last().map(|s| s.at)
    }
}

/// A capture running on its own thread until [`Capture::finish`] (or drop).
pub struct Capture {
    stop: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<anyhow::Result<Captured>>>,
}

impl Capture {
    /// Starts capturing what arrives on `end`'s interface.
    pub fn start(end: &End) -> anyhow::Result<Self> {
        let iface = end.iface.clone();
        // A socket belongs to the namespace it was created in, whichever thread reads it.
        let fd = end.run(move || open(&iface))??;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = thread::spawn(move || read(&fd, &flag));
        Ok(Self { stop, handle: Some(handle) })
    }

    /// Waits until the link has been quiet for [`QUIET`] (at most [`MAX_DRAIN`]) and returns
    /// what was seen.
    pub fn finish(mut self) -> anyhow::Result<Captured> {
        self.stop.store(true, Ordering::Relaxed);
        let handle = self.handle.take().context("the capture was already finished")?;
        handle.join().map_err(|_| anyhow!("the capture thread panicked"))?
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// An AF_PACKET socket receiving every frame that arrives on `iface` (not the ones leaving it).
fn open(iface: &str) -> anyhow::Result<OwnedFd> {
    let ifindex = flood::ifindex(iface)?;
    // Protocol 0: nothing is queued until bind() names the interface and ETH_P_ALL.
    let fd = flood::packet_socket()?;
    // The receiver's replies (RSTs, ICMP errors) leave by the same interface: not ours to count.
    setsockopt(&fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, 1).context("PACKET_IGNORE_OUTGOING")?;
    setsockopt(&fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, RCVBUF).context("SO_RCVBUFFORCE")?;
    let timeout = libc::timeval { tv_sec: 0, tv_usec: 20_000 };
    setsockopt(&fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, timeout).context("SO_RCVTIMEO")?;
    flood::bind_ll(&fd, ifindex, libc::ETH_P_ALL as u16).with_context(|| format!("binding the capture to {iface}"))?;
    Ok(fd)
}

fn setsockopt<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: T) -> io::Result<()> {
    let len = std::mem::size_of::<T>() as libc::socklen_t;
    if unsafe { libc::setsockopt(fd.as_raw_fd(), level, name, (&raw const value).cast(), len) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn read(fd: &OwnedFd, stop: &AtomicBool) -> anyhow::Result<Captured> {
    let mut captured = Captured::default();
    let mut buf = [0u8; 2048];
    let mut stop_seen: Option<Instant> = None;
    loop {
        // MSG_TRUNC: the frame's whole length (an aggregate in skb mode can be longer than the
        // buffer, which only needs its headers).
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_TRUNC) };
        if n >= 0 {
            let at = Instant::now();
            let frame = &buf[..(n as usize).min(buf.len())];
            captured.longest = captured.longest.max(n as u64);
            match flow_of(frame) {
                Some(flow) => captured.seen.push(Seen { at, flow, len: n as u64 }),
                None => captured.other += 1,
            }
        } else {
            let e = io::Error::last_os_error();
            if !matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted) {
                return Err(e).context("reading the capture");
            }
        }
        if stop.load(Ordering::Relaxed) {
            let since = *stop_seen.get_or_insert_with(Instant::now);
            let idle = captured.last().map_or(since.elapsed(), |l| l.max(since).elapsed());
            if idle >= QUIET || since.elapsed() >= MAX_DRAIN {
                captured.drops = drops(fd)?;
                return Ok(captured);
            }
        }
    }
}

/// Frames the kernel could not queue to the socket since it was opened.
fn drops(fd: &OwnedFd) -> anyhow::Result<u64> {
    let mut stats: libc::tpacket_stats = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tpacket_stats>() as libc::socklen_t;
    let rc = unsafe {
        libc::getsockopt(fd.as_raw_fd(), libc::SOL_PACKET, libc::PACKET_STATISTICS, (&raw mut stats).cast(), &mut len)
    };
    if rc < 0 {
        return Err(io::Error::last_os_error()).context("PACKET_STATISTICS");
    }
    Ok(u64::from(stats.tp_drops))
}

/// The flood flow a frame belongs to; None for anything else.
pub fn flow_of(frame: &[u8]) -> Option<Flow> {
    let sliced = SlicedPacket::from_ethernet(frame).ok()?;
    let src: IpAddr = match sliced.net? {
        NetSlice::Ipv4(ip) => ip.header().source_addr().into(),
        NetSlice::Ipv6(ip) => ip.header().source_addr().into(),
        _ => return None,
    };
    let (l4, dport) = match sliced.transport? {
        TransportSlice::Udp(udp) => (L4::Udp, udp.destination_port()),
        TransportSlice::Tcp(tcp) if tcp.syn() && !tcp.ack() => (L4::TcpSyn, tcp.destination_port()),
        TransportSlice::Icmpv4(icmp) if matches!(icmp.icmp_type(), Icmpv4Type::EchoRequest(_)) => (L4::IcmpEcho, 0),
        TransportSlice::Icmpv6(icmp) if matches!(icmp.icmp_type(), Icmpv6Type::EchoRequest(_)) => (L4::IcmpEcho, 0),
        _ => return None,
    };
    Some(Flow { src, l4, dport })
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::flood::FrameSpec;

    #[test]
    fn frames_parse_back_into_their_flows() {
        let spec =
            |dst: IpAddr| FrameSpec { src_mac: [2; 6], dst_mac: [4; 6], dst, sport: 1234, dport: 53, payload: 20 };
        let v4 = spec(Ipv4Addr::new(198, 18, 0, 1).into());
        let v6 = spec(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1).into());
        for (spec, src) in [(v4, IpAddr::from(Ipv4Addr::new(198, 19, 0, 9))), (v6, "2001:db8:9::9".parse().unwrap())] {
            for l4 in [L4::Udp, L4::TcpSyn, L4::IcmpEcho] {
                let frame = spec.frame_of(l4, src).unwrap();
                assert_eq!(flow_of(&frame), Some(spec.flow(l4, src)), "{l4:?} from {src}");
            }
        }
        assert_eq!(flow_of(&[0u8; 60]), None);
    }
}

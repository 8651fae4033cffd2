//! Exact floods: crafted Ethernet/IPv4|IPv6/UDP frames to one destination MAC, from one source,
//! from N spoofed sources of a prefix (round robin), or from every address of a prefix, each
//! frame sent by one system call, so it can be paced, stopped at any frame and counted per flow.
//! The fast floods (as fast as the machine goes, from one template) are [`crate::generator`]'s;
//! both report a [`Report`].
//!
//! Frames are built up front ([`Frames`]), so the send loop does nothing but hand the next frame
//! to a [`Transmit`]: [`PacketSocket`] (an AF_PACKET raw socket), or a stand-in in unit tests.
//!
//! Floods are bounded by time first ([`Limits::timed`]): machines of one kind differ 2-4x in
//! speed from one session to the next, so a flood bounded by a packet count would last however
//! long the machine took. A packet count is a safety cap ([`cap`]) no machine reaches in the
//! duration, unless the count is the point of the flood ([`Limits::counted`]). What a flood did
//! ([`Report`]) says how long it took and how long the sender stalled, so bounds can be held to
//! what was actually sent, and when.
//!
//! Two environment variables, for `cargo xtask test --stress`: [`THROTTLE_ENV`] slows every
//! generator down (each send is followed by a busy wait as long as it took, for half speed),
//! and [`FLOOD_LOG_ENV`] names a file every flood appends its report to.

use std::{
    collections::BTreeMap,
    fmt, io,
    net::IpAddr,
    os::fd::{AsRawFd, OwnedFd},
    str::FromStr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use etherparse::PacketBuilder;
use nix::sys::socket::{AddressFamily, MsgFlags, SockFlag, SockType, socket};

/// No more frames than this are pre-built (at 60-80 bytes each, tens of MB).
pub const MAX_FRAMES: usize = 1 << 20;
pub const DEFAULT_SPORT: u16 = 40_000;
/// UDP payload bytes: with IPv4 this makes a 60-byte frame, Ethernet's minimum without FCS.
pub const DEFAULT_PAYLOAD: usize = 18;

/// An address prefix such as `198.19.0.0/16` or `2001:db8:1::/64`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefix {
    pub addr: IpAddr,
    pub len: u8,
}

impl Prefix {
    fn bits(&self) -> u32 {
        if self.addr.is_ipv4() { 32 } else { 128 }
    }

    /// How many addresses the prefix holds (saturating at u128::MAX for ::/0).
    pub fn size(&self) -> u128 {
        1u128.checked_shl(self.bits() - u32::from(self.len)).unwrap_or(u128::MAX)
    }

    /// The `i`-th address of the prefix (0 is the prefix's own address, host bits zero).
    pub fn nth(&self, i: u128) -> Option<IpAddr> {
        if i >= self.size() {
            return None;
        }
        Some(match self.addr {
            IpAddr::V4(a) => IpAddr::V4((u32::from(a) & mask32(self.len)).wrapping_add(i as u32).into()),
            IpAddr::V6(a) => IpAddr::V6((u128::from(a) & mask128(self.len)).wrapping_add(i).into()),
        })
    }
}

fn mask32(len: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0)
}

fn mask128(len: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0)
}

impl FromStr for Prefix {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || format!("invalid prefix '{s}': expected ADDRESS/LENGTH such as 198.19.0.0/16");
        let (addr, len) = s.split_once('/').ok_or_else(err)?;
        let addr: IpAddr = addr.parse().map_err(|_| err())?;
        let len: u8 = len.parse().map_err(|_| err())?;
        let prefix = Self { addr, len };
        if u32::from(len) > prefix.bits() {
            return Err(err());
        }
        Ok(prefix)
    }
}

impl fmt::Display for Prefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// Where the flood claims to come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sources {
    One(IpAddr),
    /// Addresses 1..=count of the prefix (skipping the all-zero host), sent round robin.
    Spoofed {
        prefix: Prefix,
        count: u32,
    },
    /// Every address of the prefix in order, then again (the prefix must hold <= MAX_FRAMES).
    Sweep(Prefix),
}

impl Sources {
    /// The source of each pre-built frame, in sending order.
    pub fn addresses(&self) -> anyhow::Result<Vec<IpAddr>> {
        let (prefix, first, count) = match *self {
            Self::One(addr) => return Ok(vec![addr]),
            Self::Spoofed { prefix, count } => {
                ensure!(count >= 1, "--sources must be at least 1");
                ensure!(u128::from(count) < prefix.size(), "{prefix} holds fewer than {count} host addresses");
                (prefix, 1, u128::from(count))
            }
            Self::Sweep(prefix) => (prefix, 0, prefix.size()),
        };
        ensure!(
            count <= MAX_FRAMES as u128,
            "{count} sources in {prefix} is more than the {MAX_FRAMES} frames this generator pre-builds"
        );
        Ok((first..first + count).filter_map(|i| prefix.nth(i)).collect())
    }
}

/// Everything about the frames except their source address (and, for [`FrameSpec::frame`], the
/// protocol: UDP).
#[derive(Clone, Debug)]
pub struct FrameSpec {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
    pub payload: usize,
}

/// What a frame carries above IP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum L4 {
    /// UDP, `payload` bytes of payload.
    Udp,
    /// A bare TCP SYN (no options, no payload).
    TcpSyn,
    /// ICMP echo request over IPv4, ICMPv6 echo request over IPv6, `payload` bytes of data.
    IcmpEcho,
}

/// What tells frames apart for the limiter: source, protocol and destination port (0 for ICMP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Flow {
    pub src: IpAddr,
    pub l4: L4,
    pub dport: u16,
}

impl FrameSpec {
    /// One Ethernet/IP/UDP frame from `src`, checksums filled in.
    pub fn frame(&self, src: IpAddr) -> anyhow::Result<Vec<u8>> {
        self.frame_of(L4::Udp, src)
    }

    /// One Ethernet/IP frame carrying `l4` from `src`, checksums filled in.
    pub fn frame_of(&self, l4: L4, src: IpAddr) -> anyhow::Result<Vec<u8>> {
        let eth = PacketBuilder::ethernet2(self.src_mac, self.dst_mac);
        let ip = match (src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => eth.ipv4(s.octets(), d.octets(), 64),
            (IpAddr::V6(s), IpAddr::V6(d)) => eth.ipv6(s.octets(), d.octets(), 64),
            _ => bail!("source {src} and destination {} are of different families", self.dst),
        };
        let data = vec![0x6c; self.payload];
        let mut frame = Vec::new();
        match l4 {
            L4::Udp => ip.udp(self.sport, self.dport).write(&mut frame, &data).context("building a UDP frame")?,
            L4::TcpSyn => {
                ip.tcp(self.sport, self.dport, 1, 64_240).syn().write(&mut frame, &[]).context("building a TCP SYN")?
            }
            L4::IcmpEcho if src.is_ipv4() => {
                ip.icmpv4_echo_request(1, 1).write(&mut frame, &data).context("building an ICMP echo request")?
            }
            L4::IcmpEcho => {
                ip.icmpv6_echo_request(1, 1).write(&mut frame, &data).context("building an ICMPv6 echo request")?
            }
        }
        Ok(frame)
    }

    /// The flow of a frame `frame_of(l4, src)` builds.
    pub fn flow(&self, l4: L4, src: IpAddr) -> Flow {
        Flow { src, l4, dport: if l4 == L4::IcmpEcho { 0 } else { self.dport } }
    }
}

/// Frames of one protocol and spec, from each of `sources`.
#[derive(Clone, Debug)]
pub struct Stream {
    pub spec: FrameSpec,
    pub l4: L4,
    pub sources: Sources,
}

/// Pre-built frames, stored back to back.
pub struct Frames {
    bytes: Vec<u8>,
    /// Frame `i` is `bytes[offsets[i]..offsets[i + 1]]`.
    offsets: Vec<usize>,
    flows: Vec<Flow>,
}

impl Frames {
    /// UDP frames from each of `sources`.
    pub fn build(spec: &FrameSpec, sources: &Sources) -> anyhow::Result<Self> {
        Self::mix(&[Stream { spec: spec.clone(), l4: L4::Udp, sources: sources.clone() }])
    }

    /// The streams' frames interleaved (first of each, second of each, ...), so every stream is
    /// offered its share of the flood all along.
    pub fn mix(streams: &[Stream]) -> anyhow::Result<Self> {
        let built = streams
            .iter()
            .map(|s| Ok(s.sources.addresses()?.into_iter().map(|src| (s, src)).collect::<Vec<_>>()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let total: usize = built.iter().map(Vec::len).sum();
        ensure!(total <= MAX_FRAMES, "{total} frames is more than the {MAX_FRAMES} this generator pre-builds");
        let longest = built.iter().map(Vec::len).max().unwrap_or(0);
        let mut frames = Self { bytes: Vec::new(), offsets: vec![0], flows: Vec::new() };
        for i in 0..longest {
            for &(stream, src) in built.iter().filter_map(|b| b.get(i)) {
                frames.bytes.extend_from_slice(&stream.spec.frame_of(stream.l4, src)?);
                frames.offsets.push(frames.bytes.len());
                frames.flows.push(stream.spec.flow(stream.l4, src));
            }
        }
        Ok(frames)
    }

    pub fn count(&self) -> usize {
        self.flows.len()
    }

    /// Frame `i` (sending order), and the source address it carries.
    pub fn get(&self, i: usize) -> (&[u8], IpAddr) {
        (&self.bytes[self.offsets[i]..self.offsets[i + 1]], self.flows[i].src)
    }

    pub fn flow(&self, i: usize) -> Flow {
        self.flows[i]
    }

    /// How many frames of each flow a flood of `sent` frames put on the wire: [`Frames::send`]
    /// goes round robin and retries a refused frame, so this is exact.
    pub fn sent_per_flow(&self, sent: u64) -> BTreeMap<Flow, u64> {
        let n = self.count() as u64;
        let mut per_flow = BTreeMap::new();
        for (i, flow) in self.flows.iter().enumerate() {
            let times = sent / n + u64::from((i as u64) < sent % n);
            *per_flow.entry(*flow).or_default() += times;
        }
        per_flow
    }

    /// Sends frames round robin until `limits` says stop; pins the calling thread first if
    /// `limits.cpu` is set. Transient refusals (ENOBUFS, EAGAIN) are counted, not fatal, and the
    /// refused frame is sent again, so what went out is exactly known ([`Frames::sent_per_flow`]).
    pub fn send(&self, tx: &mut impl Transmit, limits: &Limits) -> anyhow::Result<Report> {
        self.send_steered(tx, limits, &Steer::default())
    }
}

fn is_transient(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN))
}

/// Far above what any generator here reaches (the live-frames one: about 10 Mpps on the fastest
/// machines of this kind): the packet cap of a flood bounded by time is its duration at this rate.
pub const CAP_PPS: u64 = 100_000_000;

/// The packet cap of a flood of `duration`: `duration` x [`CAP_PPS`], so time always stops it.
pub fn cap(duration: Duration) -> u64 {
    ((duration.as_secs_f64() * CAP_PPS as f64).ceil() as u64).max(1)
}

/// When a flood stops: whichever limit comes first.
#[derive(Clone, Debug)]
pub struct Limits {
    pub packets: u64,
    pub duration: Duration,
    /// Pin the sending thread to this CPU (veth runs the receiver's XDP on the sending CPU).
    pub cpu: Option<usize>,
}

impl Limits {
    /// A flood stopped by time: `duration`, with a packet cap no machine reaches in it ([`cap`]).
    pub fn timed(duration: Duration) -> Self {
        Self { packets: cap(duration), duration, cpu: None }
    }

    /// A flood whose point is its packet count (all of them captured, a sweep that covers a
    /// prefix, ...), still stopped by `duration` at the latest: check [`Report::sent`].
    pub fn counted(packets: u64, duration: Duration) -> Self {
        Self { packets, duration, cpu: None }
    }

    /// The same limits, the sender pinned to `cpu`.
    pub fn on_cpu(self, cpu: usize) -> Self {
        Self { cpu: Some(cpu), ..self }
    }
}

/// A gap between two sends longer than this (beyond the pace, for a paced flood) is a stall of
/// the sender: the machine, not the system under test, stopped the flood for that long.
pub const STALL: Duration = Duration::from_micros(200);

/// The sender's stalls ([`STALL`]) during a flood.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stalls {
    /// Each one, in order.
    pub each: Vec<Stall>,
}

/// One stall of the sender: nothing was sent from `from` for `len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stall {
    /// When it began, from the flood's start.
    pub from: Duration,
    /// How long it lasted (beyond the pace, if paced).
    pub len: Duration,
    /// The frames sent before it: between two stalls the sender sent only so many, however
    /// long the time between them.
    pub sent_before: u64,
}

impl Stall {
    pub fn end(&self) -> Duration {
        self.from + self.len
    }
}

impl Stalls {
    /// Accounts a gap of `gap` between two sends that were due `due` apart, the second one sent
    /// `at` (from the flood's start) after `sent_before` others.
    pub fn gap(&mut self, at: Duration, gap: Duration, due: Duration, sent_before: u64) {
        let excess = gap.saturating_sub(due);
        if excess > STALL {
            self.each.push(Stall { from: at.saturating_sub(excess), len: excess, sent_before });
        }
    }

    pub fn count(&self) -> usize {
        self.each.len()
    }

    pub fn total(&self) -> Duration {
        self.each.iter().map(|s| s.len).sum()
    }

    pub fn longest(&self) -> Duration {
        self.each.iter().map(|s| s.len).max().unwrap_or_default()
    }
}

/// Environment variable: run every flood generator at this fraction of its speed (`0.5`: half).
/// After each send (live frames: each batch) the sender busy-waits `(1/f - 1)` times as long as
/// the send took, so it is slowed as a slower machine would be, paced floods included (those stay
/// on pace as long as the slowed sender still keeps up).
pub const THROTTLE_ENV: &str = "LIMITER_FLOOD_THROTTLE";

/// Environment variable: a file every flood appends one line to (its engine and [`Report`]).
pub const FLOOD_LOG_ENV: &str = "LIMITER_FLOOD_LOG";

/// Slows a sender down by [`THROTTLE_ENV`].
#[derive(Clone, Copy, Debug)]
pub struct Throttle {
    /// The fraction of full speed.
    pub fraction: f64,
}

impl Throttle {
    /// The throttle [`THROTTLE_ENV`] asks for, if any; panics on a value that is not a fraction
    /// in (0, 1] (a stress run must not silently run at full speed).
    pub fn from_env() -> Option<Self> {
        let v = std::env::var(THROTTLE_ENV).ok()?;
        let fraction: f64 = v.trim().parse().unwrap_or(f64::NAN);
        assert!(fraction > 0.0 && fraction <= 1.0, "{THROTTLE_ENV}={v:?}: expected a fraction in (0, 1], e.g. 0.5");
        (fraction < 1.0).then_some(Self { fraction })
    }

    /// Busy-waits after a send that took `busy`, long enough that the sender runs at `fraction`
    /// of its speed.
    pub fn after(&self, busy: Duration) {
        let until = Instant::now() + busy.mul_f64(1.0 / self.fraction - 1.0);
        while Instant::now() < until {
            std::hint::spin_loop();
        }
    }
}

/// Appends `report` to the file [`FLOOD_LOG_ENV`] names, if it does.
pub fn log_flood(report: &Report) {
    use std::io::Write as _;
    let Some(path) = std::env::var_os(FLOOD_LOG_ENV) else { return };
    let line = format!("{} {report}\n", report.sender.unwrap_or("unnamed"));
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        eprintln!("warning: could not append the flood report to {}: {e}", std::path::Path::new(&path).display());
    }
}

/// What a flood did. `first` is taken before the first send, `last` after the last one.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub sent: u64,
    /// Sends the kernel refused for lack of room (not counted in `sent`).
    pub refused: u64,
    pub first: Option<Instant>,
    pub last: Option<Instant>,
    /// How long the sender stalled (the live-frames generator does not measure it).
    pub stalls: Stalls,
    /// The fraction of its speed the sender was throttled to ([`THROTTLE_ENV`]), if it was.
    pub throttled: Option<f64>,
    /// The rate the flood was paced at, if it was.
    pub paced: Option<f64>,
    /// What sent it: `socket`, or one of the generator's senders
    /// ([`crate::generator::Sender::name`]); `None` for stand-ins in unit tests.
    pub sender: Option<&'static str>,
}

impl Report {
    pub fn duration(&self) -> Duration {
        match (self.first, self.last) {
            (Some(first), Some(last)) => last.duration_since(first),
            _ => Duration::ZERO,
        }
    }

    pub fn pps(&self) -> f64 {
        self.sent as f64 / self.duration().as_secs_f64().max(1e-9)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "sent={} refused={} seconds={:.3} pps={:.0}",
            self.sent,
            self.refused,
            self.duration().as_secs_f64(),
            self.pps()
        )?;
        if self.stalls.count() > 0 {
            let (count, total, longest) = (self.stalls.count(), self.stalls.total(), self.stalls.longest());
            write!(f, " stalls={count} stalled={:.3}s longest={:.3}s", total.as_secs_f64(), longest.as_secs_f64())?;
        }
        if let Some(rate) = self.paced {
            write!(f, " paced={rate:.0}")?;
        }
        if let Some(fraction) = self.throttled {
            write!(f, " throttled={fraction}")?;
        }
        if let Some(sender) = self.sender {
            write!(f, " sender={sender}")?;
        }
        Ok(())
    }
}

/// Something that puts one frame on the wire (or into the program under test).
pub trait Transmit {
    fn transmit(&mut self, frame: &[u8]) -> io::Result<()>;

    /// What the flood log ([`FLOOD_LOG_ENV`]) and [`Report::sender`] call this transmitter;
    /// `None` (stand-ins in unit tests): not logged.
    fn sender(&self) -> Option<&'static str> {
        None
    }
}

/// An AF_PACKET raw socket bound to one interface of the calling thread's namespace; frames go
/// out as they are, Ethernet header included.
pub struct PacketSocket {
    fd: OwnedFd,
}

impl PacketSocket {
    /// Opens the socket in the calling thread's network namespace: call it from inside the
    /// sender's namespace.
    pub fn open(iface: &str) -> anyhow::Result<Self> {
        let ifindex = ifindex(iface)?;
        let fd = packet_socket()?;
        // Protocol 0: send only, so the socket never queues received frames.
        bind_ll(&fd, ifindex, 0).with_context(|| format!("binding the AF_PACKET socket to {iface}"))?;
        Ok(Self { fd })
    }
}

impl Transmit for PacketSocket {
    fn transmit(&mut self, frame: &[u8]) -> io::Result<()> {
        nix::sys::socket::send(self.fd.as_raw_fd(), frame, MsgFlags::empty()).map(drop).map_err(io::Error::from)
    }

    fn sender(&self) -> Option<&'static str> {
        Some("socket")
    }
}

/// The index of `iface` in the calling thread's network namespace.
pub fn ifindex(iface: &str) -> anyhow::Result<u32> {
    nix::net::if_::if_nametoindex(iface)
        .with_context(|| format!("no interface '{iface}' in this network namespace (see `ip link`)"))
}

/// A raw AF_PACKET socket of protocol 0: it queues nothing until [`bind_ll`] names a protocol.
pub fn packet_socket() -> anyhow::Result<OwnedFd> {
    socket(AddressFamily::Packet, SockType::Raw, SockFlag::SOCK_CLOEXEC, None)
        .context("opening an AF_PACKET socket (needs CAP_NET_RAW)")
}

/// Binds an AF_PACKET socket to interface `ifindex`, receiving frames of EtherType `proto` (host
/// order; 0 receives none, `ETH_P_ALL` every one). A `sockaddr_ll` of our own: nix's `LinkAddr`
/// can only be read, not built.
pub fn bind_ll(fd: &OwnedFd, ifindex: u32, proto: u16) -> io::Result<()> {
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = proto.to_be();
    addr.sll_ifindex = ifindex as i32;
    let len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
    if unsafe { libc::bind(fd.as_raw_fd(), (&raw const addr).cast(), len) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The MAC address of `iface` in the calling thread's network namespace (getifaddrs asks the
/// kernel over netlink, in that namespace; /sys would show the mount's namespace instead).
pub fn iface_mac(iface: &str) -> anyhow::Result<[u8; 6]> {
    nix::ifaddrs::getifaddrs()
        .context("listing the interfaces (getifaddrs)")?
        .filter(|a| a.interface_name == iface)
        .find_map(|a| a.address?.as_link_addr()?.addr())
        .with_context(|| format!("no MAC address for '{iface}' in this network namespace (see `ip link`)"))
}

/// Parses `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let err = || format!("invalid MAC address '{s}': expected six hex bytes such as 02:00:00:00:00:01");
    let bytes: Vec<u8> =
        s.split(':').map(|b| u8::from_str_radix(b, 16)).collect::<Result<_, _>>().map_err(|_| err())?;
    bytes.try_into().map_err(|_| err())
}

/// What else may stop or slow a flood ([`Frames::send_steered`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct Steer<'a> {
    /// Send at this many frames per second, each at its due time (`first + i / per_sec`; a late
    /// sender catches up), instead of as fast as the transmitter takes them.
    pub per_sec: Option<f64>,
    /// Stop once this is set (checked before every frame when paced, every 64 otherwise).
    pub stop: Option<&'a std::sync::atomic::AtomicBool>,
}

impl Frames {
    /// [`Frames::send`], paced and/or stopped early as `steer` says; `limits` still bound it.
    /// Slowed down by [`THROTTLE_ENV`] if set; the report goes to [`FLOOD_LOG_ENV`] if set.
    pub fn send_steered(&self, tx: &mut impl Transmit, limits: &Limits, steer: &Steer) -> anyhow::Result<Report> {
        self.send_throttled(tx, limits, steer, Throttle::from_env())
    }

    /// [`Frames::send_steered`] with an explicit throttle (`None`: full speed).
    pub fn send_throttled(
        &self,
        tx: &mut impl Transmit,
        limits: &Limits,
        steer: &Steer,
        throttle: Option<Throttle>,
    ) -> anyhow::Result<Report> {
        use std::sync::atomic::Ordering;
        ensure!(self.count() > 0, "no frames to send");
        if let Some(rate) = steer.per_sec {
            ensure!(rate > 0.0 && rate.is_finite(), "invalid pace {rate} frames per second");
        }
        if let Some(cpu) = limits.cpu {
            crate::cpu::pin_current_thread(cpu).with_context(|| format!("pinning the sender to CPU {cpu}"))?;
        }
        let mut report = Report { paced: steer.per_sec, throttled: throttle.map(|t| t.fraction), ..Report::default() };
        let due_gap = steer.per_sec.map_or(Duration::ZERO, |rate| Duration::from_secs_f64(1.0 / rate));
        let start = Instant::now();
        report.first = Some(start);
        let (mut i, mut attempts, mut previous) = (0, 0u64, start);
        while report.sent < limits.packets {
            // Paced floods check every packet; full speed every 64 tries (Instant::now costs).
            if (steer.per_sec.is_some() || attempts.is_multiple_of(64))
                && (start.elapsed() >= limits.duration || steer.stop.is_some_and(|s| s.load(Ordering::Relaxed)))
            {
                break;
            }
            if let Some(rate) = steer.per_sec {
                let due = start + Duration::from_secs_f64(report.sent as f64 / rate);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
            }
            attempts += 1;
            let before = Instant::now();
            let sent = tx.transmit(self.get(i).0);
            let now = Instant::now();
            if let Some(t) = throttle {
                t.after(now - before);
            }
            match sent {
                Ok(()) => {
                    // The first frame's gap runs from the start: a sender slow to begin stalled.
                    let due = if report.sent == 0 { Duration::ZERO } else { due_gap };
                    report.stalls.gap(now - start, now - previous, due, report.sent);
                    previous = now;
                    report.sent += 1;
                }
                Err(e) if is_transient(&e) => {
                    report.refused += 1;
                    continue;
                }
                Err(e) => return Err(e).context(format!("sending frame {} after {} sent", i, report.sent)),
            }
            i = if i + 1 == self.count() { 0 } else { i + 1 };
        }
        report.last = Some(Instant::now());
        report.sender = tx.sender();
        if report.sender.is_some() {
            log_flood(&report);
        }
        Ok(report)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use etherparse::{NetSlice, SlicedPacket, TransportSlice};

    use super::*;

    /// A frame spec between two fixed MACs to `dst`, for unit tests here and in `generator`.
    pub(crate) fn spec(dst: IpAddr) -> FrameSpec {
        FrameSpec {
            src_mac: [2, 0, 0, 0, 0, 2],
            dst_mac: [2, 0, 0, 0, 0, 1],
            dst,
            sport: DEFAULT_SPORT,
            dport: 9,
            payload: DEFAULT_PAYLOAD,
        }
    }

    fn source_of(frame: &[u8]) -> IpAddr {
        let sliced = SlicedPacket::from_ethernet(frame).expect("frame parses");
        match sliced.net.expect("has IP") {
            NetSlice::Ipv4(ip) => ip.header().source_addr().into(),
            NetSlice::Ipv6(ip) => ip.header().source_addr().into(),
            _ => panic!("not IP"),
        }
    }

    #[test]
    fn spoofed_sources_are_sent_round_robin_from_inside_the_prefix() {
        let prefix: Prefix = "198.19.7.9/16".parse().unwrap();
        let frames =
            Frames::build(&spec(Ipv4Addr::new(198, 18, 0, 1).into()), &Sources::Spoofed { prefix, count: 300 })
                .unwrap();
        assert_eq!(frames.count(), 300);
        for i in 0..300 {
            let (frame, src) = frames.get(i);
            assert_eq!(frame.len(), 60);
            assert_eq!(source_of(frame), src);
            assert!(matches!(SlicedPacket::from_ethernet(frame).unwrap().transport, Some(TransportSlice::Udp(_))));
            let expected = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 0, 0)) + 1 + i as u32);
            assert_eq!(src, IpAddr::V4(expected));
        }
    }

    #[test]
    fn a_sweep_covers_every_address_once() {
        let prefix: Prefix = "2001:db8:1::/120".parse().unwrap();
        let frames = Frames::build(&spec(Ipv6Addr::LOCALHOST.into()), &Sources::Sweep(prefix)).unwrap();
        let mut seen: Vec<IpAddr> = (0..frames.count()).map(|i| source_of(frames.get(i).0)).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert!(seen.iter().all(|a| matches!(a, IpAddr::V6(v) if v.segments()[..7] == [0x2001, 0xdb8, 1, 0, 0, 0, 0])));
    }

    #[test]
    fn refuses_what_it_cannot_build() {
        let v4 = spec(Ipv4Addr::new(198, 18, 0, 1).into());
        assert!(Frames::build(&v4, &Sources::One(Ipv6Addr::LOCALHOST.into())).is_err());
        let small: Prefix = "198.19.0.0/30".parse().unwrap();
        assert!(Sources::Spoofed { prefix: small, count: 3 }.addresses().is_ok());
        assert!(Sources::Spoofed { prefix: small, count: 4 }.addresses().is_err());
        assert!(Sources::Sweep("10.0.0.0/8".parse().unwrap()).addresses().is_err());
        assert!("198.19.0.0/33".parse::<Prefix>().is_err());
        assert!("198.19.0.0".parse::<Prefix>().is_err());
    }

    #[test]
    fn send_stops_at_the_packet_limit_and_retries_transient_refusals() {
        /// Refuses every third call; remembers the source of every frame that went out.
        struct Flaky(u64, BTreeMap<IpAddr, u64>);
        impl Transmit for Flaky {
            fn transmit(&mut self, frame: &[u8]) -> io::Result<()> {
                self.0 += 1;
                if self.0.is_multiple_of(3) {
                    return Err(io::Error::from_raw_os_error(libc::ENOBUFS));
                }
                *self.1.entry(source_of(frame)).or_default() += 1;
                Ok(())
            }
        }
        let prefix: Prefix = "198.19.0.0/24".parse().unwrap();
        let frames =
            Frames::build(&spec(Ipv4Addr::new(198, 18, 0, 1).into()), &Sources::Spoofed { prefix, count: 3 }).unwrap();
        let limits = Limits::counted(1000, Duration::from_secs(60));
        let mut tx = Flaky(0, BTreeMap::new());
        let report = frames.send(&mut tx, &limits).unwrap();
        assert_eq!(report.sent, 1000);
        assert_eq!(report.refused, 499);
        assert!(report.last >= report.first);
        let predicted: BTreeMap<IpAddr, u64> =
            frames.sent_per_flow(report.sent).into_iter().map(|(f, n)| (f.src, n)).collect();
        assert_eq!(predicted, tx.1, "a refused frame is retried, so the round robin stays exact");
    }

    #[test]
    fn steered_sends_keep_their_pace_and_stop_when_told() {
        struct Count(u64);
        impl Transmit for Count {
            fn transmit(&mut self, _: &[u8]) -> io::Result<()> {
                self.0 += 1;
                Ok(())
            }
        }
        let prefix: Prefix = "198.19.0.0/24".parse().unwrap();
        let frames =
            Frames::build(&spec(Ipv4Addr::new(198, 18, 0, 1).into()), &Sources::Spoofed { prefix, count: 3 }).unwrap();
        let limits = Limits::counted(50, Duration::from_secs(10));
        let mut tx = Count(0);
        let report = frames.send_steered(&mut tx, &limits, &Steer { per_sec: Some(1000.0), stop: None }).unwrap();
        assert_eq!((report.sent, tx.0), (50, 50));
        // Frame i goes at i ms: the 50th at 49 ms.
        assert!(report.duration() >= Duration::from_millis(49), "{report}");
        let stop = std::sync::atomic::AtomicBool::new(true);
        let report = frames.send_steered(&mut Count(0), &limits, &Steer { per_sec: None, stop: Some(&stop) }).unwrap();
        assert_eq!(report.sent, 0, "a set stop flag sends nothing");
    }

    #[test]
    fn timed_floods_are_capped_far_above_what_their_duration_needs() {
        // 10 Mpps is the fastest generator on the fastest machine of this kind.
        for ms in [1, 300, 2500, 10_000] {
            let d = Duration::from_millis(ms);
            let limits = Limits::timed(d);
            assert_eq!(limits.duration, d);
            assert!(limits.packets as f64 >= 5.0 * 10e6 * d.as_secs_f64(), "{ms} ms: cap {}", limits.packets);
        }
        assert_eq!(Limits::counted(7, Duration::from_secs(1)).on_cpu(1).cpu, Some(1));
    }

    #[test]
    fn a_throttle_halves_the_rate_and_stalls_are_measured() {
        /// Takes 20 us a frame, like a slow transmitter.
        struct Slow;
        impl Transmit for Slow {
            fn transmit(&mut self, _: &[u8]) -> io::Result<()> {
                let until = Instant::now() + Duration::from_micros(20);
                while Instant::now() < until {}
                Ok(())
            }
        }
        let prefix: Prefix = "198.19.0.0/24".parse().unwrap();
        let frames =
            Frames::build(&spec(Ipv4Addr::new(198, 18, 0, 1).into()), &Sources::Spoofed { prefix, count: 3 }).unwrap();
        // One-sided, so a loaded machine cannot fail it: at half speed each frame costs its own
        // 20 us and as long again, so 2,000 frames take at least 80 ms.
        let limits = Limits::counted(2000, Duration::from_secs(60));
        let half =
            frames.send_throttled(&mut Slow, &limits, &Steer::default(), Some(Throttle { fraction: 0.5 })).unwrap();
        assert_eq!(half.sent, 2000);
        assert_eq!(half.throttled, Some(0.5));
        assert!(half.duration() >= Duration::from_millis(80), "2000 frames of 20 us at half speed in {half}");
        let full = frames.send_throttled(&mut Slow, &limits, &Steer::default(), None).unwrap();
        assert!(full.duration() >= Duration::from_millis(40), "{full}");
        eprintln!("full speed: {full}; half speed: {half}");

        let mut stalls = Stalls::default();
        let ms = Duration::from_millis;
        stalls.gap(ms(1), Duration::from_micros(50), Duration::ZERO, 1);
        stalls.gap(ms(10), ms(3), Duration::ZERO, 2);
        stalls.gap(ms(30), Duration::from_micros(10_100), ms(10), 3);
        stalls.gap(ms(40), ms(5), ms(1), 4);
        let stall = |from, len, sent_before| Stall { from: ms(from), len: ms(len), sent_before };
        assert_eq!(stalls.each, vec![stall(7, 3, 2), stall(36, 4, 4)], "gaps beyond the pace longer than {STALL:?}");
        assert_eq!((stalls.count(), stalls.total(), stalls.longest()), (2, ms(7), ms(4)));
    }

    #[test]
    fn mixed_streams_interleave_and_carry_their_protocol() {
        let mut tcp = spec(Ipv4Addr::new(198, 18, 0, 1).into());
        tcp.dport = 80;
        let icmp6 = spec(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1).into());
        let v4: Prefix = "198.19.0.0/24".parse().unwrap();
        let streams = [
            Stream { spec: tcp, l4: L4::TcpSyn, sources: Sources::Spoofed { prefix: v4, count: 2 } },
            Stream { spec: icmp6, l4: L4::IcmpEcho, sources: Sources::One("2001:db8::2".parse().unwrap()) },
        ];
        let frames = Frames::mix(&streams).unwrap();
        let kinds: Vec<(L4, u16)> = (0..frames.count()).map(|i| (frames.flow(i).l4, frames.flow(i).dport)).collect();
        assert_eq!(kinds, vec![(L4::TcpSyn, 80), (L4::IcmpEcho, 0), (L4::TcpSyn, 80)]);
        for i in 0..frames.count() {
            let sliced = SlicedPacket::from_ethernet(frames.get(i).0).expect("frame parses");
            match (frames.flow(i).l4, sliced.transport) {
                (L4::TcpSyn, Some(TransportSlice::Tcp(t))) => {
                    assert!(t.syn() && !t.ack() && t.destination_port() == 80)
                }
                (L4::IcmpEcho, Some(TransportSlice::Icmpv6(_))) => {}
                (l4, other) => panic!("frame {i}: {l4:?} built as {other:?}"),
            }
        }
        assert_eq!(frames.sent_per_flow(4).values().copied().collect::<Vec<_>>(), vec![2, 1, 1]);
    }

    #[test]
    fn macs_parse_strictly() {
        assert_eq!(parse_mac("02:6c:6d:74:00:01"), Ok([2, 0x6c, 0x6d, 0x74, 0, 1]));
        assert!(parse_mac("02:6c:6d:74:00").is_err());
        assert!(parse_mac("02:6c:6d:74:00:0g").is_err());
    }
}

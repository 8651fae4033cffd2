//! Counting what reached a UDP socket in the receiver's namespace, per source: what got past
//! every hook (XDP and tc ingress alike), for tests where a packet capture would not do (a
//! capture sees frames after XDP but before tc ingress).

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, UdpSocket},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, anyhow};

use crate::{flood::Report, netns::End, snmp::Snmp};

/// Datagrams received, per source, and when the last one arrived.
#[derive(Default)]
pub struct Delivered {
    pub per_source: HashMap<IpAddr, u64>,
    pub last: Option<Instant>,
}

impl Delivered {
    pub fn total(&self) -> u64 {
        self.per_source.values().sum()
    }

    pub fn from(&self, src: &IpAddr) -> u64 {
        self.per_source.get(src).copied().unwrap_or(0)
    }

    pub fn sources(&self) -> Vec<IpAddr> {
        let mut v: Vec<IpAddr> = self.per_source.keys().copied().collect();
        v.sort();
        v
    }

    /// From before `report`'s first send to the last arrival (every arrival was judged inside it).
    pub fn window(&self, report: &Report) -> Duration {
        crate::bounds::window(report, self.last)
    }
}

/// A UDP socket in the receiver's namespace, counting datagrams per source on its own thread
/// (which ends once stopped, also when a failing test drops the receiver unfinished).
pub struct Receiver {
    pub port: u16,
    stop: Arc<AtomicBool>,
    handle: Option<thread::JoinHandle<anyhow::Result<Delivered>>>,
}

/// After the flood, the receiver stops once nothing arrived for this long...
const QUIET: Duration = Duration::from_millis(300);
/// ...or after this long in any case.
const MAX_DRAIN: Duration = Duration::from_secs(5);

impl Receiver {
    /// On a port the kernel picks.
    pub fn start(end: &End) -> anyhow::Result<Self> {
        Self::start_on(end, 0)
    }

    /// On `port` (of every address of `end`'s namespace).
    pub fn start_on(end: &End, port: u16) -> anyhow::Result<Self> {
        // A socket belongs to the namespace it was created in, wherever it is used later.
        let socket = end.run(|| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)))?.context("binding the UDP socket")?;
        // Room for a whole run's admissions, so the socket never drops while the test counts.
        nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::RcvBufForce, &(8 << 20))
            .context("SO_RCVBUFFORCE")?;
        socket.set_read_timeout(Some(Duration::from_millis(20)))?;
        let port = socket.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = thread::spawn(move || receive(&socket, &flag));
        Ok(Self { port, stop, handle: Some(handle) })
    }

    /// Waits until the link has been quiet for [`QUIET`] (at most [`MAX_DRAIN`]) and returns
    /// the counts.
    pub fn finish(mut self) -> anyhow::Result<Delivered> {
        self.stop.store(true, Ordering::Relaxed);
        let handle = self.handle.take().context("the receiver was already finished")?;
        handle.join().map_err(|_| anyhow!("the receiver thread panicked"))?
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn receive(socket: &UdpSocket, stop: &AtomicBool) -> anyhow::Result<Delivered> {
    let mut delivered = Delivered::default();
    let mut buf = [0u8; 2048];
    let mut stop_seen: Option<Instant> = None;
    loop {
        match socket.recv_from(&mut buf) {
            Ok((_, from)) => {
                let now = Instant::now();
                *delivered.per_source.entry(from.ip()).or_default() += 1;
                delivered.last = Some(now);
            }
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(e) => return Err(e).context("receiving"),
        }
        if stop.load(Ordering::Relaxed) {
            let since = *stop_seen.get_or_insert_with(Instant::now);
            let idle = delivered.last.map_or(since.elapsed(), |l| l.max(since).elapsed());
            if idle >= QUIET || since.elapsed() >= MAX_DRAIN {
                return Ok(delivered);
            }
        }
    }
}

/// Datagrams the UDP stack of `end`'s namespace dropped (full socket buffers and the like).
pub fn udp_drops(end: &End) -> anyhow::Result<u64> {
    let snmp = Snmp::read(end)?;
    Ok(snmp.get("Udp:", "InErrors")? + snmp.get6("Udp6InErrors")?)
}

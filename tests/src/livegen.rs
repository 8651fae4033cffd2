//! The fast flood generator: the `limiter_gen` XDP program run through BPF_PROG_TEST_RUN in
//! live-frames mode, as xdp-trafficgen does. Each run rewrites the template's source to the next
//! of `count` sources and transmits it (XDP_TX) out of the named interface, all in the kernel: on
//! this VM about ten times what an AF_PACKET socket reaches, so the receiver is what gets measured.
//!
//! The calling thread must be in the sender's network namespace (the interface index is looked
//! up there) and should be pinned: the frames are sent, and on a veth pair also received, on its
//! CPU. A veth peer only takes XDP frames while it has an XDP program attached itself.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{TestRun, TestRunAttrs, TestRunOptions, Xdp},
};
use limiter_common::testing::GenConfig;
use limiter_ctl::objects;

use crate::flood::{FrameSpec, L4, Report, Throttle, ifindex, log_flood};

const PROGRAM: &str = "limiter_gen";
/// Frames of the first BPF_PROG_TEST_RUN call, and the most of any: the deadline is checked
/// between calls, which are sized to last about [`call_time`]. Each call also has a fixed cost
/// that does not shrink with its frames (about 24 ms on kernel 6.18: setting up and tearing down
/// the page pool), so calls must be long for the generator to reach its speed.
const CHUNK: u32 = 1 << 15;
const MAX_CHUNK: u32 = 1 << 22;

/// How long one call may take: a twentieth of the flood (the deadline is overshot by no more
/// than that), at least 2 ms.
fn call_time(max_time: Duration) -> Duration {
    (max_time / 20).max(Duration::from_millis(2))
}
/// Frames the kernel builds and flushes at a time.
const BATCH: u32 = 64;

const ETH: u32 = 14;
const V4: u32 = 20;
const V6: u32 = 40;

/// Which sources the frames come from: `count` consecutive values of 4 bytes of the address.
/// IPv4: the whole address, from `first`. IPv6: bytes 4..8, so each source is its own /64
/// (the limiter's default IPv6 key) and a million sources are a million keys.
#[derive(Clone, Copy, Debug)]
pub struct LiveSources {
    pub first: IpAddr,
    pub count: u32,
}

impl LiveSources {
    /// The `i`-th source (what the program writes).
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

pub struct LiveGen {
    ebpf: Ebpf,
    frame: Vec<u8>,
}

impl LiveGen {
    /// A generator of `l4` frames like `spec` builds, from `sources`.
    pub fn new(spec: &FrameSpec, l4: L4, sources: LiveSources) -> anyhow::Result<Self> {
        ensure!(sources.count > 0, "at least one source");
        let mut frame = spec.frame_of(l4, sources.first)?;
        let v4 = sources.first.is_ipv4();
        let (src_offset, ip_csum, l3) = if v4 { (ETH + 12, ETH + 10, V4) } else { (ETH + 8 + 4, 0, V6) };
        let base = u32::from_be_bytes(frame[src_offset as usize..src_offset as usize + 4].try_into()?);
        let l4_csum = match (l4, v4) {
            // UDP over IPv4 may go without a checksum: cheaper, and nothing to keep right.
            (L4::Udp, true) => {
                frame[(ETH + l3 + 6) as usize..(ETH + l3 + 8) as usize].fill(0);
                0
            }
            (L4::Udp, false) => ETH + l3 + 6,
            (L4::TcpSyn, _) => ETH + l3 + 16,
            // ICMP's checksum covers no pseudo-header; ICMPv6's does.
            (L4::IcmpEcho, true) => 0,
            (L4::IcmpEcho, false) => ETH + l3 + 2,
        };
        let config = GenConfig {
            base,
            count: sources.count,
            src_offset,
            ip_csum_offset: ip_csum,
            l4_csum_offset: l4_csum,
            _pad: 0,
        };
        let mut ebpf = EbpfLoader::new().load(objects::GEN).context("loading the generator")?;
        let program: &mut Xdp = ebpf.program_mut(PROGRAM).context("no generator program")?.try_into()?;
        program.load().context("the kernel refused the generator")?;
        Array::<_, GenConfig>::try_from(ebpf.map_mut("GEN_CONFIG").context("no GEN_CONFIG")?)?.set(0, config, 0)?;
        Ok(Self { ebpf, frame })
    }

    /// Sends out of `iface` (in the calling thread's namespace) until `max_time` is up, or
    /// `frames` are sent if that comes first: a flood bounded by time passes
    /// [`crate::flood::cap`]`(max_time)`, one whose count is its point (every source so many
    /// times) the count. Returns what was handed to the interface (nothing is refused: `refused`
    /// is 0). Slowed down by [`crate::flood::THROTTLE_ENV`] (after each batch, a busy wait as
    /// long as the batch took, for half speed); reported to [`crate::flood::FLOOD_LOG_ENV`].
    pub fn send(&self, iface: &str, frames: u64, max_time: Duration) -> anyhow::Result<Report> {
        let ifindex = ifindex(iface)?;
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
        let ctx: Vec<u8> =
            [0, self.frame.len() as u32, 0, ifindex, 0, 0].iter().flat_map(|w: &u32| w.to_ne_bytes()).collect();
        let program: &Xdp = self.ebpf.program(PROGRAM).context("no generator program")?.try_into()?;
        let throttle = Throttle::from_env();
        let first = Instant::now();
        let deadline = first + max_time;
        let mut sent = 0u64;
        let mut chunk = CHUNK;
        while sent < frames && Instant::now() < deadline {
            let n = (frames - sent).min(u64::from(chunk)) as u32;
            let opts = TestRunOptions {
                data_in: Some(&self.frame),
                ctx_in: Some(&ctx),
                repeat: n,
                attrs: TestRunAttrs::new().xdp_live_frames(BATCH),
                ..TestRunOptions::default()
            };
            let before = Instant::now();
            program.test_run(opts).context("BPF_PROG_TEST_RUN (live frames)")?;
            let took = before.elapsed();
            sent += u64::from(n);
            // Calls of about `call_time`: shorter ones would spend the flood on their fixed cost,
            // longer ones overshoot the deadline.
            if took > call_time(max_time) && chunk > BATCH {
                chunk /= 2;
            } else if took < call_time(max_time) / 2 && n == chunk && chunk < MAX_CHUNK {
                chunk *= 2;
            }
            if let Some(t) = throttle {
                t.after(took);
            }
        }
        if sent == 0 {
            bail!("sent nothing: max_time {max_time:?} too short");
        }
        let report = Report {
            sent,
            first: Some(first),
            last: Some(Instant::now()),
            throttled: throttle.map(|t| t.fraction),
            ..Report::default()
        };
        log_flood("live", &report);
        Ok(report)
    }
}

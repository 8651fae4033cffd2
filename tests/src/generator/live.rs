//! The live-frames sender: the `limiter_gen` XDP program run through BPF_PROG_TEST_RUN in
//! live-frames mode, as xdp-trafficgen does. Each run rewrites the template's source to the next
//! source and transmits it (XDP_TX) out of the named interface, all in the kernel: on this VM
//! about ten times what an AF_PACKET socket reaches, so the receiver is what gets measured.
//!
//! The calling thread must be in the sender's network namespace (the interface index is looked
//! up there) and should be pinned: the frames are sent, and on a veth pair also received, on its
//! CPU. A veth peer only takes XDP frames while it has an XDP program attached itself.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{ProgramError, TestRun, TestRunAttrs, TestRunOptions, Xdp},
};
use limiter_common::testing::GenConfig;
use limiter_ctl::objects;

use super::Template;
use crate::flood::{Throttle, ifindex};

const PROGRAM: &str = "limiter_gen";
/// Frames of the first BPF_PROG_TEST_RUN call, and the most of any: the deadline is checked
/// between calls, which are sized to last about [`call_time`]. Each call also has a fixed cost
/// that does not shrink with its frames (about 24 ms on kernel 6.18: setting up and tearing down
/// the page pool), so calls must be long for the generator to reach its speed.
const CHUNK: u32 = 1 << 15;
const MAX_CHUNK: u32 = 1 << 22;
/// Frames the kernel builds and flushes at a time.
const BATCH: u32 = 64;

/// How long one call may take: a twentieth of the flood (the deadline is overshot by no more
/// than that), at least 2 ms.
fn call_time(max_time: Duration) -> Duration {
    (max_time / 20).max(Duration::from_millis(2))
}

/// Whether the kernel runs XDP programs with live frames: one frame of a program that drops it,
/// on the loopback device. Err says how it refused (EPERM on some machines of this kind, EINVAL
/// before kernel 5.18).
pub fn allowed() -> anyhow::Result<()> {
    let mut ebpf = EbpfLoader::new().load(objects::BENCH).context("loading the probe program")?;
    let program: &mut Xdp = ebpf.program_mut("bench_drop").context("no bench_drop program")?.try_into()?;
    program.load().context("the kernel refused the probe program")?;
    let frame = [0u8; 60];
    let ctx = xdp_md(frame.len(), ifindex("lo")?);
    let opts = TestRunOptions {
        data_in: Some(&frame),
        ctx_in: Some(&ctx),
        repeat: 1,
        attrs: TestRunAttrs::new().xdp_live_frames(1),
        ..TestRunOptions::default()
    };
    program.test_run(opts).map(drop).map_err(|e| match e {
        ProgramError::SyscallError(s) => match s.io_error.raw_os_error() {
            Some(code) => anyhow::anyhow!("BPF_PROG_TEST_RUN: {}", nix::errno::Errno::from_raw(code)),
            None => anyhow::anyhow!("BPF_PROG_TEST_RUN: {}", s.io_error),
        },
        other => anyhow::Error::new(other),
    })
}

/// struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex.
fn xdp_md(len: usize, ifindex: u32) -> Vec<u8> {
    [0, len as u32, 0, ifindex, 0, 0].iter().flat_map(|w: &u32| w.to_ne_bytes()).collect()
}

pub struct LiveFrames {
    ebpf: Ebpf,
    frame: Vec<u8>,
}

impl LiveFrames {
    pub fn new(template: Template) -> anyhow::Result<Self> {
        let config: GenConfig = template.gen_config()?;
        let mut ebpf = EbpfLoader::new().load(objects::GEN).context("loading the generator")?;
        let program: &mut Xdp = ebpf.program_mut(PROGRAM).context("no generator program")?.try_into()?;
        program.load().context("the kernel refused the generator")?;
        Array::<_, GenConfig>::try_from(ebpf.map_mut("GEN_CONFIG").context("no GEN_CONFIG")?)?.set(0, config, 0)?;
        Ok(Self { ebpf, frame: template.frame })
    }

    /// Sends until `deadline`, or until `frames` are sent; returns how many were.
    pub fn send(
        &self,
        iface: &str,
        frames: u64,
        deadline: Instant,
        max_time: Duration,
        throttle: Option<Throttle>,
    ) -> anyhow::Result<u64> {
        let ctx = xdp_md(self.frame.len(), ifindex(iface)?);
        let program: &Xdp = self.ebpf.program(PROGRAM).context("no generator program")?.try_into()?;
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
        Ok(sent)
    }
}

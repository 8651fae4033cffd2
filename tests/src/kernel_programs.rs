//! The kernel's programs loaded in-process and run on frames with BPF_PROG_TEST_RUN (on the
//! calling CPU): the kernel side of the comparisons with [`crate::reference`] ([`Probe`], the
//! limiter's parser and key builder recording what they derive; [`Judge`], the real limiter with
//! a policy per class and one port policy), and the real limiter judging UDP under one policy
//! ([`udp_limiter`]).

use std::{error::Error as StdError, io};

use anyhow::{Context, anyhow, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::Array,
    programs::{TestRun, TestRunOptions, Xdp},
};
use limiter_common::{
    SipKey,
    maps::{CLASS_TCP, CLASS_UDP, Counters, Policy},
    testing::ParseProbe,
};
use limiter_ctl::{
    Hook, Limiter,
    config::{KeySpec, PolicyDef, Rate},
    kernel::{Geometry, TestHook, compile},
    objects,
};

use crate::reference::{PROBE_KEY, Parsed};

pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;

const PROBE_PROGRAM: &str = "limiter_probe";
const PROBE_MAP: &str = "PROBE";
const PROBE_POLICY_MAP: &str = "PROBE_POLICY";

/// A policy no test refuses anything under: 10^9 per second, burst 10^6. Scope cpu: the tests
/// read the per-CPU buckets it writes.
pub fn permissive(key: KeySpec) -> PolicyDef {
    let rate = Rate { count: 1_000_000_000, period_ns: 1_000_000_000 };
    PolicyDef { key, scope: limiter_ctl::config::Scope::Cpu, ..PolicyDef::any(rate, 1_000_000) }
}

/// The real limiter loaded in-process with `salt` and `policy` (compiled under its own id),
/// which judges UDP only: anything else passes unjudged.
pub fn udp_limiter(buckets: u32, salt: SipKey, policy: &Policy) -> anyhow::Result<Limiter> {
    udp_limiter_shaped(buckets, Shape::ONE_ROW, salt, policy)
}

/// How the limiter is set up beyond its policy: its count-min rows and refusal sampling.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub rows: u32,
    /// Sample 1 in this many refusals into the ring (0: none).
    pub sample_refusals: u32,
}

impl Shape {
    /// One row, no sampling: every key has one bucket (its index predictable from the salt).
    pub const ONE_ROW: Self = Self { rows: 1, sample_refusals: 0 };
    /// What the daemon runs by default: `--rows 4`, `--sample-refusals 256`.
    pub const DAEMON: Self = Self {
        rows: limiter_common::rows::DEFAULT_ROWS,
        sample_refusals: limiter_ctl::kernel::DEFAULT_SAMPLE_REFUSALS,
    };
}

/// [`udp_limiter`] in `shape`.
pub fn udp_limiter_shaped(buckets: u32, shape: Shape, salt: SipKey, policy: &Policy) -> anyhow::Result<Limiter> {
    let mut limiter = Limiter::load_rows(buckets, shape.rows).context("loading the limiter")?;
    limiter.set_sampling(shape.sample_refusals)?;
    limiter.set_salt(salt)?;
    limiter.set_policy(policy)?;
    let mut config = limiter.config()?;
    config.class_policy[CLASS_UDP] = policy.id;
    limiter.write_config(&config)?;
    Ok(limiter)
}

/// The errno behind a failed test run, wherever it sits in the error chain.
pub fn errno(e: &(dyn StdError + 'static)) -> Option<i32> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            return io.raw_os_error();
        }
        cur = err.source();
    }
    None
}

/// The probe program: the limiter's parser and key builder, recording what they derive.
pub struct Probe {
    ebpf: Ebpf,
}

impl Probe {
    pub fn load() -> anyhow::Result<Self> {
        let mut ebpf = EbpfLoader::new().load(objects::PROBE).context("loading the probe object")?;
        let program: &mut Xdp = ebpf
            .program_mut(PROBE_PROGRAM)
            .context("the probe object has no limiter_probe program")?
            .try_into()
            .context("limiter_probe is not XDP")?;
        program.load().context("the verifier rejected limiter_probe")?;
        let policy = compile::policy(&permissive(PROBE_KEY), ParseProbe::POLICY_ID).map_err(|e| anyhow!("{e}"))?;
        let map = ebpf.map_mut(PROBE_POLICY_MAP).context("no PROBE_POLICY map")?;
        Array::<_, Policy>::try_from(map)?.set(0, policy, 0).context("writing PROBE_POLICY")?;
        Ok(Self { ebpf })
    }

    /// Runs the probe on `frame`. A cleared record first, so a run that records nothing
    /// cannot pass for the previous frame's.
    pub fn run(&mut self, frame: &[u8]) -> anyhow::Result<ParseProbe> {
        self.record_map()?.set(0, ParseProbe::default(), 0).context("clearing PROBE")?;
        let program: &Xdp = self.ebpf.program(PROBE_PROGRAM).context("no limiter_probe")?.try_into()?;
        let action = program.test_run(TestRunOptions { data_in: Some(frame), ..TestRunOptions::default() })?;
        if action.return_value != XDP_PASS {
            bail!("the probe returned XDP action {}, not XDP_PASS", action.return_value);
        }
        let record = self.record_map()?.get(&0, 0).context("reading PROBE")?;
        if record.verdict == 0 {
            bail!("the probe ran but recorded nothing");
        }
        Ok(record)
    }

    fn record_map(&mut self) -> anyhow::Result<Array<&mut aya::maps::MapData, ParseProbe>> {
        let map = self.ebpf.map_mut(PROBE_MAP).context("no PROBE map")?;
        Ok(Array::try_from(map)?)
    }
}

/// Where the real limiter counted a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landed {
    NotIp,
    Malformed,
    /// Dropped: its ports are hidden while a port policy exists (`unreadable_ports`).
    Unreadable,
    /// Admitted under this policy.
    Policy(u16),
}

/// The real limiter with a permissive policy per protocol class (id = class + 1) and one
/// port policy ([`Judge::PORT_POLICY`] on TCP [`Judge::TCP_PORT`] and UDP
/// [`Judge::UDP_PORT`]): where a frame lands says its verdict, its class, whether its port
/// was read and whether its ports are hidden.
pub struct Judge {
    pub limiter: Limiter,
    /// Where frames are run: the XDP program, or the same judgement at tcx.
    pub hook: TestHook,
    seen: Vec<Counters>,
}

impl Judge {
    pub const PORT_POLICY: u16 = 5;
    pub const TCP_PORT: u16 = 443;
    pub const UDP_PORT: u16 = 53;

    /// The policy of protocol class `class` (`CLASS_*`).
    pub fn class_policy(class: usize) -> u16 {
        class as u16 + 1
    }

    pub fn load(buckets: u32, salt: SipKey, key: KeySpec) -> anyhow::Result<Self> {
        Self::load_at(TestHook::Xdp, buckets, salt, key)
    }

    /// [`Judge::load`] running frames at `hook`.
    pub fn load_at(hook: TestHook, buckets: u32, salt: SipKey, key: KeySpec) -> anyhow::Result<Self> {
        let mut limiter = Limiter::load(buckets).context("loading the limiter")?;
        if hook == TestHook::Tcx {
            limiter.load_hook(Hook::Tc).context("loading the limiter's tc programs")?;
        }
        limiter.set_salt(salt)?;
        for id in 1..=Self::PORT_POLICY {
            let policy = compile::policy(&permissive(key), id).map_err(|e| anyhow!("{e}"))?;
            limiter.set_policy(&policy)?;
        }
        let old = limiter.read_view()?;
        let mut new = old.clone();
        new.routes.class_policy = std::array::from_fn(Self::class_policy);
        new.routes.ports[(CLASS_TCP << 16) | usize::from(Self::TCP_PORT)] = Self::PORT_POLICY;
        new.routes.ports[(CLASS_UDP << 16) | usize::from(Self::UDP_PORT)] = Self::PORT_POLICY;
        limiter.apply(&old, &new)?;
        let mut judge = Self { limiter, hook, seen: Vec::new() };
        judge.seen = judge.read()?;
        Ok(judge)
    }

    /// Counters of "no policy" (0) and of every policy, summed over CPUs.
    fn read(&self) -> anyhow::Result<Vec<Counters>> {
        (0..=Self::PORT_POLICY).map(|id| Ok(crate::bounds::total(&self.limiter.counters_per_cpu(id)?))).collect()
    }

    /// Where the limiter must count a frame the reference parsed as `parsed`.
    pub fn expected(parsed: &Parsed) -> Landed {
        let p = &parsed.probe;
        match p.verdict {
            ParseProbe::NOT_IP => Landed::NotIp,
            ParseProbe::MALFORMED => Landed::Malformed,
            _ if p.ports_hidden != 0 => Landed::Unreadable,
            _ if p.has_l4 != 0
                && ((parsed.class == CLASS_TCP && p.dport == Self::TCP_PORT)
                    || (parsed.class == CLASS_UDP && p.dport == Self::UDP_PORT)) =>
            {
                Landed::Policy(Self::PORT_POLICY)
            }
            _ => Landed::Policy(Self::class_policy(parsed.class)),
        }
    }

    /// Runs `frame` and says where it was counted. Anything but one packet counted once,
    /// dropped if and only if unreadable, is an error.
    pub fn classify(&mut self, frame: &[u8]) -> anyhow::Result<Landed> {
        let action = self.limiter.test_run_at(self.hook, frame)?;
        let now = self.read()?;
        let before = std::mem::replace(&mut self.seen, now.clone());
        let total: u64 =
            now.iter().map(Counters::packets).sum::<u64>() - before.iter().map(Counters::packets).sum::<u64>();
        let (b0, a0) = (&before[0], &now[0]);
        let landed = if a0.not_ip == b0.not_ip + 1 {
            Some(Landed::NotIp)
        } else if a0.malformed == b0.malformed + 1 {
            Some(Landed::Malformed)
        } else if a0.unreadable_ports == b0.unreadable_ports + 1 {
            Some(Landed::Unreadable)
        } else {
            (1..=Self::PORT_POLICY)
                .find(|&id| now[usize::from(id)].admitted_packets == before[usize::from(id)].admitted_packets + 1)
                .map(Landed::Policy)
        };
        let want_action = if landed == Some(Landed::Unreadable) { XDP_DROP } else { XDP_PASS };
        match landed {
            Some(landed) if action == want_action && total == 1 => Ok(landed),
            _ => bail!("action {action}, {total} packets counted; before {before:?}, after {now:?}"),
        }
    }
}

/// The three builds the shortcut tests compare, each set up by `set_up`: the shipped program
/// (every shortcut on), the test build with the tick refusal off, and with the key memo off.
pub fn shortcut_builds(geometry: Geometry, set_up: impl Fn(Limiter) -> Limiter) -> [Limiter; 3] {
    [(true, true), (true, false), (false, false)].map(|(memo, tick)| {
        let limiter = if memo && tick {
            Limiter::load_geometry(geometry)
        } else {
            Limiter::load_switchable_geometry(geometry, memo, tick)
        };
        set_up(limiter.expect("loading the limiter"))
    })
}

/// `frame` judged by each of the [`shortcut_builds`]: their one verdict. Panics, saying `what`
/// was being judged, when they differ.
pub fn judged_alike(builds: &[Limiter; 3], frame: &[u8], what: impl FnOnce() -> String) -> u32 {
    let verdicts = builds.each_ref().map(|l| l.test_run(frame).expect("test run"));
    assert!(verdicts.iter().all(|&v| v == verdicts[0]), "{}: shipped, no tick refusal, no memo: {verdicts:?}", what());
    verdicts[0]
}

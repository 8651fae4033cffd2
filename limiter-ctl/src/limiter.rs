//! The kernel-facing handle: load (or adopt) the XDP program and its maps, attach and detach
//! it, rotate its salt, read its counters. The daemon, the tests and the benchmarks share it.
//! Keeping the maps in step with a [`crate::state::State`] lives in `sync.rs`.

use std::{ffi::CString, fmt, os::fd::AsFd as _, path::PathBuf, time::Duration};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, Map, MapData, PerCpuArray, RingBuf},
    programs::{
        ProgramError, TestRun, TestRunOptions, Xdp, XdpMode,
        links::{FdLink, PinnedLink},
        xdp::{XdpLink, XdpLinkId},
    },
};
use limiter_common::{
    SipInit, SipKey,
    maps::{
        CLASSES, Config, Counters, GENERATIONS, LAYOUT_VERSION, MAP_BUCKETS, MAP_CONFIG, MAP_COUNTERS, MAP_LAYOUT,
        MAP_POLICIES, MAP_REFUSALS, MAX_BUCKETS, MAX_POLICIES, MIN_BUCKETS, PROGRAM, Policy,
    },
};

use crate::{Error, objects, pins::PinDir};

/// The attach mode an operator asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeRequest {
    /// Native (driver) mode, falling back to skb mode with a warning.
    #[default]
    Auto,
    Native,
    Skb,
}

/// The mode the program runs in once attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    Native,
    Skb,
}

impl AttachMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Skb => "skb",
        }
    }

    fn xdp_mode(self) -> XdpMode {
        match self {
            Self::Native => XdpMode::Driver,
            Self::Skb => XdpMode::Skb,
        }
    }
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the program got attached.
#[derive(Debug)]
pub struct Attached {
    pub mode: AttachMode,
    /// Why native mode was not used, when auto fell back to skb mode.
    pub fallback: Option<String>,
    /// The program replaced a pinned predecessor in place (no moment unprotected).
    pub replaced: bool,
}

/// The XDP link, held by the program (unpinned) or pinned on bpffs (outlives the process).
enum Held {
    Program(XdpLinkId),
    Pinned(PinnedLink),
}

struct Link {
    iface: String,
    held: Held,
}

pub struct Limiter {
    ebpf: Ebpf,
    buckets: u32,
    link: Option<Link>,
    pins: Option<PinDir>,
    adopted: bool,
}

pub fn check_buckets(buckets: u32) -> Result<u32, Error> {
    if buckets.is_power_of_two() && (MIN_BUCKETS..=MAX_BUCKETS).contains(&buckets) {
        Ok(buckets)
    } else {
        Err(Error::Buckets(buckets))
    }
}

/// The interface's index, or None when there is no such interface.
pub fn if_index(iface: &str) -> Option<u32> {
    let c = CString::new(iface).ok()?;
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    (index != 0).then_some(index)
}

pub fn interface_exists(iface: &str) -> bool {
    if_index(iface).is_some()
}

/// The interface's MTU, if it exists in this network namespace.
pub fn interface_mtu(iface: &str) -> Option<u64> {
    std::fs::read_to_string(format!("/sys/class/net/{iface}/mtu")).ok()?.trim().parse().ok()
}

/// `Config::grace_until_ns` while a rotation is under way: no end yet.
const GRACE_OPEN: u64 = u64::MAX;

/// CLOCK_MONOTONIC in ns: the clock the XDP program reads (bpf_ktime_get_ns).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

impl Limiter {
    /// Loads the program with `buckets` buckets per generation (a power of two), unpinned: it
    /// goes when the handle goes. Nothing is attached and no policy set: it passes everything.
    pub fn load(buckets: u32) -> Result<Self, Error> {
        Self::open(buckets, None)
    }

    /// Loads the program with its maps pinned in `pins`. When a limiter was left there (its
    /// link is pinned), its maps are adopted, TATs, counters and salt included, after checking
    /// they are what this build expects; [`Limiter::adopted`] says so.
    pub fn open(buckets: u32, pins: Option<PinDir>) -> Result<Self, Error> {
        check_buckets(buckets)?;
        let mut loader = EbpfLoader::new();
        loader.map_max_entries(MAP_BUCKETS, GENERATIONS * buckets);
        let mut adopted = false;
        let pin_paths: Vec<(&str, PathBuf)> = match &pins {
            None => Vec::new(),
            Some(p) => {
                if p.has_link() {
                    p.check_compatible(buckets)?;
                    let data = MapData::from_pin(p.map(MAP_LAYOUT))
                        .map_err(|source| Error::Map { name: MAP_LAYOUT, source })?;
                    let layout = Array::<_, u64>::try_from(Map::Array(data))
                        .and_then(|a| a.get(&0, 0))
                        .map_err(|source| Error::Map { name: MAP_LAYOUT, source })?;
                    p.check_layout(layout)?;
                    adopted = true;
                } else {
                    // Maps without a link are leftovers of a detach that did not finish.
                    p.remove()?;
                    p.prepare()?;
                }
                crate::pins::map_names().map(|m| (m, p.map(m))).collect()
            }
        };
        for (name, path) in &pin_paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader.load(objects::LIMITER).map_err(Error::Load)?;
        let program: &mut Xdp = ebpf
            .program_mut(PROGRAM)
            .ok_or_else(|| Error::Missing { kind: "program", name: PROGRAM.into() })?
            .try_into()
            .map_err(Error::Verify)?;
        program.load().map_err(Error::Verify)?;
        let mut limiter = Self { ebpf, buckets, link: None, pins, adopted };
        if !adopted {
            limiter.write_config(&Config { bucket_mask: buckets - 1, ..Config::default() })?;
            limiter
                .array_mut::<u64>(MAP_LAYOUT)?
                .set(0, LAYOUT_VERSION, 0)
                .map_err(|source| Error::Map { name: MAP_LAYOUT, source })?;
        }
        Ok(limiter)
    }

    /// The maps came from a pinned predecessor: keep its salt and state.
    pub fn adopted(&self) -> bool {
        self.adopted
    }

    pub fn buckets(&self) -> u32 {
        self.buckets
    }

    pub fn program(&self) -> Result<&Xdp, Error> {
        self.ebpf
            .program(PROGRAM)
            .ok_or_else(|| Error::Missing { kind: "program", name: PROGRAM.into() })?
            .try_into()
            .map_err(Error::Verify)
    }

    fn program_mut(&mut self) -> Result<&mut Xdp, Error> {
        self.ebpf
            .program_mut(PROGRAM)
            .ok_or_else(|| Error::Missing { kind: "program", name: PROGRAM.into() })?
            .try_into()
            .map_err(Error::Verify)
    }

    pub(crate) fn map(&self, name: &'static str) -> Result<&Map, Error> {
        self.ebpf.map(name).ok_or_else(|| Error::Missing { kind: "map", name: name.into() })
    }

    pub(crate) fn map_mut(&mut self, name: &'static str) -> Result<&mut Map, Error> {
        self.ebpf.map_mut(name).ok_or_else(|| Error::Missing { kind: "map", name: name.into() })
    }

    pub(crate) fn array<V: aya::Pod>(&self, name: &'static str) -> Result<Array<&MapData, V>, Error> {
        Array::try_from(self.map(name)?).map_err(|source| Error::Map { name, source })
    }

    pub(crate) fn array_mut<V: aya::Pod>(&mut self, name: &'static str) -> Result<Array<&mut MapData, V>, Error> {
        Array::try_from(self.map_mut(name)?).map_err(|source| Error::Map { name, source })
    }

    fn per_cpu<V: aya::Pod>(&self, name: &'static str) -> Result<PerCpuArray<&MapData, V>, Error> {
        PerCpuArray::try_from(self.map(name)?).map_err(|source| Error::Map { name, source })
    }

    pub fn config(&self) -> Result<Config, Error> {
        self.array::<Config>(MAP_CONFIG)?.get(&0, 0).map_err(|source| Error::Map { name: MAP_CONFIG, source })
    }

    pub fn write_config(&mut self, config: &Config) -> Result<(), Error> {
        self.array_mut::<Config>(MAP_CONFIG)?
            .set(0, config, 0)
            .map_err(|source| Error::Map { name: MAP_CONFIG, source })
    }

    /// Sets the current generation's salt (before attaching; later, see [`Limiter::rotate_salt`]).
    pub fn set_salt(&mut self, salt: SipKey) -> Result<(), Error> {
        let mut config = self.config()?;
        config.salts[(config.generation & 1) as usize] = SipInit::new(&salt);
        config.rotated_at_ns = monotonic_ns();
        self.write_config(&config)
    }

    /// Rotates the salt: the other generation of buckets takes `salt` and becomes current; for
    /// `grace` a packet is also judged against its bucket in the old generation and carries over
    /// a later TAT, so a source over its limit stays over it. Refused while a previous rotation's
    /// grace runs.
    ///
    /// The other generation is not cleared (that would take one write per bucket and CPU): what
    /// its buckets still hold is read under the rules of `limiter_common::gcra`, which let no
    /// stale TAT hold a source for more than one burst window of its own, and `grace` covers the
    /// longest burst window any policy had while the old generation was current, so the TATs it
    /// holds are behind now when it becomes current again (a rotation later).
    ///
    /// Each write changes one field, so a packet never sees a torn mix: the new salt goes where
    /// nothing reads it; the grace opens with no end; the switch; then the grace's end, measured
    /// from after the switch, so a daemon stalled between two writes can only lengthen it.
    pub fn rotate_salt(&mut self, salt: SipKey, grace: Duration) -> Result<(), Error> {
        let mut config = self.config()?;
        let now = monotonic_ns();
        if config.grace_until_ns == GRACE_OPEN {
            // A rotation interrupted between its writes (the daemon died): close its grace first.
            config.grace_until_ns = now.saturating_add(grace.as_nanos() as u64);
            self.write_config(&config)?;
        }
        if now < config.grace_until_ns {
            return Err(Error::RotationBusy { seconds_left: (config.grace_until_ns - now).div_ceil(1_000_000_000) });
        }
        let next = (config.generation & 1) ^ 1;
        config.salts[next as usize] = SipInit::new(&salt);
        self.write_config(&config)?;
        config.grace_until_ns = GRACE_OPEN;
        self.write_config(&config)?;
        config.generation = next;
        config.rotated_at_ns = monotonic_ns();
        self.write_config(&config)?;
        config.grace_until_ns = monotonic_ns().saturating_add(grace.as_nanos() as u64);
        self.write_config(&config)
    }

    /// Samples 1 in `one_in` refusals (a power of two; 0: none) into the `REFUSALS` ring.
    pub fn set_sampling(&mut self, one_in: u32) -> Result<(), Error> {
        let mut config = self.config()?;
        config.flags &= !Config::SAMPLE_REFUSALS;
        if one_in > 0 {
            config.flags |= Config::SAMPLE_REFUSALS;
            config.sample_mask = one_in.next_power_of_two() - 1;
        }
        self.write_config(&config)
    }

    /// The ring of sampled refusals, for the daemon to drain (it can be taken once).
    pub fn take_refusals(&mut self) -> Result<RingBuf<MapData>, Error> {
        let map = self
            .ebpf
            .take_map(MAP_REFUSALS)
            .ok_or_else(|| Error::Missing { kind: "map", name: MAP_REFUSALS.into() })?;
        RingBuf::try_from(map).map_err(|source| Error::Map { name: MAP_REFUSALS, source })
    }

    /// A handle of its own on the buckets, for scanning them off the daemon's loop.
    pub fn open_buckets(&self) -> Result<PerCpuArray<MapData, u64>, Error> {
        let Map::PerCpuArray(data) = self.map(MAP_BUCKETS)? else {
            return Err(Error::Internal("BUCKETS is not a per-CPU array".into()));
        };
        // A duplicate of our own descriptor: reopening the map by id would need CAP_SYS_ADMIN.
        let fd = data.fd().as_fd().try_clone_to_owned()?;
        let data = MapData::from_fd(fd).map_err(|source| Error::Map { name: MAP_BUCKETS, source })?;
        PerCpuArray::try_from(Map::PerCpuArray(data)).map_err(|source| Error::Map { name: MAP_BUCKETS, source })
    }

    /// How long ago the salt was drawn.
    pub fn salt_age(&self) -> Result<Duration, Error> {
        Ok(Duration::from_nanos(monotonic_ns().saturating_sub(self.config()?.rotated_at_ns)))
    }

    pub fn set_policy(&mut self, policy: &Policy) -> Result<(), Error> {
        self.array_mut::<Policy>(MAP_POLICIES)?
            .set(u32::from(policy.id), policy, 0)
            .map_err(|source| Error::Map { name: MAP_POLICIES, source })
    }

    /// Sends every protocol class without a more specific policy to policy `id` (0: none).
    pub fn set_default_policy(&mut self, id: u16) -> Result<(), Error> {
        let mut config = self.config()?;
        config.class_policy = [id; CLASSES];
        self.write_config(&config)
    }

    /// Attaches to `iface`. With pins: a pinned predecessor's link gets this program swapped in
    /// atomically (its attach mode stays); otherwise a new link is made and pinned.
    pub fn attach(&mut self, iface: &str, mode: ModeRequest) -> Result<Attached, Error> {
        if !interface_exists(iface) {
            return Err(Error::NoSuchInterface(iface.into()));
        }
        if let Some(path) = self.pins.as_ref().map(PinDir::link).filter(|p| p.exists()) {
            match self.replace_in_pinned_link(&path) {
                Ok(id) => {
                    self.link = Some(Link { iface: iface.into(), held: Held::Program(id) });
                    return Ok(Attached { mode: self.attach_mode()?, fallback: None, replaced: true });
                }
                // Defunct: its interface went away (re-created since?). Start a new link.
                Err(_) => std::fs::remove_file(&path)
                    .map_err(|e| Error::Pins(format!("removing the stale {}: {e}", path.display())))?,
            }
        }
        let (id, attached) = self.attach_new(iface, mode)?;
        let held = match &self.pins {
            None => Held::Program(id),
            Some(pins) => {
                let path = pins.link();
                let link = self.program_mut()?.take_link(id).map_err(|source| Error::Attach {
                    iface: iface.into(),
                    mode: attached.mode.as_str(),
                    source,
                })?;
                let fd = FdLink::try_from(link).map_err(|e| {
                    Error::Pins(format!("the XDP link is not a bpf_link ({e}); this kernel cannot pin it"))
                })?;
                Held::Pinned(fd.pin(&path).map_err(|e| Error::Pins(format!("pinning {}: {e}", path.display())))?)
            }
        };
        let mut config = self.config()?;
        config.flags = (config.flags & !Config::ATTACHED_SKB)
            | if attached.mode == AttachMode::Skb { Config::ATTACHED_SKB } else { 0 };
        self.write_config(&config)?;
        self.link = Some(Link { iface: iface.into(), held });
        Ok(attached)
    }

    /// How the program is attached, as recorded in the kernel's config when the link was made
    /// (so it survives reattaching and adoption).
    pub fn attach_mode(&self) -> Result<AttachMode, Error> {
        Ok(if self.config()?.flags & Config::ATTACHED_SKB != 0 { AttachMode::Skb } else { AttachMode::Native })
    }

    fn replace_in_pinned_link(&mut self, path: &std::path::Path) -> Result<XdpLinkId, Error> {
        let pinned = PinnedLink::from_pin(path).map_err(|e| Error::Pins(format!("opening {}: {e}", path.display())))?;
        let link =
            XdpLink::try_from(FdLink::from(pinned)).map_err(|e| Error::Pins(format!("{}: {e}", path.display())))?;
        self.program_mut()?.attach_to_link(link).map_err(|source| Error::Attach {
            iface: "(pinned link)".into(),
            mode: "replace",
            source,
        })
    }

    fn attach_new(&mut self, iface: &str, mode: ModeRequest) -> Result<(XdpLinkId, Attached), Error> {
        let first = match mode {
            ModeRequest::Auto | ModeRequest::Native => AttachMode::Native,
            ModeRequest::Skb => AttachMode::Skb,
        };
        let program = self.program_mut()?;
        match program.attach(iface, first.xdp_mode()) {
            Ok(id) => Ok((id, Attached { mode: first, fallback: None, replaced: false })),
            Err(native_err) if mode == ModeRequest::Auto => {
                let reason = error_chain(&native_err);
                let id = program.attach(iface, XdpMode::Skb).map_err(|source| Error::Attach {
                    iface: iface.into(),
                    mode: "skb",
                    source,
                })?;
                Ok((id, Attached { mode: AttachMode::Skb, fallback: Some(reason), replaced: false }))
            }
            Err(source) => Err(Error::Attach { iface: iface.into(), mode: first.as_str(), source }),
        }
    }

    /// Attaches again after the interface was re-created (the old link died with it).
    pub fn reattach(&mut self, mode: ModeRequest) -> Result<Attached, Error> {
        let Some(link) = self.link.take() else {
            return Err(Error::Internal("reattach without an attachment".into()));
        };
        self.drop_link(link.held, &link.iface, false)?;
        self.attach(&link.iface, mode)
    }

    /// Detaches from the interface and removes the pins: the next start begins afresh.
    /// (Dropping a `Limiter` without this leaves a pinned program attached: fail static.)
    pub fn detach(&mut self) -> Result<Option<String>, Error> {
        let Some(link) = self.link.take() else {
            return Ok(None);
        };
        self.drop_link(link.held, &link.iface, true)?;
        if let Some(pins) = &self.pins {
            pins.remove()?;
        }
        Ok(Some(link.iface))
    }

    fn drop_link(&mut self, held: Held, iface: &str, detach: bool) -> Result<(), Error> {
        let pin = self.pins.as_ref().map(PinDir::link);
        // Unpinning first: then closing our descriptor destroys the link.
        if let Some(path) = pin.filter(|p| p.exists()) {
            std::fs::remove_file(&path).map_err(|e| Error::Pins(format!("removing {}: {e}", path.display())))?;
        }
        match held {
            Held::Pinned(p) => drop(FdLink::from(p)),
            Held::Program(id) => {
                let result = self.program_mut()?.detach(id);
                if detach {
                    result.map_err(|source| Error::Detach { iface: iface.into(), source })?;
                }
            }
        }
        Ok(())
    }

    /// Counters per policy id (index 0: traffic no policy judged), summed over CPUs.
    pub fn counters(&self) -> Result<Vec<Counters>, Error> {
        let map = self.per_cpu::<Counters>(MAP_COUNTERS)?;
        (0..MAX_POLICIES)
            .map(|id| {
                let per_cpu = map.get(&id, 0).map_err(|source| Error::Map { name: MAP_COUNTERS, source })?;
                let mut sum = Counters::default();
                per_cpu.iter().for_each(|c| sum.add(c));
                Ok(sum)
            })
            .collect()
    }

    /// The counters of one policy id on each CPU.
    pub fn counters_per_cpu(&self, id: u16) -> Result<Vec<Counters>, Error> {
        let map = self.per_cpu::<Counters>(MAP_COUNTERS)?;
        let values = map.get(&u32::from(id), 0).map_err(|source| Error::Map { name: MAP_COUNTERS, source })?;
        Ok(values.iter().copied().collect())
    }

    /// The TAT stored in bucket `index` (generation offset included) on each CPU.
    pub fn bucket(&self, index: u32) -> Result<Vec<u64>, Error> {
        let map = self.per_cpu::<u64>(MAP_BUCKETS)?;
        let values = map.get(&index, 0).map_err(|source| Error::Map { name: MAP_BUCKETS, source })?;
        Ok(values.iter().copied().collect())
    }

    /// Runs the program once on `frame` (BPF_PROG_TEST_RUN) and returns its XDP action.
    pub fn test_run(&self, frame: &[u8]) -> Result<u32, Error> {
        let opts = TestRunOptions { data_in: Some(frame), ..TestRunOptions::default() };
        Ok(self.program()?.test_run(opts).map_err(Error::TestRun)?.return_value)
    }
}

fn error_chain(e: &ProgramError) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

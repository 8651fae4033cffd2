//! The kernel-facing handle: load the XDP program, write its configuration and policies,
//! attach and detach it, read its counters. The daemon, the tests and the benchmarks share it.

use std::{ffi::CString, fmt};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData, PerCpuArray},
    programs::{ProgramError, TestRun, TestRunOptions, Xdp, XdpMode, xdp::XdpLinkId},
};
use limiter_common::{
    SipInit, SipKey,
    maps::{
        CLASSES, Config, Counters, GENERATIONS, MAP_BUCKETS, MAP_CONFIG, MAP_COUNTERS,
        MAP_POLICIES, MAX_BUCKETS, MAX_POLICIES, MIN_BUCKETS, PROGRAM, Policy,
    },
};

use crate::{Error, objects};

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

/// Where and how the program got attached; `fallback` says why native mode was not used.
#[derive(Debug)]
pub struct Attached {
    pub mode: AttachMode,
    pub fallback: Option<String>,
}

struct Link {
    iface: String,
    id: XdpLinkId,
}

pub struct Limiter {
    ebpf: Ebpf,
    buckets: u32,
    link: Option<Link>,
}

pub fn check_buckets(buckets: u32) -> Result<u32, Error> {
    if buckets.is_power_of_two() && (MIN_BUCKETS..=MAX_BUCKETS).contains(&buckets) {
        Ok(buckets)
    } else {
        Err(Error::Buckets(buckets))
    }
}

pub fn interface_exists(iface: &str) -> bool {
    CString::new(iface).is_ok_and(|c| unsafe { libc::if_nametoindex(c.as_ptr()) } != 0)
}

impl Limiter {
    /// Loads the program with `buckets` buckets per generation (a power of two). Nothing is
    /// attached and no policy is set: until then it passes everything.
    pub fn load(buckets: u32) -> Result<Self, Error> {
        check_buckets(buckets)?;
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(MAP_BUCKETS, GENERATIONS * buckets)
            .load(objects::LIMITER)
            .map_err(Error::Load)?;
        let program: &mut Xdp = ebpf
            .program_mut(PROGRAM)
            .ok_or_else(|| Error::Missing { kind: "program", name: PROGRAM.into() })?
            .try_into()
            .map_err(Error::Verify)?;
        program.load().map_err(Error::Verify)?;
        let mut limiter = Self { ebpf, buckets, link: None };
        limiter.write_config(&Config { bucket_mask: buckets - 1, ..Config::default() })?;
        Ok(limiter)
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

    fn array<V: aya::Pod>(&self, name: &'static str) -> Result<Array<&MapData, V>, Error> {
        let map = self.ebpf.map(name).ok_or_else(|| Error::Missing { kind: "map", name: name.into() })?;
        Array::try_from(map).map_err(|source| Error::Map { name, source })
    }

    fn array_mut<V: aya::Pod>(&mut self, name: &'static str) -> Result<Array<&mut MapData, V>, Error> {
        let map = self.ebpf.map_mut(name).ok_or_else(|| Error::Missing { kind: "map", name: name.into() })?;
        Array::try_from(map).map_err(|source| Error::Map { name, source })
    }

    fn per_cpu<V: aya::Pod>(&self, name: &'static str) -> Result<PerCpuArray<&MapData, V>, Error> {
        let map = self.ebpf.map(name).ok_or_else(|| Error::Missing { kind: "map", name: name.into() })?;
        PerCpuArray::try_from(map).map_err(|source| Error::Map { name, source })
    }

    pub fn config(&self) -> Result<Config, Error> {
        self.array::<Config>(MAP_CONFIG)?
            .get(&0, 0)
            .map_err(|source| Error::Map { name: MAP_CONFIG, source })
    }

    pub fn write_config(&mut self, config: &Config) -> Result<(), Error> {
        self.array_mut::<Config>(MAP_CONFIG)?
            .set(0, config, 0)
            .map_err(|source| Error::Map { name: MAP_CONFIG, source })
    }

    pub fn set_salt(&mut self, salt: SipKey) -> Result<(), Error> {
        let mut config = self.config()?;
        config.salt = SipInit::new(&salt);
        self.write_config(&config)
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

    pub fn attach(&mut self, iface: &str, mode: ModeRequest) -> Result<Attached, Error> {
        if !interface_exists(iface) {
            return Err(Error::NoSuchInterface(iface.into()));
        }
        let first = match mode {
            ModeRequest::Auto | ModeRequest::Native => AttachMode::Native,
            ModeRequest::Skb => AttachMode::Skb,
        };
        let program = self.program_mut()?;
        let (id, attached) = match program.attach(iface, first.xdp_mode()) {
            Ok(id) => (id, Attached { mode: first, fallback: None }),
            Err(native_err) if mode == ModeRequest::Auto => {
                let reason = error_chain(&native_err);
                let id = program.attach(iface, XdpMode::Skb).map_err(|source| Error::Attach {
                    iface: iface.into(),
                    mode: "skb",
                    source,
                })?;
                (id, Attached { mode: AttachMode::Skb, fallback: Some(reason) })
            }
            Err(source) => {
                return Err(Error::Attach { iface: iface.into(), mode: first.as_str(), source });
            }
        };
        self.link = Some(Link { iface: iface.into(), id });
        Ok(attached)
    }

    /// Detaches from the interface, if attached. Dropping a `Limiter` detaches too.
    pub fn detach(&mut self) -> Result<Option<String>, Error> {
        let Some(link) = self.link.take() else {
            return Ok(None);
        };
        self.program_mut()?
            .detach(link.id)
            .map_err(|source| Error::Detach { iface: link.iface.clone(), source })?;
        Ok(Some(link.iface))
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

//! The kernel-facing handle: load the XDP program, write its configuration and policies,
//! attach and detach it, read its counters. The daemon, the tests and the benchmarks share it.

use std::{ffi::CString, fmt};

use aya::{
    Ebpf, EbpfLoader,
    maps::{
        Array, LpmTrie, MapData, PerCpuArray, PerCpuValues,
        lpm_trie::Key,
    },
    programs::{ProgramError, TestRun, TestRunOptions, Xdp, XdpMode, xdp::XdpLinkId},
};
use ipnet::IpNet;
use limiter_common::{
    SipInit, SipKey,
    maps::{
        ACL_ALLOW, ACL_DENY, CLASSES, Config, Counters, GENERATIONS, MAP_ACL_V4, MAP_ACL_V6,
        MAP_BUCKETS, MAP_CONFIG, MAP_COUNTERS, MAP_POLICIES, MAP_PORT_POLICY, MAX_BUCKETS,
        MAX_POLICIES, MIN_BUCKETS, PROGRAM, Policy,
    },
};

use crate::{
    Error, objects,
    state::{List, State},
};

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

    /// Makes the kernel's maps say what `new` says, given that they say what `old` says, touching
    /// only what differs. The order keeps packets in flight consistent: policies exist before
    /// routes lead to them, list entries exist before their flag is set, and routes leave a
    /// policy before it is deactivated.
    pub fn sync(&mut self, old: &State, new: &State) -> Result<(), Error> {
        let old_routes = old.routes().map_err(|e| Error::Internal(e.0))?;
        let new_routes = new.routes().map_err(|e| Error::Internal(e.0))?;
        let old_by_id: std::collections::BTreeMap<u16, &crate::state::Entry> = old.policies().map(|e| (e.id, e)).collect();
        for entry in new.policies() {
            let before = old_by_id.get(&entry.id);
            if before.map(|b| &b.kernel) != Some(&entry.kernel) {
                self.set_policy(&entry.kernel)?;
            }
            if before.is_some_and(|b| b.def.name != entry.def.name) {
                // The id changed hands: the new policy starts its own counts.
                self.zero_counters(entry.id)?;
            }
        }
        let entries = |s: &State| -> std::collections::BTreeMap<IpNet, u8> {
            let allow = s.list(List::Allow).iter().map(|n| (*n, ACL_ALLOW));
            allow.chain(s.list(List::Deny).iter().map(|n| (*n, ACL_DENY))).collect()
        };
        let (old_acl, new_acl) = (entries(old), entries(new));
        for (net, action) in &new_acl {
            if old_acl.get(net) != Some(action) {
                self.acl_insert(*net, *action)?;
            }
        }
        let mut table = self.array_mut::<u16>(MAP_PORT_POLICY)?;
        for (i, (&was, &is)) in old_routes.ports.iter().zip(&new_routes.ports).enumerate() {
            if was != is {
                table.set(i as u32, is, 0).map_err(|source| Error::Map { name: MAP_PORT_POLICY, source })?;
            }
        }
        let mut config = self.config()?;
        config.class_policy = new_routes.class_policy;
        let mut flags = config.flags & !(Config::HAS_PORT_POLICIES | Config::HAS_ACL_V4 | Config::HAS_ACL_V6);
        if new_routes.has_ports() {
            flags |= Config::HAS_PORT_POLICIES;
        }
        if new_acl.keys().any(|n| matches!(n, IpNet::V4(_))) {
            flags |= Config::HAS_ACL_V4;
        }
        if new_acl.keys().any(|n| matches!(n, IpNet::V6(_))) {
            flags |= Config::HAS_ACL_V6;
        }
        config.flags = flags;
        self.write_config(&config)?;
        for net in old_acl.keys().filter(|n| !new_acl.contains_key(n)) {
            self.acl_remove(*net)?;
        }
        let new_ids: std::collections::BTreeSet<u16> = new.policies().map(|e| e.id).collect();
        for id in old_by_id.keys().filter(|id| !new_ids.contains(id)) {
            self.set_policy(&Policy { id: *id, ..Policy::default() })?;
            self.zero_counters(*id)?;
        }
        Ok(())
    }

    fn acl_insert(&mut self, net: IpNet, action: u8) -> Result<(), Error> {
        let prefix = u32::from(net.prefix_len());
        match net {
            IpNet::V4(n) => self.acl::<[u8; 4]>(MAP_ACL_V4)?.insert(&Key::new(prefix, n.network().octets()), action, 0),
            IpNet::V6(n) => self.acl::<[u8; 16]>(MAP_ACL_V6)?.insert(&Key::new(prefix, n.network().octets()), action, 0),
        }
        .map_err(|source| Error::Map { name: acl_map_name(net), source })
    }

    fn acl_remove(&mut self, net: IpNet) -> Result<(), Error> {
        let prefix = u32::from(net.prefix_len());
        match net {
            IpNet::V4(n) => self.acl::<[u8; 4]>(MAP_ACL_V4)?.remove(&Key::new(prefix, n.network().octets())),
            IpNet::V6(n) => self.acl::<[u8; 16]>(MAP_ACL_V6)?.remove(&Key::new(prefix, n.network().octets())),
        }
        .map_err(|source| Error::Map { name: acl_map_name(net), source })
    }

    fn acl<K: aya::Pod>(&mut self, name: &'static str) -> Result<LpmTrie<&mut MapData, K, u8>, Error> {
        let map = self.ebpf.map_mut(name).ok_or_else(|| Error::Missing { kind: "map", name: name.into() })?;
        LpmTrie::try_from(map).map_err(|source| Error::Map { name, source })
    }

    fn zero_counters(&mut self, id: u16) -> Result<(), Error> {
        let cpus = aya::util::nr_cpus().map_err(|(what, e)| Error::Internal(format!("{what}: {e}")))?;
        let zeros = PerCpuValues::try_from(vec![Counters::default(); cpus])
            .map_err(|e| Error::Internal(format!("per-CPU values: {e}")))?;
        let map = self.ebpf.map_mut(MAP_COUNTERS).ok_or_else(|| Error::Missing { kind: "map", name: MAP_COUNTERS.into() })?;
        let mut counters = PerCpuArray::<_, Counters>::try_from(map).map_err(|source| Error::Map { name: MAP_COUNTERS, source })?;
        counters.set(u32::from(id), zeros, 0).map_err(|source| Error::Map { name: MAP_COUNTERS, source })
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

fn acl_map_name(net: IpNet) -> &'static str {
    match net {
        IpNet::V4(_) => MAP_ACL_V4,
        IpNet::V6(_) => MAP_ACL_V6,
    }
}

//! Loading the program, or adopting one a predecessor left pinned, and reaching its maps.

use std::path::PathBuf;

use crate::test_hook::pretend_rejected;

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, Map, MapData, PerCpuArray, ProgramArray},
    programs::{SchedClassifier, Xdp},
};
use limiter_common::maps::{
    Config, GENERATIONS, GLOBAL_MARK_IN_META, LAYOUT_VERSION, MAP_BUCKETS, MAP_CONFIG, MAP_HOST_BUCKETS, MAP_JUMPS,
    MAP_JUMPS_TCX, MAP_LAYOUT, PROGRAM, PROGRAM_LAYERS, PROGRAM_LAYERS_TCX, PROGRAM_TCX,
};

use super::{
    Error, Geometry, Hook, Incompatible, attach::Link, check_buckets, check_host_rows, check_rows, features, objects,
    pins::PinDir, verifier,
};

/// The handle on the limiter's XDP program and its maps. Dropping it without
/// [`Limiter::detach`] leaves a pinned program attached (fail static); an unpinned one goes.
pub struct Limiter {
    pub(super) ebpf: Ebpf,
    pub(super) geometry: Geometry,
    pub(super) link: Option<Link>,
    pub(super) pins: Option<PinDir>,
    pub(super) adopted: bool,
    /// Why a limiter pinned here could not be adopted: this one replaces it, state and all.
    pub(super) stale: Option<Incompatible>,
}

impl Limiter {
    /// Loads the XDP program with its maps, pinned in `pins` if given ([`Limiter::open_pinned`]).
    #[cfg(feature = "testing")]
    pub(crate) fn open(geometry: Geometry, pins: Option<PinDir>) -> Result<Self, Error> {
        Self::open_object(objects::LIMITER, EbpfLoader::new(), geometry, pins)
    }

    /// Creates the maps pinned in `pins`, or adopts them: when a limiter was left there (its
    /// link is pinned), its maps are adopted, TATs, counters and salt included, after checking
    /// they are what this build expects; [`Limiter::adopted`] says so. No program is loaded yet:
    /// attaching loads those of the hook it attaches at (see [`Limiter::load_hook`]).
    pub(crate) fn open_pinned(geometry: Geometry, pins: PinDir) -> Result<Self, Error> {
        Self::open_maps(objects::LIMITER, EbpfLoader::new(), geometry, Some(pins))
    }

    /// [`Limiter::open`] of `object` (the shipped program, or a test build of it with the same
    /// maps), with `loader` as the caller prepared it.
    #[cfg(feature = "testing")]
    pub(super) fn open_object(
        object: &[u8],
        loader: EbpfLoader<'_>,
        geometry: Geometry,
        pins: Option<PinDir>,
    ) -> Result<Self, Error> {
        let mut limiter = Self::open_maps(object, loader, geometry, pins)?;
        limiter.load_hook(Hook::Xdp)?;
        Ok(limiter)
    }

    fn open_maps(
        object: &[u8],
        mut loader: EbpfLoader<'_>,
        geometry: Geometry,
        pins: Option<PinDir>,
    ) -> Result<Self, Error> {
        let Geometry { buckets, rows, host_buckets, host_rows } = geometry;
        check_buckets(buckets)?;
        check_rows(rows)?;
        check_buckets(host_buckets)?;
        check_host_rows(host_rows)?;
        loader.map_max_entries(MAP_BUCKETS, GENERATIONS * buckets);
        loader.map_max_entries(MAP_HOST_BUCKETS, GENERATIONS * host_buckets);
        let mut adopted = false;
        let mut stale = None;
        let pin_paths: Vec<(&'static str, PathBuf)> = match &pins {
            None => Vec::new(),
            Some(p) if p.has_link() => match Self::check_adoptable(p, geometry) {
                Ok(()) => {
                    adopted = true;
                    super::pins::map_names().map(|m| (m, p.map(m))).collect()
                }
                // Another layout or geometry (--buckets, --rows, --host-buckets):
                // loaded afresh with maps of its own, which `attach`
                // swaps into the pinned link in one step and pins in place of the old ones. The
                // predecessor enforces until that step: no gap, only its state is lost.
                Err(Error::Adopt { why, .. }) => {
                    stale = Some(why);
                    Vec::new()
                }
                Err(e) => return Err(e),
            },
            Some(p) => {
                // Maps without a link are leftovers of a detach that did not finish; the caller
                // holds the directory's lock, so no one else uses them.
                p.remove_pins()?;
                p.prepare()?;
                super::pins::map_names().map(|m| (m, p.map(m))).collect()
            }
        };
        for (name, path) in pin_paths {
            loader.map_pin_path(name, path);
        }
        features::require_maps()?;
        loader.override_global(GLOBAL_MARK_IN_META, if features::xdp_metadata() { &1u8 } else { &0u8 }, true);
        let mut ebpf = loader.load(object).map_err(Error::Load)?;
        if let Err(lacks) = features::require_programs(&mut ebpf) {
            // The load pinned fresh maps for a limiter that will not run: take them back, so a
            // refused start leaves nothing (a failed start then removes the empty directory).
            if let (Some(p), false) = (&pins, adopted) {
                drop(ebpf);
                let _ = p.remove_pins();
            }
            return Err(lacks);
        }
        let mut limiter = Self { ebpf, geometry, link: None, pins, adopted, stale };
        if !adopted {
            let row_len = limiter_common::rows::row_len(buckets, rows);
            let host_row_len = limiter_common::rows::row_len(host_buckets, host_rows);
            limiter.store_config(&Config {
                bucket_mask: buckets - 1,
                rows,
                row_len,
                host_mask: host_buckets - 1,
                host_rows,
                host_row_len,
                ..Config::default()
            })?;
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

    /// A limiter was pinned here but could not be adopted, for this reason: this one takes its
    /// place in its link (see [`Limiter::attach`]) with fresh state.
    pub fn replaces_incompatible(&self) -> Option<&Incompatible> {
        self.stale.as_ref()
    }

    /// Whether the maps pinned in `p` are the ones this build makes, in `geometry`.
    fn check_adoptable(p: &PinDir, geometry: Geometry) -> Result<(), Error> {
        p.check_compatible(geometry)?;
        let data = MapData::from_pin(p.map(MAP_LAYOUT)).map_err(|source| Error::Map { name: MAP_LAYOUT, source })?;
        let layout = Array::<_, u64>::try_from(Map::Array(data))
            .and_then(|a| a.get(&0, 0))
            .map_err(|source| Error::Map { name: MAP_LAYOUT, source })?;
        p.check_layout(layout)?;
        // Another row count maps every key elsewhere: its TATs would be meaningless.
        let data = MapData::from_pin(p.map(MAP_CONFIG)).map_err(|source| Error::Map { name: MAP_CONFIG, source })?;
        let config = Array::<_, Config>::try_from(Map::Array(data))
            .and_then(|a| a.get(&0, 0))
            .map_err(|source| Error::Map { name: MAP_CONFIG, source })?;
        p.check_rows(config.rows.max(1), geometry.rows)?;
        p.check_host_rows(config.host_rows.max(1), geometry.host_rows)
    }

    /// The id the kernel gave the program of the hook it is attached at (XDP's, before it is).
    pub fn program_id(&self) -> Result<u32, Error> {
        self.hook_program_id(self.hook().unwrap_or(Hook::Xdp))
    }

    /// The id the kernel gave the program of `hook` (an error if it is not loaded).
    pub(super) fn hook_program_id(&self, hook: Hook) -> Result<u32, Error> {
        let name = hook_programs(hook).0;
        let program = self.ebpf.program(name).ok_or(Error::Missing { kind: "program", name })?;
        program.info().map(|i| i.id()).map_err(Error::Program)
    }

    /// Loads the programs of `hook`, unless they are: the limiter's, and its layered judgement,
    /// put where the limiter's tail call goes (`JUMPS` or `JUMPS_TCX`). Adopted maps: the
    /// predecessor's program, still attached until this one takes its link, reaches this build's
    /// judgement from now on (same layout, same task).
    pub fn load_hook(&mut self, hook: Hook) -> Result<(), Error> {
        let (main, layers, jumps) = hook_programs(hook);
        let loaded = |ebpf: &Ebpf, name| ebpf.program(name).is_some_and(|p| p.fd().is_ok());
        if loaded(&self.ebpf, main) && loaded(&self.ebpf, layers) {
            return Ok(());
        }
        for name in [layers, main] {
            let program = self.ebpf.program_mut(name).ok_or(Error::Missing { kind: "program", name })?;
            if program.fd().is_ok() {
                continue;
            }
            if let Some(log) = pretend_rejected(hook) {
                let denied = std::io::Error::from_raw_os_error(nix::libc::EACCES);
                return Err(verifier::refusal(hook.as_str(), name, &denied, log));
            }
            match hook {
                Hook::Xdp => <&mut Xdp>::try_from(program).map_err(Error::Program)?.load(),
                Hook::Tc => <&mut SchedClassifier>::try_from(program).map_err(Error::Program)?.load(),
            }
            .map_err(|e| verifier::rejected(hook.as_str(), name, e))?;
        }
        let program = self.ebpf.program(layers).ok_or(Error::Missing { kind: "program", name: layers })?;
        let fd = program.fd().map_err(Error::Program)?.try_clone().map_err(|error| Error::PinFile {
            doing: "duplicating the descriptor of",
            path: layers.into(),
            error,
        })?;
        let map = self.map_mut(jumps)?;
        let mut jumps_map = ProgramArray::try_from(map).map_err(|source| Error::Map { name: jumps, source })?;
        jumps_map.set(0, &fd, 0).map_err(|source| Error::Map { name: jumps, source })
    }

    /// The bucket arrays' sizes and rows, as loaded (or adopted: the same, checked).
    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Per-CPU buckets per generation.
    pub fn buckets(&self) -> u32 {
        self.geometry.buckets
    }

    pub(super) fn xdp_mut(&mut self) -> Result<&mut Xdp, Error> {
        self.ebpf
            .program_mut(PROGRAM)
            .ok_or(Error::Missing { kind: "program", name: PROGRAM })?
            .try_into()
            .map_err(Error::Program)
    }

    pub(super) fn tcx_mut(&mut self) -> Result<&mut SchedClassifier, Error> {
        self.ebpf
            .program_mut(PROGRAM_TCX)
            .ok_or(Error::Missing { kind: "program", name: PROGRAM_TCX })?
            .try_into()
            .map_err(Error::Program)
    }

    pub(super) fn map(&self, name: &'static str) -> Result<&Map, Error> {
        self.ebpf.map(name).ok_or(Error::Missing { kind: "map", name })
    }

    pub(super) fn map_mut(&mut self, name: &'static str) -> Result<&mut Map, Error> {
        self.ebpf.map_mut(name).ok_or(Error::Missing { kind: "map", name })
    }

    pub(super) fn array<V: aya::Pod>(&self, name: &'static str) -> Result<Array<&MapData, V>, Error> {
        Array::try_from(self.map(name)?).map_err(|source| Error::Map { name, source })
    }

    pub(super) fn array_mut<V: aya::Pod>(&mut self, name: &'static str) -> Result<Array<&mut MapData, V>, Error> {
        Array::try_from(self.map_mut(name)?).map_err(|source| Error::Map { name, source })
    }

    pub(super) fn per_cpu<V: aya::Pod>(&self, name: &'static str) -> Result<PerCpuArray<&MapData, V>, Error> {
        PerCpuArray::try_from(self.map(name)?).map_err(|source| Error::Map { name, source })
    }

    pub(crate) fn read_config(&self) -> Result<Config, Error> {
        self.array::<Config>(MAP_CONFIG)?.get(&0, 0).map_err(|source| Error::Map { name: MAP_CONFIG, source })
    }

    pub(super) fn store_config(&mut self, config: &Config) -> Result<(), Error> {
        self.array_mut::<Config>(MAP_CONFIG)?
            .set(0, config, 0)
            .map_err(|source| Error::Map { name: MAP_CONFIG, source })
    }
}

/// The programs of a hook: the limiter, its layered judgement, and the map the one tail-calls
/// the other through (a program array holds programs of one type only).
fn hook_programs(hook: Hook) -> (&'static str, &'static str, &'static str) {
    match hook {
        Hook::Xdp => (PROGRAM, PROGRAM_LAYERS, MAP_JUMPS),
        Hook::Tc => (PROGRAM_TCX, PROGRAM_LAYERS_TCX, MAP_JUMPS_TCX),
    }
}

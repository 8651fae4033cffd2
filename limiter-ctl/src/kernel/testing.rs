//! Test-only accessors (the `testing` feature, which limiter-tests enables): loading the program
//! unpinned (or its test build, with the memo's shortcuts off), running it on a frame, reaching
//! into its maps below the level the daemon works at, and reading another process's maps
//! through the daemon's own [`MapView`].

use aya::{
    EbpfLoader,
    maps::Map,
    programs::{SchedClassifier, TestRun as _, TestRunOptions, Xdp},
};
use limiter_common::maps::{
    CLASSES, Config, Counters, MAP_BUCKETS, MAP_COUNTERS, MAP_HOST_BUCKETS, MAP_POLICIES, PROGRAM, PROGRAM_TCX, Policy,
};

use super::{Error, Geometry, Limiter, MapView, objects};

impl Limiter {
    /// Loads the program with `buckets` buckets per generation (a power of two), unpinned: it
    /// goes when the handle goes. Nothing is attached and no policy set: it passes everything.
    /// The host-scope buckets are as many, in one row (each key one bucket, as `FlowKey::bucket`
    /// predicts).
    pub fn load(buckets: u32) -> Result<Self, Error> {
        Self::load_geometry(Geometry::same(buckets, 1))
    }

    /// [`Limiter::load`] with the per-CPU buckets split into `rows` count-min rows (1..=4); the
    /// host-scope buckets stay one row of `buckets` ([`Limiter::load_geometry`] sets both).
    pub fn load_rows(buckets: u32, rows: u32) -> Result<Self, Error> {
        Self::load_geometry(Self::rows_geometry(buckets, rows))
    }

    /// The program with the bucket arrays in `geometry`, unpinned.
    pub fn load_geometry(geometry: Geometry) -> Result<Self, Error> {
        Self::open(geometry, None)
    }

    /// [`Limiter::load_rows`] with the program's per-CPU key memo off (every packet hashes its
    /// key; the tick refusal, which lives in the memo, goes with it), for the benchmark to
    /// measure the memo against no memo in one run.
    pub fn load_rows_without_key_memo(buckets: u32, rows: u32) -> Result<Self, Error> {
        Self::load_switchable(Self::rows_geometry(buckets, rows), false, false)
    }

    /// [`Limiter::load_rows`] with the tick refusal off (a flooding key's standing refusal is
    /// checked on the precise clock on every packet), for the benchmark's A/B and for tests of
    /// exact refusal timing.
    pub fn load_rows_without_tick_refusal(buckets: u32, rows: u32) -> Result<Self, Error> {
        Self::load_switchable(Self::rows_geometry(buckets, rows), true, false)
    }

    /// The test build of the program in `geometry`, its memo's shortcuts set as asked: the key
    /// memo (`key_memo`; off, the tick refusal goes with it) and the tick refusal. Both on, it
    /// judges as the shipped program does.
    pub fn load_switchable_geometry(geometry: Geometry, key_memo: bool, tick_refusal: bool) -> Result<Self, Error> {
        Self::load_switchable(geometry, key_memo, tick_refusal)
    }

    fn rows_geometry(buckets: u32, rows: u32) -> Geometry {
        Geometry { rows, ..Geometry::same(buckets, 1) }
    }

    /// The test build of the program whose memo shortcuts are globals (`objects::SWITCHABLE`;
    /// the shipped one has them compiled in), with them set as asked.
    fn load_switchable(geometry: Geometry, key_memo: bool, tick_refusal: bool) -> Result<Self, Error> {
        let (key_memo, tick_refusal) = (u8::from(key_memo), u8::from(tick_refusal));
        let mut loader = EbpfLoader::new();
        loader.override_global("USE_KEY_MEMO", &key_memo, true);
        loader.override_global("USE_TICK_REFUSAL", &tick_refusal, true);
        Self::open_object(objects::SWITCHABLE, loader, geometry, None)
    }

    pub fn program(&self) -> Result<&Xdp, Error> {
        self.program_named(PROGRAM)
    }

    /// The program `name` of the object (`PROGRAM`, or the layers' `PROGRAM_LAYERS`).
    pub fn program_named(&self, name: &'static str) -> Result<&Xdp, Error> {
        self.ebpf.program(name).ok_or(Error::Missing { kind: "program", name })?.try_into().map_err(Error::Program)
    }

    pub fn config(&self) -> Result<Config, Error> {
        self.read_config()
    }

    pub fn write_config(&mut self, config: &Config) -> Result<(), Error> {
        self.store_config(config)
    }

    pub fn set_policy(&mut self, policy: &Policy) -> Result<(), Error> {
        self.store_policy(policy)
    }

    /// Sends every protocol class without a more specific policy to policy `id` (0: none), with
    /// the hidden-ports rule that follows for classes it alone judges (`Routes::hidden_drop`).
    pub fn set_default_policy(&mut self, id: u16) -> Result<(), Error> {
        let mut config = self.read_config()?;
        config.class_policy = [id; CLASSES];
        let policy = self.array_mut::<Policy>(MAP_POLICIES)?.get(&u32::from(id), 0).ok();
        let routes = super::compile::Routes { ports: vec![0; 1], class_policy: config.class_policy, sets: vec![] };
        let mut hidden = routes.hidden_drop(|_| policy);
        if config.flags & Config::HAS_PORT_POLICIES != 0 {
            hidden = 0xf * Config::HIDDEN_DROP;
        }
        config.flags = (config.flags & !(0xf * Config::HIDDEN_DROP)) | hidden;
        self.store_config(&config)
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

    /// The TAT stored in the shared (host-scope) bucket `index` (generation offset included).
    pub fn host_bucket(&self, index: u32) -> Result<u64, Error> {
        self.array::<u64>(MAP_HOST_BUCKETS)?
            .get(&index, 0)
            .map_err(|source| Error::Map { name: MAP_HOST_BUCKETS, source })
    }

    /// Runs the program once on `frame` (BPF_PROG_TEST_RUN) and returns its XDP action.
    pub fn test_run(&self, frame: &[u8]) -> Result<u32, Error> {
        let opts = TestRunOptions { data_in: Some(frame), ..TestRunOptions::default() };
        Ok(self.program()?.test_run(opts).map_err(Error::TestRun)?.return_value)
    }

    /// Runs the program `repeat` times back to back on `frame` in one BPF_PROG_TEST_RUN (on the
    /// calling CPU) and returns the last run's XDP action: what each run decided is in the
    /// policy's counters.
    pub fn test_run_repeat(&self, frame: &[u8], repeat: u32) -> Result<u32, Error> {
        let opts = TestRunOptions { data_in: Some(frame), repeat, ..TestRunOptions::default() };
        Ok(self.program()?.test_run(opts).map_err(Error::TestRun)?.return_value)
    }

    /// The tc program `name` of the object.
    pub fn classifier_named(&self, name: &'static str) -> Result<&SchedClassifier, Error> {
        self.ebpf.program(name).ok_or(Error::Missing { kind: "program", name })?.try_into().map_err(Error::Program)
    }

    /// [`Limiter::test_run`] at `hook`: at tcx (`Limiter::load_hook(Hook::Tc)` first), the
    /// tc action is read back as the XDP action of the same meaning (TC_ACT_SHOT is XDP_DROP,
    /// TC_ACT_UNSPEC XDP_PASS); any other tc action is returned as `u32::MAX - 100 + action`,
    /// which no XDP action is, so that a test comparing the hooks sees it.
    pub fn test_run_at(&self, hook: TestHook, frame: &[u8]) -> Result<u32, Error> {
        match hook {
            TestHook::Xdp => self.test_run(frame),
            TestHook::Tcx => {
                let opts = TestRunOptions { data_in: Some(frame), ..TestRunOptions::default() };
                let program = self.classifier_named(PROGRAM_TCX)?;
                let action = program.test_run(opts).map_err(Error::TestRun)?.return_value as i32;
                Ok(match action {
                    TC_ACT_SHOT => XDP_DROP,
                    TC_ACT_UNSPEC => XDP_PASS,
                    other => (u32::MAX - 100).wrapping_add(other as u32),
                })
            }
        }
    }
}

/// The hook a test runs the program at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestHook {
    Xdp,
    Tcx,
}

impl TestHook {
    pub const ALL: [TestHook; 2] = [TestHook::Xdp, TestHook::Tcx];
}

const TC_ACT_UNSPEC: i32 = -1;
const TC_ACT_SHOT: i32 = 2;
const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;

impl MapView {
    /// What a limiter's maps say, each map found by name through `map`: the tests read a
    /// daemon's maps this way, opened by the id of the program it attached.
    pub fn read_maps<'a>(map: impl Fn(&'static str) -> Option<&'a Map>) -> Result<Self, Error> {
        Self::read(map)
    }
}

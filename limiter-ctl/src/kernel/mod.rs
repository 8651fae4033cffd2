//! The kernel room: the handle on the limiter's programs and maps, [`Limiter`]. It loads the
//! program or adopts a pinned one (`load`), pins it on bpffs (`pins`, `pinned`), attaches it at
//! XDP or at tc ingress (through tcx, `tcx`, or a netlink filter, `tc_filter`, whichever the
//! kernel has: `tc_api`; `hook` says where it runs) and detaches it (`attach`), moves it between
//! the two (`moves`; while both hooks hold it, each packet judged once: `handover`), finds another
//! limiter on the interface (`others`), rotates its salt (`rotate`), reads and writes its maps
//! (`maps`), and brings the maps from one state to another, touching only what differs (`view`),
//! in the kernel's terms
//! of the validated state (`compile`: policy records, routes). One `impl Limiter` per concern,
//! each in its file. `host` answers what the host is (interfaces, the clock).
//!
//! It hands the daemon what it reads, never a map: the counters summed per policy
//! (`Limiter::counters`), the sampled refusals as a stream to drain ([`Refusals`], `refusals`),
//! and a scan of the buckets to run off the loop ([`BucketScan`]).
//!
//! It may use the config room (the state it compiles into the maps), nothing of the daemon or
//! the CLI. Its one error type is [`Error`].

mod attach;
mod bans;
pub mod compile;
pub(crate) mod detach;
mod error;
pub(crate) mod explain;
pub mod features;
mod geometry;
mod handover;
mod hook;
mod host;
mod load;
mod maps;
mod moves;
mod objects;
mod others;
mod pinned;
pub(crate) mod pins;
mod refusals;
mod rotate;
mod rtnl;
mod sys;
pub(crate) mod tc_api;
pub(crate) mod tc_filter;
pub(crate) mod tcx;
#[cfg(feature = "testing")]
mod testing;
mod verifier;
mod view;

pub(crate) use attach::chain as error_chain;
pub use bans::{BanMap, BanPresence};
pub use compile::Routes;
pub use error::{Error, Incompatible, MapShape};
pub use geometry::{
    BucketCount, Geometry, GeometryRequest, HostSize, HostSizeError, auto_buckets, auto_host_buckets, bytes_text,
};
pub use hook::{AttachMode, Attached, Hook, HookRequest, ModeRequest, Placement, TcReason};
pub use load::Limiter;
pub use maps::BucketScan;
pub(crate) use others::{OtherLimiter, other_limiter, take_off_advice};
pub use refusals::{DEFAULT_SAMPLE_REFUSALS, DEFAULT_SAMPLES_PER_S, Refusals, per_cpu_budget};
pub use rotate::draw_salt;
pub use tc_api::{ApiReason, TcApiRequest};
pub use tcx::{ProgRef, TcxPlace};
pub use verifier::keep_logs_in as keep_verifier_logs_in;
pub use view::MapView;

pub(crate) use host::{
    Lookup, check_buckets, check_host_rows, check_rows, if_index, interface_exists, interface_mtu, lookup_index,
    monotonic_ns,
};

/// Test-only: the BPF objects only the tests and benchmarks load.
#[cfg(feature = "testing")]
pub use objects::{BENCH, GEN, LIMITER, NEIGHBOUR, PROBE};
/// Test-only: the names of the maps pinned beside the link.
#[cfg(feature = "testing")]
pub use pins::{dir_name as pin_dir_name, map_names};
/// Test-only: whether a pin is a program's (a netlink filter's) rather than a link's.
#[cfg(feature = "testing")]
pub use sys::pinned_is_program;
/// Test-only: the hook a test runs the program at (`Limiter::test_run_at`).
#[cfg(feature = "testing")]
pub use testing::TestHook;

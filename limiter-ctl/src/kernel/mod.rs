//! The kernel room: the handle on the XDP program and its maps, [`Limiter`]. It loads the
//! program or adopts a pinned one (`load`), pins it on bpffs (`pins`), attaches and detaches it
//! (`attach`), rotates its salt (`rotate`), reads and writes its maps (`maps`), and brings the
//! maps from one state to another, touching only what differs (`view`). One `impl Limiter` per
//! concern, each in its file. `host` answers what the host is (interfaces, the clock).
//!
//! It may use the config room (the state it compiles into the maps), nothing of the daemon or
//! the CLI. Its one error type is [`Error`].

mod attach;
mod error;
mod host;
mod load;
mod maps;
mod objects;
pub(crate) mod pins;
mod rotate;
#[cfg(feature = "testing")]
mod testing;
mod view;

pub use attach::{AttachMode, Attached, ModeRequest};
pub use error::{Error, Incompatible, MapShape};
pub use load::Limiter;
pub use maps::DEFAULT_SAMPLE_REFUSALS;
pub use rotate::draw_salt;
pub use view::MapView;

pub(crate) use host::{
    Lookup, check_buckets, check_rows, if_index, interface_exists, interface_mtu, lookup_index, monotonic_ns,
};

/// Test-only: the BPF objects only the tests and benchmarks load.
#[cfg(feature = "testing")]
pub use objects::{BENCH, GEN, PROBE};
/// Test-only: the names of the maps pinned beside the link.
#[cfg(feature = "testing")]
pub use pins::map_names;

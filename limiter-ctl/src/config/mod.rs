//! The config room: what the operator asks for, checked before anything moves. The text forms
//! (`field`), the values of a policy's fields and lists (`policy`, `rate`), the fields declared
//! once (`def`: the whole policy and its partial edit), which policies judge which packets
//! (`layers`), the TOML file (`file`) and its
//! write-back (`write`), and the desired state validated as a whole (`state`). Each uses only
//! those before it.
//!
//! It uses nothing of the other rooms (the kernel and the daemon use it, never the reverse),
//! neither the CLI's parser nor the kernel's records: the CLI builds its flags from the fields'
//! declaration, the kernel compiles the validated state into its records.
//! Its one error type, [`Error`], is bad input (or the file unreadable or unwritable).

mod def;
mod duration;
mod error;
mod field;
mod file;
mod layers;
mod policy;
mod rate;
mod state;
mod write;

pub use def::{Dash, FIELDS, Field, FieldValue, Flag, PolicyDef, PolicyEdit, Visit};
pub use duration::{duration_ns, scaled_ns};
pub use error::Error;
pub use field::{FieldError, decimal, net_serde, parse_net, unmapped};
pub use file::{
    ConfigFile, DEFAULT_PATH, FORMAT_KEY, FORMAT_VERSION, MAX_FILE_BYTES, load, load_with_text, parse, position, read,
    says_no_rules, unversioned, unversioned_note,
};
pub use layers::{Layering, PortStretch};
pub use policy::{
    BurstEdit, Destination, KeySpec, List, Match, Mode, Name, Origin, Ports, Proto, Scope, SourcePorts, Unit,
    parse_burst,
};
pub use rate::{Rate, RateError};
pub use state::{DEFAULT_MAX_FRAME, Entry, L2_OVERHEAD, State, longest_window, max_frame_for_mtu};
pub use write::save;

/// The declaration's sample policy, for the CLI's test of the flags.
#[cfg(test)]
pub(crate) use def::tests as def_tests;

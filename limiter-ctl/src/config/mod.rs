//! The config room: what the operator asks for, checked before anything moves. The policy
//! model and its one textual form per field (`policy`, `rate`), the desired state validated as
//! a whole and compiled into what the kernel reads (`state`), and the TOML file (`file`).
//!
//! It uses nothing of the other rooms: the kernel and the daemon use it, never the reverse.
//! Its one error type, [`Error`], is bad input (or the file unreadable or unwritable).

mod error;
mod file;
mod policy;
mod rate;
mod state;
mod write;

pub use error::Error;
pub use file::{
    ConfigFile, DEFAULT_PATH, MAX_FILE_BYTES, PolicyDef, load, load_with_text, parse, position, read, says_no_rules,
};
pub use policy::{
    BurstEdit, FieldError, KeySpec, Match, Mode, Name, PolicyEdit, PolicySpec, Ports, Proto, Scope, Unit, decimal,
    net_serde, parse_burst, parse_net,
};
pub use rate::{Rate, RateError};
pub use state::{DEFAULT_MAX_FRAME, Entry, L2_OVERHEAD, List, Routes, State, longest_window, max_frame_for_mtu};
pub use write::save;

//! The api room: what the CLI and the daemon agree on.
pub(crate) mod ipc;

//! The api room: what the CLI and the daemon agree on, as bpfman-api is for bpfman's CLI and
//! daemon. The control socket's requests and responses (`ipc`), and the replies' data: a
//! policy's status and counters (`ipc`), `stats`' snapshot (`stats`), `top`'s report (`top`).
//! Only types and their wire form live here: the daemon fills them, the CLI shows them.
//!
//! Beside them, how the daemon is started (`start`: `limiter-ctl daemon`'s flags, parsed).
//!
//! It may use the config room (policy names, definitions and edits travel as the file spells
//! them) and the kernel room's attach mode request; nothing of the daemon or the CLI.

pub(crate) mod explain;
pub(crate) mod ipc;
pub(crate) mod start;
pub(crate) mod stats;
pub(crate) mod top;

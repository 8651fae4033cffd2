//! The bouncer room: `limiter-ctl crowdsec`, a CrowdSec bouncer, a long-running client of the
//! daemon. It polls the local API's decision stream (`GET /v1/decisions/stream`,
//! `startup=true` first for the full set, then the changes since the last poll) and turns each
//! ban on an address or a range into an expiring deny entry of origin `crowdsec`, for the
//! decision's own duration; a deleted decision removes it.
//!
//! It fails static: a LAPI that is down or answers garbage changes nothing (the bans applied
//! stay, and expire on their own in the daemon); it is retried with backoff, and the first
//! answer after a failure is asked for in full (`startup=true`) and reconciled, so a decision
//! deleted meanwhile is not missed. A daemon that cannot be reached keeps what is pending,
//! retried on every poll.
//!
//! - `lapi`: the LAPI's address and key, one poll over HTTP.
//! - `stream`: its answer read as it arrives, within `bounded`'s bounds.
//! - `decisions`: each element judged, a ban or skipped (`duration`: Go's durations, as
//!   CrowdSec writes them).
//! - `bans`: the set it keeps, and what the daemon must still be told.
//! - `daemon`: the daemon side, through the control socket's client; `sync` keeps it in step
//!   (a restarted daemon gets back what it lost).
//! - `run`: the loop.
//!
//! It may use the control socket's client, the api room's wire types and the config room's
//! networks and origins; nothing of the daemon or the CLI (which parses its arguments and
//! calls [`run`]).

mod bans;
mod bounded;
mod daemon;
mod decisions;
mod duration;
mod lapi;
mod run;
mod stream;
mod sync;

pub(crate) use daemon::DaemonSink;
pub(crate) use lapi::{Lapi, read_key, stream_url};
pub(crate) use run::run;

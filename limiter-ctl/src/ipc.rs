//! The daemon's control socket: a Unix socket (mode 0600), one JSON request line in, one JSON
//! response line out, per connection.

use std::{
    io::{self, BufRead as _, BufReader, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use ipnet::IpNet;
use limiter_common::maps::Counters;
use serde::{Deserialize, Serialize};

use crate::{config::PolicyDef, policy::Name, state::List};

pub const DEFAULT_SOCKET: &str = "/run/limiter/ctl.sock";
/// Requests are small; anything longer is not ours.
pub const MAX_REQUEST: usize = 64 * 1024;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Request {
    PolicySet { policy: PolicyDef },
    PolicyRm { name: Name },
    PolicyList,
    PolicyShow { name: Name },
    ListAdd { list: List, cidr: IpNet },
    ListRm { list: List, cidr: IpNet },
    ListShow { list: List },
    SaltRotate,
    Stats,
    Top { limit: usize },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "kebab-case")]
pub enum Response {
    Ok {
        #[serde(default)]
        data: serde_json::Value,
    },
    /// Bad input: nothing changed.
    Usage { error: String },
    /// The daemon could not do what was asked.
    Failed { error: String },
}

/// A policy as `policy list` and `policy show` report it: its definition with the burst
/// resolved, its id and its counters since it was created.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyStatus {
    pub id: u16,
    #[serde(flatten)]
    pub def: PolicyDef,
    pub counters: PolicyCounters,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyCounters {
    pub admitted_packets: u64,
    pub admitted_bytes: u64,
    pub refused_packets: u64,
    pub refused_bytes: u64,
    pub dry_run_packets: u64,
    pub dry_run_bytes: u64,
    pub allowed_packets: u64,
    pub denied_packets: u64,
}

impl From<&Counters> for PolicyCounters {
    fn from(c: &Counters) -> Self {
        Self {
            admitted_packets: c.admitted_packets,
            admitted_bytes: c.admitted_bytes,
            refused_packets: c.refused_packets,
            refused_bytes: c.refused_bytes,
            dry_run_packets: c.dry_run_packets,
            dry_run_bytes: c.dry_run_bytes,
            allowed_packets: c.allowed_packets,
            denied_packets: c.denied_packets,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no daemon is listening on {0} (start one with `limiter-ctl daemon --iface IFACE`, or pass --socket)")]
    NoDaemon(PathBuf),
    #[error("permission denied on {0}: the control socket is root-only (mode 0600); run as root")]
    Permission(PathBuf),
    #[error("talking to the daemon on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("the daemon on {path} sent an unreadable response: {source}")]
    Protocol { path: PathBuf, source: serde_json::Error },
}

/// Sends one request and waits (up to 30 s) for its response.
pub fn call(socket: &Path, request: &Request) -> Result<Response, ClientError> {
    let io_err = |source| ClientError::Io { path: socket.to_path_buf(), source };
    let stream = UnixStream::connect(socket).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => ClientError::NoDaemon(socket.to_path_buf()),
        io::ErrorKind::PermissionDenied => ClientError::Permission(socket.to_path_buf()),
        _ => io_err(e),
    })?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(io_err)?;
    let mut line = serde_json::to_string(request).map_err(|e| io_err(io::Error::other(e)))?;
    line.push('\n');
    (&stream).write_all(line.as_bytes()).map_err(io_err)?;
    let mut reply = String::new();
    BufReader::new(&stream).read_line(&mut reply).map_err(io_err)?;
    serde_json::from_str(&reply).map_err(|source| ClientError::Protocol { path: socket.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_have_a_stable_wire_form() {
        let req = Request::ListAdd { list: List::Deny, cidr: "2001:db8::/32".parse().unwrap() };
        let text = serde_json::to_string(&req).unwrap();
        assert_eq!(text, r#"{"op":"list-add","list":"deny","cidr":"2001:db8::/32"}"#);
        assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), req);
        let bad = serde_json::from_str::<Request>(r#"{"op":"list-add","list":"deny","cidr":"2001:db8::/200"}"#);
        assert!(bad.is_err());
    }
}

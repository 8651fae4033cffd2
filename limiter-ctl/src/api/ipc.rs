//! The daemon's control socket: a Unix socket (mode 0600, root and the daemon's user only,
//! checked per connection), one JSON request line in, one JSON
//! response line out, per connection. These are its wire types: the daemon's server side
//! (`daemon::socket`) and the CLI's client side (`cli::client`) speak them. A client has 2 s to
//! send its line and 2 s to take the answer; at most 256 connections are served at once.

use ipnet::IpNet;
use limiter_common::maps::Counters;
use serde::{Deserialize, Serialize};

use crate::{
    config::{List, Name, PolicyDef, PolicyEdit},
    kernel::{Hook, TcxPlace},
};

pub(crate) const DEFAULT_SOCKET: &str = "/run/limiter/ctl.sock";
/// Requests are small; anything longer is not ours.
pub(crate) const MAX_REQUEST: usize = 64 * 1024;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub(crate) enum Request {
    /// Create a policy, or change the given fields of an existing one.
    PolicySet {
        name: Name,
        edit: PolicyEdit,
    },
    PolicyRm {
        name: Name,
    },
    PolicyList,
    PolicyShow {
        name: Name,
    },
    // Through the config's parser: a client other than ours cannot slip in `010.1.1.1/32`.
    ListAdd {
        list: List,
        #[serde(deserialize_with = "crate::config::net_serde::deserialize")]
        cidr: IpNet,
    },
    ListRm {
        list: List,
        #[serde(deserialize_with = "crate::config::net_serde::deserialize")]
        cidr: IpNet,
    },
    ListShow {
        list: List,
    },
    SaltRotate,
    /// Re-read the config file (what SIGHUP does), and say whether it was applied.
    Reload,
    Stats,
    Top {
        limit: usize,
    },
    /// Move the program to `hook` without a gap (attached there first, then released where it
    /// was); at tcx, at `place` (None: where the daemon's --tcx-before/--tcx-after say).
    Attach {
        hook: Hook,
        #[serde(default)]
        place: Option<TcxPlace>,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "kebab-case")]
pub(crate) enum Response {
    Ok {
        #[serde(default)]
        data: serde_json::Value,
    },
    /// Bad input: nothing changed.
    Usage { error: String },
    /// The daemon could not do what was asked.
    Failed { error: String },
}

/// What `reload` applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Reloaded {
    pub config: std::path::PathBuf,
    pub policies: usize,
    pub allow: usize,
    pub deny: usize,
}

/// What `attach` did: where the program runs now, and where it ran before if it moved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Attachment {
    pub iface: String,
    /// "native", "skb" or "tcx", as `stats` says it.
    pub attach_mode: String,
    /// None: it was there already; nothing changed.
    pub moved_from: Option<String>,
    /// Why it runs at tcx, when it does.
    pub attach_reason: Option<String>,
}

/// What a change (`policy set`, `deny add`, ...) answers when the file held a hand edit the
/// daemon had not applied yet: that edit was reloaded first, and the change applied on top.
/// (Otherwise the answer carries no data.)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ReloadedFirst {
    pub reloaded_first: Reloaded,
}

/// A policy as `policy list` and `policy show` report it: its definition with the burst
/// resolved, its id and its counters since it was created.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct PolicyStatus {
    pub id: u16,
    #[serde(flatten)]
    pub def: PolicyDef,
    pub counters: PolicyCounters,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PolicyCounters {
    pub admitted_packets: u64,
    pub admitted_bytes: u64,
    pub refused_packets: u64,
    pub refused_bytes: u64,
    pub dry_run_packets: u64,
    pub dry_run_bytes: u64,
    /// Judged by this policy as one layer of several, and refused by another layer (which
    /// counts it as refused). Absent from an older daemon's answer: 0.
    #[serde(default)]
    pub overruled_packets: u64,
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
            overruled_packets: c.overruled_packets,
            allowed_packets: c.allowed_packets,
            denied_packets: c.denied_packets,
        }
    }
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
        let octal = serde_json::from_str::<Request>(r#"{"op":"list-add","list":"deny","cidr":"010.1.1.0/24"}"#);
        assert!(octal.unwrap_err().to_string().contains("invalid CIDR"));
    }
}

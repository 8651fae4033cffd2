//! The daemon's control socket: a Unix socket (mode 0600, root and the daemon's user only,
//! checked per connection), one JSON request line in, one JSON response line out, per
//! connection. These are its wire types: the daemon's server side (`daemon::socket`) and the
//! client side (`client`: the CLI's and the bouncer's) speak them. A client has 2 s to send its
//! line and 2 s to take the answer; at most 256 connections are served at once.

use ipnet::IpNet;
use limiter_common::maps::Counters;
use serde::{Deserialize, Serialize};

use crate::{
    config::{List, Name, Origin, PolicyDef, PolicyEdit},
    kernel::{Hook, TcxPlace},
};

pub(crate) const DEFAULT_SOCKET: &str = "/run/limiter/ctl.sock";
/// Requests are small (a ban batch of [`MAX_BATCH`] entries is about 80 KiB at most); anything
/// longer is not ours.
pub(crate) const MAX_REQUEST: usize = 256 * 1024;
/// The most entries one `ban-add` or `ban-rm` carries: clients chunk larger sets, so each
/// request is applied in a few milliseconds and other clients are answered between them.
pub(crate) const MAX_BATCH: usize = 1_000;
/// The longest ban: ten years (longer is a permanent entry: `list-add`).
pub(crate) const MAX_FOR_MS: u64 = 10 * 365 * 24 * 3600 * 1000;
/// The shortest prefix a ban may have, from any origin: an IPv4 /8 is the largest block ever
/// allocated to one holder (16.7M addresses), an IPv6 /32 the usual allocation to a whole
/// provider. Broader is a ban on a region or on everyone, not on an attacker; only the config
/// file's deny list takes it.
pub(crate) const FLOOR_V4: u8 = 8;
pub(crate) const FLOOR_V6: u8 = 32;

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
    /// Expiring entries (bans). Bad input refuses the whole batch; an entry the daemon's rules
    /// refuse (broader than the floor, a deny over the allow list) is left out and named in the
    /// answer ([`BanAdded`]), the rest applied whole or not at all. `for_ms` is required and
    /// above 0: a permanent entry is a `list-add`. IPv4-mapped networks are taken as IPv4.
    BanAdd {
        list: List,
        origin: Origin,
        entries: Vec<BanEntry>,
    },
    /// Removes the expiring entries of `origin` for these networks (others' stay); a network
    /// without one is no error: the answer ([`BanRemoved`]) says which were removed.
    BanRm {
        list: List,
        origin: Origin,
        #[serde(deserialize_with = "nets")]
        cidrs: Vec<IpNet>,
    },
    /// The expiring entries of a list, with their origin and time left ([`BanStatus`]), in
    /// lines of at most 10,000 ([`BanPage`]); with `cidrs` (at most [`MAX_BATCH`]), those
    /// networks' entries only, of every origin, in one line.
    BanList {
        list: List,
        #[serde(default, deserialize_with = "some_nets", skip_serializing_if = "Option::is_none")]
        cidrs: Option<Vec<IpNet>>,
    },
    SaltRotate,
    /// Re-read the config file (what SIGHUP does), and say whether it was applied.
    Reload,
    Stats,
    Top {
        limit: usize,
    },
    /// What a packet of these fields would meet now ([`crate::api::explain`]); reads only.
    Explain {
        #[serde(flatten)]
        query: crate::api::explain::Query,
    },
    /// Move the program to `hook` without a gap (attached there first, then released where it
    /// was); at tcx, at `place` (None: where the daemon's --tcx-before/--tcx-after say).
    Attach {
        hook: Hook,
        #[serde(default)]
        place: Option<TcxPlace>,
    },
}

/// One expiring entry of a `ban-add`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BanEntry {
    #[serde(deserialize_with = "crate::config::net_serde::deserialize")]
    pub cidr: IpNet,
    /// How long it holds, in ms from when the daemon applies it. Required (null is refused).
    pub for_ms: u64,
}

/// Networks, each through the config's parser.
fn nets<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<IpNet>, D::Error> {
    #[derive(Deserialize)]
    struct Net(#[serde(deserialize_with = "crate::config::net_serde::deserialize")] IpNet);
    Ok(Vec::<Net>::deserialize(d)?.into_iter().map(|n| n.0).collect())
}

fn some_nets<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<IpNet>>, D::Error> {
    nets(d).map(Some)
}

/// What `ban-add` answers: how many entries of the batch are now in force, and the ones the
/// daemon's rules refused (too broad, or over the allow list), each with why.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BanAdded {
    pub added: usize,
    #[serde(default)]
    pub refused: Vec<BanRefused>,
}

/// An entry of a `ban-add` the rules refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BanRefused {
    pub cidr: IpNet,
    pub reason: String,
}

/// What `ban-rm` answers: the networks whose entry of that origin was removed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BanRemoved {
    pub removed: usize,
    pub cidrs: Vec<IpNet>,
}

/// An expiring entry as `ban-list` reports it. Fields in alphabetical order: the order they
/// have always had on the wire.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BanStatus {
    pub cidr: IpNet,
    /// Wall-clock expiry, ms since the Unix epoch.
    pub expires_at_ms: u64,
    /// Time left when answered, in ms.
    pub expires_in_ms: u64,
    pub origin: Origin,
}

/// One line of a `ban-list` answer: an answer's line (`{"status":"ok","data":[...]}`), with
/// `"more":true` when another follows. So a list that fits in one line reads as any answer;
/// a longer one comes as the client reads it, never whole in the daemon's memory or the
/// client's. A refusal, or a failure midway (the daemon stopping), is an answer's usual line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct BanPage<'a> {
    pub status: Status,
    #[serde(default)]
    pub data: std::borrow::Cow<'a, [BanStatus]>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub more: bool,
    /// Why not, when `status` is not ok.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl<'a> BanPage<'a> {
    pub(crate) fn ok(data: &'a [BanStatus], more: bool) -> Self {
        Self { status: Status::Ok, data: data.into(), more, error: None }
    }
}

/// An answer's `status`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Status {
    Ok,
    /// Bad input: nothing changed.
    Usage,
    Failed,
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
    /// "native", "skb", "tcx" or "netlink", as `stats` says it.
    pub attach_mode: String,
    /// None: it was there already; nothing changed.
    pub moved_from: Option<String>,
    /// Why it runs at tc ingress, when it does.
    pub attach_reason: Option<String>,
    /// Why through netlink rather than tcx, when it is.
    #[serde(default)]
    pub attach_api_reason: Option<String>,
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

    /// The ban requests of the contract between the CLI, fail2ban's action and the CrowdSec
    /// bouncer (docs/OPERATIONS.md, Bans): these exact lines.
    #[test]
    fn ban_requests_have_a_stable_wire_form() {
        let add = Request::BanAdd {
            list: List::Deny,
            origin: Origin::Crowdsec,
            entries: vec![BanEntry { cidr: "198.18.0.5/32".parse().unwrap(), for_ms: 5000 }],
        };
        let text =
            r#"{"op":"ban-add","list":"deny","origin":"crowdsec","entries":[{"cidr":"198.18.0.5/32","for_ms":5000}]}"#;
        assert_eq!(serde_json::to_string(&add).unwrap(), text);
        assert_eq!(serde_json::from_str::<Request>(text).unwrap(), add);
        let rm = Request::BanRm {
            list: List::Deny,
            origin: Origin::Crowdsec,
            cidrs: vec!["198.18.0.5/32".parse().unwrap(), "2001:db8::/64".parse().unwrap()],
        };
        let text = r#"{"op":"ban-rm","list":"deny","origin":"crowdsec","cidrs":["198.18.0.5/32","2001:db8::/64"]}"#;
        assert_eq!(serde_json::to_string(&rm).unwrap(), text);
        assert_eq!(serde_json::from_str::<Request>(text).unwrap(), rm);
        let list = r#"{"op":"ban-list","list":"deny"}"#;
        assert_eq!(serde_json::from_str::<Request>(list).unwrap(), Request::BanList { list: List::Deny, cidrs: None });
        assert_eq!(serde_json::to_string(&Request::BanList { list: List::Deny, cidrs: None }).unwrap(), list);
        let some = r#"{"op":"ban-list","list":"deny","cidrs":["198.18.0.5/32"]}"#;
        let cidrs = Some(vec!["198.18.0.5/32".parse().unwrap()]);
        assert_eq!(serde_json::from_str::<Request>(some).unwrap(), Request::BanList { list: List::Deny, cidrs });
        let f2b = r#"{"op":"ban-add","list":"allow","origin":"fail2ban","entries":[]}"#;
        assert!(matches!(serde_json::from_str::<Request>(f2b), Ok(Request::BanAdd { origin: Origin::Fail2ban, .. })));
        // A permanent entry is no ban; nor is an unknown origin or a lax CIDR.
        for bad in [
            r#"{"op":"ban-add","list":"deny","origin":"cli","entries":[{"cidr":"198.18.0.5/32","for_ms":null}]}"#,
            r#"{"op":"ban-add","list":"deny","origin":"cli","entries":[{"cidr":"198.18.0.5/32"}]}"#,
            r#"{"op":"ban-add","list":"deny","origin":"cli","entries":[{"cidr":"198.18.0.5/32","for_ms":-5}]}"#,
            r#"{"op":"ban-add","list":"deny","origin":"nginx","entries":[]}"#,
            r#"{"op":"ban-rm","list":"deny","origin":"cli","cidrs":["010.1.1.1/32"]}"#,
            r#"{"op":"ban-list","list":"deny","cidrs":["010.1.1.1/32"]}"#,
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
    }

    /// A `ban-list` answer's lines: the last (or only) one is any answer's line; the others say
    /// `more`; a refusal midway is any refusal's line.
    #[test]
    fn ban_pages_read_as_answers() {
        let entry = BanStatus {
            cidr: "198.18.0.5/32".parse().unwrap(),
            origin: Origin::Cli,
            expires_at_ms: 1_700_000_600_000,
            expires_in_ms: 600_000,
        };
        let last = serde_json::to_string(&BanPage::ok(std::slice::from_ref(&entry), false)).unwrap();
        let as_answer = Response::Ok { data: serde_json::to_value([&entry]).unwrap() };
        assert_eq!(last, serde_json::to_string(&as_answer).unwrap());
        let more = serde_json::to_string(&BanPage::ok(&[], true)).unwrap();
        assert_eq!(more, r#"{"status":"ok","data":[],"more":true}"#);
        let page: BanPage = serde_json::from_str(&last).unwrap();
        assert_eq!((page.status, page.data.as_ref(), page.more), (Status::Ok, std::slice::from_ref(&entry), false));
        let failed = serde_json::to_string(&Response::Failed { error: "stopping".into() }).unwrap();
        let page: BanPage = serde_json::from_str(&failed).unwrap();
        assert_eq!((page.status, page.error.as_deref(), page.data.len()), (Status::Failed, Some("stopping"), 0));
    }
}

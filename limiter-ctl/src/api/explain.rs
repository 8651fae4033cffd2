//! `explain`'s question and answer: what a packet of given fields would meet now, in the order
//! the program judges it (lists, then each policy covering it), and when it would pass.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::config::{List, Origin};

/// A packet's protocol, as `explain` takes it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Proto {
    #[default]
    Tcp,
    Udp,
    Icmp,
}

impl Proto {
    pub fn as_str(self) -> &'static str {
        crate::config::Proto::from(self).as_str()
    }
}

impl From<Proto> for crate::config::Proto {
    fn from(p: Proto) -> Self {
        match p {
            Proto::Tcp => Self::Tcp,
            Proto::Udp => Self::Udp,
            Proto::Icmp => Self::Icmp,
        }
    }
}

/// The packet asked about: its source, protocol, ports and SYN flag; its destination, for
/// policies with a destination prefix.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Query {
    pub addr: Option<IpAddr>,
    #[serde(default)]
    pub proto: Proto,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dport: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sport: Option<u16>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub syn: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst: Option<IpAddr>,
}

impl Query {
    /// The source address, or why the question is not one a packet can ask (bad input: exit 2).
    pub fn check(&self) -> Result<IpAddr, String> {
        let addr = self.addr.ok_or("explain needs the source address (ADDR)")?;
        if self.syn && self.proto != Proto::Tcp {
            return Err(format!("--syn is a TCP flag; this packet is {}", self.proto.as_str()));
        }
        if self.proto == Proto::Icmp && (self.dport.is_some() || self.sport.is_some()) {
            return Err("ICMP has no ports: drop --dport and --sport, or give --proto tcp or udp".into());
        }
        if let Some(dst) = self.dst
            && dst.is_ipv4() != addr.is_ipv4()
        {
            return Err(format!("--dst {dst} is not of the source's family ({addr})"));
        }
        Ok(addr)
    }

    /// The packet in words: `tcp SYN from 198.18.0.7:1234 to port 80`.
    pub fn describe(&self) -> String {
        let mut s = self.proto.as_str().to_string();
        if self.syn {
            s.push_str(" SYN");
        }
        if let Some(addr) = self.addr {
            s.push_str(&format!(" from {addr}"));
        }
        if let Some(sport) = self.sport {
            s.push_str(&format!(" port {sport}"));
        }
        match (self.dst, self.dport) {
            (Some(dst), Some(dport)) => s.push_str(&format!(" to {dst} port {dport}")),
            (Some(dst), None) => s.push_str(&format!(" to {dst}")),
            (None, Some(dport)) => s.push_str(&format!(" to port {dport}")),
            (None, None) => {}
        }
        s
    }
}

/// What becomes of the packet (or of what one policy judges of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Verdict {
    /// Judged and admitted: it passes.
    Admitted,
    /// Judged and refused: dropped.
    Refused,
    /// Refused by a dry-run policy: it passes, counted as would-be refused.
    WouldRefuse,
    /// Dropped by a ban or the deny list, before any policy.
    Denied,
    /// Passed by a ban or the allow list, before any policy.
    Allowed,
    /// No policy covers it: it passes unjudged.
    Unjudged,
}

/// The answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Explanation {
    pub packet: String,
    pub verdict: Verdict,
    /// What decided it: a policy's name, or the list entry.
    pub by: Option<String>,
    /// A refusal of per-CPU buckets that holds on some CPUs only: those (the packet's CPU is
    /// the one its receive queue's interrupt runs on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_cpus: Option<Vec<usize>>,
    /// When refused or denied: how long until such a packet would pass, if the source sends
    /// nothing meanwhile (a refusal writes nothing); None for a permanent entry.
    pub retry_after_ms: Option<f64>,
    /// The daemon's reading of the program's clock (CLOCK_MONOTONIC ns) the answer is for.
    pub at_monotonic_ns: u64,
    /// Bans and list entries covering the source, longest prefix first.
    pub entries: Vec<Entry>,
    /// The policies that would judge the packet, in the order the program judges them.
    pub policies: Vec<PolicyLook>,
    /// Policies of the packet's route whose predicates do not hold for it.
    pub passed_over: Vec<String>,
    pub notes: Vec<String>,
    pub warnings: Vec<String>,
}

/// A list entry covering the source.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Entry {
    pub list: List,
    pub cidr: IpNet,
    /// None: the config file's permanent entry.
    pub origin: Option<Origin>,
    /// Time left; None: permanent.
    pub expires_in_ms: Option<u64>,
}

/// One policy's judgement of the packet.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct PolicyLook {
    pub name: String,
    pub id: u16,
    /// `host` (one allowance for every CPU) or `cpu` (one on each CPU).
    pub scope: String,
    pub dry_run: bool,
    /// What one packet of it costs: a packet, or a full-size frame's bytes.
    pub weight: u64,
    /// The key the source falls into: its prefix, and the destination port where the key has it.
    pub key: IpNet,
    pub key_dport: Option<u16>,
    /// Admitted, refused or would-refuse; on per-CPU buckets, on the CPU where it is refused
    /// (see `buckets`).
    pub verdict: Verdict,
    /// The key's buckets: one copy at host scope; one per CPU at scope cpu (a CPU whose every
    /// row is idle is left out; `idle_cpus` counts them). Empty for a rate of 0.
    pub buckets: Vec<Buckets>,
    #[serde(default)]
    pub idle_cpus: usize,
    /// Whether other sources are seen in the key's buckets in every row (collision collateral).
    pub shared: Option<String>,
}

/// One copy of a key's buckets, judged now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Buckets {
    /// The CPU whose copy this is (None: host scope, every CPU's).
    pub cpu: Option<usize>,
    pub admit: bool,
    /// When the next packet is admitted (0: now): its Retry-After.
    pub retry_after_ms: f64,
    /// When the whole burst is back.
    pub full_after_ms: f64,
    pub rows: Vec<RowLook>,
}

/// One row's bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct RowLook {
    pub row: usize,
    pub bucket: u32,
    /// How far ahead of now its TAT stands: what is spent, in time.
    pub spent_ms: f64,
    /// The policy that last wrote it (None: never written).
    pub written_by: Option<String>,
}

/// Milliseconds of `ns`, to the microsecond.
pub(crate) fn ms(ns: u64) -> f64 {
    (ns / 1_000) as f64 / 1_000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ipc::Request;

    #[test]
    fn the_question_has_a_stable_wire_form_and_refuses_what_no_packet_is() {
        let line = r#"{"op":"explain","addr":"198.18.0.7","proto":"udp","dport":53}"#;
        let query =
            Query { addr: Some("198.18.0.7".parse().unwrap()), proto: Proto::Udp, dport: Some(53), ..Query::default() };
        let request = Request::Explain { query: query.clone() };
        assert_eq!(serde_json::to_string(&request).unwrap(), line);
        assert_eq!(serde_json::from_str::<Request>(line).unwrap(), request);
        assert_eq!(query.describe(), "udp from 198.18.0.7 to port 53");
        assert!(query.check().is_ok());
        let bad = [
            Query { syn: true, ..query.clone() },
            Query { proto: Proto::Icmp, ..query.clone() },
            Query { dst: Some("2001:db8::1".parse().unwrap()), ..query.clone() },
            Query { addr: None, ..query.clone() },
        ];
        for q in bad {
            assert!(q.check().is_err(), "{q:?}");
        }
        assert!(serde_json::from_str::<Request>(r#"{"op":"explain","addr":"198.18.0.7","dport":70000}"#).is_err());
    }
}

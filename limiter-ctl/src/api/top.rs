//! `top`'s answer: the most-refused source prefixes over the daemon's window, estimated from
//! the refusals the XDP program samples (1 in N).

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// One source prefix and how often it was refused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub prefix: IpNet,
    pub policy: String,
    /// Present when the policy keys on the destination port.
    pub dport: Option<u16>,
    pub dry_run: bool,
    pub samples: u64,
    /// Refusals per second this prefix is estimated to cause: samples x N / window.
    pub refused_per_s: f64,
}

/// The most-refused prefixes, most samples first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub window_s: u64,
    pub sample_one_in: u32,
    pub entries: Vec<Entry>,
}

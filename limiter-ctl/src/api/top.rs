//! `top`'s answer: the most-refused source prefixes over the daemon's window, estimated from
//! the refusals the XDP program samples (1 in N, within a budget of samples per second).

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
    /// The samples received.
    pub samples: u64,
    /// Refusals per second this prefix is estimated to cause: the draws its samples stand for
    /// (their weights: under the budget a sample also stands for the draws skipped before it on
    /// its CPU) x N / window.
    pub refused_per_s: f64,
}

/// The most-refused prefixes, most estimated refusals first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub window_s: u64,
    pub sample_one_in: u32,
    /// The budget of samples a second for the host (0: none).
    #[serde(default)]
    pub samples_per_s: u32,
    pub entries: Vec<Entry>,
}

//! `stats`' answer: the daemon's latest snapshot of the kernel's counters, summed over CPUs,
//! with rates over the last sampling interval (the daemon's `stats` takes it; `/metrics`
//! exposes the same).

use std::{
    collections::BTreeMap,
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};

use super::ipc::PolicyCounters;
use crate::{config::FIELDS, kernel};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    pub admitted_per_s: f64,
    pub refused_per_s: f64,
    pub dry_run_per_s: f64,
    /// Refused by another layer (see `PolicyCounters::overruled_packets`).
    #[serde(default)]
    pub overruled_per_s: f64,
    pub allowed_per_s: f64,
    pub denied_per_s: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyStats {
    pub name: String,
    pub id: u16,
    /// Since the policy was created (they survive daemon restarts).
    pub totals: PolicyCounters,
    /// Over the last sampling interval.
    pub rates: Rates,
    /// How the policy judges, beside the fields above: its labels (`"mode": "enforce"`, `"scope":
    /// "cpu"`, `"unit": "packets"`; see `PolicyDef::labels`).
    #[serde(flatten, deserialize_with = "labels")]
    pub labels: BTreeMap<String, String>,
}

/// Of the fields the struct does not know, the labels: text under a label's key. Any other
/// field (from a newer daemon) is left alone, as a struct leaves it.
fn labels<'de, D: serde::Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    let keys: Vec<&str> = FIELDS.iter().filter(|f| !f.words.is_empty()).map(|f| f.key).collect();
    let all = BTreeMap::<String, serde_json::Value>::deserialize(d)?;
    Ok(all
        .into_iter()
        .filter(|(key, _)| keys.contains(&key.as_str()))
        .filter_map(|(key, value)| Some((key, value.as_str()?.to_string())))
        .collect())
}

/// Traffic no policy judged, and the limiter's own faults.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unjudged {
    pub not_ip: u64,
    pub malformed: u64,
    pub unmatched: u64,
    pub errors: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Wall-clock time of the snapshot, ms since the Unix epoch.
    pub taken_at_ms: u64,
    /// The interval the rates were measured over, in seconds.
    pub interval_s: f64,
    pub policies: Vec<PolicyStats>,
    pub unjudged: Unjudged,
    /// TCP/UDP whose destination port could not be read (tiny first fragments, over-long IPv6
    /// extension chains), dropped while port policies exist.
    #[serde(default)]
    pub unreadable_ports: u64,
    /// Every packet the deny list dropped, whether a policy matched it or not (each policy's
    /// `denied_packets` are its share; `no_policy` has the rest). Removing a policy takes its
    /// share out.
    #[serde(default)]
    pub denied: u64,
    /// Every packet the allow list passed, whether a policy matched it or not.
    #[serde(default)]
    pub allowed: u64,
    /// Allow and deny list hits of traffic no policy matched (counted in the kernel's slot 0).
    #[serde(default)]
    pub no_policy: ListHits,
    /// Where the program runs: "native" or "skb" (XDP), or at tc ingress, "tcx" (a tcx link) or
    /// "netlink" (a filter on the clsact qdisc).
    pub attach_mode: String,
    /// Why it runs at tc ingress, when it does: "another program holds XDP (XDP program id 12
    /// named 'xdpfilt_alw_all', native mode)", "asked for (--attach tc)", ...; None at XDP.
    #[serde(default)]
    pub attach_reason: Option<String>,
    /// The same in a word (`xdp_held`, `xdp_refused`, `asked`, `moved`, `kept`), as /metrics
    /// labels it.
    #[serde(default)]
    pub attach_reason_code: Option<String>,
    /// Why it runs there through netlink rather than tcx, when it does: "tcx needs Linux 6.6;
    /// this kernel is 6.1.0-50-amd64", "asked for (--tc-api netlink)", ...; None otherwise.
    #[serde(default)]
    pub attach_api_reason: Option<String>,
    /// The same in a word (`no_tcx`, `asked`, `kept`), as /metrics labels it.
    #[serde(default)]
    pub attach_api_reason_code: Option<String>,
    pub salt_age_s: f64,
    /// Fraction of buckets (over CPUs) whose TAT is ahead of now: the chance that a newcomer
    /// shares an allowance with a busy source. None until first measured.
    pub bucket_occupancy: Option<f64>,
    /// Config reloads since start (SIGHUP, `limiter-ctl reload`).
    #[serde(default)]
    pub reloads: Reloads,
    /// `--rotate-every` in seconds (None: rotated only on request).
    #[serde(default)]
    pub rotate_every_s: Option<f64>,
    /// The bucket arrays the limiter runs with (`auto` resolved), and their memory.
    #[serde(default)]
    pub geometry: Option<Arrays>,
    /// The expiring entries (bans): in force, added and expired, and what they decided.
    #[serde(default)]
    pub bans: Option<BanStats>,
    /// A number the daemon draws at random when it starts: a client that sees it change knows
    /// the daemon restarted (and may have lost what it had not saved: the CrowdSec bouncer then
    /// sends its bans again). 0: not known yet.
    #[serde(default)]
    pub instance: u64,
}

/// Bans (expiring allow and deny entries), by family and origin: never by address.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BanStats {
    /// In force, by origin ("cli", "fail2ban", "crowdsec"), per family.
    pub active_v4: BTreeMap<String, u64>,
    pub active_v6: BTreeMap<String, u64>,
    /// Since the daemon started, by origin (a ban renewed before it expired counts again).
    pub added: BTreeMap<String, u64>,
    pub expired: BTreeMap<String, u64>,
    /// Entries the daemon's rules refused (broader than the floor, a deny over the allow list),
    /// since start, by origin.
    #[serde(default)]
    pub refused: BTreeMap<String, u64>,
    /// Packets a ban dropped (deny) or passed (allow), since the maps were created (also in
    /// `denied` and `allowed`).
    pub dropped_packets: u64,
    pub allowed_packets: u64,
}

/// The two bucket arrays: per CPU (policies of scope cpu) and shared (scope host), each with its
/// count-min rows and the memory it takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arrays {
    /// Per-CPU buckets per generation, on each of `cpus` possible CPUs.
    pub buckets: u32,
    pub rows: u32,
    pub cpus: u32,
    /// buckets x 16 B x cpus.
    pub buckets_bytes: u64,
    /// Host-scope buckets per generation, shared by every CPU.
    pub host_buckets: u32,
    pub host_rows: u32,
    /// host_buckets x 16 B.
    pub host_buckets_bytes: u64,
}

impl Arrays {
    pub fn of(geometry: &kernel::Geometry, cpus: u32) -> Self {
        Self {
            buckets: geometry.buckets,
            rows: geometry.rows,
            cpus,
            buckets_bytes: geometry.cpu_bytes(cpus),
            host_buckets: geometry.host_buckets,
            host_rows: geometry.host_rows,
            host_buckets_bytes: geometry.host_bytes(),
        }
    }

    /// The geometry the limiter is loaded with.
    pub fn geometry(&self) -> kernel::Geometry {
        let Self { buckets, rows, host_buckets, host_rows, .. } = *self;
        kernel::Geometry { buckets, rows, host_buckets, host_rows }
    }

    /// In one line: `per-CPU buckets 65536 in 4 rows (2 MiB over 2 CPUs), host buckets 4194304 in
    /// 1 row (64 MiB)`.
    pub fn text(&self) -> String {
        let rows = |n: u32| if n == 1 { "1 row".to_string() } else { format!("{n} rows") };
        format!(
            "per-CPU buckets {} in {} ({} over {} CPUs), host buckets {} in {} ({})",
            self.buckets,
            rows(self.rows),
            kernel::bytes_text(self.buckets_bytes),
            self.cpus,
            self.host_buckets,
            rows(self.host_rows),
            kernel::bytes_text(self.host_buckets_bytes)
        )
    }
}

/// Config reloads since the daemon started, applied and refused.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reloads {
    pub applied: u64,
    pub refused: u64,
    /// Whether the last reload was applied (true before any: the config loaded at start).
    pub last_successful: bool,
    /// When the running config was last loaded (at start or by a reload), ms since the epoch.
    pub last_success_ms: u64,
}

impl Default for Reloads {
    fn default() -> Self {
        Self { applied: 0, refused: 0, last_successful: true, last_success_ms: now_ms() }
    }
}

impl Reloads {
    pub fn record(&mut self, applied: bool) {
        if applied {
            self.applied += 1;
            self.last_success_ms = now_ms();
        } else {
            self.refused += 1;
        }
        self.last_successful = applied;
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Packets a list decided, with no policy behind them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListHits {
    pub allowed_packets: u64,
    pub denied_packets: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The labels sit beside the other fields on the wire, as `mode`, `scope` and `unit` did;
    /// a field a newer daemon adds is left alone, whatever its type.
    #[test]
    fn labels_are_flat_on_the_wire() {
        let labels: BTreeMap<String, String> =
            [("mode", "dry-run"), ("scope", "host"), ("unit", "bytes")].map(|(k, v)| (k.into(), v.into())).into();
        let stats = PolicyStats { name: "dns".into(), id: 3, labels, ..PolicyStats::default() };
        let mut json = serde_json::to_value(&stats).unwrap();
        assert_eq!(
            (json["mode"].as_str(), json["scope"].as_str(), json["unit"].as_str()),
            (Some("dry-run"), Some("host"), Some("bytes"))
        );
        assert_eq!(serde_json::from_value::<PolicyStats>(json.clone()).unwrap(), stats);
        json["newer"] = serde_json::json!(7);
        assert_eq!(serde_json::from_value::<PolicyStats>(json).unwrap(), stats);
    }
}

//! What the daemon reports: a snapshot of the kernel's counters, summed over CPUs, with rates
//! over the last sampling interval. Taken once a second by the daemon's loop; `limiter-ctl
//! stats` and the Prometheus endpoint read the latest snapshot, never the maps, so they answer
//! fast whatever the load.

use std::{
    collections::BTreeMap,
    sync::{Arc, RwLock},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use aya::maps::{MapData, PerCpuArray};
use limiter_common::{gcra, maps::Counters};
use serde::{Deserialize, Serialize};

use super::ipc::PolicyCounters;
use crate::config::{FIELDS, State};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    pub admitted_per_s: f64,
    pub refused_per_s: f64,
    pub dry_run_per_s: f64,
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
    pub attach_mode: String,
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

pub type Shared = Arc<RwLock<Snapshot>>;

/// Turns successive counter readings into snapshots.
#[derive(Default)]
pub struct Sampler {
    last: Option<(Instant, Vec<Counters>)>,
}

impl Sampler {
    pub fn sample(
        &mut self,
        state: &State,
        counters: Vec<Counters>,
        attach_mode: &str,
        salt_age: Duration,
        occupancy: Option<f64>,
    ) -> Snapshot {
        let now = Instant::now();
        let (interval, prev) = match &self.last {
            Some((t, prev)) => (now.duration_since(*t).as_secs_f64().max(1e-3), Some(prev)),
            None => (1.0, None),
        };
        let rate = |id: usize, f: fn(&Counters) -> u64| {
            let before = prev.and_then(|p| p.get(id)).map_or(0, f);
            counters.get(id).map_or(0, f).saturating_sub(before) as f64 / interval
        };
        let policies = state
            .policies()
            .map(|e| {
                let id = usize::from(e.id);
                PolicyStats {
                    name: e.def.name.to_string(),
                    id: e.id,
                    totals: counters.get(id).map(Into::into).unwrap_or_default(),
                    rates: Rates {
                        admitted_per_s: rate(id, |c| c.admitted_packets),
                        refused_per_s: rate(id, |c| c.refused_packets),
                        dry_run_per_s: rate(id, |c| c.dry_run_packets),
                        allowed_per_s: rate(id, |c| c.allowed_packets),
                        denied_per_s: rate(id, |c| c.denied_packets),
                    },
                    labels: e.def.labels().into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                }
            })
            .collect();
        let global = counters.first().copied().unwrap_or_default();
        let unjudged = Unjudged {
            not_ip: global.not_ip,
            malformed: global.malformed,
            unmatched: global.unmatched,
            errors: counters.iter().map(|c| c.errors).sum(),
        };
        // Over every slot (a removed policy's counters are zeroed with it: a drop is a reset).
        let denied = counters.iter().map(|c| c.denied_packets).sum();
        let allowed = counters.iter().map(|c| c.allowed_packets).sum();
        self.last = Some((now, counters));
        Snapshot {
            taken_at_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            interval_s: interval,
            policies,
            unjudged,
            unreadable_ports: global.unreadable_ports,
            denied,
            allowed,
            no_policy: ListHits { allowed_packets: global.allowed_packets, denied_packets: global.denied_packets },
            attach_mode: attach_mode.to_string(),
            salt_age_s: salt_age.as_secs_f64(),
            bucket_occupancy: occupancy,
            reloads: Reloads::default(),
            rotate_every_s: None,
        }
    }
}

/// Scans the current generation's buckets (on its own thread: it reads every bucket of every
/// CPU) and returns the fraction whose TAT is ahead of `now`: every bucket that can refuse a
/// packet (all policies share one clock, whoever wrote the bucket).
pub fn occupancy(buckets: &PerCpuArray<MapData, u64>, generation: u32, count: u32, now_ns: u64) -> Option<f64> {
    let (mut ahead, mut total) = (0u64, 0u64);
    for index in generation * count..(generation + 1) * count {
        let values = buckets.get(&index, 0).ok()?;
        for &value in values.iter() {
            total += 1;
            ahead += u64::from(gcra::ahead_ns(value, now_ns) > 0);
        }
    }
    (total > 0).then(|| ahead as f64 / total as f64)
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

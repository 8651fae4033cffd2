//! Taking what the daemon reports: a snapshot of the kernel's counters, summed over CPUs, with
//! rates over the last sampling interval (`api::stats`). Taken once a second by the daemon's
//! loop; `limiter-ctl stats` and the Prometheus endpoint read the latest snapshot, never the
//! maps, so they answer fast whatever the load.

use std::{
    sync::{Arc, RwLock},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use limiter_common::maps::Counters;

use crate::{
    api::stats::{ListHits, PolicyStats, Rates, Reloads, Snapshot, Unjudged},
    config::State,
};

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
                        overruled_per_s: rate(id, |c| c.overruled_packets),
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
            attach_reason: None,
            attach_reason_code: None,
            attach_api_reason: None,
            attach_api_reason_code: None,
            salt_age_s: salt_age.as_secs_f64(),
            bucket_occupancy: occupancy,
            reloads: Reloads::default(),
            rotate_every_s: None,
            geometry: None,
            bans: None,
            instance: 0,
        }
    }
}

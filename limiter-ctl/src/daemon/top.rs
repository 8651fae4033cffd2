//! `limiter-ctl top`: the most-refused source prefixes right now, from the sample of refusals
//! the XDP program sends (1 in N, at most `--samples-per-s` a second, through a ring buffer).
//! Samples carry the key's prefix only (what the policy keys on), and this view is only
//! reachable over the root-only socket.
//!
//! Prefixes are ranked by the refusals their samples stand for (each sample's weight: the draws
//! the budget skipped on its CPU before it, and itself), not by the samples alone: under the
//! budget every busy CPU sends about as many samples, whatever its share of the flood.

use std::{
    collections::{HashMap, VecDeque},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use ipnet::IpNet;
use limiter_common::{key::FAMILY_V4, maps::RefusalSample};

use crate::{
    api::top::{Entry, Report},
    config::State,
};

pub const WINDOW: Duration = Duration::from_secs(10);
const SLOT: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    policy: u16,
    net: IpNet,
    dport: u16,
    dry_run: bool,
}

/// A prefix's samples in a slot, and the draws they stand for (their weights).
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    samples: u64,
    weight: u64,
}

pub struct Top {
    one_in: u32,
    per_s: u32,
    slots: VecDeque<(Instant, HashMap<Key, Tally>)>,
}

impl Top {
    /// `one_in`: the kernel's 1-in-N draw; `per_s`: its budget of samples a second (0: none).
    pub fn new(one_in: u32, per_s: u32) -> Self {
        Self { one_in, per_s, slots: VecDeque::new() }
    }

    pub fn record(&mut self, sample: &RefusalSample) {
        let Some(net) = prefix(sample) else { return };
        let key = Key { policy: sample.policy, net, dport: sample.dport, dry_run: sample.dry_run != 0 };
        let now = Instant::now();
        if self.slots.back().is_none_or(|(start, _)| now.duration_since(*start) >= SLOT) {
            self.slots.push_back((now, HashMap::new()));
        }
        self.expire(now);
        if let Some((_, counts)) = self.slots.back_mut() {
            let tally = counts.entry(key).or_default();
            tally.samples += 1;
            // A sample from before weights existed stands for itself.
            tally.weight += u64::from(sample.weight.max(1));
        }
    }

    fn expire(&mut self, now: Instant) {
        while self.slots.front().is_some_and(|(start, _)| now.duration_since(*start) > WINDOW) {
            self.slots.pop_front();
        }
    }

    /// The keys refused within the window, as sampled: (policy id, prefix, destination port).
    pub fn keys(&mut self) -> Vec<(u16, IpNet, u16)> {
        self.expire(Instant::now());
        let mut keys: Vec<(u16, IpNet, u16)> =
            self.slots.iter().flat_map(|(_, counts)| counts.keys().map(|k| (k.policy, k.net, k.dport))).collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    pub fn report(&mut self, state: &State, limit: usize) -> Report {
        self.expire(Instant::now());
        let mut totals: HashMap<Key, Tally> = HashMap::new();
        for (_, counts) in &self.slots {
            for (k, n) in counts {
                let t = totals.entry(*k).or_default();
                t.samples += n.samples;
                t.weight += n.weight;
            }
        }
        let names: HashMap<u16, (String, bool)> =
            state.policies().map(|e| (e.id, (e.def.name.to_string(), e.def.key.dport))).collect();
        let mut ranked: Vec<(Key, Tally)> = totals.into_iter().collect();
        ranked.sort_by(|(ka, a), (kb, b)| {
            b.weight.cmp(&a.weight).then(b.samples.cmp(&a.samples)).then_with(|| ka.net.cmp(&kb.net))
        });
        ranked.truncate(limit);
        let entries = ranked
            .into_iter()
            .map(|(k, t)| {
                let (policy, keyed_on_port) =
                    names.get(&k.policy).cloned().unwrap_or_else(|| (format!("#{}", k.policy), false));
                Entry {
                    prefix: k.net,
                    policy,
                    dport: keyed_on_port.then_some(k.dport),
                    dry_run: k.dry_run,
                    samples: t.samples,
                    refused_per_s: t.weight as f64 * f64::from(self.one_in) / WINDOW.as_secs_f64(),
                }
            })
            .collect();
        Report { window_s: WINDOW.as_secs(), sample_one_in: self.one_in, samples_per_s: self.per_s, entries }
    }
}

fn prefix(s: &RefusalSample) -> Option<IpNet> {
    let addr = if s.family == FAMILY_V4 {
        IpAddr::V4(Ipv4Addr::new(s.addr[0], s.addr[1], s.addr[2], s.addr[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(s.addr))
    };
    IpNet::new(addr, s.prefix_len).ok().map(|n| n.trunc())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(a: [u8; 4], policy: u16) -> RefusalSample {
        weighed(a, policy, 1)
    }

    fn weighed(a: [u8; 4], policy: u16, weight: u32) -> RefusalSample {
        let mut addr = [0; 16];
        addr[..4].copy_from_slice(&a);
        RefusalSample { addr, policy, family: FAMILY_V4, prefix_len: 24, weight, ..Default::default() }
    }

    #[test]
    fn ranks_prefixes_by_samples() {
        let mut top = Top::new(256, 0);
        for _ in 0..5 {
            top.record(&sample([198, 18, 5, 0], 1));
        }
        top.record(&sample([198, 18, 9, 0], 1));
        let r = top.report(&State::default(), 10);
        assert_eq!(r.entries.len(), 2);
        assert_eq!(r.entries[0].prefix, "198.18.5.0/24".parse::<IpNet>().unwrap());
        assert_eq!(r.entries[0].samples, 5);
        assert_eq!(r.entries[0].refused_per_s, 5.0 * 256.0 / 10.0);
        assert_eq!(top.report(&State::default(), 1).entries.len(), 1);
    }

    /// Under the budget, a CPU the flood keeps busy sends no more samples than a quieter one:
    /// the weights, not the sample counts, rank and estimate.
    #[test]
    fn ranks_and_estimates_by_weight() {
        let mut top = Top::new(256, 256);
        // 10 samples standing for 50 draws each (a busy CPU), 20 standing for 1 (a quiet one).
        for _ in 0..10 {
            top.record(&weighed([198, 18, 5, 0], 1, 50));
        }
        for _ in 0..20 {
            top.record(&weighed([198, 18, 9, 0], 1, 1));
        }
        // A weight of 0 (none sent it: an older program) counts as 1.
        top.record(&weighed([198, 18, 7, 0], 1, 0));
        let r = top.report(&State::default(), 10);
        assert_eq!(r.samples_per_s, 256);
        let got: Vec<(String, u64, f64)> =
            r.entries.iter().map(|e| (e.prefix.to_string(), e.samples, e.refused_per_s)).collect();
        assert_eq!(
            got,
            [
                ("198.18.5.0/24".to_string(), 10, 500.0 * 256.0 / 10.0),
                ("198.18.9.0/24".to_string(), 20, 20.0 * 256.0 / 10.0),
                ("198.18.7.0/24".to_string(), 1, 256.0 / 10.0),
            ]
        );
    }
}

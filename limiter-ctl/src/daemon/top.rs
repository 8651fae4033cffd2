//! `limiter-ctl top`: the most-refused source prefixes right now, from the sample of refusals
//! the XDP program sends (1 in N, through a ring buffer). Samples carry the key's prefix only
//! (what the policy keys on), and this view is only reachable over the root-only socket.

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

pub struct Top {
    one_in: u32,
    slots: VecDeque<(Instant, HashMap<Key, u64>)>,
}

impl Top {
    pub fn new(one_in: u32) -> Self {
        Self { one_in, slots: VecDeque::new() }
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
            *counts.entry(key).or_insert(0) += 1;
        }
    }

    fn expire(&mut self, now: Instant) {
        while self.slots.front().is_some_and(|(start, _)| now.duration_since(*start) > WINDOW) {
            self.slots.pop_front();
        }
    }

    pub fn report(&mut self, state: &State, limit: usize) -> Report {
        self.expire(Instant::now());
        let mut totals: HashMap<Key, u64> = HashMap::new();
        for (_, counts) in &self.slots {
            for (k, n) in counts {
                *totals.entry(*k).or_insert(0) += n;
            }
        }
        let names: HashMap<u16, (String, bool)> =
            state.policies().map(|e| (e.id, (e.def.name.to_string(), e.def.key.dport))).collect();
        let mut entries: Vec<Entry> = totals
            .into_iter()
            .map(|(k, samples)| {
                let (policy, keyed_on_port) =
                    names.get(&k.policy).cloned().unwrap_or_else(|| (format!("#{}", k.policy), false));
                Entry {
                    prefix: k.net,
                    policy,
                    dport: keyed_on_port.then_some(k.dport),
                    dry_run: k.dry_run,
                    samples,
                    refused_per_s: samples as f64 * f64::from(self.one_in) / WINDOW.as_secs_f64(),
                }
            })
            .collect();
        entries.sort_by(|a, b| b.samples.cmp(&a.samples).then_with(|| a.prefix.cmp(&b.prefix)));
        entries.truncate(limit);
        Report { window_s: WINDOW.as_secs(), sample_one_in: self.one_in, entries }
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
        let mut addr = [0; 16];
        addr[..4].copy_from_slice(&a);
        RefusalSample { addr, policy, family: FAMILY_V4, prefix_len: 24, ..Default::default() }
    }

    #[test]
    fn ranks_prefixes_by_samples() {
        let mut top = Top::new(256);
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
}

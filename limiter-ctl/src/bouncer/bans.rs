//! The set the bouncer keeps: the bans in force, by network, and what the daemon must still be
//! told of them.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use ipnet::IpNet;

use super::decisions::Batch;
use crate::api::ipc;

/// The longest ban taken from a decision: CrowdSec allows Go's longest duration (292 years);
/// the daemon takes no more than this (ten years): a longer one is cut to it.
pub(crate) const MAX_BAN: Duration = Duration::from_millis(ipc::MAX_FOR_MS);

/// The bans the LAPI's decisions make, by network: each decision's id and when it ends. A
/// network is banned until its last decision ends.
#[derive(Debug, Default)]
pub(crate) struct Bans {
    by_net: BTreeMap<IpNet, BTreeMap<i64, Instant>>,
    /// Networks whose entry the daemon must (re)take, with the last end of their decisions.
    pending_add: BTreeSet<IpNet>,
    /// Networks whose entry the daemon must remove.
    pending_rm: BTreeSet<IpNet>,
}

impl Bans {
    /// Takes in a poll's `batch`, read at `now`. `full` (an answer to `startup=true`): it is
    /// the whole set, so a ban missing from it is lifted, and every ban in it is sent again (the
    /// daemon takes a ban it has as a renewal: idempotent).
    pub fn apply(&mut self, batch: &Batch, now: Instant, full: bool) {
        let before: BTreeMap<IpNet, Option<Instant>> = if full {
            let old = std::mem::take(&mut self.by_net);
            old.into_iter().map(|(net, ids)| (net, ids.values().max().copied())).collect()
        } else {
            let touched = batch.deleted.iter().chain(&batch.new).map(|d| d.net);
            touched.map(|net| (net, self.end(&net))).collect()
        };
        for d in &batch.deleted {
            if let Some(ids) = self.by_net.get_mut(&d.net) {
                ids.remove(&d.id);
                if ids.is_empty() {
                    self.by_net.remove(&d.net);
                }
            }
        }
        for d in &batch.new {
            // Ten years on from a monotonic clock's now always fits an Instant; were it not to,
            // the decision is skipped rather than the bouncer stopped.
            let Some(end) = now.checked_add(d.left.magnitude.min(MAX_BAN)) else { continue };
            self.by_net.entry(d.net).or_default().insert(d.id, end);
        }
        let mut touched: BTreeSet<IpNet> = before.keys().copied().collect();
        touched.extend(batch.new.iter().map(|d| d.net));
        for net in touched {
            let was = before.get(&net).copied().flatten();
            match self.end(&net) {
                None => {
                    self.pending_add.remove(&net);
                    if was.is_some() {
                        self.pending_rm.insert(net);
                    }
                }
                Some(end) if full || was != Some(end) => {
                    self.pending_rm.remove(&net);
                    self.pending_add.insert(net);
                }
                Some(_) => {}
            }
        }
    }

    /// When the ban on `net` ends (its last decision's end), if it is banned.
    fn end(&self, net: &IpNet) -> Option<Instant> {
        self.by_net.get(net).and_then(|ids| ids.values().max().copied())
    }

    /// Forgets decisions ended by `now` (the daemon expires their entries itself).
    pub fn expire(&mut self, now: Instant) {
        self.by_net.retain(|_, ids| {
            ids.retain(|_, end| *end > now);
            !ids.is_empty()
        });
        let by_net = &self.by_net;
        self.pending_add.retain(|net| by_net.contains_key(net));
    }

    /// What the daemon must still be told, as of `now`: the entries to add with their time
    /// left (rounded up to the millisecond, so a ban never ends early), and those to remove.
    pub fn pending(&self, now: Instant) -> (Vec<(IpNet, Duration)>, Vec<IpNet>) {
        let adds = self
            .pending_add
            .iter()
            .filter_map(|net| {
                let left = self.end(net)?.checked_duration_since(now).filter(|d| !d.is_zero())?;
                Some((*net, round_up_ms(left)))
            })
            .collect();
        (adds, self.pending_rm.iter().copied().collect())
    }

    /// Lifts what the daemon holds of ours (`listed`, origin crowdsec) that the bans do not
    /// have: a decision deleted while no bouncer ran. Called after the first full set.
    pub fn reconcile(&mut self, listed: &[IpNet]) {
        for net in listed {
            if !self.by_net.contains_key(net) {
                self.pending_rm.insert(*net);
            }
        }
    }

    /// The daemon took the removals.
    pub fn removed(&mut self) {
        self.pending_rm.clear();
    }

    /// The daemon took the additions.
    pub fn added(&mut self) {
        self.pending_add.clear();
    }

    /// How many networks are banned.
    pub fn len(&self) -> usize {
        self.by_net.len()
    }
}

fn round_up_ms(d: Duration) -> Duration {
    let ms = d.as_nanos().div_ceil(1_000_000);
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bouncer::{
        decisions::{Decision, Skipped},
        duration::{SignedDuration, go_duration},
    };

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn ban(id: i64, n: &str, secs: u64) -> Decision {
        Decision { id, net: net(n), left: SignedDuration { negative: false, magnitude: Duration::from_secs(secs) } }
    }

    fn batch(new: Vec<Decision>, deleted: Vec<Decision>) -> Batch {
        Batch { new, deleted, skipped: Skipped::default() }
    }

    fn pending(bans: &Bans, now: Instant) -> (Vec<(String, u64)>, Vec<String>) {
        let (adds, rms) = bans.pending(now);
        (
            adds.into_iter().map(|(n, d)| (n.to_string(), d.as_secs())).collect(),
            rms.into_iter().map(|n| n.to_string()).collect(),
        )
    }

    #[test]
    fn bans_follow_their_last_decision_and_are_sent_once() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(&batch(vec![ban(1, "198.18.0.7/32", 60), ban(2, "198.18.0.7/32", 600)], vec![]), t0, true);
        assert_eq!(pending(&bans, t0), (vec![("198.18.0.7/32".into(), 600)], vec![]));
        bans.added();
        assert_eq!(pending(&bans, t0), (vec![], vec![]));
        // The longer decision deleted: the ban now ends with the shorter one, and is sent again.
        bans.apply(&batch(vec![], vec![ban(2, "198.18.0.7/32", 0)]), t0, false);
        assert_eq!(pending(&bans, t0), (vec![("198.18.0.7/32".into(), 60)], vec![]));
        bans.added();
        // The last one deleted: removed.
        bans.apply(&batch(vec![], vec![ban(1, "198.18.0.7/32", 0)]), t0, false);
        assert_eq!(pending(&bans, t0), (vec![], vec!["198.18.0.7/32".into()]));
        bans.removed();
        // Deleting what is not banned sends nothing.
        bans.apply(&batch(vec![], vec![ban(9, "198.18.0.9/32", 0)]), t0, false);
        assert_eq!(pending(&bans, t0), (vec![], vec![]));
        assert_eq!(bans.len(), 0);
    }

    #[test]
    fn a_full_set_lifts_what_it_lacks_and_renews_the_rest() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(&batch(vec![ban(1, "198.18.0.1/32", 60), ban(2, "198.18.0.2/32", 60)], vec![]), t0, true);
        bans.added();
        // After an outage: the full set no longer has .1 (deleted meanwhile) and still has .2.
        let t1 = t0 + Duration::from_secs(10);
        bans.apply(&batch(vec![ban(2, "198.18.0.2/32", 50)], vec![]), t1, true);
        assert_eq!(pending(&bans, t1), (vec![("198.18.0.2/32".into(), 50)], vec!["198.18.0.1/32".into()]));
    }

    #[test]
    fn a_first_full_set_lifts_what_the_daemon_holds_of_a_previous_run() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(&batch(vec![ban(1, "198.18.0.1/32", 60)], vec![]), t0, true);
        bans.reconcile(&[net("198.18.0.1/32"), net("198.18.0.2/32")]);
        assert_eq!(pending(&bans, t0), (vec![("198.18.0.1/32".into(), 60)], vec!["198.18.0.2/32".into()]));
    }

    #[test]
    fn pending_adds_wait_for_the_daemon_and_lapse_with_their_time() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(&batch(vec![ban(1, "198.18.0.1/32", 5), ban(2, "198.18.0.2/32", 60)], vec![]), t0, true);
        // The daemon was down for 10 s: what is sent then has 50 s left, and the 5 s ban none.
        let t1 = t0 + Duration::from_secs(10);
        bans.expire(t1);
        assert_eq!(pending(&bans, t1), (vec![("198.18.0.2/32".into(), 50)], vec![]));
        assert_eq!(bans.len(), 1);
    }

    #[test]
    fn a_huge_duration_is_cut_to_the_longest_ban() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        let huge = go_duration("2562047h47m16.854775807s").unwrap();
        bans.apply(&batch(vec![Decision { id: 1, net: net("198.18.0.1/32"), left: huge }], vec![]), t0, true);
        let (adds, _) = bans.pending(t0);
        assert_eq!(adds, [(net("198.18.0.1/32"), MAX_BAN)]);
    }
}

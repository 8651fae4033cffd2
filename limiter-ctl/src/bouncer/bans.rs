//! The set the bouncer keeps: the bans in force, by network, and what the daemon must still be
//! told of them.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use ipnet::IpNet;

use super::{
    decisions::{Batch, Decision},
    stream::MAX_DECISIONS,
};
use crate::api::ipc;

/// The longest ban taken from a decision: CrowdSec allows Go's longest duration (292 years);
/// the daemon takes no more than this (ten years): a longer one is cut to it.
pub(crate) const MAX_BAN: Duration = Duration::from_millis(ipc::MAX_FOR_MS);

/// The most decisions held (bans of the LAPI's, each with its own id and end): as many as one
/// answer may hold, what the daemon can hold. Changes that would hold more are dropped.
pub(crate) const MAX_HELD: usize = MAX_DECISIONS;

/// How far the daemon's time left on a ban may be from the bouncer's before a reconcile sends
/// it again: the daemon's list and the bouncer's clock are read a request apart.
const RECONCILE_SLACK: Duration = Duration::from_secs(2);

/// The bans the LAPI's decisions make: each decision by network and id, with when it ends. A
/// network is banned until its last decision ends. One flat map, ordered by network: a
/// network's decisions are a range of it (a map per network would cost a node each).
#[derive(Debug)]
pub(crate) struct Bans {
    decisions: BTreeMap<(IpNet, i64), Instant>,
    /// [`MAX_HELD`] (less in tests).
    max_held: usize,
    /// Networks whose entry the daemon must (re)take, with the last end of their decisions.
    pending_add: BTreeSet<IpNet>,
    /// Networks whose entry the daemon must remove.
    pending_rm: BTreeSet<IpNet>,
}

impl Default for Bans {
    fn default() -> Self {
        Self {
            decisions: BTreeMap::new(),
            max_held: MAX_HELD,
            pending_add: BTreeSet::new(),
            pending_rm: BTreeSet::new(),
        }
    }
}

/// The ends of the decisions on `net`.
fn ends<'a>(decisions: &'a BTreeMap<(IpNet, i64), Instant>, net: &IpNet) -> impl Iterator<Item = Instant> + 'a {
    decisions.range((*net, i64::MIN)..=(*net, i64::MAX)).map(|(_, end)| *end)
}

/// When a decision read at `now` ends. Ten years on from a monotonic clock's now always fits an
/// Instant; were it not to, the decision is skipped rather than the bouncer stopped.
fn end_of(d: &Decision, now: Instant) -> Option<Instant> {
    now.checked_add(d.left.min(MAX_BAN))
}

impl Bans {
    /// Takes in a poll's `batch`, read at `now`. `full` (an answer to `startup=true`): it is
    /// the whole set, so a ban missing from it is lifted, and every ban in it is sent again (the
    /// daemon takes a ban it has as a renewal: idempotent). Returns how many new decisions were
    /// dropped, the bans holding [`MAX_HELD`] already.
    pub fn apply(&mut self, mut batch: Batch, now: Instant, full: bool) -> usize {
        if full {
            // A full set holds at most MAX_DECISIONS (`stream`): it replaces the bans whole,
            // the old ones gone before the new are built (the peak is one set and the batch).
            batch.new.sort_unstable_by_key(|d| d.net);
            for net in nets(std::mem::take(&mut self.decisions).keys()) {
                if batch.new.binary_search_by_key(&net, |d| d.net).is_err() {
                    self.pending_rm.insert(net);
                }
            }
            // Collected in the batch's own buffer (a decision and an entry are the same size).
            self.decisions = batch.new.into_iter().filter_map(|d| Some(((d.net, d.id), end_of(&d, now)?))).collect();
            self.pending_add = nets(self.decisions.keys()).collect();
            self.pending_rm.retain(|net| !self.pending_add.contains(net));
            return 0;
        }
        // A change, network by network (both lists in its order): what each network's ban
        // was before and is after says what the daemon must be told.
        batch.deleted.sort_unstable_by_key(|d| d.net);
        batch.new.sort_unstable_by_key(|d| d.net);
        let (mut deleted, mut new) = (batch.deleted.iter().peekable(), batch.new.iter().peekable());
        let mut dropped = 0;
        loop {
            let net = match (deleted.peek(), new.peek()) {
                (Some(d), Some(n)) => d.net.min(n.net),
                (Some(d), None) => d.net,
                (None, Some(n)) => n.net,
                (None, None) => break,
            };
            let was = self.end(&net);
            while let Some(d) = deleted.next_if(|d| d.net == net) {
                self.decisions.remove(&(d.net, d.id));
            }
            while let Some(d) = new.next_if(|d| d.net == net) {
                let key = (d.net, d.id);
                if self.decisions.len() >= self.max_held && !self.decisions.contains_key(&key) {
                    dropped += 1;
                } else if let Some(end) = end_of(d, now) {
                    self.decisions.insert(key, end);
                }
            }
            match self.end(&net) {
                None => {
                    self.pending_add.remove(&net);
                    if was.is_some() {
                        self.pending_rm.insert(net);
                    }
                }
                Some(end) if was != Some(end) => {
                    self.pending_rm.remove(&net);
                    self.pending_add.insert(net);
                }
                Some(_) => {}
            }
        }
        dropped
    }

    fn holds(&self, net: &IpNet) -> bool {
        ends(&self.decisions, net).next().is_some()
    }

    /// When the ban on `net` ends (its last decision's end), if it is banned.
    fn end(&self, net: &IpNet) -> Option<Instant> {
        ends(&self.decisions, net).max()
    }

    /// Forgets decisions ended by `now` (the daemon expires their entries itself).
    pub fn expire(&mut self, now: Instant) {
        self.decisions.retain(|_, end| *end > now);
        let decisions = &self.decisions;
        self.pending_add.retain(|net| ends(decisions, net).next().is_some());
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

    /// Compares what the daemon holds of ours (`listed`: origin crowdsec, with the time each
    /// has left, read at `now`) with the bans: what it lacks, or holds for another time, is
    /// sent again; what the bans do not have (a decision deleted while no bouncer ran) is
    /// lifted. Returns how many of each.
    pub fn reconcile(&mut self, listed: &mut [(IpNet, Duration)], now: Instant) -> (usize, usize) {
        listed.sort_unstable_by_key(|(net, _)| *net);
        let mut lifted = 0;
        for (net, _) in listed.iter() {
            if !self.holds(net) && self.pending_rm.insert(*net) {
                lifted += 1;
            }
        }
        let mut resent = 0;
        for net in nets(self.decisions.keys()) {
            let ours = self.end(&net).map(|end| end.saturating_duration_since(now)).unwrap_or_default();
            let theirs = listed.binary_search_by_key(&net, |(n, _)| *n).ok().map(|i| listed[i].1);
            let off = |t: Duration| t.abs_diff(ours) > RECONCILE_SLACK;
            if theirs.is_none_or(off) && self.pending_add.insert(net) {
                resent += 1;
            }
        }
        (resent, lifted)
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
        nets(self.decisions.keys()).count()
    }
}

/// The networks of decisions ordered by network, each once.
fn nets<'a>(keys: impl Iterator<Item = &'a (IpNet, i64)>) -> impl Iterator<Item = IpNet> {
    let mut last = None;
    keys.filter_map(move |(net, _)| (last.replace(*net) != Some(*net)).then_some(*net))
}

fn round_up_ms(d: Duration) -> Duration {
    let ms = d.as_nanos().div_ceil(1_000_000);
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bouncer::duration::go_duration;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn ban(id: i64, n: &str, secs: u64) -> Decision {
        Decision { id, net: net(n), left: Duration::from_secs(secs) }
    }

    fn batch(new: Vec<Decision>, deleted: Vec<Decision>) -> Batch {
        Batch { new, deleted, ..Batch::default() }
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
        bans.apply(batch(vec![ban(1, "198.18.0.7/32", 60), ban(2, "198.18.0.7/32", 600)], vec![]), t0, true);
        assert_eq!(pending(&bans, t0), (vec![("198.18.0.7/32".into(), 600)], vec![]));
        bans.added();
        assert_eq!(pending(&bans, t0), (vec![], vec![]));
        // The longer decision deleted: the ban now ends with the shorter one, and is sent again.
        bans.apply(batch(vec![], vec![ban(2, "198.18.0.7/32", 0)]), t0, false);
        assert_eq!(pending(&bans, t0), (vec![("198.18.0.7/32".into(), 60)], vec![]));
        bans.added();
        // The last one deleted: removed.
        bans.apply(batch(vec![], vec![ban(1, "198.18.0.7/32", 0)]), t0, false);
        assert_eq!(pending(&bans, t0), (vec![], vec!["198.18.0.7/32".into()]));
        bans.removed();
        // Deleting what is not banned sends nothing.
        bans.apply(batch(vec![], vec![ban(9, "198.18.0.9/32", 0)]), t0, false);
        assert_eq!(pending(&bans, t0), (vec![], vec![]));
        assert_eq!(bans.len(), 0);
    }

    #[test]
    fn a_full_set_lifts_what_it_lacks_and_renews_the_rest() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(batch(vec![ban(1, "198.18.0.1/32", 60), ban(2, "198.18.0.2/32", 60)], vec![]), t0, true);
        bans.added();
        // After an outage: the full set no longer has .1 (deleted meanwhile) and still has .2.
        let t1 = t0 + Duration::from_secs(10);
        bans.apply(batch(vec![ban(2, "198.18.0.2/32", 50)], vec![]), t1, true);
        assert_eq!(pending(&bans, t1), (vec![("198.18.0.2/32".into(), 50)], vec!["198.18.0.1/32".into()]));
    }

    #[test]
    fn a_first_full_set_lifts_what_the_daemon_holds_of_a_previous_run() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(batch(vec![ban(1, "198.18.0.1/32", 60)], vec![]), t0, true);
        bans.added();
        let mut listed =
            vec![(net("198.18.0.2/32"), Duration::from_secs(60)), (net("198.18.0.1/32"), Duration::from_secs(60))];
        assert_eq!(bans.reconcile(&mut listed, t0), (0, 1));
        assert_eq!(pending(&bans, t0), (vec![], vec!["198.18.0.2/32".into()]));
    }

    #[test]
    fn a_reconcile_sends_again_what_the_daemon_lost_or_holds_for_another_time() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        let full = vec![ban(1, "198.18.0.1/32", 600), ban(2, "198.18.0.2/32", 600), ban(3, "2001:db8::3/128", 600)];
        bans.apply(batch(full, vec![]), t0, true);
        bans.added();
        // The daemon restarted: it lost .1, restored .2 with 1 s less (within the slack), and
        // ::3 with a minute less (a renewal it had not saved), and holds .9 of a previous run.
        let t1 = t0 + Duration::from_secs(100);
        let mut listed = vec![
            (net("198.18.0.2/32"), Duration::from_secs(499)),
            (net("2001:db8::3/128"), Duration::from_secs(440)),
            (net("198.18.0.9/32"), Duration::from_secs(30)),
        ];
        assert_eq!(bans.reconcile(&mut listed, t1), (2, 1));
        assert_eq!(
            pending(&bans, t1),
            (vec![("198.18.0.1/32".into(), 500), ("2001:db8::3/128".into(), 500)], vec!["198.18.0.9/32".into()])
        );
        bans.added();
        bans.removed();
        // Nothing lost: nothing to send.
        let mut listed = vec![
            (net("198.18.0.1/32"), Duration::from_secs(500)),
            (net("198.18.0.2/32"), Duration::from_secs(500)),
            (net("2001:db8::3/128"), Duration::from_secs(500)),
        ];
        assert_eq!(bans.reconcile(&mut listed, t1), (0, 0));
        assert_eq!(pending(&bans, t1), (vec![], vec![]));
    }

    #[test]
    fn new_decisions_past_the_most_held_are_dropped() {
        let t0 = Instant::now();
        let mut bans = Bans { max_held: 2, ..Bans::default() };
        bans.apply(batch(vec![ban(1, "198.18.0.1/32", 60)], vec![]), t0, true);
        let more = vec![ban(1, "198.18.0.1/32", 90), ban(2, "198.18.0.2/32", 60), ban(3, "198.18.0.3/32", 60)];
        assert_eq!(bans.apply(batch(more, vec![]), t0, false), 1, "the third decision held is one too many");
        assert_eq!(bans.len(), 2);
        // A deletion makes room.
        let next = batch(vec![ban(3, "198.18.0.3/32", 60)], vec![ban(2, "198.18.0.2/32", 0)]);
        assert_eq!(bans.apply(next, t0, false), 0);
        let (adds, rms) = pending(&bans, t0);
        assert_eq!(adds.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["198.18.0.1/32", "198.18.0.3/32"]);
        assert_eq!(rms, ["198.18.0.2/32"]);
    }

    #[test]
    fn pending_adds_wait_for_the_daemon_and_lapse_with_their_time() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(batch(vec![ban(1, "198.18.0.1/32", 5), ban(2, "198.18.0.2/32", 60)], vec![]), t0, true);
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
        bans.apply(batch(vec![Decision { id: 1, net: net("198.18.0.1/32"), left: huge.magnitude }], vec![]), t0, true);
        let (adds, _) = bans.pending(t0);
        assert_eq!(adds, [(net("198.18.0.1/32"), MAX_BAN)]);
    }
}

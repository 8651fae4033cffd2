//! The bans a page at a time, for `ban-list` and the snapshot's writer (`listing`, which runs
//! each page as a short job of the loop): a page is the entries after a key, in key order, and
//! where the next page starts. One page costs the loop a few milliseconds whatever the number of
//! bans, and nothing is ever copied whole.

use std::ops::Bound;

use ipnet::IpNet;

use super::{Bans, Key, MS, clock, net_range, seen_order};
use crate::{
    api::ipc::BanStatus,
    config::{self, List},
    daemon::listing::PAGE,
};

/// A page of the entries with their deadlines, and where the next starts (None: the last).
pub(super) type Page = (Vec<(Key, u64)>, Option<Key>);

impl Bans {
    /// A page of the entries after `after` (None: from the first), in order: of the first `max`
    /// looked at, those `keep` takes; and where the next page starts (None: there is none).
    pub(super) fn page<T>(
        &self,
        after: Option<Key>,
        max: usize,
        mut keep: impl FnMut(Key, u64) -> Option<T>,
    ) -> (Vec<T>, Option<Key>) {
        let rest = match after {
            Some(key) => self.entries.range((Bound::Excluded(key), Bound::Unbounded)),
            None => self.entries.range(..),
        };
        let (mut out, mut last, mut seen) = (Vec::new(), None, 0);
        for (&key, &at) in rest.take(max) {
            (seen, last) = (seen + 1, Some(key));
            out.extend(keep(key, at));
        }
        (out, if seen < max { None } else { last })
    }

    /// A page of the entries of a list in force, with their time left (`ban-list`).
    pub(in crate::daemon) fn list_page(
        &self,
        list: List,
        after: Option<Key>,
        max: usize,
    ) -> (Vec<BanStatus>, Option<Key>) {
        let now = Now::read();
        self.page(after, max, |key, at| now.status(key, at).filter(|_| key.1 == list))
    }

    /// The entries of a list in force for these networks, whatever their origin (IPv4-mapped
    /// networks taken as IPv4, as `ban-add` and `ban-rm` take them).
    pub(in crate::daemon) fn list_of(&self, list: List, nets: &[IpNet]) -> Vec<BanStatus> {
        let now = Now::read();
        seen_order(nets.iter().map(|n| config::unmapped(*n)))
            .into_iter()
            .flat_map(|net| self.entries.range(net_range(net)))
            .filter(|((_, l, _), _)| *l == list)
            .filter_map(|(&key, &at)| now.status(key, at))
            .collect()
    }

    /// A page of the entries with their deadlines, as the snapshot holds them.
    pub(super) fn saved_page(&self, after: Option<Key>) -> Page {
        self.page(after, PAGE, |key, at| Some((key, at)))
    }
}

/// Both clocks at the moment a page is made.
struct Now {
    /// The ban clock's (monotonic ns), which says whether an entry is in force and its time left.
    ns: u64,
    /// The wall clock's (ms since the epoch), only to show that time left as a date.
    wall_ms: u64,
}

impl Now {
    fn read() -> Self {
        Self { ns: clock::now_ns(), wall_ms: clock::wall_ms() }
    }

    /// An entry in force as `ban-list` reports it (None: expired, not swept yet).
    fn status(&self, (net, _, origin): Key, at: u64) -> Option<BanStatus> {
        let left_ms = at.checked_sub(self.ns).filter(|left| *left > 0)?.div_ceil(MS);
        Some(BanStatus {
            cidr: net,
            origin,
            expires_at_ms: self.wall_ms.saturating_add(left_ms),
            expires_in_ms: left_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Origin;

    /// A list comes in pages that end where the next starts, each of at most `max` entries
    /// looked at, the other list's and the expired skipped: every entry in force once, in
    /// order. `list_of` gives a network's entries of every origin, once, an IPv4-mapped network
    /// as its IPv4 one.
    #[test]
    fn a_list_pages_through_every_entry_once() {
        let mut bans = Bans::new(None);
        let later = clock::now_ns() + 60_000 * MS;
        let addr = |i: u32| IpNet::from(std::net::IpAddr::from(std::net::Ipv4Addr::from(0xc612_0000 + i)));
        for i in 0..25 {
            let list = if i % 5 == 0 { List::Allow } else { List::Deny };
            bans.put((addr(i), list, Origin::Cli), Some(later));
        }
        bans.put((addr(3), List::Deny, Origin::Crowdsec), Some(later));
        bans.put((addr(100), List::Deny, Origin::Cli), Some(1));
        let (mut listed, mut after, mut pages) = (Vec::new(), None, 0);
        loop {
            let (page, next) = bans.list_page(List::Deny, after, 7);
            listed.extend(page.iter().map(|b| (b.cidr, b.origin)));
            pages += 1;
            match next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        let mut want: Vec<_> = (0..25).filter(|i| i % 5 != 0).map(|i| (addr(i), Origin::Cli)).collect();
        want.insert(3, (addr(3), Origin::Crowdsec));
        assert_eq!(listed, want);
        assert_eq!(pages, 4, "27 entries, 7 looked at a page");
        let mapped: IpNet = "::ffff:198.18.0.3/128".parse().unwrap();
        let of = bans.list_of(List::Deny, &[addr(3), addr(0), mapped, addr(100)]);
        let of: Vec<_> = of.iter().map(|b| (b.cidr, b.origin)).collect();
        assert_eq!(of, [(addr(3), Origin::Cli), (addr(3), Origin::Crowdsec)], "allow's and the expired left out");
    }

    /// The time left is on the ban clock, rounded up to the ms (never shown as 0 while in
    /// force); the date only adds it to the wall clock.
    #[test]
    fn time_left_is_on_the_ban_clock() {
        let now = Now { ns: 5_000 * MS, wall_ms: 1_000_000 };
        let key: Key = ("198.18.0.5/32".parse().unwrap(), List::Deny, Origin::Cli);
        let b = now.status(key, 5_000 * MS + 1_500 * MS + 1).unwrap();
        assert_eq!((b.expires_in_ms, b.expires_at_ms), (1_501, 1_001_501));
        assert!(now.status(key, 5_000 * MS).is_none(), "due now: not in force");
        assert!(now.status(key, 1).is_none());
    }
}

//! What a ban may be, for every origin and at restore alike: no broader than a floor, and a
//! deny ban never over an address the config file allows. Only the operator's config file may
//! deny what it allows, or a whole region of the Internet; a feed (fail2ban, CrowdSec) or a
//! hand-made ban that could lock out the operator's own addresses, or everyone, is refused
//! entry by entry, the rest of its batch applied.

use std::{collections::BTreeSet, fmt, net::IpAddr};

use ipnet::IpNet;

use crate::{
    api::ipc::{FLOOR_V4, FLOOR_V6, MAX_FOR_MS},
    config::List,
};

/// Why one entry of a batch was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Broader than the floor.
    TooBroad,
    /// A deny ban overlapping this entry of the config file's allow list.
    AllowListed(IpNet),
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooBroad => write!(
                f,
                "broader than a ban may be (IPv4 /{FLOOR_V4}, IPv6 /{FLOOR_V6} at most); only the config file's deny list \
                 takes it"
            ),
            Self::AllowListed(allowed) => write!(
                f,
                "it covers {allowed}, on the allow list; only the config file's deny list may deny what the allow list \
                 allows"
            ),
        }
    }
}

/// The config file's allow list, as the rules consult it: by network, and which prefix lengths
/// it holds per family, so a ban checks only the lengths there are.
#[derive(Clone, Debug, Default)]
pub(super) struct AllowList {
    nets: BTreeSet<IpNet>,
    /// Bit `n`: an entry of prefix length `n` (IPv4, IPv6).
    lens: [u128; 2],
}

impl AllowList {
    pub fn new(nets: &BTreeSet<IpNet>) -> Self {
        let mut lens = [0u128; 2];
        for net in nets {
            lens[usize::from(net.addr().is_ipv6())] |= 1 << net.prefix_len();
        }
        Self { nets: nets.clone(), lens }
    }

    pub fn nets(&self) -> &BTreeSet<IpNet> {
        &self.nets
    }

    /// An entry that overlaps `net` (holds it, or lies within it), if any.
    pub fn overlapping(&self, net: IpNet) -> Option<IpNet> {
        let lens = self.lens[usize::from(net.addr().is_ipv6())];
        if lens == 0 {
            return None;
        }
        for len in (0..=net.prefix_len()).filter(|l| lens & (1 << l) != 0) {
            let holder = IpNet::new(net.addr(), len).map(|n| n.trunc()).ok()?;
            if self.nets.contains(&holder) {
                return Some(holder);
            }
        }
        let (first, last) = match net {
            IpNet::V4(n) => (IpNet::from(IpAddr::V4(n.network())), IpNet::from(IpAddr::V4(n.broadcast()))),
            IpNet::V6(n) => (IpNet::from(IpAddr::V6(n.network())), IpNet::from(IpAddr::V6(n.broadcast()))),
        };
        // Ordered by address then length: those within `net` start in its range.
        let first = IpNet::new(first.addr(), 0).unwrap_or(first);
        self.nets.range(first..=last).next().copied()
    }
}

/// Whether an entry of `list` for `net` may be in force: not broader than the floor, and (a
/// deny entry) overlapping nothing the allow list holds.
pub(super) fn check(list: List, net: IpNet, allow: &AllowList) -> Result<(), Refusal> {
    let floor = if net.addr().is_ipv6() { FLOOR_V6 } else { FLOOR_V4 };
    if net.prefix_len() < floor {
        return Err(Refusal::TooBroad);
    }
    match allow.overlapping(net) {
        Some(allowed) if list == List::Deny => Err(Refusal::AllowListed(allowed)),
        _ => Ok(()),
    }
}

/// Bad input that refuses a whole request: host bits, a duration of 0 or beyond the longest.
pub(super) fn usage(net: IpNet, for_ms: u64) -> Result<(), String> {
    if net.trunc() != net {
        return Err(format!("{net} has host bits set: the network is {} (nothing changed)", net.trunc()));
    }
    if for_ms == 0 || for_ms > MAX_FOR_MS {
        return Err(format!(
            "{net}: for_ms {for_ms}: a ban lasts from 1 ms to {MAX_FOR_MS} ms (10 years); a permanent entry is a \
             list-add (nothing changed)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn allow(nets: &[&str]) -> AllowList {
        AllowList::new(&nets.iter().map(|s| net(s)).collect())
    }

    /// A deny ban overlapping an allow entry either way is refused, naming it; an allow ban is
    /// not; nor is a deny ban beside it.
    #[test]
    fn deny_bans_never_cover_the_allow_list() {
        let a = allow(&["198.18.0.2/32", "198.18.8.0/24", "2001:db8:1::/48"]);
        for (ban, allowed) in [
            ("198.18.0.2/32", "198.18.0.2/32"),
            ("198.18.0.0/24", "198.18.0.2/32"),
            ("198.16.0.0/13", "198.18.0.2/32"),
            ("198.18.8.9/32", "198.18.8.0/24"),
            ("198.18.8.128/25", "198.18.8.0/24"),
            ("198.18.0.0/16", "198.18.0.2/32"),
            ("2001:db8:1:2::5/128", "2001:db8:1::/48"),
            ("2001:db8::/32", "2001:db8:1::/48"),
        ] {
            assert_eq!(check(List::Deny, net(ban), &a), Err(Refusal::AllowListed(net(allowed))), "{ban}");
            assert_eq!(check(List::Allow, net(ban), &a), Ok(()), "{ban}: an allow ban");
        }
        for ban in ["198.18.0.3/32", "198.18.0.4/30", "198.18.9.0/24", "198.18.7.255/32", "2001:db8:2::/48"] {
            assert_eq!(check(List::Deny, net(ban), &a), Ok(()), "{ban}");
        }
        assert_eq!(check(List::Deny, net("198.18.0.2/32"), &allow(&[])), Ok(()));
    }

    /// Broader than /8 (IPv4) or /32 (IPv6) is refused on either list.
    #[test]
    fn bans_are_no_broader_than_the_floor() {
        let none = allow(&[]);
        for (ban, ok) in [
            ("0.0.0.0/0", false),
            ("198.0.0.0/7", false),
            ("198.0.0.0/8", true),
            ("::/0", false),
            ("2001:d00::/31", false),
            ("2001:db8::/32", true),
        ] {
            let want = if ok { Ok(()) } else { Err(Refusal::TooBroad) };
            assert_eq!(check(List::Deny, net(ban), &none), want, "{ban}");
            assert_eq!(check(List::Allow, net(ban), &none), want, "{ban}");
        }
    }

    #[test]
    fn whole_requests_refuse_host_bits_and_durations_out_of_range() {
        assert!(usage(net("198.18.0.5/24"), 1000).unwrap_err().contains("198.18.0.0/24"));
        assert!(usage(net("198.18.0.5/32"), 0).is_err());
        assert!(usage(net("198.18.0.5/32"), MAX_FOR_MS + 1).is_err());
        assert!(usage(net("198.18.0.5/32"), MAX_FOR_MS).is_ok());
    }
}

//! The text forms every field is read through: whole numbers written one way ([`decimal`]),
//! networks ([`parse_net`], and [`net_serde`] for the file and the socket), and the one-line
//! error naming the field and its accepted form ([`FieldError`]).
//!
//! The leaf of the config room: it uses nothing else of it.

/// A field's value was not in its accepted form.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field} '{value}': {expected}")]
pub struct FieldError {
    pub field: &'static str,
    pub value: String,
    pub expected: &'static str,
}

pub(super) fn field_err(field: &'static str, value: &str, expected: &'static str) -> FieldError {
    FieldError { field, value: value.to_string(), expected }
}

/// A whole number written the one way: ASCII digits, no sign, no leading zero (but `0` itself).
/// Rust's integer parsers take `+53` and `053`; C's `strtol` with base 0 and `inet_aton` read a
/// leading zero as octal. Refusing both means every tool reads the same number.
pub fn decimal(s: &str) -> Option<u64> {
    let canonical = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    canonical.then(|| s.parse().ok()).flatten()
}

const CIDR_FORM: &str = "expected an IPv4 or IPv6 network with its prefix length, such as 198.18.0.0/24 or \
                         2001:db8::/32 (decimal numbers without leading zeros)";

/// Parses a network `ADDR/LEN`. Stricter than ipnet, which reads `010.1.1.1/32` as 10.1.1.1
/// while `inet_aton` reads it as 8.1.1.1: the address goes through the standard library's parser
/// (which refuses leading zeros in IPv4 octets, also inside IPv6), the length through
/// [`decimal`]. Host bits are the state's to refuse (with the network to use instead).
pub fn parse_net(s: &str) -> Result<ipnet::IpNet, FieldError> {
    let err = || field_err("CIDR", s, CIDR_FORM);
    let (addr, len) = s.split_once('/').ok_or_else(err)?;
    let addr: std::net::IpAddr = addr.parse().map_err(|_| err())?;
    let len = decimal(len).and_then(|n| u8::try_from(n).ok()).ok_or_else(err)?;
    ipnet::IpNet::new(addr, len).map_err(|_| err())
}

/// A network as the packets it matches carry it: an IPv4-mapped IPv6 network
/// (`::ffff:198.18.0.3/128`, `::ffff:198.18.0.0/120`) is the IPv4 network it maps (its prefix
/// length less 96), since those sources arrive in IPv4 packets and an IPv6 entry would never
/// match them. Every other network is itself. The one place every list and ban entry passes.
pub fn unmapped(net: ipnet::IpNet) -> ipnet::IpNet {
    match net {
        ipnet::IpNet::V6(n) if n.prefix_len() >= 96 => match n.network().to_ipv4_mapped() {
            Some(v4) => ipnet::Ipv4Net::new(v4, n.prefix_len() - 96).map_or(net, ipnet::IpNet::V4),
            None => net,
        },
        _ => net,
    }
}

/// serde for allow/deny entries, through [`parse_net`] (ipnet's own parser is laxer).
pub mod net_serde {
    use std::fmt;

    use ipnet::IpNet;
    use serde::{Deserializer, de};

    /// Refused inside the visitor, so the file's error points at the entry itself.
    struct Visitor;

    impl de::Visitor<'_> for Visitor {
        type Value = IpNet;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a network such as 198.18.0.0/24")
        }

        fn visit_str<E: de::Error>(self, s: &str) -> Result<IpNet, E> {
            super::parse_net(s).map_err(E::custom)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<IpNet, D::Error> {
        d.deserialize_str(Visitor)
    }

    /// One entry of a list.
    struct Strict(IpNet);

    impl<'de> serde::Deserialize<'de> for Strict {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            deserialize(d).map(Strict)
        }
    }

    /// A list of networks, each through [`super::parse_net`].
    pub fn deserialize_vec<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<IpNet>, D::Error> {
        Ok(<Vec<Strict> as serde::Deserialize>::deserialize(d)?.into_iter().map(|s| s.0).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_have_one_form() {
        assert_eq!(decimal("0"), Some(0));
        assert_eq!(decimal("53"), Some(53));
        assert_eq!(decimal("18446744073709551615"), Some(u64::MAX));
        for bad in ["", "+53", "-53", "053", "00", " 53", "53 ", "5_3", "0x35", "18446744073709551616", "٥"] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn mapped_networks_are_their_ipv4_network() {
        let n = |s: &str| s.parse::<ipnet::IpNet>().unwrap();
        for (mapped, v4) in [
            ("::ffff:198.18.0.3/128", "198.18.0.3/32"),
            ("::ffff:198.18.0.0/120", "198.18.0.0/24"),
            ("::ffff:0.0.0.0/96", "0.0.0.0/0"),
            // Not mapped: left as they are.
            ("::ffff:0:0/95", "::fffe:0:0/95"),
            ("2001:db8::/32", "2001:db8::/32"),
            ("::198.18.0.3/128", "::c612:3/128"),
            ("198.18.0.0/15", "198.18.0.0/15"),
        ] {
            assert_eq!(unmapped(n(mapped).trunc()), n(v4), "{mapped}");
        }
    }

    #[test]
    fn networks_refuse_leading_zeros_and_signs() {
        for (ok, canonical) in [
            ("10.1.1.1/32", "10.1.1.1/32"),
            ("0.0.0.0/0", "0.0.0.0/0"),
            ("198.18.0.0/15", "198.18.0.0/15"),
            ("2001:db8::/32", "2001:db8::/32"),
            ("2001:0db8::/32", "2001:db8::/32"),
            ("::ffff:10.1.1.1/128", "::ffff:10.1.1.1/128"),
        ] {
            assert_eq!(parse_net(ok).map(|n| n.to_string()), Ok(canonical.to_string()), "{ok}");
        }
        for bad in [
            "010.1.1.1/32",
            "10.01.1.1/32",
            "10.1.1.001/32",
            "10.1.1.1/032",
            "10.1.1.1/+32",
            "10.1.1.1/33",
            "2001:db8::/0128",
            "2001:db8::/129",
            "::ffff:010.1.1.1/128",
            "10.1.1.1",
            "10.1.1.1/",
            "10.1.1/24",
            " 10.1.1.1/32",
            "0x0a.1.1.1/32",
        ] {
            let err = parse_net(bad).unwrap_err();
            assert!(err.to_string().starts_with(&format!("invalid CIDR '{bad}'")), "{bad}: {err}");
        }
    }
}

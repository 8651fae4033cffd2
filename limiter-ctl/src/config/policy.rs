//! What a policy says, as operators write it, and its kernel form.
//!
//! Every field has one textual form, parsed here and nowhere else, so the CLI, the config file
//! and the socket protocol accept and reject exactly the same things, with the same one-line
//! errors naming the field and the accepted form.

use std::{fmt, str::FromStr};

use limiter_common::{
    Gcra,
    gcra::GcraError,
    key::prefix_mask_words,
    maps::{MAX_FRAME_WEIGHT, Policy},
};
use serde::{Deserialize, Serialize};

use super::{file::PolicyDef, rate::Rate};

/// A field's value was not in its accepted form.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field} '{value}': {expected}")]
pub struct FieldError {
    pub field: &'static str,
    pub value: String,
    pub expected: &'static str,
}

fn field_err(field: &'static str, value: &str, expected: &'static str) -> FieldError {
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

/// A policy name: 1 to 32 of `A-Z a-z 0-9 _ . -`, starting with a letter or digit.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Name(String);

impl FromStr for Name {
    type Err = FieldError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = (1..=32).contains(&s.len())
            && s.starts_with(|c: char| c.is_ascii_alphanumeric())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if ok {
            Ok(Self(s.to_string()))
        } else {
            Err(field_err("name", s, "1 to 32 of A-Z a-z 0-9 _ . -, starting with a letter or digit"))
        }
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Name {
    /// A name known to be valid (a constant in this crate).
    pub fn from_static(s: &'static str) -> Self {
        debug_assert!(s.parse::<Self>().is_ok(), "{s}");
        Self(s.to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
    Icmp,
    Any,
}

impl Proto {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::Icmp => "icmp",
            Self::Any => "any",
        }
    }
}

/// Destination ports a match covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Ports {
    Exact(u16),
    Range(u16, u16),
}

/// Which packets a policy judges: `any`, `tcp`, `udp`, `icmp`, `tcp:80`, `udp:8000-8999`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Match {
    pub proto: Proto,
    pub ports: Option<Ports>,
}

const MATCH_FORM: &str = "expected any, tcp, udp or icmp, optionally tcp:PORT or udp:LOW-HIGH with ports 1-65535, \
                          without sign or leading zeros (e.g. udp:53, tcp:8000-8999)";

impl FromStr for Match {
    type Err = FieldError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || field_err("match", s, MATCH_FORM);
        let (proto, ports) = match s.split_once(':') {
            Some((p, ports)) => (p, Some(ports)),
            None => (s, None),
        };
        let proto = match proto {
            "tcp" => Proto::Tcp,
            "udp" => Proto::Udp,
            "icmp" => Proto::Icmp,
            "any" => Proto::Any,
            _ => return Err(err()),
        };
        let port = |p: &str| decimal(p).and_then(|p| u16::try_from(p).ok()).filter(|&p| p != 0).ok_or_else(err);
        let ports = match ports {
            None => None,
            Some(_) if !matches!(proto, Proto::Tcp | Proto::Udp) => return Err(err()),
            Some(range) => Some(match range.split_once('-') {
                Some((lo, hi)) => {
                    let (lo, hi) = (port(lo)?, port(hi)?);
                    if lo > hi {
                        return Err(err());
                    }
                    Ports::Range(lo, hi)
                }
                None => Ports::Exact(port(range)?),
            }),
        };
        Ok(Self { proto, ports })
    }
}

impl fmt::Display for Match {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.proto.as_str())?;
        match self.ports {
            None => Ok(()),
            Some(Ports::Exact(p)) => write!(f, ":{p}"),
            Some(Ports::Range(lo, hi)) => write!(f, ":{lo}-{hi}"),
        }
    }
}

impl Default for Match {
    fn default() -> Self {
        Self { proto: Proto::Any, ports: None }
    }
}

/// How sources are grouped into one allowance: `src/24,/56`, `src/24`, `src`, `+dport` suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct KeySpec {
    pub v4_prefix: u8,
    pub v6_prefix: u8,
    pub dport: bool,
}

impl Default for KeySpec {
    fn default() -> Self {
        Self { v4_prefix: 32, v6_prefix: 64, dport: false }
    }
}

const KEY_FORM: &str = "expected src, src/V4LEN or src/V4LEN,/V6LEN (IPv4 0-32, IPv6 0-128, without leading zeros), \
                        optionally followed by +dport (e.g. src/24,/56+dport)";

impl FromStr for KeySpec {
    type Err = FieldError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || field_err("key", s, KEY_FORM);
        let (prefixes, dport) = match s.strip_suffix("+dport") {
            Some(rest) => (rest, true),
            None => (s, false),
        };
        let mut key = Self { dport, ..Self::default() };
        let lens = prefixes.strip_prefix("src").ok_or_else(err)?;
        if lens.is_empty() {
            return Ok(key);
        }
        let lens = lens.strip_prefix('/').ok_or_else(err)?;
        let (v4, v6) = match lens.split_once(",/") {
            Some((v4, v6)) => (v4, Some(v6)),
            None => (lens, None),
        };
        let len = |s: &str, max: u8| decimal(s).and_then(|n| u8::try_from(n).ok()).filter(|&n| n <= max);
        key.v4_prefix = len(v4, 32).ok_or_else(err)?;
        if let Some(v6) = v6 {
            key.v6_prefix = len(v6, 128).ok_or_else(err)?;
        }
        Ok(key)
    }
}

impl fmt::Display for KeySpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "src/{},/{}", self.v4_prefix, self.v6_prefix)?;
        if self.dport {
            f.write_str("+dport")?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    #[default]
    Packets,
    Bytes,
}

impl Unit {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Packets => "packets",
            Self::Bytes => "bytes",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    #[default]
    Enforce,
    DryRun,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enforce => "enforce",
            Self::DryRun => "dry-run",
        }
    }
}

/// Whose allowance a key's rate is: each CPU's (`cpu`: per-CPU buckets, no atomics, but a
/// source whose packets arrive on k CPUs gets up to k allowances) or the host's (`host`: one
/// shared bucket array, written by compare-and-exchange on admission only, so one allowance
/// however the packets are spread over CPUs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    #[default]
    Cpu,
    Host,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Host => "host",
        }
    }
}

/// Text-backed serde for the types above: the same parser for the CLI, the file and the socket.
macro_rules! serde_via_string {
    ($($t:ty),+) => {$(
        impl TryFrom<String> for $t {
            type Error = FieldError;

            fn try_from(s: String) -> Result<Self, Self::Error> {
                s.parse()
            }
        }

        impl From<$t> for String {
            fn from(v: $t) -> Self {
                v.to_string()
            }
        }
    )+};
}

serde_via_string!(Name, Match, KeySpec);

/// Parses a burst: a whole number from 1.
pub fn parse_burst(s: &str) -> Result<u64, FieldError> {
    decimal(s)
        .filter(|&n| n >= 1)
        .ok_or_else(|| field_err("burst", s, "expected a whole number from 1, without sign or leading zeros"))
}

/// `policy set`'s burst: a count, or back to the default (one second's worth of the rate).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BurstEdit {
    Default,
    Count(u64),
}

impl FromStr for BurstEdit {
    type Err = FieldError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "default" {
            return Ok(Self::Default);
        }
        decimal(s).filter(|&n| n >= 1).map(Self::Count).ok_or_else(|| {
            field_err("burst", s, "expected a whole number from 1, without sign or leading zeros, or default")
        })
    }
}

/// What `policy set` changes: the fields given, nothing else. An existing policy keeps every
/// field not given (a rate change must not turn a dry-run policy into an enforcing one); a new
/// policy takes the defaults for them, and needs a rate.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyEdit {
    #[serde(rename = "match", default, skip_serializing_if = "Option::is_none")]
    pub matches: Option<Match>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<BurstEdit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<KeySpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<Unit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<Scope>,
}

impl PolicyEdit {
    /// The policy `name` becomes: `existing` with the given fields changed, or (none existing)
    /// a new policy of the given fields and the defaults. A burst left at its default stays
    /// "one second's worth" of whatever the rate becomes.
    pub fn apply(&self, name: &Name, existing: Option<&PolicyDef>) -> Result<PolicyDef, super::Error> {
        let mut def = match existing {
            Some(def) => def.clone(),
            None => PolicyDef {
                name: name.clone(),
                matches: Match::default(),
                rate: self.rate.ok_or_else(|| super::Error::NewPolicyNeedsRate(name.clone()))?,
                burst: None,
                key: KeySpec::default(),
                unit: Unit::default(),
                mode: Mode::default(),
                scope: Scope::default(),
            },
        };
        def.matches = self.matches.unwrap_or(def.matches);
        def.rate = self.rate.unwrap_or(def.rate);
        def.burst = match self.burst {
            None => def.burst,
            Some(BurstEdit::Default) => None,
            Some(BurstEdit::Count(n)) => Some(n),
        };
        def.key = self.key.unwrap_or(def.key);
        def.unit = self.unit.unwrap_or(def.unit);
        def.mode = self.mode.unwrap_or(def.mode);
        def.scope = self.scope.unwrap_or(def.scope);
        Ok(def)
    }
}

/// One policy, validated: everything the kernel needs except its id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicySpec {
    pub rate: Rate,
    pub burst: u64,
    pub key: KeySpec,
    pub unit: Unit,
    pub mode: Mode,
    pub matches: Match,
    pub scope: Scope,
}

impl PolicySpec {
    /// A policy matching everything, with the default key, packets, enforcing.
    pub fn any(rate: Rate, burst: u64) -> Self {
        Self {
            rate,
            burst,
            key: KeySpec::default(),
            unit: Unit::Packets,
            mode: Mode::Enforce,
            matches: Match::default(),
            scope: Scope::Cpu,
        }
    }

    /// The burst used when none is given: one second's worth of the rate, and in byte mode at
    /// least one largest frame, so every frame can pass.
    pub fn default_burst(rate: Rate, unit: Unit) -> u64 {
        let second = rate.per_sec().ceil().max(1.0) as u64;
        match unit {
            Unit::Packets => second,
            Unit::Bytes => second.max(MAX_FRAME_WEIGHT),
        }
    }

    /// The kernel's form of this policy under `id`.
    pub fn compile(&self, id: u16) -> Result<Policy, GcraError> {
        let max_weight = match self.unit {
            Unit::Packets => 1,
            Unit::Bytes => MAX_FRAME_WEIGHT,
        };
        let gcra = Gcra::new(self.rate.count, self.rate.period_ns, self.burst, max_weight)?;
        let mut flags = Policy::ACTIVE;
        if self.unit == Unit::Bytes {
            flags |= Policy::BYTES;
        }
        if self.mode == Mode::DryRun {
            flags |= Policy::DRY_RUN;
        }
        if self.key.dport {
            flags |= Policy::KEY_DPORT;
        }
        if self.scope == Scope::Host {
            flags |= Policy::SCOPE_HOST;
        }
        Ok(Policy {
            gcra,
            // The slot's, set when it is stored (`kernel::maps::store_policy`).
            hold_until_ns: 0,
            v6_mask: prefix_mask_words(self.key.v6_prefix),
            v4_mask: prefix_mask_words(self.key.v4_prefix)[0],
            flags,
            id,
            v4_prefix: self.key.v4_prefix,
            v6_prefix: self.key.v6_prefix,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_parse_and_print_back() {
        for s in ["any", "tcp", "udp", "icmp", "tcp:80", "udp:53", "tcp:8000-8999", "udp:1-65535"] {
            assert_eq!(s.parse::<Match>().map(|m| m.to_string()), Ok(s.to_string()));
        }
        for bad in [
            "",
            "TCP",
            "tcp:",
            "tcp:0",
            "tcp:65536",
            "udp:9-8",
            "icmp:1",
            "any:53",
            "tcp:1-",
            "sctp",
            "tcp:80,81",
            "udp:+53",
            "udp:053",
            "udp:-53",
            "udp:0053",
            "tcp:080-090",
            "tcp:80-+90",
            "tcp:+80-90",
            "udp: 53",
            "udp:53 ",
        ] {
            let err = bad.parse::<Match>().unwrap_err();
            assert_eq!(err.field, "match", "{bad}");
        }
    }

    #[test]
    fn keys_parse_and_print_back() {
        let k = |s: &str| s.parse::<KeySpec>();
        assert_eq!(k("src"), Ok(KeySpec::default()));
        assert_eq!(k("src/24"), Ok(KeySpec { v4_prefix: 24, v6_prefix: 64, dport: false }));
        assert_eq!(k("src/24,/56+dport"), Ok(KeySpec { v4_prefix: 24, v6_prefix: 56, dport: true }));
        assert_eq!(k("src+dport"), Ok(KeySpec { dport: true, ..KeySpec::default() }));
        assert_eq!(k("src/0,/0").map(|k| k.to_string()), Ok("src/0,/0".into()));
        assert_eq!(k("src/0"), Ok(KeySpec { v4_prefix: 0, ..KeySpec::default() }));
        for bad in [
            "",
            "dst/24",
            "src/33",
            "src/24,/129",
            "src/",
            "src/24,56",
            "src/24+sport",
            "src/-1",
            "src/024",
            "src/+24",
            "src/24,/056",
            "src/00",
        ] {
            assert!(k(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn numbers_have_one_form() {
        assert_eq!(decimal("0"), Some(0));
        assert_eq!(decimal("53"), Some(53));
        assert_eq!(decimal("18446744073709551615"), Some(u64::MAX));
        for bad in ["", "+53", "-53", "053", "00", " 53", "53 ", "5_3", "0x35", "18446744073709551616", "٥"] {
            assert_eq!(decimal(bad), None, "{bad:?}");
        }
        assert_eq!(parse_burst("10"), Ok(10));
        for bad in ["0", "+10", "010", "-1", "1.5"] {
            assert!(parse_burst(bad).is_err(), "{bad}");
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

    #[test]
    fn names_are_checked() {
        for ok in ["dns", "web-8080", "a", "x.y_z", "0abc"] {
            assert!(ok.parse::<Name>().is_ok(), "{ok}");
        }
        for bad in ["", "-dns", "has space", "é", &"x".repeat(33), "a/b"] {
            assert!(bad.parse::<Name>().is_err(), "{bad}");
        }
    }

    #[test]
    fn host_scope_is_a_flag_of_the_kernel_policy() {
        let rate = Rate { count: 10, period_ns: 1_000_000_000 };
        let cpu = PolicySpec::any(rate, 5).compile(3).unwrap();
        let host = PolicySpec { scope: Scope::Host, ..PolicySpec::any(rate, 5) }.compile(3).unwrap();
        assert_eq!(cpu.flags & Policy::SCOPE_HOST, 0);
        assert_eq!(host.flags, cpu.flags | Policy::SCOPE_HOST);
        assert_eq!(host.gcra, cpu.gcra);
        let parse = |s: &str| serde_json::from_str::<Scope>(&format!("\"{s}\"")).map_err(|e| e.to_string());
        assert_eq!(parse("host"), Ok(Scope::Host));
        assert_eq!(parse("cpu"), Ok(Scope::Cpu));
        assert!(parse("Host").is_err() && parse("node").is_err());
    }

    #[test]
    fn an_edit_changes_only_the_fields_given() {
        let name: Name = "dns".parse().unwrap();
        let existing = PolicyDef {
            name: name.clone(),
            matches: "udp:53".parse().unwrap(),
            rate: "100/s".parse().unwrap(),
            burst: Some(20),
            key: "src/24".parse().unwrap(),
            unit: Unit::Packets,
            mode: Mode::DryRun,
            scope: Scope::Host,
        };
        let rate = PolicyEdit { rate: Some("500/s".parse().unwrap()), ..PolicyEdit::default() };
        let changed = rate.apply(&name, Some(&existing)).unwrap();
        assert_eq!(changed, PolicyDef { rate: "500/s".parse().unwrap(), ..existing.clone() });
        let enforce =
            PolicyEdit { mode: Some(Mode::Enforce), burst: Some(BurstEdit::Default), ..PolicyEdit::default() };
        assert_eq!(
            enforce.apply(&name, Some(&existing)).unwrap(),
            PolicyDef { mode: Mode::Enforce, burst: None, ..existing.clone() }
        );
        assert_eq!(PolicyEdit::default().apply(&name, Some(&existing)).unwrap(), existing);
        let cpu = PolicyEdit { scope: Some(Scope::Cpu), ..PolicyEdit::default() };
        assert_eq!(cpu.apply(&name, Some(&existing)).unwrap(), PolicyDef { scope: Scope::Cpu, ..existing.clone() });
        // A new policy: the defaults, and a rate is required.
        let new = rate.apply(&name, None).unwrap();
        assert_eq!((new.matches, new.key, new.unit, new.mode, new.burst, new.scope), Default::default());
        assert_eq!(new.scope, Scope::Cpu);
        let err = PolicyEdit::default().apply(&name, None).unwrap_err().to_string();
        assert!(err.contains("'dns'") && err.contains("--rate"), "{err}");
        assert_eq!("default".parse(), Ok(BurstEdit::Default));
        assert_eq!("7".parse(), Ok(BurstEdit::Count(7)));
        for bad in ["0", "07", "+7", "Default", ""] {
            assert!(bad.parse::<BurstEdit>().is_err(), "{bad}");
        }
    }

    #[test]
    fn default_burst_lets_any_frame_through_in_byte_mode() {
        let rate: Rate = "1000/s".parse().unwrap();
        assert_eq!(PolicySpec::default_burst(rate, Unit::Packets), 1000);
        assert_eq!(PolicySpec::default_burst(rate, Unit::Bytes), MAX_FRAME_WEIGHT);
        assert_eq!(PolicySpec::default_burst("5/h".parse().unwrap(), Unit::Packets), 1);
    }
}

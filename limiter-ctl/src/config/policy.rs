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

use super::rate::Rate;

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

const MATCH_FORM: &str = "expected any, tcp, udp or icmp, optionally tcp:PORT or udp:LOW-HIGH with ports 1-65535 (e.g. udp:53, tcp:8000-8999)";

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
        let port = |p: &str| p.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(err);
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

const KEY_FORM: &str = "expected src, src/V4LEN or src/V4LEN,/V6LEN (IPv4 0-32, IPv6 0-128), optionally followed by +dport (e.g. src/24,/56+dport)";

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
        key.v4_prefix = v4.parse().ok().filter(|&n| n <= 32).ok_or_else(err)?;
        if let Some(v6) = v6 {
            key.v6_prefix = v6.parse().ok().filter(|&n| n <= 128).ok_or_else(err)?;
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
    s.parse::<u64>().ok().filter(|&n| n >= 1).ok_or_else(|| field_err("burst", s, "expected a whole number from 1"))
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
        Ok(Policy {
            gcra,
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
        for bad in
            ["", "TCP", "tcp:", "tcp:0", "tcp:65536", "udp:9-8", "icmp:1", "any:53", "tcp:1-", "sctp", "tcp:80,81"]
        {
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
        for bad in ["", "dst/24", "src/33", "src/24,/129", "src/", "src/24,56", "src/24+sport", "src/-1"] {
            assert!(k(bad).is_err(), "{bad}");
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
    fn default_burst_lets_any_frame_through_in_byte_mode() {
        let rate: Rate = "1000/s".parse().unwrap();
        assert_eq!(PolicySpec::default_burst(rate, Unit::Packets), 1000);
        assert_eq!(PolicySpec::default_burst(rate, Unit::Bytes), MAX_FRAME_WEIGHT);
        assert_eq!(PolicySpec::default_burst("5/h".parse().unwrap(), Unit::Packets), 1);
    }
}

//! The values a policy's fields take, as operators write them: a name, a match, a key, a unit,
//! a mode, a scope, a burst (rates are `rate.rs`'s); and the lists' names. Each has one textual form, parsed here and
//! nowhere else, so the CLI, the config file and the socket protocol accept and reject exactly
//! the same things, with the same one-line errors naming the field and the accepted form.

use std::{fmt, str::FromStr};

use serde::{Deserialize, Serialize};

use super::field::{FieldError, decimal, field_err};

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

/// Which packets a policy judges: `any`, `tcp`, `udp`, `icmp`, `tcp:80`, `udp:8000-8999`, and
/// for TCP, connection openings only: `tcp,syn`, `tcp:443,syn`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Match {
    pub proto: Proto,
    pub ports: Option<Ports>,
    /// `,syn`: only TCP segments with SYN set and ACK clear (`Policy::SYN_ONLY`): the other
    /// segments never meet the policy.
    pub syn: bool,
}

const MATCH_FORM: &str = "expected any, tcp, udp or icmp, optionally tcp:PORT or udp:LOW-HIGH with ports 1-65535, \
                          without sign or leading zeros, and for tcp optionally ,syn for connection openings \
                          only (e.g. udp:53, tcp:8000-8999, tcp:443,syn)";

impl FromStr for Match {
    type Err = FieldError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || field_err("match", s, MATCH_FORM);
        let (rest, syn) = match s.strip_suffix(",syn") {
            Some(rest) => (rest, true),
            None => (s, false),
        };
        let (proto, ports) = match rest.split_once(':') {
            Some((p, ports)) => (p, Some(ports)),
            None => (rest, None),
        };
        let proto = match proto {
            "tcp" => Proto::Tcp,
            _ if syn => return Err(err()),
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
        Ok(Self { proto, ports, syn })
    }
}

impl fmt::Display for Match {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.proto.as_str())?;
        match self.ports {
            Some(Ports::Exact(p)) => write!(f, ":{p}")?,
            Some(Ports::Range(lo, hi)) => write!(f, ":{lo}-{hi}")?,
            None => {}
        }
        if self.syn { f.write_str(",syn") } else { Ok(()) }
    }
}

impl Default for Match {
    fn default() -> Self {
        Self { proto: Proto::Any, ports: None, syn: false }
    }
}

/// The source ports a policy judges (a predicate beside the match): `any` (the default), a
/// port (`123`) or a range (`1024-65535`). TCP and UDP policies only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SourcePorts(pub Option<(u16, u16)>);

const SPORT_FORM: &str = "expected any, a port (123) or a range (1024-65535), ports 0-65535 without sign or \
                          leading zeros";

impl FromStr for SourcePorts {
    type Err = FieldError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || field_err("sport", s, SPORT_FORM);
        if s == "any" {
            return Ok(Self(None));
        }
        let port = |p: &str| decimal(p).and_then(|p| u16::try_from(p).ok()).ok_or_else(err);
        let (lo, hi) = match s.split_once('-') {
            Some((lo, hi)) => (port(lo)?, port(hi)?),
            None => (port(s)?, port(s)?),
        };
        if lo > hi {
            return Err(err());
        }
        Ok(Self(Some((lo, hi))))
    }
}

impl fmt::Display for SourcePorts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            None => f.write_str("any"),
            Some((lo, hi)) if lo == hi => write!(f, "{lo}"),
            Some((lo, hi)) => write!(f, "{lo}-{hi}"),
        }
    }
}

impl SourcePorts {
    pub fn is_any(&self) -> bool {
        self.0.is_none()
    }

    /// Whether some source port meets both.
    pub fn overlaps(&self, other: &Self) -> bool {
        match (self.0, other.0) {
            (Some((a, b)), Some((c, d))) => a <= d && c <= b,
            _ => true,
        }
    }
}

/// The destinations a policy judges (a predicate beside the match): `any` (the default), or a
/// prefix per family, comma-separated (`198.18.0.2/32`, `198.18.0.0/24,2001:db8::/64`). A
/// policy with a prefix in one family only judges no packet of the other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Destination {
    pub v4: Option<ipnet::Ipv4Net>,
    pub v6: Option<ipnet::Ipv6Net>,
}

const DST_FORM: &str = "expected any, or a prefix per family, comma-separated, without host bits (198.18.0.2/32, \
                        198.18.0.0/24,2001:db8::/64)";

impl FromStr for Destination {
    type Err = FieldError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || field_err("dst", s, DST_FORM);
        let mut dst = Self::default();
        if s == "any" {
            return Ok(dst);
        }
        for part in s.split(',') {
            let net = super::field::parse_net(part).map_err(|_| err())?;
            if net.trunc() != net {
                return Err(err());
            }
            match net {
                ipnet::IpNet::V4(n) if dst.v4.is_none() => dst.v4 = Some(n),
                ipnet::IpNet::V6(n) if dst.v6.is_none() => dst.v6 = Some(n),
                _ => return Err(err()),
            }
        }
        Ok(dst)
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.v4, self.v6) {
            (None, None) => f.write_str("any"),
            (Some(a), None) => write!(f, "{a}"),
            (None, Some(b)) => write!(f, "{b}"),
            (Some(a), Some(b)) => write!(f, "{a},{b}"),
        }
    }
}

impl Destination {
    pub fn is_any(&self) -> bool {
        self.v4.is_none() && self.v6.is_none()
    }

    /// Whether a packet of the family (`v6`) can meet it.
    pub fn admits_family(&self, v6: bool) -> bool {
        self.is_any() || if v6 { self.v6.is_some() } else { self.v4.is_some() }
    }

    /// Whether some destination of the family meets both (prefixes overlap only when nested).
    pub fn overlaps(&self, other: &Self, v6: bool) -> bool {
        if !self.admits_family(v6) || !other.admits_family(v6) {
            return false;
        }
        if v6 {
            match (self.v6, other.v6) {
                (Some(a), Some(b)) => a.contains(&b) || b.contains(&a),
                _ => true,
            }
        } else {
            match (self.v4, other.v4) {
                (Some(a), Some(b)) => a.contains(&b) || b.contains(&a),
                _ => true,
            }
        }
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

/// An enum written as one word of a closed set: `as_str`, `Display`, `FromStr` and `WORDS`
/// (every word, in the order help texts list them). serde stays derived (the same words), so a
/// file's error names the variants as before.
macro_rules! words {
    ($t:ident, $field:literal { $($variant:ident = $word:literal),+ $(,)? }) => {
        impl $t {
            pub const WORDS: &'static [&'static str] = &[$($word),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $word,)+
                }
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $t {
            type Err = FieldError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($word => Ok(Self::$variant),)+
                    _ => Err(field_err($field, s, concat!("expected one of:" $(, " ", $word)+))),
                }
            }
        }
    };
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    #[default]
    Packets,
    Bytes,
}

words!(Unit, "unit" { Packets = "packets", Bytes = "bytes" });

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    #[default]
    Enforce,
    DryRun,
}

words!(Mode, "mode" { Enforce = "enforce", DryRun = "dry-run" });

/// Whose allowance a key's rate is: each CPU's (`cpu`: per-CPU buckets, no atomics, but a
/// source whose packets arrive on k CPUs gets up to k allowances) or the host's (`host`: one
/// shared bucket array, written by compare-and-exchange on admission only, so one allowance
/// however the packets are spread over CPUs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Cpu,
    /// The default of a new policy (and of a file with `version = 2`; see `file`).
    #[default]
    Host,
}

words!(Scope, "scope" { Cpu = "cpu", Host = "host" });

/// The allow list (sources that bypass limiting) or the deny list (sources always dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum List {
    Allow,
    Deny,
}

impl List {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allow => "allow",
            Self::Deny => "deny",
        }
    }
}

/// Who asked for an expiring entry (a ban): the CLI by hand, fail2ban's action, or the
/// CrowdSec bouncer. `stats` and `/metrics` count bans per origin; a removal by one origin
/// leaves the others' entries for the same network.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Origin {
    #[default]
    Cli,
    Fail2ban,
    Crowdsec,
}

impl Origin {
    pub const ALL: [Origin; 3] = [Origin::Cli, Origin::Fail2ban, Origin::Crowdsec];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cli => "cli",
            Self::Fail2ban => "fail2ban",
            Self::Crowdsec => "crowdsec",
        }
    }

    /// Its index in [`Origin::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Origin {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|o| o.as_str() == s)
            .ok_or_else(|| format!("invalid origin '{s}': expected cli, fail2ban or crowdsec"))
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

serde_via_string!(Name, Match, KeySpec, SourcePorts, Destination);

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

/// A burst edit as the policy keeps it: None is the default, one second's worth of the rate.
impl From<BurstEdit> for Option<u64> {
    fn from(edit: BurstEdit) -> Self {
        match edit {
            BurstEdit::Default => None,
            BurstEdit::Count(n) => Some(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_parse_and_print_back() {
        for s in [
            "any",
            "tcp",
            "udp",
            "icmp",
            "tcp:80",
            "udp:53",
            "tcp:8000-8999",
            "udp:1-65535",
            "tcp,syn",
            "tcp:443,syn",
            "tcp:8000-8999,syn",
        ] {
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
            "udp:53,syn",
            "udp,syn",
            "icmp,syn",
            "any,syn",
            "tcp:443,SYN",
            "tcp:443,syn,syn",
            "tcp:443,ack",
            "tcp:443, syn",
            "tcp,syn:443",
            ",syn",
            "syn",
        ] {
            let err = bad.parse::<Match>().unwrap_err();
            assert_eq!(err.field, "match", "{bad}");
        }
        let syn = "tcp:443,syn".parse::<Match>();
        assert_eq!(syn, Ok(Match { proto: Proto::Tcp, ports: Some(Ports::Exact(443)), syn: true }));
        assert_eq!("tcp:443".parse::<Match>().map(|m| m.syn), Ok(false));
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
    fn bursts_have_one_form() {
        assert_eq!(parse_burst("10"), Ok(10));
        for bad in ["0", "+10", "010", "-1", "1.5"] {
            assert!(parse_burst(bad).is_err(), "{bad}");
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
    fn scopes_and_the_other_words_read_their_serde_form() {
        let parse = |s: &str| serde_json::from_str::<Scope>(&format!("\"{s}\"")).map_err(|e| e.to_string());
        assert_eq!(parse("host"), Ok(Scope::Host));
        assert_eq!(parse("cpu"), Ok(Scope::Cpu));
        assert!(parse("Host").is_err() && parse("node").is_err());
        // Each word reads back as itself, in the text form and in serde's.
        fn words<T: FromStr + fmt::Display + Serialize>(all: &[&str]) {
            for word in all {
                let value = word.parse::<T>().ok().unwrap();
                assert_eq!(value.to_string(), *word);
                assert_eq!(serde_json::to_string(&value).unwrap(), format!("\"{word}\""));
            }
            assert!("nonsense".parse::<T>().is_err());
        }
        words::<Unit>(Unit::WORDS);
        words::<Mode>(Mode::WORDS);
        words::<Scope>(Scope::WORDS);
    }
}

//! The daemon's TOML config: policies and allow/deny lists. Loaded at start and on SIGHUP;
//! edited in place on every change (`write.rs`: comments and order kept, written atomically).
//!
//! ```toml
//! allow = ["198.18.7.0/24"]
//! deny = ["2001:db8:bad::/48"]
//!
//! [[policy]]
//! name = "dns"
//! match = "udp:53"        # any | tcp | udp | icmp, optionally :PORT or :LOW-HIGH
//! rate = "100/s"          # N/s, N/min, N/h
//! burst = 200             # default: one second's worth
//! key = "src/24,/56"      # default src/32,/64; +dport to key on the destination port too
//! unit = "packets"        # or "bytes"
//! mode = "enforce"        # or "dry-run"
//! ```

use std::{
    fs,
    io,
    path::Path,
};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::{
    Error,
    policy::{KeySpec, Match, Mode, Name, PolicySpec, Unit},
    rate::Rate,
};

pub const DEFAULT_PATH: &str = "/etc/limiter/limiter.toml";

/// A named policy as the file, the socket and `policy show` carry it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyDef {
    pub name: Name,
    #[serde(rename = "match", default)]
    pub matches: Match,
    pub rate: Rate,
    /// None: one second's worth of the rate (see [`PolicySpec::default_burst`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    #[serde(default)]
    pub key: KeySpec,
    #[serde(default)]
    pub unit: Unit,
    #[serde(default)]
    pub mode: Mode,
}

impl PolicyDef {
    pub fn spec(&self) -> PolicySpec {
        PolicySpec {
            rate: self.rate,
            burst: self.burst_or_default(),
            key: self.key,
            unit: self.unit,
            mode: self.mode,
            matches: self.matches,
        }
    }

    pub fn burst_or_default(&self) -> u64 {
        self.burst.unwrap_or_else(|| PolicySpec::default_burst(self.rate, self.unit))
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    // Through the config's own parser: ipnet's reads `010.1.1.1/32` as 10.1.1.1.
    #[serde(default, skip_serializing_if = "Vec::is_empty", deserialize_with = "super::net_serde::deserialize_vec")]
    pub allow: Vec<IpNet>,
    #[serde(default, skip_serializing_if = "Vec::is_empty", deserialize_with = "super::net_serde::deserialize_vec")]
    pub deny: Vec<IpNet>,
    #[serde(default, rename = "policy", skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<PolicyDef>,
}

/// Parses config text; errors carry the line and column they were found at.
pub fn parse(path: &Path, text: &str) -> Result<ConfigFile, Error> {
    toml::from_str(text).map_err(|e| {
        let (line, column) = e.span().map_or((1, 1), |span| line_column(text, span.start));
        Error::Parse { path: path.to_path_buf(), line, column, message: e.message().trim().replace('\n', " ") }
    })
}

fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// Loads the config; a missing file is an empty config.
pub fn load(path: &Path) -> Result<ConfigFile, Error> {
    match fs::read_to_string(path) {
        Ok(text) => parse(path, &text),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(ConfigFile::default()),
        Err(source) => Err(Error::Read { path: path.to_path_buf(), source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"
allow = ["198.18.7.0/24"]
deny = ["2001:db8:bad::/48"]

[[policy]]
name = "dns"
match = "udp:53"
rate = "100/s"
burst = 200
key = "src/24,/56"

[[policy]]
name = "web"
match = "tcp:8000-8999"
rate = "50/min"
unit = "bytes"
mode = "dry-run"
"#;

    #[test]
    fn round_trips_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/limiter.toml");
        let config = parse(&path, EXAMPLE).unwrap();
        assert_eq!(config.policies.len(), 2);
        assert_eq!(config.policies[1].unit, Unit::Bytes);
        assert_eq!(config.policies[1].mode, Mode::DryRun);
        assert_eq!(config.policies[1].burst, None);
        super::super::save(&path, &config).unwrap();
        assert_eq!(load(&path).unwrap(), config);
        // Nothing but the file is left behind in the directory.
        let names: Vec<_> = fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("limiter.toml")]);
    }

    #[test]
    fn errors_name_the_line_and_column() {
        let p = Path::new("/etc/limiter/limiter.toml");
        let cases = [
            ("[[policy]]\nname = \"dns\"\nrate = \"100/d\"\n", 3, "invalid rate"),
            ("[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nmatch = \"udp:0\"\n", 4, "invalid match"),
            ("[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nspeed = 3\n", 4, "unknown field"),
            ("allow = [\"198.18.0.0/33\"]\n", 1, "invalid"),
            ("[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nburst = \"ten\"\n", 4, "invalid type"),
            ("[[policy]\n", 1, ""),
        ];
        for (text, line, what) in cases {
            match parse(p, text) {
                Err(Error::Parse { line: l, message, .. }) => {
                    assert_eq!(l, line, "{text:?}: {message}");
                    assert!(message.contains(what), "{text:?}: {message}");
                    assert!(!message.contains('\n'));
                }
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_missing_file_is_an_empty_config() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(&dir.path().join("none.toml")).unwrap(), ConfigFile::default());
    }
}

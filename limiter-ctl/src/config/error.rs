//! Bad input, each error one line naming what was wrong; and the config file that could not
//! be read or written.

use std::{io, path::PathBuf};

use ipnet::IpNet;
use limiter_common::gcra::GcraError;

use super::{List, Match, Name};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}:{line}:{column}: {message}")]
    Parse { path: PathBuf, line: usize, column: usize, message: String },
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("writing {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
    #[error("{path} does not exist")]
    Missing { path: PathBuf },
    #[error("{path} was changed since the daemon last read or wrote it (a hand edit not yet applied): not overwritten")]
    Changed { path: PathBuf },
    #[error("{path} is {kind}, not a regular file")]
    NotAFile { path: PathBuf, kind: &'static str },
    #[error("{path} is {size} bytes, more than a config may be ({max} bytes)")]
    TooLarge { path: PathBuf, size: u64, max: u64 },
    #[error("{path} is empty (a config without rules says so: `policy = []`)")]
    Empty { path: PathBuf },
    #[error(
        "{path} has no policy and no allow/deny entry: it would remove every rule; if that is meant, \
         write `policy = []` in it"
    )]
    NoRules { path: PathBuf },
    #[error("policy '{0}' is defined twice")]
    DefinedTwice(Name),
    #[error("no policy named '{0}' (see `limiter-ctl policy list`)")]
    NoSuchPolicy(Name),
    #[error("no policy named '{name}' to change; a new policy needs --{flag} (see `limiter-ctl policy list`)")]
    NewPolicyNeeds { name: Name, flag: &'static str },
    #[error("too many policies: at most {max} (remove one first)")]
    TooManyPolicies { max: u32 },
    #[error(
        "policy '{name}': a byte policy's burst ({burst} bytes) must hold the largest frame it can meet ({max_frame} bytes: \
         the MTU plus Ethernet and VLAN headers), or such frames are refused forever; use --burst {max_frame} or more"
    )]
    BurstBelowFrame { name: Name, burst: u64, max_frame: u64 },
    #[error("policy '{name}': {error}")]
    Policy { name: Name, error: GcraError },
    #[error(
        "{} can all judge one packet ({traffic}): at most {max} policies may (narrow one with --sport or --dst, or remove one)",
        quoted(names)
    )]
    TooManyLayers { traffic: String, names: Vec<Name>, max: usize },
    #[error("{} all cover {traffic}: at most {max} policies may share one traffic (remove one)", quoted(names))]
    TooManyCandidates { traffic: String, names: Vec<Name>, max: usize },
    #[error("policy '{name}' ({matches}): --sport needs a tcp or udp match")]
    SportWithoutPorts { name: Name, matches: Match },
    #[error("invalid CIDR '{net}': host bits are set; expected a network address such as {}", net.trunc())]
    HostBits { net: IpNet },
    #[error("{net} is on the {} list; remove it there first", other.as_str())]
    OnOtherList { net: IpNet, other: List },
    #[error("{net} is not on the {} list", list.as_str())]
    NotOnList { net: IpNet, list: List },
    #[error("too many allow/deny entries for this family: at most {max}")]
    TooManyListEntries { max: u32 },
}

/// `'a', 'b' and 'c'`: policy names in an error.
fn quoted(names: &[Name]) -> String {
    let q: Vec<String> = names.iter().map(|n| format!("'{n}'")).collect();
    match q.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("policies {} and {last}", rest.join(", ")),
        Some((last, _)) => format!("policy {last}"),
        None => "no policy".to_string(),
    }
}

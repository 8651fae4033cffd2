//! tc ingress through tcx (Linux 6.6+): where the limiter judges when another program holds
//! XDP, or when asked. Several programs share the hook, each through its own link, in an order;
//! the limiter's place in it is a [`TcxPlace`], relative to a program named as `bpftool prog`
//! names it ([`ProgRef`]). (Through a netlink filter instead, the place is a priority:
//! `tc_filter`.)

use std::{fmt, str::FromStr};

use aya::programs::{LinkOrder, ProgramId, SchedClassifier, TcAttachType};
use serde::{Deserialize, Serialize};

use super::Error;

/// The longest program name the kernel keeps (BPF_OBJ_NAME_LEN, less its NUL).
const NAME_MAX: usize = 15;

/// A program at tcx ingress: `id:N`, or its name as the kernel keeps it (at most 15 characters,
/// as `bpftool prog` shows it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProgRef {
    Id(u32),
    Name(String),
}

impl FromStr for ProgRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(id) = s.strip_prefix("id:") {
            let digits = !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit());
            return match id.parse::<u32>() {
                Ok(id) if digits && id > 0 => Ok(Self::Id(id)),
                _ => {
                    Err(format!("invalid program '{s}': expected id:N with N a program id (`bpftool prog` lists them)"))
                }
            };
        }
        let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.';
        if s.is_empty() || s.len() > NAME_MAX || !s.chars().all(valid) {
            return Err(format!(
                "invalid program '{s}': expected a program name as `bpftool prog` shows it (1-{NAME_MAX} of A-Z a-z \
                 0-9 _ .) or id:N"
            ));
        }
        Ok(Self::Name(s.to_string()))
    }
}

impl ProgRef {
    /// Whether it names the program `id` named `name`.
    pub fn names(&self, id: u32, name: &str) -> bool {
        match self {
            Self::Id(i) => *i == id,
            Self::Name(n) => n == name,
        }
    }
}

impl fmt::Display for ProgRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Id(id) => write!(f, "id:{id}"),
            Self::Name(name) => f.write_str(name),
        }
    }
}

/// Where at tc ingress the limiter goes when it is attached there (an adopted attachment keeps
/// its place): in the tcx chain, or, through netlink, at the priority right before or after the
/// named program's filter (`tc_filter::priority_for`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TcxPlace {
    /// Before every other program: nothing reaches another program unjudged.
    #[default]
    First,
    Before(ProgRef),
    After(ProgRef),
}

impl fmt::Display for TcxPlace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::First => f.write_str("first"),
            Self::Before(p) => write!(f, "before {p}"),
            Self::After(p) => write!(f, "after {p}"),
        }
    }
}

/// A program attached at tcx ingress, as the kernel lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcxProgram {
    pub id: u32,
    pub name: String,
}

impl fmt::Display for TcxProgram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "id {} '{}'", self.id, self.name)
    }
}

/// The programs at tcx ingress of `iface`, first to run first.
pub(crate) fn programs(iface: &str) -> Result<Vec<TcxProgram>, Error> {
    let (_, infos) = SchedClassifier::query_tcx(iface, TcAttachType::Ingress)
        .map_err(|source| Error::TcxQuery { iface: iface.into(), source })?;
    Ok(infos.iter().map(|p| TcxProgram { id: p.id(), name: p.name_as_str().unwrap_or_default().to_string() }).collect())
}

/// The kernel's order for `place` on `iface`: the named program looked up in the chain first,
/// so a name that is not there (or names two programs) is refused saying what is.
pub(super) fn link_order(iface: &str, place: &TcxPlace) -> Result<LinkOrder, Error> {
    let (prog, before) = match place {
        TcxPlace::First => return Ok(LinkOrder::first()),
        TcxPlace::Before(p) => (p, true),
        TcxPlace::After(p) => (p, false),
    };
    let chain = programs(iface)?;
    let found: Vec<&TcxProgram> = chain.iter().filter(|p| prog.names(p.id, &p.name)).collect();
    let id = match found.as_slice() {
        [one] => one.id,
        [] => {
            return Err(Error::NoSuchTcxProgram { iface: iface.into(), prog: prog.to_string(), chain: listed(&chain) });
        }
        many => {
            let ids = many.iter().map(|p| format!("id:{}", p.id)).collect::<Vec<_>>().join(", ");
            return Err(Error::AmbiguousTcxProgram { iface: iface.into(), prog: prog.to_string(), ids });
        }
    };
    // SAFETY: not memory: an id the kernel listed for this chain, which it checks again on attach.
    let id = unsafe { ProgramId::new(id) };
    Ok(if before { LinkOrder::before_program_id(id) } else { LinkOrder::after_program_id(id) })
}

/// The chain in words, for an error: "id 12 'xdp_pass', id 13 'other'" or "nothing".
pub(crate) fn listed(chain: &[TcxProgram]) -> String {
    if chain.is_empty() {
        return "nothing".into();
    }
    chain.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_named_as_bpftool_names_them_or_by_id() {
        assert_eq!("id:42".parse(), Ok(ProgRef::Id(42)));
        assert_eq!("xdpfilt_alw_all".parse(), Ok(ProgRef::Name("xdpfilt_alw_all".into())));
        assert_eq!("cil.from_netdev".parse(), Ok(ProgRef::Name("cil.from_netdev".into())));
        for bad in ["", "id:", "id:0", "id:-1", "id:+3", "id:x", "a-b", "sixteen_chars_xx", "a b", "ünï"] {
            assert!(bad.parse::<ProgRef>().is_err(), "{bad} was taken");
        }
        assert_eq!(ProgRef::Id(7).to_string(), "id:7");
        assert_eq!(TcxPlace::After(ProgRef::Name("f".into())).to_string(), "after f");
    }
}

//! Where the program runs, as asked ([`Placement`]) and as it turned out ([`AttachMode`],
//! [`Attached`]): at XDP, in native or skb mode, or at tc ingress, through tcx or through a
//! netlink filter on the clsact qdisc.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::{
    tc_api::{ApiReason, TcApiRequest},
    tcx::TcxPlace,
};

/// Where the program judges packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Hook {
    /// XDP: before the kernel makes an skb, the cheapest; one program per interface.
    Xdp,
    /// tc ingress: once the skb is made; shared with other programs, in order (through tcx, or a
    /// netlink filter where the kernel has no tcx). `tcx`, its name before the netlink filter,
    /// still names it.
    #[value(alias = "tcx")]
    #[serde(alias = "tcx")]
    Tc,
}

impl Hook {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Xdp => "xdp",
            Self::Tc => "tc",
        }
    }

    /// Its name in a sentence: "XDP" or "tc ingress".
    pub fn name(self) -> &'static str {
        match self {
            Self::Xdp => "XDP",
            Self::Tc => "tc ingress",
        }
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The hook an operator asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum HookRequest {
    /// XDP when it is free, tc ingress when another program holds it; a pinned limiter keeps its
    /// hook.
    #[default]
    Auto,
    /// XDP only: fails when another program holds it.
    Xdp,
    /// tc ingress only, leaving XDP free for another tool (`tcx` still names it).
    #[value(alias = "tcx")]
    Tc,
}

impl HookRequest {
    pub(super) fn explicit(self) -> Option<Hook> {
        match self {
            Self::Auto => None,
            Self::Xdp => Some(Hook::Xdp),
            Self::Tc => Some(Hook::Tc),
        }
    }
}

/// The XDP attach mode an operator asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeRequest {
    /// Native (driver) mode, falling back to skb mode with a warning.
    #[default]
    Auto,
    Native,
    Skb,
}

/// How to attach: the hook, the mode at XDP, the place and the API at tc ingress.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    pub hook: HookRequest,
    pub mode: ModeRequest,
    pub tcx: TcxPlace,
    pub tc_api: TcApiRequest,
}

/// How the program runs once attached: at XDP in native or skb mode, or at tc ingress through a
/// tcx link or a netlink filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    Native,
    Skb,
    Tcx,
    Netlink,
}

impl AttachMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Skb => "skb",
            Self::Tcx => "tcx",
            Self::Netlink => "netlink",
        }
    }

    pub fn hook(self) -> Hook {
        match self {
            Self::Native | Self::Skb => Hook::Xdp,
            Self::Tcx | Self::Netlink => Hook::Tc,
        }
    }
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the program runs at tc ingress rather than XDP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TcReason {
    /// Another program holds XDP (that program, in words): it is left alone.
    XdpHeld(String),
    /// XDP refused the program (why, in one line: a rejection's verifier log is in a file).
    XdpRefused(String),
    /// `--attach tc`.
    Asked,
    /// `limiter-ctl attach tc`.
    Moved,
    /// A pinned limiter at tc ingress was adopted, or attached again there.
    Kept,
}

impl TcReason {
    /// A word for metrics' labels: `xdp_held`, `xdp_refused`, `asked`, `moved` or `kept`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::XdpHeld(_) => "xdp_held",
            Self::XdpRefused(_) => "xdp_refused",
            Self::Asked => "asked",
            Self::Moved => "moved",
            Self::Kept => "kept",
        }
    }
}

impl fmt::Display for TcReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::XdpHeld(holder) => write!(f, "another program holds XDP ({holder})"),
            Self::XdpRefused(why) => write!(f, "XDP refused the program ({why})"),
            Self::Asked => f.write_str("asked for (--attach tc)"),
            Self::Moved => f.write_str("moved there by `limiter-ctl attach tc`"),
            Self::Kept => f.write_str("kept at tc ingress, where the pinned limiter was"),
        }
    }
}

/// How the program got attached.
#[derive(Debug)]
pub struct Attached {
    pub mode: AttachMode,
    /// Why native mode was not used, when auto fell back to skb mode; or, attaching again at tc
    /// ingress, why its place is not the one asked for.
    pub fallback: Option<String>,
    /// The program replaced a pinned predecessor in place (no moment unprotected).
    pub replaced: bool,
    /// Why `mode` is an assumption: replacing a predecessor whose config is not ours, the kernel
    /// could not be asked which mode its link has.
    pub mode_unknown: Option<String>,
    /// Why the program runs at tc ingress, when it does.
    pub why_tc: Option<TcReason>,
    /// Why it runs there through netlink rather than tcx, when it does.
    pub api_reason: Option<ApiReason>,
    /// Where the program ran before, when this moved it to another hook.
    pub moved_from: Option<AttachMode>,
    /// What a move a predecessor did not finish (killed half way) left, and what the start did
    /// about it, in a sentence.
    pub repaired: Option<String>,
    /// Why both hooks still hold the program after a move (the released link is held
    /// elsewhere); each packet is still judged once.
    pub lingering: Option<String>,
}

impl Attached {
    pub(super) fn new(mode: AttachMode) -> Self {
        Self {
            mode,
            fallback: None,
            replaced: false,
            mode_unknown: None,
            why_tc: None,
            api_reason: None,
            moved_from: None,
            repaired: None,
            lingering: None,
        }
    }
}

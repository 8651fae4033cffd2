//! Where the program runs, as asked ([`Placement`]) and as it turned out ([`AttachMode`],
//! [`Attached`]): at XDP, in native or skb mode, or at tc ingress through tcx.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::tcx::TcxPlace;

/// Where the program judges packets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Hook {
    /// XDP: before the kernel makes an skb, the cheapest; one program per interface.
    Xdp,
    /// tc ingress through tcx: once the skb is made; shared with other programs, in order.
    Tcx,
}

impl Hook {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Xdp => "xdp",
            Self::Tcx => "tcx",
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
    /// XDP when it is free, tcx when another program holds it; a pinned limiter keeps its hook.
    #[default]
    Auto,
    /// XDP only: fails when another program holds it.
    Xdp,
    /// tc ingress only, leaving XDP free for another tool.
    Tcx,
}

impl HookRequest {
    pub(super) fn explicit(self) -> Option<Hook> {
        match self {
            Self::Auto => None,
            Self::Xdp => Some(Hook::Xdp),
            Self::Tcx => Some(Hook::Tcx),
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

/// How to attach: the hook, the mode at XDP, the place at tcx.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    pub hook: HookRequest,
    pub mode: ModeRequest,
    pub tcx: TcxPlace,
}

/// How the program runs once attached: at XDP in native or skb mode, or at tcx.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    Native,
    Skb,
    Tcx,
}

impl AttachMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Skb => "skb",
            Self::Tcx => "tcx",
        }
    }

    pub fn hook(self) -> Hook {
        match self {
            Self::Native | Self::Skb => Hook::Xdp,
            Self::Tcx => Hook::Tcx,
        }
    }
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the program got attached.
#[derive(Debug)]
pub struct Attached {
    pub mode: AttachMode,
    /// Why native mode was not used, when auto fell back to skb mode; or, re-creating a tcx link,
    /// why its place is not the one asked for.
    pub fallback: Option<String>,
    /// The program replaced a pinned predecessor in place (no moment unprotected).
    pub replaced: bool,
    /// Why `mode` is an assumption: replacing a predecessor whose config is not ours, the kernel
    /// could not be asked which mode its link has.
    pub mode_unknown: Option<String>,
    /// Why the program runs at tcx, when it does ("another program holds XDP (...)", ...).
    pub why_tcx: Option<String>,
    /// Where the program ran before, when this moved it to another hook.
    pub moved_from: Option<AttachMode>,
    /// A move to this hook that a predecessor did not finish (killed half way), undone at start.
    pub undone: Option<Hook>,
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
            why_tcx: None,
            moved_from: None,
            undone: None,
            lingering: None,
        }
    }
}

//! What can stop the daemon, or make it refuse a change. Bad input (the config, the flags, the
//! interface) is told apart from failures by its variant ([`Error::is_bad_input`]), which gives
//! the exit code.

use std::{fmt, io, net::SocketAddr, path::PathBuf};

use crate::{config, kernel};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // Bad input: nothing was changed.
    /// The config file does not parse (or cannot be read).
    #[error(transparent)]
    File(config::Error),
    /// The config file parses but does not validate.
    #[error("{path}: {error}")]
    Config { path: PathBuf, error: config::Error },
    #[error("--rate/--burst: {0}")]
    DefaultPolicy(config::Error),
    #[error("interface '{0}' does not exist (see `ip link`; --wait-iface waits for a late one)")]
    NoSuchInterface(String),

    // Failures.
    #[error(transparent)]
    Kernel(Box<kernel::Error>),
    /// The host's memory or CPU count could not be read to size the buckets (`auto`).
    #[error(transparent)]
    HostSize(kernel::HostSizeError),
    #[error("interface '{iface}' did not appear within {waited} (--wait-iface); see `ip link`")]
    InterfaceNeverAppeared { iface: String, waited: String },
    #[error("{}", instance_running(iface, lock, holder, ours))]
    InstanceRunning { iface: String, lock: PathBuf, holder: super::instance::Holder, ours: PathBuf },
    #[error("locking the interface's state at {path}: {error}")]
    StateLock { path: PathBuf, error: io::Error },
    #[error("the pins at {dir} were removed while the daemon ran, so the program left the interface with it")]
    PinsGone { dir: PathBuf },
    #[error("the program is not attached to {iface} any more ({found} there now)")]
    NotAttachedAtExit { iface: String, found: String },
    #[error("creating {dir}")]
    CreateSocketDir { dir: PathBuf, source: io::Error },
    #[error("another daemon is already listening on {path}; stop it or pass --socket")]
    SocketTaken { path: PathBuf },
    #[error("{path} exists and is not a socket; remove it or pass --socket")]
    NotASocket { path: PathBuf },
    #[error("removing stale {path}")]
    RemoveStaleSocket { path: PathBuf, source: io::Error },
    #[error("checking {path}")]
    CheckSocket { path: PathBuf, source: io::Error },
    #[error("binding {path}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("restricting {path} to root")]
    RestrictSocket { path: PathBuf, source: io::Error },
    #[error("binding the metrics endpoint on {addr} (--metrics off to disable)")]
    Metrics { addr: SocketAddr, source: io::Error },
    #[error("starting the async runtime failed: {0}")]
    Runtime(io::Error),
    #[error("installing the {signal} handler")]
    Signal { signal: &'static str, source: io::Error },
    #[error("watching the refusal ring: {0}")]
    RefusalRing(io::Error),
    #[error("writing the config")]
    SaveConfig(#[source] config::Error),

    // A change refused after validation (reported to the client, or logged on reload).
    #[error("updating the kernel maps failed: {error}{rollback}")]
    UpdateMaps { error: Box<kernel::Error>, rollback: Rollback },
    #[error("{error}{rollback}")]
    SaveChange { error: config::Error, rollback: Rollback },
}

impl Error {
    /// Bad input (the config, the flags, the interface): exit 2, where a failure exits 1.
    /// The daemon's exit code for it: 2 bad input, 4 a kernel that cannot run the limiter, 1
    /// any other failure (docs/OPERATIONS.md, the man page's EXIT STATUS).
    pub fn exit_code(&self) -> u8 {
        match self {
            _ if self.is_bad_input() => 2,
            Self::Kernel(e) if e.is_unsupported_kernel() => 4,
            _ => 1,
        }
    }

    pub fn is_bad_input(&self) -> bool {
        match self {
            Self::File(_) | Self::Config { .. } | Self::DefaultPolicy(_) | Self::NoSuchInterface(_) => true,
            // --tcx-before/--tcx-after naming a program that is not at tc ingress.
            Self::Kernel(e) => e.is_bad_input(),
            _ => false,
        }
    }
}

impl From<kernel::Error> for Error {
    fn from(e: kernel::Error) -> Self {
        Self::Kernel(Box::new(e))
    }
}

/// Another daemon holds the interface's state lock: who, and what to do (under this daemon's
/// pin directory `ours`, stopping it is enough: this one then adopts its program).
fn instance_running(
    iface: &str,
    lock: &std::path::Path,
    holder: &super::instance::Holder,
    ours: &std::path::Path,
) -> String {
    let pins = holder.pins.as_ref().map(|p| format!(", pins at {}", p.display())).unwrap_or_default();
    let advice = match &holder.pins {
        Some(theirs) if theirs != ours => crate::kernel::take_off_advice(iface, theirs),
        _ => format!(
            "One daemon per interface: stop that one first (`systemctl stop limiter` or `limiter@{iface}`, or kill \
             it), or choose another --iface"
        ),
    };
    format!(
        "another limiter daemon ({}{pins}) runs on {iface}: it holds {}, the lock on the interface's state (its \
         bans); nothing was changed. {advice}",
        holder.owner,
        lock.display()
    )
}

/// Whether the maps were put back after a change failed half way.
#[derive(Debug)]
pub struct Rollback(pub Result<(), Box<kernel::Error>>);

impl fmt::Display for Rollback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Ok(()) => f.write_str("; nothing changed"),
            Err(e) => write!(f, "; restoring the previous maps failed too ({e}): restart the daemon"),
        }
    }
}

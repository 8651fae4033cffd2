//! What can go wrong between userspace and the kernel, each saying what to do about it.

use std::{fmt, io, path::PathBuf};

use aya::{
    EbpfError,
    maps::{MapError, MapType},
    pin::PinError,
    programs::{ProgramError, links::LinkError},
};
use limiter_common::maps::{LAYOUT_VERSION, MAX_BUCKETS, MIN_BUCKETS};

use super::{
    Hook,
    pins::{BPFFS, Owner, XdpProgram},
};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("loading the BPF program failed: {0} (run as root, or with CAP_BPF, CAP_NET_ADMIN and CAP_PERFMON)")]
    Load(#[source] EbpfError),
    #[error("a program of the limiter: {0}")]
    Program(#[source] ProgramError),
    /// The verifier refused a program: its last words here, its whole log in a file.
    #[error("the kernel rejected the {hook} program {program}: {reason}{}", saved_note(saved))]
    Rejected { hook: &'static str, program: &'static str, reason: String, saved: Option<PathBuf> },
    /// The kernel lacks something the limiter needs (`features`): nothing was loaded.
    #[error(
        "this kernel (Linux {release}) cannot run the limiter: it lacks {lacks} (Linux {since} and later have it; \
         {detail}); run Linux {min} or later (Debian 12's 6.1 and later are tested)",
        min = super::features::MINIMUM
    )]
    KernelLacks { release: String, lacks: &'static str, since: &'static str, detail: String },
    #[error("the BPF object has no {kind} named '{name}': the build is inconsistent, rebuild limiter-ctl")]
    Missing { kind: &'static str, name: &'static str },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("interface '{0}' does not exist (see `ip link`)")]
    NoSuchInterface(String),
    #[error("attaching to {iface} at {} in {mode} mode failed: {source}", hook.name())]
    Attach {
        hook: Hook,
        iface: String,
        mode: &'static str,
        #[source]
        source: ProgramError,
    },
    #[error("detaching from {iface} failed: {source}")]
    Detach {
        iface: String,
        #[source]
        source: ProgramError,
    },
    #[error("the OS random number generator failed: {0}")]
    Salt(getrandom::Error),
    #[error("bucket count {0} is not a power of two between {MIN_BUCKETS} and {MAX_BUCKETS}")]
    Buckets(u32),
    #[error("row count {0} is not between 1 and {max}", max = limiter_common::rows::MAX_ROWS)]
    Rows(u32),
    #[error("host row count {0} is not between 1 and {max}", max = limiter_common::rows::MAX_HOST_ROWS)]
    HostRows(u32),
    #[cfg(feature = "testing")]
    #[error("test run failed: {0}")]
    TestRun(#[source] ProgramError),
    #[error(
        "cannot adopt the limiter pinned at {dir}: {why}; `limiter-ctl detach` removes it (and its state) so a new one can start"
    )]
    Adopt { dir: PathBuf, why: Incompatible },
    #[error("a salt rotation is in progress: its grace period ends in {seconds_left} s; try again then")]
    RotationBusy { seconds_left: u64 },
    // The pins on bpffs. (Fields named `error`, not `source`: the message already says it.)
    #[error("{doing} {path}: {error}")]
    PinFile { doing: &'static str, path: PathBuf, error: io::Error },
    #[error("removing {dir}: {error} (is something else pinned there?)")]
    PinDirBusy { dir: PathBuf, error: io::Error },
    #[error("{dir} is not on a BPF filesystem; mount one (mount -t bpf bpf {BPFFS}) or choose --pin-dir under it")]
    NotBpffs { dir: PathBuf },
    #[error("bpffs is not mounted at {BPFFS} and mounting it failed ({0}); mount it with `mount -t bpf bpf {BPFFS}`")]
    MountBpffs(nix::Error),
    #[error("opening {path}: {error}")]
    OpenPinnedLink { path: PathBuf, error: LinkError },
    #[error("{path}: not a link the limiter can take over ({error})")]
    PinnedLinkInvalid { path: PathBuf, error: LinkError },
    #[error("{path} is a {found} link, not an XDP or tcx one: not the limiter's; `limiter-ctl detach` removes it")]
    PinnedLinkType { path: PathBuf, found: String },
    #[error("{path}: a pinned program that cannot be read ({error}); `limiter-ctl detach` removes it")]
    PinnedProgram { path: PathBuf, error: Box<ProgramError> },
    #[error("the link is not a bpf_link ({0}); this kernel cannot pin it")]
    NotBpfLink(LinkError),
    #[error("pinning {path}: {error}")]
    PinLink { path: PathBuf, error: PinError },
    #[error("pinning {path}: {error}")]
    PinMap { path: PathBuf, error: PinError },
    // One owner per interface and pin directory (the directory's flock).
    #[error(
        "another limiter daemon ({owner}) owns {dir} and keeps enforcing there; nothing was changed. One daemon per \
         interface: stop that one first (`systemctl stop limiter` or `limiter@IFACE`, or kill it), or choose another \
         --iface"
    )]
    Owned { dir: PathBuf, owner: Owner },
    #[error(
        "a running limiter daemon ({owner}) owns {iface} ({dir}); nothing was removed. Stop it first (`systemctl stop \
         limiter` or `limiter@{iface}`: the program stays attached until this detach), or pass --force to stop it and \
         detach"
    )]
    DetachOwned { iface: String, dir: PathBuf, owner: Owner },
    /// Another limiter (under another pin directory) already judges on the interface.
    #[error("{0}")]
    OtherLimiter(Box<super::OtherLimiter>),
    #[error("sending SIGTERM to the daemon that owns the interface (pid {pid}) failed: {error}")]
    StopOwner { pid: u32, error: nix::Error },
    #[error("the daemon that owns the interface (pid {pid}) still runs {waited:?} after SIGTERM; nothing was removed")]
    OwnerStayed { pid: u32, waited: std::time::Duration },
    #[error("locking {dir}: {error}")]
    Lock { dir: PathBuf, error: nix::Error },
    #[error("{failed} of {of} interfaces could not be detached; the first: {first}")]
    DetachSome { report: String, failed: usize, of: usize, first: Box<Error> },
    #[error(
        "{iface} already has another {holder}: remove it first (`ip link set dev {iface} xdp off` if netlink attached \
         it; `bpftool net` shows who holds it; a limiter pinned under another --pin-dir: `limiter-ctl detach --iface \
         {iface} --pin-dir DIR`) [{source}]"
    )]
    Occupied { iface: String, holder: Box<XdpProgram>, source: Box<Error> },
    // tc ingress through tcx.
    #[error("listing the programs at tc ingress of {iface} failed: {source}")]
    TcxQuery {
        iface: String,
        #[source]
        source: ProgramError,
    },
    #[error(
        "no program '{prog}' at tc ingress of {iface} (there: {chain}); name one of those, by the name `bpftool \
         prog` shows or as id:N"
    )]
    NoSuchTcxProgram { iface: String, prog: String, chain: String },
    #[error("'{prog}' names several programs at tc ingress of {iface} ({ids}): name one by its id")]
    AmbiguousTcxProgram { iface: String, prog: String, ids: String },
    #[error("neither XDP nor tc ingress of {iface} took the program: at XDP, {xdp}; at tc ingress, {tc}")]
    NoHook { iface: String, xdp: String, tc: String },
    #[error(
        "attaching at tc ingress of {iface} through tcx failed: {why}. `--tc-api auto` (the default) or `netlink` \
         attaches through a filter on the clsact qdisc instead"
    )]
    NoTcx { iface: String, why: String },
    // tc ingress through netlink (a filter on the clsact qdisc).
    #[error("listing the filters at tc ingress of {iface} (netlink) failed: {error}")]
    TcFilterQuery { iface: String, error: io::Error },
    #[error("adding the clsact qdisc to {iface} (for the limiter's tc filter) failed: {source}")]
    Clsact {
        iface: String,
        #[source]
        source: aya::programs::tc::TcError,
    },
    #[error(
        "priority {priority} at tc ingress of {iface}: {why}; nothing changed. Name another neighbour with \
         --tcx-before/--tcx-after (`tc filter show dev {iface} ingress` lists the filters), or move that filter"
    )]
    TcPriority { iface: String, priority: u16, why: String },
    #[error(
        "'{prog}' runs at tcx on {iface}, and tcx runs before every tc filter: the limiter's filter (netlink) cannot \
         run before it; nothing changed. --tcx-after it (or nothing) is where a filter runs anyway; `--tc-api tcx` \
         attaches through tcx, where the order is free"
    )]
    TcxBeforeFilter { iface: String, prog: String },
    // What this build's own maps should never do.
    #[error("internal error: {0} is not a per-CPU array")]
    NotPerCpu(&'static str),
    #[error("internal error: {0} is not an array")]
    NotArray(&'static str),
    #[error("internal error: reattach without an attachment")]
    NotAttached,
    #[error("internal error: {map}: {error}")]
    AclEntry { map: &'static str, error: ipnet::PrefixLenError },
    #[error("internal error: {what}: {error}")]
    Cpus { what: &'static str, error: io::Error },
    #[error("internal error: per-CPU values: {0}")]
    PerCpuValues(io::Error),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl Error {
    /// Bad input (a program named at tc ingress that is not there, a place there that cannot be
    /// had): nothing was changed.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            Self::NoSuchTcxProgram { .. }
                | Self::AmbiguousTcxProgram { .. }
                | Self::TcPriority { .. }
                | Self::TcxBeforeFilter { .. }
        )
    }

    /// The kernel cannot run the limiter at all ([`Error::KernelLacks`]).
    pub fn is_unsupported_kernel(&self) -> bool {
        matches!(self, Self::KernelLacks { .. })
    }
}

/// Where a rejected program's verifier log went, for [`Error::Rejected`]'s message.
fn saved_note(saved: &Option<PathBuf>) -> String {
    match saved {
        Some(path) => format!(" (the verifier's whole log: {})", path.display()),
        None => String::new(),
    }
}

/// Why the maps pinned by a predecessor cannot be adopted.
#[derive(Debug)]
pub enum Incompatible {
    /// A map is not there, or not readable.
    Unreadable { map: &'static str, error: MapError },
    /// A map differs from what this build creates.
    Shape { map: &'static str, found: MapShape, needs: MapShape },
    /// The maps are of another layout version.
    Layout { found: u64 },
    /// The buckets are split into another number of rows.
    Rows { found: u32, needs: u32 },
    /// The host-scope buckets are split into another number of rows.
    HostRows { found: u32, needs: u32 },
}

/// A map's type, key size, value size and entries.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MapShape {
    pub kind: Option<MapType>,
    pub key: u32,
    pub value: u32,
    pub entries: u32,
}

impl fmt::Display for Incompatible {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unreadable { map, error } => write!(f, "map {map} is not readable ({error})"),
            Self::Shape { map, found, needs } => {
                write!(
                    f,
                    "map {map} is {} with {}-byte keys, {}-byte values and {} entries; this build needs {} with \
                     {}-byte keys, {}-byte values and {} entries",
                    kind_words(found.kind),
                    found.key,
                    found.value,
                    found.entries,
                    kind_words(needs.kind),
                    needs.key,
                    needs.value,
                    needs.entries
                )?;
                let flag = match *map {
                    limiter_common::maps::MAP_BUCKETS => Some("--buckets"),
                    limiter_common::maps::MAP_HOST_BUCKETS => Some("--host-buckets"),
                    _ => None,
                };
                if let Some(flag) = flag.filter(|_| found.entries != needs.entries) {
                    write!(
                        f,
                        " (it was pinned with {flag} {}; start with that, or detach first)",
                        found.entries / limiter_common::maps::GENERATIONS
                    )
                } else {
                    f.write_str(" (pinned by another version of limiter)")
                }
            }
            Self::Layout { found } => {
                write!(f, "its maps are layout version {found}, this build uses {LAYOUT_VERSION}")
            }
            Self::Rows { found, needs } => {
                write!(f, "its buckets are split into {found} rows, this daemon was started with --rows {needs}")
            }
            Self::HostRows { found, needs } => {
                write!(f, "its host-scope buckets are split into {found} rows, this daemon uses {needs}")
            }
        }
    }
}

/// A map type in words, for messages ("a per-CPU array"), never Rust's `Some(PerCpuArray)`.
fn kind_words(kind: Option<MapType>) -> &'static str {
    match kind {
        Some(MapType::Array) => "an array",
        Some(MapType::PerCpuArray) => "a per-CPU array",
        Some(MapType::Hash) => "a hash map",
        Some(MapType::PerCpuHash) => "a per-CPU hash map",
        Some(MapType::LruHash) => "an LRU hash map",
        Some(MapType::LruPerCpuHash) => "a per-CPU LRU hash map",
        Some(MapType::LpmTrie) => "an LPM trie",
        Some(MapType::RingBuf) => "a ring buffer",
        Some(MapType::PerfEventArray) => "a perf event array",
        Some(_) => "a map of another type",
        None => "a map of a type this build does not know",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_incompatible_map_is_described_in_words() {
        let shape = |kind, entries| MapShape { kind, key: 4, value: 8, entries };
        let why = Incompatible::Shape {
            map: limiter_common::maps::MAP_BUCKETS,
            found: shape(Some(MapType::Array), 2048),
            needs: shape(Some(MapType::PerCpuArray), 4096),
        };
        let text = Error::Adopt { dir: "/sys/fs/bpf/limiter/eth0".into(), why }.to_string();
        assert!(text.contains("is an array with 4-byte keys, 8-byte values and 2048 entries"), "{text}");
        assert!(text.contains("needs a per-CPU array with 4-byte keys, 8-byte values and 4096 entries"), "{text}");
        assert!(text.contains("--buckets 1024"), "{text}");
        for debug in ["Some(", "None", "PerCpuArray", "Array "] {
            assert!(!text.contains(debug), "{debug} in {text}");
        }
        let unknown =
            Incompatible::Shape { map: "CONFIG", found: shape(None, 1), needs: shape(Some(MapType::Array), 1) };
        assert!(!unknown.to_string().contains("None"), "{unknown}");
    }
}

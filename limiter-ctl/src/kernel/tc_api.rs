//! Which API attaches the limiter at tc ingress: a tcx link (Linux 6.6+), or a filter on the
//! clsact qdisc made through netlink (every kernel the limiter runs on). The operator picks one
//! (`--tc-api`), or the daemon asks the kernel whether it has tcx ([`tcx_present`]).
//!
//! The question is asked of the kernel, not of its version: distributions backport tcx, and a
//! version number cannot say so. The probe touches no interface: it asks for a tcx link at
//! interface index 0, which no interface has. A kernel with tcx looks the interface up and
//! answers ENODEV; one without refuses the attach type itself, EINVAL, before any lookup. The
//! program it offers is two instructions of its own (a classifier that returns 0), loaded for the
//! question and closed with it.

use std::{fmt, os::fd::AsRawFd as _, sync::OnceLock};

use nix::errno::Errno;
use serde::{Deserialize, Serialize};

use super::{
    Error, TcxPlace,
    sys::{BPF_LINK_CREATE, BPF_PROG_LOAD, bpf},
    tc_filter, tcx,
};
use crate::test_hook::pretend_no_tcx;

/// The API an operator asks for at tc ingress.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TcApiRequest {
    /// tcx where the kernel has it (6.6 and later), a netlink filter where it does not.
    #[default]
    Auto,
    /// A tcx link only: fails on a kernel without tcx.
    Tcx,
    /// A filter on the clsact qdisc, through netlink, even where tcx exists (beside other tools'
    /// tc filters, in an order of priorities).
    Netlink,
}

/// The API the limiter is attached through at tc ingress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcApi {
    Tcx,
    Netlink,
}

/// Why the limiter is attached at tc ingress through netlink rather than tcx.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApiReason {
    /// The kernel has no tcx (`release`: the kernel's, as `uname -r` says it).
    NoTcx { release: String, pretended: bool },
    /// `--tc-api netlink`.
    Asked,
    /// A pinned limiter's filter was adopted, on a kernel that has tcx.
    Kept,
}

impl ApiReason {
    /// A word for metrics' labels: `no_tcx`, `asked` or `kept`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoTcx { .. } => "no_tcx",
            Self::Asked => "asked",
            Self::Kept => "kept",
        }
    }
}

impl fmt::Display for ApiReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoTcx { release, pretended: false } => write!(f, "tcx needs Linux 6.6; this kernel is {release}"),
            Self::NoTcx { release, pretended: true } => write!(
                f,
                "tcx needs Linux 6.6; this kernel ({release}) has it, but {} asks the daemon to act as if not (a test)",
                crate::test_hook::NO_TCX
            ),
            Self::Asked => f.write_str("asked for (--tc-api netlink)"),
            Self::Kept => f.write_str("kept: the pinned limiter's filter, adopted in place"),
        }
    }
}

/// The API `want` gives on this kernel, and why it is netlink when it is. A probe the kernel does
/// not answer (a sandbox refusing BPF_PROG_LOAD of a classifier, say) gives tcx: attaching then
/// says what is wrong.
pub(super) fn choose(want: TcApiRequest) -> (TcApi, Option<ApiReason>) {
    match want {
        TcApiRequest::Tcx => (TcApi::Tcx, None),
        TcApiRequest::Netlink => (TcApi::Netlink, Some(ApiReason::Asked)),
        TcApiRequest::Auto => match no_tcx() {
            Some(reason) => (TcApi::Netlink, Some(reason)),
            None => (TcApi::Tcx, None),
        },
    }
}

/// Refuses a `place` that cannot be had at tc ingress of `iface` through the API `want` gives
/// here: naming a program that is not there (or names several), or, through netlink, a priority
/// another filter holds.
pub(crate) fn check_place(iface: &str, place: &TcxPlace, want: TcApiRequest) -> Result<(), Error> {
    match choose(want).0 {
        TcApi::Tcx => tcx::link_order(iface, place).map(drop),
        TcApi::Netlink => tc_filter::priority_for(iface, place).map(drop),
    }
}

/// Why tcx cannot be used here, if it cannot: the kernel has none (or a test says so).
pub(super) fn no_tcx() -> Option<ApiReason> {
    let release = || nix::sys::utsname::uname().map(|u| u.release().to_string_lossy().into_owned()).unwrap_or_default();
    if pretend_no_tcx() {
        return Some(ApiReason::NoTcx { release: release(), pretended: true });
    }
    (tcx_present() == Ok(false)).then(|| ApiReason::NoTcx { release: release(), pretended: false })
}

/// Whether the kernel has tcx, asked once per process.
pub(super) fn tcx_present() -> Result<bool, Errno> {
    static ANSWER: OnceLock<Result<bool, Errno>> = OnceLock::new();
    *ANSWER.get_or_init(probe)
}

// The program type and attach type the probe uses (include/uapi/linux/bpf.h).
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_TCX_INGRESS: u32 = 46;

/// The leading fields of `union bpf_attr` for BPF_PROG_LOAD.
#[repr(C)]
struct ProgLoad {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
}

/// The leading fields of `union bpf_attr` for BPF_LINK_CREATE; a tcx link's relative program
/// and revision, after them, zero.
#[repr(C)]
struct LinkCreate {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

/// Asks the kernel for a tcx link at interface 0 for a classifier that returns 0: ENODEV means it
/// has tcx, EINVAL that it has not; another answer is passed on.
fn probe() -> Result<bool, Errno> {
    // r0 = 0; exit.
    let insns: [u64; 2] =
        [u64::from_le_bytes([0xb7, 0, 0, 0, 0, 0, 0, 0]), u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0])];
    let license = c"GPL";
    let load = ProgLoad {
        prog_type: BPF_PROG_TYPE_SCHED_CLS,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
    };
    let program = bpf(BPF_PROG_LOAD, &load)?;
    let link =
        LinkCreate { prog_fd: program.as_raw_fd() as u32, target_ifindex: 0, attach_type: BPF_TCX_INGRESS, flags: 0 };
    match bpf(BPF_LINK_CREATE, &link) {
        Err(Errno::ENODEV) => Ok(true),
        Err(Errno::EINVAL) => Ok(false),
        Err(other) => Err(other),
        // Interface 0 took a link: no kernel does that; the answer is unknown.
        Ok(_) => Err(Errno::EEXIST),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reason_for_netlink_is_said_in_one_line() {
        let no = ApiReason::NoTcx { release: "6.1.0-50-amd64".into(), pretended: false };
        assert_eq!(no.to_string(), "tcx needs Linux 6.6; this kernel is 6.1.0-50-amd64");
        assert_eq!(no.code(), "no_tcx");
        let test = ApiReason::NoTcx { release: "6.18.4".into(), pretended: true }.to_string();
        assert!(test.contains("LIMITER_TEST_NO_TCX") && !test.contains('\n'), "{test}");
        assert_eq!(choose(TcApiRequest::Netlink), (TcApi::Netlink, Some(ApiReason::Asked)));
        assert_eq!(choose(TcApiRequest::Tcx), (TcApi::Tcx, None));
    }
}

//! What the kernel must offer the limiter, probed before it loads (as Cilium probes its
//! features): a kernel that lacks one is refused at start in one line naming the kernel and what
//! it lacks (`Error::KernelLacks`, exit 4), not with a verifier's log.
//!
//! Probed, not read off the version: distributions backport (RHEL 9's 5.14 has BPF atomics).
//! The minimum is Linux 5.12, for BPF atomics; everything else the limiter needs came before:
//! the ring buffer (5.8), bpf_link at XDP (5.9), global functions taking the context (5.6).
//! tc ingress through tcx (6.6) is not required: the hook falls back to tc through netlink.

use aya::{
    Ebpf,
    maps::MapType,
    programs::{ProgramError, ProgramType, Xdp},
    sys::BpfHelper,
};
use limiter_common::maps::PROBE_CAS;

use super::Error;

/// The oldest kernel the limiter runs on, for the messages.
pub const MINIMUM: &str = "5.12";

/// What can be probed before the object loads: its maps. The ring buffer of sampled refusals.
pub(super) fn require_maps() -> Result<(), Error> {
    match aya::sys::is_map_supported(MapType::RingBuf) {
        Ok(true) => Ok(()),
        Ok(false) => Err(lacks("the BPF ring buffer", "5.8", "BPF_MAP_TYPE_RINGBUF refused".into())),
        // The probe itself failed (no CAP_BPF, say): the load says why, in its own words.
        Err(_) => Ok(()),
    }
}

/// What needs the loaded object: BPF atomics, by loading [`PROBE_CAS`] (one compare-and-exchange;
/// released again when the object goes). Before 5.12 the verifier refuses it ("BPF_STX uses
/// reserved fields").
pub(super) fn require_programs(ebpf: &mut Ebpf) -> Result<(), Error> {
    let program = ebpf.program_mut(PROBE_CAS).ok_or(Error::Missing { kind: "program", name: PROBE_CAS })?;
    let probe: &mut Xdp = program.try_into().map_err(Error::Program)?;
    match probe.load() {
        Ok(()) => Ok(()),
        Err(ProgramError::LoadError { io_error, verifier_log }) => {
            let log = verifier_log.to_string();
            let said = super::verifier::last_words(&log).unwrap_or("no reason given");
            Err(lacks(
                "BPF atomics (compare-and-exchange), which host scope shares buckets with",
                "5.12",
                format!("the verifier said: {said} ({io_error})"),
            ))
        }
        Err(other) => Err(Error::Program(other)),
    }
}

/// Whether XDP programs may call `bpf_xdp_adjust_meta`, which the hand-over's mark needs (the
/// packet's metadata: `program::mark_judged`). Some kernels refuse it ("program of this type
/// cannot use helper"), though they run XDP; the limiter then loads without the call, and
/// during a move between hooks both judge what XDP passed (the strict side). Probed once per
/// process; a probe that cannot run counts as offered (the load then says what is wrong).
pub fn xdp_metadata() -> bool {
    static OFFERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFFERED.get_or_init(|| {
        let offered =
            aya::sys::is_helper_supported(ProgramType::Xdp, BpfHelper::BPF_FUNC_xdp_adjust_meta).unwrap_or(true);
        if !offered {
            tracing::info!(
                kernel = %release(),
                "this kernel refuses bpf_xdp_adjust_meta to XDP programs: loaded without the hand-over's \
                 mark, so while a move between XDP and tc has both hooks hold the limiter, both judge what XDP \
                 passes (the strict side)"
            );
        }
        offered
    })
}

fn lacks(lacks: &'static str, since: &'static str, detail: String) -> Error {
    Error::KernelLacks { release: release(), lacks, since, detail }
}

/// The running kernel's release (`uname -r`).
pub fn release() -> String {
    nix::sys::utsname::uname().map_or_else(|_| "(unknown)".into(), |u| u.release().to_string_lossy().into_owned())
}

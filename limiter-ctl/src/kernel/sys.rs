//! The few bpf(2) calls aya does not offer: the tcx probe's (`tc_api`: aya loads programs from
//! an object file only, and its tcx attach needs a real interface) and the kind of a pinned
//! object (`pinned`: aya opens a pin as a program or a link, but cannot say which it is). Each attribute is the leading `repr(C)` fields of `union bpf_attr`
//! (include/uapi/linux/bpf.h); the kernel reads the rest as zero.

use std::{
    ffi::CString,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use nix::{errno::Errno, libc};

pub(super) const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_GET: libc::c_long = 7;
pub(super) const BPF_LINK_CREATE: libc::c_long = 28;

/// bpf(`cmd`, `attr`): the descriptor it returns, or its errno.
pub(super) fn bpf<T>(cmd: libc::c_long, attr: &T) -> Result<OwnedFd, Errno> {
    // SAFETY: `attr` is a live, initialised `repr(C)` prefix of `union bpf_attr`, its size given;
    // the kernel reads it only (and pointers in it point at live memory of the caller's).
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *const T, size_of::<T>() as u32) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: a descriptor the kernel just returned, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[repr(C)]
struct ObjGet {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// Whether the object pinned at `path` is a program (not a link or a map), as bpftool tells:
/// the descriptor's anonymous inode is `bpf-prog`.
pub fn pinned_is_program(path: &Path) -> Result<bool, Errno> {
    let path = CString::new(path.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)?;
    let fd = bpf(BPF_OBJ_GET, &ObjGet { pathname: path.as_ptr() as u64, bpf_fd: 0, file_flags: 0 })?;
    let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(|_| Errno::ENOENT)?;
    Ok(target.as_os_str() == "anon_inode:bpf-prog")
}

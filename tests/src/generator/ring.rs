//! The packet-ring sender: an AF_PACKET socket with a TX ring (TPACKET_V2) that bypasses the
//! qdisc, for machines that refuse live frames. Userspace writes frames into the shared ring,
//! each the template moved to its source ([`Template::write_nth`]), and one `send` a batch hands
//! them all to the kernel, which builds an skb of each and gives it straight to the driver.
//!
//! Written against the kernel's packet_mmap ABI with `libc`: the crates that wrap a TX ring
//! bring a whole capture framework with them, for what is here a loop over slots.
//!
//! The socket is opened by each [`PacketRing::send`], in the calling thread's network namespace
//! (an AF_PACKET socket sends in the namespace it was made in): call it from inside the
//! sender's, pinned, as with live frames.

use std::{
    io,
    num::NonZeroUsize,
    os::fd::{AsRawFd as _, OwnedFd},
    ptr::NonNull,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

use super::Template;
use crate::flood::{Throttle, bind_ll, ifindex, packet_socket};

/// Bytes of a slot: the kernel's header (32 bytes, aligned) and the frame after it.
const FRAME_SIZE: usize = 256;
/// Slots in the ring: 1 MiB. Frames wait in it no longer than one batch's transmission.
const FRAMES: usize = 4096;
const BLOCK_SIZE: usize = 1 << 16;
/// Slots filled before one `send` hands them over: a system call's cost spread over many frames,
/// and the deadline checked that often.
const BATCH: usize = 256;
/// The longest a `send` may wait for its frames to leave; past it the flood fails. The frames
/// of a batch go in microseconds: this only keeps a stuck device from hanging a test.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// Where a frame starts in its slot when sending: the header, aligned (TPACKET2_HDRLEN less the
/// sockaddr_ll that only received frames carry).
const DATA: usize = (size_of::<libc::tpacket2_hdr>() + libc::TPACKET_ALIGNMENT - 1) & !(libc::TPACKET_ALIGNMENT - 1);

/// Whether this machine gives a TX ring to an AF_PACKET socket (in the caller's namespace).
pub fn allowed() -> anyhow::Result<()> {
    Ring::open().map(drop)
}

pub struct PacketRing {
    template: Template,
}

impl PacketRing {
    pub fn new(template: Template) -> anyhow::Result<Self> {
        ensure!(
            template.frame.len() <= FRAME_SIZE - DATA,
            "a frame of {} bytes does not fit the ring's slots of {} bytes",
            template.frame.len(),
            FRAME_SIZE - DATA
        );
        Ok(Self { template })
    }

    /// Sends until `deadline` (checked once a batch), or until `frames` are sent; returns how
    /// many were. A frame counts once the kernel took it from the ring and handed it to the
    /// device, as with live frames: what the device then drops is the receiver's to count.
    pub fn send(&self, iface: &str, frames: u64, deadline: Instant, throttle: Option<Throttle>) -> anyhow::Result<u64> {
        let mut ring = Ring::open()?;
        bind_ll(&ring.fd, ifindex(iface)?, 0).with_context(|| format!("binding the packet ring to {iface}"))?;
        let (count, len) = (self.template.sources.count, self.template.frame.len());
        let (mut queued, mut source) = (0u64, 0u32);
        while queued < frames && Instant::now() < deadline {
            let before = Instant::now();
            let batch = (frames - queued).min(BATCH as u64) as usize;
            let mut filled = 0;
            while filled < batch {
                let Some(slot) = ring.free_slot() else { break };
                self.template.write_nth(source, ring.data(slot, len));
                ring.request(slot, len);
                source = if source + 1 == count { 0 } else { source + 1 };
                filled += 1;
            }
            queued += filled as u64;
            ring.flush()?;
            if let Some(t) = throttle {
                t.after(before.elapsed());
            }
        }
        ring.drain()?;
        ring.check_formats()?;
        Ok(queued)
    }
}

/// The socket and its mapped ring.
struct Ring {
    fd: OwnedFd,
    base: NonNull<libc::c_void>,
    /// The next slot to fill (slots are filled and sent in order).
    next: usize,
}

impl Ring {
    fn open() -> anyhow::Result<Self> {
        let fd = packet_socket()?;
        set(&fd, libc::SOL_PACKET, libc::PACKET_VERSION, libc::tpacket_versions::TPACKET_V2 as libc::c_int)
            .context("asking for TPACKET_V2")?;
        // Straight to the driver, as a NIC's generator would: no qdisc in the measured path.
        set(&fd, libc::SOL_PACKET, libc::PACKET_QDISC_BYPASS, 1).context("PACKET_QDISC_BYPASS")?;
        let timeout = libc::timeval { tv_sec: SEND_TIMEOUT.as_secs() as libc::time_t, tv_usec: 0 };
        set(&fd, libc::SOL_SOCKET, libc::SO_SNDTIMEO, timeout).context("SO_SNDTIMEO")?;
        let req = libc::tpacket_req {
            tp_block_size: BLOCK_SIZE as u32,
            tp_block_nr: (FRAMES * FRAME_SIZE / BLOCK_SIZE) as u32,
            tp_frame_size: FRAME_SIZE as u32,
            tp_frame_nr: FRAMES as u32,
        };
        set(&fd, libc::SOL_PACKET, libc::PACKET_TX_RING, req).context("PACKET_TX_RING (an AF_PACKET TX ring)")?;
        let size = NonZeroUsize::new(FRAMES * FRAME_SIZE).context("an empty ring")?;
        // SAFETY: a new shared mapping of the socket's ring, unmapped on drop; nothing aliases it.
        let base =
            unsafe { mmap(None, size, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED, &fd, 0) }
                .context("mapping the TX ring")?;
        Ok(Self { fd, base, next: 0 })
    }

    fn header(&self, slot: usize) -> *mut libc::tpacket2_hdr {
        // SAFETY: slot < FRAMES, so the header lies inside the mapping.
        unsafe { self.base.as_ptr().cast::<u8>().add(slot * FRAME_SIZE).cast() }
    }

    /// The slot's status word, shared with the kernel.
    fn status(&self, slot: usize) -> &AtomicU32 {
        // SAFETY: tp_status is the header's first field, a u32 at a 16-byte aligned address that
        // lives as long as the mapping.
        unsafe { &*self.header(slot).cast::<AtomicU32>() }
    }

    /// The next slot, if the kernel is done with it.
    fn free_slot(&mut self) -> Option<usize> {
        let slot = self.next;
        (self.status(slot).load(Ordering::Acquire) == libc::TP_STATUS_AVAILABLE).then(|| {
            self.next = (slot + 1) % FRAMES;
            slot
        })
    }

    fn data(&mut self, slot: usize, len: usize) -> &mut [u8] {
        // SAFETY: the slot is ours (AVAILABLE) until `request`; DATA + len <= FRAME_SIZE.
        unsafe { std::slice::from_raw_parts_mut(self.header(slot).cast::<u8>().add(DATA), len) }
    }

    /// Hands the slot's frame of `len` bytes to the kernel.
    fn request(&mut self, slot: usize, len: usize) {
        // SAFETY: the slot is ours until its status says otherwise (set last, with Release).
        unsafe {
            (*self.header(slot)).tp_len = len as u32;
        }
        self.status(slot).store(libc::TP_STATUS_SEND_REQUEST, Ordering::Release);
    }

    /// Sends every requested slot and waits until the kernel is done with them. A transient
    /// refusal (the device's queue full) leaves the rest requested: the next call sends them.
    fn flush(&self) -> anyhow::Result<()> {
        // SAFETY: a send with no buffer: the kernel reads the ring instead.
        if unsafe { libc::send(self.fd.as_raw_fd(), std::ptr::null(), 0, 0) } >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENOBUFS | libc::EAGAIN | libc::EINTR) => Ok(()),
            _ => Err(e).context("sending the TX ring's frames"),
        }
    }

    /// Flushes until no slot is left requested (a refused flush leaves some), for at most
    /// [`SEND_TIMEOUT`]: then every frame counted has been handed to the device.
    fn drain(&self) -> anyhow::Result<()> {
        let until = Instant::now() + SEND_TIMEOUT;
        let requested = || (0..FRAMES).any(|s| self.status(s).load(Ordering::Acquire) == libc::TP_STATUS_SEND_REQUEST);
        while requested() {
            ensure!(Instant::now() < until, "the device took no frame of the TX ring for {SEND_TIMEOUT:?}");
            self.flush()?;
        }
        Ok(())
    }

    /// Fails if the kernel refused a frame as malformed (it would be left out silently).
    fn check_formats(&self) -> anyhow::Result<()> {
        for slot in 0..FRAMES {
            if self.status(slot).load(Ordering::Acquire) & libc::TP_STATUS_WRONG_FORMAT != 0 {
                bail!("the kernel refused slot {slot}'s frame as malformed (TP_STATUS_WRONG_FORMAT)");
            }
        }
        Ok(())
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, of this size, no longer referenced.
        unsafe { munmap(self.base, FRAMES * FRAME_SIZE) }.ok();
    }
}

/// setsockopt of a plain value.
fn set<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: T) -> io::Result<()> {
    // SAFETY: `value` lives across the call and its size is passed with it.
    let r = unsafe {
        libc::setsockopt(fd.as_raw_fd(), level, name, (&raw const value).cast(), size_of::<T>() as libc::socklen_t)
    };
    if r < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

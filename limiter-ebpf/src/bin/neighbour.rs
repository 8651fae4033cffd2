//! Test-only: another tcx program on the interface, the "neighbour" the sharing tests
//! (tests/daemon/sharing/) load beside the limiter at tc ingress. `neighbour` counts every
//! packet it sees, and each IPv4 UDP flow's packets, and drops (TC_ACT_SHOT) IPv4 UDP to one
//! destination port, `DROP_PORT`, which the loader sets; everything else goes on to the next
//! program (TC_ACT_UNSPEC). So its counters say which packets reached it, and its drops say which
//! never reach a program after it. Loaded with no port and placed last, it counts per flow what
//! the programs before it let through: at tc ingress a packet tap (AF_PACKET) runs before the
//! programs, so it cannot.
#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{BPF_NOEXIST, TC_ACT_SHOT, TC_ACT_UNSPEC},
    macros::{classifier, map},
    maps::{PerCpuArray, PerCpuHashMap},
    programs::TcContext,
};

/// The UDP destination port it drops (host order; 0: none). Read-only data the loader sets.
#[unsafe(no_mangle)]
static DROP_PORT: u16 = 0;

/// Per CPU: [`SEEN`] every packet it ran on, [`DROPPED`] those it dropped.
#[map]
static NEIGHBOUR_COUNTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(2, 0);

/// Per CPU, packets of each IPv4 UDP flow it ran on (dropped or not): the key is the source
/// address (host order) << 32 | the destination port.
#[map]
static NEIGHBOUR_FLOWS: PerCpuHashMap<u64, u64> = PerCpuHashMap::with_max_entries(4096, 0);

const SEEN: u32 = 0;
const DROPPED: u32 = 1;

const ETH_P_IP: u16 = 0x0800;
const IPPROTO_UDP: u8 = 17;
const ETH_HLEN: usize = 14;

#[classifier]
pub fn neighbour(ctx: TcContext) -> i32 {
    count(SEEN);
    let Some((src, dport)) = udp_flow(&ctx) else { return TC_ACT_UNSPEC };
    count_flow(u64::from(src) << 32 | u64::from(dport));
    let port = unsafe { core::ptr::read_volatile(&DROP_PORT) };
    if port != 0 && dport == port {
        count(DROPPED);
        return TC_ACT_SHOT as i32;
    }
    TC_ACT_UNSPEC
}

fn count(index: u32) {
    if let Some(n) = NEIGHBOUR_COUNTS.get_ptr_mut(index) {
        unsafe { *n += 1 };
    }
}

fn count_flow(key: u64) {
    if let Some(n) = NEIGHBOUR_FLOWS.get_ptr_mut(key) {
        unsafe { *n += 1 };
    } else if NEIGHBOUR_FLOWS.insert(key, 1, u64::from(BPF_NOEXIST)).is_err()
        && let Some(n) = NEIGHBOUR_FLOWS.get_ptr_mut(key)
    {
        // Another CPU added the flow in between.
        unsafe { *n += 1 };
    }
}

/// The source address and destination port (host order) of an IPv4 UDP packet (not a later
/// fragment), from the Ethernet frame the skb holds at tc ingress.
fn udp_flow(ctx: &TcContext) -> Option<(u32, u16)> {
    let proto: u16 = ctx.load(12).ok()?;
    if u16::from_be(proto) != ETH_P_IP {
        return None;
    }
    let ver_ihl: u8 = ctx.load(ETH_HLEN).ok()?;
    let l4: u8 = ctx.load(ETH_HLEN + 9).ok()?;
    let frag: u16 = ctx.load(ETH_HLEN + 6).ok()?;
    if l4 != IPPROTO_UDP || u16::from_be(frag) & 0x1fff != 0 {
        return None;
    }
    let ihl = usize::from(ver_ihl & 0x0f) * 4;
    if ihl < 20 {
        return None;
    }
    let src: u32 = ctx.load(ETH_HLEN + 12).ok()?;
    let dport: u16 = ctx.load(ETH_HLEN + ihl + 2).ok()?;
    Some((u32::from_be(src), u16::from_be(dport)))
}

limiter_ebpf::program_object!();

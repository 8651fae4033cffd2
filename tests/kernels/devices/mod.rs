//! The devices operators have (issue 40), in the VM lab: a virtio_net NIC with several queue
//! pairs on a tap, VLANs on it, with Debian's kernels. One boot per kernel carries every case
//! ([`script`]); the host floods from the tap's side when the guest asks (`LAB-SEND`), and holds
//! what the guest measured to the bound:
//!
//! - **virtio_net, multiqueue** (`mq`, `untagged`): with `--attach xdp --mode auto` the daemon
//!   attaches natively or falls back to skb mode saying why, first with every channel in use (no
//!   spare TX queue for XDP), then after `ethtool -L eth0 combined 2`; what `ethtool -L` does
//!   while the program is attached is recorded. One source whose flows the tap's hash spreads
//!   over the queues, and so over both CPUs, gets one allowance (the default host scope):
//!   admitted at most B + R t, at least 90% of it.
//! - **VLANs on the parent** (`vlan`, `qinq`): frames with one tag, and with two (802.1ad, then
//!   802.1Q), judged by their inner IP header on `eth0`, held to the same bound.
//! - **A VLAN device** (`vlandev`): a second daemon, with its defaults, on `eth0.10` (VLAN 10 of
//!   `eth0`, pinned under `eth0:10`), enforcing
//!   the same bound on what arrives tagged on the parent.
//! - **Bonds** of two more virtio NICs (one queue each, each member's interrupt on a CPU of its
//!   own): the daemon on the bond (`--attach xdp --mode auto`) in balance-xor (`bond-xor`), then
//!   in active-backup (`bond-ab`), with the active member switched mid-flood. A source flooding
//!   over both members gets one allowance; every frame is judged, on either member.
//!
//! Every frame sent is judged (less what the tap dropped, counted), and what was admitted is
//! what reached the guest's socket.

mod host;
mod results;
mod script;

use std::{collections::BTreeMap, net::Ipv4Addr, path::Path, time::Duration};

use limiter_tests::{
    daemon::limiter_ctl_binary,
    netns::mac_str,
    vm::{Lab, Payload, say},
};

use host::{Flood, GUEST_MACS, HostNet};
use script::{BOND_PORT, BOND_V4, NIC_V4, PARENT_PORT, QINQ_IDS, QINQ_V4, VLAN_DEV_PORT, VLAN_ID, VLAN_V4};

/// Every policy of the guest: its rate and burst.
pub const RATE: u64 = 200;
pub const BURST: u64 = 100;
/// Each flood: paced at 15 times the rate (the guest, emulated, keeps up), for this long.
const PACE: f64 = 3_000.0;
const FLOOD: Duration = Duration::from_secs(2);
/// The first NIC's queue pairs (QEMU's `queues=`): twice the guest's CPUs.
const QUEUES: u32 = 4;

const TPID_8021Q: u16 = 0x8100;
const TPID_8021AD: u16 = 0x88a8;

#[test]
fn debian_12_bookworm_6_1() {
    devices("bookworm", "6.1.");
}

#[test]
fn trixie_backports_7() {
    devices("trixie-backports", "7.");
}

/// The floods in the order the guest asks for them.
const ORDER: [&str; 7] = ["mq", "untagged", "vlan", "qinq", "vlandev", "bond-xor", "bond-ab"];

/// The floods the guest asks for, by name: each from a source of its own (a fresh bucket).
fn floods() -> BTreeMap<&'static str, Flood> {
    let src = |n: u8| Ipv4Addr::new(198, 18, 20, n);
    let (outer, inner) = QINQ_IDS;
    BTreeMap::from([
        ("mq", Flood::new(src(2), NIC_V4, PARENT_PORT, &[])),
        ("untagged", Flood::new(src(3), NIC_V4, PARENT_PORT, &[])),
        ("vlan", Flood::new(src(4), VLAN_V4, PARENT_PORT, &[(TPID_8021Q, VLAN_ID)])),
        ("qinq", Flood::new(src(5), QINQ_V4, PARENT_PORT, &[(TPID_8021AD, outer), (TPID_8021Q, inner)])),
        ("vlandev", Flood::new(src(6), VLAN_V4, VLAN_DEV_PORT, &[(TPID_8021Q, VLAN_ID)])),
        ("bond-xor", Flood::over_bond(src(7), BOND_V4, BOND_PORT)),
        ("bond-ab", Flood::over_bond(src(8), BOND_V4, BOND_PORT)),
    ])
}

/// [`boot`], once more when it failed only because a stall of the emulated CPUs left too little
/// of a flood to measure its lower bound ("the machine was too busy"): that failure is the
/// machine's, and says nothing of the limiter (as the matrix does for its scenario tests). Any
/// other failure, and a second stall, stand.
fn devices(suite: &str, series: &str) {
    let first = std::panic::catch_unwind(|| boot(suite, series));
    let Err(panic) = first else { return };
    let message = panic.downcast_ref::<String>().map(String::as_str).or_else(|| panic.downcast_ref::<&str>().copied());
    if !message.is_some_and(|m| m.contains("the machine was too busy")) {
        std::panic::resume_unwind(panic);
    }
    say(&format!("devices ({suite}): the emulated CPUs stalled too long to measure the lower bound; once more"));
    boot(suite, series);
}

/// Boots `suite`'s kernel with the NIC and the script, floods on each `LAB-SEND`, then checks.
fn boot(suite: &str, series: &str) {
    let lab = Lab::open().unwrap_or_else(|e| panic!("{e:#}"));
    let kernel = super::kernel_of(&lab, suite, series);
    let net = HostNet::new().unwrap_or_else(|e| panic!("the host's namespace: {e:#}"));
    let payload = Payload::new(&script::script(QUEUES)).expect("the payload");
    let ctl = limiter_ctl_binary().unwrap_or_else(|e| panic!("{e:#}"));
    payload.add(&ctl, "target/release/limiter-ctl").expect("limiter-ctl");
    payload.add(Path::new(env!("CARGO_BIN_EXE_lab-measure")), "lab-measure").expect("lab-measure");
    let mut vm = lab.vm(suite).expect("the VM");
    vm.timeout = super::BOOT_LIMIT;
    vm.netns = Some(net.ns.clone());
    for (i, (tap, mac)) in net.taps.iter().zip(GUEST_MACS).enumerate() {
        // The first NIC has QUEUES queue pairs (a vector each way, one for config, one for the
        // control queue); the bond's members one each.
        let (queues, mq) =
            if i == 0 { (QUEUES, format!(",mq=on,vectors={}", 2 * QUEUES + 2)) } else { (1, String::new()) };
        vm.qemu_args.extend(
            [
                "-netdev".to_string(),
                format!("tap,id=n{i},ifname={tap},script=no,downscript=no,queues={queues}"),
                "-device".to_string(),
                format!("virtio-net-pci,netdev=n{i},mac={}{mq}", mac_str(&mac)),
            ]
            .map(Into::into),
        );
    }

    let floods = floods();
    let mut sent = BTreeMap::new();
    let mut failures = Vec::new();
    let out = vm
        .run_watching(&payload, |line| {
            // QEMU made the taps before the kernel booted; they are brought up before any flood
            // (at each boot: a guest the emulator faulted boots once more, with new taps).
            if line.starts_with("LAB-BEGIN ") {
                if let Err(e) = net.taps_up() {
                    failures.push(format!("bringing the taps up: {e:#}"));
                }
            }
            let Some(name) = line.strip_prefix("LAB-SEND name=") else { return };
            let Some(flood) = floods.get(name.trim()) else {
                failures.push(format!("the guest asked for a flood the host does not know: {name}"));
                return;
            };
            match net.send(flood, PACE, FLOOD) {
                Ok((report, dropped)) => {
                    say(&format!("devices: flood {name}: {report}, the tap dropped {dropped}"));
                    sent.insert(name.trim().to_string(), results::Sent { report, dropped });
                }
                Err(e) => {
                    say(&format!("devices: flood {name} failed: {e:#}"));
                    failures.push(format!("flood {name}: {e:#}"));
                }
            }
        })
        .unwrap_or_else(|e| panic!("{} ({suite}): {e:#}", kernel.release));
    assert!(failures.is_empty(), "on {} ({suite}):\n  {}", out.release, failures.join("\n  "));
    results::check(&out, suite, &ORDER, &sent);
}

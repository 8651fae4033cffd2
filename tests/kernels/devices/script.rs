//! The guest's side of the device tests: one shell script, run by the lab's init, that sets the
//! NIC up (its VLAN devices, its channels), starts the release daemon on it three times and
//! asks the host for a flood per case (`lab-measure`, which prints `LAB-SEND`, then
//! `LAB-RESULT`). What it prints, each line a `LAB-` marker the host reads:
//!
//! - `LAB-CHANNELS PHASE N`: the NIC's combined channels in use (`ethtool -l`).
//! - `LAB-RESIZE PHASE ok|refused MESSAGE`: `ethtool -L eth0 combined N`, and what it said.
//! - `LAB-MODE phase=PHASE iface=IFACE mode=MODE`: where the daemon attached (`stats --json`'s
//!   `attach_mode`), then its log's attach lines as `LAB-LOG IFACE ...` (a fallback's reason),
//!   and what the kernel logged of XDP meanwhile as `LAB-DMESG IFACE ...`.
//! - `LAB-SEND name=NAME`, `LAB-RESULT name=NAME ...`: one flood (tests/src/bin/lab-measure.rs).
//!
//! - `LAB-FAILOVER FROM TO`: the active-backup bond's active member switched, mid-flood.
//!
//! Phases: `A`, every channel in use (no spare TX queue for XDP); `B`, after `ethtool -L`, with
//! spare queues; `C`, a second daemon on the VLAN device `eth0.10`, with its defaults; `D`, a
//! daemon on a balance-xor bond of the two other NICs; `E`, on an active-backup bond of them;
//! `F`, on a balance-alb bond of them (no XDP in that mode: attach only).

use super::{BURST, RATE, host::GUEST_MACS};
use limiter_tests::netns::mac_str;

/// The ports of the policies: the parent's (`eth0`) and the VLAN device's (`eth0.10`), apart so
/// that the parent's limiter passes what the VLAN device's is to judge.
pub const PARENT_PORT: u16 = 7600;
pub const VLAN_DEV_PORT: u16 = 7800;

/// The guest's addresses: the NIC, its VLAN 10, and its QinQ device (802.1ad 20, 802.1Q 30).
pub const NIC_V4: [u8; 4] = [198, 18, 16, 1];
pub const VLAN_V4: [u8; 4] = [198, 18, 17, 1];
pub const QINQ_V4: [u8; 4] = [198, 18, 18, 1];
/// The bonds' address and their policy's port.
pub const BOND_V4: [u8; 4] = [198, 18, 19, 1];
pub const BOND_PORT: u16 = 7900;
pub const VLAN_ID: u16 = 10;
pub const QINQ_IDS: (u16, u16) = (20, 30);

/// The script, for a NIC with `queues` queue pairs.
pub fn script(queues: u32) -> String {
    let v4 = |a: [u8; 4]| format!("{}.{}.{}.{}", a[0], a[1], a[2], a[3]);
    let (outer, inner) = QINQ_IDS;
    format!(
        r#"set -u
M1={m1} M2={m2}
CTL=/lab/target/release/limiter-ctl
M=/lab/lab-measure
PINS=/sys/fs/bpf/limiter
modprobe -q 8021q
# No bond made at load (bond0 by default): the script makes its own.
modprobe -q bonding max_bonds=0
for c in all default; do sysctl -qw net.ipv4.conf.$c.rp_filter=0; done
ip link set eth0 up
ip addr add {nic}/24 dev eth0
# The usual name, with a dot: the daemon pins it under `eth0:{vlan}` (bpffs refuses dots).
ip link add link eth0 name eth0.{vlan} type vlan id {vlan}
ip link add link eth0 name eth0.{outer} type vlan proto 802.1ad id {outer}
ip link add link eth0.{outer} name eth0.{outer}.{inner} type vlan id {inner}
for i in eth0.{vlan} eth0.{outer} eth0.{outer}.{inner}; do
  ip link set $i up
  echo 0 >/proc/sys/net/ipv4/conf/$i/rp_filter
done
ip addr add {vlan_v4}/24 dev eth0.{vlan}
ip addr add {qinq_v4}/24 dev eth0.{outer}.{inner}

channels() {{
  echo "LAB-CHANNELS $1 $(ethtool -l eth0 | awk '/^Current/ {{c = 1}} c && /^Combined/ {{print $2; exit}}')"
}}
resize() {{
  if out=$(ethtool -L eth0 combined $2 2>&1); then echo "LAB-RESIZE $1 ok $out"; else echo "LAB-RESIZE $1 refused $out"; fi
}}
# start IFACE PHASE [DAEMON FLAGS]: a daemon on IFACE; once it serves, where it attached. No
# metrics endpoint: two daemons run at once, and the port is the same.
start() {{
  iface=$1 phase=$2
  shift 2
  $CTL --socket /tmp/$iface.sock daemon --iface $iface --config /tmp/$iface.toml --pin-dir $PINS \
    --state-dir /tmp/state-$iface --metrics off "$@" >/tmp/$iface.log 2>&1 &
  echo $! >/tmp/$iface.pid
  tries=0
  until grep -q " attached iface=" /tmp/$iface.log; do
    tries=$((tries + 1))
    if [ $tries -gt 1200 ] || ! kill -0 "$(cat /tmp/$iface.pid)" 2>/dev/null; then
      echo "LAB-MODE phase=$phase iface=$iface mode=none"
      sed "s/^/LAB-LOG $iface /" /tmp/$iface.log
      return 1
    fi
    sleep 0.5
  done
  until $CTL --socket /tmp/$iface.sock stats --json >/tmp/$iface.stats 2>/dev/null; do sleep 0.5; done
  mode=$(grep -o '"attach_mode": *"[a-z]*"' /tmp/$iface.stats | sed 's/.*: *"//; s/"$//')
  echo "LAB-MODE phase=$phase iface=$iface mode=$mode"
  grep -E "attached iface=|fell back|unavailable" /tmp/$iface.log | sed "s/^/LAB-LOG $iface /"
  ip -d link show dev $iface | grep -o 'prog/xdp[a-z]* id [0-9]*' | sed "s/^/LAB-LINK $iface /"
  # What the driver said of XDP (warnings stay off the console under `quiet`).
  dmesg | grep -i xdp | sed "s/^/LAB-DMESG $iface /"
  dmesg -C
}}
# policy IFACE PORT: one enforcing policy, host scope (the default), of the test's rate; its
# id in $id.
policy() {{
  $CTL --socket /tmp/$1.sock policy set flood --match udp:$2 --rate {rate}/s --burst {burst} --key src/32,/64 \
    --enforce >/dev/null
  id=$($CTL --socket /tmp/$1.sock policy show flood --json | grep -o '"id": *[0-9]*' | grep -o '[0-9]*$' | head -1)
}}
stop() {{
  kill -TERM "$(cat /tmp/$1.pid)"
  wait "$(cat /tmp/$1.pid)"
}}

channels before
resize A {queues}
channels A
start eth0 A --attach xdp --mode auto || exit 1
policy eth0 {parent}
$M mq {parent} $PINS/eth0 eth0 $id
resize attached 2
stop eth0
$CTL detach --iface eth0 --pin-dir $PINS
resize B 2
channels B
start eth0 B --attach xdp --mode auto || exit 1
policy eth0 {parent}
$M untagged {parent} $PINS/eth0 eth0 $id
$M vlan {parent} $PINS/eth0 eth0 $id
$M qinq {parent} $PINS/eth0 eth0 $id
start eth0.{vlan} C || exit 1
policy eth0.{vlan} {vlan_dev}
$M vlandev {vlan_dev} $PINS/eth0:{vlan} eth0 $id
stop eth0.{vlan}
stop eth0

nic() {{
  for d in /sys/class/net/*; do [ "$(cat $d/address 2>/dev/null)" = "$1" ] && echo "${{d##*/}}"; done
}}
# pin_irq NIC MASK: the NIC's receive interrupt on the CPUs of MASK.
pin_irq() {{
  dev=$(basename "$(readlink /sys/class/net/$1/device)")
  irq=$(awk -v q="$dev-input.0" '$NF == q {{sub(":", "", $1); print $1}}' /proc/interrupts)
  [ -n "$irq" ] && echo $2 >/proc/irq/$irq/smp_affinity
}}
# bond NAME MODE...: the two members enslaved to a new bond, up, with the bond's address.
bond() {{
  name=$1
  shift
  ip link add $name type bond "$@" miimon 100
  for m in $m1 $m2; do ip link set $m down; ip link set $m master $name; done
  ip link set $name up
  sysctl -qw net.ipv4.conf.$name.rp_filter=0
  ip addr add {bond_v4}/24 dev $name
}}
m1=$(nic $M1) m2=$(nic $M2)
pin_irq $m1 1
pin_irq $m2 2
bond bond0 mode balance-xor xmit_hash_policy layer3+4
start bond0 D --attach xdp --mode auto || exit 1
policy bond0 {bond_port}
$M bond-xor {bond_port} $PINS/bond0 $m1,$m2 $id
stop bond0
$CTL detach --iface bond0 --pin-dir $PINS
ip link del bond0
bond bond1 mode active-backup
start bond1 E --attach xdp --mode auto || exit 1
policy bond1 {bond_port}
$M bond-ab {bond_port} $PINS/bond1 $m1,$m2 $id &
measure=$!
# Once the flood is under way (the first member has received a third of it), the second member
# becomes the active one, as a failover makes it.
base=$(cat /sys/class/net/$m1/statistics/rx_packets)
tries=0
while [ $(( $(cat /sys/class/net/$m1/statistics/rx_packets) - base )) -lt 1000 ] && [ $tries -lt 2400 ]; do
  tries=$((tries + 1))
  sleep 0.05
done
active=$(cat /sys/class/net/bond1/bonding/active_slave)
ip link set dev bond1 type bond active_slave $m2
echo "LAB-FAILOVER $active $(cat /sys/class/net/bond1/bonding/active_slave)"
wait $measure
stop bond1
$CTL detach --iface bond1 --pin-dir $PINS
ip link del bond1
# A mode the bond has no XDP for: the daemon must fall back, saying why.
bond bond2 mode balance-alb
start bond2 F --attach xdp --mode auto || exit 1
stop bond2
"#,
        nic = v4(NIC_V4),
        vlan = VLAN_ID,
        vlan_v4 = v4(VLAN_V4),
        qinq_v4 = v4(QINQ_V4),
        rate = RATE,
        burst = BURST,
        parent = PARENT_PORT,
        vlan_dev = VLAN_DEV_PORT,
        m1 = mac_str(&GUEST_MACS[1]),
        m2 = mac_str(&GUEST_MACS[2]),
        bond_v4 = v4(BOND_V4),
        bond_port = BOND_PORT,
    )
}

//! The policy step: which policy judges the packet (its match, then the policy's predicate),
//! after the allow and deny lists and the hidden-port rule have had their say.

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    maps::lpm_trie::Key,
};
use limiter_common::{
    key::FAMILY_V4,
    maps::{ACL_ALLOW, CLASS_OTHER, CLASS_TCP, CLASS_UDP, Config, Policy},
};
use limiter_ebpf::parse::Packet;

use super::{ACL_V4, ACL_V6, POLICIES, PORT_POLICY, act};

/// What the policy step made of a packet.
pub enum Selected {
    /// This active policy judges it.
    Judge(&'static Policy),
    /// No policy judges it: this XDP action, already counted (a listed source, a hidden port,
    /// no active policy, a fault).
    Done(u32),
}

/// The policy that judges `pkt`, or what becomes of a packet none judges.
#[inline(always)]
pub fn select(cfg: &Config, pkt: &Packet) -> Selected {
    let Some(id) = policy_id(cfg, pkt) else {
        return Selected::Done(act::fault());
    };
    let Some((id, policy)) = predicates_hold(cfg, pkt, id) else {
        return Selected::Done(act::fault());
    };
    if cfg.flags & (Config::HAS_ACL_V4 | Config::HAS_ACL_V6) != 0 {
        if let Some(action) = acl(cfg, pkt) {
            // Counted under the policy the packet would have met, so hits show per policy.
            return Selected::Done(if action == ACL_ALLOW {
                act::bump(u32::from(id), |c| c.allowed_packets += 1);
                XDP_PASS
            } else {
                act::bump(u32::from(id), |c| c.denied_packets += 1);
                XDP_DROP
            });
        }
    }
    if pkt.ports_hidden && hides_from_a_policy(cfg, pkt) {
        act::bump(0, |c| c.unreadable_ports += 1);
        return Selected::Done(XDP_DROP);
    }
    match policy {
        Some(policy) if policy.flags & Policy::ACTIVE != 0 => Selected::Judge(policy),
        _ => Selected::Done(act::unmatched()),
    }
}

/// The packet's policy id (0: none): exact port or range, then protocol, then `any`, all folded
/// by userspace into two array reads. None on a failed lookup.
#[inline(always)]
fn policy_id(cfg: &Config, pkt: &Packet) -> Option<u16> {
    if pkt.has_l4 && cfg.flags & Config::HAS_PORT_POLICIES != 0 && (pkt.class == CLASS_TCP || pkt.class == CLASS_UDP) {
        let index = (pkt.class as u32) << 16 | u32::from(pkt.dport);
        let id = *PORT_POLICY.get(index)?;
        if id != 0 {
            return Some(id);
        }
    }
    Some(cfg.class_policy[pkt.class & 3])
}

/// The policy `id` and its record (none for id 0, so unmatched traffic reads no record), or,
/// when its predicate (SYN-only) fails for `pkt`, the one that judges as if it were absent: the
/// protocol's (`Config::class_policy`, `any` folded in), and when that is SYN-only too
/// (`tcp,syn`), `any`'s, which has no predicate. None on a failed lookup. A policy without a
/// predicate costs one branch on flags already read.
#[inline(always)]
fn predicates_hold(cfg: &Config, pkt: &Packet, id: u16) -> Option<(u16, Option<&'static Policy>)> {
    if id == 0 {
        return Some((0, None));
    }
    let policy = POLICIES.get(u32::from(id))?;
    if policy.flags & Policy::SYN_ONLY == 0 || pkt.syn {
        return Some((id, Some(policy)));
    }
    let id = cfg.class_policy[pkt.class & 3];
    let policy = POLICIES.get(u32::from(id))?;
    if policy.flags & Policy::SYN_ONLY == 0 {
        return Some((id, Some(policy)));
    }
    let id = cfg.class_policy[CLASS_OTHER];
    Some((id, Some(POLICIES.get(u32::from(id))?)))
}

/// A datagram that hides its port (or, past the extension headers walked, its protocol) might
/// be meant for a policy that cannot see it: a port policy (RFC 1858), or, when even the
/// protocol is unknown, a TCP or UDP policy other than `any`. And the policy that would judge
/// it must not key on the port: its key would be port 0's, a second allowance beside the one of
/// the port the stack delivers it to. Nor may it be SYN-only: the flags are in the part of the
/// header the datagram hides, so a tiny-fragment SYN would otherwise fall through past the
/// policy meant for it. Such datagrams are dropped, whatever the policy's mode
/// (like a port policy's); otherwise they are judged like any packet of their class, under the
/// very key of the datagram they start.
#[inline(always)]
fn hides_from_a_policy(cfg: &Config, pkt: &Packet) -> bool {
    let judged_by = cfg.class_policy[pkt.class & 3];
    let any = cfg.class_policy[CLASS_OTHER];
    cfg.flags & Config::HAS_PORT_POLICIES != 0
        || (pkt.class == CLASS_OTHER && (cfg.class_policy[CLASS_TCP] != any || cfg.class_policy[CLASS_UDP] != any))
        || match POLICIES.get(u32::from(judged_by)) {
            // For class OTHER, `judged_by` is `any`, which is then also the TCP and UDP policy.
            Some(p) => p.flags & Policy::ACTIVE != 0 && p.flags & (Policy::KEY_DPORT | Policy::SYN_ONLY) != 0,
            // Id 0 (no policy) reads as an inactive entry; a failed lookup cannot happen for
            // an id below MAX_POLICIES, and is not a reason to drop.
            None => false,
        }
}

/// The allow/deny verdict for the packet's source, if a listed prefix covers it.
#[inline(always)]
fn acl(cfg: &Config, pkt: &Packet) -> Option<u8> {
    if pkt.family == FAMILY_V4 {
        if cfg.flags & Config::HAS_ACL_V4 == 0 {
            return None;
        }
        ACL_V4.get(Key::new(32, (pkt.src[0] as u32).to_le_bytes())).copied()
    } else {
        if cfg.flags & Config::HAS_ACL_V6 == 0 {
            return None;
        }
        let mut addr = [0u8; 16];
        addr[..8].copy_from_slice(&pkt.src[0].to_le_bytes());
        addr[8..].copy_from_slice(&pkt.src[1].to_le_bytes());
        ACL_V6.get(Key::new(128, addr)).copied()
    }
}

//! The policy step: which policies may judge the packet (its route: one policy, or a layer set
//! of candidates), after the allow and deny lists and the hidden-port rule have had their say;
//! and each policy's predicates.

use aya_ebpf::{
    bindings::xdp_action::{XDP_DROP, XDP_PASS},
    helpers::bpf_ktime_get_ns,
    maps::lpm_trie::Key,
};
use limiter_common::{
    key::FAMILY_V4,
    maps::{ACL_ALLOW, BAN_HIT_ALLOWED, BAN_HIT_DENIED, Ban, CLASS_TCP, CLASS_UDP, Config, LAYERED, Policy},
};
use limiter_ebpf::parse::Packet;

use super::{
    ACL_V4, ACL_V6, BAN_HITS, BAN_NETS_V4, BAN_NETS_V6, BANS_V4, BANS_V6, LAYER_SETS, POLICIES, PORT_POLICY, act,
};

/// What the policy step made of a packet.
pub enum Selected {
    /// This active policy judges it, alone.
    Judge(&'static Policy),
    /// The candidates of the layer set of this index: each whose predicates hold judges it
    /// (`program::layers`).
    Layers(u16),
    /// No policy judges it: this XDP action, already counted (a listed source, a hidden port,
    /// no active policy, a fault).
    Done(u32),
}

/// The policy (or layers) that judge `pkt`, or what becomes of a packet none judges.
#[inline(always)]
pub fn select(cfg: &Config, pkt: &Packet) -> Selected {
    let Some(route) = route(cfg, pkt) else {
        return Selected::Done(act::fault());
    };
    if cfg.flags & (Config::HAS_ACL_V4 | Config::HAS_ACL_V6 | Config::HAS_BANS) != 0 {
        if let Some(action) = acl(cfg, pkt) {
            // Counted under the (first) policy the packet would have met, so hits show per policy.
            let id = first_judge(route);
            return Selected::Done(if action == ACL_ALLOW {
                act::bump(u32::from(id), |c| c.allowed_packets += 1);
                XDP_PASS
            } else {
                act::bump(u32::from(id), |c| c.denied_packets += 1);
                XDP_DROP
            });
        }
    }
    if pkt.ports_hidden && cfg.flags & (Config::HIDDEN_DROP << (pkt.class & 3)) != 0 {
        act::bump(0, |c| c.unreadable_ports += 1);
        return Selected::Done(XDP_DROP);
    }
    let mut route = route;
    if route & LAYERED != 0 {
        // A packet that is no SYN meets the set's candidates without the SYN-only ones: a
        // route of its own, often one policy (established traffic beside a SYN-only policy).
        let Some(set) = LAYER_SETS.get(u32::from(route & !LAYERED)) else {
            return Selected::Done(act::fault());
        };
        if !pkt.syn {
            route = set.not_syn;
        }
        if route & LAYERED != 0 {
            return Selected::Layers(route & !LAYERED);
        }
    }
    // Id 0 (no policy) reads no record. A route of one policy is the only one covering the
    // packet: when its predicates fail, none judges it.
    if route == 0 {
        return Selected::Done(act::unmatched());
    }
    match POLICIES.get(u32::from(route)) {
        // Userspace routes a policy with a source port or destination predicate through a layer
        // set, even alone: here only SYN-only is checked, which keeps this path short for the
        // verifier. Such a policy reached here is the limiter's fault.
        Some(policy) if policy.flags & (Policy::SPORT | Policy::DST | Policy::DENY) != 0 => {
            Selected::Done(act::fault())
        }
        Some(policy) if policy.flags & Policy::ACTIVE != 0 && syn_holds(policy, pkt) => Selected::Judge(policy),
        Some(_) => Selected::Done(act::unmatched()),
        None => Selected::Done(act::fault()),
    }
}

/// The packet's route (0: none): exact port or range, then protocol, then `any`, all folded
/// by userspace into two array reads. None on a failed lookup.
#[inline(always)]
fn route(cfg: &Config, pkt: &Packet) -> Option<u16> {
    if pkt.has_l4 && cfg.flags & Config::HAS_PORT_POLICIES != 0 && (pkt.class == CLASS_TCP || pkt.class == CLASS_UDP) {
        let index = (pkt.class as u32) << 16 | u32::from(pkt.dport);
        let id = *PORT_POLICY.get(index)?;
        if id != 0 {
            return Some(id);
        }
    }
    Some(cfg.class_policy[pkt.class & 3])
}

/// Whether `pkt` meets `policy`'s SYN-only predicate (the only one a policy judging alone may
/// have).
#[inline(always)]
fn syn_holds(policy: &Policy, pkt: &Packet) -> bool {
    policy.flags & Policy::SYN_ONLY == 0 || pkt.syn
}

/// Whether `pkt` meets `policy`'s predicates: SYN-only, a source port range, a destination
/// prefix. A policy without any costs one branch on flags already read.
#[inline(always)]
pub fn predicates_hold(policy: &Policy, pkt: &Packet) -> bool {
    let flags = policy.flags;
    if flags & Policy::PREDICATES == 0 {
        return true;
    }
    if flags & Policy::SYN_ONLY != 0 && !pkt.syn {
        return false;
    }
    if flags & Policy::SPORT != 0 && (!pkt.has_l4 || pkt.sport < policy.sport_lo || pkt.sport > policy.sport_hi) {
        return false;
    }
    if flags & Policy::DST != 0 {
        return if pkt.family == FAMILY_V4 {
            flags & Policy::DST_V4 != 0 && pkt.dst[0] & policy.dst_v4_mask == policy.dst_v4
        } else {
            flags & Policy::DST_V6 != 0
                && pkt.dst[0] & policy.dst_v6_mask[0] == policy.dst_v6[0]
                && pkt.dst[1] & policy.dst_v6_mask[1] == policy.dst_v6[1]
        };
    }
    true
}

/// The policy a listed source's packet is counted under: its route's policy, or the first
/// candidate of its layer set (0: none).
#[inline(always)]
fn first_judge(route: u16) -> u16 {
    if route & LAYERED == 0 {
        return route;
    }
    LAYER_SETS.get(u32::from(route & !LAYERED)).map_or(0, |set| set.ids[0])
}

/// The allow/deny verdict for the packet's source: an active ban's (the daemon's expiring
/// entries: its exact address, then the longest banned prefix), else the longest listed prefix's.
#[inline(always)]
fn acl(cfg: &Config, pkt: &Packet) -> Option<u8> {
    if cfg.flags & Config::HAS_BANS != 0
        && let Some(action) = banned(cfg, pkt)
    {
        return Some(action);
    }
    if pkt.family == FAMILY_V4 {
        if cfg.flags & Config::HAS_ACL_V4 == 0 {
            return None;
        }
        ACL_V4.get(Key::new(32, (pkt.src[0] as u32).to_le_bytes())).copied()
    } else {
        if cfg.flags & Config::HAS_ACL_V6 == 0 {
            return None;
        }
        ACL_V6.get(Key::new(128, v6_bytes(pkt))).copied()
    }
}

/// The source address of an IPv6 packet, as the maps key it (network order).
#[inline(always)]
fn v6_bytes(pkt: &Packet) -> [u8; 16] {
    let mut addr = [0u8; 16];
    addr[..8].copy_from_slice(&pkt.src[0].to_le_bytes());
    addr[8..].copy_from_slice(&pkt.src[1].to_le_bytes());
    addr
}

/// The action of a ban covering the packet's source and not past its deadline, counted in
/// `BAN_HITS`: its exact address's if that one is live, else the longest banned prefix's. An
/// exact entry past its deadline (not yet swept) gives way to the prefix that covers it, so it
/// opens no hole in a prefix ban. Inlined: as a call (`inline(never)`) the verifier did not
/// finish the limiter within minutes (`fixtures::the_programs_pass_the_verifier` prints the
/// counts: the fallback took the limiter from 602k to 672k, the tc one unchanged at 594k).
#[inline(always)]
fn banned(cfg: &Config, pkt: &Packet) -> Option<u8> {
    let action = if pkt.family == FAMILY_V4 {
        let addr = (pkt.src[0] as u32).to_le_bytes();
        let exact =
            if cfg.flags & Config::HAS_BANS_V4 != 0 { live(BANS_V4.get_ptr(addr).map(|b| unsafe { &*b })) } else { 0 };
        if exact == 0 && cfg.flags & Config::HAS_BAN_NETS_V4 != 0 {
            live(BAN_NETS_V4.get(Key::new(32, addr)))
        } else {
            exact
        }
    } else {
        let addr = v6_bytes(pkt);
        let exact =
            if cfg.flags & Config::HAS_BANS_V6 != 0 { live(BANS_V6.get_ptr(addr).map(|b| unsafe { &*b })) } else { 0 };
        if exact == 0 && cfg.flags & Config::HAS_BAN_NETS_V6 != 0 {
            live(BAN_NETS_V6.get(Key::new(128, addr)))
        } else {
            exact
        }
    };
    if action == 0 {
        return None;
    }
    let hit = if action == u32::from(ACL_ALLOW) { BAN_HIT_ALLOWED } else { BAN_HIT_DENIED };
    if let Some(n) = BAN_HITS.get_ptr_mut(hit) {
        unsafe { *n += 1 };
    }
    Some(action as u8)
}

/// A ban's action, or 0 for none or one past its deadline: ignored exactly then, until the
/// daemon's sweep removes it. The clock is read only when there is an entry.
#[inline(always)]
fn live(ban: Option<&Ban>) -> u32 {
    match ban {
        Some(ban) if ban.until_ns == 0 || unsafe { bpf_ktime_get_ns() } < ban.until_ns => ban.action,
        _ => 0,
    }
}

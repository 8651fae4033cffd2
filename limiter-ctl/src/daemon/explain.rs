//! `explain`: what a packet of given fields would meet now (`kernel::explain` reads the maps),
//! in the operator's terms: the list entries with their origin and time left, each policy by
//! name with its key and buckets, which one would refuse and until when, and whether the key's
//! buckets are shared with other sources in every row. Nothing is written anywhere.

use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;
use limiter_common::{
    key::{FAMILY_V4, FlowKey},
    maps::{ACL_ALLOW, CLASS_ICMP, CLASS_TCP, CLASS_UDP, Policy},
};

use super::serve::Daemon;
use crate::{
    api::{
        explain::{Buckets, Entry, Explanation, PolicyLook, Proto, Query, RowLook, Verdict, ms},
        ipc::Response,
    },
    config::{List, Scope},
    kernel::explain::{Layer, Look, Probe, Reading},
};

impl Daemon {
    pub(super) fn explain(&mut self, query: Query) -> Response {
        let src = match query.check() {
            Ok(addr) => addr.to_canonical(),
            Err(error) => return Response::Usage { error },
        };
        let class = match query.proto {
            Proto::Tcp => CLASS_TCP,
            Proto::Udp => CLASS_UDP,
            Proto::Icmp => CLASS_ICMP,
        };
        let probe = Probe {
            src,
            dst: query.dst.map(|d| d.to_canonical()),
            class,
            dport: query.dport,
            sport: query.sport,
            syn: query.syn,
        };
        let reading = match self.limiter.explain(&probe) {
            Ok(reading) => reading,
            Err(e) => return Response::Failed { error: format!("reading the program's maps: {e}") },
        };
        let names: BTreeMap<u16, String> = self.state.policies().map(|e| (e.id, e.def.name.to_string())).collect();
        let name = |id: u16| names.get(&id).cloned().unwrap_or_else(|| format!("#{id}"));
        let mut out = Explanation {
            packet: query.describe(),
            verdict: Verdict::Unjudged,
            by: None,
            on_cpus: None,
            retry_after_ms: None,
            at_monotonic_ns: reading.now_ns,
            entries: self.entries(src),
            policies: Vec::new(),
            passed_over: reading.passed_over.iter().map(|&id| name(id)).collect(),
            notes: Vec::new(),
            warnings: Vec::new(),
        };
        for layer in &reading.layers {
            let mut look = policy_look(layer, &name);
            look.shared = self.shared(layer, &name);
            if let Some(shared) = &look.shared {
                let (what, now) = if layer.policy.flags & Policy::SCOPE_HOST != 0 {
                    ("--host-buckets", reading.host_buckets)
                } else {
                    ("--buckets", reading.buckets)
                };
                out.warnings.push(format!(
                    "'{}': the key {} shares its bucket in every row with other sources ({shared}): it can be \
                     refused for their traffic. Give the daemon more buckets ({what}, now {now}), or rotate the salt \
                     now (`limiter-ctl salt rotate`), which moves every key",
                    look.name, look.key
                ));
            }
            if layer.policy.flags & Policy::BYTES != 0 {
                out.notes.push(format!("'{}' counts bytes: judged for a frame of {} bytes", look.name, layer.weight));
            }
            out.policies.push(look);
        }
        decide(&mut out, &reading);
        if let Some(listed) = reading.listed {
            let list = if listed.action == ACL_ALLOW { List::Allow } else { List::Deny };
            out.verdict = if list == List::Allow { Verdict::Allowed } else { Verdict::Denied };
            let entry = out.entries.iter().find(|e| e.list == list && e.origin.is_some() == listed.ban);
            out.by = Some(entry.map_or_else(
                || format!("the {} list", list.as_str()),
                |e| match e.origin {
                    Some(origin) => format!("{} entry {} (origin {})", list.as_str(), e.cidr, origin.as_str()),
                    None => format!("{} entry {} (the config file)", list.as_str(), e.cidr),
                },
            ));
            out.on_cpus = None;
            out.retry_after_ms = match (list, listed.until_ns) {
                (List::Deny, Some(until)) => Some(ms(until.saturating_sub(reading.now_ns))),
                _ => None,
            };
            if !out.policies.is_empty() {
                out.notes.push("while that entry stands the packet meets no policy; below, what they would do".into());
            }
        }
        if query.dport.is_none() && matches!(query.proto, Proto::Tcp | Proto::Udp) {
            out.notes.push("no --dport: policies on ports were not consulted, only the protocol's and any's".into());
        }
        if reading.rotating {
            out.notes.push("a salt rotation is under way: the previous salt's buckets count too".into());
        }
        Response::Ok { data: serde_json::to_value(out).unwrap_or_default() }
    }

    /// Bans and config-file entries covering `src`, longest prefix first.
    fn entries(&self, src: IpAddr) -> Vec<Entry> {
        let mut entries: Vec<Entry> = self
            .bans
            .covering(src)
            .into_iter()
            .map(|(cidr, list, origin, left)| Entry {
                list,
                cidr,
                origin: Some(origin),
                expires_in_ms: Some(left.div_ceil(1_000_000)),
            })
            .collect();
        for list in [List::Allow, List::Deny] {
            for cidr in self.state.list(list).iter().filter(|n| n.contains(&src)) {
                entries.push(Entry { list, cidr: *cidr, origin: None, expires_in_ms: None });
            }
        }
        entries.sort_by_key(|e| std::cmp::Reverse(e.cidr.prefix_len()));
        entries
    }

    /// Which other sources the layer's key shares its buckets with, as far as the daemon can
    /// tell: keys refused lately (the refusal samples `top` ranks) whose bucket in a row is the
    /// key's, and rows another policy wrote last. Some only when every row has one.
    fn shared(&mut self, layer: &Layer, name: &dyn Fn(u16) -> String) -> Option<String> {
        let host = layer.policy.flags & Policy::SCOPE_HOST != 0;
        let same_scope: BTreeMap<u16, bool> =
            self.state.policies().map(|e| (e.id, e.def.scope == Scope::Host)).collect();
        let mut keys = vec![layer.key];
        let mut labels = Vec::new();
        for (policy, net, dport) in self.top.keys() {
            if same_scope.get(&policy) != Some(&host) {
                continue;
            }
            let key = sampled_key(policy, net, dport);
            if key != layer.key {
                keys.push(key);
                labels.push(format!("{net} under '{}'", name(policy)));
            }
        }
        let buckets = self.limiter.key_buckets(&keys, host).ok()?;
        let ours = buckets.first()?;
        let mut rows = Vec::new();
        for (row, bucket) in ours.iter().enumerate() {
            let sharer = buckets[1..].iter().position(|b| b.get(row) == Some(bucket)).map(|i| labels[i].clone());
            let writer = layer
                .looks
                .iter()
                .flat_map(|l| l.rows.get(row))
                .find(|r| r.ahead_ns > 0 && r.owner != 0 && u16::from(r.owner) != layer.policy.id);
            match (sharer, writer) {
                (Some(s), _) => rows.push(format!("row {row}: {s}")),
                (None, Some(w)) => rows.push(format!("row {row}: a key of '{}'", name(u16::from(w.owner)))),
                (None, None) => return None,
            }
        }
        (!rows.is_empty()).then(|| rows.join("; "))
    }
}

/// The key a refusal sample stands for.
fn sampled_key(policy: u16, net: IpNet, dport: u16) -> FlowKey {
    let mut addr = [0u8; 16];
    let family = match net.network() {
        IpAddr::V4(a) => {
            addr[..4].copy_from_slice(&a.octets());
            FAMILY_V4
        }
        IpAddr::V6(a) => {
            addr = a.octets();
            limiter_common::key::FAMILY_V6
        }
    };
    FlowKey { addr, policy, dport, family }
}

/// A layer in the answer's terms.
fn policy_look(layer: &Layer, name: &dyn Fn(u16) -> String) -> PolicyLook {
    let p = &layer.policy;
    let dry = p.flags & Policy::DRY_RUN != 0;
    let refused = if dry { Verdict::WouldRefuse } else { Verdict::Refused };
    let verdict =
        if p.flags & Policy::DENY != 0 || layer.looks.iter().any(|l| !l.admit) { refused } else { Verdict::Admitted };
    let host = p.flags & Policy::SCOPE_HOST != 0;
    let mut buckets = Vec::new();
    let mut idle = 0;
    for (cpu, look) in layer.looks.iter().enumerate() {
        if !host && look.rows.iter().all(|r| r.ahead_ns == 0) {
            idle += 1;
            continue;
        }
        buckets.push(Buckets {
            cpu: (!host).then_some(cpu),
            admit: look.admit,
            retry_after_ms: ms(look.retry_ns),
            full_after_ms: ms(look.full_ns),
            rows: look
                .rows
                .iter()
                .enumerate()
                .map(|(row, r)| RowLook {
                    row,
                    bucket: r.bucket,
                    spent_ms: ms(r.ahead_ns),
                    written_by: (r.owner != 0).then(|| name(u16::from(r.owner))),
                })
                .collect(),
        });
    }
    let (addr, prefix) = match layer.key.family {
        FAMILY_V4 => {
            let a: [u8; 4] = layer.key.addr[..4].try_into().unwrap_or([0; 4]);
            (IpAddr::from(a), p.v4_prefix.min(32))
        }
        _ => (IpAddr::from(layer.key.addr), p.v6_prefix.min(128)),
    };
    PolicyLook {
        name: name(p.id),
        id: p.id,
        scope: if host { "host" } else { "cpu" }.into(),
        dry_run: dry,
        weight: layer.weight,
        key: IpNet::new(addr, prefix).unwrap_or_else(|_| IpNet::from(addr)),
        key_dport: (p.flags & Policy::KEY_DPORT != 0).then_some(layer.key.dport),
        verdict,
        buckets,
        idle_cpus: idle,
        shared: None,
    }
}

/// The packet's verdict from its layers, CPU by CPU (a per-CPU layer's buckets differ on each):
/// refused where a layer that is not dry-run refuses it, then until every such layer admits.
fn decide(out: &mut Explanation, reading: &Reading) {
    if reading.layers.is_empty() {
        return;
    }
    let cpus = reading.layers.iter().map(|l| l.looks.len()).max().unwrap_or(1).max(1);
    // A layer's look on `cpu`: its host-scope copy, or that CPU's; None for a rate of 0.
    let on = |layer: &Layer, cpu: usize| -> Option<Look> {
        layer.looks.get(if layer.looks.len() == 1 { 0 } else { cpu }).cloned()
    };
    let (mut refusing, mut by, mut retry, mut would) = (Vec::new(), None, Some(0u64), None);
    for cpu in 0..cpus {
        let mut first = None;
        let mut wait = Some(0u64);
        for (i, layer) in reading.layers.iter().enumerate() {
            let dry = layer.policy.flags & Policy::DRY_RUN != 0;
            let look = on(layer, cpu);
            let admit = look.as_ref().is_some_and(|l| l.admit);
            if !admit && dry {
                would.get_or_insert(i);
            }
            if !admit && !dry {
                first.get_or_insert(i);
                wait = match (wait, look) {
                    (Some(w), Some(l)) => Some(w.max(l.retry_ns)),
                    _ => None,
                };
            }
        }
        if let Some(i) = first {
            refusing.push(cpu);
            by.get_or_insert(i);
            retry = match (retry, wait) {
                (Some(r), Some(w)) => Some(r.max(w)),
                _ => None,
            };
        }
    }
    let name_of = |i: usize| out.policies.get(i).map(|p| p.name.clone());
    if let Some(i) = by {
        out.verdict = Verdict::Refused;
        out.by = name_of(i);
        out.retry_after_ms = retry.map(ms);
        out.on_cpus = (refusing.len() < cpus).then_some(refusing);
    } else if let Some(i) = would {
        out.verdict = Verdict::WouldRefuse;
        out.by = name_of(i);
    } else {
        out.verdict = Verdict::Admitted;
    }
}

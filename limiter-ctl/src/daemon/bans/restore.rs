//! A start's bans: what the files say (`store`) and what the kernel still holds, judged by the
//! rules of live input (`rules`), made the kernel's.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use limiter_common::maps::{ACL_ALLOW, Ban};
use tracing::{debug, info, warn};

use super::{
    Bans, MS, capacity,
    clock::Stamp,
    rules::{self, AllowList},
    seen_order,
};
use crate::{
    api::ipc::MAX_FOR_MS,
    config::{self, List, Origin},
    kernel::{self, BanMap, Limiter},
};

impl Bans {
    /// Reads the saved bans back and makes the kernel hold them, judged by the same rules as
    /// live input (said in one WARN line with counts; each at debug). The kernel's entries of
    /// networks the files never named (changes a failed journal missed) are taken back by the
    /// origins they carry; its other entries the bans do not hold are removed.
    pub(in crate::daemon) fn restore(
        &mut self,
        limiter: &mut Limiter,
        allow: &BTreeSet<IpNet>,
    ) -> Result<(), kernel::Error> {
        self.allow = AllowList::new(allow);
        let here = Stamp::now();
        let loaded = self.store.as_mut().map(|s| s.load(&here)).unwrap_or_default();
        let kernel_bans = limiter.ban_entries()?;
        let mut adopted = Vec::new();
        for (net, ban) in kernel_bans.iter().filter(|(n, _)| !loaded.named.contains(n)) {
            let list = if ban.action == u32::from(ACL_ALLOW) { List::Allow } else { List::Deny };
            for origin in Origin::ALL.into_iter().filter(|o| ban.origins & 1 << o.index() != 0) {
                adopted.push(((*net, list, origin), ban.until_ns));
            }
        }
        let (from_files, from_kernel, legacy) = (loaded.entries.len(), adopted.len(), loaded.legacy);
        let (mut expired, mut refused) = (0usize, BTreeMap::<String, usize>::new());
        let now = here.mono_ns;
        for ((net, list, origin), at) in loaded.entries.into_iter().chain(adopted) {
            if at <= now {
                expired += 1;
                continue;
            }
            let unmapped = config::unmapped(net);
            let why = if unmapped.trunc() != unmapped {
                Some("host bits set".to_string())
            } else if at - now > MAX_FOR_MS.saturating_mul(MS) {
                Some("longer than 10 years".to_string())
            } else if let Err(why) = rules::check(list, unmapped, &self.allow) {
                self.counts.refused[origin.index()] += 1;
                Some(why.to_string())
            } else if !self.has_net(unmapped)
                && self.nets[BanMap::of(&unmapped).index()] >= capacity(BanMap::of(&unmapped))
            {
                Some("beyond the maps' capacity".to_string())
            } else {
                None
            };
            match why {
                Some(why) => {
                    debug!(%net, list = list.as_str(), %origin, reason = %why, "a saved ban refused");
                    *refused.entry(why).or_default() += 1;
                }
                None => {
                    self.put((unmapped, list, origin), Some(at));
                }
            }
        }
        if !refused.is_empty() {
            let total: usize = refused.values().sum();
            let reasons: Vec<String> = refused.iter().map(|(why, n)| format!("{n} {why}")).collect();
            warn!(refused = total, reasons = %reasons.join(", "), file = ?self.store.as_ref().map(|s| s.path().display().to_string()), "saved bans refused by the rules of live input (each at debug)");
        }
        if let Some(store) = self.store.as_mut() {
            store.begin();
        }
        // What the kernel holds that the entries do not say: removed or expired meanwhile,
        // refused, or a predecessor's that carries no origin.
        let stale: Vec<(IpNet, Option<Ban>)> =
            kernel_bans.iter().filter(|(n, _)| !self.has_net(*n)).map(|(n, _)| (*n, None)).collect();
        let present = self.presence();
        let nets: Vec<IpNet> = seen_order(self.entries.keys().map(|k| k.0));
        let writes: Vec<(IpNet, Option<Ban>)> = nets.iter().map(|n| (*n, self.kernel_ban(*n))).collect();
        limiter.set_ban_flags(std::array::from_fn(|i| present[i] || !stale.is_empty()))?;
        limiter.write_bans(&writes)?;
        limiter.write_bans(&stale)?;
        limiter.set_ban_flags(present)?;
        let refused: usize = refused.values().sum();
        if from_files + from_kernel + stale.len() > 0 {
            info!(
                restored = self.entries.len(),
                taken_from_kernel = from_kernel,
                expired_meanwhile = expired,
                refused,
                removed_from_kernel = stale.len(),
                file = ?self.store.as_ref().map(|s| s.path().display().to_string()),
                "bans restored with the time they had left"
            );
        }
        self.dirty = legacy || from_kernel + expired + refused > 0;
        Ok(())
    }
}

//! The salt: drawn from the OS CSPRNG, going nowhere but the kernel map, rotated with a grace
//! period during which the old generation of buckets is still consulted.

use std::time::Duration;

use limiter_common::{SipInit, SipKey};

use super::{Error, Limiter, monotonic_ns};

/// `Config::grace_until_ns` while a rotation is under way: no end yet.
const GRACE_OPEN: u64 = u64::MAX;

/// A fresh salt from the OS CSPRNG.
pub fn draw_salt() -> Result<SipKey, Error> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(Error::Salt)?;
    let (k0, k1) = bytes.split_at(8);
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
    Ok(SipKey { k0: word(k0), k1: word(k1) })
}

impl Limiter {
    /// Sets the current generation's salt (before attaching; later, see [`Limiter::rotate_salt`]).
    pub fn set_salt(&mut self, salt: SipKey) -> Result<(), Error> {
        let mut config = self.read_config()?;
        config.salts[(config.generation & 1) as usize] = SipInit::new(&salt);
        config.rotated_at_ns = monotonic_ns();
        self.store_config(&config)
    }

    /// Rotates the salt: the other generation of buckets takes `salt` and becomes current; for
    /// `grace` a packet is also judged against its bucket in the old generation and carries over
    /// a later TAT, so a source over its limit stays over it. Refused while a previous rotation's
    /// grace runs.
    ///
    /// The other generation is not cleared (that would take one write per bucket and CPU): what
    /// its buckets still hold is read under the rules of `limiter_common::gcra`, which count a TAT
    /// only while its writer's claim covers it, and `grace` covers the
    /// longest burst window any policy had while the old generation was current, so the TATs it
    /// holds are behind now when it becomes current again (a rotation later).
    ///
    /// Each write changes one field, so a packet never sees a torn mix: the new salt goes where
    /// nothing reads it; the grace opens with no end; the switch; then the grace's end, measured
    /// from after the switch, so a daemon stalled between two writes can only lengthen it.
    pub fn rotate_salt(&mut self, salt: SipKey, grace: Duration) -> Result<(), Error> {
        let mut config = self.read_config()?;
        let now = monotonic_ns();
        if config.grace_until_ns == GRACE_OPEN {
            // A rotation interrupted between its writes (the daemon died): close its grace first.
            config.grace_until_ns = now.saturating_add(grace.as_nanos() as u64);
            self.store_config(&config)?;
        }
        if now < config.grace_until_ns {
            return Err(Error::RotationBusy { seconds_left: (config.grace_until_ns - now).div_ceil(1_000_000_000) });
        }
        let next = (config.generation & 1) ^ 1;
        config.salts[next as usize] = SipInit::new(&salt);
        self.store_config(&config)?;
        config.grace_until_ns = GRACE_OPEN;
        self.store_config(&config)?;
        config.generation = next;
        config.rotated_at_ns = monotonic_ns();
        self.store_config(&config)?;
        config.grace_until_ns = monotonic_ns().saturating_add(grace.as_nanos() as u64);
        self.store_config(&config)
    }

    /// How long ago the salt was drawn.
    pub fn salt_age(&self) -> Result<Duration, Error> {
        Ok(Duration::from_nanos(monotonic_ns().saturating_sub(self.read_config()?.rotated_at_ns)))
    }
}

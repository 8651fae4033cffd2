//! Keeping the daemon in step with the bans: which daemon answers (a restarted one lost what
//! it had not saved), the reconcile that sends again what it lacks and lifts what it should not
//! hold, and sending what is pending. A daemon that cannot be reached keeps it all pending.

use std::time::{Duration, Instant};

use super::{
    bans::Bans,
    daemon::Sink,
    run::{BACKOFF_MIN, next_backoff},
};

/// What the bouncer knows of the daemon.
#[derive(Debug)]
pub(crate) struct DaemonState {
    /// The daemon could not be reached at the last try (said once, until it answers again).
    down: bool,
    /// The instance that answered last (None: not known yet, or a daemon that names none).
    instance: Option<u64>,
    /// Its ban list must be compared with the bans: at start, after it restarted, after it
    /// could not be reached (it may have restarted meanwhile).
    must_reconcile: bool,
    /// After a failed reconcile: not tried again before this, and the wait after the next
    /// failure.
    retry_at: Option<Instant>,
    backoff: Duration,
}

impl Default for DaemonState {
    fn default() -> Self {
        Self { down: false, instance: None, must_reconcile: true, retry_at: None, backoff: BACKOFF_MIN }
    }
}

impl DaemonState {
    /// One round with the daemon, after a poll: which daemon answers, a reconcile if it is due
    /// (and `bans` hold a full set, without which what the daemon should not hold is not
    /// known), then what is pending.
    pub(crate) fn sync(&mut self, bans: &mut Bans, full_read: bool, sink: &mut impl Sink) {
        let instance = match sink.instance() {
            Ok(instance) => instance,
            Err(e) => return self.failed(&e),
        };
        if self.down {
            tracing::info!("the daemon answers again");
            self.down = false;
            self.must_reconcile = true;
        }
        if instance != self.instance {
            if self.instance.is_some() {
                tracing::warn!("the daemon restarted: what it lost of the bans is sent again");
            }
            self.instance = instance;
            self.must_reconcile = true;
        }
        let now = Instant::now();
        if self.must_reconcile && full_read && self.retry_at.is_none_or(|at| now >= at) {
            self.reconcile(bans, sink);
        }
        let now = Instant::now();
        bans.expire(now);
        let (adds, rms) = bans.pending(now);
        let sent = (|| {
            if !rms.is_empty() {
                sink.rm(&rms)?;
                bans.removed();
            }
            if !adds.is_empty() {
                sink.add(&adds)?;
                bans.added();
            }
            Ok::<_, String>(())
        })();
        match sent {
            Ok(()) if !adds.is_empty() || !rms.is_empty() => {
                tracing::info!(added = adds.len(), removed = rms.len(), "bans applied");
            }
            Ok(()) => {}
            // Kept pending, sent again after the next poll.
            Err(e) => self.failed(&e),
        }
    }

    /// Compares the daemon's bans of ours with the bans. A failure is said, with its cause,
    /// and tried again after a backoff (what the daemon lost stays lost until then).
    fn reconcile(&mut self, bans: &mut Bans, sink: &mut impl Sink) {
        match sink.listed() {
            Ok(mut listed) => {
                let (resent, lifted) = bans.reconcile(&mut listed, Instant::now());
                tracing::info!(
                    listed = listed.len(),
                    resent,
                    lifted,
                    "compared with the daemon's bans: {resent} sent again, {lifted} lifted"
                );
                self.must_reconcile = false;
                self.retry_at = None;
                self.backoff = BACKOFF_MIN;
            }
            Err(e) => {
                tracing::error!(
                    retry_in = ?self.backoff,
                    "listing the daemon's bans failed: {e}; what it lacks of the bans is not sent again, and what it \
                     should not hold not lifted, until a listing succeeds"
                );
                self.retry_at = Some(Instant::now() + self.backoff);
                self.backoff = next_backoff(self.backoff);
            }
        }
    }

    fn failed(&mut self, e: &str) {
        if !self.down {
            tracing::error!("{e}; bans kept pending, retried on every poll");
        }
        self.down = true;
    }

    #[cfg(test)]
    pub(crate) fn must_reconcile(&self) -> bool {
        self.must_reconcile
    }
}

//! The loop: poll the LAPI, keep the set, tell the daemon; backoff while the LAPI fails.

use std::time::{Duration, Instant};

use super::{bans::Bans, daemon::Sink, lapi::Lapi};

/// The backoff after a failed poll: from [`BACKOFF_MIN`], doubled each failure, up to
/// [`BACKOFF_MAX`].
pub(crate) const BACKOFF_MIN: Duration = Duration::from_secs(1);
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The next backoff after one of `current`.
pub(crate) fn next_backoff(current: Duration) -> Duration {
    current.saturating_mul(2).min(BACKOFF_MAX)
}

/// Polls forever (the process ends on a signal; the bans it applied stay in the daemon, each
/// until its time).
pub(crate) fn run(lapi: &Lapi, sink: &mut impl Sink, interval: Duration) -> ! {
    let mut bans = Bans::default();
    let mut startup = true;
    let mut backoff = BACKOFF_MIN;
    let mut lapi_down = false;
    let mut daemon_down = false;
    // Until the daemon's entries of ours were compared with a first full set.
    let mut reconciled = false;
    tracing::info!(lapi = %lapi.url, interval = ?interval, "crowdsec bouncer started");
    loop {
        let wait = match lapi.poll(startup) {
            Ok(batch) => {
                let now = Instant::now();
                bans.expire(now);
                bans.apply(&batch, now, startup);
                if startup && !reconciled {
                    // A daemon that cannot be asked now is asked after the next full set.
                    if let Ok(listed) = sink.listed() {
                        bans.reconcile(&listed);
                        reconciled = true;
                    }
                }
                if lapi_down {
                    tracing::info!(lapi = %lapi.url, "the LAPI answers again");
                    lapi_down = false;
                }
                if batch.skipped.total() > 0 {
                    tracing::info!(skipped = batch.skipped.total(), "decisions skipped: {}", batch.skipped);
                }
                if !batch.new.is_empty() || !batch.deleted.is_empty() || startup {
                    tracing::info!(
                        new = batch.new.len(),
                        deleted = batch.deleted.len(),
                        full = startup,
                        banned = bans.len(),
                        "decisions read"
                    );
                }
                startup = false;
                backoff = BACKOFF_MIN;
                interval
            }
            Err(e) => {
                // The bans applied stay (fail static); the next answer is asked for in full,
                // to catch up on what changed meanwhile.
                tracing::error!(retry_in = ?backoff, "{e}; the bans applied are kept");
                lapi_down = true;
                startup = true;
                let wait = backoff;
                backoff = next_backoff(backoff);
                wait
            }
        };
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
            Ok(()) if daemon_down => {
                tracing::info!("the daemon takes bans again");
                daemon_down = false;
            }
            Ok(()) => {
                if !adds.is_empty() || !rms.is_empty() {
                    tracing::info!(added = adds.len(), removed = rms.len(), "bans applied");
                }
            }
            Err(e) => {
                // Kept pending, sent again after the next poll.
                if !daemon_down {
                    tracing::error!("{e}; bans kept pending, retried on every poll");
                }
                daemon_down = true;
            }
        }
        std::thread::sleep(wait);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap() {
        let mut b = BACKOFF_MIN;
        let mut seen = vec![b.as_secs()];
        for _ in 0..7 {
            b = next_backoff(b);
            seen.push(b.as_secs());
        }
        assert_eq!(seen, [1, 2, 4, 8, 16, 30, 30, 30]);
    }
}

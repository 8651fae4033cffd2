//! The loop: poll the LAPI, keep the set, keep the daemon in step (`sync`); backoff while the
//! LAPI fails.

use std::time::{Duration, Instant};

use super::{
    bans::{Bans, MAX_HELD},
    daemon::Sink,
    decisions::Batch,
    lapi::{Lapi, PollError},
    sync::DaemonState,
};

/// The backoff after a failed poll: from [`BACKOFF_MIN`], doubled each failure, up to
/// [`BACKOFF_MAX`].
pub(crate) const BACKOFF_MIN: Duration = Duration::from_secs(1);
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The next backoff after one of `current`.
pub(crate) fn next_backoff(current: Duration) -> Duration {
    current.saturating_mul(2).min(BACKOFF_MAX)
}

/// Where decisions come from: the LAPI (a stand-in in tests).
pub(crate) trait Feed {
    fn url(&self) -> &str;
    /// The full set (`startup`) or the changes since the last poll.
    fn poll(&self, startup: bool) -> Result<Batch, PollError>;
}

impl Feed for Lapi {
    fn url(&self) -> &str {
        &self.url
    }

    fn poll(&self, startup: bool) -> Result<Batch, PollError> {
        Lapi::poll(self, startup)
    }
}

/// The bouncer's state between polls.
#[derive(Debug)]
pub(crate) struct Bouncer {
    pub bans: Bans,
    /// The next poll asks for the full set: the first, and the first after a failure or an
    /// answer with decisions it could not read.
    startup: bool,
    /// The bans hold a full set (until then, what the daemon should not hold is not known).
    full_read: bool,
    backoff: Duration,
    lapi_down: bool,
    pub daemon: DaemonState,
}

impl Default for Bouncer {
    fn default() -> Self {
        Self {
            bans: Bans::default(),
            startup: true,
            full_read: false,
            backoff: BACKOFF_MIN,
            lapi_down: false,
            daemon: DaemonState::default(),
        }
    }
}

/// Polls forever (the process ends on a signal; the bans it applied stay in the daemon, each
/// until its time).
pub(crate) fn run(lapi: &Lapi, sink: &mut impl Sink, interval: Duration) -> ! {
    let mut bouncer = Bouncer::default();
    tracing::info!(lapi = %lapi.url, interval = ?interval, "crowdsec bouncer started");
    loop {
        let wait = bouncer.step(lapi, sink, interval);
        std::thread::sleep(wait);
    }
}

impl Bouncer {
    /// One poll and one round with the daemon; how long to wait before the next.
    pub(crate) fn step(&mut self, feed: &impl Feed, sink: &mut impl Sink, interval: Duration) -> Duration {
        let wait = self.poll(feed, interval);
        self.daemon.sync(&mut self.bans, self.full_read, sink);
        wait
    }

    fn poll(&mut self, feed: &impl Feed, interval: Duration) -> Duration {
        let full = self.startup;
        let batch = match feed.poll(full) {
            Ok(batch) => batch,
            Err(e) => {
                // The bans applied stay (fail static); the next answer is asked for in full,
                // to catch up on what changed meanwhile.
                tracing::error!(retry_in = ?self.backoff, "{e}; the bans applied are kept");
                self.lapi_down = true;
                self.startup = true;
                let wait = self.backoff;
                self.backoff = next_backoff(self.backoff);
                return wait;
            }
        };
        if self.lapi_down {
            tracing::info!(lapi = %feed.url(), "the LAPI answers again");
            self.lapi_down = false;
        }
        self.backoff = BACKOFF_MIN;
        let (new, deleted, skipped) = (batch.new.len(), batch.deleted.len(), batch.skipped);
        // Only a change can hold one: a full set with one is refused whole (`Lapi::poll`).
        let first_malformed = batch.first_malformed.clone();
        let now = Instant::now();
        self.bans.expire(now);
        let dropped = self.bans.apply(batch, now, full);
        self.full_read |= full;
        self.startup = skipped.malformed > 0;
        if let Some(first) = first_malformed {
            tracing::error!(
                malformed = skipped.malformed,
                "the LAPI at {} sent {} unreadable decisions (first: {first}): skipped, and nothing lifted for them; \
                 the full set is asked for next",
                feed.url(),
                skipped.malformed
            );
        }
        if dropped > 0 {
            tracing::error!(
                dropped,
                "{dropped} new decisions dropped: the bouncer holds {MAX_HELD} at most (what the daemon can hold)"
            );
        }
        if skipped.total() > 0 {
            tracing::info!(skipped = skipped.total(), "decisions skipped: {skipped}");
        }
        if new > 0 || deleted > 0 || full {
            tracing::info!(new, deleted, full, banned = self.bans.len(), "decisions read");
        }
        interval
    }
}

#[cfg(test)]
mod tests {
    use std::{cell::RefCell, collections::BTreeMap};

    use ipnet::IpNet;

    use super::*;
    use crate::bouncer::stream::parse_stream;

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

    /// A LAPI answering from a script: each poll takes the next answer, and says whether it
    /// asked for the full set.
    struct Script(RefCell<Vec<Result<&'static str, ()>>>, RefCell<Vec<bool>>);

    impl Script {
        fn new(answers: Vec<Result<&'static str, ()>>) -> Self {
            Self(RefCell::new(answers.into_iter().rev().collect()), RefCell::default())
        }
    }

    impl Feed for Script {
        fn url(&self) -> &str {
            "http://lapi"
        }

        fn poll(&self, startup: bool) -> Result<Batch, PollError> {
            self.1.borrow_mut().push(startup);
            let answer = self.0.borrow_mut().pop().expect("an answer left in the script");
            let url = "http://lapi".to_string();
            let batch = match answer {
                Ok(body) => parse_stream(body.as_bytes()).expect("a stream"),
                Err(()) => return Err(PollError::Status { url, status: 500 }),
            };
            // As `Lapi::poll` does.
            if startup && batch.skipped.malformed > 0 {
                let first = batch.first_malformed.unwrap_or_default();
                return Err(PollError::Unreadable { url, count: batch.skipped.malformed, first });
            }
            Ok(batch)
        }
    }

    /// A daemon: its bans of ours (network -> ms left), its instance, and whether it answers.
    #[derive(Default)]
    struct FakeDaemon {
        bans: BTreeMap<IpNet, u64>,
        instance: u64,
        down: bool,
        list_fails: bool,
    }

    impl Sink for FakeDaemon {
        fn add(&mut self, entries: &[(IpNet, Duration)]) -> Result<(), String> {
            if self.down {
                return Err("down".into());
            }
            self.bans.extend(entries.iter().map(|(n, d)| (*n, d.as_millis() as u64)));
            Ok(())
        }

        fn rm(&mut self, nets: &[IpNet]) -> Result<(), String> {
            if self.down {
                return Err("down".into());
            }
            for net in nets {
                self.bans.remove(net);
            }
            Ok(())
        }

        fn listed(&mut self) -> Result<Vec<(IpNet, Duration)>, String> {
            if self.down || self.list_fails {
                return Err("the listing failed".into());
            }
            Ok(self.bans.iter().map(|(n, ms)| (*n, Duration::from_millis(*ms))).collect())
        }

        fn instance(&mut self) -> Result<Option<u64>, String> {
            if self.down { Err("down".into()) } else { Ok(Some(self.instance)) }
        }
    }

    impl FakeDaemon {
        fn nets(&self) -> Vec<String> {
            self.bans.keys().map(ToString::to_string).collect()
        }
    }

    const TWO: &str = r#"{"new":[{"duration":"1h","id":1,"scope":"Ip","type":"ban","value":"198.18.0.1"},
        {"duration":"1h","id":2,"scope":"Ip","type":"ban","value":"198.18.0.2"}],"deleted":null}"#;
    const NOTHING: &str = r#"{"new":null,"deleted":null}"#;

    #[test]
    fn an_unreadable_full_set_changes_nothing_and_is_asked_for_again() {
        let feed = Script::new(vec![
            Ok(TWO),
            Err(()),
            // After the failure, the full set: one duration a number, not text.
            Ok(r#"{"new":[{"duration":3600,"id":1,"scope":"Ip","type":"ban","value":"198.18.0.1"},
                {"duration":"1h","id":2,"scope":"Ip","type":"ban","value":"198.18.0.2"}],"deleted":null}"#),
            Ok(TWO),
        ]);
        let (mut bouncer, mut daemon) = (Bouncer::default(), FakeDaemon::default());
        let step = |b: &mut Bouncer, d: &mut FakeDaemon| b.step(&feed, d, Duration::from_secs(1));
        step(&mut bouncer, &mut daemon);
        assert_eq!(daemon.nets(), ["198.18.0.1/32", "198.18.0.2/32"]);
        step(&mut bouncer, &mut daemon);
        assert_eq!(step(&mut bouncer, &mut daemon), Duration::from_secs(2), "a refused set backs off as a failure");
        assert_eq!(daemon.nets(), ["198.18.0.1/32", "198.18.0.2/32"], "the unreadable set lifted bans");
        assert_eq!(bouncer.bans.len(), 2);
        step(&mut bouncer, &mut daemon);
        assert_eq!(*feed.1.borrow(), [true, false, true, true], "the full set asked for after each failure");
    }

    #[test]
    fn an_unreadable_change_lifts_nothing_it_cannot_read_and_brings_the_full_set_next() {
        let feed = Script::new(vec![
            Ok(TWO),
            // A change: .1 deleted but unreadable (its value a number), .3 new and readable.
            Ok(r#"{"new":[{"duration":"1h","id":3,"scope":"Ip","type":"ban","value":"198.18.0.3"}],
                "deleted":[{"duration":"-1s","id":1,"scope":"Ip","type":"ban","value":3232235521}]}"#),
            Ok(TWO),
        ]);
        let (mut bouncer, mut daemon) = (Bouncer::default(), FakeDaemon::default());
        for _ in 0..2 {
            bouncer.step(&feed, &mut daemon, Duration::from_secs(1));
        }
        assert_eq!(daemon.nets(), ["198.18.0.1/32", "198.18.0.2/32", "198.18.0.3/32"]);
        // The full set next: it lacks .3, which is lifted (and .1 stays: the full set has it).
        bouncer.step(&feed, &mut daemon, Duration::from_secs(1));
        assert_eq!(*feed.1.borrow(), [true, false, true]);
        assert_eq!(daemon.nets(), ["198.18.0.1/32", "198.18.0.2/32"]);
    }

    #[test]
    fn a_restarted_daemon_gets_back_what_it_lost() {
        let feed = Script::new(vec![Ok(TWO), Ok(NOTHING), Ok(NOTHING), Ok(NOTHING), Ok(NOTHING), Ok(NOTHING)]);
        let (mut bouncer, mut daemon) = (Bouncer::default(), FakeDaemon { instance: 1, ..FakeDaemon::default() });
        // A ban of a previous run, which the LAPI no longer has: lifted by the first reconcile.
        daemon.bans.insert("198.18.0.9/32".parse().unwrap(), 60_000);
        bouncer.step(&feed, &mut daemon, Duration::from_secs(1));
        assert_eq!(daemon.nets(), ["198.18.0.1/32", "198.18.0.2/32"]);
        assert!(!bouncer.daemon.must_reconcile());
        // Restarted, with its state lost, between two polls.
        daemon.bans.clear();
        daemon.instance = 2;
        bouncer.step(&feed, &mut daemon, Duration::from_secs(1));
        assert_eq!(daemon.nets(), ["198.18.0.1/32", "198.18.0.2/32"], "not sent again after the restart");
        let left = daemon.bans.values().copied().min().unwrap_or_default();
        assert!(left > 3_590_000, "sent again with {left} ms left of an hour");
        // A listing that fails: tried again (after a backoff), the bans kept.
        daemon.bans.clear();
        daemon.instance = 3;
        daemon.list_fails = true;
        bouncer.step(&feed, &mut daemon, Duration::from_secs(1));
        assert!(bouncer.daemon.must_reconcile());
        assert_eq!(daemon.nets(), Vec::<String>::new());
        daemon.list_fails = false;
        std::thread::sleep(BACKOFF_MIN);
        bouncer.step(&feed, &mut daemon, Duration::from_secs(1));
        assert_eq!(daemon.nets(), ["198.18.0.1/32", "198.18.0.2/32"]);
        // Down, then back with nothing (a daemon that names no instance would look the same).
        daemon.down = true;
        bouncer.step(&feed, &mut daemon, Duration::from_secs(1));
        daemon.down = false;
        daemon.bans.clear();
        bouncer.step(&feed, &mut daemon, Duration::from_secs(1));
        assert_eq!(daemon.nets(), ["198.18.0.1/32", "198.18.0.2/32"]);
    }
}

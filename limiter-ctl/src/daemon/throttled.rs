//! A warning a local user could cause thousands of times a second (refused or failing
//! connections, on the control socket and the metrics endpoint), logged at a bounded rate.

use std::time::{Duration, Instant};

/// A warning a local user could cause thousands of times a second: logged at most once per
/// [`Throttled::EVERY`], saying how many were not.
#[derive(Default)]
pub(super) struct Throttled {
    last: Option<Instant>,
    quiet: u64,
}

impl Throttled {
    const EVERY: Duration = Duration::from_secs(10);

    /// Some(how many went unlogged since the last one) when this one is to be logged.
    pub(super) fn hit(&mut self) -> Option<u64> {
        match self.last {
            Some(last) if last.elapsed() < Self::EVERY => {
                self.quiet += 1;
                None
            }
            _ => {
                self.last = Some(Instant::now());
                Some(std::mem::take(&mut self.quiet))
            }
        }
    }
}

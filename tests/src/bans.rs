//! Watching bans take effect on real traffic: sources sending steadily to a rig's receiver
//! (paced, interleaved, pinned, bounded in time) while a test has them banned and unbanned, and
//! a capture of what XDP let through, timed on arrival. Afterwards, per source: when its
//! packets stopped arriving and when they came back. A source never banned runs alongside, so a
//! gap that the sender's own stall would explain is told from a ban.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::{
    flood::{Flow, Limits, Sources},
    rig::{Flooding, Rig, Run, flow},
};

/// Packets per second, for all the sources together: a delivery every few milliseconds per
/// source, a cost the 2-CPU machine does not notice.
pub const PER_SEC: f64 = 2000.0;
/// The destination port of the watched traffic.
pub const PORT: u16 = 4700;

pub struct Watch {
    flooding: Flooding,
    flows: Vec<(IpAddr, Flow)>,
}

impl Watch {
    /// Starts a capture, then `sources` (each one stream, interleaved) at [`PER_SEC`] in all,
    /// for at most `max` (or until [`Watch::finish`]).
    pub fn start(rig: &Rig, sources: &[IpAddr], max: Duration) -> anyhow::Result<Self> {
        let streams: Vec<_> = sources.iter().map(|s| rig.udp(Sources::One(*s), PORT)).collect();
        let flows = streams.iter().zip(sources).map(|(st, s)| (*s, flow(st, *s))).collect();
        let flooding = rig.start_flood(&streams, Limits::timed(max), Some(PER_SEC)).context("starting the watch")?;
        Ok(Self { flooding, flows })
    }

    /// Stops the senders and returns what arrived.
    pub fn finish(self) -> anyhow::Result<Watched> {
        self.flooding.stop();
        let run = self.flooding.finish()?;
        Ok(Watched { run, flows: self.flows })
    }
}

pub struct Watched {
    pub run: Run,
    flows: Vec<(IpAddr, Flow)>,
}

impl Watched {
    fn flow(&self, src: IpAddr) -> Flow {
        self.flows.iter().find(|(s, _)| *s == src).map(|(_, f)| *f).unwrap_or_else(|| panic!("{src} was not watched"))
    }

    /// When `src`'s packets arrived, in order.
    pub fn arrivals(&self, src: IpAddr) -> Vec<Instant> {
        let flow = self.flow(src);
        self.run.captured.seen.iter().filter(|s| s.flow == flow).map(|s| s.at).collect()
    }

    /// Packets of `src` that arrived in `[from, to)`.
    pub fn delivered(&self, src: IpAddr, from: Instant, to: Instant) -> u64 {
        let flow = self.flow(src);
        self.run.captured.between(|f| *f == flow, from, to)
    }

    /// The first arrival of `src` at or after `from`.
    pub fn first_from(&self, src: IpAddr, from: Instant) -> Option<Instant> {
        self.arrivals(src).into_iter().find(|t| *t >= from)
    }

    /// The longest time without an arrival of `src` within `[from, to)` (from `from` to the
    /// first arrival, between arrivals, from the last to `to`).
    pub fn longest_gap(&self, src: IpAddr, from: Instant, to: Instant) -> Duration {
        let mut last = from;
        let mut longest = Duration::ZERO;
        for t in self.arrivals(src).into_iter().filter(|t| *t >= from && *t < to).chain([to]) {
            longest = longest.max(t.duration_since(last));
            last = t;
        }
        longest
    }
}

/// A ban seen on the traffic of one source: it was cut off `cut` after the ban was asked for
/// (its last arrival before the dark stretch), and its packets came back `back` after that.
#[derive(Clone, Copy, Debug)]
pub struct Seen {
    /// From the ban asked for to the last packet that got through.
    pub cut: Duration,
    /// From the ban asked for to the first packet through again (None: not within the watch).
    pub back: Option<Duration>,
}

impl Watched {
    /// How a ban on `src` asked for at `asked` showed on its traffic: its last arrival before
    /// its first dark stretch of at least `dark` after `asked`, and its first arrival after it.
    pub fn ban(&self, src: IpAddr, asked: Instant, dark: Duration) -> Option<Seen> {
        let times: Vec<Instant> = self.arrivals(src).into_iter().filter(|t| *t >= asked).collect();
        let mut last = asked;
        for t in times.iter().copied().chain([Instant::now()]) {
            if t.duration_since(last) >= dark {
                let back = times.iter().find(|x| **x > last).map(|x| x.duration_since(asked));
                return Some(Seen { cut: last.duration_since(asked), back });
            }
            last = t;
        }
        None
    }
}

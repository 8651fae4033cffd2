//! Holding delivered counts to GCRA's published bound.
//!
//! GCRA state is per bucket per CPU, and veth runs the receiver's XDP in NAPI on the CPU that
//! sent, so floods are pinned to one CPU ([`crate::cpu::flood_cpu`]) and a policy's per-CPU
//! counters say which CPUs judged its packets. The upper bound is ONE CPU's `Gcra::bound(window)`,
//! the pinned CPU's, where the window runs from before the first send to after the last delivery
//! (or the counter read): frames judged on any other CPU fail it ([`check_upper`]), since another
//! CPU's state would grant an allowance of its own that the bound does not count. Only tests
//! about CPUs (tests/datapath/scope.rs) sum per-CPU bounds ([`check_upper_over`]).
//!
//! The lower bound asks for 90% of one CPU's bound over the flood's own
//! duration (as measured, whatever the machine's speed), less what the sender's own stalls can
//! have cost ([`stall_cost`]): the flood offers far more than the rate ([`MIN_OVERLOAD`]), so
//! the limiter must admit close to its full allowance of the time the flood was actually offered,
//! and of the frames it actually offered between two stalls ([`offered_allowance`]).
//!
//! A source kept to a share of the rate loses nothing ([`check_steady`]), unless its paced
//! sender, stalled, caught up in a burst larger than the bucket's.
//!
//! Every failure says what was measured and the bound it broke, and which side is at fault: an
//! upper bound broken is the limiter's; a flood too slow or too stalled to test a lower bound is
//! the machine's, and says so.

use std::time::{Duration, Instant};

use limiter_common::{Gcra, gcra::CLOCK_SHIFT, maps::Counters};

use crate::flood::Report;

/// A flood must offer a bucket at least this multiple of its rate, or the lower bound would
/// test the sender rather than the limiter.
pub const MIN_OVERLOAD: f64 = 10.0;

/// What the per-CPU counters of one policy say.
#[derive(Clone, Debug)]
pub struct Judged {
    pub per_cpu: Vec<Counters>,
    /// The CPUs that judged at least one packet.
    pub cpus: Vec<usize>,
    pub total: Counters,
}

impl Judged {
    /// What each CPU counted between two reads of the same policy's per-CPU counters.
    pub fn between(before: &[Counters], after: &[Counters]) -> Self {
        let zero = Counters::default();
        let per_cpu: Vec<Counters> =
            after.iter().enumerate().map(|(cpu, now)| since(now, before.get(cpu).unwrap_or(&zero))).collect();
        Self::new(&per_cpu)
    }

    pub fn new(per_cpu: &[Counters]) -> Self {
        let total = total(per_cpu);
        let cpus = (0..per_cpu.len()).filter(|&c| per_cpu[c].packets() > 0).collect();
        Self { per_cpu: per_cpu.to_vec(), cpus, total }
    }

    /// Someone judged the flood, the pinned CPU among them, never more than was sent, and some of
    /// it was refused (or the test measured nothing).
    pub fn check_against(&self, report: &Report) {
        let cpu = crate::cpu::flood_cpu();
        assert!(self.cpus.contains(&cpu), "the pinned CPU {cpu} judged nothing: {:?}", self.per_cpu);
        let judged = self.total.packets();
        assert!(judged <= report.sent, "judged {judged} > sent {}", report.sent);
        assert!(self.total.refused_packets > 0, "nothing was refused: {:?}", self.per_cpu);
        assert_eq!(self.total.errors, 0, "the program reported internal errors");
    }

    /// Judged on the sender's pinned CPU alone, the admissions are held to that CPU's bound over
    /// `window`, and make at least 90% of its allowance over the flood.
    pub fn check_admitted(&self, gcra: &Gcra, window: Duration, flood: &Report) {
        check_bounds("admitted", self.total.admitted_packets, gcra, self, window, flood);
    }

    /// Every frame was judged on the CPU the sender is pinned to ([`crate::cpu::flood_cpu`]), or
    /// none was: a frame judged on another CPU met that CPU's buckets, whose allowance is its own,
    /// so one CPU's bound would no longer hold the flood (a leak the bound must not absorb).
    #[track_caller]
    pub fn check_pinned(&self, what: &str) {
        let cpu = crate::cpu::flood_cpu();
        assert!(
            self.cpus.iter().all(|&c| c == cpu),
            "{what}: frames were judged on CPUs {:?}, but the sender is pinned to CPU {cpu} ({self}): another CPU's \
             buckets grant an allowance of their own, which one CPU's bound does not count",
            self.cpus
        );
    }
}

impl std::fmt::Display for Judged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let packets: Vec<u64> = self.per_cpu.iter().map(Counters::packets).collect();
        write!(
            f,
            "judged per CPU {packets:?} (admitted {}, refused {})",
            self.total.admitted_packets, self.total.refused_packets
        )
    }
}

/// Sums per-CPU counters.
pub fn total(per_cpu: &[Counters]) -> Counters {
    let mut sum = Counters::default();
    per_cpu.iter().for_each(|c| sum.add(c));
    sum
}

/// What `now` counted since `before` (counters only grow while a policy lives).
pub fn since(now: &Counters, before: &Counters) -> Counters {
    let d = |n: u64, b: u64| n.saturating_sub(b);
    Counters {
        admitted_packets: d(now.admitted_packets, before.admitted_packets),
        admitted_bytes: d(now.admitted_bytes, before.admitted_bytes),
        refused_packets: d(now.refused_packets, before.refused_packets),
        refused_bytes: d(now.refused_bytes, before.refused_bytes),
        dry_run_packets: d(now.dry_run_packets, before.dry_run_packets),
        dry_run_bytes: d(now.dry_run_bytes, before.dry_run_bytes),
        overruled_packets: d(now.overruled_packets, before.overruled_packets),
        allowed_packets: d(now.allowed_packets, before.allowed_packets),
        denied_packets: d(now.denied_packets, before.denied_packets),
        not_ip: d(now.not_ip, before.not_ip),
        malformed: d(now.malformed, before.malformed),
        unmatched: d(now.unmatched, before.unmatched),
        errors: d(now.errors, before.errors),
        unreadable_ports: d(now.unreadable_ports, before.unreadable_ports),
    }
}

/// `got` within [90% of one CPU's bound over the flood, the pinned CPU's bound over `window`]
/// ([`check_upper`], [`check_lower`]).
#[track_caller]
pub fn check_bounds(what: &str, got: u64, gcra: &Gcra, judged: &Judged, window: Duration, flood: &Report) {
    check_upper(what, got, gcra, judged, window);
    check_lower(what, got, gcra, flood);
}

/// `got` within one CPU's bound over `window`, every frame `judged` on the CPU the sender is
/// pinned to ([`Judged::check_pinned`]): the bound of the CPU named, not one per CPU seen.
#[track_caller]
pub fn check_upper(what: &str, got: u64, gcra: &Gcra, judged: &Judged, window: Duration) {
    judged.check_pinned(what);
    check_upper_over(&format!("{what} (on CPU {})", crate::cpu::flood_cpu()), got, gcra, 1, window);
}

/// `got` within the sum of `cpus` per-CPU bounds over `window`: for tests about CPUs (what a
/// policy of scope `cpu` admits on each of several CPUs); every other test names its CPU
/// ([`check_upper`]). Broken, it is the limiter's fault: no machine, however slow, makes it
/// admit more than the bound over the time it had.
#[track_caller]
pub fn check_upper_over(what: &str, got: u64, gcra: &Gcra, cpus: usize, window: Duration) {
    let upper = cpus.max(1) as u64 * gcra.bound(nanos(window));
    eprintln!("  {what}: {got} <= {upper} (window {window:?}, {cpus} CPU(s))");
    assert!(
        got <= upper,
        "{what}: admitted {got} > bound {upper} ({cpus} CPU(s) x GCRA bound over the window {window:?}: burst window \
         {:?}): the limiter let through more than its bound",
        Duration::from_nanos(gcra.window_ns())
    );
}

/// `got` (packets) at least 90% of one CPU's bound over the flood's duration, less what the
/// sender's stalls can have cost ([`check_lower_weighted`] with weight 1).
pub fn check_lower(what: &str, got: u64, gcra: &Gcra, flood: &Report) {
    check_lower_weighted(what, got, gcra, flood, 1);
}

/// `got` at least 90% of what a bucket of `gcra`, fresh at the flood's start, admits of an offer
/// that never lets up but for the sender's stalls, as measured ([`offered_allowance`], arrivals
/// of `weight` units): the flood's own duration and stalls, whatever the machine's speed. If the
/// stalls took more than half of the bound over the flood, the machine was too busy to test
/// this: the failure says so.
pub fn check_lower_weighted(what: &str, got: u64, gcra: &Gcra, flood: &Report, weight: u64) {
    let duration = flood.duration();
    let full = gcra.bound(nanos(duration));
    let least = offered_allowance(gcra, flood, weight);
    lower(what, got, full, least, duration, flood);
}

/// [`check_lower_weighted`] over `duration`, a part of `flood` whose bucket may be spent when it
/// begins: the bound less what all of the flood's stalls can have cost ([`stall_cost`]).
pub fn check_lower_during(what: &str, got: u64, gcra: &Gcra, duration: Duration, flood: &Report, weight: u64) {
    let full = gcra.bound(nanos(duration));
    let least = full.saturating_sub(stall_cost(gcra, flood, weight));
    lower(what, got, full, least, duration, flood);
}

fn lower(what: &str, got: u64, full: u64, least: u64, duration: Duration, flood: &Report) {
    let stalls = &flood.stalls;
    let machine = format!(
        "the sender stalled {} time(s) for {:?} in all (longest {:?}), leaving {least} of the {full} allowed over \
         {duration:?}; flood: {flood}",
        stalls.count(),
        stalls.total(),
        stalls.longest()
    );
    eprintln!("  {what}: {got} >= 90% of {least} ({machine})");
    assert!(
        least * 2 >= full,
        "{what}: cannot test the lower bound: {machine}: the machine was too busy (admitted {got})"
    );
    assert!(
        got * 10 >= least * 9,
        "{what}: admitted {got} < 90% of {least} (what the rate allows of the flood as offered): the limiter \
         refused what its rate allows ({machine})"
    );
}

/// What a bucket of `gcra`, fresh at the flood's start, admits over the flood's duration if
/// arrivals of `weight` units never let up except during the sender's stalls, and never
/// outnumber the frames the sender sent between two stalls (in units). A sender that offered
/// less than the rate between its stalls (an emulated CPU run in spells) offered no more.
pub fn offered_allowance(gcra: &Gcra, flood: &Report, weight: u64) -> u64 {
    let units = |d: Duration| u128::from(nanos(d)) << CLOCK_SHIFT;
    let end = units(flood.duration());
    let (cost, capacity) = (u128::from(gcra.cost(weight)), u128::from(gcra.capacity));
    let stalls: Vec<(u128, u128)> = flood.stalls.each.iter().map(|s| (units(s.from), units(s.end()))).collect();
    // Frames sent before each stall, then in all: interval `i` runs from stall `i - 1` to stall `i`.
    let sent_by: Vec<u64> = flood.stalls.each.iter().map(|s| s.sent_before).chain([flood.sent]).collect();
    let frames = |i: usize| sent_by[i] - if i == 0 { 0 } else { sent_by[i - 1] };
    let (mut tat, mut now, mut next, mut taken, mut admitted) = (0u128, 0u128, 0usize, 0u64, 0u64);
    loop {
        let mut t = earliest(tat, cost, capacity).max(now);
        while next < stalls.len() && stalls[next].1 <= t {
            (next, taken) = (next + 1, 0);
        }
        if next < stalls.len() && stalls[next].0 <= t {
            (t, next, taken) = (stalls[next].1, next + 1, 0);
        }
        if t > end {
            return admitted;
        }
        if taken >= frames(next) {
            // This interval's frames are all admitted: the next arrive when the next stall ends.
            if next == stalls.len() {
                return admitted;
            }
            (now, next, taken) = (stalls[next].1, next + 1, 0);
            continue;
        }
        tat = tat.max(t) + cost;
        now = t;
        taken += 1;
        admitted += weight;
    }
}

/// The earliest an arrival of `cost` fits a bucket at `tat` of `capacity` (clock units): once
/// `tat - now + cost <= capacity`.
fn earliest(tat: u128, cost: u128, capacity: u128) -> u128 {
    (tat + cost).saturating_sub(capacity)
}

/// A source that kept to a share of `gcra`'s rate lost nothing: `got` of the frames of its
/// `steady` flood came through. If some did not, but the flood did not keep to the rate either (a
/// paced sender sends at once what fell due while it stalled, and a long stall's catch-up can
/// outrun the burst: see [`first_over`]), the machine stalled the source, and the failure says so.
#[track_caller]
pub fn check_steady(what: &str, got: u64, gcra: &Gcra, steady: &Report) {
    if got == steady.sent {
        return;
    }
    let lost = steady.sent.saturating_sub(got);
    if let Some((k, late)) = first_over(gcra, steady) {
        panic!(
            "{what}: {lost} of the steady source's {} frames were refused, but it did not keep to the rate: its \
             sender stalled and caught up at once, offering frame {k} {late:?} before the bucket allowed \
             ({steady}): the machine was too busy to test this",
            steady.sent
        );
    }
    panic!(
        "{what}: the source keeping to its share of the rate had {lost} of its {} frames refused, though its \
         sends, stalls and catch-ups included, kept to the rate ({steady}): the limiter refused what its rate allows \
         (got {got})",
        steady.sent
    );
}

/// The first frame of a paced `flood` that a bucket of `gcra`, fresh at its start, would have
/// refused, and how early it came, if the frames were sent as early as they can have been: each
/// when due at its pace, but none during a stall, and those due in one at its end. `None` for a
/// flood that was not paced.
pub fn first_over(gcra: &Gcra, flood: &Report) -> Option<(u64, Duration)> {
    let pace = flood.paced?;
    let units = |d: Duration| u128::from(nanos(d)) << CLOCK_SHIFT;
    let (cost, capacity) = (u128::from(gcra.cost(1)), u128::from(gcra.capacity));
    let (mut tat, mut stall) = (0u128, 0usize);
    for k in 0..flood.sent {
        while stall < flood.stalls.count() && flood.stalls.each[stall].sent_before <= k {
            stall += 1;
        }
        let resumed = stall.checked_sub(1).map_or(0, |s| units(flood.stalls.each[s].end()));
        let t = units(Duration::from_secs_f64(k as f64 / pace)).max(resumed);
        let allowed = earliest(tat, cost, capacity);
        if allowed > t {
            return Some((k, Duration::from_nanos(((allowed - t) >> CLOCK_SHIFT) as u64)));
        }
        tat = tat.max(t) + cost;
    }
    None
}

/// The most a bucket of `gcra`, kept full by an overload, can have lost to the sender's stalls
/// during `flood`: each stall of `g` first spends the bucket's credit (its capacity less one
/// arrival), then delays every later admission by the rest; the delays add up, so the loss is
/// their sum over `T`, plus one arrival of `weight` for the rounding.
pub fn stall_cost(gcra: &Gcra, flood: &Report, weight: u64) -> u64 {
    let credit = u128::from(gcra.capacity.saturating_sub(gcra.cost(weight)));
    let delay: u128 = flood
        .stalls
        .each
        .iter()
        .map(|s| u128::from(nanos(s.len)) << CLOCK_SHIFT)
        .map(|g| g.saturating_sub(credit))
        .sum();
    if delay == 0 {
        return 0;
    }
    delay.div_ceil(u128::from(gcra.emission.max(1))) as u64 + weight
}

/// The flood offered each of `buckets` buckets at least [`MIN_OVERLOAD`] times `rate` per second.
/// Failing, it is the machine that is too slow, not the limiter.
pub fn check_overload(report: &Report, rate: f64, buckets: usize) {
    let per_bucket = report.pps() / buckets as f64;
    assert!(
        per_bucket >= MIN_OVERLOAD * rate,
        "the flood offered {per_bucket:.0} per second per bucket ({report}, {buckets} buckets), under {MIN_OVERLOAD}x \
         the {rate}/s rate: the machine is too slow a sender to test the limiter"
    );
}

pub fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// When the flood started (taken before its first send).
pub fn first(report: &Report) -> Instant {
    report.first.expect("a flood records its start")
}

/// From before the first send to after `last` (the last delivery; the flood's end if none): every
/// delivered packet was judged inside it.
pub fn window(report: &Report, last: Option<Instant>) -> Duration {
    let end = last.or(report.last).unwrap_or_else(Instant::now);
    end.duration_since(first(report))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flood::{Stall, Stalls};

    fn flood(ms: u64, stalls: &[(u64, u64)]) -> Report {
        let start = Instant::now();
        let d = Duration::from_millis;
        // Frames enough between stalls that only the rate and the stalls limit the allowance.
        let many = 1_000_000;
        let each =
            stalls.iter().zip(1..).map(|(&(at, len), i)| Stall { from: d(at), len: d(len), sent_before: i * many });
        Report {
            sent: (stalls.len() as u64 + 1) * many,
            first: Some(start),
            last: Some(start + d(ms)),
            stalls: Stalls { each: each.collect() },
            ..Report::default()
        }
    }

    #[test]
    fn the_allowance_of_an_offer_follows_the_bound_and_the_stalls() {
        // 100/s, burst 1: one admission every 10 ms from 0.
        let gcra = Gcra::new(100, 1_000_000_000, 1, 1).unwrap();
        assert_eq!(offered_allowance(&gcra, &flood(1000, &[]), 1), gcra.bound(nanos(Duration::from_secs(1))));
        // A stall of 3 ms over the admission due at 20 ms delays it and every later one by 3 ms.
        assert_eq!(offered_allowance(&gcra, &flood(1000, &[(19, 4)]), 1), 100);
        assert_eq!(
            offered_allowance(&gcra, &flood(1000, &[(12, 5)]), 1),
            101,
            "a stall between admissions costs nothing"
        );
        // Stalled half the time in 5 ms slices, every other admission is 5 ms late.
        let half: Vec<(u64, u64)> = (0..100).map(|i| (i * 10 + 5, 5)).collect();
        let got = offered_allowance(&gcra, &flood(1000, &half), 1);
        assert!((50..=101).contains(&got), "{got}");
        // Burst 50 at 500/s (T 2 ms): a stall spends up to 49 T = 98 ms of credit before it costs.
        let gcra = Gcra::new(500, 1_000_000_000, 50, 1).unwrap();
        let whole = offered_allowance(&gcra, &flood(1000, &[]), 1);
        assert_eq!(whole, gcra.bound(nanos(Duration::from_secs(1))));
        assert!(offered_allowance(&gcra, &flood(1000, &[(500, 50)]), 1) >= whole - 1);
        assert_eq!(stall_cost(&gcra, &flood(1000, &[(500, 50)]), 1), 0);
        assert_eq!(stall_cost(&gcra, &flood(1000, &[(500, 150)]), 1), 26 + 1, "52 ms past the credit");
        let late = offered_allowance(&gcra, &flood(1000, &[(500, 150)]), 1);
        assert!(late < whole && late + 27 >= whole, "{late} of {whole}");
    }

    /// A sender run in spells (an emulated CPU's): `spells` of (frames sent, then a stall of ms).
    fn spells(ms: u64, spells: &[(u64, u64)], paced: Option<f64>) -> Report {
        let start = Instant::now();
        let (mut at, mut sent, mut each) = (Duration::ZERO, 0, Vec::new());
        for &(frames, stall) in spells {
            // The frames go out in a millisecond, then the stall.
            (at, sent) = (at + Duration::from_millis(1), sent + frames);
            each.push(Stall { from: at, len: Duration::from_millis(stall), sent_before: sent });
            at += Duration::from_millis(stall);
        }
        let last = Some(start + Duration::from_millis(ms));
        Report { sent, first: Some(start), last, stalls: Stalls { each }, paced, ..Report::default() }
    }

    #[test]
    fn a_sender_in_spells_is_allowed_no_more_than_it_sent_between_stalls() {
        // 200/s burst 50: 60 frames at once, then 10 frames after each of 15 stalls of 75 ms.
        let gcra = Gcra::new(200, 1_000_000_000, 50, 1).unwrap();
        let mut runs = vec![(60, 75)];
        runs.extend([(10, 75); 15]);
        let flood = spells(1216, &runs, None);
        // The first spell gets the burst (50 at once), each later one its 10: the bucket refills
        // 15 in a stall, more than a spell spends.
        assert_eq!(gcra.bound(0), 50);
        assert_eq!(offered_allowance(&gcra, &flood, 1), 50 + 150);
        // A sender that kept up between the same stalls would have had 15 a stall.
        let many: Vec<(u64, u64)> = runs.iter().map(|&(_, stall)| (1000, stall)).collect();
        assert!(offered_allowance(&gcra, &spells(1216, &many, None), 1) >= 50 + 15 * 15);
    }

    /// A source paced at 100/s for 2 s that stalled `stall` ms after its 20th frame, then caught
    /// up (every frame due by then sent at once).
    fn paced(stall: u64) -> Report {
        let mut report = spells(2000, &[], Some(100.0));
        report.sent = 200;
        let from = Duration::from_millis(200);
        report.stalls.each = vec![Stall { from, len: Duration::from_millis(stall), sent_before: 20 }];
        report
    }

    #[test]
    fn a_paced_sender_keeps_to_the_rate_unless_a_stall_s_catch_up_outruns_the_burst() {
        // 200/s burst 50.
        let gcra = Gcra::new(200, 1_000_000_000, 50, 1).unwrap();
        assert_eq!(first_over(&gcra, &paced(0)), None);
        // Stalled 400 ms: the 41 frames due by its end go at once, within the burst.
        assert_eq!(first_over(&gcra, &paced(400)), None);
        check_steady("kept the rate", 200, &gcra, &paced(400));
        // Stalled 700 ms: 71 at once; the bucket, full, takes 50 of them.
        let (k, early) = first_over(&gcra, &paced(700)).expect("71 frames at once outrun a burst of 50");
        assert_eq!((k, early), (20 + 50, Duration::from_millis(5)));
    }

    #[test]
    #[should_panic(expected = "the machine was too busy")]
    fn a_steady_source_stalled_past_its_burst_is_the_machine_s_fault() {
        let gcra = Gcra::new(200, 1_000_000_000, 50, 1).unwrap();
        check_steady("stalled", 179, &gcra, &paced(700));
    }

    #[test]
    #[should_panic(expected = "the limiter refused what its rate allows")]
    fn a_steady_source_that_kept_the_rate_and_lost_frames_is_the_limiter_s_fault() {
        let gcra = Gcra::new(200, 1_000_000_000, 50, 1).unwrap();
        check_steady("kept the rate", 199, &gcra, &paced(400));
    }

    /// 100 admitted over 1 s at 100/s burst 1: over one CPU's bound (101 with the first), within
    /// two CPUs' (202), which is what an upper bound multiplied by the CPUs seen allowed.
    fn split_over_cpus(on_pinned: u64, elsewhere: u64) -> (Gcra, Judged) {
        let gcra = Gcra::new(100, 1_000_000_000, 1, 1).unwrap();
        let cpu = crate::cpu::flood_cpu();
        let other = if cpu == 0 { 1 } else { 0 };
        let mut per_cpu = vec![Counters::default(); cpu.max(other) + 1];
        per_cpu[cpu].admitted_packets = on_pinned;
        per_cpu[other].admitted_packets = elsewhere;
        (gcra, Judged::new(&per_cpu))
    }

    #[test]
    #[should_panic(expected = "but the sender is pinned to CPU")]
    fn an_upper_bound_fails_when_frames_were_judged_on_another_cpu() {
        let (gcra, judged) = split_over_cpus(50, 50);
        check_upper("leaked", 100, &gcra, &judged, Duration::from_secs(1));
    }

    #[test]
    fn an_upper_bound_is_one_cpus_bound() {
        let (gcra, judged) = split_over_cpus(100, 0);
        check_upper("pinned", 100, &gcra, &judged, Duration::from_secs(1));
        let result = std::panic::catch_unwind(|| check_upper("pinned", 102, &gcra, &judged, Duration::from_secs(1)));
        assert!(result.is_err(), "102 over 1 s at 100/s burst 1 passed one CPU's bound");
    }
}

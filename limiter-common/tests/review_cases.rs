//! The cases a review of the bucket rules reproduced (issue 22), each as it was found: a clamp
//! that handed back a spent burst (after a rate edit, a removal, an id's reuse, with four rows,
//! during a rotation's grace), a TAT read wrong after 3.26 days of idling (the old clock's
//! wrap), and a grace period of refusals behind a stale bucket of the old generation.
//! `shared_buckets.rs` drives the same rules over random schedules.

use limiter_common::{
    Gcra,
    gcra::{self, CLOCK_SHIFT},
    rows::{MAX_ROWS, judge_rows},
};

const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
/// Where the old clock (2^-16 ns units) wrapped: 2^48 ns, 3.26 days.
const OLD_WRAP: u64 = 1 << 48;

/// Policy slots as the daemon keeps them: the active entry and the hold (`store_policy`).
#[derive(Default, Clone, Copy)]
struct Slot {
    capacity: u64,
    hold_until: u64,
}

struct Host {
    slots: [Slot; 8],
}

impl Host {
    fn new() -> Self {
        Host { slots: [Slot::default(); 8] }
    }
    /// What `kernel::maps::store_policy` does to a slot (capacity 0: removed).
    fn store(&mut self, id: u8, capacity: u64, now: u64) {
        let s = &mut self.slots[usize::from(id)];
        if capacity < s.capacity {
            s.hold_until = gcra::hold_after(s.capacity, s.hold_until, now);
        }
        s.capacity = capacity;
    }
    fn claim(&self, id: u8, now: u64) -> u64 {
        let s = self.slots[usize::from(id)];
        gcra::claim(s.capacity, s.hold_until, now)
    }
    /// One arrival of policy `id` on a one-row bucket.
    fn judge(&self, gcra: &Gcra, id: u8, bucket: &mut u64, now: u64) -> bool {
        let j = gcra.judge(id, *bucket, now, 1, |o| self.claim(o, now));
        if let Some(v) = j.store {
            assert!(j.admit, "a refusal wrote");
            *bucket = v;
        }
        j.admit
    }
}

/// A 10/s burst-100 source X (policy 1) spends its burst; a 1/s burst-100 source Y (policy 2)
/// sharing its bucket raises it to ~100 s ahead. Returns the host, the policies and the bucket.
fn x_spent_then_y_raised(t0: u64) -> (Host, Gcra, u64) {
    let mut host = Host::new();
    let a = Gcra::new(10, SEC, 100, 1).unwrap();
    let p = Gcra::new(1, SEC, 100, 1).unwrap();
    host.store(1, a.capacity, 0);
    host.store(2, p.capacity, 0);
    let mut bucket = 0;
    let x = (0..1000).filter(|_| host.judge(&a, 1, &mut bucket, t0)).count();
    assert_eq!(x, 100);
    let y = (0..1000).filter(|_| host.judge(&p, 2, &mut bucket, t0 + 10_000)).count();
    assert!(y >= 89, "Y admitted {y}");
    (host, a, bucket)
}

/// X floods for 0.6 ms after whatever happened to the bucket: it may get nothing more.
fn x_floods(host: &Host, a: &Gcra, bucket: &mut u64, from: u64) -> usize {
    (0..600).filter(|i| host.judge(a, 1, bucket, from + i * 1000)).count()
}

#[test]
fn a_rate_edit_of_another_policy_hands_back_no_burst() {
    let t0 = 5 * SEC;
    let (mut host, a, mut bucket) = x_spent_then_y_raised(t0);
    // The operator lowers P to 100/s burst 10; Y's next packet comes.
    let p2 = Gcra::new(100, SEC, 10, 1).unwrap();
    host.store(2, p2.capacity, t0 + 20_000);
    assert!(!host.judge(&p2, 2, &mut bucket, t0 + 30_000), "Y admitted with 99 s of its old rate owed");
    let more = x_floods(&host, &a, &mut bucket, t0 + 40_000);
    assert_eq!(more, 0, "X got {more} more within 0.6 ms of spending its burst of 100");
}

#[test]
fn a_removal_hands_back_no_burst() {
    let t0 = 5 * SEC;
    let (mut host, a, mut bucket) = x_spent_then_y_raised(t0);
    host.store(2, 0, t0 + 20_000);
    // A third policy's source reads the bucket.
    let q = Gcra::new(1000, SEC, 10, 1).unwrap();
    host.store(3, q.capacity, t0 + 20_000);
    assert!(!host.judge(&q, 3, &mut bucket, t0 + 30_000));
    assert_eq!(x_floods(&host, &a, &mut bucket, t0 + 40_000), 0);
}

#[test]
fn an_id_handed_to_another_policy_hands_back_no_burst() {
    let t0 = 5 * SEC;
    let (mut host, a, mut bucket) = x_spent_then_y_raised(t0);
    host.store(2, 0, t0 + 20_000);
    // The lowest free id goes to a new policy with a short window.
    let r = Gcra::new(100, SEC, 10, 1).unwrap();
    host.store(2, r.capacity, t0 + 25_000);
    assert!(!host.judge(&r, 2, &mut bucket, t0 + 30_000));
    assert_eq!(x_floods(&host, &a, &mut bucket, t0 + 40_000), 0);
}

/// With four rows, a bucket idle for the old clock's wrap sits in one of X's rows and a
/// flooder of another policy shares it: X's rows are never lowered, and X keeps its bound.
#[test]
fn four_rows_after_a_long_idle_keep_xs_bound() {
    let mut host = Host::new();
    let a = Gcra::new(10, SEC, 100, 1).unwrap();
    let b = Gcra::new(1000, SEC, 10, 1).unwrap();
    host.store(1, a.capacity, 0);
    host.store(2, b.capacity, 0);
    // Row 2 was last written by B 3.26 days less 50 s before X's flood: on the old clock, a TAT
    // 50 s ahead.
    let t0 = OLD_WRAP + 3 * SEC;
    let written = (53 * SEC) << CLOCK_SHIFT | 2;
    let mut rows = [0u64; MAX_ROWS];
    rows[2] = written;
    let judge = |rows: &mut [u64; MAX_ROWS], g: &Gcra, id: u8, now: u64| {
        let j = judge_rows(g, id, rows, MAX_ROWS, now, 1, |o| host.claim(o, now));
        for (r, s) in j.store.iter().enumerate() {
            if let Some(v) = s {
                assert!(gcra::ahead_units(*v, now << CLOCK_SHIFT) >= gcra::ahead_units(rows[r], now << CLOCK_SHIFT));
                rows[r] = *v;
            }
        }
        j.admit
    };
    // X sends its burst and no more (so no refusal of its own touches the rows yet).
    let x = (0..100).filter(|_| judge(&mut rows, &a, 1, t0)).count();
    assert_eq!(x, 100);
    // B's flooder hits row 2 only (its other rows elsewhere), far over its rate.
    for i in 0..2000 {
        let now = t0 + i * 100;
        let mut mine = [0u64; MAX_ROWS];
        mine[0] = rows[2];
        let j = judge_rows(&b, 2, &mine, 1, now, 1, |o| host.claim(o, now));
        if let Some(v) = j.store[0] {
            assert!(j.admit);
            rows[2] = v;
        }
    }
    let more = (0..600).filter(|i| judge(&mut rows, &a, 1, t0 + 200_000 + i * 1000)).count();
    assert_eq!(more, 0, "X got {more} more after a flood of another policy in one of its rows");
}

/// During a rotation's grace the old generation's bucket may hold anything: a stale value is
/// never written into the current bucket below X's TAT.
#[test]
fn a_rotation_grace_hands_back_no_burst() {
    let mut host = Host::new();
    let a = Gcra::new(10, SEC, 100, 1).unwrap();
    let q = Gcra::new(1000, SEC, 10, 1).unwrap();
    host.store(1, a.capacity, 0);
    host.store(3, q.capacity, 0);
    let t0 = 100 * SEC;
    // X spent its burst in the current generation's bucket.
    let mut current = 0;
    assert_eq!((0..1000).filter(|_| host.judge(&a, 1, &mut current, t0)).count(), 100);
    // A source of Q whose key lands on X's current bucket, and whose old-generation bucket holds
    // a TAT of a removed policy 2 (a 100 s window) beyond what is left of its hold.
    host.store(2, Gcra::new(1, SEC, 100, 1).unwrap().capacity, 0);
    let old = ((t0 + 40 * SEC) << CLOCK_SHIFT) | 2;
    host.store(2, 0, t0 - 70 * SEC);
    for i in 0..1000 {
        let now = t0 + 1000 + i * 100;
        let v = gcra::later(current, old, now, q.capacity, |o| host.claim(o, now));
        let j = q.judge(3, v, now, 1, |o| host.claim(o, now));
        if let Some(s) = j.store {
            assert!(j.admit);
            current = s;
        }
    }
    assert_eq!(x_floods(&host, &a, &mut current, t0 + 200_000), 0);
}

/// An innocent of a 10/s burst-10 policy (a 1 s window), sending at half its rate, whose bucket
/// was last written 3.26 days earlier by a live policy with a 600 s window: never refused.
#[test]
fn a_bucket_idle_for_days_holds_no_innocent() {
    let mut host = Host::new();
    let a = Gcra::new(10, SEC, 10, 1).unwrap();
    let long = Gcra::new(1, SEC, 600, 1).unwrap();
    host.store(1, a.capacity, 0);
    host.store(2, long.capacity, 0);
    for idle in [OLD_WRAP - 300 * SEC, OLD_WRAP, OLD_WRAP + 100 * MS, 2 * OLD_WRAP + 7 * SEC, 500 * 86_400 * SEC] {
        let t_w = 1000 * SEC;
        let mut bucket = 0;
        assert!(host.judge(&long, 2, &mut bucket, t_w));
        while host.judge(&long, 2, &mut bucket, t_w) {}
        let start = t_w + idle;
        let refused = (0..1200).filter(|i| !host.judge(&a, 1, &mut bucket, start + i * 200 * MS)).count();
        assert_eq!(refused, 0, "after {idle} ns idle, {refused} of 1200 refused");
    }
}

/// 100/s burst 10, sending at half its rate through a 60 s grace whose old-generation bucket
/// was last written days ago: never refused, and nothing written but admissions.
#[test]
fn a_stale_old_generation_refuses_nobody_through_the_grace() {
    let mut host = Host::new();
    let a = Gcra::new(100, SEC, 10, 1).unwrap();
    host.store(1, a.capacity, 0);
    for written in [100 * SEC, 200 * SEC] {
        // On the old clock, a TAT 60 s ahead all through the grace.
        let old = (written << CLOCK_SHIFT) | 1;
        let start = written + OLD_WRAP - 60 * SEC;
        let mut current = 0;
        let mut refused = 0;
        for i in 0..3103u64 {
            let now = start + i * 20 * MS;
            let v = gcra::later(current, old, now, a.capacity, |o| host.claim(o, now));
            let j = a.judge(1, v, now, 1, |o| host.claim(o, now));
            match j.store {
                Some(s) => current = s,
                None => refused += 1,
            }
        }
        assert_eq!(refused, 0, "{refused} of 3103 refused through the grace");
    }
}

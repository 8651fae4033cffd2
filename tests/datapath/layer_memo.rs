//! The layered route's shortcuts change no verdict and no count: the refusal memo in the main
//! program (`program::layer_memo`), each layer's key-hash memo and the last host-scope layer's
//! look-and-commit in one run. The shipped program (every shortcut on), the test build with the
//! tick refusal off, and with the memo off (no layered refusal memo: every packet judged by every
//! layer) judge the same frames through the same layers, edits and rotations, and must give
//! every frame the same verdict, the same admissions under every layer and the same refusals
//! in all. A plain layer set (no predicate among its candidates) takes its layers unread, and
//! stops as soon as one of them gains a predicate.

use etherparse::EtherType;
use limiter_common::{SipKey, maps::Counters};
use limiter_ctl::{
    Limiter,
    config::{Mode, PolicyDef, Rate, Scope, State},
    kernel::Geometry,
};
use limiter_tests::{
    cpu::pin_current_thread,
    frames::{self, V4, ethernet, udp},
    kernel_programs::{XDP_DROP, XDP_PASS, judged_alike, shortcut_builds},
    require_root,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// The CPU the test runs on (BPF_PROG_TEST_RUN runs on the caller's): per-CPU state is read here.
const CPU: usize = 0;
/// Half an hour: nothing refills during the test, and 25 of them fit the longest window (19 h).
const PERIOD_NS: u64 = 1_800_000_000_000;

/// The layers one udp:53 datagram meets, in judging order (exact port, longer key first; then
/// the protocol): per source; per source for source ports 1000-1999 only; the aggregate of every
/// source; and a dry-run layer over all of udp. Rates of one per half hour: nothing refills during the
/// test, so every verdict is decided by what the rows hold, not by when it is judged.
fn layers(scope: Scope, bursts: [u64; 3], sport_layer: bool) -> State {
    let def = |name: &str, matches: &str, key: &str, burst| PolicyDef {
        name: name.parse().expect("name"),
        matches: matches.parse().expect("match"),
        key: key.parse().expect("key"),
        scope,
        ..PolicyDef::any(Rate { count: 1, period_ns: PERIOD_NS }, burst)
    };
    let mut defs = vec![def("source", "udp:53", "src/32,/64", bursts[0])];
    if sport_layer {
        defs.push(PolicyDef { sport: "1000-1999".parse().expect("ports"), ..def("ports", "udp:53", "src/32,/64", 2) });
    }
    defs.push(def("cap", "udp:53", "src/0,/0", bursts[1]));
    defs.push(PolicyDef { mode: Mode::DryRun, ..def("watch", "udp", "src/32,/64", bursts[2]) });
    defs.into_iter().fold(State::default(), |state, def| state.with_policy(def).expect("a valid layer"))
}

/// The shapes: each scope, with the rows its array is split into (both arrays alike).
const SHAPES: [(Scope, u32); 4] = [(Scope::Cpu, 1), (Scope::Cpu, 4), (Scope::Host, 1), (Scope::Host, 2)];

#[test]
fn the_layered_shortcuts_change_no_verdict_and_no_count() {
    require_root!();
    pin_current_thread(CPU).expect("pinning the test thread");
    const TINY: u32 = limiter_common::maps::MIN_BUCKETS;
    // 12 sources sharing a tiny array, from source ports in and out of the ports layer's range.
    let datagram =
        |s: u16, sport: u16| ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(s, 10)).datagram(&udp(sport, 53, 16)));
    let mut rng = StdRng::seed_from_u64(0x6c617965);
    for (scope, rows) in SHAPES {
        let geometry = Geometry::same(TINY, rows);
        let (mut bursts, mut sport_layer) = ([3, 20, 2], true);
        let first = layers(scope, bursts, sport_layer);
        let mut limiters = shortcut_builds(geometry, |mut limiter| {
            limiter.set_salt(SipKey { k0: 1, k1: 2 }).expect("salt");
            limiter.sync(&State::default(), &first).expect("setting the layers");
            limiter
        });
        let mut state = first;
        let (mut refused, mut passed, mut events, mut rotations) = (0u64, 0u64, Vec::new(), 0u8);
        // Each build's refusals counted in all, summed over the spells between events (an event
        // may start a policy's counters again: the ports layer comes and goes).
        let refusals = |l: &Limiter| l.counters().expect("counters").iter().map(|c| c.refused_packets).sum::<u64>();
        let mut counted_refusals = [0u64; 3];
        let mut since = limiters.each_ref().map(refusals);
        for step in 0..500 {
            if step % 50 == 49 {
                for (b, l) in limiters.iter().enumerate() {
                    counted_refusals[b] += refusals(l) - since[b];
                }
                let event = rng.random_range(0..4u8);
                let mut next = state.clone();
                match event {
                    // A layer's burst edited: the per-source one, or the aggregate.
                    0 | 1 => {
                        bursts[usize::from(event)] = rng.random_range(1..=25);
                        next = layers(scope, bursts, sport_layer);
                    }
                    // The source-port layer removed, or back.
                    2 => {
                        sport_layer = !sport_layer;
                        next = layers(scope, bursts, sport_layer);
                    }
                    // A rotation: the first without a grace, the second with one that outlasts
                    // the test (the previous generation read too); then edits again.
                    _ if rotations >= 2 => {
                        bursts[1] = rng.random_range(1..=25);
                        next = layers(scope, bursts, sport_layer);
                    }
                    _ => {}
                }
                let salt = SipKey { k0: rng.random(), k1: rng.random() };
                for limiter in &mut limiters {
                    if event == 3 && rotations < 2 {
                        let grace = if rotations == 0 { 0 } else { 600 };
                        limiter.rotate_salt(salt, std::time::Duration::from_secs(grace)).expect("rotating the salt");
                    } else {
                        limiter.sync(&state, &next).expect("editing the layers");
                    }
                }
                rotations += u8::from(event == 3 && rotations < 2);
                state = next;
                events.push(event);
                since = limiters.each_ref().map(refusals);
            }
            let frame = datagram(rng.random_range(0..12u16), if rng.random_bool(0.5) { 1500 } else { 40000 });
            for _ in 0..rng.random_range(1..=6) {
                let verdict = judged_alike(&limiters, &frame, || {
                    format!("{scope:?}, {rows} rows, step {step} after events {events:?}")
                });
                match verdict {
                    XDP_DROP => refused += 1,
                    v => {
                        assert_eq!(v, XDP_PASS);
                        passed += 1;
                    }
                }
            }
        }
        let counted: Vec<Vec<Counters>> = limiters.iter().map(|l| l.counters().expect("counters")).collect();
        let [shipped, no_tick, no_memo] = [&counted[0], &counted[1], &counted[2]];
        // Both with the memo: the same counts under every policy.
        assert_eq!(shipped, no_tick, "{scope:?}, {rows} rows, events {events:?}: shipped vs no tick refusal");
        // Without it: the same admissions and dry-run counts under every layer, and the same
        // refusals in all; a memo refusal is counted under the layer whose refusal stands, and
        // nothing under the layers before it (which a full judgement counts "overruled").
        let judged = |c: &Counters| (c.admitted_packets, c.admitted_bytes, c.dry_run_packets, c.dry_run_bytes);
        for id in 0..shipped.len() {
            assert_eq!(
                judged(&shipped[id]),
                judged(&no_memo[id]),
                "{scope:?}, {rows} rows, events {events:?}: policy {id}, shipped vs no memo (admitted, bytes, dry-run, \
                 bytes)"
            );
        }
        for (b, l) in limiters.iter().enumerate() {
            counted_refusals[b] += refusals(l) - since[b];
        }
        assert_eq!(counted_refusals, [refused; 3], "{scope:?}, {rows} rows: refusals counted by each build");
        let total = |c: &[Counters], f: fn(&Counters) -> u64| c.iter().map(f).sum::<u64>();
        let overruled = |c: &[Counters]| total(c, |c| c.overruled_packets);
        eprintln!(
            "{scope:?}, {rows} rows, events {events:?}: {passed} passed, {refused} refused alike; overruled {} with the \
             memo, {} without",
            overruled(shipped),
            overruled(no_memo)
        );
        assert!(refused > 300 && passed > 12, "{scope:?}, {rows} rows: {passed} passed, {refused} refused");
        // The memo served refusals behind the layers before the refusing one.
        assert!(
            overruled(shipped) < overruled(no_memo),
            "{scope:?}, {rows} rows: overruled {} with the memo, {} without: the memo refused nothing",
            overruled(shipped),
            overruled(no_memo)
        );
    }
}

/// A plain layer set (no candidate with a predicate: `LayerSet::plain`) takes its candidates
/// without reading their policies. A layer of such a set edited to gain a predicate (a source
/// port range, then a destination) judges only what its predicate holds from the next packet
/// on, and every packet again once the predicate is gone; the layer beside it judges all along.
#[test]
fn a_plain_layer_gaining_a_predicate_judges_only_what_it_holds() {
    require_root!();
    pin_current_thread(CPU).expect("pinning the test thread");
    let def = |name: &str, key: &str| PolicyDef {
        name: name.parse().expect("name"),
        matches: "udp:53".parse().expect("match"),
        key: key.parse().expect("key"),
        // Room for every frame of the test: nothing is refused.
        ..PolicyDef::any(Rate { count: 1, period_ns: 1_000_000_000 }, 100)
    };
    let (source, cap) = (def("source", "src/32,/64"), def("cap", "src/0,/0"));
    let with = |source: &PolicyDef| {
        [source.clone(), cap.clone()].into_iter().fold(State::default(), |s, d| s.with_policy(d).expect("a layer"))
    };
    let edits = [
        ("plain", source.clone(), true),
        ("sport 1000-1999", PolicyDef { sport: "1000-1999".parse().expect("ports"), ..source.clone() }, false),
        ("plain again", source.clone(), true),
        ("another destination", PolicyDef { dst: "198.18.0.1/32".parse().expect("dst"), ..source.clone() }, false),
        ("plain once more", source.clone(), true),
    ];
    let mut limiter = Limiter::load_geometry(Geometry::same(1 << 10, 1)).expect("loading the limiter");
    limiter.set_salt(SipKey { k0: 1, k1: 2 }).expect("salt");
    let mut state = State::default();
    let id = |s: &State, name: &str| usize::from(s.policy(&name.parse().expect("name")).expect("a policy").id);
    let admitted = |l: &Limiter, id: usize| l.counters().expect("counters")[id].admitted_packets;
    for (what, def, plain) in edits {
        let next = with(&def);
        limiter.sync(&state, &next).expect("editing the layers");
        state = next;
        let view = limiter_ctl::kernel::MapView::of(&state);
        assert!(view.routes.sets.iter().all(|set| (set.plain != 0) == plain), "{what}: sets {:?}", view.routes.sets);
        let (s, c) = (id(&state, "source"), id(&state, "cap"));
        for sport in [40000, 1500] {
            let before = (admitted(&limiter, s), admitted(&limiter, c));
            let frame = ethernet(&[], EtherType::IPV4, &V4::from(frames::v4(1, 10)).datagram(&udp(sport, 53, 16)));
            for _ in 0..5 {
                assert_eq!(limiter.test_run(&frame).expect("test run"), XDP_PASS, "{what}: sport {sport}");
            }
            let judged = plain || (sport == 1500 && def.dst.is_any());
            let after = (admitted(&limiter, s), admitted(&limiter, c));
            assert_eq!(after, (before.0 + if judged { 5 } else { 0 }, before.1 + 5), "{what}: sport {sport}");
        }
    }
}

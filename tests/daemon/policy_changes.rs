//! A policy changed under a flood: a new rate applies within a second, the changed policy keeps
//! its sources' spent buckets, and the other policies keep their counters and buckets. A change names only what changes: the other fields stay.
//!
//! End to end through the real `limiter-ctl` (daemon and CLI) and the real XDP program on a veth
//! pair, on the shared [`limiter_tests::rig`], with policies as [`limiter_tests::policies`] sets
//! them and holds them to their bounds.

use std::time::{Duration, Instant};

use limiter_tests::{
    bounds::{check_lower_during, check_overload, check_upper, first, nanos, stall_cost},
    flood::{Flow, L4, Limits},
    policies::{Pol, PolicyRig as _, finish},
    require_root,
    rig::{Rig, flow_of},
};

/// `policy set` on a running policy with a new rate: from 1 s after the command on, the policy
/// admits at the new rate (and before it, at the old one). Another policy flooded all along keeps
/// its counters and its bucket: it stays within its own bound over the whole run, which a
/// refilled bucket (a second burst) would break.
#[test]
fn a_rate_changed_mid_flood_applies_within_a_second() {
    require_root!();
    const CHANGE_AT: Duration = Duration::from_millis(500);
    /// The flood goes on this long after the change was answered (it is stopped then), so the new
    /// rate is watched for 1 s whatever the machine's speed and however long the change took.
    const AFTER: Duration = Duration::from_secs(2);
    /// The least the flood must run past the command for the new rate to be tested.
    const NEEDED: Duration = Duration::from_millis(1300);
    /// Frames are timed when the capture reads them, a little after XDP passed them.
    const CAPTURE_LAG: Duration = Duration::from_millis(50);
    let rig = Rig::start(&[]).expect("starting the rig");
    let old = Pol::new("changing", "udp:7000", 2000, 50);
    let new = Pol::new("changing", "udp:7000", 500, 50);
    // A burst that dominates the rate: a bucket refilled mid-run would show at once.
    let other = Pol::new("steady", "udp:7001", 200, 400);
    rig.set_all(&[old.clone(), other.clone()]);
    let (a, b) = (rig.stream(L4::Udp, 7000, "198.19.1.1"), rig.stream(L4::Udp, 7001, "198.19.2.1"));
    let (flow_a, flow_b) = (flow_of(&a), flow_of(&b));

    // Bounded by time (a safety limit far beyond what the test waits) and stopped by the test.
    let limits = Limits::timed(CHANGE_AT + AFTER + Duration::from_secs(30));
    let flooding = rig.start_counted_flood(&[a, b], limits, None).expect("starting the flood");
    std::thread::sleep(CHANGE_AT);
    let issued = Instant::now();
    rig.set(&new);
    let answered = Instant::now();
    std::thread::sleep(AFTER);
    flooding.stop();
    let run = finish(flooding);
    eprintln!("rate change: {}; the change took {:?}", run.report, answered - issued);
    check_overload(&run.report, 2000.0, 2);
    let start = first(&run.report);
    let end = run.report.last.expect("a flood records its end");
    assert!(
        issued + NEEDED < end,
        "the flood ended {:?} after the command, under the {NEEDED:?} needed ({}): the sender stopped early, \
         the machine's fault, not the limiter's",
        end.saturating_duration_since(issued),
        run.report
    );

    let id = rig.policy_id("changing");
    rig.check_installed(&new, id);
    let judged = rig.judged(&run, id);
    let is_a = |f: &Flow| *f == flow_a;
    let before = run.captured.between(is_a, start, issued);
    // Captured before the command, so admitted before it: under the old rate throughout.
    check_upper("old rate, before the change", before, &old.gcra(), &judged, issued - start);
    check_lower_during("old rate, before the change", before, &old.gcra(), issued - start, &run.report, 1);
    let settled = issued + Duration::from_secs(1);
    let after = run.captured.between(is_a, settled, Instant::now());
    // Captured from `settled` on, so admitted from `settled - CAPTURE_LAG` on.
    let after_window = run.captured.last().unwrap_or(end).saturating_duration_since(settled) + CAPTURE_LAG;
    check_upper("new rate, from 1 s after the change", after, &new.gcra(), &judged, after_window);
    // The bucket is spent when the window opens: no burst on top of the rate there; the sender's
    // stalls may have cost some of the rate.
    let watched = end - settled;
    let rate_only = new.per_sec as f64 * watched.as_secs_f64();
    let lost = stall_cost(&new.gcra(), &run.report, 1) as f64;
    let least = (rate_only - lost) * 0.9;
    assert!(
        after as f64 >= least,
        "new rate: admitted {after} from 1 s after the change to the end ({watched:?}), under 90% of \
         {rate_only:.0} (the new rate over that time) less {lost:.0} for the sender's stalls = {least:.0}: the \
         limiter refused what its new rate allows (flood: {})",
        run.report
    );
    let soon = run.captured.between(is_a, answered, settled);
    eprintln!("  (for information: {soon} admitted between the answer and 1 s after the command)");
    // Replacing keeps the counters: they cover the whole run.
    assert_eq!(
        judged.total.admitted_packets + judged.total.refused_packets,
        run.sent(&flow_a),
        "'changing' judged vs sent"
    );
    assert_eq!(judged.total.admitted_packets, run.delivered(&flow_a), "'changing' admitted vs delivered");

    rig.check_policy(&other, &run, &[vec![flow_b]]);
}

/// `policy set NAME --rate X` on a dry-run policy with match udp:53 and key src/24 changes its rate
/// and nothing else: `policy show` lists the same match, key, burst, unit and mode (still
/// dry-run), and the kernel's maps differ from before in that policy's GCRA alone (flags, masks,
/// routes, lists and the other policy untouched). Leaving dry-run takes `--enforce`, which changes
/// the mode alone; `--burst default` goes back to one second's worth of the rate.
#[test]
fn a_rate_change_keeps_every_other_field() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let watched = Pol::new("watched", "udp:53", 300, 30).key("src/24").dry_run();
    rig.set_all(&[watched.clone(), Pol::new("other", "tcp", 100, 10)]);
    rig.ctl_ok(&["deny", "add", "198.19.0.0/16"]);
    let id = rig.policy_id("watched");
    let fields = |rig: &Rig| {
        let mut shown = rig.show("watched");
        shown.as_object_mut().expect("policy show --json is an object").remove("counters");
        shown
    };
    let shown = fields(&rig);
    let before = rig.snapshot().rules;

    // The rate alone.
    rig.ctl_ok(&["policy", "set", "watched", "--rate", "500/s"]);
    let faster = Pol { per_sec: 500, ..watched.clone() };
    let mut expected = shown.clone();
    expected["rate"] = "500/s".into();
    assert_eq!(fields(&rig), expected, "`policy show watched` after `policy set watched --rate 500/s`");
    rig.check_installed(&faster, id);
    let mut expected_rules = before.clone();
    let policy = &mut expected_rules.view.policies.get_mut(&id).expect("'watched' in the kernel").0;
    policy.gcra = faster.gcra();
    let after = rig.snapshot().rules;
    assert_eq!(after, expected_rules, "the kernel after a rate change: only the rate may differ");

    // --enforce: the mode alone.
    rig.ctl_ok(&["policy", "set", "watched", "--enforce"]);
    expected["mode"] = "enforce".into();
    assert_eq!(fields(&rig), expected, "`policy show watched` after --enforce");
    let enforcing = Pol { dry_run: false, ..faster.clone() };
    rig.check_installed(&enforcing, id);
    let policy = &mut expected_rules.view.policies.get_mut(&id).expect("'watched' in the kernel").0;
    policy.flags &= !limiter_common::maps::Policy::DRY_RUN;
    assert_eq!(rig.snapshot().rules, expected_rules, "the kernel after --enforce: only the dry-run flag may differ");

    // --burst default: one second's worth of the rate (500).
    rig.ctl_ok(&["policy", "set", "watched", "--burst", "default"]);
    expected["burst"] = 500.into();
    assert_eq!(fields(&rig), expected, "`policy show watched` after --burst default");
    rig.check_installed(&Pol { burst: 500, ..enforcing }, id);
    let file = rig.scratch.config_file().expect("config").expect("the daemon wrote its config");
    assert!(!file.contains("burst = 30"), "a default burst is left out of the file:\n{file}");
    assert!(file.contains("key = \"src/24,/64\""), "the key kept in the file:\n{file}");
}

/// The daemon's `--rate` (and `--burst`) edit the policy `default` as `policy set default` does:
/// restarted with `--rate 500/s` over a dry-run `default` on udp:53 keyed on src/24, the daemon
/// changes its rate alone (match, key, burst and the dry-run mode kept), in the kernel and in the
/// file; `--burst` then changes the burst alone.
#[test]
fn the_daemons_rate_flag_changes_the_rate_alone() {
    require_root!();
    let mut rig = Rig::start(&[]).expect("starting the rig");
    let watched = Pol::new("default", "udp:53", 300, 30).key("src/24").dry_run();
    rig.set_all(std::slice::from_ref(&watched));
    let id = rig.policy_id("default");
    let fields = |rig: &Rig| {
        let mut shown = rig.show("default");
        shown.as_object_mut().expect("policy show --json is an object").remove("counters");
        shown
    };
    let mut expected = fields(&rig);

    rig.daemon.stop_ok();
    rig.restart(&["--rate", "500/s"]).expect("restarting with --rate");
    expected["rate"] = "500/s".into();
    assert_eq!(fields(&rig), expected, "`policy show default` after a start with --rate 500/s");
    rig.check_installed(&Pol { per_sec: 500, ..watched.clone() }, id);
    let file = rig.scratch.config_file().expect("config").expect("the daemon wrote its config");
    assert!(file.contains("mode = \"dry-run\"") && file.contains("rate = \"500/s\""), "the file:\n{file}");

    rig.daemon.stop_ok();
    rig.restart(&["--rate", "500/s", "--burst", "70"]).expect("restarting with --burst");
    expected["burst"] = 70.into();
    assert_eq!(fields(&rig), expected, "`policy show default` after a start with --burst 70");
    rig.check_installed(&Pol { per_sec: 500, burst: 70, ..watched }, id);
}

/// `policy set NAME --rate X` keeps the edited policy's own buckets, not only the other
/// policies': a source over its rate stays spent. 200/s burst 800 (a 4 s window) is flooded until
/// spent, then edited to 250/s: every bucket the source spent holds the same TAT after the edit
/// as before, and a flood resumed under the new rate gets at most the rate since it was spent (a
/// spent bucket), where buckets reset by the edit would give it a burst of 800 on top. (The
/// burst is large so that the two stay apart however long the machine takes between the floods,
/// up to 3 s.)
#[test]
fn a_rate_edit_keeps_the_edited_policys_spent_buckets() {
    require_root!();
    let rig = Rig::start(&["--buckets", "64", "--rotate-every", "off"]).expect("starting the rig");
    // Scope cpu: the test reads the per-CPU buckets the source spent.
    let old = Pol::new("edited", "udp:7000", 200, 800).cpu();
    let new = Pol { per_sec: 250, ..old.clone() };
    rig.set(&old);
    let id = rig.policy_id("edited");
    let stream = rig.stream(L4::Udp, 7000, "198.19.1.1");
    let flow = flow_of(&stream);
    let spend = finish(
        rig.start_counted_flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(300)), None)
            .expect("flood"),
    );
    check_overload(&spend.report, old.per_sec as f64, 1);
    let judged = rig.judged(&spend, id);
    eprintln!("spending: {}; {judged}; delivered {}", spend.report, spend.delivered(&flow));
    assert!(judged.total.refused_packets > 0, "the source never went over its rate: {judged}");
    // The buckets the source spent (rows x CPUs), with their TATs.
    let tats = |rig: &Rig| rig.daemon.current_buckets().unwrap_or_else(|e| panic!("reading the buckets: {e:#}"));
    let spent: Vec<(usize, Vec<u64>)> =
        tats(&rig).into_iter().enumerate().filter(|(_, per_cpu)| per_cpu.iter().any(|&t| t != 0)).collect();
    assert!(!spent.is_empty(), "no bucket holds a TAT after the flood");

    rig.ctl_ok(&["policy", "set", "edited", "--rate", "250/s"]);
    rig.check_installed(&new, id);
    assert_eq!(rig.policy_id("edited"), id, "the edit gave the policy another id");
    let now = tats(&rig);
    let kept: Vec<(usize, Vec<u64>)> = spent.iter().map(|(i, _)| (*i, now[*i].clone())).collect();
    assert_eq!(kept, spent, "the rate edit changed the TATs of the source's spent buckets");

    let run = finish(
        rig.start_counted_flood(std::slice::from_ref(&stream), Limits::timed(Duration::from_millis(1200)), None)
            .expect("flood"),
    );
    let judged = rig.judged(&run, id);
    let got = run.delivered(&flow);
    eprintln!("after the edit: {}; {judged}; delivered {got}", run.report);
    assert!(judged.total.refused_packets > 0, "nothing refused after the edit: {judged}");
    judged.check_pinned("after the edit");
    // Spent when the first flood ended (it was refusing at full speed up to then, give or take the
    // sender being descheduled): from then on the kept TAT, ahead by the old window (4 s, beyond
    // the new 3.2 s), admits at most the new rate and one more; buckets reset by the edit would add
    // the burst over the second flood.
    const SLACK: Duration = Duration::from_millis(50);
    let spent_at = spend.report.last.expect("a flood records its end") - SLACK;
    let since = run.window() + (first(&run.report) - spent_at);
    let most = new.gcra().bound(nanos(since)) - (new.burst - 1);
    let fresh = new.gcra().bound(nanos(run.report.duration()));
    eprintln!("  after the edit: {got} <= {most} (spent {since:?} before the last delivery; reset buckets: {fresh})");
    assert!(
        most < fresh,
        "the second flood began {:?} after the first: too late to tell kept buckets ({most}) from reset ones \
         ({fresh}): the machine was too slow",
        first(&run.report) - spend.report.last.expect("end")
    );
    assert!(
        got <= most,
        "after the edit: delivered {got}, more than the spent bucket allows over the {since:?} since ({most}): the \
         edit gave the source a fresh burst"
    );
}

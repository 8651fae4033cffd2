//! `cargo xtask demo` as a new user runs it: `limiter-demo` with the release daemon, flooding
//! through the sender this machine offers (`cargo xtask test` runs it again on the packet ring).
//! It must end well, say which sender it used and the rate it reached, and show the daemon
//! holding the flood to the rate.

use std::process::Command;

use limiter_tests::{daemon::limiter_ctl_binary, generator::Sender, require_root};

const RATE: f64 = 1000.0;
const BURST: f64 = 100.0;

/// The number after `name` in `line` (`admitted 1000/s` or `offered 326339 packets/s`).
fn number_after(line: &str, name: &str) -> Option<f64> {
    let rest = &line[line.find(name)? + name.len()..];
    rest.trim_start().split(|c: char| !c.is_ascii_digit() && c != '.').next()?.parse().ok()
}

#[test]
fn the_demo_holds_a_flood_to_the_rate_and_names_its_sender() {
    require_root!();
    let sender = Sender::chosen().unwrap_or_else(|e| panic!("{e:#}")).sender;
    let ctl = limiter_ctl_binary().unwrap_or_else(|e| panic!("{e:#}"));
    let out = Command::new(env!("CARGO_BIN_EXE_limiter-demo"))
        .args(["--seconds", "3", "--rate", "1000/s", "--burst", "100", "--ctl"])
        .arg(&ctl)
        .output()
        .expect("running limiter-demo");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let said = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(out.status.success(), "limiter-demo failed ({}):\n{said}", out.status);
    let line = |start: &str| {
        stdout.lines().find(|l| l.starts_with(start)).unwrap_or_else(|| panic!("no line `{start}...`:\n{said}"))
    };

    let offered = line("demo: one source offered");
    assert!(offered.ends_with(&format!("sent by {sender}")), "the demo does not name the sender {sender}:\n{said}");
    let pps = number_after(offered, "offered").unwrap_or_else(|| panic!("no rate in `{offered}`"));
    assert!(pps >= 20.0 * RATE, "no flood: {pps:.0} packets/s against a rate of {RATE}/s:\n{said}");

    // Per whole second of the flood: never over the bound of a second (R + B, with 10% for the
    // daemon's timer), and the best second near the rate (the first may begin before the flood).
    let admitted = line("demo: the daemon admitted");
    let seconds: Vec<f64> = admitted
        .split_once('[')
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list.split(", ").filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_default();
    assert!(!seconds.is_empty(), "no whole second of the flood reported:\n{said}");
    let most = seconds.iter().copied().fold(0.0, f64::max);
    assert!(most <= 1.1 * RATE + BURST, "admitted {most}/s in one second, over the bound:\n{said}");
    assert!(most >= 0.9 * RATE, "admitted at most {most}/s in a second of the flood, under the rate:\n{said}");
    eprintln!("{sender}: {pps:.0} packets/s offered, admitted per second {seconds:?}");
}

#[test]
fn numbers_are_read_after_their_name() {
    assert_eq!(number_after("demo: one source offered 326339 packets/s for 2 s", "offered"), Some(326_339.0));
    assert_eq!(number_after("demo: the daemon admitted 1000/s ([1000])", "admitted"), Some(1000.0));
    assert_eq!(number_after("nothing here", "offered"), None);
}

//! What the CLI refuses, and how: every kind of bad input (exit 2, one line naming the field,
//! nothing changed), a caller who is not root, and no daemon at all.
//!
//! End to end through the real `limiter-ctl` (daemon and CLI) and the real XDP program on a veth
//! pair, on the shared [`limiter_tests::rig`], with policies as [`limiter_tests::policies`] sets
//! them and holds them to their bounds.

use std::{
    os::unix::fs::{FileTypeExt as _, MetadataExt as _},
    path::Path,
};

use limiter_tests::{
    daemon::{Ctl, Scratch, limiter_ctl_binary},
    policies::{Pol, PolicyRig as _, list_json, policies_json},
    require_root,
    rig::Rig,
};

/// Every kind of bad input through the real CLI: exit code 2, exactly one line on stderr naming
/// the field (or the policy or network at fault), and neither the config file nor the kernel
/// maps change.
#[test]
fn bad_input_exits_2_with_one_line_and_changes_nothing() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    rig.set_all(&[
        Pol::new("dns", "udp:53", 300, 30),
        Pol::new("web", "tcp:80-89", 300, 30),
        Pol::new("all", "any", 100, 10),
    ]);
    rig.ctl_ok(&["deny", "add", "198.19.0.0/16"]);
    rig.ctl_ok(&["allow", "add", "198.19.10.0/24"]);
    check_good_input_works(&rig);
    let missing_iface = format!("{}-nope", rig.net.receiver.iface);
    let other_config = rig.scratch.path().join("other.toml");
    let other_config = other_config.to_string_lossy();
    let long_name = "x".repeat(33);
    let set = |extra: &[&str]| -> Vec<String> {
        ["policy", "set", "p", "--rate", "10/s"].iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let args = |a: &[&str]| -> Vec<String> { a.iter().map(|s| s.to_string()).collect() };
    // (arguments, what the one line must name)
    let cases: Vec<(Vec<String>, &str)> = vec![
        (args(&["policy", "set", "p"]), "--rate"),
        (args(&["policy", "set", "p", "--rate", "10/d"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "00/s"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "1.5/s"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "ten/s"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "10"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "2000000000000/s"]), "rate"),
        (set(&["--burst", "0"]), "burst"),
        (set(&["--burst", "1.5"]), "burst"),
        (set(&["--burst", "-1"]), "burst"),
        (args(&["policy", "set", "p", "--rate", "1/h", "--burst", "2000000"]), "burst"),
        (set(&["--match", "udp:0"]), "match"),
        (set(&["--match", "udp:65536"]), "match"),
        (set(&["--match", "tcp:"]), "match"),
        (set(&["--match", "sctp"]), "match"),
        (set(&["--match", "icmp:1"]), "match"),
        (set(&["--match", "any:53"]), "match"),
        (set(&["--match", "udp:9-8"]), "match"),
        (set(&["--match", "udp:1-70000"]), "match"),
        (set(&["--match", "tcp:80,81"]), "match"),
        // SYN-only is for TCP, spelt one way, once.
        (set(&["--match", "udp:53,syn"]), "match"),
        (set(&["--match", "icmp,syn"]), "match"),
        (set(&["--match", "tcp:443,SYN"]), "match"),
        (set(&["--match", "tcp:443,syn,syn"]), "match"),
        (set(&["--key", "src/33"]), "key"),
        (set(&["--key", "src/24,/129"]), "key"),
        (set(&["--key", "dst/24"]), "key"),
        (set(&["--key", "src/24+sport"]), "key"),
        (set(&["--unit", "frames"]), "unit"),
        // One form for every number: no sign, no leading zero (C and inet_aton read 010 as 8).
        (set(&["--match", "udp:+53"]), "match"),
        (set(&["--match", "udp:053"]), "match"),
        (set(&["--match", "tcp:080-090"]), "match"),
        (set(&["--match", "tcp:80-+90"]), "match"),
        (set(&["--key", "src/024"]), "key"),
        (set(&["--key", "src/24,/056"]), "key"),
        (args(&["policy", "set", "p", "--rate", "+100/s"]), "rate"),
        (args(&["policy", "set", "p", "--rate", "0100/s"]), "rate"),
        (set(&["--burst", "+5"]), "burst"),
        (set(&["--burst", "05"]), "burst"),
        (args(&["allow", "add", "010.1.1.0/24"]), "cidr"),
        (args(&["deny", "add", "10.1.1.0/024"]), "cidr"),
        (args(&["deny", "add", "10.1.1.0/+24"]), "cidr"),
        (args(&["deny", "add", "::ffff:010.1.1.1/128"]), "cidr"),
        (args(&["deny", "rm", "198.019.0.0/16"]), "cidr"),
        (set(&["--dry-run", "--enforce"]), "--enforce"),
        (args(&["policy", "set", "_p", "--rate", "1/s"]), "name"),
        (args(&["policy", "set", "has space", "--rate", "1/s"]), "name"),
        (args(&["policy", "set", &long_name, "--rate", "1/s"]), "name"),
        (args(&["policy", "set", "a/b", "--rate", "1/s"]), "name"),
        (args(&["policy", "rm", "a/b"]), "name"),
        (args(&["policy", "frob"]), "frob"),
        (args(&["frob"]), "frob"),
        (set(&["--bogus"]), "--bogus"),
        (args(&["policy", "list", "--yaml"]), "--yaml"),
        (args(&["allow", "add", "198.18.0.0/33"]), "cidr"),
        (args(&["allow", "add", "198.18.0.0"]), "cidr"),
        (args(&["deny", "add", "2001:db8::/129"]), "cidr"),
        (args(&["deny", "add", "not-a-network"]), "cidr"),
        (args(&["allow", "add", "198.19.10.1/24"]), "host bits"),
        (args(&["deny", "add", "2001:db8::1/32"]), "host bits"),
        (args(&["completions", "fish2"]), "shell"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--burst", "5"]), "--rate"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--buckets", "100"]), "bucket"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--buckets", "+1024"]), "bucket"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--rows", "0"]), "row count"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--rows", "5"]), "row count"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--rows", "+2"]), "row count"),
        // The bucket arrays: auto or a power of two in range; rows 1 to 4.
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--buckets", "Auto"]), "bucket"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--buckets", "0"]), "bucket"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--host-buckets", "3"]), "bucket"),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--host-buckets", "8"]), "bucket"),
        (
            args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--host-buckets", "33554432"]),
            "bucket",
        ),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--host-buckets", "auto,"]), "bucket"),
        (
            args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--sample-refusals", "+256"]),
            "sample",
        ),
        (
            args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--samples-per-s", "ten"]),
            "samples per second",
        ),
        (
            args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--samples-per-s", "0256"]),
            "samples per second",
        ),
        (
            args(&["daemon", "--iface", &missing_iface, "--config", &other_config, "--samples-per-s", "4294967296"]),
            "samples per second",
        ),
        (args(&["daemon", "--iface", &missing_iface, "--config", &other_config]), &missing_iface),
        // Refused by the daemon: the form is fine, the request is not.
        // Overlapping policies layer now; a source port asks for a protocol with ports.
        (set(&["--match", "icmp", "--sport", "53"]), "sport"),
        (set(&["--sport", "1000-10"]), "sport"),
        (set(&["--dst", "198.18.0.1/24"]), "dst"),
        (set(&["--dst", "198.18.0.0/24,198.19.0.0/24"]), "dst"),
        (args(&["policy", "rm", "nosuch"]), "nosuch"),
        (args(&["policy", "show", "nosuch"]), "nosuch"),
        (args(&["allow", "add", "198.19.0.0/16"]), "deny"),
        (args(&["deny", "add", "198.19.10.0/24"]), "allow"),
        (args(&["allow", "rm", "198.18.0.0/24"]), "198.18.0.0/24"),
        (args(&["deny", "rm", "2001:db8::/32"]), "2001:db8::/32"),
        // A byte policy's burst must hold the largest frame (MTU 1500 + 22): else every such
        // frame is refused forever. New, and by changing an existing packet policy's unit.
        (args(&["policy", "set", "p", "--rate", "1000000/s", "--unit", "bytes", "--burst", "1000"]), "burst"),
        (args(&["policy", "set", "p", "--rate", "1000000/s", "--unit", "bytes", "--burst", "1521"]), "1522"),
        (args(&["policy", "set", "dns", "--unit", "bytes"]), "burst"),
        // A new policy needs a rate; the fields given to an existing one are checked as for a new one.
        (args(&["policy", "set", "p", "--match", "udp:7"]), "--rate"),
        (args(&["policy", "set", "dns", "--match", "icmp", "--sport", "53"]), "sport"),
    ];
    let file = rig.scratch.config_file().expect("config").expect("the daemon wrote its config");
    let maps = rig.snapshot();
    let mut failures = Vec::new();
    for (args, field) in &cases {
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = rig.daemon.ctl(&argv).expect("running limiter-ctl");
        if let Some(problem) = bad_input_problem(&out, field) {
            failures.push(format!("limiter-ctl {}: {problem}", args.join(" ")));
        }
        assert_eq!(
            rig.scratch.config_file().expect("config").as_ref(),
            Some(&file),
            "{args:?} changed the config file"
        );
        let now = rig.snapshot();
        assert_eq!(now.rules, maps.rules, "{args:?} changed the kernel's rules");
        assert_eq!(now.counters[1..], maps.counters[1..], "{args:?} changed policy counters");
    }
    assert!(!Path::new(&*other_config).exists(), "a refused daemon wrote its config");
    assert!(
        failures.is_empty(),
        "{} of {} bad inputs were not reported as required:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Positive controls for the bad-input table: the same commands, well formed, succeed, and the
/// read commands print what was set in both forms.
fn check_good_input_works(rig: &Rig) {
    let table = rig.ctl_ok(&["policy", "list"]);
    for name in ["NAME", "dns", "udp:53", "web", "tcp:80-89", "all"] {
        assert!(table.contains(name), "`policy list` lacks {name}:\n{table}");
    }
    let shown = rig.ctl_ok(&["policy", "show", "web"]);
    assert!(shown.contains("tcp:80-89") && shown.contains("300/s"), "`policy show web`:\n{shown}");
    assert_eq!(rig.show("web")["match"], "tcp:80-89");
    let listed = rig.ctl_ok(&["deny", "list"]);
    let rows: Vec<Vec<&str>> = listed.lines().skip(1).map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(rows, vec![vec!["198.19.0.0/16", "config", "-"]], "{listed}");
    assert_eq!(list_json(rig, "allow"), vec!["198.19.10.0/24"]);
    // The largest frame exactly (MTU 1500 + 22) is a byte policy's smallest burst.
    let bytes_ok = ["policy", "set", "bytes-ok", "--match", "icmp", "--rate", "1000000/s", "--unit", "bytes"];
    rig.ctl_ok(&[&bytes_ok[..], &["--burst", "1522"]].concat());
    assert_eq!(rig.show("bytes-ok")["burst"], 1522);
    rig.ctl_ok(&["policy", "rm", "bytes-ok"]);
    let script = rig.ctl_ok(&["completions", "bash"]);
    assert!(script.contains("limiter-ctl") && script.contains("policy"), "no bash completions");
}

/// What is wrong with how the CLI refused bad input, if anything.
fn bad_input_problem(out: &Ctl, field: &str) -> Option<String> {
    let lines = out.stderr_lines();
    if out.code != Some(2) {
        return Some(format!("exit {:?}, expected 2; stderr {:?}", out.code, out.stderr));
    }
    if lines.len() != 1 {
        return Some(format!("{} lines on stderr, expected 1: {:?}", lines.len(), out.stderr));
    }
    if !lines[0].to_lowercase().contains(&field.to_lowercase()) {
        return Some(format!("the line does not name '{field}': {:?}", lines[0]));
    }
    None
}

/// The control socket is root's alone (mode 0600): an unprivileged caller gets one line saying
/// so; with no daemon at all the CLI names the socket it tried.
#[test]
fn the_socket_is_root_only_and_a_missing_daemon_is_named() {
    require_root!();
    let scratch = Scratch::new().expect("scratch directory");
    let bin = limiter_ctl_binary().expect("limiter-ctl");
    let absent = Ctl::run(&mut Ctl::command(&bin, &scratch.socket(), &["policy", "list"])).expect("limiter-ctl");
    assert_ne!(absent.code, Some(0), "no daemon, yet success: {absent:?}");
    assert_eq!(absent.stderr_lines().len(), 1, "{absent:?}");
    let named = absent.stderr.contains(&*scratch.socket().to_string_lossy());
    assert!(absent.stderr.contains("no daemon is listening") && named, "{absent:?}");

    let rig = Rig::start(&[]).expect("starting the rig");
    let socket = rig.scratch.socket();
    let meta = std::fs::metadata(&socket).expect("the control socket");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.mode() & 0o7777, 0o600, "socket mode {:o}", meta.mode() & 0o7777);
    assert_eq!(meta.uid(), 0, "socket owner");
    let before = rig.scratch.config_file().expect("config");
    for args in [&["policy", "list"][..], &["policy", "set", "p", "--rate", "1/s"], &["deny", "add", "198.19.0.0/16"]] {
        let mut cmd = std::process::Command::new("setpriv");
        cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&bin)
            .arg("--socket")
            .arg(&socket)
            .args(args);
        let out = Ctl::run(&mut cmd).expect("setpriv (util-linux) runs limiter-ctl as nobody");
        assert_ne!(out.code, Some(0), "{args:?} as nobody succeeded: {out:?}");
        let lines = out.stderr_lines();
        assert_eq!(lines.len(), 1, "{args:?} as nobody: {out:?}");
        assert!(lines[0].contains("permission denied") && lines[0].contains("run as root"), "{args:?}: {:?}", lines[0]);
    }
    assert_eq!(rig.scratch.config_file().expect("config"), before, "an unprivileged caller changed the config");
    assert!(policies_json(&rig).is_empty(), "an unprivileged caller set a policy");
}

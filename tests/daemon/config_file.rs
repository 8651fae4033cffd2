//! The config file: policies and lists survive a restart, SIGHUP applies a valid hand edit and
//! refuses a bad one, a config that does not parse stops the daemon at start with its
//! position, and the daemon's writes keep the operator's file (comments, order, owner, mode,
//! symlink).
//!
//! End to end through the real `limiter-ctl` (daemon and CLI) and the real XDP program on a veth
//! pair, on the shared [`limiter_tests::rig`], with policies as [`limiter_tests::policies`] sets
//! them and holds them to their bounds.

use std::time::Duration;

use limiter_tests::{
    bounds::check_overload,
    daemon::{Daemon, Scratch, xdp_program_id},
    flood::{L4, Limits, Stream},
    netns::TestNet,
    policies::{Pol, PolicyRig as _, list_json, policies_json},
    require_root,
    rig::{Rig, flow_of},
};

/// Policies and lists survive a restart from the file alone: stopped with SIGINT, detached (so
/// there is nothing to adopt) and started again on the same config, the daemon lists the same policies and lists, puts the same rules in the kernel (all
/// but the salt), leaves the file alone, and enforces the same way.
#[test]
fn policies_and_lists_survive_a_restart() {
    require_root!();
    let rig = Rig::start(&[]).expect("starting the rig");
    let pols = [
        Pol::new("a", "udp:7000", 300, 30).key("src/24"),
        Pol::new("b", "tcp", 200, 20).dry_run(),
        // ICMP: beside `a` and `b` on their traffic, `any` would be one more layer of theirs.
        Pol::new("c", "icmp", 100_000, 70_000).bytes(),
    ];
    rig.set_all(&pols);
    rig.ctl_ok(&["allow", "add", "198.19.10.0/24"]);
    rig.ctl_ok(&["deny", "add", "2001:db8:d::/48"]);
    // Before any traffic: the restarted daemon (a new program) starts its counters from zero too.
    let listed = rig.ctl_ok(&["policy", "list", "--json"]);
    let lists = (list_json(&rig, "allow"), list_json(&rig, "deny"));
    let rules = rig.snapshot().rules;
    let file = rig.scratch.config_file().expect("config").expect("the daemon wrote its config");
    let s = |l4, port, src| rig.stream(l4, port, src);
    let streams = [
        s(L4::Udp, 7000, "198.19.1.1"),
        s(L4::Udp, 7000, "198.19.1.2"),
        s(L4::TcpSyn, 80, "198.19.2.1"),
        s(L4::Udp, 7000, "198.19.10.1"),
        s(L4::Udp, 7000, "2001:db8:d::1"),
    ];
    check_enforced(&rig, &pols[0], &streams, "first daemon");

    let mut rig = rig;
    rig.daemon.stop_ok();
    let detached = rig.scratch.detach(&rig.net.receiver).expect("limiter-ctl detach");
    assert_eq!(detached.code, Some(0), "{detached:?}");
    rig.restart(&[]).expect("restarting the daemon");
    assert_eq!(rig.ctl_ok(&["policy", "list", "--json"]), listed, "`policy list --json` after the restart");
    assert_eq!((list_json(&rig, "allow"), list_json(&rig, "deny")), lists, "lists after the restart");
    assert_eq!(rig.snapshot().rules.unsalted(), rules.unsalted(), "kernel rules after the restart");
    assert_eq!(rig.scratch.config_file().expect("config").as_ref(), Some(&file), "the restart rewrote the file");
    // Written by rename from a temporary file: none may be left behind.
    let mut names: Vec<String> = std::fs::read_dir(rig.scratch.path())
        .expect("listing the scratch directory")
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()
        .expect("listing the scratch directory");
    names.sort();
    assert_eq!(names, vec!["ctl.sock", "limiter.toml"], "files beside the config");
    check_enforced(&rig, &pols[0], &streams, "restarted daemon");
}

/// The restart test's flood: two sources of one /24 share `a`'s allowance, dry-run TCP all
/// passes, the allowed source all passes, the denied one never does.
fn check_enforced(rig: &Rig, a: &Pol, streams: &[Stream; 5], round: &str) {
    let run = rig.counted_flood(streams, Limits::timed(Duration::from_millis(500)));
    eprintln!("{round}: {}", run.report);
    check_overload(&run.report, 300.0, streams.len());
    let f = |i: usize| flow_of(&streams[i]);
    rig.check_policy(a, &run, &[vec![f(0), f(1)]]);
    assert_eq!(run.delivered(&f(2)), run.sent(&f(2)), "{round}: dry-run TCP must all pass");
    assert_eq!(run.delivered(&f(3)), run.sent(&f(3)), "{round}: allowed source refused");
    assert_eq!(run.delivered(&f(4)), 0, "{round}: denied source got through");
}

/// SIGHUP re-reads the file: a valid hand edit is applied (listed, in the kernel, enforced); an
/// edit that does not parse or does not validate is refused with "reload refused", the running
/// rules stay exactly as they were, and the daemon keeps serving.
#[test]
fn sighup_applies_a_valid_edit_and_keeps_running_on_a_bad_one() {
    require_root!();
    let mut rig = Rig::start(&[]).expect("starting the rig");
    rig.set(&Pol::new("dns", "udp:53", 300, 30));
    let edited = "# edited by hand\n\
        version = 2\n\
        allow = [\"198.19.10.0/24\"]\n\n\
        [[policy]]\nname = \"dns\"\nmatch = \"udp:53\"\nrate = \"400/s\"\nburst = 40\n\n\
        [[policy]]\nname = \"web\"\nmatch = \"tcp:80\"\nrate = \"150/s\"\nburst = 15\n";
    std::fs::write(rig.scratch.config(), edited).expect("editing the config");
    rig.hup("reloaded");
    let (dns, web) = (Pol::new("dns", "udp:53", 400, 40), Pol::new("web", "tcp:80", 150, 15));
    let names: Vec<String> =
        policies_json(&rig).iter().map(|d| d["name"].as_str().unwrap_or_default().to_string()).collect();
    assert_eq!(names, vec!["dns", "web"]);
    let (dns_id, web_id) = (rig.policy_id("dns"), rig.policy_id("web"));
    rig.check_installed(&dns, dns_id);
    rig.check_installed(&web, web_id);
    assert_eq!(list_json(&rig, "allow"), vec!["198.19.10.0/24"]);
    let streams = [rig.stream(L4::TcpSyn, 80, "198.19.1.1"), rig.stream(L4::Udp, 53, "198.19.10.1")];
    let run = rig.counted_flood(&streams, Limits::timed(Duration::from_millis(500)));
    eprintln!("after reload: {}", run.report);
    check_overload(&run.report, 150.0, streams.len());
    rig.check_policy(&web, &run, &[vec![flow_of(&streams[0])]]);
    let allowed = flow_of(&streams[1]);
    assert_eq!(run.delivered(&allowed), run.sent(&allowed), "the reloaded allow list");

    let bad_edits = [
        ("a syntax error", "[[policy]\nname = \"dns\"\n"),
        ("an unknown key", "[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nspeed = 3\n"),
        ("a wrong type", "[[policy]]\nname = \"dns\"\nrate = \"1/s\"\nburst = \"ten\"\n"),
        (
            "five layers on one packet",
            "[[policy]]\nname = \"v\"\nmatch = \"udp\"\nrate = \"1/s\"\n\n[[policy]]\nname = \"w\"\nmatch = \"udp\"\nrate = \"1/s\"\n\n\
             [[policy]]\nname = \"x\"\nmatch = \"udp\"\nrate = \"1/s\"\n\n[[policy]]\nname = \"y\"\nmatch = \"udp\"\nrate = \"2/s\"\n\n\
             [[policy]]\nname = \"z\"\nmatch = \"any\"\nrate = \"2/s\"\n",
        ),
        ("a source port on icmp", "[[policy]]\nname = \"x\"\nmatch = \"icmp\"\nsport = \"53\"\nrate = \"1/s\"\n"),
        ("host bits", "deny = [\"198.19.0.1/16\"]\n"),
    ];
    for (what, text) in bad_edits {
        let listed = rig.ctl_ok(&["policy", "list", "--json"]);
        let rules = rig.snapshot().rules;
        std::fs::write(rig.scratch.config(), text).expect("editing the config");
        rig.hup("reload refused");
        assert!(rig.daemon.is_running(), "{what}: the daemon exited:\n{}", rig.daemon.output());
        assert_eq!(rig.snapshot().rules, rules, "{what}: the kernel rules changed");
        assert_eq!(rig.ctl_ok(&["policy", "list", "--json"]), listed, "{what}: `policy list --json` changed");
    }
}

/// A config that does not parse stops the daemon before anything happens: exit 2, one line with
/// PATH:LINE:COL, no XDP program on the interface, no socket, the file untouched.
#[test]
fn a_bad_config_at_start_aborts_with_its_position() {
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch directory");
    // (what, text, line of the error)
    let cases = [
        ("a syntax error", "allow = [\"198.18.0.0/24\"]\n[[policy]\nname = \"a\"\n", 2),
        ("an unknown key", "[[policy]]\nname = \"a\"\nrate = \"10/s\"\nspeed = 3\n", 4),
        ("a wrong type", "[[policy]]\nname = \"a\"\nrate = \"10/s\"\nburst = \"ten\"\n", 4),
        ("a bad rate", "\n[[policy]]\nname = \"a\"\nrate = \"10/d\"\n", 4),
        ("a bad match", "[[policy]]\nname = \"a\"\nmatch = \"udp:0\"\nrate = \"10/s\"\n", 3),
        ("a bad CIDR", "deny = [\"198.19.0.0/16\", \"2001:db8::/129\"]\n", 1),
        ("a leading zero in an address", "allow = [\n  \"198.19.0.0/16\",\n  \"010.1.1.0/24\",\n]\n", 3),
        ("a leading zero in a prefix length", "deny = [\"198.19.0.0/016\"]\n", 1),
        ("a signed port", "[[policy]]\nname = \"a\"\nmatch = \"udp:+53\"\nrate = \"10/s\"\n", 3),
        ("a leading zero in a rate", "[[policy]]\nname = \"a\"\nrate = \"010/s\"\n", 3),
    ];
    let path = scratch.config();
    for (what, text, line) in cases {
        let out = Daemon::refused_start(&net.receiver, &scratch, &[], text).unwrap_or_else(|e| panic!("{what}: {e:#}"));
        let errors: Vec<&str> = out.lines().filter(|l| l.starts_with("stderr: ")).collect();
        assert_eq!(errors.len(), 1, "{what}: expected one line on stderr:\n{out}");
        let position = format!("{}:{line}:", path.display());
        let after = errors[0].split_once(&position).map(|(_, rest)| rest);
        let column_ok = after
            .and_then(|r| r.split_once(':'))
            .is_some_and(|(col, _)| !col.is_empty() && col.chars().all(|c| c.is_ascii_digit()));
        assert!(column_ok, "{what}: no {position}COL: in {:?}", errors[0]);
        assert_eq!(xdp_program_id(&net.receiver).expect("ip link"), None, "{what}: an XDP program is attached");
        assert!(!scratch.socket().exists(), "{what}: the control socket was created");
    }
}

/// The operator's config, with comments and an order of its own, reached through a symlink.
const OPERATOR_CONFIG: &str = r#"# Edge limits: ask the network team before changing.
version = 2
deny = [
    "198.19.66.0/24", # scanner
    "2001:db8:bad::/48",
]

# DNS first.
[[policy]]
name = "dns"  # resolvers
match = "udp:53"
rate = "300/s"   # agreed with the DNS team
burst = 30
key = "src/24"

[[policy]]
name = "bulk"
match = "tcp"
rate = "200/s"
burst = 20
mode = "dry-run" # watching first
"#;

/// The daemon keeps the operator's file: started on a config reached through a symlink (mode
/// 0600, owned by nobody), it writes nothing at start; each CLI change then edits the file in
/// place: one changed value on its line with its comment, a new policy appended, a removed list
/// entry gone with its comment, every other comment and the order kept; the symlink stays a
/// symlink, the target keeps its owner and mode, and no temporary file is left.
#[test]
fn cli_changes_keep_the_operators_file() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch directory");
    let site = scratch.path().join("site");
    std::fs::create_dir(&site).expect("mkdir site");
    let target = site.join("edge.toml");
    std::fs::write(&target, OPERATOR_CONFIG).expect("writing the operator's config");
    const NOBODY: u32 = 65534;
    std::os::unix::fs::chown(&target, Some(NOBODY), Some(NOBODY)).expect("chown nobody");
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).expect("chmod 0600");
    std::os::unix::fs::symlink("site/edge.toml", scratch.config()).expect("symlinking the config");
    let daemon = Daemon::start(&net.receiver, &scratch, &[]).expect("starting the daemon");
    let rig = Rig { daemon, scratch, net };

    let check_file = |rig: &Rig, expected: &str, what: &str| {
        let link = rig.scratch.config();
        let meta = std::fs::symlink_metadata(&link).expect("the config's link");
        assert!(meta.file_type().is_symlink(), "{what}: the symlink was replaced by a file");
        assert_eq!(std::fs::read_link(&link).expect("readlink").to_string_lossy(), "site/edge.toml", "{what}");
        let now = std::fs::read_to_string(&target).expect("reading the target");
        assert_eq!(now, expected, "{what}: the file as written");
        let meta = std::fs::metadata(&target).expect("the target");
        assert_eq!((meta.uid(), meta.gid()), (NOBODY, NOBODY), "{what}: owner");
        assert_eq!(meta.mode() & 0o7777, 0o600, "{what}: mode {:o}", meta.mode() & 0o7777);
        let mut beside: Vec<String> = std::fs::read_dir(&site)
            .expect("listing site/")
            .map(|e| e.expect("an entry").file_name().to_string_lossy().into_owned())
            .collect();
        beside.sort();
        assert_eq!(beside, vec!["edge.toml"], "{what}: files beside the target");
    };
    check_file(&rig, OPERATOR_CONFIG, "after start");
    let dns = Pol::new("dns", "udp:53", 300, 30).key("src/24");
    rig.check_installed(&dns, rig.policy_id("dns"));

    rig.ctl_ok(&["policy", "set", "dns", "--rate", "400/s"]);
    let mut expected = OPERATOR_CONFIG.replace(r#"rate = "300/s"   #"#, r#"rate = "400/s"   #"#);
    check_file(&rig, &expected, "after `policy set dns --rate 400/s`");
    rig.check_installed(&Pol { per_sec: 400, ..dns }, rig.policy_id("dns"));

    rig.ctl_ok(&["policy", "set", "web", "--match", "tcp:443", "--rate", "50/s", "--burst", "5"]);
    expected.push_str("\n[[policy]]\nname = \"web\"\nmatch = \"tcp:443\"\nrate = \"50/s\"\nburst = 5\n");
    check_file(&rig, &expected, "after `policy set web ...` (new)");

    rig.ctl_ok(&["deny", "rm", "198.19.66.0/24"]);
    expected = expected.replace("    \"198.19.66.0/24\", # scanner\n", "");
    check_file(&rig, &expected, "after `deny rm 198.19.66.0/24`");

    rig.ctl_ok(&["policy", "rm", "bulk"]);
    let bulk = "\n[[policy]]\nname = \"bulk\"\nmatch = \"tcp\"\nrate = \"200/s\"\nburst = 20\nmode = \"dry-run\" # watching first\n";
    assert!(expected.contains(bulk), "the test's own expectation");
    expected = expected.replace(bulk, "");
    check_file(&rig, &expected, "after `policy rm bulk`");

    // And what the file says is what runs: re-reading it (SIGHUP) changes nothing.
    let mut rig = rig;
    let listed = rig.ctl_ok(&["policy", "list", "--json"]);
    let rules = rig.snapshot().rules;
    rig.hup("reloaded");
    assert_eq!(rig.ctl_ok(&["policy", "list", "--json"]), listed, "`policy list --json` after a reload");
    assert_eq!(rig.snapshot().rules, rules, "the kernel's rules after a reload");
    check_file(&rig, &expected, "after a reload");
}

/// A file written before scope host became the default (no `version = 2`): one policy without
/// `scope`, one with `scope = "host"`.
const UNVERSIONED_CONFIG: &str = r#"# Written by an older limiter.
deny = ["198.19.66.0/24"] # scanner

[[policy]]
name = "old"   # per CPU, as it always was
match = "udp:7000"
rate = "300/s"
burst = 30

[[policy]]
name = "shared"
match = "tcp"
rate = "200/s"
scope = "host"
"#;

/// A file from before the format marker keeps its meaning on upgrade: `config check` says so in
/// one `note:` line (exit 0), the daemon logs it once at start and writes nothing; the policy
/// without `scope` runs as scope cpu in the kernel, `policy show`, `policy list` and `stats`
/// (text and JSON). The first change rewrites the file with the marker on top and `scope =
/// "cpu"` on that policy, every other line kept; the new policy is scope host. A hand-written
/// file with the marker and no `scope` means host.
#[test]
fn a_file_from_before_the_format_marker_keeps_its_meaning() {
    use limiter_common::maps::Policy;
    require_root!();
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch directory");
    let path = scratch.config();
    std::fs::write(&path, UNVERSIONED_CONFIG).expect("writing the old config");
    let bin = limiter_tests::daemon::limiter_ctl_binary().expect("limiter-ctl");
    let check = |what: &str| {
        let mut cmd = std::process::Command::new(&bin);
        let out = limiter_tests::daemon::Ctl::run(cmd.arg("config").arg("check").arg(&path)).expect("config check");
        assert_eq!(out.code, Some(0), "{what}: {out:?}");
        out.stdout.lines().filter(|l| l.starts_with("note:")).map(str::to_string).collect::<Vec<_>>()
    };
    let notes = check("the old file");
    assert_eq!(notes.len(), 1, "one note: {notes:?}");
    for needle in ["'old'", "scope cpu", "version = 2", &path.display().to_string()] {
        assert!(notes[0].contains(needle), "the note lacks {needle:?}: {}", notes[0]);
    }
    assert!(!notes[0].contains("'shared'"), "{}", notes[0]);

    let daemon = Daemon::start(&net.receiver, &scratch, &[]).expect("starting the daemon");
    let rig = Rig { daemon, scratch, net };
    let logged: Vec<String> =
        rig.daemon.lines().iter().map(|(_, l)| l.clone()).filter(|l| l.contains("has no `version = 2`")).collect();
    assert_eq!(logged.len(), 1, "the note once in the log:\n{}", rig.daemon.output());
    assert!(logged[0].contains("'old'"), "{}", logged[0]);
    assert_eq!(std::fs::read_to_string(&path).expect("config"), UNVERSIONED_CONFIG, "the start wrote the file");

    // Every view says the scope: the kernel, `policy show` (both forms), `policy list`, `stats`.
    let scope_host = |rig: &Rig, name: &str| {
        let rules = rig.snapshot().rules;
        rules.policy(rig.policy_id(name)).unwrap_or_else(|e| panic!("{e:#}")).flags & Policy::SCOPE_HOST != 0
    };
    assert!(!scope_host(&rig, "old") && scope_host(&rig, "shared"), "scopes in the kernel");
    assert_eq!((rig.show("old")["scope"].as_str(), rig.show("shared")["scope"].as_str()), (Some("cpu"), Some("host")));
    let shown = rig.ctl_ok(&["policy", "show", "old"]);
    assert!(shown.lines().any(|l| l.split_whitespace().eq(["scope", "cpu"])), "`policy show old`:\n{shown}");
    let listed = rig.ctl_ok(&["policy", "list"]);
    assert!(listed.lines().next().is_some_and(|h| h.contains("SCOPE")), "`policy list`:\n{listed}");
    let row = |text: &str, name: &str| {
        text.lines().find(|l| l.split_whitespace().next() == Some(name)).unwrap_or_default().to_string()
    };
    assert!(row(&listed, "old").contains(" cpu ") && row(&listed, "shared").contains(" host "), "{listed}");
    let stats = rig.ctl_ok(&["stats"]);
    assert!(stats.lines().next().is_some_and(|h| h.split_whitespace().nth(1) == Some("SCOPE")), "`stats`:\n{stats}");
    assert_eq!(row(&stats, "old").split_whitespace().nth(1), Some("cpu"), "`stats`:\n{stats}");
    assert_eq!(row(&stats, "shared").split_whitespace().nth(1), Some("host"), "`stats`:\n{stats}");
    let json: serde_json::Value = serde_json::from_str(&rig.ctl_ok(&["stats", "--json"])).expect("stats --json");
    let scopes: Vec<(&str, &str)> = json["policies"]
        .as_array()
        .expect("policies")
        .iter()
        .map(|p| (p["name"].as_str().unwrap_or_default(), p["scope"].as_str().unwrap_or_default()))
        .collect();
    assert_eq!(scopes, [("old", "cpu"), ("shared", "host")], "`stats --json`");

    // The first change: the marker on top, `scope = "cpu"` on `old`, nothing else moved; the
    // new policy takes the new default, host.
    rig.ctl_ok(&["policy", "set", "new", "--match", "icmp", "--rate", "10/s"]);
    let written = std::fs::read_to_string(&path).expect("config");
    let lines: Vec<&str> = written.lines().collect();
    assert!(lines[0].starts_with("version = 2"), "the marker is not on top:\n{written}");
    let expected = UNVERSIONED_CONFIG.replace("burst = 30\n", "burst = 30\nscope = \"cpu\"\n").to_string()
        + "\n[[policy]]\nname = \"new\"\nmatch = \"icmp\"\nrate = \"10/s\"\n";
    assert_eq!(lines[1..].join("\n").trim_start(), expected.trim_end(), "the rewritten file:\n{written}");
    assert!(scope_host(&rig, "new") && !scope_host(&rig, "old"), "scopes in the kernel after the change");
    assert_eq!(rig.show("new")["scope"].as_str(), Some("host"));
    assert_eq!(check("the rewritten file"), Vec::<String>::new(), "a note on the rewritten file");

    // Re-reading the rewritten file changes nothing; a hand edit with the marker and no scope is host.
    let mut rig = rig;
    let before = rig.snapshot().rules;
    rig.hup("reloaded");
    assert_eq!(rig.snapshot().rules, before, "the kernel's rules after re-reading the rewritten file");
    std::fs::write(&path, written.replace("scope = \"cpu\"\n", "")).expect("editing the config");
    rig.hup("reloaded");
    assert!(scope_host(&rig, "old"), "`old` without scope in a file with the marker is not host");
    assert_eq!(rig.show("old")["scope"].as_str(), Some("host"));
    let notes: usize = rig.daemon.lines().iter().filter(|(_, l)| l.contains("has no `version = 2`")).count();
    assert_eq!(notes, 1, "a note for a file with the marker:\n{}", rig.daemon.output());
}

//! Never two limiters on one interface: a second daemon under another `--pin-dir`, with the
//! first's `--state-dir` or another, at the other hook or under `--attach auto`, refuses to
//! start beside a running one, whichever hook the first holds (XDP, a tcx link, or a netlink
//! filter at tc ingress): exit 1 with one line naming the
//! first's pins and pid, and nothing changed (the first's program alone on the hooks, its state
//! file the same bytes, no pins or socket of the second's). Once the first is stopped, the
//! program it left pinned still keeps the second out (no daemon named); the first restarted on
//! its own pins adopts it as ever.

use std::{path::PathBuf, time::Duration};

use limiter_tests::{
    daemon::{Daemon, Launch, Scratch, xdp_program_id},
    neighbour::{TcFilter, tc_filters, tcx_chain},
    netns::TestNet,
    require_root,
};

use super::*;

#[test]
fn a_second_limiter_is_refused_beside_one_at_xdp() {
    require_root!();
    second_refused("xdp", "tcx", &[]);
}

#[test]
fn a_second_limiter_is_refused_beside_one_at_tcx() {
    require_root!();
    second_refused("tcx", "xdp", &[]);
}

/// Both daemons as on a kernel without tcx: the first's filter at tc ingress keeps the second out.
#[test]
fn a_second_limiter_is_refused_beside_one_through_a_netlink_filter() {
    require_root!();
    second_refused("tc", "xdp", &[super::netlink::NO_TCX]);
}

/// What a daemon's flags add to [`ARGS`]: its hook and its state directory.
fn flags(attach: Option<&str>, state: &std::path::Path) -> Vec<String> {
    let mut args: Vec<String> = ARGS.iter().map(|s| s.to_string()).collect();
    args.extend(["--metrics", "off", "--rotate-every", "off", "--state-dir"].map(String::from));
    args.push(state.to_str().expect("a UTF-8 path").into());
    if let Some(hook) = attach {
        args.extend(["--attach".to_string(), hook.to_string()]);
    }
    args
}

/// What holds the hooks: XDP's program, tcx's chain, the filters at tc ingress.
fn hooks(net: &TestNet) -> (Option<u32>, Vec<u32>, Vec<TcFilter>) {
    let end = &net.receiver;
    (xdp_program_id(end).expect("ip link"), tcx_chain(end).expect("tcx chain"), tc_filters(end).expect("tc filters"))
}

fn second_refused(first_at: &str, other_hook: &str, env: &[(&str, &str)]) {
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch");
    let state = scratch.path().join("state");
    let iface = net.receiver.iface.clone();
    let launch = || Launch { env: environment(env), ..Launch::default() };
    let first_flags = flags(Some(first_at), &state);
    let mut first = Daemon::launch(&net.receiver, &scratch, &strs(&first_flags), launch()).expect("first");
    first.wait_attached(&net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    first.ctl_ok(&["deny", "add", "198.19.9.9", "--for", "10m"]).expect("a ban");
    let file = state.join(format!("bans-{iface}.json"));
    let bans = wait_for_file(&file);
    let held = hooks(&net);
    eprintln!("first at {first_at}: XDP {:?}, tcx {:?}, filters {:?}", held.0, held.1, held.2);
    let pins = scratch.pin_dir(&iface);
    let pid = first.daemon_pid();

    let elsewhere = Scratch::new().expect("scratch");
    for (where_state, second_state) in
        [("its state dir", state.clone()), ("another state dir", elsewhere.path().join("state"))]
    {
        for attach in [Some(other_hook), None] {
            let what = format!("beside one at {first_at}, with {where_state}, --attach {}", attach.unwrap_or("auto"));
            let line = refused(&what, &net, &flags(attach, &second_state), env);
            assert!(line.contains(&format!("pid {pid}")), "{what}: the refusal does not name pid {pid}: {line}");
            assert!(line.contains(&pins.display().to_string()), "{what}: it does not name {}: {line}", pins.display());
            assert_eq!(std::fs::read(&file).expect("state file"), bans, "{what}: the first's state file changed");
            assert_eq!(hooks(&net), held, "{what}: the hooks changed");
            first.ctl_ok(&["stats"]).expect("the first still answers");
        }
    }

    // Stopped, the first leaves its program pinned and enforcing: still in the way, no daemon named.
    first.stop_ok();
    let what = format!("beside one left pinned at {first_at}");
    let line = refused(&what, &net, &flags(None, &elsewhere.path().join("state")), env);
    assert!(line.contains("no daemon running it") && line.contains(&pins.display().to_string()), "{what}: {line}");
    assert_eq!(std::fs::read(&file).expect("state file"), bans, "{what}: the first's state file changed");
    // Restarted on its own pins, the first adopts its program: it is never in its own way.
    let mut again = Daemon::launch(&net.receiver, &scratch, &strs(&flags(None, &state)), launch()).expect("first");
    let line = again.wait_adopted(&net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("the first restarted: {line}");
}

/// A daemon under pins, socket and config of its own, with `args`: exits 1 within 30 s,
/// having created none of them, with one error line; returns that line.
#[track_caller]
fn refused(what: &str, net: &TestNet, args: &[String], env: &[(&str, &str)]) -> String {
    let other = Scratch::new().expect("scratch");
    let launch = Launch { env: environment(env), ..Launch::default() };
    let mut second = Daemon::launch(&net.receiver, &other, &strs(args), launch).expect("second daemon");
    let status = second.wait_exit(Duration::from_secs(30)).expect("the second daemon should exit");
    let out = second.output();
    eprintln!("{what}: {status}\n{out}");
    assert_eq!(status.code(), Some(1), "{what}: {out}");
    assert!(!out.contains(" attached ") && !out.contains("adopted"), "{what}: it attached: {out}");
    let errors: Vec<&str> = out.lines().filter(|l| l.contains("error:")).collect();
    assert_eq!(errors.len(), 1, "{what}: not one error line: {out}");
    assert!(!other.pins().exists(), "{what}: it left {}", other.pins().display());
    assert!(!other.socket().exists(), "{what}: it left its socket");
    errors[0].to_string()
}

/// The file's bytes once it exists (the daemon saves its bans within a second or two).
fn wait_for_file(path: &PathBuf) -> Vec<u8> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(bytes) = std::fs::read(path) {
            return bytes;
        }
        assert!(std::time::Instant::now() < deadline, "{} was not written within 10 s", path.display());
        std::thread::sleep(Duration::from_millis(50));
    }
}

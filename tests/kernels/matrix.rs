//! The kernel matrix (issue 38): Debian's kernels booted under QEMU from the VM lab
//! ([`limiter_tests::vm`]; `cargo xtask setup` builds it), each running the release
//! `limiter-ctl` with `limiter-verify` (each program of the shipped object loaded, the verifier's
//! count of processed instructions printed) and the scenario of tests/kernels/guest.rs, one test
//! at a time. One test per kernel: Debian 12's 6.1 (bookworm), 6.12 (bookworm-backports) and the
//! newest Debian ships (trixie-backports' 7.x). The host's kernel is the matrix's last column:
//! the guest target runs natively in the suite, and tests/datapath/fixtures.rs holds its
//! programs to the same bar. Below the minimum, bullseye's 5.10: the daemon refuses to start in
//! one line naming the kernel and what it lacks, with exit status [`TOO_OLD`].
//!
//! The devices operators have (a multiqueue virtio_net NIC, VLANs) are tested in [`devices`],
//! one more boot per kernel (Debian 12's 6.1 and the newest).
//!
//! Each test prints its kernel's results, rows to paste into docs/DESIGN.md (kernel, program,
//! processed instructions) and the scenario's tests with their times, before it asserts.

mod devices;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use limiter_tests::{
    daemon::limiter_ctl_binary,
    verifier::{self, MAX_INSNS, Verdict},
    vm::{Lab, Outcome, Payload, say},
};

/// How many times slower than this machine the VM runs the scenario (software emulation: a
/// program load takes 30-60 s there): the daemon waits stretched by it ([`limiter_tests::slowdown`]).
const SLOWDOWN: u32 = 10;
/// The most one kernel's boot may take before QEMU is killed.
const BOOT_LIMIT: Duration = Duration::from_secs(25 * 60);

/// The daemon's exit status when the kernel lacks what it needs (docs/OPERATIONS.md, "The
/// daemon": 0 stopped, 1 failed, 2 bad input; 3 is `deny add --for`'s, some entries refused).
const TOO_OLD: i32 = 4;

#[test]
fn debian_12_bookworm_6_1() {
    matrix("bookworm", "6.1.");
}

#[test]
fn bookworm_backports_6_12() {
    matrix("bookworm-backports", "6.12.");
}

#[test]
fn trixie_backports_7() {
    matrix("trixie-backports", "7.");
}

/// The lab's kernel of `suite`, which must be of `series` (the test is named after it: a suite
/// that moved on is a new row of the matrix, to be named and documented).
fn kernel_of<'l>(lab: &'l Lab, suite: &str, series: &str) -> &'l limiter_tests::vm::Kernel {
    let kernel = lab.kernel(suite).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(
        kernel.release.starts_with(series),
        "the lab's {suite} kernel is {}, not {series}x: the suite moved on; name the test and the docs' rows after it",
        kernel.release
    );
    kernel
}

/// Boots `suite`'s kernel with `limiter-verify` and the scenario; every program verifies within
/// [`MAX_INSNS`] and every test of the scenario passes.
fn matrix(suite: &str, series: &str) {
    let lab = Lab::open().unwrap_or_else(|e| panic!("{e:#}"));
    let kernel = kernel_of(&lab, suite, series);
    let guest = guest_binary();
    let tests = list_tests(&guest);
    assert!(!tests.is_empty(), "{} lists no tests", guest.display());
    let mut script =
        format!("export CI=true RUST_BACKTRACE=1 LIMITER_TESTS_SLOWDOWN={SLOWDOWN}\n/lab/limiter-verify\n{LAB_TEST}");
    for test in &tests {
        script.push_str(&format!("lab_test {test}\n"));
    }
    let payload = Payload::new(&script).expect("the payload");
    let ctl = limiter_ctl_binary().unwrap_or_else(|e| panic!("{e:#}"));
    payload.add(&ctl, "target/release/limiter-ctl").expect("limiter-ctl");
    payload.add(&guest, "target/debug/deps/guest").expect("the guest tests");
    payload.add(Path::new(env!("CARGO_BIN_EXE_limiter-verify")), "limiter-verify").expect("limiter-verify");
    let mut vm = lab.vm(suite).expect("the VM");
    vm.timeout = BOOT_LIMIT;
    let out = vm.run(&payload).unwrap_or_else(|e| panic!("{} ({suite}): {e:#}", kernel.release));

    let verdicts = verifier::parse(out.output.iter().map(String::as_str));
    let results = test_results(&out);
    report(&out, suite, &kernel.version, &verdicts, &results);
    let mut failed = Vec::new();
    for name in [
        limiter_common::maps::PROGRAM_LAYERS,
        limiter_common::maps::PROGRAM,
        limiter_common::maps::PROGRAM_LAYERS_TCX,
        limiter_common::maps::PROGRAM_TCX,
    ] {
        match verdicts.iter().find(|(n, _)| n == name).map(|(_, v)| v) {
            Some(Verdict::Loaded(Some(n))) if *n <= MAX_INSNS => {}
            Some(Verdict::Loaded(Some(n))) => failed.push(format!(
                "{name}: {} processed instructions, over {}",
                verifier::thousands(*n),
                verifier::thousands(MAX_INSNS)
            )),
            Some(v) => failed.push(format!("{name}: {v}")),
            None => failed.push(format!("{name}: limiter-verify said nothing of it")),
        }
    }
    for test in &tests {
        match results.iter().find(|r| r.name == *test) {
            Some(r) if r.status == 0 => {}
            Some(r) => failed.push(format!("{test}: failed (exit {})", r.status)),
            None => failed.push(format!("{test}: did not finish")),
        }
    }
    assert!(failed.is_empty(), "on {} ({suite}):\n  {}", out.release, failed.join("\n  "));
}

/// The guest's runner of one scenario test: it prints `LAB-TEST NAME status=N seconds=S`. A
/// test that failed only because a stall of the emulated CPUs left too little of a flood to
/// measure its lower bound, or made a steady source's catch-up outrun its burst
/// ([`limiter_tests::bounds`]: "the machine was too busy"), runs once more, saying so: that
/// failure is the machine's, and says nothing of the limiter. Any other failure, and a second
/// stall, stand.
const LAB_TEST: &str = r#"lab_test() {
  start=$(date +%s)
  for try in 1 2; do
    { /lab/target/debug/deps/guest --exact "$1" --test-threads=1 --nocapture; echo $? > /tmp/lab-status; } 2>&1 |
      tee /tmp/lab-output
    status=$(cat /tmp/lab-status)
    if [ "$status" = 0 ] || [ $try = 2 ] || ! grep -q "the machine was too busy" /tmp/lab-output; then break; fi
    echo "LAB-RETRY $1: the emulated CPUs stalled too long to measure the lower bound; once more"
  done
  echo "LAB-TEST $1 status=$status seconds=$(( $(date +%s) - start ))"
}
"#;

/// One scenario test's end in the VM.
struct TestResult {
    name: String,
    status: i32,
    seconds: u64,
}

/// The `LAB-TEST NAME status=N seconds=S` lines the payload's script printed.
fn test_results(out: &Outcome) -> Vec<TestResult> {
    out.lines_after("LAB-TEST ")
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let name = words.next()?.to_string();
            let mut field = |k: &str| words.next()?.strip_prefix(k).map(str::to_owned);
            let status = field("status=")?.parse().ok()?;
            let seconds = field("seconds=")?.parse().ok()?;
            Some(TestResult { name, status, seconds })
        })
        .collect()
}

/// The kernel's results: the verifier's counts as rows of docs/DESIGN.md's table, then the
/// scenario's tests.
fn report(out: &Outcome, suite: &str, version: &str, verdicts: &[(String, Verdict)], results: &[TestResult]) {
    let mut text = format!(
        "kernel matrix: {} ({suite}, package {version}), {} CPUs, {:.0?} from QEMU's start to the end\n\
         | kernel | program | processed instructions |\n|---|---|---|\n",
        out.release, out.cpus, out.took
    );
    for (name, verdict) in verdicts {
        text.push_str(&format!("| {} ({suite}) | {name} | {verdict} |\n", out.release));
    }
    text.push_str("| test (tests/kernels/guest.rs) | result | seconds |\n|---|---|---|\n");
    for r in results {
        let mut result = if r.status == 0 { "ok".to_string() } else { format!("FAILED (exit {})", r.status) };
        if out.lines_after("LAB-RETRY ").any(|l| l.split(':').next() == Some(r.name.as_str())) {
            result.push_str(", run twice: the first run stalled");
        }
        text.push_str(&format!("| {} | {result} | {} |\n", r.name, r.seconds));
    }
    say(&text);
}

/// The guest target's test binary, built (or found up to date) by `cargo test --no-run`.
fn guest_binary() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["test", "--package", "limiter-tests", "--test", "guest", "--no-run", "--message-format", "json"]);
    let out = cmd.current_dir(env!("CARGO_MANIFEST_DIR")).output().expect("running cargo");
    assert!(out.status.success(), "{cmd:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|m| m["target"]["name"] == "guest" && m["executable"].is_string())
        .and_then(|m| m["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("{cmd:?} named no guest executable"))
}

/// The names of the tests in the guest binary (`--list`).
fn list_tests(guest: &Path) -> Vec<String> {
    let out = Command::new(guest).args(["--list", "--format", "terse"]).output().expect("listing the guest tests");
    assert!(out.status.success(), "{} --list failed", guest.display());
    String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.strip_suffix(": test")).map(str::to_owned).collect()
}

// ---------------------------------------------------------------------------------------------
// Below the minimum

/// On bullseye's 5.10 (no BPF atomic compare-and-exchange before 5.12, among what it lacks), the
/// daemon refuses to start: exit [`TOO_OLD`], one line on stderr, `error: ` then the kernel's
/// release and what it lacks; no verifier log anywhere; nothing attached, pinned or written.
#[test]
fn below_the_minimum_on_5_10_the_daemon_refuses_in_one_line() {
    let lab = Lab::open().unwrap_or_else(|e| panic!("{e:#}"));
    let kernel = kernel_of(&lab, "bullseye", "5.10.");
    let script = "\
ip link add lab0 type veth peer name lab1 && ip link set lab0 up && ip link set lab1 up
timeout 600 /lab/target/release/limiter-ctl --socket /tmp/ctl.sock daemon --iface lab0 --config /tmp/limiter.toml \
--pin-dir /sys/fs/bpf/limiter --state-dir /tmp/state >/tmp/out 2>/tmp/err
echo \"LAB-DAEMON exit=$?\"
sed 's/^/LAB-STDOUT /' /tmp/out
sed 's/^/LAB-STDERR /' /tmp/err
echo \"LAB-PINNED $(find /sys/fs/bpf -mindepth 1 | wc -l)\"
echo \"LAB-TC $(tc filter show dev lab0 ingress | wc -l)\"
ip -d link show dev lab0 | grep -q xdp && echo 'LAB-XDP attached' || echo 'LAB-XDP none'
test -e /tmp/limiter.toml && echo 'LAB-CONFIG written' || echo 'LAB-CONFIG none'
";
    let payload = Payload::new(script).expect("the payload");
    let ctl = limiter_ctl_binary().unwrap_or_else(|e| panic!("{e:#}"));
    payload.add(&ctl, "target/release/limiter-ctl").expect("limiter-ctl");
    let out =
        lab.vm("bullseye").and_then(|vm| vm.run(&payload)).unwrap_or_else(|e| panic!("{}: {e:#}", kernel.release));
    let one = |prefix: &str| out.lines_after(prefix).next().unwrap_or_else(|| panic!("no {prefix} line")).to_string();
    let stderr: Vec<&str> = out.lines_after("LAB-STDERR ").collect();
    let stdout: Vec<&str> = out.lines_after("LAB-STDOUT ").collect();
    say(&format!(
        "kernel matrix: {} (bullseye, package {}): exit {}, stderr {stderr:?}, {} lines of log",
        out.release,
        kernel.version,
        one("LAB-DAEMON exit="),
        stdout.len()
    ));
    let all = format!("stdout:\n{}\nstderr:\n{}", stdout.join("\n"), stderr.join("\n"));
    assert_eq!(one("LAB-DAEMON exit="), TOO_OLD.to_string(), "the daemon's exit status on {}:\n{all}", out.release);
    assert_eq!(stderr.len(), 1, "the refusal is one line on stderr:\n{all}");
    let line = stderr[0];
    assert!(line.starts_with("error: ") && line.contains(&out.release), "the refusal names the kernel: {line}");
    assert!(
        ["lacks", "missing", "needs", "requires"].iter().any(|w| line.contains(w)),
        "the refusal says what the kernel lacks: {line}"
    );
    assert!(!all.contains("processed ") && all.lines().count() < 20, "a verifier log was printed:\n{all}");
    assert_eq!(one("LAB-PINNED "), "0", "pins were left");
    assert_eq!(one("LAB-TC "), "0", "a tc filter was left");
    assert_eq!(one("LAB-XDP "), "none", "an XDP program was left");
    assert_eq!(one("LAB-CONFIG "), "none", "the config file was written");
}

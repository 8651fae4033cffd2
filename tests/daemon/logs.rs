//! The daemon's log lines as a collector and journald read them, from the real binary: a daemon
//! told to wait for an interface that never comes logs that it waits (info), then fails (exit
//! 1, one error line). Unprivileged: nothing is loaded before the interface exists.

use std::{
    fs::File,
    os::unix::fs::MetadataExt as _,
    path::Path,
    process::{Command, Stdio},
};

use limiter_tests::daemon::limiter_ctl_binary;

/// A name no interface has (IFNAMSIZ allows 15 bytes).
const MISSING: &str = "lmt-log-none0";

/// Runs the daemon waiting 300 ms for [`MISSING`], stdout and stderr into `out` (one file, as
/// systemd connects both to one journal stream), with `env` set; returns the file's text.
fn run_daemon(dir: &Path, extra: &[&str], env: &[(&str, String)]) -> String {
    let config = dir.join("limiter.toml");
    std::fs::write(&config, "policy = []\n").unwrap();
    let out_path = dir.join("out");
    let out = File::create(&out_path).unwrap();
    let mut cmd = Command::new(limiter_ctl_binary().unwrap());
    cmd.arg("--socket").arg(dir.join("ctl.sock"));
    cmd.args(["daemon", "--iface", MISSING, "--wait-iface", "300ms", "--metrics", "off", "--config"]).arg(&config);
    cmd.args(extra).env_remove("JOURNAL_STREAM").env_remove("RUST_LOG");
    cmd.envs(env.iter().map(|(k, v)| (k, v))).stdin(Stdio::null());
    cmd.stdout(out.try_clone().unwrap()).stderr(out);
    let status = cmd.status().unwrap();
    assert_eq!(status.code(), Some(1), "a daemon whose interface never came should exit 1");
    std::fs::read_to_string(&out_path).unwrap()
}

fn stream_of(path: &Path) -> String {
    let meta = std::fs::metadata(path).unwrap();
    format!("{}:{}", meta.dev(), meta.ino())
}

#[test]
fn json_format_is_one_object_per_line_with_level_and_message() {
    let dir = tempfile::tempdir().unwrap();
    let text = run_daemon(dir.path(), &["--log-format", "json"], &[]);
    let (logs, rest): (Vec<&str>, Vec<&str>) = text.lines().partition(|l| l.starts_with('{'));
    // The last line is the exit's error on stderr, plain text for the operator.
    assert!(rest.len() == 1 && rest[0].starts_with("error: "), "other lines than JSON and one error: {rest:?}");
    assert!(!logs.is_empty(), "no JSON line in:\n{text}");
    for line in &logs {
        let object: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not one JSON object ({e}): {line}"));
        assert!(object["level"].is_string(), "no level: {line}");
        assert!(object["fields"]["message"].is_string(), "no message: {line}");
        assert!(object["timestamp"].is_string(), "no timestamp: {line}");
    }
    let waiting: serde_json::Value = serde_json::from_str(logs[0]).unwrap();
    assert_eq!(waiting["level"], "INFO");
    assert_eq!(waiting["fields"]["iface"], MISSING);
    assert!(waiting["fields"]["message"].as_str().unwrap().contains("waiting"), "{waiting}");

    // RUST_LOG filters: at `error`, the info line goes.
    let quiet = run_daemon(dir.path(), &["--log-format", "json"], &[("RUST_LOG", "error".into())]);
    assert!(!quiet.lines().any(|l| l.starts_with('{')), "RUST_LOG=error let info through:\n{quiet}");
}

#[test]
fn journal_stream_lines_carry_syslog_priorities() {
    let dir = tempfile::tempdir().unwrap();
    // JOURNAL_STREAM naming the very file stdout and stderr write to: the journal.
    let out = dir.path().join("out");
    File::create(&out).unwrap();
    let text = run_daemon(dir.path(), &[], &[("JOURNAL_STREAM", stream_of(&out))]);
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() >= 2, "expected the waiting line and the error:\n{text}");
    assert!(lines[0].starts_with("<6>") && lines[0].contains("waiting"), "info line without <6>: {}", lines[0]);
    let last = lines[lines.len() - 1];
    assert!(last.starts_with("<3>error: ") && last.contains(MISSING), "error line without <3>: {last}");
    // Journald keeps its own time: no timestamp in the line.
    assert!(lines[0][3..].trim_start().starts_with("INFO"), "a timestamp in {}", lines[0]);

    // JOURNAL_STREAM naming another file (a child of a unit whose output was redirected): no prefix.
    let other = dir.path().join("other");
    File::create(&other).unwrap();
    let text = run_daemon(dir.path(), &[], &[("JOURNAL_STREAM", stream_of(&other))]);
    assert!(text.lines().all(|l| !l.starts_with('<')), "prefix without the journal:\n{text}");
}

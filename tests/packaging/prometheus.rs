//! The shipped Prometheus rules and Grafana dashboard against the real thing: `promtool check
//! rules` and `promtool test rules` (packaging/prometheus/tests/, every alert firing and not
//! firing, and each alert's tests failing when the alert is broken); `promtool check metrics` on
//! a running daemon's exposition; every metric the rules and the dashboard name exported by it;
//! and Debian's `prometheus`, started here in the receiver's namespace (where the daemon's
//! metrics listener is, 127.0.0.1:9464), scraping the daemon every second during a flood, firing
//! the refusal alert and not the down alert, and answering every dashboard query.

use std::{
    collections::BTreeSet,
    fs,
    io::Write as _,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use limiter_tests::{
    flood::{Limits, Sources},
    observe::fresh_stats,
    policies::src,
    require_root,
    rig::{METRICS, Rig},
    scrape,
};
use nix::{sys::signal::Signal, unistd::Pid};
use serde_json::Value;

const RULES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/prometheus/limiter-rules.yml");
const RULE_TESTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/prometheus/tests/limiter-rules.test.yml");
const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/grafana/limiter-dashboard.json");
/// How long the refusal alert may take to fire from the flood's start, with its `for:` cut to 1 s
/// and a scrape and an evaluation every second: two scrapes for a rate, one evaluation pending,
/// the next firing (about 4 s), with slack for a loaded machine (3x and more).
const FIRING_BUDGET: Duration = Duration::from_secs(30);
/// The dashboard's `$__rate_interval`, as the test substitutes it.
const RATE_INTERVAL: Duration = Duration::from_secs(4);
/// The flood's pace, over its two streams.
const PACE: f64 = 5000.0;

fn promtool(args: &[&str]) -> std::process::Output {
    Command::new("promtool").args(args).output().unwrap_or_else(|e| {
        panic!("running promtool: {e}; it comes with Debian's prometheus package: run `cargo xtask setup`")
    })
}

fn text(o: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn yaml(path: &str) -> serde_yaml_ng::Value {
    serde_yaml_ng::from_str(&fs::read_to_string(path).unwrap()).unwrap()
}

/// Every alerting rule in the shipped file: its name and expression.
fn alerts() -> Vec<(String, String)> {
    let rules = yaml(RULES);
    rules["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_sequence().unwrap().iter())
        .map(|r| (r["alert"].as_str().unwrap().to_string(), r["expr"].as_str().unwrap().to_string()))
        .collect()
}

/// The dashboard's queries, with the panel each is in.
fn dashboard_queries() -> Vec<(String, String)> {
    let d: Value = serde_json::from_str(&fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    d["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_string();
            p["targets"].as_array().cloned().unwrap_or_default().into_iter().map(move |t| {
                (title.clone(), t["expr"].as_str().unwrap_or_else(|| panic!("a target without expr in {title}")).into())
            })
        })
        .collect()
}

/// The metric names a PromQL expression reads: its identifiers that start like ours (label
/// names and functions never do).
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|w| w.starts_with("limiter_") || w.starts_with("process_"))
        .map(str::to_string)
        .collect()
}

#[test]
fn promtool_checks_the_rules() {
    let out = promtool(&["check", "rules", RULES]);
    let said = text(&out);
    assert!(out.status.success(), "promtool check rules: {said}");
    let found = format!("SUCCESS: {} rules found", alerts().len());
    assert!(said.contains(&found), "expected {found:?}: {said}");
}

/// `promtool test rules` passes; every alert has a case where it fires and one where it does
/// not; and each alert's tests fail once that alert is broken (its expression never true).
#[test]
fn promtool_unit_tests_cover_every_alert_and_catch_a_broken_one() {
    let out = promtool(&["test", "rules", RULE_TESTS]);
    assert!(out.status.success(), "promtool test rules: {}", text(&out));

    let tests = yaml(RULE_TESTS);
    let cases: Vec<(String, bool)> = tests["tests"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_sequence().unwrap().iter())
        .map(|c| {
            let fires = c["exp_alerts"].as_sequence().is_some_and(|a| !a.is_empty());
            (c["alertname"].as_str().unwrap().to_string(), fires)
        })
        .collect();
    let names: Vec<String> = alerts().into_iter().map(|(n, _)| n).collect();
    for name in &names {
        for fires in [true, false] {
            assert!(
                cases.contains(&(name.clone(), fires)),
                "no test where {name} {}",
                if fires { "fires" } else { "stays silent" }
            );
        }
    }

    // Mutants: each alert in turn made to never fire, in a copy beside a copy of the tests.
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("tests.yml"),
        fs::read_to_string(RULE_TESTS).unwrap().replace("../limiter-rules.yml", "rules.yml"),
    )
    .unwrap();
    for name in &names {
        let mut rules = yaml(RULES);
        for group in rules["groups"].as_sequence_mut().unwrap() {
            for rule in group["rules"].as_sequence_mut().unwrap() {
                if rule["alert"].as_str() == Some(name) {
                    rule["expr"] = "vector(1) == 0".into();
                }
            }
        }
        fs::write(dir.path().join("rules.yml"), serde_yaml_ng::to_string(&rules).unwrap()).unwrap();
        let out = promtool(&["test", "rules", dir.path().join("tests.yml").to_str().unwrap()]);
        let said = text(&out);
        assert!(!out.status.success(), "the tests pass with {name} never firing: {said}");
        assert!(said.contains(&format!("alertname: {name},")), "{name} broken, but the failure names another: {said}");
    }
}

/// The dashboard's shape: the `$instance` and `$policy` variables, and every query filtered by
/// `$instance` (a dashboard for one host must not sum a fleet).
#[test]
fn dashboard_has_instance_and_policy_variables_and_every_query_uses_them() {
    let d: Value = serde_json::from_str(&fs::read_to_string(DASHBOARD).unwrap()).unwrap();
    let vars: Vec<&str> =
        d["templating"]["list"].as_array().unwrap().iter().filter_map(|v| v["name"].as_str()).collect();
    for v in ["datasource", "instance", "policy"] {
        assert!(vars.contains(&v), "no ${v} variable: {vars:?}");
    }
    let queries = dashboard_queries();
    assert!(queries.len() >= 15, "{} queries", queries.len());
    for (panel, expr) in &queries {
        assert!(expr.contains(r#"instance=~"$instance""#), "{panel}: {expr} ignores $instance");
        if expr.contains("limiter_packets_total") || expr.contains("limiter_policy_info") {
            assert!(expr.contains(r#"policy=~"$policy""#), "{panel}: {expr} ignores $policy");
        }
        assert!(!metric_names(expr).is_empty(), "{panel}: {expr} reads no metric of ours");
    }
    for title in [
        "Admitted per policy",
        "Refused per policy",
        "Refused share",
        "Dry-run: would refuse",
        "Unjudged traffic",
        "Bucket occupancy",
        "Salt age",
    ] {
        assert!(queries.iter().any(|(p, _)| p == title), "no panel {title:?}");
    }
}

/// The exposition of a daemon with a policy, in Prometheus' text format, passes `promtool check
/// metrics` without a remark (the same text in OpenMetrics is what Prometheus scrapes), and it
/// has every metric the rules and the dashboard read.
#[test]
fn the_exposition_passes_promtool_check_metrics_and_has_every_metric_the_rules_and_dashboard_read() {
    require_root!();
    let rig = Rig::start(&["--buckets", "1024", "--rotate-every", "1h"]).expect("rig");
    rig.ctl_ok(&["policy", "set", "flood", "--match", "udp:7000", "--rate", "1000/s", "--burst", "100"]);
    fresh_stats(&rig);
    let response = rig
        .net
        .receiver
        .run(|| get_with_accept(METRICS, "/metrics", "text/plain; version=0.0.4"))
        .expect("namespace")
        .expect("GET /metrics");
    assert_eq!(response.status, 200);
    let content_type = response.header("content-type").unwrap_or_default();
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{content_type}");
    let mut lint = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool");
    lint.stdin.take().unwrap().write_all(response.body.as_bytes()).unwrap();
    let out = lint.wait_with_output().unwrap();
    let said = text(&out);
    assert!(out.status.success() && said.trim().is_empty(), "promtool check metrics: {said}\n{}", response.body);

    let exported: BTreeSet<String> =
        scrape::parse(&response.body).expect("exposition").into_iter().map(|s| s.name).collect();
    eprintln!("{} metric names exported", exported.len());
    for family in [
        "limiter_build_info",
        "limiter_policy_info",
        "limiter_salt_rotation_interval_seconds",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_open_fds",
    ] {
        assert!(exported.contains(family), "{family} not exported: {exported:?}");
    }
    let read = alerts()
        .into_iter()
        .map(|(n, e)| (format!("alert {n}"), e))
        .chain(dashboard_queries().into_iter().map(|(p, e)| (format!("panel {p}"), e)));
    for (what, expr) in read {
        for name in metric_names(&expr) {
            assert!(exported.contains(&name), "{what} reads {name}, which the daemon does not export: {expr}");
        }
    }
}

/// A GET that says which formats it takes (scrape::get sends ureq's default).
fn get_with_accept(addr: std::net::SocketAddr, path: &str, accept: &str) -> anyhow::Result<scrape::Response> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: {accept}\r\nConnection: close\r\n\r\n")?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let raw = String::from_utf8(raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(|| anyhow::anyhow!("no header end: {raw}"))?;
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|c| c.parse().ok()).unwrap_or(0);
    let headers =
        lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_lowercase(), v.trim().to_string())).collect();
    // axum answers with a length (no chunking) for a body it has whole.
    Ok(scrape::Response { status, headers, body: body.to_string(), latency: Duration::ZERO })
}

// ---------------------------------------------------------------------------------------------
// A real Prometheus

/// Debian's `prometheus`, run in a namespace, killed by its pid when dropped (a failing test
/// too), its log kept to show.
struct Prometheus {
    child: Child,
    addr: std::net::SocketAddr,
    log: PathBuf,
    ns: String,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scraping the daemon at [`METRICS`] every second as job "limiter", evaluating `rules` every
    /// second, from `ns`'s loopback on a port free there.
    fn start(rig: &Rig, rules: &str) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let port =
            rig.net.receiver.run(|| std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()))??.port();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        fs::write(dir.path().join("rules.yml"), rules)?;
        fs::write(
            dir.path().join("prometheus.yml"),
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nrule_files: [rules.yml]\n\
                 scrape_configs:\n  - job_name: limiter\n    static_configs:\n      - targets: ['{METRICS}']\n"
            ),
        )?;
        let log = dir.path().join("prometheus.log");
        let out = fs::File::create(&log)?;
        let child = rig
            .net
            .receiver
            .command("prometheus")
            .arg(format!("--config.file={}", dir.path().join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .map_err(|e| {
                anyhow::anyhow!(
                    "starting prometheus: {e}; it comes with Debian's prometheus package: run `cargo xtask setup`"
                )
            })?;
        let p = Self { child, addr, log, ns: rig.net.receiver.ns.clone(), _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if p.get("/-/ready").is_ok_and(|r| r.status == 200) {
                return Ok(p);
            }
            anyhow::ensure!(Instant::now() < deadline, "prometheus not ready within 30 s: {}", p.log());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn get(&self, path: &str) -> anyhow::Result<scrape::Response> {
        let (addr, path) = (self.addr, path.to_string());
        limiter_tests::netns::run_in(&self.ns, move || scrape::get(addr, &path, Duration::from_secs(10)))?
    }

    /// An API call's `data`; fails on a status other than "success".
    fn api(&self, path: &str) -> anyhow::Result<Value> {
        let r = self.get(path)?;
        let v: Value = serde_json::from_str(&r.body)?;
        anyhow::ensure!(v["status"] == "success", "{path}: {}", r.body);
        Ok(v["data"].clone())
    }

    /// An instant query's result vector.
    fn query(&self, expr: &str) -> anyhow::Result<Vec<Value>> {
        let data = self.api(&format!("/api/v1/query?query={}", encode(expr)))?;
        anyhow::ensure!(data["resultType"] == "vector", "{expr}: {data}");
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The active alerts: name, state ("pending", "firing"), labels.
    fn alerts(&self) -> anyhow::Result<Vec<Value>> {
        Ok(self.api("/api/v1/alerts")?["alerts"].as_array().cloned().unwrap_or_default())
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A query string's value, percent-encoded (everything but RFC 3986's unreserved characters).
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The shipped rules with every `for:` cut to 1 s, so that a test of seconds sees alerts fire;
/// nothing else changed.
fn rules_with_short_for() -> String {
    let shipped = fs::read_to_string(RULES).unwrap();
    let mut out = String::new();
    let mut cut = 0;
    for line in shipped.lines() {
        match line.split_once("for: ") {
            Some((indent, _)) if indent.trim().is_empty() => {
                out.push_str(&format!("{indent}for: 1s\n"));
                cut += 1;
            }
            _ => out.push_str(&format!("{line}\n")),
        }
    }
    assert!(cut >= 5, "only {cut} `for:` lines found to shorten");
    out
}

fn named<'a>(alerts: &'a [Value], name: &str) -> Vec<&'a Value> {
    alerts.iter().filter(|a| a["labels"]["alertname"] == name).collect()
}

/// A real Prometheus scraping the daemon every second fires the refusal alert during a flood of
/// one source at 5x a policy's rate, for that policy, within [`FIRING_BUDGET`] of the flood's
/// start; the down alert does not fire while the daemon answers (`up` is 1). Then every query of
/// the dashboard, its variables substituted, answers without error and with data, and the
/// refused-per-policy panel shows the flood.
#[test]
fn a_real_prometheus_fires_the_refusal_alert_during_a_flood() {
    require_root!();
    let rig = Rig::start(&["--buckets", "1024", "--rotate-every", "1h"]).expect("rig");
    rig.ctl_ok(&["policy", "set", "flood", "--match", "udp:7000", "--rate", "1000/s", "--burst", "100"]);
    rig.ctl_ok(&["policy", "set", "watch", "--match", "udp:7001", "--rate", "100/s", "--burst", "10", "--dry-run"]);
    fresh_stats(&rig);
    let prometheus = Prometheus::start(&rig, &rules_with_short_for()).expect("prometheus");
    let rules = prometheus.api("/api/v1/rules").expect("rules");
    let loaded = rules["groups"][0]["rules"].as_array().map_or(0, Vec::len);
    assert_eq!(loaded, alerts().len(), "rules loaded: {rules}");

    // Before any flood: scraped, nothing refusing.
    let deadline = Instant::now() + Duration::from_secs(30);
    while prometheus.query(r#"up{job="limiter"} == 1"#).expect("query").is_empty() {
        assert!(Instant::now() < deadline, "the daemon was not scraped within 30 s: {}", prometheus.log());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(named(&prometheus.alerts().expect("alerts"), "LimiterPolicyRefusing").is_empty());

    let streams = [rig.udp(Sources::One(src("198.19.1.1")), 7000), rig.udp(Sources::One(src("198.19.1.2")), 7001)];
    // 5000 packets/s of two streams, at most 60 s: stopped once the alert fired.
    let flooding = rig.start_flood(&streams, Limits::timed(Duration::from_secs(60)), Some(PACE)).expect("flood");
    let (mut pending_after, mut firing) = (None, None);
    while flooding.started.elapsed() < FIRING_BUDGET {
        let alerts = prometheus.alerts().expect("alerts");
        let refusing = named(&alerts, "LimiterPolicyRefusing");
        if pending_after.is_none() && !refusing.is_empty() {
            pending_after = Some(flooding.started.elapsed());
        }
        assert!(named(&alerts, "LimiterDown").is_empty(), "LimiterDown while the daemon runs: {alerts:?}");
        if let Some(a) = refusing.iter().find(|a| a["state"] == "firing") {
            firing = Some((flooding.started.elapsed(), (*a).clone(), alerts.clone()));
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let up = prometheus.query(r#"up{job="limiter"}"#).expect("up");

    // The dashboard, mid-flood: every query, variables as Grafana substitutes them, once the
    // flood has filled the panels' 4 s rate window and two scrapes more (so the rates shown are
    // the flood's, not averaged with the quiet before it).
    let filled = RATE_INTERVAL + Duration::from_secs(2);
    if let Some(wait) = filled.checked_sub(flooding.started.elapsed()) {
        std::thread::sleep(wait);
    }
    let instance = METRICS.to_string();
    let mut empty = Vec::new();
    let (mut refused_shown, mut would_refuse_shown) = (0.0, 0.0);
    for (panel, expr) in dashboard_queries() {
        let q = expr
            .replace("$instance", &instance)
            .replace("$policy", "flood|watch")
            .replace("$__rate_interval", &format!("{}s", RATE_INTERVAL.as_secs()));
        let result = prometheus.query(&q).unwrap_or_else(|e| panic!("panel {panel}: {q}: {e:#}"));
        if result.is_empty() {
            empty.push(format!("{panel}: {q}"));
        }
        let shown = |policy: &str| -> f64 {
            result
                .iter()
                .filter(|r| r["metric"]["policy"] == policy)
                .filter_map(|r| r["value"][1].as_str()?.parse::<f64>().ok())
                .sum()
        };
        match panel.as_str() {
            "Refused per policy" => refused_shown = shown("flood"),
            "Dry-run: would refuse" => would_refuse_shown = shown("watch"),
            _ => {}
        }
    }
    let instances = prometheus.api("/api/v1/label/instance/values?match[]=limiter_build_info").expect("instances");
    let policies = prometheus
        .api(&format!(
            "/api/v1/label/policy/values?match[]={}",
            encode(&format!(r#"limiter_policy_info{{instance=~"{instance}"}}"#))
        ))
        .expect("policies");
    flooding.stop();
    let run = flooding.finish().expect("flood");
    eprintln!("flood: {}", run.report);

    let Some((fired_after, alert, alerts)) = firing else {
        panic!(
            "LimiterPolicyRefusing did not fire within {FIRING_BUDGET:?} of the flood's start (pending after {pending_after:?}); \
             alerts: {:?}; log: {}",
            prometheus.alerts(),
            prometheus.log()
        )
    };
    eprintln!(
        "LimiterPolicyRefusing: pending {pending_after:?}, firing {fired_after:?} after the flood started (activeAt {}, value {})",
        alert["activeAt"], alert["value"]
    );
    assert_eq!(alert["labels"]["policy"], "flood", "{alert}");
    assert_eq!(alert["labels"]["severity"], "info", "{alert}");
    assert_eq!(alert["labels"]["instance"], instance, "{alert}");
    assert!(alert["annotations"]["summary"].as_str().is_some_and(|s| s.contains("flood")), "{alert}");
    // The dry-run policy refuses nothing: it would.
    assert!(named(&alerts, "LimiterPolicyRefusing").iter().all(|a| a["labels"]["policy"] == "flood"), "{alerts:?}");
    for silent in
        ["LimiterDown", "LimiterSkbMode", "LimiterConfigReloadFailed", "LimiterSaltNotRotating", "LimiterErrors"]
    {
        assert!(named(&alerts, silent).is_empty(), "{silent} active: {alerts:?}");
    }
    assert_eq!(up.len(), 1, "{up:?}");
    assert_eq!(up[0]["value"][1], "1", "up: {up:?}");

    assert!(empty.is_empty(), "dashboard queries with no data mid-flood:\n{}", empty.join("\n"));
    // Each stream is offered half the pace: 2500/s. The sender must have kept it (a paced sender
    // catches up after a stall), or the panels cannot be checked against it.
    let offered = run.report.pps() / 2.0;
    assert!(
        offered >= 0.9 * PACE / 2.0,
        "the sender paced at {PACE}/s sent {}/s ({}): the machine could not keep the pace, so the panels cannot \
         be checked",
        run.report.pps(),
        run.report
    );
    // The panels show what was refused over the last 4 s: 2500 - 1000 = 1500/s for the flood, and
    // 2500 - 100 = 2400/s the dry-run policy would refuse. Within 10%: Prometheus extrapolates
    // over 3 or 4 scrapes taken a second apart, whose timing drifts by some milliseconds, and the
    // policies admit their bursts (100, 10) once, which the window may straddle.
    for (panel, shown, expected) in
        [("refused", refused_shown, offered - 1000.0), ("dry-run", would_refuse_shown, offered - 100.0)]
    {
        eprintln!("the {panel} panel shows {shown:.0}/s; expected {expected:.0}/s");
        assert!(
            (0.9 * expected..=1.1 * expected).contains(&shown),
            "the {panel} panel shows {shown:.0}/s, not within 10% of the {expected:.0}/s refused (flood: {})",
            run.report
        );
    }
    assert!(
        instances.as_array().is_some_and(|i| i.iter().any(|v| v == instance.as_str())),
        "$instance values: {instances}"
    );
    for p in ["flood", "watch"] {
        assert!(policies.as_array().is_some_and(|v| v.iter().any(|v| v == p)), "$policy values: {policies}");
    }
}

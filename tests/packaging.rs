//! The packaging as an operator's tools see it: the systemd unit (`systemd-analyze verify` and
//! `security`), the Kubernetes manifests (parsed as YAML, checked for what a kubelet needs), the
//! shipped configs (parsed by the daemon's own parser), and the Debian package (built by
//! `cargo xtask package`, installed with dpkg into a scratch root, its binary and man page run).
//!
//! Runs as any user and needs no kernel privileges. Needs cargo-deb, systemd-analyze, man and
//! dpkg, which `cargo xtask setup` installs; none of these tests skips.
//!
//! The package is installed with the real dpkg (`-i`: unpack and configure) under
//! `--root=DIR --force-not-root --force-script-chrootless`: a chroot would need root and a shell
//! inside DIR, so the maintainer scripts run outside it, with `systemctl`, `deb-systemd-helper`
//! and `deb-systemd-invoke` replaced by stubs that only log their arguments. Nothing on the host
//! is touched.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::OnceLock,
};

use limiter_ctl::config::{self, State};
use serde::Deserialize as _;
use serde_json::Value;

const CAPABILITIES: [&str; 3] = ["BPF", "NET_ADMIN", "PERFMON"];
/// `systemd-analyze security --offline` scores the unit 2.0 (0 best, 10 worst); this catches a
/// hardening line lost in an edit.
const MAX_EXPOSURE: f64 = 3.0;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn packaging(rel: &str) -> PathBuf {
    root().join("packaging").join(rel)
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn run(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("could not start {cmd:?}: {e} (run `cargo xtask setup`)"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

// ---------------------------------------------------------------------------------------------
// The package, built once per test process and installed afresh by each test that needs it.

/// `cargo xtask package`, once: the path of the .deb it printed.
fn deb() -> &'static Path {
    static DEB: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let built = DEB.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .args(["run", "--quiet", "--package", "xtask", "--", "package"])
            .current_dir(root())
            .output()
            .map_err(|e| format!("could not start `cargo xtask package`: {e}"))?;
        if !out.status.success() {
            return Err(format!("`cargo xtask package` failed ({}):\n{}", out.status, text(&out.stderr)));
        }
        let stdout = text(&out.stdout);
        let path = stdout.lines().last().map(|l| PathBuf::from(l.trim())).filter(|p| p.is_file());
        path.ok_or_else(|| format!("`cargo xtask package` printed no .deb path: {stdout:?}"))
    });
    match built {
        Ok(path) => path,
        Err(e) => panic!("{e}"),
    }
}

/// Stand-ins for the systemd tools the maintainer scripts call: each logs its arguments and
/// succeeds, except that no unit counts as having been enabled (as on a fresh machine).
const STUBBED: [&str; 3] = ["systemctl", "deb-systemd-helper", "deb-systemd-invoke"];
const STUB: &str =
    "#!/bin/sh\necho \"$(basename \"$0\") $*\" >> \"$STUB_LOG\"\ncase \"$*\" in *was-enabled*) exit 1;; esac\nexit 0\n";

/// The package installed into a scratch root with the real dpkg.
struct Installed {
    dir: tempfile::TempDir,
}

impl Installed {
    fn new() -> Self {
        let dir = tempfile::Builder::new().prefix("limiter-pkg-").tempdir().expect("scratch dir");
        let me = Self { dir };
        for sub in ["root/var/lib/dpkg/info", "root/var/lib/dpkg/updates", "stubs"] {
            fs::create_dir_all(me.dir.path().join(sub)).expect("scratch layout");
        }
        for file in ["status", "available"] {
            fs::write(me.root().join("var/lib/dpkg").join(file), "").expect("empty dpkg database");
        }
        for tool in STUBBED {
            let stub = me.dir.path().join("stubs").join(tool);
            fs::write(&stub, STUB).expect("stub");
            fs::set_permissions(&stub, fs::Permissions::from_mode(0o755)).expect("chmod stub");
        }
        me.dpkg(&["-i", &deb().to_string_lossy()]);
        me
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root().join(rel)
    }

    fn log(&self) -> PathBuf {
        self.dir.path().join("calls.log")
    }

    /// The stubbed tools first on PATH, the rest of PATH with the sbin directories dpkg wants.
    fn env_path(&self) -> String {
        format!(
            "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            self.dir.path().join("stubs").display()
        )
    }

    /// Runs dpkg on the scratch root; returns the stub calls it caused.
    fn dpkg(&self, args: &[&str]) -> String {
        let _ = fs::remove_file(self.log());
        let root = format!("--root={}", self.root().display());
        let out = run(Command::new("dpkg")
            .args([
                root.as_str(),
                "--log=/dev/null",
                "--force-not-root",
                "--force-depends",
                "--force-script-chrootless",
            ])
            .args(args)
            .env("PATH", self.env_path())
            .env("STUB_LOG", self.log()));
        assert!(
            out.status.success(),
            "dpkg {args:?} failed ({}):\n{}{}",
            out.status,
            text(&out.stdout),
            text(&out.stderr)
        );
        fs::read_to_string(self.log()).unwrap_or_default()
    }

    fn query(&self, format: &str) -> String {
        let root = format!("--root={}", self.root().display());
        let out = run(Command::new("dpkg-query").args([root.as_str(), "-W", &format!("-f={format}"), "limiter"]));
        assert!(out.status.success(), "dpkg-query failed: {}", text(&out.stderr));
        text(&out.stdout)
    }
}

// ---------------------------------------------------------------------------------------------
// The systemd unit

/// `key -> values` of one section of a unit file (a key may repeat).
fn unit_section(unit: &str, section: &str) -> BTreeMap<String, Vec<String>> {
    let mut current = String::new();
    let mut keys: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in unit.lines().map(str::trim) {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if line.starts_with('[') {
            current = line.trim_matches(['[', ']']).to_string();
        } else if current == section
            && let Some((k, v)) = line.split_once('=')
        {
            keys.entry(k.trim().to_string()).or_default().push(v.trim().to_string());
        }
    }
    keys
}

fn one<'a>(keys: &'a BTreeMap<String, Vec<String>>, key: &str) -> &'a str {
    match keys.get(key).map(Vec::as_slice) {
        Some([value]) => value,
        other => panic!("{key}: expected exactly one value, found {other:?}"),
    }
}

/// A copy of `unit` whose ExecStart points at `binary` (verify checks the executable exists),
/// as `limiter.service` in a directory of its own.
fn verifiable_copy(unit: &str, binary: &Path) -> (tempfile::TempDir, PathBuf) {
    assert!(unit.contains("/usr/sbin/limiter-ctl "), "ExecStart must run /usr/sbin/limiter-ctl");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("limiter.service");
    fs::write(&path, unit.replace("/usr/sbin/limiter-ctl ", &format!("{} ", binary.display())))
        .expect("writing the unit copy");
    (dir, path)
}

/// `systemd-analyze verify`, treating any message as a failure: it exits 0 on unknown keys and
/// unparsable values, which it only warns about.
fn verify(unit: &Path, manpath: &Path) -> Result<(), String> {
    let out = run(Command::new("systemd-analyze")
        .arg("verify")
        .arg(unit)
        .env("MANPATH", manpath)
        .env("SYSTEMD_LOG_COLOR", "0"));
    let messages = format!("{}{}", text(&out.stdout), text(&out.stderr));
    if out.status.success() && messages.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("exit {}: {messages}", out.status))
    }
}

#[test]
fn unit_passes_systemd_analyze_verify() {
    let pkg = Installed::new();
    let installed = read(&pkg.path("usr/lib/systemd/system/limiter.service"));
    assert_eq!(installed, read(&packaging("limiter.service")), "the package must ship packaging/limiter.service as is");
    let (_dir, copy) = verifiable_copy(&installed, &pkg.path("usr/sbin/limiter-ctl"));
    // MANPATH: Documentation=man:limiter-ctl(1) must resolve to the page the package installs.
    let manpath = pkg.path("usr/share/man");
    verify(&copy, &manpath).unwrap_or_else(|e| panic!("systemd-analyze verify rejected the unit: {e}"));

    // The check itself catches what verify only warns about.
    let broken = read(&copy).replace("ProtectSystem=strict", "ProtectSystm=strict");
    fs::write(&copy, broken).expect("writing the broken copy");
    assert!(verify(&copy, &manpath).is_err(), "a misspelt key must fail the check");
}

#[test]
fn unit_is_hardened_with_the_measured_capabilities() {
    let unit = read(&packaging("limiter.service"));
    let service = unit_section(&unit, "Service");
    let caps = |key: &str| -> BTreeSet<String> { one(&service, key).split_whitespace().map(str::to_string).collect() };
    let expected: BTreeSet<String> = CAPABILITIES.iter().map(|c| format!("CAP_{c}")).collect();
    assert_eq!(caps("CapabilityBoundingSet"), expected);
    assert_eq!(caps("AmbientCapabilities"), expected);
    assert_eq!(one(&service, "Restart"), "on-failure", "the pinned program enforces while the daemon restarts");
    assert_eq!(one(&service, "RestartPreventExitStatus"), "2", "bad input is not retried");
    assert_eq!(one(&service, "ExecReload"), "/bin/kill -HUP $MAINPID");
    assert_eq!(one(&service, "EnvironmentFile"), "-/etc/default/limiter");
    assert!(one(&service, "ExecStart").starts_with("/usr/sbin/limiter-ctl daemon --iface=${IFACE}"));
    assert_eq!(one(&service, "NoNewPrivileges"), "yes");
    assert_eq!(one(&service, "ProtectSystem"), "strict");
    let writable: BTreeSet<&str> = one(&service, "ReadWritePaths").split_whitespace().collect();
    assert_eq!(
        writable,
        BTreeSet::from(["/etc/limiter", "/sys/fs/bpf"]),
        "the config the daemon rewrites, and the pins"
    );
    assert_eq!(one(&service, "RuntimeDirectory"), "limiter", "/run/limiter, for the control socket");
    assert!(unit_section(&unit, "Unit").get("RequiresMountsFor").is_some_and(|v| v.iter().any(|p| p == "/sys/fs/bpf")));

    let dir = tempfile::tempdir().expect("temp dir");
    let (_copy_dir, copy) = verifiable_copy(&unit, Path::new("/bin/true"));
    let out = run(Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&copy)
        .current_dir(dir.path()));
    let report = text(&out.stdout);
    let exposure = report
        .lines()
        .find_map(|l| l.split_once("Overall exposure level for limiter.service:").map(|(_, rest)| rest.to_string()))
        .and_then(|rest| rest.split_whitespace().next().and_then(|n| n.parse::<f64>().ok()))
        .unwrap_or_else(|| panic!("no exposure level in `systemd-analyze security`:\n{report}{}", text(&out.stderr)));
    assert!(exposure <= MAX_EXPOSURE, "exposure {exposure} > {MAX_EXPOSURE}:\n{report}");
}

// ---------------------------------------------------------------------------------------------
// Kubernetes

fn yaml_documents(path: &Path) -> Vec<Value> {
    let text = read(path);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            let value = serde_yaml_ng::Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            serde_json::to_value(value).unwrap_or_else(|e| panic!("{}: not JSON-like: {e}", path.display()))
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<_> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "expected one {kind}");
    found[0]
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer).and_then(Value::as_str).unwrap_or_else(|| panic!("{pointer}: missing or not a string"))
}

fn array_at<'a>(v: &'a Value, pointer: &str) -> &'a Vec<Value> {
    v.pointer(pointer).and_then(Value::as_array).unwrap_or_else(|| panic!("{pointer}: missing or not a list"))
}

/// The value of `--flag=VALUE` in a container's args.
fn flag<'a>(args: &'a [&str], name: &str) -> &'a str {
    let prefix = format!("--{name}=");
    args.iter().find_map(|a| a.strip_prefix(prefix.as_str())).unwrap_or_else(|| panic!("no --{name}= in {args:?}"))
}

#[test]
fn daemonset_has_what_a_kubelet_needs() {
    let docs = yaml_documents(&packaging("kubernetes/daemonset.yaml"));
    let ds = kind(&docs, "DaemonSet");
    assert_eq!(ds["apiVersion"], "apps/v1");
    let namespace = str_at(ds, "/metadata/namespace");
    assert_eq!(str_at(kind(&docs, "Namespace"), "/metadata/name"), namespace);

    // The selector must match the template's labels, or the API server refuses the DaemonSet.
    let selector =
        ds.pointer("/spec/selector/matchLabels").and_then(Value::as_object).expect("spec.selector.matchLabels");
    assert!(!selector.is_empty());
    for (k, v) in selector {
        assert_eq!(ds["spec"]["template"]["metadata"]["labels"].get(k), Some(v), "template label {k}");
    }
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true, "XDP attaches to the node's interface");

    let containers = array_at(pod, "/containers");
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    assert!(!str_at(c, "/image").is_empty());
    assert_eq!(array_at(c, "/command").first().and_then(Value::as_str), Some("/usr/sbin/limiter-ctl"));
    let args: Vec<&str> = array_at(c, "/args").iter().map(|a| a.as_str().expect("args are strings")).collect();
    assert_eq!(args.first(), Some(&"daemon"));

    // Capabilities: the same measured set as the systemd unit, nothing privileged.
    let sc = &c["securityContext"];
    assert_eq!(sc["privileged"], false);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    let add: BTreeSet<&str> = array_at(sc, "/capabilities/add").iter().filter_map(Value::as_str).collect();
    assert_eq!(add, BTreeSet::from(CAPABILITIES));
    assert_eq!(array_at(sc, "/capabilities/drop").iter().filter_map(Value::as_str).collect::<Vec<_>>(), ["ALL"]);

    // Every mount has its volume; the three the daemon needs are there, of the right kind.
    let volumes: BTreeMap<&str, &Value> = array_at(pod, "/volumes").iter().map(|v| (str_at(v, "/name"), v)).collect();
    let mounts: BTreeMap<&str, &Value> =
        array_at(c, "/volumeMounts").iter().map(|m| (str_at(m, "/mountPath"), m)).collect();
    for (path, m) in &mounts {
        let name = str_at(m, "/name");
        assert!(volumes.contains_key(name), "mount {path} names volume {name}, which does not exist");
    }
    let volume_of =
        |path: &str| volumes[str_at(mounts.get(path).unwrap_or_else(|| panic!("no mount at {path}")), "/name")];
    let bpf_mount = mounts
        .iter()
        .find(|(_, m)| {
            volumes[str_at(m, "/name")].pointer("/hostPath/path").and_then(Value::as_str) == Some("/sys/fs/bpf")
        })
        .map(|(path, m)| (*path, *m))
        .expect("a mount of the host's /sys/fs/bpf");
    assert!(
        matches!(bpf_mount.1["mountPropagation"].as_str(), Some("HostToContainer" | "Bidirectional")),
        "bpffs mounted after the pod starts must reach it"
    );
    assert!(flag(&args, "pin-dir").starts_with(&format!("{}/", bpf_mount.0)), "pins must land on the host's bpffs");
    assert_eq!(str_at(volume_of("/run/limiter"), "/hostPath/path"), "/run/limiter");

    // The config comes from the ConfigMap in this file, at the path the daemon reads.
    let config_path = flag(&args, "config");
    let (dir, file) = config_path.rsplit_once('/').expect("--config is a path");
    let config_volume = volume_of(dir);
    let cm = kind(&docs, "ConfigMap");
    assert_eq!(str_at(config_volume, "/configMap/name"), str_at(cm, "/metadata/name"));
    assert_eq!(str_at(cm, "/metadata/namespace"), namespace);
    assert!(cm.pointer(&format!("/data/{file}")).and_then(Value::as_str).is_some(), "the ConfigMap has no {file}");

    // Prometheus scrapes the pod (the node IP, with hostNetwork) on the annotated port, so the
    // daemon must listen there, and not on loopback.
    let annotations = &ds["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
    let port = str_at(annotations, "/prometheus.io~1port");
    let metrics = flag(&args, "metrics");
    assert!(metrics.ends_with(&format!(":{port}")), "--metrics={metrics} is not on port {port}");
    assert!(
        !metrics.starts_with("127.") && !metrics.starts_with("[::1]"),
        "--metrics={metrics} is unreachable from Prometheus"
    );
    assert!(
        array_at(c, "/ports")
            .iter()
            .any(|p| p["containerPort"].as_u64().map(|n| n.to_string()).as_deref() == Some(port))
    );
    // Every $(VAR) in the args is defined in env.
    let env: BTreeSet<&str> = array_at(c, "/env").iter().map(|e| str_at(e, "/name")).collect();
    for arg in &args {
        for var in arg.split("$(").skip(1).filter_map(|s| s.split_once(')').map(|(v, _)| v)) {
            assert!(env.contains(var), "{arg} uses $({var}), which env does not define");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The shipped configs

/// Parses and validates a config as the daemon does at start, and checks it is in the form the
/// daemon writes: otherwise the daemon rewrites it at start (dropping its comments), which a
/// read-only ConfigMap mount turns into a failed start.
fn check_config(name: &str, text: &str) -> config::ConfigFile {
    let file = config::parse(Path::new(name), text).unwrap_or_else(|e| panic!("{e}"));
    let state = State::build(&file, &BTreeMap::new()).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(state.to_config(), file, "{name} is not in canonical order (policies by name, lists sorted)");
    assert!(
        file.policies.iter().all(|p| p.mode == limiter_ctl::config::Mode::DryRun),
        "{name}: shipped policies are dry-run, so installing the package drops nothing"
    );
    file
}

#[test]
fn shipped_configs_parse_and_drop_nothing() {
    let default = check_config("packaging/limiter.toml", &read(&packaging("limiter.toml")));
    assert!(!default.policies.is_empty());
    let docs = yaml_documents(&packaging("kubernetes/daemonset.yaml"));
    let cm = kind(&docs, "ConfigMap");
    let k8s = check_config("ConfigMap limiter.toml", str_at(cm, "/data/limiter.toml"));
    assert!(!k8s.policies.is_empty());
    let env = read(&packaging("limiter.default"));
    assert!(env.lines().any(|l| l.starts_with("IFACE=")), "limiter.default must define IFACE for the unit");
}

// ---------------------------------------------------------------------------------------------
// The Debian package

#[test]
fn deb_installs_with_dpkg_and_runs() {
    let pkg = Installed::new();
    assert_eq!(pkg.query("${Status}"), "install ok installed");
    let conffiles = pkg.query("${Conffiles}");
    for conf in ["/etc/limiter/limiter.toml", "/etc/default/limiter"] {
        assert!(conffiles.contains(conf), "{conf} is not a conffile: {conffiles}");
    }
    assert_eq!(read(&pkg.path("etc/limiter/limiter.toml")), read(&packaging("limiter.toml")));
    assert_eq!(read(&pkg.path("etc/default/limiter")), read(&packaging("limiter.default")));

    let binary = pkg.path("usr/sbin/limiter-ctl");
    let mode = fs::metadata(&binary).expect("usr/sbin/limiter-ctl").permissions().mode();
    assert_eq!(mode & 0o777, 0o755);
    let out = run(Command::new(&binary).arg("--version"));
    assert!(out.status.success());
    assert_eq!(text(&out.stdout).trim(), format!("limiter-ctl {}", env!("CARGO_PKG_VERSION")));
    let out = run(Command::new(&binary).arg("--help"));
    assert!(out.status.success());
    let help = text(&out.stdout);
    for sub in ["daemon", "policy", "allow", "deny", "stats", "top", "salt", "detach", "completions"] {
        assert!(help.lines().any(|l| l.trim_start().starts_with(sub)), "--help lists no `{sub}`:\n{help}");
    }

    for (path, marker) in [
        ("usr/share/bash-completion/completions/limiter-ctl", "complete -F"),
        ("usr/share/zsh/vendor-completions/_limiter-ctl", "#compdef limiter-ctl"),
        ("usr/share/fish/vendor_completions.d/limiter-ctl.fish", "complete -c limiter-ctl"),
    ] {
        assert!(read(&pkg.path(path)).contains(marker), "{path} lacks {marker:?}");
    }
    for doc in ["README.md", "DESIGN.md", "OPERATIONS.md", "PAIRING.md", "examples/daemonset.yaml"] {
        assert!(pkg.path("usr/share/doc/limiter").join(doc).is_file(), "no /usr/share/doc/limiter/{doc}");
    }
}

#[test]
fn man_page_renders() {
    let pkg = Installed::new();
    let page = pkg.path("usr/share/man/man1/limiter-ctl.1.gz");
    let out =
        run(Command::new("man").arg("--warnings").arg("-l").arg(&page).env("MANPAGER", "cat").env("MANWIDTH", "100"));
    assert!(out.status.success(), "man -l failed: {}", text(&out.stderr));
    assert!(out.stderr.is_empty(), "groff warnings: {}", text(&out.stderr));
    let rendered = text(&out.stdout);
    for heading in ["NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "SUBCOMMANDS"] {
        assert!(rendered.lines().any(|l| l == heading), "no {heading} section:\n{rendered}");
    }
    for needle in ["limiter-ctl - ", "--socket", "/run/limiter/ctl.sock", "daemon", "policy", "detach"] {
        assert!(rendered.contains(needle), "no {needle:?} in:\n{rendered}");
    }
    // The SUBCOMMANDS section refers to limiter-ctl-daemon(1) and the like: they are there too.
    for (page, needle) in [("limiter-ctl-daemon", "--pin-dir"), ("limiter-ctl-policy-set", "--rate")] {
        let path = pkg.path(&format!("usr/share/man/man1/{page}.1.gz"));
        let out = run(Command::new("man").arg("--warnings").arg("-l").arg(&path).env("MANPAGER", "cat"));
        assert!(out.status.success() && out.stderr.is_empty(), "{page}: {}", text(&out.stderr));
        assert!(text(&out.stdout).contains(needle), "{page} does not mention {needle}");
    }
}

/// Upgrading must not restart the daemon (SIGTERM detaches: a gap, and all state lost);
/// removing the package must stop it (which detaches).
#[test]
fn upgrade_leaves_the_daemon_alone_and_removal_stops_it() {
    let pkg = Installed::new();
    // The real dpkg, upgrading in place. Its scripts call systemctl only where systemd runs
    // (/run/systemd/system), so on a host without it this is a guard; the scripts run below as if
    // systemd were running are the check that can fail here.
    let calls = pkg.dpkg(&["-i", &deb().to_string_lossy()]);
    for forbidden in ["stop", "restart", "kill", "start limiter"] {
        assert!(
            !calls.lines().any(|l| l.starts_with("deb-systemd-invoke") && l.contains(forbidden)),
            "upgrade ran {calls}"
        );
        assert!(!calls.lines().any(|l| l.starts_with("systemctl") && l.contains(forbidden)), "upgrade ran {calls}");
    }
    // The same scripts as if systemd were running (they test for /run/systemd/system).
    let control = tempfile::tempdir().expect("temp dir");
    let out = run(Command::new("dpkg-deb").arg("-e").arg(deb()).arg(control.path()));
    assert!(out.status.success(), "dpkg-deb -e: {}", text(&out.stderr));
    let systemd_dir = tempfile::tempdir().expect("temp dir");
    let script = |name: &str, args: &[&str]| -> String {
        let body =
            read(&control.path().join(name)).replace("/run/systemd/system", &systemd_dir.path().to_string_lossy());
        let _ = fs::remove_file(pkg.log());
        let out = run(Command::new("sh")
            .arg("-e")
            .arg("-c")
            .arg(&body)
            .arg(name)
            .args(args)
            .env("PATH", pkg.env_path())
            .env("STUB_LOG", pkg.log()));
        assert!(out.status.success(), "{name} {args:?}: {}", text(&out.stderr));
        fs::read_to_string(pkg.log()).unwrap_or_default()
    };
    let upgrade = script("prerm", &["upgrade", "0.1.0-1"]) + &script("postinst", &["configure", "0.1.0-1"]);
    assert!(
        !upgrade.contains("stop") && !upgrade.contains("restart") && !upgrade.contains("kill"),
        "upgrade: {upgrade}"
    );
    assert!(upgrade.contains("systemctl --system daemon-reload"), "the next start must use the new unit: {upgrade}");
    let install = script("postinst", &["configure", ""]);
    assert!(
        !install.contains(" start") && !install.contains("helper enable"),
        "a fresh install must not start or enable: {install}"
    );
    let remove = script("prerm", &["remove"]);
    assert_eq!(remove.trim(), "deb-systemd-invoke stop limiter.service");
    // And the package comes off cleanly, conffiles staying until purge.
    pkg.dpkg(&["--remove", "limiter"]);
    assert!(!pkg.path("usr/sbin/limiter-ctl").exists());
    assert!(pkg.path("etc/limiter/limiter.toml").exists());
}

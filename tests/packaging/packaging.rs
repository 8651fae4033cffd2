//! The packaging as an operator's tools see it: the systemd units (`systemd-analyze verify` and
//! `security`), the Kubernetes manifests (parsed as YAML, checked for what a kubelet needs), the
//! shipped configs (parsed by the daemon's own parser), and the Debian package (built by
//! `cargo xtask package`, installed with dpkg into a scratch root, its binary and man page run).
//! On the real kernel (as root): a flood through a package upgrade and a purge, run by the
//! package's own binary and maintainer scripts; through an upgrade from an older release's
//! package (built from a pinned commit by `cargo xtask package --from-commit`: needs the
//! repository's full history), whose maps the new daemon cannot adopt; and through a DaemonSet
//! pod replacement, replayed the way a kubelet does it (there is no cluster here).
//!
//! The unprivileged tests run as any user. Needs cargo-deb, systemd-analyze, man and dpkg, which
//! `cargo xtask setup` installs; none of these tests skips (the privileged ones need root).
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
    time::{Duration, Instant},
};

use limiter_common::maps::{Counters, LAYOUT_VERSION};
use limiter_ctl::config::{self, State};
use limiter_tests::{
    daemon::{
        Daemon, LEFT, Launch, SIGNAL_TIMEOUT, Scratch, hold_counters, net_command, pinned_layout, program_counters,
        xdp_program_id,
    },
    netns::{End, TestNet},
    policies::{gcra, src},
    require_root,
    rig::{Rig, check_hand_over, check_hand_over_with_fresh},
};
use nix::sys::signal::Signal;
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
    built(DEB.get_or_init(|| xtask_package(&[])))
}

/// The commit whose package [`a_flood_through_an_upgrade_from_an_older_release`] upgrades from:
/// the last before issue 22's changes. Its maps are layout version 4 ([`OLDER_LAYOUT`]), this
/// tree's are 5, so the new daemon cannot adopt them.
const OLDER_RELEASE: &str = "e77ebe6a2a474a25be2431ae0e8461591cda4f81";
const OLDER_LAYOUT: u64 = 4;

/// The package of [`OLDER_RELEASE`], from `cargo xtask package --from-commit`, once (it builds it
/// with that commit's own xtask the first time, then reuses it): the path of the .deb.
fn older_deb() -> &'static Path {
    static DEB: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    built(DEB.get_or_init(|| xtask_package(&["--from-commit", OLDER_RELEASE])))
}

fn built(result: &Result<PathBuf, String>) -> &Path {
    match result {
        Ok(path) => path,
        Err(e) => panic!("{e}"),
    }
}

/// `cargo xtask package ARGS...`: the path of the .deb it printed (its last line).
fn xtask_package(args: &[&str]) -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let what = format!("`cargo xtask package {}`", args.join(" "));
    let out = Command::new(cargo)
        .args(["run", "--quiet", "--package", "xtask", "--", "package"])
        .args(args)
        .current_dir(root())
        .output()
        .map_err(|e| format!("could not start {what}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{what} failed ({}):\n{}", out.status, text(&out.stderr)));
    }
    let stdout = text(&out.stdout);
    let path = stdout.lines().last().map(|l| PathBuf::from(l.trim())).filter(|p| p.is_file());
    path.ok_or_else(|| format!("{what} printed no .deb path: {stdout:?}"))
}

/// Stand-ins for the systemd tools the maintainer scripts call (and for limiter-ctl, where a test
/// points the prerm's detach at it): each logs its arguments and succeeds, except that no unit
/// counts as having been enabled (as on a fresh machine).
const STUBBED: [&str; 5] = ["systemctl", "deb-systemd-helper", "deb-systemd-invoke", "limiter-ctl", "systemd-sysusers"];
const STUB: &str =
    "#!/bin/sh\necho \"$(basename \"$0\") $*\" >> \"$STUB_LOG\"\ncase \"$*\" in *was-enabled*) exit 1;; esac\nexit 0\n";

/// The package installed into a scratch root with the real dpkg.
struct Installed {
    dir: tempfile::TempDir,
}

impl Installed {
    fn new() -> Self {
        Self::with(deb())
    }

    /// Package `deb` installed.
    fn with(deb: &Path) -> Self {
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
        me.dpkg(&["-i", &deb.to_string_lossy()]);
        me
    }

    fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root().join(rel)
    }

    /// The installed unit `name`, which must be packaging/`name` as is.
    fn unit(&self, name: &str) -> String {
        let installed = read(&self.path(&format!("usr/lib/systemd/system/{name}")));
        assert_eq!(installed, read(&packaging(name)), "the package must ship packaging/{name} as is");
        installed
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
/// as `name` in a directory of its own.
fn verifiable_copy(name: &str, unit: &str, binary: &Path) -> (tempfile::TempDir, PathBuf) {
    assert!(unit.contains("/usr/sbin/limiter-ctl "), "ExecStart must run /usr/sbin/limiter-ctl");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(name);
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
    let installed = pkg.unit("limiter.service");
    let (_dir, copy) = verifiable_copy("limiter.service", &installed, &pkg.path("usr/sbin/limiter-ctl"));
    // MANPATH: Documentation=man:limiter-ctl(1) must resolve to the page the package installs.
    let manpath = pkg.path("usr/share/man");
    verify(&copy, &manpath).unwrap_or_else(|e| panic!("systemd-analyze verify rejected the unit: {e}"));

    // The check itself catches what verify only warns about.
    let broken = read(&copy).replace("ProtectSystem=strict", "ProtectSystm=strict");
    fs::write(&copy, broken).expect("writing the broken copy");
    assert!(verify(&copy, &manpath).is_err(), "a misspelt key must fail the check");
}

/// The template: everything per instance comes from its name, it has the same hardening and
/// lifecycle as limiter.service, and an instance of it passes `systemd-analyze verify`.
#[test]
fn template_unit_derives_everything_from_the_instance() {
    let pkg = Installed::new();
    let installed = pkg.unit("limiter@.service");
    let single = read(&packaging("limiter.service"));
    let (t, s) = (unit_section(&installed, "Service"), unit_section(&single, "Service"));
    for (key, values) in &s {
        if !["ExecStart", "ExecReload", "EnvironmentFile"].contains(&key.as_str()) {
            assert_eq!(t.get(key), Some(values), "{key} differs between limiter@.service and limiter.service");
        }
    }
    assert_eq!(one(&t, "ExecReload"), "/usr/sbin/limiter-ctl --socket=/run/limiter/%i.sock reload");
    let exec = one(&t, "ExecStart");
    for part in [
        "--socket=/run/limiter/%i.sock",
        "--iface=%i",
        "--config=/etc/limiter/%i.toml",
        "--wait-iface=",
        "--metrics=auto",
    ] {
        assert!(exec.contains(part), "ExecStart lacks {part}: {exec}");
    }
    assert!(!exec.contains("--pin-dir"), "pins go to <default pin dir>/%i: {exec}");
    assert!(exec.contains(" --socket-group=limiter-bans "), "the bouncer's group feeds bans: {exec}");
    assert_eq!(one(&t, "EnvironmentFile"), "-/etc/default/limiter@%i");
    let (_dir, copy) = verifiable_copy("limiter.service", &installed, &pkg.path("usr/sbin/limiter-ctl"));
    let instance = copy.with_file_name("limiter@eth1.service");
    fs::rename(&copy, &instance).expect("naming the instance");
    verify(&instance, &pkg.path("usr/share/man")).unwrap_or_else(|e| panic!("systemd-analyze verify: {e}"));
}

#[test]
fn unit_is_hardened_with_the_measured_capabilities() {
    let unit = read(&packaging("limiter.service"));
    let service = unit_section(&unit, "Service");
    let caps = |key: &str| -> BTreeSet<String> { one(&service, key).split_whitespace().map(str::to_string).collect() };
    let expected: BTreeSet<String> = CAPABILITIES.iter().map(|c| format!("CAP_{c}")).collect();
    assert_eq!(caps("CapabilityBoundingSet"), expected);
    assert_eq!(caps("AmbientCapabilities"), expected);
    assert_eq!(one(&service, "Type"), "notify", "`systemctl start` returns once the program is attached");
    assert_eq!(one(&service, "NotifyAccess"), "main");
    assert!(one(&service, "ExecStart").contains(" --wait-iface="), "a late interface must be waited for");
    assert_eq!(one(&service, "RuntimeDirectoryPreserve"), "yes", "stopping one unit keeps the others' sockets");
    assert_eq!(one(&service, "Restart"), "on-failure", "the pinned program enforces while the daemon restarts");
    assert_eq!(one(&service, "RestartPreventExitStatus"), "2", "bad input is not retried");
    assert_eq!(one(&service, "ExecReload"), "/usr/sbin/limiter-ctl reload", "a refused file fails the reload");
    assert_eq!(one(&service, "EnvironmentFile"), "-/etc/default/limiter");
    assert!(one(&service, "ExecStart").starts_with("/usr/sbin/limiter-ctl daemon --iface=${IFACE}"));
    assert!(
        one(&service, "ExecStart").contains(" --socket-group=limiter-bans "),
        "the CrowdSec bouncer's unit runs in limiter-bans, which the socket must serve"
    );
    assert_eq!(one(&service, "NoNewPrivileges"), "yes");
    // The metrics listener and the control socket cap their connections far below it.
    assert_eq!(one(&service, "LimitNOFILE"), "65536", "descriptors to spare beyond the connection caps");
    assert_eq!(one(&service, "ProtectSystem"), "strict");
    let writable: BTreeSet<&str> = one(&service, "ReadWritePaths").split_whitespace().collect();
    assert_eq!(
        writable,
        BTreeSet::from(["/etc/limiter", "/sys/fs/bpf"]),
        "the config the daemon rewrites, and the pins"
    );
    assert_eq!(one(&service, "RuntimeDirectory"), "limiter", "/run/limiter, for the control socket");
    assert_eq!(one(&service, "StateDirectory"), "limiter", "/var/lib/limiter, for the bans (--state-dir)");
    assert!(unit_section(&unit, "Unit").get("RequiresMountsFor").is_some_and(|v| v.iter().any(|p| p == "/sys/fs/bpf")));

    let (exposure, report) = exposure("limiter.service", &unit);
    assert!(exposure <= MAX_EXPOSURE, "exposure {exposure} > {MAX_EXPOSURE}:\n{report}");
}

/// `systemd-analyze security --offline`'s overall exposure of `unit` (0 best, 10 worst), named
/// `name`, and its report.
fn exposure(name: &str, unit: &str) -> (f64, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_copy_dir, copy) = verifiable_copy(name, unit, Path::new("/bin/true"));
    let out = run(Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&copy)
        .current_dir(dir.path()));
    let report = text(&out.stdout);
    let exposure = report
        .lines()
        .find_map(|l| l.split_once(&format!("Overall exposure level for {name}:")).map(|(_, rest)| rest.to_string()))
        .and_then(|rest| rest.split_whitespace().next().and_then(|n| n.parse::<f64>().ok()))
        .unwrap_or_else(|| panic!("no exposure level in `systemd-analyze security`:\n{report}{}", text(&out.stderr)));
    (exposure, report)
}

/// `systemd-analyze security --offline` scores the bouncer's unit 0.9: a service with no
/// privilege at all; this catches a hardening line lost in an edit.
const MAX_BOUNCER_EXPOSURE: f64 = 1.2;

/// The CrowdSec bouncer's unit: shipped as packaging/limiter-crowdsec.service, it passes
/// `systemd-analyze verify`, and runs with no privilege: a dynamic user in the group the
/// daemons' sockets serve ban feeders in, no capability, its key as a credential, sockets to
/// the LAPI and the daemon only, a system call filter; `systemd-analyze security` rates it at
/// most [`MAX_BOUNCER_EXPOSURE`]. tests/packaging/unit_sandbox.rs runs the bouncer under it.
#[test]
fn the_bouncers_unit_is_shipped_with_no_privilege() {
    let pkg = Installed::new();
    let installed = pkg.unit("limiter-crowdsec.service");
    let (_dir, copy) = verifiable_copy("limiter-crowdsec.service", &installed, &pkg.path("usr/sbin/limiter-ctl"));
    verify(&copy, &pkg.path("usr/share/man")).unwrap_or_else(|e| panic!("systemd-analyze verify: {e}"));

    let service = unit_section(&installed, "Service");
    let set = |key: &str| -> BTreeSet<String> { one(&service, key).split_whitespace().map(str::to_string).collect() };
    assert_eq!(one(&service, "DynamicUser"), "yes");
    assert_eq!(one(&service, "Group"), "limiter-bans", "the group the daemons' --socket-group serves");
    assert_eq!(set("CapabilityBoundingSet"), BTreeSet::new(), "no capability");
    assert_eq!(set("AmbientCapabilities"), BTreeSet::new());
    assert_eq!(one(&service, "NoNewPrivileges"), "yes");
    assert_eq!(one(&service, "ProtectSystem"), "strict");
    assert_eq!(one(&service, "PrivateUsers"), "yes");
    assert!(!service.contains_key("ReadWritePaths"), "it writes nothing");
    assert_eq!(set("RestrictAddressFamilies"), BTreeSet::from(["AF_UNIX", "AF_INET", "AF_INET6"].map(String::from)));
    assert_eq!(
        service.get("SystemCallFilter").map(Vec::as_slice),
        Some(&["@system-service".to_string(), "~@privileged @resources".to_string()][..])
    );
    assert_eq!(one(&service, "LoadCredential"), "lapi-key:/etc/crowdsec/bouncers/limiter.key");
    let exec = one(&service, "ExecStart");
    assert!(exec.starts_with("/usr/sbin/limiter-ctl crowdsec --lapi=${LAPI_URL} --key-file=%d/lapi-key"), "{exec}");
    assert_eq!(one(&service, "EnvironmentFile"), "/etc/default/limiter-crowdsec");
    assert_eq!(one(&service, "Restart"), "always", "it waits for the LAPI and the daemon itself");
    assert_eq!(one(&service, "RestartPreventExitStatus"), "2", "bad input is not retried");
    let (exposure, report) = exposure("limiter-crowdsec.service", &installed);
    eprintln!("systemd-analyze security: limiter-crowdsec.service {exposure}");
    assert!(exposure <= MAX_BOUNCER_EXPOSURE, "exposure {exposure} > {MAX_BOUNCER_EXPOSURE}:\n{report}");
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

/// Parses and validates a config as the daemon does at start (any order will do: the daemon
/// never rewrites its file at start, tests/packaging/kubernetes.rs).
fn check_config(name: &str, text: &str) -> config::ConfigFile {
    let file = config::parse(Path::new(name), text).unwrap_or_else(|e| panic!("{e}"));
    State::build(&file, &BTreeMap::new()).unwrap_or_else(|e| panic!("{name}: {e}"));
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
    for conf in [
        "/etc/limiter/limiter.toml",
        "/etc/default/limiter",
        "/etc/default/limiter-crowdsec",
        "/etc/fail2ban/action.d/limiter.conf",
    ] {
        assert!(conffiles.contains(conf), "{conf} is not a conffile: {conffiles}");
    }
    assert_eq!(read(&pkg.path("etc/default/limiter-crowdsec")), read(&packaging("limiter-crowdsec.default")));
    // The feeders' group: the postinst asks systemd-sysusers (a stub here) for it, in the root
    // dpkg installs to; the real one makes it from the shipped file.
    assert!(
        fs::read_to_string(pkg.log())
            .unwrap_or_default()
            .contains(&format!("systemd-sysusers --root={} limiter.conf", pkg.root().display())),
        "the postinst made no group: {}",
        fs::read_to_string(pkg.log()).unwrap_or_default()
    );
    let out = run(Command::new("systemd-sysusers").arg(format!("--root={}", pkg.root().display())).arg("limiter.conf"));
    assert!(out.status.success(), "systemd-sysusers: {}", text(&out.stderr));
    let groups = read(&pkg.path("etc/group"));
    assert!(groups.lines().any(|l| l.starts_with("limiter-bans:x:")), "no group limiter-bans: {groups}");
    // fail2ban's action, where fail2ban looks for `action = limiter` (tests/daemon/fail2ban.rs runs it).
    assert_eq!(
        read(&pkg.path("etc/fail2ban/action.d/limiter.conf")),
        read(&packaging("fail2ban/action.d/limiter.conf"))
    );
    assert_eq!(read(&pkg.path("etc/limiter/limiter.toml")), read(&packaging("limiter.toml")));
    assert_eq!(read(&pkg.path("etc/default/limiter")), read(&packaging("limiter.default")));
    assert!(pkg.path("usr/lib/systemd/system/limiter@.service").is_file(), "no limiter@.service");

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
    for doc in [
        "README.md",
        "DESIGN.md",
        "OPERATIONS.md",
        "PAIRING.md",
        "examples/daemonset.yaml",
        "examples/limiter-rules.yml",
        "examples/limiter-dashboard.json",
    ] {
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
    for heading in ["EXIT STATUS", "ENVIRONMENT", "FILES", "SIGNALS"] {
        assert!(rendered.lines().any(|l| l == heading), "no {heading} section:\n{rendered}");
    }
    // The config file's page, where `man 5 limiter.toml` finds it.
    let path = pkg.path("usr/share/man/man5/limiter.toml.5.gz");
    let out = run(Command::new("man").arg("--warnings").arg("-l").arg(&path).env("MANPAGER", "cat"));
    assert!(out.status.success() && out.stderr.is_empty(), "limiter.toml.5: {}", text(&out.stderr));
    assert!(text(&out.stdout).contains("scope"), "limiter.toml(5) does not describe scope");
    // The SUBCOMMANDS section refers to limiter-ctl-daemon(1) and the like: they are there too.
    for (page, needle) in [("limiter-ctl-daemon", "--pin-dir"), ("limiter-ctl-policy-set", "--rate")] {
        let path = pkg.path(&format!("usr/share/man/man1/{page}.1.gz"));
        let out = run(Command::new("man").arg("--warnings").arg("-l").arg(&path).env("MANPAGER", "cat"));
        assert!(out.status.success() && out.stderr.is_empty(), "{page}: {}", text(&out.stderr));
        assert!(text(&out.stdout).contains(needle), "{page} does not mention {needle}");
    }
}

/// The package's maintainer scripts, extracted from the .deb, run as if systemd were running
/// (they test for /run/systemd/system, which this machine may not have).
struct Scripts {
    control: tempfile::TempDir,
    systemd_dir: tempfile::TempDir,
}

impl Scripts {
    fn new() -> Self {
        let control = tempfile::tempdir().expect("temp dir");
        let out = run(Command::new("dpkg-deb").arg("-e").arg(deb()).arg(control.path()));
        assert!(out.status.success(), "dpkg-deb -e: {}", text(&out.stderr));
        Self { control, systemd_dir: tempfile::tempdir().expect("temp dir") }
    }

    /// Runs script `name` with `args` (after replacing each `(from, to)` in its text) with the
    /// stubs first on PATH, optionally in a test network namespace; returns the stub calls.
    fn run(&self, pkg: &Installed, name: &str, args: &[&str], replace: &[(&str, String)], ns: Option<&End>) -> String {
        let mut body = read(&self.control.path().join(name))
            .replace("/run/systemd/system", &self.systemd_dir.path().to_string_lossy());
        for (from, to) in replace {
            assert!(body.contains(from), "{name} has no {from:?}");
            body = body.replace(from, to);
        }
        let _ = fs::remove_file(pkg.log());
        let mut cmd = match ns {
            Some(end) => net_command(end, "sh"),
            None => Command::new("sh"),
        };
        let out = run(cmd
            .arg("-e")
            .arg("-c")
            .arg(&body)
            .arg(name)
            .args(args)
            .env("PATH", pkg.env_path())
            .env("STUB_LOG", pkg.log()));
        assert!(out.status.success(), "{name} {args:?}: {}{}", text(&out.stdout), text(&out.stderr));
        eprintln!("{name} {args:?}: {}{}", text(&out.stdout), text(&out.stderr));
        fs::read_to_string(pkg.log()).unwrap_or_default()
    }
}

/// An upgrade restarts the running units (try-restart: each daemon leaves its program pinned
/// and the new binary adopts it) and nothing else; a fresh install starts and enables nothing;
/// removing the package stops the units and then detaches every interface (stopping alone
/// leaves the programs enforcing).
#[test]
fn upgrade_try_restarts_and_removal_detaches() {
    let pkg = Installed::new();
    // The real dpkg, upgrading in place. Its scripts call systemctl only where systemd runs
    // (/run/systemd/system), so on a host without it this is a guard; the scripts run below as if
    // systemd were running are the check that can fail here.
    let calls = pkg.dpkg(&["-i", &deb().to_string_lossy()]);
    for forbidden in ["stop", "kill", "start limiter"] {
        assert!(!calls.lines().any(|l| l.contains(forbidden)), "upgrade ran {calls}");
    }
    let scripts = Scripts::new();
    let stub_ctl = (LIMITER_CTL, pkg.dir.path().join("stubs/limiter-ctl").display().to_string());
    let upgrade = scripts.run(&pkg, "prerm", &["upgrade", "0.1.0-1"], &[], None)
        + &scripts.run(&pkg, "postinst", &["configure", "0.1.0-1"], &[], None);
    assert!(
        !upgrade.contains("stop") && !upgrade.contains("kill") && !upgrade.contains("detach"),
        "upgrade: {upgrade}"
    );
    assert!(upgrade.contains("systemctl --system daemon-reload"), "the next start must use the new unit: {upgrade}");
    assert!(
        upgrade
            .lines()
            .any(|l| l == "systemctl try-restart limiter.service limiter@*.service limiter-crowdsec.service"),
        "an upgrade must restart the running daemons and bouncer onto the new binary: {upgrade}"
    );
    let install = scripts.run(&pkg, "postinst", &["configure", ""], &[], None);
    assert!(
        !install.contains("start") && !install.contains("helper enable"),
        "a fresh install must not start or enable: {install}"
    );
    let remove = scripts.run(&pkg, "prerm", &["remove"], std::slice::from_ref(&stub_ctl), None);
    let lines: Vec<&str> = remove.lines().collect();
    assert_eq!(
        lines,
        [
            "deb-systemd-invoke stop limiter-crowdsec.service limiter.service",
            "systemctl stop limiter@*.service",
            "limiter-ctl detach --all --force"
        ],
        "removal: stop the units, then detach every interface"
    );
    // And the package comes off cleanly, conffiles staying until purge.
    pkg.dpkg(&["--remove", "limiter"]);
    assert!(!pkg.path("usr/sbin/limiter-ctl").exists());
    assert!(pkg.path("etc/limiter/limiter.toml").exists());
}

/// Where the maintainer scripts call the binary.
const LIMITER_CTL: &str = "/usr/sbin/limiter-ctl";

/// The daemon's flags in the flood tests below.
const FLOOD_ARGS: [&str; 8] = ["--rate", "1000/s", "--burst", "400", "--buckets", "1024", "--metrics", "off"];

/// What systemd's (try-)restart and a kubelet's pod replacement do to the daemon: SIGTERM, an
/// exit within `grace` that leaves the limiter pinned, then a new daemon (`launch`), which must
/// adopt it. The new daemon's adoption line.
fn replace_daemon(rig: &mut Rig, grace: Duration, launch: Launch) -> String {
    stop_and_launch(rig, grace, launch);
    rig.daemon.wait_adopted(&rig.net.receiver).unwrap_or_else(|e| panic!("{e:#}"))
}

/// [`replace_daemon`] up to the new daemon's start: it is not waited for.
fn stop_and_launch(rig: &mut Rig, grace: Duration, launch: Launch) {
    rig.daemon.signal(Signal::SIGTERM).expect("SIGTERM");
    let status = rig.daemon.wait_exit(grace).expect("the old daemon should exit within its grace period");
    assert!(status.success() && rig.daemon.output().contains(LEFT), "{status}\n{}", rig.daemon.output());
    rig.daemon = Daemon::launch(&rig.net.receiver, &rig.scratch, &FLOOD_ARGS, launch).expect("a new daemon");
}

/// A flood through a package upgrade, with the package's own binary and scripts: the installed
/// daemon runs; dpkg upgrades the package under it; the postinst asks for a try-restart, which
/// is replayed as systemd does it (SIGTERM, wait for the exit, start the unit's command again,
/// now the new binary). Every frame of the flood was judged by a limiter program, the counters
/// went on, what got through is within the GCRA bound over the whole run, a source keeping to
/// half the rate was never refused and the flood got its allowance ([`check_hand_over`]). Then removal (the
/// prerm, its detach pointed at this test's pin directory) stops the daemon and detaches, and a
/// purge leaves no program on the interface and no pins.
#[test]
fn a_flood_through_an_upgrade_and_a_purge() {
    require_root!();
    let pkg = Installed::new();
    let bin = pkg.path("usr/sbin/limiter-ctl");
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch");
    let launch = || Launch { bin: Some(bin.clone()), ..Launch::default() };
    let mut rig =
        Rig { daemon: Daemon::launch(&net.receiver, &scratch, &FLOOD_ARGS, launch()).expect("daemon"), scratch, net };
    rig.daemon.wait_attached(&rig.net.receiver).expect("attached");
    let iface = rig.net.receiver.iface.clone();
    let id = rig.policy_id("default");
    let p1 = rig.daemon.program().expect("program");
    let hand_over = start_hand_over(&rig);

    // The upgrade: files replaced under the running daemon, then the postinst.
    pkg.dpkg(&["-i", &deb().to_string_lossy()]);
    let scripts = Scripts::new();
    let calls = scripts.run(&pkg, "postinst", &["configure", "0.1.0-1"], &[], None);
    assert!(calls.contains("systemctl try-restart limiter.service"), "{calls}");
    // What systemd's try-restart does to a running unit: stop (SIGTERM, wait), then start.
    let line = replace_daemon(&mut rig, SIGNAL_TIMEOUT, launch());
    let adopted = Instant::now();
    eprintln!("after the upgrade: {line}");
    let p2 = rig.daemon.program().expect("program");
    assert_ne!(p1, p2);
    std::thread::sleep(Duration::from_millis(700));
    let done = hand_over.finish().expect("flood");
    let before = done.run.counted.as_ref().expect("baseline")[usize::from(id)].clone();
    let after = program_counters(p2, id).expect("counters");
    check_hand_over("through the upgrade", &done, adopted, &before, &after, &gcra(1000, 400));

    // Removal: the prerm's detach, on this test's pins, in this test's network namespace.
    let detach = (
        "/usr/sbin/limiter-ctl detach --all",
        format!("{} detach --pin-dir {} --all", bin.display(), rig.scratch.pins().display()),
    );
    scripts.run(&pkg, "prerm", &["remove"], &[detach], Some(&rig.net.receiver));
    let status = rig.daemon.wait_exit(SIGNAL_TIMEOUT).expect("the daemon should have been stopped");
    assert!(status.success(), "{status}: {}", rig.daemon.output());
    pkg.dpkg(&["--purge", "limiter"]);
    assert!(!bin.exists());
    assert_eq!(xdp_program_id(&rig.net.receiver).expect("ip link"), None, "a program is attached after the purge");
    assert!(!rig.scratch.pin_dir(&iface).exists(), "pins after the purge: {:?}", rig.scratch.pinned(&iface));
}

/// A flood through an upgrade from an older release whose pinned maps this one cannot adopt
/// ([`OLDER_RELEASE`]'s package, maps of layout version [`OLDER_LAYOUT`]), with the packages' own
/// binaries and scripts: the older package's daemon runs; dpkg upgrades to this tree's package
/// under it; the postinst's try-restart is replayed as systemd does it. The new daemon cannot
/// adopt, so it replaces the program in place with fresh maps (docs/OPERATIONS.md, "When it
/// cannot adopt"): no gap, but buckets and counters start afresh. Checked both ways
/// ([`check_hand_over_with_fresh`]): every frame was judged by one program or the other (the
/// older program's counters, its map held open across its unloading, plus the new program's,
/// from zero); a source keeping to half the rate was never refused; the flood got at least 90%
/// of what an exact bucket admits of it, and after the replacement at least 90% of the rate;
/// and no more than the GCRA bound over the whole run plus exactly one burst: the one the
/// replacement's fresh bucket gives.
#[test]
fn a_flood_through_an_upgrade_from_an_older_release() {
    require_root!();
    let pkg = Installed::with(older_deb());
    let bin = pkg.path("usr/sbin/limiter-ctl");
    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch");
    let launch = || Launch { bin: Some(bin.clone()), ..Launch::default() };
    let older = Daemon::launch(&net.receiver, &scratch, &FLOOD_ARGS, launch()).expect("the older daemon");
    let mut rig = Rig { daemon: older, scratch, net };
    rig.daemon.wait_attached(&rig.net.receiver).expect("attached");
    let pins = rig.scratch.pin_dir(&rig.net.receiver.iface);
    assert_eq!(pinned_layout(&pins).expect("the pinned layout"), OLDER_LAYOUT, "the older release's maps");
    assert_ne!(OLDER_LAYOUT, LAYOUT_VERSION, "this build could adopt the older release's maps");
    let older_id = rig.policy_id("default");
    let p1 = rig.daemon.program().expect("program");
    // Its maps go when the new daemon replaces it: held open, its counters stay readable.
    let older_counters = hold_counters(p1).expect("the older program's counters");
    let hand_over = start_hand_over(&rig);

    pkg.dpkg(&["-i", &deb().to_string_lossy()]);
    let calls = Scripts::new().run(&pkg, "postinst", &["configure", "0.1.0-1"], &[], None);
    assert!(calls.contains("systemctl try-restart limiter.service"), "{calls}");
    stop_and_launch(&mut rig, SIGNAL_TIMEOUT, launch());
    let line = rig.daemon.wait_replaced(&rig.net.receiver).unwrap_or_else(|e| panic!("{e:#}"));
    let replaced = Instant::now();
    eprintln!("after the upgrade: {line}");
    // It says why: the older release's maps (the first that differs is named, not the layout).
    let why = "pinned by another version of limiter";
    assert!(rig.daemon.output().contains(why), "no {why:?} in:\n{}", rig.daemon.output());
    assert_eq!(pinned_layout(&pins).expect("the pinned layout"), LAYOUT_VERSION, "the new maps are pinned");
    let p2 = rig.daemon.program().expect("program");
    assert_ne!(p1, p2);
    let id = rig.policy_id("default");
    std::thread::sleep(Duration::from_millis(700));
    let done = hand_over.finish().expect("flood");
    let before = done.run.counted.as_ref().expect("baseline")[usize::from(older_id)].clone();
    let older_after = older_counters.read(older_id).expect("the older program's counters");
    let newer = program_counters(p2, id).expect("counters");
    assert_eq!(older_after.len(), newer.len(), "per-CPU counters of both programs");
    let after: Vec<Counters> = older_after
        .iter()
        .zip(&newer)
        .map(|(older, newer)| {
            let mut sum = *older;
            sum.add(newer);
            sum
        })
        .collect();
    // One fresh burst: the replacement's fresh bucket for the flood's source.
    let what = "through the upgrade from the older release";
    check_hand_over_with_fresh(what, &done, replaced, &before, &after, &gcra(1000, 400), 1);
}

/// A DaemonSet pod replacement, replayed as a kubelet does it (there is no cluster here): the
/// old container gets SIGTERM and has terminationGracePeriodSeconds to exit; the new container
/// starts in a mount and pid namespace of its own (`unshare --mount --pid --fork`) with the host's
/// bpffs bind-mounted at the container's mount path from the manifest's hostPath volume, and the
/// manifest's --pin-dir under it. Under a flood: every frame judged, counters and salt carried
/// over, within the GCRA bound over the whole run, and a source keeping to half the rate never
/// refused, the flood getting its allowance ([`check_hand_over`]).
#[test]
fn a_daemonset_pod_replacement_keeps_enforcing() {
    require_root!();
    let docs = yaml_documents(&packaging("kubernetes/daemonset.yaml"));
    let ds = kind(&docs, "DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    let grace =
        Duration::from_secs(pod["terminationGracePeriodSeconds"].as_u64().expect("terminationGracePeriodSeconds"));
    let c = &array_at(pod, "/containers")[0];
    let args: Vec<&str> = array_at(c, "/args").iter().filter_map(Value::as_str).collect();
    let volumes: BTreeMap<&str, &Value> = array_at(pod, "/volumes").iter().map(|v| (str_at(v, "/name"), v)).collect();
    let (mount_path, host_path) = array_at(c, "/volumeMounts")
        .iter()
        .find_map(|m| {
            let host = volumes[str_at(m, "/name")].pointer("/hostPath/path").and_then(Value::as_str)?;
            (host == "/sys/fs/bpf").then(|| (str_at(m, "/mountPath"), host))
        })
        .expect("a mount of the host's bpffs");
    let pin_dir = flag(&args, "pin-dir");
    assert!(pin_dir.starts_with(&format!("{mount_path}/")), "--pin-dir={pin_dir} is not under {mount_path}");
    assert!(args.contains(&"--wait-iface=5min"), "{args:?}");

    let net = TestNet::new().expect("test network");
    let scratch = Scratch::new().expect("scratch");
    // The container's mount path, inside the test's scratch directory (the container's root is
    // the host's here); the manifest's pin directory name is replaced by the scratch's own, so
    // the pins land where the harness cleans up.
    let container_mount = scratch.path().join(mount_path.trim_start_matches('/'));
    fs::create_dir_all(&container_mount).expect("mount point");
    let pins_in_container = container_mount.join(scratch.pins().file_name().expect("name"));
    let pod_launch = |host_path: String, at: PathBuf, pins: PathBuf| Launch {
        pin_dir: Some(pins),
        wrap: Some(Box::new(move |cmd: Command| {
            let mut pod = Command::new("unshare");
            pod.args(["--mount", "--pid", "--fork", "--propagation", "private", "sh", "-c"])
                .arg("mount --bind \"$0\" \"$1\" && shift && exec \"$@\"")
                .arg(&host_path)
                .arg(&at)
                .arg(cmd.get_program())
                .args(cmd.get_args());
            pod
        })),
        ..Launch::default()
    };
    let new_pod = || pod_launch(host_path.to_string(), container_mount.clone(), pins_in_container.clone());
    let mut rig =
        Rig { daemon: Daemon::launch(&net.receiver, &scratch, &FLOOD_ARGS, new_pod()).expect("pod"), scratch, net };
    rig.daemon.wait_attached(&rig.net.receiver).expect("attached");
    let iface = rig.net.receiver.iface.clone();
    assert!(rig.scratch.pin_dir(&iface).join("link").exists(), "the pod's pins are not on the host's bpffs");
    let id = rig.policy_id("default");
    let salts = rig.snapshot().rules.config.salts;
    let hand_over = start_hand_over(&rig);

    let line = replace_daemon(&mut rig, grace, new_pod());
    let adopted = Instant::now();
    eprintln!("the new pod: {line}");
    assert_eq!(rig.snapshot().rules.config.salts, salts, "the salt did not carry over");
    std::thread::sleep(Duration::from_millis(700));
    let done = hand_over.finish().expect("flood");
    let p2 = rig.daemon.program().expect("program");
    let before = done.run.counted.as_ref().expect("baseline")[usize::from(id)].clone();
    let after = program_counters(p2, id).expect("counters");
    check_hand_over("through the pod replacement", &done, adopted, &before, &after, &gcra(1000, 400));
}

/// A flood from 198.19.1.1 and a source keeping to half of [`FLOOD_ARGS`]'s rate from
/// 198.19.1.2, both under way for 300 ms ([`Rig::start_hand_over`]).
fn start_hand_over(rig: &Rig) -> limiter_tests::rig::HandOver {
    rig.start_hand_over(src("198.19.1.1"), src("198.19.1.2"), 7000, 1000.0, Duration::from_millis(300))
        .expect("starting the floods")
}

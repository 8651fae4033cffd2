//! Every manifest under packaging/kubernetes/ validates against the Kubernetes API schemas,
//! offline and strict (unknown fields are errors): `kubernetes-validate` from PyPI, with the
//! schemas it bundles (`cargo xtask setup` installs it). Run without a network (a network
//! namespace of its own, as root), so it cannot have fetched anything. And the check can fail:
//! broken copies of the DaemonSet (a wrong type, an unknown field) are refused.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

/// The Kubernetes releases whose schemas the manifests are held to: the oldest still common
/// in clusters, and the newest the tool bundles.
const KUBERNETES: [&str; 2] = ["1.29.0", "1.37.0"];

fn manifests() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/kubernetes");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    found.sort();
    found
}

/// `python3 -m kubernetes_validate --strict -k VERSION FILE`, without a network when root.
fn validate(file: &Path, version: &str) -> Output {
    let mut cmd = if nix::unistd::geteuid().is_root() {
        let mut c = Command::new("unshare");
        c.args(["--net", "python3"]);
        c
    } else {
        Command::new("python3")
    };
    cmd.args(["-m", "kubernetes_validate", "--strict", "--no-warn", "-k", version]).arg(file);
    cmd.output().unwrap_or_else(|e| panic!("running kubernetes-validate: {e} (`cargo xtask setup` installs it)"))
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn every_manifest_validates_offline_and_strict() {
    let files = manifests();
    assert!(!files.is_empty(), "no manifests under packaging/kubernetes/");
    for (file, version) in files.iter().flat_map(|f| KUBERNETES.map(|v| (f, v))) {
        let out = validate(file, version);
        let said = text(&out);
        eprintln!("{said}");
        assert!(
            out.status.success() && !said.contains("No module named"),
            "{} does not validate against Kubernetes {version}:\n{said}",
            file.display()
        );
        // One "passed" line per resource: nothing was skipped for want of a schema.
        let text = std::fs::read_to_string(file).expect("reading the manifest");
        let resources = text.lines().filter(|l| l.starts_with("kind:")).count();
        assert_eq!(said.matches(" passed for resource ").count(), resources, "{said}");
    }
}

#[test]
fn a_broken_manifest_is_refused() {
    let daemonset = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/kubernetes/daemonset.yaml");
    let good = std::fs::read_to_string(&daemonset).expect("reading the DaemonSet");
    let dir = tempfile::tempdir().expect("a temp dir");
    let breakages = [
        ("a port that is not a number", "containerPort: 9464", "containerPort: \"nine\""),
        ("an unknown field (strict)", "hostNetwork: true", "hostNetwork: true\n      hostNetwrk: true"),
        ("a probe without a handler's port", "port: metrics", "prt: metrics"),
    ];
    for (what, from, to) in breakages {
        assert!(good.contains(from), "{what}: the DaemonSet has no `{from}` to break");
        let broken = dir.path().join("broken.yaml");
        std::fs::write(&broken, good.replacen(from, to, 1)).expect("writing the broken copy");
        let out = validate(&broken, KUBERNETES[1]);
        assert!(!out.status.success(), "{what}: accepted:\n{}", text(&out));
        assert!(text(&out).contains("did not validate"), "{what}: {}", text(&out));
    }
}

/// The DaemonSet's documents as JSON values.
fn daemonset_documents() -> Vec<serde_json::Value> {
    use serde::Deserialize as _;
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/kubernetes/daemonset.yaml");
    let text = std::fs::read_to_string(&path).expect("reading the DaemonSet");
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| serde_json::to_value(serde_yaml_ng::Value::deserialize(doc).expect("YAML")).expect("JSON-like"))
        .filter(|v| !v.is_null())
        .collect()
}

/// What the schemas cannot say: the probes reach the daemon's /readyz and /livez on its
/// metrics port, requests and limits are both set, the namespace admits the pod under Pod
/// Security, and a rollout never runs two pods on a node.
#[test]
fn the_daemonset_probes_the_daemon_and_is_admitted() {
    let docs = daemonset_documents();
    let of = |kind: &str| docs.iter().find(|d| d["kind"] == kind).unwrap_or_else(|| panic!("no {kind}"));
    let ns = of("Namespace");
    assert_eq!(ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"], "privileged", "{ns}");
    let ds = of("DaemonSet");
    assert_eq!(ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"], 0, "two pods cannot share a node");
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    let port = c["ports"].as_array().and_then(|p| p.first()).expect("a container port");
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/livez")] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        assert!(get["port"] == port["name"] || get["port"] == port["containerPort"], "{probe} port: {get}");
    }
    let metrics = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str())
        .find_map(|a| a.strip_prefix("--metrics="));
    let metrics = metrics.expect("--metrics=");
    assert!(metrics.ends_with(&format!(":{}", port["containerPort"])), "--metrics={metrics} is not the probed port");
    for side in ["requests", "limits"] {
        for what in ["cpu", "memory"] {
            assert!(c["resources"][side][what].is_string(), "resources.{side}.{what} is not set");
        }
    }
}

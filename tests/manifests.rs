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

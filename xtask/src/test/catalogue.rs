//! What each integration test target needs, and which of its tests need neither root nor a
//! network namespace: the one table to extend when a test target is added (tests/README.md).
//! Its group is its folder under tests/ (tests/Cargo.toml's `path`), read from `cargo metadata`.

use std::collections::BTreeMap;

use anyhow::{Context as _, bail};

use crate::{
    setup::Need::{self, *},
    sh::{cargo, output},
};

/// A group of tests: a folder under tests/, or the crates' own tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum Group {
    /// The crates' own tests (limiter-common, limiter-ctl, limiter-ebpf's library, xtask).
    Unit,
    /// tests/datapath/: the XDP program on the kernel.
    Datapath,
    /// tests/daemon/: the daemon and the CLI.
    Daemon,
    /// tests/packaging/: the package, the systemd unit, Kubernetes, Prometheus.
    Packaging,
    /// tests/docs/: the documents and the man pages.
    Docs,
    /// tests/kernels/: the kernel matrix: the scenario on this kernel, and under QEMU on Debian's.
    Kernels,
}

impl Group {
    pub const ALL: [Group; 6] =
        [Group::Unit, Group::Datapath, Group::Daemon, Group::Packaging, Group::Docs, Group::Kernels];

    /// Its folder under tests/ (none for the crates' own tests).
    fn folder(self) -> Option<&'static str> {
        match self {
            Group::Unit => None,
            Group::Datapath => Some("datapath"),
            Group::Daemon => Some("daemon"),
            Group::Packaging => Some("packaging"),
            Group::Docs => Some("docs"),
            Group::Kernels => Some("kernels"),
        }
    }
}

/// The targets whose tests flood through the flood generator (`limiter_tests::generator`):
/// `cargo xtask test` runs them a second time with the packet ring forced, the sender of the
/// machines that refuse live frames, so both senders pass wherever the suite runs.
pub const FLOODS: [&str; 3] = ["generator", "flood_cost", "demo"];

/// An integration test target (a `[[test]]` of limiter-tests).
pub struct Target {
    pub name: &'static str,
    /// What its tests need besides the toolchain.
    pub needs: &'static [Need],
    /// Which of its tests `--offline-only` runs.
    pub offline: Offline,
}

/// The tests of a target that need no root and no network namespace.
pub enum Offline {
    None,
    All,
    /// These tests (exact names), which need only `needs`.
    Some {
        tests: &'static [&'static str],
        needs: &'static [Need],
    },
}

const fn root(name: &'static str, needs: &'static [Need]) -> Target {
    Target { name, needs, offline: Offline::None }
}

pub const TARGETS: &[Target] = &[
    // tests/datapath/
    root("fixtures", &[Kernel]),
    root("differential", &[Kernel]),
    root("veth", &[Kernel]),
    Target {
        name: "rows",
        needs: &[Kernel],
        offline: Offline::Some { tests: &["the_rows_table_agrees_with_theory"], needs: &[] },
    },
    root("scope", &[Kernel]),
    root("policy_fields", &[Kernel]),
    root("syn", &[Kernel]),
    Target {
        name: "layers",
        needs: &[Kernel],
        offline: Offline::Some {
            tests: &["config_check_warns_of_a_layer_that_can_never_use_its_allowance"],
            needs: &[],
        },
    },
    root("layer_memo", &[Kernel]),
    root("lists", &[Kernel]),
    root("traps", &[Kernel]),
    root("fragments", &[Kernel]),
    root("offload", &[Kernel, Ethtool]),
    root("generator", &[Kernel]),
    // tests/daemon/
    root("cli_refusals", &[Kernel]),
    root("policy_changes", &[Kernel]),
    root("config_file", &[Kernel]),
    root("config_edits", &[Kernel]),
    root("bans", &[Kernel]),
    root("ban_capacity", &[Kernel]),
    root("ban_rules", &[Kernel]),
    root("ban_crashes", &[Kernel]),
    root("ban_clock", &[Kernel, Faketime]),
    root("explain", &[Kernel]),
    Target {
        name: "control",
        needs: &[Kernel],
        offline: Offline::Some { tests: &["config_check_judges_a_file_offline"], needs: &[] },
    },
    root("lifecycle", &[Kernel]),
    root("sharing", &[Kernel, XdpTools]),
    root("rotation", &[Kernel]),
    root("metrics", &[Kernel]),
    root("flood_cost", &[Kernel]),
    root("demo", &[Kernel]),
    root("local_user", &[Kernel, Python]),
    root("fail2ban", &[Kernel, Fail2ban]),
    Target {
        name: "crowdsec",
        needs: &[Kernel, CrowdSec],
        offline: Offline::Some {
            tests: &["bad_arguments_exit_2_with_one_line", "a_failed_reconcile_is_said_and_tried_again"],
            needs: &[],
        },
    },
    Target { name: "logs", needs: &[], offline: Offline::All },
    Target {
        name: "completions",
        needs: &[Kernel, Shells],
        offline: Offline::Some {
            tests: &[
                "bash_completes_iface_with_interfaces",
                "fish_completes_iface_with_interfaces",
                "zsh_completes_iface_with_interfaces",
            ],
            needs: &[Shells],
        },
    },
    // tests/packaging/
    Target {
        name: "packaging",
        needs: &[Kernel, Package, Systemd, Man],
        offline: Offline::Some {
            tests: &[
                "unit_is_hardened_with_the_measured_capabilities",
                "daemonset_has_what_a_kubelet_needs",
                "shipped_configs_parse_and_drop_nothing",
            ],
            needs: &[Systemd],
        },
    },
    root("unit_sandbox", &[Kernel, Systemd, Bpftool, Python]),
    root("kubernetes", &[Kernel]),
    Target { name: "manifests", needs: &[KubernetesValidate], offline: Offline::All },
    Target {
        name: "prometheus",
        needs: &[Kernel, Prometheus],
        offline: Offline::Some {
            tests: &[
                "promtool_checks_the_rules",
                "promtool_unit_tests_cover_every_alert_and_catch_a_broken_one",
                "dashboard_has_instance_and_policy_variables_and_every_query_uses_them",
            ],
            needs: &[Prometheus],
        },
    },
    // tests/docs/
    Target { name: "docs", needs: &[], offline: Offline::All },
    Target { name: "man_pages", needs: &[Man], offline: Offline::All },
    // tests/kernels/
    root("guest", &[Kernel]),
    root("matrix", &[VmLab]),
];

impl Target {
    /// What the tests `--offline-only` runs need.
    pub fn offline_needs(&self) -> &'static [Need] {
        match self.offline {
            Offline::None => &[],
            Offline::All => self.needs,
            Offline::Some { needs, .. } => needs,
        }
    }
}

/// Each target of [`TARGETS`] with its group, from limiter-tests' `[[test]]` paths; fails when
/// the table and tests/Cargo.toml disagree, saying what to add where.
pub fn grouped() -> anyhow::Result<Vec<(Group, &'static Target)>> {
    let mut cmd = cargo();
    cmd.args(["metadata", "--no-deps", "--format-version", "1"]);
    let json = output(&mut cmd).context("`cargo metadata` failed")?;
    let meta: serde_json::Value = serde_json::from_str(&json).context("reading `cargo metadata`")?;
    let package = meta["packages"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "limiter-tests"))
        .context("`cargo metadata` lists no package limiter-tests")?;
    let dir = package["manifest_path"].as_str().and_then(|m| m.strip_suffix("Cargo.toml")).unwrap_or_default();
    let mut folders = BTreeMap::new();
    for target in package["targets"].as_array().into_iter().flatten() {
        if target["kind"].as_array().is_none_or(|k| !k.iter().any(|k| k == "test")) {
            continue;
        }
        let (Some(name), Some(path)) = (target["name"].as_str(), target["src_path"].as_str()) else { continue };
        let rel = path.strip_prefix(dir).unwrap_or(path);
        let folder = rel.split_once('/').map_or("", |(folder, _)| folder);
        let group = Group::ALL.into_iter().find(|g| g.folder() == Some(folder)).with_context(|| {
            let folders: Vec<&str> = Group::ALL.iter().filter_map(|g| g.folder()).collect();
            format!(
                "tests/{rel} (test target {name}) is in no group's folder: move it under tests/{{{}}}/",
                folders.join(",")
            )
        })?;
        folders.insert(name.to_owned(), group);
    }
    let mut out = Vec::new();
    for target in TARGETS {
        match folders.remove(target.name) {
            Some(group) => out.push((group, target)),
            None => {
                bail!("xtask/src/test/catalogue.rs names test target {}, which tests/Cargo.toml lacks", target.name)
            }
        }
    }
    if let Some(name) = folders.keys().next() {
        bail!("test target {name} (tests/Cargo.toml) is not in xtask/src/test/catalogue.rs: say there what it needs");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test `--offline-only` runs cannot need the kernel, and needs nothing its target does not.
    #[test]
    fn offline_tests_need_no_kernel_and_only_what_their_target_needs() {
        for t in TARGETS {
            let needs = t.offline_needs();
            assert!(!needs.contains(&Kernel), "{}: its offline tests need the kernel", t.name);
            assert!(needs.iter().all(|n| t.needs.contains(n)), "{}: offline needs beyond the target's", t.name);
            if let Offline::Some { tests, .. } = t.offline {
                assert!(!tests.is_empty(), "{}: an empty offline list is Offline::None", t.name);
            }
        }
    }

    /// So the full run installs all that `cargo xtask setup` does, as it did before the needs
    /// were split, and no need is left that no test has.
    #[test]
    fn every_need_but_the_toolchain_is_some_targets() {
        for need in Need::ALL.into_iter().filter(|n| *n != Toolchain) {
            assert!(TARGETS.iter().any(|t| t.needs.contains(&need)), "no test target needs {need:?}");
        }
    }

    #[test]
    fn every_target_is_named_once() {
        let mut names: Vec<&str> = TARGETS.iter().map(|t| t.name).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(names.len(), before);
    }
}

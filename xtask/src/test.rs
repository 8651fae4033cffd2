//! `cargo xtask test`: install what the selected tests need, then run them. Integration tests run
//! one at a time: they pin CPUs and flood veth pairs, and on a 2-core machine parallel floods
//! would measure each other.
//!
//! Tests come in groups (`--group`, [`Group`]): the crates' own tests, and the folders of tests/
//! (tests/README.md). `--offline-only` runs the tests that need no root and no network
//! namespace; [`catalogue`] says which those are and what every test target needs.

mod catalogue;
mod stress;

use std::{
    collections::{BTreeMap, BTreeSet},
    process::Command,
};

use anyhow::{Context as _, bail};
use catalogue::{Group, Offline, Target};

use crate::{
    setup::{self, Need},
    sh::{cargo, describe, exec},
};

#[derive(clap::Args)]
pub struct Args {
    /// Only run tests whose name contains this (passed to the test harness).
    filter: Option<String>,
    /// Only this group's tests (repeatable; tests/README.md says what each holds). Default: all.
    #[arg(long, value_enum)]
    group: Vec<Group>,
    /// Only the tests that need no root and no network namespace (unit tests, the documents,
    /// man pages, manifests, completions, rules...): a check that takes a minute, without sudo.
    #[arg(long, conflicts_with = "stress")]
    offline_only: bool,
    /// Run only the integration tests, under stress: the flood generator at half speed, a busy
    /// loop on every core, and three times in a row; all must pass. Prints a summary.
    #[arg(long)]
    stress: bool,
}

/// What the flood generator reads to pick its sender (`limiter_tests::generator::SENDER_ENV`).
const SENDER_ENV: &str = "LIMITER_FLOOD_SENDER";

/// Set for the integration tests `--offline-only` runs: a test that asks for root then fails
/// (`limiter_tests::privileged`), so none can be selected here and skip or run as root unseen.
const NO_ROOT_ENV: &str = "LIMITER_TESTS_NO_ROOT";

pub fn run(args: Args) -> anyhow::Result<()> {
    let groups: BTreeSet<Group> =
        if args.group.is_empty() { Group::ALL.into_iter().collect() } else { args.group.into_iter().collect() };
    let filter: Vec<String> = args.filter.into_iter().collect();
    // Every test builds limiter-ctl, whose build.rs compiles the XDP program.
    setup::provide(&BTreeSet::from([Need::Toolchain]))?;
    let targets: Vec<&Target> =
        catalogue::grouped()?.into_iter().filter(|(g, _)| groups.contains(g)).map(|(_, t)| t).collect();
    let plan = plan(&targets, filter.first().map(String::as_str), args.offline_only)?;
    let needs: BTreeSet<Need> = plan
        .iter()
        .flat_map(|(t, _)| if args.offline_only { t.offline_needs() } else { t.needs }.iter().copied())
        .collect();
    setup::provide(&needs)?;
    if needs.contains(&Need::Kernel) && !setup::is_root() {
        eprintln!(
            "test: not root: privileged tests will skip (under CI=true they fail). Use `sudo -E cargo xtask test`."
        );
    }
    if args.stress {
        let names: Vec<&str> = plan.iter().map(|(t, _)| t.name).collect();
        if names.is_empty() {
            bail!("--stress runs integration tests, and the groups and filter given select none");
        }
        return stress::run(&names, &filter);
    }
    if groups.contains(&Group::Unit) {
        unit(&filter)?;
    }
    if !plan.is_empty() {
        // The end-to-end tests run the real limiter-ctl binary, the release build the package
        // ships (`cargo test` builds only harnesses, and in the debug profile).
        exec(&mut release_binary())?;
        integration(&plan, &filter, args.offline_only)?;
    }
    if groups.len() == Group::ALL.len() && !args.offline_only {
        // The benchmark must at least build.
        exec(cargo().args(["bench", "--package", "limiter-tests", "--no-run"]))?;
    }
    Ok(())
}

/// The crates' own tests. limiter-common's in the `checked` profile (Cargo.toml: optimized,
/// assertions and overflow checks kept), where its property tests take seconds, not minutes.
/// limiter-ebpf's programs build only for the BPF target (limiter-ctl's build.rs does that);
/// its library's host tests (the host-scope retry loop under real threads) run here.
fn unit(filter: &[String]) -> anyhow::Result<()> {
    exec(cargo().args(["test", "--package", "limiter-common", "--profile", "checked", "--"]).args(filter))?;
    exec(
        cargo()
            .args(["test", "--workspace", "--exclude", "limiter-tests", "--exclude", "limiter-ebpf"])
            .args(["--exclude", "limiter-common", "--"])
            .args(filter),
    )?;
    exec(cargo().args(["test", "--package", "limiter-ebpf", "--lib", "--"]).args(filter))?;
    // The test harness's own unit tests (the reference GCRA, the bounds, frame building, the
    // flood generator's pacing): plain functions, no root; the integration targets run apart.
    exec(cargo().args(["test", "--package", "limiter-tests", "--lib", "--bins", "--"]).args(filter))
}

/// Which tests of a target run.
enum Selection {
    /// All of them (the filter, if any, passed to the harness).
    Whole,
    /// These, by exact name.
    Tests(Vec<String>),
}

/// The targets to run and which of their tests: with `--offline-only`, the tests the catalogue
/// names; with a filter, only the targets holding a test it matches (so nothing is installed for
/// the others). Either needs the tests' names, so the harnesses are built and asked first.
fn plan<'t>(
    targets: &[&'t Target],
    filter: Option<&str>,
    offline: bool,
) -> anyhow::Result<Vec<(&'t Target, Selection)>> {
    let targets: Vec<&Target> =
        targets.iter().copied().filter(|t| !offline || !matches!(t.offline, Offline::None)).collect();
    let whole = !offline || targets.iter().all(|t| matches!(t.offline, Offline::All));
    if targets.is_empty() || (filter.is_none() && whole) {
        return Ok(targets.into_iter().map(|t| (t, Selection::Whole)).collect());
    }
    let listed = list(&targets.iter().map(|t| t.name).collect::<Vec<_>>())?;
    let matches = |name: &String| filter.is_none_or(|f| name.contains(f));
    let mut plan = Vec::new();
    for t in targets {
        let tests = listed.get(t.name).map(Vec::as_slice).unwrap_or_default();
        let selection = match t.offline {
            Offline::Some { tests: named, .. } if offline => {
                if let Some(gone) = named.iter().find(|n| !tests.iter().any(|t| t == *n)) {
                    bail!("xtask/src/test/catalogue.rs names test {gone} of target {}, which has no such test", t.name);
                }
                let chosen: Vec<String> = named.iter().map(|n| n.to_string()).filter(matches).collect();
                if chosen.is_empty() {
                    continue;
                }
                Selection::Tests(chosen)
            }
            _ if tests.iter().any(matches) => Selection::Whole,
            _ => continue,
        };
        plan.push((t, selection));
    }
    Ok(plan)
}

/// Builds the harnesses of `targets` (limiter-tests' test targets) and lists each one's tests.
fn list(targets: &[&str]) -> anyhow::Result<BTreeMap<String, Vec<String>>> {
    let mut build = cargo();
    build.args(["test", "--package", "limiter-tests", "--no-run", "--message-format", "json-render-diagnostics"]);
    build.args(test_args(targets));
    eprintln!("+ {}", describe(&build));
    let out = build
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("could not start `{}`", describe(&build)))?;
    if !out.status.success() {
        bail!("`{}` failed ({})", describe(&build), out.status);
    }
    let mut listed = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        let (Some(name), Some(exe)) = (msg["target"]["name"].as_str(), msg["executable"].as_str()) else { continue };
        if msg["target"]["kind"].as_array().is_none_or(|k| !k.iter().any(|k| k == "test")) {
            continue;
        }
        let mut cmd = Command::new(exe);
        cmd.args(["--list", "--format", "terse"]);
        let out = cmd.output().with_context(|| format!("could not start `{}`", describe(&cmd)))?;
        if !out.status.success() {
            bail!("`{}` failed ({})", describe(&cmd), out.status);
        }
        let tests = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_suffix(": test"))
            .map(str::to_owned)
            .collect();
        listed.insert(name.to_owned(), tests);
    }
    Ok(listed)
}

/// `--test NAME` for each target.
fn test_args<'a>(targets: &'a [&str]) -> impl Iterator<Item = &'a str> {
    targets.iter().flat_map(|t| ["--test", t])
}

/// `cargo build --release -p limiter-ctl --bins`: the binary the package ships, which the
/// integration tests run (`limiter_tests::daemon::limiter_ctl_binary`).
fn release_binary() -> Command {
    let mut cmd = cargo();
    cmd.args(["build", "--release", "--package", "limiter-ctl", "--bins"]);
    cmd
}

/// The integration tests (package limiter-tests), one at a time: the whole targets in one run,
/// each target run for some of its tests in one of its own.
fn integration(plan: &[(&Target, Selection)], filter: &[String], offline: bool) -> anyhow::Result<()> {
    let command = || {
        let mut cmd = cargo();
        cmd.args(["test", "--package", "limiter-tests"]);
        if offline {
            cmd.env(NO_ROOT_ENV, "1");
        }
        cmd
    };
    let whole: Vec<&str> = plan.iter().filter(|(_, s)| matches!(s, Selection::Whole)).map(|(t, _)| t.name).collect();
    if !whole.is_empty() {
        exec(command().args(test_args(&whole)).args(["--", "--test-threads=1"]).args(filter))?;
    }
    for (t, selection) in plan {
        if let Selection::Tests(tests) = selection {
            exec(command().args(["--test", t.name, "--", "--test-threads=1", "--exact"]).args(tests))?;
        }
    }
    // The flood tests once more on the packet ring: the first run used live frames where this
    // machine allows them. Not when a sender was asked for: that one was tested.
    let floods: Vec<&str> = whole.iter().copied().filter(|t| catalogue::FLOODS.contains(t)).collect();
    let asked = std::env::var(SENDER_ENV).is_ok_and(|v| !matches!(v.trim(), "" | "auto"));
    if !floods.is_empty() && !asked {
        eprintln!(
            "test: the flood tests again, on the packet ring ({SENDER_ENV}=ring): the sender of machines that refuse live frames"
        );
        exec(command().env(SENDER_ENV, "ring").args(test_args(&floods)).args(["--", "--test-threads=1"]).args(filter))?;
    }
    Ok(())
}

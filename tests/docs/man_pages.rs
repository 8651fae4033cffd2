//! The man pages as `limiter-ctl man --dir` writes them (what `cargo xtask package` ships),
//! rendered by man(1): no groff warning, and each page has the sections that apply to it. The
//! package's asset list ships limiter.toml(5) where man looks for it. Unprivileged, no kernel.

use std::{collections::BTreeMap, path::Path, process::Command};

use limiter_tests::daemon::limiter_ctl_binary;

/// Every page, rendered: file name to text.
fn rendered(dir: &Path) -> BTreeMap<String, String> {
    let out = Command::new(limiter_ctl_binary().unwrap()).arg("man").arg("--dir").arg(dir).output().unwrap();
    assert!(out.status.success(), "limiter-ctl man --dir: {}", String::from_utf8_lossy(&out.stderr));
    let mut pages = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let out = Command::new("man")
            .arg("--warnings")
            .arg("-l")
            .arg(&path)
            .env("MANPAGER", "cat")
            .env("MANWIDTH", "100")
            .output()
            .expect("man (Debian package man-db)");
        assert!(out.status.success(), "man -l {name}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(out.stderr.is_empty(), "groff warnings in {name}: {}", String::from_utf8_lossy(&out.stderr));
        pages.insert(name, String::from_utf8(out.stdout).unwrap());
    }
    pages
}

fn sections(text: &str) -> Vec<&str> {
    text.lines().filter(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_uppercase() || c == ' ')).collect()
}

#[test]
fn every_page_has_the_sections_that_apply() {
    let dir = tempfile::tempdir().unwrap();
    let pages = rendered(dir.path());
    assert!(pages.len() >= 22, "only {} pages: {:?}", pages.len(), pages.keys());
    let client =
        ["policy-set", "policy-list", "allow-add", "deny-rm", "stats", "top", "salt-rotate", "reload", "explain"];
    for (name, text) in &pages {
        let has = sections(text);
        let want: &[&str] = match name.trim_start_matches("limiter-ctl-").trim_end_matches(".1") {
            "limiter-ctl" | "daemon" => &["EXIT STATUS", "ENVIRONMENT", "FILES", "SIGNALS", "SEE ALSO"],
            sub if client.contains(&sub) => &["EXIT STATUS", "ENVIRONMENT", "FILES", "SEE ALSO"],
            "limiter.toml.5" => &["NAME", "SYNOPSIS", "DESCRIPTION", "KEYS", "APPLYING CHANGES", "EXAMPLE", "FILES"],
            _ => &["EXIT STATUS", "SEE ALSO"],
        };
        for heading in want {
            assert!(has.contains(heading), "{name} has no {heading} section (has {has:?})");
        }
    }
    let daemon = &pages["limiter-ctl-daemon.1"];
    for needle in ["SIGHUP", "SIGUSR2", "RUST_LOG", "NOTIFY_SOCKET", "LIMITER_SOCKET", "/etc/limiter/limiter.toml"] {
        assert!(daemon.contains(needle), "limiter-ctl-daemon(1) does not mention {needle}");
    }
    // The exit codes the CLI uses, on the top page.
    let top = &pages["limiter-ctl.1"];
    let exit = &top[top.find("EXIT STATUS").unwrap()..];
    for code in ["0", "1", "2"] {
        assert!(exit.lines().any(|l| l.trim_start().starts_with(&format!("{code} "))), "no exit code {code}");
    }
}

#[test]
fn daemon_help_names_its_signals() {
    let out = Command::new(limiter_ctl_binary().unwrap()).args(["daemon", "--help"]).output().unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    for signal in ["SIGHUP", "SIGTERM", "SIGUSR2"] {
        assert!(help.contains(signal), "daemon --help does not name {signal}:\n{help}");
    }
    assert!(help.contains("--log-format"), "daemon --help has no --log-format");
}

/// The .deb's asset list (limiter-ctl/Cargo.toml) ships section 5 into man5: cheaper than
/// building the package, which tests/packaging/packaging.rs does.
#[test]
fn the_package_ships_limiter_toml_5() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../limiter-ctl/Cargo.toml")).unwrap();
    assert!(
        manifest.contains(r#"["target/release/dist/man/*.5.gz", "usr/share/man/man5/", "644"]"#),
        "limiter-ctl/Cargo.toml ships no section 5 page into usr/share/man/man5"
    );
    let dir = tempfile::tempdir().unwrap();
    assert!(rendered(dir.path()).contains_key("limiter.toml.5"), "limiter-ctl man --dir wrote no limiter.toml.5");
}

//! Running commands, loudly: every command is echoed before it runs.

use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, bail};

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().map(PathBuf::from).unwrap_or_default()
}

/// Where cargo puts build products: `CARGO_TARGET_DIR` when set (an absolute one replaces the
/// root in `join`), else `target/`.
pub fn target_dir() -> PathBuf {
    workspace_root().join(std::env::var_os("CARGO_TARGET_DIR").unwrap_or_else(|| "target".into()))
}

pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `cmd` with inherited stdio; fails with the command line when it fails.
pub fn exec(cmd: &mut Command) -> anyhow::Result<()> {
    eprintln!("+ {}", describe(cmd));
    let status = cmd.status().with_context(|| format!("could not start `{}`", describe(cmd)))?;
    if !status.success() {
        bail!("`{}` failed ({status})", describe(cmd));
    }
    Ok(())
}

/// Runs `cmd` quietly and returns whether it succeeded (for probes like `--version`).
pub fn probe(cmd: &mut Command) -> bool {
    cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Output of `cmd` when it succeeds.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.stderr(std::process::Stdio::null()).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

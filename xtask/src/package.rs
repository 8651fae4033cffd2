//! `cargo xtask package`: the Debian package. Builds the release binary, asks it for its man
//! page and shell completions (generated from the clap definitions, so they cannot drift from
//! the binary), then runs cargo-deb, whose asset list (limiter-ctl/Cargo.toml,
//! `[package.metadata.deb]`) picks them up from `target/release/dist/`.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use crate::sh::{cargo, describe, exec, target_dir};

#[derive(clap::Args)]
pub struct Args {
    /// Directory for the .deb [default: target/debian].
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::setup::cargo_deb()?;
    exec(cargo().args(["build", "--release", "--package", "limiter-ctl", "--bins"]))?;
    let release = target_dir().join("release");
    let binary = release.join("limiter-ctl");
    // cargo-deb maps `target/release/...` asset paths to this directory.
    let dist = release.join("dist");
    let completions = dist.join("completions");
    fs::create_dir_all(&completions).with_context(|| format!("creating {}", completions.display()))?;

    // One page per command, as the top page's SUBCOMMANDS section refers to them, and
    // limiter.toml.5; each gzipped beside itself (limiter-ctl.1.gz).
    let man = dist.join("man");
    let _ = fs::remove_dir_all(&man);
    exec(Command::new(&binary).arg("man").arg("--dir").arg(&man))?;
    for entry in fs::read_dir(&man).with_context(|| format!("reading {}", man.display()))? {
        let page = entry?.path();
        let roff = fs::read(&page).with_context(|| format!("reading {}", page.display()))?;
        let mut gz = page.clone().into_os_string();
        gz.push(".gz");
        write(Path::new(&gz), &gzip(&roff)?)?;
        fs::remove_file(&page).with_context(|| format!("removing {}", page.display()))?;
    }
    for (shell, file) in [("bash", "limiter-ctl.bash"), ("zsh", "_limiter-ctl"), ("fish", "limiter-ctl.fish")] {
        let script = capture(Command::new(&binary).args(["completions", shell]))?;
        write(&completions.join(file), &script)?;
    }

    let out_dir = args.out_dir.unwrap_or_else(|| target_dir().join("debian"));
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    // --no-build: the binary above is the one whose man page and completions were generated.
    let mut deb = cargo();
    deb.args(["deb", "--package", "limiter-ctl", "--no-build", "--output"]).arg(&out_dir);
    let printed = capture(&mut deb)?;
    let path = String::from_utf8_lossy(&printed)
        .lines()
        .rev()
        .find(|l| l.trim_end().ends_with(".deb"))
        .map(|l| l.trim().to_string());
    let Some(path) = path else {
        bail!("`{}` succeeded but printed no .deb path", describe(&deb));
    };
    eprintln!("package: built");
    // The path alone on stdout, for scripts (and tests/packaging.rs).
    println!("{path}");
    Ok(())
}

/// Stdout of `cmd`, which must succeed (its stderr goes to ours).
fn capture(cmd: &mut Command) -> anyhow::Result<Vec<u8>> {
    eprintln!("+ {}", describe(cmd));
    let out = cmd.stderr(Stdio::inherit()).output().with_context(|| format!("could not start `{}`", describe(cmd)))?;
    if !out.status.success() {
        bail!("`{}` failed ({})", describe(cmd), out.status);
    }
    if out.stdout.is_empty() {
        bail!("`{}` printed nothing", describe(cmd));
    }
    Ok(out.stdout)
}

/// gzip -9n: -n leaves the name and time out of the header, so the output is reproducible.
fn gzip(data: &[u8]) -> anyhow::Result<Vec<u8>> {
    use std::io::Write as _;
    let mut child = Command::new("gzip")
        .args(["-9n", "-c"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("could not start gzip (Debian package gzip)")?;
    let mut stdin = child.stdin.take().context("gzip's stdin")?;
    // Written from a thread: gzip may fill its stdout pipe before it has read all of stdin.
    let input = data.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().context("waiting for gzip")?;
    writer.join().map_err(|_| anyhow::anyhow!("writing to gzip panicked"))?.context("writing to gzip")?;
    if !out.status.success() {
        bail!("gzip failed ({})", out.status);
    }
    Ok(out.stdout)
}

fn write(path: &Path, data: &[u8]) -> anyhow::Result<()> {
    fs::write(path, data).with_context(|| format!("writing {}", path.display()))
}

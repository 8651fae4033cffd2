//! `cargo xtask package`: the Debian package. Builds the release binary, asks it for its man
//! page and shell completions (generated from the clap definitions, so they cannot drift from
//! the binary), then runs cargo-deb, whose asset list (limiter-ctl/Cargo.toml,
//! `[package.metadata.deb]`) picks them up from `target/release/dist/`.
//!
//! `cargo xtask package --from-commit REV`: the package of an earlier commit of this repository
//! (tests/packaging/packaging.rs upgrades from it), built by that commit's own `cargo xtask package` from a
//! `git archive` of it under `target/from-commit/COMMIT/`, with a target directory of its own there
//! (so it never touches `target/release/`), once: the .deb is kept and reused; the sources and
//! build products are removed once it is built.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use crate::sh::{cargo, describe, exec, output, target_dir, workspace_root};

#[derive(clap::Args)]
pub struct Args {
    /// Directory for the .deb [default: target/debian].
    #[arg(long, value_name = "DIR")]
    out_dir: Option<PathBuf>,
    /// Instead, the package of this earlier commit (it must be in the clone: full history), built
    /// once by its own `cargo xtask package` under target/from-commit/COMMIT/ and reused.
    #[arg(long, value_name = "COMMIT", conflicts_with = "out_dir")]
    from_commit: Option<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    crate::setup::cargo_deb()?;
    if let Some(rev) = &args.from_commit {
        return from_commit(rev);
    }
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
    // The path alone on stdout, for scripts (and tests/packaging/packaging.rs).
    println!("{path}");
    Ok(())
}

/// The package of commit `rev`, built if it is not already (see the module's comment); its path
/// alone on stdout.
fn from_commit(rev: &str) -> anyhow::Result<()> {
    let commit = resolve(rev)?;
    let base = target_dir().join("from-commit").join(&commit);
    let done = base.join("debian");
    if let Some(deb) = deb_in(&done)? {
        eprintln!("package: the package of {commit} is already built");
        println!("{}", deb.display());
        return Ok(());
    }
    let started = std::time::Instant::now();
    // Built into `partial` and renamed when complete: an interrupted build is never taken for a
    // package, and the next run starts it afresh.
    let (src, build, partial) = (base.join("src"), base.join("target"), base.join("debian.partial"));
    for dir in [&src, &partial, &done] {
        remove_dir(dir)?;
    }
    fs::create_dir_all(&src).with_context(|| format!("creating {}", src.display()))?;
    let tar = base.join("src.tar");
    exec(
        Command::new("git")
            .arg("-C")
            .arg(workspace_root())
            .args(["archive", "--format=tar", "--output"])
            .arg(&tar)
            .arg(&commit),
    )?;
    exec(Command::new("tar").arg("-xf").arg(&tar).arg("-C").arg(&src))?;
    fs::remove_file(&tar).with_context(|| format!("removing {}", tar.display()))?;
    // That commit's own xtask, in its own workspace, with its own target directory: its
    // `target_dir()` honours CARGO_TARGET_DIR, and absolute it is used as is.
    let mut old = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    old.current_dir(&src)
        .env("CARGO_TARGET_DIR", &build)
        .args(["run", "--quiet", "--package", "xtask", "--", "package", "--out-dir"])
        .arg(&partial);
    capture(&mut old).with_context(|| format!("building the package of commit {commit}"))?;
    let built =
        deb_in(&partial)?.with_context(|| format!("`{}` left no .deb in {}", describe(&old), partial.display()))?;
    fs::rename(&partial, &done).with_context(|| format!("renaming {} to {}", partial.display(), done.display()))?;
    // Its sources and build products take several hundred megabytes; only the .deb is reused.
    remove_dir(&src)?;
    remove_dir(&build)?;
    let name = built.file_name().context("a .deb path has a file name")?;
    eprintln!("package: built the package of {commit} in {:.0?}", started.elapsed());
    println!("{}", done.join(name).display());
    Ok(())
}

/// The full hash of commit `rev`; an error that says what to do if this clone does not have it.
fn resolve(rev: &str) -> anyhow::Result<String> {
    let root = workspace_root();
    let found = output(Command::new("git").arg("-C").arg(&root).args([
        "rev-parse",
        "--verify",
        "--quiet",
        &format!("{rev}^{{commit}}"),
    ]));
    match found.map(|s| s.trim().to_string()) {
        Some(commit) if !commit.is_empty() => Ok(commit),
        _ => bail!(
            "commit {rev} is not in {}: building its package needs git and the repository's full history (a \
             shallow clone lacks it: `git fetch --unshallow`; in CI, check out with full history)",
            root.display()
        ),
    }
}

/// The one .deb in `dir`, if `dir` exists.
fn deb_in(dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    if !dir.exists() {
        return Ok(None);
    }
    let mut debs = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry.with_context(|| format!("reading {}", dir.display()))?.path();
        if path.extension().is_some_and(|e| e == "deb") {
            debs.push(path);
        }
    }
    match debs.as_slice() {
        [] => Ok(None),
        [deb] => Ok(Some(deb.clone())),
        _ => bail!("{} holds several .deb files ({debs:?}): remove the directory and build again", dir.display()),
    }
}

fn remove_dir(dir: &Path) -> anyhow::Result<()> {
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", dir.display()))
        }
        _ => Ok(()),
    }
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

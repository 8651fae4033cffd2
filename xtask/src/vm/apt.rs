//! The lab's own apt configuration (under `apt/` of the cache): the suites of [`SUITES`] only, and
//! of each only its package lists, so `apt-get update` fetches a few MB; the host's sources and
//! state are not used. Through it, each suite's current kernel is found and downloaded.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use super::{Deb, Lab, MIRROR, Pick, SUITES};
use crate::sh::{describe, exec};

/// Debian's archive keys, from the host's debian-archive-keyring (which signs every suite here).
const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

pub struct Apt {
    dir: PathBuf,
}

impl Apt {
    /// The configuration in `apt/` of `lab`, written (or rewritten, when [`SUITES`] changed).
    pub fn new(lab: &Lab) -> anyhow::Result<Self> {
        let dir = lab.dir.join("apt");
        for sub in ["etc/sources.list.d", "etc/preferences.d", "lists/partial", "archives/partial"] {
            let path = dir.join(sub);
            fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        }
        // Only the package lists: no translations, no AppStream data the host's config may ask for.
        let sources: String = SUITES
            .iter()
            .map(|s| format!("deb [arch=amd64 signed-by={KEYRING} target=Packages] {MIRROR} {s} main\n"))
            .collect();
        let list = dir.join("etc/sources.list");
        if fs::read_to_string(&list).ok().as_deref() != Some(sources.as_str()) {
            super::write_atomic(&list, sources.as_bytes())?;
        }
        Ok(Self { dir })
    }

    /// `program` (apt-get, apt-cache) on this configuration.
    fn command(&self, program: &str) -> Command {
        let d = self.dir.display();
        let mut cmd = Command::new(program);
        for (key, value) in [
            ("Dir::Etc", format!("{d}/etc")),
            ("Dir::Etc::SourceParts", format!("{d}/etc/sources.list.d")),
            ("Dir::Etc::Preferences", format!("{d}/etc/preferences")),
            ("Dir::Etc::PreferencesParts", format!("{d}/etc/preferences.d")),
            ("Dir::State", d.to_string()),
            ("Dir::Cache", d.to_string()),
            // As root into root's directories: apt's _apt sandbox could not write there.
            ("APT::Sandbox::User", "root".to_string()),
        ] {
            cmd.arg("-o").arg(format!("{key}={value}"));
        }
        cmd.env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    }

    pub fn update(&self) -> anyhow::Result<()> {
        exec(self.command("apt-get").args(["update", "-q"]))
    }

    /// The fields of `package` as `suite` has it (`apt-cache show PACKAGE/SUITE`).
    fn show(&self, package: &str, suite: &str) -> anyhow::Result<BTreeMap<String, String>> {
        let mut cmd = self.command("apt-cache");
        cmd.args(["show", &format!("{package}/{suite}")]);
        let out = cmd.output().with_context(|| format!("could not start `{}`", describe(&cmd)))?;
        if !out.status.success() {
            bail!("`{}` failed: {}", describe(&cmd), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(first_stanza(&String::from_utf8_lossy(&out.stdout)))
    }

    /// `suite`'s current kernel: what its `linux-image-amd64` depends on, with the packages of
    /// the same release that one depends on in turn (7.x splits the image into binary, modules
    /// and base packages).
    pub fn resolve(&self, suite: &str) -> anyhow::Result<Pick> {
        let meta = self.show("linux-image-amd64", suite)?;
        let depends = meta.get("Depends").map(String::as_str).unwrap_or_default();
        let image = names(depends)
            .find(|n| n.starts_with("linux-image-"))
            .with_context(|| format!("{suite}: linux-image-amd64 depends on no linux-image-*: {depends}"))?;
        let release = image.trim_start_matches("linux-image-").to_string();
        let mut debs: Vec<Deb> = Vec::new();
        let mut todo = vec![image.to_string()];
        while let Some(package) = todo.pop() {
            if debs.iter().any(|d| d.package == package) {
                continue;
            }
            let fields = self.show(&package, suite)?;
            let field =
                |k: &str| fields.get(k).cloned().with_context(|| format!("{suite}: {package} has no {k} field"));
            let file = field("Filename")?;
            let file = file.rsplit('/').next().unwrap_or(&file).to_string();
            let size = field("Size")?.parse().with_context(|| format!("{suite}: {package}'s Size"))?;
            let deps = fields.get("Depends").map(String::as_str).unwrap_or_default();
            todo.extend(names(deps).filter(|n| n.contains(&release)).map(str::to_owned));
            let version = field("Version")?;
            debs.push(Deb { package, version, file, size });
        }
        let version = debs[0].version.clone();
        Ok(Pick { suite: suite.to_string(), release, version, debs })
    }

    /// Downloads into `dir` the packages of `pick` that are not there yet (a file of the
    /// archive's size counts as there).
    pub fn download(&self, pick: &Pick, dir: &Path) -> anyhow::Result<()> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let missing: Vec<&Deb> = pick.debs.iter().filter(|d| !present(dir, d)).collect();
        if missing.is_empty() {
            eprintln!("setup: {} ({}): packages present", pick.release, pick.suite);
            return Ok(());
        }
        let specs: Vec<String> = missing.iter().map(|d| format!("{}={}", d.package, d.version)).collect();
        let download = || exec(self.command("apt-get").args(["download", "-q"]).args(&specs).current_dir(dir));
        if download().is_err() {
            // Lists older than the pick (a cache made elsewhere), or none yet.
            self.update()?;
            download()?;
        }
        if let Some(d) = missing.iter().find(|d| !present(dir, d)) {
            bail!("`apt-get download` left no {} of {} bytes in {}", d.file, d.size, dir.display());
        }
        Ok(())
    }
}

fn present(dir: &Path, deb: &Deb) -> bool {
    fs::metadata(dir.join(&deb.file)).is_ok_and(|m| m.len() == deb.size)
}

/// The package names of a Depends field (alternatives included; versions dropped).
fn names(depends: &str) -> impl Iterator<Item = &str> {
    depends.split([',', '|']).filter_map(|d| d.split_whitespace().next())
}

/// The fields of the first stanza of `apt-cache show` (continuation lines dropped).
fn first_stanza(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| !l.starts_with(' '))
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_and_stanzas_are_read() {
        let deps = "dracut | initramfs-tools (>= 0.120+deb8u2) | linux-initramfs-tool, linux-base-7.3.4+deb13-amd64 \
                    (= 7.3.4-1~bpo13+1), kmod";
        let got: Vec<&str> = names(deps).collect();
        assert_eq!(got, ["dracut", "initramfs-tools", "linux-initramfs-tool", "linux-base-7.3.4+deb13-amd64", "kmod"]);
        let text = "Package: linux-image-amd64\nVersion: 6.1.176-1\nDescription: Linux\n more text: here\n\
                    Depends: linux-image-6.1.0-50-amd64 (= 6.1.176-1)\n\nPackage: other\nVersion: 1\n";
        let fields = first_stanza(text);
        assert_eq!(fields["Version"], "6.1.176-1");
        assert_eq!(fields["Depends"], "linux-image-6.1.0-50-amd64 (= 6.1.176-1)");
        assert!(!fields.contains_key(" more text"));
        assert_eq!(fields.len(), 4);
    }
}

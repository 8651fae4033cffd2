//! The shell completion scripts `limiter-ctl completions SHELL` prints (what the package ships),
//! run by the real shells: `--iface` offers the interfaces of the network namespace (`lo` is in
//! every one) and no file names; other arguments still complete. Needs bash,
//! fish and zsh (`cargo xtask setup` installs them); one test, as root, makes a namespace.

use std::{
    path::Path,
    process::{Command, Output},
};

use limiter_tests::daemon::limiter_ctl_binary;

/// A scratch directory holding the script for `shell` and, as bait, files whose names an
/// interface completion must not offer (one starting with `l`, as `lo` does).
fn scratch(shell: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    for bait in ["lmt-bait-file", "eth-bait-file"] {
        std::fs::write(dir.path().join(bait), "").unwrap();
    }
    let out = Command::new(limiter_ctl_binary().unwrap()).args(["completions", shell]).output().unwrap();
    assert!(out.status.success(), "completions {shell}: {}", String::from_utf8_lossy(&out.stderr));
    let script = dir.path().join(format!("limiter-ctl.{shell}"));
    std::fs::write(&script, &out.stdout).unwrap();
    (dir, script)
}

fn shell(program: &str, dir: &Path) -> Command {
    let mut cmd = Command::new(program);
    cmd.current_dir(dir).env("HOME", dir).env("XDG_CONFIG_HOME", dir);
    cmd
}

fn run(cmd: &mut Command, what: &str) -> String {
    let out: Output = cmd.output().unwrap_or_else(|e| panic!("{what}: {e} (cargo xtask setup installs it)"));
    assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn assert_interfaces(got: &[&str], what: &str) {
    assert!(got.contains(&"lo"), "{what}: no `lo` in {got:?}");
    assert!(!got.iter().any(|w| w.contains("bait")), "{what}: file names in {got:?}");
}

#[test]
fn bash_completes_iface_with_interfaces() {
    let (dir, script) = scratch("bash");
    // The function the script registers, called as bash calls it: $1 command, $2 word, $3 previous.
    let complete = |words: &str| {
        let body = format!(
            "source {}; COMP_WORDS=({words}); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); \
             _limiter__ctl limiter-ctl \"${{COMP_WORDS[COMP_CWORD]}}\" \"${{COMP_WORDS[COMP_CWORD-1]}}\"; \
             printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            script.display()
        );
        run(shell("bash", dir.path()).args(["--norc", "-c", &body]), "bash")
    };
    for words in
        ["limiter-ctl daemon --iface ''", "limiter-ctl detach --iface l", "limiter-ctl config check x --iface ''"]
    {
        let out = complete(words);
        assert_interfaces(&out.lines().collect::<Vec<_>>(), words);
    }
    // A subcommand's own options complete (clap_complete's labels for them are fixed up).
    let out = complete("limiter-ctl daemon --pin");
    assert_eq!(out.lines().collect::<Vec<_>>(), ["--pin-dir"], "daemon --pin<TAB>");
}

/// In a test namespace the candidates are exactly its interfaces: its veth end, which was just
/// created, and `lo`; none of the host's.
#[test]
fn bash_offers_the_namespace_s_own_interfaces() {
    limiter_tests::require_root!();
    let net = limiter_tests::netns::TestNet::new().expect("test namespaces");
    let end = &net.receiver;
    let (dir, script) = scratch("bash");
    let body = format!(
        "source {}; COMP_WORDS=(limiter-ctl daemon --iface ''); COMP_CWORD=3; \
         _limiter__ctl limiter-ctl '' --iface; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display()
    );
    // `ip netns exec` mounts the namespace's own /sys, as a shell inside it would see it.
    let out = run(end.command("bash").current_dir(dir.path()).args(["--norc", "-c", &body]), "bash in the namespace");
    let mut got: Vec<&str> = out.lines().collect();
    got.sort();
    let mut want = vec![end.iface.as_str(), "lo"];
    want.sort();
    assert_eq!(got, want, "the namespace's interfaces");
}

#[test]
fn fish_completes_iface_with_interfaces() {
    let (dir, script) = scratch("fish");
    for line in ["limiter-ctl daemon --iface ", "limiter-ctl detach --iface l"] {
        let body = format!("source {}; complete -C '{line}'", script.display());
        let out = run(shell("fish", dir.path()).args(["--no-config", "-c", &body]), "fish");
        let got: Vec<&str> = out.lines().map(|l| l.split('\t').next().unwrap_or("")).collect();
        assert_interfaces(&got, line);
    }
}

#[test]
fn zsh_completes_iface_with_interfaces() {
    let (dir, script) = scratch("zsh");
    let functions = dir.path().join("functions");
    std::fs::create_dir(&functions).unwrap();
    std::fs::rename(&script, functions.join("_limiter-ctl")).unwrap();
    // zsh completes only in its line editor: drive an interactive zsh on a pseudo-terminal
    // (zpty), wait until it has set up completion, press Tab twice to list the candidates,
    // then print a marker the typed line cannot contain (`DO""NE` is typed, `DONE` printed)
    // and read up to it.
    let driver = format!(
        r#"zmodload zsh/zpty
zpty -b z 'zsh -f -i'
zpty -w z "PS1=''; fpath=({} \$fpath); autoload -Uz compinit; compinit -u -D; zstyle ':completion:*' list-prompt ''"
zpty -w z "echo RE''ADY"
zpty -r -m z out '*READY*'
zpty -w -n z $'limiter-ctl daemon --iface \t\t'
zpty -w -n z $'\x15echo DO""NE\n'
zpty -r -m z out '*DONE*'
print -r -- "$out"
zpty -d z
"#,
        functions.display()
    );
    std::fs::write(dir.path().join("driver.zsh"), driver).unwrap();
    let out = run(shell("timeout", dir.path()).args(["30", "zsh", "-f", "driver.zsh"]), "zsh");
    // The listing, without the terminal's escape sequences.
    let mut plain = String::new();
    let mut chars = out.chars();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => {
                // CSI: up to its final byte, a letter.
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            c if c.is_control() => plain.push(' '),
            c => plain.push(c),
        }
    }
    let words: Vec<&str> = plain.split_whitespace().collect();
    assert_interfaces(&words, "zsh: limiter-ctl daemon --iface <TAB><TAB>");
}

//! Shell completion scripts: clap_complete's, with `--iface` completing the host's interface
//! names. clap's value hints cannot list interfaces (and clap_complete's dynamic engine, which
//! could, calls the binary on every Tab behind an unstable feature), so the generated script's
//! `--iface` entries are rewritten to ask the shell's own interface lister: the names under
//! /sys/class/net (bash), `_net_interfaces` (zsh), `__fish_print_interfaces` (fish). Each
//! `--iface` is declared `ValueHint::Other` so that nothing offers file names for it.

use clap::CommandFactory as _;
use clap_complete::Shell;

use super::args::Cli;

/// What bash runs for an `--iface` value: the interfaces, and no file names when none matches
/// (the script registers `-o default`, which would list files).
const BASH_IFACES: &str = r#"compopt +o default +o bashdefault 2>/dev/null
COMPREPLY=($(compgen -W "$(ls /sys/class/net 2>/dev/null)" -- "${cur}"))"#;

/// The completion script for `shell`.
pub(crate) fn script(shell: Shell) -> Vec<u8> {
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "limiter-ctl", &mut out);
    let text = String::from_utf8_lossy(&out);
    match shell {
        Shell::Bash => bash(&text),
        Shell::Zsh => text.replace(":IFACE:' \\", ":IFACE:_net_interfaces' \\"),
        Shell::Fish => text
            .lines()
            .map(|l| {
                if l.contains(" -l iface ") {
                    format!("{l} -f -a \"(__fish_print_interfaces)\"\n")
                } else {
                    format!("{l}\n")
                }
            })
            .collect(),
        _ => text.into_owned(),
    }
    .into_bytes()
}

/// Every `--iface)` case arm's body becomes [`BASH_IFACES`]. And the arms of subcommands get
/// the labels the script's dispatch loop gives them: clap_complete 4.6 spells them
/// `limiter__subcmd__ctl__...` but sets `limiter__ctl__...`, so no option of any subcommand
/// completed (clap-rs/clap#6421, for any binary with a hyphen in its name).
fn bash(text: &str) -> String {
    let text = text.replace("limiter__subcmd__ctl", "limiter__ctl");
    let mut out = String::with_capacity(text.len());
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        out.push_str(line);
        out.push('\n');
        let trimmed = line.trim_start();
        if trimmed != "--iface)" {
            continue;
        }
        let indent = format!("{}    ", &line[..line.len() - trimmed.len()]);
        for body in BASH_IFACES.lines().map(str::trim_start).chain(["return 0", ";;"]) {
            out.push_str(&format!("{indent}{body}\n"));
        }
        // The generated body, up to and including its `;;`.
        for skipped in lines.by_ref() {
            if skipped.trim() == ";;" {
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `--iface` (daemon, config check, detach) is rewritten in every shell, and nothing
    /// else is.
    #[test]
    fn every_iface_completes_interfaces() {
        let text = |shell| String::from_utf8(script(shell)).unwrap();
        let bash = text(Shell::Bash);
        assert_eq!(bash.matches("--iface)").count(), 3);
        assert_eq!(bash.matches("/sys/class/net").count(), 3);
        let arms: Vec<&str> = bash.split("--iface)").skip(1).map(|arm| arm.split(";;").next().unwrap()).collect();
        assert!(arms.iter().all(|arm| !arm.contains("compgen -f")), "an --iface arm still completes files");
        assert!(arms.iter().all(|arm| !arm.contains("nospace")), "an interface name wants a space after it");
        assert!(!bash.contains("__subcmd__ctl"), "arm labels the dispatch loop never sets");
        assert_eq!(text(Shell::Zsh).matches(":IFACE:_net_interfaces'").count(), 3);
        let fish = text(Shell::Fish);
        assert_eq!(fish.matches("__fish_print_interfaces").count(), 3);
        assert_eq!(fish.lines().filter(|l| l.contains("-l iface ") && l.contains("-F")).count(), 0);
    }
}

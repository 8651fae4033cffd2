//! The man pages: one per command, rendered by clap_mangen from the clap definitions, with the
//! sections clap knows nothing of (EXIT STATUS, ENVIRONMENT, FILES, SIGNALS, SEE ALSO) added
//! where they apply; and limiter.toml(5), the config file's page, written here.
//!
//! The exit codes are those of `exit_code` in the CLI; the defaults come from the same
//! constants the code uses, so a page cannot name another path than the binary's.

use std::{io, path::Path};

use roff::{Roff, bold, italic, roman};

use super::args::Cli;
use crate::{api::ipc, config, kernel::pins};

/// The top page to stdout, or (with `dir`) it, a page per subcommand, as the top page's
/// SUBCOMMANDS section names them (limiter-ctl-policy.1, limiter-ctl-policy-set.1, ...), and
/// limiter.toml.5.
pub(crate) fn write(dir: Option<&Path>) -> io::Result<()> {
    use clap::CommandFactory as _;
    let top = Cli::command();
    let Some(dir) = dir else {
        return io::Write::write_all(&mut io::stdout(), &command_page(top, &[])?);
    };
    std::fs::create_dir_all(dir)?;
    fn write(dir: &Path, cmd: clap::Command, name: String, path: &[&str]) -> io::Result<()> {
        let cmd = cmd.name(name.clone());
        std::fs::write(dir.join(format!("{name}.1")), command_page(cmd.clone(), path)?)?;
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            let path: Vec<&str> = path.iter().copied().chain([sub.get_name()]).collect();
            write(dir, sub.clone(), format!("{name}-{}", sub.get_name()), &path)?;
        }
        Ok(())
    }
    write(dir, top, "limiter-ctl".into(), &[])?;
    std::fs::write(dir.join("limiter.toml.5"), config_page())
}

/// clap_mangen's page, with our sections before VERSION (where man-pages(7) puts them).
fn command_page(cmd: clap::Command, path: &[&str]) -> io::Result<Vec<u8>> {
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd).render(&mut page)?;
    let page = String::from_utf8_lossy(&page).into_owned();
    let extra = sections(Page::of(path)).to_roff();
    let at = page.find("\n.SH VERSION\n").map_or(page.len(), |i| i + 1);
    Ok([&page[..at], &extra, &page[at..]].concat().into_bytes())
}

/// Which sections a page gets, by what its command does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Page {
    Top,
    Daemon,
    /// A command sent to the daemon over its socket; `edits`: one that changes the config file.
    Client {
        edits: bool,
    },
    Reload,
    ConfigCheck,
    Detach,
    Completions,
    /// The CrowdSec bouncer: runs until stopped.
    Crowdsec,
    /// `allow|deny add` (and the list's page): a batch of bans may be partly refused.
    ListAdd,
}

impl Page {
    fn of(path: &[&str]) -> Page {
        match path {
            [] => Page::Top,
            ["daemon", ..] => Page::Daemon,
            ["reload", ..] => Page::Reload,
            ["config", ..] => Page::ConfigCheck,
            ["detach", ..] => Page::Detach,
            ["completions", ..] => Page::Completions,
            ["crowdsec", ..] => Page::Crowdsec,
            ["allow" | "deny"] | ["allow" | "deny", "add"] => Page::ListAdd,
            ["policy"] | ["policy", "set" | "rm"] | ["allow" | "deny", "rm"] => Page::Client { edits: true },
            _ => Page::Client { edits: false },
        }
    }
}

/// `.TP` items: a tag in bold, then its text.
fn items(roff: &mut Roff, heading: &str, items: &[(&str, String)]) {
    if items.is_empty() {
        return;
    }
    roff.control("SH", [heading]);
    for (tag, text) in items {
        roff.control("TP", []).text([bold(*tag)]).text([roman(text.as_str())]);
    }
}

fn sections(page: Page) -> Roff {
    let mut roff = Roff::new();
    items(&mut roff, "EXIT STATUS", &exit_status(page));
    items(&mut roff, "ENVIRONMENT", &environment(page));
    items(&mut roff, "FILES", &files(page));
    items(&mut roff, "SIGNALS", &signals(page));
    roff.control("SH", ["SEE ALSO"]);
    let mut see: Vec<(&str, &str)> = vec![("limiter.toml", "5")];
    if page != Page::Top {
        see.insert(0, ("limiter-ctl", "1"));
    }
    if matches!(page, Page::Top | Page::Daemon) {
        see.extend([("systemctl", "1"), ("journalctl", "1")]);
    }
    let mut inlines = Vec::new();
    for (i, (name, section)) in see.iter().enumerate() {
        if i > 0 {
            inlines.push(roman(", "));
        }
        inlines.extend([bold(*name), roman(format!("({section})"))]);
    }
    inlines.push(roman(", and /usr/share/doc/limiter/OPERATIONS.md, the manual."));
    roff.text(inlines);
    roff
}

fn exit_status(page: Page) -> Vec<(&'static str, String)> {
    let bad_args = "a bad argument (one line on stderr); nothing was changed";
    let unreachable = "the daemon could not be reached (not running, another --socket, not root), or it could \
                       not do what was asked (the kernel refused; what it had changed was put back), or it \
                       did not answer within 30 s (the request may still be applied: check before repeating it)";
    let (ok, failed, bad) = match page {
        Page::Top => (
            "done".into(),
            "failed: see the command's page".into(),
            "bad input: a bad argument, a refused config file or request; nothing was changed".into(),
        ),
        Page::Daemon => (
            "stopped by SIGTERM, SIGINT or SIGUSR2 (the program left attached and enforcing), also while \
             waiting for the interface"
                .into(),
            "failed: the kernel refused the program (with --mode native, also when the driver or the kernel \
             refuses native XDP: no fall back to tc ingress), another daemon owns the interface (under any --pin-dir: \
             it holds the interface's lock in --state-dir, or its program is on the interface's hooks; the \
             line names its pins and pid) or the socket, the interface did not appear within --wait-iface, or \
             the program was detached or its pins removed while the daemon ran. A supervisor should start it \
             again (Restart=on-failure)."
                .into(),
            "bad input, nothing loaded: a bad flag, a config file refused (PATH:LINE:COL: why), a refused \
             --rate or --burst, an interface that does not exist (without --wait-iface), or a \
             --tcx-before or --tcx-after program that is not at tc ingress (when attaching there), or, through \
             a netlink filter, a place whose priority another filter holds"
                .into(),
        ),
        Page::Client { .. } | Page::ListAdd => (
            "done".into(),
            format!(
                "{unreachable}. A command of many entries (--file) whose connection was lost partway says how many \
                 were applied and how to finish; a list cut short is printed as far as it came"
            ),
            format!("{bad_args}, or the daemon refused the request as bad input"),
        ),
        Page::Reload => (
            "the file was applied".into(),
            format!("{unreachable}; the running config stays"),
            "the file was refused: missing, empty, not a regular file, unreadable, not parsing or not \
             validating, or without any rule while rules run (unless it says policy = []); the running \
             config stays"
                .into(),
        ),
        Page::ConfigCheck => (
            "the file is valid (a one-line summary)".into(),
            String::new(),
            "the file is not valid (PATH:LINE:COL: why), cannot be read, or --iface names no interface".into(),
        ),
        Page::Detach => (
            "detached, or nothing was pinned (the report says which)".into(),
            "refused while a daemon owns the interface (without --force), or the pins could not be removed".into(),
            bad_args.into(),
        ),
        Page::Completions => ("the script was printed".into(), String::new(), bad_args.into()),
        // It never gives up: a LAPI or a daemon that is down is retried, the bans applied kept.
        Page::Crowdsec => (
            "stopped by SIGTERM or SIGINT; the bans it applied stay in the daemon, each until its time".into(),
            String::new(),
            format!("{bad_args}: --lapi is not a plain-HTTP URL, or --key-file cannot be read or is not one line"),
        ),
    };
    let partly = match page {
        Page::ListAdd => format!(
            "with --for: some bans are in force, the daemon's rules refused the others (broader than IPv4 /{} or \
             IPv6 /{}, or a deny covering the config file's allow list), each named on a line of its own (`refused: \
             CIDR: why`). When the rules refuse every entry, the exit is 2, with the same lines.",
            crate::api::ipc::FLOOR_V4,
            crate::api::ipc::FLOOR_V6
        ),
        _ => String::new(),
    };
    let mut codes: Vec<(&'static str, String)> = [("0", ok), ("1", failed), ("2", bad), ("3", partly)]
        .into_iter()
        .filter(|(_, text)| !text.is_empty())
        .collect();
    if page == Page::Daemon {
        codes.push((
            "4",
            "this kernel cannot run the limiter: it lacks something the limiter needs (BPF atomics, Linux 5.12; the \
             line names it and the kernel); nothing was loaded. Starting again will not help: run a newer kernel"
                .into(),
        ));
    }
    codes
}

fn environment(page: Page) -> Vec<(&'static str, String)> {
    let mut env = Vec::new();
    if matches!(page, Page::Top | Page::Daemon | Page::Client { .. } | Page::ListAdd | Page::Reload | Page::Crowdsec) {
        env.push((
            "LIMITER_SOCKET",
            format!(
                "The control socket, as --socket (default {}); the units set it from /etc/default/limiter so \
                 that systemctl reload reaches the daemon they started.",
                ipc::DEFAULT_SOCKET
            ),
        ));
    }
    if page == Page::Crowdsec {
        env.push((
            "RUST_LOG",
            "Which log lines the bouncer writes: a level (error, warn, info, debug, trace). Default: info.".into(),
        ));
    }
    if matches!(page, Page::Top | Page::Daemon) {
        env.push((
            "RUST_LOG",
            "Which log lines the daemon writes: a level (error, warn, info, debug, trace) or directives such \
             as limiter_ctl=debug. Default: info."
                .into(),
        ));
        env.push((
            "NOTIFY_SOCKET",
            "Set by systemd for Type=notify: the daemon sends READY=1 once the program is attached, STATUS= \
             while it waits for its interface, and STOPPING=1."
                .into(),
        ));
    }
    if matches!(page, Page::Top | Page::Daemon | Page::Reload) {
        env.push((
            "JOURNAL_STREAM",
            "Set by systemd when output goes to the journal: lines written there start with their syslog \
             priority (<3> error, <4> warning, <6> info, <7> debug), which journald files them under."
                .into(),
        ));
    }
    env
}

fn files(page: Page) -> Vec<(&'static str, String)> {
    let mut files = Vec::new();
    let config = (config::DEFAULT_PATH, "The policies and allow/deny lists (limiter.toml(5)), the default --config.");
    let socket = (
        ipc::DEFAULT_SOCKET,
        "The daemon's control socket (root and the daemon's user; ban feeders of its --socket-group), the default \
         --socket."
            .to_string(),
    );
    let pins = (
        pins::DEFAULT_ROOT,
        "Where each interface's program, its link (XDP or tcx; through a netlink filter at tc ingress, the \
         filter's program) and maps are pinned (bpffs), in a directory per interface: the default --pin-dir.",
    );
    match page {
        Page::Top | Page::Daemon => {
            files.push((config.0, format!("{} The daemon writes every change to it.", config.1)));
            files.push((
                "/etc/limiter/IFACE.toml",
                "The config of limiter@IFACE.service, one daemon per interface.".into(),
            ));
            files.push((
                "/etc/default/limiter",
                "IFACE, LIMITER_OPTS (more daemon flags) and LIMITER_SOCKET for limiter.service; \
                 /etc/default/limiter@IFACE for limiter@IFACE.service."
                    .into(),
            ));
            files.push(socket);
            files.push((pins.0, pins.1.into()));
        }
        Page::Client { .. } | Page::ListAdd => {
            files.push(socket);
            if matches!(page, Page::Client { edits: true } | Page::ListAdd) {
                files.push((
                    config.0,
                    "The daemon's config file: the daemon writes every change to it, in place.".into(),
                ));
            }
        }
        Page::Reload => {
            files.push(socket);
            files.push((config.0, "The file the daemon re-reads (its --config).".into()));
        }
        Page::Detach => files.push((pins.0, pins.1.into())),
        Page::Crowdsec => {
            files.push(socket);
            files.push((
                "/usr/lib/systemd/system/limiter-crowdsec.service",
                "The bouncer's unit: no privilege, in the group limiter-bans, which the daemons' units let feed \
                 bans (--socket-group)."
                    .into(),
            ));
            files.push((
                "/etc/default/limiter-crowdsec",
                "LAPI_URL (the --lapi) and CROWDSEC_OPTS (more flags) for the unit.".into(),
            ));
            files.push((
                "/etc/crowdsec/bouncers/limiter.key",
                "The API key the unit hands the bouncer (LoadCredential=), from cscli bouncers add limiter -o raw."
                    .into(),
            ));
        }
        Page::ConfigCheck | Page::Completions => {}
    }
    files
}

fn signals(page: Page) -> Vec<(&'static str, String)> {
    if !matches!(page, Page::Top | Page::Daemon) {
        return Vec::new();
    }
    vec![
        (
            "SIGHUP",
            "The daemon re-reads its config file, as limiter-ctl reload does but with no answer: applied \
             whole or refused (logged at error, counted in limiter_config_reloads_total), the running config \
             staying."
                .into(),
        ),
        (
            "SIGTERM, SIGINT, SIGUSR2",
            "The daemon stops (exit 0), leaving the program attached and pinned, enforcing the last policy, \
             for the next daemon to adopt with its buckets, counters and salt: a restart leaves no gap. \
             limiter-ctl detach takes the limiter off."
                .into(),
        ),
        ("SIGUSR1", "Ignored, with one log line: the daemon goes on.".into()),
    ]
}

/// An example config, every key set; the unit test parses and validates it.
const EXAMPLE: &str = r#"version = 2
allow = ["198.51.100.0/24"]
deny = ["2001:db8:bad::/48"]

[[policy]]
name = "dns"
match = "udp:53"
rate = "100/s"
burst = 200
key = "src/24,/56"
unit = "packets"
mode = "enforce"
scope = "cpu"

[[policy]]
name = "flood"
match = "any"
rate = "20000/s"
mode = "dry-run""#;

/// The page limiter.toml(5).
fn config_page() -> String {
    let mut roff = Roff::new();
    roff.control("TH", ["limiter.toml", "5", "", &format!("limiter {}", env!("CARGO_PKG_VERSION")), "File Formats"]);
    roff.control("SH", ["NAME"]).text([roman("limiter.toml - policies and allow/deny lists of limiter-ctl")]);
    roff.control("SH", ["SYNOPSIS"]).text([bold(config::DEFAULT_PATH)]);
    roff.control("br", []).text([bold("/etc/limiter/"), italic("IFACE"), bold(".toml")]);
    roff.control("SH", ["DESCRIPTION"]).text([roman(
        "The config file of limiter-ctl daemon (--config), in TOML. It lists sources that bypass limiting, \
         sources always dropped, and rate policies. Policies may overlap: a packet is judged by every policy \
         that covers it (its match, sport and dst), in this order: exact destination port, then a port \
         range, then protocol, then any; per source before aggregate (the longer key prefix first); then \
         by name. It passes only if each admits it, and a refusal charges none of the others. At most 4 \
         policies may cover one packet and at most 8 share one traffic; more are refused with their names. \
         Up to 255 policies and 16384 list entries per address family.",
    )]);
    roff.control("PP", []).text([roman(
        "The daemon owns the file: limiter-ctl policy, allow and deny apply a change to the kernel, then \
         write it to the file atomically, in place (comments, order, spelling, owner, mode and a symlink \
         kept). Numbers are decimal, without a sign or a leading zero, here as on the command line.",
    )]);
    let top = [
        (
            "allow",
            "A list of IPv4 and IPv6 networks (\"198.51.100.0/24\") that bypass limiting; the longest prefix wins. Default: empty.",
        ),
        ("deny", "A list of networks whose packets are always dropped. Default: empty."),
        (
            "version",
            "The file's format: 2. With it, a policy without scope is scope host (one allowance for the whole \
             host). A file without it was written before scope host became the default: there a policy without \
             scope is scope cpu, as it was then, and limiter-ctl config check says so in a note. The daemon \
             writes version = 2 into a file it creates, and into one without it at its first change to it, with \
             scope = \"cpu\" on the policies that had no scope. Any other value is refused.",
        ),
        (
            "[[policy]]",
            "A table per rate policy, with the keys below. Default: none. To run without rules on purpose, say policy = [].",
        ),
    ];
    items(&mut roff, "KEYS", &top.map(|(k, v)| (k, v.to_string())));
    roff.control("SS", ["Policy keys"]);
    // The name, then each field as declared (`config::FIELDS`).
    let name = ("name", "Required. 1 to 32 of A-Z a-z 0-9 _ . -, unique.");
    for (key, text) in [name].into_iter().chain(config::FIELDS.iter().map(|f| (f.key, f.about))) {
        roff.control("TP", []).text([bold(key)]).text([roman(text)]);
    }
    roff.control("SH", ["APPLYING CHANGES"]).text([roman(
        "The daemon reads the file at start: a file that does not parse or validate stops it (PATH:LINE:COL: \
         why, exit 2); a missing file is a first start, which the daemon writes. After a hand edit, check it \
         with limiter-ctl config check FILE, then apply it with limiter-ctl reload (systemctl reload \
         limiter) or SIGHUP. A change is applied whole or not at all; a file that is refused (missing, \
         empty, not a regular file, not parsing or validating, or without any rule while rules run) leaves \
         the running config in place, logged and counted. A CLI change never overwrites a hand edit not \
         yet applied: with --watch-config (the default) the edit is reloaded first and the change applied \
         on top; with --watch-config=false the change is refused (exit 1) until limiter-ctl reload. How the \
         daemon follows the file on its own (a ConfigMap, a symlink swapped, its directory made again) is \
         in OPERATIONS.md, section Reload.",
    )]);
    roff.control("SH", ["EXAMPLE"]).control("nf", []).control("RS", ["4"]);
    for line in EXAMPLE.lines() {
        roff.text([roman(line)]);
    }
    roff.control("RE", []).control("fi", []);
    items(
        &mut roff,
        "FILES",
        &[
            (config::DEFAULT_PATH, "The file of limiter.service.".into()),
            ("/etc/limiter/IFACE.toml", "The file of limiter@IFACE.service.".into()),
        ],
    );
    roff.control("SH", ["SEE ALSO"]).text([
        bold("limiter-ctl"),
        roman("(1), "),
        bold("limiter-ctl-daemon"),
        roman("(1), "),
        bold("limiter-ctl-config-check"),
        roman("(1), and /usr/share/doc/limiter/OPERATIONS.md, the manual."),
    ]);
    roff.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_is_a_valid_config_and_every_key_is_described() {
        let path = Path::new("limiter.toml");
        let file = config::parse(path, EXAMPLE).unwrap();
        config::State::build_for(&file, &Default::default(), config::DEFAULT_MAX_FRAME).unwrap();
        // Every key a policy can have, as the daemon writes them, has its entry on the page.
        let written = toml::to_string(&file).unwrap();
        let page = config_page();
        let mut keys: Vec<&str> = written.lines().filter_map(|l| l.split_once(" = ")).map(|(k, _)| k).collect();
        keys.sort();
        keys.dedup();
        assert!(keys.len() >= 10, "{keys:?}");
        for key in keys {
            assert!(page.contains(&format!(".TP\n\\fB{key}\\fR")), "limiter.toml(5) does not describe {key}");
        }
    }

    #[test]
    fn pages_get_the_sections_that_apply() {
        let has = |page: Page, heading: &str| {
            sections(page).to_roff().contains(&format!(".SH \"{heading}\"\n"))
                || sections(page).to_roff().contains(&format!(".SH {heading}\n"))
        };
        for page in [Page::Top, Page::Daemon] {
            for heading in ["EXIT STATUS", "ENVIRONMENT", "FILES", "SIGNALS", "SEE ALSO"] {
                assert!(has(page, heading), "{page:?} lacks {heading}");
            }
        }
        assert_eq!(Page::of(&["policy", "set"]), Page::Client { edits: true });
        assert_eq!(Page::of(&["deny", "add"]), Page::ListAdd);
        assert!(sections(Page::ListAdd).to_roff().contains("refused: CIDR: why"));
        assert_eq!(Page::of(&["stats"]), Page::Client { edits: false });
        assert!(has(Page::Client { edits: false }, "ENVIRONMENT") && !has(Page::Client { edits: false }, "SIGNALS"));
        assert!(has(Page::Detach, "FILES") && !has(Page::Detach, "ENVIRONMENT"));
    }
}

//! The command line, defined once with clap; shell completions and man pages are generated
//! from it.

use std::{path::PathBuf, time::Duration};

use clap::{Arg, ArgAction, ArgMatches, Args, Parser, Subcommand, ValueHint, builder::PossibleValuesParser};

pub(crate) use super::daemon_args::DaemonArgs;
use crate::{
    api::ipc,
    config::{self, Dash, FIELDS, Flag, Name, Origin, PolicyEdit},
    kernel::{Hook, ProgRef, pins},
};

/// The daemon's runtime state (systemd's StateDirectory=limiter).
pub(crate) const DEFAULT_STATE_DIR: &str = "/var/lib/limiter";

#[derive(Debug, Parser)]
#[command(name = "limiter-ctl", version, about = "Host-level flood limiter: per-source GCRA in XDP")]
pub(crate) struct Cli {
    /// The daemon's control socket. LIMITER_SOCKET sets it for the daemon and the CLI alike (the
    /// unit's EnvironmentFile, so that `systemctl reload` reaches the daemon it started).
    #[arg(long, global = true, value_name = "PATH", env = "LIMITER_SOCKET", default_value = ipc::DEFAULT_SOCKET)]
    pub socket: PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Load the XDP limiter on an interface (or adopt the one pinned there) and serve it.
    ///
    /// SIGHUP makes it re-read its config file, as `limiter-ctl reload` does (applied whole or
    /// refused, logged; the running config stays). SIGTERM, SIGINT and SIGUSR2 stop the daemon
    /// and leave the program attached and pinned, enforcing, for the next daemon to adopt
    /// (buckets, counters and salt kept): a restart leaves no gap. `limiter-ctl detach` takes
    /// the limiter off. SIGUSR1 is logged and ignored.
    Daemon(DaemonArgs),
    /// Create, replace, remove and inspect rate policies.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Sources that bypass limiting.
    #[command(subcommand)]
    Allow(ListCommand),
    /// Sources that are always dropped.
    #[command(subcommand)]
    Deny(ListCommand),
    /// Admitted and refused packets per policy: per second over the last second, and totals.
    Stats {
        /// Redraw in place once a second, like top (Ctrl-C to stop).
        #[arg(long)]
        watch: bool,
        #[arg(long)]
        json: bool,
    },
    /// The most-refused source prefixes right now, from a sample of refusals (root only).
    Top {
        /// How many prefixes to show.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// What a packet from ADDR would meet now, and until when: bans, list entries and policies.
    ///
    /// In the order the program judges it: the bans and allow or deny entries covering ADDR
    /// (origin, time left); then every policy covering the packet, in judging order, each with
    /// the key ADDR falls into (its prefix, and the destination port where the key has it) and
    /// that key's buckets: what is spent in each row (on each CPU whose copy is not idle, for a
    /// policy of scope cpu), when the next packet is admitted (its Retry-After) and when the
    /// whole burst is back. The first line says whether such a packet is admitted, refused and
    /// by which policy (on which CPUs, for scope cpu), denied or allowed by which entry, and
    /// when it would pass again if the source sends nothing meanwhile (a refusal writes
    /// nothing). A warning says when the key shares its bucket in every row with other sources
    /// the daemon has seen refused lately, or that another policy wrote: it can then be
    /// refused for their traffic (more buckets, or `salt rotate`, which moves every key).
    ///
    /// Reads only: no bucket, memo or counter changes. Root only (it names the buckets a source
    /// hashes to; the salt never leaves the daemon). Without --dport, policies on ports are not
    /// consulted. --json prints the daemon's answer, the socket's `{"op":"explain",...}`.
    Explain(super::explain::ExplainArgs),
    /// The secret salt that hashes sources into buckets.
    #[command(subcommand)]
    Salt(SaltCommand),
    /// Make the daemon re-read its config file, and say whether it applied it.
    ///
    /// What SIGHUP does, with an answer: exit 0 when applied; exit 2, with the reason, when the
    /// file was refused (missing, empty, not a regular file, unreadable, not parsing or not
    /// validating, or without any rule while rules run, unless it says `policy = []`); the
    /// running config then stays. Exit 1 when the daemon could not be asked or failed. For
    /// `ExecReload=` (`systemctl reload limiter`).
    Reload,
    /// Move the limiter to another hook without a gap: attach there first, then release the old.
    ///
    /// `attach tc` (or `tcx`) leaves XDP free for another tool, at tc ingress through the API the
    /// daemon's --tc-api gives; `attach xdp` takes XDP back (it must be free). Both hooks judge
    /// for the moment of the move. Already there: says so, exit 0. The running daemon does it; a
    /// restart keeps the hook unless its --attach says another.
    Attach {
        #[arg(value_enum, value_name = "HOOK")]
        hook: Hook,
        /// At tc ingress, run before this program (its name as `bpftool prog` shows it, or id:N)
        /// [default: the daemon's --tcx-before/--tcx-after, or first].
        #[arg(long, value_name = "PROG", value_parser = parse_prog, conflicts_with = "after")]
        before: Option<ProgRef>,
        /// At tc ingress, run after this program (its name as `bpftool prog` shows it, or id:N).
        #[arg(long, value_name = "PROG", value_parser = parse_prog)]
        after: Option<ProgRef>,
    },
    /// Check config files without a daemon.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// A CrowdSec bouncer: ban in the deny list what CrowdSec's local API decides, each for its
    /// decision's duration.
    ///
    /// Runs until stopped, polling the LAPI's decision stream every --interval: a ban on an
    /// address or a range (scope Ip or Range) becomes an expiring deny entry of origin crowdsec,
    /// a deleted decision removes it; other decisions (captcha, a country) are skipped and
    /// counted in the log. A LAPI that is down or answers garbage changes nothing: the bans
    /// applied stay (each until its time) and it is retried with backoff, 1 s doubling to 30 s,
    /// then read in full again. A full set with a decision it cannot read is refused whole; an
    /// unreadable decision in the changes lifts nothing. An answer is read as it arrives, within
    /// bounds (256 MiB, as many bans as the daemon holds), so its memory stays under 400 MiB
    /// whatever the LAPI sends. A daemon that is down gets the pending bans when it is back; one
    /// that restarted gets back what it lost (its bans of origin crowdsec are compared with the
    /// bouncer's). The package's unit, limiter-crowdsec.service, runs it with no privilege.
    Crowdsec(CrowdsecArgs),
    /// Take the limiter off an interface: unpin its program and maps, with all its state.
    ///
    /// The one step that removes the limiter: stopping or restarting the daemon leaves the
    /// program enforcing. At tc ingress through a netlink filter, deletes the limiter's filter
    /// (no other; the clsact qdisc stays). Refused (exit 1) while a daemon owns the interface,
    /// unless --force.
    Detach {
        #[arg(long, value_name = "IFACE", value_hint = ValueHint::Other, required_unless_present = "all", conflicts_with = "all")]
        iface: Option<String>,
        /// Every interface pinned under --pin-dir (what removing the package does).
        #[arg(long)]
        all: bool,
        /// Stop the daemon that owns the interface first (SIGTERM, waiting up to 15 s for it).
        #[arg(long)]
        force: bool,
        /// Where limiters are pinned (bpffs).
        #[arg(long, value_name = "PATH", default_value = pins::DEFAULT_ROOT)]
        pin_dir: PathBuf,
    },
    /// Print a shell completion script.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), generated from these definitions; with --dir, write it and
    /// one page per subcommand (limiter-ctl-daemon.1, ...) there.
    #[command(hide = true)]
    Man {
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

#[derive(Debug, Args)]
pub(crate) struct CrowdsecArgs {
    /// The local API's address (plain HTTP), e.g. http://127.0.0.1:8080.
    #[arg(long, value_name = "URL", value_hint = ValueHint::Url)]
    pub lapi: String,
    /// A file holding the bouncer's API key, one line (`cscli bouncers add NAME -o raw`).
    #[arg(long, value_name = "FILE", value_hint = ValueHint::FilePath)]
    pub key_file: PathBuf,
    /// How often to poll the decision stream (e.g. 1s, 500ms, 10s).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_poll)]
    pub interval: Duration,
    /// Log lines on stdout as text, or one JSON object per line. RUST_LOG filters them.
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = super::logs::LogFormat::Text)]
    pub log_format: super::logs::LogFormat,
}

/// A poll interval: 100 ms to 1 h.
fn parse_poll(s: &str) -> Result<Duration, String> {
    let err = || format!("invalid interval '{s}': expected a duration from 100ms to 1h, such as 1s or 10s");
    let d = humantime::parse_duration(s).map_err(|_| err())?;
    if d < Duration::from_millis(100) || d > Duration::from_secs(3600) {
        return Err(err());
    }
    Ok(d)
}

#[derive(Debug, Subcommand)]
pub(crate) enum ConfigCommand {
    /// Read, parse and validate a config file as the daemon would, touching nothing (like
    /// `nft -c -f`): exit 0 with a one-line summary, or exit 2 with PATH:LINE:COL: what is wrong.
    Check {
        /// The file to check.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// Check byte policies' bursts against this interface's MTU [default: a 1500-byte MTU].
        #[arg(long, value_name = "IFACE", value_hint = ValueHint::Other)]
        iface: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum SaltCommand {
    /// Draw a new salt now (the daemon also does so every --rotate-every).
    Rotate,
}

#[derive(Debug, Subcommand)]
pub(crate) enum PolicyCommand {
    /// Create a policy, or change the fields given of the one of that name (it keeps its buckets
    /// and counters).
    Set(PolicySetArgs),
    /// Remove a policy: its traffic falls to the next matching policy, or passes.
    Rm { name: Name },
    /// All policies, with their counters.
    List {
        #[arg(long)]
        json: bool,
    },
    /// One policy, with its counters.
    Show {
        name: Name,
        #[arg(long)]
        json: bool,
    },
}

/// `policy set NAME` and a flag per policy field, built from the fields' declaration
/// (`config::FIELDS`): the flag is the field's key, `--KEY VALUE`, or one flag per word.
#[derive(Debug)]
pub(crate) struct PolicySetArgs {
    pub name: Name,
    /// The fields given.
    pub edit: PolicyEdit,
}

impl clap::Args for PolicySetArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        let name = Arg::new("name")
            .value_name("NAME")
            .required(true)
            .help("1-32 of A-Z a-z 0-9 _ . -")
            .value_parser(|s: &str| s.parse::<Name>());
        let mut cmd = cmd.arg(name).after_help(
            "On an existing policy only the fields given change; the others keep their values (leaving dry-run \
             takes --enforce). A new policy needs --rate; the fields not given take the defaults shown.",
        );
        for field in FIELDS {
            match field.flag {
                Flag::Value { value_name, help, dash } => {
                    let key = field.key;
                    let arg = Arg::new(key).long(key).value_name(value_name).help(help).action(ArgAction::Set);
                    let arg = match field.words {
                        [] => {
                            arg.value_parser(move |s: &str| PolicyEdit::default().set(key, s).map(|()| s.to_string()))
                        }
                        words => arg.value_parser(PossibleValuesParser::new(words)),
                    };
                    cmd = cmd.arg(match dash {
                        Dash::None => arg,
                        Dash::Numbers => arg.allow_negative_numbers(true),
                        Dash::Any => arg.allow_hyphen_values(true),
                    });
                }
                Flag::Words(words) => {
                    for (i, (word, help)) in words.iter().enumerate() {
                        let later = words[i + 1..].iter().map(|(w, _)| *w);
                        cmd = cmd.arg(
                            Arg::new(*word)
                                .long(*word)
                                .help(*help)
                                .action(ArgAction::SetTrue)
                                .conflicts_with_all(later),
                        );
                    }
                }
            }
        }
        cmd
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for PolicySetArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let missing = || clap::Error::new(clap::error::ErrorKind::MissingRequiredArgument);
        let name = m.get_one::<Name>("name").ok_or_else(missing)?.clone();
        let mut edit = PolicyEdit::default();
        // Checked by the flags' parsers already: a field refused here is a bug, said as such.
        let invalid = |e: String| clap::Error::raw(clap::error::ErrorKind::ValueValidation, e);
        for field in FIELDS {
            match field.flag {
                Flag::Value { .. } => {
                    if let Some(text) = m.get_one::<String>(field.key) {
                        edit.set(field.key, text).map_err(invalid)?;
                    }
                }
                Flag::Words(words) => {
                    for (word, _) in words.iter().filter(|(word, _)| m.get_flag(word)) {
                        edit.set(field.key, word).map_err(invalid)?;
                    }
                }
            }
        }
        Ok(Self { name, edit })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl PolicySetArgs {
    /// The fields given, as the daemon applies them (see [`PolicyEdit::apply`]).
    pub(crate) fn edit(&self) -> PolicyEdit {
        self.edit.clone()
    }
}

#[derive(Debug, Subcommand)]
pub(crate) enum ListCommand {
    /// Add IPv4 or IPv6 networks (e.g. 198.18.0.0/24, 2001:db8::/48): permanent (written to the
    /// config file), or with --for expiring (a ban, kept in the daemon's state directory).
    ///
    /// All or nothing: one malformed network or duration refuses the whole command (exit 2).
    /// Expiring entries go 1,000 per request, each applied whole: a connection lost partway is
    /// said with how many were applied, and the same command run again finishes it.
    Add {
        /// The networks; with --for, a bare address stands for itself (/32 or /128).
        #[arg(value_name = "CIDR", required_unless_present = "file")]
        cidrs: Vec<String>,
        /// Expire after this long (e.g. 10m, 600s, 1h30m, or bare seconds: 600), at most 10 years.
        #[arg(long = "for", value_name = "DURATION", value_parser = parse_ban_for, allow_hyphen_values = true)]
        for_: Option<Duration>,
        /// Who asks, for `list`, `stats` and /metrics (with --for) [default: cli].
        #[arg(long, value_name = "ORIGIN", value_parser = parse_origin, requires = "for_")]
        origin: Option<Origin>,
        /// Read the networks from this file, one per line (`-`: standard input; blank lines and
        /// lines starting with # are skipped).
        #[arg(long, value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// Remove networks: the expiring entries of --origin (default cli) for them, else the
    /// permanent entry. With --origin given, a network without an entry is no error.
    ///
    /// Sent 1,000 per request, each applied whole: a connection lost partway is said with how
    /// many were applied, and how to finish.
    Rm {
        /// The networks; a bare address stands for itself (/32 or /128).
        #[arg(value_name = "CIDR", required_unless_present = "file")]
        cidrs: Vec<String>,
        /// Whose expiring entries to remove (others' stay).
        #[arg(long, value_name = "ORIGIN", value_parser = parse_origin)]
        origin: Option<Origin>,
        /// Read the networks from this file, one per line (`-`: standard input).
        #[arg(long, value_name = "FILE")]
        file: Option<PathBuf>,
    },
    /// The networks on the list: permanent ones (origin config) and expiring ones, with their
    /// origin and the time they have left.
    ///
    /// Printed as the daemon sends them, 10,000 at a time: two million in seconds, the list never
    /// whole in memory, other clients answered meanwhile. An entry added or removed while it
    /// runs may be listed or not; every other is listed once. A list cut short (the daemon
    /// stopped) is printed as far as it came, then the error (exit 1).
    List {
        #[arg(long)]
        json: bool,
    },
}

/// Who asks for a ban.
fn parse_origin(s: &str) -> Result<Origin, String> {
    s.parse()
}

/// A ban's duration: humantime's units (`10m`, `1h30m`, `1.5h`) or bare seconds (fail2ban's
/// `<bantime>`), more than 0, at most 10 years ([`config::duration_ns`]).
fn parse_ban_for(s: &str) -> Result<Duration, String> {
    let err = || {
        format!(
            "invalid duration '{s}': expected a duration above 0 such as 10m, 600s or 1h30m (or seconds: 600), at most 10 years"
        )
    };
    // Exact (a fraction of an hour is not rounded through a float), in whole ms rounded up: a
    // ban never shorter than asked.
    let ms = config::duration_ns(s).ok_or_else(err)?.div_ceil(1_000_000);
    if ms == 0 || ms > u128::from(crate::api::ipc::MAX_FOR_MS) {
        return Err(err());
    }
    Ok(Duration::from_millis(ms as u64))
}

/// A program at tcx ingress: its name, or id:N.
pub(super) fn parse_prog(s: &str) -> Result<ProgRef, String> {
    s.parse()
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory as _, Parser as _};

    use super::*;
    use crate::kernel::{HookRequest, Placement, TcApiRequest, TcxPlace};

    /// Each declared field has its `policy set` flag (or a flag per word), and what the flag
    /// gives is what the field's text gives (see `config::def`'s test for the other forms).
    #[test]
    fn every_field_has_its_flag() {
        let top = Cli::command();
        let policy = top.find_subcommand("policy").unwrap();
        let set_cmd = policy.find_subcommand("set").unwrap();
        let longs: Vec<&str> = set_cmd.get_arguments().filter_map(|a| a.get_long()).collect();
        let sample = crate::config::def_tests::every_field_set();
        for (field, (key, text)) in FIELDS.iter().zip(sample.fields()) {
            let mut want = PolicyEdit::default();
            want.set(key, &text).unwrap();
            let flags: Vec<String> = match field.flag {
                Flag::Value { .. } => vec![format!("--{key}"), text.clone()],
                Flag::Words(words) => {
                    assert!(words.iter().any(|(w, _)| *w == text), "{key}: no flag for {text}");
                    assert!(words.iter().all(|(w, _)| field.words.contains(w)), "{key}: {words:?}");
                    vec![format!("--{text}")]
                }
            };
            assert!(longs.contains(&flags[0].trim_start_matches('-')), "{key}: no {} in {longs:?}", flags[0]);
            let argv = ["limiter-ctl", "policy", "set", "dns"].into_iter().map(String::from).chain(flags.clone());
            let cli = Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{flags:?}: {e}"));
            let Command::Policy(PolicyCommand::Set(args)) = cli.command else { panic!("{flags:?}") };
            assert_eq!((args.name.as_str(), args.edit()), ("dns", want), "{flags:?}");
        }
        // No flag a field does not declare, but the name's and the global ones.
        for long in longs {
            let declared = FIELDS.iter().any(|f| match f.flag {
                Flag::Value { .. } => f.key == long,
                Flag::Words(words) => words.iter().any(|(w, _)| *w == long),
            });
            assert!(declared || ["socket", "help"].contains(&long), "--{long} is no field");
        }
    }

    #[test]
    fn words_of_one_field_exclude_each_other() {
        let err = Cli::try_parse_from(["limiter-ctl", "policy", "set", "p", "--dry-run", "--enforce"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
        let err = Cli::try_parse_from(["limiter-ctl", "policy", "set", "p", "--unit", "frames"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue);
    }

    #[test]
    fn the_hook_and_the_place_at_tcx_are_daemon_flags() {
        let options = |extra: &[&str]| {
            let argv = ["limiter-ctl", "daemon", "--iface", "eth0"].into_iter().chain(extra.iter().copied());
            let Command::Daemon(args) = Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{extra:?}: {e}")).command
            else {
                panic!("{extra:?}")
            };
            args.options().placement
        };
        assert_eq!(options(&[]), Placement::default(), "auto, first at tc ingress, the API the kernel has");
        let after = options(&["--attach", "tcx", "--tcx-after", "id:12"]);
        assert_eq!((after.hook, after.tcx), (HookRequest::Tc, TcxPlace::After(ProgRef::Id(12))));
        assert_eq!(options(&["--attach", "tc"]).hook, HookRequest::Tc, "tc and tcx name one hook");
        assert_eq!(options(&["--tc-api", "netlink"]).tc_api, TcApiRequest::Netlink);
        let before = options(&["--tcx-before", "xdpfilt_alw_all"]);
        assert_eq!(before.tcx, TcxPlace::Before(ProgRef::Name("xdpfilt_alw_all".into())));
        let both = ["limiter-ctl", "daemon", "--iface", "e", "--tcx-before", "a", "--tcx-after", "b"];
        assert_eq!(Cli::try_parse_from(both).unwrap_err().kind(), clap::error::ErrorKind::ArgumentConflict);
        for bad in [["--attach", "tc-ingress"], ["--tc-api", "tc"]] {
            let argv = ["limiter-ctl", "daemon", "--iface", "e"].into_iter().chain(bad);
            assert_eq!(Cli::try_parse_from(argv).unwrap_err().kind(), clap::error::ErrorKind::InvalidValue, "{bad:?}");
        }
        for hook in ["tc", "tcx"] {
            let attach = Cli::try_parse_from(["limiter-ctl", "attach", hook, "--after", "id:7"]).expect("attach");
            let Command::Attach { hook: Hook::Tc, before: None, after: Some(ProgRef::Id(7)) } = attach.command else {
                panic!("{attach:?}")
            };
        }
        let both = ["limiter-ctl", "attach", "tcx", "--before", "a", "--after", "b"];
        assert_eq!(Cli::try_parse_from(both).unwrap_err().kind(), clap::error::ErrorKind::ArgumentConflict);
    }
}

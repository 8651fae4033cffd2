//! The CLI room: the argument definitions (`args`, the daemon's in `daemon_args`) and the human
//! and JSON output of the read commands (`show`; `explain`'s in its own module), over the
//! control socket's client (`crate::client`). `main` runs one
//! command and maps its error to the exit code by the error's type; `limiter-ctl daemon` it
//! parses and hands back, for `crate::main` to run in the daemon room.
//!
//! It may use the api room (the daemon's wire types and start options), the kernel room
//! (`detach`, `config check --iface`), the config room, the socket's client and the bouncer
//! (`crowdsec`); nothing of the daemon, and nothing uses it. Its one error type is [`Error`].

mod args;
mod completions;
mod daemon_args;
mod escape;
mod explain;
mod lists;
mod logs;
mod man;
mod show;

use std::{io::Write as _, path::PathBuf, process::ExitCode};

use args::{Cli, Command, ConfigCommand, CrowdsecArgs, PolicyCommand, SaltCommand};
use clap::Parser as _;

use crate::{
    api::{
        ipc::{Attachment, PolicyStatus, Reloaded, ReloadedFirst, Request, Response},
        start::Options,
        stats, top,
    },
    bouncer,
    client::{self, ClientError},
    config::{self, List},
    kernel,
};

/// Exit codes: 0 done, 1 failed, 2 bad input (nothing changed).
const BAD_INPUT: u8 = 2;
const FAILED: u8 = 1;
/// `add --for`: some entries are in force, the daemon's rules refused the others.
const PARTLY: u8 = 3;

/// What a command can fail with; [`exit_code`] tells bad input from failures.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// `config check --iface`: no such interface.
    #[error("interface '{0}' does not exist (see `ip link`; --wait-iface waits for a late one)")]
    NoSuchInterface(String),
    #[error(transparent)]
    Kernel(Box<kernel::Error>),
    #[error(transparent)]
    Client(ClientError),
    /// The daemon refused the request as bad input (nothing changed).
    #[error("{0}")]
    Refused(String),
    /// Arguments clap lets through that do not go together (nothing was sent).
    #[error("{0}")]
    Usage(String),
    /// The daemon could not do what was asked.
    #[error("{0}")]
    Failed(String),
    #[error("unexpected response from the daemon: {0}")]
    Unexpected(serde_json::Error),
    #[error("{0}")]
    Json(serde_json::Error),
    #[error("writing the man pages: {0}")]
    ManPages(std::io::Error),
    /// `config check`: the file cannot be read or does not parse (the error names the file).
    #[error(transparent)]
    BadFile(config::Error),
    /// `config check`: the file parses but does not validate; where, if the error names a place.
    #[error("{}: {error}", place(path, *at))]
    Invalid { path: std::path::PathBuf, at: Option<(usize, usize)>, error: config::Error },
}

/// PATH:LINE:COL, or PATH alone.
fn place(path: &std::path::Path, at: Option<(usize, usize)>) -> String {
    match at {
        Some((line, column)) => format!("{}:{line}:{column}", path.display()),
        None => path.display().to_string(),
    }
}

/// The exit code of an error: 2 for bad input, 1 for a failure.
fn exit_code(e: &Error) -> u8 {
    match e {
        Error::Refused(_) | Error::Usage(_) | Error::BadFile(_) | Error::Invalid { .. } | Error::NoSuchInterface(_) => {
            BAD_INPUT
        }
        Error::Kernel(_)
        | Error::Client(_)
        | Error::Failed(_)
        | Error::Unexpected(_)
        | Error::Json(_)
        | Error::ManPages(_) => FAILED,
    }
}

/// Reports an error in one line on stderr and gives its exit code.
fn fail(e: &Error) -> ExitCode {
    let line = match e {
        // PATH:LINE:COL first, as compilers put it, for editors to jump to.
        Error::BadFile(_) | Error::Invalid { .. } => escape::controls(&e.to_string(), true).into_owned(),
        _ => format!("error: {}", escape::controls(&e.to_string(), true)),
    };
    say(exit_code(e), &line)
}

/// Reports why the daemon stopped, in one line on stderr, and gives its exit `code`: bad input
/// (2) as itself; a failure (1, or 4 for a kernel that cannot run the limiter) saying what
/// failed and every cause, each after a colon.
pub(crate) fn report_failure(e: &(dyn std::error::Error + 'static), code: u8) -> ExitCode {
    if code == BAD_INPUT {
        return say(BAD_INPUT, &format!("error: {}", escape::controls(&e.to_string(), true)));
    }
    let mut line = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        line.push_str(": ");
        line.push_str(&s.to_string());
        source = s.source();
    }
    say(code, &format!("error: {}", escape::controls(&line, false)))
}

/// Writes an error's line on stderr; `code` is the exit code.
fn say(code: u8, line: &str) -> ExitCode {
    // Under systemd (the daemon, ExecReload=): filed in the journal as an error (see `logs`).
    if logs::is_journal(&std::io::stderr()) {
        eprint!("<3>");
    }
    eprintln!("{line}");
    ExitCode::from(code)
}

/// What [`main`] leaves to its caller.
pub(crate) enum Run {
    /// The command ran (or the arguments were refused, or were --help): exit with this.
    Done(ExitCode),
    /// `limiter-ctl daemon`, its logger installed: `crate::main` hands it to the daemon room (the
    /// CLI reaches a daemon over its socket only), and [`report_failure`] says how it failed.
    Daemon { options: Box<Options>, socket: PathBuf },
}

/// `limiter-ctl`: runs the command its arguments name, or returns the daemon's.
pub(crate) fn main() -> Run {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() => {
            eprintln!("{}", escape::controls(&one_line(&e.render().to_string()), false));
            return Run::Done(ExitCode::from(BAD_INPUT));
        }
        Err(e) => {
            // --help, --version (a closed pipe, `| head`, is no error)
            let _ = write!(std::io::stdout(), "{e}");
            return Run::Done(ExitCode::SUCCESS);
        }
    };
    Run::Done(match cli.command {
        Command::Daemon(args) => {
            logs::init(args.log_format);
            return Run::Daemon { options: Box::new(args.options()), socket: cli.socket };
        }
        Command::Man { dir } => match man::write(dir.as_deref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(&Error::ManPages(e)),
        },
        Command::Completions { shell } => {
            let _ = std::io::stdout().write_all(&completions::script(shell));
            ExitCode::SUCCESS
        }
        Command::Policy(cmd) => client(&cli.socket, policy_request(&cmd), |data| match cmd {
            PolicyCommand::List { json } => render::<Vec<PolicyStatus>>(data, json, |all| show::policies(&all)),
            PolicyCommand::Show { json, .. } => render::<PolicyStatus>(data, json, |one| show::policy(&one)),
            _ => Ok(changed(data)),
        }),
        Command::Stats { watch, json } => stats_command(&cli.socket, watch, json),
        Command::Top { limit, json } => client(&cli.socket, Request::Top { limit }, |data| {
            render::<top::Report>(data, json, |report| show::top(&report))
        }),
        Command::Explain(args) => explain::run(&cli.socket, args),
        Command::Salt(SaltCommand::Rotate) => client(&cli.socket, Request::SaltRotate, |_| Ok("salt rotated\n".into())),
        Command::Reload => client(&cli.socket, Request::Reload, |data| {
            let r: Reloaded = serde_json::from_value(data).map_err(Error::Unexpected)?;
            Ok(format!(
                "reloaded {}: {} policies, {} allow and {} deny entries\n",
                escape::controls(&r.config.display().to_string(), false),
                r.policies,
                r.allow,
                r.deny
            ))
        }),
        Command::Attach { hook, before, after } => attach_command(&cli.socket, hook, before, after),
        Command::Crowdsec(args) => crowdsec_command(cli.socket, args),
        Command::Config(ConfigCommand::Check { file, iface }) => match config_check(&file, iface.as_deref()) {
            Ok((summary, notes, warnings)) => {
                println!("{}", escape::controls(&summary, false));
                for note in notes {
                    println!("note: {}", escape::controls(&note, false));
                }
                for warning in warnings {
                    println!("warning: {}", escape::controls(&warning, false));
                }
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        Command::Detach { iface, all, force, pin_dir } => {
            let result = match iface {
                Some(iface) if !all => kernel::detach::detach(&pin_dir, &iface, force),
                _ => kernel::detach::detach_all(&pin_dir, force),
            };
            match result {
                Ok(report) => {
                    print!("{report}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    // What --all did detach is said before what it could not.
                    if let kernel::Error::DetachSome { report, .. } = &e {
                        print!("{report}");
                    }
                    fail(&Error::Kernel(Box::new(e)))
                }
            }
        }
        Command::Allow(cmd) => lists::run(&cli.socket, List::Allow, cmd),
        Command::Deny(cmd) => lists::run(&cli.socket, List::Deny, cmd),
    })
}

/// Clap's error up to its first blank line, as one line: the message, and for a missing
/// argument the argument's name, which clap puts on the next line.
fn one_line(rendered: &str) -> String {
    let text: Vec<&str> = rendered.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
    if text.is_empty() { "error: invalid arguments".into() } else { text.join(" ") }
}

/// `config check FILE`: the file read, parsed and validated as the daemon reads a config (at
/// start and on reload), with no daemon and no kernel; a one-line summary.
/// The summary line, notes (a file from before the format marker), and what the check warns of
/// without refusing the file (one line each).
fn config_check(path: &std::path::Path, iface: Option<&str>) -> Result<(String, Vec<String>, Vec<String>), Error> {
    let max_frame = match iface {
        None => config::DEFAULT_MAX_FRAME,
        Some(iface) => kernel::interface_mtu(iface)
            .map(config::max_frame_for_mtu)
            .ok_or_else(|| Error::NoSuchInterface(iface.to_string()))?,
    };
    let text = config::read(path).map_err(Error::BadFile)?;
    let file = config::parse(path, &text).map_err(Error::BadFile)?;
    let state = match config::State::build_for(&file, &Default::default(), max_frame) {
        Ok(state) => state,
        Err(error) => {
            return Err(Error::Invalid { path: path.to_path_buf(), at: config::position(&text, &error), error });
        }
    };
    let mut summary = format!(
        "{}: ok: {} policies, {} allow and {} deny entries",
        path.display(),
        file.policies.len(),
        file.allow.len(),
        file.deny.len()
    );
    if file.has_no_rules() && !config::says_no_rules(&text) {
        summary.push_str(" (no rules: a reload onto it is refused while rules run, unless it says `policy = []`)");
    }
    let notes = config::unversioned(&text).map(|names| config::unversioned_note(path, &names)).into_iter().collect();
    Ok((summary, notes, state.warnings()))
}

/// `crowdsec`: the bouncer, polling until the process is stopped; exit 2 at once if the URL or
/// the key file cannot be used.
fn crowdsec_command(socket: PathBuf, args: CrowdsecArgs) -> ExitCode {
    let setup = bouncer::stream_url(&args.lapi).and_then(|url| Ok((url, bouncer::read_key(&args.key_file)?)));
    let (url, key) = match setup {
        Ok(both) => both,
        Err(e) => return fail(&Error::Usage(e.to_string())),
    };
    logs::init(args.log_format);
    let lapi = bouncer::Lapi::new(url, key);
    bouncer::run(&lapi, &mut bouncer::DaemonSink { socket }, args.interval)
}

/// `attach HOOK`: the daemon moves the program there without a gap, or says it is there.
fn attach_command(
    socket: &std::path::Path,
    hook: kernel::Hook,
    before: Option<kernel::ProgRef>,
    after: Option<kernel::ProgRef>,
) -> ExitCode {
    let place = match (before, after) {
        (Some(p), _) => Some(kernel::TcxPlace::Before(p)),
        (None, Some(p)) => Some(kernel::TcxPlace::After(p)),
        (None, None) => None,
    };
    if hook == kernel::Hook::Xdp && place.is_some() {
        return fail(&Error::Usage(
            "--before and --after place the limiter at tc ingress; XDP holds one program".into(),
        ));
    }
    let placed = place.is_some();
    client(socket, Request::Attach { hook, place }, |data| {
        let a: Attachment = serde_json::from_value(data).map_err(Error::Unexpected)?;
        let iface = escape::controls(&a.iface, false);
        Ok(match a.moved_from {
            Some(from) => {
                let old = match from.as_str() {
                    "tcx" => "tcx link",
                    "netlink" => "filter at tc ingress",
                    _ => "XDP link",
                };
                let api = a.attach_api_reason.map(|why| format!(" (through netlink: {why})")).unwrap_or_default();
                format!(
                    "moved the limiter on {iface} from {from} to {}{api}: attached at {hook} first, then released its \
                     {old}\n",
                    a.attach_mode
                )
            }
            None if placed => format!(
                "the limiter on {iface} is already at {hook} ({}); nothing changed: it keeps its place at tc ingress \
                 (to place it anew: `limiter-ctl attach xdp`, then `attach tc` with --before or --after)\n",
                a.attach_mode
            ),
            None => format!("the limiter on {iface} is already at {hook} ({}); nothing changed\n", a.attach_mode),
        })
    })
}

/// `stats`, once or (`--watch`) redrawn once a second until interrupted.
fn stats_command(socket: &std::path::Path, watch: bool, json: bool) -> ExitCode {
    loop {
        let code = client(socket, Request::Stats, |data| {
            let text = if json {
                serde_json::to_string(&data).map_err(Error::Json)? + "\n"
            } else {
                serde_json::from_value::<stats::Snapshot>(data).map(|s| show::stats(&s)).map_err(Error::Json)?
            };
            // Like top: home the cursor and clear, then draw.
            Ok(if watch && !json { format!("\x1b[H\x1b[2J{text}") } else { text })
        });
        if !watch || code != ExitCode::SUCCESS {
            return code;
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

fn policy_request(cmd: &PolicyCommand) -> Request {
    match cmd {
        PolicyCommand::Set(args) => Request::PolicySet { name: args.name.clone(), edit: args.edit() },
        PolicyCommand::Rm { name } => Request::PolicyRm { name: name.clone() },
        PolicyCommand::List { .. } => Request::PolicyList,
        PolicyCommand::Show { name, .. } => Request::PolicyShow { name: name.clone() },
    }
}

/// A change applied prints nothing, unless the daemon reloaded a hand edit of its file first:
/// then a note on stderr says so, for the operator to know what else now runs.
fn changed(data: serde_json::Value) -> String {
    if let Ok(ReloadedFirst { reloaded_first: r }) = serde_json::from_value(data) {
        eprintln!(
            "note: {} had changed since the daemon last read it: reloaded it first ({} policies, {} allow and {} \
             deny entries), then applied this change on top",
            r.config.display(),
            r.policies,
            r.allow,
            r.deny
        );
    }
    String::new()
}

/// Renders a response's data as JSON or through `human`.
fn render<T: serde::de::DeserializeOwned>(
    data: serde_json::Value,
    json: bool,
    human: impl FnOnce(T) -> String,
) -> Result<String, Error> {
    if json {
        return serde_json::to_string_pretty(&data).map(|s| s + "\n").map_err(Error::Json);
    }
    serde_json::from_value(data).map(human).map_err(Error::Unexpected)
}

fn client(
    socket: &std::path::Path,
    request: Request,
    output: impl FnOnce(serde_json::Value) -> Result<String, Error>,
) -> ExitCode {
    let text = match client::call(socket, &request) {
        Ok(Response::Ok { data }) => output(data),
        Ok(Response::Usage { error }) => Err(Error::Refused(error)),
        Ok(Response::Failed { error }) => Err(Error::Failed(error)),
        Err(e) => Err(Error::Client(e)),
    };
    match text {
        Ok(text) => {
            let _ = std::io::stdout().write_all(text.as_bytes());
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

//! `allow` and `deny`: permanent entries and bans (`--for`), added, removed and listed.

use std::{io::Write as _, process::ExitCode};

use super::{BAD_INPUT, Error, PARTLY, args::ListCommand, changed, client, escape, fail, say, show};
use crate::{
    api::ipc::{BanAdded, BanStatus, Request, Response},
    config::{self, List},
};

pub(super) fn run(socket: &std::path::Path, list: List, cmd: ListCommand) -> ExitCode {
    let result = match cmd {
        ListCommand::Add { cidrs, for_: Some(d), origin, file } => {
            let added = read_nets(&cidrs, file.as_deref(), true).and_then(|nets| {
                let entries: Vec<_> = nets.into_iter().map(|n| (n, d)).collect();
                client::ban_add(socket, list, origin.unwrap_or_default(), &entries).map_err(|e| {
                    change_error(e, "run the same command again: adding an entry again only sets its expiry anew")
                })
            });
            return match added {
                Ok(answer) => bans_added(&answer),
                Err(e) => fail(&e),
            };
        }
        ListCommand::Add { cidrs, for_: None, file, .. } => {
            read_nets(&cidrs, file.as_deref(), false).and_then(|nets| add_permanent(socket, list, &nets))
        }
        ListCommand::Rm { cidrs, origin, file } => {
            read_nets(&cidrs, file.as_deref(), true).and_then(|nets| remove(socket, list, origin, &nets))
        }
        ListCommand::List { json } => list_entries(socket, list, json),
    };
    match result {
        Ok(text) => {
            let _ = std::io::stdout().write_all(text.as_bytes());
            ExitCode::SUCCESS
        }
        Err(e) => fail(&e),
    }
}

/// What `add --for` says of its bans: nothing when every entry is in force; else each entry the
/// daemon's rules refused on a line of its own, and exit 2 when none is in force (nothing
/// changed), [`PARTLY`] when the others are.
fn bans_added(answer: &BanAdded) -> ExitCode {
    for r in &answer.refused {
        say(BAD_INPUT, &format!("refused: {}: {}", r.cidr, escape::controls(&r.reason, true)));
    }
    match (answer.refused.is_empty(), answer.added) {
        (true, _) => ExitCode::SUCCESS,
        (false, 0) => ExitCode::from(BAD_INPUT),
        (false, _) => ExitCode::from(PARTLY),
    }
}

fn ban_error(e: client::BanCallError) -> Error {
    match e {
        client::BanCallError::Client(e) => Error::Client(e),
        client::BanCallError::Refused(m) => Error::Refused(m),
        client::BanCallError::Failed(m) => Error::Failed(m),
        client::BanCallError::Unexpected(e) => Error::Unexpected(e),
        lost @ client::BanCallError::Lost { .. } => Error::Failed(lost.to_string()),
    }
}

/// A ban change's error; one cut short (the connection lost partway) says how to finish it.
fn change_error(e: client::BanCallError, again: &str) -> Error {
    match e {
        lost @ client::BanCallError::Lost { .. } => Error::Failed(format!("{lost}; once the daemon answers, {again}")),
        e => ban_error(e),
    }
}

/// The networks of the arguments and of `--file` (`-`: standard input), each checked before
/// anything is sent: one bad line refuses them all. `bare`: an address alone is its own /32 or
/// /128.
fn read_nets(args: &[String], file: Option<&std::path::Path>, bare: bool) -> Result<Vec<ipnet::IpNet>, Error> {
    let text = match file {
        None => String::new(),
        Some(p) if p.as_os_str() == "-" => {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
                .map_err(|e| Error::Usage(format!("reading the networks from standard input: {e}")))?;
            text
        }
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| Error::Usage(format!("reading the networks from {}: {e}", p.display())))?,
    };
    let lines = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#'));
    args.iter().map(String::as_str).chain(lines).map(|word| parse_entry(word, bare)).collect()
}

/// One network: CIDR as the config reads it, or (with `bare`) an address alone; host bits
/// refused.
fn parse_entry(word: &str, bare: bool) -> Result<ipnet::IpNet, Error> {
    let net = match word.parse::<std::net::IpAddr>() {
        Ok(addr) if bare => ipnet::IpNet::from(addr),
        _ => config::parse_net(word).map_err(|e| Error::Usage(e.to_string()))?,
    };
    // As the daemon takes it: an IPv4-mapped network is its IPv4 network.
    let net = config::unmapped(net);
    if net.trunc() != net {
        return Err(Error::Usage(config::Error::HostBits { net }.to_string()));
    }
    Ok(net)
}

/// Permanent entries, each written to the config file by the daemon.
fn add_permanent(socket: &std::path::Path, list: List, nets: &[ipnet::IpNet]) -> Result<String, Error> {
    for (i, net) in nets.iter().enumerate() {
        let data = match client::call(socket, &Request::ListAdd { list, cidr: *net }).map_err(Error::Client)? {
            Response::Ok { data } => data,
            Response::Usage { error } if i > 0 => {
                return Err(Error::Refused(format!("{error} (the {i} networks before it were added)")));
            }
            Response::Usage { error } => return Err(Error::Refused(error)),
            Response::Failed { error } => return Err(Error::Failed(error)),
        };
        changed(data);
    }
    Ok(String::new())
}

/// `rm`: each network's expiring entry of the origin, else its permanent entry. Without
/// --origin, a network with neither refuses the command before anything changes.
fn remove(
    socket: &std::path::Path,
    list: List,
    origin: Option<config::Origin>,
    nets: &[ipnet::IpNet],
) -> Result<String, Error> {
    let permanent = |socket| -> Result<Vec<ipnet::IpNet>, Error> {
        match client::call(socket, &Request::ListShow { list }).map_err(Error::Client)? {
            Response::Ok { data } => serde_json::from_value(data).map_err(Error::Unexpected),
            Response::Usage { error } => Err(Error::Refused(error)),
            Response::Failed { error } => Err(Error::Failed(error)),
        }
    };
    let listed: std::collections::HashSet<ipnet::IpNet> = permanent(socket)?.into_iter().collect();
    let by = origin.unwrap_or_default();
    if origin.is_none() {
        // Only these networks' entries, of every origin: the list may hold millions.
        let bans = client::ban_list_of(socket, list, nets).map_err(ban_error)?;
        let ours: std::collections::HashSet<ipnet::IpNet> =
            bans.iter().filter(|b| b.origin == by).map(|b| b.cidr).collect();
        if let Some(missing) = nets.iter().find(|n| !listed.contains(n) && !ours.contains(n)) {
            return Err(Error::Refused(not_removed(list, *missing, &bans)));
        }
    }
    let again = match origin {
        Some(_) => "run the same command again: a network whose entry is gone is no error".to_string(),
        None => format!(
            "finish with `limiter-ctl {list} rm --origin {by}` on the same networks (one whose entry is gone is then \
             no error), then remove any permanent entry among them without --origin",
            list = list.as_str()
        ),
    };
    let removed: std::collections::HashSet<ipnet::IpNet> =
        client::ban_rm(socket, list, by, nets).map_err(|e| change_error(e, &again))?.into_iter().collect();
    // A permanent entry (the config file's) is removed only without `--origin`: an origin's unban
    // (fail2ban's, after its ban already expired) must not take the operator's own entry.
    for net in nets.iter().filter(|n| origin.is_none() && !removed.contains(n) && listed.contains(n)) {
        match client::call(socket, &Request::ListRm { list, cidr: *net }).map_err(Error::Client)? {
            Response::Ok { data } => {
                changed(data);
            }
            Response::Usage { error } => return Err(Error::Refused(error)),
            Response::Failed { error } => return Err(Error::Failed(error)),
        }
    }
    Ok(String::new())
}

/// Why `rm` without --origin cannot remove `net`: not on the list at all, or held by other
/// origins' bans only, which --origin removes.
fn not_removed(list: List, net: ipnet::IpNet, bans: &[BanStatus]) -> String {
    let holders: Vec<&str> = bans.iter().filter(|b| b.cidr == net).map(|b| b.origin.as_str()).collect();
    match holders.first() {
        None => config::Error::NotOnList { net, list }.to_string(),
        Some(first) => format!(
            "{net} is on the {list} list as a ban of origin {} only (not cli, nor the config file): remove it with \
             `limiter-ctl {list} rm {net} --origin {first}`",
            holders.join(" and "),
            list = list.as_str()
        ),
    }
}

/// `list`: the permanent entries (origin `config`, no expiry) then the expiring ones, printed
/// as the daemon sends them, a page at a time (the list is never whole in memory). A list cut
/// short (the daemon stopped) is printed as far as it came, then the error.
fn list_entries(socket: &std::path::Path, list: List, json: bool) -> Result<String, Error> {
    let permanent: Vec<ipnet::IpNet> = match client::call(socket, &Request::ListShow { list }).map_err(Error::Client)? {
        Response::Ok { data } => serde_json::from_value(data).map_err(Error::Unexpected)?,
        Response::Usage { error } => return Err(Error::Refused(error)),
        Response::Failed { error } => return Err(Error::Failed(error)),
    };
    let pages = client::ban_list(socket, list).map_err(Error::Client)?.read_ahead();
    let mut lost = None;
    let bans = pages.map_while(|page| page.map_err(|e| lost = Some(e)).ok()).flatten();
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    let written =
        if json { show::list_json(&mut out, &permanent, bans) } else { show::list(&mut out, &permanent, bans) };
    let written = written.and_then(|()| out.flush());
    if let Some(e) = lost {
        return Err(ban_error(e));
    }
    match written {
        // A reader that had enough (`| head`).
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(String::new()),
        Err(e) => Err(Error::Failed(format!("writing the list: {e}"))),
        Ok(()) => Ok(String::new()),
    }
}

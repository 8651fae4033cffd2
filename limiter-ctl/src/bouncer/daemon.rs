//! The daemon side: where the bans go (the daemon's deny list, through its control socket), and
//! how a request the daemon refuses is split down to the entry at fault.

use std::{path::PathBuf, time::Duration};

use ipnet::IpNet;

use crate::{
    api::ipc::{BanRefused, Request, Response},
    client::{self, BanCallError},
    config::{List, Origin},
};

/// Where the bans go: the daemon's deny list, through its socket.
pub(crate) trait Sink {
    fn add(&mut self, entries: &[(IpNet, Duration)]) -> Result<(), String>;
    fn rm(&mut self, nets: &[IpNet]) -> Result<(), String>;
    /// The networks the daemon holds an entry of ours for, each with its time left.
    fn listed(&mut self) -> Result<Vec<(IpNet, Duration)>, String>;
    /// Which daemon answers: the instance its `stats` names, drawn at its start, so another
    /// one is a restarted daemon (None: a daemon that names none).
    fn instance(&mut self) -> Result<Option<u64>, String>;
}

/// The bouncer's bans, into the daemon's deny list as expiring entries of origin crowdsec.
pub(crate) struct DaemonSink {
    pub socket: PathBuf,
}

impl Sink for DaemonSink {
    fn add(&mut self, entries: &[(IpNet, Duration)]) -> Result<(), String> {
        let socket = self.socket.clone();
        // Applied without these: the daemon's rules (allow list, floor) left them out.
        let mut left_out = Vec::new();
        let refused = bisect(entries, &mut |part: &[(IpNet, Duration)]| {
            client::ban_add(&socket, List::Deny, Origin::Crowdsec, part).map(|added| left_out.extend(added.refused))
        })?;
        report_refused("add", &refused, entries.len());
        report_left_out(&left_out, entries.len());
        Ok(())
    }

    fn rm(&mut self, nets: &[IpNet]) -> Result<(), String> {
        let socket = self.socket.clone();
        let refused =
            bisect(nets, &mut |part: &[IpNet]| client::ban_rm(&socket, List::Deny, Origin::Crowdsec, part).map(drop))?;
        report_refused("removal", &refused, nets.len());
        Ok(())
    }

    fn listed(&mut self) -> Result<Vec<(IpNet, Duration)>, String> {
        // A page at a time: the list may hold millions.
        let unreadable = |e: BanCallError| format!("the daemon's ban list could not be read: {e}");
        let mut ours = Vec::new();
        for page in client::ban_list(&self.socket, List::Deny).map_err(|e| unreadable(e.into()))? {
            let page = page.map_err(unreadable)?;
            ours.extend(
                page.into_iter()
                    .filter(|b| b.origin == Origin::Crowdsec)
                    .map(|b| (b.cidr, Duration::from_millis(b.expires_in_ms))),
            );
        }
        Ok(ours)
    }

    fn instance(&mut self) -> Result<Option<u64>, String> {
        Ok(data(&self.socket, &Request::Stats)?.get("instance").and_then(serde_json::Value::as_u64))
    }
}

/// One request's answer, or why there is none.
fn data(socket: &std::path::Path, request: &Request) -> Result<serde_json::Value, String> {
    match client::call(socket, request) {
        Ok(Response::Ok { data }) => Ok(data),
        Ok(Response::Usage { error } | Response::Failed { error }) => Err(error),
        Err(e) => Err(e.to_string()),
    }
}

/// Sends `items` through `send`; a request the daemon refuses as bad input (nothing of it
/// applied) is split in halves and sent again, down to the one item at fault, so one ban the
/// daemon will not take does not hold back the others. (A ban its rules refuse, broader than
/// the floor or over the allow list, it leaves out itself, applying the rest.) Returns
/// the refused items' first refusal and their count; an error when the daemon cannot be asked.
fn bisect<T>(
    items: &[T],
    send: &mut impl FnMut(&[T]) -> Result<(), BanCallError>,
) -> Result<Option<(String, usize)>, String> {
    if items.is_empty() {
        return Ok(None);
    }
    match send(items) {
        Ok(()) => Ok(None),
        Err(BanCallError::Refused(why)) if items.len() == 1 => Ok(Some((why, 1))),
        Err(BanCallError::Refused(_)) => {
            let (a, b) = items.split_at(items.len() / 2);
            let first = bisect(a, send)?;
            let second = bisect(b, send)?;
            Ok(match (first, second) {
                (Some((why, n)), Some((_, m))) => Some((why, n + m)),
                (one, other) => one.or(other),
            })
        }
        Err(e) => Err(e.to_string()),
    }
}

fn report_refused(what: &str, refused: &Option<(String, usize)>, of: usize) {
    if let Some((why, n)) = refused {
        tracing::warn!(refused = n, of, "the daemon refused {n} ban {what}(s), dropped (first: {why})");
    }
}

/// Bans the daemon's rules left out of an add it applied: said, so an operator sees a feed
/// that reaches for the allow list or past the floor (the daemon says so once per origin, and
/// counts them: `limiter_bans_refused_total`).
fn report_left_out(left_out: &[BanRefused], of: usize) {
    if let Some(first) = left_out.first() {
        let n = left_out.len();
        tracing::warn!(
            left_out = n,
            of,
            "the daemon's ban rules left out {n} ban(s) (first: {}: {})",
            first.cidr,
            first.reason
        );
    }
}

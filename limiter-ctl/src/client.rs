//! The client side of the control socket, shared by the CLI and the bouncer: one request out,
//! its answer back, all within [`DEADLINE`]; a `ban-list` answer a page (a line) at a time, each
//! within [`DEADLINE`] of the last.

use std::{
    io::{self, BufRead as _, BufReader, Read, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, setsockopt, socket, sockopt};

use ipnet::IpNet;

use crate::{
    api::ipc::{BanAdded, BanEntry, BanPage, BanRemoved, BanStatus, MAX_BATCH, Request, Response, Status},
    config::{List, Origin},
};

/// How long one request may take, from connecting to the end of its answer (a `ban-list`: to
/// each line of it).
pub(crate) const DEADLINE: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    #[error("no daemon is listening on {0} (start one with `limiter-ctl daemon --iface IFACE`, or pass --socket)")]
    NoDaemon(PathBuf),
    #[error(
        "permission denied on {0}: the control socket serves root and the daemon's user (and the daemon's --socket-group, if any) only; run as root"
    )]
    Permission(PathBuf),
    #[error("talking to the daemon on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("the daemon on {path} sent an unreadable response: {source}")]
    Protocol { path: PathBuf, source: serde_json::Error },
    #[error("the daemon on {} closed the connection before it answered (stopped or killed?)", .0.display())]
    Closed(PathBuf),
    #[error(
        "the daemon on {} closed the connection after {entries} entries of the list, before its end: the list is \
         incomplete; try again",
        .path.display()
    )]
    Cut { path: PathBuf, entries: usize },
    #[error(
        "the daemon on {} did not take the connection within {} s; nothing was sent; try again",
        .0.display(),
        DEADLINE.as_secs()
    )]
    NotTaken(PathBuf),
    // The request may sit in the daemon's queue: it is applied whole or not at all, but this
    // client cannot know which.
    #[error(
        "timed out after {} s waiting for the daemon on {}; the daemon may still apply the request: check (`list`, `policy show`) before repeating it",
        DEADLINE.as_secs(),
        .0.display()
    )]
    TimedOut(PathBuf),
}

impl ClientError {
    /// Whether the request may have reached the daemon (and been applied).
    fn maybe_applied(&self) -> bool {
        !matches!(self, Self::NoDaemon(_) | Self::Permission(_) | Self::NotTaken(_))
    }
}

/// Sends one request and waits for its response, connecting, sending and reading all within
/// [`DEADLINE`].
pub(crate) fn call(socket: &Path, request: &Request) -> Result<Response, ClientError> {
    let mut exchange = Exchange::open(socket, request)?;
    let mut line = Vec::new();
    if !exchange.line(&mut line)? {
        return Err(ClientError::Closed(exchange.path));
    }
    serde_json::from_slice(&line).map_err(|source| ClientError::Protocol { path: exchange.path, source })
}

/// A request sent, its answer read a line at a time: the first line within [`DEADLINE`] of
/// connecting, each other within [`DEADLINE`] of the one before.
struct Exchange {
    path: PathBuf,
    reader: BufReader<Deadlined>,
    /// Sending failed: a daemon that refuses the connection (too many open) answers and closes
    /// before reading, and its answer is still there to read; else this is the error.
    unsent: Option<io::Error>,
}

/// The stream, each read bounded by what is left until `deadline`.
struct Deadlined {
    stream: UnixStream,
    deadline: Instant,
}

impl Read for Deadlined {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero());
        self.stream.set_read_timeout(Some(left.ok_or(io::ErrorKind::TimedOut)?))?;
        self.stream.read(buf)
    }
}

impl Exchange {
    fn open(socket: &Path, request: &Request) -> Result<Self, ClientError> {
        let deadline = Instant::now() + DEADLINE;
        let path = socket.to_path_buf();
        let stream = connect_within(socket, DEADLINE).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => ClientError::NoDaemon(path.clone()),
            io::ErrorKind::PermissionDenied => ClientError::Permission(path.clone()),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::NotTaken(path.clone()),
            _ => ClientError::Io { path: path.clone(), source: e },
        })?;
        let mut line =
            serde_json::to_vec(request).map_err(|e| ClientError::Io { path: path.clone(), source: e.into() })?;
        line.push(b'\n');
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let sent = stream.set_write_timeout(Some(left)).and_then(|()| (&stream).write_all(&line));
        // Big enough for a page of a list in a few reads.
        let reader = BufReader::with_capacity(1 << 16, Deadlined { stream, deadline });
        Ok(Self { path, reader, unsent: sent.err() })
    }

    /// The next line of the answer into `line`, without its newline; false when the daemon
    /// closed the connection before a whole line.
    fn line(&mut self, line: &mut Vec<u8>) -> Result<bool, ClientError> {
        line.clear();
        let read = self.reader.read_until(b'\n', line);
        let whole = line.last() == Some(&b'\n');
        let error = |e: io::Error| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::TimedOut(self.path.clone()),
            _ => ClientError::Io { path: self.path.clone(), source: e },
        };
        match (read, self.unsent.take()) {
            (_, Some(e)) if !whole => Err(error(e)),
            (Err(e), _) => Err(error(e)),
            (Ok(_), _) if whole => {
                line.pop();
                self.reader.get_mut().deadline = Instant::now() + DEADLINE;
                Ok(true)
            }
            (Ok(_), _) => Ok(false),
        }
    }
}

/// The answer to a `ban-list`, a page at a time as the daemon sends it (`api::ipc::BanPage`).
pub(crate) struct BanPages {
    exchange: Exchange,
    line: Vec<u8>,
    /// Entries read so far.
    entries: usize,
    done: bool,
}

impl Iterator for BanPages {
    type Item = Result<Vec<BanStatus>, BanCallError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        // Until a page says another follows.
        self.done = true;
        let read = self.exchange.line(&mut self.line);
        let path = || self.exchange.path.clone();
        let page = match read {
            Ok(true) => serde_json::from_slice::<BanPage>(&self.line),
            Ok(false) if self.entries == 0 => return Some(Err(ClientError::Closed(path()).into())),
            Ok(false) => return Some(Err(ClientError::Cut { path: path(), entries: self.entries }.into())),
            Err(e) => return Some(Err(e.into())),
        };
        Some(match page {
            Err(source) => Err(ClientError::Protocol { path: path(), source }.into()),
            Ok(BanPage { status: Status::Ok, data, more, .. }) => {
                self.done = !more;
                self.entries += data.len();
                Ok(data.into_owned())
            }
            Ok(BanPage { status: Status::Usage, error, .. }) => Err(BanCallError::Refused(error.unwrap_or_default())),
            Ok(BanPage { status: Status::Failed, error, .. }) => Err(BanCallError::Failed(error.unwrap_or_default())),
        })
    }
}

impl BanPages {
    /// The pages read on a thread of their own, as fast as the daemon sends them, whatever the
    /// taker does meanwhile: the daemon drops a client that takes nothing for 2 s, and a pager
    /// (`deny list | less`) may wait longer than that. What is not taken yet waits here.
    pub(crate) fn read_ahead(self) -> impl Iterator<Item = Result<Vec<BanStatus>, BanCallError>> {
        let (pages, taken) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for page in self {
                if pages.send(page).is_err() {
                    break;
                }
            }
        });
        taken.into_iter()
    }
}

/// The expiring entries of a list, a page at a time as the daemon sends them: the whole list
/// is never in the daemon's memory (nor here, unless the pages are not taken).
pub(crate) fn ban_list(socket: &Path, list: List) -> Result<BanPages, ClientError> {
    ban_pages(socket, &Request::BanList { list, cidrs: None })
}

/// The expiring entries of a list for these networks, of every origin.
pub(crate) fn ban_list_of(socket: &Path, list: List, nets: &[IpNet]) -> Result<Vec<BanStatus>, BanCallError> {
    let mut found = Vec::new();
    for chunk in nets.chunks(MAX_BATCH) {
        for page in ban_pages(socket, &Request::BanList { list, cidrs: Some(chunk.to_vec()) })? {
            found.extend(page?);
        }
    }
    Ok(found)
}

fn ban_pages(socket: &Path, request: &Request) -> Result<BanPages, ClientError> {
    Ok(BanPages { exchange: Exchange::open(socket, request)?, line: Vec::new(), entries: 0, done: false })
}

/// Connects, waiting at most `limit` for a daemon whose backlog is full (SO_SNDTIMEO bounds a
/// Unix connect(2); std's connect has no timeout).
fn connect_within(path: &Path, limit: Duration) -> io::Result<UnixStream> {
    let fd = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    let timeout = nix::sys::time::TimeVal::new(limit.as_secs() as _, limit.subsec_micros() as _);
    setsockopt(&fd, sockopt::SendTimeout, &timeout)?;
    let addr = UnixAddr::new(path)?;
    loop {
        match connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &addr) {
            Ok(()) => return Ok(UnixStream::from(fd)),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// How a ban request went: done, refused as bad input, or failed (with what was done before).
#[derive(Debug, thiserror::Error)]
pub(crate) enum BanCallError {
    #[error(transparent)]
    Client(#[from] ClientError),
    /// Bad input: nothing of this chunk changed (earlier chunks, if any, stay applied).
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    Failed(String),
    #[error("unexpected response from the daemon: {0}")]
    Unexpected(serde_json::Error),
    /// The connection failed partway: the chunks answered were applied, the one in flight (if
    /// it was sent) may have been, the rest were not sent.
    #[error("{source}: {}", lost_note(*.done, *.maybe, *.total))]
    Lost { source: ClientError, done: usize, maybe: usize, total: usize },
}

/// What a request cut short did: `done` entries applied (answered), `maybe` sent but not
/// answered, of `total`.
fn lost_note(done: usize, maybe: usize, total: usize) -> String {
    let rest = total.saturating_sub(done + maybe);
    if done == 0 && rest == 0 {
        return format!("none of the {total} entries was confirmed applied; they may have been");
    }
    let mut said = vec![match done {
        0 => format!("none of the {total} entries was confirmed applied"),
        done => format!("of {total} entries, the first {done} were applied"),
    }];
    if maybe > 0 {
        said.push(format!("the {} {maybe} may have been", if done == 0 { "first" } else { "next" }));
    }
    if rest > 0 {
        said.push(format!("the last {rest} were not sent"));
    }
    said.join(", ")
}

/// Sends one request, its answer's data or why not.
fn call_data(socket: &Path, request: &Request) -> Result<serde_json::Value, BanCallError> {
    match call(socket, request)? {
        Response::Ok { data } => Ok(data),
        Response::Usage { error } => Err(BanCallError::Refused(error)),
        Response::Failed { error } => Err(BanCallError::Failed(error)),
    }
}

/// Says how many entries went through before a chunk (of `sent` entries) failed, when some
/// did or when the failed one may have: the chunks answered are counted.
fn after_chunks(e: BanCallError, done: usize, sent: usize, total: usize) -> BanCallError {
    let note = |m: String| format!("{m} (the first {done} of {total} entries were applied before this)");
    match e {
        BanCallError::Client(source) if done > 0 || source.maybe_applied() => {
            let maybe = if source.maybe_applied() { sent } else { 0 };
            BanCallError::Lost { source, done, maybe, total }
        }
        e if done == 0 => e,
        BanCallError::Refused(m) => BanCallError::Refused(note(m)),
        BanCallError::Failed(m) => BanCallError::Failed(note(m)),
        other => other,
    }
}

/// Adds expiring entries (bans) through the daemon, [`MAX_BATCH`] per request: each request is
/// applied whole or not at all (less the entries the daemon's rules refuse), and other clients
/// are answered between them. Returns how many were added and the refused ones. Shared by
/// `deny|allow add --for`, fail2ban's action and the CrowdSec bouncer.
pub(crate) fn ban_add(
    socket: &Path,
    list: List,
    origin: Origin,
    entries: &[(IpNet, Duration)],
) -> Result<BanAdded, BanCallError> {
    let mut total = BanAdded::default();
    for (i, chunk) in entries.chunks(MAX_BATCH).enumerate() {
        let batch = chunk
            .iter()
            .map(|(cidr, d)| BanEntry { cidr: *cidr, for_ms: u64::try_from(d.as_millis()).unwrap_or(u64::MAX) })
            .collect();
        let data = call_data(socket, &Request::BanAdd { list, origin, entries: batch })
            // Positional: the chunks before this one were answered (their refused entries too).
            .map_err(|e| after_chunks(e, i * MAX_BATCH, chunk.len(), entries.len()))?;
        let answer: BanAdded = serde_json::from_value(data).map_err(BanCallError::Unexpected)?;
        total.added += answer.added;
        total.refused.extend(answer.refused);
    }
    Ok(total)
}

/// Removes the expiring entries of `origin` for these networks, [`MAX_BATCH`] per request;
/// returns the networks that had one (a network without one is no error).
pub(crate) fn ban_rm(socket: &Path, list: List, origin: Origin, cidrs: &[IpNet]) -> Result<Vec<IpNet>, BanCallError> {
    let mut removed = Vec::new();
    for (i, chunk) in cidrs.chunks(MAX_BATCH).enumerate() {
        let data = call_data(socket, &Request::BanRm { list, origin, cidrs: chunk.to_vec() })
            .map_err(|e| after_chunks(e, i * MAX_BATCH, chunk.len(), cidrs.len()))?;
        let answer: BanRemoved = serde_json::from_value(data).map_err(BanCallError::Unexpected)?;
        removed.extend(answer.cidrs);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request cut short says what was applied, what may have been and what was not sent;
    /// one whose connection never opened (nothing sent) is said as it was.
    #[test]
    fn a_request_cut_short_says_what_was_applied() {
        let lost = |e, done, sent, total| after_chunks(BanCallError::Client(e), done, sent, total).to_string();
        let reset = || ClientError::Closed(PathBuf::from("/run/limiter/ctl.sock"));
        assert!(
            lost(reset(), 372_000, 1000, 1_048_575).ends_with(
                "of 1048575 entries, the first 372000 were applied, the next 1000 may have been, the last 675575 \
                 were not sent"
            ),
            "{}",
            lost(reset(), 372_000, 1000, 1_048_575)
        );
        assert!(lost(reset(), 0, 1000, 5000).ends_with(
            "none of the 5000 entries was confirmed applied, the first 1000 may have been, the last 4000 were not sent"
        ));
        assert!(lost(reset(), 0, 3, 3).ends_with("none of the 3 entries was confirmed applied; they may have been"));
        let gone = || ClientError::NoDaemon(PathBuf::from("/run/limiter/ctl.sock"));
        assert!(
            lost(gone(), 2000, 1000, 5000)
                .ends_with("of 5000 entries, the first 2000 were applied, the last 3000 were not sent")
        );
        assert_eq!(lost(gone(), 0, 1000, 5000), gone().to_string(), "nothing sent, nothing to count");
    }
}

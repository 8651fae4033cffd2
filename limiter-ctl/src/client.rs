//! The client side of the control socket, shared by the CLI and the bouncer: one request out,
//! one response back, all within [`DEADLINE`].

use std::{
    io::{self, Read as _, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, setsockopt, socket, sockopt};

use ipnet::IpNet;

use crate::{
    api::ipc::{BanAdded, BanEntry, BanRemoved, MAX_BATCH, Request, Response},
    config::{List, Origin},
};

/// How long one request may take, from connecting to the end of its answer.
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

/// Sends one request and waits for its response, connecting, sending and reading all within
/// [`DEADLINE`].
pub(crate) fn call(socket: &Path, request: &Request) -> Result<Response, ClientError> {
    let deadline = Instant::now() + DEADLINE;
    let path = || socket.to_path_buf();
    let io_err = |source| ClientError::Io { path: path(), source };
    let stream = connect_within(socket, DEADLINE).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => ClientError::NoDaemon(path()),
        io::ErrorKind::PermissionDenied => ClientError::Permission(path()),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::NotTaken(path()),
        _ => io_err(e),
    })?;
    // What is left of the deadline, or a timeout error once it has passed.
    let left = || {
        deadline.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()).ok_or(ClientError::TimedOut(path()))
    };
    let timed_out = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::TimedOut(path()),
        _ => io_err(e),
    };
    let mut line = serde_json::to_string(request).map_err(|e| io_err(io::Error::other(e)))?;
    line.push('\n');
    stream.set_write_timeout(Some(left()?)).map_err(io_err)?;
    let sent = (&stream).write_all(line.as_bytes());
    // A daemon that refuses the connection (too many open) answers and closes before reading:
    // its answer is still there to read after the write failed.
    let mut reply = Vec::new();
    let read = read_line(&stream, &mut reply, &left);
    match (sent, read) {
        (Err(e), _) if reply.is_empty() => return Err(timed_out(e)),
        (_, Err(e)) => return Err(e.either(timed_out)),
        _ => {}
    }
    serde_json::from_slice(&reply).map_err(|source| ClientError::Protocol { path: path(), source })
}

/// A read that failed, or ran out of time.
enum ReadError {
    Io(io::Error),
    Late(ClientError),
}

impl ReadError {
    fn either(self, io: impl FnOnce(io::Error) -> ClientError) -> ClientError {
        match self {
            Self::Io(e) => io(e),
            Self::Late(e) => e,
        }
    }
}

/// Reads up to the first newline (or the end), each read bounded by what is left.
fn read_line(
    mut stream: &UnixStream,
    reply: &mut Vec<u8>,
    left: &impl Fn() -> Result<Duration, ClientError>,
) -> Result<(), ReadError> {
    let mut chunk = [0; 4096];
    while !reply.contains(&b'\n') {
        stream.set_read_timeout(Some(left().map_err(ReadError::Late)?)).map_err(ReadError::Io)?;
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => reply.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
    Ok(())
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
}

/// Sends one request, its answer's data or why not.
fn call_data(socket: &Path, request: &Request) -> Result<serde_json::Value, BanCallError> {
    match call(socket, request)? {
        Response::Ok { data } => Ok(data),
        Response::Usage { error } => Err(BanCallError::Refused(error)),
        Response::Failed { error } => Err(BanCallError::Failed(error)),
    }
}

/// Says how many chunks went through before one failed, when some did.
fn after_chunks(e: BanCallError, done: usize, total: usize) -> BanCallError {
    if done == 0 {
        return e;
    }
    let note = |m: String| format!("{m} (the first {done} of {total} entries were applied before this)");
    match e {
        BanCallError::Refused(m) => BanCallError::Refused(note(m)),
        BanCallError::Failed(m) => BanCallError::Failed(note(m)),
        other => other,
    }
}

/// Adds expiring entries (bans) through the daemon, [`MAX_BATCH`] per request: each request is
/// applied whole or not at all, and other clients are answered between them. Returns how many
/// were added. Shared by `deny|allow add --for`, fail2ban's action and the CrowdSec bouncer.
pub(crate) fn ban_add(
    socket: &Path,
    list: List,
    origin: Origin,
    entries: &[(IpNet, Duration)],
) -> Result<usize, BanCallError> {
    let mut added = 0;
    for chunk in entries.chunks(MAX_BATCH) {
        let batch = chunk
            .iter()
            .map(|(cidr, d)| BanEntry { cidr: *cidr, for_ms: u64::try_from(d.as_millis()).unwrap_or(u64::MAX) })
            .collect();
        let data = call_data(socket, &Request::BanAdd { list, origin, entries: batch })
            .map_err(|e| after_chunks(e, added, entries.len()))?;
        let answer: BanAdded = serde_json::from_value(data).map_err(BanCallError::Unexpected)?;
        added += answer.added;
    }
    Ok(added)
}

/// Removes the expiring entries of `origin` for these networks, [`MAX_BATCH`] per request;
/// returns the networks that had one (a network without one is no error).
pub(crate) fn ban_rm(socket: &Path, list: List, origin: Origin, cidrs: &[IpNet]) -> Result<Vec<IpNet>, BanCallError> {
    let mut removed = Vec::new();
    for (i, chunk) in cidrs.chunks(MAX_BATCH).enumerate() {
        let data = call_data(socket, &Request::BanRm { list, origin, cidrs: chunk.to_vec() })
            .map_err(|e| after_chunks(e, i * MAX_BATCH, cidrs.len()))?;
        let answer: BanRemoved = serde_json::from_value(data).map_err(BanCallError::Unexpected)?;
        removed.extend(answer.cidrs);
    }
    Ok(removed)
}

//! The client side of the control socket: one request out, one response back.

use std::{
    io::{self, BufRead as _, BufReader, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use crate::daemon::ipc::{Request, Response};

#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    #[error("no daemon is listening on {0} (start one with `limiter-ctl daemon --iface IFACE`, or pass --socket)")]
    NoDaemon(PathBuf),
    #[error("permission denied on {0}: the control socket is root-only (mode 0600); run as root")]
    Permission(PathBuf),
    #[error("talking to the daemon on {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("the daemon on {path} sent an unreadable response: {source}")]
    Protocol { path: PathBuf, source: serde_json::Error },
}

/// Sends one request and waits (up to 30 s) for its response.
pub(super) fn call(socket: &Path, request: &Request) -> Result<Response, ClientError> {
    let io_err = |source| ClientError::Io { path: socket.to_path_buf(), source };
    let stream = UnixStream::connect(socket).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => ClientError::NoDaemon(socket.to_path_buf()),
        io::ErrorKind::PermissionDenied => ClientError::Permission(socket.to_path_buf()),
        _ => io_err(e),
    })?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).map_err(io_err)?;
    let mut line = serde_json::to_string(request).map_err(|e| io_err(io::Error::other(e)))?;
    line.push('\n');
    let sent = (&stream).write_all(line.as_bytes());
    // A daemon that refuses the connection (too many open) answers and closes before reading:
    // its answer is still there to read after the write failed.
    let mut reply = String::new();
    let read = BufReader::new(&stream).read_line(&mut reply);
    match (sent, read) {
        (Err(e), _) if reply.is_empty() => return Err(io_err(e)),
        (_, Err(e)) => return Err(io_err(e)),
        _ => {}
    }
    serde_json::from_str(&reply).map_err(|source| ClientError::Protocol { path: socket.to_path_buf(), source })
}

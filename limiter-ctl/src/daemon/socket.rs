//! The control socket's server side: bound so no one else can reach it (`bind`), connections
//! accepted from root and the daemon's own user only (at most [`MAX_CONNECTIONS`] at once, one
//! more told so and closed), and each served in a task of its own: its request line read
//! within [`READ_DEADLINE`], handed to the loop as a [`Job`], the loop's answer written back
//! within [`WRITE_DEADLINE`]. So no client, however slow, holds up the loop, the stats tick,
//! other clients or a signal. One JSON line each way (`api::ipc`), but for `ban-list`, whose
//! answer comes a line per page of the bans (`listing`), each within [`WRITE_DEADLINE`].

use std::{
    io,
    os::unix::fs::{DirBuilderExt as _, FileTypeExt as _, PermissionsExt as _},
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _, BufReader},
    net::{UnixListener, UnixStream},
    sync::{Semaphore, mpsc, oneshot},
};
use tracing::warn;

use super::{
    Error,
    listing::{self, Loop},
    throttled::Throttled,
};
use crate::api::ipc::{MAX_REQUEST, Request, Response};

/// Control connections served at once; one more is told so in one line and closed.
pub(crate) const MAX_CONNECTIONS: usize = 256;
/// A client has this long from connecting to send its whole request line.
const READ_DEADLINE: Duration = Duration::from_secs(2);
/// And this long to take its answer.
const WRITE_DEADLINE: Duration = Duration::from_secs(2);

/// A request read whole from a client, for the loop, and where its answer goes.
pub(super) struct Job {
    pub(super) request: Request,
    pub(super) received: Instant,
    pub(super) answer: oneshot::Sender<Response>,
}

/// Binds the control socket, refusing to take it from a running daemon. It is never reachable
/// by anyone else, whatever the umask: bound in a fresh 0700 directory of the daemon's own,
/// made 0600 there, and only then linked into place. (Bound in place, it would be open to all
/// between bind(2) and chmod(2) under a lax umask, and a connection made then stays open.)
pub(super) fn bind(path: &Path) -> Result<UnixListener, Error> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // Directories made here are 0755 even under umask 0: no one else may swap the socket.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|source| Error::CreateSocketDir { dir: dir.to_path_buf(), source })?;
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(Error::SocketTaken { path: path.to_path_buf() });
    }
    match std::fs::symlink_metadata(path) {
        // Left by a daemon that died: nothing answers on it.
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)
            .map_err(|source| Error::RemoveStaleSocket { path: path.to_path_buf(), source })?,
        Ok(_) => return Err(Error::NotASocket { path: path.to_path_buf() }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(Error::CheckSocket { path: path.to_path_buf(), source }),
    }
    let bind_err = |source| Error::Bind { path: path.to_path_buf(), source };
    // Removed on return, with the staged name in it: the socket lives on under `path`.
    let private = tempfile::Builder::new().prefix(".lmt").tempdir_in(dir).map_err(bind_err)?;
    let staged = private.path().join("s");
    let listener = UnixListener::bind(&staged).map_err(bind_err)?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o600))
        .map_err(|source| Error::RestrictSocket { path: path.to_path_buf(), source })?;
    // A link, not a rename: a socket another daemon bound there meanwhile is not replaced.
    std::fs::hard_link(&staged, path).map_err(|source| match source.kind() {
        io::ErrorKind::AlreadyExists => Error::SocketTaken { path: path.to_path_buf() },
        _ => bind_err(source),
    })?;
    Ok(listener)
}

/// Serves the control socket in a task of its own, until the returned guard is dropped (when
/// the loop ends; connections still open are dropped with the runtime). Each request read
/// whole comes out of the receiver, for the loop to answer; a `ban-list` is answered page by
/// page through `bans`.
pub(super) fn spawn(listener: UnixListener, bans: Loop) -> (AbortOnDrop, mpsc::Receiver<Job>) {
    let (jobs_in, jobs) = mpsc::channel(MAX_CONNECTIONS);
    (AbortOnDrop(tokio::spawn(accept(listener, jobs_in, bans))), jobs)
}

/// Aborts a task when dropped.
pub(super) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Accepts control connections from root or the daemon's own user, each served by a task of
/// its own, at most [`MAX_CONNECTIONS`] at once.
async fn accept(listener: UnixListener, jobs: mpsc::Sender<Job>, bans: Loop) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let (mut refused, mut failing) = (Throttled::default(), Throttled::default());
    loop {
        match listener.accept().await {
            Ok((stream, _)) if !may_control(stream.peer_cred().ok().map(|c| c.uid())) => {
                let peer = stream.peer_cred().ok(); // for the log line only
                refuse(&stream, "permission denied: the control socket serves root and the daemon's own user only");
                if let Some(unlogged) = refused.hit() {
                    warn!(
                        uid = peer.map(|c| c.uid()),
                        pid = peer.and_then(|c| c.pid()),
                        unlogged,
                        "control connection refused: the peer is neither root nor the daemon's user"
                    );
                }
            }
            Ok((stream, _)) => match slots.clone().try_acquire_owned() {
                Ok(slot) => {
                    let (jobs, bans) = (jobs.clone(), bans.clone());
                    tokio::spawn(async move {
                        if let Err(e) = connection(stream, jobs, bans).await {
                            warn!(error = %e, "control connection dropped");
                        }
                        drop(slot);
                    });
                }
                Err(_) => refuse_busy(&stream),
            },
            Err(e) => {
                if let Some(unlogged) = failing.hit() {
                    warn!(error = %e, unlogged, "accepting a control connection failed");
                }
                // Out of descriptors, most likely: give the open connections time to end.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Whether a peer may use the control socket: root, or the daemon's own user. The socket's
/// mode already keeps others out; this holds should the mode or its directory be loosened.
fn may_control(peer: Option<u32>) -> bool {
    peer.is_some_and(|uid| uid == 0 || uid == nix::unistd::geteuid().as_raw())
}

/// One line to a client beyond [`MAX_CONNECTIONS`], without waiting: a fresh socket's buffer
/// holds it.
fn refuse_busy(stream: &UnixStream) {
    refuse(stream, &format!("the daemon is serving {MAX_CONNECTIONS} control connections already; try again"));
    warn!(max = MAX_CONNECTIONS, "control connection refused: too many open");
}

/// Tells a client in one line why it is refused, without waiting, and leaves it (the stream
/// closes when dropped).
fn refuse(stream: &UnixStream, why: &str) {
    if let Ok(mut line) = serde_json::to_string(&Response::Failed { error: why.to_string() }) {
        line.push('\n');
        let _ = stream.try_write(line.as_bytes());
    }
}

/// One connection: its request line within [`READ_DEADLINE`], to the loop, and the loop's
/// answer back within [`WRITE_DEADLINE`].
async fn connection(stream: UnixStream, jobs: mpsc::Sender<Job>, bans: Loop) -> io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let mut reader = BufReader::new(read.take(MAX_REQUEST as u64));
    let timed_out = |what: &str, deadline: Duration| {
        io::Error::new(io::ErrorKind::TimedOut, format!("{what} within {} s", deadline.as_secs()))
    };
    let read = tokio::time::timeout(READ_DEADLINE, reader.read_line(&mut line)).await;
    if read.map_err(|_| timed_out("no whole request", READ_DEADLINE))?? == 0 {
        // Connected and left without a word.
        return Ok(());
    }
    let response = match serde_json::from_str::<Request>(&line) {
        Ok(Request::BanList { list, cidrs }) => {
            return listing::answer(list, cidrs, &mut write, &bans, WRITE_DEADLINE).await;
        }
        Ok(request) => {
            let (answer, answered) = oneshot::channel();
            let job = Job { request, received: Instant::now(), answer };
            // Either fails only when the loop has ended: the daemon is stopping.
            if jobs.send(job).await.is_err() {
                return Ok(());
            }
            match answered.await {
                Ok(response) => response,
                Err(_) => return Ok(()),
            }
        }
        Err(e) => Response::Usage { error: format!("unreadable request: {e}") },
    };
    let mut reply = serde_json::to_string(&response).map_err(io::Error::other)?;
    reply.push('\n');
    let written = tokio::time::timeout(WRITE_DEADLINE, write.write_all(reply.as_bytes())).await;
    written.map_err(|_| timed_out("the answer not taken", WRITE_DEADLINE))?
}

//! The control socket's server side: bound so no one else can reach it (`bind`), connections
//! accepted from root and the daemon's own user (at most [`MAX_CONNECTIONS`] at once, one
//! more told so and closed), and from the feeders' group (`--socket-group`) for what a ban
//! feeder needs only ([`feeder_may`]); each served in a task of its own: its request line read
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
use crate::{
    api::ipc::{MAX_REQUEST, Request, Response},
    config::{List, Origin},
};

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

/// The bound control socket, and the feeders' group (`--socket-group`), if any.
pub(super) struct Control {
    listener: UnixListener,
    feeders: Option<u32>,
}

/// Binds the control socket, refusing to take it from a running daemon. It is never reachable
/// by anyone else, whatever the umask: bound in a fresh 0700 directory of the daemon's own,
/// made 0600 there (0660 and of the `feeders` group, with one), and only then linked into
/// place. (Bound in place, it would be open to all between bind(2) and chmod(2) under a lax
/// umask, and a connection made then stays open.)
pub(super) fn bind(path: &Path, feeders: Option<u32>) -> Result<Control, Error> {
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
    let restrict_err = |source| Error::RestrictSocket { path: path.to_path_buf(), source };
    if let Some(gid) = feeders {
        std::os::unix::fs::chown(&staged, None, Some(gid)).map_err(restrict_err)?;
    }
    let mode = if feeders.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode)).map_err(restrict_err)?;
    // A link, not a rename: a socket another daemon bound there meanwhile is not replaced.
    std::fs::hard_link(&staged, path).map_err(|source| match source.kind() {
        io::ErrorKind::AlreadyExists => Error::SocketTaken { path: path.to_path_buf() },
        _ => bind_err(source),
    })?;
    Ok(Control { listener, feeders })
}

/// Serves the control socket in a task of its own, until the returned guard is dropped (when
/// the loop ends; connections still open are dropped with the runtime). Each request read
/// whole comes out of the receiver, for the loop to answer; a `ban-list` is answered page by
/// page through `bans`.
pub(super) fn spawn(control: Control, bans: Loop) -> (AbortOnDrop, mpsc::Receiver<Job>) {
    let (jobs_in, jobs) = mpsc::channel(MAX_CONNECTIONS);
    (AbortOnDrop(tokio::spawn(accept(control, jobs_in, bans))), jobs)
}

/// Aborts a task when dropped.
pub(super) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Accepts control connections from root, the daemon's own user and the feeders' group, each
/// served by a task of its own, at most [`MAX_CONNECTIONS`] at once.
async fn accept(control: Control, jobs: mpsc::Sender<Job>, bans: Loop) {
    let Control { listener, feeders } = control;
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let (mut refused, mut failing) = (Throttled::default(), Throttled::default());
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let peer = stream.peer_cred().ok();
                let Some(role) = role(peer.map(|c| (c.uid(), c.gid())), feeders) else {
                    let (why, who) = match feeders {
                        None => (
                            "permission denied: the control socket serves root and the daemon's own user only"
                                .to_string(),
                            "neither root nor the daemon's user",
                        ),
                        Some(gid) => (
                            format!(
                                "permission denied: the control socket serves root, the daemon's own user and group {gid} only"
                            ),
                            "neither root, the daemon's user nor of its group",
                        ),
                    };
                    refuse(&stream, &why);
                    if let Some(unlogged) = refused.hit() {
                        warn!(
                            uid = peer.map(|c| c.uid()),
                            gid = peer.map(|c| c.gid()),
                            pid = peer.and_then(|c| c.pid()),
                            unlogged,
                            "control connection refused: the peer is {who}"
                        );
                    }
                    continue;
                };
                match slots.clone().try_acquire_owned() {
                    Ok(slot) => {
                        let (jobs, bans) = (jobs.clone(), bans.clone());
                        tokio::spawn(async move {
                            if let Err(e) = connection(stream, jobs, role, bans).await {
                                warn!(error = %e, "control connection dropped");
                            }
                            drop(slot);
                        });
                    }
                    Err(_) => refuse_busy(&stream),
                }
            }
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

/// What a peer may ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Root or the daemon's own user: anything.
    Operator,
    /// Of the feeders' group: what [`feeder_may`] allows.
    Feeder,
}

/// A peer's role, from its uid and effective gid: None for anyone else. The socket's mode
/// already keeps others out; this holds should the mode or its directory be loosened.
fn role(peer: Option<(u32, u32)>, feeders: Option<u32>) -> Option<Role> {
    let (uid, gid) = peer?;
    if uid == 0 || uid == nix::unistd::geteuid().as_raw() {
        Some(Role::Operator)
    } else if feeders == Some(gid) {
        Some(Role::Feeder)
    } else {
        None
    }
}

/// What a ban feeder (a member of the socket's group: the CrowdSec bouncer, a fail2ban run as
/// another user) may ask: to read, and to add and remove deny bans of a feeder's origin, which
/// the daemon's floors and allow list hold in check. Not the policies, the lists, the allow
/// list, the operator's own bans (origin cli), a reload, the salt or the hook.
fn feeder_may(request: &Request) -> bool {
    match request {
        Request::BanAdd { list, origin, .. } | Request::BanRm { list, origin, .. } => {
            *list == List::Deny && *origin != Origin::Cli
        }
        Request::BanList { .. }
        | Request::ListShow { .. }
        | Request::PolicyList
        | Request::PolicyShow { .. }
        | Request::Stats
        | Request::Top { .. } => true,
        Request::PolicySet { .. }
        | Request::PolicyRm { .. }
        | Request::ListAdd { .. }
        | Request::ListRm { .. }
        | Request::SaltRotate
        | Request::Reload
        | Request::Attach { .. } => false,
        // It names the buckets a source hashes to, which would let a non-root member of the
        // group search for sources that share an address's buckets.
        Request::Explain { .. } => false,
    }
}

/// The answer to a feeder's request beyond [`feeder_may`].
const FEEDER_REFUSED: &str = "permission denied: the socket's group may only add and remove deny bans of origin \
                              fail2ban or crowdsec, and read; ask as root";

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
async fn connection(stream: UnixStream, jobs: mpsc::Sender<Job>, role: Role, bans: Loop) -> io::Result<()> {
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
        Ok(request) if role == Role::Feeder && !feeder_may(&request) => {
            Response::Failed { error: FEEDER_REFUSED.into() }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_feeders_group_gets_its_role_and_no_more() {
        let me = nix::unistd::geteuid().as_raw();
        assert_eq!(role(Some((0, 5)), None), Some(Role::Operator));
        assert_eq!(role(Some((me, 5)), Some(7)), Some(Role::Operator));
        assert_eq!(role(Some((64_000, 7)), Some(7)), Some(Role::Feeder));
        assert_eq!(role(Some((64_000, 8)), Some(7)), None, "another group");
        assert_eq!(role(Some((64_000, 7)), None), None, "no feeders' group");
        assert_eq!(role(None, Some(7)), None, "no credentials");
    }

    #[test]
    fn a_feeder_may_read_and_feed_deny_bans_of_its_origins_only() {
        let net = || "198.18.0.1/32".parse().unwrap();
        let add = |list, origin| Request::BanAdd { list, origin, entries: vec![] };
        let rm = |list, origin| Request::BanRm { list, origin, cidrs: vec![net()] };
        for ok in [
            add(List::Deny, Origin::Crowdsec),
            add(List::Deny, Origin::Fail2ban),
            rm(List::Deny, Origin::Crowdsec),
            Request::BanList { list: List::Allow, cidrs: None },
            Request::ListShow { list: List::Deny },
            Request::PolicyList,
            Request::Stats,
            Request::Top { limit: 5 },
        ] {
            assert!(feeder_may(&ok), "{ok:?}");
        }
        for refused in [
            add(List::Allow, Origin::Crowdsec),
            add(List::Deny, Origin::Cli),
            rm(List::Deny, Origin::Cli),
            rm(List::Allow, Origin::Fail2ban),
            Request::ListAdd { list: List::Allow, cidr: net() },
            Request::ListRm { list: List::Deny, cidr: net() },
            Request::SaltRotate,
            Request::Reload,
        ] {
            assert!(!feeder_may(&refused), "{refused:?}");
        }
    }
}

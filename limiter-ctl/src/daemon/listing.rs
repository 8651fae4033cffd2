//! Work on the bans done a page at a time: the `ban-list` answer, streamed to its client in
//! lines of at most [`PAGE`] entries, and the saves of the ban file (`bans`). The loop owns the
//! bans; each page is a short job it runs between other events ([`Loop`]), so neither a list
//! of two million bans nor a save holds up `stats`, a `ban-add` or a signal, and neither copies
//! the bans whole (the daemon's memory stays what the bans take).
//!
//! Pages follow the bans' order (network, list, origin) from where the last one ended: an
//! entry in force throughout the answer is listed exactly once; one added or removed meanwhile
//! may be listed or not.

use std::{cell::RefCell, io, time::Duration};

use serde::Serialize;

use tokio::{
    io::{AsyncWrite, AsyncWriteExt as _},
    sync::{mpsc, oneshot},
};

use super::bans::{Bans, Key};
use crate::{
    api::ipc::{BanPage, MAX_BATCH, Response},
    config::List,
};
use ipnet::IpNet;

/// Entries looked at per page: one page costs the loop a few milliseconds (a tenth of them to
/// pick the entries, the rest to write them out), and a line of the answer is about 1 MB.
pub(super) const PAGE: usize = 10_000;

/// A job on the bans, run by the loop between its other events.
pub(super) type OnBans = Box<dyn FnOnce(&Bans) + Send>;

/// Where jobs on the bans go: the loop's queue of them.
pub(super) type Loop = mpsc::Sender<OnBans>;

/// The loop's queue of jobs on the bans: room for a page per control connection and a save.
pub(super) fn queue() -> (Loop, mpsc::Receiver<OnBans>) {
    mpsc::channel(super::socket::MAX_CONNECTIONS + 1)
}

/// Runs `job` on the loop and waits for what it returns; None once the loop has ended (the
/// daemon is stopping).
async fn on_loop<T: Send + 'static>(loop_: &Loop, job: impl FnOnce(&Bans) -> T + Send + 'static) -> Option<T> {
    let (answer, answered) = oneshot::channel();
    loop_.send(Box::new(move |bans: &Bans| drop(answer.send(job(bans))))).await.ok()?;
    answered.await.ok()
}

/// [`on_loop`] from a thread outside the runtime (a save's writer).
pub(super) fn blocking_on<T: Send + 'static>(loop_: &Loop, job: impl FnOnce(&Bans) -> T + Send + 'static) -> Option<T> {
    let (answer, answered) = oneshot::channel();
    loop_.blocking_send(Box::new(move |bans: &Bans| drop(answer.send(job(bans))))).ok()?;
    answered.blocking_recv().ok()
}

/// How much lower than the loop's a background job's CPU priority is (a nice value): on a busy
/// host a save of two million bans (a second of CPU) yields to the loop, which answers
/// `stats` and takes the next `ban-add` meanwhile.
const BACKGROUND_NICE: i32 = 10;

/// Runs `job` on a thread of its own at a lower CPU priority ([`BACKGROUND_NICE`]); false when
/// no thread could be made (the job is dropped).
pub(super) fn in_background(name: &str, job: impl FnOnce() + Send + 'static) -> bool {
    let spawned = std::thread::Builder::new().name(name.into()).spawn(move || {
        // SAFETY: no memory involved; on Linux PRIO_PROCESS with 0 sets the calling thread's
        // nice value only. Failing (a seccomp filter, say) leaves it at the loop's.
        unsafe { nix::libc::setpriority(nix::libc::PRIO_PROCESS, 0, BACKGROUND_NICE) };
        job()
    });
    spawned.is_ok()
}

/// Answers a `ban-list` on its connection: the entries of these networks in one line, or the
/// whole list page by page, each line within `deadline` of the client taking the last.
pub(super) async fn answer(
    list: List,
    cidrs: Option<Vec<IpNet>>,
    out: &mut (impl AsyncWrite + Unpin),
    loop_: &Loop,
    deadline: Duration,
) -> io::Result<()> {
    let mut line = Vec::new();
    let mut send = async |line: &[u8]| {
        let written = tokio::time::timeout(deadline, out.write_all(line)).await;
        written.map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("a page of the list not taken within {} s", deadline.as_secs()),
            )
        })?
    };
    let stopping = || Response::Failed {
        error: "the daemon is stopping: the list is incomplete; ask again once it is back".into(),
    };
    if let Some(nets) = cidrs {
        let answer = if nets.len() > MAX_BATCH {
            Err(Response::Usage {
                error: format!("{} networks in one request: at most {MAX_BATCH} (ask in several)", nets.len()),
            })
        } else {
            on_loop(loop_, move |bans| bans.list_of(list, &nets)).await.ok_or_else(stopping)
        };
        write_line(&mut line, answer.as_deref().map(|entries| BanPage::ok(entries, false)))?;
        return send(&line).await;
    }
    let mut after = None;
    loop {
        let page = on_loop(loop_, move |bans| bans.list_page(list, after, PAGE)).await;
        let Some((entries, next)) = page else {
            write_line(&mut line, Err(&stopping()))?;
            return send(&line).await;
        };
        // A stretch of the other list's entries: nothing to say yet.
        if !(entries.is_empty() && next.is_some()) {
            write_line(&mut line, Ok(BanPage::ok(&entries, next.is_some())))?;
            send(&line).await?;
        }
        match next {
            Some(next) => after = Some(next),
            None => return Ok(()),
        }
    }
}

/// One line of the answer into `line`: a page, or a refusal.
fn write_line(line: &mut Vec<u8>, what: Result<BanPage<'_>, &Response>) -> io::Result<()> {
    line.clear();
    match what {
        Ok(page) => serde_json::to_writer(&mut *line, &page),
        Err(response) => serde_json::to_writer(&mut *line, &response),
    }
    .map_err(io::Error::other)?;
    line.push(b'\n');
    Ok(())
}

/// The items of successive pages, fetched as they are taken: from the first page (`fetch(None)`)
/// on, each page with where the next starts. A page that cannot be had (the loop ended) ends
/// them, and says so (`stopped`).
pub(super) struct Pages<T, F> {
    fetch: F,
    page: std::vec::IntoIter<T>,
    /// Where the next page starts: None once the last was fetched.
    next: Option<Option<Key>>,
    pub(super) stopped: bool,
}

impl<T, F: FnMut(Option<Key>) -> Option<(Vec<T>, Option<Key>)>> Pages<T, F> {
    pub(super) fn new(fetch: F) -> Self {
        Self { fetch, page: Vec::new().into_iter(), next: Some(None), stopped: false }
    }
}

impl<T, F: FnMut(Option<Key>) -> Option<(Vec<T>, Option<Key>)>> Iterator for Pages<T, F> {
    type Item = T;

    fn next(&mut self) -> Option<T> {
        loop {
            if let Some(item) = self.page.next() {
                return Some(item);
            }
            let after = self.next.take()?;
            let Some((page, next)) = (self.fetch)(after) else {
                self.stopped = true;
                return None;
            };
            self.page = page.into_iter();
            self.next = next.map(Some);
        }
    }
}

/// An iterator's items serialized as one sequence, as they come (once: it is used up).
pub(super) struct Seq<I>(RefCell<I>);

impl<I> Seq<I> {
    pub(super) fn new(items: I) -> Self {
        Self(RefCell::new(items))
    }

    pub(super) fn into_inner(self) -> I {
        self.0.into_inner()
    }
}

impl<I: Iterator<Item: Serialize>> Serialize for Seq<I> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(&mut *self.0.borrow_mut())
    }
}

//! The requests: each [`Request`] the control socket hands the loop, answered on the running
//! rules. A change is validated whole, then committed (`commit`: the maps, then the file, put
//! back on a failure), after a hand edit of the file is caught up with (`reload`), and logged
//! in one line; a read is answered from the state, the counters or the latest snapshot.

use std::time::Duration;

use limiter_common::maps::Counters;
use tracing::{info, warn};

use super::{
    Error,
    bans::{Added, BanError},
    serve::Daemon,
    socket::Job,
};
use crate::{
    api::ipc::{
        Attachment, BanAdded, BanRefused, BanRemoved, PolicyStatus, Reloaded, ReloadedFirst, Request, Response,
    },
    config::{self, Entry, PolicyDef, State},
    kernel::{self, Hook, Placement, TcxPlace},
};

/// A request the loop could not take up within this long of reading it is refused, not applied
/// (the CLI gives a request 30 s in all, and says on a timeout that it may still be applied).
const QUEUE_DEADLINE: Duration = Duration::from_secs(5);

impl Daemon {
    /// Handles a request read whole and sends the answer to its connection's task. Once taken
    /// up it is applied whole or not at all (validated, then the maps, then the file, put back
    /// on a failure), whether or not its client is still there; a client that left gets no
    /// answer and the log says what was done.
    pub(super) fn run(&mut self, job: Job) {
        let waited = job.received.elapsed();
        let response = if waited > QUEUE_DEADLINE {
            warn!(waited_ms = waited.as_millis() as u64, "a control request waited too long; refused, nothing changed");
            Response::Failed {
                error: format!("the daemon was busy for {} ms; nothing was changed; try again", waited.as_millis()),
            }
        } else {
            self.handle(job.request)
        };
        let _ = job.answer.send(response);
    }

    fn handle(&mut self, request: Request) -> Response {
        if !matches!(
            request,
            Request::PolicySet { .. } | Request::PolicyRm { .. } | Request::ListAdd { .. } | Request::ListRm { .. }
        ) {
            return self.answer(request);
        }
        // A change merges the running rules into the file: a hand edit not yet applied would be
        // undone. It is applied first, or the change refused.
        let reloaded = match self.catch_up() {
            Ok(reloaded) => reloaded,
            Err(error) => return Response::Failed { error },
        };
        match (self.answer(request), reloaded) {
            (Response::Ok { .. }, Some(reloaded_first)) => {
                Response::Ok { data: serde_json::to_value(ReloadedFirst { reloaded_first }).unwrap_or_default() }
            }
            // The reload stands (it was logged and counted as one): the answer says so.
            (Response::Usage { error }, Some(r)) => {
                Response::Usage { error: format!("{error}; {}", reloaded_note(&r)) }
            }
            (Response::Failed { error }, Some(r)) => {
                Response::Failed { error: format!("{error}; {}", reloaded_note(&r)) }
            }
            (response, None) => response,
        }
    }

    /// Answers a request on the running rules.
    fn answer(&mut self, request: Request) -> Response {
        match request {
            Request::PolicySet { name, edit } => {
                // Only the fields given change (see `PolicyEdit::apply`).
                let policy = match edit.apply(&name, self.state.policy(&name).map(|e| &e.def)) {
                    Ok(policy) => policy,
                    Err(error) => return Response::Usage { error: error.to_string() },
                };
                let what = policy.summary();
                let next = self.state.with_policy(policy);
                self.change(next, "policy set", what)
            }
            Request::PolicyRm { name } => {
                let next = self.state.without_policy(&name);
                self.change(next, "policy removed", format!("name={name}"))
            }
            Request::ListAdd { list, cidr } => {
                let next = self.state.with_net(list, cidr);
                self.change(next, "list entry added", format!("list={} cidr={cidr}", list.as_str()))
            }
            Request::ListRm { list, cidr } => {
                let next = self.state.without_net(list, cidr);
                self.change(next, "list entry removed", format!("list={} cidr={cidr}", list.as_str()))
            }
            Request::PolicyList => self.reply(self.statuses().map(|s| serde_json::to_value(s).unwrap_or_default())),
            Request::PolicyShow { name } => match self.state.policy(&name) {
                None => Response::Usage { error: format!("no policy named '{name}' (see `limiter-ctl policy list`)") },
                Some(entry) => self.reply(
                    self.limiter.counters().map(|c| serde_json::to_value(status(entry, &c)).unwrap_or_default()),
                ),
            },
            Request::ListShow { list } => {
                Response::Ok { data: serde_json::to_value(self.state.list(list)).unwrap_or_default() }
            }
            Request::Stats => match self.shared.read() {
                Ok(snapshot) => Response::Ok { data: serde_json::to_value(&*snapshot).unwrap_or_default() },
                Err(_) => Response::Failed { error: "the stats snapshot is unavailable".into() },
            },
            Request::Top { limit } => {
                Response::Ok { data: serde_json::to_value(self.top.report(&self.state, limit)).unwrap_or_default() }
            }
            Request::Explain { query } => self.explain(query),
            Request::Reload => match self.reload("limiter-ctl reload") {
                Ok(reloaded) => Response::Ok { data: serde_json::to_value(reloaded).unwrap_or_default() },
                // A file refused is bad input (exit 2); a kernel that refused the maps, a failure.
                Err(e @ (Error::File(_) | Error::Config { .. })) => {
                    Response::Usage { error: format!("reload refused: {e}; the running config stays") }
                }
                Err(e) => Response::Failed { error: format!("reload failed: {e}") },
            },
            Request::SaltRotate => match self.rotate() {
                Ok(()) => Response::Ok { data: serde_json::Value::Null },
                Err(e) => Response::Failed { error: e.to_string() },
            },
            Request::Attach { hook, place } => self.move_to(hook, place),
            // Bans are runtime state: no catching up with the file, no write to it.
            Request::BanAdd { list, origin, entries } => {
                let batch: Vec<_> = entries.iter().map(|e| (e.cidr, e.for_ms)).collect();
                match self.bans.add(&mut self.limiter, list, origin, &batch) {
                    Ok(Added { added, refused }) => {
                        if added > 0 {
                            info!(list = list.as_str(), origin = origin.as_str(), entries = added, "bans added");
                        }
                        let refused = refused
                            .into_iter()
                            .map(|(cidr, why)| BanRefused { cidr, reason: why.to_string() })
                            .collect();
                        Response::Ok { data: serde_json::to_value(BanAdded { added, refused }).unwrap_or_default() }
                    }
                    Err(e) => ban_error(e),
                }
            }
            Request::BanRm { list, origin, cidrs } => match self.bans.remove(&mut self.limiter, list, origin, &cidrs) {
                Ok(removed) => {
                    if !removed.is_empty() {
                        info!(list = list.as_str(), origin = origin.as_str(), entries = removed.len(), "bans removed");
                    }
                    let answer = BanRemoved { removed: removed.len(), cidrs: removed };
                    Response::Ok { data: serde_json::to_value(answer).unwrap_or_default() }
                }
                Err(e) => ban_error(e),
            },
            // Answered by its connection, page by page from the loop (`listing`): never queued here.
            Request::BanList { .. } => {
                Response::Failed { error: "ban-list is answered by its connection, not the loop".into() }
            }
        }
    }

    /// `limiter-ctl attach`: the program moved to `hook` without a gap, or left where it is.
    fn move_to(&mut self, hook: Hook, place: Option<TcxPlace>) -> Response {
        let placed = place.is_some();
        let want = Placement { tcx: place.unwrap_or_else(|| self.placement.tcx.clone()), ..self.placement.clone() };
        let before = self.limiter.attach_mode().map(|m| m.to_string()).unwrap_or_else(|_| "its hook".into());
        let attached = match self.limiter.move_to(hook, &want, kernel::TcReason::Moved) {
            Ok(attached) => attached,
            Err(e) if e.is_bad_input() => return Response::Usage { error: format!("{e}; nothing changed") },
            Err(e) => {
                let error = kernel::error_chain(&e);
                warn!(iface = %self.iface, to = %hook, %error, "moving the program failed; it stays where it was");
                return Response::Failed {
                    error: format!("moving to {hook} failed: {error}; the program stays at {before}"),
                };
            }
        };
        match attached.moved_from {
            Some(from) => info!(
                iface = %self.iface,
                from = %from,
                to = %attached.mode,
                why = attached.why_tc.as_ref().map(ToString::to_string).unwrap_or_default(),
                api_reason = attached.api_reason.as_ref().map(ToString::to_string).unwrap_or_default(),
                "moved without a gap: attached at {hook} first, then released {}",
                from.hook()
            ),
            None if placed && hook == Hook::Tc => {
                info!(iface = %self.iface, "attach {hook}: already there, its place at tc ingress kept; nothing changed")
            }
            None => info!(iface = %self.iface, "attach {hook}: already there; nothing changed"),
        }
        if let Some(why) = &attached.lingering {
            warn!(iface = %self.iface, "{why}");
        }
        // `stats` says the new hook at once, not a second later.
        if let Err(e) = self.snapshot() {
            warn!(error = %e, "reading the counters failed; stats are stale");
        }
        let report = Attachment {
            iface: self.iface.clone(),
            attach_mode: attached.mode.to_string(),
            moved_from: attached.moved_from.map(|m| m.to_string()),
            attach_reason: attached.why_tc.map(|r| r.to_string()),
            attach_api_reason: attached.api_reason.map(|r| r.to_string()),
        };
        Response::Ok { data: serde_json::to_value(report).unwrap_or_default() }
    }

    fn reply(&self, data: Result<serde_json::Value, kernel::Error>) -> Response {
        match data {
            Ok(data) => Response::Ok { data },
            Err(e) => Response::Failed { error: e.to_string() },
        }
    }

    fn statuses(&self) -> Result<Vec<PolicyStatus>, kernel::Error> {
        let counters = self.limiter.counters()?;
        Ok(self.state.policies().map(|e| status(e, &counters)).collect())
    }

    /// Applies a validated change: kernel first, then the file; puts the kernel back if the
    /// file cannot be written.
    fn change(&mut self, next: Result<State, config::Error>, event: &str, detail: String) -> Response {
        let next = match next {
            Ok(next) => next,
            Err(error) => return Response::Usage { error: error.to_string() },
        };
        match self.commit(next, true) {
            Ok(()) => {
                info!("{event} {detail}");
                Response::Ok { data: serde_json::Value::Null }
            }
            Err(error) => Response::Failed { error: error.to_string() },
        }
    }
}

fn ban_error(e: BanError) -> Response {
    match e {
        BanError::Usage(error) => Response::Usage { error },
        BanError::Failed(error) => {
            warn!(%error, "a ban change failed");
            Response::Failed { error }
        }
    }
}

/// What a change refused after its file's hand edit was reloaded adds: that reload stays.
fn reloaded_note(r: &Reloaded) -> String {
    format!(
        "{} had changed and was reloaded first ({} policies, {} allow and {} deny entries): that stays applied",
        r.config.display(),
        r.policies,
        r.allow,
        r.deny
    )
}

/// A policy as `policy list` and `policy show` report it: its burst resolved, its counters.
fn status(e: &Entry, counters: &[Counters]) -> PolicyStatus {
    PolicyStatus {
        id: e.id,
        def: PolicyDef { burst: Some(e.def.burst_or_default()), ..e.def.clone() },
        counters: counters.get(usize::from(e.id)).map(Into::into).unwrap_or_default(),
    }
}

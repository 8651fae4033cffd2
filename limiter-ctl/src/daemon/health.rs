//! The probes beside `/metrics`: `/readyz` answers 200 once the program is attached with the
//! config loaded (503 and a one-line reason before, and while the interface is gone), `/livez`
//! 200 while the daemon's loop ticks (503 once it has not for [`STALE`]; 200 while starting).
//! Kubernetes reads them (packaging/kubernetes/daemonset.yaml); the loop writes them.

use std::{
    sync::{Arc, RwLock},
    time::{Duration, Instant},
};

use axum::{Router, http::StatusCode, routing::get};

/// The loop ticks every second: this many missed ticks mean it is stuck, not busy.
const STALE: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct State {
    /// Ok once attached with the config loaded; else why not.
    ready: Result<(), String>,
    /// The loop's last tick (None before it runs).
    beat: Option<Instant>,
}

/// What the probes answer; cloned into the HTTP handlers.
#[derive(Clone, Debug)]
pub(super) struct Health(Arc<RwLock<State>>);

impl Health {
    pub(super) fn new() -> Self {
        Self(Arc::new(RwLock::new(State { ready: Err("starting: the config is not loaded yet".into()), beat: None })))
    }

    pub(super) fn not_ready(&self, reason: impl Into<String>) {
        if let Ok(mut s) = self.0.write() {
            s.ready = Err(reason.into());
        }
    }

    pub(super) fn ready(&self) {
        if let Ok(mut s) = self.0.write() {
            s.ready = Ok(());
        }
    }

    /// The loop is alive: called on its once-a-second tick.
    pub(super) fn beat(&self) {
        if let Ok(mut s) = self.0.write() {
            s.beat = Some(Instant::now());
        }
    }

    fn readyz(&self) -> (StatusCode, String) {
        match self.0.read() {
            Ok(s) => match &s.ready {
                Ok(()) => (StatusCode::OK, "ready\n".into()),
                Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {reason}\n")),
            },
            Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "health state unavailable\n".into()),
        }
    }

    fn livez(&self) -> (StatusCode, String) {
        match self.0.read() {
            Ok(s) => match s.beat.map(|b| b.elapsed()) {
                None => (StatusCode::OK, "alive: starting\n".into()),
                Some(quiet) if quiet < STALE => (StatusCode::OK, "alive\n".into()),
                Some(quiet) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("the daemon's loop has not ticked for {} s\n", quiet.as_secs()),
                ),
            },
            Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "health state unavailable\n".into()),
        }
    }

    /// `/readyz` and `/livez`, merged into the metrics listener's router.
    pub(super) fn routes(&self) -> Router {
        let (r, l) = (self.clone(), self.clone());
        Router::new()
            .route("/readyz", get(move || std::future::ready(r.readyz())))
            .route("/livez", get(move || std::future::ready(l.livez())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_once_told_and_live_until_the_beat_goes_stale() {
        let h = Health::new();
        assert_eq!(h.readyz().0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(h.livez().0, StatusCode::OK);
        h.ready();
        h.beat();
        assert_eq!(h.readyz(), (StatusCode::OK, "ready\n".into()));
        assert_eq!(h.livez().0, StatusCode::OK);
        h.not_ready("interface eth0 is gone");
        assert_eq!(h.readyz(), (StatusCode::SERVICE_UNAVAILABLE, "not ready: interface eth0 is gone\n".into()));
        if let Ok(mut s) = h.0.write() {
            s.beat = Instant::now().checked_sub(STALE);
        }
        assert_eq!(h.livez().0, StatusCode::SERVICE_UNAVAILABLE);
    }
}

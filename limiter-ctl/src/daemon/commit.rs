//! Commit with rollback: a validated state made the running one, the kernel's maps first,
//! then (for a change) the config file; if the file cannot be written the maps are put back,
//! and the error says whether that worked.

use super::{Error, Rollback, serve::Daemon};
use crate::config::{self, State};

impl Daemon {
    /// Makes `next` the running state: the kernel maps, then (with `save`) the file. On a
    /// failure the maps are put back and the error says whether that worked.
    pub(super) fn commit(&mut self, next: State, save: bool) -> Result<(), Error> {
        if let Err(error) = self.limiter.sync(&self.state, &next) {
            let rollback = Rollback(self.limiter.sync(&next, &self.state).map_err(Box::new));
            return Err(Error::UpdateMaps { error: Box::new(error), rollback });
        }
        if save {
            match config::save(&self.config_path, &next.to_config(), self.synced.as_deref()) {
                Ok(written) => {
                    // The daemon's own write: the watch sees it, and must not apply it again.
                    self.seen = Ok(written.clone());
                    self.synced = Some(written);
                }
                Err(error) => {
                    let rollback = Rollback(self.limiter.sync(&next, &self.state).map_err(Box::new));
                    return Err(Error::SaveChange { error, rollback });
                }
            }
        }
        // A layering the operator may not mean: said once per change that brings it.
        let before = self.state.warnings();
        for warning in next.warnings().into_iter().filter(|w| !before.contains(w)) {
            tracing::warn!("{warning}");
        }
        self.state = next;
        // No deny ban may cover what the allow list now holds.
        self.bans.set_allow_list(&mut self.limiter, self.state.list(config::List::Allow));
        self.longest_window = self.longest_window.max(self.state.max_window());
        Ok(())
    }
}

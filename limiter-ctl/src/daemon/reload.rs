//! The config file as the operator edits it: written at start when `--rate` changed the rules,
//! re-read on SIGHUP, `limiter-ctl reload` and (`--watch-config`) when it changes, and caught
//! up with before a CLI change would overwrite a hand edit. A reload is validated whole and
//! applied or refused whole, logged once and counted for `/metrics`.

use tracing::{error, info, warn};

use super::{Error, serve::Daemon};
use crate::{
    api::ipc::Reloaded,
    config::{self, ConfigFile, State},
};

impl Daemon {
    /// Once started: the first snapshot, and the file written if the rules differ from it.
    /// `text`: the file's text `file` was loaded from (None: there was no file).
    pub(super) fn start_up(&mut self, file: &ConfigFile, text: Option<&str>) -> Result<(), Error> {
        self.snapshot()?;
        self.synced = text.map(str::to_string);
        // Written only if the rules differ (`--rate` installed or changed "default"): a file that
        // says the same in its own order, spelling and comments is the operator's, left alone.
        // A file edited since it was loaded is not overwritten: the start fails, saying so.
        if !self.state.to_config().same_rules(file) {
            let written = config::save(&self.config_path, &self.state.to_config(), text).map_err(Error::SaveConfig)?;
            self.synced = Some(written);
        }
        self.seen = match &self.synced {
            Some(text) => Ok(text.clone()),
            None => Err(config::Error::Missing { path: self.config_path.clone() }.to_string()),
        };
        Ok(())
    }

    /// SIGHUP and `limiter-ctl reload`: re-read the file and make it the running config. A
    /// file that is missing, empty, not a regular file, unreadable, or does not parse or
    /// validate is refused, and so is one without rules while rules run, unless it says
    /// `policy = []`: nothing changes. Either way it is logged (a refusal as an error, naming
    /// the file and why) and counted for `/metrics`.
    pub(super) fn reload(&mut self, trigger: &'static str) -> Result<Reloaded, Error> {
        self.reload_from(config::read(&self.config_path), trigger)
    }

    /// [`Daemon::reload`] of the file as `read` just now.
    fn reload_from(&mut self, read: Result<String, config::Error>, trigger: &'static str) -> Result<Reloaded, Error> {
        let config = self.config_path.display().to_string();
        // Whatever the outcome, these bytes have been judged: the watch need not see them again.
        self.seen = read.as_ref().map(Clone::clone).map_err(ToString::to_string);
        super::notify_reloading();
        let result = self.try_reload(read);
        super::notify_reloaded(&self.iface, result.is_ok());
        self.reloads.record(result.is_ok());
        if let Ok(mut shared) = self.shared.write() {
            shared.reloads = self.reloads.clone();
        }
        match &result {
            Ok(r) => info!(%config, trigger, policies = r.policies, allow = r.allow, deny = r.deny, "reloaded"),
            Err(e) => error!(%config, trigger, "reload refused: {e}; the running config stays"),
        }
        result
    }

    /// The watch saw the config's directory change and settle: bytes other than those last
    /// seen are reloaded as SIGHUP reloads them (validated, applied or refused whole, logged
    /// once, counted); the same bytes (the daemon's own write, a resync, a touch) are nothing.
    pub(super) fn file_changed(&mut self) {
        // Read as a reload reads it (never blocking: a FIFO is refused, not waited on).
        let read = config::read(&self.config_path);
        if read.as_ref().map_err(ToString::to_string) == self.seen.as_ref().map_err(Clone::clone) {
            return;
        }
        let _ = self.reload_from(read, "config file changed");
    }

    fn try_reload(&mut self, read: Result<String, config::Error>) -> Result<Reloaded, Error> {
        let path = &self.config_path;
        let text = read.map_err(Error::File)?;
        let file = config::parse(path, &text).map_err(Error::File)?;
        let running = self.state.to_config();
        // An emptied file is far likelier an accident than a wish to drop all protection.
        if file.has_no_rules() && !running.has_no_rules() && !config::says_no_rules(&text) {
            return Err(Error::File(config::Error::NoRules { path: path.clone() }));
        }
        let next = State::build_for(&file, &self.state.ids(), self.state.max_frame())
            .map_err(|error| Error::Config { path: path.clone(), error })?;
        self.commit(next, false)?;
        if let Some(names) = config::unversioned(&text) {
            info!("note: {}", config::unversioned_note(&self.config_path, &names));
        }
        self.synced = Some(text);
        Ok(Reloaded {
            config: self.config_path.clone(),
            policies: self.state.policies().count(),
            allow: file.allow.len(),
            deny: file.deny.len(),
        })
    }

    /// Before a change: whether the file still says what the running rules were loaded from or
    /// written as. If it holds a hand edit, with the watch on (the file is live) the edit is
    /// reloaded now, as the watch would a moment later (same checks, logged and counted), and
    /// returned; with the watch off (edits apply on reload only) the change is refused, and so
    /// it is when the reload is refused or the file cannot be read. A missing file holds nothing
    /// to lose: the change writes it afresh. The error is the client's one line.
    pub(super) fn catch_up(&mut self) -> Result<Option<Reloaded>, String> {
        let path = self.config_path.display().to_string();
        let read = config::read(&self.config_path);
        match (&read, &self.synced) {
            (Err(config::Error::Missing { .. }), _) => return Ok(None),
            (Ok(text), Some(synced)) if text == synced => return Ok(None),
            (Ok(_), _) => {}
            (Err(e), _) => {
                warn!(config = %path, "a change refused: the config cannot be read: {e}; nothing changed");
                return Err(format!(
                    "{e}: not written, nothing was changed; fix the file (`limiter-ctl config check {path}`), then \
                     retry"
                ));
            }
        }
        if self.watching && self.writing.writing() {
            warn!(config = %path, "a change refused: the file is being written; nothing changed");
            return Err(format!(
                "{path} is being written (written to and not closed yet): not overwritten, nothing was changed; \
                 retry once it is saved"
            ));
        }
        if !self.watching {
            warn!(config = %path, "a change refused: the file holds a hand edit not yet applied; nothing changed");
            return Err(format!(
                "{path} was changed since the daemon last read or wrote it (a hand edit not yet applied): not \
                 overwritten, nothing was changed; apply the edit with `limiter-ctl reload` (`limiter-ctl config \
                 check {path}` first), then retry"
            ));
        }
        match self.reload_from(read, "a change found the file edited") {
            Ok(reloaded) => Ok(Some(reloaded)),
            Err(e) => Err(format!(
                "{path} was changed since the daemon last read or wrote it, and that edit is refused ({e}): not \
                 overwritten, nothing was changed; fix the file (`limiter-ctl config check {path}`), then retry"
            )),
        }
    }
}

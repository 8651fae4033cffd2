//! The LAPI: its address and key, and one poll of its decision stream over plain HTTP.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use super::{
    decisions::Batch,
    stream::{MAX_DECISIONS, StreamError, read_stream},
};

/// One poll's HTTP exchange, connecting and reading the whole answer.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the LAPI URL or the key cannot be used (bad input: exit 2).
#[derive(Debug, thiserror::Error)]
pub(crate) enum SetupError {
    #[error(
        "invalid --lapi '{0}': expected the local API's plain-HTTP address, such as http://127.0.0.1:8080 (https is not supported: run the bouncer beside the LAPI)"
    )]
    Url(String),
    #[error("reading the API key from {path}: {source}")]
    KeyFile { path: PathBuf, source: std::io::Error },
    #[error("the API key file {0} is empty or not one line (`cscli bouncers add NAME -o raw` prints a key)")]
    BadKey(PathBuf),
}

/// The stream's URL under `lapi` (`http://host:port`, a path prefix allowed).
pub(crate) fn stream_url(lapi: &str) -> Result<String, SetupError> {
    let bad = || SetupError::Url(lapi.to_owned());
    let rest = lapi.strip_prefix("http://").ok_or_else(bad)?;
    let host = rest.split('/').next().unwrap_or_default();
    if host.is_empty() || lapi.chars().any(|c| c.is_whitespace() || c.is_control() || c == '?' || c == '#') {
        return Err(bad());
    }
    Ok(format!("{}/v1/decisions/stream", lapi.trim_end_matches('/')))
}

/// The API key: the file's one line (a trailing newline allowed).
pub(crate) fn read_key(path: &Path) -> Result<String, SetupError> {
    let text =
        std::fs::read_to_string(path).map_err(|source| SetupError::KeyFile { path: path.to_path_buf(), source })?;
    let key = text.trim();
    if key.is_empty() || key.lines().count() != 1 || !key.chars().all(|c| c.is_ascii_graphic()) {
        return Err(SetupError::BadKey(path.to_path_buf()));
    }
    Ok(key.to_owned())
}

/// Why a poll failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PollError {
    #[error("the LAPI at {url} cannot be reached: {source}")]
    Unreachable { url: String, source: Box<ureq::Error> },
    #[error("the LAPI at {url} refused the API key (HTTP {status}): check --key-file (`cscli bouncers list`)")]
    Key { url: String, status: u16 },
    #[error("the LAPI at {url} answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("the LAPI at {url} sent {source}")]
    Garbage { url: String, source: StreamError },
    /// A full set with decisions that cannot be read: what they are (bans, maybe) is not
    /// known, so what the set lacks is not known either. Nothing of it is applied.
    #[error(
        "the LAPI at {url} sent a full set with {count} unreadable decisions (first: {first}); none of it is applied"
    )]
    Unreadable { url: String, count: u64, first: String },
}

pub(crate) struct Lapi {
    agent: ureq::Agent,
    pub url: String,
    key: String,
}

impl Lapi {
    pub fn new(url: String, key: String) -> Self {
        let agent = ureq::Agent::config_builder()
            .proxy(None)
            .max_redirects(0)
            .http_status_as_error(false)
            .timeout_global(Some(HTTP_TIMEOUT))
            .user_agent(concat!("limiter-ctl-crowdsec/", env!("CARGO_PKG_VERSION")))
            .build()
            .into();
        Self { agent, url, key }
    }

    /// One poll: the full set (`startup`) or the changes since the last poll. The answer is
    /// read as it arrives (`stream`); a full set with an unreadable decision is refused whole.
    pub fn poll(&self, startup: bool) -> Result<Batch, PollError> {
        let url = &self.url;
        let mut answer = self
            .agent
            .get(url)
            .query("startup", if startup { "true" } else { "false" })
            .header("X-Api-Key", &self.key)
            .call()
            .map_err(|e| PollError::Unreachable { url: url.clone(), source: Box::new(e) })?;
        let status = answer.status().as_u16();
        if status == 401 || status == 403 {
            return Err(PollError::Key { url: url.clone(), status });
        }
        if status != 200 {
            return Err(PollError::Status { url: url.clone(), status });
        }
        let batch = read_stream(answer.body_mut().as_reader(), MAX_DECISIONS)
            .map_err(|source| PollError::Garbage { url: url.clone(), source })?;
        if startup && batch.skipped.malformed > 0 {
            let first = batch.first_malformed.unwrap_or_default();
            return Err(PollError::Unreadable { url: url.clone(), count: batch.skipped.malformed, first });
        }
        Ok(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lapi_urls_and_keys() {
        assert_eq!(stream_url("http://127.0.0.1:8080").unwrap(), "http://127.0.0.1:8080/v1/decisions/stream");
        assert_eq!(stream_url("http://127.0.0.1:8080/").unwrap(), "http://127.0.0.1:8080/v1/decisions/stream");
        assert_eq!(stream_url("http://[::1]:8080/lapi").unwrap(), "http://[::1]:8080/lapi/v1/decisions/stream");
        for bad in ["", "127.0.0.1:8080", "https://127.0.0.1:8080", "http://", "http:///x", "http://a b", "http://h/?x"]
        {
            assert!(stream_url(bad).is_err(), "{bad:?}");
        }
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("key");
        std::fs::write(&file, "c74586f518104154586e272ab1f65000\n").unwrap();
        assert_eq!(read_key(&file).unwrap(), "c74586f518104154586e272ab1f65000");
        for bad in ["", "\n", "a\nb\n", "a b\n"] {
            std::fs::write(&file, bad).unwrap();
            assert!(read_key(&file).is_err(), "{bad:?}");
        }
        assert!(read_key(&dir.path().join("missing")).is_err());
    }
}

//! `limiter-ctl crowdsec`: a CrowdSec bouncer. It polls the local API's decision stream
//! (`GET /v1/decisions/stream`, `startup=true` first for the full set, then the changes since
//! the last poll) and turns each ban on an address or a range into an expiring deny entry of
//! origin `crowdsec`, for the decision's own duration; a deleted decision removes it.
//!
//! It fails static: a LAPI that is down or answers garbage changes nothing (the bans applied
//! stay, and expire on their own in the daemon); it is retried with backoff, and the first
//! answer after a failure is asked for in full (`startup=true`) and reconciled, so a decision
//! deleted meanwhile is not missed. A daemon that cannot be reached keeps what is pending,
//! retried on every poll.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use ipnet::IpNet;
use serde::{Deserialize, Deserializer, de::IgnoredAny};

use super::client::{self, BanCallError};
use crate::{
    api::ipc,
    config::{List, Origin},
};

/// The longest ban taken from a decision: CrowdSec allows Go's longest duration (292 years);
/// the daemon takes no more than this (ten years): a longer one is cut to it.
pub(crate) const MAX_BAN: Duration = Duration::from_millis(ipc::MAX_FOR_MS);
/// The backoff after a failed poll: from [`BACKOFF_MIN`], doubled each failure, up to
/// [`BACKOFF_MAX`].
pub(crate) const BACKOFF_MIN: Duration = Duration::from_secs(1);
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// The largest answer read from the LAPI: the full set of a large blocklist (about 200 bytes a
/// decision: a million decisions) and no more.
const MAX_BODY: u64 = 256 * 1024 * 1024;
/// One poll's HTTP exchange, connecting and reading the whole answer.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Go durations, as CrowdSec writes them ("4h59m58.5s", "-1.2s", "300ms")

/// A duration as Go's `time.Duration.String()` writes it (and `time.ParseDuration` reads it):
/// an optional sign, then one or more decimal numbers (a fraction allowed) each with a unit
/// (ns, us, µs, ms, s, m, h), or a bare `0`. Negative durations are those of decisions already
/// expired. `None` for anything else, and for a value beyond 2^64 ns in either direction.
pub(crate) fn go_duration(s: &str) -> Option<SignedDuration> {
    let (negative, mut rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    if rest == "0" {
        return Some(SignedDuration { negative: false, magnitude: Duration::ZERO });
    }
    if rest.is_empty() {
        return None;
    }
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        let (int, after) = rest.split_at(int_len);
        let (frac, after) = match after.strip_prefix('.') {
            Some(a) => {
                let n = a.bytes().take_while(u8::is_ascii_digit).count();
                a.split_at(n)
            }
            None => ("", after),
        };
        if int.is_empty() && frac.is_empty() {
            return None;
        }
        let unit_len = after.find(|c: char| c == '.' || c.is_ascii_digit()).unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let scale: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return None,
        };
        // Exact to the nanosecond, rounded down as Go does; beyond u128 refused, not wrapped.
        nanos = nanos.checked_add(crate::config::scaled_ns(int, frac, scale)?)?;
        rest = after;
    }
    let nanos = u64::try_from(nanos).ok()?;
    Some(SignedDuration { negative: negative && nanos > 0, magnitude: Duration::from_nanos(nanos) })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SignedDuration {
    pub negative: bool,
    pub magnitude: Duration,
}

// ---------------------------------------------------------------------------------------------
// The decision stream

/// `{"new": [...], "deleted": [...]}`, either null; an answer with neither key is not a stream.
#[derive(Deserialize)]
struct RawStream {
    #[serde(default, deserialize_with = "present")]
    new: Option<Option<Vec<RawItem>>>,
    #[serde(default, deserialize_with = "present")]
    deleted: Option<Option<Vec<RawItem>>>,
}

/// A key that is present (null or not), told from one that is absent (`None`).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// One element of `new` or `deleted`: a decision, or something else (counted, skipped), so that
/// one odd element does not cost the others.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawItem {
    Decision(RawDecision),
    Other(IgnoredAny),
}

/// The fields used; each any JSON (checked in [`decision`]), the others ignored.
#[derive(Deserialize)]
struct RawDecision {
    #[serde(default)]
    id: Option<serde_json::Value>,
    #[serde(default, rename = "type")]
    kind: Option<serde_json::Value>,
    #[serde(default)]
    scope: Option<serde_json::Value>,
    #[serde(default)]
    value: Option<serde_json::Value>,
    #[serde(default)]
    duration: Option<serde_json::Value>,
}

/// A ban on `net`, for `left` from when it was read (zero or negative: already over).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Decision {
    /// The LAPI's id of the decision (several may ban the same address, each with its time).
    pub id: i64,
    pub net: IpNet,
    pub left: SignedDuration,
}

/// What a poll's answer holds: its bans, new and deleted, and what was skipped, by reason.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Batch {
    pub new: Vec<Decision>,
    pub deleted: Vec<Decision>,
    pub skipped: Skipped,
}

/// Decisions not turned into bans, counted by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Skipped {
    /// Of another type than ban (captcha, throttle...): not the limiter's to apply.
    pub not_ban: u64,
    /// Of another scope than Ip or Range (Country, AS, Username...).
    pub scope: u64,
    /// New, but already expired (a zero or negative duration).
    pub expired: u64,
    /// Malformed: not an object, a missing or unreadable value, duration or type.
    pub malformed: u64,
}

impl Skipped {
    pub fn total(&self) -> u64 {
        self.not_ban + self.scope + self.expired + self.malformed
    }
}

impl fmt::Display for Skipped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} not bans, {} of another scope than Ip or Range, {} already expired, {} malformed",
            self.not_ban, self.scope, self.expired, self.malformed
        )
    }
}

/// Why an answer is not a decision stream at all (then nothing of it is applied).
#[derive(Debug, thiserror::Error)]
pub(crate) enum StreamError {
    #[error("not a decision stream: {0}")]
    Json(#[from] serde_json::Error),
    #[error("not a decision stream: it has neither \"new\" nor \"deleted\"")]
    Empty,
}

/// Reads an answer of `/v1/decisions/stream`. Garbage as a whole is an error (nothing of it may
/// be applied); an element that is not a usable ban is skipped and counted.
pub(crate) fn parse_stream(body: &[u8]) -> Result<Batch, StreamError> {
    let raw: RawStream = serde_json::from_slice(body)?;
    if raw.new.is_none() && raw.deleted.is_none() {
        return Err(StreamError::Empty);
    }
    let mut batch = Batch::default();
    for item in raw.deleted.flatten().into_iter().flatten() {
        // A deleted decision's duration is not used (it is over, whatever it says).
        match decision(item) {
            Ok(d) => batch.deleted.push(d),
            Err(why) => why.count(&mut batch.skipped),
        }
    }
    for item in raw.new.flatten().into_iter().flatten() {
        match decision(item) {
            Ok(d) if d.left.negative || d.left.magnitude.is_zero() => batch.skipped.expired += 1,
            Ok(d) => batch.new.push(d),
            Err(why) => why.count(&mut batch.skipped),
        }
    }
    Ok(batch)
}

enum Skip {
    NotBan,
    Scope,
    Malformed,
}

impl Skip {
    fn count(self, skipped: &mut Skipped) {
        match self {
            Skip::NotBan => skipped.not_ban += 1,
            Skip::Scope => skipped.scope += 1,
            Skip::Malformed => skipped.malformed += 1,
        }
    }
}

fn decision(item: RawItem) -> Result<Decision, Skip> {
    let RawItem::Decision(d) = item else { return Err(Skip::Malformed) };
    let text = |v: &Option<serde_json::Value>| v.as_ref().and_then(|v| v.as_str().map(str::to_owned));
    let kind = text(&d.kind).ok_or(Skip::Malformed)?;
    let scope = text(&d.scope).ok_or(Skip::Malformed)?;
    let value = text(&d.value).ok_or(Skip::Malformed)?;
    let duration = text(&d.duration).ok_or(Skip::Malformed)?;
    // An absent id (no LAPI sends none) makes the decisions on one address one.
    let id = match &d.id {
        None | Some(serde_json::Value::Null) => 0,
        Some(v) => v.as_i64().ok_or(Skip::Malformed)?,
    };
    if !kind.eq_ignore_ascii_case("ban") {
        return Err(Skip::NotBan);
    }
    let net = if scope.eq_ignore_ascii_case("ip") {
        // The standard parser: no leading zeros (inet_aton would read 010.0.0.1 as 8.0.0.1).
        let addr: IpAddr = value.trim().parse().map_err(|_| Skip::Malformed)?;
        // An IPv4 address written mapped (::ffff:198.18.0.1) arrives in IPv4 packets.
        IpNet::from(addr.to_canonical())
    } else if scope.eq_ignore_ascii_case("range") {
        // The config's parser (the same strictness); a range written with host bits set
        // (198.18.4.1/24) means its network.
        crate::config::parse_net(value.trim()).map_err(|_| Skip::Malformed)?.trunc()
    } else {
        return Err(Skip::Scope);
    };
    let left = go_duration(duration.trim()).ok_or(Skip::Malformed)?;
    Ok(Decision { id, net, left })
}

// ---------------------------------------------------------------------------------------------
// The bans in force, and what to send the daemon

/// The bans the LAPI's decisions make, by network: each decision's id and when it ends. A
/// network is banned until its last decision ends.
#[derive(Debug, Default)]
pub(crate) struct Bans {
    by_net: BTreeMap<IpNet, BTreeMap<i64, Instant>>,
    /// Networks whose entry the daemon must (re)take, with the last end of their decisions.
    pending_add: BTreeSet<IpNet>,
    /// Networks whose entry the daemon must remove.
    pending_rm: BTreeSet<IpNet>,
}

impl Bans {
    /// Takes in a poll's `batch`, read at `now`. `full` (an answer to `startup=true`): it is
    /// the whole set, so a ban missing from it is lifted, and every ban in it is sent again (the
    /// daemon takes a ban it has as a renewal: idempotent).
    pub fn apply(&mut self, batch: &Batch, now: Instant, full: bool) {
        let before: BTreeMap<IpNet, Option<Instant>> = if full {
            let old = std::mem::take(&mut self.by_net);
            old.into_iter().map(|(net, ids)| (net, ids.values().max().copied())).collect()
        } else {
            let touched = batch.deleted.iter().chain(&batch.new).map(|d| d.net);
            touched.map(|net| (net, self.end(&net))).collect()
        };
        for d in &batch.deleted {
            if let Some(ids) = self.by_net.get_mut(&d.net) {
                ids.remove(&d.id);
                if ids.is_empty() {
                    self.by_net.remove(&d.net);
                }
            }
        }
        for d in &batch.new {
            // Ten years on from a monotonic clock's now always fits an Instant; were it not to,
            // the decision is skipped rather than the bouncer stopped.
            let Some(end) = now.checked_add(d.left.magnitude.min(MAX_BAN)) else { continue };
            self.by_net.entry(d.net).or_default().insert(d.id, end);
        }
        let mut touched: BTreeSet<IpNet> = before.keys().copied().collect();
        touched.extend(batch.new.iter().map(|d| d.net));
        for net in touched {
            let was = before.get(&net).copied().flatten();
            match self.end(&net) {
                None => {
                    self.pending_add.remove(&net);
                    if was.is_some() {
                        self.pending_rm.insert(net);
                    }
                }
                Some(end) if full || was != Some(end) => {
                    self.pending_rm.remove(&net);
                    self.pending_add.insert(net);
                }
                Some(_) => {}
            }
        }
    }

    /// When the ban on `net` ends (its last decision's end), if it is banned.
    fn end(&self, net: &IpNet) -> Option<Instant> {
        self.by_net.get(net).and_then(|ids| ids.values().max().copied())
    }

    /// Forgets decisions ended by `now` (the daemon expires their entries itself).
    pub fn expire(&mut self, now: Instant) {
        self.by_net.retain(|_, ids| {
            ids.retain(|_, end| *end > now);
            !ids.is_empty()
        });
        let by_net = &self.by_net;
        self.pending_add.retain(|net| by_net.contains_key(net));
    }

    /// What the daemon must still be told, as of `now`: the entries to add with their time
    /// left (rounded up to the millisecond, so a ban never ends early), and those to remove.
    pub fn pending(&self, now: Instant) -> (Vec<(IpNet, Duration)>, Vec<IpNet>) {
        let adds = self
            .pending_add
            .iter()
            .filter_map(|net| {
                let left = self.end(net)?.checked_duration_since(now).filter(|d| !d.is_zero())?;
                Some((*net, round_up_ms(left)))
            })
            .collect();
        (adds, self.pending_rm.iter().copied().collect())
    }

    /// Lifts what the daemon holds of ours (`listed`, origin crowdsec) that the bans do not
    /// have: a decision deleted while no bouncer ran. Called after the first full set.
    pub fn reconcile(&mut self, listed: &[IpNet]) {
        for net in listed {
            if !self.by_net.contains_key(net) {
                self.pending_rm.insert(*net);
            }
        }
    }

    /// The daemon took the removals.
    pub fn removed(&mut self) {
        self.pending_rm.clear();
    }

    /// The daemon took the additions.
    pub fn added(&mut self) {
        self.pending_add.clear();
    }

    /// How many networks are banned.
    pub fn len(&self) -> usize {
        self.by_net.len()
    }
}

fn round_up_ms(d: Duration) -> Duration {
    let ms = d.as_nanos().div_ceil(1_000_000);
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
}

// ---------------------------------------------------------------------------------------------
// The LAPI

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
    #[error("the LAPI at {url} sent an unreadable answer: {source}")]
    Body { url: String, source: Box<ureq::Error> },
    #[error("the LAPI at {url} sent {source}")]
    Garbage { url: String, source: StreamError },
}

pub(crate) struct Lapi {
    agent: ureq::Agent,
    url: String,
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

    /// One poll: the full set (`startup`) or the changes since the last poll.
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
        let body = answer
            .body_mut()
            .with_config()
            .limit(MAX_BODY)
            .read_to_vec()
            .map_err(|e| PollError::Body { url: url.clone(), source: Box::new(e) })?;
        parse_stream(&body).map_err(|source| PollError::Garbage { url: url.clone(), source })
    }
}

// ---------------------------------------------------------------------------------------------
// The loop

/// Where the bans go: the daemon's deny list, through its socket.
pub(crate) trait Sink {
    fn add(&mut self, entries: &[(IpNet, Duration)]) -> Result<(), String>;
    fn rm(&mut self, nets: &[IpNet]) -> Result<(), String>;
    /// The networks the daemon holds an entry of ours for.
    fn listed(&mut self) -> Result<Vec<IpNet>, String>;
}

/// The next backoff after one of `current`.
pub(crate) fn next_backoff(current: Duration) -> Duration {
    current.saturating_mul(2).min(BACKOFF_MAX)
}

/// Polls forever (the process ends on a signal; the bans it applied stay in the daemon, each
/// until its time).
pub(crate) fn run(lapi: &Lapi, sink: &mut impl Sink, interval: Duration) -> ! {
    let mut bans = Bans::default();
    let mut startup = true;
    let mut backoff = BACKOFF_MIN;
    let mut lapi_down = false;
    let mut daemon_down = false;
    // Until the daemon's entries of ours were compared with a first full set.
    let mut reconciled = false;
    tracing::info!(lapi = %lapi.url, interval = ?interval, "crowdsec bouncer started");
    loop {
        let wait = match lapi.poll(startup) {
            Ok(batch) => {
                let now = Instant::now();
                bans.expire(now);
                bans.apply(&batch, now, startup);
                if startup && !reconciled {
                    // A daemon that cannot be asked now is asked after the next full set.
                    if let Ok(listed) = sink.listed() {
                        bans.reconcile(&listed);
                        reconciled = true;
                    }
                }
                if lapi_down {
                    tracing::info!(lapi = %lapi.url, "the LAPI answers again");
                    lapi_down = false;
                }
                if batch.skipped.total() > 0 {
                    tracing::info!(skipped = batch.skipped.total(), "decisions skipped: {}", batch.skipped);
                }
                if !batch.new.is_empty() || !batch.deleted.is_empty() || startup {
                    tracing::info!(
                        new = batch.new.len(),
                        deleted = batch.deleted.len(),
                        full = startup,
                        banned = bans.len(),
                        "decisions read"
                    );
                }
                startup = false;
                backoff = BACKOFF_MIN;
                interval
            }
            Err(e) => {
                // The bans applied stay (fail static); the next answer is asked for in full,
                // to catch up on what changed meanwhile.
                tracing::error!(retry_in = ?backoff, "{e}; the bans applied are kept");
                lapi_down = true;
                startup = true;
                let wait = backoff;
                backoff = next_backoff(backoff);
                wait
            }
        };
        let now = Instant::now();
        bans.expire(now);
        let (adds, rms) = bans.pending(now);
        let sent = (|| {
            if !rms.is_empty() {
                sink.rm(&rms)?;
                bans.removed();
            }
            if !adds.is_empty() {
                sink.add(&adds)?;
                bans.added();
            }
            Ok::<_, String>(())
        })();
        match sent {
            Ok(()) if daemon_down => {
                tracing::info!("the daemon takes bans again");
                daemon_down = false;
            }
            Ok(()) => {
                if !adds.is_empty() || !rms.is_empty() {
                    tracing::info!(added = adds.len(), removed = rms.len(), "bans applied");
                }
            }
            Err(e) => {
                // Kept pending, sent again after the next poll.
                if !daemon_down {
                    tracing::error!("{e}; bans kept pending, retried on every poll");
                }
                daemon_down = true;
            }
        }
        std::thread::sleep(wait);
    }
}

// ---------------------------------------------------------------------------------------------
// The daemon

/// The bouncer's bans, into the daemon's deny list as expiring entries of origin crowdsec.
pub(crate) struct DaemonSink {
    pub socket: PathBuf,
}

impl Sink for DaemonSink {
    fn add(&mut self, entries: &[(IpNet, Duration)]) -> Result<(), String> {
        let socket = self.socket.clone();
        let refused = bisect(entries, &mut |part: &[(IpNet, Duration)]| {
            client::ban_add(&socket, List::Deny, Origin::Crowdsec, part).map(drop)
        })?;
        report_refused("add", &refused, entries.len());
        Ok(())
    }

    fn rm(&mut self, nets: &[IpNet]) -> Result<(), String> {
        let socket = self.socket.clone();
        let refused =
            bisect(nets, &mut |part: &[IpNet]| client::ban_rm(&socket, List::Deny, Origin::Crowdsec, part).map(drop))?;
        report_refused("removal", &refused, nets.len());
        Ok(())
    }

    fn listed(&mut self) -> Result<Vec<IpNet>, String> {
        // A page at a time: the list may hold millions.
        let mut ours = Vec::new();
        for page in client::ban_list(&self.socket, List::Deny).map_err(|e| e.to_string())? {
            let page = page.map_err(|e| e.to_string())?;
            ours.extend(page.into_iter().filter(|b| b.origin == Origin::Crowdsec).map(|b| b.cidr));
        }
        Ok(ours)
    }
}

/// Sends `items` through `send`; a request the daemon refuses as bad input (nothing of it
/// applied) is split in halves and sent again, down to the one item at fault, so one ban the
/// daemon will not take does not hold back the others. (A ban its rules refuse, broader than
/// the floor or over the allow list, it leaves out itself, applying the rest.) Returns
/// the refused items' first refusal and their count; an error when the daemon cannot be asked.
fn bisect<T>(
    items: &[T],
    send: &mut impl FnMut(&[T]) -> Result<(), BanCallError>,
) -> Result<Option<(String, usize)>, String> {
    if items.is_empty() {
        return Ok(None);
    }
    match send(items) {
        Ok(()) => Ok(None),
        Err(BanCallError::Refused(why)) if items.len() == 1 => Ok(Some((why, 1))),
        Err(BanCallError::Refused(_)) => {
            let (a, b) = items.split_at(items.len() / 2);
            let first = bisect(a, send)?;
            let second = bisect(b, send)?;
            Ok(match (first, second) {
                (Some((why, n)), Some((_, m))) => Some((why, n + m)),
                (one, other) => one.or(other),
            })
        }
        Err(e) => Err(e.to_string()),
    }
}

fn report_refused(what: &str, refused: &Option<(String, usize)>, of: usize) {
    if let Some((why, n)) = refused {
        tracing::warn!(refused = n, of, "the daemon refused {n} ban {what}(s), dropped (first: {why})");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Option<(bool, u128)> {
        go_duration(s).map(|d| (d.negative, d.magnitude.as_nanos()))
    }

    #[test]
    fn go_durations_as_crowdsec_writes_them() {
        const S: u128 = 1_000_000_000;
        assert_eq!(d("4h"), Some((false, 4 * 3600 * S)));
        assert_eq!(d("4h59m58.5s"), Some((false, (4 * 3600 + 59 * 60 + 58) * S + S / 2)));
        assert_eq!(d("3.956111315s"), Some((false, 3_956_111_315)));
        assert_eq!(d("9m58.956109232s"), Some((false, 598 * S + 956_109_232)));
        assert_eq!(d("-2.06220007s"), Some((true, 2_062_200_070)));
        assert_eq!(d("-1s"), Some((true, S)));
        assert_eq!(d("+5s"), Some((false, 5 * S)));
        assert_eq!(d("0"), Some((false, 0)));
        assert_eq!(d("-0s"), Some((false, 0)), "minus zero is zero, not negative");
        assert_eq!(d("300ms"), Some((false, 300_000_000)));
        assert_eq!(d("1us"), Some((false, 1_000)));
        assert_eq!(d("1µs"), Some((false, 1_000)));
        assert_eq!(d("1μs"), Some((false, 1_000)));
        assert_eq!(d("7ns"), Some((false, 7)));
        assert_eq!(d(".5s"), Some((false, S / 2)));
        assert_eq!(d("5.s"), Some((false, 5 * S)));
        assert_eq!(d("1h1h"), Some((false, 2 * 3600 * S)), "Go sums repeated units");
        // A long fraction, exact (it once overflowed into 3 m 16 s).
        assert_eq!(d("0.99999999999999999999999999h"), Some((false, 3600 * S - 1)));
        // Go's longest duration, and just past what 64 bits of nanoseconds hold.
        assert_eq!(d("2562047h47m16.854775807s"), Some((false, i64::MAX as u128)));
        assert_eq!(d("5124095h"), Some((false, 5124095 * 3600 * S)));
        assert_eq!(d("5124096h"), None, "beyond 2^64 ns");
    }

    #[test]
    fn go_durations_refuse_garbage_and_huge_values() {
        for bad in [
            "",
            "-",
            "+",
            "s",
            ".s",
            "5",
            "12",
            "5d",
            "5 s",
            " 5s",
            "5s ",
            "5S",
            "1h-5m",
            "--5s",
            "5sx",
            "0x10s",
            "1e3s",
            "NaN",
            "∞s",
            "99999999999999999999999999999999999999999999h",
            "184467440737095516160ns",
        ] {
            assert_eq!(go_duration(bad), None, "{bad:?}");
        }
    }

    const ANSWER: &str = r#"{"deleted":null,"new":[
        {"duration":"3.956111315s","id":1,"origin":"cscli","scenario":"manual","scope":"Ip","type":"ban","value":"198.18.0.7"},
        {"duration":"9m58.9s","id":3,"origin":"cscli","scenario":"manual","scope":"Ip","type":"captcha","value":"2001:db8::5"},
        {"duration":"59m58.9s","id":2,"origin":"cscli","scenario":"manual","scope":"Range","type":"ban","value":"198.18.4.0/24"}]}"#;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn a_stream_answer_gives_its_bans_and_counts_the_rest() {
        let batch = parse_stream(ANSWER.as_bytes()).unwrap();
        assert_eq!(batch.deleted, []);
        let nets: Vec<(i64, IpNet)> = batch.new.iter().map(|d| (d.id, d.net)).collect();
        assert_eq!(nets, [(1, net("198.18.0.7/32")), (2, net("198.18.4.0/24"))]);
        assert_eq!(batch.new[0].left.magnitude, Duration::from_nanos(3_956_111_315));
        assert_eq!(batch.skipped, Skipped { not_ban: 1, ..Skipped::default() });

        let deleted = r#"{"deleted":[{"duration":"-2.06220007s","id":1,"origin":"cscli","scope":"Ip","type":"ban",
            "value":"198.18.0.7"}],"new":null}"#;
        let batch = parse_stream(deleted.as_bytes()).unwrap();
        assert_eq!(batch.deleted.len(), 1);
        assert_eq!(batch.deleted[0].net, net("198.18.0.7/32"));
        assert_eq!(batch.skipped.total(), 0, "a deleted decision's negative duration is no reason to skip it");
        assert_eq!(parse_stream(br#"{"deleted":null,"new":null}"#).unwrap(), Batch::default());
    }

    #[test]
    fn odd_decisions_are_skipped_one_by_one() {
        let body = r#"{"new":[
            {"duration":"1h","id":1,"scope":"ip","type":"BAN","value":"2001:db8::1"},
            {"duration":"1h","id":2,"scope":"Range","type":"ban","value":"198.18.4.1/24"},
            {"duration":"-1s","id":3,"scope":"Ip","type":"ban","value":"198.18.0.3"},
            {"duration":"0s","id":4,"scope":"Ip","type":"ban","value":"198.18.0.4"},
            {"duration":"1h","id":5,"scope":"Country","type":"ban","value":"FR"},
            {"duration":"1h","id":6,"scope":"Ip","type":"ban","value":"010.0.0.1"},
            {"duration":"1h","id":7,"scope":"Ip","type":"ban","value":"198.18.0.1/32"},
            {"duration":"1 hour","id":8,"scope":"Ip","type":"ban","value":"198.18.0.8"},
            {"duration":3600,"id":9,"scope":"Ip","type":"ban","value":"198.18.0.9"},
            {"duration":"1h","id":"ten","scope":"Ip","type":"ban","value":"198.18.0.10"},
            {"duration":"1h","id":11,"scope":"Ip","type":"ban"},
            {"duration":"1h","id":12,"scope":"Range","type":"ban","value":"198.18.0.0/33"},
            {"duration":"9999999999h","id":13,"scope":"Ip","type":"ban","value":"198.18.0.13"},
            "garbage", 42, null, [],
            {"duration":"2562047h","id":14,"scope":"Ip","type":"ban","value":"198.18.0.14","extra":{"a":[1]}},
            {"duration":"1h","id":15,"scope":"Ip","type":"ban","value":"::ffff:198.18.0.15"}
        ]}"#;
        let batch = parse_stream(body.as_bytes()).unwrap();
        let nets: Vec<(i64, IpNet)> = batch.new.iter().map(|d| (d.id, d.net)).collect();
        assert_eq!(
            nets,
            [
                (1, net("2001:db8::1/128")),
                (2, net("198.18.4.0/24")),
                (14, net("198.18.0.14/32")),
                (15, net("198.18.0.15/32"))
            ]
        );
        assert_eq!(batch.skipped, Skipped { not_ban: 0, scope: 1, expired: 2, malformed: 12 });
    }

    #[test]
    fn garbage_answers_are_refused_whole() {
        for bad in [
            "",
            "null",
            "[]",
            "{}",
            "\"new\"",
            "<html>502 Bad Gateway</html>",
            r#"{"message":"access forbidden"}"#,
            r#"{"new":[{"duration":"1h","id":1,"scope":"Ip","type":"ban","value":"198.18.0.1"}]"#,
            r#"{"new":{"duration":"1h"}}"#,
            r#"{"new":"198.18.0.1"}"#,
            r#"{"deleted":5}"#,
        ] {
            assert!(parse_stream(bad.as_bytes()).is_err(), "{bad:?}");
        }
        let mut garbage = vec![0xff, 0xfe, b'{'];
        garbage.extend(std::iter::repeat_n(b'[', 10_000));
        assert!(parse_stream(&garbage).is_err());
        // Deep nesting inside an element: serde_json's recursion limit, an error, not a crash.
        let deep = format!(r#"{{"new":[{}{}]}}"#, "[".repeat(100_000), "]".repeat(100_000));
        assert!(parse_stream(deep.as_bytes()).is_err());
    }

    fn ban(id: i64, n: &str, secs: u64) -> Decision {
        Decision { id, net: net(n), left: SignedDuration { negative: false, magnitude: Duration::from_secs(secs) } }
    }

    fn batch(new: Vec<Decision>, deleted: Vec<Decision>) -> Batch {
        Batch { new, deleted, skipped: Skipped::default() }
    }

    fn pending(bans: &Bans, now: Instant) -> (Vec<(String, u64)>, Vec<String>) {
        let (adds, rms) = bans.pending(now);
        (
            adds.into_iter().map(|(n, d)| (n.to_string(), d.as_secs())).collect(),
            rms.into_iter().map(|n| n.to_string()).collect(),
        )
    }

    #[test]
    fn bans_follow_their_last_decision_and_are_sent_once() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(&batch(vec![ban(1, "198.18.0.7/32", 60), ban(2, "198.18.0.7/32", 600)], vec![]), t0, true);
        assert_eq!(pending(&bans, t0), (vec![("198.18.0.7/32".into(), 600)], vec![]));
        bans.added();
        assert_eq!(pending(&bans, t0), (vec![], vec![]));
        // The longer decision deleted: the ban now ends with the shorter one, and is sent again.
        bans.apply(&batch(vec![], vec![ban(2, "198.18.0.7/32", 0)]), t0, false);
        assert_eq!(pending(&bans, t0), (vec![("198.18.0.7/32".into(), 60)], vec![]));
        bans.added();
        // The last one deleted: removed.
        bans.apply(&batch(vec![], vec![ban(1, "198.18.0.7/32", 0)]), t0, false);
        assert_eq!(pending(&bans, t0), (vec![], vec!["198.18.0.7/32".into()]));
        bans.removed();
        // Deleting what is not banned sends nothing.
        bans.apply(&batch(vec![], vec![ban(9, "198.18.0.9/32", 0)]), t0, false);
        assert_eq!(pending(&bans, t0), (vec![], vec![]));
        assert_eq!(bans.len(), 0);
    }

    #[test]
    fn a_full_set_lifts_what_it_lacks_and_renews_the_rest() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(&batch(vec![ban(1, "198.18.0.1/32", 60), ban(2, "198.18.0.2/32", 60)], vec![]), t0, true);
        bans.added();
        // After an outage: the full set no longer has .1 (deleted meanwhile) and still has .2.
        let t1 = t0 + Duration::from_secs(10);
        bans.apply(&batch(vec![ban(2, "198.18.0.2/32", 50)], vec![]), t1, true);
        assert_eq!(pending(&bans, t1), (vec![("198.18.0.2/32".into(), 50)], vec!["198.18.0.1/32".into()]));
    }

    #[test]
    fn a_first_full_set_lifts_what_the_daemon_holds_of_a_previous_run() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(&batch(vec![ban(1, "198.18.0.1/32", 60)], vec![]), t0, true);
        bans.reconcile(&[net("198.18.0.1/32"), net("198.18.0.2/32")]);
        assert_eq!(pending(&bans, t0), (vec![("198.18.0.1/32".into(), 60)], vec!["198.18.0.2/32".into()]));
    }

    #[test]
    fn pending_adds_wait_for_the_daemon_and_lapse_with_their_time() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        bans.apply(&batch(vec![ban(1, "198.18.0.1/32", 5), ban(2, "198.18.0.2/32", 60)], vec![]), t0, true);
        // The daemon was down for 10 s: what is sent then has 50 s left, and the 5 s ban none.
        let t1 = t0 + Duration::from_secs(10);
        bans.expire(t1);
        assert_eq!(pending(&bans, t1), (vec![("198.18.0.2/32".into(), 50)], vec![]));
        assert_eq!(bans.len(), 1);
    }

    #[test]
    fn a_huge_duration_is_cut_to_the_longest_ban() {
        let t0 = Instant::now();
        let mut bans = Bans::default();
        let huge = go_duration("2562047h47m16.854775807s").unwrap();
        bans.apply(&batch(vec![Decision { id: 1, net: net("198.18.0.1/32"), left: huge }], vec![]), t0, true);
        let (adds, _) = bans.pending(t0);
        assert_eq!(adds, [(net("198.18.0.1/32"), MAX_BAN)]);
    }

    #[test]
    fn backoff_doubles_to_its_cap() {
        let mut b = BACKOFF_MIN;
        let mut seen = vec![b.as_secs()];
        for _ in 0..7 {
            b = next_backoff(b);
            seen.push(b.as_secs());
        }
        assert_eq!(seen, [1, 2, 4, 8, 16, 30, 30, 30]);
    }

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

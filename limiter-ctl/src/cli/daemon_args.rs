//! `limiter-ctl daemon`'s flags, and the parsers of their values.

use std::{path::PathBuf, time::Duration};

use clap::{Args, ValueHint};

use super::args::{DEFAULT_STATE_DIR, parse_prog};
use crate::{
    api::start::{MetricsAt, Options},
    config::{self, Rate, parse_burst},
    kernel::{
        self, BucketCount, GeometryRequest, HookRequest, ModeRequest, Placement, ProgRef, TcApiRequest, TcxPlace, pins,
    },
};

// A flag given twice takes its last value: the units pass defaults (--wait-iface, --metrics)
// that LIMITER_OPTS, after them, can override.
#[derive(Debug, Args)]
#[command(args_override_self = true)]
pub(crate) struct DaemonArgs {
    /// Interface to protect.
    #[arg(long, value_name = "IFACE", value_hint = ValueHint::Other)]
    pub iface: String,
    /// Wait this long for a missing interface to appear (e.g. 5min; 0: fail at once, exit 2).
    /// Still missing then: exit 1, so a supervisor retries.
    #[arg(long, value_name = "DURATION", default_value = "0s", value_parser = parse_wait)]
    pub wait_iface: Duration,
    /// Policies and lists, loaded at start, re-read when it changes, on `limiter-ctl reload` or SIGHUP, edited in
    /// place on every change (comments, order, owner, mode and a symlink kept).
    #[arg(long, value_name = "PATH", default_value = config::DEFAULT_PATH)]
    pub config: PathBuf,
    /// Apply a changed config file within about 2 s of its writer closing it, as SIGHUP would
    /// (the path is followed as named: a ConfigMap's `..data` swap, a symlink swapped, its
    /// directory made again are seen too); a CLI change then applies a hand edit first.
    /// `--watch-config=false`: only on SIGHUP or `limiter-ctl reload`, and a CLI change refuses
    /// to overwrite a hand edit not yet applied.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    pub watch_config: bool,
    /// Install (or replace) the policy "default", matching all traffic, at this rate per source.
    #[arg(long, value_name = "RATE", allow_hyphen_values = true)]
    pub rate: Option<Rate>,
    /// Burst of the "default" policy [default: one second's worth of the rate].
    #[arg(long, value_name = "N", value_parser = parse_burst, requires = "rate", allow_negative_numbers = true)]
    pub burst: Option<u64>,
    /// Buckets per CPU, for policies of scope cpu (a power of two from 16 to 16777216), or auto:
    /// the largest power of two within 1/512 of the host's memory over its possible CPUs,
    /// 4096 to 65536. Memory is buckets x 16 bytes x CPUs.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = parse_buckets)]
    pub buckets: BucketCount,
    /// Count-min rows of the per-CPU buckets (1 to 4): the buckets are split into this many rows
    /// and a source keeps one bucket in each; it is judged by the least spent, so an innocent
    /// source is refused only when a flooder shares every one of its rows. Same memory whatever
    /// the count.
    #[arg(long, value_name = "D", default_value_t = limiter_common::rows::DEFAULT_ROWS, value_parser = parse_rows)]
    pub rows: u32,
    /// Buckets for policies of scope host, shared by every CPU (a power of two from 16 to
    /// 16777216), or auto: the largest power of two within 1/256 of the host's memory,
    /// 1048576 to 4194304. Memory is buckets x 16 bytes, once.
    #[arg(long, value_name = "auto|N", default_value = "auto", value_parser = parse_buckets)]
    pub host_buckets: BucketCount,
    /// Count-min rows of the host-scope buckets (1 or 2), as --rows for the per-CPU ones. Two by
    /// default: fewer innocents refused than one row up to about 0.48 x the buckets in flooding
    /// sources.
    #[arg(long, value_name = "D", default_value_t = limiter_common::rows::DEFAULT_HOST_ROWS, value_parser = parse_host_rows)]
    pub host_rows: u32,
    /// Where to judge packets: xdp (cheapest; alone on the interface), tc (tc ingress, shared
    /// with other programs in order, leaving XDP free; `tcx` is the same), or auto: XDP when it
    /// is free, tc ingress when another program holds it (logged, naming it); a limiter pinned
    /// here keeps its hook.
    #[arg(long, value_enum, value_name = "HOOK", default_value_t = HookRequest::Auto)]
    pub attach: HookRequest,
    /// How to attach at tc ingress: tcx (a link, Linux 6.6+), netlink (a filter on the clsact
    /// qdisc, every kernel; beside other tc filters, by priority), or auto: tcx where the kernel
    /// has it, netlink where it has not (logged, saying why). A limiter pinned here keeps its own.
    #[arg(long, value_enum, value_name = "API", default_value_t = TcApiRequest::Auto)]
    pub tc_api: TcApiRequest,
    /// XDP attach mode: auto tries native and falls back to skb with a warning.
    #[arg(long, value_enum, default_value_t = ModeRequest::Auto)]
    pub mode: ModeRequest,
    /// At tc ingress, run before this program (its name as `bpftool prog` shows it, or id:N)
    /// rather than first of all. Through netlink: at the priority right before its filter's.
    #[arg(long, value_name = "PROG", value_parser = parse_prog, conflicts_with = "tcx_after")]
    pub tcx_before: Option<ProgRef>,
    /// At tc ingress, run after this program (its name as `bpftool prog` shows it, or id:N).
    /// Through netlink: at the priority right after its filter's.
    #[arg(long, value_name = "PROG", value_parser = parse_prog)]
    pub tcx_after: Option<ProgRef>,
    /// Print admitted and refused packets per second at this interval (e.g. 1s); off by default.
    #[arg(long, value_name = "DURATION", value_parser = parse_interval)]
    pub stats_every: Option<Duration>,
    /// Draw a new salt this often (e.g. 1h, 30min, 90s), or `off`.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = parse_rotation)]
    pub rotate_every: Rotation,
    /// Where the program, its link and maps are pinned (bpffs), under a directory per interface.
    #[arg(long, value_name = "PATH", default_value = pins::DEFAULT_ROOT)]
    pub pin_dir: PathBuf,
    /// Where the daemon keeps runtime state: the expiring allow and deny entries (bans), in
    /// bans-IFACE.json, so a restart keeps each with the time it had left.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Let processes of this group (a name or a number; their effective group, as a unit's
    /// Group= sets it) use the control socket for what a ban feeder needs, and no more: add and
    /// remove deny bans of origin fail2ban or crowdsec, and read (stats, lists, bans, policies).
    /// The socket is then mode 0660 and of that group. The shipped units give limiter-bans, the
    /// CrowdSec bouncer's unit's group.
    #[arg(long, value_name = "GROUP", value_parser = parse_group)]
    pub socket_group: Option<u32>,
    /// Prometheus endpoint address, `off`, or `auto`: 127.0.0.1 on a port derived from the
    /// interface's name (9465-9999, logged; for one daemon per interface).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9464", value_parser = parse_metrics)]
    pub metrics: Metrics,
    /// Send 1 in N refusals to `limiter-ctl top` (a power of two; 0: none).
    #[arg(long, value_name = "N", default_value_t = crate::kernel::DEFAULT_SAMPLE_REFUSALS, value_parser = parse_sample)]
    pub sample_refusals: u32,
    /// Send at most N of those samples a second for the whole host (split evenly over the
    /// possible CPUs, at least 1 each), so a flood of any rate costs the daemon almost nothing;
    /// 0: no cap (every 1-in-N refusal, whatever the flood's rate).
    #[arg(long, value_name = "N", default_value_t = crate::kernel::DEFAULT_SAMPLES_PER_S, value_parser = parse_samples_per_s)]
    pub samples_per_s: u32,
    /// Log lines on stdout as text, or one JSON object per line (for collectors). RUST_LOG
    /// filters them (default info). Under systemd each line carries its syslog priority.
    #[arg(long, value_enum, value_name = "FORMAT", default_value_t = super::logs::LogFormat::Text)]
    pub log_format: super::logs::LogFormat,
}

/// Where the metrics endpoint listens, if anywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Metrics(pub MetricsAt);

fn parse_metrics(s: &str) -> Result<Metrics, String> {
    match s {
        "off" => Ok(Metrics(MetricsAt::Off)),
        "auto" => Ok(Metrics(MetricsAt::Auto)),
        _ => s.parse().map(|a| Metrics(MetricsAt::At(a))).map_err(|_| {
            format!("invalid metrics address '{s}': expected IP:PORT such as 127.0.0.1:9464, auto, or off")
        }),
    }
}

/// A wait: a humantime duration (`90s`, `5min`), or a bare number of seconds.
fn parse_wait(s: &str) -> Result<Duration, String> {
    config::decimal(s)
        .map(Duration::from_secs)
        .map_or_else(|| humantime::parse_duration(s), Ok)
        .map_err(|_| format!("invalid duration '{s}': expected a duration such as 90s or 5min, or 0 not to wait"))
}

fn parse_sample(s: &str) -> Result<u32, String> {
    match config::decimal(s).and_then(|n| u32::try_from(n).ok()) {
        Some(n) if n == 0 || (n.is_power_of_two() && n <= 1 << 20) => Ok(n),
        _ => Err(format!("invalid sample rate '{s}': expected 0 (none) or a power of two up to 1048576, such as 256")),
    }
}

fn parse_samples_per_s(s: &str) -> Result<u32, String> {
    config::decimal(s).and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
        format!("invalid samples per second '{s}': expected 0 (no cap) or a whole number up to 4294967295, such as 256")
    })
}

impl DaemonArgs {
    /// The daemon's options, as these flags give them.
    pub(crate) fn options(self) -> Options {
        Options {
            iface: self.iface,
            wait_iface: self.wait_iface,
            config: self.config,
            watch_config: self.watch_config,
            rate: self.rate,
            burst: self.burst,
            geometry: GeometryRequest {
                buckets: self.buckets,
                rows: self.rows,
                host_buckets: self.host_buckets,
                host_rows: self.host_rows,
            },
            placement: Placement {
                hook: self.attach,
                mode: self.mode,
                tcx: match (self.tcx_before, self.tcx_after) {
                    (Some(p), _) => TcxPlace::Before(p),
                    (None, Some(p)) => TcxPlace::After(p),
                    (None, None) => TcxPlace::First,
                },
                tc_api: self.tc_api,
            },
            stats_every: self.stats_every,
            rotate_every: self.rotate_every.0,
            pin_dir: self.pin_dir,
            state_dir: self.state_dir,
            socket_group: self.socket_group,
            metrics: self.metrics.0,
            sample_refusals: self.sample_refusals,
            samples_per_s: self.samples_per_s,
        }
    }
}

fn parse_buckets(s: &str) -> Result<BucketCount, String> {
    if s == "auto" {
        return Ok(BucketCount::Auto);
    }
    let n = config::decimal(s).and_then(|n| u32::try_from(n).ok());
    n.and_then(|n| kernel::check_buckets(n).ok()).map(BucketCount::Exactly).ok_or_else(|| {
        format!(
            "invalid bucket count '{s}': expected auto, or a power of two from {} to {}",
            limiter_common::maps::MIN_BUCKETS,
            limiter_common::maps::MAX_BUCKETS
        )
    })
}

fn parse_host_rows(s: &str) -> Result<u32, String> {
    let n = config::decimal(s).and_then(|n| u32::try_from(n).ok());
    n.and_then(|n| kernel::check_host_rows(n).ok())
        .ok_or_else(|| format!("invalid row count '{s}': expected 1 or {}", limiter_common::rows::MAX_HOST_ROWS))
}

fn parse_rows(s: &str) -> Result<u32, String> {
    let n = config::decimal(s).and_then(|n| u32::try_from(n).ok());
    n.and_then(|n| kernel::check_rows(n).ok())
        .ok_or_else(|| format!("invalid row count '{s}': expected 1 to {}", limiter_common::rows::MAX_ROWS))
}

/// How often the daemon draws a new salt; `off`: only on `limiter-ctl salt rotate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rotation(pub Option<Duration>);

fn parse_rotation(s: &str) -> Result<Rotation, String> {
    if s == "off" {
        return Ok(Rotation(None));
    }
    match humantime::parse_duration(s) {
        Ok(d) if d >= Duration::from_millis(10) => Ok(Rotation(Some(d))),
        _ => Err(format!(
            "invalid rotation interval '{s}': expected a duration of at least 10ms such as 1h, 30min or 90s, or off"
        )),
    }
}

/// A group's id, from its name (the group database) or as a number.
fn parse_group(s: &str) -> Result<u32, String> {
    if let Some(gid) = config::decimal(s) {
        return u32::try_from(gid).map_err(|_| format!("invalid group '{s}': a group id is below 2^32"));
    }
    match nix::unistd::Group::from_name(s) {
        Ok(Some(group)) => Ok(group.gid.as_raw()),
        Ok(None) => Err(format!("no group '{s}' (see `getent group`; the package creates limiter-bans)")),
        Err(e) => Err(format!("looking up group '{s}': {e}")),
    }
}

/// Whole seconds from 1, as humantime writes them (`1s`, `5s`, `2m`), or bare (`5`).
fn parse_interval(s: &str) -> Result<Duration, String> {
    let err = || format!("invalid interval '{s}': expected whole seconds such as 1s or 5s");
    let d = match config::decimal(s) {
        Some(n) => Duration::from_secs(n),
        None => humantime::parse_duration(s).map_err(|_| err())?,
    };
    if d.is_zero() || d.subsec_nanos() != 0 {
        return Err(err());
    }
    Ok(d)
}

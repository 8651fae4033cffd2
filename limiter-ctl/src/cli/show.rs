//! Human output (aligned tables) and `--json` output of the read commands.

use std::{fmt::Write as _, io::Write};

use comfy_table::{Cell, CellAlignment, Table, presets::NOTHING};
use ipnet::IpNet;
use serde::Serialize;

use crate::{
    api::{
        ipc::{BanStatus, PolicyStatus},
        stats, top,
    },
    config::{FIELDS, Field},
};

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_style(NOTHING).set_header(header.iter().map(Cell::new));
    t
}

fn right(v: u64) -> Cell {
    Cell::new(v).set_alignment(CellAlignment::Right)
}

pub(super) fn policies(all: &[PolicyStatus]) -> String {
    // NAME, then a column per field (see `config::FIELDS`), then the counters.
    let fields = FIELDS.iter().map(|f| f.key.to_uppercase());
    let header: Vec<String> = ["NAME".to_string()]
        .into_iter()
        .chain(fields)
        .chain(["ADMITTED", "REFUSED", "DRY-RUN"].map(String::from))
        .collect();
    let mut t = table(&header.iter().map(String::as_str).collect::<Vec<_>>());
    for p in all {
        let d = &p.def;
        let fields = d.fields().into_iter().zip(FIELDS).map(|((_, text), f)| field_cell(f, text));
        t.add_row(
            [Cell::new(&d.name)]
                .into_iter()
                .chain(fields)
                .chain([p.counters.admitted_packets, p.counters.refused_packets, p.counters.dry_run_packets].map(right))
                .collect::<Vec<_>>(),
        );
    }
    t.trim_fmt() + "\n"
}

/// A field's cell: numbers to the right.
fn field_cell(field: &Field, text: String) -> Cell {
    let cell = Cell::new(text);
    if field.number { cell.set_alignment(CellAlignment::Right) } else { cell }
}

pub(super) fn policy(p: &PolicyStatus) -> String {
    let d = &p.def;
    let c = &p.counters;
    let head = [("name", d.name.to_string()), ("id", p.id.to_string())];
    let counters = [
        ("admitted", format!("{} packets, {} bytes", c.admitted_packets, c.admitted_bytes)),
        ("refused", format!("{} packets, {} bytes", c.refused_packets, c.refused_bytes)),
        ("dry-run", format!("{} packets, {} bytes would have been refused", c.dry_run_packets, c.dry_run_bytes)),
        ("overruled", format!("{} packets (refused by another layer)", c.overruled_packets)),
        ("allowed", format!("{} packets (allow list)", c.allowed_packets)),
        ("denied", format!("{} packets (deny list)", c.denied_packets)),
    ];
    let mut t = Table::new();
    t.load_style(NOTHING);
    for (k, v) in head.into_iter().chain(d.fields()).chain(counters) {
        t.add_row(vec![Cell::new(k), Cell::new(v)]);
    }
    t.trim_fmt() + "\n"
}

/// The bans in force per family and origin, and what they decided, in a line.
fn bans_line(b: &stats::BanStats) -> String {
    let family = |m: &std::collections::BTreeMap<String, u64>| {
        let total: u64 = m.values().sum();
        let parts: Vec<String> = m.iter().filter(|(_, n)| **n > 0).map(|(o, n)| format!("{o} {n}")).collect();
        if parts.is_empty() { total.to_string() } else { format!("{total} ({})", parts.join(", ")) }
    };
    let sum = |m: &std::collections::BTreeMap<String, u64>| m.values().sum::<u64>();
    format!(
        "bans in force: IPv4 {}, IPv6 {}; added {}, expired {}, refused {} since start; {} packets dropped, {} allowed \
         by bans\n",
        family(&b.active_v4),
        family(&b.active_v6),
        sum(&b.added),
        sum(&b.expired),
        family(&b.refused),
        b.dropped_packets,
        b.allowed_packets
    )
}

/// `allow|deny list`: CIDR, ORIGIN, EXPIRES (time left; `-`: permanent), a line per entry as
/// the entries come. Plain columns, not a table: a list may hold two million bans.
pub(super) fn list(
    out: &mut impl Write,
    permanent: &[IpNet],
    bans: impl Iterator<Item = BanStatus>,
) -> std::io::Result<()> {
    // A line at a time in one buffer, padded by hand: `{:<43}` pads a char per call, which
    // was a sixth of a list's time at two million lines.
    let mut line = String::new();
    let mut row = |out: &mut dyn Write, cidr: &dyn std::fmt::Display, origin: &str, expires: &dyn std::fmt::Display| {
        line.clear();
        let _ = write!(line, "{cidr}");
        pad(&mut line, 0, 43);
        let start = line.len();
        line.push_str(origin);
        pad(&mut line, start, 9);
        let _ = writeln!(line, "{expires}");
        out.write_all(line.as_bytes())
    };
    row(out, &"CIDR", "ORIGIN", &"EXPIRES")?;
    for net in permanent {
        row(out, net, "config", &"-")?;
    }
    for b in bans {
        row(out, &b.cidr, b.origin.as_str(), &time_left(b.expires_in_ms))?;
    }
    Ok(())
}

/// The cell begun at `start` padded to `width` (ASCII), then the gap after it.
fn pad(line: &mut String, start: usize, width: usize) {
    line.extend(std::iter::repeat_n(' ', (start + width).saturating_sub(line.len()) + 1));
}

/// An entry as `list --json` says it; `expires_in_ms` and `expires_at_ms` are null for a
/// permanent entry (origin `config`). Fields in alphabetical order, as they always were.
#[derive(Serialize)]
struct Listed {
    cidr: IpNet,
    expires_at_ms: Option<u64>,
    expires_in_ms: Option<u64>,
    origin: &'static str,
}

/// A ban's time left, in whole seconds rounded up (`59m 58s`), as `list` and `explain` say it.
pub(super) fn time_left(ms: u64) -> humantime::FormattedDuration {
    humantime::format_duration(std::time::Duration::from_secs(ms.div_ceil(1000)))
}

/// `allow|deny list --json`: an array of [`Listed`], written as the entries come.
pub(super) fn list_json(
    out: &mut impl Write,
    permanent: &[IpNet],
    bans: impl Iterator<Item = BanStatus>,
) -> std::io::Result<()> {
    let permanent =
        permanent.iter().map(|n| Listed { cidr: *n, expires_at_ms: None, expires_in_ms: None, origin: "config" });
    let bans = bans.map(|b| Listed {
        cidr: b.cidr,
        expires_at_ms: Some(b.expires_at_ms),
        expires_in_ms: Some(b.expires_in_ms),
        origin: b.origin.as_str(),
    });
    serde::Serializer::collect_seq(&mut serde_json::Serializer::pretty(&mut *out), permanent.chain(bans))?;
    out.write_all(b"\n")
}

pub(super) fn stats(s: &stats::Snapshot) -> String {
    let mut t = table(&[
        "POLICY",
        "SCOPE",
        "ADMITTED/S",
        "REFUSED/S",
        "DRY-RUN/S",
        "ADMITTED",
        "REFUSED",
        "DRY-RUN",
        "ALLOWED",
        "DENIED",
    ]);
    let per_s = |v: f64| Cell::new(format!("{v:.0}")).set_alignment(CellAlignment::Right);
    for p in &s.policies {
        // Every policy says its scope: a rate per CPU and one for the host differ k-fold.
        let scope = p.labels.get("scope").map_or("-", String::as_str);
        t.add_row(vec![
            Cell::new(&p.name),
            Cell::new(scope),
            per_s(p.rates.admitted_per_s),
            per_s(p.rates.refused_per_s),
            per_s(p.rates.dry_run_per_s),
            right(p.totals.admitted_packets),
            right(p.totals.refused_packets),
            right(p.totals.dry_run_packets),
            right(p.totals.allowed_packets),
            right(p.totals.denied_packets),
        ]);
    }
    // What the lists decided for traffic no policy matched: otherwise seen nowhere in the table.
    let none = &s.no_policy;
    if none.allowed_packets + none.denied_packets > 0 {
        let dash = || Cell::new("-").set_alignment(CellAlignment::Right);
        t.add_row(vec![
            Cell::new("(no policy)"),
            dash(),
            dash(),
            dash(),
            dash(),
            dash(),
            dash(),
            dash(),
            right(none.allowed_packets),
            right(none.denied_packets),
        ]);
    }
    // Layers: which policy a refusal was counted under is the REFUSED column; what the other
    // layers had judged of those packets, here (only when layers overlap).
    let overruled: Vec<String> = s
        .policies
        .iter()
        .filter(|p| p.totals.overruled_packets > 0)
        .map(|p| format!("{} {}", p.name, p.totals.overruled_packets))
        .collect();
    let overruled = if overruled.is_empty() {
        String::new()
    } else {
        format!("overruled (judged, then refused by another layer): {}\n", overruled.join(", "))
    };
    let u = &s.unjudged;
    let occupancy = s.bucket_occupancy.map_or("not measured yet".to_string(), |o| format!("{:.2}%", o * 100.0));
    let geometry = s.geometry.map(|g| format!("{}\n", g.text())).unwrap_or_default();
    let bans = s.bans.as_ref().map(bans_line).unwrap_or_default();
    format!(
        "{}\n{overruled}{bans}passed unjudged: {} not IP, {} malformed, {} unmatched, {} allow-listed; dropped unjudged: {} deny-listed, {} with unreadable ports; limiter errors: {}\nmode {}, salt age {:.0} s, bucket occupancy {}\n{geometry}",
        t.trim_fmt(),
        u.not_ip,
        u.malformed,
        u.unmatched,
        s.allowed,
        s.denied,
        s.unreadable_ports,
        u.errors,
        match (&s.attach_reason, &s.attach_api_reason) {
            (Some(why), Some(api)) => format!("{} ({why}; through netlink: {api})", s.attach_mode),
            (Some(why), None) => format!("{} ({why})", s.attach_mode),
            (None, _) => s.attach_mode.clone(),
        },
        s.salt_age_s,
        occupancy
    )
}

pub(super) fn top(r: &top::Report) -> String {
    let mut t = table(&["PREFIX", "POLICY", "DPORT", "SAMPLES", "EST. REFUSED/S", "MODE"]);
    for e in &r.entries {
        t.add_row(vec![
            Cell::new(e.prefix),
            Cell::new(&e.policy),
            Cell::new(e.dport.map_or("-".to_string(), |p| p.to_string())),
            right(e.samples),
            Cell::new(format!("{:.0}", e.refused_per_s)).set_alignment(CellAlignment::Right),
            Cell::new(if e.dry_run { "dry-run" } else { "enforce" }),
        ]);
    }
    let budget = match r.samples_per_s {
        0 => String::new(),
        n => format!(", at most {n} samples/s"),
    };
    format!("{}\n(1 in {} refusals sampled{budget}, over the last {} s)\n", t.trim_fmt(), r.sample_one_in, r.window_s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Origin;

    fn bans() -> Vec<BanStatus> {
        let ban = |cidr: &str, origin, left| BanStatus {
            cidr: cidr.parse().unwrap(),
            origin,
            expires_at_ms: 1_700_000_000_000 + left,
            expires_in_ms: left,
        };
        vec![
            ban("198.18.0.5/32", Origin::Cli, 599_001),
            ban("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff/128", Origin::Crowdsec, 3_600_000),
            ban("2001:db8::/48", Origin::Fail2ban, 1),
        ]
    }

    /// The columns as `{:<43} {:<9} {}` lays them out, whatever the widths.
    #[test]
    fn a_list_is_laid_out_in_columns() {
        let mut out = Vec::new();
        list(&mut out, &["198.18.1.0/24".parse().unwrap()], bans().into_iter()).unwrap();
        let mut want = format!("{:<43} {:<9} {}\n", "CIDR", "ORIGIN", "EXPIRES");
        for (cidr, origin, left) in [
            ("198.18.1.0/24", "config", "-"),
            ("198.18.0.5/32", "cli", "10m"),
            ("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff/128", "crowdsec", "1h"),
            ("2001:db8::/48", "fail2ban", "1s"),
        ] {
            want.push_str(&format!("{cidr:<43} {origin:<9} {left}\n"));
        }
        assert_eq!(String::from_utf8(out).unwrap(), want);
    }

    /// `--json`: an array of objects, fields in alphabetical order, nulls for a permanent entry,
    /// pretty as `serde_json::to_string_pretty` makes it; `[]` when empty.
    #[test]
    fn a_json_list_is_one_array() {
        let mut out = Vec::new();
        list_json(&mut out, &["198.18.1.0/24".parse().unwrap()], bans().into_iter()).unwrap();
        let text = String::from_utf8(out).unwrap();
        let mut want = vec![
            serde_json::json!({"cidr": "198.18.1.0/24", "origin": "config", "expires_in_ms": null, "expires_at_ms": null}),
        ];
        want.extend(bans().iter().map(|b| {
            serde_json::json!({"cidr": b.cidr, "origin": b.origin, "expires_in_ms": b.expires_in_ms, "expires_at_ms": b.expires_at_ms})
        }));
        assert_eq!(text, serde_json::to_string_pretty(&want).unwrap() + "\n");
        let mut out = Vec::new();
        list_json(&mut out, &[], std::iter::empty()).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "[]\n");
    }
}

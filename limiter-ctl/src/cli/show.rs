//! Human output (aligned tables) and `--json` output of the read commands.

use comfy_table::{Cell, CellAlignment, Table, presets::NOTHING};
use ipnet::IpNet;

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

/// `allow|deny list`: CIDR, ORIGIN, EXPIRES (time left; `-`: permanent). Plain columns, not a
/// table: a list may hold a million bans.
pub(super) fn list(permanent: &[IpNet], bans: &[BanStatus]) -> String {
    let mut out = format!("{:<43} {:<9} {}\n", "CIDR", "ORIGIN", "EXPIRES");
    for net in permanent {
        out.push_str(&format!("{:<43} {:<9} -\n", net.to_string(), "config"));
    }
    for b in bans {
        let left = humantime::format_duration(std::time::Duration::from_secs(b.expires_in_ms.div_ceil(1000)));
        out.push_str(&format!("{:<43} {:<9} {left}\n", b.cidr.to_string(), b.origin.as_str()));
    }
    out
}

/// `allow|deny list --json`: one object per entry; `expires_in_ms` and `expires_at_ms` are null
/// for a permanent entry (origin `config`).
pub(super) fn list_json(permanent: &[IpNet], bans: &[BanStatus]) -> Result<String, serde_json::Error> {
    let mut all: Vec<serde_json::Value> = permanent
        .iter()
        .map(|n| serde_json::json!({"cidr": n, "origin": "config", "expires_in_ms": null, "expires_at_ms": null}))
        .collect();
    all.extend(bans.iter().map(|b| {
        serde_json::json!({
            "cidr": b.cidr, "origin": b.origin, "expires_in_ms": b.expires_in_ms, "expires_at_ms": b.expires_at_ms
        })
    }));
    serde_json::to_string_pretty(&all).map(|s| s + "\n")
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
        match &s.attach_reason {
            Some(why) => format!("{} ({why})", s.attach_mode),
            None => s.attach_mode.clone(),
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

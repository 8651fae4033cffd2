//! Human output (aligned tables) and `--json` output of the read commands.

use comfy_table::{Cell, CellAlignment, Table, presets::NOTHING};
use ipnet::IpNet;

use crate::ipc::PolicyStatus;

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_style(NOTHING).set_header(header.iter().map(|h| Cell::new(h)));
    t
}

fn right(v: u64) -> Cell {
    Cell::new(v).set_alignment(CellAlignment::Right)
}

pub fn policies(all: &[PolicyStatus]) -> String {
    let mut t = table(&["NAME", "MATCH", "RATE", "BURST", "KEY", "UNIT", "MODE", "ADMITTED", "REFUSED", "DRY-RUN"]);
    for p in all {
        let d = &p.def;
        t.add_row(vec![
            Cell::new(&d.name),
            Cell::new(d.matches),
            Cell::new(d.rate),
            right(d.burst.unwrap_or_default()),
            Cell::new(d.key),
            Cell::new(d.unit.as_str()),
            Cell::new(d.mode.as_str()),
            right(p.counters.admitted_packets),
            right(p.counters.refused_packets),
            right(p.counters.dry_run_packets),
        ]);
    }
    t.trim_fmt() + "\n"
}

pub fn policy(p: &PolicyStatus) -> String {
    let d = &p.def;
    let c = &p.counters;
    let rows = [
        ("name", d.name.to_string()),
        ("id", p.id.to_string()),
        ("match", d.matches.to_string()),
        ("rate", d.rate.to_string()),
        ("burst", d.burst.unwrap_or_default().to_string()),
        ("key", d.key.to_string()),
        ("unit", d.unit.as_str().into()),
        ("mode", d.mode.as_str().into()),
        ("admitted", format!("{} packets, {} bytes", c.admitted_packets, c.admitted_bytes)),
        ("refused", format!("{} packets, {} bytes", c.refused_packets, c.refused_bytes)),
        ("dry-run", format!("{} packets, {} bytes would have been refused", c.dry_run_packets, c.dry_run_bytes)),
        ("allowed", format!("{} packets (allow list)", c.allowed_packets)),
        ("denied", format!("{} packets (deny list)", c.denied_packets)),
    ];
    let mut t = Table::new();
    t.load_style(NOTHING);
    for (k, v) in rows {
        t.add_row(vec![Cell::new(k), Cell::new(v)]);
    }
    t.trim_fmt() + "\n"
}

pub fn nets(nets: &[IpNet]) -> String {
    nets.iter().map(|n| format!("{n}\n")).collect()
}

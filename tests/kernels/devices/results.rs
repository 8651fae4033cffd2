//! What the guest measured, read from its console, and held to the bounds: the report first
//! (rows for docs/OPERATIONS.md's "Devices"), then the assertions.

use std::{collections::BTreeMap, time::Duration};

use limiter_tests::{
    bounds::{check_lower, check_overload, check_upper_over},
    flood::Report,
    policies::gcra,
    vm::{Outcome, say},
};

use super::{BURST, RATE};

/// What the host sent for one flood, and what the tap dropped of it.
pub struct Sent {
    pub report: Report,
    pub dropped: u64,
}

/// One `LAB-RESULT` line (tests/src/bin/lab-measure.rs).
#[derive(Debug, Default)]
struct Measured {
    admitted: u64,
    refused: u64,
    errors: u64,
    unjudged: u64,
    delivered: u64,
    window: Duration,
    /// Judged, per CPU.
    cpus: Vec<u64>,
    /// Received, per queue of the NIC.
    queues: Vec<u64>,
}

impl Measured {
    fn parse(line: &str) -> Option<(String, Self)> {
        let fields: BTreeMap<&str, &str> = line.split_whitespace().filter_map(|w| w.split_once('=')).collect();
        let n = |k: &str| fields.get(k)?.parse::<u64>().ok();
        let list = |k: &str| -> Option<Vec<u64>> {
            fields.get(k)?.split('/').filter(|s| !s.is_empty()).map(|s| s.parse().ok()).collect()
        };
        Some((
            fields.get("name")?.to_string(),
            Self {
                admitted: n("admitted")?,
                refused: n("refused")?,
                errors: n("errors")?,
                unjudged: n("unjudged")?,
                delivered: n("delivered")?,
                window: Duration::from_micros(n("window_us")?),
                cpus: list("cpus")?,
                queues: list("queues")?,
            },
        ))
    }

    fn judged(&self) -> u64 {
        self.admitted + self.refused
    }
}

/// Where a daemon attached (`LAB-MODE`), and why it fell back if it did (its `LAB-LOG` lines).
struct Mode {
    phase: String,
    iface: String,
    mode: String,
    fallback: Option<String>,
}

/// The `LAB-MODE` lines in order, each with the fallback its daemon logged (the `LAB-LOG` lines
/// of its interface that follow it, before the next daemon's).
fn modes(out: &Outcome) -> Vec<Mode> {
    let mut modes: Vec<Mode> = Vec::new();
    for line in &out.output {
        if let Some(l) = line.strip_prefix("LAB-MODE ") {
            let fields: BTreeMap<&str, &str> = l.split_whitespace().filter_map(|w| w.split_once('=')).collect();
            let field = |k: &str| fields.get(k).map_or_else(String::new, |v| v.to_string());
            modes.push(Mode { phase: field("phase"), iface: field("iface"), mode: field("mode"), fallback: None });
        } else if let (Some(l), Some(last)) = (line.strip_prefix("LAB-LOG "), modes.last_mut()) {
            let said = l.strip_prefix(&format!("{} ", last.iface));
            if let Some(said) = said.filter(|s| s.contains("fell back")) {
                last.fallback.get_or_insert_with(|| said.to_string());
            }
        }
    }
    modes
}

/// The floods that must spread over queues and CPUs: untagged, to the NIC's own address.
const SPREAD: [&str; 2] = ["mq", "untagged"];

/// Prints what each case measured, then holds it to the bounds.
pub fn check(out: &Outcome, suite: &str, order: &[&str], sent: &BTreeMap<String, Sent>) {
    let measured: BTreeMap<String, Measured> = out.lines_after("LAB-RESULT ").filter_map(Measured::parse).collect();
    let modes = modes(out);
    let g = gcra(RATE, BURST);
    let mut text = format!(
        "devices: {} ({suite}), {:.0?} from QEMU's start to the end; policy {RATE}/s burst {BURST}, host scope\n",
        out.release, out.took
    );
    let notes = ["LAB-CHANNELS ", "LAB-RESIZE ", "LAB-LINK ", "LAB-DMESG ", "LAB-FAILOVER "];
    for l in notes.iter().flat_map(|p| out.lines_after(p)) {
        text.push_str(&format!("  {l}\n"));
    }
    text.push_str("| phase | interface | attach mode | fallback |\n|---|---|---|---|\n");
    for m in &modes {
        text.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            m.phase,
            m.iface,
            m.mode,
            m.fallback.as_deref().unwrap_or("-")
        ));
    }
    text.push_str(
        "| flood | sent | pps | tap dropped | judged per CPU | per queue | admitted | bound | window | delivered |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for name in order {
        let (Some(s), Some(m)) = (sent.get(*name), measured.get(*name)) else {
            text.push_str(&format!("| {name} | did not run |\n"));
            continue;
        };
        text.push_str(&format!(
            "| {name} | {} | {:.0} | {} | {:?} | {:?} | {} | {} | {:.3?} | {} |\n",
            s.report.sent,
            s.report.pps(),
            s.dropped,
            m.cpus,
            m.queues,
            m.admitted,
            g.bound(limiter_tests::bounds::nanos(m.window)),
            m.window,
            m.delivered
        ));
    }
    for e in out.lines_after("LAB-RESULT-ERROR ") {
        text.push_str(&format!("  lab-measure failed: {e}\n"));
    }
    say(&text);

    assert_eq!(out.status, 0, "the guest's script failed on {} ({suite})", out.release);
    for m in &modes {
        let what = format!("{} ({suite}), phase {}, {}", out.release, m.phase, m.iface);
        assert_ne!(m.mode, "none", "{what}: the daemon did not attach");
        if m.iface != "eth0.10" {
            assert!(["native", "skb"].contains(&m.mode.as_str()), "{what}: --attach xdp attached at {}", m.mode);
        }
        if m.mode == "skb" {
            assert!(m.fallback.is_some(), "{what}: in skb mode without saying why native XDP was refused");
        }
    }
    assert_eq!(modes.len(), 6, "six daemons started (phases A to F)");
    // balance-alb has no XDP: native must be refused, and the daemon say so.
    assert!(
        modes.iter().any(|m| m.iface == "bond2" && m.mode == "skb"),
        "on a balance-alb bond, --mode auto did not fall back to skb mode"
    );
    let failover: Vec<&str> = out.lines_after("LAB-FAILOVER ").flat_map(str::split_whitespace).collect();
    assert!(
        matches!(failover.as_slice(), [from, to] if from != to),
        "the active-backup bond's active member did not change: {failover:?}"
    );
    // At skb mode the program runs on the bond, which drops what its inactive member receives
    // before the program sees it; natively it runs on each member.
    let bond_ab_native = modes.iter().any(|m| m.iface == "bond1" && m.mode == "native");
    for name in order {
        let s = sent.get(*name).unwrap_or_else(|| panic!("{name}: the host sent no flood"));
        let m = measured.get(*name).unwrap_or_else(|| panic!("{name}: the guest measured nothing"));
        let what = format!("{name} on {} ({suite})", out.release);
        check_overload(&s.report, RATE as f64, 1);
        assert_eq!(m.errors, 0, "{what}: the program reported internal errors");
        let arrived = s.report.sent - s.dropped;
        let unjudged = format!(
            "{what}: judged {} (unjudged beside them: {}) of {} sent, {} dropped by the tap",
            m.judged(),
            m.unjudged,
            s.report.sent,
            s.dropped
        );
        if *name == "bond-ab" {
            // Admitted on the inactive member, a frame is then dropped by the bond.
            assert!(
                m.delivered > 0 && m.delivered <= m.admitted,
                "{what}: delivered {} of {}",
                m.delivered,
                m.admitted
            );
            if bond_ab_native {
                assert_eq!(m.judged(), arrived, "{unjudged}: a frame passed unjudged");
            } else {
                assert!(m.judged() <= arrived, "{unjudged}");
            }
        } else {
            assert_eq!(m.judged(), arrived, "{unjudged}: a frame passed unjudged");
            assert_eq!(m.admitted, m.delivered, "{what}: admitted vs delivered to the guest's socket");
        }
        // One allowance however many CPUs judged: host scope shares the source's bucket.
        check_upper_over(&what, m.admitted, &g, 1, m.window);
        check_lower(&what, m.admitted, &g, &s.report);
        let busy = |v: &[u64]| v.iter().filter(|&&n| n > 0).count();
        if SPREAD.contains(name) || name.starts_with("bond") {
            // The multiqueue NIC's queues, or the bond's two members.
            assert!(busy(&m.queues) >= 2, "{what}: received {:?} per queue: not spread", m.queues);
        }
        if SPREAD.contains(name) {
            assert!(busy(&m.cpus) >= 2, "{what}: judged {:?} per CPU: not spread over CPUs", m.cpus);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_line_reads_back() {
        let line = "name=bond-ab admitted=499 refused=5502 errors=0 unjudged=0 delivered=240 window_us=2007000 \
                    cpus=3001/3000 queues=3001/3000";
        let (name, m) = Measured::parse(line).expect("a whole line");
        assert_eq!(name, "bond-ab");
        assert_eq!((m.admitted, m.judged(), m.delivered), (499, 6001, 240));
        assert_eq!(m.window, Duration::from_millis(2007));
        assert_eq!((m.cpus, m.queues), (vec![3001, 3000], vec![3001, 3000]));
        let (_, none) = Measured::parse(&line.replace("queues=3001/3000", "queues=")).expect("no queue counts");
        assert!(none.queues.is_empty());
        assert!(Measured::parse("name=mq admitted=1").is_none(), "a line cut short");
    }
}

//! `limiter-ctl explain ADDR`: its arguments, and its answer in words.

use std::{fmt::Write as _, net::IpAddr, path::Path, process::ExitCode};

use clap::Args;

use super::{Error, client, escape, fail, render, show};
use crate::api::{
    explain::{Explanation, PolicyLook, Proto, Query, Verdict},
    ipc::Request,
};

#[derive(Debug, Args)]
pub(crate) struct ExplainArgs {
    /// The packet's source address (IPv4 or IPv6).
    #[arg(value_name = "ADDR")]
    pub addr: IpAddr,
    /// Its protocol.
    #[arg(long, value_enum, default_value_t = Proto::Tcp)]
    pub proto: Proto,
    /// Its destination port (without it, policies on ports are not consulted).
    #[arg(long, value_name = "PORT")]
    pub dport: Option<u16>,
    /// Its source port (for policies with a source-port range).
    #[arg(long, value_name = "PORT")]
    pub sport: Option<u16>,
    /// A connection opening: TCP SYN without ACK (for SYN-only policies).
    #[arg(long)]
    pub syn: bool,
    /// Its destination address (for policies with a destination prefix).
    #[arg(long, value_name = "ADDR")]
    pub dst: Option<IpAddr>,
    #[arg(long)]
    pub json: bool,
}

pub(super) fn run(socket: &Path, args: ExplainArgs) -> ExitCode {
    let query = Query {
        addr: Some(args.addr),
        proto: args.proto,
        dport: args.dport,
        sport: args.sport,
        syn: args.syn,
        dst: args.dst,
    };
    if let Err(e) = query.check() {
        return fail(&Error::Usage(e));
    }
    client(socket, Request::Explain { query }, |data| render::<Explanation>(data, args.json, |e| text(&e)))
}

/// The answer in words: the verdict first, then what stands in the way, in judging order.
fn text(e: &Explanation) -> String {
    let mut s = String::new();
    let verdict = match e.verdict {
        Verdict::Admitted => "admitted",
        Verdict::Refused => "REFUSED",
        Verdict::WouldRefuse => "would be refused (dry run: passes)",
        Verdict::Denied => "DENIED",
        Verdict::Allowed => "allowed (passes unjudged)",
        Verdict::Unjudged => "passes unjudged: no policy covers it",
    };
    let _ = write!(s, "{}: {verdict}", e.packet);
    if let Some(by) = &e.by {
        let _ = write!(s, " by {by}");
    }
    if let Some(cpus) = &e.on_cpus {
        let _ = write!(s, " on CPU {}", list(cpus));
    }
    match (e.verdict, e.retry_after_ms) {
        (Verdict::Refused | Verdict::Denied, Some(ms)) => {
            let _ = write!(s, "; passes again in {ms:.1} ms (Retry-After), if it sends nothing meanwhile");
        }
        (Verdict::Refused | Verdict::Denied, None) => s.push_str("; until the rule changes"),
        _ => {}
    }
    s.push('\n');
    if !e.entries.is_empty() {
        s.push_str("\nlist entries covering it (longest first):\n");
        for entry in &e.entries {
            let origin = entry.origin.map_or("config file", |o| o.as_str());
            let left =
                entry.expires_in_ms.map_or("permanent".to_string(), |ms| format!("{} left", show::time_left(ms)));
            let _ = writeln!(s, "  {} {}  ({origin}, {left})", entry.list.as_str(), entry.cidr);
        }
    }
    if e.policies.is_empty() {
        s.push_str("\nno policy judges it");
        if !e.passed_over.is_empty() {
            let _ = write!(s, " ({} do not cover it: predicates)", e.passed_over.join(", "));
        }
        s.push('\n');
    } else {
        s.push_str("\npolicies, in judging order:\n");
        for (i, p) in e.policies.iter().enumerate() {
            policy(&mut s, i + 1, p);
        }
        if !e.passed_over.is_empty() {
            let _ = writeln!(s, "  not judged (predicates do not hold): {}", e.passed_over.join(", "));
        }
    }
    for note in &e.notes {
        let _ = writeln!(s, "note: {note}");
    }
    for warning in &e.warnings {
        let _ = writeln!(s, "warning: {warning}");
    }
    escape::controls(&s, true).into_owned()
}

fn policy(s: &mut String, n: usize, p: &PolicyLook) {
    let verdict = match p.verdict {
        Verdict::Admitted => "admits",
        Verdict::WouldRefuse => "would refuse (dry run)",
        _ => "refuses",
    };
    let key = match p.key_dport {
        Some(port) => format!("{} port {port}", p.key),
        None => p.key.to_string(),
    };
    let _ = writeln!(s, "  {n}. '{}' (scope {}): key {key}: {verdict}", p.name, p.scope);
    if p.buckets.is_empty() && p.scope == "cpu" {
        let _ = writeln!(s, "     every CPU's buckets idle: the whole burst is there");
    } else if p.buckets.is_empty() {
        let _ = writeln!(s, "     a rate of 0: refuses every packet it judges");
    }
    for b in &p.buckets {
        let whose = b.cpu.map_or("every CPU".to_string(), |c| format!("CPU {c}"));
        let next =
            if b.admit { "admits now".to_string() } else { format!("next admitted in {:.1} ms", b.retry_after_ms) };
        let rows: Vec<String> = b
            .rows
            .iter()
            .map(|r| {
                let by = r.written_by.as_deref().map(|w| format!(", by '{w}'")).unwrap_or_default();
                format!("row {} bucket {}: {:.1} ms spent{by}", r.row, r.bucket, r.spent_ms)
            })
            .collect();
        let _ = writeln!(s, "     {whose}: {next}; burst whole in {:.1} ms; {}", b.full_after_ms, rows.join("; "));
    }
    if p.idle_cpus > 0 && !p.buckets.is_empty() {
        let _ = writeln!(s, "     {} other CPU(s): idle, the whole burst there", p.idle_cpus);
    }
    if let Some(shared) = &p.shared {
        let _ = writeln!(s, "     shares every row with other sources: {shared}");
    }
}

fn list(cpus: &[usize]) -> String {
    cpus.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

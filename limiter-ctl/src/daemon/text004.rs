//! Prometheus' text format 0.0.4, for scrapers that ask for it: `/metrics` is OpenMetrics
//! otherwise.

pub(super) const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub(super) const TEXT_004: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a client's Accept header asks for Prometheus' text format only (it names text/plain
/// and neither OpenMetrics nor anything at all): everyone else, Prometheus included, gets
/// OpenMetrics.
pub(super) fn wants_text_004(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| a.contains("text/plain") && !a.contains("openmetrics") && !a.contains("*/*"))
}

/// OpenMetrics text as Prometheus' text format 0.0.4: a counter's HELP and TYPE name its
/// `_total` series (OpenMetrics names the family without it), and no `# EOF`. Only counters and
/// gauges are exposed here, so nothing else differs.
pub(super) fn to_text_004(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.contains(name).then(|| format!("{prefix}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

//! What the verifier made of the limiter's programs, and the bar they are held to: every program
//! the daemon loads verifies in at most [`MAX_INSNS`] processed instructions on every kernel of
//! the matrix (issue 38), so a feature cannot quietly eat the headroom under the kernel's
//! 1,000,000. The counts are the verifier's own (the program's `verified_insns`, 5.16 and
//! later): on this kernel tests/datapath/fixtures.rs reads them; in the kernel matrix
//! (tests/kernels/matrix.rs) `limiter-verify` prints one line a program, which [`parse`] reads.

/// The most instructions the verifier may process for any one program.
pub const MAX_INSNS: u64 = 500_000;

/// What the verifier said of one program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Loaded, after processing this many instructions (None: the kernel does not say).
    Loaded(Option<u64>),
    /// Refused: why (the log's last word on it), and how many instructions it had processed.
    Refused { why: String, processed: Option<u64> },
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Loaded(Some(n)) => f.write_str(&thousands(*n)),
            Self::Loaded(None) => f.write_str("loaded (count not reported)"),
            Self::Refused { why, processed: Some(n) } => write!(f, "refused after {}: {why}", thousands(*n)),
            Self::Refused { why, processed: None } => write!(f, "refused: {why}"),
        }
    }
}

/// `n` with commas between thousands, as the docs write counts.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Each program's verdict from `limiter-verify`'s lines, in order: `verify NAME: ok insns=N`, or
/// `verify NAME: refused ...` followed by the end of the verifier's log (lines `  | ...`).
/// Other lines (a console's kernel messages) are skipped.
pub fn parse<'a>(lines: impl IntoIterator<Item = &'a str>) -> Vec<(String, Verdict)> {
    let mut out: Vec<(String, Verdict)> = Vec::new();
    for line in lines {
        if let Some(log) = line.strip_prefix("  | ") {
            if let Some((_, Verdict::Refused { why, processed })) = out.last_mut() {
                read_log_line(log, why, processed);
            }
            continue;
        }
        let Some((name, said)) = line.strip_prefix("verify ").and_then(|l| l.split_once(": ")) else { continue };
        let verdict = match said.strip_prefix("ok insns=") {
            Some(n) => Verdict::Loaded(n.trim().parse().ok()),
            None => Verdict::Refused { why: said.to_string(), processed: None },
        };
        out.push((name.to_string(), verdict));
    }
    out
}

/// The statistics a log ends with (`processed N insns ...`, then or before it the time, the
/// stack and, from 6.x, each subprogram's share): not the reason for a refusal.
const STATISTICS: [&str; 4] = ["processed ", "verification time", "stack depth", "subprog "];

/// One line of a refusal's log: the count from the verifier's statistics line (`processed N
/// insns (limit 1000000) ...`), and the last line that is not statistics as the reason.
fn read_log_line(log: &str, why: &mut String, processed: &mut Option<u64>) {
    let log = log.trim();
    if let Some(rest) = log.strip_prefix("processed ") {
        *processed = rest.split_whitespace().next().and_then(|n| n.parse().ok());
    } else if !log.is_empty() && !STATISTICS.iter().any(|s| log.starts_with(s)) {
        *why = log.to_string();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limiter_verify_lines_are_read() {
        let out = "\
verify limiter_layers: ok insns=295758
[  12.3] random kernel message
verify limiter: refused (Permission denied (os error 13))
  | 454: (0f) r5 += r3
  | math between pkt pointer and register with unbounded min value is not allowed
  | processed 147894 insns (limit 1000000) max_states_per_insn 4 total_states 900 peak_states 800 mark_read 30
  | 
verify limiter_tcx: ok insns=?
verify limiter_lay_tcx: refused (Argument list too long (os error 7))
  | BPF program is too large. Processed 1000001 insn
  | verification time 54842821 usec
  | stack depth max 0
  | subprog 0 (limiter_tcx) main insns_self 664201 insns_total 1000001 stack 416
  | processed 1000001 insns (limit 1000000) max_states_per_insn 30 total_states 71463 peak_states 4909";
        let got = parse(out.lines());
        assert_eq!(got.len(), 4);
        assert_eq!(got[0], ("limiter_layers".into(), Verdict::Loaded(Some(295_758))));
        assert_eq!(
            got[1].1,
            Verdict::Refused {
                why: "math between pkt pointer and register with unbounded min value is not allowed".into(),
                processed: Some(147_894)
            }
        );
        assert_eq!(got[2].1, Verdict::Loaded(None));
        let too_large = "BPF program is too large. Processed 1000001 insn".to_string();
        assert_eq!(got[3].1, Verdict::Refused { why: too_large, processed: Some(1_000_001) });
        assert_eq!(got[0].1.to_string(), "295,758");
        assert_eq!(thousands(1_000_001), "1,000,001");
        assert_eq!(thousands(999), "999");
    }
}

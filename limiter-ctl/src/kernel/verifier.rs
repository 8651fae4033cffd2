//! A program the verifier refused: its last words make the error's one line (what `stats`, the
//! log and the CLI show), and its whole log, hundreds of lines, goes to a file beside the
//! daemon's socket, which the line names.

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
};

use aya::programs::ProgramError;

use super::Error;

/// Where rejected programs' logs are written (set once by the daemon: its runtime directory).
static LOG_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Keeps the verifier's logs of rejected programs in `dir` (the first call wins).
pub fn keep_logs_in(dir: &Path) {
    let _ = LOG_DIR.set(dir.to_path_buf());
}

/// The error for `program` of `hook` refused by the kernel: the verifier's reason in one line,
/// its log saved to `<dir>/verifier-<program>.log` when a directory was given and writable.
pub(super) fn rejected(hook: &'static str, program: &'static str, e: ProgramError) -> Error {
    let ProgramError::LoadError { io_error, verifier_log } = e else {
        return Error::Program(e);
    };
    refusal(hook, program, &io_error, &verifier_log.to_string())
}

/// [`rejected`], from the load's error and the verifier's log.
pub(super) fn refusal(hook: &'static str, program: &'static str, io_error: &std::io::Error, log: &str) -> Error {
    let reason = match last_words(log) {
        Some(words) => format!("{words} ({io_error})"),
        None => io_error.to_string(),
    };
    let saved = LOG_DIR.get().map(|dir| dir.join(format!("verifier-{program}.log"))).filter(|path| {
        // Best effort: the one line says what matters without it.
        std::fs::write(path, log).is_ok()
    });
    Error::Rejected { hook, program, reason, saved }
}

/// The verifier's reason: the last line of its log that is neither its statistics nor an
/// instruction, e.g. `math between pkt pointer and register with unbounded min value is not
/// allowed`, or `BPF program is too large. Processed 1000001 insn`.
pub(super) fn last_words(log: &str) -> Option<&str> {
    let statistic =
        |l: &str| ["processed ", "verification time", "stack depth", "subprog "].iter().any(|s| l.starts_with(s));
    let instruction = |l: &str| l.split_once(':').is_some_and(|(n, _)| n.trim().bytes().all(|b| b.is_ascii_digit()));
    log.lines().map(str::trim).rev().find(|l| !l.is_empty() && !statistic(l) && !instruction(l) && !l.starts_with(';'))
}

#[cfg(test)]
mod tests {
    use super::last_words;

    #[test]
    fn the_reason_is_the_last_line_that_says_one() {
        let log = "0: R1=ctx() R10=fp0\n454: (0f) r5 += r3\nmath between pkt pointer and register with unbounded \
                   min value is not allowed\nverification time 5205823 usec\nstack depth 408+0\nprocessed 147894 \
                   insns (limit 1000000) max_states_per_insn 25\n";
        assert_eq!(
            last_words(log),
            Some("math between pkt pointer and register with unbounded min value is not allowed")
        );
        let stack = "combined stack size of 4 calls is 544. Too large\nverification time 25291230 usec\n";
        assert_eq!(last_words(stack), Some("combined stack size of 4 calls is 544. Too large"));
        assert_eq!(last_words("processed 1 insns\n\n"), None);
    }
}

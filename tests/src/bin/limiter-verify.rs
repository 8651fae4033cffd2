//! `limiter-verify`: loads each program of the shipped object on the running kernel and prints,
//! one line a program, what the verifier made of it: the instructions it processed and the
//! stack of the deepest call chain, or why it refused it (the last lines of its log). For the
//! kernel matrix (`cargo xtask test --group kernels`), and for seeing a change's cost at once:
//! `limiter-verify PATH` loads the object at PATH instead (a build of limiter-ebpf's `limiter`).

use std::process::ExitCode;

use aya::{
    EbpfLoader, VerifierLogLevel,
    programs::{Program, ProgramError},
};
use limiter_common::maps::{PROGRAM, PROGRAM_LAYERS, PROGRAM_LAYERS_TCX, PROGRAM_TCX};
use limiter_ctl::objects;

/// Lines of a refusal's log shown: the refusal and what led to it (`LIMITER_VERIFY_TAIL`).
const TAIL: usize = 60;

fn main() -> ExitCode {
    let object = match std::env::args_os().nth(1) {
        Some(path) => match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) => {
                println!("verify: reading {}: {e}", std::path::Path::new(&path).display());
                return ExitCode::FAILURE;
            }
        },
        None => objects::LIMITER.to_vec(),
    };
    // For digging into a refusal: `LIMITER_VERIFY_LOG=1` (or 2) logs every instruction the
    // verifier walks (the kernel keeps the last 16 MiB), `LIMITER_VERIFY_TAIL` shows more of it,
    // `LIMITER_VERIFY_ONLY` loads one program.
    let env = |name: &str| std::env::var(name).ok();
    let level = match env("LIMITER_VERIFY_LOG").as_deref() {
        Some("1") => VerifierLogLevel::DEBUG | VerifierLogLevel::STATS,
        Some("2") => VerifierLogLevel::VERBOSE | VerifierLogLevel::STATS,
        _ => VerifierLogLevel::STATS,
    };
    let tail: usize = env("LIMITER_VERIFY_TAIL").and_then(|t| t.parse().ok()).unwrap_or(TAIL);
    let only = env("LIMITER_VERIFY_ONLY");
    let mut ebpf = match EbpfLoader::new().verifier_log_level(level).load(&object) {
        Ok(ebpf) => ebpf,
        Err(e) => {
            println!("verify: the object did not load: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = false;
    for name in [PROGRAM_LAYERS, PROGRAM, PROGRAM_LAYERS_TCX, PROGRAM_TCX] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let Some(program) = ebpf.program_mut(name) else {
            println!("verify {name}: missing from the object");
            failed = true;
            continue;
        };
        let loaded = match program {
            Program::Xdp(p) => p.load(),
            Program::SchedClassifier(p) => p.load(),
            _ => Err(ProgramError::UnexpectedProgramType),
        };
        match loaded {
            Ok(()) => {
                let count = program.info().ok().and_then(|i| i.verified_instruction_count());
                println!("verify {name}: ok insns={}", count.map_or("?".into(), |c| c.to_string()));
            }
            Err(ProgramError::LoadError { io_error, verifier_log }) => {
                failed = true;
                let log = verifier_log.to_string();
                let lines: Vec<&str> = log.lines().collect();
                println!("verify {name}: refused ({io_error})");
                for line in &lines[lines.len().saturating_sub(tail)..] {
                    println!("  | {line}");
                }
            }
            Err(e) => {
                failed = true;
                println!("verify {name}: refused: {e}");
            }
        }
    }
    if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS }
}

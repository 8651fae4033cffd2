//! `limiter-verify`: loads each program of the shipped object on the running kernel and prints,
//! one line a program, what the verifier made of it: the instructions it processed and the
//! stack of the deepest call chain, or why it refused it (the last lines of its log). For the
//! kernel matrix (`cargo xtask test --group kernels`), and for seeing a change's cost at once.

use std::process::ExitCode;

use aya::{
    EbpfLoader, VerifierLogLevel,
    programs::{Program, ProgramError},
};
use limiter_common::maps::{PROGRAM, PROGRAM_LAYERS, PROGRAM_LAYERS_TCX, PROGRAM_TCX};
use limiter_ctl::objects;

/// Lines of a refusal's log shown: the refusal and what led to it.
const TAIL: usize = 60;

fn main() -> ExitCode {
    let mut ebpf = match EbpfLoader::new().verifier_log_level(VerifierLogLevel::STATS).load(objects::LIMITER) {
        Ok(ebpf) => ebpf,
        Err(e) => {
            println!("verify: the object did not load: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut failed = false;
    for name in [PROGRAM_LAYERS, PROGRAM, PROGRAM_LAYERS_TCX, PROGRAM_TCX] {
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
                for line in &lines[lines.len().saturating_sub(TAIL)..] {
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

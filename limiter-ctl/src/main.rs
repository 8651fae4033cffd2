//! `limiter-ctl`: the daemon and its CLI, one binary over the library (see `cli`).

fn main() -> std::process::ExitCode {
    limiter_ctl::cli::main()
}

//! `limiter-ctl`: the daemon and its CLI, one binary over the library (see `limiter_ctl::main`).

fn main() -> std::process::ExitCode {
    limiter_ctl::main()
}

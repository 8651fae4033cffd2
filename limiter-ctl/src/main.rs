use std::process::ExitCode;

use clap::Parser as _;
use limiter_ctl::{
    cli::{Cli, Command},
    daemon,
    error::Usage,
};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() => {
            // One line: clap's first line names the argument and the accepted form.
            let rendered = e.render().to_string();
            eprintln!("{}", rendered.lines().next().unwrap_or("error: invalid arguments"));
            return ExitCode::from(2);
        }
        Err(e) => {
            // --help, --version
            print!("{e}");
            return ExitCode::SUCCESS;
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stdout)
        .with_target(false)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime failed: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Daemon(args) => daemon::run(args).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<Usage>() => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

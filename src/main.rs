//! The `stepgate` binary: parse the command line, start the runtime, run the
//! command ([`stepgate::cli::run`]) and turn its error into an exit status.

use clap::Parser;
use std::process::ExitCode;
use stepgate::cli::Cli;

#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Logging is set up by each command, from the config it loads.
    match runtime.block_on(stepgate::cli::run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

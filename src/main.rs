use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    runner::cli::main(runner::cli::Cli::parse())
}

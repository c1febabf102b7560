use clap::Parser;

fn main() {
    runner::dist::exit_now(runner::cli::main(runner::cli::Cli::parse()))
}

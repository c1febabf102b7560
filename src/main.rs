use clap::Parser;

fn main() {
    // Before anything runs libtorch (and MKL reads its environment), in every process.
    runner::numerics::fix();
    runner::dist::exit_now(runner::cli::main(runner::cli::Cli::parse()))
}

use clap::Parser;

fn main() {
    let cli = runner::cli::Cli::parse();
    // Before anything runs libtorch (and MKL reads its environment), in every process; but for
    // `runner bench`, which measures the matmul peak with MKL's kernels for this CPU and gives
    // each run it starts its own MKL_CBWR.
    if !matches!(cli.command, runner::cli::Command::Bench(_)) {
        runner::numerics::fix();
    }
    runner::dist::exit_now(runner::cli::main(cli))
}

use clap::Parser;

fn main() {
    let cli = runner::cli::Cli::parse();
    // Before anything runs libtorch (MKL reads its environment when it loads), in every process
    // that computes under a plan's run.numerics. The others compute nothing under one: a sweep's
    // points and a bench's runs are processes of their own, each given or choosing its setting.
    if let Some(mode) = runner::cli::numerics_of(&cli) {
        if let Err(why) = runner::numerics::fix(mode) {
            runner::say_err!("error: {why}");
            runner::dist::exit_now(2);
        }
    }
    runner::dist::exit_now(runner::cli::main(cli))
}

use clap::Parser;

/// Run by the dynamic loader before anything else in the process (libtorch's initialisers
/// included): from here on a stop or preemption signal waits for the process to set itself up
/// instead of killing it ([`runner::signals`]).
#[used]
#[link_section = ".preinit_array"]
static BLOCK_SIGNALS: extern "C" fn() = block_signals;

extern "C" fn block_signals() {
    runner::signals::block_early();
}

fn main() {
    let cli = runner::cli::Cli::parse();
    // Before anything runs libtorch (MKL reads its environment when it loads), in every process
    // that computes under a plan's run.numerics. The others compute nothing under one: a sweep's
    // points and a bench's runs are processes of their own, each given or choosing its setting.
    // (It may run the process again: the signals stay blocked through that.)
    if let Some(mode) = runner::cli::numerics_of(&cli) {
        if let Err(why) = runner::numerics::fix(mode) {
            runner::say_err!("error: {why}");
            runner::dist::exit_now(2);
        }
    }
    if let Err(e) = runner::signals::install(runner::cli::signal_role(&cli)) {
        runner::say_err!("error: cannot set up the signal handlers: {e}");
        runner::dist::exit_now(1);
    }
    runner::checked::install_panic_hook();
    // A panic that no command caught (a libtorch allocation failure outside a rank) still ends
    // with its one line and exit status 1, not an unexplained 101.
    let code =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runner::cli::main(cli))).unwrap_or_else(|panic| {
            runner::say_err!("error: {}", runner::checked::panic_report(&panic));
            1
        });
    runner::dist::exit_now(code)
}

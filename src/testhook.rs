//! Hooks that let the integration tests stop a rank at a chosen moment, so that they kill it
//! exactly there (a kill during a checkpoint, during validation) instead of guessing with
//! sleeps. Inert unless their variable is set. A value is a `;`-separated list of `SPEC` or
//! `SPEC@FILE`: with a file, the hook stops the rank only once per file (the first process to
//! create it), so that a run restarted after the kill goes past the same moment.
use std::sync::OnceLock;

/// `RUNNER_TEST_STALL_AT=R:TEXT[@FILE]`: rank R stops for good once its position
/// ([`crate::rundir::position`]) is TEXT ("validate, epoch 2").
pub fn stall_at(rank: usize, text: &str) {
    static VALUE: OnceLock<Option<String>> = OnceLock::new();
    let value = VALUE.get_or_init(|| std::env::var("RUNNER_TEST_STALL_AT").ok());
    stall_if(value.as_deref(), &format!("{rank}:{text}"));
}

/// `RUNNER_TEST_WAIT_AT=R:TEXT@FILE`: rank R waits at position TEXT until FILE exists (so that
/// a test holds the run there until something else has happened).
pub fn wait_at(rank: usize, text: &str) {
    static VALUE: OnceLock<Option<String>> = OnceLock::new();
    let value = VALUE.get_or_init(|| std::env::var("RUNNER_TEST_WAIT_AT").ok());
    let spec = format!("{rank}:{text}");
    for item in value.iter().flat_map(|v| v.split(';')) {
        if let Some((_, file)) = item.split_once('@').filter(|(asked, _)| *asked == spec) {
            while !std::path::Path::new(file).exists() {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

/// `RUNNER_TEST_STALL_CHECKPOINT=R:STEP[@FILE]`: rank R stops for good once its file of the
/// checkpoint of step STEP is written, before the checkpoint is committed (in the thread that
/// writes it, with `checkpoint.async`).
pub fn stall_in_checkpoint(rank: usize, step: usize) {
    stall_if(std::env::var("RUNNER_TEST_STALL_CHECKPOINT").ok().as_deref(), &format!("{rank}:{step}"));
}

/// Stops this thread for good when `value` lists `spec` (once per `@FILE`, when it names one).
fn stall_if(value: Option<&str>, spec: &str) {
    for item in value.into_iter().flat_map(|v| v.split(';')) {
        let (asked, once) = match item.split_once('@') {
            Some((asked, file)) => (asked, Some(file)),
            None => (item, None),
        };
        if asked != spec {
            continue;
        }
        if let Some(file) = once {
            if std::fs::OpenOptions::new().write(true).create_new(true).open(file).is_err() {
                continue;
            }
        }
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

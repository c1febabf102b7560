//! The one signal setup of every runner process. The signals that stop or preempt a run are
//! blocked before any other code of the process runs ([`block_early`], from `main.rs`'s pre-init
//! hook), so one that arrives while libtorch loads, while the configuration resolves or while the
//! process runs itself again (`numerics::fix`) waits instead of killing the process. Once the
//! process knows what it is, [`install`] sets it up and unblocks them (one that arrived meanwhile
//! is delivered then):
//! - a launcher records every one of them: its waits end on them ([`interruption`]) and its
//!   supervision stops or preempts the ranks;
//! - a rank records SIGUSR1 and SIGUSR2: `run.preempt_signal` ([`set_preempt`]) stops the ranks
//!   after the same step ([`preempted`]), the other keeps its default action, as does every other
//!   signal (its launcher, torchrun or srun stops it with SIGTERM);
//! - any other command takes the default actions back.
//!
//! The launcher starts its ranks with the signals blocked ([`blocked`]): a signal it forwards to a
//! rank still starting waits for the rank's own setup.
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};

use nix::sys::signal::{pthread_sigmask, SigSet, SigmaskHow, Signal};
use signal_hook::consts::signal::*;

/// Signals that stop a run cleanly (ranks stopped, manifest `interrupted`) when a launcher gets
/// them, besides the SIGUSR1 or SIGUSR2 that is not `run.preempt_signal`.
pub const STOP: &[i32] = &[SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGALRM, SIGXCPU, SIGXFSZ, SIGVTALRM, SIGPROF];
/// The two signals `run.preempt_signal` may name.
const USR: [i32; 2] = [SIGUSR1, SIGUSR2];

/// What a process is, for its signals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `runner run` that launches ranks (on its own, or as one node of several).
    Launcher,
    /// A rank: started by `runner run`, torchrun or srun.
    Rank,
    /// Every other command.
    Other,
}

/// The last stop signal a launcher got (0: none).
static STOPPED_BY: AtomicUsize = AtomicUsize::new(0);
/// Whether SIGUSR1, SIGUSR2 arrived.
static USR_SEEN: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
/// A rank: whether SIGUSR1, SIGUSR2 take their default action (it is not the preempt signal).
static USR_DEFAULT: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
/// `run.preempt_signal` (SIGUSR1 until a plan says otherwise).
static PREEMPT: AtomicI32 = AtomicI32::new(SIGUSR1);
/// The role [`install`] set up; `None` before.
static ROLE: std::sync::OnceLock<Role> = std::sync::OnceLock::new();

fn all() -> SigSet {
    let mut set = SigSet::empty();
    for &sig in STOP.iter().chain(&USR) {
        set.add(Signal::try_from(sig).expect("a signal of this platform"));
    }
    set
}

/// Blocks the stop and preemption signals in the calling thread (at pre-init: the process's only
/// thread, whose mask every later thread inherits).
pub fn block_early() {
    let _ = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&all()), None);
}

/// Runs `f` with the signals blocked in this thread, so that what `f` starts (a rank) inherits
/// them blocked; this thread's mask is restored after.
pub fn blocked<T>(f: impl FnOnce() -> T) -> T {
    let mut old = SigSet::empty();
    let _ = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&all()), Some(&mut old));
    let out = f();
    let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None);
    out
}

/// Sets the process up as `role` and unblocks the signals; a second call changes nothing.
pub fn install(role: Role) -> std::io::Result<()> {
    if ROLE.set(role).is_err() {
        return Ok(());
    }
    match role {
        Role::Launcher => {
            for &sig in STOP {
                signal_hook::flag::register_usize(sig, &STOPPED_BY, sig as usize)?;
            }
            for (i, &sig) in USR.iter().enumerate() {
                signal_hook::flag::register(sig, &USR_SEEN[i])?;
            }
        }
        Role::Rank => {
            for (i, &sig) in USR.iter().enumerate() {
                // Registered first: the default action, once armed, ends the process.
                signal_hook::flag::register_conditional_default(sig, &USR_DEFAULT[i])?;
                signal_hook::flag::register(sig, &USR_SEEN[i])?;
            }
        }
        Role::Other => {}
    }
    pthread_sigmask(SigmaskHow::SIG_UNBLOCK, Some(&all()), None).map_err(std::io::Error::from)
}

/// `run.preempt_signal` is `signal` (SIGUSR1 or SIGUSR2). In a rank the other one takes its
/// default action from now on, and at once if it already arrived.
pub fn set_preempt(signal: i32) {
    PREEMPT.store(signal, Ordering::SeqCst);
    if ROLE.get() != Some(&Role::Rank) {
        return;
    }
    for (i, &sig) in USR.iter().enumerate().filter(|(_, &s)| s != signal) {
        USR_DEFAULT[i].store(true, Ordering::SeqCst);
        if USR_SEEN[i].load(Ordering::SeqCst) {
            let _ = signal_hook::low_level::emulate_default_handler(sig);
        }
    }
}

/// Whether this process records the preemption signal (a launcher or a rank that [`install`]ed).
pub fn watching() -> bool {
    matches!(ROLE.get(), Some(Role::Launcher | Role::Rank))
}

/// Whether `run.preempt_signal` arrived.
pub fn preempted() -> bool {
    let signal = PREEMPT.load(Ordering::SeqCst);
    USR.iter().zip(&USR_SEEN).any(|(&s, seen)| s == signal && seen.load(Ordering::SeqCst))
}

/// A launcher: the stop signal it got (SIGINT, SIGTERM, ..., or the SIGUSR that does not preempt).
pub fn stop() -> Option<i32> {
    if ROLE.get() != Some(&Role::Launcher) {
        return None;
    }
    let preempt = PREEMPT.load(Ordering::SeqCst);
    match STOPPED_BY.load(Ordering::SeqCst) {
        0 => USR.iter().zip(&USR_SEEN).find(|(&s, seen)| s != preempt && seen.load(Ordering::SeqCst)).map(|(&s, _)| s),
        sig => Some(sig as i32),
    }
}

/// A signal that ends a launcher's wait: a stop signal or the preemption signal. Ranks wait on:
/// their stop signals end them where they stand, and a preemption waits for the ranks' next
/// agreed step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interruption {
    pub signal: i32,
    pub preempt: bool,
}

/// What ends a launcher's wait now, if anything.
pub fn interruption() -> Option<Interruption> {
    if let Some(signal) = stop() {
        return Some(Interruption { signal, preempt: false });
    }
    (ROLE.get() == Some(&Role::Launcher) && preempted())
        .then(|| Interruption { signal: PREEMPT.load(Ordering::SeqCst), preempt: true })
}

/// "SIGTERM".
pub fn name(signal: i32) -> String {
    Signal::try_from(signal).map(|s| s.as_str().to_owned()).unwrap_or_else(|_| format!("signal {signal}"))
}

//! One run per directory: the launcher holds an exclusive `flock` on `.runner.lock` for the
//! whole run and writes its pid there, and a token that names this hold (host, pid, time). The
//! kernel drops the lock when the process dies however it dies, so a free lock beside a manifest
//! still `running` means that run crashed. The token tells another node's launcher whether its
//! `--out` is node 0's directory (a shared file system) without taking the lock: node 0 says its
//! token through the store ([`crate::launch::nodes`]).
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};

pub const FILE: &str = ".runner.lock";

/// The held lock; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct RunLock {
    _file: Flock<File>,
    token: String,
}

impl RunLock {
    /// What names this hold: the file's second line while it is held.
    pub fn token(&self) -> &str {
        &self.token
    }
}

/// Why the lock could not be taken.
#[derive(Debug)]
pub enum LockError {
    /// Another live process holds it (its pid, when it wrote one).
    Held(Option<u32>),
    Io(std::io::Error),
}

fn open(run_dir: &Path) -> std::io::Result<File> {
    OpenOptions::new().read(true).write(true).create(true).truncate(false).open(run_dir.join(FILE))
}

/// Takes the lock of `run_dir` (which must exist) and records this process's pid in it, and
/// the hold's token.
pub fn acquire(run_dir: &Path) -> Result<RunLock, LockError> {
    let file = open(run_dir).map_err(LockError::Io)?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(mut locked) => {
            let pid = std::process::id();
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            let token = format!("{} {pid} {}", super::manifest::hostname(), nanos.as_nanos());
            let write = (|| {
                locked.set_len(0)?;
                locked.rewind()?;
                locked.write_all(format!("{pid}\n{token}\n").as_bytes())?;
                // Another node reads the token over a shared file system while this one holds it.
                locked.sync_all()
            })();
            write.map_err(LockError::Io)?;
            Ok(RunLock { _file: locked, token })
        }
        Err((mut file, Errno::EWOULDBLOCK)) => {
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            Err(LockError::Held(pid_of(&text)))
        }
        Err((_, e)) => Err(LockError::Io(e.into())),
    }
}

/// The pid on the lock file's first line (the whole file of an older runner's).
fn pid_of(text: &str) -> Option<u32> {
    text.lines().next()?.trim().parse().ok()
}

/// The token of the last hold of `run_dir`'s lock (`None` without one), read without locking.
pub fn token_of(run_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(run_dir.join(FILE)).ok()?;
    text.lines().nth(1).map(str::to_owned).filter(|t| !t.is_empty())
}

/// The pid of the live process holding `run_dir`'s lock: `None` when nobody holds it.
pub fn holder(run_dir: &Path) -> Option<Option<u32>> {
    if !run_dir.join(FILE).exists() {
        return None;
    }
    match acquire_probe(run_dir) {
        Err(LockError::Held(pid)) => Some(pid),
        _ => None,
    }
}

/// Like [`acquire`] but without writing the pid (a probe that releases at once).
fn acquire_probe(run_dir: &Path) -> Result<(), LockError> {
    let file = OpenOptions::new().read(true).open(run_dir.join(FILE)).map_err(LockError::Io)?;
    match Flock::lock(file, FlockArg::LockSharedNonblock) {
        Ok(_) => Ok(()),
        Err((mut file, Errno::EWOULDBLOCK)) => {
            let mut text = String::new();
            let _ = file.read_to_string(&mut text);
            Err(LockError::Held(pid_of(&text)))
        }
        Err((_, e)) => Err(LockError::Io(e.into())),
    }
}

impl LockError {
    /// The message for a launcher refused `run_dir`.
    pub fn message(&self, run_dir: &Path) -> String {
        match self {
            LockError::Held(Some(pid)) => format!(
                "{} is in use by another run (runner pid {pid} holds {}); wait for it, stop it, or choose \
                 another --out",
                run_dir.display(),
                FILE
            ),
            LockError::Held(None) => {
                format!("{} is in use by another run (it holds {})", run_dir.display(), FILE)
            }
            LockError::Io(e) => format!("cannot lock {}: {e}", run_dir.join(FILE).display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_pid_and_the_lock_frees_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let lock = acquire(dir.path()).unwrap();
        match acquire(dir.path()) {
            Err(LockError::Held(Some(pid))) => assert_eq!(pid, std::process::id()),
            other => panic!("{other:?}"),
        }
        assert_eq!(holder(dir.path()), Some(Some(std::process::id())));
        assert_eq!(token_of(dir.path()).as_deref(), Some(lock.token()));
        drop(lock);
        assert_eq!(holder(dir.path()), None);
        // Each hold has its own token; the file keeps the last one.
        let again = acquire(dir.path()).unwrap();
        assert_eq!(token_of(dir.path()).as_deref(), Some(again.token()));
        assert!(again.token().contains(&std::process::id().to_string()));
    }
}

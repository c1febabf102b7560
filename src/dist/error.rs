//! The one error type of `dist`: which operation failed, which peer caused it where known, and
//! the message c10d gave.
use std::fmt;

/// A failed c10d operation.
#[derive(Debug, Clone, PartialEq)]
pub struct Error {
    /// The operation, e.g. `all_reduce` or `store.get("key")`.
    pub op: String,
    /// The peer whose departure caused the failure, with what it (or its launcher) reported.
    pub peer: Option<PeerExit>,
    /// The message c10d or gloo gave, without C++ backtrace.
    pub message: String,
}

/// A rank that left the group, as recorded in the store by the rank itself or its launcher.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerExit {
    pub rank: usize,
    pub how: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// `message` as c10d gave it, less the generic advice gloo appends to transport errors
    /// (the error names the peer instead).
    pub fn new(op: impl Into<String>, message: impl AsRef<str>) -> Self {
        let m = message.as_ref();
        let m = m.split(" This is typically caused by").next().unwrap_or(m).trim();
        let m = m.strip_prefix("Internal torch error: ").unwrap_or(m);
        Error { op: op.into(), peer: None, message: m.to_owned() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.peer {
            Some(p) => write!(f, "{} failed because rank {} {}: {}", self.op, p.rank, p.how, self.message),
            None => write!(f, "{} failed: {}", self.op, self.message),
        }
    }
}

impl std::error::Error for Error {}

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
    /// (the error names the peer instead) and the C++ source locations gloo puts before its
    /// text (`[/__w/pytorch/.../pair.cc:537] Read error ...`): the build machine's paths mean
    /// nothing to a user.
    pub fn new(op: impl Into<String>, message: impl AsRef<str>) -> Self {
        let m = message.as_ref();
        let m = m.split(" This is typically caused by").next().unwrap_or(m).trim();
        let m = m.strip_prefix("Internal torch error: ").unwrap_or(m);
        Error { op: op.into(), peer: None, message: without_source_locations(m) }
    }
}

/// `text` without `[path/file.cc:123] ` (a C++ source file and line in brackets).
fn without_source_locations(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(open) = rest.find('[') {
        let Some(close) = rest[open..].find(']').map(|c| open + c) else { break };
        let inside = &rest[open + 1..close];
        let located = inside.rsplit_once(':').is_some_and(|(file, line)| {
            let source = [".cc", ".cpp", ".h", ".hpp", ".cu"].iter().any(|x| file.ends_with(x));
            source && !line.is_empty() && line.bytes().all(|b| b.is_ascii_digit())
        });
        out += &rest[..open];
        rest = if located {
            rest[close + 1..].trim_start()
        } else {
            out += &rest[open..=close];
            &rest[close + 1..]
        };
    }
    out + rest
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gloo_source_locations_are_left_out_and_addresses_kept() {
        let e = Error::new(
            "all_reduce",
            "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:31158: \
             Connection reset by peer. This is typically caused by a peer that died",
        );
        assert_eq!(e.message, "Read error [127.0.0.1]:31158: Connection reset by peer.");
        assert_eq!(Error::new("x", "[a.cc:] b [c]").message, "[a.cc:] b [c]");
    }
}

//! Printing that never fails a run: a closed stdout or stderr (`runner run ... | head -2`)
//! drops the text instead of panicking on the broken pipe as `println!` does.

/// `println!` that ignores write errors.
#[macro_export]
macro_rules! say {
    () => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock());
    }};
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

/// `eprintln!` that ignores write errors.
#[macro_export]
macro_rules! say_err {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

/// Writes `text` and a newline to stdout and flushes it, reporting a failed write (a full disk):
/// for commands whose output is their product. A reader that closed the pipe (`| head`) wanted
/// no more, which is no error.
pub fn write_all(text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

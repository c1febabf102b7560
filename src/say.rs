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

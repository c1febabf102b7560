//! The two doors between libtorch and what a user's files hold. [`tensor`] is the only way bytes
//! read from a file become a tensor: the shape is checked against the bytes actually there
//! (negative or overflowing sizes, too few or too many bytes) before libtorch allocates or copies
//! anything. [`torch_message`] turns a libtorch error into the one line a user reads: no
//! "Exception raised from ..." line, no C++ frames, no TorchScript traceback. [`fail`] ends a
//! rank from inside a model's forward pass (which returns no `Result`) with such a line.
use std::fmt::Display;

use tch::{Kind, Tensor};

/// `bytes` (little-endian, C order) as a tensor of `shape` and `kind`: refused, naming the
/// counts, unless `shape` holds exactly `bytes.len()` bytes of `kind`.
pub fn tensor(bytes: &[u8], shape: &[i64], kind: Kind) -> Result<Tensor, String> {
    if let Some(d) = shape.iter().find(|&&d| d < 0) {
        return Err(format!("shape {shape:?} has a negative size ({d})"));
    }
    let size = kind.elt_size_in_bytes();
    let want = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d as usize)).and_then(|n| n.checked_mul(size));
    match want {
        None => Err(format!("shape {shape:?} is too large to be a tensor")),
        Some(n) if n != bytes.len() => Err(format!(
            "shape {shape:?} of {kind:?} needs {n} bytes, {} are there: the file is truncated or its header lies",
            bytes.len()
        )),
        Some(_) => Tensor::f_from_data_size(bytes, shape, kind).map_err(|e| torch_message(&e)),
    }
}

/// A libtorch error as one line: the message without the "Exception raised from ..." line and
/// the C++ frames after it; of a TorchScript error (a traceback of the module's code), the
/// exception it ends with (`RuntimeError: ...`).
pub fn torch_message(e: &impl Display) -> String {
    let text = e.to_string();
    let text = text.strip_prefix("Internal torch error: ").unwrap_or(&text);
    let text = text.split("Exception raised from").next().unwrap_or_default();
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let scripted = text.contains("Traceback of TorchScript");
    let line = if scripted {
        // The interpreter's traceback ends with the exception the module raised.
        lines.iter().rev().find(|l| l.contains("Error")).or(lines.last())
    } else {
        lines.first()
    };
    let line = line.copied().unwrap_or("libtorch failed without a message");
    line.strip_prefix("builtins.").unwrap_or(line).to_owned()
}

/// A failure the rank cannot go on from, raised where no `Result` can carry it (inside a model's
/// forward pass: a user's module that raises). The rank's catch turns it into its one-line error.
#[derive(Debug)]
pub struct Failure(pub String);

/// Ends the rank with `msg` as its error: unwinds to the rank's catch without the panic hook's
/// "panicked at" message and backtrace.
pub fn fail(msg: String) -> ! {
    std::panic::resume_unwind(Box::new(Failure(msg)))
}

/// What a panic said, for the error that reports it.
pub fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}

/// Whether a panic's text is an allocator's failure: libtorch's (tch's panicking wrappers raise
/// it as a panic: "DefaultCPUAllocator: can't allocate memory", "CUDA out of memory") or Rust's.
pub fn is_out_of_memory(text: &str) -> bool {
    ["can't allocate memory", "out of memory", "memory allocation of"].iter().any(|m| text.contains(m))
}

/// The process's panic hook: the default one, but silent on an allocation failure. The default
/// hook symbolizes a backtrace (RUST_BACKTRACE), which reads the binary's debug information into
/// hundreds of MiB; with memory exhausted that allocation fails too, and std's out-of-memory
/// handler then waits for the backtrace lock the hook holds: the rank hung instead of failing.
/// Whoever catches the panic reports it in one line ([`panic_report`]).
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let text = payload.downcast_ref::<String>().map(String::as_str).or(payload.downcast_ref::<&str>().copied());
        if !text.is_some_and(is_out_of_memory) {
            default(info)
        }
    }));
}

/// A caught panic as the one line a user reads: a libtorch error without its C++ frames, and an
/// allocation failure said as running out of memory, with what lowers the need.
pub fn panic_report(panic: &Box<dyn std::any::Any + Send>) -> String {
    let text = panic_text(panic);
    if is_out_of_memory(&text) {
        // tch's wrappers unwrap libtorch's error: `... Err` value: Torch("message\n...")`.
        let inner = text.split_once("Torch(\"").map_or(text.as_str(), |(_, t)| t);
        let line = inner.split("\\n").next().unwrap_or(inner).trim_end_matches("\")");
        format!(
            "out of memory: {} (lower train.batch_size, shard the model with wrap.strategy = \"fsdp\" or \
             [wrap.mesh], or recompute activations with wrap.activation_checkpointing.policy = \"full\"; `runner plan` estimates each rank's peak)",
            torch_message(&line)
        )
    } else {
        text
    }
}

#[cfg(test)]
pub(crate) mod fuzz {
    //! A fuzz harness for any reader of files: mutated bytes, cut files and lying lengths must
    //! open cleanly or be refused, never panic or crash. Point it at a reader with one valid file.
    use std::path::Path;

    use proptest::prelude::*;

    /// Runs `read` on `cases` files derived from `valid` (saved as `name`): one byte set to any
    /// value, or a 4-byte little-endian length written at any offset, then a cut of the end.
    /// The reader must return (Ok or Err) for each: a panic fails the test, a crash ends it.
    pub fn reader<T, E>(name: &str, valid: &[u8], cases: u32, read: fn(&Path) -> Result<T, E>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        let config = ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() };
        let len = valid.len();
        let strategy = (0..len, any::<u8>(), any::<bool>(), any::<u32>(), 0..len + 1);
        proptest::test_runner::TestRunner::new(config)
            .run(&strategy, |(at, byte, length, value, keep)| {
                let mut bytes = valid.to_vec();
                if length && at + 4 <= len {
                    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
                } else {
                    bytes[at] = byte;
                }
                bytes.truncate(keep.max(1));
                std::fs::write(&path, &bytes).unwrap();
                let _ = read(&path);
                Ok(())
            })
            .unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_that_do_not_fit_the_bytes_are_refused() {
        let bytes = [0u8; 24];
        assert_eq!(tensor(&bytes, &[2, 3], Kind::Float).unwrap().size(), [2, 3]);
        assert!(tensor(&bytes, &[2, 4], Kind::Float).unwrap_err().contains("needs 32 bytes, 24 are there"));
        assert!(tensor(&bytes, &[-2, -3], Kind::Float).unwrap_err().contains("negative size"));
        assert!(tensor(&bytes, &[i64::MAX, 4], Kind::Float).unwrap_err().contains("too large"));
    }

    #[test]
    fn libtorch_errors_become_one_line() {
        let e = Tensor::zeros([2, 3], (Kind::Float, tch::Device::Cpu)).f_view([7]).unwrap_err();
        let m = torch_message(&e);
        assert!(!m.contains('\n') && !m.contains("Exception raised from") && m.contains("shape '[7]'"), "{m}");
        let scripted = "The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript \
                        (most recent call last):\n  File \"code/__torch__.py\", line 9\n    raise \
                        builtins.RuntimeError(\"boom\")\nbuiltins.RuntimeError: boom\n";
        assert_eq!(torch_message(&scripted), "RuntimeError: boom");
    }

    /// libtorch's allocation failure, as tch's panicking wrappers raise it, reads as one line.
    #[test]
    fn an_allocation_failure_is_reported_as_running_out_of_memory_in_one_line() {
        let text = "called `Result::unwrap()` on an `Err` value: Torch(\"DefaultCPUAllocator: can't allocate memory: \
                    you tried to allocate 4194304 bytes. Error code 12 (Cannot allocate memory)\\nException raised from \
                    malloc at alloc_cpu.cpp:117\")";
        let panic: Box<dyn std::any::Any + Send> = Box::new(text.to_string());
        let report = panic_report(&panic);
        assert!(
            report.starts_with(
                "out of memory: DefaultCPUAllocator: can't allocate memory: you tried to allocate 4194304 bytes. \
                 Error code 12 (Cannot allocate memory) (lower train.batch_size"
            ),
            "{report}"
        );
        let other: Box<dyn std::any::Any + Send> = Box::new("index out of bounds");
        assert_eq!(panic_report(&other), "index out of bounds");
        assert!(is_out_of_memory("memory allocation of 5632 bytes failed"));
        assert!(!is_out_of_memory("index out of bounds"));
    }
}

//! Input files the runner reads (pipeline, experiment, initial weights, data): regular files
//! only, so a FIFO cannot hang a run, `/dev/zero` cannot fill memory and a directory gets a
//! message rather than an I/O error; files read whole are capped in size.
use std::path::Path;

/// The most a configuration file (pipeline, experiment) may hold.
pub const CONFIG_FILE_CAP: u64 = 4 << 20;

/// `path`'s size when it is a regular file (links followed); otherwise why it cannot be read.
pub fn regular_file(path: &Path) -> Result<u64, String> {
    named_regular_file(path, "")
}

/// As [`regular_file`], the messages naming the file as `what` ("the pipeline file").
pub fn named_regular_file(path: &Path, what: &str) -> Result<u64, String> {
    let what = if what.is_empty() { String::new() } else { format!("{what} ") };
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {what}{}: {e}", path.display()))?;
    let kind = meta.file_type();
    if kind.is_file() {
        return Ok(meta.len());
    }
    use std::os::unix::fs::FileTypeExt;
    let kind_name = if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO (named pipe)"
    } else if kind.is_char_device() || kind.is_block_device() {
        "a device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    Err(format!("{what}{} is {kind_name}; give a regular file", path.display()))
}

/// Checks `path` (`what`, for the messages) is a regular file of at most `cap` bytes.
pub fn capped_file(path: &Path, cap: u64, what: &str) -> Result<u64, String> {
    let len = named_regular_file(path, what)?;
    if len > cap {
        return Err(format!(
            "{what} {} holds {len} bytes, more than the {} MiB a file read whole may hold",
            path.display(),
            cap >> 20
        ));
    }
    Ok(len)
}

/// Reads a regular text file (`what`, for the messages) of at most `cap` bytes.
pub fn read_capped(path: &Path, cap: u64, what: &str) -> Result<String, String> {
    capped_file(path, cap, what)?;
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .map_err(|e| format!("cannot read {what} {}: {e}", path.display()))?
        // A file that grew since the check still stops at the cap.
        .take(cap + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read {what} {}: {e}", path.display()))?;
    if text.len() as u64 > cap {
        return Err(format!("{what} {} grew past {} MiB while it was read", path.display(), cap >> 20));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_directories_and_fifos_are_refused() {
        assert!(regular_file(Path::new("/dev/zero")).unwrap_err().contains("a device"));
        assert!(regular_file(Path::new("/")).unwrap_err().contains("a directory"));
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("f");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(regular_file(&fifo).unwrap_err().contains("FIFO"));
        let big = dir.path().join("big");
        std::fs::File::create(&big).unwrap().set_len(5 << 20).unwrap();
        let err = read_capped(&big, CONFIG_FILE_CAP, "the pipeline file").unwrap_err();
        assert!(err.starts_with("the pipeline file ") && err.contains("more than the 4 MiB"), "{err}");
    }
}

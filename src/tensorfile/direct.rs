//! A file written with direct I/O (`O_DIRECT`): its bytes go from one aligned buffer to the disk
//! without passing through the page cache. Written through the cache, a checkpoint's gigabytes
//! each need a page of it, which on a machine whose memory is full of cache (any that has read
//! its data set) means reclaiming others first, on the writer's time and the training's cores:
//! measured on `pipelines/large_model_fsdp.toml`, 1.2 s of CPU a rank for 300 MB with the cache
//! full against 0.3 s with it empty (docs/fault-tolerance.md). Where the file system refuses
//! direct I/O, the same writes go through the cache.
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg, OFlag};

/// What direct I/O asks to be aligned to: the buffer's address, each write's offset and length
/// (the largest logical block size of Linux's block devices).
const ALIGN: usize = 4096;

/// The bytes gathered before each write: a multiple of [`ALIGN`].
const CHUNK: usize = 8 << 20;

pub(super) struct DirectFile {
    file: File,
    /// [`CHUNK`] + [`ALIGN`] bytes, the [`CHUNK`] from `start` on aligned.
    buf: Vec<u8>,
    start: usize,
    /// Bytes gathered in the buffer, not yet written.
    filled: usize,
    /// Bytes written to the file.
    written: u64,
    direct: bool,
}

impl DirectFile {
    /// Creates (or truncates) `path` for writing, with direct I/O where its file system has it.
    pub fn create(path: &Path) -> io::Result<DirectFile> {
        let open = |flags: OFlag| {
            OpenOptions::new().write(true).create(true).truncate(true).custom_flags(flags.bits()).open(path)
        };
        let (file, direct) = match open(OFlag::O_DIRECT) {
            Ok(file) => (file, true),
            Err(e) if e.raw_os_error() == Some(Errno::EINVAL as i32) => (open(OFlag::empty())?, false),
            Err(e) => return Err(e),
        };
        let buf = vec![0u8; CHUNK + ALIGN];
        let start = buf.as_ptr().align_offset(ALIGN);
        Ok(DirectFile { file, buf, start, filled: 0, written: 0, direct })
    }

    /// Appends `bytes`.
    pub fn write_all(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            let n = bytes.len().min(CHUNK - self.filled);
            let at = self.start + self.filled;
            self.buf[at..at + n].copy_from_slice(&bytes[..n]);
            self.filled += n;
            bytes = &bytes[n..];
            if self.filled == CHUNK {
                self.flush(CHUNK)?;
            }
        }
        Ok(())
    }

    /// Writes what is left (padded to [`ALIGN`], then cut back to its length) and syncs the file.
    pub fn finish(mut self) -> io::Result<()> {
        let len = self.written + self.filled as u64;
        let padded = self.filled.next_multiple_of(ALIGN);
        self.buf[self.start + self.filled..self.start + padded].fill(0);
        self.flush(padded)?;
        self.file.set_len(len)?;
        self.file.sync_all()
    }

    /// Writes the buffer's first `len` bytes at the file's end so far.
    fn flush(&mut self, len: usize) -> io::Result<()> {
        let data = &self.buf[self.start..self.start + len];
        match self.file.write_all_at(data, self.written) {
            // A file system that opens with the flag but refuses its writes: through the cache.
            Err(e) if self.direct && e.raw_os_error() == Some(Errno::EINVAL as i32) => {
                let flags = OFlag::from_bits_truncate(fcntl(&self.file, FcntlArg::F_GETFL)?);
                fcntl(&self.file, FcntlArg::F_SETFL(flags - OFlag::O_DIRECT))?;
                self.direct = false;
                self.file.write_all_at(data, self.written)?;
            }
            result => result?,
        }
        self.written += len as u64;
        self.filled = 0;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lengths around the buffer's and the alignment's edges give back exactly their bytes, in
    /// a folder of the build's disk (a temporary folder may be memory). On ext4 and XFS, which
    /// have direct I/O, the file is written with it.
    #[test]
    fn any_length_is_written_whole_and_exact() {
        let target = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
        std::fs::create_dir_all(&target).unwrap();
        let dir = tempfile::tempdir_in(target).unwrap();
        let kind = nix::sys::statfs::statfs(dir.path()).unwrap().filesystem_type();
        let has_direct = [nix::sys::statfs::EXT4_SUPER_MAGIC, nix::sys::statfs::XFS_SUPER_MAGIC].contains(&kind);
        for len in [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, CHUNK - 3, CHUNK, CHUNK + ALIGN + 5, 2 * CHUNK + 17] {
            let path = dir.path().join(format!("f{len}"));
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
            let mut f = DirectFile::create(&path).unwrap();
            assert!(f.direct || !has_direct, "ext4 and XFS take direct I/O");
            // In uneven pieces, as a writer hands them.
            for piece in bytes.chunks(1_000_003) {
                f.write_all(piece).unwrap();
            }
            f.finish().unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), bytes, "length {len}");
        }
    }
}

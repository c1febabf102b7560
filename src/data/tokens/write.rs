//! Token files written as the ids come, never held whole: nanoGPT's raw little-endian uint16
//! `.bin` while every id of the vocabulary fits 16 bits, and a `.npy` array of uint32 (`<u4`)
//! past that. A reader tells which by the name: a `.bin` is always uint16 (nanoGPT's `np.memmap(...,
//! dtype=np.uint16)`), a `.npy` says its width in its header (`np.load(..., mmap_mode="r")`).
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Vocabularies of up to this many ids fit uint16 token files.
pub const UINT16_IDS: usize = 1 << 16;

/// The token file `stem` for a vocabulary of `vocab` ids: `stem.bin` (uint16) or `stem.npy` (uint32).
pub fn token_file_name(stem: &str, vocab: usize) -> String {
    if vocab > UINT16_IDS {
        format!("{stem}.npy")
    } else {
        format!("{stem}.bin")
    }
}

/// The header of a 1-D `<u4` array of `count` ids: always [`HEADER`] bytes (padded with spaces,
/// as numpy pads), so that it can be written before the count is known and rewritten after.
fn npy_header(count: u64) -> Vec<u8> {
    let dict = format!("{{'descr': '<u4', 'fortran_order': False, 'shape': ({count},), }}");
    let mut h = b"\x93NUMPY\x01\x00".to_vec();
    h.extend(((HEADER - 10) as u16).to_le_bytes());
    h.extend(dict.as_bytes());
    h.resize(HEADER - 1, b' ');
    h.push(b'\n');
    h
}

/// numpy aligns its data to 64 bytes; 128 leave room for any count.
const HEADER: usize = 128;

pub struct TokenWriter {
    out: BufWriter<File>,
    path: PathBuf,
    /// uint32 in a `.npy` (else uint16 in a `.bin`).
    wide: bool,
    count: u64,
}

impl TokenWriter {
    /// A new file at `path` for ids of a vocabulary of `vocab`: uint16 ids while they fit, else
    /// a `.npy` of uint32 (the caller names the file with [`token_file_name`]).
    pub fn create(path: &Path, vocab: usize) -> std::io::Result<TokenWriter> {
        let wide = vocab > UINT16_IDS;
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        if wide {
            out.write_all(&npy_header(0))?;
        }
        Ok(TokenWriter { out, path: path.to_owned(), wide, count: 0 })
    }

    /// Appends `ids` (each below the vocabulary the file was named for).
    pub fn push(&mut self, ids: &[u32]) -> std::io::Result<()> {
        for &id in ids {
            if self.wide {
                self.out.write_all(&id.to_le_bytes())?;
            } else {
                debug_assert!(id < UINT16_IDS as u32, "{id} does not fit {}", self.path.display());
                self.out.write_all(&(id as u16).to_le_bytes())?;
            }
        }
        self.count += ids.len() as u64;
        Ok(())
    }

    /// Ids written so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Moves the ids from `at` on into `rest`, and ends this file at `at`: both files completed
    /// ([`TokenWriter::finish`]); returns their counts. (A split of a stream written once.)
    pub fn split_off(self, at: u64, mut rest: TokenWriter) -> std::io::Result<(u64, u64)> {
        let width = if self.wide { 4 } else { 2 };
        let end = if self.wide { HEADER as u64 } else { 0 } + at.min(self.count) * width;
        let mut file = self.out.into_inner().map_err(|e| e.into_error())?;
        file.seek(SeekFrom::Start(end))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = (&file).read(&mut buf)?;
            if n == 0 {
                break;
            }
            let ids: Vec<u32> = match width {
                4 => buf[..n].chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
                _ => buf[..n].chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]]) as u32).collect(),
            };
            rest.push(&ids)?;
        }
        file.set_len(end)?;
        let kept =
            TokenWriter { out: BufWriter::new(file), path: self.path, wide: self.wide, count: at.min(self.count) };
        Ok((kept.finish()?, rest.finish()?))
    }

    /// Completes the file (a `.npy`'s header then holds the count), synced; returns the count.
    pub fn finish(self) -> std::io::Result<u64> {
        let mut file = self.out.into_inner().map_err(|e| e.into_error())?;
        if self.wide {
            file.rewind()?;
            file.write_all(&npy_header(self.count))?;
        }
        file.sync_all()?;
        Ok(self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::Source;

    #[test]
    fn wide_ids_go_to_a_npy_that_the_token_reader_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(token_file_name("train", 65_536), "train.bin");
        assert_eq!(token_file_name("train", 70_000), "train.npy");
        let ids: Vec<u32> = vec![0, 65_535, 65_536, 69_999, 7];
        for (name, vocab, want) in [("a.npy", 70_000, ids.clone()), ("a.bin", 65_536, vec![0, 65_535, 7])] {
            let path = dir.path().join(name);
            let mut w = TokenWriter::create(&path, vocab).unwrap();
            w.push(&want[..2]).unwrap();
            w.push(&want[2..]).unwrap();
            assert_eq!(w.finish().unwrap(), want.len() as u64);
            let f = super::super::open(&path, Source::Tokens).unwrap();
            assert_eq!(f.tokens, want.len());
            assert!(super::super::scan(&f, Source::Tokens, vocab).is_ok());
            let s = super::super::Stream { files: vec![f], start: 0, len: want.len() };
            let w = super::super::Windows::open(&s, 1, 1).unwrap();
            let got: Vec<u32> = w.read(0, want.len()).unwrap().into_iter().map(|i| i as u32).collect();
            assert_eq!(got, want, "{name}");
        }
        let bytes = std::fs::read(dir.path().join("a.npy")).unwrap();
        assert_eq!(bytes.len(), HEADER + 5 * 4);
        assert!(
            String::from_utf8_lossy(&bytes[..HEADER]).contains("'descr': '<u4', 'fortran_order': False, 'shape': (5,)")
        );
        // Split after the third id: the head stays, the rest moves (read back both).
        for (name, vocab) in [("s.npy", 70_000), ("s.bin", 100)] {
            let (head, tail) = (dir.path().join(name), dir.path().join(format!("tail-{name}")));
            let mut w = TokenWriter::create(&head, vocab).unwrap();
            w.push(&(0..600_000).map(|i| i % 97).collect::<Vec<u32>>()).unwrap();
            let rest = TokenWriter::create(&tail, vocab).unwrap();
            assert_eq!(w.split_off(599_997, rest).unwrap(), (599_997, 3));
            let read = |p: &Path| {
                let f = super::super::open(p, Source::Tokens).unwrap();
                let n = f.tokens;
                let s = super::super::Stream { files: vec![f], start: 0, len: n };
                super::super::Windows::open(&s, 1, 1).unwrap().read(0, n).unwrap()
            };
            assert_eq!(read(&tail), [599_997 % 97, 599_998 % 97, 599_999 % 97], "{name}");
            let h = read(&head);
            assert_eq!((h.len(), h[599_996]), (599_997, 599_996 % 97), "{name}");
        }
    }
}

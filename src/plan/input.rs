//! The files a run reads and the run id: each file's content digest is part of the id, so the
//! same configuration over the same files is the same run, and an edited data file is another.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::schema::Config;

/// A file the run reads, with the digest of its content when the plan was made: the run id
/// covers it, and a resumed run refuses a file that changed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InputFile {
    /// The configuration key that names it (`load.path`, `wrap.init`).
    pub key: String,
    /// Absolute.
    pub path: PathBuf,
    pub bytes: u64,
    /// XXH3-64 of the content, 16 hex digits: fast enough for data files of many GB.
    pub digest: String,
}

impl InputFile {
    pub fn read(key: &str, path: &Path) -> Result<InputFile, String> {
        use std::io::Read;
        let path = std::fs::canonicalize(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut file = std::fs::File::open(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let (mut hasher, mut bytes, mut buf) = (xxhash_rust::xxh3::Xxh3::new(), 0u64, vec![0u8; 1 << 20]);
        loop {
            let n = file.read(&mut buf).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            bytes += n as u64;
        }
        Ok(InputFile { key: key.to_owned(), path, bytes, digest: format!("{:016x}", hasher.digest()) })
    }
}

/// Digests every file `files` names (a missing one is reported by the checks that found it).
pub fn digests(files: Vec<(&str, Option<PathBuf>)>, bad: &mut impl FnMut(&str, String)) -> Vec<InputFile> {
    let mut inputs = Vec::new();
    for (key, path) in files {
        match path.filter(|p| p.is_file()).map(|p| InputFile::read(key, &p)).transpose() {
            Ok(file) => inputs.extend(file),
            Err(e) => bad(key, e),
        }
    }
    inputs
}

/// 12 hex digits of FNV-1a over the resolved configuration's canonical JSON and the content
/// digests of the files the run reads (tracking settings left out: they change no result).
pub fn run_id(c: &Config, inputs: &[InputFile]) -> String {
    let mut bytes = serde_json::to_string(&c.without_tracking()).expect("a Config serializes").into_bytes();
    for f in inputs {
        bytes.extend(f.digest.as_bytes());
    }
    format!("{:012x}", crate::rng::fnv1a(&bytes) >> 16)
}

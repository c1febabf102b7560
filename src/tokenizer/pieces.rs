//! A text file read in pieces of about a MiB, checked to be UTF-8, so that encoding a text of any
//! size holds one piece at a time. A tokenizer sees each piece alone, so a piece ends only where
//! that changes nothing: anywhere for characters and bytes; for a tokenizer.json, at a line end
//! between two visible ASCII characters (`…x\ny…`), where GPT-2's and Llama 3's pre-tokenizers
//! always split, and only if the tokenizer's own answer says so
//! ([`super::Tokenizer::cuts_at_line_ends`]); otherwise the text is encoded whole.
use std::io::Read;
use std::path::Path;

use anyhow::Context;

/// Bytes read before a piece is cut.
pub const PIECE: usize = 1 << 20;

/// Where a text may be cut into pieces.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cut {
    /// At any character.
    Anywhere,
    /// After a newline between two visible ASCII characters.
    LineEnds,
    /// Nowhere: one piece.
    Never,
}

/// Calls `each` with the pieces of the UTF-8 text `path`, in order, each of about `piece` bytes
/// ([`PIECE`]) or more; a byte that is not UTF-8 is an error naming its offset. Returns the
/// text's length in bytes.
pub fn pieces(
    path: &Path,
    cut: Cut,
    piece: usize,
    each: &mut dyn FnMut(&str) -> anyhow::Result<()>,
) -> anyhow::Result<u64> {
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut buf: Vec<u8> = Vec::with_capacity(2 * piece);
    // Bytes of the file before buf[0].
    let mut before = 0u64;
    let mut block = vec![0u8; piece];
    // buf[..checked] is UTF-8 and was searched for a cut: a text that cannot be cut is read once.
    let mut checked = 0;
    loop {
        let n = file.read(&mut block).with_context(|| format!("cannot read {}", path.display()))?;
        buf.extend_from_slice(&block[..n]);
        let end = n == 0;
        if !end && buf.len() < checked + piece {
            continue;
        }
        let valid = checked
            + match std::str::from_utf8(&buf[checked..]) {
                Ok(_) => buf.len() - checked,
                // A character that the next block completes.
                Err(e) if e.error_len().is_none() && !end => e.valid_up_to(),
                Err(e) => anyhow::bail!(
                    "{} is not UTF-8 text (byte {}): convert it first",
                    path.display(),
                    before + (checked + e.valid_up_to()) as u64
                ),
            };
        // A cut at `checked` looks two bytes back.
        let from = checked.saturating_sub(2);
        let at = if end { Some(valid) } else { cut_in(&buf[from..valid], cut).map(|p| from + p) };
        checked = valid;
        if let Some(at) = at.filter(|&a| a > 0) {
            each(std::str::from_utf8(&buf[..at]).expect("checked"))?;
            buf.drain(..at);
            before += at as u64;
            checked -= at;
        }
        if end {
            return Ok(before);
        }
    }
}

/// Where the valid text `text` may end a piece: its last place allowed by `cut`.
fn cut_in(text: &[u8], cut: Cut) -> Option<usize> {
    let visible = |b: u8| b.is_ascii_graphic();
    match cut {
        Cut::Anywhere => Some(text.len()),
        Cut::LineEnds => {
            (2..text.len()).rev().find(|&p| text[p - 1] == b'\n' && visible(text[p - 2]) && visible(text[p]))
        }
        Cut::Never => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(path: &Path, how: Cut) -> Vec<String> {
        let mut out = Vec::new();
        pieces(path, how, 1000, &mut |p: &str| {
            out.push(p.to_owned());
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn pieces_cover_the_text_and_end_only_where_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.txt");
        // Many pieces, with characters split across the blocks' boundaries.
        let text = "é, a line of words.\nthe next one  \n\nand more\n".repeat(600);
        std::fs::write(&path, &text).unwrap();
        for how in [Cut::Anywhere, Cut::LineEnds, Cut::Never] {
            let parts = cut(&path, how);
            assert_eq!(parts.concat(), text, "{how:?}");
            assert_eq!(parts.len() > 1, how != Cut::Never, "{how:?}: {} pieces", parts.len());
            if how == Cut::LineEnds {
                for p in &parts[..parts.len() - 1] {
                    assert!(p.ends_with(".\n"), "{:?}", &p[p.len() - 10..]);
                }
            }
        }
        std::fs::write(&path, [b'a', b'b', 0xc3]).unwrap();
        let e = pieces(&path, Cut::Anywhere, PIECE, &mut |_| Ok(())).unwrap_err().to_string();
        assert!(e.ends_with("t.txt is not UTF-8 text (byte 2): convert it first"), "{e}");
    }
}

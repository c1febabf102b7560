//! The paths a pipeline file sets (`load.path`, `wrap.init`, ...), each relative to the file
//! that sets it: a base's are rewritten to name the same files from the directory of the file that
//! extends it, which the plan resolves every path against.
use std::path::{Path, PathBuf};

use super::extends::normalize;

/// The pipeline keys that name files, each relative to the file that sets it.
pub const PATH_KEYS: [&str; 5] = ["load.path", "load.labels", "load.validation_path", "wrap.init", "wrap.model.path"];

/// Rewrites the relative paths of `table` (a file in `dir`) to name the same files from `top`,
/// the directory of the file that extends it. Paths of a file in `top` itself are left as
/// written (what runs recorded stays the same); absolute paths are kept.
pub fn rebase(table: &mut toml::Table, dir: &Path, top: &Path) {
    let absolute = |p: &Path| normalize(&std::path::absolute(p.join(".")).unwrap_or_else(|_| p.to_owned()));
    if absolute(dir) == absolute(top) {
        return;
    }
    let one = |v: &mut toml::Value| {
        if let Some(path) = v.as_str().map(Path::new).filter(|p| p.is_relative()) {
            *v = toml::Value::String(relative(&absolute(top), &absolute(&dir.join(path))).display().to_string());
        }
    };
    for key in PATH_KEYS {
        match get_mut(table, key) {
            Some(toml::Value::Array(paths)) => paths.iter_mut().for_each(one),
            Some(v) => one(v),
            None => {}
        }
    }
}

fn get_mut<'a>(table: &'a mut toml::Table, dotted: &str) -> Option<&'a mut toml::Value> {
    match dotted.split_once('.') {
        None => table.get_mut(dotted),
        Some((head, rest)) => get_mut(table.get_mut(head)?.as_table_mut()?, rest),
    }
}

/// `to` relative to the directory `from`, both absolute and normalized.
pub fn relative(from: &Path, to: &Path) -> PathBuf {
    let common = from.components().zip(to.components()).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in from.components().skip(common) {
        out.push("..");
    }
    for c in to.components().skip(common) {
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(s: &str) -> toml::Table {
        toml::from_str(s).unwrap()
    }

    #[test]
    fn a_base_s_relative_paths_are_rewritten_to_name_the_same_files_from_the_extending_file() {
        let mut t = table(
            "[load]\npath = [\"data/a.bin\", \"/abs/b.bin\"]\nvalidation_path = \"../v.bin\"\n[wrap]\ninit = \"m\"\n\
             [train]\nlr = 1\n",
        );
        rebase(&mut t, Path::new("p"), Path::new("res/shf"));
        let want = table(
            "[load]\npath = [\"../../p/data/a.bin\", \"/abs/b.bin\"]\nvalidation_path = \"../../v.bin\"\n[wrap]\n\
             init = \"../../p/m\"\n[train]\nlr = 1\n",
        );
        assert_eq!(t, want);
        let mut same = table("[load]\npath = \"./data/a.bin\"\n");
        rebase(&mut same, Path::new("p/."), Path::new("p"));
        assert_eq!(same, table("[load]\npath = \"./data/a.bin\"\n"), "a file beside it: as written");
    }
}

//! The run's vocabulary: the file beside its first token file (tokenizer.json, else meta.json), or
//! an instruction source's tokenizer.json,
//! recorded in the plan with its digest and checked against the model when the plan is made, and
//! read back for `runner predict --prompt`, `runner eval` and an export.
use std::path::Path;

use super::{InputFile, Plan};
use crate::config::schema::{Config, Model, Source};
use crate::data::SourceSpec;
use crate::tokenizer::{Vocabulary, META, TOKENIZER};

/// The vocabulary beside the token files `load.path` names, when there is one (not for
/// `load.source = "text"`, whose vocabulary is bytes), refused when it has more token ids than
/// the model: whether or not the token files hold its largest ids, its size says more.
pub(super) fn record(c: &Config, base: &Path, bad: &mut impl FnMut(&str, String)) -> Option<InputFile> {
    let Model::Transformer(t) = &c.wrap.model else { return None };
    if c.load.source == Source::Instructions {
        // Checked against the model by the source's own plan.
        let data = base.join(c.load.path.as_ref()?.single()?);
        let dir = match &c.load.tokenizer {
            Some(d) => base.join(d),
            None => data.parent()?.to_owned(),
        };
        return InputFile::read("vocabulary", &dir.join(TOKENIZER)).ok();
    }
    if c.load.source != Source::Tokens {
        return None;
    }
    let first = crate::data::tokens::resolve_paths(c.load.path.as_ref()?, base).ok()?.into_iter().next()?;
    let path = crate::tokenizer::file_beside(&first)?;
    match Vocabulary::read(&path) {
        Ok(v) if v.size() > t.vocab => bad(
            "wrap.model.vocab",
            format!(
                "{} is fewer than the {} token ids of {}, the vocabulary beside the token file: set wrap.model.vocab \
                 = {} or more",
                t.vocab,
                v.size(),
                path.display(),
                v.size()
            ),
        ),
        Ok(_) => {}
        Err(e) => bad("load.path", format!("{e:#} (it is the vocabulary beside the token file)")),
    }
    InputFile::read("vocabulary", &path).ok()
}

impl Plan {
    /// The vocabulary this run trained with: bytes for `load.source = "text"`, else the file the
    /// plan recorded beside its token file, refused if it changed since or has more token ids than
    /// the model.
    pub fn read_vocabulary(&self) -> anyhow::Result<Vocabulary> {
        let Model::Transformer(t) = &self.config.wrap.model else {
            anyhow::bail!("this run trained a {}, which has no vocabulary", self.model().describe());
        };
        let file = match &self.data.source {
            SourceSpec::Tokens(spec) if spec.source == Source::Text => return Ok(Vocabulary::Bytes),
            SourceSpec::Tokens(spec) => &spec.train.files[0].path,
            SourceSpec::Instructions(spec) => &spec.path,
            _ => anyhow::bail!(
                "this run trained on generated tokens, which have no text: use a run of a token or text file"
            ),
        };
        let Some(then) = &self.vocabulary else {
            anyhow::bail!(
                "no {TOKENIZER} or {META} beside {}: the token ids have no text to decode to (runner prepare text \
                 writes one)",
                file.display()
            );
        };
        let path = &then.path;
        anyhow::ensure!(
            path.is_file(),
            "{} is gone: it was this run's vocabulary (beside {}); put it back",
            path.display(),
            file.display()
        );
        let now = InputFile::read(&then.key, path).map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            now.digest == then.digest,
            "{} is not the vocabulary this run trained with: it changed since (digest {} then, {} now); put back the \
             {} that was made with the token file",
            path.display(),
            then.digest,
            now.digest,
            path.file_name().unwrap_or_default().to_string_lossy()
        );
        let vocabulary = Vocabulary::read(path)?;
        if let Some(why) = vocabulary.exceeds(t.vocab) {
            anyhow::bail!("{} {why}: it is not this run's vocabulary", path.display());
        }
        Ok(vocabulary)
    }
}

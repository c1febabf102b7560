//! `runner predict RUN_DIR --prompt TEXT`: text from a trained language model, as nanoGPT's
//! `sample.py` makes it. The context is cropped to the last `seq_len` tokens, the last
//! position's logits divided by the temperature, all but the `top_k` largest set to -inf, and
//! the next token drawn from their softmax; the draws come from the runner's generator seeded by
//! `--seed`, so a sample is the same on every machine. The vocabulary is the run's: `meta.json`
//! beside its token file (`runner prepare text` writes it), or bytes for `load.source = "text"`.
use std::path::Path;

use anyhow::Context;
use tch::{nn, Kind, Tensor};

use crate::config::schema::{Model, Source};
use crate::data::SourceSpec;
use crate::plan::Plan;
use crate::prepare::Meta;
use crate::rng::Rng;

/// What to sample.
#[derive(Debug, Clone)]
pub struct Options {
    pub prompt: String,
    /// New tokens after the prompt.
    pub tokens: usize,
    pub temperature: f64,
    pub top_k: usize,
    pub seed: u64,
}

/// How a run's token ids map to text.
enum Vocabulary {
    /// Characters from meta.json.
    Chars(Meta),
    /// Bytes (`load.source = "text"`), decoded as UTF-8 (invalid sequences as U+FFFD).
    Bytes,
}

impl Vocabulary {
    fn of(plan: &Plan) -> anyhow::Result<Vocabulary> {
        let SourceSpec::Tokens(spec) = &plan.data.source else {
            anyhow::bail!(
                "this run trained on generated tokens, which have no text: sample a run of a token or text file"
            );
        };
        if spec.source == Source::Text {
            return Ok(Vocabulary::Bytes);
        }
        let file = &spec.train.files[0].path;
        let meta = file.parent().unwrap_or(Path::new(".")).join(crate::prepare::META);
        anyhow::ensure!(
            meta.exists(),
            "no {} beside {}: the token ids have no characters to decode to (runner prepare text writes one)",
            crate::prepare::META,
            file.display()
        );
        Ok(Vocabulary::Chars(Meta::read(&meta)?))
    }

    fn encode(&self, text: &str) -> anyhow::Result<Vec<i64>> {
        match self {
            Vocabulary::Chars(m) => Ok(m.encode(text).context("--prompt")?.into_iter().map(i64::from).collect()),
            Vocabulary::Bytes => Ok(text.bytes().map(i64::from).collect()),
        }
    }

    /// Token ids 0..size have text.
    fn size(&self) -> usize {
        match self {
            Vocabulary::Chars(m) => m.vocab_size,
            Vocabulary::Bytes => 256,
        }
    }

    fn decode(&self, ids: &[i64]) -> anyhow::Result<String> {
        match self {
            Vocabulary::Chars(m) => m.decode(ids),
            Vocabulary::Bytes => Ok(String::from_utf8_lossy(&ids.iter().map(|&i| i as u8).collect::<Vec<_>>()).into()),
        }
    }
}

/// Prints the prompt and `o.tokens` tokens sampled after it.
pub fn sample(run_dir: &Path, o: &Options) -> anyhow::Result<u8> {
    let plan = Plan::load(&run_dir.join(crate::rundir::PLAN))?;
    let Model::Transformer(t) = &plan.config.wrap.model else {
        anyhow::bail!("--prompt samples a language model, but this run trained a {}", plan.model().describe());
    };
    anyhow::ensure!(o.temperature > 0.0 && o.temperature.is_finite(), "--temperature must be positive");
    anyhow::ensure!(o.top_k >= 1, "--top-k must be at least 1");
    let vocab = Vocabulary::of(&plan)?;
    let mut ids = vocab.encode(&o.prompt)?;
    anyhow::ensure!(!ids.is_empty(), "--prompt is empty: give the model at least one character to continue");
    if let Some(id) = ids.iter().find(|&&i| i as usize >= t.vocab) {
        anyhow::bail!("--prompt: token id {id} is outside the model's vocab ({})", t.vocab);
    }
    // Only ids with text are drawn (a model's vocab may be larger than its data's).
    let drawable = vocab.size().min(t.vocab);
    tch::set_num_threads(plan.threads_per_rank as i32);
    let arch = plan.model();
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let model = arch.build(&vs.root(), 0..arch.layers().len(), &crate::model::BuildContext::new(plan.config.run.seed));
    let weights = crate::model::read_weights(
        &run_dir.join(crate::rundir::MODEL),
        &crate::model::sorted_parameters(arch.as_ref()),
    )
    .map_err(anyhow::Error::msg)?;
    for (name, mut var) in vs.variables() {
        tch::no_grad(|| var.copy_(&weights[&name]));
    }
    let mut rng = Rng::new(o.seed, SAMPLE_STREAM);
    for _ in 0..o.tokens {
        let context = &ids[ids.len().saturating_sub(t.seq_len)..];
        let x = Tensor::from_slice(context).view([1, context.len() as i64]);
        let logits = tch::no_grad(|| model.forward_t(&x, false)).select(1, -1).squeeze_dim(0);
        let logits: Vec<f64> = Vec::try_from(logits.narrow(0, 0, drawable as i64).to_kind(Kind::Double))?;
        ids.push(draw(&logits, o.temperature, o.top_k, &mut rng) as i64);
    }
    crate::say!("{}", vocab.decode(&ids)?);
    Ok(0)
}

/// Separates the sampler's draws from other uses of a seed.
const SAMPLE_STREAM: u64 = 0x5A4D_504C;

/// One token from `logits`: temperature, top-k, softmax, then a draw.
fn draw(logits: &[f64], temperature: f64, top_k: usize, rng: &mut Rng) -> usize {
    let scaled: Vec<f64> = logits.iter().map(|l| l / temperature).collect();
    let mut sorted = scaled.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    // sample.py: logits below the k-th largest become -inf (ties with it stay).
    let kth = sorted[top_k.min(sorted.len()) - 1];
    let max = sorted[0];
    let weights: Vec<f64> = scaled.iter().map(|&l| if l < kth { 0.0 } else { (l - max).exp() }).collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.uniform() * total;
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i;
        }
        u -= w;
    }
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_only_the_largest_logits_and_temperature_sharpens() {
        let logits = [0.0, 3.0, 1.0, 2.9];
        let mut rng = Rng::new(1, 2);
        let picks: Vec<usize> = (0..500).map(|_| draw(&logits, 1.0, 2, &mut rng)).collect();
        assert!(picks.iter().all(|&p| p == 1 || p == 3), "top-2 draws only ids 1 and 3");
        assert!(picks.contains(&1) && picks.contains(&3));
        let cold: Vec<usize> = (0..200).map(|_| draw(&logits, 0.01, 4, &mut rng)).collect();
        assert!(cold.iter().all(|&p| p == 1), "a low temperature takes the largest");
    }
}

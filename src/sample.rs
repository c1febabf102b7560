//! `runner predict RUN_DIR --prompt TEXT`: text from a trained language model, as nanoGPT's
//! `sample.py` makes it. The context is cropped to the last `seq_len` tokens, the last
//! position's logits divided by the temperature, all but the `top_k` largest set to -inf, and
//! the next token drawn from their softmax; the draws come from the runner's generator seeded by
//! `--seed`, so a sample is the same on every machine. The vocabulary is the run's
//! ([`Plan::read_vocabulary`]): `tokenizer.json` or `meta.json` beside its token file (`runner
//! prepare text` writes them; the plan recorded the digest), or bytes for `load.source = "text"`.
//! Each token is written as soon as it completes a character; on a terminal, control characters
//! are shown escaped (`\x1b`), and a reader that goes away (`| head`) ends the sampling.
use std::io::{IsTerminal, Write};
use std::path::Path;

use anyhow::Context;
use tch::{Kind, Tensor};

use crate::config::schema::Model;
use crate::plan::Plan;
use crate::rng::Rng;
use crate::tokenizer::Vocabulary;

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

/// The text of the tokens drawn so far, given out as it completes: the vocabulary decodes the
/// prompt and every token drawn after it, and the text past what was given out before is new
/// (held back while it ends in an incomplete character, U+FFFD).
struct Decoded<'v> {
    vocab: &'v Vocabulary,
    ids: Vec<u32>,
    /// Bytes of the decoded text given out (the prompt's at first).
    shown: usize,
}

impl<'v> Decoded<'v> {
    fn new(vocab: &'v Vocabulary, prompt: &[u32]) -> anyhow::Result<Decoded<'v>> {
        Ok(Decoded { vocab, ids: prompt.to_vec(), shown: vocab.decode(prompt)?.len() })
    }

    /// The new text once `id` is drawn (empty while a character is incomplete).
    fn next(&mut self, id: u32) -> anyhow::Result<String> {
        self.ids.push(id);
        let text = self.vocab.decode(&self.ids)?;
        if text.ends_with('\u{fffd}') || !text.is_char_boundary(self.shown) || text.len() < self.shown {
            return Ok(String::new());
        }
        let new = text[self.shown..].to_owned();
        self.shown = text.len();
        Ok(new)
    }

    /// What is left: an incomplete character, as U+FFFD.
    fn rest(&self) -> anyhow::Result<String> {
        let text = self.vocab.decode(&self.ids)?;
        Ok(text.get(self.shown..).unwrap_or_default().to_owned())
    }
}

/// Prints the prompt and `o.tokens` tokens sampled after it, each as soon as it is drawn.
pub fn sample(run_dir: &Path, o: &Options) -> anyhow::Result<u8> {
    let plan = Plan::load(&run_dir.join(crate::rundir::PLAN))?;
    let Model::Transformer(t) = &plan.config.wrap.model else {
        let why = format!("--prompt samples a language model, but this run trained a {}", plan.model().describe());
        return Err(crate::config::ConfigError::new(why).into());
    };
    // The command line's mistakes: exit code 2, as every usage error.
    let usage = |why: String| -> anyhow::Error { crate::config::ConfigError::new(why).into() };
    if !(o.temperature > 0.0 && o.temperature.is_finite()) {
        return Err(usage(format!("--temperature must be a finite number above 0, got {}", show(o.temperature))));
    }
    if o.top_k < 1 {
        return Err(usage("--top-k must be at least 1".into()));
    }
    let vocab = plan.read_vocabulary()?;
    let prompt_ids = vocab.encode(&o.prompt).context("--prompt")?;
    if prompt_ids.is_empty() {
        return Err(usage("--prompt is empty: give the model at least one character to continue".into()));
    }
    let mut ids: Vec<i64> = prompt_ids.iter().map(|&i| i64::from(i)).collect();
    // Only ids with text are drawn (a model's vocab may be larger than its data's).
    let drawable = vocab.size().min(t.vocab);
    tch::set_num_threads(plan.threads_per_rank as i32);
    let (_vs, model) = crate::predict::trained_module(&plan, run_dir, tch::Device::Cpu)?;
    let mut out = Writer::new();
    let mut rng = Rng::new(o.seed, SAMPLE_STREAM);
    let mut decoded = Decoded::new(&vocab, &prompt_ids)?;
    // The prompt goes out with the first token: a temperature that leaves nothing to draw from
    // is said before anything is printed.
    let mut prompt = Some(o.prompt.as_str());
    for _ in 0..o.tokens {
        let context = &ids[ids.len().saturating_sub(t.seq_len)..];
        let x = Tensor::from_slice(context).view([1, context.len() as i64]);
        let logits = tch::no_grad(|| model.forward_t(&x, false)).select(1, -1).squeeze_dim(0);
        let logits: Vec<f64> = Vec::try_from(logits.narrow(0, 0, drawable as i64).to_kind(Kind::Double))?;
        let id = draw(&logits, o.temperature, o.top_k, &mut rng)? as i64;
        ids.push(id);
        let text = prompt.take().unwrap_or_default().to_owned() + &decoded.next(id as u32)?;
        // The reader went away (`| head -c 100`): nothing more is wanted.
        if out.write(&text).is_err() {
            return Ok(0);
        }
    }
    let _ = out.write(&(prompt.unwrap_or_default().to_owned() + &decoded.rest()? + "\n"));
    Ok(0)
}

/// Standard output, flushed after every piece; on a terminal, control characters other than
/// newline and tab are written escaped, so that a drawn ESC cannot drive the terminal.
struct Writer {
    out: std::io::Stdout,
    terminal: bool,
}

impl Writer {
    fn new() -> Writer {
        let out = std::io::stdout();
        Writer { terminal: out.is_terminal(), out }
    }

    fn write(&mut self, text: &str) -> std::io::Result<()> {
        let text = if self.terminal { escape_controls(text) } else { text.to_owned() };
        let mut out = self.out.lock();
        out.write_all(text.as_bytes())?;
        out.flush()
    }
}

/// `text` with every control character but newline and tab written as `\x1b` or `\u{85}`.
fn escape_controls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\n' | '\t' => out.push(c),
            c if (c as u32) < 0x80 && c.is_control() => out += &format!("\\x{:02x}", c as u32),
            c if c.is_control() => out += &format!("\\u{{{:x}}}", c as u32),
            c => out.push(c),
        }
    }
    out
}

/// `x` as a person would write it: `0.8`, `1e-320`.
fn show(x: f64) -> String {
    if x != 0.0 && x.is_finite() && !(1e-4..1e6).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// Separates the sampler's draws from other uses of a seed.
const SAMPLE_STREAM: u64 = 0x5A4D_504C;

/// One token from `logits`: temperature, top-k, softmax, then a draw.
fn draw(logits: &[f64], temperature: f64, top_k: usize, rng: &mut Rng) -> anyhow::Result<usize> {
    if let Some(l) = logits.iter().find(|l| !l.is_finite()) {
        anyhow::bail!("the model's logits are not finite ({l}): its weights do not make a usable model");
    }
    let scaled: Vec<f64> = logits.iter().map(|l| l / temperature).collect();
    if scaled.iter().any(|l| !l.is_finite()) {
        let largest = logits.iter().fold(0.0f64, |m, l| m.max(l.abs()));
        let why = format!(
            "--temperature {} divides the logits (up to {largest:.3} in size) past the largest float; give a larger \
             temperature",
            show(temperature)
        );
        return Err(crate::config::ConfigError::new(why).into());
    }
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
            return Ok(i);
        }
        u -= w;
    }
    Ok(weights.iter().rposition(|&w| w > 0.0).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_only_the_largest_logits_and_temperature_sharpens() {
        let logits = [0.0, 3.0, 1.0, 2.9];
        let mut rng = Rng::new(1, 2);
        let picks: Vec<usize> = (0..500).map(|_| draw(&logits, 1.0, 2, &mut rng).unwrap()).collect();
        assert!(picks.iter().all(|&p| p == 1 || p == 3), "top-2 draws only ids 1 and 3");
        assert!(picks.contains(&1) && picks.contains(&3));
        let cold: Vec<usize> = (0..200).map(|_| draw(&logits, 0.01, 4, &mut rng).unwrap()).collect();
        assert!(cold.iter().all(|&p| p == 1), "a low temperature takes the largest");
        let e = draw(&logits, 1e-320, 4, &mut rng).unwrap_err().to_string();
        assert!(e.starts_with("--temperature 1e-320 divides the logits (up to 3.000 in size) past"), "{e}");
        assert!(draw(&[0.0, f64::NAN], 1.0, 2, &mut rng).is_err());
    }

    #[test]
    fn control_characters_are_escaped_and_bytes_decode_as_they_complete() {
        assert_eq!(escape_controls("a\x1b[2Jb\n\tc\u{85}é"), "a\\x1b[2Jb\n\tc\\u{85}é");
        let v = Vocabulary::Bytes;
        let mut d = Decoded::new(&v, &[b'>' as u32]).unwrap();
        let parts: Vec<String> = "é!".bytes().map(|b| d.next(b as u32).unwrap()).collect();
        assert_eq!(parts, ["", "é", "!"]);
        assert_eq!(d.next(0xc3).unwrap(), "");
        assert_eq!(d.rest().unwrap(), "\u{fffd}");
    }
}

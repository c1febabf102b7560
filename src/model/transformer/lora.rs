//! LoRA adapters on a transformer's block linears, as PEFT makes them (`wrap.lora`). PEFT names
//! the modules of the Hugging Face class (`self_attn.q_proj`, `mlp.gate_proj`; GPT-2's
//! `attn.c_attn`, `mlp.c_proj`); the runner's block fuses some of them (q, k and v are the rows of
//! `qkv`, gate and up those of `fc`), so each adapter adds its (alpha / r) · B · A · dropout(x) to
//! the rows of the fused output its module's weight makes. An adapter's parameters are named
//! `blocks.{i}.{module}.lora_A` ([r, inputs]) and `.lora_B` ([rows, r]): PEFT's keys with the
//! block's prefix and `.weight` left out. A is Kaiming-uniform (a = √5, as `nn.Linear`: uniform in
//! ±1/√inputs) from its own stream of (seed, layer), B zero: step 0 is the base model.
use std::ops::Range;

use tch::nn;
use tch::Tensor;

use super::Spec;
use crate::config::schema::Lora;
use crate::model::hf::Arch;
use crate::rng::Rng;

/// Separates the adapters' streams from the layers' (`block::LAYER_STREAM`).
const LORA_STREAM: u64 = 0x7F0B_0000;

/// A linear layer of the runner's block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    Qkv,
    Proj,
    Fc,
    Out,
}

/// One adapted module of each block: its PEFT name, its path in the block, the runner's linear
/// it adds to, the rows of that linear's output it makes, and its inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub name: &'static str,
    pub module: &'static str,
    pub site: Site,
    pub rows: Range<i64>,
    pub inputs: i64,
}

impl Target {
    /// `blocks.{block}.{module}.lora_A` and `.lora_B` with their shapes.
    pub fn parameters(&self, block: &str, rank: i64) -> [(String, Vec<i64>); 2] {
        let rows = self.rows.end - self.rows.start;
        [
            (format!("{block}.{}.lora_A", self.module), vec![rank, self.inputs]),
            (format!("{block}.{}.lora_B", self.module), vec![rows, rank]),
        ]
    }
}

/// The adapters of a run's `[wrap]`: `None` without `wrap.lora` (or with one the plan refused).
pub fn of_wrap(w: &crate::config::schema::Wrap) -> Option<Adapters> {
    match (&w.lora, &w.model) {
        (Some(l), crate::config::schema::Model::Transformer(t)) => resolve(&Spec::of(t), l).ok(),
        _ => None,
    }
}

/// Whether `name` is an adapter's parameter.
pub fn is_adapter(name: &str) -> bool {
    name.ends_with(".lora_A") || name.ends_with(".lora_B")
}

/// The adapters `wrap.lora` resolves to on a model: the same modules in every block.
#[derive(Debug, Clone, PartialEq)]
pub struct Adapters {
    pub rank: i64,
    pub alpha: f64,
    pub dropout: f64,
    /// The Hugging Face class whose module names the targets are.
    pub class: Arch,
    pub targets: Vec<Target>,
}

impl Adapters {
    /// alpha / rank: what B · A is multiplied by.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// PEFT's names of the targets, each once (GPT-2's c_proj is two modules).
    pub fn names(&self) -> Vec<&'static str> {
        let mut names: Vec<&'static str> = self.targets.iter().map(|t| t.name).collect();
        names.dedup();
        names
    }
}

/// Every module of the class's blocks that LoRA can target, in PEFT's module order.
pub fn modules(s: &Spec, class: Arch) -> Vec<Target> {
    let (d, q, kv, hidden) =
        ((s.d) as i64, (s.heads * s.head_dim) as i64, (s.kv_heads * s.head_dim) as i64, s.hidden as i64);
    let t = |name, module, site, rows: Range<i64>, inputs| Target { name, module, site, rows, inputs };
    match class {
        Arch::Llama => vec![
            t("q_proj", "self_attn.q_proj", Site::Qkv, 0..q, d),
            t("k_proj", "self_attn.k_proj", Site::Qkv, q..q + kv, d),
            t("v_proj", "self_attn.v_proj", Site::Qkv, q + kv..q + 2 * kv, d),
            t("o_proj", "self_attn.o_proj", Site::Proj, 0..d, q),
            t("gate_proj", "mlp.gate_proj", Site::Fc, 0..hidden, d),
            t("up_proj", "mlp.up_proj", Site::Fc, hidden..2 * hidden, d),
            t("down_proj", "mlp.down_proj", Site::Out, 0..d, hidden),
        ],
        Arch::Gpt2 => vec![
            t("c_attn", "attn.c_attn", Site::Qkv, 0..q + 2 * kv, d),
            t("c_proj", "attn.c_proj", Site::Proj, 0..d, q),
            t("c_fc", "mlp.c_fc", Site::Fc, 0..hidden, d),
            t("c_proj", "mlp.c_proj", Site::Out, 0..d, hidden),
        ],
    }
}

/// `wrap.lora` on a model of `s`: its adapters, or the problems found, by key.
pub fn resolve(s: &Spec, l: &Lora) -> Result<Adapters, Vec<(&'static str, String)>> {
    let class = Arch::of(s).map_err(|e| {
        vec![("wrap.lora", format!("{e}: LoRA targets the modules of one of these classes (wrap.init's checkpoint)"))]
    })?;
    let all = modules(s, class);
    let mut names: Vec<&str> = all.iter().map(|t| t.name).collect();
    names.dedup();
    let mut problems = Vec::new();
    let asked: Vec<&str> = match l.targets.iter().map(String::as_str).collect::<Vec<_>>() {
        t if t.is_empty() && class == Arch::Llama => vec!["q_proj", "v_proj"],
        t if t.is_empty() => vec!["c_attn"],
        t if t.contains(&"all-linear") => names.clone(),
        t => t,
    };
    for name in asked.iter().filter(|n| !names.contains(n)) {
        problems.push((
            "wrap.lora.targets",
            format!(
                "the model ({}) has no module \"{name}\"; it has {} (or give [\"all-linear\"])",
                class.class(),
                names.iter().map(|n| format!("\"{n}\"")).collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    let targets: Vec<Target> = all.into_iter().filter(|t| asked.contains(&t.name)).collect();
    if l.rank <= 0 {
        problems.push(("wrap.lora.rank", format!("is {}; give a rank of at least 1 (PEFT's default is 8)", l.rank)));
    } else if let Some(t) = targets.iter().find(|t| l.rank > t.inputs.min(t.rows.end - t.rows.start)) {
        let (rows, inputs) = (t.rows.end - t.rows.start, t.inputs);
        problems.push((
            "wrap.lora.rank",
            format!(
                "is {}, larger than {} ({inputs} inputs, {rows} outputs): a low-rank update has at most {} ranks; \
                 give at most that",
                l.rank,
                t.module,
                inputs.min(rows)
            ),
        ));
    }
    if !l.alpha.is_finite() || l.alpha <= 0.0 {
        problems.push(("wrap.lora.alpha", format!("is {}; give a positive number (PEFT's default is 8)", l.alpha)));
    }
    if !(0.0..1.0).contains(&l.dropout) {
        problems.push(("wrap.lora.dropout", format!("is {}; give a probability in [0, 1)", l.dropout)));
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    Ok(Adapters { rank: l.rank, alpha: l.alpha, dropout: l.dropout, class, targets })
}

/// One adapter of a block, built.
#[derive(Debug)]
struct Adapter {
    site: Site,
    rows: Range<i64>,
    a: Tensor,
    b: Tensor,
}

/// A block's adapters (none without LoRA).
#[derive(Debug, Default)]
pub struct BlockAdapters {
    list: Vec<Adapter>,
    scale: f64,
    dropout: f64,
}

impl BlockAdapters {
    /// Block `layer`'s adapters under its path `b`, A drawn from the stream of (`seed`, layer).
    pub fn build(b: &nn::Path, adapters: Option<&Adapters>, seed: u64, layer: usize) -> BlockAdapters {
        let Some(ad) = adapters else { return BlockAdapters::default() };
        let mut rng = Rng::new(seed, LORA_STREAM + layer as u64);
        let list = ad
            .targets
            .iter()
            .map(|t| {
                let p = t.module.split('.').fold(b.clone(), |p, part| p / part);
                let bound = 1.0 / (t.inputs as f64).sqrt();
                let n = (ad.rank * t.inputs) as usize;
                let values: Vec<f32> = (0..n).map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32).collect();
                let a = p.var_copy("lora_A", &Tensor::from_slice(&values).view([ad.rank, t.inputs]));
                let rows = t.rows.end - t.rows.start;
                let b = p.var_copy("lora_B", &Tensor::zeros([rows, ad.rank], (tch::Kind::Float, tch::Device::Cpu)));
                Adapter { site: t.site, rows: t.rows.clone(), a, b }
            })
            .collect();
        BlockAdapters { list, scale: ad.scale(), dropout: ad.dropout }
    }

    /// `y`, the output of the linear `site` on `x`, with its adapters' updates added to their
    /// rows: y + scale · B · A · dropout(x), as PEFT's `lora.Linear` adds it. Added in place, to
    /// a view of the rows: cutting `y` into pieces and concatenating them again gives the same
    /// values, but its backward pass holds a zero-padded copy of the whole output's gradient for
    /// every piece (measured: four times the MLP's hidden width per token, with up_proj adapted).
    pub fn apply(&self, site: Site, x: &Tensor, y: Tensor, train: bool) -> Tensor {
        for a in self.list.iter().filter(|a| a.site == site) {
            let update = x.dropout(self.dropout, train).linear(&a.a, None::<Tensor>).linear(&a.b, None::<Tensor>);
            let mut rows = y.narrow(-1, a.rows.start, a.rows.end - a.rows.start);
            rows += update * self.scale;
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::{Family, Transformer};

    fn llama() -> Spec {
        let t = Transformer {
            family: Family::Llama,
            vocab: 11,
            d_model: 16,
            heads: 4,
            kv_heads: Some(2),
            layers: 2,
            seq_len: 5,
            mlp_hidden: Some(24),
            ..Default::default()
        };
        Spec::of(&t)
    }

    #[test]
    fn targets_are_resolved_by_peft_names_and_bad_ones_named() {
        let ad = resolve(&llama(), &Lora::default()).unwrap();
        assert_eq!(ad.names(), ["q_proj", "v_proj"]);
        assert_eq!(ad.targets[1].rows, 24..32);
        let all = Lora { targets: vec!["all-linear".into()], ..Lora::default() };
        assert_eq!(resolve(&llama(), &all).unwrap().targets.len(), 7);
        let bad = Lora { rank: 17, targets: vec!["c_attn".into(), "down_proj".into()], ..Lora::default() };
        let errs = resolve(&llama(), &bad).unwrap_err();
        assert_eq!(errs[0].0, "wrap.lora.targets");
        assert!(errs[0].1.contains("has no module \"c_attn\"; it has \"q_proj\", \"k_proj\""), "{}", errs[0].1);
        assert!(errs[1].1.contains("larger than mlp.down_proj (24 inputs, 16 outputs)"), "{}", errs[1].1);
        let zero = resolve(&llama(), &Lora { rank: 0, ..Lora::default() }).unwrap_err();
        assert_eq!(zero[0].0, "wrap.lora.rank");
    }

    #[test]
    fn a_model_with_adapters_counts_them_freezes_its_base_and_starts_as_it() {
        use crate::model::{Architecture, BuildContext};
        let ad = resolve(&llama(), &Lora::default()).unwrap();
        let arch = super::super::TransformerArch::from_spec(llama()).with_lora(Some(ad));
        // q_proj: 8 × (16 + 16), v_proj: 8 × (16 + 8), in each of 2 blocks.
        assert!(arch.describe().ends_with(", LoRA of rank 8 (alpha 8) on q_proj, v_proj: 896 parameters trained)"));
        let n = arch.layers().len();
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let net = arch.build(&vs.root(), 0..n, &BuildContext::new(5));
        let built: usize = vs.variables().values().map(|t| t.numel()).sum();
        assert_eq!(built, arch.layers().iter().map(|l| l.parameters).sum::<usize>());
        assert!(arch.frozen("blocks.0.qkv.weight") && !arch.frozen("blocks.0.self_attn.q_proj.lora_A"));
        let base = super::super::TransformerArch::from_spec(llama());
        let base_vs = nn::VarStore::new(tch::Device::Cpu);
        let base_net = base.build(&base_vs.root(), 0..n, &BuildContext::new(5));
        let x = Tensor::from_slice(&[1i64, 2, 3, 4, 5]).view([1, 5]);
        assert!(net.forward_t(&x, false).equal(&base_net.forward_t(&x, false)), "B is zero: step 0 is the base");
    }

    #[test]
    fn an_adapter_adds_its_update_to_its_rows_only() {
        let ad = resolve(&llama(), &Lora { targets: vec!["k_proj".into()], ..Lora::default() }).unwrap();
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let built = BlockAdapters::build(&(vs.root() / "blocks" / "0"), Some(&ad), 1, 1);
        let b = &vs.variables()["blocks.0.self_attn.k_proj.lora_B"];
        let _ = tch::no_grad(|| b.shallow_clone().fill_(0.5));
        let x = Tensor::ones([2, 3, 16], (tch::Kind::Float, tch::Device::Cpu));
        let y = Tensor::zeros([2, 3, 32], (tch::Kind::Float, tch::Device::Cpu));
        let out = built.apply(Site::Qkv, &x, y.shallow_clone(), false);
        let a = &vs.variables()["blocks.0.self_attn.k_proj.lora_A"];
        let expected = x.linear(a, None::<Tensor>).linear(b, None::<Tensor>);
        assert!(out.narrow(-1, 16, 8).allclose(&expected, 1e-6, 1e-6, false));
        assert_eq!(out.narrow(-1, 0, 16).abs().sum(tch::Kind::Float).double_value(&[]), 0.0);
        assert_eq!(out.narrow(-1, 24, 8).abs().sum(tch::Kind::Float).double_value(&[]), 0.0);
        assert!(a.abs().max().double_value(&[]) <= 0.25, "uniform within 1/√16");
    }
}

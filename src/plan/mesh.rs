//! The device mesh (`[wrap.mesh]`): the ranks as a grid of data × pipeline × tensor, its shape
//! resolved from the configuration ([`Shape::of`]) and checked on the plan ([`check`]).
//!
//! Rank order puts the tensor dimension innermost (its ranks consecutive: the most traffic on the
//! nearest links, as torchtitan and Megatron order it), then the pipeline's, then the data's:
//! `rank = (data × pipeline + stage) × tensor + tensor index`. With tensor = 1 this is the order
//! `wrap.pipeline.replicas` always had (each copy of a pipeline on consecutive ranks), so a
//! pipeline spelled either way runs the same.
use std::collections::BTreeMap;

use crate::config::schema::{Config, Model, WrapStrategy};

/// One dimension of the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Data,
    Pipeline,
    Tensor,
}

/// How many ranks each dimension has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub data: usize,
    pub pipeline: usize,
    pub tensor: usize,
}

/// A rank's index along each dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    pub data: usize,
    pub pipeline: usize,
    pub tensor: usize,
}

impl Shape {
    /// The mesh the configuration asks for, each unset dimension worked out from the others (see
    /// `[wrap.mesh]`); every dimension at least 1 (whether they multiply to the world size is
    /// [`check`]'s).
    pub fn of(c: &Config) -> Shape {
        let (m, world) = (&c.wrap.mesh, c.run.world_size.max(1));
        let tensor = m.tensor.unwrap_or(1).max(1);
        let pipeline = match (c.wrap.strategy, m.pipeline, m.data) {
            (_, Some(p), _) => p,
            (WrapStrategy::Pipeline, None, Some(d)) => world / (d.max(1) * tensor),
            (WrapStrategy::Pipeline, None, None) => world / (c.wrap.pipeline.replicas.max(1) * tensor),
            (_, None, _) => 1,
        }
        .max(1);
        let data = m.data.unwrap_or(world / (tensor * pipeline)).max(1);
        Shape { data, pipeline, tensor }
    }

    pub fn ranks(&self) -> usize {
        self.data * self.pipeline * self.tensor
    }

    pub fn size(&self, dim: Dim) -> usize {
        match dim {
            Dim::Data => self.data,
            Dim::Pipeline => self.pipeline,
            Dim::Tensor => self.tensor,
        }
    }

    pub fn coords(&self, rank: usize) -> Coords {
        Coords {
            data: rank / (self.pipeline * self.tensor),
            pipeline: rank / self.tensor % self.pipeline,
            tensor: rank % self.tensor,
        }
    }

    pub fn rank(&self, at: Coords) -> usize {
        (at.data * self.pipeline + at.pipeline) * self.tensor + at.tensor
    }

    /// The ranks of `rank`'s group along `dim`: those differing from it in that index alone, in
    /// order.
    pub fn group(&self, rank: usize, dim: Dim) -> Vec<usize> {
        let at = self.coords(rank);
        (0..self.size(dim))
            .map(|i| {
                let mut c = at;
                *match dim {
                    Dim::Data => &mut c.data,
                    Dim::Pipeline => &mut c.pipeline,
                    Dim::Tensor => &mut c.tensor,
                } = i;
                self.rank(c)
            })
            .collect()
    }

    /// Every group along `dim`, each once, by its first rank.
    pub fn groups(&self, dim: Dim) -> Vec<Vec<usize>> {
        let mut all: Vec<Vec<usize>> = (0..self.ranks()).map(|r| self.group(r, dim)).collect();
        all.sort();
        all.dedup();
        all
    }
}

/// Under the plan's table, where `[wrap.mesh]` is set: the shape, the ranks of each group, what
/// each rank holds, and what each is predicted to send per step.
pub(super) fn note(plan: &super::Plan) -> String {
    let c = &plan.config;
    if c.wrap.mesh == crate::config::schema::Mesh::default() {
        return String::new();
    }
    let shape = Shape::of(c);
    let mut note = format!(
        "  mesh: data {} × tensor {} × pipeline {} (rank = (data index × {} + stage) × {} + tensor index)\n",
        shape.data, shape.tensor, shape.pipeline, shape.pipeline, shape.tensor
    );
    for (dim, does) in [
        (Dim::Data, "copies of the model, each on its own shard of the data"),
        (Dim::Pipeline, "a pipeline's stages, activations sent between them"),
        (Dim::Tensor, "the slices of each layer"),
    ] {
        if shape.size(dim) > 1 {
            let groups: Vec<String> = shape.groups(dim).iter().map(|g| format!("{g:?}")).collect();
            let name = format!("{dim:?}").to_lowercase();
            note += &format!("    {name} groups ({does}): {}\n", groups.join(" "));
        }
    }
    let holds = match c.wrap.strategy {
        WrapStrategy::Pipeline if shape.tensor > 1 => {
            "its stage's layers: 1 / tensor of each block's attention heads and MLP units, the embeddings, norms \
             and head whole"
        }
        WrapStrategy::Pipeline => "its stage's layers, whole",
        WrapStrategy::Fsdp if shape.tensor > 1 => {
            "1 / data of its tensor slice of every parameter (1 / tensor of each block's attention heads and MLP \
             units; the embeddings, norms and head whole), each layer's slices gathered when used"
        }
        WrapStrategy::Fsdp => "1 / data of every parameter, each layer gathered whole when used",
        _ if shape.tensor > 1 => match c.wrap.model {
            Model::Mlp(_) => "1 / tensor of each pair of layers (the first's outputs, the second's inputs); an unpaired last layer whole",
            _ => "1 / tensor of each block's attention heads and MLP units; the embeddings, norms and head whole",
        },
        _ => "every layer, whole",
    };
    note += &format!("    each rank holds {holds}\n");
    note + &super::traffic::note(plan)
}

/// Under the memory estimate, with `wrap.mesh.sequence_parallel`: what each tensor rank keeps
/// of the activations, against tensor parallelism alone.
pub(super) fn sequence_note(plan: &super::Plan) -> Option<String> {
    let c = &plan.config;
    if !c.wrap.mesh.sequence_parallel {
        return None;
    }
    let tensor = Shape::of(c).tensor;
    let mut note = format!(
        "  sequence parallel: between the split layers each tensor rank holds 1/{tensor} of the sequence (the \
         residual stream, the norms, the residual dropout); an all-gather enters and a reduce-scatter leaves each \
         split pair, in place of the all-reduce"
    );
    let batch = plan.layout.split_batch.unwrap_or(c.train.batch_size);
    let how = |sequence| crate::model::Activations {
        checkpointing: c.wrap.activation_checkpointing,
        bf16: c.train.precision == crate::config::schema::Precision::Bf16,
        tensor,
        sequence,
    };
    let (arch, val) = (plan.model(), plan.data.validation_rows);
    if let (Some(with), Some(without)) =
        (arch.activation_bytes(batch, val, &how(true)), arch.activation_bytes(batch, val, &how(false)))
    {
        note += &format!(
            ": activations {} per rank, where tensor parallelism alone keeps {} (saves {}, {:.0}%)",
            crate::limits::size(with),
            crate::limits::size(without),
            crate::limits::size(without - with),
            100.0 * (without - with) / without.max(1.0)
        );
    }
    Some(note + "\n")
}

/// The mesh's checks: each dimension at least 1, their product the world size, the dimensions
/// the strategy can use, and (tensor > 1) a model whose heads and widths the tensor ranks split.
pub(super) fn check(c: &Config, sources: &BTreeMap<String, String>, bad: &mut impl FnMut(&str, String)) {
    let m = &c.wrap.mesh;
    let set = |key: &str| sources.get(key).is_some_and(|s| s != "default");
    if m.sequence_parallel {
        sequence_problems(c, bad);
    }
    // The product is refused on the first key given: its source is where the mesh was spelled.
    let Some(mesh_key) = ["wrap.mesh.data", "wrap.mesh.tensor", "wrap.mesh.pipeline"].into_iter().find(|k| set(k))
    else {
        return;
    };
    for (key, v) in [("data", m.data), ("tensor", m.tensor), ("pipeline", m.pipeline)] {
        if v == Some(0) {
            bad(&format!("wrap.mesh.{key}"), "must be at least 1".into());
            return;
        }
    }
    let pipeline = c.wrap.strategy == WrapStrategy::Pipeline;
    if c.wrap.strategy == WrapStrategy::Auto {
        bad(
            mesh_key,
            "wrap.strategy = \"auto\" chooses the strategy and, where none over the whole world fits, the mesh \
             itself; set wrap.strategy (\"ddp\", \"fsdp\" or \"pipeline\") for this mesh, or remove [wrap.mesh]"
                .into(),
        );
        return;
    }
    if m.pipeline.is_some_and(|p| p > 1) && !pipeline {
        bad("wrap.mesh.pipeline", "splits the layers into stages, which only wrap.strategy = \"pipeline\" does; set it, or leave wrap.mesh.pipeline out".into());
    }
    // By value, as stages.rs compares the pipeline's keys: replicas = 1 says nothing the mesh does not.
    if pipeline && c.wrap.pipeline.replicas != 1 {
        bad(
            "wrap.pipeline.replicas",
            "says how many copies of the pipeline run, as wrap.mesh.data does; with [wrap.mesh] set, \
             remove wrap.pipeline.replicas and give the copies as wrap.mesh.data"
                .into(),
        );
    }
    let shape = Shape::of(c);
    let world = c.run.world_size;
    if shape.ranks() != world {
        bad(mesh_key, product_problem(shape, world));
        return;
    }
    if shape.tensor > 1 {
        tensor_problems(c, shape.tensor, bad);
    }
}

/// Sequence parallelism splits a transformer's sequence over the tensor group: it needs one of
/// more than one rank, a sequence those ranks split evenly, and (not built yet) no pipeline.
fn sequence_problems(c: &Config, bad: &mut impl FnMut(&str, String)) {
    let key = "wrap.mesh.sequence_parallel";
    let tensor = Shape::of(c).tensor;
    if tensor < 2 {
        bad(
            key,
            format!(
                "splits the activations between the tensor-parallel layers along the sequence over the tensor \
                 group, but wrap.mesh.tensor = {tensor}; set wrap.mesh.tensor above 1, or remove sequence_parallel"
            ),
        );
        return;
    }
    let Model::Transformer(t) = &c.wrap.model else {
        bad(key, "splits a transformer's sequence; this model has none: remove sequence_parallel".into());
        return;
    };
    if t.seq_len > 0 && !t.seq_len.is_multiple_of(tensor) {
        let divide: Vec<String> =
            (1..=t.seq_len.min(64)).filter(|d| t.seq_len.is_multiple_of(*d)).map(|d| d.to_string()).collect();
        bad(
            key,
            format!(
                "{tensor} tensor ranks cannot split wrap.model.seq_len = {} evenly along the sequence; the tensor \
                 degrees that divide it: {} (or a seq_len that {tensor} divides)",
                t.seq_len,
                divide.join(", ")
            ),
        );
    }
}

/// Why `shape` is not `world` ranks, and what would be.
fn product_problem(shape: Shape, world: usize) -> String {
    let Shape { data, pipeline, tensor } = shape;
    let split = tensor * pipeline;
    let fix = if world.is_multiple_of(split) {
        format!("use data = {} (or leave it out: it is worked out)", world / split)
    } else {
        let divisors: Vec<String> = (1..=world).filter(|d| world.is_multiple_of(*d)).map(|d| d.to_string()).collect();
        format!("tensor × pipeline must divide it: use one of {}", divisors.join(", "))
    };
    format!(
        "data = {data} × tensor = {tensor} × pipeline = {pipeline} is {} ranks, but run.world_size = {world}; {fix}",
        shape.ranks()
    )
}

/// The model parts `tensor` ranks split: refused where they do not divide, naming the degrees
/// that would; and the strategies tensor parallelism does not compose with yet.
pub(super) fn tensor_problems(c: &Config, tensor: usize, bad: &mut impl FnMut(&str, String)) {
    let sizes: Vec<(&str, usize)> = match &c.wrap.model {
        Model::Torchscript(_) => {
            bad(
                "wrap.mesh.tensor",
                "a TorchScript module is one opaque graph to the runner: it has no layers to split across \
                 tensor ranks; use tensor = 1, or a built-in model kind"
                    .into(),
            );
            return;
        }
        // Layers 0, 2, ... are split by their outputs: hidden widths 0, 2, ...
        Model::Mlp(m) => m.hidden.iter().step_by(2).map(|&h| ("wrap.model.hidden", h)).collect(),
        Model::Transformer(t) => {
            let s = crate::model::transformer::Spec::of(t);
            vec![
                ("wrap.model.heads", s.heads),
                ("wrap.model.kv_heads", s.kv_heads),
                ("wrap.model.mlp_hidden", s.hidden),
            ]
        }
        Model::Cnn(_) => {
            bad("wrap.mesh.tensor", "a CNN's layers are not split across tensor ranks; use tensor = 1".into());
            return;
        }
    };
    for (key, n) in sizes.into_iter().filter(|(_, n)| !n.is_multiple_of(tensor)) {
        let divide: Vec<String> = (1..=n.min(64)).filter(|d| n.is_multiple_of(*d)).map(|d| d.to_string()).collect();
        bad(
            "wrap.mesh.tensor",
            format!(
                "{tensor} tensor ranks cannot split {key} = {n} evenly; the degrees that divide it: {}",
                divide.join(", ")
            ),
        );
    }
    // What is built: tensor parallelism within each copy of the model, DDP across the copies.
    if c.wrap.threads_per_replica.is_some() {
        bad(
            "wrap.threads_per_replica",
            "thread replicas share a rank's model whole; under wrap.mesh.tensor > 1 each rank holds slices: remove \
             one of them"
                .into(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_ranks_are_innermost_then_the_pipeline() {
        let s = Shape { data: 2, pipeline: 2, tensor: 2 };
        assert_eq!(s.coords(5), Coords { data: 1, pipeline: 0, tensor: 1 });
        assert_eq!((0..8).map(|r| s.rank(s.coords(r))).collect::<Vec<_>>(), (0..8).collect::<Vec<_>>());
        assert_eq!(s.groups(Dim::Tensor), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(s.groups(Dim::Pipeline), [[0, 2], [1, 3], [4, 6], [5, 7]]);
        assert_eq!(s.groups(Dim::Data), [[0, 4], [1, 5], [2, 6], [3, 7]]);
    }

    #[test]
    fn unset_dimensions_keep_what_a_pipeline_with_replicas_had() {
        let mut c = Config::default();
        c.run.world_size = 4;
        assert_eq!(Shape::of(&c), Shape { data: 4, pipeline: 1, tensor: 1 });
        c.wrap.strategy = WrapStrategy::Pipeline;
        c.wrap.pipeline.replicas = 2;
        let replicas = Shape::of(&c);
        assert_eq!(replicas, Shape { data: 2, pipeline: 2, tensor: 1 });
        c.wrap.pipeline.replicas = 1;
        c.wrap.mesh.data = Some(2);
        assert_eq!(Shape::of(&c), replicas);
        // A copy of the pipeline is stage-consecutive ranks, as `r % stages` always gave.
        assert_eq!(replicas.groups(Dim::Data), [[0, 2], [1, 3]]);
    }

    /// The problems `check` finds in `c`, with `wrap.mesh.tensor` given.
    fn problems(c: &Config) -> Vec<String> {
        let sources = BTreeMap::from([("wrap.mesh.tensor".to_owned(), "--set".to_owned())]);
        let mut out = Vec::new();
        check(c, &sources, &mut |key: &str, msg: String| out.push(format!("{key}: {msg}")));
        out
    }

    #[test]
    fn a_transformer_names_each_part_the_tensor_ranks_cannot_split() {
        let mut c = Config::default();
        c.run.world_size = 4;
        c.wrap.mesh.tensor = Some(4);
        let t = crate::config::schema::Transformer {
            heads: 6,
            kv_heads: Some(2),
            vocab: 65,
            mlp_hidden: Some(96),
            ..Default::default()
        };
        c.wrap.model = Model::Transformer(t);
        assert_eq!(
            problems(&c),
            [
                "wrap.mesh.tensor: 4 tensor ranks cannot split wrap.model.heads = 6 evenly; the degrees that divide it: 1, 2, 3, 6",
                "wrap.mesh.tensor: 4 tensor ranks cannot split wrap.model.kv_heads = 2 evenly; the degrees that divide it: 1, 2",
            ]
        );
        c.wrap.model = Model::Torchscript(crate::config::schema::Torchscript { path: "m.pt".into() });
        assert!(problems(&c)[0].contains("a TorchScript module is one opaque graph"), "{:?}", problems(&c));
    }

    #[test]
    fn sequence_parallelism_needs_tensor_ranks_and_a_sequence_they_split() {
        let mut c = Config::default();
        c.run.world_size = 2;
        c.wrap.mesh.sequence_parallel = true;
        let t = crate::config::schema::Transformer { seq_len: 9, ..Default::default() };
        c.wrap.model = Model::Transformer(t.clone());
        assert!(problems(&c)[0].contains("but wrap.mesh.tensor = 1"), "{:?}", problems(&c));
        c.wrap.mesh.tensor = Some(2);
        assert_eq!(
            problems(&c),
            ["wrap.mesh.sequence_parallel: 2 tensor ranks cannot split wrap.model.seq_len = 9 evenly along the \
              sequence; the tensor degrees that divide it: 1, 3, 9 (or a seq_len that 2 divides)"]
        );
        c.wrap.model = Model::Transformer(crate::config::schema::Transformer { seq_len: 8, ..t });
        assert!(problems(&c).is_empty(), "{:?}", problems(&c));
        c.wrap.model = Model::Mlp(Default::default());
        assert!(problems(&c).iter().any(|p| p.contains("this model has none")), "{:?}", problems(&c));
    }

    #[test]
    fn a_product_off_the_world_size_names_what_works() {
        let s = Shape { data: 1, pipeline: 1, tensor: 3 };
        assert_eq!(
            product_problem(s, 4),
            "data = 1 × tensor = 3 × pipeline = 1 is 3 ranks, but run.world_size = 4; tensor × pipeline must \
             divide it: use one of 1, 2, 4"
        );
        let s = Shape { data: 3, pipeline: 1, tensor: 2 };
        assert!(product_problem(s, 4).ends_with("use data = 2 (or leave it out: it is worked out)"));
    }
}

//! `wrap.strategy = "auto"` over mesh shapes. Where no strategy over the whole world fits (DDP,
//! FSDP, the pipeline: [`super::memory::Planner::choose`]), the plan considers every shape data ×
//! tensor × pipeline of the world size but those two (every rank in the data dimension, or in
//! the pipeline's): the tensor degrees the model splits (heads, KV heads, MLP widths: what
//! `[wrap.mesh]` itself refuses, [`super::mesh::tensor_problems`]), and the pipelines it can be
//! cut into (no more stages than layers, a tied head beside its embedding). Without a pipeline
//! each is tried under DDP and, with more than one copy, FSDP over the data dimension; with one,
//! each stage's gradients are averaged over the copies. Each is estimated as the plan estimates
//! that mesh when it is configured; of those that fit, the one whose ranks send the least per
//! sample trained (the busiest rank's bytes per step over every dimension,
//! [`super::traffic::split_copies`], over the step's rows: each copy takes `train.batch_size`
//! rows, so fewer copies train fewer rows a step) is chosen, the first on a tie (fewer pipeline
//! stages, then fewer tensor ranks, DDP before FSDP).
use crate::config::schema::{Config, WrapStrategy};
use crate::limits::size;

/// One mesh shape considered: its strategy over the data dimension, its shape, what a rank
/// needs (`None`: the estimate could not be made) and sends per step, and the rows a step
/// trains over every copy.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub strategy: WrapStrategy,
    pub data: usize,
    pub tensor: usize,
    pub pipeline: usize,
    pub needs: Option<f64>,
    pub sends: f64,
    pub rows: usize,
}

impl Candidate {
    /// `c` with this shape and strategy configured.
    pub fn config(&self, c: &Config) -> Config {
        let mut c = c.clone();
        c.wrap.strategy = self.strategy;
        c.wrap.fsdp.reshard_after_forward = true;
        c.wrap.mesh.data = Some(self.data);
        c.wrap.mesh.tensor = Some(self.tensor);
        c.wrap.mesh.pipeline = (self.pipeline > 1).then_some(self.pipeline);
        c
    }

    /// "data 2 × tensor 2 under DDP", "data 1 × tensor 2 × pipeline 2".
    fn name(&self) -> String {
        let (d, t, p) = (self.data, self.tensor, self.pipeline);
        match self.strategy {
            WrapStrategy::Pipeline => format!("data {d} × tensor {t} × pipeline {p}"),
            WrapStrategy::Fsdp => format!("data {d} × tensor {t} under FSDP (ZeRO-3)"),
            _ => format!("data {d} × tensor {t} under DDP"),
        }
    }

    /// The keys that configure this shape: "wrap.mesh.data = 2, wrap.mesh.tensor = 2".
    fn keys(&self) -> String {
        let pipeline = match self.pipeline {
            1 => String::new(),
            p => format!(", wrap.mesh.pipeline = {p}"),
        };
        format!("wrap.mesh.data = {}, wrap.mesh.tensor = {}{pipeline}", self.data, self.tensor)
    }

    /// Bytes a rank sends per sample the step trains.
    fn per_row(&self) -> f64 {
        self.sends / self.rows.max(1) as f64
    }

    fn text(&self) -> String {
        match self.needs {
            Some(needs) => {
                format!(
                    "{} needs {} and sends {} a step of {} rows",
                    self.name(),
                    size(needs),
                    size(self.sends),
                    self.rows
                )
            }
            None => format!("{} could not be estimated", self.name()),
        }
    }
}

/// The mesh shapes of `c`'s world size the model can be split into, each with what a rank needs
/// (`needs`: of the configuration with that shape) and sends per step (`sends`), copies of
/// `rows` rows a step.
pub fn candidates(
    c: &Config,
    needs: &dyn Fn(&Config) -> Option<f64>,
    sends: &dyn Fn(&Config) -> f64,
    rows: usize,
) -> Vec<Candidate> {
    let world = c.run.world_size;
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut out = Vec::new();
    for pipeline in divisors(world) {
        for tensor in divisors(world / pipeline) {
            // Every rank in the data dimension, or in a pipeline: a strategy over the whole world.
            if (pipeline == 1 && tensor == 1) || pipeline == world {
                continue;
            }
            let mut problems = 0;
            if tensor > 1 {
                super::mesh::tensor_problems(c, tensor, &mut |_: &str, _: String| problems += 1);
            }
            if problems > 0 {
                continue;
            }
            let data = world / (tensor * pipeline);
            let strategies: &[WrapStrategy] = match (pipeline > 1, data > 1) {
                (true, _) => &[WrapStrategy::Pipeline],
                (false, true) => &[WrapStrategy::Ddp, WrapStrategy::Fsdp],
                (false, false) => &[WrapStrategy::Ddp],
            };
            for &strategy in strategies {
                let mut shape =
                    Candidate { strategy, data, tensor, pipeline, needs: None, sends: 0.0, rows: data * rows };
                let configured = shape.config(c);
                (shape.needs, shape.sends) = (needs(&configured), sends(&configured));
                // A pipeline the model cannot be cut into (more stages than layers, a tied head
                // away from its embedding) is no shape of it.
                if pipeline == 1 || shape.needs.is_some() {
                    out.push(shape);
                }
            }
        }
    }
    out
}

/// Of `shapes`, the one that fits `limit` bytes a rank and sends the least per row, with why; or why
/// none does, naming the one that needs the least. `before`: why no strategy over the whole
/// world fits.
pub fn choose(shapes: &[Candidate], limit: f64, limit_text: &str, before: &str) -> Result<(Candidate, String), String> {
    let considered: Vec<String> = shapes.iter().map(Candidate::text).collect();
    let fits = shapes.iter().filter(|s| s.needs.is_some_and(|n| n <= limit));
    // The first of the least: fewer tensor ranks, DDP before FSDP, on a tie.
    let best = fits.fold(None::<&Candidate>, |best, s| match best {
        Some(b) if b.per_row() <= s.per_row() => Some(b),
        _ => Some(s),
    });
    if let Some(best) = best {
        let why = format!(
            "chose the mesh {} ({}): a rank needs {} within {limit_text} and sends {} a step of {} rows, the least \
             per row of the mesh shapes that fit; no strategy over the whole world fits ({before}); considered: {}",
            best.name(),
            best.keys(),
            size(best.needs.unwrap_or_default()),
            size(best.sends),
            best.rows,
            considered.join(", ")
        );
        return Ok((best.clone(), why));
    }
    if shapes.is_empty() {
        return Err("no mesh shape of this world size splits the model (wrap.mesh.tensor must divide its heads, \
                    KV heads and MLP widths; wrap.mesh.pipeline cannot exceed its layers)"
            .into());
    }
    let smallest = shapes
        .iter()
        .filter_map(|s| Some((s, s.needs?)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(s, n)| format!("; the smallest, {}, needs {}", s.name(), size(n)))
        .unwrap_or_default();
    Err(format!("no mesh shape fits either: {}{smallest}", considered.join(", ")))
}

/// Under a configured strategy that does not fit `limit` bytes a rank: the mesh shapes of this
/// world size that do, least first, with what a rank needs and how to choose one; where none
/// does, with `smallest_too`, the one that needs the least; `None` where the model has no mesh
/// shape, or none fits and the smallest is not asked for.
pub fn fitting(shapes: &[Candidate], limit: f64, smallest_too: bool) -> Option<String> {
    let mut all: Vec<(&Candidate, f64)> = shapes.iter().filter_map(|s| Some((s, s.needs?))).collect();
    all.sort_by(|a, b| a.1.total_cmp(&b.1));
    let fits: Vec<(&Candidate, f64)> = all.iter().copied().filter(|(_, n)| *n <= limit).collect();
    if fits.is_empty() {
        let (smallest, needs) = all.first().filter(|_| smallest_too)?;
        return Some(format!(
            "no mesh shape of this world size fits either (the smallest, {}, needs {})",
            smallest.name(),
            size(*needs)
        ));
    }
    let named: Vec<String> =
        fits.iter().map(|(s, n)| format!("{} ({}: {} a rank)", s.name(), s.keys(), size(*n))).collect();
    Some(format!(
        "at this world size the mesh {} {} (set wrap.strategy and [wrap.mesh] so, or wrap.strategy = \"auto\" with \
         no [wrap.mesh] chooses among them)",
        if fits.len() == 1 { "shape" } else { "shapes" },
        named.join(", ") + if fits.len() == 1 { " fits" } else { " fit" }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(strategy: WrapStrategy, data: usize, tensor: usize, needs: f64, sends: f64) -> Candidate {
        Candidate { strategy, data, tensor, pipeline: 1, needs: Some(needs), sends, rows: 16 * data }
    }

    #[test]
    fn the_shape_that_fits_and_sends_least_is_chosen_and_the_smallest_named_when_none_fits() {
        let shapes = [
            shape(WrapStrategy::Ddp, 2, 2, 900.0, 20.0),
            shape(WrapStrategy::Fsdp, 2, 2, 500.0, 60.0),
            shape(WrapStrategy::Ddp, 1, 4, 600.0, 20.0),
        ];
        let (best, why) = choose(&shapes, 700.0, "the limit", "DDP would need 2 kB").unwrap();
        assert_eq!(best, shapes[2]);
        assert!(why.starts_with("chose the mesh data 1 × tensor 4 under DDP (wrap.mesh.data = 1"), "{why}");
        // With room for all three, the least traffic per row wins: 2 copies train twice the rows.
        assert_eq!(choose(&shapes, 1000.0, "", "").unwrap().0, shapes[0]);
        let refused = choose(&shapes, 100.0, "", "").unwrap_err();
        assert!(refused.ends_with("the smallest, data 2 × tensor 2 under FSDP (ZeRO-3), needs 0.0 MiB"), "{refused}");
    }

    #[test]
    fn a_limit_s_advice_names_the_shapes_that_fit_least_first_or_the_smallest() {
        let pipeline = Candidate { pipeline: 2, ..shape(WrapStrategy::Pipeline, 1, 2, 550.0, 10.0) };
        let shapes =
            [shape(WrapStrategy::Ddp, 2, 2, 900.0, 20.0), shape(WrapStrategy::Ddp, 1, 4, 600.0, 20.0), pipeline];
        let advice = fitting(&shapes, 700.0, false).unwrap();
        assert!(
            advice.starts_with(
                "at this world size the mesh shapes data 1 × tensor 2 × pipeline 2 (wrap.mesh.data = 1, \
                 wrap.mesh.tensor = 2, wrap.mesh.pipeline = 2: 0.0 MiB a rank), data 1 × tensor 4 under DDP"
            ),
            "{advice}"
        );
        let none = fitting(&shapes, 100.0, true).unwrap();
        assert!(none.ends_with("(the smallest, data 1 × tensor 2 × pipeline 2, needs 0.0 MiB)"), "{none}");
        // Where a strategy or world size fits, a shape that does not is not named.
        assert_eq!(fitting(&shapes, 100.0, false), None);
        assert_eq!(fitting(&[], 100.0, true), None);
    }
}

//! `wrap.strategy = "auto"` over mesh shapes. Where no strategy over the whole world fits (DDP,
//! FSDP, the pipeline: [`super::memory::Planner::choose`]), the plan considers the shapes data ×
//! tensor of the world size whose tensor degree the model splits (heads, KV heads, MLP widths:
//! what `[wrap.mesh]` itself refuses, [`super::mesh::tensor_problems`]), each under DDP and,
//! with more than one copy, FSDP over the data dimension. Each is estimated as the plan estimates
//! that mesh when it is configured; of those that fit, the one whose ranks send the least per
//! sample trained (a rank's bytes per step in the data and tensor dimensions together,
//! [`super::traffic::split_copies`], over the step's rows: each copy takes `train.batch_size`
//! rows, so fewer copies train fewer rows a step) is chosen, the fewer tensor ranks on a tie.
//! Pipeline × tensor shapes are not considered yet.
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
        c
    }

    /// "data 2 × tensor 2 under DDP".
    fn name(&self) -> String {
        let strategy = if self.strategy == WrapStrategy::Fsdp { "FSDP (ZeRO-3)" } else { "DDP" };
        format!("data {} × tensor {} under {strategy}", self.data, self.tensor)
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
    let mut out = Vec::new();
    for tensor in (2..=world).filter(|t| world.is_multiple_of(*t)) {
        let mut problems = 0;
        super::mesh::tensor_problems(c, tensor, &mut |_: &str, _: String| problems += 1);
        if problems > 0 {
            continue;
        }
        let data = world / tensor;
        let strategies: &[WrapStrategy] =
            if data > 1 { &[WrapStrategy::Ddp, WrapStrategy::Fsdp] } else { &[WrapStrategy::Ddp] };
        for &strategy in strategies {
            let mut shape = Candidate { strategy, data, tensor, needs: None, sends: 0.0, rows: data * rows };
            let configured = shape.config(c);
            (shape.needs, shape.sends) = (needs(&configured), sends(&configured));
            out.push(shape);
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
            "chose the mesh {} (wrap.mesh.data = {}, wrap.mesh.tensor = {}): a rank needs {} within {limit_text} and \
             sends {} a step of {} rows, the least per row of the mesh shapes that fit; no strategy over the whole \
             world fits ({before}); considered: {}",
            best.name(),
            best.data,
            best.tensor,
            size(best.needs.unwrap_or_default()),
            size(best.sends),
            best.rows,
            considered.join(", ")
        );
        return Ok((best.clone(), why));
    }
    if shapes.is_empty() {
        return Err("no mesh shape of this world size splits the model (wrap.mesh.tensor must divide its heads, \
                    KV heads and MLP widths)"
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

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(strategy: WrapStrategy, data: usize, tensor: usize, needs: f64, sends: f64) -> Candidate {
        Candidate { strategy, data, tensor, needs: Some(needs), sends, rows: 16 * data }
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
}

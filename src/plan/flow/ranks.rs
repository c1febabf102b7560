//! The plan's rows of what each rank holds: FSDP's units, a pipeline's stages, and the notes
//! under the table (the memory estimate, the pipeline's bubble).
use super::super::Plan;
use super::{fmt_mib, micro_size, schedule_name, versus_ddp};

impl Plan {
    /// One row per FSDP unit: its layer, what each rank holds of it, when it is gathered.
    pub(super) fn unit_rows(&self) -> Vec<Vec<String>> {
        let arch = self.model();
        let layers = arch.layers();
        let units = crate::model::shard_units(arch.as_ref());
        // Under tensor parallelism each tensor rank's slices are sharded over the data dimension.
        let mesh = self.mesh();
        let shapes = crate::plan::memory::Shapes::of(arch.as_ref(), mesh.tensor);
        let w = (self.world_size() / mesh.tensor) as i64;
        let mut unit = 0;
        let mut rows = Vec::new();
        for (l, layer) in layers.iter().enumerate() {
            if layer.parameters == 0 {
                continue;
            }
            let shard: i64 = shapes.layers[l].iter().map(|&(r, v)| (r + w - 1) / w * v).sum();
            let pad = shard * w - shapes.layers[l].iter().map(|&(r, v)| r * v).sum::<i64>();
            let padding = if pad > 0 { format!(" ({pad} padding)") } else { String::new() };
            let shared =
                units.layers[l].iter().filter(|&&u| u != unit).map(|u| format!(" with unit {u} (a shared parameter)"));
            rows.push(vec![
                format!("  unit {unit}"),
                format!("{}: {} parameters", layer.name, layer.parameters),
                format!("{shard} on each rank{padding}, {} MiB", fmt_mib(shard as f64 * 4.0)),
                format!("gathered for layer {l}{}", shared.collect::<String>()),
            ]);
            unit += 1;
        }
        rows
    }

    /// One row per pipeline stage: the ranks holding it, what flows in, its layers, what flows out.
    pub(super) fn stage_rows(&self) -> Vec<Vec<String>> {
        let c = &self.config;
        let layers = self.model().layers();
        let dims = |v: &[i64]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" × ");
        let mb = micro_size(self.batch_per_rank, c.wrap.pipeline.micro_batches);
        let (w, t) = (self.pipeline_ranks(), self.mesh().tensor.max(1));
        (0..w)
            .map(|r| {
                let s = &self.stages[r];
                let ranks: Vec<String> = (r..self.world_size()).step_by(w).map(|x| x.to_string()).collect();
                let label =
                    if ranks.len() == 1 { format!("  rank {r}") } else { format!("  ranks {}", ranks.join(", ")) };
                // A stage's tensor ranks each exchange with the same tensor rank of the next stage.
                let (from, to) = match (r < t, ranks.len()) {
                    (true, _) => ("batch".to_string(), format!("to rank {}", r + t)),
                    (_, 1) => (format!("from rank {}", r - t), format!("to rank {}", r + t)),
                    _ => ("from the stage before".to_string(), "to the next stage".to_string()),
                };
                let to = if r + t >= w { "logits → loss".to_string() } else { to };
                let (input, output) = self.stage_shapes(s);
                // "10-64-64" for linear layers: the widths the stage's activations take.
                let layer_widths: Vec<String> = std::iter::once(dims(&input))
                    .chain(
                        layers[s.clone()]
                            .iter()
                            .map(|l| l.output.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" × ")),
                    )
                    .collect();
                let p = self.rank_parameters(r);
                // Parameters, gradients and optimizer state.
                let state = p as f64 * 4.0 * (2.0 + crate::plan::memory::optimizer_slots(c));
                vec![
                    label,
                    format!("{mb} × {} {from}", dims(&input)),
                    format!(
                        "{} ({}): {p} parameters, {} MiB of training state",
                        crate::model::layers_text(s),
                        layer_widths.join("-"),
                        fmt_mib(state)
                    ),
                    format!("{mb} × {} {to}", dims(&output)),
                ]
            })
            .collect()
    }

    /// Under the table: the memory estimate the plan checked.
    pub(super) fn memory_note(&self) -> String {
        let mut note = String::new();
        if let Some(e) = &self.memory {
            note += &format!("\n  memory: about {e}, estimated\n");
        }
        if let Some(device) = crate::plan::device_memory::DeviceMemory::of(self) {
            note += &format!("  GPU memory per rank: about {device}, estimated\n");
        }
        if let Some((state, ddp)) = &self.state {
            let layout = crate::plan::memory::Layout::of(&self.config);
            let versus = ddp.as_ref().map(|d| versus_ddp(layout, state, d, self.world_size())).unwrap_or_default();
            note += &format!("  training state under {layout}: {state} per rank{versus}\n");
        }
        note += &crate::plan::strategy::checkpointing_note(self).unwrap_or_default();
        note += &crate::plan::mesh::sequence_note(self).unwrap_or_default();
        if let Some(why) = &self.auto {
            note += &format!("  wrap.strategy = \"auto\": {why}\n");
        }
        note
    }

    /// Under a pipeline's table: the idle share its schedule implies.
    pub(super) fn bubble_note(&self) -> String {
        if !self.is_pipeline() {
            return String::new();
        }
        let (s, m) = (self.pipeline_stages() as f64, self.config.wrap.pipeline.micro_batches as f64);
        format!(
            "\n  {} bubble: (stages - 1) / (micro-batches + stages - 1) = {:.0}% of each step idle per rank, \
             before communication; the trace measures it (column bubble)\n",
            schedule_name(self.config.wrap.pipeline.schedule),
            100.0 * (s - 1.0) / (m + s - 1.0)
        )
    }
}

//! `kind = "torchscript"`: a module the user scripted or traced in PyTorch
//! (`torch.jit.script(model).save("model.pt")`), loaded with its own initial weights. Its
//! parameters join the VarStore (tch's `TrainableCModule`, names with `_` for `.`:
//! `fc1.weight` is `fc1_weight`), so the optimizer, DDP's Reducer, checkpoints, `wrap.init` and
//! `model.safetensors` treat them as any model's; the order of `named_parameters()` is torch's
//! module order. To the runner the module is one opaque layer: a pipeline cannot cut it. Its
//! buffers (batch norm's running statistics, if it has any) stay inside the module: they are
//! neither checkpointed nor written to `model.safetensors`.
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tch::nn::{self, ModuleT};
use tch::{CModule, Kind, Tensor, TrainableCModule};

use super::{Architecture, BuildContext, Layer};

/// What the plan learned by loading the module and running it once.
#[derive(Debug, Clone)]
pub struct TorchScriptArch {
    path: PathBuf,
    /// Parameter names as the VarStore holds them, with shapes, in module order.
    params: Vec<(String, Vec<i64>)>,
    /// Parameters the module freezes (`requires_grad = False`): kept and saved, never trained.
    frozen: Vec<(String, Vec<i64>)>,
    outputs: usize,
}

/// The VarStore's name of a module parameter (as `TrainableCModule::load` registers it).
fn var_name(name: &str) -> String {
    name.replace('.', "_")
}

/// Loads the module at `path` and runs one batch of 2 zero samples of shape `input` through it
/// (in eval mode, without gradients): it must be TorchScript and give 2 × `outputs` values.
pub fn inspect(path: &Path, input: &[usize], outputs: usize) -> Result<TorchScriptArch, String> {
    // torch.jit.save writes a zip archive; anything else is not worth libtorch's message.
    let mut magic = [0u8; 4];
    let zip = std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok()
        && magic == *b"PK\x03\x04";
    if !zip {
        return Err(format!(
            "{} is not a TorchScript module (not the zip archive torch.jit.save writes); save one with \
             torch.jit.script(model).save(path) or torch.jit.trace(model, example).save(path)",
            path.display()
        ));
    }
    let mut module = CModule::load(path).map_err(|e| {
        let first = e.to_string().lines().next().unwrap_or_default().to_owned();
        format!(
            "{} is not a TorchScript module ({first}); save one with torch.jit.script(model).save(path) or \
             torch.jit.trace(model, example).save(path)",
            path.display()
        )
    })?;
    let (mut params, mut frozen) = (Vec::new(), Vec::new());
    for (name, t) in
        module.named_parameters().map_err(|e| format!("cannot list the parameters of {}: {e}", path.display()))?
    {
        let list = if t.requires_grad() { &mut params } else { &mut frozen };
        list.push((var_name(&name), t.size()));
    }
    module.f_set_eval().map_err(|e| format!("{}: {e}", path.display()))?;
    let batch: Vec<i64> = std::iter::once(2).chain(input.iter().map(|&d| d as i64)).collect();
    let x = Tensor::zeros(batch.as_slice(), (Kind::Float, tch::Device::Cpu));
    let out = tch::no_grad(|| module.forward_ts(&[x])).map_err(|e| {
        let first = e.to_string().lines().next().unwrap_or_default().to_owned();
        format!("{} fails on a batch of shape {batch:?} (the data's samples): {first}", path.display())
    })?;
    if out.size() != [2, outputs as i64] {
        return Err(format!(
            "{} maps a batch of shape {batch:?} to {:?}, but the task needs [2, {outputs}] (one logit per class)",
            path.display(),
            out.size()
        ));
    }
    Ok(TorchScriptArch { path: path.to_owned(), params, frozen, outputs })
}

impl TorchScriptArch {
    /// The module at `path` (already inspected by the plan); one with no parameters if it cannot
    /// be read now.
    pub fn new(path: &Path, input: &[usize], outputs: usize) -> TorchScriptArch {
        inspect(path, input, outputs).unwrap_or(TorchScriptArch {
            path: path.to_owned(),
            params: Vec::new(),
            frozen: Vec::new(),
            outputs,
        })
    }
}

impl Architecture for TorchScriptArch {
    fn describe(&self) -> String {
        let name = self.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        format!("TorchScript {name}")
    }

    fn layers(&self) -> Vec<Layer> {
        let parameters = self.params.iter().map(|(_, s)| s.iter().product::<i64>() as usize).sum();
        vec![Layer {
            name: format!("TorchScript module, {} tensors", self.params.len()),
            parameters,
            output: vec![self.outputs],
            // Unknown: the module's insides are not described.
            held: 0,
        }]
    }

    fn parameters(&self, range: Range<usize>) -> Vec<(String, Vec<i64>)> {
        if range.is_empty() {
            Vec::new()
        } else {
            self.params.clone()
        }
    }

    fn buffers(&self, range: Range<usize>) -> Vec<(String, Vec<i64>)> {
        if range.is_empty() {
            Vec::new()
        } else {
            self.frozen.clone()
        }
    }

    fn build<'a>(&self, p: &nn::Path, _range: Range<usize>, _ctx: &BuildContext<'a>) -> Box<dyn ModuleT + 'a> {
        let mut module = TrainableCModule::load(&self.path, p.clone()).unwrap_or_else(|e| {
            panic!("cannot load {} (it was read when the plan was made): {e}", self.path.display())
        });
        module.set_train();
        Box::new(Scripted { module: Mutex::new((module, true)) })
    }
}

/// The loaded module and whether it is in training mode (switched only when `train` changes).
struct Scripted {
    module: Mutex<(TrainableCModule, bool)>,
}

impl std::fmt::Debug for Scripted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scripted")
    }
}

impl ModuleT for Scripted {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let mut guard = self.module.lock().unwrap_or_else(|e| e.into_inner());
        let (module, training) = &mut *guard;
        if *training != train {
            if train {
                module.set_train()
            } else {
                module.set_eval()
            }
            *training = train;
        }
        module.forward_ts(&[x]).unwrap_or_else(|e| panic!("the TorchScript module failed: {e}"))
    }
}

//! `kind = "torchscript"`: a module the user scripted or traced in PyTorch
//! (`torch.jit.script(model).save("model.pt")`), loaded with its own initial weights. Its whole
//! state joins the VarStore under PyTorch's own names (`layer1.0.bn1.running_mean`, the keys of
//! the module's `state_dict()`): the parameters as trainable variables (in `named_parameters()`
//! order, torch's module order, which DDP's buckets follow), frozen parameters and buffers (batch
//! norm's running statistics and batch count) as variables that are not trained. So the
//! optimizer and DDP's Reducer see the parameters, while checkpoints, DDP's buffer broadcast,
//! `wrap.init` and `model.safetensors` see everything: the saved file loads into the user's own
//! class with `load_state_dict(..., strict=True)`. To the runner the module is one opaque layer:
//! a pipeline cannot cut it.
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tch::nn::{self, ModuleT};
use tch::{Kind, Tensor};

use crate::dist::Script;

use super::{Architecture, BuildContext, Layer};

/// What the plan learned by loading the module and running it once.
#[derive(Debug, Clone)]
pub struct TorchScriptArch {
    path: PathBuf,
    /// Trained parameters' names and shapes, in module order.
    params: Vec<(String, Vec<i64>)>,
    /// Parameters the module freezes (`requires_grad = False`), then its buffers: kept, broadcast
    /// and saved, never trained.
    frozen: Vec<(String, Vec<i64>)>,
    outputs: usize,
}

/// Adds `t` to the VarStore under `name`, PyTorch's dotted name: one sub-path per part.
fn add_var(p: &nn::Path, name: &str, t: Tensor, trainable: bool) {
    let mut parts: Vec<&str> = name.split('.').collect();
    let leaf = parts.pop().unwrap_or(name);
    let path = parts.iter().fold(p.clone(), |p, part| p.sub(*part));
    let _ = path.add(leaf, t, trainable);
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
    let mut module = Script::load(path, tch::Device::Cpu).map_err(|e| {
        let first = e.to_string().lines().next().unwrap_or_default().to_owned();
        format!(
            "{} is not a TorchScript module ({first}); save one with torch.jit.script(model).save(path) or \
             torch.jit.trace(model, example).save(path)",
            path.display()
        )
    })?;
    let (mut params, mut frozen) = (Vec::new(), Vec::new());
    for (name, t) in
        module.parameters().map_err(|e| format!("cannot list the parameters of {}: {e}", path.display()))?
    {
        let list = if t.requires_grad() { &mut params } else { &mut frozen };
        list.push((name, t.size()));
    }
    for (name, t) in module.buffers().map_err(|e| format!("cannot list the buffers of {}: {e}", path.display()))? {
        frozen.push((name, t.size()));
    }
    module.set_train(false).map_err(|e| format!("{}: {e}", path.display()))?;
    let batch: Vec<i64> = std::iter::once(2).chain(input.iter().map(|&d| d as i64)).collect();
    let x = Tensor::zeros(batch.as_slice(), (Kind::Float, tch::Device::Cpu));
    let out = tch::no_grad(|| module.forward(&x)).map_err(|e| {
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
            name: format!("TorchScript module, {} parameters, {} buffers", self.params.len(), self.frozen.len()),
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
        let fail = |e: crate::dist::Error| -> ! {
            panic!("cannot load {} (it was read when the plan was made): {e}", self.path.display())
        };
        let mut module = Script::load(&self.path, p.device()).unwrap_or_else(|e| fail(e));
        for (name, t) in module.parameters().unwrap_or_else(|e| fail(e)) {
            let trainable = t.requires_grad();
            add_var(p, &name, t, trainable);
        }
        for (name, t) in module.buffers().unwrap_or_else(|e| fail(e)) {
            add_var(p, &name, t, false);
        }
        module.set_train(true).unwrap_or_else(|e| fail(e));
        Box::new(Scripted { module: Mutex::new((module, true)) })
    }
}

/// The loaded module and whether it is in training mode (switched only when `train` changes).
struct Scripted {
    module: Mutex<(Script, bool)>,
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
            module.set_train(train).unwrap_or_else(|e| panic!("the TorchScript module failed: {e}"));
            *training = train;
        }
        module.forward(x).unwrap_or_else(|e| panic!("the TorchScript module failed: {e}"))
    }
}

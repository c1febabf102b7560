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
use tch::{CModule, Kind, Tensor};

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

/// The module's parameters with each tensor once, under the first name that holds it: a
/// parameter the module shares (`b.weight = a.weight`, one tensor under two names) is one
/// parameter, trained, counted, sharded and saved once (as PyTorch's `named_parameters()` lists
/// it), while the module reads it under both names.
fn distinct(named: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = Vec::with_capacity(named.len());
    for (name, t) in named {
        if !out.iter().any(|(_, seen)| t.numel() > 0 && t.is_set_to(seen)) {
            out.push((name, t));
        }
    }
    out
}

/// A real batch of the data, for the plan's check of a module ([`check`]).
pub struct Probe {
    /// The first training rows, as many as a training batch holds (the training batch size).
    pub x: Tensor,
    /// Rows of the smallest training batch (an epoch's last, when the rows do not divide).
    pub smallest: usize,
    /// Logits (or values) per sample the task needs.
    pub outputs: usize,
    /// How long the module may take on it: `run.timeout_s`.
    pub timeout_s: f64,
}

/// Loads the module at `path` and lists its parameters: it must be the zip archive
/// `torch.jit.save` writes, and libtorch must read it.
pub fn describe(path: &Path, outputs: usize) -> Result<TorchScriptArch, String> {
    Ok(load(path)?.1.with_outputs(outputs))
}

fn load(path: &Path) -> Result<(CModule, TorchScriptArch), String> {
    let advice = "save one with torch.jit.script(model).save(path) or torch.jit.trace(model, example).save(path)";
    // torch.jit.save writes a zip archive; anything else is not worth libtorch's message.
    let mut magic = [0u8; 4];
    let zip = std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok()
        && magic == *b"PK\x03\x04";
    if !zip {
        return Err(format!(
            "{} is not a TorchScript module (not the zip archive torch.jit.save writes); {advice}",
            path.display()
        ));
    }
    let module = CModule::load(path).map_err(|e| {
        format!("{} is not a TorchScript module ({}); {advice}", path.display(), crate::checked::torch_message(&e))
    })?;
    // The whole state under PyTorch's names: trainable parameters, then frozen ones and buffers.
    let script = Script::load(path, tch::Device::Cpu)
        .map_err(|e| format!("{} is not a TorchScript module ({e}); {advice}", path.display()))?;
    let (mut params, mut frozen) = (Vec::new(), Vec::new());
    let named = script.parameters().map_err(|e| format!("cannot list the parameters of {}: {e}", path.display()))?;
    for (name, t) in &distinct(named) {
        let list = if t.requires_grad() { &mut params } else { &mut frozen };
        list.push((name.clone(), t.size()));
    }
    for (name, t) in script.buffers().map_err(|e| format!("cannot list the buffers of {}: {e}", path.display()))? {
        frozen.push((name, t.size()));
    }
    Ok((module, TorchScriptArch { path: path.to_owned(), params, frozen, outputs: 0 }))
}

/// The plan's check of the module at `path` on `probe`, the data's own rows: in training mode
/// forward and backward at the training batch size (and at the smallest batch), in eval mode at
/// the batch size and on one row. It must have trainable parameters, all finite, give float,
/// finite outputs of `[rows, outputs]` whatever the rows, and gradients to its parameters. A
/// module that does not return within `probe.timeout_s` is refused too (its thread is left to
/// the process's end).
pub fn check(path: &Path, probe: Probe) -> Result<TorchScriptArch, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let doing = std::sync::Arc::new(Mutex::new(String::from("loading")));
    let now = std::sync::Arc::clone(&doing);
    let (file, timeout) = (path.to_owned(), probe.timeout_s);
    std::thread::spawn(move || {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_checks(&file, &probe, &now)));
        let _ = tx.send(result.unwrap_or_else(|_| Err(format!("{} failed in libtorch", file.display()))));
    });
    match rx.recv_timeout(std::time::Duration::from_secs_f64(timeout)) {
        Ok(result) => result,
        Err(_) => Err(format!(
            "{} did not return within run.timeout_s ({timeout} s) {}: a forward pass that never ends (a loop?)",
            path.display(),
            doing.lock().unwrap_or_else(|e| e.into_inner())
        )),
    }
}

fn run_checks(path: &Path, probe: &Probe, doing: &Mutex<String>) -> Result<TorchScriptArch, String> {
    let p = path.display();
    let (mut module, arch) = load(path)?;
    let arch = arch.with_outputs(probe.outputs);
    if arch.params.is_empty() {
        return Err(format!(
            "{p} has no trainable parameter ({} frozen, requires_grad = False): there is nothing to train; leave \
             requires_grad on for the parameters to train",
            arch.frozen.len()
        ));
    }
    for (name, t) in module.named_parameters().map_err(|e| crate::checked::torch_message(&e))? {
        let bad = tch::no_grad(|| t.isfinite().logical_not().sum(Kind::Int64).int64_value(&[]));
        if bad > 0 {
            return Err(format!("{p}: parameter `{name}` holds {bad} NaN or infinite values"));
        }
    }
    let rows = probe.x.size()[0];
    let mut sizes = vec![(true, rows)];
    if (probe.smallest as i64) < rows {
        sizes.push((true, probe.smallest as i64));
    }
    sizes.extend([(false, rows), (false, 1)]);
    for (train, n) in sizes {
        let mode = if train { "training" } else { "eval" };
        *doing.lock().unwrap_or_else(|e| e.into_inner()) = format!("in {mode} mode on a batch of {n} rows");
        let x = probe.x.narrow(0, 0, n);
        let out = if train {
            module.f_set_train().map_err(|e| crate::checked::torch_message(&e))?;
            module.forward_ts(&[&x])
        } else {
            module.f_set_eval().map_err(|e| crate::checked::torch_message(&e))?;
            tch::no_grad(|| module.forward_ts(&[&x]))
        };
        let on = format!("on a batch of {n} rows of the data (shape {:?}) in {mode} mode", x.size());
        let out = out.map_err(|e| format!("{p} fails {on}: {}", crate::checked::torch_message(&e)))?;
        check_output(&out, n, probe.outputs).map_err(|e| format!("{p}, {on}, {e}"))?;
        if train {
            check_backward(&mut module, &out).map_err(|e| format!("{p}, {on}: {e}"))?;
        }
    }
    Ok(arch)
}

/// The output of a batch of `rows`: floats, finite, `[rows, outputs]`.
fn check_output(out: &Tensor, rows: i64, outputs: usize) -> Result<(), String> {
    if out.size() != [rows, outputs as i64] {
        return Err(format!(
            "returns shape {:?} where the task needs [{rows}, {outputs}] (one row of {outputs} per sample)",
            out.size()
        ));
    }
    if !out.is_floating_point() {
        return Err(format!("returns {:?} values, not floats", out.kind()));
    }
    let bad = tch::no_grad(|| out.isfinite().logical_not().sum(Kind::Int64).int64_value(&[]));
    if bad > 0 {
        return Err(format!("returns {bad} NaN or infinite values"));
    }
    Ok(())
}

/// The gradient of the output's sum reaches the trainable parameters, and is finite.
fn check_backward(module: &mut CModule, out: &Tensor) -> Result<(), String> {
    if !out.requires_grad() {
        return Err("its output has no gradient (detached, or computed without its parameters)".into());
    }
    let params: Vec<(String, Tensor)> = module.named_parameters().map_err(|e| crate::checked::torch_message(&e))?;
    out.sum(Kind::Float)
        .f_backward()
        .map_err(|e| format!("the backward pass fails: {}", crate::checked::torch_message(&e)))?;
    let trainable: Vec<&(String, Tensor)> = params.iter().filter(|(_, t)| t.requires_grad()).collect();
    let with_grad = trainable.iter().filter(|(_, t)| t.grad().defined()).count();
    if with_grad == 0 {
        return Err("no trainable parameter gets a gradient from its output".into());
    }
    for (name, t) in trainable.iter().filter(|(_, t)| t.grad().defined()) {
        let grad = t.grad();
        if tch::no_grad(|| grad.isfinite().all().int64_value(&[])) == 0 {
            return Err(format!("the gradient of `{name}` holds NaN or infinite values"));
        }
    }
    Ok(())
}

impl TorchScriptArch {
    fn with_outputs(self, outputs: usize) -> TorchScriptArch {
        TorchScriptArch { outputs, ..self }
    }

    /// The module at `path` (already checked by the plan); one with no parameters if it cannot
    /// be read now.
    pub fn new(path: &Path, outputs: usize) -> TorchScriptArch {
        describe(path, outputs).unwrap_or(TorchScriptArch {
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
            crate::checked::fail(format!(
                "cannot load {} (it was read when the plan was made): {e}",
                self.path.display()
            ))
        };
        let mut module = Script::load(&self.path, p.device()).unwrap_or_else(|e| fail(e));
        for (name, t) in distinct(module.parameters().unwrap_or_else(|e| fail(e))) {
            let trainable = t.requires_grad();
            add_var(p, &name, t, trainable);
        }
        for (name, t) in module.buffers().unwrap_or_else(|e| fail(e)) {
            add_var(p, &name, t, false);
        }
        module.set_train(true).unwrap_or_else(|e| fail(e));
        Box::new(Scripted { module: Mutex::new((module, true)), path: self.path.clone() })
    }
}

/// The loaded module and whether it is in training mode (switched only when `train` changes).
struct Scripted {
    module: Mutex<(Script, bool)>,
    path: PathBuf,
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
            module
                .set_train(train)
                .unwrap_or_else(|e| crate::checked::fail(format!("the TorchScript module failed: {e}")));
            *training = train;
        }
        module.forward(x).unwrap_or_else(|e| {
            crate::checked::fail(format!(
                "the TorchScript module {} failed on a batch of shape {:?} in {} mode: {}",
                self.path.display(),
                x.size(),
                if train { "training" } else { "eval" },
                crate::checked::torch_message(&e)
            ))
        })
    }
}

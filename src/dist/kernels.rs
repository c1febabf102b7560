//! libtorch operations that tch does not expose, called through the bridge.
use std::ffi::c_void;

use tch::{Device, Kind, Tensor};

use super::error::Result;
use super::{check, ffi};

fn ptrs(ts: &[Tensor]) -> Vec<*mut c_void> {
    ts.iter().map(|t| t.as_ptr() as *mut c_void).collect()
}

/// Drops the tensors' gradients (torch's `zero_grad(set_to_none=True)`): the next backward pass
/// writes fresh ones, where zeroed gradients would cost a pass to zero and one to add.
pub fn clear_grads(params: &[Tensor]) -> Result<()> {
    let p = ptrs(params);
    // SAFETY: every pointer is a live tensor for the duration of the call.
    check("clear_grads", unsafe { ffi::rn_clear_grads(p.as_ptr(), p.len()) })
}

/// Adam's hyper-parameters for [`adam`].
#[derive(Debug, Clone, Copy)]
pub struct AdamConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// AdamW: weight decay applied to the parameters, not added to the gradients.
    pub decoupled: bool,
    /// One fused kernel (`fused=True`), or torch's multi-tensor `_foreach_` passes (`foreach=True`).
    pub fused: bool,
}

/// One Adam step (`step` counts it, from 1) over every parameter that has a gradient. Fused
/// (`c.fused`): in a single kernel (libtorch's `_fused_adam_`, what `torch.optim.Adam(fused=True)`
/// runs), torch's Adam formula in one pass over memory; else in torch's multi-tensor `_foreach_`
/// operations (`foreach=True`), one pass over every parameter per elementwise operation. `m` and
/// `v` hold each parameter's first and second moments, in the parameter's shape: the same state
/// for both, so a checkpoint of one resumes with the other.
pub fn adam(params: &[Tensor], m: &[Tensor], v: &[Tensor], step: i64, c: AdamConfig) -> Result<()> {
    assert!(m.len() == params.len() && v.len() == params.len(), "two moments per parameter");
    let (p, m, v) = (ptrs(params), ptrs(m), ptrs(v));
    // SAFETY: every pointer is a live tensor for the duration of the call; lengths match.
    let err = unsafe {
        ffi::rn_adam(
            p.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            p.len(),
            step as f64,
            c.lr,
            c.beta1,
            c.beta2,
            c.weight_decay,
            c.eps,
            c.decoupled as i32,
            c.fused as i32,
        )
    };
    check(if c.fused { "fused adam" } else { "foreach adam" }, err)
}

/// SGD's hyper-parameters for [`sgd`].
#[derive(Debug, Clone, Copy)]
pub struct SgdConfig {
    pub lr: f64,
    /// 0: no momentum (`bufs` is then unused and may be empty).
    pub momentum: f64,
    pub weight_decay: f64,
}

/// One step of torch's SGD over every parameter that has a gradient, rounding as torch does:
/// `p.add_(d, alpha=-lr)` is one rounding where tch's `p - d * lr` would be two, and over a run
/// those differences grow until the losses drift from PyTorch's. `first` (the first step) copies
/// the gradients into the momentum buffers `bufs`.
pub fn sgd(params: &[Tensor], bufs: &[Tensor], first: bool, c: SgdConfig) -> Result<()> {
    assert!(c.momentum == 0.0 || bufs.len() == params.len(), "one momentum buffer per parameter");
    let (p, b) = (ptrs(params), ptrs(bufs));
    let b = if c.momentum == 0.0 { vec![std::ptr::null_mut(); p.len()] } else { b };
    // SAFETY: every pointer is a live tensor for the duration of the call (the buffers are only
    // read when momentum ≠ 0, and then there is one per parameter); lengths match.
    let err = unsafe { ffi::rn_sgd(p.as_ptr(), b.as_ptr(), p.len(), first as i32, c.lr, c.momentum, c.weight_decay) };
    check("sgd", err)
}

/// Makes `tch::autocast` regions on `device`'s type compute in `kind` (`Half` or `BFloat16`), as
/// `torch.autocast(device_type, dtype=kind)`: tch's autocast alone uses libtorch's default,
/// float16 on CUDA.
pub fn set_autocast_dtype(device: Device, kind: Kind) -> Result<()> {
    let device_type = match device {
        Device::Cpu => 0,
        Device::Cuda(_) => 1,
        other => return Err(super::Error::new("set_autocast_dtype", format!("no autocast on {other:?}"))),
    };
    let scalar_type = match kind {
        Kind::Half => 5,
        Kind::BFloat16 => 15,
        other => return Err(super::Error::new("set_autocast_dtype", format!("{other:?} is not a reduced precision"))),
    };
    // SAFETY: plain integers; the bridge catches what libtorch throws.
    check("set_autocast_dtype", unsafe { ffi::rn_set_autocast_dtype(device_type, scalar_type) })
}

/// Autocast to bfloat16 while it lives, on this thread, on CPU and on CUDA alike
/// (`torch.autocast(device, dtype=torch.bfloat16)` where the tensors are): matrix products and
/// convolutions run in bfloat16, the weights stay float32.
pub struct AutocastBf16(());

impl AutocastBf16 {
    pub fn enter() -> Result<AutocastBf16> {
        // SAFETY: no pointers; thread-local state only.
        check("autocast", unsafe { ffi::rn_autocast_bf16(1) })?;
        Ok(AutocastBf16(()))
    }
}

impl Drop for AutocastBf16 {
    fn drop(&mut self) {
        // SAFETY: as in `enter`; leaving a region cannot fail short of a libtorch bug.
        let err = unsafe { ffi::rn_autocast_bf16(0) };
        let _ = check("autocast", err);
    }
}

/// The CPU kernels a process computes with: ATen's CPU capability ("DEFAULT", "AVX2", "AVX512")
/// and whether the oneDNN and NNPACK paths are on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuKernels {
    pub capability: String,
    pub onednn: bool,
    pub nnpack: bool,
}

/// The CPU kernels of this process; `pin` first turns oneDNN and NNPACK off, so that
/// convolutions and GELU run ATen's own kernels (of the capability `ATEN_CPU_CAPABILITY` fixes)
/// and MKL's. Call it before anything computes: ATen reads `ATEN_CPU_CAPABILITY` once, at its
/// first kernel, and this call makes that happen.
pub fn cpu_kernels(pin: bool) -> Result<CpuKernels> {
    let mut capability: *mut std::ffi::c_char = std::ptr::null_mut();
    let (mut onednn, mut nnpack) = (0, 0);
    // SAFETY: out-pointers to locals; the bridge catches what libtorch throws.
    check("cpu_kernels", unsafe { ffi::rn_cpu_kernels(pin as i32, &mut capability, &mut onednn, &mut nnpack) })?;
    // SAFETY: on success the bridge set a NUL-terminated string from its malloc, freed once after the copy.
    let text = unsafe { std::ffi::CStr::from_ptr(capability) }.to_string_lossy().into_owned();
    // SAFETY: as above.
    unsafe { ffi::rn_free_string(capability) };
    Ok(CpuKernels { capability: text, onednn: onednn != 0, nnpack: nnpack != 0 })
}

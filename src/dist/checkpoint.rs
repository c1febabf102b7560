//! Activation checkpointing (`wrap.activation_checkpointing`): a segment of the model (a
//! transformer block, an MLP layer) whose forward keeps nothing for the backward pass but its
//! input, and which is run again in the backward pass to differentiate it.
//!
//! Built as an autograd node in the bridge (csrc/checkpoint.cpp), torch.utils.checkpoint's
//! reentrant variant, rather than as the runner's own recomputation around the backward pass:
//! a node is only a part of the graph, so DDP's reducer hooks, FSDP's gathers before a layer's
//! backward and the pipeline's partial backward passes see the gradients arrive at each parameter
//! as they would without it, and no strategy changes. libtorch's C++ has no
//! `torch.utils.checkpoint`, and tch no custom autograd functions.
//!
//! The recomputation is exact: the node saves the default generators' states (the CPU's, and the
//! input's device's) and autocast's flags at the forward, restores them for the recomputation
//! (so dropout draws the same masks and bf16 casts the same values) and then restores the states
//! it found, so the rest of the run draws exactly as without checkpointing. Losses and gradients
//! are bit-identical to a run without it.
use std::ffi::{c_char, c_void, CString};
use std::time::Duration;

use tch::Tensor;

use super::{check, ffi, Result};

/// The body of a segment, which the backward pass calls again (on the autograd engine's thread
/// for CUDA tensors, while the rank's own waits: never from two threads at once).
type Body = Box<dyn Fn(&Tensor) -> Tensor + Send>;

/// `segment(input)`, computed now without recording its graph, as a tensor autograd
/// differentiates by running `segment` again in the backward pass (with the forward's random
/// state and autocast flags) with respect to `input` and `params` (every parameter `segment`
/// reads that needs a gradient: a parameter left out gets none from this segment). The closure
/// lives until no backward pass can need it, hence `'static`: it owns (shallow clones of) what it
/// reads.
pub fn checkpoint<F>(input: &Tensor, params: &[Tensor], segment: F) -> Result<Tensor>
where
    F: Fn(&Tensor) -> Tensor + Send + 'static,
{
    let closure = leaked(segment);
    let ptrs = handles(params.iter());
    let mut out = std::ptr::null_mut();
    // SAFETY: `input` and every parameter are live tensors for the call; `closure` is a leaked
    // Box<Body> that the bridge owns from now on and frees exactly once through `drop_body`;
    // `call_body` and `drop_body` match the signatures bridge.h declares.
    let err = unsafe {
        ffi::rn_checkpoint(
            input.as_ptr() as *mut c_void,
            ptrs.as_ptr(),
            ptrs.len(),
            call_body,
            drop_body,
            closure,
            &mut out,
        )
    };
    check("checkpoint", err)?;
    Ok(adopted(out))
}

/// Selective checkpointing's unit: `segment(source).linear(weight, bias)`, computed now, keeping
/// `source` but not the segment's output (the product's input, which `segment` recomputes in
/// the backward pass: a norm, an activation, a copy), nor running the product again: its
/// gradients are computed as at::linear's backward computes them, so they are the same bits.
/// `params`: the parameters `segment` reads. The segment's output must be a contiguous
/// [B, T, features]; under autocast the product runs in its dtype, as a plain linear would.
pub fn checkpoint_linear<F>(
    source: &Tensor,
    params: &[Tensor],
    weight: &Tensor,
    bias: Option<&Tensor>,
    segment: F,
) -> Result<Tensor>
where
    F: Fn(&Tensor) -> Tensor + Send + 'static,
{
    let closure = leaked(segment);
    let ptrs = handles(params.iter().chain(std::iter::once(weight)).chain(bias));
    let mut out = std::ptr::null_mut();
    // SAFETY: as in `checkpoint`: live tensors for the call, a leaked Box<Body> the bridge frees
    // once through `drop_body`, and the callbacks bridge.h declares.
    let err = unsafe {
        ffi::rn_checkpoint_linear(
            source.as_ptr() as *mut c_void,
            ptrs.as_ptr(),
            ptrs.len(),
            params.len(),
            call_body,
            drop_body,
            closure,
            &mut out,
        )
    };
    check("checkpoint", err)?;
    Ok(adopted(out))
}

/// The segment boxed for the bridge, which owns it from now on and frees it once (`drop_body`).
fn leaked<F>(segment: F) -> *mut c_void
where
    F: Fn(&Tensor) -> Tensor + Send + 'static,
{
    let body: Box<Body> = Box::new(Box::new(segment));
    Box::into_raw(body) as *mut c_void
}

/// The tensors' at::Tensor handles, as the bridge takes them.
fn handles<'a>(tensors: impl Iterator<Item = &'a Tensor>) -> Vec<*mut c_void> {
    tensors.map(|t| t.as_ptr() as *mut c_void).collect()
}

/// The tensor the bridge returned (allocated with `new at::Tensor`, what tch's handles are).
fn adopted(out: *mut c_void) -> Tensor {
    // SAFETY: called only on a successful bridge call, whose out-slot holds such a tensor.
    unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) }
}

/// Time this process has spent recomputing checkpointed segments in backward passes since it
/// started (host time: on CUDA, what launching the kernels took).
pub fn recompute_time() -> Duration {
    // SAFETY: reads an atomic counter.
    Duration::from_nanos(unsafe { ffi::rn_checkpoint_recompute_ns() }.max(0) as u64)
}

/// Runs the body on the bridge's input; a panic becomes the message the bridge raises.
unsafe extern "C" fn call_body(closure: *mut c_void, input: *mut c_void, output: *mut *mut c_void) -> *mut c_char {
    // SAFETY: the bridge passes the closure `checkpoint` leaked (live until `drop_body`) and a new
    // at::Tensor* whose ownership it gives to us.
    let (body, input) = unsafe { (&*(closure as *const Body), Tensor::from_ptr(input as *mut torch_sys::C_tensor)) };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&input))) {
        Ok(out) => {
            // The bridge takes over the at::Tensor the handle points at (and deletes it).
            let mut out = std::mem::ManuallyDrop::new(out);
            // SAFETY: `output` is the bridge's out-slot, valid for this call.
            unsafe { *output = out.as_mut_ptr() as *mut c_void };
            std::ptr::null_mut()
        }
        Err(panic) => {
            let text = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            let text = CString::new(text.replace('\0', " ")).expect("no NUL left");
            // SAFETY: strdup copies the string with malloc, which the bridge frees with free().
            unsafe { nix::libc::strdup(text.as_ptr()) }
        }
    }
}

unsafe extern "C" fn drop_body(closure: *mut c_void) {
    // SAFETY: the bridge calls this once, with the pointer `checkpoint` leaked from a Box<Body>.
    drop(unsafe { Box::from_raw(closure as *mut Body) });
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Without random draws, the same output and gradients to the bit as the plain segment.
    #[test]
    fn recomputation_gives_the_plain_gradients() {
        let run = |checkpointed: bool| {
            let w = Tensor::from_slice(&[0.3f32, -1.7, 2.1, 0.05, 1.1, -0.4]).view([3, 2]).set_requires_grad(true);
            let x = Tensor::from_slice(&[1.5f32, -0.25, 0.75, 2.0, -3.0, 0.1]).view([2, 3]).set_requires_grad(true);
            let wc = w.shallow_clone();
            let body = move |h: &Tensor| (h.matmul(&wc).gelu("none") * 3.0).log_softmax(-1, Kind::Float);
            let y = if checkpointed { checkpoint(&x, &[w.shallow_clone()], body).unwrap() } else { body(&x) };
            y.sum(Kind::Float).backward();
            (y, x.grad(), w.grad())
        };
        let (a, b) = (run(false), run(true));
        assert!(a.0.equal(&b.0) && a.1.equal(&b.1) && a.2.equal(&b.2));
        assert!(recompute_time() > Duration::ZERO);
    }

    /// The recomputation draws the forward's dropout mask, whatever was drawn in between: the
    /// gradient is the mask the forward applied, scaled.
    #[test]
    fn recomputation_replays_the_forwards_dropout_mask() {
        let x = Tensor::ones([4096], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let y = checkpoint(&x, &[], |h: &Tensor| h.dropout(0.5, true)).unwrap();
        let _between = Tensor::rand([100], (Kind::Float, Device::Cpu));
        y.sum(Kind::Float).backward();
        let kept = y.detach().ne(0.0).to_kind(Kind::Float) * 2.0;
        assert!(x.grad().equal(&kept));
        assert!(kept.sum(Kind::Float).double_value(&[]) > 0.0);
    }

    /// A recomputed product gives the plain linear's output and gradients to the bit, with and
    /// without a bias, for the segment's parameters too.
    #[test]
    fn a_recomputed_product_gives_the_plain_linears_gradients() {
        let opts = (Kind::Float, Device::Cpu);
        let values = [Tensor::randn([2, 5, 6], opts), Tensor::randn([6], opts), Tensor::randn([7, 6], opts)];
        let bias_values = Tensor::randn([7], opts);
        for bias in [false, true] {
            let run = |selective: bool| {
                let leaf = |t: &Tensor| t.copy().set_requires_grad(true);
                let (x, g, w) = (leaf(&values[0]), leaf(&values[1]), leaf(&values[2]));
                let b = bias.then(|| leaf(&bias_values));
                let gc = g.shallow_clone();
                let norm = move |h: &Tensor| h.layer_norm([6], Some(&gc), None::<&Tensor>, 1e-5, true).gelu("none");
                let y = if selective {
                    checkpoint_linear(&x, &[g.shallow_clone()], &w, b.as_ref(), norm).unwrap()
                } else {
                    norm(&x).linear(&w, b.as_ref())
                };
                (y.square().sum(Kind::Float) * 0.5).backward();
                (y.detach(), x.grad(), g.grad(), w.grad(), b.map(|b| b.grad()))
            };
            let (a, b) = (run(false), run(true));
            assert!(a.0.equal(&b.0) && a.1.equal(&b.1) && a.2.equal(&b.2) && a.3.equal(&b.3), "bias {bias}");
            if let (Some(p), Some(q)) = (&a.4, &b.4) {
                assert!(p.equal(q));
            }
        }
    }

    #[test]
    fn a_panicking_segment_fails_the_backward_pass_with_its_message() {
        let x = Tensor::ones([2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let first = std::sync::atomic::AtomicBool::new(true);
        let y = checkpoint(&x, &[], move |h: &Tensor| {
            if !first.swap(false, std::sync::atomic::Ordering::SeqCst) {
                panic!("no second time");
            }
            h * 2
        })
        .unwrap();
        let err = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
        assert!(err.contains("recomputing a checkpointed segment: no second time"), "{err}");
    }
}

//! `Script`: a TorchScript module with its buffers. tch's `CModule` lists a module's parameters
//! only; the runner needs batch norm's running statistics too (checkpoints, DDP's buffer
//! broadcast, `model.safetensors`), under PyTorch's own dotted names.
use std::ffi::{c_char, c_void, CStr, CString};
use std::path::Path;
use std::ptr::NonNull;

use tch::{Device, Tensor};

use super::error::{Error, Result};
use super::{check, ffi};

/// A loaded `torch.jit.save` archive. The tensors [`Script::parameters`] and [`Script::buffers`]
/// return share the module's storage: what the optimizer writes into them, the module computes
/// with, and what the module's forward pass updates (running statistics) they hold.
pub struct Script {
    raw: NonNull<ffi::RnScript>,
}

// SAFETY: the module is used by one thread at a time (`&mut self` for every call that runs it);
// libtorch's jit::Module holds no thread-affine state.
unsafe impl Send for Script {}

impl Script {
    /// Loads the module at `path` onto `device`.
    pub fn load(path: &Path, device: Device) -> Result<Script> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| Error::new("script.load", format!("{} holds a NUL byte", path.display())))?;
        let (ty, index) = match device {
            Device::Cpu => (0, -1),
            Device::Cuda(i) => (1, i as i32),
            other => return Err(Error::new("script.load", format!("cannot load a module onto {other:?}"))),
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: the path is NUL-terminated and read only for the call; on success `raw` is a
        // new module this Script owns.
        check("script.load", unsafe { ffi::rn_script_load(c_path.as_ptr(), ty, index, &mut raw) })?;
        NonNull::new(raw).map(|raw| Script { raw }).ok_or_else(|| Error::new("script.load", "no module"))
    }

    /// `named_parameters()`, in module order.
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        self.named(0)
    }

    /// `named_buffers()` (batch norm's `running_mean`, `running_var`, `num_batches_tracked`), in
    /// module order.
    pub fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        self.named(1)
    }

    fn named(&self, buffers: i32) -> Result<Vec<(String, Tensor)>> {
        let mut n = 0;
        // SAFETY: the module is live; `n` is written once.
        check("script.count", unsafe { ffi::rn_script_count(self.raw.as_ptr(), buffers, &mut n) })?;
        (0..n)
            .map(|i| {
                let (mut name, mut t): (*mut c_char, *mut c_void) = (std::ptr::null_mut(), std::ptr::null_mut());
                // SAFETY: `i` is in range; on success both outputs are new allocations we own.
                check("script.entry", unsafe {
                    ffi::rn_script_entry(self.raw.as_ptr(), buffers, i, &mut name, &mut t)
                })?;
                // SAFETY: a NUL-terminated string from the bridge's malloc, freed once after the copy.
                let text = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
                // SAFETY: as above.
                unsafe { ffi::rn_free_string(name) };
                // SAFETY: the bridge allocated `t` with `new at::Tensor`, what tch's handles are.
                Ok((text, unsafe { Tensor::from_ptr(t as *mut torch_sys::C_tensor) }))
            })
            .collect()
    }

    /// `module.train(training)`: batch norm and dropout behave as in training or evaluation.
    pub fn set_train(&mut self, training: bool) -> Result<()> {
        // SAFETY: the module is live.
        check("script.train", unsafe { ffi::rn_script_train(self.raw.as_ptr(), training as i32) })
    }

    /// `module.forward(x)`, which must return one tensor.
    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let mut out = std::ptr::null_mut();
        // SAFETY: `x` is live for the call; on success `out` is a new at::Tensor we own.
        check("script.forward", unsafe {
            ffi::rn_script_forward(self.raw.as_ptr(), x.as_ptr() as *mut c_void, &mut out)
        })?;
        // SAFETY: allocated with `new at::Tensor` by the bridge.
        Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        // SAFETY: freed once; the tensors handed out keep their own references.
        unsafe { ffi::rn_script_free(self.raw.as_ptr()) }
    }
}

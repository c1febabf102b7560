//! What libtorch sees of a CUDA device (torch.cuda.get_device_properties) and the peaks of its
//! caching allocator there (torch.cuda.max_memory_allocated): tch exposes neither. In a build
//! without the `cuda` feature both are errors.
use super::error::Result;
use super::{check, ffi};

/// A GPU as libtorch sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaDevice {
    pub name: String,
    /// Compute capability (9.0 for an H100 or H200).
    pub capability: (i32, i32),
    pub total_bytes: u64,
    pub multiprocessors: i32,
}

/// The properties of `cuda:index`.
pub fn cuda_device(index: usize) -> Result<CudaDevice> {
    let mut name: *mut std::ffi::c_char = std::ptr::null_mut();
    let (mut major, mut minor, mut total, mut processors) = (0, 0, 0i64, 0);
    // SAFETY: out-pointers to locals; the bridge catches what libtorch throws.
    check("cuda_device", unsafe {
        ffi::rn_cuda_device(index as i32, &mut name, &mut major, &mut minor, &mut total, &mut processors)
    })?;
    // SAFETY: on success the bridge set a NUL-terminated string from its malloc, freed once after the copy.
    let text = unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy().into_owned();
    // SAFETY: as above.
    unsafe { ffi::rn_free_string(name) };
    Ok(CudaDevice { name: text, capability: (major, minor), total_bytes: total as u64, multiprocessors: processors })
}

/// The caching allocator's peaks on one GPU, in bytes: what tensors held at most (`allocated`),
/// and what the allocator held from the driver at most (`reserved`, which `nvidia-smi` shows,
/// plus the CUDA context's own few hundred MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaPeak {
    pub allocated: u64,
    pub reserved: u64,
}

/// The peaks on `cuda:index` since the process started.
pub fn cuda_peak_memory(index: usize) -> Result<CudaPeak> {
    let (mut allocated, mut reserved) = (0i64, 0i64);
    // SAFETY: out-pointers to locals; the bridge catches what libtorch throws.
    check("cuda_peak_memory", unsafe { ffi::rn_cuda_peak_memory(index as i32, &mut allocated, &mut reserved) })?;
    Ok(CudaPeak { allocated: allocated.max(0) as u64, reserved: reserved.max(0) as u64 })
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    #[test]
    fn without_the_cuda_feature_both_say_what_is_missing() {
        let err = super::cuda_device(0).unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
        let err = super::cuda_peak_memory(0).unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
    }
}

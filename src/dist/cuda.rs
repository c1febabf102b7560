//! What libtorch sees of a CUDA device (torch.cuda.get_device_properties), the peaks of its
//! caching allocator there (torch.cuda.max_memory_allocated) and timing events on its stream
//! (torch.cuda.Event(enable_timing=True)), and CUDA graphs of a step: tch exposes none of them. In a build without the
//! `cuda` feature each is an error.
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

/// An event recorded on a GPU's current stream, with timing on: it passes when the device has
/// done the work queued before it.
#[derive(Debug)]
pub struct CudaEvent(*mut std::ffi::c_void);

// SAFETY: a CUDA event is a driver handle, usable from any thread; the bridge's object is owned
// here alone and freed once, in `drop`.
unsafe impl Send for CudaEvent {}
// SAFETY: `&self` methods only query the event or wait for it, which CUDA allows concurrently.
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    /// An event recorded now on `cuda:index`'s current stream.
    pub fn record(index: usize) -> Result<CudaEvent> {
        let mut event = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; the bridge catches what libtorch throws.
        check("cuda_event_record", unsafe { ffi::rn_cuda_event_record(index as i32, &mut event) })?;
        Ok(CudaEvent(event))
    }

    /// Whether the device has passed the event (no wait).
    pub fn done(&self) -> Result<bool> {
        let mut done = 0;
        // SAFETY: self.0 is a live event of the bridge's; an out-pointer to a local.
        check("cuda_event_done", unsafe { ffi::rn_cuda_event_done(self.0, &mut done) })?;
        Ok(done == 1)
    }

    /// The device's seconds from `self` to `to`, once `to` has passed (waiting for it).
    pub fn seconds_to(&self, to: &CudaEvent) -> Result<f64> {
        let mut ms = 0.0;
        // SAFETY: both are live events of the bridge's; an out-pointer to a local.
        check("cuda_event_elapsed", unsafe { ffi::rn_cuda_event_elapsed(self.0, to.0, &mut ms) })?;
        Ok(ms / 1e3)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        // SAFETY: recorded by the bridge, freed only here.
        unsafe { ffi::rn_cuda_event_free(self.0) }
    }
}

/// Makes a stream of libtorch's pool the current one of `cuda:index` on this thread: a CUDA graph
/// cannot be captured on the default stream, and the steps before the capture warm up the one
/// it replays on.
pub fn use_side_stream(index: usize) -> Result<()> {
    // SAFETY: plain values; the bridge catches what libtorch throws.
    check("cuda_side_stream", unsafe { ffi::rn_cuda_side_stream(index as i32) })
}

/// A CUDA graph (torch.cuda.CUDAGraph): from [`CudaGraph::begin`] to [`CudaGraph::end`], the
/// kernels launched on the current stream are recorded, not run; [`CudaGraph::replay`] runs them
/// again, on the same memory.
#[derive(Debug)]
pub struct CudaGraph(*mut ffi::RnGraph);

impl CudaGraph {
    pub fn begin() -> Result<CudaGraph> {
        let mut graph = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; the bridge catches what libtorch throws.
        check("cuda_graph_begin", unsafe { ffi::rn_cuda_graph_begin(&mut graph) })?;
        Ok(CudaGraph(graph))
    }

    /// Ends the capture (always), failing where it failed.
    pub fn end(&self) -> Result<()> {
        // SAFETY: self.0 is a live graph of the bridge's.
        check("cuda_graph_end", unsafe { ffi::rn_cuda_graph_end(self.0) })
    }

    pub fn replay(&self) -> Result<()> {
        // SAFETY: self.0 is a live graph of the bridge's.
        check("cuda_graph_replay", unsafe { ffi::rn_cuda_graph_replay(self.0) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: made by the bridge, freed only here.
        unsafe { ffi::rn_cuda_graph_free(self.0) }
    }
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    #[test]
    fn without_the_cuda_feature_each_says_what_is_missing() {
        let err = super::cuda_device(0).unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
        let err = super::cuda_peak_memory(0).unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
        let err = super::CudaEvent::record(0).unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
        let err = super::CudaGraph::begin().unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
        let err = super::use_side_stream(0).unwrap_err().to_string();
        assert!(err.contains("--features cuda"), "{err}");
    }
}

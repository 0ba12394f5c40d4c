//! GPU memory of one step (issue 15, item 7): the most memory the caching
//! allocator handed to tensors (`allocated`) and held from the device
//! (`reserved`) since the step began — PyTorch's
//! `torch.cuda.max_memory_allocated` / `max_memory_reserved` after a
//! `reset_peak_memory_stats` — reported per rank in `MetricSums` and on to
//! `metrics.jsonl`, `accrue watch` and Prometheus.
//!
//! Read from libtorch's allocator through the C++ shim `csrc/cuda_memory.cpp`
//! (built with the `cuda` feature, see `build.rs`). Without the shim but
//! with `cuda`, the driver's figure of the device's used memory stands in
//! for `reserved` (a worker owns its GPU, so that is the process's memory
//! plus the CUDA context), sampled at the step's end, and `allocated` is
//! unknown (0). CPU workers report nothing.

use tch::Device;

/// A step's peaks, in bytes (0: unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Peak {
    pub allocated: u64,
    pub reserved: u64,
}

#[cfg(accrue_cuda_memory)]
mod shim {
    extern "C" {
        pub fn accrue_cuda_memory_stats(device: i32, out: *mut i64) -> i32;
        pub fn accrue_cuda_reset_peak(device: i32) -> i32;
    }
}

/// Starts a new peak window on `device` (the start of a step).
pub fn reset_peak(device: Device) {
    #[cfg(accrue_cuda_memory)]
    if let Device::Cuda(n) = device {
        // SAFETY: plain C call; errors come back as a status.
        let _ = unsafe { shim::accrue_cuda_reset_peak(n as i32) };
    }
    let _ = device;
}

/// The peaks on `device` since the last [`reset_peak`]; `None` on the CPU
/// or when nothing can be read.
pub fn peak(device: Device) -> Option<Peak> {
    let Device::Cuda(n) = device else {
        return None;
    };
    #[cfg(accrue_cuda_memory)]
    {
        let mut out = [0i64; 4];
        // SAFETY: `out` holds the four values the shim writes.
        if unsafe { shim::accrue_cuda_memory_stats(n as i32, out.as_mut_ptr()) } == 0 {
            return Some(Peak {
                allocated: out[1].max(0) as u64,
                reserved: out[3].max(0) as u64,
            });
        }
    }
    driver_used(n).map(|reserved| Peak {
        allocated: 0,
        reserved,
    })
}

/// The device's used memory according to the CUDA driver.
#[cfg(feature = "cuda")]
fn driver_used(ordinal: usize) -> Option<u64> {
    // SAFETY: only tries to load libcuda; calling cudarc without it panics.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return None;
    }
    let ctx = cudarc::driver::CudaContext::new(ordinal).ok()?;
    let (free, total) = ctx.mem_get_info().ok()?;
    Some(total.saturating_sub(free) as u64)
}

#[cfg(not(feature = "cuda"))]
fn driver_used(_ordinal: usize) -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cpu_has_no_gpu_memory() {
        super::reset_peak(tch::Device::Cpu);
        assert_eq!(super::peak(tch::Device::Cpu), None);
    }
}

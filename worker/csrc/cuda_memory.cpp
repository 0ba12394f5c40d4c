// Peak CUDA memory of libtorch's caching allocator, for the worker's
// per-step GPU memory metrics (worker/src/gpu_memory.rs): what PyTorch
// reports as torch.cuda.max_memory_allocated / max_memory_reserved. tch
// binds no allocator statistics, so this reads them through c10's own
// header (the vtable of the allocator must be the library's, hence C++).
// Built by build.rs with the `cuda` feature when the CUDA headers exist.
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstdint>

extern "C" {

// out[0..4] = allocated current, allocated peak, reserved current,
// reserved peak (bytes, all memory pools). 0 on success, 1 on any error
// (no CUDA, no allocator yet, a device index out of range).
int accrue_cuda_memory_stats(int device, int64_t* out) {
  try {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(
        static_cast<c10::DeviceIndex>(device));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[all].current;
    out[1] = stats.allocated_bytes[all].peak;
    out[2] = stats.reserved_bytes[all].current;
    out[3] = stats.reserved_bytes[all].peak;
    return 0;
  } catch (...) {
    return 1;
  }
}

// Starts a new peak window (torch.cuda.reset_peak_memory_stats).
int accrue_cuda_reset_peak(int device) {
  try {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return 0;
  } catch (...) {
    return 1;
  }
}
}

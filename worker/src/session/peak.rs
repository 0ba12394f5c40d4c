//! The peak FLOP/s a worker reports at registration: the denominator of the
//! coordinator's MFU.
//!
//! - `--peak-tflops` wins when given.
//! - CUDA: the dense bf16 tensor-core peak of the worker's GPU, looked up
//!   by its name (`crate::device::describe`; vendor data sheets); 0
//!   (unknown, no MFU) for a GPU not in the table.
//! - CPU: measured, the best of a few fp32 `1024³` matmuls with libtorch's
//!   current thread count (about 0.1–0.5 s at startup). This is the peak the
//!   worker's own kernels reach, not the vendor's theoretical one, so CPU MFU
//!   reads "fraction of achievable matmul throughput".

use std::time::Instant;

use tch::{Device, Kind, Tensor};

use crate::device::DeviceInfo;

/// Dense bf16 peaks (FLOP/s) by a substring of the `nvidia-smi` name;
/// more specific names first.
const GPU_PEAKS: &[(&str, f64)] = &[
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
];

/// The peak for a GPU name, if known.
pub fn gpu_peak_flops(name: &str) -> Option<f64> {
    GPU_PEAKS
        .iter()
        .find(|(key, _)| name.contains(key))
        .map(|&(_, peak)| peak)
}

/// The peak FLOP/s to report for a worker on `device`: `override_tflops`
/// when given, else the GPU table or the CPU probe (see the module docs).
/// 0 = unknown.
pub fn peak_flops(override_tflops: Option<f64>, device: &DeviceInfo) -> f64 {
    if let Some(t) = override_tflops {
        return (t * 1e12).max(0.0);
    }
    if device.label != "cpu" {
        let peak = gpu_peak_flops(&device.gpu_name);
        if peak.is_none() {
            tracing::warn!(gpu = %device, "unknown GPU peak FLOP/s: pass --peak-tflops for MFU");
        }
        return peak.unwrap_or(0.0);
    }
    cpu_matmul_flops()
}

/// Best fp32 matmul FLOP/s of a few `1024³` products on the CPU.
pub fn cpu_matmul_flops() -> f64 {
    const N: i64 = 1024;
    tch::no_grad(|| {
        let a = Tensor::randn([N, N], (Kind::Float, Device::Cpu));
        let b = Tensor::randn([N, N], (Kind::Float, Device::Cpu));
        let out = Tensor::empty([N, N], (Kind::Float, Device::Cpu));
        let _ = a.mm_out(&out, &b); // warm-up
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let start = Instant::now();
            let _ = a.mm_out(&out, &b);
            best = best.min(start.elapsed().as_secs_f64());
        }
        2.0 * (N * N * N) as f64 / best.max(1e-9)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_table_prefers_the_specific_name() {
        assert_eq!(gpu_peak_flops("NVIDIA H100 PCIe"), Some(756e12));
        assert_eq!(gpu_peak_flops("NVIDIA H100 80GB HBM3"), Some(989e12));
        assert_eq!(gpu_peak_flops("NVIDIA L40S"), Some(362e12));
        assert_eq!(gpu_peak_flops("Voodoo 2"), None);
    }

    #[test]
    fn override_wins_and_cpu_probe_is_positive() {
        let cpu = DeviceInfo {
            label: "cpu".into(),
            ..Default::default()
        };
        assert_eq!(peak_flops(Some(2.5), &cpu), 2.5e12);
        let h100 = DeviceInfo {
            label: "cuda:3".into(),
            gpu_name: "NVIDIA H100 80GB HBM3".into(),
            gpu_memory_bytes: 80 << 30,
        };
        assert_eq!(peak_flops(None, &h100), 989e12);
        let cpu = cpu_matmul_flops();
        assert!(cpu.is_finite() && cpu > 1e8, "{cpu}");
    }
}

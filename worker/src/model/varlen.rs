//! Varlen flash attention on CUDA (issue 37 item 3): a packed row's
//! documents by their cumulative lengths in one kernel call, no padding,
//! through libtorch's `_flash_attention_forward` / `_backward` (the C++
//! shim `csrc/flash_varlen.cpp`, an autograd function whose backward is
//! the kernel's; its header lists the kernel's contract). The shim is
//! built with the `cuda` feature; [`refusal`] checks the contract before a
//! call, and a row the kernel cannot take runs on the bucketed path
//! (`super::attention::PackedAttention::Bucketed`), which stays the
//! default: the varlen path is opt-in (`ACCRUE_VARLEN_FLASH=1`) until
//! `scripts/gpu-check.sh` has run it on a GPU (it has not: no GPU was lent
//! to the sessions that built it).

use tch::{Kind, Tensor};

#[cfg(accrue_flash_varlen)]
mod shim {
    use std::ffi::{c_char, c_void};

    extern "C" {
        #[allow(clippy::too_many_arguments)]
        pub fn accrue_flash_varlen(
            q: *mut c_void,
            k: *mut c_void,
            v: *mut c_void,
            cu: *mut c_void,
            max_len: i64,
            scale: f64,
            out: *mut *mut c_void,
            err: *mut c_char,
            err_len: usize,
        ) -> i32;
    }
}

/// Whether this build has the kernel's shim (the `cuda` feature, with
/// libtorch's headers at build time).
pub fn built() -> bool {
    cfg!(accrue_flash_varlen)
}

/// Whether CUDA rows take the varlen kernel: built, and asked for with
/// `ACCRUE_VARLEN_FLASH=1` (read once).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| built() && std::env::var("ACCRUE_VARLEN_FLASH").is_ok_and(|v| v == "1"))
}

/// Why `q` (`[T, heads, d]`) over `k` and `v` (`[T, kv_heads, d]`) cannot
/// take the kernel (its contract, `csrc/flash_varlen.cpp`), if it cannot.
pub fn refusal(q: &Tensor, k: &Tensor, v: &Tensor) -> Option<String> {
    if !built() {
        return Some("this worker was built without the varlen flash shim (feature `cuda`)".into());
    }
    let device = q.device();
    if !device.is_cuda() || k.device() != device || v.device() != device {
        return Some(format!(
            "the kernel runs on one CUDA device, not {device:?}"
        ));
    }
    let kind = q.kind();
    if !matches!(kind, Kind::BFloat16 | Kind::Half) || k.kind() != kind || v.kind() != kind {
        return Some(format!(
            "the kernel takes bf16 or fp16, not {kind:?} (fp32 runs bucketed)"
        ));
    }
    let (qs, ks) = (q.size(), k.size());
    if qs.len() != 3 || ks.len() != 3 || v.size() != ks || qs[0] != ks[0] || qs[2] != ks[2] {
        return Some(format!(
            "shapes q {qs:?}, k {ks:?}, v {:?}: [T, heads, d] over [T, kv_heads, d]",
            v.size()
        ));
    }
    if ks[1] == 0 || qs[1] % ks[1] != 0 {
        return Some(format!("{} query heads over {} kv heads", qs[1], ks[1]));
    }
    if qs[2] > 256 {
        return Some(format!("head dimension {} above the kernel's 256", qs[2]));
    }
    if [q, k, v].iter().any(|t| t.stride().last() != Some(&1)) {
        return Some("the last dimension must be contiguous".into());
    }
    None
}

/// Causal attention within the documents of `cu_seq_lens` of `q`
/// (`[T, heads, d]`) over `k`, `v` (`[T, kv_heads, d]`, read in place for
/// grouped-query attention): `[T, heads, d]`, with autograd (the
/// backward is the kernel's). `scale`: the softmax's, else `1/√d`.
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seq_lens: &[i64],
    scale: Option<f64>,
) -> anyhow::Result<Tensor> {
    if let Some(why) = refusal(q, k, v) {
        anyhow::bail!("varlen flash attention: {why}");
    }
    let total = q.size()[0];
    anyhow::ensure!(
        cu_seq_lens.first() == Some(&0)
            && cu_seq_lens.last() == Some(&total)
            && cu_seq_lens.windows(2).all(|w| w[0] <= w[1]),
        "varlen flash attention: cumulative lengths {cu_seq_lens:?} do not cover {total} rows"
    );
    anyhow::ensure!(
        total <= i64::from(i32::MAX),
        "varlen flash attention: {total} rows overflow the kernel's int32 lengths"
    );
    let max_len = cu_seq_lens
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or(0);
    let cu: Vec<i32> = cu_seq_lens.iter().map(|&c| c as i32).collect();
    let cu = Tensor::from_slice(&cu).to_device(q.device());
    let scale = scale.unwrap_or(1.0 / (q.size()[2] as f64).sqrt());
    call(q, k, v, &cu, max_len, scale)
}

#[cfg(accrue_flash_varlen)]
fn call(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu: &Tensor,
    max_len: i64,
    scale: f64,
) -> anyhow::Result<Tensor> {
    let ptr = |t: &Tensor| t.as_ptr() as *mut std::ffi::c_void;
    let mut out: *mut std::ffi::c_void = std::ptr::null_mut();
    let mut err = [0 as std::ffi::c_char; 1024];
    // SAFETY: the pointers are live tch tensors (libtorch `at::Tensor`s)
    // borrowed for the call; on success the shim hands over a new tensor,
    // owned from here by the `Tensor` built on it.
    let rc = unsafe {
        shim::accrue_flash_varlen(
            ptr(q),
            ptr(k),
            ptr(v),
            ptr(cu),
            max_len,
            scale,
            &mut out,
            err.as_mut_ptr(),
            err.len(),
        )
    };
    if rc != 0 || out.is_null() {
        // SAFETY: the shim wrote a NUL-terminated message into `err`.
        let msg = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) };
        anyhow::bail!("varlen flash attention: {}", msg.to_string_lossy());
    }
    // SAFETY: `out` is a heap `at::Tensor` the shim allocated for us.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

#[cfg(not(accrue_flash_varlen))]
fn call(_: &Tensor, _: &Tensor, _: &Tensor, _: &Tensor, _: i64, _: f64) -> anyhow::Result<Tensor> {
    anyhow::bail!("varlen flash attention: not built (feature `cuda`)")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off CUDA, or in fp32, or with a shape the kernel does not take, the
    /// call is refused before the shim, naming why (the caller then runs
    /// the bucketed path); malformed lengths are refused too.
    #[test]
    fn rows_the_kernel_cannot_take_are_refused_by_name() {
        let q = Tensor::zeros([8, 4, 16], (Kind::BFloat16, tch::Device::Cpu));
        let kv = Tensor::zeros([8, 2, 16], (Kind::BFloat16, tch::Device::Cpu));
        let why = refusal(&q, &kv, &kv).unwrap();
        assert!(
            why.contains("CUDA") || why.contains("built without"),
            "{why}"
        );
        let e = attend(&q, &kv, &kv, &[0, 3, 8], None).unwrap_err();
        assert!(
            format!("{e}").starts_with("varlen flash attention: "),
            "{e}"
        );
        assert!(!enabled() || built(), "enabled only when built");
    }

    /// The shim's plumbing without a GPU: libtorch has no CPU kernel for
    /// the op, and its error comes back as an error (the C++ exception
    /// caught in the shim), not an abort.
    #[cfg(accrue_flash_varlen)]
    #[test]
    fn the_shim_returns_the_kernels_refusal_as_an_error() {
        let q = Tensor::zeros([8, 4, 16], (Kind::BFloat16, tch::Device::Cpu));
        let kv = Tensor::zeros([8, 2, 16], (Kind::BFloat16, tch::Device::Cpu));
        let cu = Tensor::from_slice(&[0i32, 3, 8]);
        let e = call(&q, &kv, &kv, &cu, 5, 0.25).unwrap_err();
        assert!(format!("{e}").contains("_flash_attention_forward"), "{e}");
    }
}

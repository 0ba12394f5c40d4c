//! The worker's hot loops over plain `f32` slices: the one-pass AdamW
//! update and the squared gradient norm. They live in a crate of their own
//! so that the dev build — what `scripts/setup.sh` and the README's first
//! command make — compiles them optimised (`[profile.dev.package]` in the
//! workspace `Cargo.toml`) while the rest of the workspace keeps fast
//! unoptimised builds: unoptimised, the AdamW pass over a 135M-parameter
//! model took 4.6× torch's foreach AdamW.
//!
//! [`adamw_f32`] reads and writes every element of the parameter, gradient
//! and both moments once (28 bytes of traffic per parameter). It computes
//! exactly the float32 operations of torch's single-tensor and foreach
//! AdamW, in their order (`mul_`, `lerp_`, `mul_`/`addcmul_`,
//! `sqrt`/`div_`/`add_`, `addcdiv_`), without fused multiply-adds, so it
//! matches `torch.optim.AdamW` to the last bit or one ulp (torch's
//! vectorised `lerp` fuses).

/// Below this many elements a run is updated on the calling thread.
pub const PARALLEL_MIN: usize = 1 << 16;

/// The per-thread chunk of `n` elements over at most `threads` threads,
/// each with at least [`PARALLEL_MIN`]; `None`: one thread does it all.
fn chunk_len(n: usize, threads: usize) -> Option<usize> {
    let threads = threads.max(1).min(n / PARALLEL_MIN).max(1);
    (threads > 1).then(|| n.div_ceil(threads))
}

/// The scalars of one step, shared by every buffer it updates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepScalars {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// `1 − lr·wd` for decaying elements.
    pub decay_factor: f64,
    /// `lr / (1 − β1ᵗ)`.
    pub step_size: f64,
    /// `√(1 − β2ᵗ)`.
    pub bias2_sqrt: f64,
    /// The gradient clip factor (1: none).
    pub grad_scale: f64,
}

/// One AdamW step of `p` from `g` with moments `m`, `v` (equally long),
/// over at most `threads` threads (see the crate docs).
pub fn adamw_f32(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &StepScalars,
    decay: bool,
    threads: usize,
) {
    let n = p.len();
    assert!(
        g.len() == n && m.len() == n && v.len() == n,
        "runs differ in length"
    );
    let Some(chunk) = chunk_len(n, threads) else {
        return adamw_chunk(p, g, m, v, s, decay);
    };
    std::thread::scope(|scope| {
        let parts = p
            .chunks_mut(chunk)
            .zip(g.chunks(chunk))
            .zip(m.chunks_mut(chunk))
            .zip(v.chunks_mut(chunk));
        for (((p, g), m), v) in parts {
            scope.spawn(move || adamw_chunk(p, g, m, v, s, decay));
        }
    });
}

fn adamw_chunk(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    s: &StepScalars,
    decay: bool,
) {
    // ATen casts every scalar to the float32 op math of float32 tensors.
    let scale = s.grad_scale as f32;
    let decay_factor = s.decay_factor as f32;
    let w = (1.0 - s.beta1) as f32;
    let one_minus_w = 1.0 - w;
    let beta2 = s.beta2 as f32;
    let one_minus_beta2 = (1.0 - s.beta2) as f32;
    let bias2_sqrt = s.bias2_sqrt as f32;
    let eps = s.eps as f32;
    let neg_step = (-s.step_size) as f32;
    let small = w.abs() < 0.5;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = g * scale;
        if decay {
            *p *= decay_factor;
        }
        // torch's `lerp`: from the nearer end.
        let diff = g - *m;
        *m = if small {
            *m + w * diff
        } else {
            g - diff * one_minus_w
        };
        *v = *v * beta2 + one_minus_beta2 * g * g;
        let denom = v.sqrt() / bias2_sqrt + eps;
        *p += neg_step * *m / denom;
    }
}

/// Σ x² in f64, over at most `threads` threads.
pub fn sum_sq_f32(x: &[f32], threads: usize) -> f64 {
    let part = |x: &[f32]| x.iter().map(|&a| f64::from(a) * f64::from(a)).sum::<f64>();
    let Some(chunk) = chunk_len(x.len(), threads) else {
        return part(x);
    };
    std::thread::scope(|scope| {
        let handles: Vec<_> = x
            .chunks(chunk)
            .map(|c| scope.spawn(move || part(c)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(f64::NAN))
            .sum()
    })
}

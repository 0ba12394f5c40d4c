//! The AdamW update and the squared gradient norm on one flat run.
//!
//! On contiguous f32 CPU tensors the one-pass kernel of `accrue-kernels`
//! (`adamw_f32`, optimised even in the dev build) runs over libtorch's
//! intra-op thread count. [`adamw_ops`] is the same update as a
//! sequence of ATen operations, for buffers the kernel does not take
//! (CUDA, a bfloat16 parameter).

use tch::{Device, Kind, Tensor};

pub use accrue_kernels::StepScalars;

/// libtorch's intra-op thread count, which the kernels split over.
fn threads() -> usize {
    tch::get_num_threads().max(1) as usize
}

fn is_cpu_f32(t: &Tensor) -> bool {
    t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous()
}

/// A mutable view of a contiguous f32 CPU tensor's storage (a raw
/// pointer in, not `&Tensor`: the tensor handle is shared, its storage is
/// what the caller vouches for).
///
/// # Safety
/// `t` must be a contiguous f32 CPU tensor whose storage nothing else
/// touches while the slice lives.
unsafe fn slice_mut<'a>(t: &Tensor) -> &'a mut [f32] {
    let n = t.numel();
    if n == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, n)
}

/// One AdamW step of the run `p` (parameter), `g` (gradient), `m`, `v`
/// (moments), all flat and equally long; `decay`: apply weight decay.
pub fn adamw(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, s: &StepScalars, decay: bool) {
    if [p, g, m, v].iter().all(|t| is_cpu_f32(t)) {
        // SAFETY: checked contiguous f32 CPU tensors; the trainers pass four
        // distinct buffers, and no other thread uses them during the call.
        let (ps, gs, ms, vs) = unsafe { (slice_mut(p), slice_mut(g), slice_mut(m), slice_mut(v)) };
        accrue_kernels::adamw_f32(ps, gs, ms, vs, s, decay, threads());
    } else {
        adamw_ops(p, g, m, v, s, decay);
    }
}

/// The same update as ATen operations (torch's foreach sequence), for
/// any device and a float32 or lower-precision parameter.
pub fn adamw_ops(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor, s: &StepScalars, decay: bool) {
    tch::no_grad(|| {
        let g = if s.grad_scale != 1.0 {
            g * s.grad_scale
        } else {
            g.shallow_clone()
        };
        let mut p32 = if p.kind() == Kind::Float {
            p.shallow_clone()
        } else {
            p.to_kind(Kind::Float)
        };
        if decay {
            let _ = p32.g_mul_scalar_(s.decay_factor);
        }
        let _ = m.shallow_clone().lerp_(&g, 1.0 - s.beta1);
        let mut v = v.shallow_clone();
        let _ = v.g_mul_scalar_(s.beta2);
        let _ = v.addcmul_(&(&g * (1.0 - s.beta2)), &g);
        let mut denom = v.sqrt();
        let _ = denom.g_div_scalar_(s.bias2_sqrt);
        let _ = denom.g_add_scalar_(s.eps);
        let _ = p32.addcdiv_(&(m * -s.step_size), &denom);
        if p.kind() != Kind::Float {
            p.shallow_clone().copy_(&p32);
        }
    });
}

/// Σ g² in f64 over a flat gradient run.
pub fn sum_sq(g: &Tensor) -> f64 {
    if is_cpu_f32(g) {
        // SAFETY: checked contiguous f32 CPU tensor; only read here.
        let s: &[f32] = unsafe { slice_mut(g) };
        return accrue_kernels::sum_sq_f32(s, threads());
    }
    // Accumulated in f64 by the reduction itself, no f64 copy of `g`.
    let norm = g.norm_scalaropt_dtype(2.0, Kind::Double);
    f64::try_from(norm.square()).unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scalars(step: i32, lr: f64, grad_scale: f64) -> StepScalars {
        let (b1, b2, wd) = (0.9, 0.95, 0.1);
        StepScalars {
            lr,
            beta1: b1,
            beta2: b2,
            eps: 1e-8,
            decay_factor: 1.0 - lr * wd,
            step_size: lr / (1.0 - f64::powi(b1, step)),
            bias2_sqrt: (1.0 - f64::powi(b2, step)).sqrt(),
            grad_scale,
        }
    }

    fn rand(n: i64, seed: f64) -> Tensor {
        let i = Tensor::arange(n, (Kind::Double, Device::Cpu));
        ((&i * seed).sin() * 0.3).to_kind(Kind::Float)
    }

    /// The kernel and the ATen sequence agree to within an ulp or two
    /// over several steps, with and without decay and clipping, across
    /// the thread split.
    #[test]
    fn the_one_pass_kernel_matches_the_aten_sequence() {
        let n = 200_003;
        for (decay, scale) in [(true, 1.0), (false, 0.37)] {
            let (p1, m1, v1) = (
                rand(n, 0.1),
                Tensor::zeros([n], (Kind::Float, Device::Cpu)),
                Tensor::zeros([n], (Kind::Float, Device::Cpu)),
            );
            let (p2, m2, v2) = (p1.copy(), m1.copy(), v1.copy());
            for step in 1..=4 {
                let g = rand(n, 0.7 + step as f64);
                let s = scalars(step, 1e-3, scale);
                adamw(&p1, &g, &m1, &v1, &s, decay);
                adamw_ops(&p2, &g, &m2, &v2, &s, decay);
            }
            for (a, b) in [(&p1, &p2), (&m1, &m2), (&v1, &v2)] {
                let d = f64::try_from((a - b).abs().max()).unwrap();
                let mag = f64::try_from(b.abs().max()).unwrap();
                assert!(d <= 4.0 * f64::from(f32::EPSILON) * mag, "{d} vs {mag}");
            }
        }
    }

    #[test]
    fn sum_of_squares_in_f64_matches_aten() {
        let g = rand(300_001, 0.3);
        let ours = sum_sq(&g);
        let theirs = f64::try_from(g.to_kind(Kind::Double).square().sum(Kind::Double)).unwrap();
        assert!(
            (ours - theirs).abs() <= 1e-12 * theirs,
            "{ours} vs {theirs}"
        );
    }
}

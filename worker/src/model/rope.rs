//! Rotary position embeddings (HF `LlamaRotaryEmbedding` + `rotate_half`),
//! with the `linear` and `llama3` frequency scalings. Positions restart at 0
//! for every packed document, so the cos/sin table is indexed by per-token
//! positions rather than by the flat row index.
//!
//! Frequencies are computed in f64 and rounded once to f32 (HF computes them
//! in f32); the difference is below the parity tolerance.

use tch::{Kind, Tensor};

use super::config::RopeScaling;

/// Inverse frequencies for one head dimension.
#[derive(Debug)]
pub struct Rope {
    inv_freq: Vec<f64>,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Rope {
        let base: Vec<f64> = (0..head_dim / 2)
            .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        let inv_freq = match *scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        Rope { inv_freq }
    }

    /// `(cos, sin)` of shape `[T, head_dim]` for the given per-token positions.
    pub fn cos_sin(&self, positions: &[i64], kind: Kind, device: tch::Device) -> (Tensor, Tensor) {
        let half = self.inv_freq.len();
        let mut angles = Vec::with_capacity(positions.len() * half * 2);
        for &p in positions {
            for _ in 0..2 {
                angles.extend(self.inv_freq.iter().map(|f| p as f64 * f));
            }
        }
        let a = Tensor::from_slice(&angles).view([positions.len() as i64, 2 * half as i64]);
        let cos = a.cos().to_kind(Kind::Float).to_kind(kind).to_device(device);
        let sin = a.sin().to_kind(Kind::Float).to_kind(kind).to_device(device);
        (cos, sin)
    }
}

/// Applies RoPE to `x: [heads, T, head_dim]` with `cos, sin: [T, head_dim]`.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[2] / 2;
    let x1 = x.narrow(2, 0, half);
    let x2 = x.narrow(2, half, half);
    let rotated = Tensor::cat(&[x2.neg(), x1], 2);
    x * cos + rotated * sin
}

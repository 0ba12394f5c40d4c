//! Seeded random init of a model's parameters, as HF `_init_weights` does
//! it: normal(0, `initializer_range`) for every linear and embedding weight,
//! zero biases, ones for norms, the embedding's padding row zeroed.
//!
//! The draws come from a private generator per parameter (ChaCha8 seeded
//! by the job's seed, one stream per parameter name), never from
//! libtorch's process-global generator. A global generator is shared by
//! every thread of the process: another trainer built, loaded or sampled
//! at the same time would consume draws in between and make this init an
//! independent random draw (the state_sync flake, issue 13). Per-name
//! streams also make the init independent of the order parameters are
//! created in.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};
use tch::{Kind, Tensor};

/// How a freshly built model's parameters are set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// Weights zero, norms one: a structure about to receive loaded
    /// tensors. Draws nothing.
    Empty,
    /// HF's random init from this seed.
    Seeded(u64),
}

/// The stream id of a parameter: FNV-1a of its name (stable across
/// builds, platforms and Rust versions, unlike `DefaultHasher`).
pub(crate) fn stream_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// `numel` draws of normal(0, `std`) for parameter `name` under `seed`.
pub fn normal_values(seed: u64, name: &str, numel: usize, std: f64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream_of(name));
    (0..numel)
        .map(|_| {
            let z: f64 = StandardNormal.sample(&mut rng);
            (z * std) as f32
        })
        .collect()
}

/// Fills every 2-D weight of `vars` with normal(0, `std`) drawn for its
/// name from `seed`; other parameters (biases, norms) keep their constant
/// init. `vars` must be float32 (the init is drawn before any cast).
pub fn fill_weights(vars: &[(String, Tensor)], seed: u64, std: f64) {
    for (name, t) in vars {
        if t.dim() != 2 || !name.ends_with(".weight") {
            continue;
        }
        debug_assert_eq!(t.kind(), Kind::Float, "{name}");
        let values = normal_values(seed, name, t.numel(), std);
        let src = Tensor::from_slice(&values)
            .view(t.size().as_slice())
            .to_device(t.device());
        tch::no_grad(|| t.shallow_clone().copy_(&src));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_depend_on_seed_and_name_only() {
        let a = normal_values(7, "model.layers.0.mlp.up_proj.weight", 1000, 0.02);
        assert_eq!(
            a,
            normal_values(7, "model.layers.0.mlp.up_proj.weight", 1000, 0.02)
        );
        assert_ne!(
            a,
            normal_values(8, "model.layers.0.mlp.up_proj.weight", 1000, 0.02)
        );
        assert_ne!(
            a,
            normal_values(7, "model.layers.1.mlp.up_proj.weight", 1000, 0.02)
        );
        // A prefix of a longer draw: the stream does not depend on numel.
        assert_eq!(
            &normal_values(7, "model.layers.0.mlp.up_proj.weight", 2000, 0.02)[..1000],
            &a[..]
        );
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = a
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.003, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 0.002, "std {}", var.sqrt());
    }
}

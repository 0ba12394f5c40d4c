//! A LoRA adapter's arithmetic, apart from the model it sits in (so the
//! linear layers can hold one without importing the model): the adapter
//! itself (`x Wᵀ + s · (x Aᵀ) Bᵀ`, in the adapter's dtype as PEFT), the
//! switch that turns a model's adapters off (its reference is the base),
//! and the training-time dropout whose masks do not depend on how
//! documents are split into microbatches. Attaching adapters to a model,
//! their PEFT folder and initialisation: [`super::lora`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Kind, Tensor};

use crate::config::LoraConfig;

/// Turns every adapter of one model on or off.
#[derive(Debug, Clone)]
pub struct Switch(Arc<AtomicBool>);

impl Default for Switch {
    fn default() -> Switch {
        Switch::new()
    }
}

impl Switch {
    pub fn new() -> Switch {
        Switch(Arc::new(AtomicBool::new(true)))
    }

    pub(super) fn on(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Turns the adapters on or off.
    pub fn set(&self, on: bool) {
        self.0.store(on, Ordering::Relaxed);
    }
}

/// One linear's adapter.
#[derive(Debug)]
pub struct Adapter {
    /// `[r, in]`.
    pub a: Tensor,
    /// `[out, r]`.
    pub b: Tensor,
    pub(super) scale: f64,
    pub(super) switch: Switch,
    /// `lora.dropout`, applied to the input in training forwards only
    /// (inside a [`with_dropout`] scope).
    pub(super) dropout: f64,
    /// The module's HF path: its dropout masks' stream.
    pub(super) module: String,
}

impl Adapter {
    pub(super) fn enabled(&self) -> bool {
        self.switch.on()
    }

    /// `y + s · (x Aᵀ) Bᵀ`, computed in the adapter's dtype and returned
    /// in `y`'s.
    pub(super) fn add_to(&self, y: Tensor, x: &Tensor) -> Tensor {
        let out = y.kind();
        let x = x.to_kind(self.a.kind());
        let x = match dropout_mask(&self.module, self.dropout, &x) {
            Some(mask) => x * mask,
            None => x,
        };
        let d = x.matmul(&self.a.tr()).matmul(&self.b.tr()) * self.scale;
        (y + d).to_kind(out)
    }

    /// `s · B A`, the adapter's change of the weight `[out, in]` (float32).
    pub fn delta(&self) -> Tensor {
        self.b
            .to_kind(Kind::Float)
            .matmul(&self.a.to_kind(Kind::Float))
            * self.scale
    }
}

/// What [`super::lora::attach`] put on a model.
#[derive(Debug, Clone)]
pub struct Adapters {
    pub config: LoraConfig,
    pub(super) switch: Switch,
    /// The adapted modules' HF paths (`model.layers.0.self_attn.q_proj`).
    pub modules: Vec<String>,
}

/// The keys of one training forward's dropout masks: what makes them the
/// same whatever microbatch and rank a document lands in, and in the
/// recomputed forward of its backward. A document's mask in a module is
/// drawn from `(seed, step, the module's path, the document's tokens)`,
/// row by row along the document, so it does not depend on the other
/// documents packed beside it. Two identical documents of one step share
/// their masks.
#[derive(Debug, Clone)]
pub struct DropoutKeys {
    pub seed: u64,
    /// The optimizer step being computed (the same on every rank, and
    /// after a restore).
    pub step: u64,
    /// Per document: its rows in the packed microbatch and its key.
    docs: Vec<(usize, usize, u64)>,
}

impl DropoutKeys {
    /// The keys of a packed microbatch (`input_ids`, `cu_seq_lens`).
    pub fn new(seed: u64, step: u64, input_ids: &[i64], cu_seq_lens: &[i64]) -> DropoutKeys {
        let docs = cu_seq_lens
            .windows(2)
            .map(|w| {
                let (s, e) = (w[0] as usize, w[1] as usize);
                let key = input_ids[s..e]
                    .iter()
                    .fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
                        (h ^ t as u64).wrapping_mul(0x0000_0100_0000_01b3)
                    });
                (s, e, key ^ ((e - s) as u64).rotate_left(32))
            })
            .collect();
        DropoutKeys { seed, step, docs }
    }
}

thread_local! {
    /// The training forward this thread is in (see [`with_dropout`]).
    static DROPOUT: std::cell::RefCell<Option<DropoutKeys>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` (a training forward and its backward) with LoRA dropout on,
/// its masks keyed by `keys`; outside such a scope (reference, eval,
/// generation) adapters see their whole input, as in PEFT's eval mode.
pub fn with_dropout<R>(keys: Option<DropoutKeys>, f: impl FnOnce() -> R) -> R {
    struct Reset(Option<DropoutKeys>);
    impl Drop for Reset {
        fn drop(&mut self) {
            let old = self.0.take();
            DROPOUT.with(|d| *d.borrow_mut() = old);
        }
    }
    let old = DROPOUT.with(|d| std::mem::replace(&mut *d.borrow_mut(), keys));
    let _reset = Reset(old);
    f()
}

/// The inverted-dropout mask (`0` or `1/(1−p)`) of input `x: [T, in]` of
/// `module` in the current training forward; `None` outside one or with
/// `p = 0`.
fn dropout_mask(module: &str, p: f64, x: &Tensor) -> Option<Tensor> {
    if p <= 0.0 {
        return None;
    }
    DROPOUT.with(|d| {
        let d = d.borrow();
        let keys = d.as_ref()?;
        let (rows, width) = (x.size()[0] as usize, x.size()[1] as usize);
        let keep = 1.0 - p;
        let mut values = vec![0f32; rows * width];
        let stream = super::init::stream_of(module);
        for &(s, e, key) in &keys.docs {
            if e > rows {
                break;
            }
            let seed = keys.seed ^ keys.step.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ key;
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            rng.set_stream(stream);
            for v in &mut values[s * width..e * width] {
                if rng.random::<f64>() < keep {
                    *v = (1.0 / keep) as f32;
                }
            }
        }
        Some(
            Tensor::from_slice(&values)
                .view([rows as i64, width as i64])
                .to_device(x.device())
                .to_kind(x.kind()),
        )
    })
}

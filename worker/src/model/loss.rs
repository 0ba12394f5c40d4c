//! Chunked LM head + cross-entropy: the `[T, V]` logits never exist whole.
//!
//! Labels follow HF semantics, shifted inside each packed document: token t
//! predicts `labels[t + 1]` of the same document; the last token of a
//! document predicts nothing; `-100` is ignored. Only positions with a
//! target go through the LM head at all (prompt tokens cost nothing here).
//!
//! Gradient, written out rather than taped: for a chunk of C target rows
//! with logits `z = h_c Wᵀ` and `p = softmax(z)`, `∂NLL/∂z = p − onehot`, so
//! `g_h = scale·(p − onehot) W` and `g_W += (p − onehot)ᵀ (scale·h_c)`. One
//! `[C, V]` buffer is reused for every chunk: the matmul writes the logits
//! into it, log-softmax and exp turn them into `p` in place, the target
//! entries get −1, and two matmuls read it. Compared with autograd over
//! `cross_entropy` this skips three `[C, V]` temporaries per chunk (the
//! log-softmax output, the NLL backward's one-hot and the softmax
//! backward's output) and the page faults of allocating them, and
//! accumulates `g_W` in place with `addmm_`. The buffer is cached per thread
//! between calls (on CPU a fresh 100+ MiB allocation is a fresh mmap whose
//! pages fault in again). The result is `(g_h, g_W)` for `scale · NLL`; they
//! are pushed into the model with one backward of `⟨hidden, g_h⟩ + ⟨W, g_W⟩`,
//! whose gradient is exactly `(g_h, g_W)` — this also handles a head tied to
//! the embedding. A chunk whose loss is not finite stops before anything
//! reaches the model's parameters.
//!
//! A soft-capped head (Gemma's `final_logit_softcapping`: `c·tanh(z/c)`)
//! caps the logits in the buffer, keeps `tanh(z/c)`, and multiplies the
//! gradient by its derivative `1 − tanh²(z/c)` before the two matmuls.

use anyhow::bail;
use tch::{Kind, Tensor};

/// Per-token targets after the per-document shift (`-100` = none).
pub fn shifted_targets(labels: &[i64], cu_seq_lens: &[i64]) -> Vec<i64> {
    let mut out = vec![-100; labels.len()];
    for w in cu_seq_lens.windows(2) {
        let (s, e) = (w[0] as usize, w[1] as usize);
        if e > s + 1 {
            out[s..e - 1].copy_from_slice(&labels[s + 1..e]);
        }
    }
    out
}

/// The outcome of [`chunked_nll`].
#[derive(Debug)]
pub struct ChunkedLoss {
    /// Σ per-token NLL (unscaled), accumulated in f64.
    pub loss_sum: f64,
    pub loss_tokens: u64,
    /// `scale · ∂NLL/∂hidden`, `[T, H]` (undefined when no loss token).
    pub grad_hidden: Tensor,
    /// `scale · ∂NLL/∂W`, `[V, H]`.
    pub grad_weight: Tensor,
}

/// A non-finite chunk loss.
#[derive(Debug, thiserror::Error)]
#[error("non-finite loss {value} in loss chunk {chunk} (tokens {start}..{end} of the loss tokens)")]
pub struct NonFiniteLoss {
    pub value: f64,
    pub chunk: usize,
    pub start: usize,
    pub end: usize,
}

impl NonFiniteLoss {
    /// Err when chunk `chunk` (of `len` rows, chunks of `chunk_tokens`)
    /// summed to a non-finite `value`.
    pub fn check(value: f64, chunk: usize, chunk_tokens: usize, len: usize) -> Result<(), Self> {
        if value.is_finite() {
            return Ok(());
        }
        let start = chunk * chunk_tokens;
        Err(NonFiniteLoss {
            value,
            chunk,
            start,
            end: start + len,
        })
    }
}

/// Rows of a packed row that have a target (`!= -100`), in order.
pub fn target_rows(targets: &[i64]) -> Vec<i64> {
    (0..targets.len() as i64)
        .filter(|&t| targets[t as usize] != -100)
        .collect()
}

/// NLL over the targets in chunks of `chunk_tokens` and the gradients of
/// `scale · NLL` w.r.t. `hidden: [T, H]` and `weight: [V, H]` (not yet
/// applied to the model: see [`backward_into_model`]).
pub fn chunked_nll(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[i64],
    chunk_tokens: usize,
    scale: f64,
    softcap: Option<f64>,
) -> anyhow::Result<ChunkedLoss> {
    chunked_nll_with(hidden, weight, targets, chunk_tokens, scale, softcap, true)
}

/// [`chunked_nll`], the head's gradient computed only with `head_grad`
/// (a frozen head, under LoRA, needs none: `grad_weight` is undefined).
pub fn chunked_nll_with(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[i64],
    chunk_tokens: usize,
    scale: f64,
    softcap: Option<f64>,
    head_grad: bool,
) -> anyhow::Result<ChunkedLoss> {
    if chunk_tokens == 0 {
        bail!("loss_chunk_tokens must be positive");
    }
    tch::no_grad(|| {
        chunked_nll_untaped(
            hidden,
            weight,
            targets,
            chunk_tokens,
            scale,
            softcap,
            head_grad,
        )
    })
}

/// Logits soft-capped as `cap · tanh(z / cap)` (Gemma's
/// `final_logit_softcapping`), or as they are.
pub fn cap_logits(z: Tensor, softcap: Option<f64>) -> Tensor {
    match softcap {
        Some(c) => (z / c).tanh() * c,
        None => z,
    }
}

fn chunked_nll_untaped(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[i64],
    chunk_tokens: usize,
    scale: f64,
    softcap: Option<f64>,
    head_grad: bool,
) -> anyhow::Result<ChunkedLoss> {
    let device = hidden.device();
    let kind = hidden.kind();
    let h = hidden.detach();
    let w = weight.detach();
    let (t, hid) = (h.size()[0], h.size()[1]);
    let vocab = w.size()[0];
    let rows = target_rows(targets);
    if rows.is_empty() {
        return Ok(ChunkedLoss {
            loss_sum: 0.0,
            loss_tokens: 0,
            grad_hidden: Tensor::new(),
            grad_weight: Tensor::new(),
        });
    }
    let grad_hidden = Tensor::zeros([t, hid], (kind, device));
    let mut grad_weight = if head_grad {
        Tensor::zeros([vocab, hid], (kind, device))
    } else {
        Tensor::new()
    };
    let chunk_max = chunk_tokens.min(rows.len()) as i64;
    let buf = scratch(chunk_max * vocab, device);
    let mut loss_sum = 0.0;
    for (i, chunk) in rows.chunks(chunk_tokens).enumerate() {
        let c = chunk.len() as i64;
        let idx = Tensor::from_slice(chunk).to_device(device);
        let tgt: Vec<i64> = chunk.iter().map(|&r| targets[r as usize]).collect();
        let tgt = Tensor::from_slice(&tgt).to_device(device).unsqueeze(1);
        let h_c = h.index_select(0, &idx);
        let z = buf.narrow(0, 0, c * vocab).view([c, vocab]);
        if kind == Kind::Float {
            let _ = h_c.mm_out(&z, &w.tr());
        } else {
            z.shallow_clone().copy_(&h_c.mm(&w.tr()));
        }
        // Soft-capped: z ← c·tanh(z/c), keeping tanh for the gradient.
        let tanh = softcap.map(|c| {
            let t = (&z / c).tanh();
            z.shallow_clone().copy_(&(&t * c));
            t
        });
        // In place: each row is fully read (max, Σexp) before it is written.
        let _ = z.internal_log_softmax_out(&z, 1, false);
        let nll = z.gather(1, &tgt, false).sum(Kind::Double).neg();
        let value = f64::try_from(&nll)?;
        NonFiniteLoss::check(value, i, chunk_tokens, chunk.len())?;
        loss_sum += value;
        // z ← softmax − onehot = ∂NLL/∂logits; `scale` goes on the small side.
        let _ = z.shallow_clone().exp_();
        let minus_one = Tensor::full([c, 1], -1.0, (Kind::Float, device));
        let _ = z.shallow_clone().scatter_add_(1, &tgt, &minus_one);
        if let Some(t) = tanh {
            // ∂/∂z_raw = ∂/∂z_capped · (1 − tanh²).
            let _ = z.shallow_clone().g_mul_(&(t.square().neg() + 1.0));
        }
        let g = if kind == Kind::Float {
            z.shallow_clone()
        } else {
            z.to_kind(kind)
        };
        let g_h = g.mm(&w) * scale;
        let _ = grad_hidden.shallow_clone().index_copy_(0, &idx, &g_h);
        if head_grad {
            let _ = grad_weight.addmm_(&g.tr(), &(h_c * scale));
        }
    }
    Ok(ChunkedLoss {
        loss_sum,
        loss_tokens: rows.len() as u64,
        grad_hidden,
        grad_weight,
    })
}

thread_local! {
    /// The per-thread `[C·V]` float32 logits buffer of [`chunked_nll`].
    static SCRATCH: std::cell::RefCell<Option<Tensor>> = const { std::cell::RefCell::new(None) };
}

/// A flat float32 buffer of at least `numel` elements on `device`, reused
/// across calls on this thread (grown when too small). Callers must not keep
/// views of it past their own call.
fn scratch(numel: i64, device: tch::Device) -> Tensor {
    SCRATCH.with(|cell| {
        let mut slot = cell.borrow_mut();
        let fits = slot
            .as_ref()
            .is_some_and(|b| b.device() == device && b.numel() as i64 >= numel);
        if !fits {
            // Drop the old buffer first so the two never coexist.
            *slot = None;
            *slot = Some(Tensor::empty([numel], (Kind::Float, device)));
        }
        slot.as_ref().expect("just filled").shallow_clone()
    })
}

/// Backpropagates the chunked loss's gradients through the model:
/// accumulates into the parameters' `.grad` (never resets them).
pub fn backward_into_model(hidden: &Tensor, weight: &Tensor, loss: &ChunkedLoss) {
    if !loss.grad_hidden.defined() {
        return;
    }
    let surrogate = (hidden * &loss.grad_hidden).sum(Kind::Float)
        + (weight * &loss.grad_weight).sum(Kind::Float);
    surrogate.backward();
}

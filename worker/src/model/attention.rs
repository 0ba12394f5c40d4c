//! Grouped-query self-attention over a padding-free packed row (HF
//! `LlamaAttention` / `Qwen2Attention`).
//!
//! The row `[T, H]` holds several documents (`cu_seq_lens`); attention is
//! causal inside each document and never crosses one. Three
//! implementations ([`PackedAttention::Auto`], the default, takes the
//! first on the CPU and the second on CUDA):
//!
//! - per document ([`PackedAttention::PerDocument`]): one
//!   `scaled_dot_product_attention(is_causal)` call per document on a view of
//!   q/k/v. Cost is Σ lᵢ², no mask tensor, and the causal fast path (flash
//!   kernel on CPU) applies.
//! - bucketed ([`PackedAttention::Bucketed`]): documents of similar length padded into
//!   a batch `[B, heads, L, d]` and one causal SDPA call per length bucket,
//!   which on CUDA dispatches to the fused flash (bf16/fp16) or
//!   memory-efficient (fp32) kernels with a handful of launches instead of
//!   one per document. Padding sits after each document's tokens, so with
//!   the causal mask no real query sees it; buckets are powers of two from
//!   64 tokens, so the padded cost is below 4× Σ lᵢ² (about 1.3× on
//!   typical lengths). Varlen flash attention (cumulative sequence lengths,
//!   no padding) has no autograd entry point in tch
//!   (`_flash_attention_forward` is not bound), hence the buckets.
//! - one mask ([`PackedAttention::BlockMask`]): one call over the whole row with a
//!   `[T, T]` block-diagonal causal boolean mask. Cost is T², plus the mask.
//!
//! Attention cost per layer, fwd + bwd, T = 4096 in 16 documents of
//! 64–512 tokens, 4 heads × 64, 1 thread (torch eager, same kernels):
//! per-document flash 0.66 s, per-document math path 0.9 s, one masked call
//! over the whole row 9.7 s (the masked kernel computes all T² scores).
//! PerDocument is the default; BlockMask is kept for the benchmark and tests.
//!
//! Grouped-query attention: on the CPU a long document's kv heads are read
//! in place by SDPA's `enable_gqa` (the flash kernel takes each query
//! group against its kv head), so neither repeated k/v nor their
//! gradients exist ([`GQA_IN_PLACE_FROM`]); shorter documents, and CUDA
//! (as the fp32 kernel needs), repeat them (HF `repeat_kv`).
//!
//! Family variants ([`crate::model::config::Arch`]): q/k RMSNorm before
//! RoPE (per head or over the projection), a softmax scale other than
//! `1/√d`, and a sliding window (a boolean mask on the documents longer
//! than the window; shorter ones stay on the causal fast path).
//!
//! q, k and v come from one matmul over the concatenated weights, and RoPE
//! runs once over the q and k heads together; the stored parameters keep
//! HF's names and shapes.

use tch::{nn, Kind, Tensor};

use super::config::{Arch, LayerSpec, ModelConfig, QkNorm};
use super::linear::{fused_linear, linear, Linear};
use super::norm::RmsNorm;
use super::rope;

/// Documents at least this long read their kv heads in place on the CPU
/// (`enable_gqa`); shorter ones repeat them. Measured at 4 query heads
/// per kv head (`scripts/bench_attention.sh`, 2 threads): in place saves
/// 43 % of one layer's attention memory at 64k tokens and is ~15 % slower
/// in backward at 4k–64k; below this length the repeated copies are a few
/// MiB.
pub const GQA_IN_PLACE_FROM: i64 = 8192;

/// A row the varlen kernel refused runs bucketed; said once per process
/// (every layer of every step would refuse alike).
fn varlen_fallback(e: &anyhow::Error) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(
        || tracing::warn!(error = %e, "varlen flash attention refused a row: it runs bucketed"),
    );
}

/// How the packed row's block-diagonal causal attention is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PackedAttention {
    /// `PerDocument` on the CPU; on CUDA `Bucketed`, or `Varlen` where
    /// enabled (`super::varlen::enabled`).
    #[default]
    Auto,
    PerDocument,
    Bucketed,
    BlockMask,
    /// Varlen flash attention on CUDA (`super::varlen`): the row's
    /// documents by their cumulative lengths, no padding; a row the
    /// kernel cannot take (fp32, a sliding window) runs bucketed.
    Varlen,
}

impl PackedAttention {
    /// The implementation `Auto` stands for on `device`.
    pub fn on(self, device: tch::Device) -> PackedAttention {
        match self {
            PackedAttention::Auto if device.is_cuda() && super::varlen::enabled() => {
                PackedAttention::Varlen
            }
            PackedAttention::Auto if device.is_cuda() => PackedAttention::Bucketed,
            PackedAttention::Auto => PackedAttention::PerDocument,
            m => m,
        }
    }
}

#[derive(Debug)]
pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// `q_norm`, `k_norm` (Qwen3, Gemma 3 per head; OLMo 2 over the
    /// projection), before RoPE.
    qk_norm: Option<(QkNorm, RmsNorm, RmsNorm)>,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    /// The softmax scale when not `1/√head_dim`.
    scale: Option<f64>,
    /// A query sees at most this many keys, itself included.
    window: Option<i64>,
}

impl Attention {
    pub fn new(p: nn::Path, cfg: &ModelConfig, arch: &Arch, layer: &LayerSpec) -> Attention {
        let h = cfg.hidden_size;
        let hd = cfg.head_dim();
        let (nh, nkv) = (cfg.num_attention_heads, cfg.kv_heads());
        let bias = arch.bias;
        let eps = cfg.rms_norm_eps;
        let norm =
            |name: &str, size: usize| RmsNorm::with(&p / name, size, eps, arch.norm_plus_one);
        let qk_norm = match arch.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead => Some((QkNorm::PerHead, norm("q_norm", hd), norm("k_norm", hd))),
            QkNorm::Full => Some((
                QkNorm::Full,
                norm("q_norm", nh * hd),
                norm("k_norm", nkv * hd),
            )),
        };
        Attention {
            q_proj: linear(&p / "q_proj", h, nh * hd, bias.qkv),
            k_proj: linear(&p / "k_proj", h, nkv * hd, bias.qkv),
            v_proj: linear(&p / "v_proj", h, nkv * hd, bias.qkv),
            o_proj: linear(&p / "o_proj", nh * hd, h, bias.o),
            qk_norm,
            heads: nh as i64,
            kv_heads: nkv as i64,
            head_dim: hd as i64,
            scale: arch.attn_scale,
            window: layer.window.map(|w| w as i64),
        }
    }

    /// The softmax scale when not `1/√head_dim`.
    pub fn scale(&self) -> Option<f64> {
        self.scale
    }

    /// The sliding window, if this layer has one.
    pub fn window(&self) -> Option<i64> {
        self.window
    }

    /// `x: [T, H]`, `cos/sin: [T, head_dim]`, `cu_seq_lens` the document
    /// boundaries of the row (0, …, T).
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cu_seq_lens: &[i64],
        mode: PackedAttention,
    ) -> Tensor {
        let t = x.size()[0];
        let (q, k, v) = self.project(x, cos, sin);
        let out = self.attend(&q, &k, &v, cu_seq_lens, mode);
        let out = out.transpose(0, 1).reshape([t, self.heads * self.head_dim]);
        self.output(&out)
    }

    /// Causal attention within the documents of `cu_seq_lens` of `q:
    /// [heads, T, d]` over `k, v: [kv_heads, T, d]`; `[heads, T, d]`.
    pub fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cu_seq_lens: &[i64],
        mode: PackedAttention,
    ) -> Tensor {
        let scale = self.scale;
        let longest = cu_seq_lens
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0);
        // A window shorter than a document needs a mask; the padded
        // buckets are causal only, so such a row runs per document.
        let windowed = self.window.filter(|&w| w < longest);
        let mode = match (mode.on(q.device()), windowed) {
            (PackedAttention::Bucketed, Some(_)) => PackedAttention::PerDocument,
            (PackedAttention::Varlen, Some(_)) => PackedAttention::PerDocument,
            (m, _) => m,
        };
        let mode = match mode {
            PackedAttention::Varlen => {
                let rows = |t: &Tensor| t.transpose(0, 1);
                match super::varlen::attend(&rows(q), &rows(k), &rows(v), cu_seq_lens, scale) {
                    Ok(out) => return out.transpose(0, 1),
                    Err(e) => {
                        varlen_fallback(&e);
                        PackedAttention::Bucketed
                    }
                }
            }
            m => m,
        };
        // GQA: on the CPU, SDPA's `enable_gqa` lets the flash kernel read
        // each kv head for its query group (no repeated k/v, nor their
        // gradients); on CUDA the fp32 memory-efficient kernel has no
        // grouped path (SDPA would fall back to the T² math kernel), and
        // the padded buckets gather whole heads, so the kv heads are
        // repeated there (HF `repeat_kv`).
        let rep = self.heads / self.kv_heads;
        let gqa = rep > 1 && !q.device().is_cuda() && mode != PackedAttention::Bucketed;
        let (k, v) = if rep > 1 && !gqa {
            (
                k.repeat_interleave_self_int(rep, 0, None),
                v.repeat_interleave_self_int(rep, 0, None),
            )
        } else {
            (k.shallow_clone(), v.shallow_clone())
        };
        match mode {
            // (A row the varlen kernel refused, above.)
            PackedAttention::Bucketed | PackedAttention::Varlen => {
                bucketed(q, &k, &v, cu_seq_lens, scale)
            }
            PackedAttention::Auto | PackedAttention::PerDocument => {
                // `split` rather than one `narrow` per document: its backward
                // is one concatenation, not a zero-filled full-size gradient
                // per document.
                let lens: Vec<i64> = cu_seq_lens.windows(2).map(|w| w[1] - w[0]).collect();
                // (A row of one document is used whole: splitting it would
                // cost its gradients a copy.)
                let split = |x: &Tensor| match lens.len() {
                    1 => vec![x.shallow_clone()],
                    _ => x.split_with_sizes(&lens, 1),
                };
                let (qs, ks, vs) = (split(q), split(&k), split(&v));
                let docs: Vec<Tensor> = (0..lens.len())
                    .filter(|&d| lens[d] > 0)
                    .map(|d| {
                        let mask = windowed
                            .filter(|&w| w < lens[d])
                            .map(|w| window_mask(lens[d], w, q.device()));
                        let causal = mask.is_none();
                        // A short document's repeated k/v cost little
                        // memory and its backward runs faster repeated
                        // (scripts/bench_attention.sh): in place from
                        // GQA_IN_PLACE_FROM tokens.
                        let in_place = gqa && lens[d] >= GQA_IN_PLACE_FROM;
                        let kv = |x: &Tensor| match gqa && !in_place {
                            true => x.repeat_interleave_self_int(rep, 0, None),
                            false => x.shallow_clone(),
                        };
                        Tensor::scaled_dot_product_attention(
                            &qs[d].unsqueeze(0),
                            &kv(&ks[d]).unsqueeze(0),
                            &kv(&vs[d]).unsqueeze(0),
                            mask,
                            0.0,
                            causal,
                            scale,
                            in_place,
                        )
                        .squeeze_dim(0)
                    })
                    .collect();
                // One document (a long one) needs no copy into a row.
                match <[Tensor; 1]>::try_from(docs) {
                    Ok([one]) => one,
                    Err(docs) => Tensor::cat(&docs, 1),
                }
            }
            PackedAttention::BlockMask => {
                let mut mask = block_causal_mask(cu_seq_lens, q.device());
                if let Some(w) = windowed {
                    let t = *cu_seq_lens.last().unwrap_or(&0);
                    mask = mask.logical_and(&window_mask(t, w, q.device()));
                }
                Tensor::scaled_dot_product_attention(
                    &q.unsqueeze(0),
                    &k.unsqueeze(0),
                    &v.unsqueeze(0),
                    Some(mask),
                    0.0,
                    false,
                    scale,
                    gqa,
                )
                .squeeze_dim(0)
            }
        }
    }

    /// q `[heads, T, d]`, k and v `[kv_heads, T, d]` of the tokens `x:
    /// [T, H]`, RoPE applied to q and k (the cached keys of generation are
    /// these k).
    pub fn project(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> (Tensor, Tensor, Tensor) {
        let t = x.size()[0];
        let (nq, nkv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        // One matmul for q/k/v (weights concatenated at run time; the stored
        // parameters keep HF's names and shapes), and one RoPE for q and k.
        let qkv = fused_linear(x, &[&self.q_proj, &self.k_proj, &self.v_proj]);
        let (h, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        let qk = match &self.qk_norm {
            None => qkv.narrow(1, 0, nq + nkv).view([t, h + kv, d]),
            Some((QkNorm::Full, qn, kn)) => Tensor::cat(
                &[
                    qn.forward(&qkv.narrow(1, 0, nq)),
                    kn.forward(&qkv.narrow(1, nq, nkv)),
                ],
                1,
            )
            .view([t, h + kv, d]),
            Some((_, qn, kn)) => Tensor::cat(
                &[
                    qn.forward(&qkv.narrow(1, 0, nq).view([t, h, d])),
                    kn.forward(&qkv.narrow(1, nq, nkv).view([t, kv, d])),
                ],
                1,
            ),
        }
        .transpose(0, 1);
        let qk = rope::apply(&qk, cos, sin);
        let q = qk.narrow(0, 0, self.heads);
        let k = qk.narrow(0, self.heads, self.kv_heads);
        let v = qkv
            .narrow(1, nq + nkv, nkv)
            .view([t, self.kv_heads, self.head_dim])
            .transpose(0, 1);
        (q, k, v)
    }

    /// The output projection of the heads' outputs `[T, heads · d]`.
    pub fn output(&self, heads: &Tensor) -> Tensor {
        self.o_proj.forward(heads)
    }

    /// The projections by their HF names.
    pub(super) fn linears(&self) -> [(&'static str, &Linear); 4] {
        [
            ("q_proj", &self.q_proj),
            ("k_proj", &self.k_proj),
            ("v_proj", &self.v_proj),
            ("o_proj", &self.o_proj),
        ]
    }

    /// The projections by their HF names (where LoRA adapters attach).
    pub(super) fn linears_mut(&mut self) -> [(&'static str, &mut Linear); 4] {
        [
            ("q_proj", &mut self.q_proj),
            ("k_proj", &mut self.k_proj),
            ("v_proj", &mut self.v_proj),
            ("o_proj", &mut self.o_proj),
        ]
    }

    /// `(heads, kv_heads, head_dim)`.
    pub fn shape(&self) -> (i64, i64, i64) {
        (self.heads, self.kv_heads, self.head_dim)
    }
}

/// Causal attention of `q, k, v: [heads, T, d]` within documents, one SDPA
/// call per bucket of documents padded to the same power-of-two length.
fn bucketed(q: &Tensor, k: &Tensor, v: &Tensor, cu_seq_lens: &[i64], scale: Option<f64>) -> Tensor {
    let device = q.device();
    let (heads, t, d) = (q.size()[0], q.size()[1], q.size()[2]);
    let plan = buckets(cu_seq_lens);
    // Where each token's output sits in the concatenated padded outputs.
    let mut back = vec![0i64; t as usize];
    let mut outs = Vec::with_capacity(plan.len());
    let mut base = 0i64;
    for b in &plan {
        let (n, len) = (b.docs.len() as i64, b.len);
        // Token index of every padded slot; padding repeats the
        // document's first token (after its real tokens: never attended).
        let mut idx = Vec::with_capacity((n * len) as usize);
        for (row, &doc) in b.docs.iter().enumerate() {
            let (s, e) = (cu_seq_lens[doc], cu_seq_lens[doc + 1]);
            for j in 0..len {
                let tok = if s + j < e { s + j } else { s };
                if s + j < e {
                    back[tok as usize] = base + row as i64 * len + j;
                }
                idx.push(tok);
            }
        }
        let idx = Tensor::from_slice(&idx).to_device(device);
        let gather = |x: &Tensor| {
            x.index_select(1, &idx)
                .view([heads, n, len, d])
                .transpose(0, 1)
        };
        let out = Tensor::scaled_dot_product_attention::<Tensor>(
            &gather(q),
            &gather(k),
            &gather(v),
            None,
            0.0,
            true,
            scale,
            false,
        );
        outs.push(out.transpose(0, 1).reshape([heads, n * len, d]));
        base += n * len;
    }
    let back = Tensor::from_slice(&back).to_device(device);
    Tensor::cat(&outs, 1).index_select(1, &back)
}

/// Documents of one padded length.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Bucket {
    len: i64,
    docs: Vec<usize>,
}

/// Groups the non-empty documents by their length rounded up to a power
/// of two (at least 64).
fn buckets(cu_seq_lens: &[i64]) -> Vec<Bucket> {
    let mut by_len: std::collections::BTreeMap<i64, Vec<usize>> = Default::default();
    for (d, w) in cu_seq_lens.windows(2).enumerate() {
        let l = w[1] - w[0];
        if l > 0 {
            let padded = (l as u64).next_power_of_two().max(64) as i64;
            by_len.entry(padded).or_default().push(d);
        }
    }
    by_len
        .into_iter()
        .map(|(len, docs)| Bucket { len, docs })
        .collect()
}

/// `[L, L]` boolean mask of a sliding window: true where key j is one of
/// query i's `window` latest positions (`i - window < j ≤ i`, HF's
/// `sliding_window_overlay` on the causal mask).
pub fn window_mask(len: i64, window: i64, device: tch::Device) -> Tensor {
    let pos = Tensor::arange(len, (Kind::Int64, device));
    let back = pos.unsqueeze(1) - pos.unsqueeze(0);
    back.ge(0).logical_and(&back.lt(window))
}

/// `[T, T]` boolean mask: true where query i may attend key j (same
/// document, j ≤ i).
pub fn block_causal_mask(cu_seq_lens: &[i64], device: tch::Device) -> Tensor {
    let t = *cu_seq_lens.last().unwrap_or(&0);
    let mut doc = Vec::with_capacity(t as usize);
    for (d, w) in cu_seq_lens.windows(2).enumerate() {
        doc.extend(std::iter::repeat_n(d as i64, (w[1] - w[0]) as usize));
    }
    let doc = Tensor::from_slice(&doc).to_device(device);
    let same = doc.unsqueeze(1).eq_tensor(&doc.unsqueeze(0));
    let causal = Tensor::ones([t, t], (Kind::Bool, device)).tril(0);
    same.logical_and(&causal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Grouped-query attention read in place (`enable_gqa`, per document
    /// and with one mask) computes what repeating the kv heads computes
    /// (the bucketed path repeats them), forward and backward: every
    /// query group against its own kv head, in HF `repeat_kv` order.
    #[test]
    fn grouped_query_attention_in_place_equals_repeated_kv_heads() {
        let cfg = super::super::config::ModelConfig::from_json(&serde_json::json!({
            "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6
        }))
        .unwrap();
        let arch = cfg.arch().unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let attn = Attention::new(vs.root(), &cfg, &arch, &arch.layers[0]);
        // Short documents (repeated kv heads), and a row with one as long
        // as GQA_IN_PLACE_FROM (kv heads read in place).
        let long = GQA_IN_PLACE_FROM;
        let rows: [(&[i64], &[PackedAttention]); 2] = [
            (
                &[0, 37, 42, 142, 210],
                &[PackedAttention::PerDocument, PackedAttention::BlockMask],
            ),
            (&[0, 37, 37 + long], &[PackedAttention::PerDocument]),
        ];
        for (cu, modes) in rows {
            let t = *cu.last().unwrap();
            let i = Tensor::arange(t * 8 * 4, (Kind::Double, Device::Cpu));
            let make = |heads: i64, seed: f64| {
                (&i.narrow(0, 0, heads * t * 8) * seed)
                    .sin()
                    .to_kind(Kind::Float)
                    .view([heads, t, 8])
                    .set_requires_grad(true)
            };
            let (q, k, v) = (make(4, 0.37), make(2, 0.71), make(2, 1.13));
            let grad_out = make(4, 0.05).detach();
            let run = |mode: PackedAttention| {
                let out = attn.attend(&q, &k, &v, cu, mode);
                let objective = (&out * &grad_out).sum(Kind::Float);
                let g = Tensor::run_backward(&[objective], &[&q, &k, &v], false, false);
                (out, g)
            };
            let (want, want_g) = run(PackedAttention::Bucketed);
            for &mode in modes {
                let (out, g) = run(mode);
                let worst = |a: &Tensor, b: &Tensor| f64::try_from((a - b).abs().max()).unwrap();
                assert!(
                    worst(&out, &want) < 1e-5,
                    "{mode:?} T={t}: {}",
                    worst(&out, &want)
                );
                for (a, b) in g.iter().zip(&want_g) {
                    assert!(
                        worst(a, b) < 1e-4,
                        "{mode:?} T={t} gradient: {}",
                        worst(a, b)
                    );
                }
            }
        }
    }

    /// The bucketed batch computes exactly what per-document calls do,
    /// forward and backward (padding never reaches a real token).
    #[test]
    fn bucketed_attention_equals_per_document() {
        let cu = [0i64, 37, 42, 142, 143, 210, 410];
        let t = *cu.last().unwrap();
        let plan = buckets(&cu);
        assert_eq!(
            plan.iter()
                .map(|b| (b.len, b.docs.clone()))
                .collect::<Vec<_>>(),
            vec![(64, vec![0, 1, 3]), (128, vec![2, 4]), (256, vec![5])]
        );
        let i = Tensor::arange(4 * t * 8, (Kind::Double, Device::Cpu));
        let make = |seed: f64| {
            (&i * seed)
                .sin()
                .to_kind(Kind::Float)
                .view([4, t, 8])
                .set_requires_grad(true)
        };
        let (q, k, v) = (make(0.37), make(0.71), make(1.13));
        let grad_out = make(0.05).detach();
        let run = |mode: PackedAttention| {
            let out = match mode {
                PackedAttention::Bucketed => bucketed(&q, &k, &v, &cu, None),
                _ => {
                    let lens: Vec<i64> = cu.windows(2).map(|w| w[1] - w[0]).collect();
                    let docs: Vec<Tensor> = q
                        .split_with_sizes(&lens, 1)
                        .iter()
                        .zip(k.split_with_sizes(&lens, 1))
                        .zip(v.split_with_sizes(&lens, 1))
                        .map(|((q, k), v)| {
                            Tensor::scaled_dot_product_attention::<Tensor>(
                                &q.unsqueeze(0),
                                &k.unsqueeze(0),
                                &v.unsqueeze(0),
                                None,
                                0.0,
                                true,
                                None,
                                false,
                            )
                            .squeeze_dim(0)
                        })
                        .collect();
                    Tensor::cat(&docs, 1)
                }
            };
            let g = Tensor::run_backward(
                &[(&out * &grad_out).sum(Kind::Float)],
                &[&q, &k, &v],
                false,
                false,
            );
            (out.detach(), g)
        };
        let (a, ga) = run(PackedAttention::Bucketed);
        let (b, gb) = run(PackedAttention::PerDocument);
        let close = |x: &Tensor, y: &Tensor| f64::try_from((x - y).abs().max()).unwrap() <= 1e-5;
        assert!(close(&a, &b), "outputs differ");
        for (x, y) in ga.iter().zip(&gb) {
            assert!(close(x, y), "gradients differ");
        }
        assert_eq!(
            PackedAttention::Auto.on(Device::Cpu),
            PackedAttention::PerDocument
        );
        assert_eq!(
            PackedAttention::Auto.on(Device::Cuda(0)),
            PackedAttention::Bucketed
        );
    }
}

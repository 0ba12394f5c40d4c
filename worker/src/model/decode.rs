//! Generation's forward: the same [`Llama`] with a per-layer key/value
//! cache, so a new token costs one token's forward instead of the whole
//! sequence's (HF `DynamicCache`/`StaticCache`, vLLM's slots).
//!
//! The cache is a fixed set of slots, one sequence each, every layer's keys
//! and values held as `[slots, kv_heads, capacity, head_dim]` (a static
//! cache: no reallocation while decoding). [`Llama::prefill`] runs new
//! prompts as one packed row through the training forward's attention and
//! writes their keys and values into their slots; [`Llama::decode`] runs one
//! token for each of any set of slots, each at its own position, attending
//! to its slot's cache under a length mask. Both return the logits of the
//! last token per sequence, from the same weights and kernels as a training
//! forward (the log-probs a sampler reports are then the trainer's
//! `old_logprobs`).

use anyhow::bail;
use tch::{Kind, Tensor};

use super::llama::{positions, Llama};
use super::moe::Route;

/// Keys and values of up to `slots` sequences of at most `capacity` tokens.
pub struct KvCache {
    /// Per layer, `[slots, kv_heads, capacity, head_dim]`.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    /// Tokens held per slot.
    lens: Vec<i64>,
    capacity: i64,
    /// With routing recorded (Qwen3-MoE, routing replay): per slot, the
    /// experts each cached token went through, `sparse layers × top_k`
    /// ids per token, flat.
    routing: Option<Vec<Vec<i64>>>,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("lens", &self.lens)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl KvCache {
    /// An empty cache for `model` (its dtype and device).
    pub fn new(model: &Llama, slots: usize, capacity: usize) -> KvCache {
        let (_, kv_heads, head_dim) = model.layers[0].self_attn.shape();
        let shape = [slots as i64, kv_heads, capacity as i64, head_dim];
        let opts = (model.kind(), model.vs.device());
        let make = || -> Vec<Tensor> {
            (0..model.layers.len())
                .map(|_| Tensor::zeros(shape, opts))
                .collect()
        };
        KvCache {
            keys: make(),
            values: make(),
            lens: vec![0; slots],
            capacity: capacity as i64,
            routing: None,
        }
    }

    /// Records the experts every cached token is routed through (see
    /// [`Self::routing`]); nothing for a dense model.
    pub fn record_routing(mut self) -> KvCache {
        self.routing = Some(vec![Vec::new(); self.lens.len()]);
        self
    }

    /// The experts `slot`'s cached tokens went through, `sparse layers ×
    /// top_k` ids per token in layer order (empty for a dense model or
    /// without [`Self::record_routing`]).
    pub fn routing(&self, slot: usize) -> &[i64] {
        self.routing.as_ref().map_or(&[], |r| r[slot].as_slice())
    }

    /// Appends per-token routing rows `[N, S, k]` (S = 0: dense) to the
    /// slots they belong to, `spans` giving each slot's row count.
    fn push_routing(&mut self, chosen: &[Tensor], spans: &[(usize, i64)]) {
        let Some(routing) = &mut self.routing else {
            return;
        };
        if chosen.is_empty() {
            return;
        }
        let rows = Tensor::stack(chosen, 1).to_device(tch::Device::Cpu);
        let per_token = (rows.size()[1] * rows.size()[2]) as usize;
        let flat = Vec::<i64>::try_from(rows.contiguous().view([-1])).unwrap_or_default();
        let mut at = 0;
        for &(slot, n) in spans {
            let len = n as usize * per_token;
            routing[slot].extend_from_slice(&flat[at..at + len]);
            at += len;
        }
    }

    /// Tokens cached in `slot`.
    pub fn len(&self, slot: usize) -> usize {
        self.lens[slot] as usize
    }

    pub fn slots(&self) -> usize {
        self.lens.len()
    }

    pub fn capacity(&self) -> usize {
        self.capacity as usize
    }

    /// Frees `slot` for a new sequence (its stale entries are masked out).
    pub fn clear(&mut self, slot: usize) {
        self.lens[slot] = 0;
        if let Some(r) = &mut self.routing {
            r[slot].clear();
        }
    }

    /// A copy of the keys and values of `slot`'s first `n` tokens (a
    /// prompt another slot will start from; see [`Self::start_from`]).
    pub fn prefix(&self, slot: usize, n: usize) -> anyhow::Result<Prefix> {
        if n as i64 > self.lens[slot] {
            bail!(
                "prefix of slot {slot}: {n} tokens asked, {} held",
                self.lens[slot]
            );
        }
        let take = |c: &Vec<Tensor>| -> Vec<Tensor> {
            c.iter()
                .map(|t| t.get(slot as i64).narrow(1, 0, n as i64).copy())
                .collect()
        };
        let routing = self.routing.as_ref().map(|r| {
            let per_token = r[slot].len() / (self.lens[slot] as usize).max(1);
            r[slot][..n * per_token].to_vec()
        });
        Ok(Prefix {
            keys: take(&self.keys),
            values: take(&self.values),
            len: n as i64,
            routing,
        })
    }

    /// Starts empty `slot` from `prefix`, as if its tokens had been
    /// prefilled there (a prefix's keys and values depend only on its
    /// tokens and positions).
    pub fn start_from(&mut self, slot: usize, prefix: &Prefix) -> anyhow::Result<()> {
        if self.lens[slot] != 0 || prefix.len > self.capacity {
            bail!(
                "slot {slot}: a {}-token prefix into a slot holding {} of {}",
                prefix.len,
                self.lens[slot],
                self.capacity
            );
        }
        for (c, p) in self.keys.iter().zip(&prefix.keys) {
            c.get(slot as i64).narrow(1, 0, prefix.len).copy_(p);
        }
        for (c, p) in self.values.iter().zip(&prefix.values) {
            c.get(slot as i64).narrow(1, 0, prefix.len).copy_(p);
        }
        self.lens[slot] = prefix.len;
        if let (Some(r), Some(p)) = (&mut self.routing, &prefix.routing) {
            r[slot] = p.clone();
        }
        Ok(())
    }
}

/// The cached keys and values of a prompt, per layer `[kv_heads, len,
/// head_dim]`, taken out of a slot to start other slots from.
pub struct Prefix {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: i64,
    routing: Option<Vec<i64>>,
}

impl Llama {
    /// Runs `prompts` (slot, token ids) as one packed row, stores their keys
    /// and values in their slots (which must be empty) and returns the
    /// float32 logits of each prompt's last token, `[prompts, V]`.
    pub fn prefill(
        &self,
        cache: &mut KvCache,
        prompts: &[(usize, &[i64])],
    ) -> anyhow::Result<Tensor> {
        let mut cu = vec![0i64];
        let mut ids = Vec::new();
        for &(slot, p) in prompts {
            if p.is_empty() || cache.lens[slot] != 0 || p.len() as i64 > cache.capacity {
                bail!(
                    "prefill of slot {slot}: {} prompt tokens into a slot holding {} of {}",
                    p.len(),
                    cache.lens[slot],
                    cache.capacity
                );
            }
            ids.extend_from_slice(p);
            cu.push(ids.len() as i64);
        }
        let device = self.vs.device();
        let tables = self.rope_tables(&positions(&cu));
        let tokens = Tensor::from_slice(&ids).to_device(device);
        let mut x = self.embed(&tokens);
        let t = ids.len() as i64;
        let mut chosen = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let (cos, sin) = &tables[layer.rope];
            let (y, routed) =
                layer.forward_with_route(&x, cos, sin, Route::default(), |attn, q, k, v| {
                    for (&(slot, _), w) in prompts.iter().zip(cu.windows(2)) {
                        let (s, n) = (w[0], w[1] - w[0]);
                        let at = |c: &Tensor| c.get(slot as i64).narrow(1, 0, n);
                        at(&cache.keys[l]).copy_(&k.narrow(1, s, n));
                        at(&cache.values[l]).copy_(&v.narrow(1, s, n));
                    }
                    let (heads, _, head_dim) = attn.shape();
                    attn.attend(q, k, v, &cu, self.attention)
                        .transpose(0, 1)
                        .reshape([t, heads * head_dim])
                });
            x = y;
            chosen.extend(routed.chosen);
        }
        for &(slot, p) in prompts {
            cache.lens[slot] = p.len() as i64;
        }
        let spans: Vec<(usize, i64)> = prompts.iter().map(|&(s, p)| (s, p.len() as i64)).collect();
        cache.push_routing(&chosen, &spans);
        let last: Vec<i64> = cu[1..].iter().map(|&e| e - 1).collect();
        let last = Tensor::from_slice(&last).to_device(device);
        Ok(self.head_logits(&x.index_select(0, &last)))
    }

    /// Runs one token for each `(slot, token)`, at the position after its
    /// slot's cached tokens, appends its key and value to the slot and
    /// returns the float32 logits `[tokens, V]`.
    pub fn decode(&self, cache: &mut KvCache, tokens: &[(usize, i64)]) -> anyhow::Result<Tensor> {
        let device = self.vs.device();
        let b = tokens.len() as i64;
        let pos: Vec<i64> = tokens.iter().map(|&(s, _)| cache.lens[s]).collect();
        if let Some(&(slot, _)) = tokens
            .iter()
            .find(|&&(s, _)| cache.lens[s] >= cache.capacity)
        {
            bail!(
                "decode of slot {slot}: its cache is full ({} tokens)",
                cache.capacity
            );
        }
        let slots: Vec<i64> = tokens.iter().map(|&(s, _)| s as i64).collect();
        // Only the cache up to the longest sequence is attended.
        let span = pos.iter().max().map_or(0, |m| m + 1);
        // Per layer window (sliding layers see their latest `w` keys).
        let mask_for = |window: Option<i64>| {
            let mask: Vec<bool> = pos
                .iter()
                .flat_map(|&p| (0..span).map(move |j| j <= p && window.is_none_or(|w| p - j < w)))
                .collect();
            Tensor::from_slice(&mask)
                .view([b, 1, 1, span])
                .to_device(device)
        };
        // One mask per distinct window, built once per step, not per layer.
        let mut masks: Vec<(Option<i64>, Tensor)> = Vec::new();
        for layer in &self.layers {
            let w = layer.self_attn.window();
            if !masks.iter().any(|(x, _)| *x == w) {
                masks.push((w, mask_for(w)));
            }
        }
        // Contiguous slots from 0 (the common case) are a view, not a copy.
        let in_order = slots.iter().enumerate().all(|(i, &s)| i as i64 == s);
        let slot_idx = Tensor::from_slice(&slots).to_device(device);
        let pos_idx = Tensor::from_slice(&pos).to_device(device);
        let tables = self.rope_tables(&pos);
        let ids: Vec<i64> = tokens.iter().map(|&(_, t)| t).collect();
        let ids = Tensor::from_slice(&ids).to_device(device);
        let mut x = self.embed(&ids);
        let mut chosen = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let (cos, sin) = &tables[layer.rope];
            let (y, routed) =
                layer.forward_with_route(&x, cos, sin, Route::default(), |attn, q, k, v| {
                    let (heads, kv_heads, head_dim) = attn.shape();
                    // k, v: [kv_heads, B, d] → [B, kv_heads, d] at (slot, :, pos).
                    let index = [
                        Some(slot_idx.shallow_clone()),
                        None,
                        Some(pos_idx.shallow_clone()),
                    ];
                    let _ = cache.keys[l].index_put_(&index, &k.transpose(0, 1), false);
                    let _ = cache.values[l].index_put_(&index, &v.transpose(0, 1), false);
                    let window = |c: &Tensor| {
                        let c = c.narrow(2, 0, span);
                        match in_order {
                            true => c.narrow(0, 0, b),
                            false => c.index_select(0, &slot_idx),
                        }
                    };
                    // GQA without repeating the cache: the `heads / kv_heads`
                    // query heads of a kv head (HF `repeat_kv` order) are its
                    // queries.
                    let q = q
                        .transpose(0, 1)
                        .reshape([b, kv_heads, heads / kv_heads, head_dim]);
                    let mask = masks
                        .iter()
                        .find(|(w, _)| *w == attn.window())
                        .map(|(_, m)| m.shallow_clone())
                        .expect("a mask per window");
                    Tensor::scaled_dot_product_attention(
                        &q,
                        &window(&cache.keys[l]),
                        &window(&cache.values[l]),
                        Some(mask),
                        0.0,
                        false,
                        attn.scale(),
                        false,
                    )
                    .reshape([b, heads * head_dim])
                });
            x = y;
            chosen.extend(routed.chosen);
        }
        for &(s, _) in tokens {
            cache.lens[s] += 1;
        }
        let spans: Vec<(usize, i64)> = tokens.iter().map(|&(s, _)| (s, 1)).collect();
        cache.push_routing(&chosen, &spans);
        Ok(self.head_logits(&x))
    }

    /// Final norm and LM head of hidden states `[N, H]`, float32
    /// (soft-capped where the model caps them).
    fn head_logits(&self, x: &Tensor) -> Tensor {
        let z = self
            .norm
            .forward(x)
            .matmul(&self.lm_head_weight().tr())
            .to_kind(Kind::Float);
        super::loss::cap_logits(z, self.arch.final_softcap)
    }
}

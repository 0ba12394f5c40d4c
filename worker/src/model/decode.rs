//! Generation's forward: the same [`Llama`] with a per-layer key/value
//! cache, so a new token costs one token's forward instead of the whole
//! sequence's (HF `DynamicCache`, vLLM's paged attention).
//!
//! The cache holds up to `slots` sequences, one each, in PAGES of
//! [`PAGE_TOKENS`] tokens (issue 37): every layer's keys and values live
//! in one pool `[pages, kv_heads, page_tokens, head_dim]`, each slot owns
//! the pages its tokens fill, a page is taken when a slot's length crosses
//! a page boundary and returned when the slot is cleared, and the pool
//! doubles when it runs out. So memory follows the tokens held, not
//! `slots × capacity` (a 32k-token episode does not reserve 32k tokens
//! for every slot); `capacity` only bounds a slot's length.
//! [`Llama::prefill`] runs new prompts as one packed row through the
//! training forward's attention and writes their keys and values into
//! their slots' pages; [`Llama::decode`] runs one token for each of any
//! set of slots, each at its own position, attending to its slot's pages
//! (gathered in order) under a length mask. Both return the logits of the
//! last token per sequence, from the same weights and kernels as a
//! training forward (the log-probs a sampler reports are then the
//! trainer's `old_logprobs`). A cache whose page is `capacity` tokens is
//! the static layout (one page per slot, all taken up front, read in place
//! by decode with no gather): [`KvCache::new`] takes it while that
//! reservation is small ([`STATIC_MAX_BYTES`]), pages beyond; the tests
//! check the two give the same tokens and log-probs.

use anyhow::bail;
use tch::{Device, Kind, Tensor};

use super::llama::{positions, Llama};
use super::moe::Route;

/// Tokens per page of a [`KvCache`] (vLLM's default block is 16; bigger
/// pages mean fewer index entries per decode step on the CPU, and at most
/// a page less one of waste per slot).
pub const PAGE_TOKENS: usize = 64;

/// The most a cache reserves up front in the static layout (every slot's
/// whole capacity): beyond it the cache is paged. Decode reads the static
/// layout in place, while pages are gathered each step — on the CPU that
/// copy made decode 0.91× as fast at 64 new tokens and 0.66× at 512
/// (`scripts/bench_generate.sh`), so pages are used where memory needs them.
pub const STATIC_MAX_BYTES: u64 = 1 << 30;

/// Keys and values of up to `slots` sequences of at most `capacity` tokens,
/// in pages (see the module docs).
pub struct KvCache {
    /// Per layer, the page pool `[pages, kv_heads, page, head_dim]`.
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    page: i64,
    /// The static layout (see [`KvCache::paged`]).
    fixed: bool,
    /// Per slot, the pool indices of its pages in token order.
    tables: Vec<Vec<i64>>,
    /// Pool pages no slot holds.
    free: Vec<i64>,
    /// Tokens held per slot.
    lens: Vec<i64>,
    capacity: i64,
    /// With routing recorded (Qwen3-MoE, routing replay): per slot, the
    /// experts each cached token went through, `sparse layers × top_k`
    /// ids per token, flat.
    routing: Option<Vec<Vec<i64>>>,
}

/// How a decode step reads its slots from a [`KvCache`].
enum Reads {
    /// The static layout: `b` slots' first `span` positions; `idx` picks
    /// the slots when they are not 0..b in order.
    Slots {
        b: i64,
        span: i64,
        idx: Option<Tensor>,
    },
    /// Pages: `n` per slot, `idx` their pool indices slot by slot.
    Pages {
        b: i64,
        n: i64,
        span: i64,
        idx: Tensor,
    },
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("lens", &self.lens)
            .field("capacity", &self.capacity)
            .field("page", &self.page)
            .field("fixed", &self.fixed)
            .field("pages", &self.pool_pages())
            .finish_non_exhaustive()
    }
}

impl KvCache {
    /// An empty cache for `model` (its dtype and device): the static
    /// layout while reserving every slot's whole capacity costs at most
    /// [`STATIC_MAX_BYTES`], else pages of [`PAGE_TOKENS`].
    pub fn new(model: &Llama, slots: usize, capacity: usize) -> KvCache {
        let (_, kv_heads, head_dim) = model.layers[0].self_attn.shape();
        let per_token = 2
            * model.layers.len() as u64
            * (kv_heads * head_dim) as u64
            * model.kind().elt_size_in_bytes() as u64;
        let reserve = slots as u64 * capacity as u64 * per_token;
        let page = match reserve <= STATIC_MAX_BYTES {
            true => capacity,
            false => PAGE_TOKENS,
        };
        KvCache::paged(model, slots, capacity, page)
    }

    /// [`Self::new`] with pages of `page` tokens; a page of at least
    /// `capacity` tokens is the static layout: one page per slot, held for
    /// good, read in place by decode (no gather).
    pub fn paged(model: &Llama, slots: usize, capacity: usize, page: usize) -> KvCache {
        let (_, kv_heads, head_dim) = model.layers[0].self_attn.shape();
        let fixed = page >= capacity;
        let page = page.clamp(1, capacity.max(1)) as i64;
        // One page per slot to start (short completions never grow it).
        let pages = slots.max(1) as i64;
        let shape = [pages, kv_heads, page, head_dim];
        let opts = (model.kind(), model.vs.device());
        let make = || -> Vec<Tensor> {
            (0..model.layers.len())
                .map(|_| Tensor::zeros(shape, opts))
                .collect()
        };
        KvCache {
            keys: make(),
            values: make(),
            page,
            fixed,
            // Static: slot i's page is page i, for good.
            tables: match fixed {
                true => (0..slots as i64).map(|s| vec![s]).collect(),
                false => vec![Vec::new(); slots],
            },
            free: match fixed {
                true => Vec::new(),
                false => (0..pages).rev().collect(),
            },
            lens: vec![0; slots],
            capacity: capacity as i64,
            routing: None,
        }
    }

    /// Pages in the pool (held or free): what the cache's memory is.
    pub fn pool_pages(&self) -> usize {
        self.keys.first().map_or(0, |k| k.size()[0] as usize)
    }

    /// Tokens per page.
    pub fn page_tokens(&self) -> usize {
        self.page as usize
    }

    /// Gives `slot` the pages to hold `len` tokens, doubling the pool
    /// when no page is free.
    fn reserve(&mut self, slot: usize, len: i64) {
        let need = (len + self.page - 1) / self.page;
        while (self.tables[slot].len() as i64) < need {
            if self.free.is_empty() {
                self.grow();
            }
            let p = self.free.pop().expect("grown above");
            self.tables[slot].push(p);
        }
    }

    /// Doubles the pool (its pages keep their indices).
    fn grow(&mut self) {
        let old = self.pool_pages() as i64;
        for pool in self.keys.iter_mut().chain(self.values.iter_mut()) {
            let mut shape = pool.size();
            shape[0] = old;
            let more = Tensor::zeros(shape.as_slice(), (pool.kind(), pool.device()));
            *pool = Tensor::cat(&[&*pool, &more], 0);
        }
        self.free.extend((old..2 * old).rev());
    }

    /// (page, offset) index tensors of the cache places of `at`'s
    /// (slot, position) pairs (each slot holding the page already).
    fn places(&self, at: impl Iterator<Item = (usize, i64)>, device: Device) -> (Tensor, Tensor) {
        let (pages, offs): (Vec<i64>, Vec<i64>) = at
            .map(|(s, t)| (self.tables[s][(t / self.page) as usize], t % self.page))
            .unzip();
        (
            Tensor::from_slice(&pages).to_device(device),
            Tensor::from_slice(&offs).to_device(device),
        )
    }

    /// Writes layer `l`'s keys and values `[kv_heads, n, d]` of `slot`'s
    /// positions `from..from + n` into its pages.
    fn write(&mut self, l: usize, slot: usize, from: i64, k: &Tensor, v: &Tensor) {
        let n = k.size()[1];
        let (pages, offs) = self.places((from..from + n).map(|t| (slot, t)), k.device());
        self.put(l, [Some(pages), None, Some(offs)], k, v);
    }

    /// Stores `k, v: [kv_heads, N, d]` at the N (page, :, offset) places.
    fn put(&mut self, l: usize, index: [Option<Tensor>; 3], k: &Tensor, v: &Tensor) {
        let _ = self.keys[l].index_put_(&index, &k.transpose(0, 1), false);
        let _ = self.values[l].index_put_(&index, &v.transpose(0, 1), false);
    }

    /// How `slots`' first `span` positions are read, the same for every
    /// layer (built once per decode step).
    fn reads(&self, slots: &[usize], span: i64) -> Reads {
        let device = self.keys[0].device();
        let b = slots.len() as i64;
        if self.fixed {
            // The static layout: a view when the slots are 0..b in order
            // (the common case), else one index_select of whole slots.
            let in_order = slots.iter().enumerate().all(|(i, &s)| i == s);
            let idx = (!in_order).then(|| {
                let idx: Vec<i64> = slots.iter().map(|&s| s as i64).collect();
                Tensor::from_slice(&idx).to_device(device)
            });
            return Reads::Slots { b, span, idx };
        }
        let n = (span + self.page - 1) / self.page;
        let idx: Vec<i64> = slots
            .iter()
            .flat_map(|&s| {
                let t = &self.tables[s];
                (0..n as usize).map(move |i| t.get(i).or(t.first()).copied().unwrap_or(0))
            })
            .collect();
        let idx = Tensor::from_slice(&idx).to_device(device);
        Reads::Pages { b, n, span, idx }
    }

    /// Layer `l`'s keys and values as `reads` says, `[slots, kv_heads,
    /// span, d]` each: pages gathered in order (a slot holding fewer pages
    /// reads its first page there, which the length mask hides).
    fn gather(&self, l: usize, reads: &Reads) -> (Tensor, Tensor) {
        let take = |pool: &Tensor| match reads {
            Reads::Slots { b, span, idx } => {
                let c = pool.narrow(2, 0, *span);
                match idx {
                    None => c.narrow(0, 0, *b),
                    Some(idx) => c.index_select(0, idx),
                }
            }
            Reads::Pages { b, n, span, idx } => {
                let size = pool.size();
                let (kv, d) = (size[1], size[3]);
                pool.index_select(0, idx)
                    .view([*b, *n, kv, self.page, d])
                    .permute([0, 2, 1, 3, 4])
                    .reshape([*b, kv, *n * self.page, d])
                    .narrow(2, 0, *span)
            }
        };
        (take(&self.keys[l]), take(&self.values[l]))
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

    /// Frees `slot` for a new sequence: its pages go back to the pool
    /// (the static layout keeps its one page; stale entries are masked).
    pub fn clear(&mut self, slot: usize) {
        self.lens[slot] = 0;
        if !self.fixed {
            let pages = std::mem::take(&mut self.tables[slot]);
            self.free.extend(pages.into_iter().rev());
        }
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
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        let reads = self.reads(&[slot], n as i64);
        for l in 0..self.keys.len() {
            let (k, v) = self.gather(l, &reads);
            keys.push(k.squeeze_dim(0).copy());
            values.push(v.squeeze_dim(0).copy());
        }
        let routing = self.routing.as_ref().map(|r| {
            let per_token = r[slot].len() / (self.lens[slot] as usize).max(1);
            r[slot][..n * per_token].to_vec()
        });
        Ok(Prefix {
            keys,
            values,
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
        self.reserve(slot, prefix.len);
        for l in 0..self.keys.len() {
            self.write(l, slot, 0, &prefix.keys[l], &prefix.values[l]);
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
        for &(slot, p) in prompts {
            cache.reserve(slot, p.len() as i64);
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
                        cache.write(l, slot, 0, &k.narrow(1, s, n), &v.narrow(1, s, n));
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
        // Each new token's place: its slot's page holding its position
        // (taken now when the position starts a page) and the offset there.
        let stepped: Vec<usize> = tokens.iter().map(|&(s, _)| s).collect();
        for (&s, &p) in stepped.iter().zip(&pos) {
            cache.reserve(s, p + 1);
        }
        let (page_idx, offset_idx) =
            cache.places(stepped.iter().copied().zip(pos.iter().copied()), device);
        // Every layer reads the same places.
        let reads = cache.reads(&stepped, span);
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
                    // k, v: [kv_heads, B, d] → [B, kv_heads, d] at (page, :, offset).
                    let index = [
                        Some(page_idx.shallow_clone()),
                        None,
                        Some(offset_idx.shallow_clone()),
                    ];
                    cache.put(l, index, k, v);
                    let (keys, values) = cache.gather(l, &reads);
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
                        &keys,
                        &values,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Init, ModelConfig};

    fn tiny() -> Llama {
        let raw = serde_json::json!({
            "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6
        });
        let cfg = ModelConfig::from_json(&raw).unwrap();
        Llama::new(cfg, raw, Kind::Float, Device::Cpu, Init::Seeded(1)).unwrap()
    }

    /// The cache's memory follows the tokens held: eight slots of up to
    /// 8192 tokens start with one page each; a long sequence takes pages
    /// as it grows (the pool doubling when none is free) and gives them
    /// back when cleared, for the next sequences to reuse.
    #[test]
    fn pages_follow_the_tokens_held() {
        let model = tiny();
        let mut c = KvCache::paged(&model, 8, 8192, 16);
        assert_eq!((c.pool_pages(), c.page_tokens()), (8, 16));
        let prompt: Vec<i64> = (0..100).map(|i| i % 60).collect();
        let _ = model.prefill(&mut c, &[(3, &prompt)]).unwrap();
        assert_eq!(c.tables[3].len(), 7, "100 tokens in pages of 16");
        assert_eq!(c.pool_pages(), 8, "seven of the eight free pages");
        let _ = model.prefill(&mut c, &[(5, &prompt[..20])]).unwrap();
        assert_eq!(c.pool_pages(), 16, "no page free: the pool doubled");
        for _ in 0..60 {
            let _ = model.decode(&mut c, &[(3, 7), (5, 9)]).unwrap();
        }
        assert_eq!((c.len(3), c.len(5)), (160, 80));
        assert_eq!(c.tables[3].len(), 10);
        assert_eq!(c.pool_pages(), 16, "15 pages held of 16");
        c.clear(3);
        assert_eq!(c.free.len(), 11);
        let _ = model.prefill(&mut c, &[(0, &prompt)]).unwrap();
        assert_eq!(c.pool_pages(), 16, "the cleared slot's pages reused");
        // The static layout would hold 8 × 8192 tokens from the start.
        assert!(c.pool_pages() * c.page_tokens() < 8192 / 16);
    }
}

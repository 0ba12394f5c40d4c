//! A training forward and its backward, with activation checkpointing per
//! decoder layer as an option (`runtime.activation_checkpointing`,
//! Chen et al. 2016, "Training deep nets with sublinear memory cost"; the
//! per-block policy of `torch.utils.checkpoint` in HF ReplicatedTrainer and
//! OLMo-core).
//!
//! Without checkpointing the forward is taped whole and the backward is
//! one pass. With it, the forward runs without autograd and keeps only
//! each layer's input `[T, H]`; the backward first takes the gradient of
//! the last layer's output through the final norm and LM head, then, layer
//! by layer in reverse, recomputes the layer from its saved input with
//! autograd and backpropagates the upstream gradient (what fsdp does per
//! unit, see `train::fsdp`). Activation memory is then one layer's worth
//! plus `L` inputs instead of every layer's intermediates.
//!
//! Both return the gradients with respect to the model's variables rather
//! than accumulating them into `.grad`: the trainers own where gradients
//! accumulate (a float32 flat buffer, or a ZeRO-2 shard).

use tch::{Kind, Tensor};

use super::attention::Attention;
use super::context::{self, RowShard};
use super::llama::{positions, DecoderLayer, Llama};
use super::moe::{Route, Routed, Routes};
use crate::collective::{Collective, CollectiveError};

/// Which of a model's trained variables (by index into a name-sorted
/// list) belong to each part the checkpointed backward visits; a part
/// that does not train (a LoRA job's frozen base) has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VarGroups {
    /// Per decoder layer, the indices of `model.layers.{i}.*`.
    pub layers: Vec<Vec<usize>>,
    pub embed: Option<usize>,
    pub norm: Option<usize>,
    /// The LM head's weight: `lm_head.weight`, or the embedding when tied.
    pub head: Option<usize>,
}

impl VarGroups {
    /// Groups `names` (the trained variables' names, any order) of a model
    /// with `layers` decoder layers whose head is tied to the embedding
    /// when `tied`.
    pub fn new(names: &[String], layers: usize, tied: bool) -> VarGroups {
        let find = |n: &str| names.iter().position(|x| x == n);
        let embed = find("model.embed_tokens.weight");
        let layers = (0..layers)
            .map(|l| {
                let prefix = format!("model.layers.{l}.");
                (0..names.len())
                    .filter(|&i| names[i].starts_with(&prefix))
                    .collect()
            })
            .collect();
        VarGroups {
            layers,
            embed,
            norm: find("model.norm.weight"),
            head: if tied { embed } else { find("lm_head.weight") },
        }
    }
}

/// What the backward needs of a training forward.
pub struct Forward {
    /// The final hidden states after the norm, `[T, H]`, in the graph.
    pub hidden: Tensor,
    /// The load-balancing loss's share of this forward (`Route::aux`
    /// summed over the sparse layers) when routed with one.
    pub aux_share: Option<f64>,
    tape: Tape,
}

enum Tape {
    /// The whole forward is in the autograd graph, with the
    /// load-balancing loss's part when routed with one.
    Full { aux: Option<Tensor> },
    /// Per-layer recomputation.
    Layers {
        ids: Tensor,
        /// The RoPE tables (see `Llama::rope_tables`).
        tables: Vec<(Tensor, Tensor)>,
        cu_seq_lens: Vec<i64>,
        /// Each layer's input (no graph).
        inputs: Vec<Tensor>,
        /// The last layer's output, a leaf that requires grad.
        last: Tensor,
        routes: Routes,
    },
    /// Per-layer recomputation of a rank's share of a row under context
    /// parallelism (`super::context`).
    Context {
        ids: Tensor,
        tables: Vec<(Tensor, Tensor)>,
        inputs: Vec<Tensor>,
        last: Tensor,
        routes: Routes,
        shard: RowShard,
    },
}

impl Llama {
    /// The forward of a packed row for training (see the module docs),
    /// its sparse layers routed by `routes`.
    pub fn forward_train(
        &self,
        input_ids: &[i64],
        cu_seq_lens: &[i64],
        checkpoint: bool,
        routes: &Routes,
    ) -> Forward {
        if !checkpoint {
            let f = self.hidden_routed(input_ids, cu_seq_lens, routes);
            return Forward {
                hidden: f.hidden,
                aux_share: f.aux.as_ref().map(|a| a.double_value(&[])),
                tape: Tape::Full { aux: f.aux },
            };
        }
        let device = self.vs.device();
        let tables = self.rope_tables(&positions(cu_seq_lens));
        let ids = Tensor::from_slice(input_ids).to_device(device);
        let t = input_ids.len() as i64;
        let mode = self.attention;
        let (inputs, x, aux) = self
            .recorded_forward(&ids, &tables, routes, |attn, q, k, v| {
                let (heads, _, d) = attn.shape();
                let out = attn.attend(q, k, v, cu_seq_lens, mode);
                Some(out.transpose(0, 1).reshape([t, heads * d]))
            })
            .expect("the packed attention cannot fail");
        let last = x.detach().set_requires_grad(true);
        Forward {
            hidden: self.norm.forward(&last),
            // One read of the summed share, not one per layer.
            aux_share: aux.map(|a| a.double_value(&[])),
            tape: Tape::Layers {
                ids,
                tables,
                cu_seq_lens: cu_seq_lens.to_vec(),
                inputs,
                last,
                routes: routes.shallow_clone(),
            },
        }
    }

    /// The gradients of `⟨hidden, grad_hidden⟩ + ⟨head, grad_head⟩` (the
    /// chunked loss's, see `loss`), plus the load-balancing loss's part
    /// when the forward was routed with one, with respect to `vars`, the
    /// model's variables as grouped by `groups`; undefined for a variable
    /// the loss does not reach. `grad_hidden` undefined: no loss token, no
    /// gradient.
    pub fn backward_train(
        &self,
        fwd: Forward,
        grad_hidden: &Tensor,
        grad_head: &Tensor,
        vars: &[Tensor],
        groups: &VarGroups,
    ) -> Vec<Tensor> {
        let mut out: Vec<Tensor> = vars.iter().map(|_| Tensor::new()).collect();
        if !grad_hidden.defined() {
            return out;
        }
        let surrogate = self.head_surrogate(&fwd.hidden, grad_hidden, grad_head);
        let (ids, tables, cu_seq_lens, inputs, last, routes) = match fwd.tape {
            Tape::Full { aux } => {
                let surrogate = match aux {
                    Some(a) => surrogate + a,
                    None => surrogate,
                };
                return Tensor::run_backward(&[surrogate], vars, false, false);
            }
            Tape::Layers {
                ids,
                tables,
                cu_seq_lens,
                inputs,
                last,
                routes,
            } => (ids, tables, cu_seq_lens, inputs, last, routes),
            Tape::Context { .. } => {
                unreachable!("a context-parallel forward's backward is backward_train_context")
            }
        };
        let mut upstream = self.tail_backward(surrogate, &last, vars, groups, &mut out);
        for (l, layer) in self.layers.iter().enumerate().rev() {
            let x = inputs[l].detach().set_requires_grad(true);
            let (cos, sin) = &tables[layer.rope];
            let route = routes.layer(layer.sparse);
            let (y, routed) =
                layer.forward_routed(&x, cos, sin, &cu_seq_lens, self.attention, route);
            let surrogate = (&y * &upstream).sum(Kind::Float);
            let surrogate = match routed.aux {
                Some(a) => surrogate + a,
                None => surrogate,
            };
            let mut wrt = vec![x.shallow_clone()];
            wrt.extend(groups.layers[l].iter().map(|&i| vars[i].shallow_clone()));
            let g = Tensor::run_backward(&[surrogate], &wrt, false, false);
            for (k, &i) in groups.layers[l].iter().enumerate() {
                accumulate(&mut out, i, &g[k + 1]);
            }
            upstream = g[0].shallow_clone();
        }
        self.embed_backward_into(&upstream, &ids, groups, &mut out);
        out
    }

    /// `⟨hidden, grad_hidden⟩ + ⟨head, grad_head⟩`, whose gradient is the
    /// chunked loss's (a frozen head, under LoRA, has no `grad_head`).
    fn head_surrogate(&self, hidden: &Tensor, grad_hidden: &Tensor, grad_head: &Tensor) -> Tensor {
        let surrogate = (hidden * grad_hidden).sum(Kind::Float);
        if grad_head.defined() {
            surrogate + (self.lm_head_weight() * grad_head).sum(Kind::Float)
        } else {
            surrogate
        }
    }

    /// Backpropagates `surrogate` through the final norm and the head
    /// (where they train) into `out`; the gradient at the last layer's
    /// output `last`.
    fn tail_backward(
        &self,
        surrogate: Tensor,
        last: &Tensor,
        vars: &[Tensor],
        groups: &VarGroups,
        out: &mut [Tensor],
    ) -> Tensor {
        let tail: Vec<usize> = [groups.norm, groups.head].into_iter().flatten().collect();
        let mut wrt = vec![last.shallow_clone()];
        wrt.extend(tail.iter().map(|&i| vars[i].shallow_clone()));
        let g = Tensor::run_backward(&[surrogate], &wrt, false, false);
        for (k, &i) in tail.iter().enumerate() {
            accumulate(out, i, &g[k + 1]);
        }
        g[0].shallow_clone()
    }

    /// The embedding's gradient, from the ids and the gradient at the
    /// first layer's input (what autograd's embedding backward computes).
    fn embed_backward_into(
        &self,
        upstream: &Tensor,
        ids: &Tensor,
        groups: &VarGroups,
        out: &mut [Tensor],
    ) {
        if let Some(e) = groups.embed {
            let vocab = self.cfg.vocab_size as i64;
            let embed = super::llama::embed_backward(upstream, ids, vocab, self.arch.embed_scale);
            accumulate(out, e, &embed);
        }
    }
}

impl Llama {
    /// The forward per-layer recomputation keeps, without autograd: each
    /// layer's input, the last layer's output and the summed
    /// load-balancing share; `core` is the attention core (see
    /// `DecoderLayer::forward_with`), `None` when it failed (the forward
    /// stops there and returns `None`).
    #[allow(clippy::type_complexity)]
    fn recorded_forward(
        &self,
        ids: &Tensor,
        tables: &[(Tensor, Tensor)],
        routes: &Routes,
        mut core: impl FnMut(&Attention, &Tensor, &Tensor, &Tensor) -> Option<Tensor>,
    ) -> Option<(Vec<Tensor>, Tensor, Option<Tensor>)> {
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut aux: Option<Tensor> = None;
        tch::no_grad(|| {
            let mut x = self.embed(ids);
            for layer in &self.layers {
                let (cos, sin) = &tables[layer.rope];
                let route = routes.layer(layer.sparse);
                let mut ok = true;
                let (y, routed) = layer.forward_with_route(&x, cos, sin, route, |attn, q, k, v| {
                    core(attn, q, k, v).unwrap_or_else(|| {
                        ok = false;
                        zeros_out(attn, q)
                    })
                });
                if !ok {
                    return None;
                }
                add_aux(&mut aux, routed.aux);
                inputs.push(x);
                x = y;
            }
            Some((inputs, x, aux))
        })
    }
}

/// Adds a layer's load-balancing share to the forward's sum.
fn add_aux(sum: &mut Option<Tensor>, share: Option<Tensor>) {
    if let Some(a) = share {
        *sum = Some(match sum.take() {
            Some(s) => s + a,
            None => a,
        });
    }
}

/// A stand-in for the heads' outputs `[n, heads · d]` of a core that
/// failed (its error is returned; the value is never used).
fn zeros_out(attn: &Attention, q: &Tensor) -> Tensor {
    let (h, _, d) = attn.shape();
    Tensor::zeros([q.size()[1], h * d], (q.kind(), q.device()))
}

/// Adds `g` to `out[i]` (an undefined `g` adds nothing).
fn accumulate(out: &mut [Tensor], i: usize, g: &Tensor) {
    if !g.defined() {
        return;
    }
    out[i] = if out[i].defined() {
        &out[i] + g
    } else {
        g.shallow_clone()
    };
}

impl Llama {
    /// [`Self::forward_train`] of this rank's share of a packed row under
    /// context parallelism (`super::context`): `input_ids` are the rank's
    /// tokens (`shard.take` of the row's), every layer's attention runs
    /// over the group `coll`, and the backward is per-layer recomputation
    /// ([`Self::backward_train_context`], called in the same order on every
    /// rank of the group). Sliding-window layers are not supported.
    pub fn forward_train_context(
        &self,
        input_ids: &[i64],
        shard: &RowShard,
        coll: &mut dyn Collective,
        routes: &Routes,
    ) -> anyhow::Result<Forward> {
        anyhow::ensure!(
            self.layers.iter().all(|l| l.self_attn.window().is_none()),
            "context parallelism does not support sliding-window attention layers yet"
        );
        let device = self.vs.device();
        let tables = self.rope_tables(&shard.positions);
        let ids = Tensor::from_slice(input_ids).to_device(device);
        let mut failed: Option<CollectiveError> = None;
        let recorded = self.recorded_forward(&ids, &tables, routes, |attn, q, k, v| {
            match context::group_attention(coll, shard, attn.scale(), q, k, v) {
                Ok((out, ..)) => Some(out),
                Err(e) => {
                    failed = Some(e);
                    None
                }
            }
        });
        if let Some(e) = failed {
            return Err(e.into());
        }
        let (inputs, x, aux) = recorded.expect("a forward that did not fail ran whole");
        let last = x.detach().set_requires_grad(true);
        Ok(Forward {
            hidden: self.norm.forward(&last),
            aux_share: aux.map(|a| a.double_value(&[])),
            tape: Tape::Context {
                ids,
                tables,
                inputs,
                last,
                routes: routes.shallow_clone(),
                shard: shard.clone(),
            },
        })
    }

    /// [`Self::backward_train`] of a [`Self::forward_train_context`]: this
    /// rank's share of the gradients (their sum over the group is the
    /// row's). Each layer is recomputed and backpropagated in two passes:
    /// the part after attention, whose gradient at the attention's output
    /// goes through the attention's backward over the group, then the
    /// projections before it with the gradients of this rank's q, k and v.
    pub fn backward_train_context(
        &self,
        fwd: Forward,
        grad_hidden: &Tensor,
        grad_head: &Tensor,
        vars: &[Tensor],
        groups: &VarGroups,
        coll: &mut dyn Collective,
    ) -> Result<Vec<Tensor>, CollectiveError> {
        let mut out: Vec<Tensor> = vars.iter().map(|_| Tensor::new()).collect();
        let Tape::Context {
            ids,
            tables,
            inputs,
            last,
            routes,
            shard,
        } = fwd.tape
        else {
            unreachable!("backward_train_context takes a forward_train_context");
        };
        // Every rank of the group takes part in every layer's collectives,
        // whether or not it holds a loss token.
        let grad_hidden = if grad_hidden.defined() {
            grad_hidden.shallow_clone()
        } else {
            fwd.hidden.zeros_like()
        };
        let surrogate = self.head_surrogate(&fwd.hidden, &grad_hidden, grad_head);
        let mut upstream = self.tail_backward(surrogate, &last, vars, groups, &mut out);
        for (l, layer) in self.layers.iter().enumerate().rev() {
            let (cos, sin) = &tables[layer.rope];
            let route = routes.layer(layer.sparse);
            let layer_vars: Vec<Tensor> = groups.layers[l]
                .iter()
                .map(|&i| vars[i].shallow_clone())
                .collect();
            let (gx, g) = layer.backward_context(
                &inputs[l],
                (cos, sin),
                route,
                &upstream,
                &layer_vars,
                coll,
                &shard,
            )?;
            for (k, &i) in groups.layers[l].iter().enumerate() {
                accumulate(&mut out, i, &g[k]);
            }
            upstream = gx;
        }
        self.embed_backward_into(&upstream, &ids, groups, &mut out);
        Ok(out)
    }
}

impl DecoderLayer {
    /// This layer without autograd on this rank's share of a row under
    /// context parallelism: its attention runs over the group `coll`.
    pub fn forward_context(
        &self,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        route: Route<'_>,
        coll: &mut dyn Collective,
        shard: &RowShard,
    ) -> Result<(Tensor, Routed), CollectiveError> {
        let mut failed = None;
        let out = tch::no_grad(|| {
            self.forward_with_route(x, cos, sin, route, |attn, q, k, v| {
                match context::group_attention(coll, shard, attn.scale(), q, k, v) {
                    Ok((out, ..)) => out,
                    Err(e) => {
                        failed = Some(e);
                        zeros_out(attn, q)
                    }
                }
            })
        });
        match failed {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// This layer recomputed from its input `x` and backpropagated from
    /// `upstream` under context parallelism (every rank of the group calls
    /// it for the same layer): the gradient of `x` and this rank's share
    /// of each of `vars`' (undefined where none). Two passes: the part
    /// after attention, whose gradient at the attention's output goes
    /// through the attention's backward over the group, then the
    /// projections before it with the gradients of this rank's q, k, v.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_context(
        &self,
        x: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        route: Route<'_>,
        upstream: &Tensor,
        vars: &[Tensor],
        coll: &mut dyn Collective,
        shard: &RowShard,
    ) -> Result<(Tensor, Vec<Tensor>), CollectiveError> {
        let x = x.detach().set_requires_grad(true);
        let mut kept = None;
        let mut failed = None;
        let (y, routed) = self.forward_with_route(&x, cos, sin, route, |attn, q, k, v| {
            match context::group_attention(coll, shard, attn.scale(), q, k, v) {
                Ok((o, saved)) => {
                    let o = o.set_requires_grad(true);
                    kept = Some((
                        q.shallow_clone(),
                        k.shallow_clone(),
                        v.shallow_clone(),
                        saved,
                        o.shallow_clone(),
                        attn.scale(),
                    ));
                    o
                }
                Err(e) => {
                    failed = Some(e);
                    zeros_out(attn, q)
                }
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        let (q, k, v, saved, o, scale) = kept.expect("the core ran");
        let surrogate = (&y * upstream).sum(Kind::Float);
        let surrogate = match routed.aux {
            Some(a) => surrogate + a,
            None => surrogate,
        };
        let mut wrt = vec![x.shallow_clone(), o.shallow_clone()];
        wrt.extend(vars.iter().map(Tensor::shallow_clone));
        let g = Tensor::run_backward(&[surrogate], &wrt, false, false);
        // The layer's output is not needed again (its gradient is in `g`).
        drop(y);
        let (dq, dk, dv) =
            context::group_attention_backward(coll, shard, scale, &o, &g[1], &q, &k, &v, &saved)?;
        // The projections before the attention, with q, k and v's
        // gradients (autograd's vector-Jacobian product as a surrogate).
        let before =
            (&q * &dq).sum(Kind::Float) + (&k * &dk).sum(Kind::Float) + (&v * &dv).sum(Kind::Float);
        let mut wrt = vec![x.shallow_clone()];
        wrt.extend(vars.iter().map(Tensor::shallow_clone));
        let g2 = Tensor::run_backward(&[before], &wrt, false, false);
        let mut grads: Vec<Tensor> = vars.iter().map(|_| Tensor::new()).collect();
        for k in 0..vars.len() {
            accumulate(&mut grads, k, &g[k + 2]);
            accumulate(&mut grads, k, &g2[k + 1]);
        }
        let gx = match (g[0].defined(), g2[0].defined()) {
            (true, true) => &g[0] + &g2[0],
            (true, false) => g[0].shallow_clone(),
            _ => g2[0].shallow_clone(),
        };
        Ok((gx, grads))
    }
}

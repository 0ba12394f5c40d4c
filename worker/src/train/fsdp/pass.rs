//! One microbatch through the FSDP units (see the module above for the
//! schedule): prepare the inputs, forward without autograd, the head's
//! loss and gradient, then the layers' recomputation and backward in
//! reverse and the embedding's gradient.

use std::collections::BTreeMap;

use anyhow::{bail, Context};
use tch::{Kind, Tensor};

use crate::batch::{MicrobatchMeta, PackedBatch, StepNorms};
use crate::collective::Collective;
use crate::error::StepError;
use crate::model::config::MoeSpec;
use crate::model::context::{gather_values, RowShard};
use crate::model::llama::RoutedForward;
use crate::model::{llama, loss, Routes};
use crate::objective::microbatch::{self, ObjectiveOut};
use crate::objective::Objective;

use super::units::{self, head_unit, layer_unit, EMBED, NORM_NAME};
use super::FsdpTrainer;

/// A DPO or policy-gradient microbatch's inputs to the head.
pub(super) struct ObjectiveIn<'a> {
    objective: Objective,
    mb: &'a PackedBatch,
    meta: &'a MicrobatchMeta,
    norms: &'a StepNorms,
    /// Per-row reference log-probs computed here (a LoRA job's live
    /// reference, the base); `None`: the plan's cached ones.
    reference: Option<&'a [f64]>,
}

impl<'a> ObjectiveIn<'a> {
    pub(super) fn new(
        objective: Objective,
        mb: &'a PackedBatch,
        meta: &'a MicrobatchMeta,
        norms: &'a StepNorms,
    ) -> Self {
        ObjectiveIn {
            objective,
            mb,
            meta,
            norms,
            reference: None,
        }
    }

    /// With per-row reference log-probs computed on this rank.
    pub(super) fn with_reference(mut self, reference: Option<&'a [f64]>) -> Self {
        self.reference = reference;
        self
    }

    /// The step's normalisers.
    pub(super) fn norms(&self) -> &StepNorms {
        self.norms
    }

    /// The objective's gradients of the final hidden state and the head
    /// weight, and its sums (no collective).
    pub(super) fn run(
        &self,
        hidden: &Tensor,
        head_w: &Tensor,
        chunk: usize,
        softcap: Option<f64>,
    ) -> anyhow::Result<ObjectiveOut> {
        microbatch::objective(
            &self.objective,
            hidden,
            head_w,
            self.mb,
            self.meta,
            self.norms,
            chunk,
            self.reference,
            softcap,
        )
    }

    /// [`Self::run`] on this rank's share of a row split over `group`
    /// (`hidden` and `targets` are its tokens'): the row's log-probs are
    /// gathered, the objective's math runs on the whole row alike on every
    /// rank, and this rank's tokens take their weights.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_context(
        &self,
        hidden: &Tensor,
        head_w: &Tensor,
        chunk: usize,
        softcap: Option<f64>,
        targets: &[i64],
        shard: &RowShard,
        group: &mut dyn Collective,
    ) -> anyhow::Result<ObjectiveOut> {
        let mine = crate::objective::head::token_logps(hidden, head_w, targets, chunk, softcap)?;
        let lp = gather_values(group, shard, &mine)?;
        let w = microbatch::weights(
            &self.objective,
            self.mb,
            self.meta,
            self.norms,
            &lp,
            self.reference,
        )?;
        let grads = crate::objective::head::weighted_nll(
            hidden,
            head_w,
            targets,
            &shard.take(&w.weights),
            chunk,
            softcap,
        )?;
        Ok(w.into_out(grads))
    }
}

/// Locks a context-parallel group (a poisoned lock still holds it).
pub(super) fn lock(g: &super::Group) -> std::sync::MutexGuard<'_, Box<dyn Collective>> {
    g.lock().unwrap_or_else(|p| p.into_inner())
}

/// The per-microbatch inputs a rank with loss tokens computes on.
pub(super) struct Prepared {
    pub(super) ids: Tensor,
    pub(super) cu_seq_lens: Vec<i64>,
    /// The RoPE tables (a layer takes `tables[layer.rope]`).
    pub(super) tables: Vec<(Tensor, Tensor)>,
    pub(super) targets: Vec<i64>,
    /// Under context parallelism, this rank's share of the row: `ids`,
    /// `tables` and `targets` are then its tokens'.
    pub(super) shard: Option<RowShard>,
    /// How the sparse layers route (the step's load-balancing weights).
    pub(super) routes: Routes,
    /// `1/T` of the SFT loss (0 for the other objectives, which take
    /// their normalisers from [`ObjectiveIn`]).
    scale: f64,
}

/// A rank's loss sums of one microbatch.
#[derive(Debug, Default)]
pub(super) struct HeadSums {
    pub(super) loss_sum: f64,
    pub(super) loss_tokens: u64,
    /// Preference pairs (DPO; 0 otherwise).
    pub(super) pairs: u64,
    /// The objective's extra metric sums (empty for SFT).
    pub(super) extra: BTreeMap<String, f64>,
}

/// What the head computes on a rank with work.
struct HeadOutcome {
    grad_x: Tensor,
    head_grad: Tensor,
    tied_grad: Option<Tensor>,
    sums: HeadSums,
}

impl FsdpTrainer {
    // ---- one microbatch -------------------------------------------------

    /// Checks a microbatch and builds its inputs; `None`: nothing to
    /// compute (padding, or no loss token). `sft_loss_tokens`: the step's
    /// global loss-token count of the SFT loss (`None` for the other
    /// objectives and reference plans). No collective here.
    pub(super) fn prepare(
        &self,
        index: usize,
        mb: &PackedBatch,
        sft_loss_tokens: Option<u64>,
    ) -> anyhow::Result<Option<Prepared>> {
        if mb.is_empty() {
            return Ok(None);
        }
        mb.validate()
            .with_context(|| format!("microbatch {index}"))?;
        if let Some(&bad) = mb
            .input_ids
            .iter()
            .find(|&&t| t as usize >= self.cfg.vocab_size)
        {
            return Err(StepError::data(format!(
                "microbatch {index}: token {bad} outside the vocabulary ({} tokens)",
                self.cfg.vocab_size
            )));
        }
        let targets = loss::shifted_targets(&mb.labels, &mb.cu_seq_lens);
        if targets.iter().all(|&t| t == -100) {
            return Ok(None);
        }
        if sft_loss_tokens == Some(0) {
            return Err(StepError::invalid(format!(
                "microbatch {index}: has loss tokens but the step's global loss-token count is 0"
            )));
        }
        let replay =
            crate::model::moe::replay_tensors(&mb.routing, mb.tokens(), &self.arch, self.device)
                .map_err(|e| StepError::invalid(format!("microbatch {index}: {e}")))?;
        let group = self.context.as_ref().map(|g| {
            let g = lock(g);
            (g.world_size() as i64, g.rank() as i64)
        });
        if group.is_some() && self.arch.moe.is_some() {
            return Err(StepError::invalid(format!(
                "microbatch {index}: context parallelism does not run mixture-of-experts models yet"
            )));
        }
        let (ids, targets, positions, shard) = match group {
            Some((n, r)) => {
                let shard = RowShard::new(&mb.cu_seq_lens, n, r);
                let ids = shard.take(&mb.input_ids);
                let targets = shard.take(&targets);
                (ids, targets, shard.positions.clone(), Some(shard))
            }
            None => {
                let positions = llama::positions(&mb.cu_seq_lens);
                (mb.input_ids.clone(), targets, positions, None)
            }
        };
        let tables = llama::rope_tables(&self.ropes, &positions, self.kind, self.device);
        Ok(Some(Prepared {
            ids: Tensor::from_slice(&ids).to_device(self.device),
            cu_seq_lens: mb.cu_seq_lens.clone(),
            tables,
            targets,
            shard,
            routes: Routes {
                replay,
                aux: self.step_aux.as_ref().map(Tensor::shallow_clone),
            },
            scale: sft_loss_tokens.map_or(0.0, |t| 1.0 / t as f64),
        }))
    }

    /// Runs the embedding and every layer without autograd; returns each
    /// layer's input and the final hidden state (empty without work), and
    /// what the sparse layers routed.
    pub(super) fn forward(
        &mut self,
        p: Option<&Prepared>,
    ) -> anyhow::Result<(Vec<Tensor>, RoutedForward)> {
        let embed = self.gather(EMBED)?;
        let mut x = p.map(|p| {
            let w = self.layouts[EMBED].slots[0].view(&self.compute(&embed));
            tch::no_grad(|| llama::embed(&w, &p.ids, self.embed_scale))
        });
        drop(embed);
        let mut saved = Vec::with_capacity(self.shells.len() + 1);
        let mut routing = RoutedForward::default();
        let group = self.context.clone();
        for l in 0..self.shells.len() {
            let u = layer_unit(l);
            let flat = self.gather(u)?;
            let adapters = self.gather_adapters(l)?;
            if let (Some(p), Some(input)) = (p, x.take()) {
                let shell = &self.shells[l];
                let _bound = shell.bind(&self.compute(&flat), &self.layouts[u]);
                let _adapters = adapters
                    .as_ref()
                    .map(|(a, flat)| shell.bind_adapters(flat, &self.layouts[*a]));
                let (cos, sin) = &p.tables[shell.layer.rope];
                let route = p.routes.layer(shell.layer.sparse);
                let (out, routed) = match (&p.shard, &group) {
                    (Some(shard), Some(g)) => {
                        let mut g = lock(g);
                        let layer = &shell.layer;
                        layer.forward_context(&input, (cos, sin), route, g.as_mut(), shard)?
                    }
                    _ => tch::no_grad(|| {
                        shell.layer.forward_routed(
                            &input,
                            cos,
                            sin,
                            &p.cu_seq_lens,
                            self.attention,
                            route,
                        )
                    }),
                };
                routing.absorb(routed);
                saved.push(input);
                x = Some(out);
            }
        }
        saved.extend(x);
        Ok((saved, routing))
    }

    /// Layer `l`'s adapter unit and its gathered float32 values (a
    /// collective on every rank; `None` without adapters on the layer).
    pub(super) fn gather_adapters(&mut self, l: usize) -> anyhow::Result<Option<(usize, Tensor)>> {
        let Some(a) = self.lora.as_ref().and_then(|lora| lora.units[l]) else {
            return Ok(None);
        };
        Ok(Some((a, self.gather(a)?)))
    }

    /// The MoE spec when the load-balancing loss is on.
    pub(super) fn aux_spec(&self) -> Option<MoeSpec> {
        self.arch.moe.filter(|m| m.aux_loss_coef > 0.0)
    }

    /// Final norm, chunked LM head + loss (the SFT cross-entropy, or the
    /// objective's weighted NLL when `obj` is given), and the head's
    /// gradient (reduce-scattered). Returns the gradient of the final
    /// hidden state and the loss sums on a rank with work.
    pub(super) fn head(
        &mut self,
        index: usize,
        p: Option<&Prepared>,
        last: Option<&Tensor>,
        obj: Option<&ObjectiveIn<'_>>,
    ) -> anyhow::Result<(Option<Tensor>, Option<HeadSums>)> {
        let hu = head_unit(self.shells.len());
        let tied = self.cfg.tie_word_embeddings;
        let head_flat = self.gather(hu)?;
        let embed_flat = if tied {
            Some(self.gather(EMBED)?)
        } else {
            None
        };
        let outcome = match (p, last) {
            (Some(p), Some(x)) => {
                Some(self.head_loss(index, p, x, &head_flat, embed_flat.as_ref(), obj))
            }
            _ => None,
        };
        drop((head_flat, embed_flat));
        let bad = matches!(outcome, Some(Err(_)));
        let [bad_ranks] = self.agree(index, "loss", [bad as u8 as f32])?;
        let outcome = outcome.transpose()?;
        if bad_ranks > 0.0 {
            return Err(StepError::non_finite(format!(
                "microbatch {index}: abandoned, another rank's loss was not finite"
            )));
        }
        let (grad_x, head_grad, tied_grad, loss) = match outcome {
            Some(o) => (Some(o.grad_x), o.head_grad, o.tied_grad, Some(o.sums)),
            None => (
                None,
                self.layouts[hu].zeros(self.device),
                tied.then(|| self.layouts[EMBED].zeros(self.device)),
                None,
            ),
        };
        // A LoRA job's head is frozen: nothing to reduce.
        if self.trains(hu) {
            self.scatter_grad(hu, head_grad)?;
        }
        if let Some(g) = tied_grad.filter(|_| self.trains(EMBED)) {
            self.scatter_grad(EMBED, g)?;
        }
        Ok((grad_x, loss))
    }

    /// The head on this rank's microbatch (no collective).
    fn head_loss(
        &mut self,
        index: usize,
        p: &Prepared,
        x: &Tensor,
        head_flat: &Tensor,
        embed_flat: Option<&Tensor>,
        obj: Option<&ObjectiveIn<'_>>,
    ) -> anyhow::Result<HeadOutcome> {
        let hu = head_unit(self.shells.len());
        let w = self.compute(head_flat);
        let layout = &self.layouts[hu];
        let slot = |name: &str| layout.slots.iter().find(|s| s.name == name);
        let norm_w = slot(NORM_NAME)
            .context("head unit has no final norm")?
            .view(&w)
            .detach()
            .set_requires_grad(true);
        let head_w = match embed_flat {
            Some(e) => self.layouts[EMBED].slots[0].view(&self.compute(e)),
            None => slot(units::LM_HEAD_NAME)
                .context("head unit has no lm_head")?
                .view(&w),
        };
        let x = x.detach().set_requires_grad(true);
        self.norm.weight = norm_w.shallow_clone();
        let hidden = self.norm.forward(&x);
        self.norm.weight = Tensor::empty([0], (self.kind, self.device));
        let head_trains = self.trains(hu);
        let (chunked, pairs, extra) = match obj {
            None => loss::chunked_nll_with(
                &hidden,
                &head_w,
                &p.targets,
                self.loss_chunk_tokens,
                p.scale,
                self.arch.final_softcap,
                head_trains,
            )
            .map(|c| (c, 0, BTreeMap::new())),
            Some(o) => match (&p.shard, self.context.clone()) {
                (Some(shard), Some(g)) => o.run_context(
                    &hidden,
                    &head_w,
                    self.loss_chunk_tokens,
                    self.arch.final_softcap,
                    &p.targets,
                    shard,
                    lock(&g).as_mut(),
                ),
                _ => o.run(
                    &hidden,
                    &head_w,
                    self.loss_chunk_tokens,
                    self.arch.final_softcap,
                ),
            }
            .map(|out| {
                let mut c = out.grads;
                // The objective's own sums, not Σ w·nll.
                (c.loss_sum, c.loss_tokens) = (out.loss_sum, out.loss_tokens);
                (c, out.pairs, out.extra)
            }),
        }
        .with_context(|| format!("microbatch {index}"))?;
        let mut chunked = chunked;
        if !chunked.grad_hidden.defined() {
            if p.shard.is_none() {
                bail!("microbatch {index}: the loss has no gradient (no loss token)");
            }
            // A row's share without a loss token: the group's layers
            // still run over it, with a zero gradient.
            chunked.grad_hidden = hidden.zeros_like();
            chunked.grad_weight = head_w.zeros_like();
        }
        let surrogate = (&hidden * &chunked.grad_hidden).sum(Kind::Float);
        let g = Tensor::run_backward(&[surrogate], &[&x, &norm_w], false, false);
        let layout = &self.layouts[hu];
        let (head_grad, tied_grad) = if head_trains {
            let parts: Vec<Tensor> = layout
                .slots
                .iter()
                .map(|s| {
                    if s.name == NORM_NAME {
                        g[1].shallow_clone()
                    } else {
                        chunked.grad_weight.shallow_clone()
                    }
                })
                .collect();
            (
                layout.flatten(&parts),
                embed_flat.map(|_| chunked.grad_weight.reshape([-1]).to_kind(Kind::Float)),
            )
        } else {
            (Tensor::new(), None)
        };
        Ok(HeadOutcome {
            grad_x: g[0].shallow_clone(),
            head_grad,
            tied_grad,
            sums: HeadSums {
                loss_sum: chunked.loss_sum,
                loss_tokens: chunked.loss_tokens,
                pairs,
                extra,
            },
        })
    }

    /// Layers in reverse (gather, recompute, backward, reduce-scatter),
    /// then the embedding's gradient.
    pub(super) fn backward(
        &mut self,
        p: Option<&Prepared>,
        saved: &[Tensor],
        mut grad: Option<Tensor>,
    ) -> anyhow::Result<()> {
        let group = self.context.clone();
        for l in (0..self.shells.len()).rev() {
            let u = layer_unit(l);
            let flat = self.gather(u)?;
            let adapters = self.gather_adapters(l)?;
            // The unit whose gradient this layer produces: its own, or a
            // LoRA job's adapters (none when the layer has no adapter).
            let target = match &self.lora {
                Some(_) => adapters.as_ref().map(|(a, _)| *a),
                None => Some(u),
            };
            let flat_grad = match (p, grad.take()) {
                (Some(p), Some(gy)) => {
                    let shell = &self.shells[l];
                    let _bound = shell.bind(&self.compute(&flat), &self.layouts[u]);
                    let _adapters = adapters
                        .as_ref()
                        .map(|(a, flat)| shell.bind_adapters(flat, &self.layouts[*a]));
                    let (cos, sin) = &p.tables[shell.layer.rope];
                    let route = p.routes.layer(shell.layer.sparse);
                    if let (Some(shard), Some(g)) = (&p.shard, &group) {
                        let vars = match target {
                            Some(t) if t != u => shell.adapter_vars(),
                            Some(_) => shell.vars(),
                            None => Vec::new(),
                        };
                        let (gx, grads) = shell.layer.backward_context(
                            &saved[l],
                            (cos, sin),
                            route,
                            &gy,
                            &vars,
                            lock(g).as_mut(),
                            shard,
                        )?;
                        grad = Some(gx);
                        let grads: Vec<Tensor> = grads
                            .into_iter()
                            .zip(&vars)
                            .map(|(g, v)| if g.defined() { g } else { v.zeros_like() })
                            .collect();
                        target.map(|t| self.layouts[t].flatten(&grads))
                    } else {
                        let x = saved[l].detach().set_requires_grad(true);
                        let (y, routed) = shell.layer.forward_routed(
                            &x,
                            cos,
                            sin,
                            &p.cu_seq_lens,
                            self.attention,
                            route,
                        );
                        let surrogate = (&y * &gy).sum(Kind::Float);
                        let surrogate = match routed.aux {
                            Some(a) => surrogate + a,
                            None => surrogate,
                        };
                        let mut inputs = vec![x];
                        match target {
                            Some(t) if t != u => inputs.extend(shell.adapter_vars()),
                            Some(_) => inputs.extend(shell.vars()),
                            None => {}
                        }
                        let mut grads = Tensor::run_backward(&[surrogate], &inputs, false, false);
                        let gx = grads.remove(0);
                        grad = Some(gx);
                        target.map(|t| self.layouts[t].flatten(&grads))
                    }
                }
                _ => target.map(|t| self.layouts[t].zeros(self.device)),
            };
            drop((flat, adapters));
            if let (Some(t), Some(g)) = (target, flat_grad) {
                self.scatter_grad(t, g)?;
            }
        }
        if !self.trains(EMBED) {
            return Ok(());
        }
        let embed_grad = match (p, grad) {
            (Some(p), Some(g0)) => {
                let vocab = self.cfg.vocab_size as i64;
                llama::embed_backward(&g0, &p.ids, vocab, self.embed_scale)
                    .reshape([-1])
                    .to_kind(Kind::Float)
            }
            _ => self.layouts[EMBED].zeros(self.device),
        };
        self.scatter_grad(EMBED, embed_grad)
    }
}

//! The FSDP trainer under the job's objective: one microbatch of any
//! objective (SFT's cross-entropy, or DPO / policy gradient through the
//! log-prob head of `crate::objective`, with cached reference log-probs
//! from the plan), and the forward-only reference plans.
//!
//! Reference plans need the job's INITIAL weights. FSDP keeps no frozen
//! copy (that would be a full model per rank), so they run on the sharded
//! parameters themselves, which are the initial ones until the first
//! optimizer step: the coordinator runs the cached reference pass before
//! step 1. A reference plan after training started (only a coordinator
//! restart with an incomplete cache leads there) is refused on every rank.

use anyhow::{anyhow, Context};
use tch::Tensor;

use super::pass::{HeadSums, ObjectiveIn, Prepared};
use super::units::{self, head_unit, EMBED, NORM_NAME};
use super::FsdpTrainer;
use crate::batch::{MicrobatchMeta, MicrobatchOutcome, PackedBatch, SequenceLogp, StepNorms};
use crate::error::StepError;
use crate::model::loss;
use crate::objective::head;
use crate::objective::Objective;
use crate::train::routing;
use crate::train::trainer::Passes;

impl FsdpTrainer {
    /// One microbatch: SFT when `obj` is `None` (scaled by
    /// `1/global_loss_tokens`), else the objective's weighted head.
    pub(super) fn run_microbatch(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        obj: Option<&ObjectiveIn<'_>>,
        global_loss_tokens: u64,
    ) -> anyhow::Result<MicrobatchOutcome> {
        let sums = MicrobatchOutcome {
            tokens: mb.tokens() as u64,
            ..Default::default()
        };
        let sft_tokens = obj.is_none().then_some(global_loss_tokens);
        // Outside a step (probes, tests) the loss takes this microbatch
        // index's counts over the ranks.
        let lone = self.aux_spec().is_some() && self.step_aux.is_none();
        if lone {
            self.begin_step(std::slice::from_ref(mb))?;
        }
        let result = self.run_prepared(index, mb, obj, sft_tokens, sums);
        if lone {
            self.step_aux = None;
        }
        result
    }

    fn run_prepared(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        obj: Option<&ObjectiveIn<'_>>,
        sft_tokens: Option<u64>,
        mut sums: MicrobatchOutcome,
    ) -> anyhow::Result<MicrobatchOutcome> {
        let prep = self.prepare_agreed(index, mb, sft_tokens)?;
        let Some(prep) = prep else {
            return Ok(sums);
        };
        let keys = self.dropout_keys(mb);
        let (saved, routing) =
            crate::model::lora::with_dropout(keys.clone(), || self.forward(prep.as_ref()))?;
        let obj_norms = match obj {
            Some(o) => Some(*o.norms()),
            None => sft_tokens.map(|t| StepNorms {
                loss_tokens: t,
                ..StepNorms::default()
            }),
        };
        let (grad_x, loss) = self.head(index, prep.as_ref(), saved.last(), obj)?;
        let HeadSums {
            loss_sum,
            loss_tokens,
            pairs,
            extra,
        } = loss.unwrap_or_default();
        // Context parallelism: SFT's sums are this rank's tokens'; every
        // rank of the group reports the row's (an objective's already are).
        let (loss_sum, loss_tokens) = match (&self.context, obj) {
            (Some(g), None) => {
                let shares = [loss_sum, loss_tokens as f64];
                let row = crate::model::context::sum_values(super::pass::lock(g).as_mut(), &shares)
                    .with_context(|| {
                        format!("microbatch {index}: summing the loss over the group")
                    })?;
                (row[0], row[1].round() as u64)
            }
            _ => (loss_sum, loss_tokens),
        };
        sums.loss_sum = loss_sum;
        sums.loss_tokens = loss_tokens;
        sums.pairs = pairs;
        sums.extra = extra;
        if let Some(norms) = obj_norms {
            let share = routing.aux.map(|a| a.double_value(&[]));
            routing::report(&mut sums.extra, share, self.aux_spec(), &norms, mb);
        }
        crate::model::lora::with_dropout(keys, || self.backward(prep.as_ref(), &saved, grad_x))?;
        Ok(sums)
    }

    /// [`prepare`](Self::prepare) and the opening all-reduce: `None` when
    /// no rank has work (every rank skips the microbatch), else this
    /// rank's inputs (`Some(None)`: it joins with zeros). A rank that
    /// failed to prepare fails every rank.
    fn prepare_agreed(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        sft_loss_tokens: Option<u64>,
    ) -> anyhow::Result<Option<Option<Prepared>>> {
        self.prepare_checked(index, mb, sft_loss_tokens, Ok(()))
    }

    fn prepare_checked(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        sft_loss_tokens: Option<u64>,
        allowed: anyhow::Result<()>,
    ) -> anyhow::Result<Option<Option<Prepared>>> {
        let local = allowed.and_then(|()| self.prepare(index, mb, sft_loss_tokens));
        let flags = match &local {
            Ok(Some(_)) => [1.0, 0.0],
            Ok(None) => [0.0, 0.0],
            Err(_) => [0.0, 1.0],
        };
        let [working, failed] = self.agree(index, "work", flags)?;
        let prep = local?;
        if failed > 0.0 {
            return Err(StepError::invalid(format!(
                "microbatch {index}: abandoned, another rank failed to prepare it"
            )));
        }
        Ok((working > 0.0).then_some(prep))
    }

    fn sharded_logps(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        allowed: anyhow::Result<()>,
        per_token: bool,
    ) -> anyhow::Result<Vec<SequenceLogp>> {
        let (lp, targets) = self.sharded_token_logps(index, mb, allowed)?;
        if mb.is_empty() {
            return Ok(Vec::new());
        }
        head::reference_sequences(&lp, &targets, &mb.cu_seq_lens, per_token)
            .with_context(|| format!("microbatch {index}"))
    }

    /// Every row's target log-prob (0 without a target) and the targets,
    /// forward only under the sharded weights (a collective).
    fn sharded_token_logps(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        allowed: anyhow::Result<()>,
    ) -> anyhow::Result<(Vec<f64>, Vec<i64>)> {
        let prep = self.prepare_checked(index, mb, None, allowed)?;
        let targets = if mb.is_empty() {
            Vec::new()
        } else {
            loss::shifted_targets(&mb.labels, &mb.cu_seq_lens)
        };
        // Rows without a target have log-prob 0 (as `head::token_logps`).
        let mut lp = vec![0.0; targets.len()];
        if let Some(prep) = prep {
            let (saved, _) = self.forward(prep.as_ref())?;
            let got = self.head_logps(prep.as_ref(), saved.last());
            let bad = match &got {
                Ok(Some(l)) => !l.iter().all(|x| x.is_finite()),
                Ok(None) => false,
                Err(_) => true,
            };
            let [bad_ranks] = self.agree(index, "reference log-probs", [bad as u8 as f32])?;
            if let Some(l) = got.with_context(|| format!("microbatch {index}"))? {
                lp = l;
            }
            if bad_ranks > 0.0 && !bad {
                return Err(StepError::non_finite(format!(
                    "microbatch {index}: abandoned, another rank's reference log-probs failed"
                )));
            }
        }
        Ok((lp, targets))
    }

    /// Gathers the head (and the tied embedding) and, on a rank with work,
    /// every row's target log-prob without autograd.
    fn head_logps(
        &mut self,
        p: Option<&Prepared>,
        last: Option<&Tensor>,
    ) -> anyhow::Result<Option<Vec<f64>>> {
        let hu = head_unit(self.shells.len());
        let head_flat = self.gather(hu)?;
        let embed_flat = if self.cfg.tie_word_embeddings {
            Some(self.gather(EMBED)?)
        } else {
            None
        };
        let (Some(p), Some(x)) = (p, last) else {
            return Ok(None);
        };
        let w = self.compute(&head_flat);
        let layout = &self.layouts[hu];
        let slot = |name: &str| layout.slots.iter().find(|s| s.name == name);
        let norm_w = slot(NORM_NAME)
            .ok_or_else(|| anyhow!("head unit has no final norm"))?
            .view(&w);
        let head_w = match &embed_flat {
            Some(e) => self.layouts[EMBED].slots[0].view(&self.compute(e)),
            None => slot(units::LM_HEAD_NAME)
                .ok_or_else(|| anyhow!("head unit has no lm_head"))?
                .view(&w),
        };
        self.norm.weight = norm_w;
        let hidden = tch::no_grad(|| self.norm.forward(x));
        self.norm.weight = Tensor::empty([0], (self.kind, self.device));
        let lp = head::token_logps(
            &hidden,
            &head_w,
            &p.targets,
            self.loss_chunk_tokens,
            self.arch.final_softcap,
        )?;
        // Context parallelism: this rank's tokens'; the row's gathered.
        match (&p.shard, &self.context) {
            (Some(shard), Some(g)) => {
                let row = crate::model::context::gather_values(
                    super::pass::lock(g).as_mut(),
                    shard,
                    &lp,
                )?;
                Ok(Some(row))
            }
            _ => Ok(Some(lp)),
        }
    }
}

impl Passes for FsdpTrainer {
    /// Forward + backward of one microbatch under the job's objective with
    /// the step's global normalisers (a
    /// collective: every rank calls it for every microbatch index, padding
    /// ones included). Gradient shards accumulate.
    fn train_microbatch(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        meta: &MicrobatchMeta,
        norms: &StepNorms,
    ) -> anyhow::Result<MicrobatchOutcome> {
        let objective = self.objective;
        if objective == Objective::Sft {
            return self.run_microbatch(index, mb, None, norms.loss_tokens);
        }
        // A LoRA job's live reference: the base (adapters off), forward
        // only over the same shards before the training pass.
        let live = if self.lora.is_some() && objective.live_reference() {
            let (lp, _) = self.without_adapters(|t| t.sharded_token_logps(index, mb, Ok(())))?;
            Some(lp)
        } else {
            None
        };
        let obj = ObjectiveIn::new(objective, mb, meta, norms).with_reference(live.as_deref());
        self.run_microbatch(index, mb, Some(&obj), norms.loss_tokens)
    }

    /// Each sequence's log-prob (Σ over its loss tokens), loss-token count
    /// and, for a policy-gradient job, per-token log-probs
    /// (`head::token_aligned`) under the job's initial weights, forward
    /// only (a collective: every rank calls it for every microbatch index
    /// of the reference plan, empty ones included). Refused on every rank
    /// once any rank has trained or was restored from a checkpoint.
    fn reference_logps(
        &mut self,
        index: usize,
        mb: &PackedBatch,
    ) -> anyhow::Result<Vec<SequenceLogp>> {
        let per_token = matches!(self.objective, Objective::Pg { .. });
        if self.lora.is_some() {
            // The base is frozen: its log-probs are the reference at any step.
            return self.without_adapters(|t| t.sharded_logps(index, mb, Ok(()), per_token));
        }
        let allowed = if self.restored || self.opt.step > 0 {
            Err(anyhow!(
                "fsdp reference plan after training started (optimizer step {}{}): fsdp keeps no \
                 copy of the initial weights, so the cached reference pass must complete before \
                 step 1 (a coordinator restart with an incomplete reference cache leads here)",
                self.opt.step,
                if self.restored {
                    ", restored from a checkpoint"
                } else {
                    ""
                }
            ))
        } else {
            Ok(())
        };
        self.sharded_logps(index, mb, allowed, per_token)
    }

    /// Each sequence's log-prob under the current (sharded) weights,
    /// forward only: eval plans (a collective, like the reference's).
    fn eval_logps(&mut self, index: usize, mb: &PackedBatch) -> anyhow::Result<Vec<SequenceLogp>> {
        self.sharded_logps(index, mb, Ok(()), false)
    }

    fn zero_grad(&mut self) {
        for g in &mut self.grads {
            let _ = g.zero_();
        }
        self.step_aux = None;
    }

    fn needs_whole_step(&self) -> bool {
        self.aux_spec().is_some()
    }

    /// Counts the step's routing (a forward per microbatch index, every
    /// rank joins) and sums it over the ranks (`train::routing`).
    fn begin_step(&mut self, batches: &[PackedBatch]) -> anyhow::Result<()> {
        self.step_aux = None;
        let Some(spec) = self.aux_spec() else {
            return Ok(());
        };
        let mut local = vec![0i64; spec.experts];
        for (i, mb) in batches.iter().enumerate() {
            let Some(prep) = self.prepare_agreed(i, mb, None)? else {
                continue;
            };
            // Routed as the training forward will be, dropout included.
            let keys = self.dropout_keys(mb);
            let (_, routing) =
                crate::model::lora::with_dropout(keys, || self.forward(prep.as_ref()))?;
            routing.add_counts(&mut local)?;
        }
        let counts = routing::reduce_counts(self.coll.as_mut(), &local)?;
        self.step_aux = routing::aux_weights(&counts, &spec, self.device);
        Ok(())
    }

    fn grads_finite(&self) -> bool {
        crate::train::finite::all_finite(&self.grads)
    }

    fn collective_per_microbatch(&self) -> bool {
        true
    }

    fn model_flops(&self, cu_seq_lens: &[i64], loss_tokens: u64) -> f64 {
        let cfg = self.model_config();
        if self.lora.is_some() {
            let adapters: usize = (0..self.layouts.len())
                .filter(|&u| self.trains(u))
                .map(|u| self.layouts[u].numel)
                .sum();
            return crate::model::flops::lora_training_flops(
                cfg,
                cu_seq_lens,
                loss_tokens,
                adapters as f64,
            );
        }
        crate::model::flops::training_flops(cfg, cu_seq_lens, loss_tokens)
    }
}

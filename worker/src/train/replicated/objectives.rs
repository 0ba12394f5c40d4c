//! The trainer under the job's objective: SFT goes through the plain
//! chunked loss (`ReplicatedTrainer::microbatch`); DPO and policy gradient through the
//! log-prob head (`crate::objective`), with reference log-probs from the
//! plan (cached pass) or a frozen copy of the initial model (live). Also
//! the forward-only reference plans.

use anyhow::Context;
use tch::Tensor;

use super::{reference_model, ReplicatedTrainer, Sharding};
use crate::batch::{MicrobatchMeta, MicrobatchOutcome, PackedBatch, SequenceLogp, StepNorms};
use crate::collective::Collective;
use crate::model::context::{gather_values, RowShard};
use crate::model::{loss, Llama, Routes};
use crate::objective::head;
use crate::objective::microbatch;
use crate::objective::Objective;
use crate::train::trainer::Passes;

/// Per-token log-probs of this rank's share of a row (`ids`, `targets`:
/// its tokens) under `model`, without autograd; the group's collectives
/// run inside.
fn context_logps(
    model: &Llama,
    ids: &[i64],
    shard: &RowShard,
    targets: &[i64],
    chunk: usize,
    group: &mut dyn Collective,
) -> anyhow::Result<Vec<f64>> {
    tch::no_grad(|| {
        let f = model.forward_train_context(ids, shard, group, &Routes::default())?;
        head::token_logps(
            &f.hidden,
            model.lm_head_weight(),
            targets,
            chunk,
            model.arch.final_softcap,
        )
    })
}

/// Per-token reference log-probs of `mb` under `model`, without autograd.
fn reference_token_logps(
    model: &Llama,
    mb: &PackedBatch,
    targets: &[i64],
    chunk: usize,
) -> anyhow::Result<Vec<f64>> {
    tch::no_grad(|| {
        let hidden = model.hidden(&mb.input_ids, &mb.cu_seq_lens);
        head::token_logps(
            &hidden,
            model.lm_head_weight(),
            targets,
            chunk,
            model.arch.final_softcap,
        )
    })
}

impl ReplicatedTrainer {
    /// Per-token log-probs of `mb`'s row under `model`, forward only (the
    /// reference and eval passes): the whole row here, or under context
    /// parallelism each rank's share, gathered over the group (the same
    /// values on every rank of it).
    fn row_logps(
        &self,
        model: &Llama,
        mb: &PackedBatch,
        targets: &[i64],
    ) -> anyhow::Result<Vec<f64>> {
        let chunk = self.loss_chunk_tokens;
        let Some(group) = &self.context else {
            return reference_token_logps(model, mb, targets, chunk);
        };
        let mut group = group.lock().unwrap_or_else(|p| p.into_inner());
        let group = group.as_mut();
        let shard = RowShard::new(
            &mb.cu_seq_lens,
            group.world_size() as i64,
            group.rank() as i64,
        );
        let ids = shard.take(&mb.input_ids);
        let mine = context_logps(model, &ids, &shard, &shard.take(targets), chunk, group)?;
        Ok(gather_values(group, &shard, &mine)?)
    }

    /// The sums and gradients of one microbatch under the job's objective
    /// (nothing applied).
    pub(super) fn objective_grads(
        &self,
        index: usize,
        mb: &PackedBatch,
        meta: &MicrobatchMeta,
        norms: &StepNorms,
    ) -> anyhow::Result<(MicrobatchOutcome, Vec<Tensor>)> {
        let objective = self.objective;
        if objective == Objective::Sft {
            return self.sft_grads(index, mb, norms.loss_tokens);
        }
        if let Some(group) = &self.context {
            let mut group = group.lock().unwrap_or_else(|p| p.into_inner());
            return self.objective_grads_context(index, mb, meta, norms, group.as_mut());
        }
        let mut sums = MicrobatchOutcome {
            tokens: mb.tokens() as u64,
            ..Default::default()
        };
        if mb.is_empty() {
            return Ok((sums, Vec::new()));
        }
        mb.validate()
            .with_context(|| format!("microbatch {index}"))?;
        self.check_vocabulary(index, mb)?;
        let targets = loss::shifted_targets(&mb.labels, &mb.cu_seq_lens);
        let chunk = self.loss_chunk_tokens;
        let live = match &self.reference {
            Some(r) => Some(reference_token_logps(r, mb, &targets, chunk)?),
            // LoRA: the base with the adapters off, no copy.
            None if self.lora() && self.objective.live_reference() => {
                let net = self.net();
                Some(net.without_adapters(|| reference_token_logps(net, mb, &targets, chunk))?)
            }
            None => None,
        };
        let net = self.net();
        let routes = self.routes(index, mb)?;
        let keys = self.dropout_keys(mb);
        let fwd = crate::model::lora::with_dropout(keys.clone(), || {
            net.forward_train(&mb.input_ids, &mb.cu_seq_lens, self.checkpointing, &routes)
        });
        let aux_share = fwd.aux_share;
        let head_w = net.lm_head_weight();
        let out = microbatch::objective(
            &objective,
            &fwd.hidden,
            head_w,
            mb,
            meta,
            norms,
            chunk,
            live.as_deref(),
            net.arch.final_softcap,
        )
        .with_context(|| format!("microbatch {index}"))?;
        let grads = crate::model::lora::with_dropout(keys, || {
            net.backward_train(
                fwd,
                &out.grads.grad_hidden,
                &out.grads.grad_weight,
                &self.compute_params,
                &self.groups,
            )
        });
        sums.loss_sum = out.loss_sum;
        sums.loss_tokens = out.loss_tokens;
        sums.pairs = out.pairs;
        sums.extra = out.extra;
        self.report_routing(aux_share, norms, mb, &mut sums);
        Ok((sums, grads))
    }

    /// [`Self::objective_grads`] of this rank's share of `mb`'s row under
    /// context parallelism: each rank computes its tokens' log-probs (and
    /// a live reference's), the row's are gathered over the group, the
    /// objective's math runs on the whole row alike on every rank, and each
    /// rank backpropagates its own tokens' weights. Every rank reports the
    /// row's sums (the objective's, computed alike on every rank).
    fn objective_grads_context(
        &self,
        index: usize,
        mb: &PackedBatch,
        meta: &MicrobatchMeta,
        norms: &StepNorms,
        group: &mut dyn Collective,
    ) -> anyhow::Result<(MicrobatchOutcome, Vec<Tensor>)> {
        let mut sums = MicrobatchOutcome::default();
        if mb.is_empty() {
            return Ok((sums, Vec::new()));
        }
        mb.validate()
            .with_context(|| format!("microbatch {index}"))?;
        self.check_vocabulary(index, mb)?;
        let net = self.net();
        if self.model.arch.moe.is_some() || self.dropout_keys(mb).is_some() {
            return Err(crate::error::StepError::invalid(format!(
                "microbatch {index}: context parallelism does not run mixture-of-experts models or LoRA dropout yet"
            )));
        }
        let targets = loss::shifted_targets(&mb.labels, &mb.cu_seq_lens);
        let (ranks, rank) = (group.world_size() as i64, group.rank() as i64);
        let shard = RowShard::new(&mb.cu_seq_lens, ranks, rank);
        let ids = shard.take(&mb.input_ids);
        let local = shard.take(&targets);
        let chunk = self.loss_chunk_tokens;
        let reference = match &self.reference {
            Some(r) => Some(context_logps(r, &ids, &shard, &local, chunk, group)?),
            // LoRA: the base with the adapters off, no copy.
            None if self.lora() && self.objective.live_reference() => Some(
                net.without_adapters(|| context_logps(net, &ids, &shard, &local, chunk, group))?,
            ),
            None => None,
        };
        let live = match reference {
            Some(l) => Some(gather_values(group, &shard, &l)?),
            None => None,
        };
        let fwd = net
            .forward_train_context(&ids, &shard, group, &Routes::default())
            .with_context(|| format!("microbatch {index}"))?;
        let head_w = net.lm_head_weight();
        let softcap = net.arch.final_softcap;
        let mine = head::token_logps(&fwd.hidden, head_w, &local, chunk, softcap)?;
        let lp = gather_values(group, &shard, &mine)?;
        let w = microbatch::weights(&self.objective, mb, meta, norms, &lp, live.as_deref())
            .with_context(|| format!("microbatch {index}"))?;
        let out = head::weighted_nll(
            &fwd.hidden,
            head_w,
            &local,
            &shard.take(&w.weights),
            chunk,
            softcap,
        )
        .with_context(|| format!("microbatch {index}"))?;
        let grads = net.backward_train_context(
            fwd,
            &out.grad_hidden,
            &out.grad_weight,
            &self.compute_params,
            &self.groups,
            group,
        )?;
        sums.tokens = mb.tokens() as u64;
        sums.loss_sum = w.loss_sum;
        sums.loss_tokens = w.loss_tokens;
        sums.pairs = w.pairs;
        sums.extra = w.extra;
        Ok((sums, grads))
    }

    /// Each sequence's log-prob (Σ over its loss tokens) and loss-token
    /// count under the job's INITIAL weights, forward only: the model
    /// itself while it has not trained, else a frozen copy built from the
    /// job's init (kept for later reference plans).
    pub fn sequence_logps(
        &mut self,
        index: usize,
        mb: &PackedBatch,
    ) -> anyhow::Result<Vec<(f64, u64)>> {
        Ok(self
            .reference_logps(index, mb)?
            .into_iter()
            .map(|s| (s.logp, s.loss_tokens))
            .collect())
    }
}

impl Passes for ReplicatedTrainer {
    /// Gradients accumulate (zero2: reduce-scattered into this rank's
    /// shard, every rank joins).
    fn train_microbatch(
        &mut self,
        index: usize,
        mb: &PackedBatch,
        meta: &MicrobatchMeta,
        norms: &StepNorms,
    ) -> anyhow::Result<MicrobatchOutcome> {
        let (sums, grads) = self.objective_grads(index, mb, meta, norms)?;
        self.absorb(&grads)?;
        Ok(sums)
    }

    /// [`Self::sequence_logps`] with, for a policy-gradient job, every
    /// token's log-prob too (the cached reference of its KL penalty).
    fn reference_logps(
        &mut self,
        index: usize,
        mb: &PackedBatch,
    ) -> anyhow::Result<Vec<SequenceLogp>> {
        if mb.is_empty() {
            return Ok(Vec::new());
        }
        mb.validate()
            .with_context(|| format!("microbatch {index}"))?;
        self.check_vocabulary(index, mb)?;
        if !self.pristine && self.reference.is_none() && !self.lora() {
            self.reference = Some(reference_model(&self.init)?);
        }
        let model = match &self.reference {
            Some(r) => r,
            None => self.net(),
        };
        let targets = loss::shifted_targets(&mb.labels, &mb.cu_seq_lens);
        // A LoRA job's reference is its base: the adapters off.
        let lp = model
            .without_adapters(|| self.row_logps(model, mb, &targets))
            .with_context(|| format!("microbatch {index}"))?;
        let per_token = matches!(self.objective, Objective::Pg { .. });
        head::reference_sequences(&lp, &targets, &mb.cu_seq_lens, per_token)
            .with_context(|| format!("microbatch {index}"))
    }

    /// Each sequence's log-prob and loss-token count under the model as it
    /// is now, forward only (eval plans).
    fn eval_logps(&mut self, index: usize, mb: &PackedBatch) -> anyhow::Result<Vec<SequenceLogp>> {
        if mb.is_empty() {
            return Ok(Vec::new());
        }
        mb.validate()
            .with_context(|| format!("microbatch {index}"))?;
        self.check_vocabulary(index, mb)?;
        let targets = loss::shifted_targets(&mb.labels, &mb.cu_seq_lens);
        let lp = self
            .row_logps(&self.model, mb, &targets)
            .with_context(|| format!("microbatch {index}"))?;
        head::reference_sequences(&lp, &targets, &mb.cu_seq_lens, false)
            .with_context(|| format!("microbatch {index}"))
    }

    fn needs_whole_step(&self) -> bool {
        self.aux_spec().is_some()
    }

    /// Counts the step's routing on this rank and sums it over the ranks
    /// (`train::routing`).
    fn begin_step(&mut self, batches: &[PackedBatch]) -> anyhow::Result<()> {
        self.step_aux = None;
        let Some(spec) = self.aux_spec() else {
            return Ok(());
        };
        for (i, mb) in batches.iter().enumerate().filter(|(_, b)| !b.is_empty()) {
            mb.validate().with_context(|| format!("microbatch {i}"))?;
            self.check_vocabulary(i, mb)?;
        }
        let local = self.local_counts(batches)?;
        let counts = crate::train::routing::reduce_counts(self.coll.as_mut(), &local)?;
        self.step_aux = crate::train::routing::aux_weights(&counts, &spec, self.net().vs.device());
        Ok(())
    }

    fn zero_grad(&mut self) {
        self.grads.zero();
        self.step_aux = None;
    }

    fn grads_finite(&self) -> bool {
        self.grads.finite(&self.layout)
    }

    /// The microbatch's own gradients, checked and dropped: nothing is
    /// reduced (a zero2 rank would otherwise sum other ranks' probes in).
    fn probe_microbatch(
        &mut self,
        index: usize,
        batch: &PackedBatch,
        meta: &MicrobatchMeta,
        norms: &StepNorms,
    ) -> anyhow::Result<(MicrobatchOutcome, bool)> {
        self.zero_grad();
        let (o, grads) = self.objective_grads(index, batch, meta, norms)?;
        let finite = o.loss_sum.is_finite() && crate::train::finite::all_finite(&grads);
        Ok((o, finite))
    }

    /// zero2 reduce-scatters every microbatch's gradient.
    fn collective_per_microbatch(&self) -> bool {
        self.sharding == Sharding::Zero2 && self.coll.world_size() > 1
    }

    fn model_flops(&self, cu_seq_lens: &[i64], loss_tokens: u64) -> f64 {
        let cfg = &self.model.cfg;
        if self.lora() {
            let adapters = self.layout.total as f64;
            return crate::model::flops::lora_training_flops(
                cfg,
                cu_seq_lens,
                loss_tokens,
                adapters,
            );
        }
        crate::model::flops::training_flops(cfg, cu_seq_lens, loss_tokens)
    }
}

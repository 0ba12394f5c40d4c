//! The settings of every step of a job: the submitted spec plus the
//! operator's live changes (`accrue set`), in order. One owner (issue 13):
//! every planner path (files, stream, replay, reference pass), the
//! learning-rate schedule, the step manifests and `accrue set`'s checks ask
//! [`Settings`]; nothing else reads `batch.*`, `data.max_tokens` or
//! `optimizer.lr` to plan a step.
//!
//! A [`ConfigChange`] takes effect from a given step on and is kept in the
//! job record, so the settings of any step, a re-planned or replayed one
//! included, are a pure function of the spec and the list of changes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::job::batch::StepSize;
use crate::job::limits::{self, DatasetSize, StepShape};
use crate::job::optimizer::{OptimizerSection, Schedule};
use crate::job::section::SpecProblem;
use crate::job::spec::JobSpec;

/// The step settings an operator may change on a running job. `None`
/// leaves a setting as it is.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobUpdate {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docs_per_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// The peak (base) learning rate of the schedule; warmup and decay
    /// continue from the same step with the new base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// A mixture's new weights by source name (sources not named keep
    /// theirs); the interleave restarts from the step it applies to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<BTreeMap<String, f64>>,
}

impl JobUpdate {
    pub fn is_empty(&self) -> bool {
        *self == JobUpdate::default()
    }

    /// `docs_per_step 8, lr 0.0002` (the fields that are set).
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(v) = self.docs_per_step {
            parts.push(format!("docs_per_step {v}"));
        }
        if let Some(v) = self.tokens_per_step {
            parts.push(format!("tokens_per_step {v}"));
        }
        if let Some(v) = self.max_tokens {
            parts.push(format!("max_tokens {v}"));
        }
        if let Some(v) = self.lr {
            parts.push(format!("lr {v}"));
        }
        if let Some(w) = &self.weights {
            let each: Vec<String> = w.iter().map(|(k, v)| format!("{k}={v}")).collect();
            parts.push(format!("weights {}", each.join(",")));
        }
        parts.join(", ")
    }

    /// `self` then `later` (later values win).
    fn merged(self, later: JobUpdate) -> JobUpdate {
        let weights = match (self.weights, later.weights) {
            (Some(mut a), Some(b)) => {
                a.extend(b);
                Some(a)
            }
            (a, b) => b.or(a),
        };
        JobUpdate {
            docs_per_step: later.docs_per_step.or(self.docs_per_step),
            tokens_per_step: later.tokens_per_step.or(self.tokens_per_step),
            max_tokens: later.max_tokens.or(self.max_tokens),
            lr: later.lr.or(self.lr),
            weights,
        }
    }
}

/// An accepted update, persisted in the job record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigChange {
    /// First step planned with it. Steps before it, including an aborted
    /// step re-planned after the change, keep the earlier settings (and so
    /// the same documents).
    pub from_step: u64,
    pub update: JobUpdate,
    pub unix_ms: i64,
}

/// Appends `update` effective from `from_step`; several updates before the
/// same step merge into one change.
pub fn record_change(changes: &mut Vec<ConfigChange>, from_step: u64, update: JobUpdate, now: i64) {
    match changes.last_mut() {
        Some(last) if last.from_step == from_step => {
            last.update = std::mem::take(&mut last.update).merged(update);
            last.unix_ms = now;
        }
        _ => changes.push(ConfigChange {
            from_step,
            update,
            unix_ms: now,
        }),
    }
}

/// The settings one step is planned with (recorded in its manifest).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(from = "StoredSettings", into = "StoredSettings")]
pub struct StepSettings {
    /// How big the step is: the one owner of "docs per step" and what it
    /// implies (rollouts in whole groups).
    pub size: StepSize,
    /// Token budget of one microbatch.
    pub max_tokens: u32,
    /// The schedule's peak learning rate.
    pub base_lr: f64,
}

impl StepSettings {
    pub fn docs_per_step(&self) -> Option<u64> {
        self.size.fields().0
    }

    pub fn tokens_per_step(&self) -> Option<u64> {
        self.size.fields().1
    }

    pub fn microbatches_per_rank(&self) -> Option<u32> {
        self.size.fields().2
    }
}

/// [`StepSettings`] as manifests store it (`[batch]`'s field names).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct StoredSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    docs_per_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tokens_per_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    microbatches_per_rank: Option<u32>,
    max_tokens: u32,
    base_lr: f64,
}

impl From<StoredSettings> for StepSettings {
    fn from(s: StoredSettings) -> Self {
        StepSettings {
            size: StepSize::of(s.docs_per_step, s.tokens_per_step, s.microbatches_per_rank),
            max_tokens: s.max_tokens,
            base_lr: s.base_lr,
        }
    }
}

impl From<StepSettings> for StoredSettings {
    fn from(s: StepSettings) -> Self {
        let (docs_per_step, tokens_per_step, microbatches_per_rank) = s.size.fields();
        StoredSettings {
            docs_per_step,
            tokens_per_step,
            microbatches_per_rank,
            max_tokens: s.max_tokens,
            base_lr: s.base_lr,
        }
    }
}

/// What an update is checked against besides the spec.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpdateContext {
    /// The longest document the job may still train (its id, tokens): a new
    /// `max_tokens` must hold it, since documents are never cut.
    pub longest: Option<(String, u64)>,
    /// A streamed job: (queue capacity, group size). A step must fit the
    /// queue, in whole groups.
    pub stream: Option<(u64, u32)>,
    /// A job reading files: what its dataset holds. A step may not hold
    /// more (see [`crate::job::limits`]).
    pub dataset: Option<DatasetSize>,
}

/// A job's settings: the spec and its live changes.
#[derive(Debug, Clone, Copy)]
pub struct Settings<'a> {
    spec: &'a JobSpec,
    changes: &'a [ConfigChange],
}

impl<'a> Settings<'a> {
    pub fn new(spec: &'a JobSpec, changes: &'a [ConfigChange]) -> Self {
        Self { spec, changes }
    }

    /// The settings of `step`: the spec with every change whose
    /// `from_step ≤ step` applied in order.
    pub fn at(&self, step: u64) -> StepSettings {
        let mut s = StepSettings {
            size: self.spec.batch.step_size(),
            max_tokens: self.spec.data.max_tokens,
            base_lr: self.spec.optimizer.lr,
        };
        // A running job keeps its step mode (`check`): a change resizes it.
        for c in self.changes.iter().filter(|c| c.from_step <= step) {
            let u = &c.update;
            if let Some(n) = u.docs_per_step {
                s.size = StepSize::Docs(n);
            }
            if let Some(t) = u.tokens_per_step {
                s.size = StepSize::Tokens(t);
            }
            s.max_tokens = u.max_tokens.unwrap_or(s.max_tokens);
            s.base_lr = u.lr.unwrap_or(s.base_lr);
        }
        s
    }

    /// The rollouts a streamed or generated job's step `step` takes: its
    /// documents in whole groups (`rl.group_size`).
    pub fn rollouts_needed(&self, step: u64) -> u64 {
        let group = self.spec.rl.group_size.unwrap_or(1);
        self.at(step).size.rollouts_needed(group)
    }

    /// The mixture weights of `step` (the sources' own, then every
    /// change's named weights up to it) and how many weight changes are in
    /// force (0: the spec's).
    pub fn weights_at(
        &self,
        step: u64,
        sources: &[crate::job::sources::Source],
    ) -> (Vec<f64>, u32) {
        let mut w: Vec<f64> = sources.iter().map(|s| s.weight).collect();
        let mut rev = 0;
        for c in self.changes.iter().filter(|c| c.from_step <= step) {
            if let Some(named) = &c.update.weights {
                rev += 1;
                for (i, s) in sources.iter().enumerate() {
                    if let Some(&v) = named.get(&s.name) {
                        w[i] = v;
                    }
                }
            }
        }
        (w, rev)
    }

    /// The settings every change so far applies to (the next new step's,
    /// and those of work that is not a training step, such as the
    /// reference pass).
    pub fn latest(&self) -> StepSettings {
        self.at(u64::MAX)
    }

    /// The step shape of the next new step, for [`crate::job::limits`].
    pub fn latest_shape(&self) -> StepShape {
        let s = self.latest();
        let (docs_per_step, tokens_per_step, microbatches_per_rank) = s.size.fields();
        StepShape {
            docs_per_step,
            tokens_per_step,
            microbatches_per_rank,
            max_tokens: s.max_tokens,
            max_workers: self.spec.parallel.max_workers,
        }
    }

    /// The settings a replay of committed `step` packs with: the step's own
    /// (its documents and learning rate come from its record), but never a
    /// larger `max_tokens` than the latest. Packing does not change the
    /// math, and a lowered `max_tokens` is usually a memory limit that a
    /// replay must respect too.
    pub fn for_replay(&self, step: u64) -> StepSettings {
        let mut s = self.at(step);
        s.max_tokens = s.max_tokens.min(self.latest().max_tokens);
        s
    }

    /// The learning rate of training step `step` when the job runs `total`
    /// steps (0 = unknown): linear warmup, then the spec's schedule from
    /// the step's base rate down to 0 at `total`. The one schedule.
    pub fn lr(&self, step: u64, total: u64) -> f64 {
        scheduled_lr(&self.spec.optimizer, self.at(step).base_lr, step, total)
    }

    /// Every problem with `update` against the spec and `ctx`, with the
    /// spec's field paths (the rules of [`JobSpec::validate`], plus what a
    /// running job cannot change). Empty means valid.
    pub fn check(&self, update: &JobUpdate, ctx: &UpdateContext) -> Vec<SpecProblem> {
        let spec = self.spec;
        let mut p = Vec::new();
        let mut bad = |field: &str, message: String| {
            p.push(SpecProblem {
                field: field.into(),
                message,
            })
        };
        if update.is_empty() {
            bad(
                "update",
                "set at least one of docs_per_step, tokens_per_step, max_tokens, lr, weights"
                    .into(),
            );
        }
        let mode = if spec.batch.docs_per_step.is_some() {
            "batch.docs_per_step"
        } else if spec.batch.tokens_per_step.is_some() {
            "batch.tokens_per_step"
        } else {
            "batch.microbatches_per_rank"
        };
        for (field, value, mine) in [
            (
                "batch.docs_per_step",
                update.docs_per_step,
                spec.batch.docs_per_step.is_some(),
            ),
            (
                "batch.tokens_per_step",
                update.tokens_per_step,
                spec.batch.tokens_per_step.is_some(),
            ),
        ] {
            match value {
                Some(0) => bad(field, "must be at least 1".into()),
                Some(_) if !mine => bad(
                    field,
                    format!(
                        "the job's steps are sized by {mode}; a running job keeps its step mode"
                    ),
                ),
                _ => {}
            }
        }
        if let (Some(n), Some((capacity, group))) = (update.docs_per_step, ctx.stream) {
            let step = crate::job::rl::step_rollouts(n, group);
            if n > 0 && step > capacity {
                bad(
                    "batch.docs_per_step",
                    format!(
                        "{n} rollouts in whole groups of {group} is {step} per step, more than \
                         the job's rollout queue holds (rl.queue_capacity = {capacity})"
                    ),
                );
            }
        }
        match update.max_tokens {
            Some(0) => bad("data.max_tokens", "must be at least 1".into()),
            Some(m) => {
                if let Some((doc, tokens)) = ctx.longest.as_ref().filter(|(_, t)| *t > u64::from(m))
                {
                    bad(
                        "data.max_tokens",
                        format!(
                            "document {doc} has {tokens} tokens, more than {m} (documents are never truncated)"
                        ),
                    );
                }
            }
            None => {}
        }
        if let Some(named) = &update.weights {
            check_weights(spec, named, &mut bad);
        }
        if let Some(lr) = update.lr {
            if !(lr.is_finite() && lr > 0.0) {
                bad(
                    "optimizer.lr",
                    format!("must be a positive number, got {lr}"),
                );
            }
        }
        // The bounds of submit (one owner, `crate::job::limits`) on what the
        // update changes; a static step's size changes with max_tokens.
        let next = self.latest();
        let shape = StepShape {
            docs_per_step: update.docs_per_step,
            tokens_per_step: update.tokens_per_step,
            microbatches_per_rank: next
                .microbatches_per_rank()
                .filter(|_| update.max_tokens.is_some()),
            max_tokens: update.max_tokens.unwrap_or(next.max_tokens),
            max_workers: spec.parallel.max_workers,
        };
        let mut over = Vec::new();
        let mut limit = |field: &str, message: String| over.push(SpecProblem::new(field, message));
        limits::check_step(&shape, &mut limit);
        if let Some(data) = ctx.dataset {
            limits::check_against_dataset(&shape, data, &mut limit);
        }
        p.extend(over);
        p
    }
}

/// New mixture weights by source name: the job mixes sources, each name
/// is one of them, each weight positive.
fn check_weights(
    spec: &JobSpec,
    named: &BTreeMap<String, f64>,
    bad: &mut impl FnMut(&str, String),
) {
    let sources = spec.data.train_sources(spec.job.epochs);
    if sources.len() < 2 {
        bad(
            "data.sources",
            "the job reads one source: there are no mixture weights to change".into(),
        );
        return;
    }
    for (name, &w) in named {
        match sources.iter().position(|s| &s.name == name) {
            None => bad(
                "data.sources",
                format!(
                    "no source named {name:?} (the job's sources: {})",
                    sources
                        .iter()
                        .map(|s| s.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ),
            Some(i) if !(w.is_finite() && w > 0.0) => bad(
                &format!("data.sources[{i}].weight"),
                format!("must be a positive number, got {w}"),
            ),
            Some(_) => {}
        }
    }
}

/// Learning rate of 1-based `step` out of `total` (0 = unknown, which
/// makes decaying schedules hold at the peak) for peak `base`: linear
/// warmup, then the schedule from the peak down to 0 at `total`.
fn scheduled_lr(o: &OptimizerSection, base: f64, step: u64, total: u64) -> f64 {
    if o.warmup_steps > 0 && step <= o.warmup_steps {
        return base * step as f64 / o.warmup_steps as f64;
    }
    if total <= o.warmup_steps {
        return base;
    }
    let progress = ((step - o.warmup_steps) as f64 / (total - o.warmup_steps) as f64).min(1.0);
    match o.schedule {
        Schedule::Constant => base,
        Schedule::Linear => base * (1.0 - progress),
        Schedule::Cosine => base * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(batch: &str) -> JobSpec {
        toml::from_str(&format!(
            "[job]\nname = \"t\"\nsteps = 9\noutput_dir = \"/o\"\n[model]\ninit = \"random\"\n\
             [data]\ntrain = []\nformat = \"sft\"\nmax_tokens = 64\n[batch]\n{batch}\n\
             [optimizer]\nlr = 0.001\n"
        ))
        .unwrap()
    }

    fn id(line: u64) -> crate::stream::doc::DocId {
        crate::stream::doc::DocId { file: 0, line }
    }

    #[test]
    fn changes_apply_from_their_step_and_merge_before_the_same_step() {
        let s = spec("docs_per_step = 4");
        let mut changes = Vec::new();
        let up = |d: Option<u64>, lr: Option<f64>| JobUpdate {
            docs_per_step: d,
            lr,
            ..Default::default()
        };
        record_change(&mut changes, 3, up(Some(8), None), 1);
        record_change(&mut changes, 3, up(None, Some(0.5)), 2);
        record_change(&mut changes, 5, up(Some(2), None), 3);
        assert_eq!(changes.len(), 2, "{changes:?}");
        let settings = Settings::new(&s, &changes);
        let at = |step| settings.at(step);
        assert_eq!((at(2).docs_per_step(), at(2).base_lr), (Some(4), 0.001));
        assert_eq!((at(3).docs_per_step(), at(3).base_lr), (Some(8), 0.5));
        assert_eq!((at(9).docs_per_step(), at(9).base_lr), (Some(2), 0.5));
        assert_eq!(at(9).max_tokens, 64);
        assert_eq!(at(4).size, StepSize::Docs(8));
        assert_eq!(settings.latest(), at(9));
    }

    #[test]
    fn a_replay_never_packs_above_the_latest_max_tokens() {
        let s = spec("docs_per_step = 4");
        let mut changes = Vec::new();
        let max = |m| JobUpdate {
            max_tokens: Some(m),
            ..Default::default()
        };
        record_change(&mut changes, 5, max(32), 1);
        let settings = Settings::new(&s, &changes);
        // Step 3 ran with 64; replayed now, it packs with the lowered 32.
        assert_eq!(settings.at(3).max_tokens, 64);
        assert_eq!(settings.for_replay(3).max_tokens, 32);
        assert_eq!(settings.for_replay(6).max_tokens, 32);
        // A raised value does not widen an older step's microbatches.
        record_change(&mut changes, 8, max(128), 2);
        let settings = Settings::new(&s, &changes);
        assert_eq!(settings.for_replay(3).max_tokens, 64);
        assert_eq!(settings.for_replay(8).max_tokens, 128);
    }

    #[test]
    fn bad_updates_name_every_field_at_fault() {
        let s = spec("docs_per_step = 4");
        let ctx = UpdateContext {
            longest: Some((id(2).to_string(), 40)),
            stream: None,
            dataset: None,
        };
        let check = |spec: &JobSpec, u: JobUpdate, ctx: &UpdateContext| {
            Settings::new(spec, &[]).check(&u, ctx)
        };
        let fields = |u: JobUpdate| -> Vec<String> {
            check(&s, u, &ctx).into_iter().map(|p| p.field).collect()
        };
        assert_eq!(fields(JobUpdate::default()), vec!["update"]);
        let all_bad = JobUpdate {
            docs_per_step: Some(0),
            tokens_per_step: Some(100),
            max_tokens: Some(0),
            lr: Some(f64::NAN),
            weights: None,
        };
        assert_eq!(
            fields(all_bad),
            vec![
                "batch.docs_per_step",
                "batch.tokens_per_step",
                "data.max_tokens",
                "optimizer.lr"
            ]
        );
        let short = check(
            &s,
            JobUpdate {
                max_tokens: Some(39),
                ..Default::default()
            },
            &ctx,
        );
        assert_eq!(short.len(), 1);
        assert!(
            short[0].message.contains("document 0:2 has 40 tokens"),
            "{}",
            short[0]
        );
        let ok = JobUpdate {
            docs_per_step: Some(16),
            max_tokens: Some(40),
            lr: Some(3e-4),
            ..Default::default()
        };
        assert!(check(&s, ok, &ctx).is_empty());
        let by_tokens = spec("tokens_per_step = 256");
        let p = check(
            &by_tokens,
            JobUpdate {
                docs_per_step: Some(2),
                ..Default::default()
            },
            &ctx,
        );
        assert_eq!(p[0].field, "batch.docs_per_step");
        assert!(p[0].message.contains("batch.tokens_per_step"), "{}", p[0]);
        let tokens = JobUpdate {
            tokens_per_step: Some(512),
            ..Default::default()
        };
        assert_eq!(check(&by_tokens, tokens, &ctx), vec![]);
        let negative = JobUpdate {
            lr: Some(-1.0),
            ..Default::default()
        };
        assert_eq!(
            check(&s, negative, &ctx)[0].to_string(),
            "optimizer.lr: must be a positive number, got -1"
        );
        // A streamed job: a step must fit its queue in whole groups.
        let streamed = UpdateContext {
            longest: None,
            stream: Some((16, 4)),
            dataset: None,
        };
        let docs = |n| JobUpdate {
            docs_per_step: Some(n),
            ..Default::default()
        };
        assert!(check(&s, docs(13), &streamed).is_empty(), "16 rollouts fit");
        let p = check(&s, docs(17), &streamed);
        assert_eq!(p[0].field, "batch.docs_per_step");
        assert!(p[0].message.contains("rl.queue_capacity = 16"), "{}", p[0]);
    }

    /// Issue 14 item 2: `accrue set --docs-per-step 1000000000` was accepted,
    /// and the next plan grew the coordinator until it was killed.
    #[test]
    fn set_applies_the_bounds_of_submit() {
        let s = spec("docs_per_step = 4");
        let ctx = UpdateContext {
            longest: None,
            stream: None,
            dataset: Some(DatasetSize {
                docs: 40,
                tokens: 1000,
            }),
        };
        let check = |u: JobUpdate| Settings::new(&s, &[]).check(&u, &ctx);
        let p = check(JobUpdate {
            docs_per_step: Some(1_000_000_000),
            ..Default::default()
        });
        assert_eq!(
            p.iter().map(ToString::to_string).collect::<Vec<_>>(),
            vec![
                "batch.docs_per_step: 1000000000 is more than the limit of 1048576 documents per step",
                "batch.docs_per_step: 1000000000 is more than the 40 documents in data.train (a step would hold a document twice)",
            ]
        );
        let p = check(JobUpdate {
            docs_per_step: Some(41),
            ..Default::default()
        });
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].message.starts_with("41 is more than the 40 documents"),
            "{}",
            p[0]
        );
        assert!(check(JobUpdate {
            docs_per_step: Some(40),
            ..Default::default()
        })
        .is_empty());
        let p = check(JobUpdate {
            max_tokens: Some(u32::MAX),
            ..Default::default()
        });
        assert_eq!(p[0].field, "data.max_tokens");
        // A static job: a larger microbatch grows every step.
        let stat = spec("microbatches_per_rank = 4096");
        let p = Settings::new(&stat, &[]).check(
            &JobUpdate {
                max_tokens: Some(1 << 20),
                ..Default::default()
            },
            &ctx,
        );
        assert_eq!(p[0].field, "batch.microbatches_per_rank", "{p:?}");
        // The lr alone checks nothing else.
        assert!(check(JobUpdate {
            lr: Some(1e-3),
            ..Default::default()
        })
        .is_empty());
    }

    #[test]
    fn lr_schedules() {
        let mut s = spec("docs_per_step = 4");
        s.optimizer.lr = 1.0;
        s.optimizer.warmup_steps = 10;
        let lr = |s: &JobSpec, step, total| Settings::new(s, &[]).lr(step, total);
        assert_eq!(lr(&s, 5, 100), 0.5);
        assert_eq!(lr(&s, 50, 100), 1.0);
        s.optimizer.schedule = Schedule::Linear;
        assert!((lr(&s, 55, 100) - 0.5).abs() < 1e-12);
        s.optimizer.schedule = Schedule::Cosine;
        assert!((lr(&s, 55, 100) - 0.5).abs() < 1e-12);
        assert!(lr(&s, 100, 100).abs() < 1e-12);
        // A changed base rate keeps the schedule's shape.
        let changes = [ConfigChange {
            from_step: 50,
            update: JobUpdate {
                lr: Some(2.0),
                ..Default::default()
            },
            unix_ms: 0,
        }];
        let settings = Settings::new(&s, &changes);
        assert!((settings.lr(55, 100) - 1.0).abs() < 1e-12);
        assert!((settings.lr(5, 100) - 0.5).abs() < 1e-12);
    }
}

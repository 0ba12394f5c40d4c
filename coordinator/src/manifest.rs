//! Per-step manifests and live changes of a job's step settings.
//!
//! A [`StepManifest`] is what the coordinator's store keeps for every
//! committed step: who trained it (generation, world size), with which
//! settings (learning rate, docs/tokens per step, `max_tokens`), and the
//! exact layout `ranks[rank][microbatch] → sequences` with token counts.
//! From the manifests alone [`check_exactly_once`] verifies DESIGN.md's
//! promise that every document of each epoch is trained exactly once,
//! whatever failed (`accrue steps JOB --detail --json` prints them).
//!
//! A [`ConfigChange`] is an operator's live update (`accrue set`): it takes
//! effect from a given step on and is kept in the job record, so the
//! settings of any step, including a re-planned or replayed one, are a pure
//! function of the spec and the list of changes ([`settings_at`]).

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::doc::{DocId, Document};
use crate::spec::{JobSpec, SpecProblem};

/// The step settings an operator may change on a running job. `None`
/// leaves a setting as it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
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
        parts.join(", ")
    }

    /// `self` then `later` (later values win).
    fn merged(self, later: JobUpdate) -> JobUpdate {
        JobUpdate {
            docs_per_step: later.docs_per_step.or(self.docs_per_step),
            tokens_per_step: later.tokens_per_step.or(self.tokens_per_step),
            max_tokens: later.max_tokens.or(self.max_tokens),
            lr: later.lr.or(self.lr),
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
pub fn push_change(changes: &mut Vec<ConfigChange>, from_step: u64, update: JobUpdate, now: i64) {
    match changes.last_mut() {
        Some(last) if last.from_step == from_step => {
            last.update = last.update.merged(update);
            last.unix_ms = now;
        }
        _ => changes.push(ConfigChange {
            from_step,
            update,
            unix_ms: now,
        }),
    }
}

/// The settings a step was planned with.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct StepSettings {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docs_per_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub microbatches_per_rank: Option<u32>,
    pub max_tokens: u32,
    /// The schedule's peak learning rate.
    pub base_lr: f64,
}

/// The effective settings of `step`: the spec with every change whose
/// `from_step ≤ step` applied in order.
pub fn settings_at(spec: &JobSpec, changes: &[ConfigChange], step: u64) -> StepSettings {
    let mut s = StepSettings {
        docs_per_step: spec.batch.docs_per_step,
        tokens_per_step: spec.batch.tokens_per_step,
        microbatches_per_rank: spec.batch.microbatches_per_rank,
        max_tokens: spec.data.max_tokens,
        base_lr: spec.optimizer.lr,
    };
    for c in changes.iter().filter(|c| c.from_step <= step) {
        let u = &c.update;
        s.docs_per_step = u.docs_per_step.or(s.docs_per_step);
        s.tokens_per_step = u.tokens_per_step.or(s.tokens_per_step);
        s.max_tokens = u.max_tokens.unwrap_or(s.max_tokens);
        s.base_lr = u.lr.unwrap_or(s.base_lr);
    }
    s
}

/// The spec `step` is planned from: borrowed when no change applies.
pub fn spec_at<'a>(spec: &'a JobSpec, changes: &[ConfigChange], step: u64) -> Cow<'a, JobSpec> {
    if !changes.iter().any(|c| c.from_step <= step) {
        return Cow::Borrowed(spec);
    }
    let s = settings_at(spec, changes, step);
    let mut out = spec.clone();
    out.batch.docs_per_step = s.docs_per_step;
    out.batch.tokens_per_step = s.tokens_per_step;
    out.data.max_tokens = s.max_tokens;
    out.optimizer.lr = s.base_lr;
    Cow::Owned(out)
}

/// Every problem with `update` against the job's spec and dataset, with
/// the spec's field paths (the rules of [`JobSpec::validate`], plus what a
/// running job cannot change). Empty means valid.
pub fn validate_update(spec: &JobSpec, docs: &[Document], update: &JobUpdate) -> Vec<SpecProblem> {
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
            "set at least one of docs_per_step, tokens_per_step, max_tokens, lr".into(),
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
                format!("the job's steps are sized by {mode}; a running job keeps its step mode"),
            ),
            _ => {}
        }
    }
    match update.max_tokens {
        Some(0) => bad("data.max_tokens", "must be at least 1".into()),
        Some(m) => {
            // Documents are never cut: the longest one must still fit.
            if let Some(d) = docs.iter().max_by_key(|d| d.tokens()) {
                if d.tokens() > u64::from(m) {
                    bad(
                        "data.max_tokens",
                        format!(
                            "document {} has {} tokens, more than {m} (documents are never truncated)",
                            d.id,
                            d.tokens()
                        ),
                    );
                }
            }
        }
        None => {}
    }
    if let Some(lr) = update.lr {
        if !(lr.is_finite() && lr > 0.0) {
            bad(
                "optimizer.lr",
                format!("must be a positive number, got {lr}"),
            );
        }
    }
    p
}

/// One sequence of a microbatch: document, role (0: SFT, rollout or DPO
/// chosen; 1: DPO rejected) and tokens. On the wire of `--json` and in the
/// store: `["0:17", 0, 312]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeqEntry(#[serde(with = "doc_str")] pub DocId, pub u32, pub u32);

/// One microbatch: its sequences in packing order. Padding microbatches
/// (a rank with fewer real ones) are empty.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MicrobatchEntry {
    pub tokens: u32,
    pub seqs: Vec<SeqEntry>,
}

/// Everything the store keeps about one committed step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepManifest {
    pub step: u64,
    pub generation: u64,
    pub world_size: u32,
    /// The learning rate the optimizer step used.
    pub lr: f64,
    #[serde(flatten)]
    pub settings: StepSettings,
    /// The data cursor's epoch after the step.
    pub epoch: u64,
    pub tokens: u64,
    /// How many times the step was dispatched (1 + aborts before commit).
    pub attempts: u32,
    /// Re-run after a restore from an older checkpoint.
    #[serde(default)]
    pub replayed: bool,
    /// `ranks[rank][microbatch]`; every rank has the same count.
    pub ranks: Vec<Vec<MicrobatchEntry>>,
}

impl StepManifest {
    /// The manifest of a planned step about to commit.
    pub fn of(
        planned: &crate::core::PlannedStep,
        generation: u64,
        settings: StepSettings,
        attempts: u32,
        replayed: bool,
    ) -> StepManifest {
        let ranks: Vec<Vec<MicrobatchEntry>> = planned
            .ranks
            .iter()
            .map(|mbs| {
                mbs.iter()
                    .map(|mb| MicrobatchEntry {
                        tokens: mb.token_ids.len() as u32,
                        seqs: mb
                            .seqs
                            .iter()
                            .zip(mb.cu_seq_lens.windows(2))
                            .map(|(s, w)| SeqEntry(s.doc, s.role, w[1] - w[0]))
                            .collect(),
                    })
                    .collect()
            })
            .collect();
        StepManifest {
            step: planned.step,
            generation,
            world_size: planned.ranks.len() as u32,
            lr: planned.lr,
            settings,
            epoch: planned.cursor_after.epoch,
            tokens: ranks.iter().flatten().map(|m| u64::from(m.tokens)).sum(),
            attempts,
            replayed,
            ranks,
        }
    }

    /// The step's documents, each once (a DPO pair's two sequences are one
    /// document), in layout order.
    pub fn docs(&self) -> Vec<DocId> {
        self.ranks
            .iter()
            .flatten()
            .flat_map(|m| &m.seqs)
            .filter(|s| s.1 == 0)
            .map(|s| s.0)
            .collect()
    }

    /// Microbatches per rank.
    pub fn microbatches_per_rank(&self) -> u32 {
        self.ranks.first().map_or(0, |r| r.len() as u32)
    }
}

/// What a run should have trained, for [`check_exactly_once`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Expectation {
    /// The dataset's documents; empty: the union of those in the manifests
    /// (then a document no step ever trained cannot be named).
    pub universe: Vec<DocId>,
    /// Epochs every document must have been trained in.
    pub complete_epochs: u64,
    /// The run stopped inside epoch `complete_epochs` (a `job.steps` run):
    /// a document may appear once more.
    pub partial: bool,
}

/// Why a document, or a step, breaks exactly-once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Offender {
    /// Trained `times`, expected `expected` (or up to `expected + 1` when the
    /// last epoch is partial).
    Document {
        #[serde(with = "doc_str")]
        doc: DocId,
        times: u64,
        expected: u64,
    },
    /// Trained but not in the dataset.
    Unknown {
        #[serde(with = "doc_str")]
        doc: DocId,
    },
    /// A step number missing from, or repeated in, the committed sequence
    /// 1..=last.
    Step { step: u64, times: u64 },
}

/// Checks from the manifests that every document of each epoch was trained
/// exactly once: the k-th time a document is trained counts for epoch k,
/// so a document trained twice in one epoch shows up as one time too many
/// and a lost one as one too few. Also checks that the committed steps are
/// exactly 1..=last (`first_step` for a resumed job). Returns the offenders
/// (empty: the run is clean), in a stable order.
pub fn check_exactly_once(
    manifests: &[StepManifest],
    first_step: u64,
    expect: &Expectation,
) -> Vec<Offender> {
    let mut out = Vec::new();
    let mut steps: BTreeMap<u64, u64> = BTreeMap::new();
    let mut counts: BTreeMap<DocId, u64> = BTreeMap::new();
    for m in manifests {
        *steps.entry(m.step).or_default() += 1;
        for d in m.docs() {
            *counts.entry(d).or_default() += 1;
        }
    }
    let last = steps.keys().next_back().copied().unwrap_or(0);
    for step in first_step..=last {
        let times = steps.get(&step).copied().unwrap_or(0);
        if times != 1 {
            out.push(Offender::Step { step, times });
        }
    }
    let universe: Vec<DocId> = if expect.universe.is_empty() {
        counts.keys().copied().collect()
    } else {
        let mut u = expect.universe.clone();
        u.sort_unstable();
        u.dedup();
        u
    };
    let (lo, hi) = (
        expect.complete_epochs,
        expect.complete_epochs + u64::from(expect.partial),
    );
    for d in &universe {
        let times = counts.get(d).copied().unwrap_or(0);
        if times < lo || times > hi {
            out.push(Offender::Document {
                doc: *d,
                times,
                expected: lo,
            });
        }
    }
    for d in counts.keys() {
        if universe.binary_search(d).is_err() {
            out.push(Offender::Unknown { doc: *d });
        }
    }
    out
}

/// Serde of a [`DocId`] as its `file:line` string.
mod doc_str {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::doc::DocId;

    pub fn serialize<S: Serializer>(d: &DocId, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(d)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DocId, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doc::{DocBody, Sequence};
    use proptest::prelude::*;

    fn spec(batch: &str) -> JobSpec {
        toml::from_str(&format!(
            "[job]\nname = \"t\"\nsteps = 9\noutput_dir = \"/o\"\n[model]\ninit = \"random\"\n\
             [data]\ntrain = []\nformat = \"sft\"\nmax_tokens = 64\n[batch]\n{batch}\n\
             [optimizer]\nlr = 0.001\n"
        ))
        .unwrap()
    }

    fn doc(line: u64, len: usize) -> Document {
        Document {
            id: DocId { file: 0, line },
            body: DocBody::Sft(Sequence {
                input_ids: vec![1; len],
                labels: vec![1; len],
            }),
        }
    }

    fn id(line: u64) -> DocId {
        DocId { file: 0, line }
    }

    /// A one-rank, one-microbatch manifest of `docs`.
    fn m(step: u64, docs: &[u64]) -> StepManifest {
        StepManifest {
            step,
            generation: 1,
            world_size: 1,
            lr: 0.1,
            settings: StepSettings::default(),
            epoch: 0,
            tokens: 0,
            attempts: 1,
            replayed: false,
            ranks: vec![vec![MicrobatchEntry {
                tokens: 0,
                seqs: docs.iter().map(|&l| SeqEntry(id(l), 0, 3)).collect(),
            }]],
        }
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
        push_change(&mut changes, 3, up(Some(8), None), 1);
        push_change(&mut changes, 3, up(None, Some(0.5)), 2);
        push_change(&mut changes, 5, up(Some(2), None), 3);
        assert_eq!(changes.len(), 2, "{changes:?}");
        let at = |step| settings_at(&s, &changes, step);
        assert_eq!((at(2).docs_per_step, at(2).base_lr), (Some(4), 0.001));
        assert_eq!((at(3).docs_per_step, at(3).base_lr), (Some(8), 0.5));
        assert_eq!((at(9).docs_per_step, at(9).base_lr), (Some(2), 0.5));
        assert_eq!(at(9).max_tokens, 64);
        assert!(matches!(spec_at(&s, &changes, 2), Cow::Borrowed(_)));
        let eff = spec_at(&s, &changes, 4);
        assert_eq!((eff.batch.docs_per_step, eff.optimizer.lr), (Some(8), 0.5));
    }

    #[test]
    fn bad_updates_name_every_field_at_fault() {
        let docs = [doc(1, 10), doc(2, 40)];
        let s = spec("docs_per_step = 4");
        let fields = |u: JobUpdate| -> Vec<String> {
            validate_update(&s, &docs, &u)
                .into_iter()
                .map(|p| p.field)
                .collect()
        };
        assert_eq!(fields(JobUpdate::default()), vec!["update"]);
        let all_bad = JobUpdate {
            docs_per_step: Some(0),
            tokens_per_step: Some(100),
            max_tokens: Some(0),
            lr: Some(f64::NAN),
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
        let short = validate_update(
            &s,
            &docs,
            &JobUpdate {
                max_tokens: Some(39),
                ..Default::default()
            },
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
        assert!(validate_update(&s, &docs, &ok).is_empty());
        let by_tokens = spec("tokens_per_step = 256");
        let p = validate_update(
            &by_tokens,
            &docs,
            &JobUpdate {
                docs_per_step: Some(2),
                ..Default::default()
            },
        );
        assert_eq!(p[0].field, "batch.docs_per_step");
        assert!(p[0].message.contains("batch.tokens_per_step"), "{}", p[0]);
        assert_eq!(
            validate_update(
                &by_tokens,
                &docs,
                &JobUpdate {
                    tokens_per_step: Some(512),
                    ..Default::default()
                }
            ),
            vec![]
        );
        assert_eq!(
            validate_update(
                &s,
                &docs,
                &JobUpdate {
                    lr: Some(-1.0),
                    ..Default::default()
                }
            )[0]
            .to_string(),
            "optimizer.lr: must be a positive number, got -1"
        );
    }

    #[test]
    fn exactly_once_names_duplicates_losses_strangers_and_step_gaps() {
        let universe: Vec<DocId> = (1..=6).map(id).collect();
        let expect = Expectation {
            universe: universe.clone(),
            complete_epochs: 1,
            partial: false,
        };
        let clean = [m(1, &[1, 2]), m(2, &[3, 4]), m(3, &[5, 6])];
        assert_eq!(check_exactly_once(&clean, 1, &expect), vec![]);
        let bad = [m(1, &[1, 2]), m(2, &[2, 4]), m(2, &[5, 9]), m(4, &[6])];
        assert_eq!(
            check_exactly_once(&bad, 1, &expect),
            vec![
                Offender::Step { step: 2, times: 2 },
                Offender::Step { step: 3, times: 0 },
                Offender::Document {
                    doc: id(2),
                    times: 2,
                    expected: 1
                },
                Offender::Document {
                    doc: id(3),
                    times: 0,
                    expected: 1
                },
                Offender::Unknown { doc: id(9) },
            ]
        );
        // A run that stopped inside its second epoch.
        let partial = [m(5, &[1, 2, 3, 4, 5, 6]), m(6, &[4, 1])];
        let two = Expectation {
            partial: true,
            ..expect.clone()
        };
        assert_eq!(check_exactly_once(&partial, 5, &two), vec![]);
        let twice = [m(1, &[1, 2, 3, 4, 5, 6]), m(2, &[4, 4])];
        assert_eq!(
            check_exactly_once(&twice, 1, &two),
            vec![Offender::Document {
                doc: id(4),
                times: 3,
                expected: 1
            }]
        );
        // A DPO pair's rejected sequence is the same document, not another.
        let mut pair = m(1, &[1]);
        pair.ranks[0][0].seqs.push(SeqEntry(id(1), 1, 3));
        assert_eq!(pair.docs(), vec![id(1)]);
    }

    #[test]
    fn manifests_round_trip_through_json_with_compact_doc_ids() {
        let mut x = m(7, &[3, 11]);
        x.settings = StepSettings {
            docs_per_step: Some(2),
            max_tokens: 64,
            base_lr: 0.5,
            ..Default::default()
        };
        x.replayed = true;
        let text = serde_json::to_string(&x).unwrap();
        assert!(text.contains(r#"["0:11",0,3]"#), "{text}");
        assert!(text.contains(r#""docs_per_step":2"#), "{text}");
        assert!(!text.contains("tokens_per_step"), "{text}");
        let back: StepManifest = serde_json::from_str(&text).unwrap();
        assert_eq!(back, x);
    }

    proptest! {
        /// However a clean epoch is cut into steps, the check passes; one
        /// document trained twice or dropped is the one named.
        #[test]
        fn any_clean_split_passes_and_one_fault_is_named(
            n in 1u64..40,
            cuts in proptest::collection::vec(1usize..6, 1..20),
            fault in 0usize..3,
            pick in any::<proptest::sample::Index>(),
        ) {
            let docs: Vec<u64> = (1..=n).collect();
            let mut steps = Vec::new();
            let mut at = 0;
            for (i, c) in cuts.iter().cycle().enumerate() {
                if at >= docs.len() { break; }
                let end = (at + c).min(docs.len());
                steps.push(m(i as u64 + 1, &docs[at..end]));
                at = end;
            }
            let expect = Expectation {
                universe: docs.iter().map(|&l| id(l)).collect(),
                complete_epochs: 1,
                partial: false,
            };
            prop_assert_eq!(check_exactly_once(&steps, 1, &expect), vec![]);
            let victim = docs[pick.index(docs.len())];
            let times = match fault {
                0 => {
                    let s = pick.index(steps.len());
                    steps[s].ranks[0][0].seqs.push(SeqEntry(id(victim), 0, 1));
                    2
                }
                1 => {
                    for st in &mut steps {
                        st.ranks[0][0].seqs.retain(|q| q.0 != id(victim));
                    }
                    0
                }
                _ => return Ok(()),
            };
            prop_assert_eq!(
                check_exactly_once(&steps, 1, &expect),
                vec![Offender::Document { doc: id(victim), times, expected: 1 }]
            );
        }
    }
}

//! Evaluation (`[eval]`, issue 16): after every `every_steps`-th committed
//! step (and after the last), the eval sources' documents go to the
//! generation in forward-only chunks (`PlanKind::Eval`), spread over all
//! ranks and packed like a step (one source per microbatch). Workers report
//! each sequence's summed log-prob under the current weights; the metrics
//! are formed here, exactly, from those sums:
//! - SFT and policy gradient: the loss per loss token, `−Σ logp / Σ loss
//!   tokens`, per source and over all (PG also reports the rollouts' mean
//!   `reward`, which they carry);
//! - DPO: per pair the implicit rewards `β·(logπ − logπ_ref)` (reference
//!   log-probs from the cached pass, which covers the eval pairs too), their
//!   accuracy (the share of pairs whose chosen reward is higher), margin,
//!   and the sigmoid DPO loss `−log σ(margin)`.
//!
//! An eval never moves the training cursor, never commits a step and is not
//! persisted: a generation lost mid-eval simply runs it again.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::metrics::{SourceMetrics, SourceSums};
use super::reference::{ReferenceCache, SeqLogp};
use crate::job::sources::Source;
use crate::stream::doc::{DocBody, DocId, Document};

/// A job's eval documents and sources.
#[derive(Debug, Clone)]
pub struct EvalSet {
    pub docs: Arc<[Document]>,
    pub sources: Vec<Source>,
    /// The source of each file of the job (eval files after the training
    /// files).
    pub file_source: Vec<u32>,
    pub every_steps: u64,
    /// DPO's β (rewards), when the job is DPO.
    pub dpo_beta: Option<f64>,
}

impl EvalSet {
    pub fn source_of(&self, doc: &DocId) -> u32 {
        self.file_source
            .get(doc.file as usize)
            .copied()
            .unwrap_or(0)
    }
}

/// An evaluation in progress: which committed step it evaluates, how far
/// its chunks got, and the sums so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalRun {
    pub step: u64,
    /// Eval documents already evaluated (a prefix of the set).
    pub next: usize,
    pub sums: BTreeMap<u32, SourceSums>,
}

/// One evaluation's metrics, written to `metrics.jsonl` as an `eval` line
/// and sent to watchers.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct EvalMetrics {
    /// The committed step the weights are from.
    pub step: u64,
    #[serde(deserialize_with = "crate::core::nonfinite::f64")]
    pub loss: f64,
    pub loss_tokens: u64,
    pub tokens: u64,
    pub docs: u64,
    #[serde(default, deserialize_with = "crate::core::nonfinite::map")]
    pub extra: BTreeMap<String, f64>,
    pub sources: BTreeMap<String, SourceMetrics>,
    pub unix_ms: i64,
}

/// Why a chunk's reports cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EvalError {
    #[error("eval of step {step}: no log-prob reported for {doc} role {role}")]
    Missing { step: u64, doc: DocId, role: u32 },
    #[error("eval of step {step}: no reference log-prob cached for pair {doc}")]
    NoReference { step: u64, doc: DocId },
}

impl EvalRun {
    pub fn new(step: u64) -> Self {
        EvalRun {
            step,
            ..Default::default()
        }
    }

    /// Adds a chunk's documents with the log-probs the ranks reported.
    pub fn add_chunk(
        &mut self,
        set: &EvalSet,
        docs: &[&Document],
        logps: &[SeqLogp],
        reference: Option<&ReferenceCache>,
    ) -> Result<(), EvalError> {
        let by: BTreeMap<(DocId, u32), f64> =
            logps.iter().map(|l| ((l.doc, l.role), l.logp)).collect();
        let got = |doc: DocId, role: u32| {
            by.get(&(doc, role)).copied().ok_or(EvalError::Missing {
                step: self.step,
                doc,
                role,
            })
        };
        for d in docs {
            let s = self.sums.entry(set.source_of(&d.id)).or_default();
            s.documents += 1;
            s.tokens += d.tokens();
            match &d.body {
                DocBody::Sft(seq) => {
                    s.loss_sum -= got(d.id, 0)?;
                    s.loss_tokens += seq.loss_tokens();
                }
                DocBody::Rollout(r) => {
                    s.loss_sum -= got(d.id, 0)?;
                    s.loss_tokens += r.seq.loss_tokens();
                    s.reward_sum += r.reward;
                    s.rollouts += 1;
                }
                DocBody::Pair { chosen, rejected } => {
                    let beta = set.dpo_beta.unwrap_or(0.1);
                    let [rc, rr] =
                        reference
                            .and_then(|c| c.get(&d.id))
                            .ok_or(EvalError::NoReference {
                                step: self.step,
                                doc: d.id,
                            })?;
                    let (pc, pr) = (got(d.id, 0)?, got(d.id, 1)?);
                    let (chosen_r, rejected_r) = (beta * (pc - rc), beta * (pr - rr));
                    let margin = chosen_r - rejected_r;
                    // −log σ(m), stably.
                    let loss = if margin > 0.0 {
                        (-margin).exp().ln_1p()
                    } else {
                        -margin + margin.exp().ln_1p()
                    };
                    s.loss_sum += loss;
                    s.loss_tokens += chosen.loss_tokens() + rejected.loss_tokens();
                    let mut add = |k: &str, v: f64| *s.extra.entry(k.into()).or_default() += v;
                    s.pairs += 1;
                    add("rewards/chosen", chosen_r);
                    add("rewards/rejected", rejected_r);
                    add("rewards/margin", margin);
                    add(
                        "rewards/accuracy",
                        f64::from(u8::from(chosen_r > rejected_r)),
                    );
                }
            }
        }
        self.next += docs.len();
        Ok(())
    }

    /// The metrics once every document was evaluated: per source and over
    /// all, means formed after summing (`pairs` present: per pair).
    pub fn finish(&self, set: &EvalSet, unix_ms: i64) -> EvalMetrics {
        let mut total = SourceSums::default();
        let mut sources = BTreeMap::new();
        for (s, sums) in &self.sums {
            total.add(sums);
            let name = set
                .sources
                .get(*s as usize)
                .map_or_else(|| format!("source-{s}"), |x| x.name.clone());
            sources.insert(name, sums.means());
        }
        let all = total.means();
        EvalMetrics {
            step: self.step,
            loss: all.loss,
            loss_tokens: all.loss_tokens,
            tokens: all.tokens,
            docs: all.docs,
            extra: all.extra,
            sources,
            unix_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::doc::Sequence;

    fn doc(file: u32, line: u64, loss: usize) -> Document {
        let labels: Vec<i32> = (0..loss + 1).map(|_| 7).collect();
        Document {
            id: DocId { file, line },
            body: DocBody::Sft(Sequence::new(vec![7; loss + 1], labels)),
        }
    }

    fn set() -> EvalSet {
        let src = |name: &str, files: std::ops::Range<u32>| Source {
            name: name.into(),
            files,
            weight: 1.0,
            epochs: None,
            max_docs: None,
            chat_template: None,
        };
        EvalSet {
            docs: Arc::from(Vec::new()),
            sources: vec![src("held-a", 1..2), src("held-b", 2..3)],
            file_source: vec![0, 0, 1],
            every_steps: 1,
            dpo_beta: None,
        }
    }

    #[test]
    fn eval_loss_is_exact_per_loss_token_per_source_and_over_all() {
        let s = set();
        let docs = [doc(1, 1, 3), doc(1, 2, 1), doc(2, 1, 4)];
        let refs: Vec<&Document> = docs.iter().collect();
        let logps =
            [(docs[0].id, -6.0), (docs[1].id, -1.0), (docs[2].id, -2.0)].map(|(doc, logp)| {
                SeqLogp {
                    doc,
                    role: 0,
                    logp,
                    tokens: Vec::new(),
                }
            });
        let mut run = EvalRun::new(4);
        run.add_chunk(&s, &refs[..2], &logps, None).unwrap();
        run.add_chunk(&s, &refs[2..], &logps, None).unwrap();
        let m = run.finish(&s, 0);
        assert_eq!(m.step, 4);
        assert_eq!((m.loss_tokens, m.docs), (8, 3));
        assert!((m.loss - 9.0 / 8.0).abs() < 1e-12);
        assert!((m.sources["held-a"].loss - 7.0 / 4.0).abs() < 1e-12);
        assert!((m.sources["held-b"].loss - 0.5).abs() < 1e-12);
        // A document without its log-prob is an error naming it.
        let mut run = EvalRun::new(4);
        let e = run.add_chunk(&s, &refs, &logps[..1], None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "eval of step 4: no log-prob reported for 1:2 role 0"
        );
    }
}

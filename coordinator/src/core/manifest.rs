//! Per-step manifests: what the coordinator's store keeps for every
//! committed step — who trained it (generation, world size), with which
//! settings (learning rate, docs/tokens per step, `max_tokens`: see
//! [`crate::job::settings`]), and the exact layout `ranks[rank][microbatch] →
//! sequences` with token counts. From the manifests alone
//! [`check_exactly_once`] verifies DESIGN.md's promise that every document
//! of each epoch is trained exactly once, whatever failed (`accrue steps JOB
//! --detail --json` prints them).

pub mod compact;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::job::settings::StepSettings;
use crate::stream::doc::DocId;

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
    /// A mixture: the source of each file the step's documents come from
    /// (so every document's source follows from its `file:line`) ...
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files: BTreeMap<u32, String>,
    /// ... and the step's documents per source.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sources: BTreeMap<String, u64>,
    /// A rollout stream: the groups the step trained, in order (the RL
    /// loop names them `prompt_id@position`, so the prompts a step
    /// trained on are on record).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
}

impl StepManifest {
    /// The step's documents, each once (a DPO pair's two sequences are one
    /// document), in layout order.
    pub fn docs(&self) -> Vec<DocId> {
        layout_docs(&self.ranks).collect()
    }

    /// Records each document's source (`file_source[file]` indexes
    /// `names`).
    pub fn record_sources(&mut self, file_source: &[u32], names: &[String]) {
        for d in self.docs() {
            let s = file_source.get(d.file as usize).copied().unwrap_or(0) as usize;
            let name = names.get(s).cloned().unwrap_or_default();
            *self.sources.entry(name.clone()).or_default() += 1;
            self.files.insert(d.file, name);
        }
    }

    /// The source a document of this step came from (mixtures).
    pub fn source_of(&self, doc: &DocId) -> Option<&str> {
        self.files.get(&doc.file).map(String::as_str)
    }

    /// Microbatches per rank.
    pub fn microbatches_per_rank(&self) -> u32 {
        self.ranks.first().map_or(0, |r| r.len() as u32)
    }
}

/// A layout's documents, each once (at its first sequence: a DPO pair's
/// rejected one is the same document), in layout order.
pub fn layout_docs(ranks: &[Vec<MicrobatchEntry>]) -> impl Iterator<Item = DocId> + '_ {
    ranks
        .iter()
        .flatten()
        .flat_map(|m| &m.seqs)
        .filter(|s| s.1 == 0)
        .map(|s| s.0)
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

    use crate::stream::doc::DocId;

    pub fn serialize<S: Serializer>(d: &DocId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&d.label())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DocId, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
            files: Default::default(),
            sources: Default::default(),
            groups: Vec::new(),
        }
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
            size: crate::job::batch::StepSize::Docs(2),
            max_tokens: 64,
            base_lr: 0.5,
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

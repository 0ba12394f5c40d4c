//! Issue 16 in the pure core: a mixture job's steps hold exactly the
//! promised documents of each source, every source is trained exactly once
//! per its own epochs whatever fails, microbatches hold one source each,
//! and `accrue set` changes the weights from the next step.

use super::*;

/// 12, 8 and 4 documents in files 0, 1, 2 (one source each).
pub(super) fn mix_docs() -> Arc<[Document]> {
    let mut out = Vec::new();
    for (file, n) in [(0u32, 12u64), (1, 8), (2, 4)] {
        for line in 1..=n {
            let len = 5 + (line as usize * 13 + file as usize * 7) % 40;
            out.push(Document {
                id: DocId { file, line },
                body: DocBody::Sft(Sequence::new(vec![7; len], vec![7; len])),
            });
        }
    }
    out.into()
}

/// Sources a, b, c over the three files, 3, 2 and 1 documents per step,
/// a for 1 epoch, b for 2, c for 3: all end at step 4... then b and c go on.
pub(super) fn mix_spec(sources: &str) -> JobSpec {
    let text = format!(
        r#"
[job]
name = "t"
seed = 3
epochs = 1
output_dir = "/tmp/accrue-core-test"
[model]
init = "random"
config = "/dev/null"
[data]
format = "sft"
max_tokens = 128
{sources}
[batch]
docs_per_step = 6
[parallel]
min_workers = 1
max_workers = 3
[checkpoint]
every_steps = 2
"#
    );
    toml::from_str(&text).unwrap()
}

const SOURCES: &str = r#"
[[data.sources]]
name = "a"
paths = ["/dev/null"]
docs = 3
[[data.sources]]
name = "b"
paths = ["/dev/null"]
docs = 2
epochs = 2
[[data.sources]]
name = "c"
paths = ["/dev/null"]
docs = 1
epochs = 3
"#;

pub(super) fn per_file(docs: &[DocId]) -> [usize; 3] {
    let mut n = [0; 3];
    for d in docs {
        n[d.file as usize] += 1;
    }
    n
}

#[test]
fn a_mixture_trains_each_source_exactly_once_per_its_epochs_through_faults() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    let d = mix_docs();
    s.submit(mix_spec(SOURCES), d.clone());
    let at = |n: usize| move |s: &Sim| s.committed.len() >= n;
    s.run_until(at(2));
    s.kill("b"); // the step in flight is re-planned with the same documents
    s.run_until(at(3));
    s.worker("c");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let steps = s.manifests();
    // While all three are live, every step holds exactly 3, 2 and 1.
    for docs in steps.values().take(4) {
        assert_eq!(per_file(docs), [3, 2, 1]);
    }
    // Every document trained exactly its source's epochs.
    let mut times: BTreeMap<DocId, u64> = BTreeMap::new();
    for docs in steps.values() {
        for id in docs {
            *times.entry(*id).or_default() += 1;
        }
    }
    for doc in d.iter() {
        let want = [1, 2, 3][doc.id.file as usize];
        assert_eq!(times.get(&doc.id), Some(&want), "{}", doc.id);
    }
    // The manifests name each document's source, and every microbatch
    // holds one source's documents.
    for m in &s.manifests {
        for doc in m.docs() {
            assert_eq!(m.source_of(&doc), Some(["a", "b", "c"][doc.file as usize]));
        }
        let total: u64 = m.sources.values().sum();
        assert_eq!(total as usize, m.docs().len());
        for mb in m.ranks.iter().flatten() {
            let files: BTreeSet<u32> = mb.seqs.iter().map(|q| q.0.file).collect();
            assert!(files.len() <= 1, "step {}: {files:?}", m.step);
        }
    }
    // Per-source metrics for a mixture.
    let (first, _) = &s.committed[0];
    assert_eq!(first.sources.keys().collect::<Vec<_>>(), ["a", "b", "c"]);
}

#[test]
fn new_weights_apply_from_the_next_step() {
    let mut s = Sim::new();
    s.worker("a");
    let d = mix_docs();
    let sources = SOURCES
        .replace("docs = 3", "weight = 3.0")
        .replace("docs = 2", "weight = 2.0")
        .replace("docs = 1", "weight = 1.0");
    s.submit(mix_spec(&sources), d.clone());
    s.step_once(); // Ready → step 1 in flight
    let weights: BTreeMap<String, f64> = [("c".to_string(), 1000.0)].into();
    set(
        &mut s,
        JobUpdate {
            weights: Some(weights),
            ..Default::default()
        },
    )
    .unwrap();
    s.run();
    let steps = s.manifests();
    assert_eq!(
        per_file(&steps[&1]),
        [3, 2, 1],
        "the step in flight keeps its weights"
    );
    // From step 2 source c (4 documents × 3 epochs) comes first, until its
    // 12 document-epochs are spent (1 + 6 + 5); then a and b share.
    assert_eq!(per_file(&steps[&2]), [0, 0, 6]);
    assert_eq!(per_file(&steps[&3]), [1, 0, 5]);
    assert_eq!(per_file(&steps[&4]), [3, 3, 0]);
    // Unknown sources and bad weights are refused, naming them.
    let bad: BTreeMap<String, f64> = [("nope".to_string(), 1.0)].into();
    let mut s2 = Sim::new();
    s2.submit(mix_spec(&sources), d);
    let e = set(
        &mut s2,
        JobUpdate {
            weights: Some(bad),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(e.to_string().contains("no source named \"nope\""), "{e}");
}

#[test]
fn eval_runs_at_its_steps_and_never_moves_the_training_cursor() {
    let mut s = Sim::new();
    s.worker("a");
    s.worker("b");
    let mut d: Vec<Document> = mix_docs().to_vec();
    // Five held-out documents in the eval file (index 3, after the three
    // training files).
    for line in 1..=5 {
        d.push(Document {
            id: DocId { file: 3, line },
            body: DocBody::Sft(Sequence::new(vec![7; 6], vec![7; 6])),
        });
    }
    let eval =
        "[eval]\nevery_steps = 2\n[[eval.sources]]\nname = \"held\"\npaths = [\"/dev/null\"]\n";
    let spec = mix_spec(SOURCES).to_toml() + eval;
    let spec: JobSpec = toml::from_str(&spec).unwrap();
    s.submit(spec, d.into());
    // Between the plans of step 2 and step 3 come the eval's, and the
    // cursor step 3 starts from is the one step 2 left.
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    let last = s.committed.len() as u64;
    let mut want: Vec<u64> = (1..=last).filter(|k| k % 2 == 0).collect();
    if !last.is_multiple_of(2) {
        want.push(last);
    }
    let got: Vec<u64> = s.evals.iter().map(|e| e.step).collect();
    assert_eq!(got, want, "after every 2nd step and the last");
    for e in &s.evals {
        // 5 documents of 5 loss tokens each, fake log-prob −line: the loss
        // per loss token is Σ line / 25.
        assert_eq!((e.docs, e.loss_tokens), (5, 25));
        assert!((e.loss - 15.0 / 25.0).abs() < 1e-12, "{}", e.loss);
        assert_eq!(e.sources.keys().collect::<Vec<_>>(), ["held"]);
    }
    let kinds: Vec<(PlanKind, u64)> = s.plans.iter().map(|p| (p.kind, p.step)).collect();
    let i = kinds
        .iter()
        .position(|k| *k == (PlanKind::Eval, 2))
        .unwrap();
    assert_eq!(kinds[i - 1], (PlanKind::Train, 2));
    assert_eq!(kinds[i + 1], (PlanKind::Train, 3));
    assert_eq!(
        s.plans[i].cursor_after,
        s.plans[i - 1].cursor_after,
        "eval moves no cursor"
    );
    // Training is exactly as without eval: no eval document is trained.
    for docs in s.manifests().values() {
        assert!(docs.iter().all(|id| id.file < 3));
    }
    // Every step but the first went out as planned while the one before
    // ran: the eval chunks between them keep the step planned ahead.
    assert_eq!(s.c.job("job").unwrap().ahead.sent, last - 1);
}

//! Context parallelism in the core (issue 37, `parallel.context`): a
//! generation is whole groups, plans are for its groups (rows of up to
//! context × `data.max_tokens`), every rank of a group is sent its group's
//! microbatches, and a group's result counts once.

use super::*;

/// `n` documents of 20..=230 tokens: many longer than one rank's
/// `max_tokens = 128`, none longer than a group's row of 256.
fn long_docs(n: usize) -> Arc<[Document]> {
    (0..n)
        .map(|i| {
            let len = 20 + (i * 71) % 211;
            Document {
                id: DocId {
                    file: 0,
                    line: i as u64 + 1,
                },
                body: DocBody::Sft(Sequence::new(vec![7; len], vec![7; len])),
            }
        })
        .collect::<Vec<_>>()
        .into()
}

fn context_spec(context: u32, min: u32, max: u32) -> JobSpec {
    let mut s = spec("epochs = 1", "docs_per_step = 6", min, max);
    s.parallel.context = context;
    s
}

#[test]
fn groups_train_rows_longer_than_a_rank_and_count_each_document_once() {
    let mut s = Sim::new();
    let d = long_docs(20);
    assert!(d.iter().any(|x| x.tokens() > 128));
    for w in ["a", "b", "c", "d", "e"] {
        s.worker(w);
    }
    s.submit(context_spec(2, 2, 6), d.clone());
    // Five workers, groups of two: four train, the fifth waits.
    let ranks: Vec<u32> = s
        .inbox
        .iter()
        .filter_map(|(_, m)| match m {
            ToWorker::Configure { rank, .. } => Some(*rank),
            _ => None,
        })
        .collect();
    assert_eq!(ranks, vec![0, 1, 2, 3]);
    // Each rank is sent its group's microbatches.
    let mut sent: Vec<(u32, u32)> = Vec::new();
    while let Some((_, m)) = s.inbox.front() {
        if let ToWorker::Plan { rank, group, .. } = m {
            sent.push((*rank, *group));
        }
        if !s.step_once() {
            break;
        }
    }
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    sent.sort();
    sent.dedup();
    assert_eq!(sent, vec![(0, 0), (1, 0), (2, 1), (3, 1)]);
    for p in &s.plans {
        assert_eq!(p.ranks.len(), 2, "step {}: one plan rank per group", p.step);
        let rows = p.ranks.iter().flatten().map(|m| m.tokens());
        assert!(rows.clone().all(|t| t <= 256), "step {}", p.step);
    }
    let longest = s.plans.iter().flat_map(|p| p.ranks.iter().flatten());
    assert!(longest.map(|m| m.tokens()).max().unwrap() > 128);
    // Every document once; a step's counts are its documents' (a group's
    // second rank is not counted again).
    let trained: Vec<DocId> = s.committed.iter().flat_map(|(_, x)| x.clone()).collect();
    assert_eq!(trained.len(), d.len());
    let mut ids: Vec<DocId> = trained.clone();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), d.len());
    for (m, docs) in &s.committed {
        assert_eq!(m.docs, docs.len() as u64, "step {}", m.step);
        let tokens: u64 = docs
            .iter()
            .map(|id| d.iter().find(|x| x.id == *id).unwrap().tokens())
            .sum();
        assert_eq!(m.tokens, tokens, "step {}", m.step);
        assert_eq!(m.world_size, 4);
        assert!((m.loss - 2.0).abs() < 1e-12);
    }
}

#[test]
fn without_context_a_document_longer_than_a_rank_fails_the_plan() {
    let mut s = Sim::new();
    s.submit(context_spec(1, 1, 2), long_docs(20));
    s.worker("a");
    s.run();
    assert_eq!(s.state(), JobState::Failed);
}

#[test]
fn a_generation_leaves_out_the_workers_of_a_partial_group() {
    let mut s = Sim::new();
    for w in ["a", "b", "c"] {
        s.worker(w);
    }
    s.submit(context_spec(2, 2, 4), long_docs(30));
    let members = |s: &Sim| -> Vec<u32> {
        s.configures
            .iter()
            .filter_map(|(_, m)| match m {
                ToWorker::Configure { rank, .. } => Some(*rank),
                _ => None,
            })
            .collect()
    };
    while s.committed.len() < 2 {
        assert!(s.step_once());
    }
    // The third worker waits: it would not make a whole group more.
    assert_eq!(members(&s), vec![0, 1]);
    assert!(s.committed.iter().all(|(m, _)| m.world_size == 2));
    // A fourth makes one: the next generation is two groups.
    s.worker("d");
    s.run();
    assert_eq!(s.state(), JobState::Completed);
    assert_eq!(members(&s), vec![0, 1, 0, 1, 2, 3]);
    let last = &s.committed.last().unwrap().0;
    assert_eq!(last.world_size, 4);
    assert_eq!(s.plans.last().unwrap().ranks.len(), 2);
    let trained: usize = s.committed.iter().map(|(_, d)| d.len()).sum();
    assert_eq!(trained, 30);
}

//! The shell carrying out the core's effects against a store that fails.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::*;
use crate::core::{CoordinatorOptions, JobState, Registration};
use crate::job::spec::JobSpec;
use crate::stream::doc::{DocBody, DocId, Document, Sequence};

fn spec(dir: &std::path::Path) -> JobSpec {
    let text = format!(
        "[job]\nname = \"t\"\nsteps = 2\noutput_dir = \"{}\"\n\
         [model]\ninit = \"random\"\nconfig = \"/dev/null\"\n\
         [data]\ntrain = [\"/dev/null\"]\nformat = \"sft\"\n\
         [batch]\ndocs_per_step = 2\n",
        dir.join("out").display()
    );
    toml::from_str(&text).unwrap()
}

fn docs(n: u64) -> Arc<[Document]> {
    (1..=n)
        .map(|line| Document {
            id: DocId { file: 0, line },
            body: DocBody::Sft(Sequence::new(vec![7; 8], vec![7; 8])),
        })
        .collect::<Vec<_>>()
        .into()
}

/// Regression (issue 32, bug 1): a failed persist still sent. The store
/// refused the job's writes at submit, yet the worker was configured:
/// it would train on a generation the store never recorded (after a
/// restart the coordinator and the workers would disagree). Nothing a
/// failed write guarded goes out; the job fails in memory only, and the
/// store keeps its last durable state.
#[test]
fn a_failed_persist_sends_nothing_it_guarded() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let shared = Shared::new(
        Coordinator::new(CoordinatorOptions::default()),
        store.clone(),
        crate::shell::output::Holder {
            id: "c".into(),
            state_dir: dir.path().into(),
        },
    );
    shared
        .apply(Event::RegisterWorker {
            id: "w".into(),
            reg: Registration {
                hostname: "h".into(),
                collective_addr: "127.0.0.1:9".into(),
                ..Default::default()
            },
        })
        .unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    shared.open_session("w", tx).unwrap();

    store.fail_writes(true);
    let submit = Event::SubmitJob {
        id: "job".into(),
        spec: Arc::new(spec(dir.path())),
        spec_toml: String::new(),
        docs: docs(4),
        start: None,
    };
    let err = shared.apply(submit).unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal);
    assert!(err.message().contains("injected write failure"), "{err}");
    // The submit's own write failed: no Configure (or anything else)
    // reached the worker.
    let mut sent = Vec::new();
    while let Ok(m) = rx.try_recv() {
        sent.push(m);
    }
    assert!(
        sent.iter()
            .all(|m| !matches!(m, Ok(ToWorker::Configure { .. }))),
        "the worker was configured for a job the store never recorded: {sent:?}"
    );
    // The job ended in memory, naming the store; the store holds nothing.
    let (state, reason) = shared.read(|c| {
        let j = c.job("job").unwrap();
        (j.rec.state, j.rec.reason.clone())
    });
    assert_eq!(state, JobState::Failed);
    assert!(reason.contains("store refused"), "{reason}");
    store.fail_writes(false);
    assert!(store.jobs().unwrap().is_empty());
}

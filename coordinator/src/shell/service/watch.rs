//! `WatchJob`: a job's committed steps from the store, then its live
//! items, until the job ends.

use std::pin::Pin;

use accrue_proto::v1 as wire;
use futures::Stream;
use tokio::sync::broadcast::error::RecvError;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::convert;
use super::shared::{now_ms, Shared};
use crate::core::{EventKind, WatchItem};

pub(super) type WatchStream =
    Pin<Box<dyn Stream<Item = Result<wire::WatchJobResponse, Status>> + Send>>;

/// The watch of `job` from committed step `from_step` (0: live items only).
pub(super) fn watch(shared: &Shared, job: String, from_step: u64) -> Result<WatchStream, Status> {
    // Subscribe before reading history so nothing falls in between.
    let mut live = shared.subscribe();
    let (history, state, last_step) = {
        let inner = shared.lock();
        let j = inner.core.job(&job).map_err(super::shared::core_status)?;
        let history = if from_step > 0 {
            inner
                .store
                .steps(&job, from_step)
                .map_err(|e| Status::internal(e.to_string()))?
        } else {
            Vec::new()
        };
        (history, j.rec.state, j.rec.step)
    };
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    tokio::spawn(async move {
        let mut sent_up_to = 0;
        for r in &history {
            sent_up_to = r.metrics.step;
            if tx
                .send(Ok(convert::watch_item(&WatchItem::Step(Box::new(
                    r.metrics.clone(),
                )))))
                .await
                .is_err()
            {
                return;
            }
        }
        if state.is_terminal() {
            let end = WatchItem::Event {
                kind: EventKind::State,
                message: format!("job is {} at step {last_step}", state.name()),
                state,
                unix_ms: now_ms(),
                reason: None,
                aborted_step: None,
            };
            let _ = tx.send(Ok(convert::watch_item(&end))).await;
            return;
        }
        loop {
            match live.recv().await {
                Ok((j, item)) if j == job => {
                    if matches!(&item, WatchItem::Step(m) if m.step <= sent_up_to) {
                        continue;
                    }
                    let terminal =
                        matches!(&item, WatchItem::Event { state, .. } if state.is_terminal());
                    if tx.send(Ok(convert::watch_item(&item))).await.is_err() || terminal {
                        return;
                    }
                }
                Ok(_) => {}
                Err(RecvError::Lagged(n)) => {
                    let _ = tx
                        .send(Err(Status::data_loss(format!(
                            "watcher fell {n} items behind"
                        ))))
                        .await;
                    return;
                }
                Err(RecvError::Closed) => return,
            }
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

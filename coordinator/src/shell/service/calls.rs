//! Endpoint calls waiting for their generation (`[rl.serve]`): each
//! caller holds the receiving end of a one-shot channel, found here by
//! its call number when the core hands out its answer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use tokio::sync::oneshot;
use tracing::debug;

use crate::rl::serve::Served;

/// Calls waiting for their generation, by call number.
#[derive(Default)]
pub(super) struct Calls {
    waiting: Mutex<HashMap<u64, (String, oneshot::Sender<Served>)>>,
    next: AtomicU64,
}

impl Calls {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (String, oneshot::Sender<Served>)>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new call of `job`: its number, and where its answer arrives.
    pub(super) fn open(&self, job: &str) -> (u64, oneshot::Receiver<Served>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let (tx, rx) = oneshot::channel();
        self.lock().insert(id, (job.to_string(), tx));
        (id, rx)
    }

    /// A call whose caller went away.
    pub(super) fn forget(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// An ended job's calls: their callers get an error.
    pub(super) fn drop_job(&self, job: &str) {
        self.lock().retain(|_, (j, _)| j != job);
    }

    /// Hands generated calls to their callers.
    pub(super) fn deliver(&self, served: Vec<Served>) {
        let mut calls = self.lock();
        for s in served {
            match calls.remove(&s.id) {
                Some((_, tx)) => {
                    let _ = tx.send(s);
                }
                None => debug!(call = s.id, "a served call's caller went away"),
            }
        }
    }
}

//! Rollout pushers waiting for room in a streamed job's queue: a commit
//! (or a job's end) wakes them to try again.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::watch;

/// Wakes pushers waiting for room in a rollout queue.
pub(crate) struct Signals {
    pub(crate) space: watch::Sender<u64>,
    pub(crate) waiting: AtomicUsize,
}

impl Default for Signals {
    fn default() -> Self {
        Self {
            space: watch::channel(0).0,
            waiting: AtomicUsize::new(0),
        }
    }
}

impl Signals {
    /// Something that may free room or end a job happened: waiters re-check.
    pub(crate) fn wake(&self) {
        self.space.send_modify(|v| *v = v.wrapping_add(1));
    }
}

/// Counts a waiting pusher for as long as it waits (also when dropped).
pub(crate) struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    pub(crate) fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::SeqCst);
        Self(n)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

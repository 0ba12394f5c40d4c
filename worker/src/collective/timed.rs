//! Time spent inside collectives, so a step's `collective_s` is measured
//! rather than hidden in compute (FSDP's gathers) and optimizer time (the
//! gradient reduction). [`Timed`] wraps a backend and adds the wall time of
//! every operation to a per-thread total: each rank runs its collectives on
//! its own runner thread, so ranks sharing a process (tests) never mix.

use std::cell::Cell;
use std::time::Instant;

use tch::Tensor;

use super::{AbortHandle, Collective, CollectiveError};

thread_local! {
    static SPENT_S: Cell<f64> = const { Cell::new(0.0) };
}

/// Seconds this thread has spent inside [`Timed`] collectives so far.
pub fn spent_s() -> f64 {
    SPENT_S.with(Cell::get)
}

/// A collective whose operations count towards [`spent_s`].
pub struct Timed(pub Box<dyn Collective>);

impl Timed {
    fn time<T>(f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        let dt = start.elapsed().as_secs_f64();
        SPENT_S.with(|s| s.set(s.get() + dt));
        out
    }
}

impl Collective for Timed {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        Self::time(|| self.0.all_reduce_sum(t))
    }
    fn reduce_scatter_sum(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        Self::time(|| self.0.reduce_scatter_sum(t))
    }
    fn all_gather(&mut self, t: &mut Tensor) -> Result<(), CollectiveError> {
        Self::time(|| self.0.all_gather(t))
    }
    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<(), CollectiveError> {
        Self::time(|| self.0.broadcast(t, root))
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Self::time(|| self.0.barrier())
    }
    fn abort_handle(&self) -> Option<AbortHandle> {
        self.0.abort_handle()
    }
    fn device(&self) -> tch::Device {
        self.0.device()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::local::LocalGroup;

    #[test]
    fn operations_count_on_the_calling_thread_only() {
        let handles: Vec<_> = LocalGroup::new(2)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let mut c = Timed(Box::new(c));
                    let before = spent_s();
                    let mut t = Tensor::ones([4], (tch::Kind::Float, tch::Device::Cpu));
                    if c.rank() == 1 {
                        // Rank 0 waits for rank 1 inside the all-reduce.
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                    c.all_reduce_sum(&mut t).unwrap();
                    assert_eq!(f64::try_from(t.sum(tch::Kind::Float)).unwrap(), 8.0);
                    (c.rank(), spent_s() - before)
                })
            })
            .collect();
        let mut got: Vec<(usize, f64)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        got.sort_by_key(|g| g.0);
        assert!(got[0].1 >= 0.04, "rank 0 waited inside: {got:?}");
        assert!(got[1].1 < got[0].1, "rank 1 arrived last: {got:?}");
        assert_eq!(spent_s(), 0.0, "the test thread ran no collective");
    }
}

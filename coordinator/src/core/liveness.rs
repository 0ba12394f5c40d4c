//! Whether a worker has gone silent, judged net of the coordinator's own
//! delays (issue 19). Two of them are the coordinator's, not the workers':
//! - a *stall*: the shell could not listen at all (the state lock held, its
//!   threads blocked); its tick comes late by that much, and the shell
//!   reports the lateness;
//! - a *backlog*: the shell listens but reads behind (at 4096 workers,
//!   back-to-back re-formations keep its threads busy and every worker's
//!   heartbeats reach the state machine 1–2.6 s after they were sent, while
//!   the tick stays on time). The shell measures each heartbeat's delay
//!   against the quickest of its session; the backlog is what most of the
//!   heartbeats read in one tick period were delayed by.
//!
//! A worker is lost once silent past the timeout after both are taken off.
//! The backlog credit only ever shortens silence: a worker whose own
//! heartbeats are slow (its path, its clock) is judged as before, and one
//! heard with a backlog already counted gets no second credit for it.

/// The share of a tick period's heartbeats whose delay must exceed the
/// backlog (a few slow workers do not move it; a queue every reader
/// waits behind does).
const BACKLOG_QUANTILE: f64 = 0.9;

/// When a worker was last heard, and the coordinator's delays then.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Heard {
    pub at_ms: i64,
    /// [`Liveness`]'s stall total then.
    stalled_ms: i64,
    /// How late that message was read (its own measured delay, or the
    /// backlog then when it carried no send time).
    lag_ms: i64,
}

/// The coordinator's delays, as its shell reports them.
#[derive(Debug, Clone, Default)]
pub struct Liveness {
    /// Total time the shell reported itself stalled.
    stalled_ms: i64,
    /// The current backlog (0 when not measured lately).
    backlog_ms: i64,
    /// When the backlog was last measured.
    backlog_at_ms: i64,
    /// Delays of the heartbeats read since the last tick.
    lags: Vec<i64>,
}

impl Liveness {
    /// A message from a worker at `now_ms`, read `lag_ms` late (None: it
    /// carried no send time; it waited like everything else read now).
    pub fn heard(&mut self, now_ms: i64, lag_ms: Option<i64>) -> Heard {
        let lag_ms = match lag_ms {
            Some(l) => {
                let l = l.max(0);
                self.lags.push(l);
                l
            }
            None => self.backlog_ms,
        };
        Heard {
            at_ms: now_ms,
            stalled_ms: self.stalled_ms,
            lag_ms,
        }
    }

    /// A tick: adds the stall the shell measured and takes the backlog
    /// from the heartbeats read since the last one. With none read, the
    /// last measure stands for one heartbeat timeout, then lapses (a
    /// coordinator reading nothing is stalled, which the stall covers, or
    /// hears from no one, which is no backlog). Capped at `timeout_ms`: a
    /// backlog longer than the timeout itself only postpones detection.
    pub fn tick(&mut self, now_ms: i64, stalled_ms: i64, timeout_ms: i64) {
        self.stalled_ms += stalled_ms.max(0);
        if self.lags.is_empty() {
            if now_ms - self.backlog_at_ms > timeout_ms {
                self.backlog_ms = 0;
            }
            return;
        }
        let at = ((self.lags.len() - 1) as f64 * (1.0 - BACKLOG_QUANTILE)).round() as usize;
        let (_, &mut nth, _) = self.lags.select_nth_unstable_by(at, |a, b| b.cmp(a));
        self.backlog_ms = nth.min(timeout_ms.max(0));
        self.backlog_at_ms = now_ms;
        self.lags.clear();
    }

    /// How long a worker last heard as `h` has been silent while the
    /// coordinator was listening and keeping up: wall time since, less the
    /// stalls since, less the backlog grown past what its last message
    /// already waited.
    pub fn silent_ms(&self, h: &Heard, now_ms: i64) -> i64 {
        let stalls = self.stalled_ms - h.stalled_ms;
        let backlog = (self.backlog_ms - h.lag_ms).max(0);
        now_ms - h.at_ms - stalls - backlog
    }

    /// The current backlog (for status and metrics).
    pub fn backlog_ms(&self) -> i64 {
        self.backlog_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_is_wall_time_when_the_coordinator_keeps_up() {
        let mut l = Liveness::default();
        let h = l.heard(1_000, Some(0));
        l.tick(1_200, 0, 2_000);
        assert_eq!(l.silent_ms(&h, 3_500), 2_500);
    }

    #[test]
    fn a_grown_backlog_is_credited_but_a_standing_one_is_not() {
        let mut l = Liveness::default();
        // Heard with no delay, then every heartbeat read comes 1.5 s late.
        let early = l.heard(1_000, Some(0));
        l.tick(1_200, 0, 2_000);
        let late = l.heard(2_000, Some(1_500));
        for _ in 0..9 {
            l.heard(2_000, Some(1_500));
        }
        l.tick(2_200, 0, 2_000);
        assert_eq!(l.backlog_ms(), 1_500);
        // 2.5 s of wall silence, 1 s of it while keeping up.
        assert_eq!(l.silent_ms(&early, 3_500), 1_000);
        // Heard already 1.5 s late: the backlog is no news for it.
        assert_eq!(l.silent_ms(&late, 4_500), 2_500);
        // Messages without a send time waited like the rest.
        let other = l.heard(2_300, None);
        assert_eq!(l.silent_ms(&other, 4_300), 2_000);
    }

    #[test]
    fn a_few_slow_workers_do_not_make_a_backlog() {
        let mut l = Liveness::default();
        let h = l.heard(1_000, Some(0));
        for i in 0..100 {
            l.heard(1_100, Some(if i < 5 { 1_800 } else { 10 }));
        }
        l.tick(1_200, 0, 2_000);
        assert_eq!(l.backlog_ms(), 10);
        assert_eq!(l.silent_ms(&h, 3_000), 1_990);
    }

    #[test]
    fn the_backlog_is_capped_and_lapses_when_nothing_is_read() {
        let mut l = Liveness::default();
        let h = l.heard(0, Some(0));
        l.heard(100, Some(60_000));
        l.tick(200, 0, 2_000);
        assert_eq!(l.backlog_ms(), 2_000);
        assert_eq!(l.silent_ms(&h, 3_000), 1_000);
        // Nothing read for longer than the timeout: no backlog is known.
        l.tick(1_000, 0, 2_000);
        assert_eq!(l.backlog_ms(), 2_000);
        l.tick(2_201, 0, 2_000);
        assert_eq!(l.backlog_ms(), 0);
        assert_eq!(l.silent_ms(&h, 3_000), 3_000);
    }

    #[test]
    fn stalls_are_credited_from_when_a_worker_was_heard() {
        let mut l = Liveness::default();
        l.tick(100, 700, 2_000);
        let h = l.heard(1_000, None);
        l.tick(1_200, 5_000, 2_000);
        assert_eq!(l.silent_ms(&h, 7_000), 1_000);
    }
}

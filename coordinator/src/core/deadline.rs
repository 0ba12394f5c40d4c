//! The step deadline (issue 14): how long a dispatched plan may go
//! unanswered before its silent members are treated as lost. Heartbeats
//! only say a worker's process is alive; a trainer thread that hangs keeps
//! heartbeating, and without a deadline its job would wait forever.

/// Never less than this when derived from observed step times: a first
/// step (or a much larger one) has nothing to go by.
pub const FLOOR_MS: f64 = 600_000.0;
/// A derived deadline allows this many times the slowest pace seen.
pub const SLACK: f64 = 10.0;

/// The slowest pace a job's plans ran at (live only: a restarted
/// coordinator starts again from the floor).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pace {
    /// Milliseconds per planned token, the slowest plan so far.
    slowest_ms_per_token: Option<f64>,
}

impl Pace {
    /// Notes a plan of `tokens` tokens that took `ms` from dispatch to its
    /// last result.
    pub fn observe(&mut self, ms: i64, tokens: u64) {
        if tokens == 0 || ms <= 0 {
            return;
        }
        let pace = ms as f64 / tokens as f64;
        self.slowest_ms_per_token = Some(self.slowest_ms_per_token.map_or(pace, |s| s.max(pace)));
    }

    /// The deadline of a plan of `tokens` tokens: `configured_s` when the
    /// spec sets `faults.step_timeout_s`, else [`SLACK`] times the slowest
    /// pace seen, scaled to this plan, and at least [`FLOOR_MS`].
    pub fn deadline_ms(&self, configured_s: Option<f64>, tokens: u64) -> i64 {
        if let Some(s) = configured_s {
            return (s * 1000.0).ceil() as i64;
        }
        let derived = self
            .slowest_ms_per_token
            .map_or(0.0, |p| SLACK * p * tokens as f64);
        derived.max(FLOOR_MS).min(i64::MAX as f64 / 2.0) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configured_timeout_wins() {
        let mut p = Pace::default();
        p.observe(1_000_000, 10);
        assert_eq!(p.deadline_ms(Some(2.5), 10), 2_500);
    }

    #[test]
    fn the_derived_deadline_scales_the_slowest_pace_and_has_a_floor() {
        let mut p = Pace::default();
        assert_eq!(p.deadline_ms(None, 1_000_000), FLOOR_MS as i64);
        p.observe(2_000, 1_000); // 2 ms per token
        p.observe(1_000, 1_000); // faster: ignored
        assert_eq!(p.deadline_ms(None, 100_000), 2_000_000);
        assert_eq!(p.deadline_ms(None, 10), FLOOR_MS as i64);
        p.observe(0, 10);
        p.observe(10, 0);
        assert_eq!(p.deadline_ms(None, 100_000), 2_000_000);
    }
}

//! `[tracking]`: the metric trackers a job writes to besides
//! `metrics.jsonl` and Prometheus. No checks: every value is valid.

use serde::{Deserialize, Serialize};

/// `[tracking]`: where metrics go besides `metrics.jsonl` and Prometheus.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrackingSection {
    /// TensorBoard event files in `OUTPUT_DIR/tb/`, written by the
    /// coordinator: every step and eval metric of metrics.jsonl as a scalar.
    #[serde(default)]
    pub tensorboard: bool,
}

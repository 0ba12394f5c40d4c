//! `[tracking] tensorboard = true`: a job trained by a fake worker over
//! the real protocol leaves an event file in OUTPUT_DIR/tb whose records
//! (both CRCs checked) hold every step's metrics under metrics.jsonl's
//! names.

mod common;

use accrue_coordinator::shell::tensorboard;
use accrue_coordinator::wire;
use common::{fake_worker, submit, FakeWorker};

fn sums(p: &wire::StepPlan) -> wire::MetricSums {
    common::counted(common::loss_2(p), p)
}

const SPEC: &str =
    "[job]\nname = \"tb\"\nsteps = 3\noutput_dir = \"out\"\n[model]\ninit = \"random\"\n\
     config = \"tiny.json\"\n[data]\ntrain = [\"train.jsonl\"]\nformat = \"sft\"\n\
     [batch]\ndocs_per_step = 4\n[tracking]\ntensorboard = true\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensorboard_events_hold_every_step_metric() {
    let (dir, s, _) = common::start_with_http().await;
    submit(&s.url, dir.path(), SPEC).await;
    fake_worker(s.url.clone(), FakeWorker::new(sums)).await;
    let tb = dir.path().join("out/tb");
    let files: Vec<_> = std::fs::read_dir(&tb)
        .unwrap_or_else(|e| panic!("{}: {e}", tb.display()))
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let events = tensorboard::read(&files[0]).unwrap();
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(dir.path().join("out/metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    let steps: Vec<&tensorboard::Event> = events.iter().filter(|e| e.summary.is_some()).collect();
    assert_eq!(steps.len(), lines.len());
    for (e, line) in steps.iter().zip(&lines) {
        assert_eq!(e.step, line["step"].as_i64().unwrap());
        let value = |tag: &str| {
            e.summary
                .as_ref()
                .unwrap()
                .value
                .iter()
                .find(|v| v.tag == tag)
                .and_then(|v| v.simple_value)
                .unwrap_or_else(|| panic!("step {}: no {tag}", e.step))
        };
        // Every number of the metrics.jsonl line, by the same name.
        for key in ["loss", "tokens", "docs", "lr", "grad_norm", "tokens_per_s"] {
            let want = line[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} in {line}"));
            assert_eq!(value(&format!("train/{key}")), want as f32, "{key}");
        }
    }
}

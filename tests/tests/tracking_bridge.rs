//! scripts/track.py (issue 18): follows a metrics.jsonl the way the
//! coordinator writes it — lines appended while it runs, an eval line, a
//! step re-committed after a recovery — into W&B (offline mode, read back
//! from the run file with W&B's own record protobuf) and MLflow (a local
//! store, read back with its client). Installs wandb / mlflow-skinny into
//! the venv on first use.

mod real;

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use accrue_coordinator::core::{EvalMetrics, StepMetrics};
use real::root;

fn step_line(step: u64) -> String {
    let mut m = StepMetrics {
        step,
        loss: 4.0 / step as f64,
        tokens: 100 * step,
        lr: 1e-3,
        ..Default::default()
    };
    m.extra.insert("kl".into(), 0.01 * step as f64);
    let mut v = serde_json::to_value(&m).unwrap();
    v["job"] = "j".into();
    v.to_string()
}

fn eval_line(step: u64) -> String {
    let e = EvalMetrics {
        step,
        loss: 0.25,
        loss_tokens: 9,
        tokens: 10,
        docs: 3,
        extra: Default::default(),
        sources: Default::default(),
        unix_ms: 1,
    };
    serde_json::json!({"job": "j", "eval": e}).to_string()
}

/// Installs both trackers once, before either test runs its bridge: two
/// pip installs into one venv at once can break each other.
fn ensure_trackers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let py = root().join(".venv/bin/python");
        let have = Command::new(&py)
            .args(["-c", "import wandb, mlflow"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !have {
            let ok = Command::new(&py)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "wandb==0.31.0",
                    "mlflow-skinny==3.17.2",
                ])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "pip install wandb mlflow-skinny failed");
        }
    });
}

/// Starts the bridge following `metrics`, appends steps 1..=4 (step 2
/// twice, an eval after 3) while it runs, and waits for it to stop at
/// step 4.
fn follow(tracker: &str, metrics: &Path, extra: &[&str], env: &[(&str, &str)]) {
    ensure_trackers();
    std::fs::write(metrics, format!("{}\n", step_line(1))).unwrap();
    let child = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("scripts/track.py"))
        .args([
            tracker,
            metrics.to_str().unwrap(),
            "--follow",
            "--steps",
            "4",
            "--poll",
            "0.2",
        ])
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(metrics)
        .unwrap();
    for line in [
        step_line(2),
        step_line(2).replace("\"loss\":2.0", "\"loss\":99.0"),
        step_line(3),
        eval_line(3),
        step_line(4),
    ] {
        std::thread::sleep(Duration::from_millis(300));
        writeln!(f, "{line}").unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{tracker} bridge failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = String::from_utf8_lossy(&out.stdout);
    let summary: serde_json::Value = serde_json::from_str(last.lines().last().unwrap()).unwrap();
    assert_eq!(summary["steps"], 4, "{summary}");
}

#[test]
fn the_wandb_bridge_logs_every_step_and_eval_once_in_offline_mode() {
    let d = tempfile::tempdir().unwrap();
    let metrics = d.path().join("metrics.jsonl");
    let dir = d.path().to_str().unwrap();
    follow(
        "wandb",
        &metrics,
        &["--offline", "--dir", dir],
        &[("WANDB_SILENT", "true"), ("WANDB_MODE", "offline")],
    );
    let run = walk(d.path())
        .into_iter()
        .find(|p| p.extension().is_some_and(|e| e == "wandb"))
        .expect("an offline run file");
    let out = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("scripts/reference/read_wandb_offline.py"))
        .arg(&run)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let steps: Vec<u64> = rows.iter().map(|r| r["_step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2, 3, 4], "{rows:?}");
    for r in &rows {
        let s = r["_step"].as_f64().unwrap();
        assert_eq!(
            r["train/loss"].as_f64().unwrap(),
            4.0 / s,
            "{r}: the first line of a step"
        );
        assert!(
            (r["train/extra/kl"].as_f64().unwrap() - 0.01 * s).abs() < 1e-12,
            "{r}"
        );
        assert!(
            r.get("train/unix_ms").is_none() && r.get("train/cursor/epoch").is_none(),
            "{r}"
        );
    }
    assert_eq!(rows[2]["eval/loss"], 0.25, "{}", rows[2]);
}

#[test]
fn the_mlflow_bridge_logs_every_step_and_eval_once() {
    let d = tempfile::tempdir().unwrap();
    let metrics = d.path().join("metrics.jsonl");
    let uri = format!("file://{}", d.path().join("mlruns").display());
    follow(
        "mlflow",
        &metrics,
        &["--tracking-uri", &uri, "--experiment", "bridge"],
        &[("MLFLOW_ALLOW_FILE_STORE", "true")],
    );
    let script = format!(
        "import json, mlflow\nmlflow.set_tracking_uri({uri:?})\nc = mlflow.MlflowClient()\n\
         e = c.get_experiment_by_name('bridge')\nr = c.search_runs([e.experiment_id])[0]\n\
         h = lambda k: [[m.step, m.value] for m in sorted(c.get_metric_history(r.info.run_id, k), key=lambda m: m.step)]\n\
         print(json.dumps({{'loss': h('train/loss'), 'eval': h('eval/loss')}}))\n"
    );
    let out = Command::new(root().join(".venv/bin/python"))
        .args(["-c", &script])
        .env("MLFLOW_ALLOW_FILE_STORE", "true")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().last().unwrap()).unwrap();
    assert_eq!(
        got["loss"],
        serde_json::json!([[1, 4.0], [2, 2.0], [3, 4.0 / 3.0], [4, 1.0]])
    );
    assert_eq!(got["eval"], serde_json::json!([[3, 0.25]]));
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

//! Issue 14 with real processes: a poison document (one whose tokens
//! produce a NaN) is bisected out, quarantined and the job completes with
//! every other document trained exactly once; a job whose outputs cannot
//! be written fails, and `accrue watch` says so, instead of "completed".
//!
//! The poison: the tiny model's untied input embedding rows of the bytes
//! of "☃" (E2 98 83) are NaN, and exactly one document (appended to the
//! 96 synthetic ones, as line 97) contains that character. Any step
//! holding it has a NaN loss; no other document reads those rows.

use std::path::Path;
use std::time::Duration;

mod real;

use real::cluster::{lock, Cluster};

/// Writes `name.toml`: one epoch of the data, `docs_per_step` 16, the
/// given init and sharding, two workers.
fn write_spec(d: &Path, name: &str, init: &str, sharding: &str, extra: &str) -> std::path::PathBuf {
    let model = if init == "random" {
        "init = \"random\"\nconfig = \"tiny.json\"".to_string()
    } else {
        format!("init = \"{init}\"\nresume = false")
    };
    let spec = format!(
        r#"[job]
name = "{name}"
seed = 7
epochs = 1
output_dir = "out/{name}"
[model]
{model}
[data]
train = ["data/arith-sft.jsonl"]
format = "sft"
max_tokens = 256
[batch]
docs_per_step = 16
[optimizer]
lr = 1e-3
[parallel]
sharding = "{sharding}"
min_workers = 2
max_workers = 2
[checkpoint]
every_steps = 100
{extra}"#
    );
    let path = d.join(format!("{name}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

/// A copy of a checkpoint's weights (its shards merged into one
/// `model.safetensors`) with the "☃" byte rows of the input embedding set
/// to NaN.
fn poisoned_model(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::copy(from.join("config.json"), to.join("config.json")).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut poisoned = false;
    for e in std::fs::read_dir(from).unwrap() {
        let path = e.unwrap().path();
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        if !(file.starts_with("model") && file.ends_with(".safetensors")) {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            let mut data = t.data().to_vec();
            if name.ends_with("embed_tokens.weight") {
                let hidden = t.shape()[1];
                for row in "☃".bytes() {
                    let start = row as usize * hidden * 4;
                    for c in data[start..start + hidden * 4].chunks_exact_mut(4) {
                        c.copy_from_slice(&f32::NAN.to_le_bytes());
                    }
                }
                poisoned = true;
            }
            owned.push((name, t.dtype(), t.shape().to_vec(), data));
        }
    }
    assert!(poisoned, "no embed_tokens.weight in {}", from.display());
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, dt, shape, data)| {
            let v = safetensors::tensor::TensorView::new(*dt, shape.clone(), data).unwrap();
            (n.clone(), v)
        })
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(to.join("model.safetensors"), out).unwrap();
}

/// Two workers that stay up across jobs.
fn start_workers(c: &mut Cluster) {
    for _ in 0..2 {
        c.start_worker_with(None, &["--exit-on-release", "false"]);
    }
}

#[test]
fn a_poison_document_is_quarantined_and_the_job_completes_without_it() {
    let _g = lock();
    let mut c = Cluster::new();
    let d = c.d().to_path_buf();
    start_workers(&mut c);
    // Weights to poison: a one-step job's checkpoint.
    let prep = write_spec(&d, "prep", "random", "ddp", "");
    std::fs::write(
        &prep,
        std::fs::read_to_string(&prep)
            .unwrap()
            .replace("epochs = 1", "steps = 1"),
    )
    .unwrap();
    let id = c.submit(&prep);
    c.wait_completed(&id, Duration::from_secs(240));
    poisoned_model(&d.join("out/prep/checkpoints/step-1"), &d.join("poisoned"));
    let data = d.join("data/arith-sft.jsonl");
    let mut rows = std::fs::read_to_string(&data).unwrap();
    assert_eq!(rows.lines().count(), 96);
    rows.push_str("{\"prompt\": \"7☃7=\", \"completion\": \"14\"}\n");
    std::fs::write(&data, rows).unwrap();

    for sharding in ["fsdp", "ddp"] {
        let name = format!("poison-{sharding}");
        let faults = "[faults]\non_nonfinite = \"bisect\"\n";
        let spec = write_spec(&d, &name, "poisoned", sharding, faults);
        let id = c.submit(&spec);
        c.wait_completed(&id, Duration::from_secs(300));
        let q: serde_json::Value =
            serde_json::from_str(&c.accrue_ok(&["quarantine", &id, "--json"])).unwrap();
        let q = q.as_array().unwrap();
        assert_eq!(q.len(), 1, "{sharding}: {q:?}");
        assert_eq!(q[0]["doc_id"], "0:97", "{sharding}");
        let source = q[0]["source"].as_str().unwrap();
        assert!(
            source.ends_with("arith-sft.jsonl:97"),
            "{sharding}: {source}"
        );
        assert!(
            q[0]["detail"].as_str().unwrap().contains("non-finite"),
            "{sharding}: {q:?}"
        );
        // Every other document exactly once, the poison never committed.
        let manifests = c.manifests(&id);
        let mut seen = std::collections::BTreeMap::new();
        for m in &manifests {
            for doc in m.docs() {
                *seen.entry(doc.to_string()).or_insert(0) += 1;
            }
        }
        assert_eq!(seen.len(), 96, "{sharding}: documents trained");
        assert!(seen.values().all(|&n| n == 1), "{sharding}: {seen:?}");
        assert!(!seen.contains_key("0:97"), "{sharding}");
        assert!(
            manifests.iter().any(|m| m.attempts > 1),
            "{sharding}: the poisoned step was attempted again"
        );
        // Completed means the final checkpoint is on disk.
        let final_ckpt = d
            .join(format!("out/{name}/checkpoints"))
            .join(format!("step-{}", manifests.len()));
        assert!(
            final_ckpt.join("manifest.json").exists(),
            "{sharding}: {}",
            final_ckpt.display()
        );
    }
}

#[test]
fn outputs_that_cannot_be_written_fail_the_job_and_watch_exits_1() {
    let _g = lock();
    let mut c = Cluster::new();
    let d = c.d().to_path_buf();
    start_workers(&mut c);
    for (case, blocker) in [("ckpt", "checkpoints"), ("metrics", "metrics.jsonl")] {
        let name = format!("blocked-{case}");
        let spec = write_spec(&d, &name, "random", "ddp", "");
        std::fs::write(
            &spec,
            std::fs::read_to_string(&spec)
                .unwrap()
                .replace("epochs = 1", "steps = 2"),
        )
        .unwrap();
        // Where the job writes, something of the wrong kind is in the way
        // (as root, permissions would not stop the write).
        let out = d.join(format!("out/{name}"));
        std::fs::create_dir_all(&out).unwrap();
        if blocker == "checkpoints" {
            std::fs::write(out.join(blocker), "not a directory").unwrap();
        } else {
            std::fs::create_dir_all(out.join(blocker)).unwrap();
        }
        let id = c.submit(&spec);
        let watch = c.accrue(&["watch", &id]);
        assert_eq!(
            watch.status.code(),
            Some(1),
            "{case}: {watch:?}\n{}",
            c.logs()
        );
        let j = c.job(&id);
        assert_eq!(j["state"], "failed", "{case}: {j}");
        let reason = j["reason"].as_str().unwrap();
        assert!(reason.contains(blocker), "{case}: {reason}");
    }
}

//! End-to-end (issue 3 "Done means"): `accrue local` with one real
//! `accrue-worker` trains a tiny Llama (hidden 64, 2 layers) on synthetic
//! arithmetic, writes metrics.jsonl and checkpoints that `transformers`
//! loads, and a job resumed from a checkpoint continues at the same step and
//! data position with the same model and optimizer state. Issue 4: two
//! workers train the same curve at every sharding level, equal to one
//! worker's. Issue 5: the DPO demo's reward accuracy rises above 0.9.
//!
//! Needs the venv with torch (scripts/setup.sh) and `scripts/env.sh` sourced
//! for the worker build (scripts/test.sh does both).

use std::path::{Path, PathBuf};
use std::process::Command;

mod real;

use real::{root, write_tiny_config};

fn accrue(dir: &Path, args: &[&str]) -> std::process::Output {
    real::accrue_in(dir, args, String::new)
}

fn job(dir: &Path, name: &str, init: &str) -> PathBuf {
    let model = if init == "random" {
        "init = \"random\"\nconfig = \"tiny.json\"".to_string()
    } else {
        format!("init = \"{init}\"")
    };
    let spec = format!(
        r#"[job]
name = "{name}"
seed = 11
steps = 20
output_dir = "out/{name}"
[model]
{model}
[data]
train = ["data/arith-sft.jsonl"]
format = "sft"
max_tokens = 512
[batch]
docs_per_step = 16
[optimizer]
lr = 3e-3
warmup_steps = 2
[checkpoint]
every_steps = 10
"#
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn loss(m: &serde_json::Value) -> f64 {
    m["loss"].as_f64().unwrap()
}

#[test]
fn accrue_local_trains_checkpoints_and_resumes_at_the_same_step_and_cursor() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    accrue(
        d,
        &[
            "data",
            "synth",
            "--task",
            "arithmetic",
            "--out",
            "data",
            "--rows",
            "400",
        ],
    );
    write_tiny_config(d);

    // Run a: 20 steps from a random init.
    let a_spec = job(d, "a", "random");
    accrue(d, &["local", a_spec.to_str().unwrap(), "--workers", "1"]);
    let out_a = d.join("out/a");
    let a = metrics(&out_a.join("metrics.jsonl"));
    let steps: Vec<u64> = a.iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=20).collect::<Vec<_>>());
    for m in &a {
        for field in [
            "step",
            "loss",
            "tokens",
            "docs",
            "microbatches",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "step_time_s",
        ] {
            assert!(m.get(field).is_some(), "{field} missing from {m}");
        }
        assert!(loss(m).is_finite() && loss(m) > 0.0, "{m}");
        assert_eq!(m["docs"], 16);
        assert!(m["tokens"].as_u64().unwrap() > 0);
        assert!(m["grad_norm"].as_f64().unwrap().is_finite());
    }
    let first: f64 = a[..3].iter().map(loss).sum::<f64>() / 3.0;
    let last: f64 = a[17..].iter().map(loss).sum::<f64>() / 3.0;
    assert!(
        last < 0.8 * first,
        "the loss must fall: first steps {first:.3}, last steps {last:.3}"
    );

    // Checkpoints at 10 and 20, each complete, loadable by transformers.
    for step in [10u64, 20] {
        let ck = out_a.join(format!("checkpoints/step-{step}"));
        for f in ["config.json", "model.safetensors", "manifest.json"] {
            assert!(ck.join(f).is_file(), "{} missing", ck.join(f).display());
        }
        let m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(ck.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(m["step"], step);
        assert_eq!(m["cursor"], a[step as usize - 1]["cursor"]);
    }
    let ck10 = out_a.join("checkpoints/step-10");
    let py = root().join(".venv/bin/python");
    assert!(
        py.is_file(),
        "no venv at {} (run scripts/setup.sh)",
        py.display()
    );
    let ids = ["256", "49", "43", "50", "61", "51", "257"];
    let out = Command::new(&py)
        .arg(root().join("scripts/reference/load_checkpoint.py"))
        .arg(&ck10)
        .args(ids)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "transformers could not load {}:\n{}",
        ck10.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let hf: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(hf["finite"], true, "{hf}");
    assert_eq!(hf["architectures"][0], "LlamaForCausalLM");
    // embed + lm_head 2·320·64, per layer 4 attn (64·64, 2×64·32 for k/v, 64·64)
    // + 3·64·128 MLP + 2 norms, final norm.
    let per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64;
    assert_eq!(hf["params"], 2 * 320 * 64 + 2 * per_layer + 64);

    // The checkpoint is a complete model folder, and `accrue export` makes
    // the clean one a user uploads: bf16, sharded, no optimizer state;
    // transformers loads model and tokenizer, which encodes, decodes and
    // renders the chat template as Accrue did, and generates greedily.
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ] {
        assert!(
            ck10.join(f).is_file(),
            "{f} missing from {}",
            ck10.display()
        );
    }
    let exported = d.join("export");
    let out = accrue(
        d,
        &[
            "export",
            ck10.to_str().unwrap(),
            "--out",
            exported.to_str().unwrap(),
            "--dtype",
            "bfloat16",
            "--shard-size",
            "40KB",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(exported.join("model.safetensors.index.json").is_file());
    let files: Vec<String> = std::fs::read_dir(&exported)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        files.iter().filter(|f| f.starts_with("model-0")).count() >= 2,
        "{files:?}"
    );
    assert!(
        !files
            .iter()
            .any(|f| f.contains("optimizer") || f == "trainer.json"),
        "{files:?}"
    );
    let texts = ["12+30=42", "héllo ✓ <|eos|>", " spaces  and\ttabs\n"];
    let ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| {
            std::iter::once(256)
                .chain(t.replace("<|eos|>", "\u{1}").bytes().map(|b| {
                    if b == 1 {
                        257
                    } else {
                        u32::from(b)
                    }
                }))
                .collect()
        })
        .collect();
    let expect = serde_json::json!({
        "texts": texts,
        "ids": ids,
        "messages": [{"role": "user", "content": "12+30="}, {"role": "assistant", "content": "42"}],
        "rendered": "<|bos|><|user|>\n12+30=\n<|assistant|>\n42<|eos|>",
        "prompt_ids": [256, 49, 50, 43, 51, 48, 61],
        "new_tokens": 4,
    });
    let mut child = Command::new(&py)
        .arg(root().join("scripts/reference/check_export.py"))
        .arg(&exported)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write as _;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(expect.to_string().as_bytes())
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "transformers could not load the export:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let hf: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(hf["bad"], serde_json::json!([]), "{hf}");
    assert_eq!(hf["dtype"], "bfloat16", "{hf}");
    assert_eq!(hf["generated"].as_array().unwrap().len(), 4, "{hf}");

    // Run b resumes from a's step-10 checkpoint: steps 11..20 on the same
    // documents (same cursors), and since model and optimizer state are
    // restored, the same losses as run a.
    let b_spec = job(d, "b", ck10.to_str().unwrap());
    accrue(d, &["local", b_spec.to_str().unwrap(), "--workers", "1"]);
    let b = metrics(&d.join("out/b/metrics.jsonl"));
    let steps: Vec<u64> = b.iter().map(|m| m["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (11..=20).collect::<Vec<_>>());
    for (rb, ra) in b.iter().zip(&a[10..]) {
        let step = &rb["step"];
        assert_eq!(
            rb["cursor"], ra["cursor"],
            "step {step}: same data position"
        );
        assert_eq!(rb["tokens"], ra["tokens"], "step {step}: same documents");
        let (lb, la) = (loss(rb), loss(ra));
        assert!(
            (lb - la).abs() <= 1e-3 * la,
            "step {step}: resumed loss {lb} vs uninterrupted {la}"
        );
    }
}

fn small_job(dir: &Path, name: &str, sharding: &str, body: &str) -> PathBuf {
    let spec = format!(
        r#"[job]
name = "{name}"
seed = 5
output_dir = "out/{name}"
{body}
[model]
init = "random"
config = "tiny.json"
[optimizer]
lr = 3e-3
warmup_steps = 1
[parallel]
sharding = "{sharding}"
[checkpoint]
every_steps = 0
"#
    );
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

#[test]
fn two_workers_train_the_same_curve_at_every_sharding_level() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rows = ["--task", "arithmetic", "--out", "data", "--rows", "200"];
    accrue(d, &[&["data", "synth"][..], &rows[..]].concat());
    write_tiny_config(d);
    let body = "steps = 6\n[data]\ntrain = [\"data/arith-sft.jsonl\"]\nformat = \"sft\"\nmax_tokens = 256\n[batch]\ndocs_per_step = 24";
    let run = |name: &str, sharding: &str, workers: &str| {
        let spec = small_job(d, name, sharding, body);
        accrue(d, &["local", spec.to_str().unwrap(), "--workers", workers]);
        metrics(&d.join(format!("out/{name}/metrics.jsonl")))
    };
    let one = run("one", "ddp", "1");
    for sharding in ["ddp", "zero2", "fsdp"] {
        let two = run(&format!("two-{sharding}"), sharding, "2");
        assert_eq!(two.len(), 6);
        for (a, b) in one.iter().zip(&two) {
            assert_eq!(b["world_size"], 2, "{sharding}: {b}");
            // Two ranks spend measurable time inside collectives; one
            // rank has none to wait in.
            assert!(b["collective_s"].as_f64().unwrap() > 0.0, "{sharding}: {b}");
            assert_eq!(a["collective_s"].as_f64(), Some(0.0), "{a}");
            assert_eq!(a["docs"], b["docs"]);
            assert_eq!(a["loss_tokens"], b["loss_tokens"]);
            for field in ["loss", "grad_norm"] {
                let (x, y) = (a[field].as_f64().unwrap(), b[field].as_f64().unwrap());
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs(),
                    "{sharding} step {}: {field} {x} at 1 worker vs {y} at 2",
                    a["step"]
                );
            }
        }
    }
}

#[test]
fn dpo_runs_its_reference_pass_then_reward_accuracy_rises_above_0_9() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rows = ["--task", "arithmetic", "--out", "data", "--rows", "64"];
    accrue(d, &[&["data", "synth"][..], &rows[..]].concat());
    write_tiny_config(d);
    let body = "steps = 60\n[data]\ntrain = [\"data/arith-dpo.jsonl\"]\nformat = \"dpo\"\nmax_tokens = 256\n[batch]\ndocs_per_step = 32\n[objective]\nkind = \"dpo\"\nbeta = 0.1";
    let spec = small_job(d, "dpo", "ddp", body);
    accrue(d, &["local", spec.to_str().unwrap(), "--workers", "2"]);
    // The reference pass ran on the workers before step 1.
    let logs: String = (0..2)
        .map(|k| std::fs::read_to_string(d.join(format!("out/dpo/logs/worker-{k}.log"))).unwrap())
        .collect();
    assert!(logs.contains("reference chunk done"), "{logs}");
    let m = metrics(&d.join("out/dpo/metrics.jsonl"));
    assert_eq!(m.len(), 60);
    // Step 1 starts from the reference itself: zero rewards, loss log 2.
    assert!(
        (loss(&m[0]) - std::f64::consts::LN_2).abs() < 1e-6,
        "{}",
        m[0]
    );
    assert_eq!(m[0]["extra"]["rewards/margin"].as_f64().unwrap(), 0.0);
    for k in [
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
    ] {
        assert!(m[59]["extra"][k].as_f64().unwrap().is_finite(), "{k}");
    }
    let acc: f64 = m[50..]
        .iter()
        .map(|s| s["extra"]["rewards/accuracy"].as_f64().unwrap())
        .sum::<f64>()
        / 10.0;
    assert!(acc > 0.9, "reward accuracy over the last 10 steps: {acc}");
    assert!(loss(&m[59]) < 0.5 * loss(&m[0]), "{} → {}", m[0], m[59]);
}

/// DPO under fsdp (its cached reference pass included) trains the ddp
/// curve: same loss, grad norm and rewards at every step.
#[test]
fn dpo_under_fsdp_trains_the_ddp_curve() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rows = ["--task", "arithmetic", "--out", "data", "--rows", "32"];
    accrue(d, &[&["data", "synth"][..], &rows[..]].concat());
    write_tiny_config(d);
    let body = "steps = 5\n[data]\ntrain = [\"data/arith-dpo.jsonl\"]\nformat = \"dpo\"\nmax_tokens = 256\n[batch]\ndocs_per_step = 12\n[objective]\nkind = \"dpo\"\nbeta = 0.1";
    let run = |sharding: &str| {
        let spec = small_job(d, sharding, sharding, body);
        accrue(d, &["local", spec.to_str().unwrap(), "--workers", "2"]);
        metrics(&d.join(format!("out/{sharding}/metrics.jsonl")))
    };
    let (ddp, fsdp) = (run("ddp"), run("fsdp"));
    assert_eq!(fsdp.len(), 5);
    for (a, b) in ddp.iter().zip(&fsdp) {
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * x.abs().max(1e-3);
        for field in ["loss", "grad_norm"] {
            let (x, y) = (a[field].as_f64().unwrap(), b[field].as_f64().unwrap());
            assert!(close(x, y), "step {}: {field} ddp {x} fsdp {y}", a["step"]);
        }
        for k in ["rewards/margin", "rewards/accuracy", "logps/chosen"] {
            let (x, y) = (
                a["extra"][k].as_f64().unwrap(),
                b["extra"][k].as_f64().unwrap(),
            );
            assert!(close(x, y), "step {}: {k} ddp {x} fsdp {y}", a["step"]);
        }
    }
}

/// The RL loop under every sharding level (issue 17): two workers sample
/// seeded completions of the prompts (fsdp gathers the model for each
/// round), a regex verifier scores them, the policy trains 4 steps on
/// them. Every worker draws the same rollouts, round by round, at zero2
/// and fsdp as at ddp (the digest of its completion token ids in its log),
/// the steps see the same rewards and token counts, and the losses, grad
/// norms and final parameters agree within the fsdp-vs-ddp tolerance.
#[test]
fn rl_loop_generates_and_trains_alike_under_ddp_zero2_and_fsdp() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rows = [
        "--task",
        "arithmetic-small",
        "--out",
        "data",
        "--rows",
        "64",
    ];
    accrue(d, &[&["data", "synth"][..], &rows[..]].concat());
    write_tiny_config(d);
    // A random model seldom writes a digit: groups with and without one
    // give the policy gradient something to push.
    let body = "steps = 4\n[data]\nsource = \"generate\"\nformat = \"prompts\"\ntrain = [\"data/arith-sft.jsonl\"]\ntokenizer = \"bytes\"\nmax_tokens = 512\n[batch]\ndocs_per_step = 16\n[objective]\nkind = \"pg\"\n[rl]\ngroup_size = 4\n[rl.sampling]\ntemperature = 1.0\nmax_new_tokens = 6\n[rl.verifier]\nkind = \"regex\"\npattern = \"[0-9]\"";
    let run = |sharding: &str| {
        let spec = small_job(d, sharding, sharding, body);
        accrue(d, &["local", spec.to_str().unwrap(), "--workers", "2"]);
        let out = d.join(format!("out/{sharding}"));
        // (round, rank, digest of the rank's completions), from both logs:
        // which worker process became which rank is a race.
        let field = |line: &str, key: &str| -> String {
            let at = line.find(key).unwrap_or_else(|| panic!("{key} in {line}")) + key.len();
            line[at..]
                .trim_start_matches('"')
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect()
        };
        let mut digests: Vec<(u64, u64, String)> = (0..2)
            .flat_map(|k| {
                let log =
                    std::fs::read_to_string(out.join(format!("logs/worker-{k}.log"))).unwrap();
                log.lines()
                    .filter(|l| l.contains("generation round done"))
                    .map(|l| {
                        let n = |key| field(l, key).parse::<u64>().unwrap();
                        (n(" round="), n(" rank="), field(l, "digest="))
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        digests.sort();
        let m = metrics(&out.join("metrics.jsonl"));
        (digests, m, real::cluster::final_params_at(&out, 4))
    };
    let ddp = run("ddp");
    let rewards: Vec<f64> = ddp
        .1
        .iter()
        .map(|m| m["extra"]["rl/reward_mean"].as_f64().unwrap())
        .collect();
    assert!(
        rewards.iter().any(|&r| r > 0.0 && r < 1.0),
        "the verifier should reward some completions and not others: {rewards:?}"
    );
    // 0xcbf29ce484222325: the digest of no completions (an empty share).
    for rank in 0..2 {
        assert!(
            ddp.0
                .iter()
                .any(|d| d.1 == rank && d.2 != "cbf29ce484222325"),
            "rank {rank} generated: {:?}",
            ddp.0
        );
    }
    for sharding in ["zero2", "fsdp"] {
        let (digests, m, params) = run(sharding);
        assert_eq!(digests, ddp.0, "{sharding}: (round, rank, rollouts digest)");
        assert_eq!(m.len(), 4, "{sharding}");
        for (a, b) in ddp.1.iter().zip(&m) {
            let step = &a["step"];
            assert_eq!(b["world_size"], 2, "{sharding}: {b}");
            for k in ["docs", "tokens", "loss_tokens"] {
                assert_eq!(a[k], b[k], "{sharding} step {step}: {k}");
            }
            for k in [
                "rl/reward_mean",
                "rl/response_tokens_mean",
                "rl/completions",
            ] {
                assert_eq!(a["extra"][k], b["extra"][k], "{sharding} step {step}: {k}");
            }
            let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * x.abs().max(1e-3);
            for k in ["loss", "grad_norm"] {
                let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
                assert!(close(x, y), "{sharding} step {step}: {k} ddp {x} vs {y}");
            }
        }
        real::cluster::assert_same_params(&params, &ddp.2, sharding);
    }
}

/// Multi-turn episodes (issue 36) on two real worker processes, against
/// an environment program speaking the JSON-lines protocol: every
/// episode's first turn gets a tool message, its second ends it with the
/// environment's reward. The trainer sees each episode as one sequence and
/// recomputes the sampler's log-probs of its policy tokens across the
/// environment's (`logprob_diff`); the program resets, steps twice and
/// closes every episode, each under a new id.
#[test]
fn multi_turn_episodes_against_an_environment_program_train_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    accrue(
        d,
        &[
            "data",
            "synth",
            "--task",
            "arithmetic-small",
            "--out",
            "data",
            "--rows",
            "32",
        ],
    );
    write_tiny_config(d);
    std::fs::write(
        d.join("env.py"),
        r#"import json, sys
log = open("env.log", "a")
for line in sys.stdin:
    m = json.loads(line)
    log.write(m["type"] + " " + m["episode"] + " " + str(m.get("turn", "")) + "\n"); log.flush()
    if m["type"] != "step":
        continue
    if m["turn"] == 1:
        out = {"episode": m["episode"], "messages": [{"role": "tool", "content": "result-1"}]}
    else:
        r = float(len(m["content"]) % 2)
        out = {"episode": m["episode"], "done": True, "reward": r, "correct": r > 0}
    print(json.dumps(out), flush=True)
"#,
    )
    .unwrap();
    let body = "steps = 3\n[data]\nsource = \"generate\"\nformat = \"prompts\"\ntrain = [\"data/arith-sft.jsonl\"]\ntokenizer = \"bytes\"\nmax_tokens = 512\n[batch]\ndocs_per_step = 16\n[objective]\nkind = \"pg\"\n[rl]\ngroup_size = 4\n[rl.sampling]\ntemperature = 1.0\nmax_new_tokens = 6\n[rl.env]\nkind = \"command\"\ncommand = [\"python3\", \"env.py\"]\nmax_turns = 4\n[rl.verifier]\nkind = \"exact\"";
    // Colocated (both workers generate, then train), then disaggregated
    // (one worker only generates, on policy).
    for (name, rl) in [
        ("episodes", ""),
        ("episodes-apart", "generators = 1\nmax_staleness = 0\n"),
    ] {
        let _ = std::fs::remove_file(d.join("env.log"));
        let body = body.replace("[rl]\n", &format!("[rl]\n{rl}"));
        let spec = small_job(d, name, "ddp", &body);
        let out = accrue(d, &["local", spec.to_str().unwrap(), "--workers", "2"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        check_episodes(d, name);
    }
    // A program that prints garbage fails the job at its first turn,
    // naming the program and the line, never quoting it.
    std::fs::write(
        d.join("env.py"),
        "import sys\nfor line in sys.stdin:\n    if '\"step\"' in line:\n        print('garbage-from-env', flush=True)\n",
    )
    .unwrap();
    let spec = small_job(d, "garbage", "ddp", body);
    let out = std::process::Command::new(real::bin_dir().join("accrue"))
        .args(["local", spec.to_str().unwrap(), "--workers", "1"])
        .current_dir(d)
        .output()
        .expect("running accrue");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("environment: round")
            && err.contains("environment command \"python3\": stdout line 1: not JSON"),
        "{err}"
    );
    assert!(!err.contains("garbage-from-env"), "{err}");
    let trained = d.join("out/garbage/metrics.jsonl");
    assert!(
        !trained.exists() || metrics(&trained).iter().all(|r| r.get("eval").is_some()),
        "nothing trained"
    );
}

/// Issue 36: an agent harness drives a served job (`[rl.serve]`) through
/// its OpenAI-compatible endpoint with the `openai` Python client —
/// two-turn tool episodes, rewards reported per episode — while two
/// worker processes generate between steps and train on what the harness
/// reported. The harness checks the client-facing contract (a wrong key
/// refused, log-probs per token, turn 2's prompt extending turn 1's
/// tokens, an edited history refused by field, a repeated report answered
/// the same); the trainer's recomputed log-probs of every stitched
/// episode equal the generation's across the tool message.
#[test]
fn an_openai_client_drives_served_tool_episodes_that_train_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_tiny_config(d);
    let body = "steps = 3\n[data]\nsource = \"stream\"\nformat = \"rollouts\"\ntokenizer = \"bytes\"\nmax_tokens = 512\n[batch]\ndocs_per_step = 4\n[objective]\nkind = \"pg\"\n[rl]\ngroup_size = 2\n[rl.sampling]\nmax_new_tokens = 8\n[rl.serve]\n";
    let spec = small_job(d, "served", "ddp", body);
    let mut local = std::process::Command::new(real::bin_dir().join("accrue"))
        .args(["local", spec.to_str().unwrap(), "--workers", "2"])
        .args(["--metrics-listen", "off"])
        .current_dir(d)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(d.join("local.err")).unwrap())
        .spawn()
        .expect("running accrue local");
    let endpoint = d.join("out/served/endpoint.json");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !endpoint.exists() {
        assert!(
            std::time::Instant::now() < deadline && local.try_wait().unwrap().is_none(),
            "no endpoint.json: {}",
            std::fs::read_to_string(d.join("local.err")).unwrap_or_default()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&endpoint).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "the key file is its owner's only");
    }
    let harness = std::process::Command::new(root().join(".venv/bin/python"))
        .arg(root().join("scripts/reference/openai_episodes.py"))
        .arg(&endpoint)
        .output()
        .expect("running the harness");
    let status = local.wait().unwrap();
    let err = std::fs::read_to_string(d.join("local.err")).unwrap_or_default();
    assert!(
        harness.status.success(),
        "{}\n{err}",
        String::from_utf8_lossy(&harness.stderr)
    );
    assert!(status.success(), "{err}");
    let out = String::from_utf8_lossy(&harness.stdout);
    let seen: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    for check in ["refused_token", "refused_edit", "repeat_same"] {
        assert_eq!(seen[check], true, "{check}: {seen}");
    }
    assert!(seen["episodes"].as_u64().unwrap() >= 12, "{seen}");
    assert_eq!(
        seen["calls"].as_u64(),
        seen["episodes"].as_u64().map(|e| 2 * e)
    );
    // The tool message's tokens: the template's text after the reply.
    assert!(seen["tool_message_tokens"].as_u64().unwrap() > 0, "{seen}");
    let m = metrics(&d.join("out/served/metrics.jsonl"));
    assert_eq!(m.len(), 3);
    for s in &m {
        let diff = s["extra"]["logprob_diff"].as_f64().unwrap();
        assert!(
            diff < 1e-5,
            "trainer vs sampler log-probs across turns: {diff} ({s})"
        );
        assert!(s["loss_tokens"].as_u64().unwrap() > 0);
        assert_eq!(s["docs"], 4);
    }
}

/// The metrics and the environment program's log of a run of
/// `multi_turn_episodes_against_an_environment_program_train_exactly`.
fn check_episodes(d: &Path, name: &str) {
    let m = metrics(&d.join(format!("out/{name}/metrics.jsonl")));
    let steps: Vec<&serde_json::Value> = m
        .iter()
        .filter(|r| r.get("step").is_some() && r.get("eval").is_none())
        .collect();
    assert_eq!(steps.len(), 3);
    let env_turn = "<tool_response>result-1</tool_response>".len() as f64;
    let mut rewards = Vec::new();
    for s in &steps {
        let x = &s["extra"];
        if x.get("rl/turns_mean").is_none() {
            continue; // (a step whose rollouts were scored before it)
        }
        assert_eq!(x["rl/turns_mean"], 2.0, "{s}");
        assert_eq!(x["rl/env_tokens_mean"].as_f64(), Some(env_turn), "{s}");
        assert_eq!(
            x["rl/tool_calls_per_episode"], 0.0,
            "a program's messages are not tool calls: {s}"
        );
        rewards.push(x["rl/reward_mean"].as_f64().unwrap());
        let diff = x["logprob_diff"].as_f64().unwrap();
        assert!(
            diff < 1e-5,
            "trainer vs sampler log-probs across turns: {diff}"
        );
        assert!(s["loss_tokens"].as_u64().unwrap() > 0);
    }
    assert!(!rewards.is_empty());
    assert!(rewards.iter().any(|&r| r > 0.0 && r < 1.0), "{rewards:?}");
    // The program's view: reset, step 1, step 2, close, per episode id.
    let log = std::fs::read_to_string(d.join("env.log")).unwrap();
    let mut per: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for l in log.lines() {
        let mut f = l.split(' ');
        let (kind, id, turn) = (f.next().unwrap(), f.next().unwrap(), f.next().unwrap_or(""));
        per.entry(id.to_string())
            .or_default()
            .push(format!("{kind}{turn}"));
    }
    assert!(per.len() >= 48, "3 steps of 16 episodes: {}", per.len());
    for (id, seen) in &per {
        assert_eq!(seen, &["reset", "step1", "step2", "close"], "episode {id}");
    }
}

/// Disaggregated RL (`rl.generators = 1`, issue 17) on two real worker
/// processes: one trains, one only generates, and trainer rank 0 sends
/// every step's policy over the weight ring. On policy (`rl.max_staleness
/// = 0`) it draws the same rollouts as the colocated loop on two workers
/// (same rewards, tokens and documents per step), and trains to the same
/// losses and final parameters within the tolerance of another world
/// size; the generator logs the policy of every step it received.
#[test]
fn rl_loop_disaggregated_on_policy_trains_as_colocated() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rows = [
        "--task",
        "arithmetic-small",
        "--out",
        "data",
        "--rows",
        "64",
    ];
    accrue(d, &[&["data", "synth"][..], &rows[..]].concat());
    write_tiny_config(d);
    let body = |rl: &str| {
        format!("steps = 4\n[data]\nsource = \"generate\"\nformat = \"prompts\"\ntrain = [\"data/arith-sft.jsonl\"]\ntokenizer = \"bytes\"\nmax_tokens = 512\n[batch]\ndocs_per_step = 16\n[objective]\nkind = \"pg\"\n[rl]\ngroup_size = 4\nmax_staleness = 0\n{rl}[rl.sampling]\ntemperature = 1.0\nmax_new_tokens = 6\n[rl.verifier]\nkind = \"regex\"\npattern = \"[0-9]\"")
    };
    let run = |name: &str, rl: &str| {
        let spec = small_job(d, name, "ddp", &body(rl));
        accrue(d, &["local", spec.to_str().unwrap(), "--workers", "2"]);
        let out = d.join(format!("out/{name}"));
        let logs: Vec<String> = (0..2)
            .map(|k| std::fs::read_to_string(out.join(format!("logs/worker-{k}.log"))).unwrap())
            .collect();
        (
            metrics(&out.join("metrics.jsonl")),
            real::cluster::final_params_at(&out, 4),
            logs,
        )
    };
    let (colocated, params, _) = run("colocated", "");
    let (apart, apart_params, logs) = run("apart", "generators = 1\n");
    let generator: Vec<&String> = logs
        .iter()
        .filter(|l| l.contains("configured as a generator"))
        .collect();
    assert_eq!(generator.len(), 1, "one worker generates");
    let g = generator[0];
    assert!(!g.contains("step done"), "the generator trained a step");
    let received: Vec<u64> = g
        .lines()
        .filter(|l| l.contains("policy received from trainer rank 0"))
        .map(|l| {
            let at = l.find(" step=").expect("step in the line") + 6;
            l[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(
        received,
        [0, 1, 2, 3],
        "the policy of every step before a round"
    );
    assert!(
        logs.iter()
            .any(|l| l.contains("policy sent to the generators")),
        "trainer rank 0 sent it"
    );
    assert_eq!(apart.len(), 4);
    let rewards: Vec<f64> = colocated
        .iter()
        .map(|m| m["extra"]["rl/reward_mean"].as_f64().unwrap())
        .collect();
    assert!(
        rewards.iter().any(|&r| r > 0.0 && r < 1.0),
        "the verifier should reward some completions and not others: {rewards:?}"
    );
    for (a, b) in colocated.iter().zip(&apart) {
        let step = &a["step"];
        assert_eq!(b["world_size"], 1, "one trainer: {b}");
        for k in ["docs", "tokens", "loss_tokens"] {
            assert_eq!(a[k], b[k], "step {step}: {k}");
        }
        for k in [
            "rl/reward_mean",
            "rl/response_tokens_mean",
            "rl/completions",
        ] {
            assert_eq!(a["extra"][k], b["extra"][k], "step {step}: {k}");
        }
        assert_eq!(b["extra"]["staleness/max"], 0.0, "step {step}: on policy");
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-4 * x.abs().max(1e-3);
        for k in ["loss", "grad_norm"] {
            let (x, y) = (a[k].as_f64().unwrap(), b[k].as_f64().unwrap());
            assert!(
                close(x, y),
                "step {step}: {k} colocated {x} vs disaggregated {y}"
            );
        }
    }
    real::cluster::assert_same_params(&apart_params, &params, "disaggregated");
}

/// A LoRA RL job (issue 35) on two real worker processes, colocated and
/// disaggregated (`rl.generators = 1`, on policy): the generator builds
/// the frozen base itself and receives only the adapters after each step
/// (the bytes it logs are exactly the adapters'), generation with the
/// adapters matches the trainer's log-probs, and both runs draw the same
/// rollouts and end with the same adapters; the base never moves.
#[test]
fn lora_rl_loop_syncs_only_the_adapters_to_generators() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rows = [
        "--task",
        "arithmetic-small",
        "--out",
        "data",
        "--rows",
        "64",
    ];
    accrue(d, &[&["data", "synth"][..], &rows[..]].concat());
    write_tiny_config(d);
    let body = |rl: &str| {
        format!("steps = 3\n[data]\nsource = \"generate\"\nformat = \"prompts\"\ntrain = [\"data/arith-sft.jsonl\"]\ntokenizer = \"bytes\"\nmax_tokens = 512\n[batch]\ndocs_per_step = 16\n[objective]\nkind = \"pg\"\nkl_coef = 0.05\nreference = \"live\"\n[rl]\ngroup_size = 4\nmax_staleness = 0\n{rl}[rl.sampling]\ntemperature = 1.0\nmax_new_tokens = 6\n[rl.verifier]\nkind = \"regex\"\npattern = \"[0-9]\"\n[lora]\nrank = 8\nalpha = 16\n")
    };
    let run = |name: &str, rl: &str| {
        let spec = small_job(d, name, "ddp", &body(rl));
        let text = std::fs::read_to_string(&spec)
            .unwrap()
            .replace("every_steps = 0", "every_steps = 1");
        std::fs::write(&spec, text).unwrap();
        accrue(d, &["local", spec.to_str().unwrap(), "--workers", "2"]);
        let out = d.join(format!("out/{name}"));
        let logs: Vec<String> = (0..2)
            .map(|k| std::fs::read_to_string(out.join(format!("logs/worker-{k}.log"))).unwrap())
            .collect();
        (
            metrics(&out.join("metrics.jsonl")),
            real::cluster::final_params_at(&out, 3),
            logs,
        )
    };
    let (colocated, params, _) = run("lora-colocated", "");
    let (apart, apart_params, logs) = run("lora-apart", "generators = 1\n");
    // Adapters of rank 8 on every linear of the tiny Llama (hidden 64,
    // intermediate 128, kv width 32, 2 layers): r·(in + out) each, float32.
    let per_layer = 8 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128));
    let adapter_bytes = 2 * per_layer * 4;
    let g = logs
        .iter()
        .find(|l| l.contains("configured as a generator"))
        .expect("a generator");
    let synced: Vec<u64> = g
        .lines()
        .filter(|l| l.contains("policy received from trainer rank 0"))
        .map(|l| {
            let at = l.find(" bytes=").expect("bytes in the line") + 7;
            l[at..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(synced.len(), 3, "a sync before every round: {synced:?}");
    assert!(
        synced.iter().all(|&b| b == adapter_bytes as u64),
        "the generator received {synced:?} bytes, the adapters are {adapter_bytes}"
    );
    for (a, b) in colocated.iter().zip(&apart) {
        let step = &a["step"];
        for k in ["rl/reward_mean", "rl/completions"] {
            assert_eq!(a["extra"][k], b["extra"][k], "step {step}: {k}");
        }
        for m in [a, b] {
            let diff = m["extra"]["logprob_diff"].as_f64().unwrap();
            assert!(
                diff <= 1e-5,
                "step {step}: trainer vs sampler log-probs {diff}"
            );
        }
    }
    assert_eq!(apart.len(), 3);
    real::cluster::assert_same_params(&apart_params, &params, "disaggregated LoRA");
    let adapters = params.keys().filter(|k| k.contains("lora_")).count();
    assert_eq!(adapters, 2 * 7 * 2, "adapter tensors in the checkpoint");
    // The base (written whole: a random init exists nowhere else) is the
    // same bits after step 1 and step 3; the adapters moved.
    let first = real::cluster::final_params_at(&d.join("out/lora-colocated"), 1);
    for (k, v) in &params {
        if k.contains("lora_") {
            assert_ne!(&first[k], v, "{k} did not train");
        } else {
            assert_eq!(&first[k], v, "base weight {k} moved");
        }
    }
}

/// Routing replay (`rl.routing_replay`, issue 34) with a tiny Qwen3-MoE on
/// two real worker processes, colocated and disaggregated: the generators
/// record every token's experts, the coordinator keeps them with the
/// rollout and packs them with its tokens, the trainers replay them (a
/// routing that did not line up with the tokens would fail the step). On
/// policy the trainer's log-probs then equal the sampler's; the rollouts
/// are those of the same job without replay.
#[test]
fn rl_loop_with_routing_replay_trains_a_moe_model() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rows = [
        "--task",
        "arithmetic-small",
        "--out",
        "data",
        "--rows",
        "64",
    ];
    accrue(d, &[&["data", "synth"][..], &rows[..]].concat());
    std::fs::write(
        d.join("tiny.json"),
        r#"{"model_type":"qwen3_moe","hidden_size":64,"intermediate_size":128,
"moe_intermediate_size":32,"num_local_experts":8,"num_experts_per_tok":2,"norm_topk_prob":true,
"num_attention_heads":4,"num_key_value_heads":2,"head_dim":24,"num_hidden_layers":2,
"vocab_size":320,"rms_norm_eps":1e-6,"initializer_range":0.02,"tie_word_embeddings":false,
"bos_token_id":256,"eos_token_id":257}"#,
    )
    .unwrap();
    let body = |rl: &str| {
        format!("steps = 3\n[data]\nsource = \"generate\"\nformat = \"prompts\"\ntrain = [\"data/arith-sft.jsonl\"]\ntokenizer = \"bytes\"\nmax_tokens = 512\n[batch]\ndocs_per_step = 16\n[objective]\nkind = \"pg\"\n[rl]\ngroup_size = 4\nmax_staleness = 0\n{rl}[rl.sampling]\ntemperature = 1.0\nmax_new_tokens = 6\n[rl.verifier]\nkind = \"regex\"\npattern = \"[0-9]\"")
    };
    let run = |name: &str, rl: &str| {
        let spec = small_job(d, name, "ddp", &body(rl));
        accrue(d, &["validate", spec.to_str().unwrap()]);
        accrue(d, &["local", spec.to_str().unwrap(), "--workers", "2"]);
        metrics(&d.join(format!("out/{name}/metrics.jsonl")))
    };
    let plain = run("plain", "");
    for (name, rl) in [
        ("replay", "routing_replay = true\n"),
        ("replay-apart", "routing_replay = true\ngenerators = 1\n"),
    ] {
        let m = run(name, rl);
        assert_eq!(m.len(), 3, "{name}");
        for (a, b) in m.iter().zip(&plain) {
            let step = &a["step"];
            let diff = a["extra"]["logprob_diff"].as_f64().unwrap();
            // Every token but each rollout's last trained on the
            // generator's experts (reported per loss token: > 1 here, the
            // prompts are longer than the completions).
            let replayed = a["extra"]["routing_replayed"].as_f64().unwrap();
            assert!(replayed > 1.0, "{name} step {step}: {replayed}");
            assert!(b["extra"].get("routing_replayed").is_none(), "plain: {b}");
            println!("{name} step {step}: mean |trainer - sampler| log-prob {diff:e}");
            assert!(diff <= 1e-4, "{name} step {step}: log-prob diff {diff}");
            if name == "replay" {
                for k in ["docs", "tokens", "loss_tokens"] {
                    assert_eq!(a[k], b[k], "{name} step {step}: {k}");
                }
                assert_eq!(
                    a["extra"]["rl/reward_mean"], b["extra"]["rl/reward_mean"],
                    "{name} step {step}: the same rollouts"
                );
            }
        }
    }
}

/// The PG demo as shipped (deploy/examples/pg-demo.toml, run from a copy of
/// its directory layout) on two workers: every kept rollout trained exactly
/// once in its one epoch, flat groups dropped and refused groups counted,
/// staleness reported, the loss finite.
#[test]
fn pg_demo_trains_every_kept_rollout_once_and_reports_its_counters() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let examples = d.join("deploy/examples");
    std::fs::create_dir_all(&examples).unwrap();
    for f in ["pg-demo.toml", "tiny-llama.json"] {
        std::fs::copy(root().join("deploy/examples").join(f), examples.join(f)).unwrap();
    }
    let rows = [
        "--task",
        "arithmetic-rollouts",
        "--out",
        "runs/data-pg",
        "--rows",
        "512",
    ];
    accrue(d, &[&["data", "synth"][..], &rows[..]].concat());
    // What the coordinator should keep: groups with both rewards that claim
    // policy 0; flat groups dropped; the rest refused at admission.
    let mut groups: std::collections::BTreeMap<String, (Vec<f64>, u64)> = Default::default();
    for line in std::fs::read_to_string(d.join("runs/data-pg/arith-pg.jsonl"))
        .unwrap()
        .lines()
    {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        let g = groups
            .entry(r["group"].as_str().unwrap().to_string())
            .or_default();
        g.0.push(r["reward"].as_f64().unwrap());
        g.1 = r["policy_version"].as_u64().unwrap();
    }
    let refused: usize = groups.values().filter(|g| g.1 > 0).map(|g| g.0.len()).sum();
    let admitted: Vec<&Vec<f64>> = groups.values().filter(|g| g.1 == 0).map(|g| &g.0).collect();
    let flat = admitted
        .iter()
        .filter(|r| r.iter().all(|&x| x == r[0]))
        .count();
    let kept: usize = admitted
        .iter()
        .filter(|r| r.iter().any(|&x| x != r[0]))
        .map(|r| r.len())
        .sum();
    assert!(
        refused > 0 && flat > 0 && kept > 0,
        "{refused} {flat} {kept}"
    );

    accrue(
        d,
        &["local", "deploy/examples/pg-demo.toml", "--workers", "2"],
    );
    let m = metrics(&d.join("runs/pg-demo/metrics.jsonl"));
    assert_eq!(m.len(), kept / 16, "steps of 16 rollouts in one epoch");
    let docs: u64 = m.iter().map(|s| s["docs"].as_u64().unwrap()).sum();
    assert_eq!(docs as usize, kept, "every kept rollout exactly once");
    for (i, s) in m.iter().enumerate() {
        let e = &s["extra"];
        assert!(loss(s).is_finite(), "{s}");
        assert_eq!(
            e["count/zero_variance_groups"].as_f64().unwrap(),
            flat as f64,
            "{s}"
        );
        assert_eq!(
            e["count/rejected_stale"].as_f64().unwrap(),
            refused as f64,
            "{s}"
        );
        // The file's rollouts come from policy 0: step N trains on N − 1.
        assert_eq!(e["staleness/max"].as_f64().unwrap(), i as f64, "{s}");
        assert_eq!(e["staleness/mean"].as_f64().unwrap(), i as f64, "{s}");
        for k in ["advantage", "clip_fraction"] {
            assert!(e[k].as_f64().unwrap().is_finite(), "{k}: {s}");
        }
        // The KL penalty against the cached reference pass: zero while
        // the policy is the initial one, positive once it has moved.
        let kl = e["kl"].as_f64().unwrap();
        if i == 0 {
            assert!(kl.abs() < 1e-9, "step 1: {s}");
        } else {
            assert!(kl > 0.0, "step {}: {s}", i + 1);
        }
    }
    // Weights out (rl.publish_every = 5): a transformers-loadable policy
    // after every 5th step, two shards (two workers) with their index, no
    // optimizer state, policy.json last; ../policy.json names the newest.
    let policy = d.join("runs/pg-demo/policy");
    let published: Vec<u64> = (1..=m.len() as u64).filter(|s| s % 5 == 0).collect();
    assert!(!published.is_empty());
    for step in &published {
        let p = policy.join(format!("step-{step}"));
        for f in ["config.json", "model.safetensors.index.json", "policy.json"] {
            assert!(p.join(f).exists(), "{}/{f} missing", p.display());
        }
        let marker: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p.join("policy.json")).unwrap()).unwrap();
        assert_eq!(marker["step"].as_u64(), Some(*step));
        let names: Vec<String> = std::fs::read_dir(&p)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            !names
                .iter()
                .any(|n| n.starts_with("optimizer") || n == "trainer.json"),
            "{names:?}"
        );
    }
    let latest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(policy.join("policy.json")).unwrap())
            .unwrap();
    let last = *published.last().unwrap();
    assert_eq!(latest["step"].as_u64(), Some(last));
    let py = root().join(".venv/bin/python");
    let ids = ["256", "49", "43", "50", "61", "51", "257"];
    let out = Command::new(&py)
        .arg(root().join("scripts/reference/load_checkpoint.py"))
        .arg(policy.join(format!("step-{last}")))
        .args(ids)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "transformers could not load the policy:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(line.lines().last().unwrap()).unwrap();
    assert_eq!(v["finite"], true, "{v}");
}

/// Regression (issue 32, bug 3): `accrue local` reported a spec the
/// coordinator refuses at submit (here a model vocabulary smaller than the
/// byte tokenizer's 259 ids) only after two minutes: its workers, never
/// given a job, were waited for as if finishing one. The same admission as
/// `submit` runs first, so the error comes at once, before any worker.
#[test]
fn accrue_local_reports_an_inadmissible_spec_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_tiny_config(d);
    let tiny = std::fs::read_to_string(d.join("tiny.json")).unwrap();
    std::fs::write(
        d.join("tiny.json"),
        tiny.replace("\"vocab_size\":320", "\"vocab_size\":100"),
    )
    .unwrap();
    std::fs::create_dir(d.join("data")).unwrap();
    std::fs::write(
        d.join("data/arith-sft.jsonl"),
        "{\"prompt\": \"1+1=\", \"completion\": \"2\"}\n",
    )
    .unwrap();
    let spec = job(d, "small-vocab", "random");
    let accrue = real::bin_dir().join("accrue");
    let started = std::time::Instant::now();
    let out = Command::new(accrue)
        .args(["local", spec.to_str().unwrap(), "--workers", "1"])
        .current_dir(d)
        .output()
        .unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("vocab_size"), "{stderr}");
    // Well under the 2 s the issue asks, with room for a loaded machine;
    // it took over 120 s before.
    assert!(took.as_secs_f64() < 10.0, "took {took:?}: {stderr}");
    assert!(
        !d.join("out/small-vocab/logs").exists(),
        "no worker was started for a spec that cannot run"
    );
}

/// The README's promise (issue 32): Ctrl-C stops `accrue local`, and running
/// the same command again resumes the job where its state says, rather than
/// cancelling it and training from step 1. Before, a leftover job was always
/// cancelled and the re-run refused by name.
#[test]
fn accrue_local_interrupted_then_run_again_resumes_the_job() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    accrue(
        d,
        &[
            "data",
            "synth",
            "--task",
            "arithmetic",
            "--out",
            "data",
            "--rows",
            "200",
        ],
    );
    write_tiny_config(d);
    let spec = job(d, "again", "random");
    let std_spec = std::fs::read_to_string(&spec).unwrap();
    std::fs::write(
        &spec,
        std_spec
            .replace("steps = 20", "steps = 60")
            .replace("docs_per_step = 16", "docs_per_step = 4")
            .replace("every_steps = 10", "every_steps = 2"),
    )
    .unwrap();
    let run = || {
        Command::new(real::bin_dir().join("accrue"))
            .args(["local", spec.to_str().unwrap(), "--workers", "1"])
            .args(["--metrics-listen", "off"])
            .current_dir(d)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting accrue local")
    };
    let out = d.join("out/again");
    let mut first = run();
    let stderr = first.stderr.take().unwrap();
    let drained = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
    });
    let t0 = Instant::now();
    // Checkpoints are pruned to the last few: any at step 4 or later.
    let checkpointed = || {
        std::fs::read_dir(out.join("checkpoints")).is_ok_and(|dir| {
            dir.filter_map(Result::ok).any(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let step = name
                    .strip_prefix("step-")
                    .and_then(|s| s.parse::<u64>().ok());
                step.is_some_and(|s| s >= 4) && e.path().join("manifest.json").is_file()
            })
        })
    };
    while !checkpointed() {
        assert!(
            first.try_wait().unwrap().is_none(),
            "the first run ended early: {:?}",
            drained.join().unwrap()
        );
        assert!(
            t0.elapsed() < Duration::from_secs(240),
            "no checkpoint at step 4"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let int = Command::new("kill")
        .args(["-INT", &first.id().to_string()])
        .status()
        .unwrap();
    assert!(int.success());
    let status = first.wait().unwrap();
    let first_err = drained.join().unwrap().join("\n");
    let before = metrics(&out.join("metrics.jsonl"));
    let reached = before.last().unwrap()["step"].as_u64().unwrap();
    assert!(
        (4..60).contains(&reached),
        "{status:?}: step {reached}\n{first_err}"
    );

    let second = run().wait_with_output().unwrap();
    let second_err = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{second_err}");
    assert!(
        second_err.contains("resuming job"),
        "the re-run did not resume:\n{second_err}"
    );
    assert!(!second_err.contains("cancelling job"), "{second_err}");
    // One step sequence across both runs: none trained twice into the
    // metrics, none skipped, the last the job's.
    let steps: Vec<u64> = metrics(&out.join("metrics.jsonl"))
        .iter()
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=60).collect::<Vec<_>>(), "{second_err}");
    assert!(out.join("checkpoints/step-60/manifest.json").is_file());
}

/// Issue 34: each family's example (deploy/examples/sft-<family>.toml, a
/// tiny random config) trains on the CPU as shipped but shorter, its loss
/// falls, and its checkpoint is a Hugging Face folder transformers loads
/// with no missing or unexpected tensor.
#[test]
fn every_family_example_trains_and_its_checkpoint_loads_in_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let examples = d.join("deploy/examples");
    std::fs::create_dir_all(&examples).unwrap();
    accrue(
        d,
        &[
            "data",
            "synth",
            "--task",
            "arithmetic",
            "--out",
            "runs/data",
            "--rows",
            "256",
        ],
    );
    for family in ["qwen3", "qwen3-moe", "olmo2", "gemma3", "mistral"] {
        let spec =
            std::fs::read_to_string(root().join(format!("deploy/examples/sft-{family}.toml")))
                .unwrap()
                .replace("steps = 40", "steps = 8")
                .replace("docs_per_step = 64", "docs_per_step = 16")
                .replace("every_steps = 50", "every_steps = 8")
                .replace("warmup_steps = 10", "warmup_steps = 2");
        assert!(
            spec.contains("steps = 8\n"),
            "{family}: the example changed shape"
        );
        std::fs::write(examples.join(format!("sft-{family}.toml")), spec).unwrap();
        let config = format!("tiny-{family}.json");
        std::fs::copy(
            root().join("deploy/examples").join(&config),
            examples.join(&config),
        )
        .unwrap();
        let toml = format!("deploy/examples/sft-{family}.toml");
        accrue(d, &["validate", &toml]);
        accrue(d, &["local", &toml, "--workers", "1"]);
        let m = metrics(&d.join(format!("runs/sft-{family}/metrics.jsonl")));
        let (first, last) = (loss(&m[0]), loss(m.last().unwrap()));
        println!(
            "{family}: loss {first:.3} -> {last:.3} over {} steps",
            m.len()
        );
        assert_eq!(m.len(), 8, "{family}");
        assert!(last < first, "{family}: loss {first} -> {last}");
        if family == "qwen3-moe" {
            // The load-balancing loss ran (top 2 of 8: 2 when balanced).
            let line = m.last().unwrap().to_string();
            assert!(line.contains("router_aux_loss"), "{line}");
        }
        let ckpt = d.join(format!("runs/sft-{family}/checkpoints/step-8"));
        let out = Command::new(root().join(".venv/bin/python"))
            .arg("-c")
            .arg(
                "import sys; from transformers import AutoModelForCausalLM as M; \
                 m, info = M.from_pretrained(sys.argv[1], output_loading_info=True); \
                 bad = {k: v for k, v in info.items() if v}; \
                 assert not bad, bad; print(type(m).__name__)",
            )
            .arg(&ckpt)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{family}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        println!("{family}: {}", String::from_utf8_lossy(&out.stdout).trim());
    }
}

/// Context parallelism end to end (issue 37): documents of up to 460
/// tokens, most longer than one rank's `data.max_tokens = 256`, trained by
/// two worker processes as one context-parallel group (each splits every
/// row, the layers' attention runs over the group's own ring) give the
/// update of one worker holding whole rows of 512: loss, grad norm, counts
/// and the final parameters, for SFT at ddp, zero2 and fsdp and for DPO at
/// ddp and fsdp (its reference pass included).
#[test]
fn a_context_parallel_group_trains_the_one_rank_update() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_tiny_config(d);
    std::fs::create_dir_all(d.join("data")).unwrap();
    // Deterministic text of a given length (bytes tokenizer: a token a byte).
    let text = |seed: usize, n: usize| -> String {
        (0..n)
            .map(|i| (b'a' + ((seed * 31 + i * 7 + i * i) % 26) as u8) as char)
            .collect()
    };
    let (mut sft, mut dpo) = (String::new(), String::new());
    for i in 0..24 {
        let (p, c) = (40 + (i * 53) % 200, 30 + (i * 97) % 220);
        let row = serde_json::json!({"prompt": text(i, p), "completion": text(i + 100, c)});
        sft.push_str(&format!("{row}\n"));
        let (c1, c2) = (20 + (i * 37) % 90, 25 + (i * 61) % 80);
        let pair = serde_json::json!({
            "prompt": text(i, p / 2),
            "chosen": text(i + 200, c1),
            "rejected": text(i + 300, c2),
        });
        dpo.push_str(&format!("{pair}\n"));
    }
    std::fs::write(d.join("data/long-sft.jsonl"), sft).unwrap();
    std::fs::write(d.join("data/long-dpo.jsonl"), dpo).unwrap();
    let run = |name: &str, body: &str, sharding: &str, context: u32, workers: &str| {
        let max_tokens = 512 / context;
        let body = body.replace("MAX", &max_tokens.to_string());
        let spec = small_job(d, name, sharding, &body);
        let mut text = std::fs::read_to_string(&spec).unwrap();
        text = text.replace(
            "[parallel]\n",
            &format!("[parallel]\ncontext = {context}\nmin_workers = {workers}\n"),
        );
        std::fs::write(&spec, text).unwrap();
        accrue(d, &["local", spec.to_str().unwrap(), "--workers", workers]);
        let out = d.join(format!("out/{name}"));
        let m = metrics(&out.join("metrics.jsonl"));
        (m, real::cluster::final_params_at(&out, 4))
    };
    let sft = "steps = 4\n[data]\ntrain = [\"data/long-sft.jsonl\"]\nformat = \"sft\"\ntokenizer = \"bytes\"\nmax_tokens = MAX\n[batch]\ndocs_per_step = 6\n[runtime]\nloss_chunk_tokens = 64";
    let dpo = "steps = 4\n[data]\ntrain = [\"data/long-dpo.jsonl\"]\nformat = \"dpo\"\ntokenizer = \"bytes\"\nmax_tokens = MAX\n[batch]\ndocs_per_step = 4\n[objective]\nkind = \"dpo\"\nbeta = 0.1\n[runtime]\nloss_chunk_tokens = 64";
    let compare = |case: &str,
                   one: &(Vec<serde_json::Value>, real::cluster::Params),
                   two: &(Vec<serde_json::Value>, real::cluster::Params),
                   extra: &[&str]| {
        assert_eq!(two.0.len(), 4, "{case}");
        for (a, b) in one.0.iter().zip(&two.0) {
            assert_eq!(b["world_size"], 2, "{case}: {b}");
            for k in ["docs", "tokens", "loss_tokens", "microbatches"] {
                assert_eq!(a[k], b[k], "{case} step {}: {k}", a["step"]);
            }
            let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * x.abs().max(1e-3);
            for field in ["loss", "grad_norm"] {
                let (x, y) = (a[field].as_f64().unwrap(), b[field].as_f64().unwrap());
                assert!(
                    close(x, y),
                    "{case} step {}: {field} {x} at C = 1 vs {y} at C = 2",
                    a["step"]
                );
            }
            // Step 1's margins are 0 up to rounding (policy = reference):
            // compared to a floor of 0.1.
            for k in extra {
                let (x, y) = (
                    a["extra"][k].as_f64().unwrap(),
                    b["extra"][k].as_f64().unwrap(),
                );
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(0.1),
                    "{case} step {}: {k} {x} at C = 1 vs {y} at C = 2",
                    a["step"]
                );
            }
        }
        real::cluster::assert_same_params(&two.1, &one.1, case);
    };
    // Most documents are longer than one rank's budget: a group of one at
    // max_tokens = 256 refuses them at once, naming a document and both
    // fields of the row's budget.
    let spec = small_job(d, "too-long", "ddp", &sft.replace("MAX", "128"));
    let text = std::fs::read_to_string(&spec).unwrap();
    let text = text.replace("[parallel]\n", "[parallel]\ncontext = 2\nmin_workers = 2\n");
    std::fs::write(&spec, text).unwrap();
    let out = Command::new(real::bin_dir().join("accrue"))
        .args(["validate", spec.to_str().unwrap()])
        .current_dir(d)
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert_ne!(out.status.code(), Some(0), "{said}");
    assert!(
        said.contains("long-sft.jsonl")
            && said.contains("data.max_tokens × parallel.context = 128 × 2 = 256"),
        "{said}"
    );
    let one = run("sft-one", sft, "ddp", 1, "1");
    for sharding in ["ddp", "zero2", "fsdp"] {
        let two = run(&format!("sft-{sharding}"), sft, sharding, 2, "2");
        compare(&format!("sft {sharding}"), &one, &two, &[]);
    }
    let one = run("dpo-one", dpo, "ddp", 1, "1");
    for sharding in ["ddp", "fsdp"] {
        let two = run(&format!("dpo-{sharding}"), dpo, sharding, 2, "2");
        let case = format!("dpo {sharding}");
        compare(&case, &one, &two, &["rewards/margin", "logps/chosen"]);
    }
}

/// The RL loop under context parallelism (issue 37): two workers as one
/// group of 2 (rows of 2 × 256) sample, score and train what two
/// data-parallel workers (rows of 512) do: the same documents, tokens,
/// loss tokens and grad norms at every step, and the same final
/// parameters.
#[test]
fn rl_loop_with_context_parallelism_trains_as_data_parallel_workers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rows = ["--task", "arithmetic", "--out", "data", "--rows", "64"];
    accrue(d, &[&["data", "synth"][..], &rows[..]].concat());
    write_tiny_config(d);
    let run = |name: &str, context: u32| {
        let body = format!("steps = 4\n[data]\nsource = \"generate\"\nformat = \"prompts\"\ntrain = [\"data/arith-sft.jsonl\"]\ntokenizer = \"bytes\"\nmax_tokens = {}\n[batch]\ndocs_per_step = 16\n[objective]\nkind = \"pg\"\n[rl]\ngroup_size = 4\n[rl.sampling]\ntemperature = 1.0\nmax_new_tokens = 6\n[rl.verifier]\nkind = \"regex\"\npattern = \"[0-9]\"", 512 / context);
        let spec = small_job(d, name, "ddp", &body);
        let text = std::fs::read_to_string(&spec).unwrap().replace(
            "[parallel]\n",
            &format!("[parallel]\ncontext = {context}\nmin_workers = 2\n"),
        );
        std::fs::write(&spec, text).unwrap();
        accrue(d, &["local", spec.to_str().unwrap(), "--workers", "2"]);
        let out = d.join(format!("out/{name}"));
        (
            metrics(&out.join("metrics.jsonl")),
            real::cluster::final_params_at(&out, 4),
        )
    };
    let (dp, cp) = (run("dp", 1), run("cp", 2));
    assert_eq!(cp.0.len(), 4);
    for (a, b) in dp.0.iter().zip(&cp.0) {
        for k in ["docs", "tokens", "loss_tokens", "world_size"] {
            assert_eq!(a[k], b[k], "step {}: {k}", a["step"]);
        }
        let (x, y) = (
            a["grad_norm"].as_f64().unwrap(),
            b["grad_norm"].as_f64().unwrap(),
        );
        assert!(
            (x - y).abs() <= 1e-5 * x,
            "step {}: grad norm {x} vs {y}",
            a["step"]
        );
    }
    real::cluster::assert_same_params(&cp.1, &dp.1, "rl, context 2");
}

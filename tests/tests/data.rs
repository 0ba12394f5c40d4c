//! Issue 16, with the real `accrue` binary: `accrue data prepare` killed
//! with `kill -9` in the middle of building a token store leaves nothing a
//! job could use, and the next prepare builds the store whole, then finds
//! it; `accrue validate` then reads the data through the cache even though
//! the file is above the size it scans unasked.
//!
//! Needs no shared data: the rows are synthetic, the tokenizer the
//! built-in byte one.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

/// Rows of the dataset: ~20 MiB, above validate's 16 MiB automatic scan,
/// and seconds of tokenizing in a debug build (time to kill it).
const ROWS: u64 = 200_000;

fn write_rows(path: &Path) {
    let mut w = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for i in 0..ROWS {
        let row = serde_json::json!({
            "prompt": format!("row {i}: what is {} plus {}? ", i % 97, i % 89),
            "completion": format!("{} and some words to make the row longer, {}", i % 97 + i % 89, "x".repeat((i % 40) as usize)),
        });
        writeln!(w, "{row}").unwrap();
    }
    w.flush().unwrap();
}

/// Entries of the cache root: (finished stores, unfinished build dirs).
fn cache_entries(root: &Path) -> (Vec<String>, Vec<String>) {
    let names: Vec<String> = std::fs::read_dir(root)
        .map(|r| {
            r.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.into_iter().partition(|n| !n.starts_with('.'))
}

fn prepare(d: &Path) -> serde_json::Value {
    let out = Command::new(common::bin_dir().join("accrue"))
        .args(["data", "prepare", "--json", "job.toml"])
        .current_dir(d)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "prepare failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().next().unwrap_or("")).unwrap()
}

#[test]
fn a_prepare_killed_mid_build_leaves_no_usable_store_and_the_next_builds_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_rows(&d.join("rows.jsonl"));
    std::fs::write(d.join("tiny.json"), r#"{"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#).unwrap();
    let cache = d.join("cache");
    std::fs::write(
        d.join("job.toml"),
        format!(
            "[job]\nname = \"prep\"\nepochs = 1\noutput_dir = \"out\"\n\
             [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
             [data]\ntrain = [\"rows.jsonl\"]\nformat = \"sft\"\ncache_dir = {:?}\n\
             [batch]\ndocs_per_step = 8\n",
            cache.display().to_string()
        ),
    )
    .unwrap();

    // Start a prepare and kill it once its build directory exists.
    let mut child = Command::new(common::bin_dir().join("accrue"))
        .args(["data", "prepare", "--json", "job.toml"])
        .current_dir(d)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if !cache_entries(&cache).1.is_empty() {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "prepare exited before its build directory was seen"
        );
        assert!(Instant::now() < deadline, "no build directory appeared");
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        child.try_wait().unwrap().is_none(),
        "prepare finished before it could be killed: make the file larger"
    );
    child.kill().unwrap(); // SIGKILL: no cleanup runs
    child.wait().unwrap();
    let (stores, partial) = cache_entries(&cache);
    assert!(stores.is_empty(), "a killed build left a store: {stores:?}");
    assert_eq!(partial.len(), 1, "{partial:?}");

    // The next prepare builds the whole store (and sweeps the dead
    // build's directory); the one after finds it.
    let built = prepare(d);
    assert_eq!(built["found"], "built", "{built}");
    assert_eq!(built["docs"], ROWS, "{built}");
    assert_eq!(built["skipped"], 0, "{built}");
    let (stores, partial) = cache_entries(&cache);
    assert_eq!(
        (stores.len(), partial.len()),
        (1, 0),
        "{stores:?} {partial:?}"
    );
    let hit = prepare(d);
    assert_eq!(hit["found"], "hit", "{hit}");
    assert_eq!(
        (hit["docs"].clone(), hit["tokens"].clone()),
        (built["docs"].clone(), built["tokens"].clone())
    );

    // validate reads a cached dataset unasked, per source.
    let out = Command::new(common::bin_dir().join("accrue"))
        .args(["validate", "job.toml"])
        .current_dir(d)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!(
            "  source train: {ROWS} documents, {} tokens",
            built["tokens"]
        )),
        "{stdout}"
    );
}

/// Regression (issue 32, bug 4): `accrue bench data` run from the project
/// root handed the default `../shared/data` to a child process working in
/// another directory (`file not found: /../shared/data/...`). Paths are
/// made absolute before they cross a process or directory boundary.
#[test]
fn bench_data_from_the_project_root_finds_the_shared_data() {
    let root = common::workspace_root();
    let shared = root.join("../shared/data");
    if !shared.join("tokenizers").is_dir() {
        assert!(
            std::env::var("ACCRUE_REQUIRE_SHARED_DATA").as_deref() != Ok("1"),
            "shared data required but {} is missing",
            shared.display()
        );
        eprintln!("skipping: no shared data at {}", shared.display());
        return;
    }
    let out = Command::new(common::bin_dir().join("accrue"))
        .args([
            "bench",
            "data",
            "--json",
            "--no-reference",
            "--synthetic-rows",
            "1000",
        ])
        .env_remove("ACCRUE_SHARED_DATA")
        .current_dir(&root)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // The shared datasets were measured, not only the synthetic one.
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        rows.iter()
            .any(|r| r["bench"] == "submit" && r["dataset"] != "synthetic"),
        "{stdout}"
    );
}

/// `accrue data show` (issue 34): a document as the job will train it. The
/// byte tokenizer makes the expectations exact: `<|bos|>` (256), the
/// prompt's bytes without loss, the completion's bytes and `<|eos|>` (257)
/// with loss; `[[…]]` marks the loss spans in the text.
#[test]
fn data_show_prints_documents_as_the_job_trains_them() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let rows = [("1+1=", "2"), ("20+22=", "42"), ("3+4=", "7")];
    let mut text = String::new();
    for (p, c) in rows {
        text.push_str(&format!(
            "{}\n",
            serde_json::json!({"prompt": p, "completion": c})
        ));
    }
    text.push_str("{\"prompt\": \"no completion\"}\n");
    std::fs::write(d.join("rows.jsonl"), text).unwrap();
    std::fs::copy(
        common::workspace_root().join("deploy/examples/tiny-llama.json"),
        d.join("tiny.json"),
    )
    .unwrap();
    std::fs::write(
        d.join("job.toml"),
        "[job]\nname = \"show\"\nsteps = 1\noutput_dir = \"out\"\n\
         [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
         [data]\ntrain = [\"rows.jsonl\"]\nformat = \"sft\"\non_bad_line = \"skip\"\n\
         [batch]\ndocs_per_step = 2\n",
    )
    .unwrap();
    let show = |args: &[&str]| {
        let out = Command::new(common::bin_dir().join("accrue"))
            .args(["data", "show", "job.toml"])
            .args(args)
            .current_dir(d)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code(), text)
    };
    let (code, out) = show(&["--json", "--count", "2"]);
    assert_eq!(code, Some(0), "{out}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    for (v, (p, c)) in lines.iter().zip(rows) {
        let s = &v["sequences"][0];
        let mut ids = vec![256u64];
        ids.extend(format!("{p}{c}").bytes().map(u64::from));
        ids.push(257);
        let got: Vec<u64> = s["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(got, ids);
        let mask: Vec<u64> = s["loss_mask"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        let want: Vec<u64> = (0..ids.len()).map(|i| u64::from(i > p.len())).collect();
        assert_eq!(mask, want, "{p}{c}");
        assert_eq!(s["loss_tokens"], c.len() + 1);
        assert_eq!(s["marked"], format!("<|bos|>{p}[[{c}<|eos|>]]"));
    }
    // One row by number, in text; a row that is not a document says why.
    let (code, out) = show(&["--doc", "2"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("rows.jsonl:2") && out.contains("<|bos|>20+22=[[42<|eos|>]]"),
        "{out}"
    );
    assert!(
        out.contains("3 carry loss") && !out.contains("rows.jsonl:1"),
        "{out}"
    );
    let (code, out) = show(&["--doc", "4"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("rows.jsonl:4): not a document:"), "{out}");
    let (code, out) = show(&["--doc", "9"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("has 4 rows, no row 9"), "{out}");
    let (code, out) = show(&["--source", "nope"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("--source nope: no such source") && out.contains("train"),
        "{out}"
    );
}

/// The shared data folder (`../shared/data` or `$ACCRUE_SHARED_DATA`), or
/// `None` when it is absent and not required.
fn shared_data() -> Option<std::path::PathBuf> {
    let dir = std::env::var("ACCRUE_SHARED_DATA").map_or_else(
        |_| common::workspace_root().join("../shared/data"),
        std::path::PathBuf::from,
    );
    if dir.join("tokenizers").is_dir() {
        return Some(dir);
    }
    assert!(
        std::env::var("ACCRUE_REQUIRE_SHARED_DATA").as_deref() != Ok("1"),
        "shared data required but {} is missing",
        dir.display()
    );
    eprintln!("skipping: no shared data at {}", dir.display());
    None
}

/// Issue 34 (1): the ids Accrue trains a chat on are transformers'
/// `apply_chat_template` ids, token for token, for the tokenizer folders
/// models come in (scripts/reference/chat_template_ids.py): the shared
/// phi-3 files as published (a legacy SentencePiece conversion that
/// transformers 5 runs through LlamaTokenizer's pipeline: 33 ids read as
/// written, 31 as transformers reads the two-turn chat); save_pretrained's
/// `chat_template.jinja` and in-config layouts; a byte-level BPE (phi-2);
/// named templates (`tool_use` for rows with tools); system prompts,
/// multi-turn chats, tool calls (arguments through `tojson`), tool results
/// and reasoning; and a `{% generation %}` template's assistant masks.
#[test]
fn chats_tokenize_as_transformers_apply_chat_template() {
    let Some(shared) = shared_data() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let root = common::workspace_root();
    let out = Command::new(root.join(".venv/bin/python"))
        .arg(root.join("scripts/reference/chat_template_ids.py"))
        .arg(shared.join("tokenizers"))
        .arg(d)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("expected.json")).unwrap()).unwrap();
    // A model config whose vocabulary holds both tokenizers' ids.
    std::fs::write(
        d.join("model.json"),
        r#"{"model_type":"llama","vocab_size":51200,"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2}"#,
    )
    .unwrap();
    let chats = std::fs::read_to_string(d.join("chats.jsonl")).unwrap();
    let chats: Vec<&str> = chats.lines().collect();
    let as_ids = |v: &serde_json::Value| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    for (folder, want) in expected.as_object().unwrap() {
        let used: Vec<usize> = as_ids(&want["rows"])
            .into_iter()
            .map(|r| r as usize)
            .collect();
        let file = d.join(format!("{folder}.jsonl"));
        let text: String = used.iter().map(|&r| format!("{}\n", chats[r])).collect();
        std::fs::write(&file, text).unwrap();
        let spec = d.join(format!("{folder}.toml"));
        std::fs::write(
            &spec,
            format!(
                "[job]\nname = \"ct\"\nsteps = 1\noutput_dir = \"out\"\n\
                 [model]\ninit = \"random\"\nconfig = \"model.json\"\n\
                 [data]\ntrain = [\"{folder}.jsonl\"]\nformat = \"sft\"\n\
                 tokenizer = \"{folder}/tokenizer.json\"\n\
                 [batch]\ndocs_per_step = 1\n"
            ),
        )
        .unwrap();
        let out = Command::new(common::bin_dir().join("accrue"))
            .args(["data", "show"])
            .arg(&spec)
            .args(["--json", "--count", "100"])
            .current_dir(d)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{folder}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let shown: Vec<serde_json::Value> = stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(shown.len(), used.len(), "{folder}: {stdout}");
        for (i, (doc, row)) in shown.iter().zip(&used).enumerate() {
            let seq = &doc["sequences"][0];
            let ours = as_ids(&seq["ids"]);
            let theirs = as_ids(&want["ids"][i]);
            assert_eq!(
                ours, theirs,
                "{folder}, chat {row}: ids differ from apply_chat_template\n{}",
                seq["text"]
            );
            if let Some(masks) = want["masks"].as_array() {
                assert_eq!(
                    as_ids(&seq["loss_mask"]),
                    as_ids(&masks[i]),
                    "{folder}, chat {row}: loss mask differs from return_assistant_tokens_mask\n{}",
                    seq["marked"]
                );
            }
        }
    }
}

//! The token cache: hits, misses and invalidation, crashes mid-build,
//! parquet against JSONL, and that cached documents equal the in-memory
//! ones (on the shared dolly file with the phi-3-mini tokenizer when it is
//! there).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::cache::{self, Found};
use super::token_store::{TokenStore, Writer};
use super::*;
use crate::job::data::{DataFormat, DataSection, OnBad};
use crate::job::objective::ObjectiveKind;
use crate::stream::doc::Document;

fn section(train: Vec<PathBuf>, tokenizer: &str) -> DataSection {
    DataSection {
        train,
        format: DataFormat::Sft,
        tokenizer: tokenizer.to_string(),
        chat_template: None,
        chat_template_name: None,
        max_tokens: 1 << 20,
        on_overlong: OnBad::Error,
        on_bad_line: OnBad::Skip,
        source: Default::default(),
        shuffle: true,
        sources: Vec::new(),
        cache_dir: None,
    }
}

/// Loads `data` through the cache at `root`; counts stores built.
fn cached(data: &DataSection, root: &Path, builds: &AtomicU64) -> Dataset {
    let enc = encoder(data, u32::MAX).unwrap();
    let sources = data.train_sources(None);
    let progress = |_: &Path, p: cache::Progress| {
        if p.rows > 0 {
            builds.fetch_add(1, Ordering::Relaxed);
        }
    };
    let via = Via::Cache {
        root,
        progress: &progress,
    };
    load_sources(
        &enc,
        data,
        one(data),
        ObjectiveKind::Sft,
        &sources,
        &data.files(),
        via,
    )
    .unwrap()
}

const ROWS: &str = "{\"prompt\": \"1+1=\", \"completion\": \"2\"}\n\
                    {\"prompt\": \"2+2=\", \"completion\": \"4\"}\n\
                    not json\n\
                    {\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"}]}\n";

#[test]
fn a_stored_rows_wire_bytes_are_its_ids_and_labels_packed() {
    // Masked labels (chat, prompt/completion) and explicit ones: what a
    // plan's encoder writes from the store, without a label row between.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.jsonl");
    let explicit = "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n";
    std::fs::write(&file, format!("{ROWS}{explicit}")).unwrap();
    let data = section(vec![file], "bytes");
    let ds = cached(&data, &dir.path().join("cache"), &AtomicU64::new(0));
    assert_eq!(ds.docs.len(), 4);
    for s in ds.docs.iter().flat_map(Document::sequences) {
        assert!(s.is_mapped());
        let (mut ids, mut labels) = (vec![9u8], vec![9u8]);
        s.write_le(&mut ids, &mut labels);
        assert_eq!(ids[1..], accrue_proto::pack_u32(s.input_ids()));
        assert_eq!(labels[1..], accrue_proto::pack_i32(&s.labels()));
    }
}

#[test]
fn a_store_is_built_once_then_found_and_equals_the_in_memory_load() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.jsonl");
    std::fs::write(&file, ROWS).unwrap();
    let root = dir.path().join("cache");
    let data = section(vec![file.clone()], "bytes");
    let builds = AtomicU64::new(0);
    let first = cached(&data, &root, &builds);
    assert_eq!(builds.load(Ordering::Relaxed), 1, "a miss builds the store");
    let again = cached(&data, &root, &builds);
    assert_eq!(builds.load(Ordering::Relaxed), 1, "a hit builds nothing");
    let memory = load(&data, ObjectiveKind::Sft, u32::MAX).unwrap();
    assert_eq!(first.docs, memory.docs);
    assert_eq!(again.docs, memory.docs);
    assert_eq!(first.report, memory.report);
    assert_eq!(first.docs.len(), 3);
    assert_eq!(first.report.bad_lines_skipped, 1);
    // The tokens live in the store, not on the heap.
    assert!(first
        .docs
        .iter()
        .all(|d| d.sequences().all(|s| s.is_mapped())));
    // on_bad_line = "error" names the line the store remembered.
    let strict = DataSection {
        on_bad_line: OnBad::Error,
        ..data.clone()
    };
    let enc = encoder(&strict, u32::MAX).unwrap();
    let none = |_: &Path, _: cache::Progress| {};
    let e = load_sources(
        &enc,
        &strict,
        one(&strict),
        ObjectiveKind::Sft,
        &strict.train_sources(None),
        &strict.files(),
        Via::Cache {
            root: &root,
            progress: &none,
        },
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("{}:3: invalid json", file.display())),
        "{e}"
    );
    // max_tokens is applied at open: the same store serves a smaller budget.
    let tight = DataSection {
        max_tokens: 12,
        on_overlong: OnBad::Skip,
        ..data.clone()
    };
    let t = cached(&tight, &root, &builds);
    assert_eq!(
        builds.load(Ordering::Relaxed),
        1,
        "max_tokens is not in the key"
    );
    assert!(
        t.report.overlong_skipped > 0 && t.docs.len() < 3,
        "{:?}",
        t.report
    );
}

#[test]
fn a_changed_file_tokenizer_or_template_is_a_new_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.jsonl");
    std::fs::write(&file, ROWS).unwrap();
    let key = |data: &DataSection| {
        let e = encoder_key(data, u32::MAX, None).unwrap();
        cache::file_key(&data.train[0], e).unwrap()
    };
    let data = section(vec![file.clone()], "bytes");
    let k0 = key(&data);
    assert_eq!(k0, key(&data), "the same inputs give the same key");
    // The file's content.
    std::fs::write(
        &file,
        format!("{ROWS}{{\"prompt\": \"3\", \"completion\": \"3\"}}\n"),
    )
    .unwrap();
    let k1 = key(&data);
    assert_ne!(k0, k1);
    // The chat template.
    let tmpl = dir.path().join("t.jinja");
    std::fs::write(&tmpl, "{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
    let with_template = DataSection {
        chat_template: Some(tmpl.clone()),
        ..data.clone()
    };
    let k2 = key(&with_template);
    assert_ne!(k1, k2);
    std::fs::write(
        &tmpl,
        "{% for m in messages %}[{{ m.content }}]{% endfor %}",
    )
    .unwrap();
    assert_ne!(k2, key(&with_template), "the template's text, not its path");
    // The tokenizer (and the vocabulary bound of pre-tokenized ids).
    let vocab = |v| cache::file_key(&file, encoder_key(&data, v, None).unwrap()).unwrap();
    assert_ne!(vocab(300), vocab(400));
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, "{}").unwrap();
    let a = cache::file_key(
        &file,
        cache::EncoderKey::new(Some(&tok), None, None, DataFormat::Sft, 9).unwrap(),
    )
    .unwrap();
    std::fs::write(&tok, "{\"x\": 1}").unwrap();
    let b = cache::file_key(
        &file,
        cache::EncoderKey::new(Some(&tok), None, None, DataFormat::Sft, 9).unwrap(),
    )
    .unwrap();
    assert_ne!(a, b);
    // A different document kind over the same file.
    let dpo = cache::file_key(
        &file,
        cache::EncoderKey::new(None, None, None, DataFormat::Dpo, 9).unwrap(),
    )
    .unwrap();
    let sft = cache::file_key(
        &file,
        cache::EncoderKey::new(None, None, None, DataFormat::Sft, 9).unwrap(),
    )
    .unwrap();
    assert_ne!(dpo, sft);
}

#[test]
fn a_crash_mid_build_leaves_nothing_usable() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.jsonl");
    std::fs::write(&file, ROWS).unwrap();
    let root = dir.path().join("cache");
    std::fs::create_dir_all(&root).unwrap();
    let data = section(vec![file.clone()], "bytes");
    let fkey = cache::file_key(&file, encoder_key(&data, u32::MAX, None).unwrap()).unwrap();
    let key = fkey.key.clone();
    let dest = root.join(&key);
    // A writer that dies before finishing (the process killed mid-prepare):
    // its rows are in a temporary directory, nothing under the key.
    let enc = encoder(&data, u32::MAX).unwrap();
    let mut w = Writer::create(&dest, &file).unwrap();
    let body = build_doc(
        &enc,
        DataFormat::Sft,
        &serde_json::json!({"prompt": "a", "completion": "b"}),
    )
    .unwrap();
    w.push(1, None, &body).unwrap();
    std::mem::forget(w);
    assert!(!dest.exists(), "an unfinished store is not under its key");
    // A directory under the key without meta.json (or with files that do
    // not match it) is never opened: it is rebuilt.
    std::fs::create_dir_all(&dest).unwrap();
    std::fs::write(dest.join("ids.bin"), [1u8, 2, 3]).unwrap();
    assert!(TokenStore::open(&dest).is_err());
    // A dead builder's directory (pid above Linux's pid_max) is swept by
    // the next build of the key; this process's own is kept.
    let dead = root.join(format!(".{key}.tmp-4194305-1"));
    std::fs::create_dir_all(&dead).unwrap();
    // Issue 33 (10): a live builder in another PID namespace (its pid means
    // nothing here) holds its directory's lock: it is kept.
    let elsewhere = root.join(format!(".{key}.tmp-4194306-1"));
    std::fs::create_dir_all(&elsewhere).unwrap();
    let held = std::fs::File::open(&elsewhere).unwrap();
    held.lock().unwrap();
    let none = |_: cache::Progress| {};
    let (s, found) =
        cache::open_or_build(&root, &fkey, &file, &enc, DataFormat::Sft, &none).unwrap();
    assert_eq!((found, s.meta.docs), (Found::Built, 3));
    assert!(!dead.exists(), "a dead builder's directory is swept");
    assert!(elsewhere.is_dir(), "a live builder's directory is kept");
    drop(held);
    let ours = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with(&format!(".{key}.tmp-{}-", std::process::id()))
        })
        .count();
    assert_eq!(ours, 1, "the forgotten writer of this live process is kept");
    // A store whose file was cut short after it was complete is damaged.
    let ids = dest.join("ids.bin");
    let len = std::fs::metadata(&ids).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&ids)
        .unwrap()
        .set_len(len - 4)
        .unwrap();
    let e = TokenStore::open(&dest).unwrap_err();
    assert!(e.to_string().contains("ids.bin holds"), "{e}");
    let (_, found) =
        cache::open_or_build(&root, &fkey, &file, &enc, DataFormat::Sft, &none).unwrap();
    assert_eq!(found, Found::Built);
    let (_, found) =
        cache::open_or_build(&root, &fkey, &file, &enc, DataFormat::Sft, &none).unwrap();
    assert_eq!(found, Found::Hit);
}

/// Writes `rows` (prompt, completion) as a parquet file of two string
/// columns.
fn write_parquet(path: &Path, rows: &[(&str, &str)]) {
    use ::parquet::data_type::{ByteArray, ByteArrayType};
    use ::parquet::file::properties::WriterProperties;
    use ::parquet::file::writer::SerializedFileWriter;
    use ::parquet::schema::parser::parse_message_type;
    use std::sync::Arc;
    let schema = Arc::new(
        parse_message_type(
            "message schema { REQUIRED BYTE_ARRAY prompt (UTF8); REQUIRED BYTE_ARRAY completion (UTF8); }",
        )
        .unwrap(),
    );
    let props = Arc::new(WriterProperties::builder().build());
    let mut w =
        SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, props).unwrap();
    let mut rg = w.next_row_group().unwrap();
    for col in 0..2 {
        let values: Vec<ByteArray> = rows
            .iter()
            .map(|r| ByteArray::from(if col == 0 { r.0 } else { r.1 }))
            .collect();
        let mut c = rg.next_column().unwrap().unwrap();
        c.typed::<ByteArrayType>()
            .write_batch(&values, None, None)
            .unwrap();
        c.close().unwrap();
    }
    rg.close().unwrap();
    w.close().unwrap();
}

#[test]
fn parquet_rows_equal_the_same_rows_as_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let rows = [
        ("1+1=", "2"),
        ("2+2=", "4"),
        ("what is rust?", "a language"),
    ];
    let pq = dir.path().join("train-00000-of-00001.parquet");
    write_parquet(&pq, &rows);
    let jl = dir.path().join("same.jsonl");
    let text: String = rows
        .iter()
        .map(|(p, c)| format!("{}\n", serde_json::json!({"prompt": p, "completion": c})))
        .collect();
    std::fs::write(&jl, text).unwrap();
    let a = load(
        &section(vec![pq.clone()], "bytes"),
        ObjectiveKind::Sft,
        u32::MAX,
    )
    .unwrap();
    let b = load(&section(vec![jl], "bytes"), ObjectiveKind::Sft, u32::MAX).unwrap();
    let bodies = |d: &Dataset| d.docs.iter().map(|d| d.body.clone()).collect::<Vec<_>>();
    assert_eq!(bodies(&a), bodies(&b));
    // Row numbers are the documents' lines.
    let lines: Vec<u64> = a.docs.iter().map(|d| d.id.line).collect();
    assert_eq!(lines, vec![1, 2, 3]);
    // Through the cache too.
    let builds = AtomicU64::new(0);
    let c = cached(
        &section(vec![pq], "bytes"),
        &dir.path().join("cache"),
        &builds,
    );
    assert_eq!(bodies(&c), bodies(&b));
}

#[test]
fn the_shared_dolly_file_caches_to_the_same_documents() {
    let Some(shared) = super::tests::shared_data() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let tok = shared.join("tokenizers/phi-3-mini/tokenizer.json");
    let data = section(
        vec![shared.join("sft/dolly_hhrlhf_train_small.jsonl")],
        &tok.display().to_string(),
    );
    let builds = AtomicU64::new(0);
    let c = cached(&data, dir.path(), &builds);
    let m = load(&data, ObjectiveKind::Sft, u32::MAX).unwrap();
    assert_eq!(c.docs.len(), 1000);
    let same = c
        .docs
        .iter()
        .zip(m.docs.iter())
        .all(|(a, b): (&Document, &Document)| a == b);
    assert!(same, "cached documents equal the in-memory ones");
    assert_eq!(c.report.tokens, m.report.tokens);
}

/// Issue 33 (10): the key hashed the file in one read and the build read it
/// again, so a file rewritten in between was tokenized from its new bytes
/// and filed under the old bytes' key (a later job with the old file would
/// train on the new tokens). The build now refuses a file that changed
/// since it was hashed, and nothing is filed.
#[test]
fn a_file_rewritten_between_hashing_and_building_is_refused_not_misfiled() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a.jsonl");
    std::fs::write(&file, ROWS).unwrap();
    let root = dir.path().join("cache");
    let data = section(vec![file.clone()], "bytes");
    let enc = encoder(&data, u32::MAX).unwrap();
    let ekey = encoder_key(&data, u32::MAX, None).unwrap();
    let old = cache::file_key(&file, ekey).unwrap();
    // Same length, other bytes: only the file's change time tells.
    std::fs::write(&file, ROWS.replace("1+1=", "3+3=")).unwrap();
    let none = |_: cache::Progress| {};
    let e = cache::open_or_build(&root, &old, &file, &enc, DataFormat::Sft, &none).unwrap_err();
    assert!(
        matches!(&e, DataError::Changed { path } if path == &file),
        "{e}"
    );
    assert!(
        e.to_string().contains("changed while it was being read"),
        "{e}"
    );
    assert!(
        !root.join(&old.key).exists(),
        "nothing filed under the old key"
    );
    let leftovers = std::fs::read_dir(&root).unwrap().count();
    assert_eq!(leftovers, 0, "the refused build leaves no directory");
    // Hashed again, the new bytes get their own key and build.
    let new = cache::file_key(&file, ekey).unwrap();
    assert_ne!(new.key, old.key);
    let (s, found) =
        cache::open_or_build(&root, &new, &file, &enc, DataFormat::Sft, &none).unwrap();
    assert_eq!((found, s.meta.docs), (Found::Built, 3));
}

/// Issue 34: a Hugging Face tokenizer without a chat template rendered
/// chats with the byte tokenizer's built-in template, without a word. A
/// chat row now fails the load (in memory and through the token cache,
/// which keeps no store) naming the tokenizer and where the template was
/// looked for; rows that need no template still load.
#[test]
fn chats_with_a_tokenizer_that_has_no_template_are_refused_naming_where_it_looked() {
    let Some(shared) = super::tests::shared_data() else {
        return;
    };
    let tok = shared.join("tokenizers/phi-2/tokenizer.json");
    let dir = tempfile::tempdir().unwrap();
    let chat = dir.path().join("chat.jsonl");
    std::fs::write(
        &chat,
        "{\"prompt\": \"1+1=\", \"completion\": \"2\"}\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"}]}\n",
    )
    .unwrap();
    let plain = dir.path().join("plain.jsonl");
    std::fs::write(&plain, "{\"prompt\": \"1+1=\", \"completion\": \"2\"}\n").unwrap();
    let root = dir.path().join("cache");
    let data = section(vec![chat.clone()], &tok.display().to_string());
    let enc = encoder(&data, u32::MAX).unwrap();
    let sources = data.train_sources(None);
    let progress = |_: &Path, _: cache::Progress| {};
    for via in [
        Via::Memory,
        Via::Cache {
            root: &root,
            progress: &progress,
        },
    ] {
        let Err(e) = load_sources(
            &enc,
            &data,
            one(&data),
            ObjectiveKind::Sft,
            &sources,
            &data.files(),
            via,
        ) else {
            panic!("the chat row was not refused")
        };
        let DataError::NoChatTemplate { tokenizer, looked } = &e else {
            panic!("{e}")
        };
        assert_eq!(tokenizer, &tok);
        assert!(
            looked.contains("chat_template.jinja")
                && looked.contains("no chat_template in")
                && looked.contains("data.chat_template"),
            "{looked}"
        );
        assert!(e.to_string().contains("set data.chat_template"), "{e}");
    }
    let kept = std::fs::read_dir(&root).map_or(0, |d| d.count());
    assert_eq!(kept, 0, "no store, finished or not, is kept");
    // Rows that need no template load with the same tokenizer.
    let data = section(vec![plain], &tok.display().to_string());
    let builds = AtomicU64::new(0);
    assert_eq!(cached(&data, &root, &builds).docs.len(), 1);
}

/// One rank's row budget of `data`.
fn one(data: &DataSection) -> crate::job::parallel::RowBudget {
    crate::job::parallel::RowBudget::single(data.max_tokens)
}

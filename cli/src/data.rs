//! `accrue data …`: dataset utilities that run locally, without a coordinator.

use std::process::ExitCode;

use anyhow::Context;

use super::output::outln;
use crate::args::{SynthArgs, SynthTask};

/// `accrue data synth`.
pub fn synth(args: &SynthArgs) -> anyhow::Result<ExitCode> {
    match args.task {
        SynthTask::Arithmetic | SynthTask::ArithmeticSmall => {
            let digits = match args.task {
                SynthTask::ArithmeticSmall => 1,
                _ => accrue_coordinator::stream::data::synth::DIGITS,
            };
            let rows = args.rows as usize;
            let files = accrue_coordinator::stream::data::synth::synth_arithmetic_digits(
                &args.out, args.seed, rows, digits,
            )
            .with_context(|| format!("writing synthetic data to {}", args.out.display()))?;
            for f in [&files.sft, &files.dpo, &files.rollouts] {
                outln!("wrote {}", f.display())?;
            }
            Ok(ExitCode::SUCCESS)
        }
        SynthTask::ArithmeticRollouts => {
            let groups =
                (args.rows as usize).div_ceil(accrue_coordinator::stream::data::synth::GROUP_SIZE);
            let file = accrue_coordinator::stream::data::synth::synth_arithmetic_rollouts(
                &args.out, args.seed, groups,
            )
            .with_context(|| format!("writing synthetic rollouts to {}", args.out.display()))?;
            outln!("wrote {} ({groups} groups)", file.display())?;
            Ok(ExitCode::SUCCESS)
        }
        SynthTask::ToolArithmetic => {
            let rows = args.rows as usize;
            let files = accrue_coordinator::stream::data::synth_tools::synth_tool_arithmetic(
                &args.out,
                args.seed,
                rows,
                rows.div_ceil(10),
            )
            .with_context(|| format!("writing synthetic data to {}", args.out.display()))?;
            for f in [&files.sft, &files.prompts, &files.eval] {
                outln!("wrote {}", f.display())?;
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `accrue data prepare SPEC.toml`: builds (or finds) the token store of
/// every file of the job's sources and eval sources, with a progress bar
/// per file, and prints what each holds: documents, rows/s, and the rows
/// skipped (`file:line: reason`).
pub fn prepare(args: &crate::args::PrepareArgs) -> anyhow::Result<ExitCode> {
    use accrue_coordinator::stream::data::{self, cache};
    // The model's vocabulary bounds pre-tokenized ids, so it is part of a
    // store's key: without it the stores would be built under a key submit
    // never looks up.
    let (spec, vocab) = spec_and_vocab(&args.spec)?;
    let root = spec.data.cache_root();
    let base_enc = data::encoder(&spec.data, vocab)?;
    let train_files = spec.data.files();
    let mut lists = vec![(
        train_files.clone(),
        spec.data.train_sources(spec.job.epochs),
    )];
    if let Some(e) = &spec.eval {
        let mut files = train_files.clone();
        files.extend(e.sources.iter().flat_map(|s| s.entries().cloned()));
        lists.push((
            files,
            accrue_coordinator::job::sources::resolve(&e.sources, train_files.len() as u32, None),
        ));
    }
    let mut skipped_total = 0u64;
    for (files, sources) in &lists {
        for s in sources {
            let own;
            let enc = match &s.chat_template {
                Some(t) => {
                    own = data::encoder_with_template(&spec.data, vocab, Some(t))?;
                    &own
                }
                None => &base_enc,
            };
            let ekey = data::encoder_key(&spec.data, vocab, s.chat_template.as_deref())?;
            for f in s.files.clone() {
                let path = &files[f as usize];
                let key = cache::file_key(path, ekey)?;
                let bar = if args.json {
                    indicatif::ProgressBar::hidden()
                } else {
                    indicatif::ProgressBar::new_spinner()
                };
                bar.set_style(
                    indicatif::ProgressStyle::with_template("{spinner} {prefix} {msg}")
                        .expect("a valid template"),
                );
                bar.set_prefix(format!("{} [{}]", path.display(), s.name));
                let started = std::time::Instant::now();
                let (store, found) =
                    cache::open_or_build(&root, &key, path, enc, spec.data.format, &|p| {
                        let secs = started.elapsed().as_secs_f64().max(1e-9);
                        bar.set_message(format!(
                            "{} rows, {:.0} rows/s, {} skipped",
                            p.rows,
                            p.rows as f64 / secs,
                            p.bad
                        ));
                        bar.tick();
                    })?;
                bar.finish_and_clear();
                let secs = started.elapsed().as_secs_f64();
                let m = &store.meta;
                let rows_per_s = m.rows_read as f64 / secs.max(1e-9);
                skipped_total += m.bad;
                if args.json {
                    let row = serde_json::json!({
                        "source": s.name, "path": path, "store": store.dir(),
                        "found": found.name(),
                        "rows": m.rows_read, "docs": m.docs, "tokens": m.tokens,
                        "skipped": m.bad, "seconds": secs, "rows_per_s": rows_per_s,
                        "skipped_rows": store.bad.iter().map(|b| format!("{}:{}: {}", path.display(), b.line, b.reason)).collect::<Vec<_>>(),
                    });
                    outln!("{row}")?;
                    continue;
                }
                let how = match found {
                    cache::Found::Hit => "cached".to_string(),
                    cache::Found::Built => format!("built in {secs:.1}s, {rows_per_s:.0} rows/s"),
                };
                outln!(
                    "{} [{}]: {} documents, {} tokens, {} rows skipped ({how}) → {}",
                    path.display(),
                    s.name,
                    m.docs,
                    m.tokens,
                    m.bad,
                    store.dir().display()
                )?;
                for b in store.bad.iter().take(20) {
                    outln!("  skipped {}:{}: {}", path.display(), b.line, b.reason)?;
                }
                if store.bad.len() > 20 {
                    outln!("  … and {} more", store.bad.len() - 20)?;
                }
            }
        }
    }
    if skipped_total > 0
        && spec.data.on_bad_line == accrue_coordinator::job::data::OnBad::Error
        && !args.json
    {
        outln!("note: {skipped_total} rows are not documents; the job fails on them unless data.on_bad_line = \"skip\"")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The spec at `path` (relative paths against the current directory, as
/// submit resolves them) and its model's vocabulary size.
fn spec_and_vocab(
    path: &std::path::Path,
) -> anyhow::Result<(accrue_coordinator::job::spec::JobSpec, u32)> {
    let text = accrue_coordinator::job::input::read_spec(
        path,
        accrue_coordinator::job::input::MAX_CONFIG_BYTES,
    )?;
    let base = std::env::current_dir().context("cannot determine the current directory")?;
    let spec = accrue_coordinator::job::spec::JobSpec::parse(&text, &base).map_err(|p| {
        let lines: Vec<String> = p.iter().map(ToString::to_string).collect();
        anyhow::anyhow!(
            "{}: invalid spec:\n  {}",
            path.display(),
            lines.join("\n  ")
        )
    })?;
    let vocab = accrue_coordinator::model::config::read_config(&spec.model)
        .map_err(|e| {
            anyhow::anyhow!(
                "{}: cannot read the model's vocab_size: {e}",
                path.display()
            )
        })?
        .vocab_size;
    Ok((spec, vocab))
}

/// `accrue data show SPEC.toml`: rows of a source as the job will train
/// them (see [`crate::args::ShowArgs`]). A row that is not a document is
/// shown with its reason; a chat row without the model's template fails
/// as the job would.
pub fn show(args: &crate::args::ShowArgs) -> anyhow::Result<ExitCode> {
    use accrue_coordinator::stream::data::{self, read};
    use accrue_coordinator::stream::doc::DocBody;
    let (spec, vocab) = spec_and_vocab(&args.spec)?;
    let sources = spec.data.train_sources(spec.job.epochs);
    let source = match &args.source {
        None => sources.first(),
        Some(name) => sources.iter().find(|s| &s.name == name),
    }
    .ok_or_else(|| {
        let names: Vec<&str> = sources.iter().map(|s| s.name.as_str()).collect();
        anyhow::anyhow!(
            "--source {}: no such source in {} (its sources: {})",
            args.source.as_deref().unwrap_or(""),
            args.spec.display(),
            names.join(", ")
        )
    })?;
    let enc = data::encoder_with_template(&spec.data, vocab, source.chat_template.as_deref())?;
    let files = spec.data.files();
    let want = |n: u64| match args.doc {
        Some(d) => n == d,
        None => n <= args.count,
    };
    let last = args.doc.unwrap_or(args.count);
    let mut n = 0u64;
    let mut out = Vec::new();
    for f in source.files.clone() {
        let path = &files[f as usize];
        read::for_each_batch(path, 256, |rows| {
            for row in rows {
                n += 1;
                if !want(n) {
                    continue;
                }
                let at = row.location(path);
                let body = match &row.value {
                    Err(message) => Err(format!("invalid json: {message}")),
                    Ok(v) => data::build_doc(&enc, spec.data.format, v),
                };
                enc.template.check_needed()?;
                out.push((n, at, body));
            }
            Ok(())
        })?;
        if n >= last {
            break;
        }
    }
    if out.is_empty() {
        anyhow::bail!(
            "{}: source {} has {n} rows{}",
            args.spec.display(),
            source.name,
            args.doc.map_or(String::new(), |d| format!(", no row {d}"))
        );
    }
    for (n, at, body) in out {
        let seqs: Vec<(&str, &accrue_coordinator::stream::doc::Sequence)> = match &body {
            Ok(DocBody::Sft(s)) => vec![("sft", s)],
            Ok(DocBody::Pair { chosen, rejected }) => {
                vec![("chosen", chosen), ("rejected", rejected)]
            }
            Ok(DocBody::Rollout(r)) => vec![("rollout", &r.seq)],
            Err(_) => Vec::new(),
        };
        let shown: Vec<serde_json::Value> = seqs
            .iter()
            .map(|(kind, s)| sequence_json(&enc.tok, kind, s))
            .collect::<anyhow::Result<_>>()?;
        if args.json {
            let mut v = serde_json::json!({
                "row": n,
                "file": at.path.display().to_string(),
                "line": at.line,
                "element": at.element,
            });
            match &body {
                Ok(_) => v["sequences"] = shown.into(),
                Err(reason) => v["error"] = reason.clone().into(),
            }
            outln!("{v}")?;
            continue;
        }
        match &body {
            Err(reason) => outln!("row {n} ({at}): not a document: {reason}")?,
            Ok(_) => {
                outln!("row {n} ({at})")?;
                for s in &shown {
                    outln!(
                        "  {}: {} tokens, {} carry loss",
                        s["kind"].as_str().unwrap_or(""),
                        s["tokens"],
                        s["loss_tokens"]
                    )?;
                    outln!("  text: {}", s["marked"].as_str().unwrap_or(""))?;
                    outln!("  ids:  {}", s["ids"])?;
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One sequence for `data show`: its text, ids and loss mask, and the text
/// with every span of loss-carrying tokens between `[[` and `]]`.
fn sequence_json(
    tok: &accrue_coordinator::stream::data::Tokenizer,
    kind: &str,
    s: &accrue_coordinator::stream::doc::Sequence,
) -> anyhow::Result<serde_json::Value> {
    use accrue_coordinator::stream::doc::IGNORE_INDEX;
    let ids = s.input_ids();
    let mask: Vec<u8> = s
        .labels()
        .iter()
        .map(|&l| u8::from(l != IGNORE_INDEX))
        .collect();
    let decode = |ids: &[u32]| {
        tok.decode_all(ids)
            .map_err(|e| anyhow::anyhow!("decoding: {e}"))
    };
    let mut marked = String::new();
    let mut start = 0;
    while start < ids.len() {
        let end = (start..ids.len())
            .find(|&i| mask[i] != mask[start])
            .unwrap_or(ids.len());
        let text = decode(&ids[start..end])?;
        if mask[start] == 1 {
            marked.push_str(&format!("[[{text}]]"));
        } else {
            marked.push_str(&text);
        }
        start = end;
    }
    Ok(serde_json::json!({
        "kind": kind,
        "text": decode(ids)?,
        "marked": marked,
        "ids": ids,
        "loss_mask": mask,
        "tokens": ids.len(),
        "loss_tokens": s.loss_tokens(),
    }))
}

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
    }
}

/// `accrue data prepare SPEC.toml`: builds (or finds) the token store of
/// every file of the job's sources and eval sources, with a progress bar
/// per file, and prints what each holds: documents, rows/s, and the rows
/// skipped (`file:line: reason`).
pub fn prepare(args: &crate::args::PrepareArgs) -> anyhow::Result<ExitCode> {
    use accrue_coordinator::stream::data::{self, cache};
    let text = accrue_coordinator::job::input::read_spec(
        &args.spec,
        accrue_coordinator::job::input::MAX_CONFIG_BYTES,
    )?;
    let base = std::env::current_dir().context("cannot determine the current directory")?;
    let spec = accrue_coordinator::job::spec::JobSpec::parse(&text, &base).map_err(|p| {
        let lines: Vec<String> = p.iter().map(ToString::to_string).collect();
        anyhow::anyhow!(
            "{}: invalid spec:\n  {}",
            args.spec.display(),
            lines.join("\n  ")
        )
    })?;
    // The model's vocabulary bounds pre-tokenized ids, so it is part of a
    // store's key: without it the stores would be built under a key submit
    // never looks up.
    let vocab = accrue_coordinator::model::config::read_config(&spec.model)
        .map_err(|e| {
            anyhow::anyhow!(
                "{}: cannot read the model's vocab_size (part of the token cache key): {e}",
                args.spec.display()
            )
        })?
        .vocab_size;
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

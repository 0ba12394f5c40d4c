//! Text and JSON renderings of the admin API's messages: pure functions from
//! the generated `accrue.v1` types to `String`/`serde_json::Value`, so the
//! exact output of every command is unit-tested without a coordinator.
//!
//! The prost types do not derive `Serialize`; the JSON here is written by
//! hand and is the CLI's stable `--json` format (snake_case field names as in
//! the `.proto` files, enum values as lowercase words such as `"running"`).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{json, Value};

use accrue_coordinator::wire::{
    watch_job_response::Item, AbortReason, DataCursor, EventKind, GetJobResponse, JobEvent,
    JobState, JobSummary, StepMetrics, WatchJobResponse, WorkerInfo, WorkerState,
};

/// Lowercase name of a wire job state, e.g. `"running"`; `"unknown(9)"` for
/// a value this CLI does not know (a newer coordinator).
pub fn job_state_name(state: i32) -> String {
    match JobState::try_from(state) {
        Ok(s) => enum_word(s.as_str_name(), "JOB_STATE_"),
        Err(_) => format!("unknown({state})"),
    }
}

/// Lowercase name of a wire event kind, e.g. `"generation"`.
pub fn event_kind_name(kind: i32) -> String {
    match EventKind::try_from(kind) {
        Ok(k) => enum_word(k.as_str_name(), "EVENT_KIND_"),
        Err(_) => format!("unknown({kind})"),
    }
}

/// Lowercase name of a wire abort reason, e.g. `"worker_lost"`.
pub fn abort_reason_name(reason: i32) -> String {
    match AbortReason::try_from(reason) {
        Ok(r) => enum_word(r.as_str_name(), "ABORT_REASON_"),
        Err(_) => format!("unknown({reason})"),
    }
}

/// Lowercase name of a wire worker state, e.g. `"active"`.
pub fn worker_state_name(state: i32) -> String {
    match WorkerState::try_from(state) {
        Ok(s) => enum_word(s.as_str_name(), "WORKER_STATE_"),
        Err(_) => format!("unknown({state})"),
    }
}

fn enum_word(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix).unwrap_or(name).to_lowercase()
}

/// Left-aligned columns separated by two spaces, header first. Trailing
/// spaces are trimmed so the last column is not padded.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (cell, w) in row.iter().zip(&widths) {
            let _ = write!(line, "{cell:<w$}  ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `"12/100"`, or `"12"` when the total is unknown (0).
pub fn step_of_total(step: u64, total: u64) -> String {
    if total == 0 {
        step.to_string()
    } else {
        format!("{step}/{total}")
    }
}

/// A loss with four decimals, or `-` before the first committed step.
fn loss_cell(step: u64, loss: f64) -> String {
    if step == 0 {
        "-".into()
    } else {
        format!("{loss:.4}")
    }
}

fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_string()
    }
}

/// A rate with an SI suffix: `950`, `12.3k`, `4.56M`.
pub fn human_rate(x: f64) -> String {
    let a = x.abs();
    if a >= 1e9 {
        format!("{:.2}G", x / 1e9)
    } else if a >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if a >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// Bytes in binary units: `512 B`, `1.5 KiB`, `79.6 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// A duration in milliseconds as `850ms`, `12s`, `3m05s`, `2h10m`, `3d4h`.
pub fn human_ms(ms: u64) -> String {
    let s = ms / 1000;
    if ms < 1000 {
        format!("{ms}ms")
    } else if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else if s < 86_400 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}d{}h", s / 86_400, (s % 86_400) / 3600)
    }
}

/// The `accrue jobs` table.
pub fn jobs_table(jobs: &[JobSummary]) -> String {
    if jobs.is_empty() {
        return "no jobs\n".into();
    }
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            vec![
                j.job_id.clone(),
                j.name.clone(),
                job_state_name(j.state),
                step_of_total(j.step, j.total_steps),
                j.world_size.to_string(),
                loss_cell(j.step, j.last_loss),
                or_dash(&j.reason),
            ]
        })
        .collect();
    table(
        &["ID", "NAME", "STATE", "STEP", "WORKERS", "LOSS", "REASON"],
        &rows,
    )
}

/// One job summary as JSON.
pub fn job_json(j: &JobSummary) -> Value {
    json!({
        "job_id": j.job_id,
        "name": j.name,
        "state": job_state_name(j.state),
        "step": j.step,
        "total_steps": j.total_steps,
        "cursor": j.cursor.as_ref().map(cursor_json),
        "generation": j.generation,
        "world_size": j.world_size,
        "reason": j.reason,
        "last_loss": j.last_loss,
        "submitted_unix_ms": j.submitted_unix_ms,
        "documents": j.documents,
    })
}

/// `accrue jobs --json`: an array of job summaries.
pub fn jobs_json(jobs: &[JobSummary]) -> Value {
    Value::Array(jobs.iter().map(job_json).collect())
}

/// A data cursor as JSON.
pub fn cursor_json(c: &DataCursor) -> Value {
    json!({ "epoch": c.epoch, "position": c.position, "overflow": c.overflow })
}

/// `epoch 0, position 768, overflow 3`.
pub fn cursor_line(c: Option<&DataCursor>) -> String {
    match c {
        Some(c) => format!(
            "epoch {}, position {}, overflow {}",
            c.epoch,
            c.position,
            c.overflow.len()
        ),
        None => "-".into(),
    }
}

/// Sorted so the output does not depend on hash-map order.
fn extra_json(extra: &std::collections::HashMap<String, f64>) -> Value {
    let sorted: BTreeMap<&String, &f64> = extra.iter().collect();
    json!(sorted)
}

/// One step's metrics as JSON, each field named as in metrics.jsonl (a
/// test holds the two to one name per field).
pub fn step_json(s: &StepMetrics) -> Value {
    let mut v = json!({
        "step": s.step,
        "loss": s.loss,
        "tokens": s.tokens,
        "loss_tokens": s.loss_tokens,
        "docs": s.documents,
        "microbatches": s.microbatches,
        "lr": s.lr,
        "grad_norm": s.grad_norm,
        "tokens_per_s": s.tokens_per_s,
        "tokens_per_s_per_worker": s.tokens_per_s_per_worker,
        "padding_fraction": s.padding_fraction,
        "step_time_s": s.step_time_s,
        "model_flops": s.model_flops,
        "mfu": s.mfu,
        "gpu_memory_peak_allocated_bytes": s.gpu_memory_peak_allocated_bytes,
        "gpu_memory_peak_reserved_bytes": s.gpu_memory_peak_reserved_bytes,
        "world_size": s.world_size,
        "generation": s.generation,
        "cursor": s.cursor.as_ref().map(cursor_json),
        "extra": extra_json(&s.extra),
    });
    if !s.sources.is_empty() {
        v["sources"] = sources_json(&s.sources);
    }
    v
}

/// Per-source metrics as JSON, by source name.
pub fn sources_json(
    sources: &std::collections::HashMap<String, accrue_coordinator::wire::SourceMetrics>,
) -> Value {
    let sorted: std::collections::BTreeMap<_, _> = sources.iter().collect();
    let each = sorted.into_iter().map(|(name, m)| {
        let v = json!({
            "loss": m.loss,
            "loss_tokens": m.loss_tokens,
            "tokens": m.tokens,
            "docs": m.documents,
            "extra": extra_json(&m.extra),
        });
        (name.clone(), v)
    });
    Value::Object(each.collect())
}

/// An evaluation as JSON.
pub fn eval_json(e: &accrue_coordinator::wire::EvalMetrics) -> Value {
    json!({
        "step": e.step,
        "loss": e.loss,
        "loss_tokens": e.loss_tokens,
        "tokens": e.tokens,
        "docs": e.documents,
        "extra": extra_json(&e.extra),
        "sources": sources_json(&e.sources),
        "unix_ms": e.unix_ms,
    })
}

/// An evaluation on one line: `eval @ step N  loss X  (a 1.2, b 3.4)`.
pub fn eval_line(e: &accrue_coordinator::wire::EvalMetrics) -> String {
    let mut line = format!(
        "eval @ step {}  loss {:.4}  docs {}",
        e.step, e.loss, e.documents
    );
    if let Some(acc) = e.extra.get("rewards/accuracy") {
        line.push_str(&format!("  accuracy {acc:.3}"));
    }
    if let Some(r) = e.extra.get("reward") {
        line.push_str(&format!("  reward {r:.3}"));
    }
    line.push_str(&per_source(&e.sources));
    line
}

/// `  (a 1.2345, b 3.4567)`: each source's loss, by name; empty for none.
fn per_source(
    sources: &std::collections::HashMap<String, accrue_coordinator::wire::SourceMetrics>,
) -> String {
    if sources.is_empty() {
        return String::new();
    }
    let sorted: std::collections::BTreeMap<_, _> = sources.iter().collect();
    let parts: Vec<String> = sorted
        .iter()
        .map(|(n, m)| format!("{n} {:.4}", m.loss))
        .collect();
    format!("  ({})", parts.join(", "))
}

/// One job event as JSON.
pub fn event_json(e: &JobEvent) -> Value {
    let mut v = json!({
        "unix_ms": e.unix_ms,
        "kind": event_kind_name(e.kind),
        "message": e.message,
        "state": job_state_name(e.state),
    });
    if e.abort_reason != AbortReason::Unspecified as i32 {
        v["reason"] = json!(abort_reason_name(e.abort_reason));
    }
    if let Some(step) = e.aborted_step {
        v["aborted_step"] = json!(step);
    }
    v
}

/// One `watch` stream item as a JSON object, `{"step": …}` or
/// `{"event": …}`; `None` for an empty item (nothing to print).
pub fn watch_item_json(item: &WatchJobResponse) -> Option<Value> {
    match item.item.as_ref()? {
        Item::Step(s) => Some(json!({ "step": step_json(s) })),
        Item::Event(e) => Some(json!({ "event": event_json(e) })),
        Item::Eval(e) => Some(json!({ "eval": eval_json(e) })),
    }
}

/// A committed step on one line, for logs and the `watch` fallback when
/// stderr is not a terminal.
pub fn step_line(s: &StepMetrics) -> String {
    format!(
        "step {}  loss {:.4}  lr {:.3e}  grad_norm {:.3}  tokens {}  docs {}  mbs {}  {} tok/s  mfu {}  {:.2}s  world {}{}",
        s.step,
        s.loss,
        s.lr,
        s.grad_norm,
        s.tokens,
        s.documents,
        s.microbatches,
        human_rate(s.tokens_per_s),
        mfu_text(s.mfu),
        s.step_time_s,
        s.world_size,
        gpu_memory_text(s)
    ) + &per_source(&s.sources)
}

/// `  gpu 12.3 GiB (reserved 14.0 GiB)` on GPU workers, empty on CPU.
fn gpu_memory_text(s: &StepMetrics) -> String {
    if s.gpu_memory_peak_reserved_bytes == 0 && s.gpu_memory_peak_allocated_bytes == 0 {
        return String::new();
    }
    format!(
        "  gpu {} (reserved {})",
        human_bytes(s.gpu_memory_peak_allocated_bytes),
        human_bytes(s.gpu_memory_peak_reserved_bytes)
    )
}

/// The progress bar's message for the latest step.
pub fn bar_message(s: &StepMetrics) -> String {
    format!(
        "loss {:.4} · {} tok/s · mfu {}{}",
        s.loss,
        human_rate(s.tokens_per_s),
        mfu_text(s.mfu),
        if s.gpu_memory_peak_allocated_bytes > 0 {
            format!(" · gpu {}", human_bytes(s.gpu_memory_peak_allocated_bytes))
        } else {
            String::new()
        }
    )
}

/// MFU as a percentage, `-` when unknown (a worker did not report its peak).
fn mfu_text(mfu: f64) -> String {
    if mfu > 0.0 && mfu.is_finite() {
        format!("{:.1}%", mfu * 100.0)
    } else {
        "-".into()
    }
}

/// An event on one line: `[state] running: generation 2 formed`.
pub fn event_line(e: &JobEvent) -> String {
    let state = if e.state == JobState::Unspecified as i32 {
        String::new()
    } else {
        format!(" {}", job_state_name(e.state))
    };
    let kind = event_kind_name(e.kind);
    if e.message.is_empty() {
        format!("[{kind}]{state}")
    } else {
        format!("[{kind}]{state}: {}", e.message)
    }
}

/// `accrue status`: summary, cursor and recent steps. `now_unix_ms` is the
/// caller's clock, used only for "submitted … ago".
pub fn job_detail(r: &GetJobResponse, now_unix_ms: i64) -> String {
    let mut out = String::new();
    let Some(j) = &r.job else {
        return "no job summary in the coordinator's reply\n".into();
    };
    let ago = u64::try_from(now_unix_ms.saturating_sub(j.submitted_unix_ms)).unwrap_or(0);
    let submitted = if j.submitted_unix_ms > 0 {
        format!("{} ago", human_ms(ago))
    } else {
        "-".into()
    };
    let fields = [
        ("job", format!("{} ({})", j.job_id, j.name)),
        ("state", job_state_name(j.state)),
        ("reason", or_dash(&j.reason)),
        ("step", step_of_total(j.step, j.total_steps)),
        ("loss", loss_cell(j.step, j.last_loss)),
        ("documents", j.documents.to_string()),
        (
            "workers",
            format!("{} (generation {})", j.world_size, j.generation),
        ),
        ("cursor", cursor_line(j.cursor.as_ref())),
        ("submitted", submitted),
    ];
    for (k, v) in fields {
        let _ = writeln!(out, "{k:<10} {v}");
    }
    if r.recent_steps.is_empty() {
        out.push_str("no committed steps yet\n");
    } else {
        out.push_str("\nrecent steps:\n");
        let rows: Vec<Vec<String>> = r
            .recent_steps
            .iter()
            .map(|s| {
                vec![
                    s.step.to_string(),
                    format!("{:.4}", s.loss),
                    format!("{:.3e}", s.lr),
                    format!("{:.3}", s.grad_norm),
                    s.tokens.to_string(),
                    s.documents.to_string(),
                    s.microbatches.to_string(),
                    human_rate(s.tokens_per_s),
                    format!("{:.1}%", s.padding_fraction * 100.0),
                    format!("{:.2}s", s.step_time_s),
                    s.world_size.to_string(),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "STEP",
                "LOSS",
                "LR",
                "GRAD_NORM",
                "TOKENS",
                "DOCS",
                "MBS",
                "TOK/S",
                "PAD",
                "TIME",
                "WORLD",
            ],
            &rows,
        ));
    }
    out
}

/// `accrue status --json`.
pub fn job_detail_json(r: &GetJobResponse) -> Value {
    json!({
        "job": r.job.as_ref().map(job_json),
        "spec_toml": r.spec_toml,
        "recent_steps": r.recent_steps.iter().map(step_json).collect::<Vec<_>>(),
    })
}

/// The `accrue workers` table.
pub fn workers_table(workers: &[WorkerInfo]) -> String {
    if workers.is_empty() {
        return "no workers\n".into();
    }
    let rows: Vec<Vec<String>> = workers
        .iter()
        .map(|w| {
            vec![
                w.worker_id.clone(),
                or_dash(&w.hostname),
                if w.gpu_name.is_empty() {
                    or_dash(&w.device)
                } else {
                    format!("{} ({})", w.device, w.gpu_name)
                },
                worker_state_name(w.state),
                or_dash(&w.job_id),
                match (w.rank, w.generator) {
                    (Some(r), true) => format!("gen {r}"),
                    (Some(r), false) => r.to_string(),
                    (None, _) => "-".into(),
                },
                format!("{} ago", human_ms(w.last_seen_ms_ago)),
                match (w.gpu_memory_bytes, w.memory_bytes) {
                    (0, 0) => "-".into(),
                    (0, host) => human_bytes(host),
                    (gpu, _) => human_bytes(gpu),
                },
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "HOST",
            "DEVICE",
            "STATE",
            "JOB",
            "RANK",
            "LAST SEEN",
            "MEMORY",
        ],
        &rows,
    )
}

/// One worker as JSON.
pub fn worker_json(w: &WorkerInfo) -> Value {
    json!({
        "worker_id": w.worker_id,
        "hostname": w.hostname,
        "device": w.device,
        "state": worker_state_name(w.state),
        "job_id": w.job_id,
        "rank": w.rank,
        "generator": w.generator,
        "last_seen_ms_ago": w.last_seen_ms_ago,
        "memory_bytes": w.memory_bytes,
        "gpu_name": w.gpu_name,
        "gpu_memory_bytes": w.gpu_memory_bytes,
    })
}

/// `accrue workers --json`: an array of workers.
pub fn workers_json(workers: &[WorkerInfo]) -> Value {
    Value::Array(workers.iter().map(worker_json).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: &str, state: JobState, step: u64, total: u64) -> JobSummary {
        JobSummary {
            job_id: id.into(),
            name: "sft-demo".into(),
            state: state as i32,
            step,
            total_steps: total,
            cursor: Some(DataCursor {
                epoch: 1,
                position: 768,
                overflow: vec![4, 9],
                ..Default::default()
            }),
            generation: 2,
            world_size: 4,
            reason: String::new(),
            last_loss: 2.345_678,
            submitted_unix_ms: 1_000,
            documents: 768,
            quarantined: 0,
        }
    }

    fn step(n: u64) -> StepMetrics {
        StepMetrics {
            step: n,
            loss: 1.5,
            tokens: 4096,
            loss_tokens: 2000,
            documents: 64,
            microbatches: 3,
            lr: 1e-4,
            grad_norm: 0.5,
            tokens_per_s: 12_345.0,
            tokens_per_s_per_worker: 3_086.25,
            padding_fraction: 0.125,
            step_time_s: 0.33,
            world_size: 4,
            generation: 2,
            cursor: None,
            extra: [("rewards/chosen".to_string(), 0.25)].into(),
            model_flops: 1.0e12,
            mfu: 0.125,
            ..Default::default()
        }
    }

    #[test]
    fn state_names_are_lowercase_words_and_unknown_values_are_named() {
        assert_eq!(job_state_name(JobState::Running as i32), "running");
        assert_eq!(job_state_name(JobState::Cancelled as i32), "cancelled");
        assert_eq!(job_state_name(42), "unknown(42)");
        assert_eq!(worker_state_name(WorkerState::Draining as i32), "draining");
    }

    #[test]
    fn table_aligns_columns_and_trims_trailing_space() {
        let t = table(
            &["A", "LONGER"],
            &[vec!["xxxx".into(), "1".into()], vec!["y".into(), "".into()]],
        );
        assert_eq!(t, "A     LONGER\nxxxx  1\ny\n");
    }

    #[test]
    fn jobs_table_shows_every_column() {
        let mut pending = job("b2", JobState::Pending, 0, 0);
        pending.reason = "waiting for 2 workers (have 1)".into();
        let t = jobs_table(&[job("a1", JobState::Running, 12, 100), pending]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("ID  NAME      STATE"), "{t}");
        for cell in ["a1", "sft-demo", "running", "12/100", "4", "2.3457"] {
            assert!(lines[1].contains(cell), "{cell} missing in {t}");
        }
        assert!(lines[1].ends_with('-'), "empty reason is a dash: {t}");
        // Before the first step the loss is unknown, and the total too.
        assert!(lines[2].contains("pending"), "{t}");
        assert!(lines[2].ends_with("waiting for 2 workers (have 1)"), "{t}");
        assert!(!lines[2].contains("2.3457"), "{t}");
        assert_eq!(jobs_table(&[]), "no jobs\n");
    }

    #[test]
    fn jobs_json_mirrors_the_summary() {
        let v = jobs_json(&[job("a1", JobState::Paused, 12, 100)]);
        assert_eq!(v[0]["job_id"], "a1");
        assert_eq!(v[0]["state"], "paused");
        assert_eq!(v[0]["step"], 12);
        assert_eq!(v[0]["total_steps"], 100);
        assert_eq!(v[0]["cursor"]["overflow"], json!([4, 9]));
        assert_eq!(v[0]["world_size"], 4);
        assert_eq!(jobs_json(&[]), json!([]));
    }

    #[test]
    fn job_detail_shows_cursor_and_recent_steps() {
        let r = GetJobResponse {
            job: Some(job("a1", JobState::Running, 12, 100)),
            spec_toml: "[job]\n".into(),
            recent_steps: vec![step(11), step(12)],
        };
        let t = job_detail(&r, 1_000 + 125_000);
        assert!(t.contains("job        a1 (sft-demo)"), "{t}");
        assert!(t.contains("step       12/100"), "{t}");
        assert!(
            t.contains("cursor     epoch 1, position 768, overflow 2"),
            "{t}"
        );
        assert!(t.contains("workers    4 (generation 2)"), "{t}");
        assert!(t.contains("submitted  2m05s ago"), "{t}");
        assert!(t.contains("recent steps:"), "{t}");
        let last = t.lines().last().unwrap();
        for cell in [
            "12", "1.5000", "1.000e-4", "4096", "12.3k", "12.5%", "0.33s",
        ] {
            assert!(last.contains(cell), "{cell} missing in {last}");
        }
        let v = job_detail_json(&r);
        assert_eq!(v["job"]["job_id"], "a1");
        assert_eq!(v["spec_toml"], "[job]\n");
        assert_eq!(v["recent_steps"][1]["step"], 12);
        assert_eq!(v["recent_steps"][0]["extra"]["rewards/chosen"], 0.25);
    }

    #[test]
    fn job_detail_without_steps_says_so() {
        let r = GetJobResponse {
            job: Some(job("a1", JobState::Pending, 0, 0)),
            spec_toml: String::new(),
            recent_steps: vec![],
        };
        let t = job_detail(&r, 0);
        assert!(t.contains("no committed steps yet"), "{t}");
        assert!(t.contains("loss       -"), "{t}");
    }

    #[test]
    fn workers_table_and_json() {
        let w = WorkerInfo {
            worker_id: "w-1".into(),
            hostname: "node7".into(),
            device: "cuda:0".into(),
            state: WorkerState::Active as i32,
            job_id: "a1".into(),
            rank: Some(3),
            last_seen_ms_ago: 1_500,
            memory_bytes: 80 * 1024 * 1024 * 1024,
            ..Default::default()
        };
        let idle = WorkerInfo {
            worker_id: "w-2".into(),
            state: WorkerState::Idle as i32,
            ..Default::default()
        };
        let generator = WorkerInfo {
            worker_id: "w-3".into(),
            rank: Some(0),
            generator: true,
            ..Default::default()
        };
        let t = workers_table(&[w.clone(), idle, generator.clone()]);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[3].contains("gen 0"), "a generator's rank: {t}");
        assert_eq!(workers_json(&[generator])[0]["generator"], true);
        for cell in [
            "w-1", "node7", "cuda:0", "active", "a1", "3", "1s ago", "80.0 GiB",
        ] {
            assert!(lines[1].contains(cell), "{cell} missing in {t}");
        }
        assert!(lines[2].contains("idle"), "{t}");
        assert_eq!(workers_table(&[]), "no workers\n");
        let v = workers_json(&[w]);
        assert_eq!(v[0]["rank"], 3);
        assert_eq!(v[0]["state"], "active");
        assert_eq!(v[0]["memory_bytes"], 80u64 * 1024 * 1024 * 1024);
    }

    #[test]
    fn watch_items_render_as_tagged_json_lines() {
        let s = WatchJobResponse {
            item: Some(Item::Step(step(7))),
        };
        let v = watch_item_json(&s).unwrap();
        assert_eq!(v["step"]["step"], 7);
        assert_eq!(v["step"]["tokens_per_s"], 12_345.0);
        let e = WatchJobResponse {
            item: Some(Item::Event(JobEvent {
                unix_ms: 5,
                kind: EventKind::State as i32,
                message: "all steps done".into(),
                state: JobState::Completed as i32,
                ..Default::default()
            })),
        };
        let v = watch_item_json(&e).unwrap();
        assert_eq!(v["event"]["state"], "completed");
        assert_eq!(v["event"]["message"], "all steps done");
        assert!(watch_item_json(&WatchJobResponse { item: None }).is_none());
    }

    #[test]
    fn event_and_step_lines() {
        let e = JobEvent {
            unix_ms: 0,
            kind: EventKind::Generation as i32,
            message: "generation 3 formed with 2 workers".into(),
            state: JobState::Unspecified as i32,
            ..Default::default()
        };
        assert_eq!(
            event_line(&e),
            "[generation]: generation 3 formed with 2 workers"
        );
        let e = JobEvent {
            kind: EventKind::State as i32,
            message: String::new(),
            state: JobState::Failed as i32,
            ..e
        };
        assert_eq!(event_line(&e), "[state] failed");
        assert_eq!(
            bar_message(&step(1)),
            "loss 1.5000 · 12.3k tok/s · mfu 12.5%"
        );
        let l = step_line(&step(9));
        assert!(l.starts_with("step 9  loss 1.5000"), "{l}");
    }

    #[test]
    fn human_units() {
        assert_eq!(human_rate(950.0), "950");
        assert_eq!(human_rate(12_345.0), "12.3k");
        assert_eq!(human_rate(4_560_000.0), "4.56M");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_ms(850), "850ms");
        assert_eq!(human_ms(12_000), "12s");
        assert_eq!(human_ms(185_000), "3m05s");
        assert_eq!(human_ms(7_800_000), "2h10m");
        assert_eq!(human_ms(3 * 86_400_000 + 4 * 3_600_000), "3d4h");
        assert_eq!(step_of_total(3, 0), "3");
    }

    /// `watch --json` and metrics.jsonl name every field alike: each key
    /// the watch stream prints (nested ones too) is the metrics.jsonl
    /// line's key for the same value.
    #[test]
    fn watch_json_and_metrics_jsonl_use_one_name_per_field() {
        use accrue_coordinator::core::{EvalMetrics, SourceMetrics, StepMetrics};
        let source = SourceMetrics {
            loss: 1.5,
            loss_tokens: 10,
            tokens: 12,
            docs: 2,
            extra: [("rewards/accuracy".to_string(), 0.5)].into(),
        };
        let step = StepMetrics {
            step: 7,
            loss: 2.0,
            tokens: 100,
            loss_tokens: 90,
            docs: 4,
            microbatches: 3,
            lr: 1e-4,
            grad_norm: 0.5,
            tokens_per_s: 1000.0,
            world_size: 2,
            generation: 1,
            mfu: 0.25,
            model_flops: 1e9,
            gpu_memory_peak_allocated_bytes: 5,
            gpu_memory_peak_reserved_bytes: 6,
            extra: [("kl".to_string(), 0.1)].into(),
            sources: [("chat".to_string(), source.clone())].into(),
            ..Default::default()
        };
        fn check(watch: &Value, line: &Value, at: &str) {
            for (k, v) in watch.as_object().unwrap() {
                let Some(l) = line.get(k) else {
                    panic!("{at}{k}: in watch --json, not in metrics.jsonl ({line})");
                };
                match (v, l) {
                    (Value::Object(_), Value::Object(_)) => check(v, l, &format!("{at}{k}.")),
                    (Value::Number(a), Value::Number(b)) => {
                        assert_eq!(a.as_f64(), b.as_f64(), "{at}{k}")
                    }
                    _ => {}
                }
            }
        }
        let line = serde_json::to_value(&step).unwrap();
        let watch = step_json(&accrue_coordinator::shell::service::convert::step_metrics(
            &step,
        ));
        check(&watch, &line, "step.");
        let eval = EvalMetrics {
            step: 7,
            loss: 1.0,
            loss_tokens: 9,
            tokens: 11,
            docs: 3,
            extra: BTreeMap::new(),
            sources: [("chat".to_string(), source)].into(),
            unix_ms: 5,
        };
        let line = serde_json::to_value(&eval).unwrap();
        let watch = eval_json(&accrue_coordinator::shell::service::convert::eval_metrics(
            &eval,
        ));
        check(&watch, &line, "eval.");
    }
}

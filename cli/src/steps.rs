//! `accrue steps JOB`: the per-step manifests of a job's committed steps, as
//! a table (with `--detail`, each rank's microbatches below its step) or
//! as JSON lines. A `--json` line deserialises into
//! [`accrue_coordinator::core::manifest::StepManifest`], so a test can feed
//! `accrue steps JOB --detail --json` to
//! [`accrue_coordinator::core::manifest::check_exactly_once`].

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::Context as _;
use serde_json::{json, Value};

use super::client::{connect, rpc_error};
use super::output::{out, outln};
use super::render::table;
use crate::args::Conn;
use accrue_coordinator::wire::{ListStepsRequest, StepManifest, StepRankLayout};

/// What `accrue steps` asks for and how it prints it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepsArgs {
    pub job: String,
    pub from: Option<u64>,
    pub to: Option<u64>,
    pub detail: bool,
    pub json: bool,
}

/// `accrue steps JOB [--from N] [--to M] [--detail] [--json]`.
pub async fn run(conn: &Conn, args: &StepsArgs) -> anyhow::Result<ExitCode> {
    let steps = connect(conn)
        .await?
        .list_steps(ListStepsRequest {
            job_id: args.job.clone(),
            from_step: args.from,
            to_step: args.to,
            detail: args.detail,
        })
        .await
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .with_context(|| format!("list steps of job {}", args.job))?
        .into_inner()
        .steps;
    if args.json {
        for s in &steps {
            outln!("{}", step_json(s))?;
        }
    } else {
        out!("{}", steps_table(&steps, args.detail))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// A learning rate as `1.00e-4`; `-` when unknown (0).
fn lr_cell(lr: f64) -> String {
    if lr == 0.0 {
        "-".into()
    } else {
        format!("{lr:.2e}")
    }
}

/// How the step was sized: `docs 8`, `tokens 4096`, `mb/rank 2`.
fn size_cell(s: &StepManifest) -> String {
    match (s.docs_per_step, s.tokens_per_step, s.microbatches_per_rank) {
        (Some(n), _, _) => format!("docs {n}"),
        (_, Some(t), _) => format!("tokens {t}"),
        (_, _, Some(k)) => format!("mb/rank {k}"),
        _ => "-".into(),
    }
}

/// The `accrue steps` table; with `detail`, each rank's microbatches as
/// indented lines under its step.
pub fn steps_table(steps: &[StepManifest], detail: bool) -> String {
    if steps.is_empty() {
        return "no committed steps\n".into();
    }
    let headers = [
        "STEP", "GEN", "WORLD", "LR", "DOCS", "TOKENS", "MB/RANK", "ATTEMPTS", "SIZE", "MAX_TOK",
    ];
    let row = |s: &StepManifest| {
        vec![
            s.step.to_string(),
            s.generation.to_string(),
            s.world_size.to_string(),
            lr_cell(s.lr),
            s.documents.to_string(),
            s.tokens.to_string(),
            s.rank_microbatches.to_string(),
            if s.complete {
                s.attempts.to_string()
            } else {
                "-".into()
            },
            size_cell(s),
            if s.complete {
                s.max_tokens.to_string()
            } else {
                "-".into()
            },
        ]
    };
    if !detail {
        let rows: Vec<Vec<String>> = steps.iter().map(row).collect();
        return table(&headers, &rows);
    }
    let mut out = String::new();
    for s in steps {
        out.push_str(&table(&headers, &[row(s)]));
        for (r, layout) in s.ranks.iter().enumerate() {
            let _ = writeln!(out, "  rank {r}: {}", rank_line(layout));
        }
        if s.ranks.is_empty() && !s.docs.is_empty() {
            let _ = writeln!(out, "  docs: {}", s.docs.join(" "));
        }
    }
    out
}

/// `mb0 412t [0:3 0:9/r] | mb1 0t []`: tokens and sequences per microbatch
/// (`/r` marks a DPO rejected sequence).
fn rank_line(layout: &StepRankLayout) -> String {
    let mbs: Vec<String> = layout
        .microbatches
        .iter()
        .enumerate()
        .map(|(i, mb)| {
            let seqs: Vec<String> = mb
                .sequences
                .iter()
                .map(|q| {
                    if q.role == 1 {
                        format!("{}/r", q.doc)
                    } else {
                        q.doc.clone()
                    }
                })
                .collect();
            format!("mb{i} {}t [{}]", mb.tokens, seqs.join(" "))
        })
        .collect();
    mbs.join(" | ")
}

/// One step as a JSON object (one line of `--json`); its fields are those
/// of [`accrue_coordinator::core::manifest::StepManifest`]'s serde form plus `documents`,
/// `rank_microbatches`, `complete` and, with `--detail`, `docs`.
pub fn step_json(s: &StepManifest) -> Value {
    let mut v = json!({
        "step": s.step,
        "generation": s.generation,
        "world_size": s.world_size,
        "lr": s.lr,
        "base_lr": s.base_lr,
        "max_tokens": s.max_tokens,
        "epoch": s.epoch,
        "documents": s.documents,
        "tokens": s.tokens,
        "rank_microbatches": s.rank_microbatches,
        "attempts": s.attempts,
        "replayed": s.replayed,
        "complete": s.complete,
        "ranks": s.ranks.iter().map(|r| {
            r.microbatches.iter().map(|mb| json!({
                "tokens": mb.tokens,
                "seqs": mb.sequences.iter().map(|q| json!([q.doc, q.role, q.tokens])).collect::<Vec<_>>(),
            })).collect::<Vec<_>>()
        }).collect::<Vec<_>>(),
    });
    let o = v.as_object_mut().expect("an object");
    if let Some(n) = s.docs_per_step {
        o.insert("docs_per_step".into(), n.into());
    }
    if let Some(t) = s.tokens_per_step {
        o.insert("tokens_per_step".into(), t.into());
    }
    if let Some(k) = s.microbatches_per_rank {
        o.insert("microbatches_per_rank".into(), k.into());
    }
    if !s.docs.is_empty() {
        o.insert("docs".into(), s.docs.clone().into());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use accrue_coordinator::core::manifest::{check_exactly_once, Expectation};
    use accrue_coordinator::wire::{StepMicrobatch, StepSequence};

    fn seq(doc: &str, role: u32, tokens: u32) -> StepSequence {
        StepSequence {
            doc: doc.into(),
            role,
            tokens,
        }
    }

    fn manifest(step: u64, docs: &[&str]) -> StepManifest {
        StepManifest {
            step,
            generation: 2,
            world_size: 2,
            lr: 1e-4,
            base_lr: 1e-4,
            docs_per_step: Some(docs.len() as u64),
            max_tokens: 128,
            documents: docs.len() as u64,
            tokens: 30,
            rank_microbatches: 1,
            attempts: 2,
            complete: true,
            docs: docs.iter().map(|d| d.to_string()).collect(),
            ranks: vec![
                StepRankLayout {
                    microbatches: vec![StepMicrobatch {
                        tokens: 20,
                        sequences: vec![seq(docs[0], 0, 12), seq(docs[0], 1, 8)],
                    }],
                },
                StepRankLayout {
                    microbatches: vec![StepMicrobatch {
                        tokens: 10,
                        sequences: docs[1..].iter().map(|d| seq(d, 0, 10)).collect(),
                    }],
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn table_has_one_row_per_step_and_detail_lines_per_rank() {
        let steps = [manifest(1, &["0:1", "0:2"]), manifest(2, &["0:3", "0:4"])];
        let t = steps_table(&steps, false);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(lines[0].starts_with("STEP  GEN  WORLD  LR"), "{t}");
        assert!(
            lines[1].starts_with(
                "1     2    2      1.00e-4  2     30      1        2         docs 2  128"
            ),
            "{t}"
        );
        let d = steps_table(&steps[..1], true);
        assert!(d.contains("  rank 0: mb0 20t [0:1 0:1/r]\n"), "{d}");
        assert!(d.contains("  rank 1: mb0 10t [0:2]\n"), "{d}");
        assert_eq!(steps_table(&[], false), "no committed steps\n");
        let old = StepManifest {
            step: 1,
            ..Default::default()
        };
        let t = steps_table(&[old], false);
        assert!(
            t.lines().nth(1).unwrap().ends_with("-         -     -"),
            "{t}"
        );
    }

    #[test]
    fn json_lines_parse_back_into_manifests_for_the_exactly_once_check() {
        let steps = [manifest(1, &["0:1", "0:2"]), manifest(2, &["0:3", "0:2"])];
        let parsed: Vec<accrue_coordinator::core::manifest::StepManifest> = steps
            .iter()
            .map(|s| serde_json::from_str(&step_json(s).to_string()).unwrap())
            .collect();
        assert_eq!(parsed[0].settings.docs_per_step(), Some(2));
        assert_eq!(parsed[0].attempts, 2);
        assert_eq!(parsed[0].ranks[0][0].seqs[1].1, 1, "role of the rejected");
        let offenders = check_exactly_once(
            &parsed,
            1,
            &Expectation {
                complete_epochs: 1,
                ..Default::default()
            },
        );
        let v = serde_json::to_value(&offenders).unwrap();
        assert_eq!(
            v,
            json!([{"kind": "document", "doc": "0:2", "times": 2, "expected": 1}])
        );
    }
}

//! `accrue quarantine JOB`: the documents a job trains without (non-finite
//! steps bisected down to them), and releasing them back to its stream.

use std::process::ExitCode;

use anyhow::Context as _;
use serde_json::json;

use super::client::{connect, rpc_error};
use super::output::{out, outln};
use crate::args::Conn;
use accrue_coordinator::wire::{
    ListQuarantineRequest, QuarantinedDocument, ReleaseQuarantineRequest,
};

/// What `accrue quarantine` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    List,
    /// Release these ids (`file:line`).
    Release(Vec<String>),
    ReleaseAll,
}

pub async fn run(
    conn: &Conn,
    job_id: &str,
    action: Action,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut c = connect(conn).await?;
    let (docs, verb) = match action {
        Action::List => {
            let r = c
                .list_quarantine(ListQuarantineRequest {
                    job_id: job_id.into(),
                })
                .await
                .map_err(|s| rpc_error(&s, &conn.coordinator))
                .with_context(|| format!("list the quarantine of job {job_id}"))?;
            (r.into_inner().documents, None)
        }
        Action::Release(ids) => (
            release(&mut c, conn, job_id, ids, false).await?,
            Some("released"),
        ),
        Action::ReleaseAll => (
            release(&mut c, conn, job_id, Vec::new(), true).await?,
            Some("released"),
        ),
    };
    if json {
        let rows: Vec<_> = docs.iter().map(doc_json).collect();
        outln!("{}", serde_json::to_string_pretty(&rows)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    match verb {
        Some(v) => outln!("{v} {} document(s)", docs.len())?,
        None if docs.is_empty() => outln!("job {job_id}: no quarantined documents")?,
        None => {}
    }
    out!("{}", table(&docs))?;
    Ok(ExitCode::SUCCESS)
}

async fn release(
    c: &mut super::client::AdminConn,
    conn: &Conn,
    job_id: &str,
    doc_ids: Vec<String>,
    all: bool,
) -> anyhow::Result<Vec<QuarantinedDocument>> {
    let r = c
        .release_quarantine(ReleaseQuarantineRequest {
            job_id: job_id.into(),
            doc_ids,
            all,
        })
        .await
        .map_err(|s| rpc_error(&s, &conn.coordinator))
        .with_context(|| format!("release quarantined documents of job {job_id}"))?;
    Ok(r.into_inner().released)
}

fn doc_json(d: &QuarantinedDocument) -> serde_json::Value {
    json!({
        "doc_id": d.doc_id,
        "source": d.source,
        "step": d.step,
        "detail": d.detail,
        "unix_ms": d.unix_ms,
    })
}

/// One row per document: id, where it came from, the step it broke, why.
pub fn table(docs: &[QuarantinedDocument]) -> String {
    if docs.is_empty() {
        return String::new();
    }
    let width = docs
        .iter()
        .map(|d| d.source.len())
        .max()
        .unwrap_or(0)
        .max(6);
    let mut out = format!("{:<10} {:<width$} {:>6}  DETAIL\n", "DOC", "SOURCE", "STEP");
    for d in docs {
        out += &format!(
            "{:<10} {:<width$} {:>6}  {}\n",
            d.doc_id, d.source, d.step, d.detail
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_each_document_and_its_source() {
        let d = QuarantinedDocument {
            doc_id: "0:13".into(),
            source: "data/train.jsonl:13".into(),
            step: 2,
            detail: "worker w1: non-finite loss NaN".into(),
            unix_ms: 5,
        };
        let t = table(&[d]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("DOC"));
        assert!(lines[1].contains("0:13") && lines[1].contains("data/train.jsonl:13"));
        assert!(lines[1].contains("non-finite loss NaN"));
        assert_eq!(table(&[]), "");
    }
}

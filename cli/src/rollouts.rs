//! `accrue rollouts push JOB FILE.jsonl`: streams a rollouts file to a
//! streamed job through `Rollouts.PushRollouts`, `--batch` rollouts per
//! message, and prints the coordinator's counts. Rows are read with the
//! data stream's reader and sent as they are (ids or text); the coordinator
//! tokenizes text with the job's tokenizer and checks every row the way it
//! checks rollout files, so errors name the message and rollout, which this
//! command maps back to `FILE:line`.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context};
use serde_json::{Map, Value as Json};

use super::client::rpc_error;
use super::output::out;
use crate::args::Conn;
use accrue_coordinator::stream::data::read;
use accrue_coordinator::wire;
use accrue_coordinator::wire::rollouts_client::RolloutsClient;

/// One row as the wire rollout; the error names the field.
pub fn wire_rollout(row: &Json) -> Result<wire::StreamedRollout, String> {
    let obj = row
        .as_object()
        .ok_or_else(|| "a rollout row must be a JSON object".to_string())?;
    let ids = |field: &str| -> Result<Vec<u32>, String> {
        match obj.get(field) {
            None | Some(Json::Null) => Ok(Vec::new()),
            Some(Json::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| format!("\"{field}\" must be a list of token ids")),
            Some(_) => Err(format!("\"{field}\" must be a list of token ids")),
        }
    };
    let text = |field: &str| -> Result<String, String> {
        match obj.get(field) {
            None | Some(Json::Null) => Ok(String::new()),
            Some(Json::String(s)) => Ok(s.clone()),
            Some(_) => Err(format!(
                "\"{field}\" must be a string here (chat-message prompts are not streamed; send prompt_ids)"
            )),
        }
    };
    let reward = match obj.get("reward") {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| format!("\"reward\" must be a number, got {v}"))?,
        None => return Err("\"reward\" is missing".into()),
    };
    let group = match obj.get("group") {
        None | Some(Json::Null) => String::new(),
        Some(Json::String(s)) => s.clone(),
        Some(Json::Number(n)) => n.to_string(),
        Some(_) => return Err("\"group\" must be a string or a number".into()),
    };
    let policy_version = match obj.get("policy_version") {
        None | Some(Json::Null) => 0,
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("\"policy_version\" must be a non-negative integer, got {v}"))?,
    };
    let old_logprobs = match obj.get("old_logprobs") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Array(a)) => a
            .iter()
            .map(|v| v.as_f64().map(|x| x as f32))
            .collect::<Option<Vec<f32>>>()
            .ok_or_else(|| "\"old_logprobs\" must be a list of numbers".to_string())?,
        Some(_) => return Err("\"old_logprobs\" must be a list of numbers".into()),
    };
    Ok(wire::StreamedRollout {
        prompt_ids: ids("prompt_ids")?,
        prompt: text("prompt")?,
        completion_ids: ids("completion_ids")?,
        completion: text("completion")?,
        reward,
        group,
        policy_version,
        old_logprobs,
    })
}

/// The file's rows as wire rollouts with their 1-based lines.
pub fn read_file(path: &Path) -> anyhow::Result<Vec<(u64, wire::StreamedRollout)>> {
    let rows = read::read_rows(path).with_context(|| format!("reading {}", path.display()))?;
    rows.iter()
        .map(|row| {
            let value = row
                .value
                .as_ref()
                .map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), row.line))?;
            let r = wire_rollout(value)
                .map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), row.line))?;
            Ok((row.line, r))
        })
        .collect()
}

/// Splits rows into request messages of at most `batch` rollouts; the first
/// names the job.
pub fn messages(
    job: &str,
    rows: &[(u64, wire::StreamedRollout)],
    batch: usize,
) -> Vec<wire::PushRolloutsRequest> {
    let mut out: Vec<wire::PushRolloutsRequest> = rows
        .chunks(batch.max(1))
        .map(|c| wire::PushRolloutsRequest {
            job_id: String::new(),
            rollouts: c.iter().map(|(_, r)| r.clone()).collect(),
        })
        .collect();
    if out.is_empty() {
        out.push(wire::PushRolloutsRequest::default());
    }
    out[0].job_id = job.to_string();
    out
}

/// Rewrites `messages[i].rollouts[j]` in a coordinator error as the file
/// line it came from.
fn locate(msg: &str, path: &Path, rows: &[(u64, wire::StreamedRollout)], batch: usize) -> String {
    let parse = || -> Option<(usize, usize, &str)> {
        let rest = msg.strip_prefix("messages[")?;
        let (i, rest) = rest.split_once("].rollouts[")?;
        let (j, rest) = rest.split_once(']')?;
        Some((i.parse().ok()?, j.parse().ok()?, rest))
    };
    match parse().and_then(|(i, j, rest)| Some((rows.get(i * batch.max(1) + j)?.0, rest))) {
        Some((line, rest)) => format!("{}:{line}{rest}", path.display()),
        None => msg.to_string(),
    }
}

/// `accrue rollouts push`.
pub async fn push(conn: &Conn, job: &str, file: &Path, batch: usize) -> anyhow::Result<ExitCode> {
    if batch == 0 {
        bail!("--batch must be at least 1");
    }
    let rows = read_file(file)?;
    let messages = messages(job, &rows, batch);
    for (i, m) in messages.iter().enumerate() {
        let first = rows.get(i * batch).map_or(0, |r| r.0);
        let what = format!(
            "message {i} ({} rollouts from {}:{first}; --batch {batch})",
            m.rollouts.len(),
            file.display()
        );
        super::client::check_request_size(conn, &what, prost::Message::encoded_len(m))?;
    }
    let (channel, auth) = super::client::channel(conn).await?;
    let max = conn.max_message_mb << 20;
    let mut client = RolloutsClient::with_interceptor(channel, auth)
        .max_decoding_message_size(max)
        .max_encoding_message_size(max);
    let reply = client
        .push_rollouts(tokio_stream::iter(messages))
        .await
        .map_err(|s| {
            let s = tonic::Status::new(s.code(), locate(s.message(), file, &rows, batch));
            rpc_error(&s, &conn.coordinator)
        })?
        .into_inner();
    out!("{}", render(&reply))?;
    Ok(ExitCode::SUCCESS)
}

/// The counts, one per line.
pub fn render(r: &wire::PushRolloutsResponse) -> String {
    let mut m = Map::new();
    for (k, v) in [
        ("messages", r.messages),
        ("accepted", r.accepted),
        ("rejected_stale", r.rejected_stale),
        ("zero_variance_dropped", r.zero_variance_dropped),
        ("zero_variance_groups", r.zero_variance_groups),
        ("invalid", r.invalid),
        ("queued", r.queued),
    ] {
        m.insert(k.into(), v.into());
    }
    m.iter().map(|(k, v)| format!("{k:<22} {v}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rows_become_wire_rollouts_and_messages() {
        let r = wire_rollout(
            &json!({"prompt": "1+1=", "completion_ids": [5, 2], "reward": 1,
            "group": 7, "policy_version": 2, "old_logprobs": [-0.5, -1.0]}),
        )
        .unwrap();
        assert_eq!((r.prompt.as_str(), r.group.as_str()), ("1+1=", "7"));
        assert_eq!((r.completion_ids, r.policy_version), (vec![5, 2], 2));
        let e = wire_rollout(&json!({"prompt": [{"role": "user", "content": "x"}],
            "completion": "y", "reward": 0}))
        .unwrap_err();
        assert!(e.starts_with("\"prompt\" must be a string"), "{e}");
        assert!(wire_rollout(&json!({"prompt": "a", "completion": "b"}))
            .unwrap_err()
            .contains("reward"));

        let rows: Vec<(u64, wire::StreamedRollout)> = (1..=5)
            .map(|l| (l * 2, wire::StreamedRollout::default()))
            .collect();
        let m = messages("j", &rows, 2);
        assert_eq!(
            m.iter().map(|m| m.rollouts.len()).collect::<Vec<_>>(),
            [2, 2, 1]
        );
        assert_eq!((m[0].job_id.as_str(), m[1].job_id.as_str()), ("j", ""));
        let msg = "messages[1].rollouts[1]: \"reward\" must be a finite number";
        assert_eq!(
            locate(msg, Path::new("r.jsonl"), &rows, 2),
            "r.jsonl:8: \"reward\" must be a finite number"
        );
    }
}

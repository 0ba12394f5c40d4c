//! Who owns an output directory (issue 33, finding 8): directories are
//! compared by where they really are, not by how a spec spells them, and
//! a second coordinator on the same volume leaves a live job's directory
//! alone.

mod common;

use std::path::Path;

use accrue_coordinator::wire;
use common::start;
use tonic::Code;

type Admin = wire::admin_client::AdminClient<tonic::transport::Channel>;

const SPEC: &str = r#"
[job]
name = "first"
steps = 2
output_dir = "runs/a"
[model]
init = "random"
config = "tiny.json"
[data]
train = ["train.jsonl"]
format = "sft"
[batch]
docs_per_step = 4
"#;

/// The fixture's spec with another job name and output_dir.
fn spec(name: &str, out: &str) -> String {
    SPEC.replace("name = \"first\"", &format!("name = \"{name}\""))
        .replace(
            "output_dir = \"runs/a\"",
            &format!("output_dir = \"{out}\""),
        )
}

async fn submit(admin: &mut Admin, base: &Path, spec: String) -> Result<String, tonic::Status> {
    admin
        .submit_job(wire::SubmitJobRequest {
            spec_toml: spec,
            base_dir: base.display().to_string(),
            new_job: false,
        })
        .await
        .map(|r| r.into_inner().job_id)
}

/// While `runs/a` is live, an output_dir that is the same directory under
/// another spelling (`..`, a link), lies inside it or contains it is
/// refused naming the live job and both directories; a sibling whose name
/// only starts the same is not.
#[tokio::test]
async fn an_output_dir_inside_containing_or_linked_to_a_live_jobs_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    common::write_sft_fixture(d, 8, |_| "x".to_string());
    let s = start(&d.join("state")).await;
    let mut admin = Admin::connect(s.url.clone()).await.unwrap();
    let first = submit(&mut admin, d, spec("first", "runs/a"))
        .await
        .unwrap();
    std::fs::create_dir_all(d.join("runs/x")).unwrap();
    std::os::unix::fs::symlink(d.join("runs/a"), d.join("link")).unwrap();
    for (i, out) in [
        "runs/a/checkpoints",
        "runs/x/../a",
        "runs/missing/../a",
        "link",
        "link/sub",
        "runs",
    ]
    .into_iter()
    .enumerate()
    {
        let err = submit(&mut admin, d, spec(&format!("n{i}"), out))
            .await
            .unwrap_err();
        let msg = err.message();
        assert_eq!(err.code(), Code::FailedPrecondition, "{out}: {msg}");
        assert!(
            msg.contains(&first) && msg.contains("first"),
            "{out}: {msg}"
        );
        let (asked, held) = (d.join(out), d.join("runs/a"));
        assert!(
            msg.contains(&asked.display().to_string()) && msg.contains(&held.display().to_string()),
            "{out}: {msg}"
        );
    }
    assert!(!d.join("link/sub").exists(), "a refusal creates nothing");
    submit(&mut admin, d, spec("sibling", "runs/ab"))
        .await
        .unwrap();
    s.stop.cancel();
}

/// A second coordinator (its own state dir) on the same volume refuses a
/// directory whose marker a live coordinator keeps fresh, or one inside
/// it, naming the job and that coordinator's state dir; a marker nobody
/// refreshed for long is taken over; and a job the first coordinator
/// ended frees its directory at once.
#[tokio::test]
async fn another_coordinators_live_output_dir_is_refused_and_a_stale_one_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    common::write_sft_fixture(d, 8, |_| "x".to_string());
    let one = start(&d.join("state-one")).await;
    let two = start(&d.join("state-two")).await;
    let mut admin1 = Admin::connect(one.url.clone()).await.unwrap();
    let mut admin2 = Admin::connect(two.url.clone()).await.unwrap();
    let first = submit(&mut admin1, d, spec("first", "runs/a"))
        .await
        .unwrap();
    for out in ["runs/a", "runs/a/inner"] {
        let err = submit(&mut admin2, d, spec("second", out))
            .await
            .unwrap_err();
        let msg = err.message();
        assert_eq!(err.code(), Code::FailedPrecondition, "{out}: {msg}");
        assert!(
            msg.contains(&first) && msg.contains(&d.join("state-one").display().to_string()),
            "{out}: {msg}"
        );
    }

    // The first coordinator's job ends: its marker says so, and the
    // directory is free to the second at once.
    admin1
        .cancel_job(wire::CancelJobRequest {
            job_id: first.clone(),
        })
        .await
        .unwrap();
    let second = submit(&mut admin2, d, spec("second", "runs/a"))
        .await
        .unwrap();
    let marker = d.join("runs/a/.accrue-job.json");
    let text = std::fs::read_to_string(&marker).unwrap();
    assert!(text.contains(&second), "{text}");

    // A marker whose coordinator stopped refreshing it long ago (a
    // coordinator that died) is taken over.
    let mut stale: serde_json::Value = serde_json::from_str(&text).unwrap();
    stale["alive_unix_ms"] = serde_json::json!(1);
    std::fs::create_dir_all(d.join("runs/b")).unwrap();
    std::fs::write(
        d.join("runs/b/.accrue-job.json"),
        serde_json::to_vec(&stale).unwrap(),
    )
    .unwrap();
    let third = submit(&mut admin1, d, spec("third", "runs/b"))
        .await
        .unwrap();
    let text = std::fs::read_to_string(d.join("runs/b/.accrue-job.json")).unwrap();
    assert!(text.contains(&third), "{text}");
    one.stop.cancel();
    two.stop.cancel();
}

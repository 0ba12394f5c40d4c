//! Scoring a generated round: decode, cut at stop strings, verify, build
//! rollouts aligned with their sampling log-probs.

use super::*;
use crate::rl::rounds::{GenCompletion, GroupToScore, RoundKind};

fn spec(dir: &Path, verifier: &str) -> JobSpec {
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"1+2=\", \"completion\": \"3\"}\n{\"question\": \"How many?\", \"answer\": \"so 2+2=4\\n#### 4\"}\n",
    )
    .unwrap();
    let text = format!(
        r#"
[job]
name = "t"
output_dir = "/tmp/accrue-loop-test"
steps = 1
[model]
init = "random"
config = "/dev/null"
[data]
train = ["{}"]
format = "prompts"
source = "generate"
[batch]
docs_per_step = 2
[objective]
kind = "pg"
[rl]
group_size = 2
[rl.sampling]
stop = ["\n"]
[rl.verifier]
{verifier}
"#,
        prompts.display()
    );
    toml::from_str(&text).unwrap()
}

fn completion(prompt: DocId, sample: u32, text: &str) -> GenCompletion {
    let mut token_ids: Vec<u32> = text.bytes().map(u32::from).collect();
    token_ids.push(257); // the byte tokenizer's EOS
    GenCompletion {
        routing: Default::default(),
        trace: None,
        prompt,
        sample,
        logprobs: (0..token_ids.len()).map(|i| -(i as f32) - 1.0).collect(),
        token_ids,
        finish: Finish::Stop,
    }
}

#[test]
fn a_round_is_decoded_cut_verified_and_aligned() {
    let d = tempfile::tempdir().unwrap();
    let s = Scorer::load(&spec(d.path(), "kind = \"exact\""), 300, None).unwrap();
    let inputs = s.inputs();
    assert_eq!(inputs.prompts.len(), 2);
    assert_eq!(inputs.stop_sequences, vec![vec![u32::from(b'\n')]]);
    assert_eq!(inputs.stop_ids, vec![257]);
    let p1 = DocId { file: 0, line: 1 };
    let round = RoundToScore {
        job: "j".into(),
        round: 7,
        kind: RoundKind::Train,
        policy_version: 3,
        groups: vec![GroupToScore {
            position: 12,
            prompt: p1,
            completions: vec![completion(p1, 0, "3\nignored"), completion(p1, 1, "4")],
        }],
        seconds: 2.0,
    };
    let (rollouts, stats) = s.score(&round).unwrap();
    assert_eq!(rollouts.len(), 2);
    assert_eq!((rollouts[0].reward, rollouts[1].reward), (1.0, 0.0));
    assert_eq!(rollouts[0].group, "0:1@12");
    assert_eq!(rollouts[0].policy_version, 3);
    let prompt_len = inputs.prompts.prompts[0].ids.len();
    let seq = &rollouts[0].seq;
    assert_eq!(seq.len(), prompt_len + 10);
    assert_eq!(seq.loss_tokens(), 10, "the completion, EOS included");
    let old = rollouts[0].old_logprobs.as_ref().unwrap();
    assert_eq!(old.len(), seq.len());
    assert_eq!(old[prompt_len], -1.0, "aligned with input_ids");
    assert_eq!((stats.completions, stats.correct, stats.judged), (2, 1, 2));
    assert_eq!(stats.completion_tokens, 12);
    assert_eq!(stats.gen_seconds, 2.0);
}

#[test]
fn gsm8k_rows_score_by_their_final_number_and_unknown_prompts_are_named() {
    let d = tempfile::tempdir().unwrap();
    let s = Scorer::load(&spec(d.path(), "kind = \"gsm8k\""), 300, None).unwrap();
    let p2 = DocId { file: 0, line: 2 };
    let mut round = RoundToScore {
        job: "j".into(),
        round: 1,
        kind: RoundKind::Train,
        policy_version: 0,
        groups: vec![GroupToScore {
            position: 0,
            prompt: p2,
            completions: vec![completion(p2, 0, "It is 4."), completion(p2, 1, "5")],
        }],
        seconds: 1.0,
    };
    let (r, _) = s.score(&round).unwrap();
    assert_eq!((r[0].reward, r[1].reward), (1.0, 0.0));
    round.groups[0].prompt = DocId { file: 0, line: 9 };
    let e = s.score(&round).unwrap_err().to_string();
    assert!(
        e.contains("round 1: prompt 0:9: not a prompt of this job"),
        "{e}"
    );
}

#[test]
fn a_failing_command_verifier_is_named_by_rollout_never_by_its_output() {
    let d = tempfile::tempdir().unwrap();
    let prog = d.path().join("v.sh");
    std::fs::write(
        &prog,
        "#!/bin/sh\ncat >/dev/null\necho 'MARKER-33-7 traceback' >&2\necho 1\necho 'MARKER-33-7'\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
    let verifier = format!("kind = \"command\"\ncommand = [\"{}\"]", prog.display());
    let s = Scorer::load(&spec(d.path(), &verifier), 300, None).unwrap();
    let p1 = DocId { file: 0, line: 1 };
    let round = RoundToScore {
        job: "j".into(),
        round: 7,
        kind: RoundKind::Train,
        policy_version: 3,
        groups: vec![GroupToScore {
            position: 12,
            prompt: p1,
            completions: vec![completion(p1, 0, "3"), completion(p1, 1, "4")],
        }],
        seconds: 2.0,
    };
    // What a failed round's reason (shown on the status page) says.
    let e = s.score(&round).unwrap_err().to_string();
    assert!(!e.contains("MARKER"), "{e}");
    assert!(
        e.starts_with("round 7: rollout 0:1@12 sample 1: verifier command"),
        "{e}"
    );
    assert!(e.contains("stdout line 2: not JSON"), "{e}");
}

#[test]
fn generating_specs_are_validated_field_by_field() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(
        d.path().join("p.jsonl"),
        "{\"prompt\": \"a\", \"answer\": \"b\"}\n",
    )
    .unwrap();
    std::fs::write(d.path().join("c.json"), "{}").unwrap();
    let fields = |data: &str, rl: &str| -> Vec<String> {
        let text = format!(
            "[job]\nname = \"g\"\noutput_dir = \"o\"\nsteps = 2\n[model]\ninit = \"random\"\n\
             config = \"c.json\"\n[data]\n{data}\n[batch]\ndocs_per_step = 4\n\
             [objective]\nkind = \"pg\"\n[rl]\n{rl}\n"
        );
        match JobSpec::parse(&text, d.path()) {
            Ok(_) => Vec::new(),
            Err(problems) => problems.into_iter().map(|p| p.field).collect(),
        }
    };
    let data = "source = \"generate\"\nformat = \"prompts\"\ntrain = [\"p.jsonl\"]";
    let ok = "group_size = 2\n[rl.verifier]\nkind = \"exact\"";
    assert!(fields(data, ok).is_empty(), "{:?}", fields(data, ok));
    assert_eq!(fields(data, "group_size = 2"), ["rl.verifier"]);
    assert_eq!(
        fields(
            data,
            &format!("{ok}\n[rl.sampling]\ntemperature = -1.0\ntop_p = 0.0")
        ),
        ["rl.sampling.temperature", "rl.sampling.top_p"]
    );
    assert_eq!(
        fields(data, &format!("eval_prompts = [\"missing.jsonl\"]\n{ok}")),
        ["rl.eval_prompts[0]"]
    );
    let wrong_format = data.replace("\"prompts\"", "\"rollouts\"");
    assert!(fields(&wrong_format, ok).contains(&"data.format".to_string()));
    // Loop settings on a job that reads rollout files are refused.
    let files = "format = \"rollouts\"\ntrain = [\"p.jsonl\"]";
    assert_eq!(
        fields(files, "[rl.verifier]\nkind = \"exact\""),
        ["rl.verifier"]
    );
    // An engine: its fields, and publication the staleness bound can wait for.
    let engine = "[rl.engine]\nurl = \"http://e:8000\"\nmodel = \"m\"\nreload = \"vllm\"";
    let with =
        |rl: &str| format!("group_size = 2\n{rl}\n[rl.verifier]\nkind = \"exact\"\n{engine}");
    assert!(fields(data, &with("publish_every = 2\nmax_staleness = 1")).is_empty());
    assert_eq!(fields(data, &with("")), ["rl.publish_every"]);
    assert_eq!(
        fields(data, &with("publish_every = 3\nmax_staleness = 1")),
        ["rl.publish_every"]
    );
    assert_eq!(
        fields(
            data,
            &with("publish_every = 1").replace("http://e:8000", "e:8000")
        ),
        ["rl.engine.url"]
    );
    assert_eq!(
        fields(files, &format!("[rl.verifier]\nkind = \"exact\"\n{engine}")),
        ["rl.publish_every", "rl.verifier", "rl.engine"]
    );
    // Generator workers: at least one, not with an engine, at least one
    // worker left to train, and syncs the staleness bound can wait for.
    let apart = |rl: &str| format!("group_size = 2\n{rl}\n[rl.verifier]\nkind = \"exact\"");
    assert!(fields(data, &apart("generators = 2")).is_empty());
    assert!(fields(
        data,
        &apart("generators = 1\npublish_every = 2\nmax_staleness = 1")
    )
    .is_empty());
    assert_eq!(fields(data, &apart("generators = 0")), ["rl.generators"]);
    assert_eq!(
        fields(
            data,
            &apart("generators = 1\npublish_every = 3\nmax_staleness = 1")
        ),
        ["rl.publish_every"]
    );
    assert_eq!(
        fields(
            data,
            &apart("generators = 1\nmax_staleness = 0\npublish_every = 2")
        ),
        ["rl.publish_every"]
    );
    assert_eq!(
        fields(
            data,
            &format!("{}\n{engine}", apart("generators = 1\npublish_every = 1"))
        ),
        ["rl.generators"]
    );
    // parallel.max_workers defaults to 8: 8 generators leave none to train.
    assert_eq!(fields(data, &apart("generators = 8")), ["rl.generators"]);
    assert_eq!(fields(files, "generators = 1"), ["rl.generators"]);
}

//! Scoring a generated round: decode, cut at stop strings, verify, build
//! rollouts aligned with their sampling log-probs.

use super::*;
use crate::rl::episode::{EpisodesToStep, TurnToStep};
use crate::rl::generation::GenCompletion;
use crate::rl::generation::{Span, Trace};
use crate::rl::rounds::{GroupToScore, RoundKind};

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

fn env_spec(dir: &Path, env: &str) -> JobSpec {
    let mut s = spec(dir, "kind = \"exact\"");
    s.rl.env = Some(toml::from_str(env).unwrap());
    s
}

fn turn(prompt: DocId, sample: u32, text: &str, turns: u32, episode: u32) -> TurnToStep {
    let mut ids: Vec<u32> = text.bytes().map(u32::from).collect();
    ids.push(257);
    TurnToStep {
        prompt,
        sample,
        episode: format!("r1-{prompt}-{sample}"),
        turn: ids,
        turns,
        episode_tokens: episode,
    }
}

/// Issue 36: a turn with a calculator call gets its result as the next
/// environment turn (Hermes tags, the byte tokenizer having no chat
/// template); a turn without one ends the episode; the turn and episode
/// limits end it as truncated; garbage in a call is answered, not fatal.
#[test]
fn the_tools_environment_answers_calls_and_ends_episodes() {
    let d = tempfile::tempdir().unwrap();
    let s = Scorer::load(
        &env_spec(d.path(), "max_turns = 2\nmax_episode_tokens = 200"),
        300,
        None,
    )
    .unwrap();
    assert!(s.inputs().episodes);
    let p = DocId { file: 0, line: 1 };
    let call =
        r#"<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>"#;
    let step = EpisodesToStep {
        job: "j".into(),
        round: 4,
        episodes: vec![
            turn(p, 0, call, 1, 80),
            turn(p, 1, "391", 2, 90),
            turn(p, 2, call, 2, 80),
            turn(p, 3, call, 1, 180),
            turn(p, 4, "<tool_call>{\"name\": \"calc\"}</tool_call>", 1, 40),
        ],
    };
    let r = s.step(&step).unwrap();
    let text = |t: &[u32]| String::from_utf8(t.iter().map(|&b| b as u8).collect()).unwrap();
    assert_eq!(text(&r[0].tokens), "<tool_response>391</tool_response>");
    assert_eq!((r[0].tool_calls, r[0].done), (1, None));
    assert_eq!((r[1].tool_calls, r[1].done), (0, Some(Finish::Stop)));
    assert_eq!(r[2].done, Some(Finish::Length), "max_turns");
    assert_eq!(r[3].done, Some(Finish::Length), "max_episode_tokens");
    assert_eq!(
        text(&r[4].tokens),
        "<tool_response>error: no tool named \"calc\" (tools: calculator)</tool_response>"
    );
    let no_env = Scorer::load(&spec(d.path(), "kind = \"exact\""), 300, None).unwrap();
    let e = no_env.step(&step).unwrap_err().to_string();
    assert!(e.contains("round 4") && e.contains("no [rl.env]"), "{e}");
}

/// An episode is scored on its last policy turn and trained on its policy
/// turns only: the environment's tokens carry no loss.
#[test]
fn an_episode_trains_on_policy_tokens_and_is_judged_on_its_answer() {
    let d = tempfile::tempdir().unwrap();
    let s = Scorer::load(&env_spec(d.path(), ""), 300, None).unwrap();
    let p1 = DocId { file: 0, line: 1 };
    let mut c = completion(p1, 0, "CALL");
    let env: Vec<u32> = b"<r>3</r>".iter().map(|&b| u32::from(b)).collect();
    let answer = completion(p1, 0, "3");
    c.token_ids.extend(&env);
    c.logprobs.extend(vec![0.0; env.len()]);
    c.token_ids.extend(&answer.token_ids);
    c.logprobs.extend(&answer.logprobs);
    c.trace = Some(Box::new(Trace {
        spans: vec![
            Span {
                policy: true,
                len: 5,
            },
            Span {
                policy: false,
                len: env.len() as u32,
            },
            Span {
                policy: true,
                len: 2,
            },
        ],
        answer_from: 5 + env.len(),
        turns: 2,
        tool_calls: 1,
        score: None,
    }));
    let round = RoundToScore {
        job: "j".into(),
        round: 9,
        kind: RoundKind::Train,
        policy_version: 2,
        groups: vec![GroupToScore {
            position: 0,
            prompt: p1,
            completions: vec![c.clone()],
        }],
        seconds: 1.0,
    };
    let (rollouts, stats) = s.score(&round).unwrap();
    assert_eq!(rollouts[0].reward, 1.0, "the answer turn \"3\" is right");
    let seq = &rollouts[0].seq;
    let n = s.inputs().prompts.prompts[0].ids.len();
    assert_eq!(seq.len(), n + c.token_ids.len());
    assert_eq!(
        seq.loss_tokens(),
        7,
        "5 + 2 policy tokens, no environment token"
    );
    let mask: Vec<bool> = seq.labels().iter().map(|&l| l != IGNORE_INDEX).collect();
    assert!(mask[n..n + 5].iter().all(|&m| m));
    assert!(mask[n + 5..n + 5 + env.len()].iter().all(|&m| !m));
    assert!(mask[n + 5 + env.len()..].iter().all(|&m| m));
    assert_eq!(stats.completion_tokens, 7);
    assert_eq!((stats.episodes, stats.turns, stats.tool_calls), (1, 2, 1));
    assert_eq!(stats.env_tokens, env.len() as u64);
    let m = stats.metrics();
    assert_eq!(m["rl/tool_calls_per_episode"], 1.0);
    assert_eq!(m["rl/turns_mean"], 2.0);
}

/// With a chat template the tool results are the template's `tool` turn
/// after the assistant's, with the generation prompt, less the end of
/// turn the policy sampled.
#[test]
fn tool_results_are_rendered_by_the_chat_template() {
    let Some(data) = crate::stream::data::tests::shared_data() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let tokdir = d.path().join("tok");
    std::fs::create_dir_all(&tokdir).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(data.join("tokenizers/phi-3-mini").join(f), tokdir.join(f)).unwrap();
    }
    std::fs::write(
        tokdir.join("chat_template.jinja"),
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}",
    )
    .unwrap();
    let mut sp = env_spec(d.path(), "");
    sp.data.tokenizer = tokdir.join("tokenizer.json").display().to_string();
    let chat = d.path().join("chat.jsonl");
    std::fs::write(
        &chat,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"2*21?\"}], \"reference\": \"42\"}\n",
    )
    .unwrap();
    sp.data.train = vec![chat];
    let s = Scorer::load(&sp, 32064, None).unwrap();
    let eos = s.enc.eos_id;
    let call =
        r#"<tool_call>{"name": "calculator", "arguments": {"expression": "2*21"}}</tool_call>"#;
    let mut ids = s.enc.tok.ids(call, false).unwrap();
    let step = |ids: &[u32]| {
        s.step(&EpisodesToStep {
            job: "j".into(),
            round: 1,
            episodes: vec![TurnToStep {
                prompt: DocId { file: 0, line: 1 },
                sample: 0,
                episode: "r1-0:1-0".into(),
                turn: ids.to_vec(),
                turns: 1,
                episode_tokens: 30,
            }],
        })
        .unwrap()
        .remove(0)
    };
    let cut = step(&ids);
    ids.push(eos);
    let ended = step(&ids);
    let eos_text = s.enc.template.eos_token.clone();
    assert_eq!(
        s.enc.tok.decode_all(&ended.tokens).unwrap(),
        format!("\n[tool] 42{eos_text}\n[assistant] "),
        "the policy sampled the end of its turn"
    );
    assert_eq!(
        s.enc.tok.decode_all(&cut.tokens).unwrap(),
        format!("{eos_text}\n[tool] 42{eos_text}\n[assistant] "),
        "the turn was cut before its end: the environment closes it"
    );
}

use serde_json::json;

use super::*;
use crate::rl::generation::GenCompletion;
use crate::stream::doc::DocId;

/// The byte tokenizer with a template that renders tools and tool
/// messages (`<|role|>content\n`, the assistant's turn ended by EOS).
fn endpoint(max_tokens: u32, max_open: u32) -> (Endpoint, tempfile::TempDir) {
    let d = tempfile::tempdir().unwrap();
    let t = d.path().join("t.jinja");
    std::fs::write(
        &t,
        "{% if tools %}[tools]{% for x in tools %} {{ x.function.name }}{% endfor %}{{ '\n' }}{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
    )
    .unwrap();
    let data: crate::job::data::DataSection = toml::from_str(&format!(
        "source = \"stream\"\nformat = \"rollouts\"\nchat_template = \"{}\"",
        t.display()
    ))
    .unwrap();
    let enc = crate::stream::data::encoder(&data, 320).unwrap();
    let defaults = SamplingSection {
        max_new_tokens: 16,
        ..Default::default()
    };
    (Endpoint::new(enc, defaults, max_tokens, max_open), d)
}

fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

/// A completion of `text` (then EOS when `ended`), each token's log-prob
/// -0.25, drawn by policy `version`.
fn served(text: &str, ended: bool, version: u64) -> Served {
    let mut token_ids = bytes(text);
    if ended {
        token_ids.push(257);
    }
    Served {
        id: 1,
        completion: GenCompletion {
            prompt: DocId { file: 0, line: 0 },
            sample: 0,
            logprobs: vec![-0.25; token_ids.len()],
            token_ids,
            finish: if ended { Finish::Stop } else { Finish::Length },
            routing: Vec::new(),
            trace: None,
        },
        policy_version: version,
    }
}

fn tools() -> Json {
    json!([{"type": "function", "function": {"name": "calculator"}}])
}

/// Two calls of one episode, the second echoing the first's reply (as a
/// client returns it) and a tool's result: one sequence, the tool message
/// rendered after the reply's own EOS, loss on the sampled tokens only,
/// each with its log-prob, the older policy's version.
#[test]
fn an_episodes_calls_stitch_into_one_sequence_trained_on_the_replies_only() {
    let (e, _d) = endpoint(4096, 8);
    let user = json!({"role": "user", "content": "12*34?"});
    let t1 = e
        .begin(
            &json!({"messages": [user], "tools": tools(), "logprobs": true}),
            Some("ep".into()),
        )
        .unwrap();
    let p1 = "[tools] calculator\n<|user|>12*34?\n<|assistant|>";
    assert_eq!(t1.prompt_ids, bytes(p1));
    assert_eq!((t1.turn, t1.sampling.max_new_tokens), (1, 16));
    let reply = "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12*34\"}}</tool_call>";
    let r1 = e.finish(t1, &served(reply, true, 3), 0).unwrap();
    let msg = &r1["choices"][0]["message"];
    assert_eq!(r1["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(msg["content"], Json::Null);
    assert_eq!(msg["tool_calls"][0]["function"]["name"], "calculator");
    assert_eq!(
        r1["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .len(),
        reply.len() + 1
    );
    assert!(
        r1["choices"][0].get("token_ids").is_none(),
        "only when asked"
    );
    // The client echoes the reply (arguments as a string) and the result.
    let mut echoed = msg.clone();
    echoed["refusal"] = Json::Null;
    let tool = json!({"role": "tool", "tool_call_id": "call_x", "content": "408"});
    let body =
        json!({"messages": [user, echoed, tool], "tools": tools(), "return_token_ids": true});
    let t2 = e.begin(&body, Some("ep".into())).unwrap();
    let mut want = bytes(p1);
    want.extend(bytes(reply));
    want.push(257);
    want.extend(bytes("<|tool|>408\n<|assistant|>"));
    assert_eq!(
        t2.prompt_ids, want,
        "the tool message follows the reply's own EOS"
    );
    let r2 = e.finish(t2, &served("408", false, 2), 0).unwrap();
    assert_eq!(r2["choices"][0]["finish_reason"], "length");
    assert_eq!(r2["prompt_token_ids"], json!(want));
    assert_eq!(r2["accrue"]["turn"], 2);
    let (rollout, stats) = e
        .report(
            "ep",
            &Report {
                reward: 1.0,
                group: None,
            },
        )
        .unwrap()
        .unwrap();
    assert_eq!(stats.turns, 2);
    assert_eq!(stats.tool_calls, 1);
    let mut ids = want.clone();
    ids.extend(bytes("408"));
    assert_eq!(rollout.seq.input_ids(), &ids[..]);
    let trained: Vec<usize> = rollout
        .seq
        .labels()
        .iter()
        .enumerate()
        .filter(|(_, &l)| l != IGNORE_INDEX)
        .map(|(i, _)| i)
        .collect();
    let reply_at = p1.len();
    let mut expect: Vec<usize> = (reply_at..reply_at + reply.len() + 1).collect();
    expect.extend(ids.len() - 3..ids.len());
    assert_eq!(trained, expect, "the replies' tokens only");
    let old = rollout.old_logprobs.unwrap();
    assert_eq!(old.len(), ids.len());
    assert!(expect.iter().all(|&i| old[i] == -0.25));
    assert!((0..ids.len())
        .filter(|i| !expect.contains(i))
        .all(|i| old[i] == 0.0));
    assert_eq!(rollout.policy_version, 2, "the oldest policy of its calls");
    // Episodes of one prompt share a group.
    assert!(rollout.group.starts_with("prompt-"));
    e.reported("ep", json!({"accepted": 1}));
    assert_eq!(
        e.report(
            "ep",
            &Report {
                reward: 0.0,
                group: None
            }
        )
        .unwrap(),
        Err(json!({"accepted": 1}))
    );
    let again = e.begin(&body, Some("ep".into())).unwrap_err();
    assert_eq!(again.status, 409, "a reported episode takes no calls");
}

/// A call that edits the history, adds an assistant turn of its own, adds
/// nothing or changes the tools is refused naming the field, and leaves
/// the episode as it was; a call in flight holds its episode; an
/// abandoned call leaves it where it stood before.
#[test]
fn calls_that_do_not_extend_their_episode_are_refused_by_field() {
    let (e, _d) = endpoint(4096, 8);
    let user = json!({"role": "user", "content": "hi"});
    let t1 = e
        .begin(&json!({"messages": [user]}), Some("a".into()))
        .unwrap();
    let busy = e
        .begin(&json!({"messages": [user]}), Some("a".into()))
        .unwrap_err();
    assert_eq!(busy.status, 409);
    let p1 = t1.prompt_ids.clone();
    e.finish(t1, &served("yo", true, 0), 0).unwrap();
    let reply = json!({"role": "assistant", "content": "yo"});
    let next = json!({"role": "user", "content": "again"});
    let cases = [
        (
            json!({"messages": [{"role": "user", "content": "hey"}, reply, next]}),
            "messages[0]",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "content": "yo!"}, next]}),
            "messages[1]",
        ),
        (json!({"messages": [user, reply]}), "messages[2]"),
        (
            json!({"messages": [user, reply, next, {"role": "assistant", "content": "x"}, next]}),
            "messages[3]",
        ),
        (
            json!({"messages": [user, reply, next], "tools": tools()}),
            "tools",
        ),
    ];
    for (body, field) in cases {
        let err = e.begin(&body, Some("a".into())).unwrap_err();
        assert_eq!(
            (err.status, err.param.as_deref()),
            (400, Some(field)),
            "{err}"
        );
    }
    let good = json!({"messages": [user, reply, next]});
    let t2 = e.begin(&good, Some("a".into())).unwrap();
    let len2 = t2.prompt_ids.len();
    assert_eq!(&t2.prompt_ids[..p1.len()], &p1[..]);
    e.abandon(&t2);
    let t2 = e.begin(&good, Some("a".into())).unwrap();
    assert_eq!(
        t2.prompt_ids.len(),
        len2,
        "the abandoned call left nothing behind"
    );
    // An abandoned first call forgets the episode.
    let t = e
        .begin(&json!({"messages": [user]}), Some("b".into()))
        .unwrap();
    e.abandon(&t);
    assert_eq!(
        e.report(
            "b",
            &Report {
                reward: 0.0,
                group: None
            }
        )
        .unwrap_err()
        .status,
        404
    );
}

/// Episodes are bounded in number and length: one too many is 429, a
/// prompt that fills `data.max_tokens` is refused, and a reply is cut so
/// the episode fits.
#[test]
fn episodes_are_bounded_in_number_and_length() {
    let (e, _d) = endpoint(40, 1);
    let user = json!({"role": "user", "content": "hi"});
    let t = e
        .begin(
            &json!({"messages": [user], "max_tokens": 100}),
            Some("a".into()),
        )
        .unwrap();
    assert_eq!(
        t.sampling.max_new_tokens as usize,
        40 - t.prompt_ids.len(),
        "cut to the episode's room"
    );
    let full = e
        .begin(&json!({"messages": [user]}), Some("b".into()))
        .unwrap_err();
    assert_eq!(full.status, 429);
    e.abandon(&t);
    let long = json!({"messages": [{"role": "user", "content": "x".repeat(64)}]});
    let err = e.begin(&long, Some("c".into())).unwrap_err();
    assert_eq!(err.param.as_deref(), Some("messages"), "{err}");
    assert!(err.message.contains("data.max_tokens = 40"), "{err}");
    assert_eq!(e.open_episodes(), 0, "a refused first call opens nothing");
}

//! The environment program's protocol and its fences, against real
//! programs (Python: what environments are written in).

use super::*;

fn env_of(dir: &std::path::Path, name: &str, body: &str, extra: &str) -> CommandEnv {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    let section: EnvSection = toml::from_str(&format!(
        "kind = \"command\"\ncommand = [\"python3\", \"{}\"]\n{extra}",
        p.display()
    ))
    .unwrap();
    CommandEnv::new(&section, Some(dir.to_path_buf()))
}

fn step<'a>(episode: &'a str, turn: u32, content: &'a str) -> StepIn<'a> {
    StepIn {
        episode,
        turn,
        content,
        prompt: "6*7",
        reference: "42",
    }
}

/// A calculator environment: "CALC e" gets e's value as a tool message,
/// anything else ends the episode, scored against the reference. It logs
/// what it was sent, and answers a turn's steps in reverse order.
const CALC: &str = r#"
import json, os, sys
log = open("env.log", "a")
refs, pending = {}, []
for line in sys.stdin:
    m = json.loads(line)
    log.write(m["type"] + " " + m["episode"] + "\n"); log.flush()
    if m["type"] == "reset":
        refs[m["episode"]] = m["reference"]
    elif m["type"] == "step":
        c = m["content"]
        if c.startswith("CALC "):
            out = {"episode": m["episode"], "messages": [{"role": "tool", "content": str(eval(c[5:]))}]}
        else:
            ok = c.strip() == refs[m["episode"]]
            out = {"episode": m["episode"], "done": True, "reward": float(ok), "correct": ok,
                   "components": {"turns": m["turn"]}}
        pending.append(out)
        if len(pending) == int(os.environ.get("BATCH", "1")):
            for o in reversed(pending):
                print(json.dumps(o), flush=True)
            pending = []
"#;

#[test]
fn episodes_are_reset_stepped_and_closed_over_one_process() {
    let d = tempfile::tempdir().unwrap();
    let env = env_of(d.path(), "calc.py", CALC, "");
    // One step at a time (BATCH unset: the program answers each at once).
    let out = env
        .step(&[step("a", 1, "CALC 6*7"), step("b", 1, "43")])
        .unwrap();
    assert_eq!(
        out[0],
        StepOut::Messages(vec![("tool".into(), "42".into())])
    );
    let StepOut::Done(Some(score)) = &out[1] else {
        panic!("{out:?}")
    };
    assert_eq!((score.reward, score.correct), (0.0, Some(false)));
    assert_eq!(score.components["turns"], 1.0);
    env.close(&["b"]);
    let out = env.step(&[step("a", 2, "42")]).unwrap();
    assert!(matches!(&out[0], StepOut::Done(Some(s)) if s.reward == 1.0));
    env.close(&["a"]);
    let out = env.step(&[step("c", 1, "42")]).unwrap();
    assert!(matches!(&out[0], StepOut::Done(Some(s)) if s.correct == Some(true)));
    let log = std::fs::read_to_string(d.path().join("env.log")).unwrap();
    assert_eq!(
        log, "reset a\nstep a\nreset b\nstep b\nclose b\nstep a\nclose a\nreset c\nstep c\n",
        "one process: reset before the first step, closes in between"
    );
}

#[test]
fn answers_may_come_in_any_order() {
    let d = tempfile::tempdir().unwrap();
    let body = format!("import os\nos.environ['BATCH'] = '3'\n{CALC}");
    let env = env_of(d.path(), "calc3.py", &body, "");
    let out = env
        .step(&[
            step("x", 1, "CALC 1+1"),
            step("y", 1, "CALC 2+2"),
            step("z", 1, "42"),
        ])
        .unwrap();
    assert_eq!(out[0], StepOut::Messages(vec![("tool".into(), "2".into())]));
    assert_eq!(out[1], StepOut::Messages(vec![("tool".into(), "4".into())]));
    assert!(matches!(out[2], StepOut::Done(Some(_))));
}

/// An environment that holds one episode's answer (a slow tool): the
/// other episodes of its step are answered as they come, and steps of
/// other episodes (the next waves) go on meanwhile.
#[test]
fn a_slow_episode_holds_no_other() {
    let d = tempfile::tempdir().unwrap();
    let body = r#"
import json, sys
held = []
def say(o):
    print(json.dumps(o), flush=True)
for line in sys.stdin:
    m = json.loads(line)
    if m["type"] != "step":
        continue
    if m["content"] == "slow":
        held.append(m["episode"])
    elif m["content"] == "release":
        for h in held:
            say({"episode": h, "messages": [{"role": "tool", "content": "late"}]})
        held = []
        say({"episode": m["episode"], "done": True})
    else:
        say({"episode": m["episode"], "messages": [{"role": "tool", "content": "now"}]})
"#;
    let env = std::sync::Arc::new(env_of(d.path(), "slow.py", body, "timeout_s = 20"));
    let (tx, rx) = std::sync::mpsc::channel();
    let e = env.clone();
    let waiting = std::thread::spawn(move || {
        e.step_each(&[step("a", 1, "fast"), step("b", 1, "slow")], |batch| {
            tx.send(batch).unwrap()
        })
    });
    let got = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let now = StepOut::Messages(vec![("tool".into(), "now".into())]);
    assert_eq!(
        got,
        vec![(0, now.clone())],
        "the fast episode's answer alone"
    );
    // Another call goes on while "b" waits.
    assert_eq!(env.step(&[step("c", 1, "fast")]).unwrap(), [now]);
    let released = env.step(&[step("d", 1, "release")]).unwrap();
    assert_eq!(released, [StepOut::Done(None)]);
    let late = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(
        late,
        vec![(1, StepOut::Messages(vec![("tool".into(), "late".into())]))]
    );
    waiting.join().unwrap().unwrap();
}

/// Every way a program can misbehave fails the turn with a reason that
/// names the line or the wait, never quoting what the program wrote.
#[test]
fn a_misbehaving_environment_is_named_not_quoted() {
    let d = tempfile::tempdir().unwrap();
    let run = |name: &str, answer: &str, extra: &str| {
        let body = format!(
            "import sys, time, json\nfor line in sys.stdin:\n    m = json.loads(line)\n    if m['type'] == 'step':\n{answer}\n"
        );
        let env = env_of(d.path(), name, &body, extra);
        env.step(&[step("e1", 1, "hi"), step("e2", 1, "hi")])
            .unwrap_err()
            .to_string()
    };
    let e = run(
        "garbage.py",
        "        print('secret-garbage', flush=True)",
        "",
    );
    assert!(e.contains("stdout line 1: not JSON"), "{e}");
    assert!(!e.contains("secret-garbage"), "{e}");
    let e = run(
        "unknown.py",
        "        print(json.dumps({'episode': 'zz', 'done': True}), flush=True)",
        "",
    );
    assert!(
        e.contains("stdout line 1: answers episode \"zz\", which is not waiting for an answer"),
        "{e}"
    );
    let e = run(
        "twice.py",
        "        print(json.dumps({'episode': 'e1', 'done': True}), flush=True)",
        "",
    );
    assert!(
        e.contains("stdout line 2: answers episode \"e1\", which is not waiting"),
        "{e}"
    );
    let e = run("sleepy.py", "        time.sleep(30)", "timeout_s = 0.5");
    assert!(e.contains("did not answer 2 steps within 500ms"), "{e}");
    let e = run("crash.py", "        sys.exit(3)", "");
    assert!(
        e.contains("exited (or closed its stdout) with 2 steps unanswered"),
        "{e}"
    );
    let e = run(
        "nomsg.py",
        "        print(json.dumps({'episode': m['episode']}), flush=True)",
        "",
    );
    assert!(
        e.contains("episode \"e1\": an episode that goes on needs \"messages\""),
        "{e}"
    );
    let e = run(
        "badreward.py",
        "        print(json.dumps({'episode': m['episode'], 'done': True, 'reward': 'high'}), flush=True)",
        "",
    );
    assert!(e.contains("\"reward\" must be a finite number"), "{e}");
    let e = run(
        "role.py",
        "        print(json.dumps({'episode': m['episode'], 'messages': [{'role': 'assistant', 'content': 'x'}]}), flush=True)",
        "",
    );
    assert!(e.contains("messages[0] must be"), "{e}");
    let e = run("long.py", "        print('x' * (2 << 20), flush=True)", "");
    assert!(e.contains("a line longer than 1048576 bytes"), "{e}");
    let missing: EnvSection =
        toml::from_str("kind = \"command\"\ncommand = [\"/nonexistent/env\"]").unwrap();
    let e = CommandEnv::new(&missing, None)
        .step(&[step("e", 1, "x")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("could not start"), "{e}");
}

/// The program sees the fixed few variables and those the spec names,
/// never Accrue's own.
#[test]
fn the_environment_program_sees_only_its_allow_listed_variables() {
    let d = tempfile::tempdir().unwrap();
    std::env::set_var("ENV_CMD_TEST_PASSED", "yes");
    std::env::set_var("ACCRUE_ENV_CMD_TEST_SECRET", "no");
    let body = r#"
import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m["type"] == "step":
        names = sorted(k for k in os.environ if k.startswith(("ENV_CMD", "ACCRUE")))
        print(json.dumps({"episode": m["episode"], "messages": [{"role": "tool", "content": ",".join(names)}]}), flush=True)
"#;
    let env = env_of(d.path(), "vars.py", body, "env = [\"ENV_CMD_TEST_PASSED\"]");
    let out = env.step(&[step("v", 1, "x")]).unwrap();
    assert_eq!(
        out[0],
        StepOut::Messages(vec![("tool".into(), "ENV_CMD_TEST_PASSED".into())])
    );
}

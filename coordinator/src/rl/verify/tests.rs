//! Verifier tests, on real GSM8K rows where the data is present
//! (`/work/shared/data/rl/`, or `ACCRUE_RL_DATA`; never committed).

use super::*;
use crate::job::verifier::VerifierSection;

/// (question, answer) rows of the GSM8K test split, or None (printed).
fn gsm8k_rows(n: usize) -> Option<Vec<(String, String)>> {
    let dir = std::env::var("ACCRUE_RL_DATA").unwrap_or_else(|_| "/work/shared/data/rl".into());
    let path = std::path::Path::new(&dir).join("gsm8k_test.jsonl");
    let Ok(text) = std::fs::read_to_string(&path) else {
        println!("skipped: {} is absent (set ACCRUE_RL_DATA)", path.display());
        return None;
    };
    Some(
        text.lines()
            .take(n)
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                (
                    v["question"].as_str().unwrap().to_string(),
                    v["answer"].as_str().unwrap().to_string(),
                )
            })
            .collect(),
    )
}

fn verifier(toml_text: &str) -> Verifier {
    let s: VerifierSection = toml::from_str(toml_text).unwrap();
    let mut problems = Vec::new();
    s.validate(&mut |f: &str, m: String| problems.push(format!("{f}: {m}")));
    assert!(problems.is_empty(), "{problems:?}");
    Verifier::new(&s).unwrap()
}

fn sample<'a>(prompt: &'a str, completion: &'a str, reference: &'a str) -> Sample<'a> {
    Sample {
        prompt,
        completion,
        reference,
    }
}

#[test]
fn gsm8k_reads_the_final_answer_of_real_rows() {
    let Some(rows) = gsm8k_rows(200) else { return };
    let v = verifier("kind = \"gsm8k\"");
    let mut right = 0;
    for (q, a) in &rows {
        let want = gsm8k_reference(a).unwrap_or_else(|| panic!("no answer in {a:?}"));
        // The reference solution itself ends with its answer: right.
        // The same text with the answer moved by one: wrong.
        let wrong = format!("{a} so maybe {}", want.parse::<f64>().unwrap() + 1.0);
        let prose = format!("Let me think. The answer is ${want}.");
        let batch = [sample(q, a, a), sample(q, &wrong, a), sample(q, &prose, a)];
        let s = v.score(&batch).unwrap();
        assert_eq!(s[0].correct, Some(true), "{a:?}");
        assert_eq!(s[1].correct, Some(false), "{wrong:?}");
        assert_eq!(s[2].reward, 1.0, "{prose:?}");
        assert_eq!(s[1].components["correct"], 0.0);
        right += 1;
    }
    assert_eq!(right, 200);
    // Row 1 of the test split: Janet's ducks, 18 dollars.
    assert_eq!(gsm8k_reference(&rows[0].1).as_deref(), Some("18"));
}

#[test]
fn gsm8k_normalises_numbers() {
    for (text, want) in [
        ("it costs $1,000.00 in total", "1000"),
        ("-0.50 degrees", "-0.5"),
        ("+7", "7"),
        ("x = 3.", "3"),
        ("from 2 to 007", "7"),
        ("-0", "0"),
        (".25 of it", "0.25"),
    ] {
        assert_eq!(last_number(text).as_deref(), Some(want), "{text:?}");
    }
    assert_eq!(last_number("no digits here"), None);
    assert!(!builtin::gsm8k("no number", "#### 5"));
}

#[test]
fn exact_match_on_real_answers_and_arithmetic() {
    let v = verifier("kind = \"exact\"");
    let s = v
        .score(&[
            sample("12+30=", "42", "42"),
            sample("12+30=", " 42\n", "42"),
            sample("12+30=", "420", "42"),
            sample("12+30=", "", "42"),
        ])
        .unwrap();
    let got: Vec<f64> = s.iter().map(|s| s.reward).collect();
    assert_eq!(got, [1.0, 1.0, 0.0, 0.0]);
    let Some(rows) = gsm8k_rows(50) else { return };
    for (i, (q, a)) in rows.iter().enumerate() {
        let want = gsm8k_reference(a).unwrap();
        let other = gsm8k_reference(&rows[(i + 1) % rows.len()].1).unwrap();
        let s = v
            .score(&[sample(q, &want, &want), sample(q, a, &want)])
            .unwrap();
        assert_eq!(s[0].correct, Some(true));
        assert_eq!(
            s[1].correct,
            Some(false),
            "a whole solution is not the bare answer"
        );
        if other != want {
            assert_eq!(v.score(&[sample(q, &other, &want)]).unwrap()[0].reward, 0.0);
        }
    }
}

#[test]
fn regex_format_reward_on_real_rows() {
    let v = verifier("kind = \"regex\"\npattern = '####\\s*-?[\\d,]+\\s*$'");
    let Some(rows) = gsm8k_rows(100) else { return };
    for (q, a) in &rows {
        let s = v.score(&[sample(q, a, a), sample(q, q, a)]).unwrap();
        assert_eq!(s[0].reward, 1.0, "{a:?}");
        assert_eq!(s[1].reward, 0.0, "{q:?}");
    }
    // A format component on top of gsm8k correctness.
    let v = verifier(
        "kind = \"gsm8k\"\nformat_pattern = '####\\s*-?[\\d,]+\\s*$'\nformat_weight = 0.5",
    );
    let (q, a) = &rows[3];
    let want = gsm8k_reference(a).unwrap();
    let s = v.score(&[sample(q, a, a), sample(q, &want, a)]).unwrap();
    assert_eq!(s[0].reward, 1.5);
    assert_eq!(s[0].components["format"], 1.0);
    assert_eq!((s[1].reward, s[1].components["format"]), (1.0, 0.0));
}

fn script(dir: &std::path::Path, name: &str, body: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p.display().to_string()
}

#[test]
fn command_verifier_scores_real_rows_through_a_program() {
    let d = tempfile::tempdir().unwrap();
    // Rewards 1 when the line's completion field holds "#### " (what the
    // program sees is the JSON we send: check it carries the reference).
    let prog = script(
        d.path(),
        "v.sh",
        r#"while IFS= read -r line; do
  case "$line" in
    *'"reference":'*'####'*) ;; *) echo "no reference" >&2; exit 3;;
  esac
  case "$line" in
    *'"completion":"'*'####'*'","reference"'*) echo '{"reward": 1, "correct": true, "len": 2}';;
    *) echo 0;;
  esac
done"#,
    );
    let v = verifier(&format!("kind = \"command\"\ncommand = [\"{prog}\"]"));
    let Some(rows) = gsm8k_rows(20) else { return };
    let batch: Vec<Sample> = rows
        .iter()
        .flat_map(|(q, a)| [sample(q, a, a), sample(q, q, a)])
        .collect();
    let s = v.score(&batch).unwrap();
    assert_eq!(s.len(), 40);
    for pair in s.chunks(2) {
        assert_eq!((pair[0].reward, pair[0].correct), (1.0, Some(true)));
        assert_eq!(pair[0].components["len"], 2.0);
        assert_eq!((pair[1].reward, pair[1].correct), (0.0, None));
    }
}

#[test]
fn command_verifier_errors_name_the_problem() {
    let d = tempfile::tempdir().unwrap();
    let batch = [sample("p", "c", "r"), sample("p2", "c2", "r2")];
    let run = |body: &str, timeout: &str| {
        let prog = script(d.path(), &format!("s{}.sh", body.len()), body);
        let v = verifier(&format!(
            "kind = \"command\"\ncommand = [\"{prog}\"]\ntimeout_s = {timeout}"
        ));
        v.score(&batch).unwrap_err().to_string()
    };
    let e = run("cat >/dev/null; echo 1; echo nope", "5");
    assert!(e.contains("stdout line 2: not JSON"), "{e}");
    let e = run("cat >/dev/null; echo 1", "5");
    assert!(e.contains("wrote 1 score lines for 2 completions"), "{e}");
    let e = run("cat >/dev/null; echo '{\"reward\": null}'; echo 1", "5");
    assert!(
        e.contains("line 1: the reward is not a finite number"),
        "{e}"
    );
    let e = run("cat >/dev/null; echo oops >&2; exit 4", "5");
    assert!(
        e.contains("exit status: 4") && e.contains("5 bytes on stderr"),
        "{e}"
    );
    let started = std::time::Instant::now();
    let e = run("sleep 5", "0.3");
    assert!(e.contains("timed out after 0.3s"), "{e}");
    assert!(started.elapsed() < std::time::Duration::from_secs(4));
    let v = verifier("kind = \"command\"\ncommand = [\"/nonexistent/verifier\"]");
    let e = v.score(&batch).unwrap_err().to_string();
    assert!(e.contains("\"/nonexistent/verifier\": cannot start"), "{e}");
}

/// Whether process `pid` is gone (or a zombie), waiting up to 5 s.
fn gone(pid: u32) -> bool {
    let stat = format!("/proc/{pid}/stat");
    for _ in 0..500 {
        match std::fs::read_to_string(&stat) {
            Err(_) => return true,
            // The state is the field after the command's closing paren.
            Ok(s)
                if s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z') =>
            {
                return true
            }
            Ok(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
        }
    }
    false
}

/// The pid a script wrote to `file`.
fn pid_in(file: &std::path::Path) -> u32 {
    std::fs::read_to_string(file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn command_verifier_sees_only_its_allow_listed_environment() {
    // Set for the whole test binary; nothing else in it reads them.
    std::env::set_var("ACCRUE_ADMIN_TOKEN", "admin-secret-33-7");
    std::env::set_var("VERIFY_TEST_OTHER_SECRET", "other-secret-33-7");
    std::env::set_var("VERIFY_TEST_PASSED", "passed-33-7");
    let d = tempfile::tempdir().unwrap();
    let seen = d.path().join("env.txt");
    let prog = script(
        d.path(),
        "env.sh",
        &format!("env > '{}'; cat >/dev/null; echo 1", seen.display()),
    );
    let batch = [sample("p", "c", "r")];
    let v = verifier(&format!("kind = \"command\"\ncommand = [\"{prog}\"]"));
    v.score(&batch).unwrap();
    let env = std::fs::read_to_string(&seen).unwrap();
    assert!(!env.contains("admin-secret-33-7"), "{env}");
    assert!(!env.contains("ACCRUE_"), "{env}");
    assert!(!env.contains("other-secret-33-7"), "{env}");
    assert!(
        !env.contains("VERIFY_TEST_PASSED"),
        "only when listed: {env}"
    );
    assert!(env.lines().any(|l| l.starts_with("PATH=")), "{env}");
    let v = verifier(&format!(
        "kind = \"command\"\ncommand = [\"{prog}\"]\nenv = [\"VERIFY_TEST_PASSED\", \"VERIFY_TEST_UNSET\"]"
    ));
    v.score(&batch).unwrap();
    let env = std::fs::read_to_string(&seen).unwrap();
    assert!(
        env.lines().any(|l| l == "VERIFY_TEST_PASSED=passed-33-7"),
        "{env}"
    );
    assert!(!env.contains("VERIFY_TEST_UNSET"), "{env}");
    assert!(!env.contains("secret-33-7"), "{env}");
}

#[test]
fn command_verifier_deadline_covers_its_grandchildren_and_kills_them() {
    let d = tempfile::tempdir().unwrap();
    let batch = [sample("p", "c", "r")];
    let pid = d.path().join("pid");
    for (name, body) in [
        // Exits at once, leaving a grandchild that holds stdout open.
        (
            "exits.sh",
            "sleep 20 & echo $! > '{pid}'; cat >/dev/null; echo 1",
        ),
        // Hangs, with a grandchild.
        (
            "hangs.sh",
            "sleep 20 & echo $! > '{pid}'; cat >/dev/null; sleep 20",
        ),
    ] {
        let prog = script(
            d.path(),
            name,
            &body.replace("{pid}", &pid.display().to_string()),
        );
        let v = verifier(&format!(
            "kind = \"command\"\ncommand = [\"{prog}\"]\ntimeout_s = 0.5"
        ));
        let started = std::time::Instant::now();
        let e = v.score(&batch).unwrap_err().to_string();
        let took = started.elapsed();
        assert!(e.contains("timed out after 0.5s"), "{name}: {e}");
        assert!(took < std::time::Duration::from_secs(3), "{name}: {took:?}");
        assert!(
            gone(pid_in(&pid)),
            "{name}: the grandchild outlived the batch"
        );
    }
    // A batch that succeeds takes whatever it started with it.
    let prog = script(
        d.path(),
        "leaves.sh",
        &format!(
            "sleep 20 </dev/null >/dev/null 2>&1 & echo $! > '{}'; cat >/dev/null; echo 1",
            pid.display()
        ),
    );
    let v = verifier(&format!("kind = \"command\"\ncommand = [\"{prog}\"]"));
    assert_eq!(v.score(&batch).unwrap()[0].reward, 1.0);
    assert!(
        gone(pid_in(&pid)),
        "the leftover process outlived the batch"
    );
}

#[test]
fn command_verifier_output_is_capped() {
    let d = tempfile::tempdir().unwrap();
    let batch = [sample("p", "c", "r"), sample("p2", "c2", "r2")];
    for (name, body, stream) in [
        (
            "out.sh",
            "cat >/dev/null; yes 1 | head -n 5000000",
            "stdout",
        ),
        (
            "err.sh",
            "cat >/dev/null; yes x | head -n 5000000 >&2; echo 1; echo 1",
            "stderr",
        ),
    ] {
        let prog = script(d.path(), name, body);
        let v = verifier(&format!(
            "kind = \"command\"\ncommand = [\"{prog}\"]\ntimeout_s = 30"
        ));
        let started = std::time::Instant::now();
        let e = v.score(&batch).unwrap_err().to_string();
        assert!(
            e.contains(&format!("wrote more than 1048576 bytes on {stream}")),
            "{name}: {e}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{name}"
        );
    }
}

#[test]
fn command_verifier_output_is_never_echoed_in_its_errors() {
    let d = tempfile::tempdir().unwrap();
    let batch = [sample("p", "c", "r"), sample("p2", "c2", "r2")];
    let marker = "MARKER-33-7-secret";
    for body in [
        format!("cat >/dev/null; echo {marker} >&2; exit 3"),
        format!("cat >/dev/null; echo 1; echo '{marker}'"),
        format!("cat >/dev/null; echo 1; echo '{{\"reward\": 1, \"{marker}\": \"x\"}}'"),
        format!("cat >/dev/null; echo {marker}"),
    ] {
        let prog = script(d.path(), &format!("m{}.sh", body.len()), &body);
        let v = verifier(&format!("kind = \"command\"\ncommand = [\"{prog}\"]"));
        let e = v.score(&batch).unwrap_err().to_string();
        assert!(!e.contains("MARKER"), "{body}: {e}");
    }
}

#[test]
fn config_problems_are_named() {
    let problems = |t: &str| {
        let s: VerifierSection = toml::from_str(t).unwrap();
        let mut out = Vec::new();
        s.validate(&mut |f: &str, m: String| out.push(format!("{f}: {m}")));
        out.join("\n")
    };
    assert!(problems("kind = \"regex\"").contains("rl.verifier.pattern: required"));
    assert!(problems("kind = \"command\"").contains("rl.verifier.command: required"));
    assert!(problems("kind = \"regex\"\npattern = \"(\"").contains("not a valid regular"));
    assert!(problems("kind = \"exact\"\ncommand = [\"x\"]").contains("only applies"));
    assert!(
        problems("kind = \"command\"\ncommand = [\"x\"]\ntimeout_s = 0")
            .contains("rl.verifier.timeout_s")
    );
    for timeout in ["1e300", "inf", "nan", "-1", "86401"] {
        let p = problems(&format!(
            "kind = \"command\"\ncommand = [\"x\"]\ntimeout_s = {timeout}"
        ));
        assert!(p.starts_with("rl.verifier.timeout_s: "), "{timeout}: {p}");
    }
    assert!(problems("kind = \"command\"\ncommand = [\"x\"]\ntimeout_s = 86400").is_empty());
    for name in [
        "ACCRUE_ADMIN_TOKEN",
        "accrue_worker_token",
        "A-B",
        "1X",
        "",
        "A B",
    ] {
        let p = problems(&format!(
            "kind = \"command\"\ncommand = [\"x\"]\nenv = [\"{name}\"]"
        ));
        assert!(p.starts_with("rl.verifier.env[0]: "), "{name:?}: {p}");
    }
    assert!(problems("kind = \"exact\"\nenv = [\"X\"]").contains("rl.verifier.env: only applies"));
    assert!(toml::from_str::<VerifierSection>("kind = \"fuzzy\"").is_err());
    assert!(toml::from_str::<VerifierSection>("kin = \"exact\"").is_err());
}

#[test]
fn stop_strings_cut_the_text() {
    let stops = vec!["\n".to_string(), "<|im_end|>".to_string()];
    assert_eq!(truncate_at_stop("42\nmore", &stops), "42");
    assert_eq!(truncate_at_stop("7<|im_end|>\n", &stops), "7");
    assert_eq!(truncate_at_stop("none", &stops), "none");
}

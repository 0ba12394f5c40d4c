//! The tool-use demo's task (issue 36, `accrue data synth --task
//! tool-arithmetic`): two-digit multiplication, which a tiny byte-level
//! model cannot learn to do in its head in minutes but can with a
//! calculator call. Three files, chat rows (the tokenizer's chat template
//! renders them, and the environment's turns with them):
//! - `tool-sft.jsonl`: formatted traces — the question, the assistant's
//!   `<tool_call>` of the calculator with the expression, the tool's
//!   result, the assistant's answer;
//! - `tool-prompts.jsonl`: training questions with their reference;
//! - `tool-eval.jsonl`: held-out questions, from problems that never
//!   occur in the other two files (a problem is held out when a hash of it
//!   says so, whatever the seed), so accuracy on them is generalisation.
//!
//! The same seed gives byte-identical files.

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

/// The files [`synth_tool_arithmetic`] writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolFiles {
    pub sft: PathBuf,
    pub prompts: PathBuf,
    pub eval: PathBuf,
}

/// One problem in ten is held out.
const HELD_OUT_ONE_IN: u64 = 10;

/// Whether `a*b` is a held-out problem (a fixed hash: the same split for
/// every seed).
pub fn held_out(a: u64, b: u64) -> bool {
    let mut z = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (z ^ (z >> 29)).is_multiple_of(HELD_OUT_ONE_IN)
}

/// A two-digit × two-digit problem on the chosen side of the split.
fn problem(rng: &mut ChaCha8Rng, want_held_out: bool) -> (u64, u64) {
    loop {
        let (a, b) = (rng.random_range(10..100u64), rng.random_range(10..100u64));
        if held_out(a, b) == want_held_out {
            return (a, b);
        }
    }
}

/// The assistant's tool call for `expr`, as Hermes/Qwen write it.
pub fn calculator_call(expr: &str) -> String {
    format!(
        "<tool_call>{}</tool_call>",
        json!({"name": "calculator", "arguments": {"expression": expr}})
    )
}

fn lines(rows: impl IntoIterator<Item = serde_json::Value>) -> String {
    rows.into_iter().map(|r| format!("{r}\n")).collect()
}

/// Writes `rows` traces, `rows` training prompts and `eval_rows` held-out
/// prompts into `out_dir`.
pub fn synth_tool_arithmetic(
    out_dir: &Path,
    seed: u64,
    rows: usize,
    eval_rows: usize,
) -> std::io::Result<ToolFiles> {
    std::fs::create_dir_all(out_dir)?;
    let files = ToolFiles {
        sft: out_dir.join("tool-sft.jsonl"),
        prompts: out_dir.join("tool-prompts.jsonl"),
        eval: out_dir.join("tool-eval.jsonl"),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let sft = (0..rows).map(|_| {
        let (a, b) = problem(&mut rng, false);
        let expr = format!("{a}*{b}");
        let answer = (a * b).to_string();
        json!({"messages": [
            {"role": "user", "content": expr},
            {"role": "assistant", "content": calculator_call(&expr)},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": answer},
        ]})
    });
    std::fs::write(&files.sft, lines(sft.collect::<Vec<_>>()))?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5EED_0001);
    let mut prompt = |held: bool| {
        let (a, b) = problem(&mut rng, held);
        json!({
            "messages": [{"role": "user", "content": format!("{a}*{b}")}],
            "reference": (a * b).to_string(),
        })
    };
    let prompts: Vec<_> = (0..rows).map(|_| prompt(false)).collect();
    std::fs::write(&files.prompts, lines(prompts))?;
    let eval: Vec<_> = (0..eval_rows).map(|_| prompt(true)).collect();
    std::fs::write(&files.eval, lines(eval))?;
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(path: &Path) -> Vec<(u64, u64)> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                let q = v["messages"][0]["content"].as_str().unwrap().to_string();
                let (a, b) = q.split_once('*').unwrap();
                (a.parse().unwrap(), b.parse().unwrap())
            })
            .collect()
    }

    #[test]
    fn held_out_problems_never_occur_in_training_and_traces_are_right() {
        let d = tempfile::tempdir().unwrap();
        let f = synth_tool_arithmetic(d.path(), 3, 400, 100).unwrap();
        let train: std::collections::BTreeSet<_> = problems(&f.sft)
            .into_iter()
            .chain(problems(&f.prompts))
            .collect();
        let eval = problems(&f.eval);
        assert_eq!(eval.len(), 100);
        assert!(eval
            .iter()
            .all(|p| !train.contains(p) && held_out(p.0, p.1)));
        let share = (10..100)
            .flat_map(|a| (10..100).map(move |b| (a, b)))
            .filter(|&(a, b)| held_out(a, b))
            .count();
        assert!((600..1000).contains(&share), "about one in ten: {share}");
        let first = std::fs::read_to_string(&f.sft).unwrap();
        let v: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
        let q = v["messages"][0]["content"].as_str().unwrap();
        let (a, b) = q.split_once('*').unwrap();
        let product = a.parse::<u64>().unwrap() * b.parse::<u64>().unwrap();
        assert_eq!(
            v["messages"][1]["content"],
            format!(
                "<tool_call>{{\"name\":\"calculator\",\"arguments\":{{\"expression\":\"{q}\"}}}}</tool_call>"
            )
        );
        assert_eq!(v["messages"][2]["content"], product.to_string());
        assert_eq!(v["messages"][3]["content"], product.to_string());
        let again = tempfile::tempdir().unwrap();
        let g = synth_tool_arithmetic(again.path(), 3, 400, 100).unwrap();
        assert_eq!(first, std::fs::read_to_string(&g.sft).unwrap());
    }
}

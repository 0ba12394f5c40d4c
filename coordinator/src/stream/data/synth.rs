//! A seeded demo dataset: multi-digit addition, small enough for a tiny
//! byte-level model to make visible progress on in ~100 steps.
//!
//! Every row asks `"{a}+{b}="` with operands of 1 to 3 digits (digit count
//! uniform, then the value uniform; single digits with
//! [`synth_arithmetic_digits`] at 1, `--task arithmetic-small`, the RL
//! demo's task) and the answer is the decimal sum:
//! - `arith-sft.jsonl`: `{"prompt": "123+456=", "completion": "579"}`;
//! - `arith-dpo.jsonl`: `{"prompt", "chosen": correct, "rejected": wrong}`,
//!   the wrong answer a plausible slip (off by one or ten, a dropped carry,
//!   two digits swapped);
//! - `arith-rollouts.jsonl`: groups of [`GROUP_SIZE`] completions of one
//!   prompt, `{"prompt", "completion", "reward": 1 or 0, "group",
//!   "policy_version": 0}`; every full group holds at least one correct and
//!   one wrong completion, so group-normalised advantages are non-zero.
//! - `arith-pg.jsonl` ([`synth_arithmetic_rollouts`], `accrue data synth
//!   --task arithmetic-rollouts`): rollout groups for the policy-gradient
//!   demo, mixed, flat (zero variance) and from a future policy (refused).
//!
//! Each file draws from its own ChaCha stream of `seed`, so the same seed
//! gives byte-identical files and `rows` changes no file's prefix.

use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

/// Completions per prompt in the rollout file.
pub const GROUP_SIZE: usize = 4;

/// The three files [`synth_arithmetic`] writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SynthFiles {
    pub sft: PathBuf,
    pub dpo: PathBuf,
    pub rollouts: PathBuf,
}

#[derive(Serialize)]
struct SftRow<'a> {
    prompt: &'a str,
    completion: &'a str,
}

#[derive(Serialize)]
struct DpoRow<'a> {
    prompt: &'a str,
    chosen: &'a str,
    rejected: &'a str,
}

#[derive(Serialize)]
struct RolloutRow<'a> {
    prompt: &'a str,
    completion: &'a str,
    reward: f64,
    group: &'a str,
    policy_version: u64,
}

/// Operand digits of `--task arithmetic`.
pub const DIGITS: u32 = 3;

fn operand(rng: &mut ChaCha8Rng, max_digits: u32) -> u64 {
    let digits: u32 = rng.random_range(1..=max_digits);
    let lo = if digits == 1 {
        0
    } else {
        10u64.pow(digits - 1)
    };
    rng.random_range(lo..10u64.pow(digits))
}

/// A problem: (prompt, correct answer).
fn problem(rng: &mut ChaCha8Rng, max_digits: u32) -> (String, u64) {
    let (a, b) = (operand(rng, max_digits), operand(rng, max_digits));
    (format!("{a}+{b}="), a + b)
}

/// The sum of `a` and `b` without carries, digit by digit.
fn carryless(answer: u64, prompt: &str) -> u64 {
    let body = prompt.trim_end_matches('=');
    let (a, b) = body.split_once('+').expect("synth prompt");
    let (mut a, mut b): (u64, u64) = (a.parse().expect("digits"), b.parse().expect("digits"));
    let (mut out, mut place) = (0, 1);
    while a > 0 || b > 0 {
        out += ((a % 10 + b % 10) % 10) * place;
        a /= 10;
        b /= 10;
        place *= 10;
    }
    if out == 0 {
        answer + 1
    } else {
        out
    }
}

/// A plausible wrong answer, never equal to `answer`.
fn wrong(rng: &mut ChaCha8Rng, prompt: &str, answer: u64) -> u64 {
    loop {
        let w = match rng.random_range(0..5) {
            0 => answer + 1,
            1 => answer.saturating_sub(1),
            2 => answer + 10,
            3 => carryless(answer, prompt),
            _ => {
                let mut d: Vec<u8> = answer.to_string().into_bytes();
                if d.len() < 2 {
                    answer + 2
                } else {
                    let i = rng.random_range(0..d.len() - 1);
                    d.swap(i, i + 1);
                    String::from_utf8(d)
                        .expect("ascii")
                        .parse()
                        .expect("digits")
                }
            }
        };
        if w != answer {
            return w;
        }
    }
}

fn jsonl<T: Serialize>(rows: impl IntoIterator<Item = T>) -> String {
    let mut out = String::new();
    for r in rows {
        out.push_str(&serde_json::to_string(&r).expect("plain rows serialise"));
        out.push('\n');
    }
    out
}

fn stream(seed: u64, n: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(n);
    rng
}

/// Writes `arith-sft.jsonl`, `arith-dpo.jsonl` and `arith-rollouts.jsonl`
/// (each `rows` rows) into `out_dir`, creating it if needed.
pub fn synth_arithmetic(out_dir: &Path, seed: u64, rows: usize) -> std::io::Result<SynthFiles> {
    synth_arithmetic_digits(out_dir, seed, rows, DIGITS)
}

/// [`synth_arithmetic`] with operands of 1 to `max_digits` digits
/// (`--task arithmetic-small`: 1, single-digit operands, the RL demo's
/// task). The same seed and `max_digits` give the same files.
pub fn synth_arithmetic_digits(
    out_dir: &Path,
    seed: u64,
    rows: usize,
    max_digits: u32,
) -> std::io::Result<SynthFiles> {
    std::fs::create_dir_all(out_dir)?;
    let files = SynthFiles {
        sft: out_dir.join("arith-sft.jsonl"),
        dpo: out_dir.join("arith-dpo.jsonl"),
        rollouts: out_dir.join("arith-rollouts.jsonl"),
    };

    let mut rng = stream(seed, 0);
    let sft: Vec<(String, String)> = (0..rows)
        .map(|_| {
            let (p, a) = problem(&mut rng, max_digits);
            (p, a.to_string())
        })
        .collect();
    let text = jsonl(sft.iter().map(|(p, c)| SftRow {
        prompt: p,
        completion: c,
    }));
    std::fs::write(&files.sft, text)?;

    let mut rng = stream(seed, 1);
    let dpo: Vec<(String, String, String)> = (0..rows)
        .map(|_| {
            let (p, a) = problem(&mut rng, max_digits);
            let w = wrong(&mut rng, &p, a);
            (p, a.to_string(), w.to_string())
        })
        .collect();
    let text = jsonl(dpo.iter().map(|(p, c, r)| DpoRow {
        prompt: p,
        chosen: c,
        rejected: r,
    }));
    std::fs::write(&files.dpo, text)?;

    let mut rng = stream(seed, 2);
    let mut rollouts: Vec<(String, String, f64, String)> = Vec::with_capacity(rows);
    for g in 0..rows.div_ceil(GROUP_SIZE) {
        let (p, a) = problem(&mut rng, max_digits);
        let n = GROUP_SIZE.min(rows - g * GROUP_SIZE);
        // One right and one wrong in every group of two or more.
        let mut correct: Vec<bool> = (0..n)
            .map(|i| match i {
                0 => true,
                1 => false,
                _ => rng.random_bool(0.5),
            })
            .collect();
        correct.shuffle(&mut rng);
        for ok in correct {
            let c = if ok { a } else { wrong(&mut rng, &p, a) };
            let reward = if ok { 1.0 } else { 0.0 };
            rollouts.push((p.clone(), c.to_string(), reward, format!("arith-{g}")));
        }
    }
    let text = jsonl(rollouts.iter().map(|(p, c, r, g)| RolloutRow {
        prompt: p,
        completion: c,
        reward: *r,
        group: g,
        policy_version: 0,
    }));
    std::fs::write(&files.rollouts, text)?;
    Ok(files)
}

/// Policy version claimed by the refused groups of
/// [`synth_arithmetic_rollouts`]: newer than any step a job starts from, so
/// admission refuses them (counted as `count/rejected_stale`).
pub const FUTURE_POLICY: u64 = 1_000_000;

/// What one group of [`synth_arithmetic_rollouts`] holds, by group index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RolloutGroupKind {
    /// Right and wrong completions: nonzero advantages, trained on.
    Mixed,
    /// Every completion equally rewarded (all right or all wrong): dropped
    /// as a zero-variance group.
    Flat,
    /// Claims a policy from the future ([`FUTURE_POLICY`]): refused at
    /// admission.
    Refused,
}

impl RolloutGroupKind {
    /// Group `g`: every 4th (from 3) is flat, every 8th (from 5) refused.
    pub fn of(g: usize) -> RolloutGroupKind {
        if g % 4 == 3 {
            RolloutGroupKind::Flat
        } else if g % 8 == 5 {
            RolloutGroupKind::Refused
        } else {
            RolloutGroupKind::Mixed
        }
    }
}

/// Writes `arith-pg.jsonl` into `out_dir`: `groups` groups of
/// [`GROUP_SIZE`] rollouts of one addition prompt each, rewards 1 (right)
/// or 0 (wrong), shaped by [`RolloutGroupKind::of`] so a policy-gradient
/// job sees every path of its admission: mixed groups are trained on,
/// flat groups are dropped (zero variance), refused groups are counted as
/// rejected. Kept groups claim policy 0, so their staleness at step N is
/// N − 1. Deterministic in `seed` (its own ChaCha stream).
pub fn synth_arithmetic_rollouts(
    out_dir: &Path,
    seed: u64,
    groups: usize,
) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(out_dir)?;
    let path = out_dir.join("arith-pg.jsonl");
    let mut rng = stream(seed, 3);
    let mut rows: Vec<(String, String, f64, String, u64)> = Vec::with_capacity(groups * GROUP_SIZE);
    for g in 0..groups {
        let (p, a) = problem(&mut rng, DIGITS);
        let kind = RolloutGroupKind::of(g);
        let mut correct: Vec<bool> = match kind {
            RolloutGroupKind::Flat => vec![g % 8 == 3; GROUP_SIZE],
            _ => (0..GROUP_SIZE)
                .map(|i| match i {
                    0 => true,
                    1 => false,
                    _ => rng.random_bool(0.5),
                })
                .collect(),
        };
        correct.shuffle(&mut rng);
        let version = match kind {
            RolloutGroupKind::Refused => FUTURE_POLICY,
            _ => 0,
        };
        for ok in correct {
            let c = if ok { a } else { wrong(&mut rng, &p, a) };
            rows.push((
                p.clone(),
                c.to_string(),
                f64::from(u8::from(ok)),
                format!("pg-{g}"),
                version,
            ));
        }
    }
    let text = jsonl(rows.iter().map(|(p, c, r, g, v)| RolloutRow {
        prompt: p,
        completion: c,
        reward: *r,
        group: g,
        policy_version: *v,
    }));
    std::fs::write(&path, text)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rollout_task_is_deterministic_with_mixed_flat_and_refused_groups() {
        let (d1, d2, d3) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let a = synth_arithmetic_rollouts(d1.path(), 7, 16).unwrap();
        let b = synth_arithmetic_rollouts(d2.path(), 7, 16).unwrap();
        let c = synth_arithmetic_rollouts(d3.path(), 8, 16).unwrap();
        let (a, b, c) = (
            std::fs::read_to_string(a).unwrap(),
            std::fs::read_to_string(b).unwrap(),
            std::fs::read_to_string(c).unwrap(),
        );
        assert_eq!(a, b);
        assert_ne!(a, c);
        let mut groups: std::collections::BTreeMap<String, (Vec<f64>, u64)> = Default::default();
        for line in a.lines() {
            let r: serde_json::Value = serde_json::from_str(line).unwrap();
            let p = r["prompt"].as_str().unwrap();
            let (x, y) = p.trim_end_matches('=').split_once('+').unwrap();
            let sum = x.parse::<u64>().unwrap() + y.parse::<u64>().unwrap();
            let right = r["completion"].as_str().unwrap() == sum.to_string();
            assert_eq!(r["reward"].as_f64().unwrap(), if right { 1.0 } else { 0.0 });
            let e = groups
                .entry(r["group"].as_str().unwrap().to_string())
                .or_default();
            e.0.push(r["reward"].as_f64().unwrap());
            e.1 = r["policy_version"].as_u64().unwrap();
        }
        assert_eq!(groups.len(), 16);
        for g in 0..16 {
            let (rewards, version) = &groups[&format!("pg-{g}")];
            assert_eq!(rewards.len(), GROUP_SIZE);
            let flat = rewards.iter().all(|&r| r == rewards[0]);
            match RolloutGroupKind::of(g) {
                RolloutGroupKind::Mixed => assert!(!flat && *version == 0, "group {g}"),
                RolloutGroupKind::Flat => assert!(flat && *version == 0, "group {g}"),
                RolloutGroupKind::Refused => assert_eq!(*version, FUTURE_POLICY, "group {g}"),
            }
        }
        // Both kinds of flat group: all right and all wrong.
        assert_eq!(groups["pg-3"].0, vec![1.0; GROUP_SIZE]);
        assert_eq!(groups["pg-7"].0, vec![0.0; GROUP_SIZE]);
    }

    #[test]
    fn same_seed_gives_identical_files_and_other_seeds_differ() {
        let (d1, d2, d3) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let a = synth_arithmetic(d1.path(), 7, 50).unwrap();
        let b = synth_arithmetic(d2.path(), 7, 50).unwrap();
        let c = synth_arithmetic(d3.path(), 8, 50).unwrap();
        for (x, y, z) in [
            (&a.sft, &b.sft, &c.sft),
            (&a.dpo, &b.dpo, &c.dpo),
            (&a.rollouts, &b.rollouts, &c.rollouts),
        ] {
            let (x, y, z) = (
                std::fs::read(x).unwrap(),
                std::fs::read(y).unwrap(),
                std::fs::read(z).unwrap(),
            );
            assert_eq!(x, y);
            assert_ne!(x, z);
            assert_eq!(x.iter().filter(|&&b| b == b'\n').count(), 50);
        }
    }

    #[test]
    fn the_small_task_has_single_digit_operands() {
        let d = tempfile::tempdir().unwrap();
        let f = synth_arithmetic_digits(d.path(), 1, 300, 1).unwrap();
        let text = std::fs::read_to_string(&f.sft).unwrap();
        for l in text.lines() {
            let r: serde_json::Value = serde_json::from_str(l).unwrap();
            let p = r["prompt"].as_str().unwrap();
            let (a, b) = p.trim_end_matches('=').split_once('+').unwrap();
            let (a, b): (u64, u64) = (a.parse().unwrap(), b.parse().unwrap());
            assert!(a < 10 && b < 10, "{p}");
            assert_eq!(r["completion"].as_str().unwrap(), (a + b).to_string());
        }
        // Three digits is `--task arithmetic`, byte for byte.
        let e = tempfile::tempdir().unwrap();
        let g = synth_arithmetic(e.path(), 1, 300).unwrap();
        let h = synth_arithmetic_digits(d.path(), 1, 300, DIGITS).unwrap();
        assert_eq!(std::fs::read(g.sft).unwrap(), std::fs::read(h.sft).unwrap());
    }

    #[test]
    fn rows_are_correct_sums_and_wrong_answers_are_wrong() {
        let d = tempfile::tempdir().unwrap();
        let f = synth_arithmetic(d.path(), 1, 201).unwrap();
        let sum = |p: &str| -> u64 {
            let (a, b) = p.trim_end_matches('=').split_once('+').unwrap();
            a.parse::<u64>().unwrap() + b.parse::<u64>().unwrap()
        };
        let rows = |p: &Path| -> Vec<serde_json::Value> {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect()
        };
        for r in rows(&f.sft) {
            assert_eq!(
                r["completion"].as_str().unwrap(),
                sum(r["prompt"].as_str().unwrap()).to_string()
            );
        }
        for r in rows(&f.dpo) {
            let s = sum(r["prompt"].as_str().unwrap()).to_string();
            assert_eq!(r["chosen"].as_str().unwrap(), s);
            assert_ne!(r["rejected"].as_str().unwrap(), s);
        }
        let ro = rows(&f.rollouts);
        assert_eq!(ro.len(), 201);
        let mut groups: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
        for r in &ro {
            let right =
                r["completion"].as_str().unwrap() == sum(r["prompt"].as_str().unwrap()).to_string();
            assert_eq!(r["reward"].as_f64().unwrap(), if right { 1.0 } else { 0.0 });
            assert_eq!(r["policy_version"], 0);
            groups
                .entry(r["group"].as_str().unwrap().to_string())
                .or_default()
                .push(r["reward"].as_f64().unwrap());
        }
        assert_eq!(groups.len(), 201usize.div_ceil(GROUP_SIZE));
        let mixed = groups
            .values()
            .filter(|g| g.contains(&1.0) && g.contains(&0.0))
            .count();
        assert_eq!(mixed, groups.len() - 1, "every full group has both rewards");
    }
}

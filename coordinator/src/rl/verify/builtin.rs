//! The built-in answer checks: exact match and GSM8K's final number.
//! GSM8K answers end `#### 72`; a completion's answer is its last number,
//! with thousands separators, a leading `+` and trailing zeros of a
//! fraction dropped (so "1,000", "1000.00" and "$1000" all read 1000), as
//! open-instruct's `extract_gsm8k_answer` and lm-eval's "flexible-extract"
//! do.

use std::sync::OnceLock;

use regex::Regex;

/// The completion, trimmed, equals the reference, trimmed.
pub fn exact(completion: &str, reference: &str) -> bool {
    completion.trim() == reference.trim()
}

/// The last number of the completion equals the reference's final answer.
pub fn gsm8k(completion: &str, reference: &str) -> bool {
    match (last_number(completion), gsm8k_reference(reference)) {
        (Some(got), Some(want)) => got == want,
        _ => false,
    }
}

fn number() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"[-+]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+").expect("a valid regex"))
}

/// The number after the last `####` of a GSM8K answer (the whole text when
/// there is no `####`: a bare reference), normalised.
pub fn gsm8k_reference(reference: &str) -> Option<String> {
    let tail = reference.rsplit_once("####").map_or(reference, |(_, t)| t);
    number()
        .find(tail)
        .and_then(|m| normalize_number(m.as_str()))
}

/// The last number in `text`, normalised.
pub fn last_number(text: &str) -> Option<String> {
    number()
        .find_iter(text)
        .last()
        .and_then(|m| normalize_number(m.as_str()))
}

/// A number's canonical spelling: no separators, no `+`, no trailing
/// fraction zeros, no "-0".
pub fn normalize_number(s: &str) -> Option<String> {
    let s: String = s.chars().filter(|&c| c != ',').collect();
    let s = s.strip_prefix('+').unwrap_or(&s);
    let (neg, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if !int.chars().chain(frac.chars()).all(|c| c.is_ascii_digit()) || (int.len() + frac.len()) == 0
    {
        return None;
    }
    let int = int.trim_start_matches('0');
    let frac = frac.trim_end_matches('0');
    let int = if int.is_empty() { "0" } else { int };
    let body = if frac.is_empty() {
        int.to_string()
    } else {
        format!("{int}.{frac}")
    };
    Some(if neg && body != "0" {
        format!("-{body}")
    } else {
        body
    })
}

//! When a completion ends: a stop id, a stop sequence at its end, or
//! `max_new_tokens` (stop is checked first, so a stop token that is also
//! the last allowed one reports `Stop`).

use super::types::{Finish, SamplingParams};

/// Whether `completion` (the new tokens so far) is finished, and why.
pub fn finished(params: &SamplingParams, completion: &[i64]) -> Option<Finish> {
    let last = completion.last()?;
    if params.stop_ids.contains(last)
        || params
            .stop_sequences
            .iter()
            .any(|s| !s.is_empty() && completion.ends_with(s))
    {
        return Some(Finish::Stop);
    }
    (completion.len() >= params.max_new_tokens).then_some(Finish::Length)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_ids_sequences_and_length() {
        let p = SamplingParams {
            max_new_tokens: 4,
            stop_ids: vec![9],
            stop_sequences: vec![vec![5, 6], vec![]],
            ..SamplingParams::default()
        };
        assert_eq!(finished(&p, &[]), None);
        assert_eq!(finished(&p, &[1, 2]), None);
        assert_eq!(finished(&p, &[1, 9]), Some(Finish::Stop));
        assert_eq!(finished(&p, &[5, 6]), Some(Finish::Stop));
        assert_eq!(finished(&p, &[6, 5]), None);
        assert_eq!(finished(&p, &[1, 2, 3, 4]), Some(Finish::Length));
        assert_eq!(finished(&p, &[1, 2, 5, 6]), Some(Finish::Stop));
    }
}

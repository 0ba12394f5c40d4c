//! Checks of worker messages that the state machine cannot make itself
//! (the wire shape: empty ids, impossible numbers, malformed addresses).
//! A refused message is `InvalidArgument` naming the field, and is refused
//! before it reaches the core, so it changes nothing.

use std::fmt;

use accrue_proto::v1 as wire;
use accrue_proto::v1::worker_message::Msg;
use tonic::Status;

fn non_empty(field: impl fmt::Display, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field} must not be empty"
        )));
    }
    Ok(())
}

/// A duration or count that must be a finite number ≥ 0.
fn non_negative(field: impl fmt::Display, value: f64) -> Result<(), Status> {
    if !(value.is_finite() && value >= 0.0) {
        return Err(Status::invalid_argument(format!(
            "{field}: expected a finite number >= 0, got {value}"
        )));
    }
    Ok(())
}

/// `RegisterRequest`: a hostname, and a collective address that is empty
/// (single-rank workers) or `host:port`.
pub fn register(r: &wire::RegisterRequest) -> Result<(), Status> {
    non_empty("hostname", &r.hostname)?;
    if r.protocol != accrue_proto::PROTOCOL {
        // Not retried by the worker: a rebuild is what fixes it.
        return Err(Status::failed_precondition(format!(
            "protocol: this worker (version {:?}) speaks revision {} of the \
             worker contract, this coordinator revision {}: run workers and \
             coordinator of the same release",
            r.version,
            r.protocol,
            accrue_proto::PROTOCOL
        )));
    }
    for (field, addr) in [
        ("collective_addr", &r.collective_addr),
        ("relay_addr", &r.relay_addr),
    ] {
        let ok = addr.is_empty()
            || addr
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        if !ok {
            return Err(Status::invalid_argument(format!(
                "{field}: expected host:port, got {addr:?}"
            )));
        }
    }
    Ok(())
}

/// The first session message's worker id.
pub fn hello(h: &wire::Hello) -> Result<(), Status> {
    non_empty("hello.worker_id", &h.worker_id)?;
    // The coordinator's own acknowledger of checkpoint tokenizer files.
    if h.worker_id == crate::core::TOKENIZER_FILES {
        return Err(Status::invalid_argument(format!(
            "hello.worker_id {:?} is reserved for the coordinator",
            h.worker_id
        )));
    }
    Ok(())
}

/// One session message after hello.
pub fn session_message(msg: &Msg) -> Result<(), Status> {
    match msg {
        Msg::Ready(r) => non_empty("ready.job_id", &r.job_id),
        Msg::StepResult(r) => step_result(&"step_result", r),
        Msg::StepResults(b) => {
            non_empty("step_results.job_id", &b.job_id)?;
            let mut ranks = std::collections::HashSet::new();
            for (i, r) in b.results.iter().enumerate() {
                let field = Entry(i);
                step_result(&field, r)?;
                if (r.job_id.as_str(), r.generation, r.step) != (&b.job_id, b.generation, b.step) {
                    return Err(Status::invalid_argument(format!(
                        "{field}: job {} generation {} step {} in a batch of job {} generation {} step {}",
                        r.job_id, r.generation, r.step, b.job_id, b.generation, b.step
                    )));
                }
                if !ranks.insert(r.rank) {
                    return Err(Status::invalid_argument(format!(
                        "{field}.rank: rank {} given twice",
                        r.rank
                    )));
                }
            }
            Ok(())
        }
        Msg::Error(e) => non_empty("error.job_id", &e.job_id),
        Msg::GenerateResult(g) => non_empty("generate_result.job_id", &g.job_id),
        Msg::CheckpointDone(c) => non_empty("checkpoint_done.job_id", &c.job_id),
        Msg::WeightsSynced(w) => non_empty("weights_synced.job_id", &w.job_id),
        Msg::Hello(_) | Msg::Heartbeat(_) | Msg::PolicyPublished(_) | Msg::Leave(_) => Ok(()),
    }
}

/// A batch's entry as errors name it, written only when one is (a batch
/// holds one entry per rank and is checked every step).
struct Entry(usize);

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step_results.results[{}]", self.0)
    }
}

/// `{0}.{1}`, written only when an error names it.
struct Sub<'a>(&'a dyn fmt::Display, &'a str);

impl fmt::Display for Sub<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.0, self.1)
    }
}

/// One rank's step result (`field` names it in errors).
fn step_result(field: &dyn fmt::Display, r: &wire::StepResult) -> Result<(), Status> {
    non_empty(Sub(field, "job_id"), &r.job_id)?;
    if let Some(s) = &r.sums {
        for (name, v) in [
            ("sums.compute_s", s.compute_s),
            ("sums.collective_s", s.collective_s),
            ("sums.optimizer_s", s.optimizer_s),
            ("sums.idle_s", s.idle_s),
            ("sums.model_flops", s.model_flops),
        ] {
            non_negative(Sub(field, name), v)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn bad_fields_are_named() {
        let mut r = wire::RegisterRequest {
            hostname: "h".into(),
            collective_addr: "127.0.0.1:9".into(),
            protocol: accrue_proto::PROTOCOL,
            ..Default::default()
        };
        assert!(register(&r).is_ok());
        // A worker of another revision (0: built before workers sent it).
        for other in [0, accrue_proto::PROTOCOL + 1] {
            let e = register(&wire::RegisterRequest {
                protocol: other,
                version: "0.0.9".into(),
                ..r.clone()
            })
            .unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition);
            assert!(e.message().starts_with("protocol: "), "{}", e.message());
            assert!(
                e.message().contains(&format!("revision {other} ")),
                "{}",
                e.message()
            );
            assert!(e.message().contains("\"0.0.9\""), "{}", e.message());
        }
        for bad in ["nohost", ":9", "h:99999", "h:"] {
            r.collective_addr = bad.into();
            let e = register(&r).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(
                e.message().starts_with("collective_addr:"),
                "{}",
                e.message()
            );
        }
        let e = hello(&wire::Hello::default()).unwrap_err();
        assert_eq!(e.message(), "hello.worker_id must not be empty");
        let reserved = wire::Hello {
            worker_id: crate::core::TOKENIZER_FILES.into(),
        };
        assert!(hello(&reserved).unwrap_err().message().contains("reserved"));
        let result = |sums| {
            Msg::StepResult(wire::StepResult {
                job_id: "j".into(),
                sums: Some(sums),
                ..Default::default()
            })
        };
        assert!(session_message(&result(wire::MetricSums::default())).is_ok());
        let e = session_message(&result(wire::MetricSums {
            compute_s: -1.0,
            ..Default::default()
        }))
        .unwrap_err();
        assert!(
            e.message().starts_with("step_result.sums.compute_s"),
            "{}",
            e.message()
        );
        let e = session_message(&Msg::Ready(wire::Ready::default())).unwrap_err();
        assert_eq!(e.message(), "ready.job_id must not be empty");
    }

    #[test]
    fn a_gathered_batch_names_the_entry_at_fault() {
        let entry = |rank, step, compute_s| wire::StepResult {
            job_id: "j".into(),
            generation: 2,
            step,
            rank,
            sums: Some(wire::MetricSums {
                compute_s,
                ..Default::default()
            }),
            ..Default::default()
        };
        let batch = |results| {
            Msg::StepResults(wire::StepResults {
                job_id: "j".into(),
                generation: 2,
                step: 5,
                results,
            })
        };
        assert!(session_message(&batch(vec![entry(0, 5, 0.1), entry(1, 5, 0.2)])).is_ok());
        let message = |m| session_message(&m).unwrap_err().message().to_string();
        let m = message(batch(vec![entry(0, 5, 0.1), entry(1, 5, -1.0)]));
        assert!(
            m.starts_with("step_results.results[1].sums.compute_s"),
            "{m}"
        );
        let m = message(batch(vec![entry(0, 5, 0.1), entry(1, 4, 0.1)]));
        assert!(
            m.starts_with("step_results.results[1]: job j generation 2 step 4"),
            "{m}"
        );
        let m = message(batch(vec![entry(1, 5, 0.1), entry(1, 5, 0.1)]));
        assert_eq!(m, "step_results.results[1].rank: rank 1 given twice");
    }
}

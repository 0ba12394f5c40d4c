//! Conversions between the wire (`accrue.v1`) and the domain types. The only
//! place either side's shape leaks into the other.

mod job;
mod messages;
mod metrics;
mod steps;
mod worker;

pub use job::{cursor, job_definition, job_state, job_summary, quarantined};
pub use messages::{packed_rows, to_worker, to_worker_within, PackedRows};
pub use metrics::{
    abort_reason, eval_metrics, event_kind, metric_sums, seq_logp, source_metrics, step_metrics,
    watch_item,
};
pub use steps::step_manifest;
pub use worker::{error_kind, held_from_wire, held_state, worker_info};

#[cfg(test)]
mod tests {
    use super::messages::*;
    use super::worker::*;
    use crate::core::{HeldState, Role, ToWorker, WorkerId};
    use crate::job::spec::JobSpec;
    use accrue_proto::v1 as wire;
    use prost::Message as _;

    fn wire_held(rank: u32, world_size: u32) -> wire::HeldState {
        wire::HeldState {
            job_id: "j".into(),
            step: 7,
            world_size,
            rank,
            generation: 3,
        }
    }

    /// Issue 33 (2): a hub's Relay held every follower's message in one
    /// gRPC message, which at ⌈√W⌉ plans went over the limit. It is cut
    /// into Relays that each fit, the members' messages whole and in order.
    #[test]
    fn a_relay_over_the_message_limit_is_cut_into_relays_that_fit() {
        let msgs: Vec<(u32, ToWorker)> = (0..500u32)
            .map(|i| {
                let m = ToWorker::SyncWeights {
                    job: "job-with-a-long-id".into(),
                    generation: 9,
                    version: u64::from(i) * 1_000_003,
                };
                (1 + i % 31, m)
            })
            .collect();
        let relay = ToWorker::Relay {
            job: "job-with-a-long-id".into(),
            generation: 9,
            messages: msgs.clone(),
        };
        let whole = to_worker(&relay);
        // Under a limit it fits: one message, as before.
        assert_eq!(
            to_worker_within(&relay, whole.encoded_len()),
            vec![whole.clone()]
        );
        for limit in [whole.encoded_len() - 1, 4096, 1000, 200, 60] {
            let parts = to_worker_within(&relay, limit);
            assert!(parts.len() > 1, "limit {limit}");
            let mut entries = Vec::new();
            for p in &parts {
                let Some(wire::coordinator_message::Msg::Relay(r)) = &p.msg else {
                    panic!("not a relay: {p:?}")
                };
                assert_eq!((r.job_id.as_str(), r.generation), ("job-with-a-long-id", 9));
                assert!(!r.messages.is_empty());
                // Each fits, unless it is one entry that alone does not.
                assert!(
                    p.encoded_len() <= limit || r.messages.len() == 1,
                    "limit {limit}: {} bytes, {} entries",
                    p.encoded_len(),
                    r.messages.len()
                );
                entries.extend(r.messages.iter().cloned());
            }
            let Some(wire::coordinator_message::Msg::Relay(all)) = &whole.msg else {
                unreachable!()
            };
            assert_eq!(
                entries, all.messages,
                "limit {limit}: every message, in order"
            );
        }
        // Other messages pass as they are.
        let m = &msgs[0].1;
        assert_eq!(to_worker_within(m, 10), vec![to_worker(m)]);
    }

    #[test]
    fn held_states_round_trip_and_bad_ones_name_the_field() {
        let h = held_from_wire(wire_held(1, 2)).unwrap();
        assert_eq!(held_state(&h), wire_held(1, 2));
        let err = held_from_wire(wire_held(2, 2)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("held.rank"), "{}", err.message());
        let mut nameless = wire_held(0, 1);
        nameless.job_id.clear();
        assert!(held_from_wire(nameless)
            .unwrap_err()
            .message()
            .contains("held.job_id"));
    }

    /// Issue 19: a generation's Configures are O(W) in total (each O(1)),
    /// even re-formed with every member holding the state; listing every
    /// peer in each made them O(W²).
    #[test]
    fn a_generations_configures_grow_linearly_with_its_size() {
        use std::sync::Arc;
        let spec: Arc<JobSpec> = Arc::new(
            toml::from_str(
                "[job]\nname = \"t\"\noutput_dir = \"/o\"\n[model]\ninit = \"random\"\n\
                 config = \"/c.json\"\n[data]\nformat = \"sft\"\n[batch]\ndocs_per_step = 2\n",
            )
            .unwrap(),
        );
        let relaying = |w: usize| {
            let addrs = vec!["10.0.0.1:7072"; w];
            crate::core::relay::Relaying::decide(&addrs, 2).expect("relayed")
        };
        let total = |w: usize| -> usize {
            let peers: Arc<[(WorkerId, String)]> = (0..w)
                .map(|i| {
                    (
                        uuid::Uuid::new_v4().to_string(),
                        format!("10.0.{}.{}:29500", i / 256, i % 256),
                    )
                })
                .collect();
            let priors: Vec<Option<HeldState>> = (0..w)
                .map(|r| {
                    Some(HeldState {
                        job: "j".into(),
                        step: 9,
                        world_size: w as u32,
                        rank: r as u32,
                        generation: 1,
                    })
                })
                .collect();
            let prior_runs: Arc<[_]> = crate::core::recovery::prior_runs(&priors).into();
            let priors: Arc<[Option<HeldState>]> = priors.into();
            (0..w)
                .map(|r| {
                    to_worker(&ToWorker::Configure {
                        link: crate::core::links::LinkSecret::generate(false),
                        job: "j".into(),
                        generation: 2,
                        rank: r as u32,
                        peers: peers.clone(),
                        priors: priors.clone(),
                        prior_runs: prior_runs.clone(),
                        spec: spec.clone(),
                        step: 9,
                        restore_from: None,
                        role: Role::Trainer,
                        weights: None,
                        // Relayed: a hub's Configure lists its √W
                        // followers, still O(W) in all.
                        relay: relaying(w).role(r as u32, w as u32, |h| format!("10.0.0.{h}:7072")),
                    })
                    .encoded_len()
                })
                .sum()
        };
        let (small, large) = (total(16), total(256));
        let ratio = large as f64 / small as f64;
        assert!(
            (15.0..17.0).contains(&ratio),
            "16 → 256 members: {small} → {large} bytes ({ratio:.1}×, linear is 16×)"
        );
    }

    #[test]
    fn configure_carries_each_peers_prior() {
        let h = held_from_wire(wire_held(0, 1)).unwrap();
        let priors = vec![Some(h), None];
        let spec: JobSpec = toml::from_str(
            "[job]\nname = \"t\"\noutput_dir = \"/o\"\n[model]\ninit = \"random\"\n\
             config = \"/c.json\"\n[data]\nformat = \"sft\"\n[batch]\ndocs_per_step = 2\n",
        )
        .unwrap();
        let msg = to_worker(&ToWorker::Configure {
            link: crate::core::links::LinkSecret::generate(false),
            job: "j".into(),
            generation: 4,
            rank: 1,
            peers: vec![("a".into(), "x:1".into()), ("b".into(), "x:2".into())].into(),
            priors: priors.clone().into(),
            prior_runs: crate::core::recovery::prior_runs(&priors).into(),
            spec: std::sync::Arc::new(spec),
            step: 7,
            restore_from: None,
            role: Role::Trainer,
            weights: None,
            relay: None,
        });
        let Some(wire::coordinator_message::Msg::Configure(c)) = msg.msg else {
            panic!("expected a configure");
        };
        // Rank 1 of 2: its neighbour is rank 0, the holder; it holds nothing.
        assert!(c.peers.is_empty());
        assert_eq!(
            c.next
                .as_ref()
                .map(|p| (p.rank, p.collective_addr.as_str())),
            Some((0, "x:1"))
        );
        assert_eq!(c.prior, None);
        let run = wire::PriorRun {
            rank: 0,
            count: 1,
            prior_rank: 0,
            prior_world_size: 1,
        };
        assert_eq!(c.priors, vec![run]);
        assert!(c.restore_from.is_empty());
        let job = c.job.expect("the resolved job travels with it");
        assert_eq!(job.sharding, wire::Sharding::Ddp as i32);
        assert_eq!(job.runtime.unwrap().loss_chunk_tokens, 1024);
    }
}

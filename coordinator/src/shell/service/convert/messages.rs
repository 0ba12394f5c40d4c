//! The coordinator's messages to a worker: Configure, step plans with their packed rows, and the rest.

use accrue_proto::{pack_f32, v1 as wire};
use prost::Message as _;

use super::job::{cursor, job_definition};
use super::metrics::abort_reason;
use super::worker::held_state;
use crate::core::relay::RelayRole;
use crate::core::{PlanKind, Role, ToWorker, WorkerId};
use crate::stream::plan::Normalizers;

fn normalizers(n: &Normalizers) -> wire::Normalizers {
    wire::Normalizers {
        loss_tokens: n.loss_tokens,
        pairs: n.pairs,
        documents: n.documents,
        sequences: n.sequences,
        tokens: n.tokens,
    }
}

/// The peer rank `rank` dials in the generation's ring (itself when alone).
fn ring_next(peers: &[(WorkerId, String)], rank: u32) -> Option<wire::Peer> {
    let next = (rank as usize + 1) % peers.len().max(1);
    peers.get(next).map(|(id, addr)| wire::Peer {
        rank: next as u32,
        worker_id: id.clone(),
        collective_addr: addr.clone(),
        prior: None,
    })
}

/// The member rank `rank` dials in its context-parallel group's ring
/// (groups of `context` consecutive ranks), numbered by its place in the
/// group; `None` without context parallelism.
fn context_next(peers: &[(WorkerId, String)], rank: u32, context: u32) -> Option<wire::Peer> {
    if context <= 1 {
        return None;
    }
    let (group, place) = (rank / context, rank % context);
    let next = (place + 1) % context;
    peers
        .get((group * context + next) as usize)
        .map(|(id, addr)| wire::Peer {
            rank: next,
            worker_id: id.clone(),
            collective_addr: addr.clone(),
            prior: None,
        })
}

/// A microbatch's row as the wire carries it: token ids little-endian, 4
/// bytes a token (`pack_u32` of its rows), and its labels as a loss mask
/// when every sequence's are its ids or ignored, else packed (`pack_i32`);
/// written straight from its documents' sequences.
pub struct PackedRows {
    pub token_ids: Vec<u8>,
    pub labels: Vec<u8>,
    pub loss_mask: Vec<u8>,
}

pub fn packed_rows(mb: &crate::core::step::MicrobatchPayload) -> PackedRows {
    let tokens = mb.tokens() as usize;
    let mut token_ids = Vec::with_capacity(tokens * 4);
    let mut mask = accrue_proto::LossMask::with_capacity(tokens);
    // Documents first (their addresses need no load), then their rows
    // (their addresses are in the documents), then the copying.
    mb.prefetch_docs();
    mb.sequences()
        .for_each(crate::stream::doc::Sequence::prefetch);
    if mb
        .sequences()
        .all(|s| s.write_masked(&mut token_ids, &mut mask))
    {
        return PackedRows {
            token_ids,
            labels: Vec::new(),
            loss_mask: mask.into_bytes(),
        };
    }
    // A sequence with other labels: the whole row again, labels packed.
    token_ids.clear();
    let mut labels = Vec::with_capacity(tokens * 4);
    for seq in mb.sequences() {
        seq.write_le(&mut token_ids, &mut labels);
    }
    PackedRows {
        token_ids,
        labels,
        loss_mask: Vec::new(),
    }
}

pub fn to_worker(msg: &ToWorker) -> wire::CoordinatorMessage {
    use wire::coordinator_message::Msg;
    let msg = match msg {
        m @ ToWorker::Configure { .. } => Msg::Configure(configure(m)),
        m @ ToWorker::Plan { .. } => Msg::StepPlan(step_plan(m)),
        ToWorker::Abort {
            job,
            generation,
            step,
            why,
        } => Msg::Abort(wire::Abort {
            job_id: job.clone(),
            generation: *generation,
            step: *step,
            detail: why.detail.clone(),
            reason: abort_reason(why.reason) as i32,
        }),
        ToWorker::Checkpoint {
            job,
            step,
            dir,
            cursor: c,
        } => Msg::CheckpointRequest(wire::CheckpointRequest {
            job_id: job.clone(),
            step: *step,
            dir: dir.display().to_string(),
            cursor: Some(cursor(c)),
        }),
        ToWorker::PublishPolicy { job, step, dir } => Msg::PublishPolicy(wire::PublishPolicy {
            job_id: job.clone(),
            step: *step,
            dir: dir
                .as_ref()
                .map(|d| d.display().to_string())
                .unwrap_or_default(),
            target: match dir {
                Some(_) => wire::PolicyTarget::Disk,
                None => wire::PolicyTarget::Generators,
            } as i32,
        }),
        ToWorker::SyncWeights {
            job,
            generation,
            version,
        } => Msg::SyncWeights(wire::SyncWeights {
            job_id: job.clone(),
            generation: *generation,
            version: *version,
        }),
        ToWorker::Release { job, reason } => Msg::Release(wire::Release {
            job_id: job.clone(),
            reason: reason.clone(),
        }),
        ToWorker::Generate {
            job,
            generation,
            rank,
            plan,
        } => Msg::GeneratePlan(crate::shell::service::generate::generate_plan(
            job,
            *generation,
            *rank,
            plan,
        )),
        // Each follower's message encoded here, in the hub's session task:
        // the hub forwards the bytes as they are.
        ToWorker::Relay {
            job,
            generation,
            messages,
        } => Msg::Relay(wire::Relay {
            job_id: job.clone(),
            generation: *generation,
            messages: messages
                .iter()
                .map(|(rank, m)| wire::Relayed {
                    rank: *rank,
                    message: to_worker(m).encode_to_vec(),
                })
                .collect(),
        }),
    };
    wire::CoordinatorMessage { msg: Some(msg) }
}

/// `msg` on the wire as messages of at most `limit` encoded bytes: a Relay
/// whose members' messages do not fit in one is cut into several, in
/// order (issue 33 (2): one Relay held ⌈√W⌉ ranks' plans and went over the
/// gRPC limit, which ended the hub's session, so the generation re-formed
/// for ever). One member's message that alone exceeds the limit goes in a
/// Relay of its own: it would not fit sent directly either.
pub fn to_worker_within(msg: &ToWorker, limit: usize) -> Vec<wire::CoordinatorMessage> {
    let ToWorker::Relay {
        job,
        generation,
        messages,
    } = msg
    else {
        return vec![to_worker(msg)];
    };
    let relay = |messages: Vec<wire::Relayed>| wire::CoordinatorMessage {
        msg: Some(wire::coordinator_message::Msg::Relay(wire::Relay {
            job_id: job.clone(),
            generation: *generation,
            messages,
        })),
    };
    // Exact sizes: a Relay of entries costing `sum` bytes encodes to its
    // base, plus `sum`, plus the outer tag and the length's varint.
    let varint = |n: usize| prost::encoding::encoded_len_varint(n as u64);
    let base = wire::Relay {
        job_id: job.clone(),
        generation: *generation,
        messages: Vec::new(),
    }
    .encoded_len();
    let tag = relay(Vec::new()).encoded_len() - varint(base) - base;
    let size = |sum: usize| tag + varint(base + sum) + base + sum;
    let cost = |r: &wire::Relayed| 1 + varint(r.encoded_len()) + r.encoded_len();
    let mut out = Vec::new();
    let (mut batch, mut sum) = (Vec::new(), 0);
    for (rank, m) in messages {
        let r = wire::Relayed {
            rank: *rank,
            message: to_worker(m).encode_to_vec(),
        };
        let c = cost(&r);
        if size(c) > limit {
            // It cannot be sent directly either: the session will refuse it.
            tracing::warn!(
                job = %job,
                rank = *rank,
                bytes = c,
                limit,
                "a relayed message alone exceeds the message limit"
            );
        }
        if !batch.is_empty() && size(sum + c) > limit {
            out.push(relay(std::mem::take(&mut batch)));
            sum = 0;
        }
        sum += c;
        batch.push(r);
    }
    if !batch.is_empty() || out.is_empty() {
        out.push(relay(batch));
    }
    out
}

/// A `ToWorker::Configure` on the wire: O(1) in the world size (this
/// rank's neighbour and prior, and the priors as runs).
fn configure(msg: &ToWorker) -> wire::Configure {
    let ToWorker::Configure {
        job,
        generation,
        rank,
        peers,
        priors,
        prior_runs,
        spec,
        step,
        restore_from,
        role,
        weights,
        relay,
        link,
    } = msg
    else {
        unreachable!("to_worker hands over Configures only")
    };
    wire::Configure {
        job_id: job.clone(),
        generation: *generation,
        rank: *rank,
        world_size: peers.len() as u32,
        // O(1) in the world size: the neighbour, this rank's prior and
        // the runs, never the whole membership.
        peers: Vec::new(),
        // A generator joins only the weight ring.
        next: match role {
            Role::Trainer => ring_next(peers, *rank),
            Role::Generator => None,
        },
        context_next: match role {
            Role::Trainer => context_next(peers, *rank, spec.parallel.context),
            Role::Generator => None,
        },
        role: match role {
            Role::Trainer => wire::Role::Trainer,
            Role::Generator => wire::Role::Generator,
        } as i32,
        weights: weights.as_ref().map(|w| wire::WeightRing {
            rank: w.rank,
            world_size: w.world,
            next: Some(wire::Peer {
                rank: (w.rank + 1) % w.world.max(1),
                worker_id: w.next.0.clone(),
                collective_addr: w.next.1.clone(),
                prior: None,
            }),
        }),
        prior: priors
            .get(*rank as usize)
            .and_then(Option::as_ref)
            .map(held_state),
        priors: prior_runs
            .iter()
            .map(|r| wire::PriorRun {
                rank: r.rank,
                count: r.count,
                prior_rank: r.prior_rank,
                prior_world_size: r.prior_world,
            })
            .collect(),
        job: Some(job_definition(spec)),
        link_key: link.key.to_vec(),
        seal_links: link.seal,
        step: *step,
        restore_from: restore_from
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        // Trainers answer train steps with one gathered message from
        // rank 0 (`Event::StepResults`); generators run no steps.
        gather_results: matches!(role, Role::Trainer),
        relay: relay.as_ref().map(|r| match r {
            RelayRole::Hub { key, followers } => wire::RelayRoute {
                token: key.to_vec(),
                hub_addr: String::new(),
                followers: followers.clone(),
                hub_rank: *rank,
            },
            RelayRole::Follower { key, hub, hub_addr } => wire::RelayRoute {
                token: key.to_vec(),
                hub_addr: hub_addr.clone(),
                followers: Vec::new(),
                hub_rank: *hub,
            },
        }),
    }
}

/// A `ToWorker::Plan` on the wire: this rank's microbatches, their token
/// rows materialised here (in the session's task, off the state lock).
fn step_plan(msg: &ToWorker) -> wire::StepPlan {
    let ToWorker::Plan {
        job,
        generation,
        rank,
        group,
        planned,
    } = msg
    else {
        unreachable!("to_worker hands over plans only")
    };
    wire::StepPlan {
        job_id: job.clone(),
        generation: *generation,
        step: planned.step,
        rank: *rank,
        lr: planned.lr,
        normalizers: Some(normalizers(&planned.normalizers)),
        microbatches: planned.ranks[*group as usize]
            .iter()
            .map(|mb| {
                // The token rows are materialised here, in the
                // session's task, outside the state lock.
                let rows = packed_rows(mb);
                wire::Microbatch {
                    token_ids: rows.token_ids,
                    labels: rows.labels,
                    loss_mask: rows.loss_mask,
                    cu_seq_lens: mb.cu_seq_lens.clone(),
                    sequences: mb
                        .seqs
                        .iter()
                        .map(|s| wire::PackedSequence {
                            doc_id: String::new(),
                            doc_file: s.doc.file,
                            doc_line: s.doc.line,
                            role: s.role,
                            advantage: s.advantage,
                            ref_logp: s.ref_logp,
                        })
                        .collect(),
                    // pack_f32 of an empty slice is empty.
                    old_logprobs: pack_f32(&mb.old_logprobs()),
                    ref_logprobs: pack_f32(&mb.ref_logprobs()),
                    source: mb.source,
                    routing: accrue_proto::pack_u16(&mb.routing()),
                }
            })
            .collect(),
        cursor_after: Some(cursor(&planned.cursor_after)),
        kind: match planned.kind {
            PlanKind::Train => wire::PlanKind::Train,
            PlanKind::Reference => wire::PlanKind::Reference,
            PlanKind::Probe => wire::PlanKind::Probe,
            PlanKind::Eval => wire::PlanKind::Eval,
        } as i32,
        replay: planned.replay,
        max_tokens: planned.settings.max_tokens,
    }
}

//! A committed step's record on the wire (`accrue steps`): its manifest,
//! or what its metrics hold for steps committed before manifests were kept.

use accrue_proto::v1 as wire;

use crate::core::manifest::StepManifest;
use crate::shell::store::StepRecord;

/// The wire form of a step record: its manifest, or what its metrics hold
/// for steps committed before manifests were kept.
pub fn step_manifest(r: &StepRecord, detail: bool) -> wire::StepManifest {
    let m = &r.metrics;
    let mut out = wire::StepManifest {
        step: m.step,
        generation: m.generation,
        world_size: m.world_size,
        lr: m.lr,
        documents: m.docs,
        tokens: m.tokens,
        rank_microbatches: m.microbatches.checked_div(m.world_size).unwrap_or(0),
        epoch: m.cursor.epoch,
        ..Default::default()
    };
    if detail {
        out.docs = r.docs.iter().map(ToString::to_string).collect();
    }
    let Some(man) = &r.manifest else {
        return out;
    };
    let s = &man.settings;
    out.base_lr = s.base_lr;
    out.docs_per_step = s.docs_per_step();
    out.tokens_per_step = s.tokens_per_step();
    out.microbatches_per_rank = s.microbatches_per_rank();
    out.max_tokens = s.max_tokens;
    out.tokens = man.tokens;
    out.rank_microbatches = man.microbatches_per_rank();
    out.attempts = man.attempts;
    out.replayed = man.replayed;
    out.epoch = man.epoch;
    out.complete = true;
    if detail {
        out.docs = man.docs().iter().map(ToString::to_string).collect();
        out.ranks = rank_layouts(man);
    }
    out
}

fn rank_layouts(man: &StepManifest) -> Vec<wire::StepRankLayout> {
    man.ranks
        .iter()
        .map(|mbs| wire::StepRankLayout {
            microbatches: mbs
                .iter()
                .map(|mb| wire::StepMicrobatch {
                    tokens: mb.tokens,
                    sequences: mb
                        .seqs
                        .iter()
                        .map(|q| wire::StepSequence {
                            doc: q.0.to_string(),
                            role: q.1,
                            tokens: q.2,
                        })
                        .collect(),
                })
                .collect(),
        })
        .collect()
}

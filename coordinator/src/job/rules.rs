//! The checks that read two or more sections of a spec, each a small
//! function taking the sections it ties together. `JobSpec::validate`
//! runs each after the sections it reads have checked themselves, so the
//! problems come out roughly in the order of the file.

use std::collections::BTreeSet;

use crate::job::batch::BatchSection;
use crate::job::data::{DataFormat, DataSection};
use crate::job::header::JobSection;
use crate::job::limits;
use crate::job::model::{Dtype, ModelSection};
use crate::job::objective::{ObjectiveKind, ObjectiveSection, Reference};
use crate::job::optimizer::OptimizerSection;
use crate::job::parallel::{ParallelSection, Sharding};
use crate::job::rl::{step_rollouts, RlSection};
use crate::job::runtime::PrecisionSection;
use crate::job::section::{bound, check_file, is_default};
use crate::job::sources::{self, EvalSection};

/// `job.steps` or `job.epochs`: a job trains for one of them, except a
/// streamed one, which may run until cancelled.
pub fn length_given(job: &JobSection, data: &DataSection, bad: &mut impl FnMut(&str, String)) {
    let open_ended = data.is_stream() && !data.is_generate();
    if job.steps.is_none() && job.epochs.is_none() && !open_ended {
        bad(
            "job.steps",
            "give exactly one of job.steps and job.epochs".into(),
        );
    }
}

/// A policy-gradient job reads one source: its stream's unit is a group
/// of rollouts, not a document (prompts are mixed upstream).
pub fn one_source_for_pg(
    data: &DataSection,
    objective: &ObjectiveSection,
    bad: &mut impl FnMut(&str, String),
) {
    if data.sources.len() > 1 && objective.kind == ObjectiveKind::Pg {
        bad(
            "data.sources",
            "a policy-gradient job reads one source (its stream's unit is a group of rollouts); mix prompts upstream".into(),
        );
    }
}

/// Sources mixed by docs per step fill exactly `batch.docs_per_step`.
pub fn source_docs_fill_step(
    data: &DataSection,
    batch: &BatchSection,
    bad: &mut impl FnMut(&str, String),
) {
    sources::validate_docs(&data.sources, "data.sources", batch.docs_per_step, bad);
}

/// `[eval]` against the training job: a streamed job has no held-out
/// files, a DPO eval takes its reference log-probs from the cached pass,
/// and no eval source is named like one of a mixture's training sources.
pub fn eval_fits_training(
    eval: &EvalSection,
    data: &DataSection,
    objective: &ObjectiveSection,
    bad: &mut impl FnMut(&str, String),
) {
    if data.is_stream() {
        bad("eval", "a streamed job has no eval sources".into());
    }
    if objective
        .dpo()
        .is_some_and(|d| d.reference != Reference::Cached)
    {
        bad(
            "eval",
            "evaluating a DPO job needs objective.reference = \"cached\" (the eval pairs' reference log-probs come from the cached pass)".into(),
        );
    }
    let train: BTreeSet<String> = data
        .train_sources(None)
        .into_iter()
        .map(|s| s.name)
        .collect();
    for (i, s) in eval.sources.iter().enumerate() {
        let n = sources::name_of(s, i);
        if train.contains(&n) && !data.sources.is_empty() {
            bad(
                &format!("eval.sources[{i}].name"),
                format!("{n:?} also names a training source"),
            );
        }
    }
}

/// Policy-gradient steps take whole groups of rollouts, which a fixed
/// count of microbatches per rank would cut.
pub fn pg_steps_take_groups(
    batch: &BatchSection,
    objective: &ObjectiveSection,
    bad: &mut impl FnMut(&str, String),
) {
    if batch.microbatches_per_rank.is_some() && objective.kind == ObjectiveKind::Pg {
        bad(
            "batch.microbatches_per_rank",
            "policy-gradient steps take whole groups of rollouts; use docs_per_step or tokens_per_step".into(),
        );
    }
}

/// Each objective reads its own data format (the RL loop reads prompts).
pub fn format_fits_objective(
    data: &DataSection,
    objective: &ObjectiveSection,
    bad: &mut impl FnMut(&str, String),
) {
    let expected = match objective.kind {
        ObjectiveKind::Sft => DataFormat::Sft,
        ObjectiveKind::Dpo => DataFormat::Dpo,
        ObjectiveKind::Pg if data.is_generate() => DataFormat::Prompts,
        ObjectiveKind::Pg => DataFormat::Rollouts,
    };
    if data.format != expected {
        bad(
            "objective.kind",
            format!(
                "{} needs data.format = {expected}, got {}",
                objective.kind, data.format
            ),
        );
    }
}

/// `[rl]` configures policy gradient only: any of it on another objective
/// would be ignored.
pub fn rl_needs_pg(
    rl: &RlSection,
    objective: &ObjectiveSection,
    bad: &mut impl FnMut(&str, String),
) {
    if !is_default(rl) && objective.kind != ObjectiveKind::Pg {
        bad("rl", "only applies to objective.kind = \"pg\"".into());
    }
}

/// The RL loop's settings apply only when the coordinator generates the
/// rollouts (`data.source = "generate"`).
pub fn rl_loop_fields_need_generate(
    data: &DataSection,
    rl: &RlSection,
    bad: &mut impl FnMut(&str, String),
) {
    if data.is_generate() {
        return;
    }
    for (field, given) in [
        // A served job's sampling defaults (`[rl.serve]`).
        ("rl.sampling", rl.sampling.is_some() && rl.serve.is_none()),
        ("rl.verifier", rl.verifier.is_some()),
        ("rl.prompts_per_round", rl.prompts_per_round.is_some()),
        ("rl.eval_prompts", !rl.eval_prompts.is_empty()),
        ("rl.eval_every", rl.eval_every.is_some()),
        ("rl.engine", rl.engine.is_some()),
        ("rl.generators", rl.generators.is_some()),
        ("rl.routing_replay", rl.routing_replay.is_some()),
        ("rl.env", rl.env.is_some()),
    ] {
        if given {
            bad(field, "only applies to data.source = \"generate\"".into());
        }
    }
}

/// `[rl.serve]`: a streamed job (the harness reports the rollouts) whose
/// policy turns run on its own training workers between steps; stop
/// strings are the harness's to apply (a call's `stop` is refused).
pub fn serve_fits(data: &DataSection, rl: &RlSection, bad: &mut impl FnMut(&str, String)) {
    if rl.serve.is_none() {
        return;
    }
    if data.source != crate::job::data::DataSource::Stream {
        bad(
            "rl.serve",
            "needs data.source = \"stream\": the agent harness driving the endpoint reports each episode's reward, which makes the job's rollouts".into(),
        );
    }
    if rl.sampling.as_ref().is_some_and(|s| !s.stop.is_empty()) {
        bad(
            "rl.sampling.stop",
            "does not apply to [rl.serve]: a call's stop strings are the harness's (the endpoint stops at the tokenizer's end-of-sequence token)".into(),
        );
    }
}

/// The RL loop (`data.source = "generate"`): its eval prompt files, at
/// least one training worker beside the generators, and a verifier.
pub fn rl_loop_fits(
    data: &DataSection,
    rl: &RlSection,
    parallel: &ParallelSection,
    bad: &mut impl FnMut(&str, String),
) {
    if !data.is_generate() {
        return;
    }
    for (i, f) in rl.eval_prompts.iter().enumerate() {
        check_file(bad, &format!("rl.eval_prompts[{i}]"), f);
    }
    if rl.eval_every.is_some() && rl.eval_prompts.is_empty() {
        bad("rl.eval_every", "needs rl.eval_prompts".into());
    }
    if let Some(g) = rl.generators.filter(|&g| g >= parallel.max_workers) {
        bad(
            "rl.generators",
            format!(
                "must be below parallel.max_workers = {} (got {g}): at least one worker trains",
                parallel.max_workers
            ),
        );
    }
    if rl.verifier.is_none() {
        bad(
            "rl.verifier",
            "required for data.source = \"generate\": how completions are scored ([rl.verifier] kind = \"exact\" | \"gsm8k\" | \"regex\" | \"command\")".into(),
        );
    }
}

/// A policy-gradient job that reads files groups its rollouts by their
/// "group" field: the stream's group and queue settings do not apply.
pub fn stream_fields_need_stream(
    data: &DataSection,
    objective: &ObjectiveSection,
    rl: &RlSection,
    bad: &mut impl FnMut(&str, String),
) {
    if data.is_stream() || objective.kind != ObjectiveKind::Pg {
        return;
    }
    for (field, given) in [
        ("rl.group_size", rl.group_size.is_some()),
        ("rl.queue_capacity", rl.queue_capacity.is_some()),
    ] {
        if given {
            bad(
                field,
                "only applies to data.source = \"stream\" (file rollouts group by their \"group\" field)".into(),
            );
        }
    }
}

/// A streamed job (`data.source = "stream"`, and the RL loop's) trains
/// policy gradient on rollouts that arrive while it runs: no epochs
/// (`job.steps`, or until cancelled), and steps counted by
/// `batch.docs_per_step` (in whole groups: [`stream_groups_fit_queue`]).
pub fn stream_fits(
    job: &JobSection,
    data: &DataSection,
    batch: &BatchSection,
    objective: &ObjectiveSection,
    bad: &mut impl FnMut(&str, String),
) {
    if !data.is_stream() {
        return;
    }
    if objective.kind != ObjectiveKind::Pg {
        bad(
            "data.source",
            "\"stream\" takes pushed rollouts: it needs objective.kind = \"pg\"".into(),
        );
    }
    // The cached pass runs before step 1 over the job's documents; pushed
    // rollouts arrive later, so they need the live reference.
    if objective
        .pg()
        .is_some_and(|p| p.kl_coef > 0.0 && p.reference == Reference::Cached)
    {
        bad(
            "objective.reference",
            "a streamed job's KL penalty needs reference = \"live\" (the cached pass runs before step 1, over file rollouts only)".into(),
        );
    }
    if job.epochs.is_some() {
        bad(
            "job.epochs",
            "a streamed job has no epochs: give job.steps, or neither to run until cancelled"
                .into(),
        );
    }
    if batch.docs_per_step.is_none() {
        bad(
            "batch.docs_per_step",
            "required for a streamed job (a step takes whole groups until it holds this many rollouts)".into(),
        );
    }
}

/// A streamed job's rollouts come in groups of `rl.group_size`, and its
/// queue holds at least one step of whole groups.
pub fn stream_groups_fit_queue(
    data: &DataSection,
    batch: &BatchSection,
    rl: &RlSection,
    bad: &mut impl FnMut(&str, String),
) {
    if !data.is_stream() {
        return;
    }
    match rl.group_size {
        None => bad(
            "rl.group_size",
            "required for a streamed job: rollouts per group (a group is trained once complete)"
                .into(),
        ),
        Some(g) if g < 2 => bad(
            "rl.group_size",
            format!("must be at least 2 (a group of one has no reward variance), got {g}"),
        ),
        Some(g) if g > limits::MAX_GROUP_SIZE => bound(
            bad,
            "rl.group_size",
            u64::from(g),
            u64::from(limits::MAX_GROUP_SIZE),
            "rollouts per group",
        ),
        Some(g) => {
            if let Some(docs) = batch.docs_per_step {
                let step = step_rollouts(docs, g);
                let cap = rl.queue_capacity_or_default(docs);
                if let Some(q) = rl.queue_capacity {
                    bound(
                        bad,
                        "rl.queue_capacity",
                        q,
                        limits::MAX_QUEUE_ROLLOUTS,
                        "rollouts",
                    );
                }
                if cap < step {
                    bad(
                        "rl.queue_capacity",
                        format!("{cap} cannot hold one step: {step} rollouts (docs_per_step = {docs} in whole groups of {g})"),
                    );
                }
            }
        }
    }
}

/// fsdp shards the model so that no rank holds it whole: a live reference
/// (a frozen full copy on every rank) would undo that, so fsdp jobs take
/// the cached reference pass.
pub fn fsdp_takes_cached_reference(
    parallel: &ParallelSection,
    objective: &ObjectiveSection,
    lora: bool,
    bad: &mut impl FnMut(&str, String),
) {
    // A LoRA job's reference is its own base with the adapters off: no copy.
    if parallel.sharding != Sharding::Fsdp || lora {
        return;
    }
    let live = objective.dpo().map(|d| d.reference) == Some(Reference::Live)
        || objective
            .pg()
            .is_some_and(|p| p.kl_coef > 0.0 && p.reference == Reference::Live);
    if live {
        bad(
            "objective.reference",
            "parallel.sharding = \"fsdp\" needs reference = \"cached\" (a live reference keeps a full frozen copy of the model on every rank)".into(),
        );
    }
}

/// Context parallelism splits a row's tokens over ranks: LoRA dropout's
/// masks are drawn per row position on one rank (`lora::DropoutKeys`), not
/// yet per share.
pub fn context_fits(
    parallel: &ParallelSection,
    lora: Option<&crate::job::lora::LoraSection>,
    bad: &mut impl FnMut(&str, String),
) {
    if parallel.context > 1 && lora.is_some_and(|l| l.dropout > 0.0) {
        bad(
            "parallel.context",
            "context parallelism does not run LoRA dropout yet: set lora.dropout = 0".into(),
        );
    }
}

/// A LoRA job's engine must load each step's adapter folder: vLLM's
/// runtime LoRA loading does (`rl::engine::wire::reload_requests`);
/// SGLang's weight update and `reload = "none"` would serve the base.
pub fn lora_fits(rl: &RlSection, bad: &mut impl FnMut(&str, String)) {
    if let Some(engine) = &rl.engine {
        if engine.reload != crate::job::engine::EngineReload::Vllm {
            bad(
                "rl.engine.reload",
                "[lora] with an external engine needs reload = \"vllm\" (it loads each step's adapter with /v1/load_lora_adapter; start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)".into(),
            );
        }
    }
}

/// The warmup fits in the job's steps (when it counts them).
pub fn warmup_within_steps(
    optimizer: &OptimizerSection,
    job: &JobSection,
    bad: &mut impl FnMut(&str, String),
) {
    if let Some(steps) = job.steps {
        if optimizer.warmup_steps > steps {
            bad(
                "optimizer.warmup_steps",
                format!(
                    "{} is more than job.steps = {steps}",
                    optimizer.warmup_steps
                ),
            );
        }
    }
}

/// Mixed precision narrows the compute dtype below the parameters', never
/// the other way round.
pub fn compute_no_wider_than_params(
    model: &ModelSection,
    precision: &PrecisionSection,
    bad: &mut impl FnMut(&str, String),
) {
    if model.dtype == Dtype::Bfloat16 && precision.compute_dtype(model.dtype) == Dtype::Float32 {
        bad(
            "precision.compute",
            "float32 compute with bfloat16 parameters would only widen rounded weights; \
             use model.dtype = \"float32\" with precision.compute = \"bfloat16\" for mixed precision"
                .into(),
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::job::spec::JobSpec;

    #[test]
    fn fsdp_takes_only_the_cached_reference() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("c.json"), "{}").unwrap();
        let spec = |format: &str, objective: &str| {
            format!(
                "[job]\nname = \"f\"\noutput_dir = \"o\"\nsteps = 1\n[model]\ninit = \"random\"\n\
                 config = \"c.json\"\n[data]\nformat = \"{format}\"\ntrain = [\"c.json\"]\n\
                 [batch]\ndocs_per_step = 4\n[objective]\n{objective}\n\
                 [parallel]\nsharding = \"fsdp\"\n"
            )
        };
        let fields = |text: String| -> Vec<String> {
            match JobSpec::parse(&text, dir.path()) {
                Ok(_) => Vec::new(),
                Err(problems) => problems.into_iter().map(|p| p.field).collect(),
            }
        };
        let refused = ["objective.reference"];
        assert_eq!(
            fields(spec("dpo", "kind = \"dpo\"\nreference = \"live\"")),
            refused
        );
        assert!(fields(spec("dpo", "kind = \"dpo\"")).is_empty());
        let pg_live = "kind = \"pg\"\nkl_coef = 0.1\nreference = \"live\"";
        assert_eq!(fields(spec("rollouts", pg_live)), refused);
        assert!(fields(spec("rollouts", "kind = \"pg\"\nkl_coef = 0.1")).is_empty());
        // No KL: the reference setting is moot.
        assert!(fields(spec("rollouts", "kind = \"pg\"\nreference = \"live\"")).is_empty());
    }

    #[test]
    fn streamed_jobs_are_validated_with_field_paths() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("c.json"), "{}").unwrap();
        let spec = |data: &str, batch: &str, rl: &str, job: &str| {
            format!(
                "[job]\nname = \"s\"\noutput_dir = \"o\"\n{job}\n[model]\ninit = \"random\"\n\
                 config = \"c.json\"\n[data]\nformat = \"rollouts\"\nsource = \"stream\"\n{data}\n\
                 [batch]\n{batch}\n[objective]\nkind = \"pg\"\n[rl]\n{rl}\n"
            )
        };
        let ok = spec("", "docs_per_step = 5", "group_size = 2", "");
        let parsed = JobSpec::parse(&ok, dir.path()).unwrap();
        assert!(parsed.data.is_stream() && parsed.job.steps.is_none());
        assert_eq!(
            parsed.rl.queue_capacity_or_default(5),
            24,
            "4 steps of 3 groups of 2"
        );
        let fields = |text: String| -> Vec<String> {
            JobSpec::parse(&text, dir.path())
                .unwrap_err()
                .into_iter()
                .map(|p| p.field)
                .collect()
        };
        let f = fields(spec(
            "train = [\"c.json\"]",
            "tokens_per_step = 100",
            "group_size = 1",
            "epochs = 1",
        ));
        for want in [
            "data.train",
            "job.epochs",
            "batch.docs_per_step",
            "rl.group_size",
        ] {
            assert!(f.iter().any(|x| x == want), "{want} not in {f:?}");
        }
        let f = fields(spec("", "docs_per_step = 5", "queue_capacity = 5", ""));
        assert_eq!(f, ["rl.group_size"]);
        let f = fields(spec(
            "",
            "docs_per_step = 5",
            "group_size = 2\nqueue_capacity = 5",
            "",
        ));
        assert_eq!(f, ["rl.queue_capacity"], "5 < one step of 6");
        let files = ok
            .replace("source = \"stream\"", "train = [\"c.json\"]")
            .replace("[job]", "[job]\nsteps = 1");
        assert_eq!(fields(files), ["rl.group_size"], "only for streams");
        // [rl.serve]: a stream's, with the calls' sampling defaults; no
        // stop strings; bounds at least 1.
        let served = ok.replace(
            "group_size = 2",
            "group_size = 2\n[rl.sampling]\nmax_new_tokens = 64\n[rl.serve]\nmax_waiting = 8",
        );
        let parsed = JobSpec::parse(&served, dir.path()).unwrap();
        assert_eq!(parsed.rl.serve.unwrap().max_waiting, 8);
        let f = fields(served.replace("max_new_tokens = 64", "stop = [\"x\"]"));
        assert_eq!(f, ["rl.sampling.stop"]);
        let f = fields(served.replace("max_waiting = 8", "max_waiting = 0"));
        assert_eq!(f, ["rl.serve.max_waiting"]);
        let f = fields(ok.replace("group_size = 2", "group_size = 2\n[rl.sampling]\n"));
        assert_eq!(
            f,
            ["rl.sampling"],
            "sampling is the loop's or the endpoint's"
        );
        // A KL penalty: cached needs file rollouts, live works everywhere.
        let kl = ok.replace("kind = \"pg\"", "kind = \"pg\"\nkl_coef = 0.1");
        assert_eq!(fields(kl.clone()), ["objective.reference"]);
        let live = kl.replace("kl_coef = 0.1", "kl_coef = 0.1\nreference = \"live\"");
        JobSpec::parse(&live, dir.path()).unwrap();
        let from_files = kl
            .replace("source = \"stream\"", "train = [\"c.json\"]")
            .replace("[job]", "[job]\nsteps = 1")
            .replace("group_size = 2", "");
        JobSpec::parse(&from_files, dir.path()).unwrap();
    }

    #[test]
    fn rl_section_only_for_pg() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("c.json"), "{}").unwrap();
        let text = "[job]\nname = \"r\"\noutput_dir = \"o\"\nsteps = 1\n[model]\n\
                    init = \"random\"\nconfig = \"c.json\"\n[data]\nformat = \"sft\"\n\
                    train = [\"c.json\"]\n[batch]\ndocs_per_step = 4\n\
                    [rl]\nmax_staleness = 2\npublish_every = 0\n";
        let out: Vec<String> = JobSpec::parse(text, dir.path())
            .unwrap_err()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(out[0].starts_with("rl: only applies"));
        assert!(out[1].starts_with("rl.publish_every"));
    }
}

//! Generation (issue 17): the KV-cache decode with continuous batching
//! gives what recomputing the whole sequence every token gives, and what
//! transformers' `generate` gives on the same weights; sampling depends on
//! the seed only; the returned log-probs are a training forward's; stops
//! are honoured.

mod common;

use accrue_worker::batch::PackedBatch;
use accrue_worker::generate::sampler::{log_sum_exp, Sampler};
use accrue_worker::generate::stop::finished;
use accrue_worker::generate::{generate, Completion, Finish, Request, SamplingParams};
use accrue_worker::model::{Init, Llama, ModelConfig};
use accrue_worker::objective::head::token_logps;
use accrue_worker::runner::{default_factory, Runner, Work};
use accrue_worker::wire;
use accrue_worker::wire::worker_message::Msg;
use tch::{Device, Kind, Tensor};

fn tiny_model(seed: u64) -> Llama {
    let raw: serde_json::Value = serde_json::from_str(common::TINY_CONFIG).unwrap();
    let cfg: ModelConfig = serde_json::from_value(raw.clone()).unwrap();
    Llama::new(cfg, raw, Kind::Float, Device::Cpu, Init::Seeded(seed)).unwrap()
}

/// Prompts of different lengths (1 token included), more than a batch.
fn requests(n: usize) -> Vec<Request> {
    let lens = [7usize, 1, 12, 3, 9, 5, 2];
    (0..n)
        .map(|i| Request {
            prompt: (0..lens[i % lens.len()])
                .map(|j| ((i * 37 + j * 11 + 5) % 300) as i64)
                .collect(),
            seed: 1000 + i as u64,
        })
        .collect()
}

/// The slow reference: every token recomputes the whole sequence with the
/// training forward (no cache, one request at a time), same sampler.
fn recompute(model: &Llama, params: &SamplingParams, r: &Request) -> Completion {
    let mut seq = r.prompt.clone();
    let mut sampler = Sampler::new(r.seed);
    let (mut tokens, mut logprobs) = (Vec::new(), Vec::new());
    loop {
        let logits = tch::no_grad(|| model.logits(&seq, &[0, seq.len() as i64]));
        let row = Vec::<f32>::try_from(logits.get(seq.len() as i64 - 1)).unwrap();
        let (t, lp) = sampler.sample(params, &row, log_sum_exp(&row));
        tokens.push(t as i64);
        logprobs.push(lp);
        seq.push(t as i64);
        if let Some(finish) = finished(params, &tokens) {
            return Completion {
                tokens,
                logprobs,
                finish,
                routing: Vec::new(),
            };
        }
    }
}

fn sampled(max_batch: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        max_new_tokens: 9,
        max_batch,
        ..SamplingParams::default()
    }
}

#[test]
fn kv_cache_decode_equals_recomputing_the_whole_sequence() {
    let model = tiny_model(3);
    let reqs = requests(7);
    let mut greedy = SamplingParams {
        max_new_tokens: 11,
        max_batch: 3,
        ..SamplingParams::default()
    };
    // A stop id request 1 draws third: slots free at different steps, and
    // the last steps decode slots that are not 0..n (a gather of the cache).
    greedy.stop_ids = vec![recompute(&model, &greedy, &reqs[1]).tokens[2]];
    for params in [greedy, sampled(3)] {
        let ours = generate(&model, &params, &reqs).unwrap();
        if params.temperature == 0.0 {
            assert_eq!(ours[1].finish, Finish::Stop);
            assert!(ours[1].tokens.len() <= 3);
        }
        for (i, (r, c)) in reqs.iter().zip(&ours).enumerate() {
            let want = recompute(&model, &params, r);
            assert_eq!(c.tokens, want.tokens, "request {i} ({params:?})");
            assert_eq!(c.finish, want.finish, "request {i}");
            for (a, b) in c.logprobs.iter().zip(&want.logprobs) {
                assert!((a - b).abs() < 1e-4, "request {i}: log-prob {a} vs {b}");
            }
        }
    }
}

#[test]
fn same_seed_same_completions_whatever_the_batch() {
    let model = tiny_model(5);
    let reqs = requests(6);
    let one = generate(&model, &sampled(1), &reqs).unwrap();
    for b in [2, 4, 16] {
        let other = generate(&model, &sampled(b), &reqs).unwrap();
        let tokens = |c: &[Completion]| c.iter().map(|c| c.tokens.clone()).collect::<Vec<_>>();
        assert_eq!(tokens(&one), tokens(&other), "max_batch {b}");
    }
    // A different seed draws differently (the seed is used at all).
    let mut reseeded = reqs.clone();
    for r in &mut reseeded {
        r.seed += 1;
    }
    let again = generate(&model, &sampled(4), &reseeded).unwrap();
    assert_ne!(
        one.iter().map(|c| &c.tokens).collect::<Vec<_>>(),
        again.iter().map(|c| &c.tokens).collect::<Vec<_>>()
    );
}

/// A training forward over `docs` (ids, labels) packed: the final hidden
/// states, the shifted targets, and the log-prob of every labelled token.
fn training_logprobs(model: &Llama, docs: &[(Vec<i64>, Vec<i64>)]) -> (Tensor, Vec<i64>, Vec<f64>) {
    let b = PackedBatch::from_documents(docs);
    let targets = accrue_worker::model::loss::shifted_targets(&b.labels, &b.cu_seq_lens);
    let hidden = tch::no_grad(|| model.hidden(&b.input_ids, &b.cu_seq_lens));
    let lp = token_logps(&hidden, model.lm_head_weight(), &targets, 64, None).unwrap();
    let labelled = lp
        .iter()
        .zip(&targets)
        .filter(|(_, &t)| t != -100)
        .map(|(l, _)| *l)
        .collect();
    (hidden, targets, labelled)
}

/// Largest |a − b| over the pairs.
fn worst_diff(a: &[f64], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - f64::from(*y)).abs())
        .fold(0.0, f64::max)
}

#[test]
fn returned_logprobs_equal_a_training_forward() {
    let model = tiny_model(7);
    let reqs = requests(5);
    let out = generate(&model, &sampled(2), &reqs).unwrap();
    // prompt + completion as training documents, the completion labelled.
    let docs: Vec<(Vec<i64>, Vec<i64>)> = reqs
        .iter()
        .zip(&out)
        .map(|(r, c)| {
            let ids = [r.prompt.clone(), c.tokens.clone()].concat();
            let labels = [vec![-100; r.prompt.len()], c.tokens.clone()].concat();
            (ids, labels)
        })
        .collect();
    let (_, _, train) = training_logprobs(&model, &docs);
    let ours: Vec<f32> = out.iter().flat_map(|c| c.logprobs.clone()).collect();
    assert_eq!(train.len(), ours.len());
    let worst = worst_diff(&train, &ours);
    assert!(worst < 1e-4, "log-probs differ from training by {worst}");
}

#[test]
fn stop_ids_stop_sequences_and_max_new_tokens_are_honoured() {
    let model = tiny_model(3);
    let reqs = requests(4);
    let free = SamplingParams {
        max_new_tokens: 8,
        max_batch: 2,
        ..SamplingParams::default()
    };
    let base = generate(&model, &free, &reqs).unwrap();
    for c in &base {
        assert_eq!((c.tokens.len(), c.finish), (8, Finish::Length));
    }
    // Request 0's 4th token as a stop id: it ends there, the id kept.
    let stop = base[0].tokens[3];
    let cut = |c: &Completion, n: usize| c.tokens[..n].to_vec();
    let first = base[0].tokens.iter().position(|&t| t == stop).unwrap();
    let by_id = generate(
        &model,
        &SamplingParams {
            stop_ids: vec![stop],
            ..free.clone()
        },
        &reqs,
    )
    .unwrap();
    assert_eq!(by_id[0].tokens, cut(&base[0], first + 1));
    assert_eq!(by_id[0].finish, Finish::Stop);
    // Tokens 2..5 of request 1 as a stop sequence.
    let seq = base[1].tokens[2..5].to_vec();
    let by_seq = generate(
        &model,
        &SamplingParams {
            stop_sequences: vec![seq.clone()],
            ..free.clone()
        },
        &reqs,
    )
    .unwrap();
    let end = (3..=8)
        .find(|&n| base[1].tokens[..n].ends_with(&seq))
        .unwrap();
    assert_eq!(by_seq[1].tokens, cut(&base[1], end));
    assert_eq!(by_seq[1].finish, Finish::Stop);
    // The others are cut where they contain it, or run to the length.
    for (b, c) in base.iter().zip(&by_seq) {
        assert!(b.tokens.starts_with(&c.tokens));
    }
    let none = generate(
        &model,
        &SamplingParams {
            max_new_tokens: 0,
            ..free
        },
        &reqs,
    )
    .unwrap();
    assert!(none
        .iter()
        .all(|c| c.tokens.is_empty() && c.finish == Finish::Length));
}

#[test]
fn bad_prompts_are_data_errors() {
    let model = tiny_model(3);
    let params = SamplingParams::default();
    for prompt in [vec![], vec![1, 300]] {
        let e = generate(&model, &params, &[Request { prompt, seed: 0 }]).unwrap_err();
        let (kind, _) = accrue_worker::error::classify(&e);
        assert_eq!(kind, accrue_worker::wire::ErrorKind::Data, "{e:#}");
    }
}

/// Greedy decoding equals transformers `generate(do_sample=False)` with its
/// KV cache on the same checkpoint, token for token.
#[test]
fn greedy_equals_transformers_generate() {
    greedy_equals_generate("llama");
}

/// Per family: prefill and KV-cache decode run the family's block (q/k
/// norms, post-norms, Gemma's scales and two RoPE tables); the sliding
/// window (8) is shorter than the sequences (up to 24 tokens), so decode's
/// windowed mask is exercised.
#[test]
fn greedy_equals_transformers_generate_qwen3() {
    greedy_equals_generate("qwen3");
}

#[test]
fn greedy_equals_transformers_generate_olmo2() {
    greedy_equals_generate("olmo2");
}

#[test]
fn greedy_equals_transformers_generate_mistral_sliding_window() {
    greedy_equals_generate("mistral");
}

#[test]
fn greedy_equals_transformers_generate_gemma3() {
    greedy_equals_generate("gemma3");
}

fn greedy_equals_generate(variant: &str) {
    let dir = tempfile::tempdir().unwrap();
    common::make_reference(dir.path(), variant);
    let model_dir = dir.path().join("model");
    let model =
        accrue_worker::train::source::load_model(&model_dir, Kind::Float, Device::Cpu).unwrap();
    let reqs = requests(5);
    let max_new = 12;
    let params = SamplingParams {
        max_new_tokens: max_new,
        max_batch: 2,
        ..SamplingParams::default()
    };
    let ours = generate(&model, &params, &reqs).unwrap();
    let prompts: Vec<(String, Tensor)> = reqs
        .iter()
        .enumerate()
        .map(|(i, r)| (format!("prompt{i}"), Tensor::from_slice(&r.prompt)))
        .collect();
    let input = dir.path().join("prompts.safetensors");
    Tensor::write_safetensors(&prompts, &input).unwrap();
    let out = dir.path().join("hf_completions.safetensors");
    common::python(
        "hf_generate.py",
        &[
            model_dir.to_str().unwrap(),
            input.to_str().unwrap(),
            &max_new.to_string(),
            out.to_str().unwrap(),
        ],
    );
    let theirs = common::read(&out);
    for (i, c) in ours.iter().enumerate() {
        let want = Vec::<i64>::try_from(&theirs[&format!("completion{i}")]).unwrap();
        assert_eq!(c.tokens, want, "{variant}: request {i}");
    }
}

/// `scripts/bench_generate.sh`: tokens/s of greedy generation of the
/// prompts and checkpoint in `ACCRUE_BENCH_DIR` (made by
/// `bench_hf_generate.py make`), all prompts in one batch, one JSON line.
#[test]
#[ignore = "benchmark: run by scripts/bench_generate.sh"]
fn bench_generate() {
    let dir = std::path::PathBuf::from(std::env::var("ACCRUE_BENCH_DIR").unwrap());
    let max_new: usize = std::env::var("ACCRUE_BENCH_MAX_NEW").map_or(64, |s| s.parse().unwrap());
    let threads: i32 = std::env::var("OMP_NUM_THREADS").map_or(2, |s| s.parse().unwrap());
    tch::set_num_threads(threads);
    let model =
        accrue_worker::train::source::load_model(&dir.join("model"), Kind::Float, Device::Cpu)
            .unwrap();
    let prompts = common::read(&dir.join("prompts.safetensors"));
    let reqs: Vec<Request> = (0..prompts.len())
        .map(|i| Request {
            prompt: Vec::<i64>::try_from(&prompts[&format!("prompt{i}")]).unwrap(),
            seed: i as u64,
        })
        .collect();
    // `ACCRUE_BENCH_KV_PAGE`: the KV cache's page (the default when
    // unset; one longer than every sequence is the static layout).
    let page: usize = std::env::var("ACCRUE_BENCH_KV_PAGE").map_or(0, |s| s.parse().unwrap());
    let params = SamplingParams {
        max_new_tokens: max_new,
        max_batch: reqs.len(),
        kv_page_tokens: page,
        ..SamplingParams::default()
    };
    // Warm-up (allocator, kernels), as the HF side does.
    generate(
        &model,
        &SamplingParams {
            max_new_tokens: 2,
            ..params.clone()
        },
        &reqs[..1],
    )
    .unwrap();
    let start = std::time::Instant::now();
    let out = generate(&model, &params, &reqs).unwrap();
    let seconds = start.elapsed().as_secs_f64();
    let tokens: usize = out.iter().map(|c| c.tokens.len()).sum();
    println!(
        "{}",
        serde_json::json!({"impl": match page { 0 => "accrue-generate".to_string(), p => format!("accrue-generate-page{p}") },
                           "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens as f64 / seconds})
    );
}

fn next(rx: &mut tokio::sync::mpsc::UnboundedReceiver<accrue_worker::wire::WorkerMessage>) -> Msg {
    for _ in 0..3000 {
        if let Ok(m) = rx.try_recv() {
            return m.msg.unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("no message from the runner");
}

/// A runner configured with the tiny random job (`extra` continues its
/// `[model]` section), at generation 1 step 0.
fn configured(
    dir: &std::path::Path,
    extra: &str,
) -> (
    Runner,
    tokio::sync::mpsc::UnboundedReceiver<accrue_worker::wire::WorkerMessage>,
) {
    let config = dir.join("config.json");
    std::fs::write(&config, common::TINY_CONFIG).unwrap();
    let job = common::job_definition(
        "random",
        &format!("config = \"{}\"\n{extra}", config.display()),
    );
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runner = Runner::spawn(default_factory(), tx);
    runner.submit(Work::Configure(Box::new(wire::Configure {
        link_key: vec![9; 32],
        job_id: "j".into(),
        generation: 1,
        world_size: 1,
        job: Some(job),
        step: 0,
        ..Default::default()
    })));
    assert!(matches!(next(&mut rx), Msg::Ready(_)));
    (runner, rx)
}

fn plan(reqs: &[Request], policy_version: u64) -> wire::GeneratePlan {
    wire::GeneratePlan {
        job_id: "j".into(),
        generation: 1,
        round: 4,
        rank: 0,
        policy_version,
        sampling: Some(wire::SamplingParams {
            record_routing: Default::default(),
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 6,
            stop_ids: vec![],
            stop_sequences: vec![],
            max_batch: 2,
        }),
        requests: reqs
            .iter()
            .enumerate()
            .map(|(i, r)| wire::GenerateRequest {
                prompt_id: format!("p:{i}"),
                sample: 1,
                prompt_ids: accrue_proto::pack_u32(
                    &r.prompt.iter().map(|&t| t as u32).collect::<Vec<_>>(),
                ),
                seed: r.seed,
            })
            .collect(),
    }
}

/// A generate plan on the runner thread answers with the completions of the
/// replica's weights, tagged with the plan's round and policy version; a
/// plan for another policy version is refused as an invalid plan.
#[test]
fn the_runner_answers_a_generate_plan_with_the_replicas_completions() {
    let dir = tempfile::tempdir().unwrap();
    let (runner, mut rx) = configured(dir.path(), "");
    let reqs = requests(3);
    runner.submit(Work::Generate(Box::new(plan(&reqs, 0))));
    let Msg::GenerateResult(r) = next(&mut rx) else {
        panic!("expected a generate result");
    };
    assert_eq!(
        (r.job_id.as_str(), r.generation, r.round, r.policy_version),
        ("j", 1, 4, 0)
    );
    assert!(r.seconds > 0.0);
    // The same weights (the job's seeded init) decoded directly.
    let cfg = common::random_job(dir.path(), "");
    let trainer = accrue_worker::train::ReplicatedTrainer::single(&cfg, None).unwrap();
    let params = SamplingParams {
        max_new_tokens: 6,
        max_batch: 2,
        ..SamplingParams::default()
    };
    let want = generate(trainer.model(), &params, &reqs).unwrap();
    assert_eq!(r.completions.len(), 3);
    for (i, (c, w)) in r.completions.iter().zip(&want).enumerate() {
        assert_eq!((c.prompt_id.clone(), c.sample), (format!("p:{i}"), 1));
        let ids: Vec<i64> = accrue_proto::unpack_u32(&c.token_ids)
            .unwrap()
            .into_iter()
            .map(i64::from)
            .collect();
        assert_eq!(ids, w.tokens, "completion {i}");
        assert_eq!(accrue_proto::unpack_f32(&c.logprobs).unwrap(), w.logprobs);
        assert_eq!(c.finish, wire::FinishReason::Length as i32);
    }
    runner.submit(Work::Generate(Box::new(plan(&reqs, 3))));
    let Msg::Error(e) = next(&mut rx) else {
        panic!("expected an error");
    };
    assert_eq!(e.kind, wire::ErrorKind::InvalidPlan as i32);
    assert_eq!(e.step, 4, "errors carry the round");
    assert!(e.message.contains("policy version 3"), "{}", e.message);
    runner.shutdown();
}

/// Under fsdp and zero2 the runner answers a generate plan too (fsdp
/// gathers the model for the round): the completions are those of the
/// job's initial weights decoded directly, and a plan at another policy
/// version is still refused (after telling the other ranks, here none).
#[test]
fn fsdp_and_zero2_runners_answer_a_generate_plan() {
    let reqs = requests(3);
    for sharding in ["fsdp", "zero2"] {
        let dir = tempfile::tempdir().unwrap();
        let extra = format!("[parallel]\nsharding = \"{sharding}\"");
        let (runner, mut rx) = configured(dir.path(), &extra);
        runner.submit(Work::Generate(Box::new(plan(&reqs, 0))));
        let Msg::GenerateResult(r) = next(&mut rx) else {
            panic!("{sharding}: expected a generate result");
        };
        let cfg = common::random_job(dir.path(), "");
        let trainer = accrue_worker::train::ReplicatedTrainer::single(&cfg, None).unwrap();
        let params = SamplingParams {
            max_new_tokens: 6,
            max_batch: 2,
            ..SamplingParams::default()
        };
        let want = generate(trainer.model(), &params, &reqs).unwrap();
        assert_eq!(r.completions.len(), 3, "{sharding}");
        for (i, (c, w)) in r.completions.iter().zip(&want).enumerate() {
            let ids: Vec<i64> = accrue_proto::unpack_u32(&c.token_ids)
                .unwrap()
                .into_iter()
                .map(i64::from)
                .collect();
            assert_eq!(ids, w.tokens, "{sharding}: completion {i}");
        }
        runner.submit(Work::Generate(Box::new(plan(&reqs, 3))));
        let Msg::Error(e) = next(&mut rx) else {
            panic!("{sharding}: expected an error");
        };
        assert_eq!(e.kind, wire::ErrorKind::InvalidPlan as i32);
        assert!(e.message.contains("policy version 3"), "{}", e.message);
        runner.shutdown();
    }
}

/// Groups of samples of one prompt, as the RL loop deals them: `groups`
/// prompts of different lengths, `size` requests each, every one its own
/// seed.
fn grouped(groups: usize, size: usize) -> Vec<Request> {
    let lens = [11usize, 4, 23, 1, 8, 15];
    (0..groups)
        .flat_map(|g| {
            let prompt: Vec<i64> = (0..lens[g % lens.len()])
                .map(|j| ((g * 53 + j * 7 + 1) % 300) as i64)
                .collect();
            (0..size).map(move |s| Request {
                prompt: prompt.clone(),
                seed: 10_000 + (g * size + s) as u64,
            })
        })
        .collect()
}

/// Largest log-prob difference between two runs with the same tokens.
fn worst_logprob(a: &[Completion], b: &[Completion]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            x.logprobs
                .iter()
                .zip(&y.logprobs)
                .map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

/// Shared-prompt prefill (a group's prompt run once, its keys and values
/// copied into the group's slots) gives what prefilling every request
/// gives. One sequence at a time, every prefill is the same computation
/// either way: completions and log-probs are bit-identical. Several at
/// once, the unshared path's own numbers depend on how prompts are packed
/// (a prompt beside its copies is another matrix shape): the tokens and
/// finishes are identical, whether a group fills slots at once or across
/// refills (a batch smaller than a group, stops freeing slots at different
/// steps), and the log-probs agree within 1e-5 (rounding: the unshared
/// path moves as much between batch sizes; both printed).
#[test]
fn shared_prompt_prefill_equals_prefilling_every_request() {
    let model = tiny_model(9);
    let reqs = grouped(5, 4);
    let tokens = |c: &[Completion]| {
        c.iter()
            .map(|c| (c.tokens.clone(), c.finish))
            .collect::<Vec<_>>()
    };
    for stop in [vec![], vec![17, 99, 123]] {
        let params = |max_batch: usize, share_prompts: bool| SamplingParams {
            stop_ids: stop.clone(),
            max_new_tokens: 12,
            share_prompts,
            ..sampled(max_batch)
        };
        let one = generate(&model, &params(1, false), &reqs).unwrap();
        assert_eq!(
            generate(&model, &params(1, true), &reqs).unwrap(),
            one,
            "one at a time, stops {stop:?}"
        );
        let mut unshared_spread = 0f32;
        for max_batch in [3, 8, 32] {
            let want = generate(&model, &params(max_batch, false), &reqs).unwrap();
            let got = generate(&model, &params(max_batch, true), &reqs).unwrap();
            assert_eq!(
                tokens(&got),
                tokens(&want),
                "max_batch {max_batch}, stops {stop:?}"
            );
            let w = worst_logprob(&got, &want);
            unshared_spread = unshared_spread.max(worst_logprob(&want, &one));
            println!("max_batch {max_batch}, stops {stop:?}: shared vs unshared log-probs {w:e}");
            assert!(w <= 1e-5, "max_batch {max_batch}: log-probs differ by {w}");
        }
        println!("stops {stop:?}: unshared at batch 1 vs larger batches {unshared_spread:e}");
    }
    // The samples of a group differ (their seeds are used).
    let out = generate(&model, &sampled(8), &reqs).unwrap();
    assert_ne!(out[0].tokens, out[1].tokens);
}

/// Shared-prompt prefill against prefilling every request (a measurement,
/// not a check): a random Llama (4 layers, hidden 512, vocab 8192, float32,
/// CPU), 8 groups of 8 samples of a 192-token prompt, one batch of 64;
/// `max_new_tokens` 1 (the prefill alone) and 16. Runs alternate, 3 each;
/// one JSON line per run.
#[test]
#[ignore = "benchmark: a measurement, run by hand"]
fn bench_shared_prompt_prefill() {
    tch::set_num_threads(2);
    let raw: serde_json::Value = serde_json::from_str(
        &common::TINY_CONFIG
            .replace("\"vocab_size\": 300", "\"vocab_size\": 8192")
            .replace("\"hidden_size\": 64", "\"hidden_size\": 512")
            .replace("\"intermediate_size\": 128", "\"intermediate_size\": 1408")
            .replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 4")
            .replace("\"num_attention_heads\": 4", "\"num_attention_heads\": 8")
            .replace(
                "\"max_position_embeddings\": 256",
                "\"max_position_embeddings\": 512",
            ),
    )
    .unwrap();
    let cfg: ModelConfig = serde_json::from_value(raw.clone()).unwrap();
    let model = Llama::new(cfg, raw, Kind::Float, Device::Cpu, Init::Seeded(1)).unwrap();
    let reqs: Vec<Request> = (0..8)
        .flat_map(|g| {
            let prompt: Vec<i64> = (0..192)
                .map(|j| ((g * 977 + j * 31) % 8192) as i64)
                .collect();
            (0..8).map(move |s| Request {
                prompt: prompt.clone(),
                seed: (g * 8 + s) as u64,
            })
        })
        .collect();
    for max_new_tokens in [1, 16] {
        for _ in 0..3 {
            for share_prompts in [false, true] {
                let params = SamplingParams {
                    temperature: 1.0,
                    max_new_tokens,
                    max_batch: 64,
                    share_prompts,
                    ..SamplingParams::default()
                };
                let start = std::time::Instant::now();
                generate(&model, &params, &reqs).unwrap();
                let seconds = start.elapsed().as_secs_f64();
                println!(
                    "{}",
                    serde_json::json!({"share_prompts": share_prompts,
                        "max_new_tokens": max_new_tokens, "seconds": seconds})
                );
            }
        }
    }
}

/// Qwen3-MoE: prefill and decode route every token through the sparse
/// layer's top-2 experts as transformers does.
#[test]
fn greedy_equals_transformers_generate_qwen3_moe() {
    greedy_equals_generate("qwen3_moe");
}

/// Gemma 3 with the final-logit soft-cap: generation's logits are capped
/// as transformers caps them.
#[test]
fn greedy_equals_transformers_generate_gemma3_soft_capping() {
    greedy_equals_generate("gemma3_softcap");
}

/// Issue 36: a 3-turn episode — each policy turn generated from the
/// episode so far (prompt, earlier turns, environment turns), as the
/// coordinator drives them — is trained as one sequence: the trainer's
/// log-probs of the policy tokens equal the ones each turn's generation
/// returned, and the environment's tokens carry no loss and no gradient
/// (labels -100: the final hidden states predicting them get none).
#[test]
fn a_three_turn_episode_recomputes_its_policy_logprobs() {
    let model = tiny_model(11);
    let params = sampled(4);
    let prompt: Vec<i64> = vec![5, 17, 42, 99, 3];
    let envs: [Vec<i64>; 2] = [vec![200, 201, 202], vec![210, 211]];
    let (mut ids, mut labels) = (prompt.clone(), vec![-100i64; prompt.len()]);
    let mut sampled_lp: Vec<f32> = Vec::new();
    for turn in 0..3 {
        let req = Request {
            prompt: ids.clone(),
            seed: 77 + turn as u64,
        };
        let c = generate(&model, &params, &[req]).unwrap().remove(0);
        assert!(!c.tokens.is_empty());
        ids.extend(&c.tokens);
        labels.extend(&c.tokens);
        sampled_lp.extend(&c.logprobs);
        if let Some(env) = envs.get(turn) {
            ids.extend(env);
            labels.extend(vec![-100; env.len()]);
        }
    }
    let (hidden, targets, train) = training_logprobs(&model, &[(ids, labels)]);
    assert_eq!(
        train.len(),
        sampled_lp.len(),
        "one log-prob per policy token"
    );
    let worst = worst_diff(&train, &sampled_lp);
    assert!(
        worst < 1e-4,
        "policy log-probs differ from generation by {worst}"
    );
    // The weighted NLL the policy-gradient objective backpropagates
    // (`head::weighted_nll`, every token weighted 1 here): its gradient
    // reaches no hidden state that predicts an environment token.
    let weights = vec![1.0; targets.len()];
    let out = accrue_worker::objective::head::weighted_nll(
        &hidden,
        model.lm_head_weight(),
        &targets,
        &weights,
        64,
        None,
    )
    .unwrap();
    assert_eq!(out.loss_tokens as usize, sampled_lp.len());
    let g = out
        .grad_hidden
        .abs()
        .sum_dim_intlist(-1, false, Kind::Float);
    let g = Vec::<f32>::try_from(g.reshape([-1])).unwrap();
    for (i, &t) in targets.iter().enumerate() {
        if t == -100 {
            assert_eq!(g[i], 0.0, "position {i} predicts no policy token");
        } else {
            assert!(g[i] > 0.0, "position {i} predicts a policy token");
        }
    }
    let env_targets = targets
        .iter()
        .enumerate()
        .filter(|&(i, &t)| t == -100 && i >= prompt.len())
        .count();
    assert!(
        env_targets >= 5,
        "the environment's tokens were in the sequence"
    );
}

/// Issue 37: the paged KV cache gives what the static layout gives (one
/// page of the longest sequence per slot, taken up front): the same
/// tokens and log-probs, greedy and sampled, with shared prompts started
/// from a prefix and slots reused as sequences end, for pages of 1, 3, 4
/// and 64 tokens (every sequence crosses pages, prompts start mid-page),
/// and the default (static here: a small reservation).
#[test]
fn a_paged_kv_cache_generates_what_the_static_one_does() {
    let model = tiny_model(13);
    let mut reqs = grouped(4, 3);
    reqs.extend(requests(5));
    for base in [
        SamplingParams {
            max_new_tokens: 14,
            max_batch: 4,
            ..SamplingParams::default()
        },
        SamplingParams {
            max_new_tokens: 14,
            stop_ids: vec![17, 99, 123],
            ..sampled(5)
        },
    ] {
        let run = |page: usize| {
            let p = SamplingParams {
                kv_page_tokens: page,
                ..base.clone()
            };
            generate(&model, &p, &reqs).unwrap()
        };
        // Longer than any prompt plus its completion: one page per slot.
        let fixed = run(4096);
        for page in [1, 3, 4, 64, 0] {
            let paged = run(page);
            for (i, (a, b)) in paged.iter().zip(&fixed).enumerate() {
                assert_eq!(
                    (&a.tokens, a.finish),
                    (&b.tokens, b.finish),
                    "page {page}, request {i}"
                );
            }
            let w = worst_logprob(&paged, &fixed);
            assert!(w <= 1e-6, "page {page}: log-probs differ by {w}");
        }
    }
}

//! Disaggregated RL on the worker (issue 17, `rl.generators`): two
//! training runners on a real TCP ring and a generator runner joined to
//! trainer rank 0 by the weight ring (the real connector, loopback
//! listeners). After every training step the trainers take the policy for
//! the generators, trainer rank 0 broadcasts it, and the generator's
//! weights are the trainer's: the same greedy completions with bit-equal
//! log-probs, at ddp, at fsdp (rank 0 sends the gathered policy) and with
//! a bf16 compute copy. Before its first sync a generator refuses to
//! generate; a sync asks for no older version than the newest snapshot.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use accrue_worker::runner::{default_connector, default_factory, Runner, RunnerConfig, Work};
use accrue_worker::wire;
use accrue_worker::wire::worker_message::Msg;

fn recv(rx: &mut tokio::sync::mpsc::UnboundedReceiver<wire::WorkerMessage>) -> Msg {
    for _ in 0..6000 {
        if let Ok(m) = rx.try_recv() {
            return m.msg.unwrap();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("no message from the runners");
}

fn peer(rank: u32, addr: &str) -> Option<wire::Peer> {
    Some(wire::Peer {
        rank,
        collective_addr: addr.to_string(),
        ..Default::default()
    })
}

fn round(rank: u32, policy_version: u64, requests: bool) -> wire::GeneratePlan {
    let prompts: [&[u32]; 3] = [&[5, 9, 31], &[7], &[40, 2, 2, 8, 11]];
    wire::GeneratePlan {
        job_id: "j".into(),
        generation: 1,
        round: policy_version + 1,
        rank,
        policy_version,
        sampling: Some(wire::SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            max_new_tokens: 6,
            max_batch: 2,
            ..Default::default()
        }),
        requests: if requests {
            prompts
                .iter()
                .enumerate()
                .map(|(i, p)| wire::GenerateRequest {
                    prompt_id: format!("p:{i}"),
                    sample: 0,
                    prompt_ids: accrue_proto::pack_u32(p),
                    seed: 100 + i as u64,
                })
                .collect()
        } else {
            Vec::new()
        },
    }
}

/// A generator (runner 2) and two trainers (runners 0, 1) of `sharding`:
/// three steps, each followed by a publication and a sync; after every
/// sync the generator's greedy completions equal trainer rank 0's, token
/// for token and log-prob for log-prob (bits).
fn weights_follow_the_trainer(sharding: &str, extra: &str) {
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("config.json");
    std::fs::write(&cfg_path, common::TINY_CONFIG).unwrap();
    let job = common::job_definition(
        "random",
        &format!(
            "config = \"{}\"\n{extra}[parallel]\nsharding = \"{sharding}\"\n[data]\nmax_tokens = 256\n",
            cfg_path.display()
        ),
    );
    let listeners: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let runners: Vec<Runner> = listeners
        .into_iter()
        .map(|l| {
            Runner::start(
                RunnerConfig {
                    factory: default_factory(),
                    connector: default_connector(tch::Device::Cpu),
                    listener: Some(l),
                    device: tch::Device::Cpu,
                },
                tx.clone(),
            )
        })
        .collect();
    let (gen_runner, trainers) = (&runners[2], &runners[..2]);
    // The generator first: it waits in the weight ring's accept while the
    // trainers form theirs (its dial is refused until trainer 0's turn).
    gen_runner.submit(Work::Configure(Box::new(wire::Configure {
        link_key: vec![9; 32],
        job_id: "j".into(),
        generation: 1,
        rank: 0,
        world_size: 1,
        job: Some(job.clone()),
        role: wire::Role::Generator as i32,
        weights: Some(wire::WeightRing {
            rank: 1,
            world_size: 2,
            next: peer(0, &addrs[0]),
        }),
        ..Default::default()
    })));
    for (rank, r) in trainers.iter().enumerate() {
        r.submit(Work::Configure(Box::new(wire::Configure {
            link_key: vec![9; 32],
            job_id: "j".into(),
            generation: 1,
            rank: rank as u32,
            world_size: 2,
            next: peer(((rank + 1) % 2) as u32, &addrs[(rank + 1) % 2]),
            job: Some(job.clone()),
            weights: (rank == 0).then(|| wire::WeightRing {
                rank: 0,
                world_size: 2,
                next: peer(1, &addrs[2]),
            }),
            ..Default::default()
        })));
    }
    for _ in 0..3 {
        let m = recv(&mut rx);
        assert!(matches!(&m, Msg::Ready(r) if r.generation == 1), "{m:?}");
    }
    // No weights yet: the generator refuses to generate.
    gen_runner.submit(Work::Generate(Box::new(round(0, 0, true))));
    let m = recv(&mut rx);
    let Msg::Error(e) = &m else {
        panic!("a generator without weights answered {m:?}");
    };
    assert!(e.message.contains("no weights"), "{}", e.message);

    let docs = common::synthetic_documents(&[30, 11, 25, 7, 40], 9);
    let total = accrue_worker::batch::PackedBatch::from_documents(&docs).loss_tokens();
    for step in 1..=3u64 {
        for (rank, r) in trainers.iter().enumerate() {
            r.submit(Work::Plan(Box::new(wire::StepPlan {
                job_id: "j".into(),
                generation: 1,
                step,
                rank: rank as u32,
                lr: 1e-2,
                normalizers: Some(wire::Normalizers {
                    loss_tokens: total,
                    ..Default::default()
                }),
                microbatches: if rank == 0 {
                    vec![common::to_wire(&docs[..2])]
                } else {
                    vec![common::to_wire(&docs[2..])]
                },
                kind: wire::PlanKind::Train as i32,
                max_tokens: 256,
                ..Default::default()
            })));
            r.submit(Work::Publish(wire::PublishPolicy {
                job_id: "j".into(),
                step,
                target: wire::PolicyTarget::Generators as i32,
                ..Default::default()
            }));
        }
        let mut published = 0;
        while published < 2 {
            match recv(&mut rx) {
                Msg::StepResult(r) => assert_eq!(r.step, step),
                Msg::PolicyPublished(p) => {
                    assert_eq!((p.step, p.path.as_str()), (step, ""));
                    published += 1;
                }
                m => panic!("step {step}: {m:?}"),
            }
        }
        let sync = wire::SyncWeights {
            job_id: "j".into(),
            generation: 1,
            version: step,
        };
        trainers[0].submit(Work::Sync(sync.clone()));
        gen_runner.submit(Work::Sync(sync));
        let m = recv(&mut rx);
        assert!(
            matches!(&m, Msg::WeightsSynced(w) if w.version == step && w.rank == 0),
            "step {step}: {m:?}"
        );
        // ReplicatedTrainer rank 0 (and, under fsdp, rank 1 for the gather) and the
        // generator decode the same prompts greedily.
        for (rank, r) in trainers.iter().enumerate() {
            r.submit(Work::Generate(Box::new(round(
                rank as u32,
                step,
                rank == 0,
            ))));
        }
        gen_runner.submit(Work::Generate(Box::new(round(0, step, true))));
        let mut answers = Vec::new();
        while answers.len() < 3 {
            match recv(&mut rx) {
                Msg::GenerateResult(g) => answers.push(g),
                m => panic!("step {step}: {m:?}"),
            }
        }
        let full: Vec<_> = answers
            .iter()
            .filter(|g| !g.completions.is_empty())
            .collect();
        assert_eq!(full.len(), 2, "trainer rank 0 and the generator");
        let key = |g: &wire::GenerateResult| {
            g.completions
                .iter()
                .map(|c| (c.prompt_id.clone(), c.token_ids.clone(), c.logprobs.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            key(full[0]),
            key(full[1]),
            "{sharding} step {step}: the generator's weights are not the trainer's"
        );
    }
    // Step 3's snapshot is the newest: a sync for step 2 sends step 3's.
    let sync = wire::SyncWeights {
        job_id: "j".into(),
        generation: 1,
        version: 2,
    };
    trainers[0].submit(Work::Sync(sync.clone()));
    gen_runner.submit(Work::Sync(sync));
    let m = recv(&mut rx);
    assert!(
        matches!(&m, Msg::WeightsSynced(w) if w.version == 3),
        "{m:?}"
    );
    if sharding == "ddp" && extra.is_empty() {
        roles_switch(&runners, &addrs, &job, &mut rx);
    }
    for r in runners {
        r.shutdown();
    }
}

/// Generation 2 at step 3: the generator (runner 2) becomes trainer rank
/// 1, taking the state from trainer rank 0 over the new ring (it held
/// none), and trainer rank 1 (runner 1) becomes the generator. A step
/// then agrees across the trainers, and the new generator's weights
/// follow trainer rank 0's after the sync.
fn roles_switch(
    runners: &[Runner],
    addrs: &[String],
    job: &wire::JobDefinition,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<wire::WorkerMessage>,
) {
    let (t0, new_gen, new_t1) = (&runners[0], &runners[1], &runners[2]);
    new_gen.submit(Work::Configure(Box::new(wire::Configure {
        link_key: vec![9; 32],
        job_id: "j".into(),
        generation: 2,
        rank: 0,
        world_size: 1,
        step: 3,
        job: Some(job.clone()),
        role: wire::Role::Generator as i32,
        weights: Some(wire::WeightRing {
            rank: 1,
            world_size: 2,
            next: peer(0, &addrs[0]),
        }),
        ..Default::default()
    })));
    let held = wire::PriorRun {
        rank: 0,
        count: 1,
        prior_rank: 0,
        prior_world_size: 2,
    };
    for (rank, (r, next)) in [(t0, &addrs[2]), (new_t1, &addrs[0])]
        .into_iter()
        .enumerate()
    {
        r.submit(Work::Configure(Box::new(wire::Configure {
            link_key: vec![9; 32],
            job_id: "j".into(),
            generation: 2,
            rank: rank as u32,
            world_size: 2,
            step: 3,
            next: peer(((rank + 1) % 2) as u32, next),
            job: Some(job.clone()),
            prior: (rank == 0).then(|| wire::HeldState {
                job_id: "j".into(),
                step: 3,
                world_size: 2,
                rank: 0,
                generation: 1,
            }),
            priors: vec![held],
            weights: (rank == 0).then(|| wire::WeightRing {
                rank: 0,
                world_size: 2,
                next: peer(1, &addrs[1]),
            }),
            ..Default::default()
        })));
    }
    for _ in 0..3 {
        let m = recv(rx);
        assert!(
            matches!(&m, Msg::Ready(r) if r.generation == 2 && r.step == 3),
            "{m:?}"
        );
    }
    let docs = common::synthetic_documents(&[12, 33, 8], 4);
    let total = accrue_worker::batch::PackedBatch::from_documents(&docs).loss_tokens();
    for (rank, r) in [t0, new_t1].into_iter().enumerate() {
        let mine = if rank == 0 { &docs[..1] } else { &docs[1..] };
        r.submit(Work::Plan(Box::new(wire::StepPlan {
            job_id: "j".into(),
            generation: 2,
            step: 4,
            rank: rank as u32,
            lr: 1e-2,
            normalizers: Some(wire::Normalizers {
                loss_tokens: total,
                ..Default::default()
            }),
            microbatches: vec![common::to_wire(mine)],
            kind: wire::PlanKind::Train as i32,
            max_tokens: 256,
            ..Default::default()
        })));
        r.submit(Work::Publish(wire::PublishPolicy {
            job_id: "j".into(),
            step: 4,
            target: wire::PolicyTarget::Generators as i32,
            ..Default::default()
        }));
    }
    let mut norms = Vec::new();
    let mut published = 0;
    while norms.len() < 2 || published < 2 {
        match recv(rx) {
            Msg::StepResult(r) => norms.push(r.sums.unwrap().grad_norm),
            Msg::PolicyPublished(_) => published += 1,
            m => panic!("{m:?}"),
        }
    }
    assert_eq!(norms[0], norms[1], "the new trainer holds rank 0's state");
    let sync = wire::SyncWeights {
        job_id: "j".into(),
        generation: 2,
        version: 4,
    };
    t0.submit(Work::Sync(sync.clone()));
    new_gen.submit(Work::Sync(sync));
    let m = recv(rx);
    assert!(
        matches!(&m, Msg::WeightsSynced(w) if w.version == 4),
        "{m:?}"
    );
    let mut plan = round(0, 4, true);
    plan.generation = 2;
    t0.submit(Work::Generate(Box::new(plan.clone())));
    new_gen.submit(Work::Generate(Box::new(plan)));
    let mut answers = Vec::new();
    while answers.len() < 2 {
        match recv(rx) {
            Msg::GenerateResult(g) => answers.push(g.completions),
            m => panic!("{m:?}"),
        }
    }
    assert_eq!(
        answers[0], answers[1],
        "the new generator's weights are not trainer 0's"
    );
}

#[test]
fn the_generators_weights_follow_a_ddp_trainer() {
    weights_follow_the_trainer("ddp", "");
}

#[test]
fn the_generators_weights_follow_an_fsdp_trainer() {
    weights_follow_the_trainer("fsdp", "");
}

#[test]
fn the_generators_weights_follow_a_bf16_compute_copy() {
    weights_follow_the_trainer("ddp", "[precision]\ncompute = \"bfloat16\"\n");
}

//! Context-parallel attention against the unsplit row's (torch SDPA with
//! autograd, per document), on in-process groups of 1–4 ranks.

use super::*;
use crate::collective::local::LocalGroup;

#[test]
fn the_zig_zag_split_balances_causal_work_and_covers_the_row_once() {
    let z = ZigZag::new(103, 4);
    let mut seen: Vec<i64> = (0..4).flat_map(|r| z.positions(r)).collect();
    seen.sort();
    assert_eq!(seen, (0..103).collect::<Vec<_>>());
    assert_eq!(z.held(0), [0..12, 90..103]);
    assert_eq!(z.held(3), [38..51, 51..64]);
    // Causal work: Σ over held positions of the keys each sees.
    let work: Vec<i64> = (0..4)
        .map(|r| z.positions(r).iter().map(|p| p + 1).sum())
        .collect();
    let (lo, hi) = (work.iter().min().unwrap(), work.iter().max().unwrap());
    assert!(*hi as f64 / *lo as f64 <= 1.05, "{work:?}");
    assert_eq!(z.slot(), 26);
}

#[test]
fn pieces_cut_each_held_chunk_at_document_boundaries() {
    let z = ZigZag::new(20, 2);
    // Chunks of 5: rank 0 holds [0, 5) and [15, 20).
    let p = pieces(&z, 0, &[0, 3, 17, 20]);
    assert_eq!(
        p,
        [
            Piece {
                local: 0..3,
                before: 0..0,
                diag: 0..3
            },
            Piece {
                local: 3..5,
                before: 3..3,
                diag: 3..5
            },
            Piece {
                local: 5..7,
                before: 3..15,
                diag: 15..17
            },
            Piece {
                local: 7..10,
                before: 17..17,
                diag: 17..20
            },
        ]
    );
}

fn sdpa_reference(q: &Tensor, k: &Tensor, v: &Tensor, cu: &[i64]) -> Tensor {
    let groups = q.size()[1] / k.size()[1];
    let outs: Vec<Tensor> = cu
        .windows(2)
        .map(|w| {
            let n = w[1] - w[0];
            let f = |t: &Tensor| heads_first(&t.narrow(0, w[0], n));
            let o = Tensor::scaled_dot_product_attention(
                &f(q),
                &f(k).repeat_interleave_self_int(groups, 1, None),
                &f(v).repeat_interleave_self_int(groups, 1, None),
                None::<Tensor>,
                0.0,
                true,
                None,
                false,
            );
            o.squeeze_dim(0).transpose(0, 1)
        })
        .collect();
    Tensor::cat(&outs, 0)
}

/// One rank's results: (positions, out, dq, dk, dv), its rows.
type RankOut = (Vec<i64>, Tensor, Tensor, Tensor, Tensor);

fn split_run(
    ranks: i64,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    w: &Tensor,
    cu: &[i64],
) -> Vec<RankOut> {
    let len = q.size()[0];
    let threads: Vec<_> = LocalGroup::new(ranks as usize)
        .into_iter()
        .enumerate()
        .map(|(r, mut coll)| {
            let (q, k, v, w) = (q.copy(), k.copy(), v.copy(), w.copy());
            let cu = cu.to_vec();
            std::thread::spawn(move || {
                let r = r as i64;
                let shard = RowShard::new(&cu, ranks, r);
                let pos = shard.held.clone();
                let at = Tensor::from_slice(&pos);
                let (ql, kl, vl, wl) = (
                    q.index_select(0, &at),
                    k.index_select(0, &at),
                    v.index_select(0, &at),
                    w.index_select(0, &at),
                );
                let (kvh, d) = (k.size()[1], k.size()[2]);
                let n = pos.len() as i64;
                let row = gather_rows(&mut coll, &shard, &kl.reshape([n, kvh * d])).unwrap();
                assert!(
                    row.view([len, kvh, d]).equal(&k),
                    "the gather rebuilds the row exactly"
                );
                let split = &shard.split;
                let kf = gather_slots(&mut coll, split, &kl.reshape([n, kvh * d]))
                    .unwrap()
                    .view([-1, kvh, d]);
                let vf = gather_slots(&mut coll, split, &vl.reshape([n, kvh * d]))
                    .unwrap()
                    .view([-1, kvh, d]);
                // Every row range reads the row's keys through the segments.
                let whole: Vec<Tensor> = split
                    .segments(&(0..len))
                    .into_iter()
                    .map(|r| kf.narrow(0, r.start, r.end - r.start))
                    .collect();
                assert!(Tensor::cat(&whole, 0).equal(&k), "the segments are the row");
                let ps = &shard.pieces;
                let qh = ql.transpose(0, 1);
                let (out, lse) = attend(&qh, &kf, &vf, split, ps, None);
                let (dq, dk, dv) = attend_backward(&wl, &qh, &out, &kf, &vf, split, ps, &lse, None);
                let dk = scatter_slots(&mut coll, split, dk.view([-1, kvh * d]))
                    .unwrap()
                    .view([n, kvh, d]);
                let dv = scatter_slots(&mut coll, split, dv.view([-1, kvh * d]))
                    .unwrap()
                    .view([n, kvh, d]);
                (pos, out, dq, dk, dv)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Output and q/k/v gradients of the split attention equal the unsplit
/// row's, for 1–4 ranks, grouped-query heads, a document longer than a
/// rank's share and short ones cut by chunk boundaries.
#[test]
fn split_attention_and_its_gradients_equal_the_unsplit_rows() {
    tch::manual_seed(3);
    let (len, heads, kv_heads, d) = (157i64, 4, 2, 8);
    let cu = [0i64, 9, 13, 121, 122, 157];
    let opts = (Kind::Float, tch::Device::Cpu);
    let q = Tensor::randn([len, heads, d], opts);
    let k = Tensor::randn([len, kv_heads, d], opts);
    let v = Tensor::randn([len, kv_heads, d], opts);
    let w = Tensor::randn([len, heads, d], opts);
    let (ql, kl, vl) = (
        q.copy().set_requires_grad(true),
        k.copy().set_requires_grad(true),
        v.copy().set_requires_grad(true),
    );
    let want = sdpa_reference(&ql, &kl, &vl, &cu);
    (&want * &w).sum(Kind::Float).backward();
    let (gq, gk, gv) = (ql.grad(), kl.grad(), vl.grad());
    let want = want.detach();
    for ranks in 1..=4 {
        for (pos, out, dq, dk, dv) in split_run(ranks, &q, &k, &v, &w, &cu) {
            let at = Tensor::from_slice(&pos);
            let close = |got: &Tensor, full: &Tensor, what: &str| {
                let diff = (got - full.index_select(0, &at))
                    .abs()
                    .max()
                    .double_value(&[]);
                assert!(diff < 1e-5, "{ranks} ranks: {what} differs by {diff}");
            };
            close(&out, &want, "the output");
            close(&dq, &gq, "dq");
            close(&dk, &gk, "dk");
            close(&dv, &gv, "dv");
        }
    }
}

fn tiny_model() -> crate::model::Llama {
    let raw = serde_json::json!({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6
    });
    let cfg = crate::model::ModelConfig::from_json(&raw).unwrap();
    crate::model::Llama::new(
        cfg,
        raw,
        Kind::Float,
        tch::Device::Cpu,
        crate::model::Init::Seeded(1),
    )
    .unwrap()
}

/// The model's variables in name order, and their groups.
fn vars_of(m: &crate::model::Llama) -> (Vec<Tensor>, crate::model::recompute::VarGroups) {
    let mut named: Vec<(String, Tensor)> = m.vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    let groups = crate::model::recompute::VarGroups::new(&names, 2, m.cfg.tie_word_embeddings);
    (named.into_iter().map(|(_, t)| t).collect(), groups)
}

/// The whole model under context parallelism: each rank's final hidden
/// states equal the unsplit row's at its positions, and the ranks'
/// gradients summed (as the data-parallel reduction sums them) equal the
/// unsplit row's, for every variable, on groups of 2 and 4.
#[test]
fn a_context_parallel_forward_and_backward_equal_the_unsplit_models() {
    let cu = [0i64, 9, 13, 121, 122, 157];
    let len = 157i64;
    let ids: Vec<i64> = (0..len).map(|i| (i * 7 + 3) % 64).collect();
    tch::manual_seed(5);
    let grad_hidden = Tensor::randn([len, 32], (Kind::Float, tch::Device::Cpu));
    let model = tiny_model();
    let (vars, groups) = vars_of(&model);
    let routes = crate::model::Routes::default();
    let f = model.forward_train(&ids, &cu, true, &routes);
    let hidden = f.hidden.detach();
    let want = model.backward_train(f, &grad_hidden, &Tensor::new(), &vars, &groups);
    for ranks in [2i64, 4] {
        let threads: Vec<_> = LocalGroup::new(ranks as usize)
            .into_iter()
            .enumerate()
            .map(|(r, mut coll)| {
                let (ids, gh) = (ids.clone(), grad_hidden.copy());
                std::thread::spawn(move || {
                    let model = tiny_model();
                    let (vars, groups) = vars_of(&model);
                    let shard = RowShard::new(&cu, ranks, r as i64);
                    let routes = crate::model::Routes::default();
                    let f = model
                        .forward_train_context(&shard.take(&ids), &shard, &mut coll, &routes)
                        .unwrap();
                    let at = Tensor::from_slice(&shard.held);
                    let hidden = f.hidden.detach();
                    let grads = model
                        .backward_train_context(
                            f,
                            &gh.index_select(0, &at),
                            &Tensor::new(),
                            &vars,
                            &groups,
                            &mut coll,
                        )
                        .unwrap();
                    (shard.held, hidden, grads)
                })
            })
            .collect();
        let mut sum: Vec<Tensor> = want.iter().map(|_| Tensor::new()).collect();
        for t in threads {
            let (held, h, grads) = t.join().unwrap();
            let diff = (h - hidden.index_select(0, &Tensor::from_slice(&held)))
                .abs()
                .max()
                .double_value(&[]);
            assert!(diff < 1e-5, "{ranks} ranks: hidden differs by {diff}");
            for (s, g) in sum.iter_mut().zip(&grads) {
                if g.defined() {
                    *s = if s.defined() { &*s + g } else { g.copy() };
                }
            }
        }
        for (i, (s, w)) in sum.iter().zip(&want).enumerate() {
            assert_eq!(s.defined(), w.defined(), "variable {i}");
            if !w.defined() {
                continue;
            }
            let scale = w.abs().max().double_value(&[]).max(1e-6);
            let diff = (s - w).abs().max().double_value(&[]) / scale;
            assert!(
                diff < 1e-5,
                "{ranks} ranks: variable {i}: relative difference {diff}"
            );
        }
    }
}

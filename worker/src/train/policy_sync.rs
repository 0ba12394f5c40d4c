//! Disaggregated RL (issue 17): the policy as one flat buffer, and its
//! broadcast from trainer rank 0 to the generators over the weight ring.
//!
//! The payload is every parameter of the model generation runs on (the
//! trainer's compute copy: `Trainer::policy`) — of a LoRA job only the
//! adapters, the generators holding the same frozen base — in HF name order, each
//! tensor's bytes in its own dtype, back to back: the generators load
//! exactly the bits the trainer holds (bf16 stays bf16), so their weights
//! equal the trainer's. Collectives move float32, so the bytes travel as
//! float32 words (a broadcast only copies them; padding to 4 bytes).
//!
//! A fixed header goes first: magic, the policy's version (step), its
//! byte length and a hash of its layout (names, shapes, dtypes). A
//! generator whose model differs (another config, another dtype) fails
//! naming both layouts instead of loading misplaced bytes.

use anyhow::{bail, ensure, Context};
use tch::{Device, Kind, Tensor};

use crate::collective::Collective;
use crate::model::Llama;

const MAGIC: u32 = 0x5753_4341; // "ACSW"
const HEADER_WORDS: usize = 8;

/// The policy of one version as one flat byte buffer.
#[derive(Debug)]
pub struct PolicyPayload {
    pub version: u64,
    /// Uint8, flat, its length a multiple of 4.
    bytes: Tensor,
    /// Bytes of parameters (before the padding).
    len: u64,
    layout: u64,
}

impl PolicyPayload {
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The parameters that change with training (a LoRA job's adapters, else
/// every parameter) in name order (the order both sides use).
fn named(model: &Llama) -> Vec<(String, Tensor)> {
    model.trainable()
}

/// What a generator received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// The committed step of the policy.
    pub version: u64,
    /// Bytes of parameters received.
    pub bytes: u64,
}

/// FNV-1a over every parameter's name, shape and dtype, and the total
/// bytes: what a sender and a receiver must agree on.
fn layout_of(vars: &[(String, Tensor)]) -> (u64, u64) {
    let fnv = |h: u64, bytes: &[u8]| {
        bytes.iter().fold(h, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    };
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut len = 0u64;
    for (name, t) in vars {
        h = fnv(h, name.as_bytes());
        for d in t.size() {
            h = fnv(h, &d.to_le_bytes());
        }
        h = fnv(h, format!("{:?}", t.kind()).as_bytes());
        len += (t.numel() * t.kind().elt_size_in_bytes()) as u64;
    }
    (fnv(h, &len.to_le_bytes()), len)
}

fn padded(len: u64) -> i64 {
    len.div_ceil(4) as i64 * 4
}

/// Copies `model`'s parameters into one buffer on its device, tagged with
/// `version` (the committed step they are the update of).
pub fn snapshot(model: &Llama, version: u64) -> anyhow::Result<PolicyPayload> {
    let vars = named(model);
    let (layout, len) = layout_of(&vars);
    let device = model.vs.device();
    let bytes = tch::no_grad(|| {
        let mut parts: Vec<Tensor> = vars
            .iter()
            .map(|(_, t)| t.detach().contiguous().view([-1]).view_dtype(Kind::Uint8))
            .collect();
        let pad = padded(len) - len as i64;
        if pad > 0 {
            parts.push(Tensor::zeros([pad], (Kind::Uint8, device)));
        }
        Tensor::cat(&parts, 0)
    });
    Ok(PolicyPayload {
        version,
        bytes,
        len,
        layout,
    })
}

fn header(version: u64, len: u64, layout: u64) -> Tensor {
    let words: [u32; HEADER_WORDS] = [
        MAGIC,
        version as u32,
        (version >> 32) as u32,
        len as u32,
        (len >> 32) as u32,
        layout as u32,
        (layout >> 32) as u32,
        0,
    ];
    let ints: Vec<i32> = words.iter().map(|&w| w as i32).collect();
    Tensor::from_slice(&ints).view_dtype(Kind::Float)
}

fn read_header(t: &Tensor) -> anyhow::Result<(u64, u64, u64)> {
    let ints = Vec::<i32>::try_from(&t.to_device(Device::Cpu).view_dtype(Kind::Int))
        .context("reading the weight header")?;
    let w: Vec<u64> = ints.iter().map(|&i| u64::from(i as u32)).collect();
    ensure!(
        w.len() == HEADER_WORDS && w[0] == u64::from(MAGIC),
        "the weight ring carried no policy header (words {w:?})"
    );
    Ok((w[1] | w[2] << 32, w[3] | w[4] << 32, w[5] | w[6] << 32))
}

/// ReplicatedTrainer rank 0 (weight ring rank 0): sends `payload` to every generator.
pub fn send(coll: &mut dyn Collective, payload: &PolicyPayload) -> anyhow::Result<()> {
    ensure!(coll.rank() == 0, "only weight ring rank 0 sends the policy");
    let device = coll.device();
    let mut h = header(payload.version, payload.len, payload.layout).to_device(device);
    coll.broadcast(&mut h, 0)
        .context("sending the weight header")?;
    let mut words = payload.bytes.to_device(device).view_dtype(Kind::Float);
    coll.broadcast(&mut words, 0)
        .context("sending the policy's weights")?;
    Ok(())
}

/// A generator: receives the policy trainer rank 0 sends into `model`'s
/// parameters.
pub fn receive(coll: &mut dyn Collective, model: &Llama) -> anyhow::Result<Received> {
    let vars = named(model);
    let (layout, len) = layout_of(&vars);
    let device = coll.device();
    let mut h = Tensor::zeros([HEADER_WORDS as i64], (Kind::Float, device));
    coll.broadcast(&mut h, 0)
        .context("receiving the weight header")?;
    let (version, sent_len, sent_layout) = read_header(&h)?;
    if (sent_len, sent_layout) != (len, layout) {
        bail!(
            "trainer rank 0 sent a policy of {sent_len} bytes (layout {sent_layout:016x}); this \
             generator's model is {len} bytes (layout {layout:016x}): the models differ"
        );
    }
    let mut words = Tensor::zeros([padded(len) / 4], (Kind::Float, device));
    coll.broadcast(&mut words, 0)
        .context("receiving the policy's weights")?;
    let bytes = words.view_dtype(Kind::Uint8);
    let model_device = model.vs.device();
    tch::no_grad(|| {
        let mut at = 0i64;
        for (_, t) in &vars {
            let n = (t.numel() * t.kind().elt_size_in_bytes()) as i64;
            let part = bytes
                .narrow(0, at, n)
                .view_dtype(t.kind())
                .view(t.size().as_slice())
                .to_device(model_device);
            t.shallow_clone().copy_(&part);
            at += n;
        }
    });
    Ok(Received {
        version,
        bytes: len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::local::LocalGroup;
    use crate::model::{Init, ModelConfig};

    fn tiny(kind: Kind, init: Init) -> Llama {
        let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
            "vocab_size": 37, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "tie_word_embeddings": false
        }))
        .unwrap();
        Llama::new(cfg, serde_json::Value::Null, kind, Device::Cpu, init).unwrap()
    }

    /// Every parameter arrives bit for bit, in float32 and in bf16 (whose
    /// bytes ride in float32 words), with the version in the header.
    #[test]
    fn a_generator_receives_the_senders_weights_bit_for_bit() {
        for kind in [Kind::Float, Kind::BFloat16] {
            let sender = tiny(kind, Init::Seeded(7));
            let payload = snapshot(&sender, 41).unwrap();
            assert_eq!(payload.len() % 2, 0);
            let groups = LocalGroup::new(3);
            let handles: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, mut g)| {
                    let bytes = (rank == 0).then(|| snapshot(&sender, 41).unwrap());
                    std::thread::spawn(move || {
                        if let Some(p) = bytes {
                            send(&mut g, &p).unwrap();
                            return None;
                        }
                        let model = tiny(kind, Init::Empty);
                        let v = receive(&mut g, &model).unwrap().version;
                        Some((v, snapshot(&model, v).unwrap().bytes))
                    })
                })
                .collect();
            for h in handles {
                if let Some((v, got)) = h.join().unwrap() {
                    assert_eq!(v, 41);
                    assert!(got.equal(&payload.bytes), "{kind:?}: bytes differ");
                }
            }
        }
    }

    /// A generator whose model is another shape refuses the bytes.
    #[test]
    fn a_model_of_another_layout_is_refused_by_name() {
        let sender = tiny(Kind::Float, Init::Seeded(1));
        let payload = snapshot(&sender, 3).unwrap();
        let mut groups = LocalGroup::new(2).into_iter();
        let (mut a, mut b) = (groups.next().unwrap(), groups.next().unwrap());
        let t = std::thread::spawn(move || send(&mut a, &payload));
        let other = tiny(Kind::BFloat16, Init::Empty);
        let err = receive(&mut b, &other).unwrap_err().to_string();
        assert!(err.contains("the models differ"), "{err}");
        // The sender waits in its payload broadcast for a receiver that
        // gave up (on a real ring its peer's socket closes); not joined.
        drop(t);
    }
}

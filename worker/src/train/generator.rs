//! A generator of a disaggregated RL job (`rl.generators`, issue 17): the
//! policy alone, in the dtype generation runs in (the trainers' compute
//! dtype), with no optimizer and no training state. Its weights come only
//! from trainer rank 0 over the weight ring ([`super::policy_sync`]); until
//! the first sync it has none and refuses to generate.

use anyhow::{anyhow, bail};

use super::source::frozen;
use super::trainer::{
    CheckpointWrite, Checkpointing, Membership, Passes, Policy, StepStats, Trainer,
};
use crate::batch::{MicrobatchMeta, MicrobatchOutcome, PackedBatch, StepNorms};
use crate::collective::Collective;
use crate::config::{JobConfig, ModelSource};
use crate::model::{Init, Llama, ModelConfig};

pub struct Generator {
    model: Llama,
    /// The weight ring (trainer rank 0 is its rank 0).
    ring: Box<dyn Collective>,
    /// The committed step whose policy the model holds; `None` before the
    /// first sync.
    version: Option<u64>,
}

impl Generator {
    /// The job's model architecture, allocated empty in the compute dtype
    /// on `cfg.device`: nothing is read from disk (the weights come from
    /// the trainer). A LoRA job's generator builds the frozen base as the
    /// trainers do (it never changes) with its adapters, and receives only
    /// the adapters.
    pub fn new(cfg: &JobConfig, ring: Box<dyn Collective>) -> anyhow::Result<Generator> {
        if cfg.lora.is_some() {
            let model = super::source::build_model(cfg, None)?;
            return Ok(Generator {
                model: frozen(model),
                ring,
                version: None,
            });
        }
        let config = match &cfg.model {
            ModelSource::Random { config } => config.clone(),
            ModelSource::Checkpoint(dir) => dir.join("config.json"),
        };
        let (mcfg, raw) = ModelConfig::from_file(&config)?;
        let model = Llama::new(mcfg, raw, cfg.precision.compute, cfg.device, Init::Empty)?;
        Ok(Generator {
            model: frozen(model),
            ring,
            version: None,
        })
    }

    /// The version of the policy held, if any.
    pub fn version(&self) -> Option<u64> {
        self.version
    }
}

fn no_training() -> anyhow::Error {
    anyhow!("a generator worker does not train (it only generates, with the trainers' weights)")
}

impl Passes for Generator {
    fn train_microbatch(
        &mut self,
        _index: usize,
        _batch: &PackedBatch,
        _meta: &MicrobatchMeta,
        _norms: &StepNorms,
    ) -> anyhow::Result<MicrobatchOutcome> {
        Err(no_training())
    }

    fn zero_grad(&mut self) {}

    fn grads_finite(&self) -> bool {
        true
    }
}

impl Membership for Generator {
    /// A generator never serves as a training replica (a worker that
    /// generated and now trains is rebuilt or synced like a new member).
    fn fits(&self, _rank: usize, _world: usize) -> bool {
        false
    }

    fn set_collective(&mut self, coll: Box<dyn Collective>) -> anyhow::Result<()> {
        self.ring = coll;
        Ok(())
    }

    fn group(&mut self) -> &mut dyn Collective {
        self.ring.as_mut()
    }
}

impl Checkpointing for Generator {
    fn checkpoint_snapshot(&mut self) -> anyhow::Result<CheckpointWrite> {
        Err(no_training())
    }
}

impl Trainer for Generator {
    fn optimizer_step(&mut self, _lr: f64) -> anyhow::Result<StepStats> {
        Err(no_training())
    }

    fn policy(&mut self, _ready: bool) -> anyhow::Result<Policy<'_>> {
        if self.version.is_none() {
            bail!("this generator has received no weights from trainer rank 0 yet");
        }
        Ok(Policy::Held(&self.model))
    }

    fn device(&self) -> tch::Device {
        self.model.vs.device()
    }

    fn receive_policy(&mut self) -> anyhow::Result<super::policy_sync::Received> {
        // A failed transfer leaves the model part old, part new.
        self.version = None;
        let got = super::policy_sync::receive(self.ring.as_mut(), &self.model)?;
        self.version = Some(got.version);
        Ok(got)
    }
}

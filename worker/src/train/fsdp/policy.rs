//! Generation under fsdp (issue 17), as FSDP's `summon_full_params`: every
//! unit is all-gathered in turn into a temporary full [`Llama`] in the
//! compute dtype, which the round decodes with and then drops. On top of
//! the shards a rank holds, for the round, the full model in the compute
//! dtype and one unit's float32 gather buffer.

use anyhow::{bail, Context};

use super::FsdpTrainer;
use crate::collective::count_failures;
use crate::model::{Init, Llama};

impl FsdpTrainer {
    /// The full model, gathered (a collective: every rank calls it for the
    /// round). `ready`: whether this rank's plan can run. The model is
    /// allocated first, then the ranks agree: if any rank is not ready or
    /// could not allocate, every rank fails before the gather. Each
    /// parameter is its gathered float32 master cast to the compute dtype,
    /// as the training forward casts a gathered unit.
    pub fn gather_policy(&mut self, ready: bool) -> anyhow::Result<Llama> {
        // libtorch raises an allocation failure as a panic: it must still
        // reach the agreement below.
        let (cfg, raw) = (self.cfg.clone(), self.raw_config.clone());
        let (kind, device) = (self.kind, self.device);
        let allocated =
            std::panic::catch_unwind(move || Llama::new(cfg, raw, kind, device, Init::Empty))
                .unwrap_or_else(|payload| Err(crate::error::from_panic(payload.as_ref())));
        let failed = count_failures(self.coll.as_mut(), ready && allocated.is_ok())
            .context("fsdp: agreeing to gather the model for generation")?;
        let mut model = allocated.context("fsdp: allocating the full model for generation")?;
        if !ready {
            bail!("this rank cannot run the round; nothing gathered");
        }
        if failed > 0 {
            bail!("{failed} other rank(s) cannot run the round; nothing gathered");
        }
        model.attention = self.attention;
        if let Some(lora) = &self.lora {
            // The adapters' values come from their units below.
            let config = crate::config::LoraConfig {
                init: None,
                ..lora.config.clone()
            };
            crate::model::lora::attach(&mut model, &config, 0)?;
        }
        let vars = model.vs.variables();
        let mut filled = 0;
        for u in 0..self.layouts.len() {
            let flat = self.gather(u)?;
            for s in &self.layouts[u].slots {
                let var = vars
                    .get(&s.name)
                    .with_context(|| format!("fsdp: the model has no parameter {}", s.name))?;
                tch::no_grad(|| var.shallow_clone().copy_(&s.view(&flat)));
                filled += 1;
            }
        }
        if filled != vars.len() {
            bail!(
                "fsdp: the units hold {filled} parameters, the model {}",
                vars.len()
            );
        }
        Ok(model)
    }
}

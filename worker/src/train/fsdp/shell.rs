//! Parameter-less shells of the model's modules, for running one FSDP unit
//! at a time on gathered parameters.
//!
//! A shell is the model's own `DecoderLayer` / `RmsNorm` built from a copy
//! of the config whose hidden and intermediate sizes are 0 (head counts and
//! head_dim kept), so every variable has zero elements and building it
//! costs nothing. [`LayerShell::bind`] points the variables at
//! views of a gathered flat buffer (`Tensor::set_data`, PyTorch's
//! `param.data = view`, as FSDP1's flat parameters do) and the returned
//! guard points them back at empty tensors, which frees the gathered
//! buffer once the caller drops it.

use tch::{nn, Device, Kind, Tensor};

use crate::model::llama::DecoderLayer;
use crate::model::norm::RmsNorm;
use crate::model::ModelConfig;

use super::units::UnitLayout;

/// `cfg` with zero-sized hidden and intermediate dimensions.
fn zero_config(cfg: &ModelConfig) -> ModelConfig {
    let mut z = cfg.clone();
    z.head_dim = Some(cfg.head_dim());
    z.hidden_size = 0;
    z.intermediate_size = 0;
    z
}

/// One decoder layer's module tree with swappable parameters.
pub struct LayerShell {
    /// Keeps the variables alive.
    _vs: nn::VarStore,
    pub layer: DecoderLayer,
    /// The base variables, sorted by HF name (the unit's slot order).
    vars: Vec<(String, Tensor)>,
    /// A LoRA job's adapters of this layer, sorted (their unit's slots).
    adapters: Vec<(String, Tensor)>,
}

/// What a LoRA job's shells attach: the job's config, each layer's
/// targets, and the switch all of them share.
pub struct ShellAdapters<'a> {
    pub lora: &'a crate::config::LoraConfig,
    pub targets: &'a [accrue_arch::lora::LayerTargets],
    pub switch: &'a crate::model::lora::Switch,
}

impl LayerShell {
    /// The shell of decoder layer `index` (variables named
    /// `model.layers.{index}.…`).
    pub fn new(
        cfg: &ModelConfig,
        index: usize,
        kind: Kind,
        device: Device,
        adapters: Option<&ShellAdapters<'_>>,
    ) -> LayerShell {
        let mut vs = nn::VarStore::new(device);
        let zero = zero_config(cfg);
        let arch = cfg.arch().expect("a validated config");
        let mut layer = DecoderLayer::new(
            vs.root() / "model" / "layers" / index,
            &zero,
            &arch,
            &arch.layers[index],
        );
        if kind != Kind::Float {
            vs.set_kind(kind);
        }
        if let Some(a) = adapters {
            // After the cast: adapters stay float32. The base is frozen.
            for (_, t) in vs.variables() {
                let _ = t.set_requires_grad(false);
            }
            let root = vs.root();
            crate::model::lora::attach_layer(
                &mut layer,
                &root,
                index,
                &a.targets[index],
                a.lora,
                0,
                a.switch,
            );
        }
        type Named = Vec<(String, Tensor)>;
        let (mut adapters, mut vars): (Named, Named) = vs
            .variables()
            .into_iter()
            .partition(|(n, _)| crate::model::lora::is_adapter(n));
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        adapters.sort_by(|a, b| a.0.cmp(&b.0));
        LayerShell {
            _vs: vs,
            layer,
            vars,
            adapters,
        }
    }

    /// The HF parameter names of this layer's base, sorted.
    pub fn names(&self) -> Vec<String> {
        self.vars.iter().map(|(n, _)| n.clone()).collect()
    }

    /// The names of this layer's adapters, sorted (none without LoRA).
    pub fn adapter_names(&self) -> Vec<String> {
        self.adapters.iter().map(|(n, _)| n.clone()).collect()
    }

    /// The adapters' variables, in their unit's slot order.
    pub fn adapter_vars(&self) -> Vec<Tensor> {
        self.adapters
            .iter()
            .map(|(_, v)| v.shallow_clone())
            .collect()
    }

    /// Points the adapters at views of `flat` (their unit's gathered
    /// float32 values) until the guard drops; the views take gradients.
    pub fn bind_adapters(&self, flat: &Tensor, layout: &UnitLayout) -> Bound {
        bind_vars(&self.adapters, flat, layout)
    }

    /// The variables (leaves that require grad), in slot order.
    pub fn vars(&self) -> Vec<Tensor> {
        self.vars.iter().map(|(_, v)| v.shallow_clone()).collect()
    }

    /// Points the variables at views of `flat` (the unit's gathered
    /// parameters, already in the compute dtype) until the guard drops.
    pub fn bind(&self, flat: &Tensor, layout: &UnitLayout) -> Bound {
        bind_vars(&self.vars, flat, layout)
    }
}

fn bind_vars(named: &[(String, Tensor)], flat: &Tensor, layout: &UnitLayout) -> Bound {
    assert_eq!(layout.slots.len(), named.len(), "{}", layout.name);
    let vars: Vec<Tensor> = named.iter().map(|(_, v)| v.shallow_clone()).collect();
    for ((slot, (name, _)), var) in layout.slots.iter().zip(named).zip(&vars) {
        assert_eq!(&slot.name, name, "shell and layout disagree");
        var.shallow_clone().set_data(&slot.view(flat).detach());
    }
    Bound { vars }
}

/// Variables bound to a gathered buffer; unbinds on drop.
pub struct Bound {
    vars: Vec<Tensor>,
}

impl Drop for Bound {
    fn drop(&mut self) {
        for v in &self.vars {
            let empty = Tensor::empty([0], (v.kind(), v.device()));
            v.shallow_clone().set_data(&empty);
        }
    }
}

/// The final RMSNorm, with its weight supplied per use.
pub fn norm_shell(cfg: &ModelConfig, device: Device) -> (nn::VarStore, RmsNorm) {
    let vs = nn::VarStore::new(device);
    let plus_one = cfg.arch().expect("a validated config").norm_plus_one;
    let norm = RmsNorm::with(vs.root() / "model" / "norm", 0, cfg.rms_norm_eps, plus_one);
    (vs, norm)
}

//! LoRA (Hu et al. 2021) as PEFT defines it (`peft/tuners/lora/layer.py`):
//! a targeted linear computes `x Wᵀ + s · (x Aᵀ) Bᵀ` with `A: [r, in]`,
//! `B: [out, r]` and `s = alpha / r` (`alpha / √r` with rsLoRA). The
//! adapters are float32 variables of the model's own `VarStore`, named as
//! PEFT names them without its prefix and adapter name
//! (`model.layers.0.self_attn.q_proj.lora_A.weight`); every other variable
//! is frozen (no gradient). The input is cast to the adapter's dtype and
//! the sum back to the base's, as PEFT does.
//!
//! PEFT's default init: A Kaiming-uniform with `a = √5` (uniform in
//! `±1/√in`), B zero, so a fresh adapter leaves the model as it was. Drawn
//! from a private generator per adapter name (see `super::init`).
//!
//! The adapters of a model switch on and off together ([`Switch`]): a
//! DPO/PG reference is the base with them off, with no second copy.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{bail, Context};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{nn, Kind, Tensor};

pub use super::adapter::{with_dropout, Adapter, Adapters, DropoutKeys, Switch};
use super::llama::{DecoderLayer, FeedForward, Llama};
use super::weights;
use crate::config::LoraConfig;

/// The prefix PEFT's saved adapter keys carry (`PeftModel` wraps the
/// transformers model as `base_model.model`).
pub const PEFT_PREFIX: &str = "base_model.model.";

/// The adapter file of a PEFT adapter folder.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
/// Its config.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

/// Whether a variable name is an adapter's.
pub fn is_adapter(name: &str) -> bool {
    name.contains(".lora_A.") || name.contains(".lora_B.")
}

impl Llama {
    /// Runs `f` with this model's adapters off (the base model); a model
    /// without adapters runs it as it is.
    pub fn without_adapters<R>(&self, f: impl FnOnce() -> R) -> R {
        let Some(a) = &self.adapters else {
            return f();
        };
        struct Restore<'a>(&'a Switch);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.set(true);
            }
        }
        a.switch.set(false);
        let _restore = Restore(&a.switch);
        f()
    }

    /// The names of the variables that train: the adapters' in a LoRA
    /// model, else every variable (sorted).
    pub fn trainable(&self) -> Vec<(String, Tensor)> {
        let mut vars: Vec<(String, Tensor)> = self
            .vs
            .variables()
            .into_iter()
            .filter(|(n, _)| self.adapters.is_none() || is_adapter(n))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        vars
    }

    /// Each adapted linear's adapter, by module path.
    pub fn adapters(&self) -> Vec<(String, &Adapter)> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (name, l) in layer.self_attn.linears() {
                if let Some(a) = &l.adapter {
                    out.push((format!("model.layers.{i}.self_attn.{name}"), a));
                }
            }
            if let FeedForward::Dense(m) = &layer.mlp {
                for (name, l) in m.linears() {
                    if let Some(a) = &l.adapter {
                        out.push((format!("model.layers.{i}.mlp.{name}"), a));
                    }
                }
            }
        }
        out
    }
}

/// Puts adapters on the modules `lora` targets, freezes every other
/// variable, and sets the adapters from `lora.init` (a PEFT folder) or
/// PEFT's initialisation drawn from `seed`. Adapters are float32.
pub fn attach(model: &mut Llama, lora: &LoraConfig, seed: u64) -> anyhow::Result<()> {
    if model.adapters.is_some() {
        bail!("the model already has adapters");
    }
    for (_, t) in model.vs.variables() {
        let _ = t.set_requires_grad(false);
    }
    let per_layer = targets_per_layer(&model.arch, lora)?;
    let switch = Switch::new();
    let root = model.vs.root();
    let mut modules = Vec::new();
    for (i, layer) in model.layers.iter_mut().enumerate() {
        modules.extend(attach_layer(
            layer,
            &root,
            i,
            &per_layer[i],
            lora,
            seed,
            &switch,
        ));
    }
    model.adapters = Some(Adapters {
        config: lora.clone(),
        switch,
        modules,
    });
    if let Some(dir) = &lora.init {
        load_adapter(model, dir).with_context(|| format!("lora.init: {}", dir.display()))?;
    }
    Ok(())
}

/// The modules `lora` adapts in each decoder layer of `arch`.
pub fn targets_per_layer(
    arch: &accrue_arch::Arch,
    lora: &LoraConfig,
) -> anyhow::Result<Vec<accrue_arch::lora::LayerTargets>> {
    accrue_arch::lora::resolve(arch, &lora.targets)
        .map_err(|e| anyhow::anyhow!("lora.target_modules: {e}"))
}

/// Puts adapters (PEFT's init from `seed`, float32 variables under
/// `root`, switched by `switch`) on the modules of decoder layer `i` that
/// `targets` names; returns their module paths. The fsdp trainer's layer
/// shells take theirs from here too (zero-sized until bound).
pub fn attach_layer(
    layer: &mut DecoderLayer,
    root: &nn::Path,
    i: usize,
    targets: &accrue_arch::lora::LayerTargets,
    lora: &LoraConfig,
    seed: u64,
    switch: &Switch,
) -> Vec<String> {
    let scale = lora.scaling();
    let r = lora.rank as i64;
    let device = root.device();
    let mut linears: Vec<(String, &mut super::linear::Linear)> = Vec::new();
    for (name, l) in layer.self_attn.linears_mut() {
        if targets.adapts(name) {
            linears.push((format!("model.layers.{i}.self_attn.{name}"), l));
        }
    }
    if let FeedForward::Dense(m) = &mut layer.mlp {
        for (name, l) in m.linears_mut() {
            if targets.mlp.contains(&name) {
                linears.push((format!("model.layers.{i}.mlp.{name}"), l));
            }
        }
    }
    let mut modules = Vec::new();
    for (path, l) in linears {
        let size = l.base.ws.size();
        let (out, inp) = (size[0], size[1]);
        let mut p = root.clone();
        for part in path.split('.') {
            p = &p / part;
        }
        let a_name = format!("{path}.lora_A.weight");
        let a = kaiming_uniform(seed, &a_name, r, inp).to_device(device);
        let b = Tensor::zeros([out, r], (Kind::Float, device));
        let a = (&p / "lora_A").add("weight", a, true);
        let b = (&p / "lora_B").add("weight", b, true);
        l.adapter = Some(Adapter {
            a,
            b,
            scale,
            switch: switch.clone(),
            dropout: lora.dropout,
            module: path.clone(),
        });
        modules.push(path);
    }
    modules
}

/// PEFT's `kaiming_uniform_(a = √5)` of an `[r, in]` weight: uniform in
/// `±1/√in`, drawn for `name` from `seed`.
fn kaiming_uniform(seed: u64, name: &str, r: i64, inp: i64) -> Tensor {
    let bound = 1.0 / (inp as f64).sqrt();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(super::init::stream_of(name));
    let values: Vec<f32> = (0..r * inp)
        .map(|_| rng.random_range(-bound..bound) as f32)
        .collect();
    Tensor::from_slice(&values).view([r, inp])
}

/// Sets the model's adapters from a PEFT adapter folder: its
/// `adapter_config.json` must agree with the job's rank, alpha and
/// rsLoRA, and `adapter_model.safetensors` must hold exactly the adapters
/// of the targeted modules, shaped as they are.
pub fn load_adapter(model: &Llama, dir: &Path) -> anyhow::Result<()> {
    let Some(adapters) = &model.adapters else {
        bail!("the model has no adapters to load into");
    };
    check_adapter_config(dir, &adapters.config)?;
    let file = dir.join(ADAPTER_FILE);
    let tensors = weights::read_tensors(std::slice::from_ref(&file))?;
    let mut named = HashMap::new();
    for (k, t) in tensors {
        let Some(name) = k.strip_prefix(PEFT_PREFIX) else {
            bail!(
                "{}: tensor {k} is not a PEFT adapter key (no {PEFT_PREFIX} prefix)",
                file.display()
            );
        };
        // Older PEFT versions kept the adapter's name in the key.
        let name = name
            .replace(".lora_A.default.", ".lora_A.")
            .replace(".lora_B.default.", ".lora_B.");
        named.insert(name, t);
    }
    let vars: HashMap<String, Tensor> = model.trainable().into_iter().collect();
    weights::copy_into(&vars, &named, &file)
}

/// Refuses an adapter folder whose config trains another adapter than
/// the job's (another rank, scale or kind of adapter).
fn check_adapter_config(dir: &Path, lora: &LoraConfig) -> anyhow::Result<()> {
    let path = dir.join(ADAPTER_CONFIG);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let c: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let field = |k: &str| c.get(k).filter(|v| !v.is_null());
    if let Some(t) = field("peft_type").and_then(|v| v.as_str()) {
        if t != "LORA" {
            bail!(
                "{}: peft_type {t:?}, a [lora] job needs \"LORA\"",
                path.display()
            );
        }
    }
    for flag in ["use_dora", "lora_bias"] {
        if field(flag).and_then(|v| v.as_bool()) == Some(true) {
            bail!(
                "{}: {flag} is set; Accrue trains plain LoRA adapters",
                path.display()
            );
        }
    }
    let r = field("r").and_then(|v| v.as_u64());
    if r != Some(lora.rank as u64) {
        bail!(
            "{}: r = {}, the job's lora.rank is {}",
            path.display(),
            r.map_or("missing".into(), |r| r.to_string()),
            lora.rank
        );
    }
    let alpha = field("lora_alpha").and_then(|v| v.as_f64());
    if alpha != Some(lora.alpha) {
        bail!(
            "{}: lora_alpha = {}, the job's lora.alpha is {}",
            path.display(),
            alpha.map_or("missing".into(), |a| a.to_string()),
            lora.alpha
        );
    }
    let rs = field("use_rslora")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    if rs != lora.use_rslora {
        bail!(
            "{}: use_rslora = {rs}, the job's lora.use_rslora is {}",
            path.display(),
            lora.use_rslora
        );
    }
    for pattern in ["rank_pattern", "alpha_pattern"] {
        if field(pattern)
            .and_then(|v| v.as_object())
            .is_some_and(|o| !o.is_empty())
        {
            bail!(
                "{}: {pattern} gives modules their own rank or alpha; Accrue trains one rank and alpha",
                path.display()
            );
        }
    }
    Ok(())
}

/// The `adapter_config.json` PEFT reads for these adapters of a model
/// whose base is `base` (`base_model_name_or_path`).
pub fn adapter_config(adapters: &Adapters, base: &str) -> serde_json::Value {
    adapter_config_of(&adapters.config, &adapters.modules, base)
}

/// [`adapter_config`] of adapters `c` on the modules at `modules` (HF
/// paths).
pub fn adapter_config_of(c: &LoraConfig, modules: &[String], base: &str) -> serde_json::Value {
    let mut targets: Vec<&str> = modules
        .iter()
        .filter_map(|m| m.rsplit('.').next())
        .collect();
    targets.sort_unstable();
    targets.dedup();
    serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": c.rank,
        "lora_alpha": c.alpha,
        "lora_dropout": c.dropout,
        "use_rslora": c.use_rslora,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "use_dora": false,
    })
}

/// Writes `adapter_model.safetensors` (PEFT's keys) and
/// `adapter_config.json` into `dir`: what `PeftModel.from_pretrained`
/// loads. `tensors` are the adapters by variable name.
pub fn write_adapter_folder(
    dir: &Path,
    tensors: &[(String, Tensor)],
    config: &serde_json::Value,
) -> anyhow::Result<Vec<String>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let keyed: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| (format!("{PEFT_PREFIX}{n}"), t.shallow_clone()))
        .collect();
    weights::write_tensors(&dir.join(ADAPTER_FILE), &keyed, BTreeMap::new())?;
    let path = dir.join(ADAPTER_CONFIG);
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(config)?)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(vec![ADAPTER_FILE.into(), ADAPTER_CONFIG.into()])
}

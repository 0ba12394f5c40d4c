//! Which linear modules LoRA adapts (`[lora] target_modules`), resolved
//! against a model's architecture the way PEFT resolves them on the same
//! transformers model: a name adapts every module whose HF path ends with
//! it (`q_proj` → `model.layers.{i}.self_attn.q_proj`), `"all-linear"`
//! every linear of the decoder layers (never the LM head). Shared by the
//! coordinator's admission (an unknown name is refused there, naming the
//! model's modules) and the workers' model.
//!
//! Mixture-of-experts layers: transformers 5 stores a sparse layer's
//! experts as fused parameters, not linear modules, so a name such as
//! `gate_proj` reaches only the dense layers' MLPs, as it does in PEFT.
//! PEFT's `"all-linear"` on such a model also wraps the experts and the
//! router as parameters, which Accrue does not adapt: it is refused for
//! them, and the message says to name the modules.

use crate::Arch;

/// The attention projections every layer has.
pub const ATTENTION: [&str; 4] = ["q_proj", "k_proj", "v_proj", "o_proj"];
/// A dense MLP's projections.
pub const MLP: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// `target_modules` as the spec gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Targets {
    /// PEFT's `"all-linear"`.
    AllLinear,
    /// Module names (a name matches a module path ending with it).
    Named(Vec<String>),
}

/// The modules one decoder layer adapts (short names, in model order).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LayerTargets {
    pub attention: Vec<&'static str>,
    /// Empty on a sparse layer.
    pub mlp: Vec<&'static str>,
}

impl LayerTargets {
    /// Whether the layer's module `name` (short) is adapted.
    pub fn adapts(&self, name: &str) -> bool {
        self.attention.contains(&name) || self.mlp.contains(&name)
    }
}

/// The linear modules of the model's decoder layers, by short name
/// (attention first, then the dense MLP's when some layer is dense).
pub fn module_names(arch: &Arch) -> Vec<&'static str> {
    let dense = arch
        .layers
        .iter()
        .any(|l| l.sparse.is_none() || arch.moe.is_none());
    let mut out = ATTENTION.to_vec();
    if dense {
        out.extend(MLP);
    }
    out
}

/// Resolves `targets` per decoder layer. An empty list, a name no module
/// of this model has, or `"all-linear"` on a mixture-of-experts model is
/// an error saying which names the model has.
pub fn resolve(arch: &Arch, targets: &Targets) -> Result<Vec<LayerTargets>, String> {
    let names = module_names(arch);
    let chosen: Vec<&'static str> = match targets {
        Targets::AllLinear => {
            if arch.routing_width().is_some() {
                return Err(format!(
                    "\"all-linear\" on a mixture-of-experts model adapts its experts and router in \
                     PEFT, which Accrue does not; name the modules instead (this model has: {})",
                    names.join(", ")
                ));
            }
            names.clone()
        }
        Targets::Named(list) => {
            if list.is_empty() {
                return Err(format!(
                    "is empty: name the modules to adapt (this model has: {}) or \"all-linear\"",
                    names.join(", ")
                ));
            }
            let mut out = Vec::new();
            for want in list {
                let short = want.rsplit('.').next().unwrap_or(want);
                // A dotted name must still be a suffix of the module path.
                let full_ok = |m: &str| {
                    let path = if ATTENTION.contains(&m) {
                        format!("model.layers.0.self_attn.{m}")
                    } else {
                        format!("model.layers.0.mlp.{m}")
                    };
                    path == *want || path.ends_with(&format!(".{want}"))
                };
                match names.iter().find(|m| **m == short && full_ok(m)) {
                    Some(m) if !out.contains(m) => out.push(*m),
                    Some(_) => {}
                    None => {
                        return Err(format!(
                            "{want:?} is no linear module of this model (it has: {}, or \"all-linear\")",
                            names.join(", ")
                        ))
                    }
                }
            }
            out
        }
    };
    Ok(arch
        .layers
        .iter()
        .map(|l| {
            let sparse = l.sparse.is_some() && arch.moe.is_some();
            LayerTargets {
                attention: ATTENTION
                    .iter()
                    .copied()
                    .filter(|m| chosen.contains(m))
                    .collect(),
                mlp: if sparse {
                    Vec::new()
                } else {
                    MLP.iter().copied().filter(|m| chosen.contains(m)).collect()
                },
            }
        })
        .collect())
}

/// PEFT's scaling of the adapter's output: `alpha / r`, or `alpha / √r`
/// with rank-stabilised LoRA.
pub fn scaling(rank: usize, alpha: f64, use_rslora: bool) -> f64 {
    if use_rslora {
        alpha / (rank as f64).sqrt()
    } else {
        alpha / rank as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelConfig;

    fn arch(json: &str) -> Arch {
        ModelConfig::from_json(&serde_json::from_str(json).unwrap())
            .unwrap()
            .arch()
            .unwrap()
    }

    const LLAMA: &str = r#"{"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}"#;
    const MOE: &str = r#"{"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [1]}"#;

    #[test]
    fn names_and_all_linear_resolve_per_layer() {
        let a = arch(LLAMA);
        let all = resolve(&a, &Targets::AllLinear).unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].attention, ATTENTION.to_vec());
        assert_eq!(all[1].mlp, MLP.to_vec());
        let some = resolve(
            &a,
            &Targets::Named(vec![
                "v_proj".into(),
                "self_attn.q_proj".into(),
                "q_proj".into(),
            ]),
        )
        .unwrap();
        assert_eq!(some[0].attention, vec!["q_proj", "v_proj"]);
        assert!(some[0].mlp.is_empty());
        assert!(!some[0].adapts("k_proj"));
    }

    #[test]
    fn unknown_names_and_experts_are_refused_naming_the_modules() {
        let a = arch(LLAMA);
        let e = resolve(&a, &Targets::Named(vec!["qkv_proj".into()])).unwrap_err();
        assert!(
            e.contains("\"qkv_proj\"") && e.contains("q_proj, k_proj"),
            "{e}"
        );
        let e = resolve(&a, &Targets::Named(vec!["mlp.q_proj".into()])).unwrap_err();
        assert!(e.contains("mlp.q_proj"), "{e}");
        assert!(resolve(&a, &Targets::Named(vec![])).is_err());
        let m = arch(MOE);
        let e = resolve(&m, &Targets::AllLinear).unwrap_err();
        assert!(e.contains("experts"), "{e}");
        // Named MLP modules reach the dense layer only.
        let r = resolve(&m, &Targets::Named(vec!["up_proj".into(), "o_proj".into()])).unwrap();
        assert!(r[0].mlp.is_empty());
        assert_eq!(r[1].mlp, vec!["up_proj"]);
        assert_eq!(r[0].attention, vec!["o_proj"]);
    }

    #[test]
    fn rslora_scales_by_the_root_of_the_rank() {
        assert_eq!(scaling(16, 32.0, false), 2.0);
        assert_eq!(scaling(16, 32.0, true), 8.0);
    }
}

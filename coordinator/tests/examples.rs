//! Every example job spec under deploy/examples parses and validates; the
//! only problems allowed are dataset files that `accrue data synth` writes
//! and checkpoints an earlier phase of a demo writes (neither is part of
//! the repository).

use std::path::Path;

use accrue_coordinator::job::spec::JobSpec;

#[test]
fn example_specs_are_valid() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = root.join("deploy/examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        seen += 1;
        let text = std::fs::read_to_string(&path).unwrap();
        match JobSpec::parse(&text, &root) {
            Ok(_) => {}
            Err(problems) => {
                let real: Vec<_> = problems
                    .iter()
                    .filter(|p| {
                        let data_field = [
                            "data.train",
                            "data.sources[",
                            "eval.sources[",
                            "rl.eval_prompts[",
                        ]
                        .iter()
                        .any(|f| p.field.starts_with(f));
                        // The checkpoint an earlier phase of a demo writes
                        // (the RL demo starts from its SFT run).
                        let earlier_phase = p.field == "model.init" && p.message.contains("/runs/");
                        let synthesized = data_field
                            && p.message.contains("file not found")
                            && p.message.contains("runs/data");
                        !(synthesized || earlier_phase)
                    })
                    .collect();
                assert!(real.is_empty(), "{}: {real:?}", path.display());
            }
        }
    }
    assert!(seen >= 2, "expected the sft and dpo demos, found {seen}");
}

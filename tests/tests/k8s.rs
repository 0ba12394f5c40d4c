//! Offline validation of deploy/ (issue 7 "Done means": CI renders and
//! validates every overlay and fails on a broken manifest): every overlay
//! under deploy/k8s/overlays is rendered with `kubectl kustomize`, each
//! object checked against its Kubernetes API schema and the containers
//! against the real binaries' `--help` (see k8s_check); the ConfigMap's
//! job spec passes `accrue validate` in a directory laid out like the
//! submit pod's mounts; the Dockerfiles pin their bases, run as non-root
//! and ship the binaries the workspace builds. No cluster, no container
//! engine: what those would add (pulling images, scheduling, a real
//! volume) is not exercised here.
//!
//! Needs `kubectl` on PATH and the worker build (scripts/test.sh sources
//! scripts/env.sh).

mod k8s_check;
mod real;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use k8s_check::{array, check, dockerfile, object_name, parse_yaml_stream, Help};
use real::{bin_dir, root};
use serde_json::Value;

/// deploy/k8s/overlays/*, by name.
fn overlays() -> Vec<(String, PathBuf)> {
    let dir = root().join("deploy/k8s/overlays");
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("kustomization.yaml").is_file())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    out.sort();
    assert!(
        out.len() >= 2,
        "expected the gpu and cpu-dev overlays in {}",
        dir.display()
    );
    out
}

/// `kubectl kustomize DIR`, parsed.
fn render(dir: &Path) -> Vec<Value> {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run `kubectl kustomize` ({e}): install kubectl (it bundles kustomize) to validate deploy/k8s")
        });
    assert!(
        out.status.success(),
        "kubectl kustomize {} failed:\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    parse_yaml_stream(&String::from_utf8_lossy(&out.stdout))
        .unwrap_or_else(|e| panic!("rendering of {}: {e}", dir.display()))
}

/// A binary and its subcommand path.
type Invocation = (String, Vec<String>);

/// `--help` of the built binaries, cached.
#[derive(Default)]
struct RealHelp(RefCell<BTreeMap<Invocation, Result<String, String>>>);

impl Help for RealHelp {
    fn help(&self, binary: &str, sub: &[String]) -> Result<String, String> {
        let key = (binary.to_string(), sub.to_vec());
        self.0
            .borrow_mut()
            .entry(key)
            .or_insert_with(|| {
                let out = Command::new(bin_dir().join(binary))
                    .args(sub)
                    .arg("--help")
                    .output()
                    .map_err(|e| e.to_string())?;
                if !out.status.success() {
                    return Err(String::from_utf8_lossy(&out.stderr).into_owned());
                }
                Ok(String::from_utf8_lossy(&out.stdout).into_owned())
            })
            .clone()
    }
}

#[test]
fn every_overlay_renders_and_matches_the_api_schemas_and_the_binaries() {
    let help = RealHelp::default();
    let mut all = Vec::new();
    for (name, dir) in overlays() {
        let docs = render(&dir);
        all.extend(
            check(&docs, &help)
                .into_iter()
                .map(|p| format!("{name}: {p}")),
        );
    }
    assert!(
        all.is_empty(),
        "{} problem(s):\n  {}",
        all.len(),
        all.join("\n  ")
    );
}

fn find<'a>(docs: &'a [Value], object: &str) -> &'a Value {
    docs.iter()
        .find(|d| object_name(d) == object)
        .unwrap_or_else(|| panic!("{object} is not rendered"))
}

fn container<'a>(doc: &'a mut Value, name: &str) -> &'a mut Value {
    doc["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

/// Regression guard for the checker itself: each mutation of a rendered
/// overlay adds exactly the problem it should, named by object and field.
#[test]
fn the_checker_catches_broken_manifests() {
    let help = RealHelp::default();
    let (_, dir) = &overlays()[0];
    let docs = render(dir);
    let before: BTreeSet<String> = check(&docs, &help)
        .iter()
        .map(ToString::to_string)
        .collect();
    type Mutation = fn(&mut [Value]);
    let cases: [(&str, Mutation, &str); 8] = [
        ("unknown field", |d| {
            let w = d.iter_mut().find(|d| object_name(d) == "Deployment/accrue-worker").unwrap();
            container(w, "worker")["imagePullPolcy"] = "Always".into();
        }, "Deployment/accrue-worker: spec.template.spec.containers[0].imagePullPolcy: unknown field"),
        ("probe on an undeclared port", |d| {
            let w = d.iter_mut().find(|d| object_name(d) == "Deployment/accrue-worker").unwrap();
            container(w, "worker")["livenessProbe"]["grpc"]["port"] = 7999.into();
        }, "Deployment/accrue-worker: spec.template.spec.containers[worker].livenessProbe.grpc.port: port 7999 is not a declared containerPort"),
        ("unknown flag", |d| {
            let w = d.iter_mut().find(|d| object_name(d) == "Deployment/accrue-worker").unwrap();
            container(w, "worker")["args"].as_array_mut().unwrap().push("--no-such-flag".into());
        }, "--no-such-flag is not a flag of `accrue-worker`"),
        ("misspelt env var", |d| {
            let c = d.iter_mut().find(|d| object_name(d) == "StatefulSet/accrue-coordinator").unwrap();
            container(c, "coordinator")["env"][0]["name"] = "ACCRUE_ADMIN_TOKN".into();
        }, "StatefulSet/accrue-coordinator: spec.template.spec.containers[coordinator].env[0]: ACCRUE_ADMIN_TOKN is not read by `accrue-coordinator`"),
        ("listen port not declared", |d| {
            let c = d.iter_mut().find(|d| object_name(d) == "StatefulSet/accrue-coordinator").unwrap();
            container(c, "coordinator")["args"][1] = "0.0.0.0:7080".into();
        }, "--listen 0.0.0.0:7080: port 7080 is not a declared containerPort"),
        ("service target port not declared", |d| {
            let s = d.iter_mut().find(|d| object_name(d) == "Service/accrue-coordinator").unwrap();
            s["spec"]["ports"][0]["targetPort"] = "grcp".into();
        }, "Service/accrue-coordinator: spec.ports[0].targetPort: \"grcp\" is not a declared containerPort"),
        ("coordinator url names no service", |d| {
            let w = d.iter_mut().find(|d| object_name(d) == "Deployment/accrue-worker").unwrap();
            container(w, "worker")["args"][1] = "http://accrue-coordinatr:7070".into();
        }, "no Service named \"accrue-coordinatr\" is rendered"),
        ("subcommand flag", |d| {
            let j = d.iter_mut().find(|d| object_name(d) == "Job/accrue-submit").unwrap();
            j["spec"]["template"]["spec"]["initContainers"][0]["args"][3] = "--tasks".into();
        }, "--tasks is not a flag of `accrue data synth`"),
    ];
    for (what, mutate, expected) in cases {
        let mut broken = docs.clone();
        mutate(&mut broken);
        let new: Vec<String> = check(&broken, &help)
            .iter()
            .map(ToString::to_string)
            .filter(|p| !before.contains(p))
            .collect();
        assert!(
            new.len() == 1 && new[0].contains(expected),
            "{what}: expected one new problem containing {expected:?}, got {new:#?}"
        );
    }
}

/// The source of a pod volume: `pvc:NAME` or `configMap:NAME`.
fn volume_source(pod: &Value, volume: &str) -> String {
    let v = array(&pod["volumes"])
        .find(|v| v["name"] == volume)
        .cloned()
        .unwrap_or_default();
    if let Some(c) = v["persistentVolumeClaim"]["claimName"].as_str() {
        format!("pvc:{c}")
    } else if let Some(c) = v["configMap"]["name"].as_str() {
        format!("configMap:{c}")
    } else {
        format!("volume:{volume}")
    }
}

/// (mountPath, source) of a container.
fn mounts(pod: &Value, c: &Value) -> BTreeSet<(String, String)> {
    array(&c["volumeMounts"])
        .map(|m| {
            (
                m["mountPath"].as_str().unwrap_or("").to_string(),
                volume_source(pod, m["name"].as_str().unwrap_or("")),
            )
        })
        .collect()
}

fn run_accrue(args: &[String], cwd: &Path) -> std::process::Output {
    Command::new(bin_dir().join("accrue"))
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap()
}

/// The submit Job's pod, emulated in a temp dir: its ConfigMap mounts
/// hold the ConfigMap's files, its volume mounts are directories, the init
/// containers run for real; then `accrue validate` checks the spec it
/// submits with every mounted path mapped under that directory. Every
/// mount the spec's paths use is also mounted, from the same source, on
/// the coordinator and the workers (they read those files too).
#[test]
fn the_job_spec_in_the_config_map_passes_accrue_validate() {
    for (name, dir) in overlays() {
        let docs = render(&dir);
        let job = find(&docs, "Job/accrue-submit");
        let pod = &job["spec"]["template"]["spec"];
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path().to_str().unwrap().to_string();
        let containers: Vec<&Value> = array(&pod["initContainers"])
            .chain(array(&pod["containers"]))
            .collect();
        let mut mount_paths = BTreeMap::new();
        for c in &containers {
            for (path, source) in mounts(pod, c) {
                let local = PathBuf::from(format!("{t}{path}"));
                std::fs::create_dir_all(&local).unwrap();
                if let Some(cm) = source.strip_prefix("configMap:") {
                    let data = &find(&docs, &format!("ConfigMap/{cm}"))["data"];
                    for (k, v) in data.as_object().unwrap() {
                        std::fs::write(local.join(k), v.as_str().unwrap()).unwrap();
                    }
                }
                mount_paths.insert(path, source);
            }
        }
        let map = |s: &str| -> String {
            match mount_paths
                .keys()
                .find(|m| s == *m || s.starts_with(&format!("{m}/")))
            {
                Some(_) => format!("{t}{s}"),
                None => s.to_string(),
            }
        };
        let cwd = |c: &Value| PathBuf::from(map(c["workingDir"].as_str().unwrap_or(&t)));
        for c in array(&pod["initContainers"]) {
            let args: Vec<String> = array(&c["args"])
                .map(|a| map(a.as_str().unwrap()))
                .collect();
            let out = run_accrue(&args, &cwd(c));
            assert!(
                out.status.success(),
                "{name}: init container {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let submit = containers.last().unwrap();
        let args: Vec<&str> = array(&submit["args"]).filter_map(Value::as_str).collect();
        assert_eq!(
            args.first(),
            Some(&"submit"),
            "{name}: the submit Job's container runs {args:?}"
        );
        let spec_path = args[1];
        let mut spec = std::fs::read_to_string(map(spec_path)).unwrap();
        let mut used = Vec::new();
        for (m, source) in &mount_paths {
            if spec.contains(&format!("\"{m}/")) {
                used.push((m.clone(), source.clone()));
                spec = spec.replace(&format!("\"{m}/"), &format!("\"{t}{m}/"));
            }
        }
        let mapped = tmp.path().join("job.mapped.toml");
        std::fs::write(&mapped, &spec).unwrap();
        let out = run_accrue(
            &["validate".into(), mapped.display().to_string()],
            &cwd(submit),
        );
        assert!(
            out.status.success(),
            "{name}: accrue validate {spec_path}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok: "));
        assert!(
            !used.is_empty(),
            "{name}: the spec uses none of the submit pod's mounts"
        );
        for object in ["StatefulSet/accrue-coordinator", "Deployment/accrue-worker"] {
            let w = find(&docs, object);
            let wpod = &w["spec"]["template"]["spec"];
            let c = array(&wpod["containers"]).next().unwrap();
            let have = mounts(wpod, c);
            for u in &used {
                assert!(
                    have.contains(u),
                    "{name}: {object} does not mount {} from {} (the job spec reads it)",
                    u.0,
                    u.1
                );
            }
        }
    }
}

#[test]
fn workers_scale_as_a_deployment_and_the_gpu_overlay_runs_8_gpu_pods() {
    for (name, dir) in overlays() {
        let docs = render(&dir);
        let w = find(&docs, "Deployment/accrue-worker");
        let pod = &w["spec"]["template"]["spec"];
        assert!(
            pod["terminationGracePeriodSeconds"].as_i64() >= Some(900),
            "{name}: workers need time to drain"
        );
        let c = find(&docs, "StatefulSet/accrue-coordinator");
        assert_eq!(c["spec"]["replicas"], 1, "{name}: exactly one coordinator");
        assert!(
            !c["spec"]["volumeClaimTemplates"][0].is_null(),
            "{name}: the state dir needs a PVC"
        );
        let gpu =
            &array(&pod["containers"]).next().unwrap()["resources"]["limits"]["nvidia.com/gpu"];
        match name.as_str() {
            "gpu" => {
                // An 8-GPU pod running one worker process per GPU.
                assert_eq!(gpu, "8", "{name}: 8-GPU pods");
                let args: Vec<&str> = array(&array(&pod["containers"]).next().unwrap()["args"])
                    .filter_map(|a| a.as_str())
                    .collect();
                assert!(
                    args.windows(2).any(|w| w == ["--gpus", "all"]),
                    "{name}: one process per GPU needs --gpus all: {args:?}"
                );
                assert!(array(&pod["tolerations"]).any(|t| t["key"] == "nvidia.com/gpu"));
            }
            "cpu-dev" => {
                assert!(gpu.is_null(), "{name}: CPU workers ask for no GPU");
                assert_eq!(w["spec"]["replicas"], 2);
            }
            _ => {}
        }
    }
}

/// [[bin]] targets of the workspace, from `cargo metadata`.
fn workspace_bins() -> BTreeSet<String> {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    array(&meta["packages"])
        .flat_map(|p| array(&p["targets"]))
        .filter(|t| array(&t["kind"]).any(|k| k == "bin"))
        .filter_map(|t| t["name"].as_str().map(String::from))
        .collect()
}

/// The containerPorts the rendered manifests declare for containers
/// running `binary`.
fn manifest_ports(binary: &str) -> BTreeSet<u16> {
    let mut ports = BTreeSet::new();
    for (_, dir) in overlays() {
        for d in render(&dir) {
            let pod = &d["spec"]["template"]["spec"];
            for c in array(&pod["containers"]) {
                if array(&c["command"])
                    .next()
                    .and_then(Value::as_str)
                    .is_some_and(|s| s.ends_with(&format!("/{binary}")))
                {
                    ports.extend(
                        array(&c["ports"])
                            .filter_map(|p| p["containerPort"].as_u64())
                            .map(|p| p as u16),
                    );
                }
            }
        }
    }
    ports
}

#[test]
fn dockerfiles_pin_their_bases_run_as_non_root_and_ship_the_workspace_binaries() {
    let bins = workspace_bins();
    let docker = root().join("deploy/docker");
    for (file, entry) in [
        ("coordinator.Dockerfile", "accrue-coordinator"),
        ("worker.Dockerfile", "accrue-worker"),
    ] {
        let text = std::fs::read_to_string(docker.join(file)).unwrap();
        let df = dockerfile::parse(&text);
        let problems = dockerfile::check(&df, &bins, entry, &manifest_ports(entry));
        assert!(problems.is_empty(), "{file}:\n  {}", problems.join("\n  "));
    }
    // The checks can fail: a floating base and a root runtime are caught.
    let bad = dockerfile::parse(
        "FROM rust:latest AS b\nRUN cargo build --bin nope\nFROM debian\nUSER root\n",
    );
    let problems = dockerfile::check(&bad, &bins, "accrue-worker", &BTreeSet::from([7071]));
    for expected in [
        "rust:latest",
        "\"debian\" is not pinned",
        "runs as root",
        "nope",
        "EXPOSE",
    ] {
        assert!(
            problems.iter().any(|p| p.contains(expected)),
            "{expected:?} not in {problems:#?}"
        );
    }
    let ignore = std::fs::read_to_string(root().join(".dockerignore")).unwrap();
    for dir in ["target/", ".venv/", "runs/"] {
        assert!(
            ignore.lines().any(|l| l.trim() == dir),
            ".dockerignore must exclude {dir}"
        );
    }
}

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

/// A copy of deploy/k8s in a temp dir (to render a changed parameter or
/// an extra component without touching the repository).
fn copy_k8s() -> tempfile::TempDir {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            let target = to.join(e.file_name());
            if e.file_type().unwrap().is_dir() {
                copy(&e.path(), &target);
            } else {
                std::fs::copy(e.path(), &target).unwrap();
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    copy(&root().join("deploy/k8s"), &dir.path().join("k8s"));
    dir
}

/// Every overlay, plus the cpu-dev overlay with the loader component
/// (opt-in, so no overlay includes it).
fn rendered_everything() -> Vec<(String, Vec<Value>)> {
    let mut out: Vec<(String, Vec<Value>)> = overlays()
        .into_iter()
        .map(|(name, dir)| (name, render(&dir)))
        .collect();
    let copy = copy_k8s();
    let with_loader = copy.path().join("k8s/overlays/with-loader");
    std::fs::create_dir_all(&with_loader).unwrap();
    std::fs::write(
        with_loader.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
         resources:\n  - ../cpu-dev\ncomponents:\n  - ../../components/loader\n",
    )
    .unwrap();
    out.push(("with-loader".into(), render(&with_loader)));
    out
}

/// Pod Security Standards "restricted" (v1.35), the checks that apply to
/// what we ship: non-root, RuntimeDefault seccomp, no privilege escalation,
/// every capability dropped, no host namespaces, ports or paths. A pod-level
/// setting counts for every container, as the admission controller reads it.
#[test]
fn every_pod_passes_pod_security_restricted() {
    let mut bad = Vec::new();
    for (overlay, docs) in rendered_everything() {
        for d in docs
            .iter()
            .filter(|d| !d["spec"]["template"]["spec"].is_null())
        {
            let pod = &d["spec"]["template"]["spec"];
            let at = format!("{overlay}: {}", object_name(d));
            for host in ["hostNetwork", "hostPID", "hostIPC"] {
                if pod[host] == true {
                    bad.push(format!("{at}: {host}"));
                }
            }
            if array(&pod["volumes"]).any(|v| !v["hostPath"].is_null()) {
                bad.push(format!("{at}: a hostPath volume"));
            }
            let psc = &pod["securityContext"];
            for c in array(&pod["initContainers"]).chain(array(&pod["containers"])) {
                let name = c["name"].as_str().unwrap_or("?");
                let csc = &c["securityContext"];
                let either = |key: &str| {
                    if csc[key].is_null() {
                        psc[key].clone()
                    } else {
                        csc[key].clone()
                    }
                };
                if either("runAsNonRoot") != true {
                    bad.push(format!("{at}/{name}: runAsNonRoot is not true"));
                }
                if either("runAsUser") == 0 {
                    bad.push(format!("{at}/{name}: runs as uid 0"));
                }
                if either("seccompProfile")["type"] != "RuntimeDefault" {
                    bad.push(format!("{at}/{name}: seccompProfile is not RuntimeDefault"));
                }
                if csc["allowPrivilegeEscalation"] != false {
                    bad.push(format!(
                        "{at}/{name}: allowPrivilegeEscalation is not false"
                    ));
                }
                if csc["privileged"] == true {
                    bad.push(format!("{at}/{name}: privileged"));
                }
                if !array(&csc["capabilities"]["drop"]).any(|c| c == "ALL") {
                    bad.push(format!("{at}/{name}: capabilities.drop lacks ALL"));
                }
                if array(&csc["capabilities"]["add"]).any(|c| c != "NET_BIND_SERVICE") {
                    bad.push(format!("{at}/{name}: adds capabilities"));
                }
                if array(&c["ports"]).any(|p| !p["hostPort"].is_null()) {
                    bad.push(format!("{at}/{name}: a hostPort"));
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Issue 33 (10): the coordinator image's user has no home and `/` is not
/// writable, so the token cache's default root could not be created and
/// every chat or tokenized job failed at admission. Every container of the
/// coordinator image points `ACCRUE_CACHE_DIR` into a writable mount (the
/// shared volume), and the image itself sets a root it owns.
#[test]
fn every_coordinator_image_container_has_a_writable_token_cache() {
    let mut bad = Vec::new();
    let mut seen = 0;
    for (overlay, docs) in rendered_everything() {
        for d in docs
            .iter()
            .filter(|d| !d["spec"]["template"]["spec"].is_null())
        {
            let pod = &d["spec"]["template"]["spec"];
            for c in array(&pod["initContainers"]).chain(array(&pod["containers"])) {
                // The commands that tokenize or look into the cache.
                let command: Vec<&str> = array(&c["command"])
                    .chain(array(&c["args"]))
                    .filter_map(|a| a.as_str())
                    .collect();
                let tokenizes = match command.as_slice() {
                    [bin, ..] if bin.ends_with("/accrue-coordinator") => true,
                    [bin, sub, rest @ ..] if bin.ends_with("/accrue") => {
                        matches!(*sub, "submit" | "validate" | "local")
                            || (*sub == "data" && rest.first() == Some(&"prepare"))
                    }
                    _ => false,
                };
                if !tokenizes {
                    continue;
                }
                seen += 1;
                let at = format!("{overlay}: {}/{}", object_name(d), c["name"]);
                let Some(dir) = array(&c["env"])
                    .find(|e| e["name"] == "ACCRUE_CACHE_DIR")
                    .and_then(|e| e["value"].as_str())
                else {
                    bad.push(format!("{at}: no ACCRUE_CACHE_DIR"));
                    continue;
                };
                let writable = array(&c["volumeMounts"]).any(|m| {
                    m["readOnly"] != true
                        && m["mountPath"]
                            .as_str()
                            .is_some_and(|p| Path::new(dir).starts_with(p))
                });
                if !writable {
                    bad.push(format!(
                        "{at}: ACCRUE_CACHE_DIR={dir} is in no writable mount"
                    ));
                }
            }
        }
    }
    assert!(
        seen > 0,
        "no container of the coordinator image was checked"
    );
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    let text =
        std::fs::read_to_string(root().join("deploy/docker/coordinator.Dockerfile")).unwrap();
    let env = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("ENV ACCRUE_CACHE_DIR="))
        .expect("the coordinator image sets ACCRUE_CACHE_DIR");
    let owned = text
        .lines()
        .filter_map(|l| l.split("chown -R 65532:65532 ").nth(1))
        .any(|d| Path::new(env).starts_with(d.trim()));
    assert!(
        owned,
        "ACCRUE_CACHE_DIR={env} is not under a directory the image's user owns"
    );
}

/// OpenShift's restricted SCC gives each pod a random uid from the
/// namespace's range and refuses fixed ones: the openshift overlay has
/// none, and keeps the rest of the gpu overlay.
#[test]
fn the_openshift_overlay_asks_for_no_fixed_uid_or_group() {
    let dir = root().join("deploy/k8s/overlays/openshift");
    let docs = render(&dir);
    let gpu = render(&root().join("deploy/k8s/overlays/gpu"));
    assert_eq!(
        docs.iter().map(object_name).collect::<BTreeSet<_>>(),
        gpu.iter().map(object_name).collect::<BTreeSet<_>>(),
        "openshift renders the gpu overlay's objects"
    );
    let text = serde_json::to_string(&docs).unwrap();
    for key in ["runAsUser", "runAsGroup", "\"fsGroup\""] {
        assert!(!text.contains(key), "openshift: {key} is set");
    }
    for d in docs
        .iter()
        .filter(|d| !d["spec"]["template"]["spec"].is_null())
    {
        assert_eq!(
            d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"],
            true,
            "{}",
            object_name(d)
        );
    }
}

/// The shared volume's storage class comes from the overlay's params.env:
/// what the file says is what renders, and changing the one line changes
/// it. Pods that mount it re-own it only on a root mismatch.
#[test]
fn the_shared_volume_storage_class_is_a_parameter() {
    for (name, dir) in overlays() {
        let docs = render(&dir);
        let params = std::fs::read_to_string(dir.join("params.env"))
            .or_else(|_| std::fs::read_to_string(dir.join("../gpu/params.env")))
            .unwrap_or_else(|e| panic!("{name}: params.env: {e}"));
        let want = params
            .lines()
            .find_map(|l| l.strip_prefix("shared_storage_class="))
            .unwrap_or_else(|| panic!("{name}: params.env sets no shared_storage_class"));
        let pvc = find(&docs, "PersistentVolumeClaim/accrue-shared");
        assert_eq!(pvc["spec"]["storageClassName"], want, "{name}");
        for d in docs
            .iter()
            .filter(|d| !d["spec"]["template"]["spec"].is_null())
        {
            let pod = &d["spec"]["template"]["spec"];
            let mounts_shared = array(&pod["volumes"])
                .any(|v| v["persistentVolumeClaim"]["claimName"] == "accrue-shared");
            if mounts_shared {
                assert_eq!(
                    pod["securityContext"]["fsGroupChangePolicy"],
                    "OnRootMismatch",
                    "{name}: {}",
                    object_name(d)
                );
            }
        }
    }
    let copy = copy_k8s();
    let params = copy.path().join("k8s/overlays/cpu-dev/params.env");
    std::fs::write(&params, "shared_storage_class=fast-rwx\n").unwrap();
    let docs = render(&copy.path().join("k8s/overlays/cpu-dev"));
    assert_eq!(
        find(&docs, "PersistentVolumeClaim/accrue-shared")["spec"]["storageClassName"],
        "fast-rwx"
    );
}

/// Metric names (`accrue_…`) a PromQL expression uses.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("accrue_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

/// The names the exporters register (string literals in their code).
fn exported_names() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for file in [
        "coordinator/src/shell/prometheus/families.rs",
        "worker/src/metrics.rs",
    ] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        for part in text.split('"').skip(1).step_by(2) {
            if part.starts_with("accrue_") && !part.contains(['{', ' ']) {
                out.insert(part.to_string());
            }
        }
    }
    out
}

/// A series name of an exported family: the family itself or a
/// histogram's _bucket/_sum/_count.
fn is_exported(name: &str, exported: &BTreeSet<String>) -> bool {
    exported.contains(name)
        || ["_bucket", "_sum", "_count"]
            .iter()
            .any(|s| name.strip_suffix(s).is_some_and(|b| exported.contains(b)))
}

/// Monitoring: the workers' metrics port is in a Service; the PodMonitor
/// scrapes a port named `metrics` that every Accrue pod serving metrics
/// declares; the alerts (no committed step, worker lost, checkpoint
/// failing) and every dashboard query name metrics the exporters really
/// export and select by `job_id` (Prometheus overwrites a `job` label).
#[test]
fn monitoring_scrapes_every_pod_and_alerts_on_real_metrics_by_job_id() {
    let exported = exported_names();
    assert!(
        exported.contains("accrue_steps_committed_total"),
        "{exported:?}"
    );
    let code = std::fs::read_to_string(root().join("coordinator/src/shell/prometheus/families.rs"))
        .unwrap();
    assert!(
        !code.contains("&[\"job\"") && !code.contains("[\"job\","),
        "a coordinator metric is labelled `job`"
    );
    let docs = render(&root().join("deploy/k8s/overlays/gpu"));
    let svc = find(&docs, "Service/accrue-worker");
    assert!(
        array(&svc["spec"]["ports"]).any(|p| p["targetPort"] == "metrics"),
        "the workers' metrics port is not in a Service"
    );
    let monitor = find(&docs, "PodMonitor/accrue");
    let selector = &monitor["spec"]["selector"]["matchLabels"];
    let ports: BTreeSet<&str> = array(&monitor["spec"]["podMetricsEndpoints"])
        .filter_map(|e| e["port"].as_str())
        .collect();
    for object in ["Deployment/accrue-worker", "StatefulSet/accrue-coordinator"] {
        let d = find(&docs, object);
        let labels = &d["spec"]["template"]["metadata"]["labels"];
        for (k, v) in selector.as_object().unwrap() {
            assert_eq!(&labels[k], v, "{object} is not selected by the PodMonitor");
        }
        let declared: BTreeSet<&str> = array(&d["spec"]["template"]["spec"]["containers"])
            .flat_map(|c| array(&c["ports"]))
            .filter_map(|p| p["name"].as_str())
            .filter(|n| n.starts_with("metrics"))
            .collect();
        assert!(
            declared.contains("metrics"),
            "{object}: no port named metrics"
        );
        for p in &declared {
            assert!(ports.contains(p), "{object}: port {p} is not scraped");
        }
    }
    let rules = find(&docs, "PrometheusRule/accrue");
    let mut alerts = BTreeSet::new();
    let mut exprs = Vec::new();
    for g in array(&rules["spec"]["groups"]) {
        for r in array(&g["rules"]) {
            alerts.insert(r["alert"].as_str().unwrap_or("").to_string());
            exprs.push(r["expr"].as_str().unwrap().to_string());
        }
    }
    for want in [
        "AccrueNoCommittedStep",
        "AccrueWorkerLost",
        "AccrueCheckpointFailing",
    ] {
        assert!(alerts.contains(want), "alert {want} missing: {alerts:?}");
    }
    let dashboard = find(&docs, "ConfigMap/accrue-dashboard");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let json: Value =
        serde_json::from_str(dashboard["data"]["accrue-dashboard.json"].as_str().unwrap())
            .expect("the dashboard is JSON");
    let panels: Vec<&Value> = array(&json["panels"]).collect();
    assert!(panels.len() >= 8, "{} panels", panels.len());
    for p in &panels {
        let targets: Vec<&Value> = array(&p["targets"]).collect();
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        exprs.extend(
            targets
                .iter()
                .map(|t| t["expr"].as_str().unwrap().to_string()),
        );
    }
    for e in &exprs {
        let names = metric_names(e);
        assert!(!names.is_empty(), "{e}: names no accrue metric");
        for n in names {
            assert!(is_exported(&n, &exported), "{e}: {n} is not exported");
        }
        assert!(
            !e.contains("job=") && !e.contains("by (job)") && !e.contains("job,"),
            "{e}: selects by `job`, not `job_id`"
        );
    }
}

/// GPUs are released when no job needs them: in the gpu overlay a Job
/// follows the demo job (by its job.name, exit 0 on any end) and then
/// scales the worker Deployment to zero, with RBAC allowing exactly that.
#[test]
fn the_gpu_overlay_scales_the_workers_to_zero_when_the_job_ends() {
    let docs = render(&root().join("deploy/k8s/overlays/gpu"));
    let job = find(&docs, "Job/accrue-release");
    let pod = &job["spec"]["template"]["spec"];
    let wait = array(&pod["initContainers"]).next().expect("a wait step");
    let args: Vec<&str> = array(&wait["args"]).filter_map(Value::as_str).collect();
    let spec = std::fs::read_to_string(root().join("deploy/k8s/base/job.toml")).unwrap();
    let name = spec
        .lines()
        .find_map(|l| l.strip_prefix("name = "))
        .unwrap()
        .trim_matches('"');
    assert_eq!(&args[..2], ["watch", name], "{args:?}");
    assert!(args.contains(&"--exit-zero"), "{args:?}");
    let scale = array(&pod["containers"]).next().unwrap();
    let cmd: Vec<&str> = array(&scale["command"])
        .chain(array(&scale["args"]))
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        cmd,
        [
            "kubectl",
            "scale",
            "deployment/accrue-worker",
            "--replicas=0"
        ]
    );
    let sa = pod["serviceAccountName"].as_str().unwrap();
    let binding = find(&docs, &format!("RoleBinding/{sa}"));
    assert!(array(&binding["subjects"]).any(|s| s["name"] == sa));
    let role = find(
        &docs,
        &format!("Role/{}", binding["roleRef"]["name"].as_str().unwrap()),
    );
    assert!(array(&role["rules"]).any(|r| {
        array(&r["resources"]).any(|x| x == "deployments/scale")
            && array(&r["verbs"]).any(|v| v == "patch")
            && array(&r["resourceNames"]).any(|n| n == "accrue-worker")
    }));
}

/// Workers are disrupted one at a time and rank below the coordinator.
#[test]
fn workers_have_a_disruption_budget_and_rank_below_the_coordinator() {
    for (name, dir) in overlays() {
        let docs = render(&dir);
        let pdb = find(&docs, "PodDisruptionBudget/accrue-worker");
        assert_eq!(pdb["spec"]["maxUnavailable"], 1, "{name}");
        let workers = find(&docs, "Deployment/accrue-worker");
        assert_eq!(
            pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"],
            workers["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"],
            "{name}: the budget selects the workers"
        );
        let priority = |object: &str| -> i64 {
            let d = find(&docs, object);
            let class = d["spec"]["template"]["spec"]["priorityClassName"]
                .as_str()
                .unwrap_or_else(|| panic!("{name}: {object} has no priority class"));
            find(&docs, &format!("PriorityClass/{class}"))["value"]
                .as_i64()
                .unwrap()
        };
        assert!(
            priority("StatefulSet/accrue-coordinator") > priority("Deployment/accrue-worker"),
            "{name}"
        );
    }
}

/// The loader component (a model or dataset from the Hub onto the shared
/// volume) renders into a valid overlay, writes under /shared and reads
/// its token from an optional Secret.
#[test]
fn the_loader_component_downloads_onto_the_shared_volume() {
    let (_, docs) = rendered_everything()
        .into_iter()
        .find(|(n, _)| n == "with-loader")
        .unwrap();
    let problems = check(&docs, &RealHelp::default());
    assert!(problems.is_empty(), "{problems:?}");
    let job = find(&docs, "Job/accrue-loader");
    let pod = &job["spec"]["template"]["spec"];
    let c = array(&pod["containers"]).next().unwrap();
    assert!(mounts(pod, c).contains(&("/shared".to_string(), "pvc:accrue-shared".to_string())));
    let env: BTreeMap<&str, &Value> = array(&c["env"])
        .map(|e| (e["name"].as_str().unwrap(), e))
        .collect();
    assert!(env["DEST"]["value"]
        .as_str()
        .unwrap()
        .starts_with("/shared/"));
    assert_eq!(
        env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"],
        true
    );
}

//! Offline checks of rendered Kubernetes manifests (issue 7): every object
//! against its Kubernetes API schema (the typed `k8s-openapi` object; a
//! field the schema does not know is dropped by the round trip, and that
//! is reported), and every container running one of our binaries against
//! that binary's real `--help`: flags, `ACCRUE_*` variables, listen ports
//! declared as containerPorts, probe and Service ports naming declared
//! ports, the coordinator URL naming a rendered Service, mounts naming
//! declared volumes. [`check`] returns every problem at once.
#![allow(dead_code)]

mod crd;
pub mod dockerfile;
mod schema;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde_json::Value;

pub use schema::{parse_yaml_stream, roundtrip_dropped};

/// The binaries a container may run (the basename of `command[0]`).
pub const BINARIES: [&str; 3] = ["accrue", "accrue-coordinator", "accrue-worker"];

/// Outside tools a container may run instead (the release Job's kubectl,
/// the loader's shell): their image must be pinned, their flags are not
/// checked (we do not build them).
pub const TOOLS: [&str; 2] = ["kubectl", "sh"];

/// One thing wrong with one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// `Kind/name`.
    pub object: String,
    /// Path of the field inside the object.
    pub field: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.object, self.field, self.message)
    }
}

/// The `--help` text of a binary run with a subcommand path (empty for
/// none); `Err` when it cannot be run.
pub trait Help {
    fn help(&self, binary: &str, subcommand: &[String]) -> Result<String, String>;
}

/// `Kind/name` of a manifest.
pub fn object_name(doc: &Value) -> String {
    format!(
        "{}/{}",
        doc["kind"].as_str().unwrap_or("?"),
        doc["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// Every problem in a rendered set of manifests.
pub fn check(docs: &[Value], help: &dyn Help) -> Vec<Problem> {
    let mut out = Vec::new();
    for doc in docs {
        let object = object_name(doc);
        match roundtrip_dropped(doc) {
            Ok(dropped) => out.extend(dropped.into_iter().map(|(field, message)| Problem {
                object: object.clone(),
                field,
                message,
            })),
            Err(message) => out.push(Problem {
                object: object.clone(),
                field: "(object)".into(),
                message,
            }),
        }
    }
    let world = World::new(docs);
    for w in &world.workloads {
        check_pod(w, &world, help, &mut out);
    }
    for svc in docs.iter().filter(|d| d["kind"] == "Service") {
        check_service(svc, &world, &mut out);
    }
    out
}

/// A workload's pod template.
pub struct Workload<'a> {
    pub object: String,
    pub labels: BTreeMap<String, String>,
    pub pod: &'a Value,
    /// Volume names from a StatefulSet's volumeClaimTemplates.
    pub claim_templates: BTreeSet<String>,
}

/// What the checks look objects up in.
pub struct World<'a> {
    pub workloads: Vec<Workload<'a>>,
    pub services: BTreeMap<String, BTreeSet<i64>>,
    pub config_maps: BTreeSet<String>,
    pub claims: BTreeSet<String>,
}

impl<'a> World<'a> {
    pub fn new(docs: &'a [Value]) -> World<'a> {
        let names = |kind: &str| -> BTreeSet<String> {
            docs.iter()
                .filter(|d| d["kind"] == kind)
                .filter_map(|d| d["metadata"]["name"].as_str().map(String::from))
                .collect()
        };
        let mut workloads = Vec::new();
        for d in docs {
            if !matches!(
                d["kind"].as_str(),
                Some("Deployment" | "StatefulSet" | "Job" | "DaemonSet")
            ) {
                continue;
            }
            let t = &d["spec"]["template"];
            workloads.push(Workload {
                object: object_name(d),
                labels: string_map(&t["metadata"]["labels"]),
                pod: &t["spec"],
                claim_templates: array(&d["spec"]["volumeClaimTemplates"])
                    .filter_map(|c| c["metadata"]["name"].as_str().map(String::from))
                    .collect(),
            });
        }
        let services = docs
            .iter()
            .filter(|d| d["kind"] == "Service")
            .map(|d| {
                let ports = array(&d["spec"]["ports"])
                    .filter_map(|p| p["port"].as_i64())
                    .collect();
                (
                    d["metadata"]["name"].as_str().unwrap_or("").to_string(),
                    ports,
                )
            })
            .collect();
        World {
            workloads,
            services,
            config_maps: names("ConfigMap"),
            claims: names("PersistentVolumeClaim"),
        }
    }
}

pub fn array(v: &Value) -> impl Iterator<Item = &Value> {
    v.as_array().into_iter().flatten()
}

fn string_map(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string()))
        .collect()
}

/// Declared container ports: numbers and names.
fn declared_ports(c: &Value) -> (BTreeSet<i64>, BTreeSet<String>) {
    let ports: Vec<&Value> = array(&c["ports"]).collect();
    (
        ports
            .iter()
            .filter_map(|p| p["containerPort"].as_i64())
            .collect(),
        ports
            .iter()
            .filter_map(|p| p["name"].as_str().map(String::from))
            .collect(),
    )
}

/// Whether `port` (a number or a port name) is one of `c`'s containerPorts.
fn declares(c: &Value, port: &Value) -> bool {
    let (nums, names) = declared_ports(c);
    match port {
        Value::Number(n) => n.as_i64().is_some_and(|n| nums.contains(&n)),
        Value::String(s) => names.contains(s) || s.parse().is_ok_and(|n: i64| nums.contains(&n)),
        _ => false,
    }
}

/// Whether `flag` appears in `help` as a whole option name.
fn mentions(help: &str, word: &str) -> bool {
    help.match_indices(word).any(|(i, _)| {
        let next = help[i + word.len()..].chars().next();
        let prev = help[..i].chars().next_back();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            && !prev.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// The port of `host:port` (`off` and unparsable values: none).
fn port_of(addr: &str) -> Option<i64> {
    addr.rsplit_once(':').and_then(|(_, p)| p.parse().ok())
}

fn check_pod(w: &Workload<'_>, world: &World<'_>, help: &dyn Help, out: &mut Vec<Problem>) {
    let mut bad = |field: String, message: String| {
        out.push(Problem {
            object: w.object.clone(),
            field,
            message,
        })
    };
    let mut volumes: BTreeSet<String> = w.claim_templates.clone();
    for (i, v) in array(&w.pod["volumes"]).enumerate() {
        volumes.insert(v["name"].as_str().unwrap_or("").into());
        let field = format!("spec.template.spec.volumes[{i}]");
        if let Some(claim) = v["persistentVolumeClaim"]["claimName"].as_str() {
            if !world.claims.contains(claim) {
                bad(
                    field.clone(),
                    format!("PersistentVolumeClaim {claim:?} is not rendered"),
                );
            }
        }
        if let Some(cm) = v["configMap"]["name"].as_str() {
            if !world.config_maps.contains(cm) {
                bad(field, format!("ConfigMap {cm:?} is not rendered"));
            }
        }
    }
    for list in ["initContainers", "containers"] {
        for c in array(&w.pod[list]) {
            let name = c["name"].as_str().unwrap_or("?");
            let at = format!("spec.template.spec.{list}[{name}]");
            check_container(c, &at, &volumes, world, help, &mut bad);
        }
    }
}

fn check_container(
    c: &Value,
    at: &str,
    volumes: &BTreeSet<String>,
    world: &World<'_>,
    help: &dyn Help,
    bad: &mut dyn FnMut(String, String),
) {
    if let Some(image) = c["image"].as_str() {
        let tag = image
            .rsplit_once(':')
            .map(|(_, t)| t)
            .filter(|t| !t.contains('/'));
        if matches!(tag, None | Some("latest")) {
            bad(
                format!("{at}.image"),
                format!("{image:?} is not pinned to a tag"),
            );
        }
    }
    for (i, m) in array(&c["volumeMounts"]).enumerate() {
        let v = m["name"].as_str().unwrap_or("");
        if !volumes.contains(v) {
            bad(
                format!("{at}.volumeMounts[{i}]"),
                format!("volume {v:?} is not declared by the pod"),
            );
        }
    }
    for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
        for kind in ["grpc", "httpGet", "tcpSocket"] {
            let port = &c[probe][kind]["port"];
            if !port.is_null() && !declares(c, port) {
                bad(
                    format!("{at}.{probe}.{kind}.port"),
                    format!("port {port} is not a declared containerPort"),
                );
            }
        }
    }
    let env: Vec<(&str, Option<&str>)> = array(&c["env"])
        .map(|e| (e["name"].as_str().unwrap_or(""), e["value"].as_str()))
        .collect();
    let Some(command) = array(&c["command"]).filter_map(Value::as_str).next() else {
        bad(
            format!("{at}.command"),
            "not set: cannot tell which binary the container runs".into(),
        );
        return;
    };
    let binary = command.rsplit('/').next().unwrap_or(command);
    if TOOLS.contains(&binary) {
        return;
    }
    if !BINARIES.contains(&binary) {
        bad(
            format!("{at}.command"),
            format!("{command:?} is none of {BINARIES:?}"),
        );
        return;
    }
    let args: Vec<&str> = array(&c["command"])
        .skip(1)
        .chain(array(&c["args"]))
        .filter_map(Value::as_str)
        .collect();
    let sub: Vec<String> = if binary == "accrue" {
        args.iter()
            .take_while(|a| !a.starts_with('-'))
            .map(|a| a.to_string())
            .collect()
    } else {
        Vec::new()
    };
    let text = match help.help(binary, &sub) {
        Ok(t) => t,
        Err(e) => {
            bad(
                format!("{at}.args"),
                format!("{binary} {} --help failed: {e}", sub.join(" ")),
            );
            return;
        }
    };
    let shown = format!(
        "{binary}{}",
        sub.iter().map(|s| format!(" {s}")).collect::<String>()
    );
    for (i, a) in args.iter().enumerate() {
        for var in a
            .split("$(")
            .skip(1)
            .filter_map(|s| s.split_once(')'))
            .map(|(v, _)| v)
        {
            if !env.iter().any(|(n, _)| *n == var) {
                bad(
                    format!("{at}.args[{i}]"),
                    format!("$({var}) names no env var of the container"),
                );
            }
        }
        let Some(flag) = a.strip_prefix("--") else {
            continue;
        };
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) => (f, Some(v)),
            None => (flag, None),
        };
        if !mentions(&text, &format!("--{flag}")) {
            bad(
                format!("{at}.args[{i}]"),
                format!("--{flag} is not a flag of `{shown}` (see its --help)"),
            );
        }
        let value = inline.or_else(|| args.get(i + 1).copied().filter(|v| !v.starts_with("--")));
        let Some(value) = value else { continue };
        if (flag.ends_with("listen") || flag.ends_with("advertise")) && value != "off" {
            match port_of(value) {
                Some(p) if declares(c, &Value::from(p)) => {}
                Some(p) => bad(
                    format!("{at}.args[{i}]"),
                    format!("--{flag} {value}: port {p} is not a declared containerPort"),
                ),
                None => bad(
                    format!("{at}.args[{i}]"),
                    format!("--{flag} {value}: no port"),
                ),
            }
        }
        if flag == "coordinator" {
            check_coordinator_url(value, world, &format!("{at}.args[{i}]"), bad);
        }
    }
    for (i, (name, value)) in env.iter().enumerate() {
        if name.starts_with("ACCRUE_") && !mentions(&text, name) {
            bad(
                format!("{at}.env[{i}]"),
                format!("{name} is not read by `{shown}` (see its --help)"),
            );
        }
        if *name == "ACCRUE_COORDINATOR" {
            if let Some(v) = value {
                check_coordinator_url(v, world, &format!("{at}.env[{i}]"), bad);
            }
        }
    }
}

/// `http://SERVICE[.ns...]:PORT` must name a rendered Service and one of its ports.
fn check_coordinator_url(
    url: &str,
    world: &World<'_>,
    field: &str,
    bad: &mut dyn FnMut(String, String),
) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let (host, port) = match rest.trim_end_matches('/').rsplit_once(':') {
        Some((h, p)) => (h, p.parse::<i64>().ok()),
        None => (rest, None),
    };
    let service = host.split('.').next().unwrap_or(host);
    match (world.services.get(service), port) {
        (None, _) => bad(
            field.into(),
            format!("{url}: no Service named {service:?} is rendered"),
        ),
        (Some(ports), Some(p)) if !ports.contains(&p) => bad(
            field.into(),
            format!("{url}: Service {service} has no port {p}"),
        ),
        (Some(_), None) => bad(field.into(), format!("{url}: no port")),
        _ => {}
    }
}

fn check_service(svc: &Value, world: &World<'_>, out: &mut Vec<Problem>) {
    let object = object_name(svc);
    let selector = string_map(&svc["spec"]["selector"]);
    let pods: Vec<&Workload<'_>> = world
        .workloads
        .iter()
        .filter(|w| {
            !selector.is_empty() && selector.iter().all(|(k, v)| w.labels.get(k) == Some(v))
        })
        .collect();
    if pods.is_empty() {
        out.push(Problem {
            object,
            field: "spec.selector".into(),
            message: format!("{selector:?} selects no rendered pod template"),
        });
        return;
    }
    for (i, p) in array(&svc["spec"]["ports"]).enumerate() {
        let target = if p["targetPort"].is_null() {
            &p["port"]
        } else {
            &p["targetPort"]
        };
        for w in &pods {
            if !array(&w.pod["containers"]).any(|c| declares(c, target)) {
                out.push(Problem {
                    object: object.clone(),
                    field: format!("spec.ports[{i}].targetPort"),
                    message: format!("{target} is not a declared containerPort of {}", w.object),
                });
            }
        }
    }
}

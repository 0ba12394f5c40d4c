//! Dockerfiles checked without a container engine: every base image is
//! pinned to a tag (ARG defaults resolved), the runtime stage runs as a
//! non-root USER, the binaries built (`cargo build --bin X`) are workspace
//! binaries and are copied into the runtime stage, the entrypoint is one of
//! them, and EXPOSE matches the ports the manifests declare.

use std::collections::{BTreeMap, BTreeSet};

/// One `FROM` stage: its base, alias and instructions (continuations joined).
pub struct Stage {
    pub base: String,
    pub alias: Option<String>,
    pub lines: Vec<String>,
}

/// A parsed Dockerfile.
pub struct Dockerfile {
    pub stages: Vec<Stage>,
}

/// Splits `text` into stages, resolving `${X}`/`$X` in FROM lines from the
/// global ARG defaults.
pub fn parse(text: &str) -> Dockerfile {
    let mut logical = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || (t.is_empty() && cur.is_empty()) {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(head) => cur.push_str(head),
            None => {
                cur.push_str(t);
                logical.push(std::mem::take(&mut cur));
            }
        }
    }
    let mut args = BTreeMap::new();
    let mut stages: Vec<Stage> = Vec::new();
    for l in logical.into_iter().filter(|l| !l.trim().is_empty()) {
        let (op, rest) = l.split_once(char::is_whitespace).unwrap_or((&l, ""));
        let rest = rest.trim();
        match op.to_ascii_uppercase().as_str() {
            "ARG" if stages.is_empty() => {
                if let Some((k, v)) = rest.split_once('=') {
                    args.insert(k.to_string(), v.to_string());
                }
            }
            "FROM" => {
                let words: Vec<&str> = rest
                    .split_whitespace()
                    .filter(|w| !w.starts_with("--"))
                    .collect();
                let mut base = words.first().copied().unwrap_or("").to_string();
                // A default may name another ARG (`nvidia/cuda:${CUDA_VERSION}-...`).
                for _ in 0..4 {
                    for (k, v) in &args {
                        base = base
                            .replace(&format!("${{{k}}}"), v)
                            .replace(&format!("${k}"), v);
                    }
                }
                let alias = match words.as_slice() {
                    [_, as_, a] if as_.eq_ignore_ascii_case("as") => Some(a.to_string()),
                    _ => None,
                };
                stages.push(Stage {
                    base,
                    alias,
                    lines: Vec::new(),
                });
            }
            _ => {
                if let Some(s) = stages.last_mut() {
                    s.lines.push(l.clone());
                }
            }
        }
    }
    Dockerfile { stages }
}

fn instr<'a>(s: &'a Stage, op: &str) -> impl Iterator<Item = &'a str> {
    let op = op.to_string();
    s.lines.iter().filter_map(move |l| {
        let (o, rest) = l.split_once(char::is_whitespace)?;
        o.eq_ignore_ascii_case(&op).then_some(rest.trim())
    })
}

/// Every problem; `entry` is the binary the image runs, `ports` those the
/// manifests declare for it.
pub fn check(
    df: &Dockerfile,
    bins: &BTreeSet<String>,
    entry: &str,
    ports: &BTreeSet<u16>,
) -> Vec<String> {
    let mut p = Vec::new();
    let mut aliases = BTreeSet::new();
    for s in &df.stages {
        let tag = s
            .base
            .rsplit_once(':')
            .map(|(_, t)| t)
            .filter(|t| !t.contains('/'));
        if !aliases.contains(&s.base) && matches!(tag, None | Some("latest")) {
            p.push(format!("FROM {:?} is not pinned to a tag", s.base));
        }
        aliases.extend(s.alias.clone());
    }
    let Some(last) = df.stages.last() else {
        return vec!["no FROM".into()];
    };
    let mut built = BTreeSet::new();
    for s in &df.stages[..df.stages.len() - 1] {
        for run in instr(s, "RUN") {
            let words: Vec<&str> = run.split_whitespace().collect();
            for w in words.windows(2).filter(|w| w[0] == "--bin") {
                built.insert(w[1].to_string());
            }
        }
    }
    for b in &built {
        if !bins.contains(b) {
            p.push(format!(
                "builds --bin {b}, which is not a workspace binary ({bins:?})"
            ));
        }
    }
    let copied: BTreeSet<String> = instr(last, "COPY")
        .filter(|c| c.starts_with("--from"))
        .flat_map(|c| {
            let words: Vec<&str> = c.split_whitespace().skip(1).collect();
            let n = words.len().saturating_sub(1);
            words[..n]
                .iter()
                .map(|w| w.rsplit('/').next().unwrap_or(w).to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    for b in built.iter().filter(|b| !copied.contains(*b)) {
        p.push(format!(
            "builds {b} but does not copy it into the runtime stage"
        ));
    }
    if !copied.contains(entry) {
        p.push(format!("the runtime stage does not hold {entry}"));
    }
    if !instr(last, "ENTRYPOINT").any(|e| e.contains(&format!("/{entry}\""))) {
        p.push(format!("ENTRYPOINT is not {entry}"));
    }
    match instr(last, "USER").last() {
        None => p.push("the runtime stage runs as root (no USER)".into()),
        Some(u) if matches!(u.split(':').next(), Some("root" | "0")) => {
            p.push(format!("the runtime stage runs as root (USER {u})"))
        }
        Some(_) => {}
    }
    let exposed: BTreeSet<u16> = instr(last, "EXPOSE")
        .flat_map(|e| {
            e.split_whitespace()
                .filter_map(|w| w.split('/').next()?.parse().ok())
        })
        .collect();
    if &exposed != ports {
        p.push(format!(
            "EXPOSE {exposed:?} differs from the manifests' containerPorts {ports:?}"
        ));
    }
    p
}

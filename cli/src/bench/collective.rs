//! `accrue bench collective`: bus bandwidth of the TCP ring
//! (`accrue-collective`) for all_reduce, reduce_scatter and all_gather, one
//! OS process per rank on 127.0.0.1, beside `torch.distributed` with gloo on
//! the same sizes (`scripts/reference/bench_gloo.py`, embedded in the
//! binary).
//!
//! Bus bandwidth follows nccl-tests (`doc/PERFORMANCE.md`): `2(n−1)/n ·
//! bytes / time` for all_reduce, `(n−1)/n · bytes / time` for the others,
//! where time is the slowest rank's mean over the timed iterations; so the
//! numbers compare across world sizes and against the link speed.
//!
//! Ranks are this binary re-executed with the hidden `bench collective-rank`
//! subcommand: each binds 127.0.0.1:0, prints `ADDR host:port`, reads the
//! ring's link secret and every rank's address on one stdin line, forms the
//! ring and prints one JSON [`RankTiming`] per (op, size). `--seal` seals
//! every piece (AES-256-GCM, as a coordinator with TLS asks): run with and
//! without it to see what sealing costs.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accrue_collective::{LinkKey, RingConfig, TcpRing};
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// The Python reference, run with `python -c`.
const GLOO_SCRIPT: &str = include_str!("../../../scripts/reference/bench_gloo.py");

/// The operations measured, in order.
pub const OPS: [&str; 3] = ["all_reduce", "reduce_scatter", "all_gather"];

/// Timed iterations for a buffer of `bytes`: about 256 MiB moved, 5..=50
/// (the gloo script uses the same rule).
pub fn iters_for(bytes: usize) -> usize {
    ((256usize << 20) / bytes.max(1)).clamp(5, 50)
}

/// Bus bandwidth in GB/s (10⁹ bytes) of `op` moving `bytes` in `secs` at
/// world size `world`.
pub fn bus_bandwidth_gbps(op: &str, bytes: usize, world: usize, secs: f64) -> f64 {
    let n = world as f64;
    let factor = if op == "all_reduce" {
        2.0 * (n - 1.0) / n
    } else {
        (n - 1.0) / n
    };
    factor * bytes as f64 / secs / 1e9
}

/// One rank's timing of one (op, size), as printed by a rank process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankTiming {
    pub op: String,
    pub bytes: usize,
    pub world: usize,
    pub rank: usize,
    #[serde(default)]
    pub iters: usize,
    #[serde(default)]
    pub secs_per_iter: f64,
    /// Set when the implementation cannot run this op.
    #[serde(default)]
    pub error: Option<String>,
}

/// One row of the report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CollectiveRow {
    pub op: String,
    pub world: usize,
    pub size_mib: f64,
    pub accrue_ms: f64,
    pub accrue_busbw_gbps: f64,
    /// `None` when gloo was not run or cannot do this op.
    pub gloo_ms: Option<f64>,
    pub gloo_busbw_gbps: Option<f64>,
    /// accrue bus bandwidth / gloo bus bandwidth.
    pub ratio: Option<f64>,
}

/// What `accrue bench collective` runs.
#[derive(Debug, Clone)]
pub struct CollectiveBenchOpts {
    pub sizes_mib: Vec<f64>,
    pub worlds: Vec<usize>,
    /// The `accrue` binary to re-execute for each rank.
    pub exe: PathBuf,
    /// Python with torch; `None` skips gloo.
    pub python: Option<PathBuf>,
    /// Ring piece size; `None` for the default.
    pub chunk_bytes: Option<usize>,
    /// Seal every piece (`accrue_collective::LinkKey`).
    pub seal: bool,
}

/// The body of one rank process (`accrue bench collective-rank`).
pub fn run_rank(
    rank: usize,
    world: usize,
    sizes_mib: &[f64],
    chunk_bytes: Option<usize>,
    seal: bool,
    input: &mut impl BufRead,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    writeln!(out, "ADDR {}", listener.local_addr()?)?;
    out.flush()?;
    let mut line = String::new();
    input.read_line(&mut line)?;
    let mut words = line.split_whitespace();
    let secret = words.next().context("no link secret on stdin")?;
    let peers: Vec<String> = words.map(String::from).collect();
    let cfg = RingConfig {
        rank,
        world,
        peers,
        generation: 1,
        timeout: Duration::from_secs(60),
        link: LinkKey::new(secret.as_bytes(), seal)?,
    };
    let mut ring = TcpRing::connect(&listener, cfg)?;
    if let Some(c) = chunk_bytes {
        ring.set_chunk_bytes(c);
    }
    for &mib in sizes_mib {
        let bytes = (mib * (1 << 20) as f64) as usize / 4 / world * world * 4;
        let mut buf = vec![1.0f32; bytes / 4];
        for op in OPS {
            let call = |ring: &mut TcpRing, buf: &mut [f32]| match op {
                "all_reduce" => ring.all_reduce_sum(buf),
                "reduce_scatter" => ring.reduce_scatter_sum(buf),
                _ => ring.all_gather(buf),
            };
            for _ in 0..2 {
                call(&mut ring, &mut buf)?;
            }
            ring.barrier()?;
            let iters = iters_for(bytes);
            let start = Instant::now();
            for _ in 0..iters {
                call(&mut ring, &mut buf)?;
            }
            let t = RankTiming {
                op: op.into(),
                bytes,
                world,
                rank,
                iters,
                secs_per_iter: start.elapsed().as_secs_f64() / iters as f64,
                error: None,
            };
            writeln!(out, "{}", serde_json::to_string(&t)?)?;
            out.flush()?;
        }
    }
    ring.barrier()?;
    Ok(())
}

/// Runs every (world, op, size) with the ring and, if configured, gloo.
pub fn collective(opts: &CollectiveBenchOpts) -> anyhow::Result<Vec<CollectiveRow>> {
    let sizes = opts
        .sizes_mib
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut rows = Vec::new();
    for &world in &opts.worlds {
        if world < 2 {
            bail!("world size {world}: the bench needs at least 2 ranks");
        }
        let ours = run_ring(opts, world, &sizes)?;
        let gloo = match &opts.python {
            Some(py) => run_gloo(py, world, &sizes).unwrap_or_else(|e| {
                eprintln!("warning: gloo reference failed at world {world}: {e:#}");
                Vec::new()
            }),
            None => Vec::new(),
        };
        for &mib in &opts.sizes_mib {
            for op in OPS {
                let bytes = (mib * (1 << 20) as f64) as usize / 4 / world * world * 4;
                let Some(a) = slowest(&ours, op, bytes) else {
                    bail!("no ring timing for {op} at {mib} MiB, world {world}");
                };
                let g = slowest(&gloo, op, bytes);
                let bw = |s: f64| bus_bandwidth_gbps(op, bytes, world, s);
                rows.push(CollectiveRow {
                    op: op.into(),
                    world,
                    size_mib: mib,
                    accrue_ms: a * 1e3,
                    accrue_busbw_gbps: bw(a),
                    gloo_ms: g.map(|g| g * 1e3),
                    gloo_busbw_gbps: g.map(bw),
                    ratio: g.map(|g| g / a),
                });
            }
        }
    }
    Ok(rows)
}

/// The slowest rank's time per iteration, if every rank measured it.
fn slowest(timings: &[RankTiming], op: &str, bytes: usize) -> Option<f64> {
    let mine: Vec<_> = timings
        .iter()
        .filter(|t| t.op == op && t.bytes == bytes)
        .collect();
    if mine.is_empty() || mine.iter().any(|t| t.error.is_some()) {
        return None;
    }
    mine.iter().map(|t| t.secs_per_iter).reduce(f64::max)
}

fn run_ring(
    opts: &CollectiveBenchOpts,
    world: usize,
    sizes: &str,
) -> anyhow::Result<Vec<RankTiming>> {
    let mut children = Vec::new();
    for rank in 0..world {
        let mut cmd = Command::new(&opts.exe);
        cmd.args(["bench", "collective-rank", "--rank", &rank.to_string()])
            .args(["--world", &world.to_string(), "--sizes-mib", sizes]);
        if let Some(c) = opts.chunk_bytes {
            cmd.args(["--chunk-bytes", &c.to_string()]);
        }
        if opts.seal {
            cmd.arg("--seal");
        }
        children.push(spawn(cmd, &format!("ring rank {rank}"))?);
    }
    let mut addrs = Vec::new();
    let mut readers = Vec::new();
    for (rank, child) in children.iter_mut().enumerate() {
        let mut r = BufReader::new(child.stdout.take().expect("piped"));
        let mut line = String::new();
        r.read_line(&mut line)?;
        let Some(addr) = line.trim().strip_prefix("ADDR ") else {
            bail!("ring rank {rank} did not print its address (got {line:?})");
        };
        addrs.push(addr.to_string());
        readers.push(r);
    }
    // The ranks' shared secret, as the coordinator hands one to each
    // generation (here over their stdin).
    let secret: String = (0..32)
        .map(|_| char::from(b'a' + rand::random_range(0..26u8)))
        .collect();
    for child in &mut children {
        let mut stdin = child.stdin.take().expect("piped");
        writeln!(stdin, "{secret} {}", addrs.join(" "))?;
    }
    collect(children, readers, "ring")
}

fn run_gloo(python: &Path, world: usize, sizes: &str) -> anyhow::Result<Vec<RankTiming>> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut children = Vec::new();
    for rank in 0..world {
        let mut cmd = Command::new(python);
        cmd.args(["-c", GLOO_SCRIPT, "--rank", &rank.to_string()])
            .args(["--world", &world.to_string(), "--port", &port.to_string()])
            .args(["--sizes-mib", sizes]);
        children.push(spawn(cmd, &format!("gloo rank {rank}"))?);
    }
    let readers = children
        .iter_mut()
        .map(|c| BufReader::new(c.stdout.take().expect("piped")))
        .collect();
    collect(children, readers, "gloo")
}

fn spawn(mut cmd: Command, what: &str) -> anyhow::Result<Child> {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {what}: {cmd:?}"))
}

/// Reads every rank's JSON lines, then waits for all of them.
fn collect(
    children: Vec<Child>,
    readers: Vec<BufReader<std::process::ChildStdout>>,
    what: &str,
) -> anyhow::Result<Vec<RankTiming>> {
    let handles: Vec<_> = readers
        .into_iter()
        .map(|r| {
            std::thread::spawn(move || {
                r.lines()
                    .map_while(Result::ok)
                    .filter(|l| l.starts_with('{'))
                    .map(|l| serde_json::from_str::<RankTiming>(&l))
                    .collect::<Result<Vec<_>, _>>()
            })
        })
        .collect();
    let mut out = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        let lines = h.join().expect("reader thread panicked");
        out.extend(lines.with_context(|| format!("{what} rank {rank} printed a bad line"))?);
    }
    for (rank, mut c) in children.into_iter().enumerate() {
        let status = c.wait()?;
        if !status.success() {
            bail!("{what} rank {rank} failed: {status}");
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_bandwidth_follows_nccl_tests() {
        // 1 GB all_reduce in 1 s at world 4: 2·3/4 GB/s.
        assert_eq!(bus_bandwidth_gbps("all_reduce", 1_000_000_000, 4, 1.0), 1.5);
        assert_eq!(
            bus_bandwidth_gbps("all_gather", 1_000_000_000, 4, 1.0),
            0.75
        );
        assert_eq!(
            bus_bandwidth_gbps("reduce_scatter", 1_000_000_000, 2, 0.5),
            1.0
        );
    }

    #[test]
    fn the_slowest_rank_counts_and_errors_drop_the_row() {
        let t = |rank, secs, error: Option<&str>| RankTiming {
            op: "all_gather".into(),
            bytes: 8,
            world: 2,
            rank,
            iters: 5,
            secs_per_iter: secs,
            error: error.map(String::from),
        };
        assert_eq!(
            slowest(&[t(0, 1.0, None), t(1, 3.0, None)], "all_gather", 8),
            Some(3.0)
        );
        assert_eq!(
            slowest(&[t(0, 1.0, None), t(1, 3.0, None)], "all_reduce", 8),
            None
        );
        assert_eq!(
            slowest(
                &[t(0, 1.0, None), t(1, 0.0, Some("unsupported"))],
                "all_gather",
                8
            ),
            None
        );
    }

    #[test]
    fn iteration_counts_match_the_gloo_script() {
        assert_eq!(iters_for(1 << 20), 50);
        assert_eq!(iters_for(16 << 20), 16);
        assert_eq!(iters_for(64 << 20), 5);
        assert!(GLOO_SCRIPT.contains("max(5, min(50, (256 << 20) // max(nbytes, 1)))"));
    }
}

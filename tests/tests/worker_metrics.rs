//! Issue 7 (metrics): a real `accrue-worker --metrics-listen 127.0.0.1:0`
//! prints the bound address, trains a tiny Llama (hidden 64, 2 layers) for
//! three steps, and its `GET /metrics` then shows where the time went:
//! compute seconds above zero, exactly three steps, the tokens, the
//! resident memory, its generation and rank.
//!
//! Needs the venv with torch (scripts/setup.sh) and `scripts/env.sh`
//! sourced for the worker build (scripts/test.sh does both).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod real;

use real::{bin_dir, write_tiny_config};

/// Kills the process on drop (a failed assert must not leak it).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `bin` with `args` and returns it with the first stdout line
/// stripped of `prefix` (its bound address).
fn start(bin: &str, args: &[&str], dir: &Path, prefix: &str) -> (Killed, String) {
    let mut child = Command::new(bin_dir().join(bin))
        .args(args)
        .current_dir(dir)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {bin}: {e}"));
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("{bin}: unexpected first line {line:?}"))
        .to_string();
    (Killed(child), addr)
}

fn accrue(url: &str, dir: &Path, args: &[&str]) -> String {
    real::accrue_at(url, dir, args, String::new)
}

fn scrape(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from:\n{text}"))
}

#[test]
fn a_worker_exports_its_time_split_steps_and_memory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write_tiny_config(d);
    let rows: String = (0..24)
        .map(|i| {
            format!(
                "{{\"prompt\": \"{i}+{i}=\", \"completion\": \"{}\"}}\n",
                2 * i
            )
        })
        .collect();
    std::fs::write(d.join("train.jsonl"), rows).unwrap();
    std::fs::write(
        d.join("job.toml"),
        "[job]\nname = \"wm\"\nseed = 3\nsteps = 3\noutput_dir = \"out\"\n\
         [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
         [data]\ntrain = [\"train.jsonl\"]\nformat = \"sft\"\nmax_tokens = 64\n\
         [batch]\ndocs_per_step = 4\n",
    )
    .unwrap();

    let state = d.join("state");
    let (_coord, addr) = start(
        "accrue-coordinator",
        &[
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            state.to_str().unwrap(),
        ],
        d,
        "listening on ",
    );
    let url = format!("http://{addr}");
    // Stays up after the job so it can be scraped.
    let (_worker, metrics) = start(
        "accrue-worker",
        &[
            "--coordinator",
            &url,
            "--threads",
            "1",
            "--exit-on-release",
            "false",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        d,
        "metrics on ",
    );
    let before = scrape(&metrics);
    assert_eq!(sample(&before, "accrue_worker_steps_total"), 0.0);

    accrue(&url, d, &["submit", "job.toml"]);
    let t0 = Instant::now();
    loop {
        let jobs: serde_json::Value =
            serde_json::from_str(&accrue(&url, d, &["jobs", "--json"])).unwrap();
        if jobs[0]["state"] == "completed" {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "job never completed: {jobs}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let text = scrape(&metrics);
    assert_eq!(sample(&text, "accrue_worker_steps_total"), 3.0, "{text}");
    assert!(
        sample(&text, "accrue_worker_compute_seconds_total") > 0.0,
        "{text}"
    );
    assert!(
        sample(&text, "accrue_worker_optimizer_seconds_total") > 0.0,
        "{text}"
    );
    assert!(sample(&text, "accrue_worker_tokens_total") > 0.0, "{text}");
    // Resident memory of a process that loaded libtorch: well above 10 MB.
    let rss = sample(&text, "accrue_worker_memory_bytes{kind=\"rss\"}");
    assert!(rss > 10e6, "rss {rss}");
    assert_eq!(sample(&text, "accrue_worker_generation"), 1.0, "{text}");
    assert_eq!(sample(&text, "accrue_worker_rank"), 0.0, "{text}");
    for line in [
        "# TYPE accrue_worker_compute_seconds_total counter",
        "# TYPE accrue_worker_collective_seconds_total counter",
        "# TYPE accrue_worker_idle_seconds_total counter",
        "# TYPE accrue_worker_steps_total counter",
        "# TYPE accrue_worker_memory_bytes gauge",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
}

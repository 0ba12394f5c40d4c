//! The status page in a real browser (issue 7 "Done means"): a real
//! `accrue-coordinator` (HTTP on 127.0.0.1:0) and two real `accrue-worker`
//! processes train a tiny Llama; while the job is running, headless Chromium
//! loads `GET /`, and the test checks the DOM it dumps (the running job's
//! row, both workers, a loss chart with plotted points) and a screenshot
//! (1280×900, the loss chart's box holding pixels of the line's colour), then
//! `accrue plot JOB` draws the same job's curves into a PNG.
//!
//! Chromium comes from Debian's packages: scripts/test.sh installs it
//! (scripts/install-chromium.sh). Without it the test skips with a message,
//! unless ACCRUE_REQUIRE_CHROMIUM=1 (CI sets it), when it fails.
//! Needs the venv with torch and `scripts/env.sh` sourced for the worker
//! build (scripts/test.sh does both).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod real;

use real::{bin_dir, write_tiny_config};

/// The loss line's colour on the page (`--loss` in status_page.html).
const LOSS_RGB: [u8; 3] = [0x1f, 0x77, 0xb4];

/// Chromium, or None when it is absent and not required.
fn chromium() -> Option<PathBuf> {
    let path = PathBuf::from(
        std::env::var("ACCRUE_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into()),
    );
    if path.exists() {
        return Some(path);
    }
    let msg = format!(
        "chromium not found at {}: run scripts/test.sh (it installs Chromium from Debian's \
         packages through scripts/install-chromium.sh) or set ACCRUE_CHROMIUM",
        path.display()
    );
    if std::env::var("ACCRUE_REQUIRE_CHROMIUM").as_deref() == Ok("1") {
        panic!("{msg}");
    }
    eprintln!("skipping: {msg}");
    None
}

/// The processes of the test, killed when it ends (also on a panic).
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn accrue(dir: &Path, url: &str, args: &[&str]) -> String {
    real::accrue_at(url, dir, args, || logs(dir))
}

fn logs(dir: &Path) -> String {
    let mut out = String::new();
    for e in std::fs::read_dir(dir.join("logs")).unwrap().flatten() {
        let text = std::fs::read_to_string(e.path()).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(30).collect();
        out.push_str(&format!("--- {}\n", e.path().display()));
        for l in tail.into_iter().rev() {
            out.push_str(l);
            out.push('\n');
        }
    }
    out
}

/// Polls `f` every 200 ms until it returns Some, for at most `limit`.
fn wait_for<T>(what: &str, limit: Duration, dir: &Path, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            t0.elapsed() < limit,
            "{what} not within {limit:?}\n{}",
            logs(dir)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Runs headless Chromium on `url` with `args`, killed after 90 s.
fn run_chromium(chromium: &Path, profile: &Path, url: &str, args: &[&str]) -> Vec<u8> {
    let mut child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            "--window-size=1280,900",
            // Virtual time: the page's 2 s poll runs at least twice.
            "--virtual-time-budget=6000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting chromium");
    let stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut BufReader::new(stdout), &mut buf).unwrap();
        buf
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            panic!("chromium {args:?} did not finish in 90 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = reader.join().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "chromium {args:?}: {status}\n{err}");
    out
}

/// The value of attribute `attr` of the element with id `id` in `dom`.
fn attr<'a>(dom: &'a str, id: &str, attr: &str) -> Option<&'a str> {
    let start = dom.find(&format!("id=\"{id}\""))?;
    let tag_start = dom[..start].rfind('<')?;
    let tag_end = start + dom[start..].find('>')?;
    let tag = &dom[tag_start..tag_end];
    let key = format!("{attr}=\"");
    let v = tag.find(&key)? + key.len();
    Some(&tag[v..v + tag[v..].find('"')?])
}

#[test]
fn status_page_in_chromium_shows_the_running_job_workers_and_a_chart() {
    let Some(chromium) = chromium() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    std::fs::create_dir_all(d.join("logs")).unwrap();
    write_tiny_config(d);
    let synth = Command::new(bin_dir().join("accrue"))
        .args([
            "data",
            "synth",
            "--task",
            "arithmetic",
            "--out",
            "data",
            "--rows",
            "64",
        ])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(synth.status.success(), "data synth: {synth:?}");
    let mut procs = Procs(Vec::new());

    // The coordinator prints its gRPC and HTTP addresses on stdout.
    let mut coord = Command::new(bin_dir().join("accrue-coordinator"))
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(["--state-dir", "state"])
        .current_dir(d)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(d.join("logs/coordinator.log")).unwrap())
        .spawn()
        .expect("starting accrue-coordinator");
    let mut lines = BufReader::new(coord.stdout.take().unwrap()).lines();
    procs.0.push(coord);
    let mut next = |prefix: &str| {
        let line = lines.next().expect("coordinator output").unwrap();
        line.strip_prefix(prefix)
            .unwrap_or_else(|| panic!("unexpected line {line:?}"))
            .to_string()
    };
    let url = format!("http://{}", next("listening on "));
    let page = format!("http://{}/", next("metrics on "));

    for i in 0..2 {
        let log = std::fs::File::create(d.join(format!("logs/worker-{i}.log"))).unwrap();
        let child = Command::new(bin_dir().join("accrue-worker"))
            .args(["--coordinator", &url, "--threads", "1"])
            .current_dir(d)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting accrue-worker");
        procs.0.push(child);
    }
    let workers: Vec<String> = wait_for("2 idle workers", Duration::from_secs(120), d, || {
        let w: serde_json::Value =
            serde_json::from_str(&accrue(d, &url, &["workers", "--json"])).unwrap();
        let idle: Vec<String> = w
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["state"] == "idle")
            .map(|w| w["worker_id"].as_str().unwrap().to_string())
            .collect();
        (idle.len() == 2).then_some(idle)
    });

    // Long enough to stay running while Chromium looks; cancelled at the end.
    let spec = "[job]\nname = \"status-page\"\nseed = 3\nsteps = 100000\noutput_dir = \"out\"\n\
                [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
                [data]\ntrain = [\"data/arith-sft.jsonl\"]\nformat = \"sft\"\nmax_tokens = 256\n\
                [batch]\ndocs_per_step = 8\n[optimizer]\nlr = 3e-3\n\
                [parallel]\nmin_workers = 2\nmax_workers = 2\n";
    std::fs::write(d.join("job.toml"), spec).unwrap();
    let job = accrue(d, &url, &["submit", "job.toml"]).trim().to_string();
    wait_for("3 committed steps", Duration::from_secs(180), d, || {
        let jobs: serde_json::Value =
            serde_json::from_str(&accrue(d, &url, &["jobs", "--json"])).unwrap();
        let j = jobs
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["job_id"] == job.as_str())?;
        assert!(
            j["state"] == "running" || j["state"] == "pending",
            "{j}\n{}",
            logs(d)
        );
        (j["step"].as_u64()? >= 3).then_some(())
    });

    check_page_in_chromium(&chromium, d, &page, &job, &workers);

    // `accrue plot JOB` finds the job's metrics.jsonl through the coordinator.
    let png_out = d.join("curves.png");
    let out = accrue(d, &url, &["plot", &job, "--out", png_out.to_str().unwrap()]);
    assert!(
        out.lines().last().is_some_and(|l| l.starts_with("wrote ")),
        "{out}"
    );
    assert!(out.contains(" steps, 1.."), "{out}");
    let reader = png::Decoder::new(std::fs::File::open(&png_out).unwrap())
        .read_info()
        .unwrap();
    assert_eq!((reader.info().width, reader.info().height), (1280, 960));

    accrue(d, &url, &["cancel", &job]);
}

/// Loads the status page at `page` in headless Chromium while `job` runs
/// on `workers`: its DOM shows the running job, each worker and a loss
/// chart with plotted points, and a screenshot shows the loss line in the
/// chart's box.
fn check_page_in_chromium(chromium: &Path, d: &Path, page: &str, job: &str, workers: &[String]) {
    let profile = tempfile::tempdir().unwrap();
    let dom = run_chromium(chromium, profile.path(), page, &["--dump-dom"]);
    let dom = String::from_utf8(dom).unwrap();
    assert!(
        dom.contains(&format!("data-job-id=\"{job}\" data-state=\"running\"")),
        "running job {job} not on the page:\n{dom}"
    );
    for w in workers {
        assert!(
            dom.contains(&format!("data-worker-id=\"{w}\"")),
            "worker {w} missing:\n{dom}"
        );
    }
    let plotted: usize = attr(&dom, "loss-chart", "data-points")
        .unwrap_or_else(|| panic!("no loss chart with points:\n{dom}"))
        .parse()
        .unwrap();
    assert!(plotted >= 3, "{plotted} points plotted");
    let points = attr(&dom, "loss-line", "points").expect("a loss polyline");
    assert_eq!(points.split(' ').count(), plotted, "{points}");
    assert!(
        attr(&dom, "tps-line", "points").is_some(),
        "no tokens/s line:\n{dom}"
    );
    let bx: Vec<u32> = attr(&dom, "loss-chart", "data-box")
        .expect("the chart's box")
        .split(',')
        .map(|v| v.parse().unwrap())
        .collect();

    let shot = d.join("status.png");
    run_chromium(
        chromium,
        profile.path(),
        page,
        &[&format!("--screenshot={}", shot.display())],
    );
    // For a human to look at: ACCRUE_STATUS_PAGE_SHOT=/tmp/status.png.
    if let Ok(keep) = std::env::var("ACCRUE_STATUS_PAGE_SHOT") {
        std::fs::copy(&shot, keep).unwrap();
    }
    let decoder = png::Decoder::new(std::fs::File::open(&shot).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut img = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut img).unwrap();
    assert_eq!((info.width, info.height), (1280, 900));
    let channels = info.color_type.samples();
    let near = |px: &[u8]| px.iter().zip(LOSS_RGB).all(|(&a, b)| a.abs_diff(b) <= 16);
    let (x0, y0, w, h) = (bx[0], bx[1], bx[2], bx[3]);
    assert!(
        x0 + w <= 1280 && y0 + h <= 900 && w > 100 && h > 100,
        "chart box {bx:?}"
    );
    let mut in_chart = 0;
    let mut colours = std::collections::HashSet::new();
    for y in y0..y0 + h {
        for x in x0..x0 + w {
            let i = (y as usize * 1280 + x as usize) * channels;
            let px = &img[i..i + 3];
            in_chart += usize::from(near(px));
            colours.insert([px[0], px[1], px[2]]);
        }
    }
    assert!(
        in_chart > 100,
        "{in_chart} loss-coloured pixels in the chart box {bx:?}"
    );
    assert!(colours.len() > 3, "the chart box is blank: {colours:?}");
}

/// One HTTP/1.0 GET on 127.0.0.1: the body, or None while nothing answers.
fn http_get(addr: &str, path: &str) -> Option<String> {
    http_get_as(addr, path, None)
}

/// [`http_get`] with `token` as a bearer token.
fn http_get_as(addr: &str, path: &str, token: Option<&str>) -> Option<String> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(conn, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{auth}\r\n").ok()?;
    let mut reply = String::new();
    conn.read_to_string(&mut reply).ok()?;
    let (head, body) = reply.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.0 200")
        .then(|| body.to_string())
        .or_else(|| head.starts_with("HTTP/1.1 200").then(|| body.to_string()))
}

/// Issue 32, bug 6: `accrue local`, what users run first, serves the same
/// status page and Prometheus metrics as the standalone coordinator, and
/// prints where.
#[test]
fn accrue_local_serves_the_status_page_and_metrics() {
    let Some(chromium) = chromium() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    std::fs::create_dir_all(d.join("logs")).unwrap();
    write_tiny_config(d);
    let synth = Command::new(bin_dir().join("accrue"))
        .args(["data", "synth", "--task", "arithmetic", "--out", "data"])
        .args(["--rows", "64"])
        .current_dir(d)
        .output()
        .unwrap();
    assert!(synth.status.success(), "data synth: {synth:?}");
    // Long enough to stay running while Chromium looks; interrupted at the end.
    let spec = "[job]\nname = \"local-page\"\nseed = 3\nsteps = 100000\noutput_dir = \"out\"\n\
                [model]\ninit = \"random\"\nconfig = \"tiny.json\"\n\
                [data]\ntrain = [\"data/arith-sft.jsonl\"]\nformat = \"sft\"\nmax_tokens = 256\n\
                [batch]\ndocs_per_step = 8\n[optimizer]\nlr = 3e-3\n\
                [parallel]\nmin_workers = 2\nmax_workers = 2\n";
    std::fs::write(d.join("job.toml"), spec).unwrap();
    let mut local = Command::new(bin_dir().join("accrue"))
        .args(["local", "job.toml", "--workers", "2", "--devices", "cpu"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .env("ACCRUE_WORKER_BIN", bin_dir().join("accrue-worker"))
        .current_dir(d)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting accrue local");
    let stderr = local.stderr.take().unwrap();
    let mut procs = Procs(vec![local]);
    // The URL is printed before the workers start; the rest of stderr
    // (the progress bar) is drained so that the run never blocks on it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    // The URL carries the run's admin token in its fragment.
    let (addr, token) = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("no status page URL ({e}); stderr so far: {seen:#?}"));
        if let Some(rest) = line.strip_prefix("status page on http://") {
            let url = rest.split(' ').next().unwrap();
            let (addr, token) = url.split_once("/#token=").expect("a #token= fragment");
            break (addr.to_string(), token.to_string());
        }
        seen.push(line);
    };
    std::thread::spawn(move || for _ in rx {});

    // Where accrue local writes the worker logs, for failure messages.
    let out = d.join("out");
    let status = |out: &Path| -> serde_json::Value {
        let body = wait_for("GET /api/status", Duration::from_secs(30), out, || {
            http_get_as(&addr, "/api/status", Some(&token))
        });
        serde_json::from_str(&body).unwrap()
    };
    let (job, workers) = wait_for("3 committed steps", Duration::from_secs(240), &out, || {
        let s = status(&out);
        let j = s["jobs"].as_array()?.first()?.clone();
        assert!(
            j["state"] == "running" || j["state"] == "pending",
            "{j}\n{}",
            logs(&out)
        );
        let workers: Vec<String> = s["workers"]
            .as_array()?
            .iter()
            .map(|w| w["id"].as_str().unwrap().to_string())
            .collect();
        (j["step"].as_u64()? >= 3 && workers.len() == 2)
            .then(|| (j["id"].as_str().unwrap().to_string(), workers))
    });
    // Without the token: the public view (issue 33), no workers named.
    let public: serde_json::Value =
        serde_json::from_str(&http_get(&addr, "/api/status").expect("GET /api/status")).unwrap();
    assert_eq!(public["detail"], "public", "{public}");
    assert_eq!(public["worker_count"], 2, "{public}");
    assert!(
        public["workers"].as_array().unwrap().is_empty() && public["jobs"][0]["reason"].is_null(),
        "{public}"
    );
    let metrics = http_get(&addr, "/metrics").expect("GET /metrics");
    assert!(
        metrics.contains(&format!("job_id=\"{job}\"")),
        "no series of job {job} in /metrics:\n{metrics}"
    );
    // The page as printed: it takes the token from the fragment.
    let page = format!("http://{addr}/#token={token}");
    check_page_in_chromium(&chromium, d, &page, &job, &workers);

    // Ctrl-C stops the run, its workers and the page at once (the workers
    // of an unfinished job have no final checkpoint to wait for).
    let local = &mut procs.0[0];
    let int = Command::new("kill")
        .args(["-INT", &local.id().to_string()])
        .status()
        .unwrap();
    assert!(int.success());
    let t0 = Instant::now();
    while local.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(150),
            "accrue local still runs after Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        http_get(&addr, "/api/status").is_none(),
        "the page outlived the run"
    );
}

//! `accrue plot`: a job's training curves as a PNG, panels against the step
//! (loss, tokens/s, gradient norm, learning rate, then one per objective
//! metric the run has: reward, accuracy, margin, KL, ... from the line's
//! `extra`), read from its metrics.jsonl. Several runs are overlaid, one
//! colour each (`accrue plot RUN_A RUN_B`); `--smooth A` draws an
//! exponential moving average over the raw curve (TensorBoard's, debiased).
//! With one run the loss panel also draws a mixture's per-source losses
//! (one curve per source) and the evaluations (`eval` lines: the overall
//! eval loss as dots, each eval source's as smaller ones). Drawn with
//! `plotters` on its bitmap backend; text uses a font embedded in the binary
//! (a DejaVu Sans subset, cli/assets), so it renders on a machine
//! without fontconfig or system fonts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Once;

use anyhow::Context as _;
use plotters::prelude::*;
use serde::Deserialize;

use super::output::outln;
use crate::args::Conn;

/// The embedded font (see cli/assets/LICENSE-DejaVu.txt).
const FONT: &[u8] = include_bytes!("../assets/DejaVuSans-ascii.ttf");

/// Why a plot could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a step metrics line: {source}")]
    BadLine {
        path: String,
        line: usize,
        source: serde_json::Error,
    },
    #[error("{path} holds no committed steps: nothing to plot")]
    NoSteps { path: String },
    #[error("drawing {path}: {message}")]
    Draw { path: String, message: String },
}

/// The fields of a metrics.jsonl line that are plotted. `null` (how JSON
/// writes a non-finite number) is a gap in that curve; a missing field is an
/// error (`deserialize_with` keeps serde from defaulting it to `None`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Point {
    pub step: u64,
    #[serde(deserialize_with = "Option::deserialize")]
    pub loss: Option<f64>,
    #[serde(deserialize_with = "Option::deserialize")]
    pub tokens_per_s: Option<f64>,
    #[serde(deserialize_with = "Option::deserialize")]
    pub grad_norm: Option<f64>,
    #[serde(deserialize_with = "Option::deserialize")]
    pub lr: Option<f64>,
    /// A mixture: each source's loss at this step.
    #[serde(default)]
    pub sources: BTreeMap<String, SourcePoint>,
    /// The objective's own metrics (DPO rewards/accuracy, PG reward, KL).
    #[serde(default)]
    pub extra: BTreeMap<String, Option<f64>>,
}

/// One source's loss at a step (or in an evaluation).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct SourcePoint {
    #[serde(deserialize_with = "Option::deserialize")]
    pub loss: Option<f64>,
}

/// An evaluation line of metrics.jsonl.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct EvalPoint {
    pub step: u64,
    #[serde(deserialize_with = "Option::deserialize")]
    pub loss: Option<f64>,
    #[serde(default)]
    pub sources: BTreeMap<String, SourcePoint>,
}

#[derive(Deserialize)]
struct EvalLine {
    eval: EvalPoint,
}

/// The evaluations in metrics.jsonl `text`, in order (other lines skipped).
pub fn parse_evals(text: &str) -> Vec<EvalPoint> {
    text.lines()
        .filter(|l| l.contains("\"eval\""))
        .filter_map(|l| serde_json::from_str::<EvalLine>(l).ok())
        .map(|l| l.eval)
        .collect()
}

/// Colours of per-source curves, in source-name order.
const SOURCE_COLORS: [RGBColor; 8] = [
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
    RGBColor(188, 189, 34),
    RGBColor(227, 119, 194),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
];

/// One panel: its title, its colour and the value it plots.
pub struct Panel {
    pub title: &'static str,
    pub color: RGBColor,
    pub value: fn(&Point) -> Option<f64>,
}

/// The four panels every run has, left to right, top to bottom.
pub const PANELS: [Panel; 4] = [
    Panel {
        title: "loss",
        color: RGBColor(31, 119, 180),
        value: |p| p.loss,
    },
    Panel {
        title: "tokens/s",
        color: RGBColor(214, 39, 40),
        value: |p| p.tokens_per_s,
    },
    Panel {
        title: "grad norm",
        color: RGBColor(44, 160, 44),
        value: |p| p.grad_norm,
    },
    Panel {
        title: "learning rate",
        color: RGBColor(148, 103, 189),
        value: |p| p.lr,
    },
];

/// Objective metrics drawn first when a run has them (then any other
/// `extra` key, by name).
pub const OBJECTIVE_METRICS: [&str; 11] = [
    "rl/accuracy",
    "rl/reward_mean",
    "reward",
    "rewards/accuracy",
    "rewards/margin",
    "kl",
    "rl/response_tokens_mean",
    "rl/gen_tokens_per_s",
    "rewards/chosen",
    "rewards/rejected",
    "reward_std",
];

/// At most this many objective panels (beyond the four).
pub const MAX_EXTRA_PANELS: usize = 8;

/// Colours of the objective panels, in panel order.
const EXTRA_COLORS: [RGBColor; 4] = [
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
];

/// Colours of overlaid runs, in argument order.
pub const RUN_COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// What a drawn panel plots.
#[derive(Debug, Clone, PartialEq)]
enum Metric {
    /// One of [`PANELS`].
    Base(usize),
    /// A key of the lines' `extra`.
    Extra(String),
}

struct PanelSpec {
    title: String,
    color: RGBColor,
    metric: Metric,
}

impl PanelSpec {
    fn value(&self, p: &Point) -> Option<f64> {
        match &self.metric {
            Metric::Base(i) => (PANELS[*i].value)(p),
            Metric::Extra(k) => p.extra.get(k).copied().flatten(),
        }
    }
}

/// The four base panels, then one per objective metric any run has.
fn panels_for(runs: &[Run]) -> Vec<PanelSpec> {
    let mut out: Vec<PanelSpec> = PANELS
        .iter()
        .enumerate()
        .map(|(i, p)| PanelSpec {
            title: p.title.to_string(),
            color: p.color,
            metric: Metric::Base(i),
        })
        .collect();
    let keys: std::collections::BTreeSet<&String> = runs
        .iter()
        .flat_map(|r| r.points.iter().flat_map(|p| p.extra.keys()))
        .collect();
    let mut ordered: Vec<&String> = OBJECTIVE_METRICS
        .iter()
        .filter_map(|k| keys.iter().find(|x| x.as_str() == *k).copied())
        .collect();
    ordered.extend(
        keys.iter()
            .filter(|k| !OBJECTIVE_METRICS.contains(&k.as_str())),
    );
    for (i, k) in ordered.into_iter().take(MAX_EXTRA_PANELS).enumerate() {
        out.push(PanelSpec {
            title: k.clone(),
            color: EXTRA_COLORS[i % EXTRA_COLORS.len()],
            metric: Metric::Extra(k.clone()),
        });
    }
    out
}

/// One run to draw: its label (in the legend when overlaid), its steps and
/// its evaluations.
pub struct Run {
    pub label: String,
    pub points: Vec<Point>,
    pub evals: Vec<EvalPoint>,
}

/// TensorBoard's smoothing: an exponential moving average with weight `a`
/// on the past, debiased so the first points are not pulled to zero.
pub fn smooth(values: &[(f64, f64)], a: f64) -> Vec<(f64, f64)> {
    let mut last = 0.0;
    let mut weight = 0.0;
    values
        .iter()
        .map(|&(x, v)| {
            last = last * a + (1.0 - a) * v;
            weight = weight * a + (1.0 - a);
            (x, last / weight)
        })
        .collect()
}

/// Parses metrics.jsonl `text` (read from `path`, named in errors). Blank
/// lines are skipped; a step written twice (re-committed after a recovery)
/// keeps its last line. Returns the points by step.
pub fn parse_metrics(text: &str, path: &Path) -> Result<Vec<Point>, PlotError> {
    let mut by_step = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() || is_eval_line(line) {
            continue;
        }
        let p: Point = serde_json::from_str(line).map_err(|source| PlotError::BadLine {
            path: path.display().to_string(),
            line: i + 1,
            source,
        })?;
        by_step.insert(p.step, p);
    }
    if by_step.is_empty() {
        return Err(PlotError::NoSteps {
            path: path.display().to_string(),
        });
    }
    Ok(by_step.into_values().collect())
}

/// An evaluation line (`{"job": …, "eval": {…}}`), not a step.
fn is_eval_line(line: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(line).is_ok_and(|v| v.get("eval").is_some())
}

/// Reads and parses the metrics.jsonl at `path`.
pub fn read_metrics(path: &Path) -> Result<Vec<Point>, PlotError> {
    let text = std::fs::read_to_string(path).map_err(|source| PlotError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse_metrics(&text, path)
}

fn register_font() {
    static FONT_ONCE: Once = Once::new();
    FONT_ONCE.call_once(|| {
        // The bytes are a valid font, checked by the tests that draw.
        if plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_err() {
            tracing::error!("the embedded font does not parse");
        }
    });
}

/// Draws `points` as a `size` PNG at `out`, titled `title`.
pub fn render_png(
    points: &[Point],
    title: &str,
    out: &Path,
    size: (u32, u32),
) -> Result<(), PlotError> {
    render_png_with(points, &[], title, out, size)
}

/// [`render_png`] with evaluations drawn on the loss panel.
pub fn render_png_with(
    points: &[Point],
    evals: &[EvalPoint],
    title: &str,
    out: &Path,
    size: (u32, u32),
) -> Result<(), PlotError> {
    let run = Run {
        label: title.to_string(),
        points: points.to_vec(),
        evals: evals.to_vec(),
    };
    render_runs(&[run], title, out, size, None)
}

/// Draws `runs` (overlaid when several) as a PNG at `out`: two panels a
/// row, `size` for the first two rows and taller for more; `smoothing`
/// draws each curve's moving average over its faint raw values.
pub fn render_runs(
    runs: &[Run],
    title: &str,
    out: &Path,
    size: (u32, u32),
    smoothing: Option<f64>,
) -> Result<(), PlotError> {
    register_font();
    let draw_err = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: out.display().to_string(),
        message: e.to_string(),
    };
    let panels = panels_for(runs);
    let rows = panels.len().div_ceil(2);
    let height = size.1 * rows.max(2) as u32 / 2;
    let root = BitMapBackend::new(out, (size.0, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw_err(&e))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|e| draw_err(&e))?;
    for (area, panel) in root.split_evenly((rows, 2)).iter().zip(&panels) {
        draw_panel(area, panel, runs, smoothing).map_err(|e| draw_err(&e))?;
    }
    root.present().map_err(|e| draw_err(&e))
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;
type DrawResult =
    Result<(), DrawingAreaErrorKind<<BitMapBackend<'static> as DrawingBackend>::ErrorType>>;

fn draw_panel(
    area: &Area<'_>,
    panel: &PanelSpec,
    runs: &[Run],
    smoothing: Option<f64>,
) -> DrawResult {
    let overlaid = runs.len() > 1;
    let series_of = |run: &Run| -> Vec<(f64, f64)> {
        run.points
            .iter()
            .filter_map(|p| {
                panel
                    .value(p)
                    .filter(|v| v.is_finite())
                    .map(|v| (p.step as f64, v))
            })
            .collect()
    };
    let all: Vec<Vec<(f64, f64)>> = runs.iter().map(series_of).collect();
    // One run's loss panel: each source's curve and the evaluations too.
    let single = (!overlaid).then(|| &runs[0]);
    let is_loss = panel.metric == Metric::Base(0);
    let points: &[Point] = single.map_or(&[], |r| &r.points);
    let evals: &[EvalPoint] = single.map_or(&[], |r| &r.evals);
    let names: std::collections::BTreeSet<&String> = if is_loss {
        points.iter().flat_map(|p| p.sources.keys()).collect()
    } else {
        Default::default()
    };
    let source_series = |name: &String| -> Vec<(f64, f64)> {
        points
            .iter()
            .filter_map(|p| {
                let v = p.sources.get(name)?.loss.filter(|v| v.is_finite())?;
                Some((p.step as f64, v))
            })
            .collect()
    };
    let eval_points: Vec<(f64, f64, Option<&String>)> = if is_loss {
        evals
            .iter()
            .flat_map(|e| {
                let all = e.loss.map(|v| (e.step as f64, v, None));
                let each = e
                    .sources
                    .iter()
                    .filter_map(move |(n, s)| s.loss.map(|v| (e.step as f64, v, Some(n))));
                all.into_iter().chain(each)
            })
            .filter(|p| p.1.is_finite())
            .collect()
    } else {
        Vec::new()
    };
    let extra: Vec<f64> = names
        .iter()
        .flat_map(|n| source_series(n).into_iter().map(|p| p.1))
        .chain(eval_points.iter().map(|p| p.1))
        .collect();
    let values = all
        .iter()
        .flatten()
        .map(|s| s.1)
        .chain(extra.iter().copied());
    let steps = runs
        .iter()
        .flat_map(|r| r.points.iter().map(|p| p.step as f64));
    let (sx0, sx1) = steps.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    let (x0, x1) = if sx0.is_finite() {
        padded(sx0, sx1, 0.0)
    } else {
        (0.0, 1.0)
    };
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    let empty = all.iter().all(Vec::is_empty);
    let (y0, y1) = if empty {
        (0.0, 1.0)
    } else {
        padded(lo, hi, 0.05)
    };
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(32)
        .y_label_area_size(72)
        .build_cartesian_2d(x0..x1, y0..y1)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .x_desc("step")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| label(*y))
        .label_style(("sans-serif", 13))
        .draw()?;
    if empty {
        let mid = ((x0 + x1) / 2.0, 0.5);
        chart.draw_series(std::iter::once(Text::new(
            "no values",
            mid,
            ("sans-serif", 14),
        )))?;
        return Ok(());
    }
    let legend = overlaid || !names.is_empty() || !eval_points.is_empty();
    for (i, (run, series)) in runs.iter().zip(&all).enumerate() {
        let color = if overlaid {
            RUN_COLORS[i % RUN_COLORS.len()]
        } else {
            panel.color
        };
        let style = ShapeStyle::from(color).stroke_width(2);
        let line = match smoothing {
            Some(a) => {
                // The raw values faint underneath.
                let faint = ShapeStyle::from(color.mix(0.25)).stroke_width(1);
                chart.draw_series(LineSeries::new(series.iter().copied(), faint))?;
                smooth(series, a)
            }
            None => series.clone(),
        };
        let drawn = chart.draw_series(LineSeries::new(line, style))?;
        if legend {
            let text = if overlaid { run.label.as_str() } else { "all" };
            drawn
                .label(text)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], style));
        }
        // A lone step has no line: mark it.
        if series.len() == 1 {
            chart.draw_series(std::iter::once(Circle::new(series[0], 4, style.filled())))?;
        }
    }
    for (i, name) in names.iter().enumerate() {
        let c = SOURCE_COLORS[i % SOURCE_COLORS.len()];
        let s = ShapeStyle::from(c).stroke_width(2);
        chart
            .draw_series(LineSeries::new(source_series(name), s))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], s));
    }
    if !eval_points.is_empty() {
        let dot = ShapeStyle::from(BLACK).filled();
        chart
            .draw_series(
                eval_points.iter().map(|&(x, y, who)| {
                    Circle::new((x, y), if who.is_none() { 5 } else { 3 }, dot)
                }),
            )?
            .label("eval")
            .legend(move |(x, y)| Circle::new((x + 8, y), 4, dot));
    }
    if legend {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()?;
    }
    Ok(())
}

/// `lo..hi` widened by `frac` of its span (a flat range by 10% of its value,
/// or 1, so it is never empty).
fn padded(lo: f64, hi: f64, frac: f64) -> (f64, f64) {
    if hi > lo {
        let d = (hi - lo) * frac;
        (lo - d, hi + d)
    } else {
        let d = if lo != 0.0 { lo.abs() * 0.1 } else { 1.0 };
        (lo - d, hi + d)
    }
}

/// An axis label: scientific for small magnitudes (learning rates), else
/// at most 3 decimals.
fn label(y: f64) -> String {
    let a = y.abs();
    if a != 0.0 && !(1e-2..1e6).contains(&a) {
        format!("{y:.1e}")
    } else {
        let s = format!("{y:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Where a job's metrics.jsonl is: under `job.output_dir` of its stored
/// spec (paths there are already absolute).
fn metrics_path(spec_toml: &str) -> anyhow::Result<PathBuf> {
    let spec: toml::Value = toml::from_str(spec_toml).context("the job's stored spec")?;
    let dir = spec
        .get("job")
        .and_then(|j| j.get("output_dir"))
        .and_then(|d| d.as_str())
        .context("the job's stored spec has no job.output_dir")?;
    Ok(Path::new(dir).join("metrics.jsonl"))
}

/// Arguments of `accrue plot`.
#[derive(Debug, Clone)]
pub struct PlotArgs {
    /// Jobs (id, name or id prefix), resolved through the coordinator.
    pub jobs: Vec<String>,
    /// metrics.jsonl files to read directly.
    pub metrics: Vec<PathBuf>,
    pub out: PathBuf,
    pub size: (u32, u32),
    /// Moving-average weight in [0, 1) (None: raw curves).
    pub smooth: Option<f64>,
}

/// Reads one run's metrics.jsonl; `job` says where the path came from
/// (for a better message when it is on another machine).
fn read_run(path: &Path, label: String, from_job: bool) -> anyhow::Result<Run> {
    let points = read_metrics(path).map_err(|e| match (e, from_job) {
        (PlotError::Read { path, source }, true) => anyhow::anyhow!(
            "cannot read {path}: {source} (it is on the coordinator's filesystem; \
             copy it here and pass --metrics PATH)"
        ),
        (e, _) => e.into(),
    })?;
    let evals = std::fs::read_to_string(path)
        .map(|t| parse_evals(&t))
        .unwrap_or_default();
    Ok(Run {
        label,
        points,
        evals,
    })
}

/// Runs `accrue plot`: prints the PNG's path and the steps plotted.
pub async fn run(conn: &Conn, args: &PlotArgs) -> anyhow::Result<ExitCode> {
    if args.jobs.is_empty() && args.metrics.is_empty() {
        anyhow::bail!("give one or more jobs, or --metrics PATH (repeatable)");
    }
    if let Some(a) = args.smooth {
        anyhow::ensure!((0.0..1.0).contains(&a), "--smooth {a}: must be in [0, 1)");
    }
    let mut runs = Vec::new();
    for job in &args.jobs {
        let mut client = super::client::connect(conn).await?;
        let reply = client
            .get_job(accrue_proto::v1::GetJobRequest {
                job_id: job.clone(),
            })
            .await
            .map_err(|s| anyhow::anyhow!("{job}: {}", s.message()))?
            .into_inner();
        let name = reply.job.map(|j| j.name).unwrap_or_default();
        runs.push(read_run(
            &metrics_path(&reply.spec_toml)?,
            format!("{name} ({job})"),
            true,
        )?);
    }
    for p in &args.metrics {
        runs.push(read_run(p, p.display().to_string(), false)?);
    }
    let title = runs
        .iter()
        .map(|r| r.label.as_str())
        .collect::<Vec<_>>()
        .join(" vs ");
    render_runs(&runs, &title, &args.out, args.size, args.smooth)?;
    for r in &runs {
        outln!(
            "{}: {} steps, {}..{}",
            r.label,
            r.points.len(),
            r.points[0].step,
            r.points[r.points.len() - 1].step
        )?;
    }
    outln!("wrote {}", args.out.display())?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::PLOT_SIZE as DEFAULT_SIZE;

    /// A metrics.jsonl of `n` steps shaped like the coordinator's lines.
    fn fixture(n: u64) -> String {
        let mut s = String::new();
        for step in 1..=n {
            let m = accrue_coordinator::core::StepMetrics {
                step,
                loss: 3.0 / (1.0 + step as f64 * 0.2),
                tokens_per_s: 1000.0 + 50.0 * (step % 7) as f64,
                grad_norm: 2.0 / (step as f64).sqrt(),
                lr: 1e-4 * (step as f64 / n as f64).min(1.0),
                ..Default::default()
            };
            s.push_str(&serde_json::to_string(&m).unwrap());
            s.push('\n');
        }
        s
    }

    /// Pixels of exactly `c` in the rectangle `[x0, x1) × [y0, y1)`.
    fn count(img: &[u8], width: u32, rect: (u32, u32, u32, u32), c: RGBColor) -> usize {
        let (x0, y0, x1, y1) = rect;
        let mut n = 0;
        for y in y0..y1 {
            for x in x0..x1 {
                let i = ((y * width + x) * 3) as usize;
                if img[i..i + 3] == [c.0, c.1, c.2] {
                    n += 1;
                }
            }
        }
        n
    }

    #[test]
    fn plot_has_four_panels_with_their_curves() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        std::fs::write(&metrics, fixture(40)).unwrap();
        let out = dir.path().join("plot.png");
        let points = read_metrics(&metrics).unwrap();
        assert_eq!(points.len(), 40);
        render_png(&points, "fixture", &out, DEFAULT_SIZE).unwrap();

        let decoder = png::Decoder::new(std::fs::File::open(&out).unwrap());
        let mut reader = decoder.read_info().unwrap();
        let mut img = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut img).unwrap();
        assert_eq!((info.width, info.height), DEFAULT_SIZE);
        assert_eq!(info.color_type, png::ColorType::Rgb);
        let (w, h) = (info.width, info.height);
        let quads = [
            (0, 0, w / 2, h / 2),
            (w / 2, 0, w, h / 2),
            (0, h / 2, w / 2, h),
            (w / 2, h / 2, w, h),
        ];
        for (i, panel) in PANELS.iter().enumerate() {
            for (j, &q) in quads.iter().enumerate() {
                let n = count(&img, w, q, panel.color);
                if i == j {
                    // A 2 px line across most of a ~600 px panel.
                    assert!(n > 300, "{}: {n} pixels of its colour", panel.title);
                } else {
                    assert_eq!(n, 0, "{} colour in panel {j}", panel.title);
                }
            }
        }
        // The font rendered text: dark pixels in the title band.
        let dark = (0..30 * w as usize)
            .filter(|&p| img[p * 3] < 100 && img[p * 3 + 1] < 100)
            .count();
        assert!(dark > 50, "title text missing ({dark} dark pixels)");
    }

    /// Issue 16: a mixture's metrics.jsonl (steps with `sources`, and
    /// `eval` lines) plots one loss curve per source, in the loss panel only,
    /// and the eval lines are read as evaluations, not steps.
    #[test]
    fn a_mixture_plots_a_loss_curve_per_source_and_the_evals() {
        let mut text = String::new();
        for step in 1..=30u64 {
            let src = |loss: f64| accrue_coordinator::core::SourceMetrics {
                loss,
                loss_tokens: 10,
                tokens: 12,
                docs: 2,
                ..Default::default()
            };
            let m = accrue_coordinator::core::StepMetrics {
                step,
                loss: 2.0 / (1.0 + step as f64 * 0.1),
                tokens_per_s: 1000.0,
                grad_norm: 1.0,
                lr: 1e-4,
                sources: [
                    ("chat".to_string(), src(3.0 / (1.0 + step as f64 * 0.1))),
                    ("code".to_string(), src(1.0 / (1.0 + step as f64 * 0.1))),
                ]
                .into(),
                ..Default::default()
            };
            text.push_str(&serde_json::to_string(&m).unwrap());
            text.push('\n');
            if step % 10 == 0 {
                let e = accrue_coordinator::core::EvalMetrics {
                    step,
                    loss: 2.1 / (1.0 + step as f64 * 0.1),
                    sources: [("held".to_string(), src(2.0))].into(),
                    ..Default::default()
                };
                let line = serde_json::json!({"job": "j", "eval": e});
                text.push_str(&format!("{line}\n"));
            }
        }
        let points = parse_metrics(&text, Path::new("m.jsonl")).unwrap();
        assert_eq!(points.len(), 30);
        assert_eq!(
            points[4].sources.keys().collect::<Vec<_>>(),
            ["chat", "code"]
        );
        let evals = parse_evals(&text);
        assert_eq!(
            evals.iter().map(|e| e.step).collect::<Vec<_>>(),
            [10, 20, 30]
        );
        assert_eq!(evals[0].sources["held"].loss, Some(2.0));

        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("mix.png");
        render_png_with(&points, &evals, "mix", &out, DEFAULT_SIZE).unwrap();
        let decoder = png::Decoder::new(std::fs::File::open(&out).unwrap());
        let mut reader = decoder.read_info().unwrap();
        let mut img = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut img).unwrap();
        let (w, h) = (info.width, info.height);
        let loss_panel = (0, 0, w / 2, h / 2);
        let rate_panel = (w / 2, 0, w, h / 2);
        for (name, c) in [("chat", SOURCE_COLORS[0]), ("code", SOURCE_COLORS[1])] {
            let n = count(&img, w, loss_panel, c);
            assert!(
                n > 200,
                "{name}: {n} pixels of its colour in the loss panel"
            );
            assert_eq!(
                count(&img, w, rate_panel, c),
                0,
                "{name} outside the loss panel"
            );
        }
    }

    #[test]
    fn a_malformed_line_is_named_by_file_and_line() {
        let mut text = fixture(3);
        text.push_str("{\"step\": 4, \"loss\": \n");
        let e = parse_metrics(&text, Path::new("runs/x/metrics.jsonl")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("runs/x/metrics.jsonl:4: not a step metrics line"),
            "{e}"
        );
        let e = parse_metrics("{\"step\": 1}\n", Path::new("m.jsonl")).unwrap_err();
        assert!(e.to_string().contains("missing field `loss`"), "{e}");
    }

    #[test]
    fn no_steps_is_a_clear_error_and_replays_keep_the_last_line() {
        let e = parse_metrics("\n\n", Path::new("m.jsonl")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "m.jsonl holds no committed steps: nothing to plot"
        );
        let text = "{\"step\":2,\"loss\":1,\"tokens_per_s\":5,\"grad_norm\":1,\"lr\":0.1}\n\
                    {\"step\":1,\"loss\":null,\"tokens_per_s\":5,\"grad_norm\":1,\"lr\":0.1}\n\
                    {\"step\":2,\"loss\":0.5,\"tokens_per_s\":5,\"grad_norm\":1,\"lr\":0.1}\n";
        let p = parse_metrics(text, Path::new("m.jsonl")).unwrap();
        assert_eq!(p.iter().map(|p| p.step).collect::<Vec<_>>(), [1, 2]);
        assert_eq!((p[0].loss, p[1].loss), (None, Some(0.5)));
    }

    #[test]
    fn a_single_step_and_a_missing_file_plot_or_fail_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("one.png");
        let p = parse_metrics(&fixture(1), Path::new("m")).unwrap();
        render_png(&p, "one", &out, (640, 480)).unwrap();
        assert!(std::fs::metadata(&out).unwrap().len() > 1000);
        let e = read_metrics(&dir.path().join("nope.jsonl")).unwrap_err();
        assert!(e.to_string().starts_with("cannot read "), "{e}");
    }

    #[test]
    fn labels_and_paths() {
        assert_eq!(label(0.0001), "1.0e-4");
        assert_eq!(label(2.5), "2.5");
        assert_eq!(label(1200.0), "1200");
        assert_eq!(padded(2.0, 2.0, 0.05), (1.8, 2.2));
        let spec = "[job]\nname = \"a\"\noutput_dir = \"/r/a\"\n";
        assert_eq!(metrics_path(spec).unwrap(), Path::new("/r/a/metrics.jsonl"));
    }

    #[test]
    fn smoothing_is_a_debiased_moving_average() {
        let raw: Vec<(f64, f64)> = (0..5)
            .map(|i| (i as f64, if i % 2 == 0 { 1.0 } else { 3.0 }))
            .collect();
        let s = smooth(&raw, 0.5);
        // Debiased: the first point is the first value, not half of it.
        assert_eq!(s[0], (0.0, 1.0));
        // (0.5·0.5·1 + 0.5·3) / 0.75
        assert!((s[1].1 - (0.25 + 1.5) / 0.75).abs() < 1e-12);
        assert_eq!(smooth(&raw, 0.0), raw, "weight 0 is the raw curve");
        let flat = smooth(&[(0.0, 2.0), (1.0, 2.0), (2.0, 2.0)], 0.9);
        assert!(flat.iter().all(|p| (p.1 - 2.0).abs() < 1e-12));
    }

    fn pixels(path: &Path) -> (Vec<u8>, u32, u32) {
        let decoder = png::Decoder::new(std::fs::File::open(path).unwrap());
        let mut reader = decoder.read_info().unwrap();
        let mut img = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut img).unwrap();
        (img, info.width, info.height)
    }

    /// A PG run (reward and kl in `extra`) gets a panel per objective
    /// metric, and two runs overlaid draw each in its own colour in every
    /// panel they both have.
    #[test]
    fn objective_panels_and_overlaid_runs() {
        let dir = tempfile::tempdir().unwrap();
        let run = |offset: f64| -> Vec<Point> {
            (1..=30u64)
                .map(|step| {
                    let mut m = accrue_coordinator::core::StepMetrics {
                        step,
                        loss: 3.0 / (1.0 + step as f64 * 0.2) + offset,
                        tokens_per_s: 1000.0 + 50.0 * (step % 7) as f64 + 400.0 * offset,
                        grad_norm: 2.0 / (step as f64).sqrt() + offset,
                        lr: 1e-4,
                        ..Default::default()
                    };
                    m.extra.insert("reward".into(), step as f64 / 30.0 + offset);
                    m.extra.insert("kl".into(), 0.01 * step as f64 + offset);
                    let text = serde_json::to_string(&m).unwrap();
                    serde_json::from_str(&text).unwrap()
                })
                .collect()
        };
        let a = Run {
            label: "a".into(),
            points: run(0.0),
            evals: vec![],
        };
        let panels = panels_for(std::slice::from_ref(&a));
        let titles: Vec<&str> = panels.iter().map(|p| p.title.as_str()).collect();
        assert_eq!(
            titles,
            [
                "loss",
                "tokens/s",
                "grad norm",
                "learning rate",
                "reward",
                "kl"
            ]
        );
        let out = dir.path().join("two.png");
        let b = Run {
            label: "b".into(),
            points: run(0.5),
            evals: vec![],
        };
        render_runs(&[a, b], "a vs b", &out, DEFAULT_SIZE, Some(0.6)).unwrap();
        let (img, w, h) = pixels(&out);
        // 6 panels: 3 rows, the image 1.5 times the default height.
        assert_eq!((w, h), (DEFAULT_SIZE.0, DEFAULT_SIZE.1 * 3 / 2));
        let third = h / 3;
        for (row, col) in [(0u32, 0u32), (0, 1), (2, 0), (2, 1)] {
            let rect = (
                col * w / 2,
                row * third,
                (col + 1) * w / 2,
                (row + 1) * third,
            );
            for (i, c) in RUN_COLORS[..2].iter().enumerate() {
                let n = count(&img, w, rect, *c);
                assert!(n > 200, "panel ({row}, {col}): run {i} drew {n} pixels");
            }
        }
    }
}

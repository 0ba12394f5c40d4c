//! The command line's shape: clap definitions of every subcommand and
//! flag, the connection flags every online command shares ([`Conn`]), and
//! the generated `clap::Command` (completions, man page).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Where the CLI looks for a coordinator when neither `--coordinator` nor
/// `ACCRUE_COORDINATOR` says otherwise.
pub const DEFAULT_COORDINATOR: &str = "http://127.0.0.1:7070";

/// Submit, watch and steer Accrue training jobs.
///
/// Talks to an accrue-coordinator over gRPC; `validate`, `bench` and `data`
/// work offline.
#[derive(Debug, Parser)]
#[command(name = "accrue", version, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub command: Command,
}

/// How to reach the coordinator (global flags, valid on every subcommand;
/// shown under their own heading, and hidden from the help of the
/// [`OFFLINE`] commands).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Connection")]
pub struct Conn {
    /// Address of the coordinator's admin API (http://host:port).
    #[arg(
        long,
        global = true,
        value_name = "URL",
        env = "ACCRUE_COORDINATOR",
        default_value = DEFAULT_COORDINATOR
    )]
    pub coordinator: String,
    /// Admin bearer token, sent as `authorization: Bearer <TOKEN>` on every call.
    #[arg(
        long,
        global = true,
        value_name = "TOKEN",
        env = "ACCRUE_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// File holding the admin token (wins over --token).
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        env = "ACCRUE_ADMIN_TOKEN_FILE"
    )]
    pub token_file: Option<PathBuf>,
    /// PEM CA bundle that signed the coordinator's certificate: connect
    /// with TLS (https).
    #[arg(long, global = true, value_name = "FILE", env = "ACCRUE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Name to check the coordinator's certificate against (default: the
    /// host of --coordinator).
    #[arg(long, global = true, value_name = "NAME", requires = "tls_ca")]
    pub tls_domain: Option<String>,
    /// Client certificate (PEM) for a coordinator that requires mutual TLS.
    #[arg(
        long,
        global = true,
        value_name = "FILE",
        requires = "tls_key",
        requires = "tls_ca"
    )]
    pub tls_cert: Option<PathBuf>,
    /// Private key of --tls-cert.
    #[arg(long, global = true, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Largest gRPC message accepted or sent, in MiB.
    #[arg(
        long,
        global = true,
        value_name = "MB",
        default_value_t = accrue_coordinator::shell::auth::DEFAULT_MAX_MESSAGE_MB,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=4096)
    )]
    pub max_message_mb: usize,
}

/// Subcommands that never talk to a coordinator (`local` runs its own).
pub const OFFLINE: [&str; 7] = [
    "validate",
    "export",
    "bench",
    "data",
    "local",
    "completions",
    "man",
];

/// The CLI's definition as `accrue` parses it: [`Cli`] with the connection
/// flags hidden from the offline commands' help (they stay accepted, as
/// global flags are, so scripts that always pass them keep working).
pub fn command() -> clap::Command {
    use clap::CommandFactory as _;
    let mut cmd = Cli::command();
    // A subcommand's own argument shadows a global one of the same id, so
    // hidden local copies keep the flags accepted but out of the help.
    let conn: Vec<clap::Arg> = Conn::augment_args(clap::Command::new("conn"))
        .get_arguments()
        .map(|a| a.clone().global(false).hide(true))
        .collect();
    for name in OFFLINE {
        cmd = cmd.mut_subcommand(name, |sub| sub.args(conn.iter().cloned()));
    }
    cmd
}

/// Parses the process's arguments with [`command`] (exits on an error or
/// `--help`, as clap does).
pub fn parse() -> Cli {
    use clap::FromArgMatches as _;
    let matches = command().get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

impl Conn {
    /// Plain settings for `coordinator`: no token, no TLS, default limits.
    pub fn new(coordinator: &str) -> Conn {
        Conn {
            coordinator: coordinator.to_string(),
            token: None,
            token_file: None,
            tls_ca: None,
            tls_domain: None,
            tls_cert: None,
            tls_key: None,
            max_message_mb: accrue_coordinator::shell::auth::DEFAULT_MAX_MESSAGE_MB,
        }
    }

    /// The admin token: `--token-file` wins over `--token`/`$ACCRUE_ADMIN_TOKEN`.
    pub fn resolved_token(&self) -> anyhow::Result<Option<accrue_coordinator::shell::auth::Token>> {
        Ok(accrue_coordinator::shell::auth::resolve_token(
            "--token",
            self.token.as_deref(),
            self.token_file.as_deref(),
        )?)
    }

    /// The TLS settings (all `None`: plain HTTP/2).
    pub fn tls(&self) -> accrue_coordinator::shell::tls::ClientTls {
        accrue_coordinator::shell::tls::ClientTls {
            ca: self.tls_ca.clone(),
            domain: self.tls_domain.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Check a job spec offline and print every problem (no coordinator needed).
    ///
    /// Runs the checks of submit: the spec, the model's config against the
    /// tokenizer, a model.init checkpoint, and the data (read with the
    /// job's own readers when its files hold at most 16 MiB, or with
    /// --data). Relative paths in the spec resolve against the current
    /// directory, as they do on submit.
    #[command(after_help = accrue_coordinator::job::locate::CACHE_ENV_HELP)]
    Validate {
        /// The job spec.
        #[arg(value_name = "JOB.toml")]
        spec: PathBuf,
        /// Read and tokenize the data whatever its size.
        #[arg(long, conflicts_with = "no_data")]
        data: bool,
        /// Do not read the data.
        #[arg(long)]
        no_data: bool,
    },
    /// Check this machine for a job: the worker binary loads libtorch,
    /// CUDA devices and the NCCL build, the coordinator answers with the
    /// admin token, the shared directory is writable. Exit 1 if anything
    /// failed.
    Doctor {
        /// The directory jobs write checkpoints and metrics to.
        #[arg(long, value_name = "DIR", default_value = ".")]
        shared: PathBuf,
        /// Skip the coordinator check.
        #[arg(long)]
        offline: bool,
        /// Print the checks as a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Write a checkpoint as a clean Hugging Face model folder: weights
    /// (in --dtype, sharded by --shard-size, with an index), config.json and
    /// the tokenizer files; no optimizer state. The folder loads with
    /// `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.
    /// A LoRA checkpoint exports its PEFT adapter folder
    /// (`PeftModel.from_pretrained`), or with --merge the merged model.
    Export {
        /// The checkpoint directory (OUTPUT_DIR/checkpoints/step-N).
        #[arg(value_name = "CKPT")]
        checkpoint: PathBuf,
        /// The folder to write (created; must be empty or absent).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Weight dtype: float32, bfloat16 or float16 (default: as trained).
        #[arg(long, value_name = "DTYPE", value_parser = accrue_coordinator::model::export::Dtype::parse)]
        dtype: Option<accrue_coordinator::model::export::Dtype>,
        /// Largest weight shard (5GB, 500MB, 2GiB, bytes), as
        /// `save_pretrained(max_shard_size=...)`.
        #[arg(long, value_name = "SIZE", default_value = "5GB", value_parser = accrue_coordinator::model::export::parse_size)]
        shard_size: u64,
        /// A LoRA checkpoint: write the full model with the adapters merged
        /// into its weights (PEFT's `merge_and_unload`), not the adapter
        /// folder.
        #[arg(long)]
        merge: bool,
    },
    /// Submit a job; prints its id.
    ///
    /// Relative paths in the spec resolve against the current directory.
    /// Submitting is safe to retry: while a job of the same name and spec
    /// is live, its id is printed and nothing new starts; a live job of the
    /// same name with another spec is refused.
    #[command(after_help = accrue_coordinator::job::locate::CACHE_ENV_HELP)]
    Submit {
        /// The job spec.
        #[arg(value_name = "JOB.toml")]
        spec: PathBuf,
        /// Start a new job even if a live one has this name.
        #[arg(long = "new")]
        new_job: bool,
    },
    /// List jobs.
    Jobs {
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show one job: summary, data cursor and recent steps.
    Status {
        /// The job: its id, its job.name (the live one), or a unique id prefix.
        #[arg(value_name = "JOB")]
        job: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a job; prints its new state.
    Cancel {
        /// The job: its id, its job.name (the live one), or a unique id prefix.
        #[arg(value_name = "JOB")]
        job: String,
    },
    /// Pause a job at the next step boundary; prints its new state.
    Pause {
        /// The job: its id, its job.name (the live one), or a unique id prefix.
        #[arg(value_name = "JOB")]
        job: String,
    },
    /// Resume a paused job; prints its new state.
    Resume {
        /// The job: its id, its job.name (the live one), or a unique id prefix.
        #[arg(value_name = "JOB")]
        job: String,
    },
    /// Print a shell completion script (e.g. `accrue completions bash >
    /// /etc/bash_completion.d/accrue`).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the man pages (`accrue.1` and one per subcommand) into DIR,
    /// or print the top page.
    Man {
        #[arg(long, value_name = "DIR")]
        out: Option<PathBuf>,
    },
    /// List workers.
    Workers {
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print the bearer token of a served job's OpenAI-compatible
    /// endpoint (`[rl.serve]`), derived from the admin token (--token,
    /// --token-file or $ACCRUE_ADMIN_TOKEN); no coordinator is contacted.
    EndpointToken {
        /// The job id.
        #[arg(value_name = "JOB")]
        job: String,
    },
    /// Take a worker out of service at the next step boundary.
    Drain {
        /// Worker id.
        #[arg(value_name = "WORKER")]
        worker: String,
    },
    /// Ask for a checkpoint; prints the step at whose boundary it is written.
    Checkpoint {
        /// The job: its id, its job.name (the live one), or a unique id prefix.
        #[arg(value_name = "JOB")]
        job: String,
    },
    /// Show the manifests of a job's committed steps: generation, world
    /// size, learning rate, documents, tokens, microbatches per rank and
    /// how often each step was attempted.
    Steps {
        /// The job: its id, its job.name (the live one), or a unique id prefix.
        #[arg(value_name = "JOB")]
        job: String,
        /// First step to show.
        #[arg(long, value_name = "N")]
        from: Option<u64>,
        /// Last step to show.
        #[arg(long, value_name = "M")]
        to: Option<u64>,
        /// Also show the documents of every microbatch of every rank.
        #[arg(long)]
        detail: bool,
        /// Print one JSON object per step (a line each) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List the documents a job quarantined (non-finite steps bisected
    /// down to them; see `[faults] on_nonfinite`), or release them back to
    /// its stream (each is trained when the stream next reaches it).
    Quarantine {
        /// The job: its id, its job.name (the live one), or a unique id prefix.
        #[arg(value_name = "JOB")]
        job: String,
        /// Release these documents (ids as listed, `file:line`).
        #[arg(long, value_name = "DOC", num_args = 1.., conflicts_with = "release_all")]
        release: Vec<String>,
        /// Release every quarantined document.
        #[arg(long)]
        release_all: bool,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Change a running job's step settings from its next new step on
    /// (the step in flight keeps its settings); prints that step.
    #[command(group = clap::ArgGroup::new("setting").required(true).multiple(true))]
    Set {
        /// The job: its id, its job.name (the live one), or a unique id prefix.
        #[arg(value_name = "JOB")]
        job: String,
        /// Documents per step (jobs sized by docs_per_step).
        #[arg(long, value_name = "N", group = "setting")]
        docs_per_step: Option<u64>,
        /// Tokens per step (jobs sized by tokens_per_step).
        #[arg(long, value_name = "T", group = "setting")]
        tokens_per_step: Option<u64>,
        /// Tokens per microbatch; at least the longest document.
        #[arg(long, value_name = "M", group = "setting")]
        max_tokens: Option<u32>,
        /// The schedule's base (peak) learning rate; warmup and decay go on.
        #[arg(long, value_name = "X", group = "setting")]
        lr: Option<f64>,
        /// A mixture source's new weight, as NAME=W (repeatable; sources not
        /// named keep theirs).
        #[arg(long = "weight", value_name = "NAME=W", group = "setting", value_parser = parse_weight)]
        weights: Vec<(String, f64)>,
    },
    /// Follow a job until it ends: exit 0 if it completed, 1 if it failed or
    /// was cancelled.
    Watch {
        /// The job: its id, its job.name (the live one), or a unique id prefix.
        #[arg(value_name = "JOB")]
        job: String,
        /// Replay committed steps from this step on (0: only new ones).
        #[arg(long, value_name = "N", default_value_t = 0)]
        from_step: u64,
        /// Print every step and event as a JSON line instead of a progress bar.
        #[arg(long)]
        json: bool,
        /// Exit 0 whenever the job ends, completed or not (for a clean-up
        /// step that must run after any end, e.g. scaling workers to zero).
        /// Errors (an unknown job, an unreachable coordinator) still exit 1.
        #[arg(long)]
        exit_zero: bool,
    },
    /// Draw training curves (loss, tokens/s, grad norm, learning rate and
    /// the objective's metrics against step) from metrics.jsonl into a PNG;
    /// several runs are overlaid.
    ///
    /// Each JOB is looked up on the coordinator and its metrics.jsonl read
    /// from the job's output_dir (which must be visible here); --metrics
    /// reads a metrics.jsonl directly, offline.
    #[command(group = clap::ArgGroup::new("source").required(true).multiple(true).args(["jobs", "metrics"]))]
    Plot {
        /// Jobs to plot, overlaid (id, job.name of the live one, or a
        /// unique id prefix).
        #[arg(value_name = "JOB")]
        jobs: Vec<String>,
        /// Read this metrics.jsonl instead of asking the coordinator
        /// (repeatable; overlaid with the jobs).
        #[arg(long, value_name = "PATH")]
        metrics: Vec<PathBuf>,
        /// The PNG to write.
        #[arg(long, value_name = "FILE.png")]
        out: PathBuf,
        /// Smooth each curve with an exponential moving average of this
        /// weight (0.6–0.99; TensorBoard's slider), drawn over the raw one.
        #[arg(long, value_name = "A")]
        smooth: Option<f64>,
        /// Image width in pixels.
        #[arg(long, value_name = "PX", default_value_t = PLOT_SIZE.0,
              value_parser = clap::value_parser!(u32).range(200..=8000))]
        width: u32,
        /// Image height in pixels (of the first two panel rows; more rows
        /// make it taller).
        #[arg(long, value_name = "PX", default_value_t = PLOT_SIZE.1,
              value_parser = clap::value_parser!(u32).range(200..=8000))]
        height: u32,
    },
    /// Run a benchmark in-process.
    Bench {
        #[command(subcommand)]
        bench: BenchCommand,
    },
    /// Dataset utilities.
    Data {
        #[command(subcommand)]
        data: DataCommand,
    },
    /// Feed rollouts to a streamed policy-gradient job.
    Rollouts {
        #[command(subcommand)]
        rollouts: RolloutsCommand,
    },
    /// Run a coordinator and N workers on this machine for one job.
    #[command(after_help = accrue_coordinator::job::locate::CACHE_ENV_HELP)]
    Local {
        /// The job spec.
        #[arg(value_name = "JOB.toml")]
        spec: PathBuf,
        /// Number of worker processes.
        #[arg(long, value_name = "N", default_value_t = 1)]
        workers: u32,
        /// Where the workers train: gpu (worker i on visible GPU i mod the
        /// GPU count; the CPU when none is visible) or cpu.
        #[arg(long, value_name = "gpu|cpu", default_value = "gpu")]
        devices: Devices,
        /// Serve the status page (GET /) and Prometheus metrics
        /// (GET /metrics) here; port 0 lets the OS pick, "off" disables.
        /// Default 127.0.0.1:9090, skipped with a warning when taken.
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<String>,
        /// A job with [rl.serve]: where its OpenAI-compatible endpoint
        /// listens (default 127.0.0.1 with a port the OS picks; the URL
        /// and key are written to OUTPUT_DIR/endpoint.json).
        #[arg(long, value_name = "ADDR")]
        serve_listen: Option<std::net::SocketAddr>,
    },
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Packing efficiency and planner speed on real or synthetic documents.
    Packing(PackingArgs),
    /// Bus bandwidth of the TCP ring (one process per rank on 127.0.0.1)
    /// beside torch.distributed gloo on the same sizes.
    Collective(CollectiveArgs),
    /// Time from a worker's death (or freeze) to its detection and to the
    /// next committed step, with real worker processes on a tiny model.
    Recovery(RecoveryArgs),
    /// One rank of `bench collective` (internal: started by it).
    #[command(hide = true)]
    CollectiveRank(CollectiveRankArgs),
    /// The data layer: tokenization rows/s beside Hugging Face
    /// datasets.map, submit-to-first-step with a cold and a warm token
    /// cache, memory per document, mixture planner documents/s.
    Data(DataArgs),
    /// One submit measurement of `bench data` (internal: started by it).
    #[command(hide = true)]
    DataSubmitChild { spec: PathBuf },
    /// The control plane at scale: the real coordinator against W
    /// simulated workers (one process, real sockets), per W: coordinator
    /// CPU and locked time per step, generation formation, bytes per
    /// worker, memory, store growth.
    ControlPlane(ControlPlaneArgs),
}

/// Arguments of `accrue bench control-plane`.
#[derive(Debug, Clone, Args)]
pub struct ControlPlaneArgs {
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Numbers of simulated workers (each row runs in its own process).
    #[arg(
        long,
        value_name = "W,...",
        value_delimiter = ',',
        default_value = "1,64,256,1024"
    )]
    pub workers: Vec<usize>,
    /// Dataset sizes in documents.
    #[arg(
        long,
        value_name = "N,...",
        value_delimiter = ',',
        default_value = "200000"
    )]
    pub docs: Vec<u64>,
    /// docs_per_step = this × W.
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub docs_per_worker: u64,
    /// Steps measured (after the warm-up steps).
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub steps: u64,
    /// Steps run before measuring.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub warmup: u64,
    /// Generations re-formed after the measured steps (a worker leaves and
    /// comes back): re-formation time and memory growth per generation.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub reforms: u64,
    /// The fake workers send one result each per step, as workers did
    /// before results were gathered on rank 0 (the comparison row).
    #[arg(long)]
    pub per_rank_results: bool,
    /// Each fake takes this long over a train step before it answers (0:
    /// at once). With it, `GAP_MS` is the time the coordinator adds between
    /// steps: the step's wall time less this.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub fake_step_ms: u64,
    /// The coordinator's `--relay-min-world` (the fakes can all relay):
    /// 0 sends every message to its worker directly.
    #[arg(long, value_name = "W", default_value_t = accrue_coordinator::core::RELAY_MIN_WORLD)]
    pub relay_min_world: u32,
    /// Scratch directory (default: a temporary one).
    #[arg(long, value_name = "DIR")]
    pub work: Option<PathBuf>,
}

/// Arguments of `accrue bench data`.
#[derive(Debug, Clone, Args)]
pub struct DataArgs {
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Rows of the synthetic chat dataset.
    #[arg(long, value_name = "N", default_value_t = 1_000_000)]
    pub synthetic_rows: u64,
    /// Python with `datasets` for the reference (installed on first use).
    #[arg(long, value_name = "PATH", default_value = ".venv/bin/python")]
    pub python: PathBuf,
    /// Skip the datasets.map reference.
    #[arg(long)]
    pub no_reference: bool,
    /// The shared data directory (default: $ACCRUE_SHARED_DATA or ../shared/data).
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Scratch directory (default: a temporary one).
    #[arg(long, value_name = "DIR")]
    pub work: Option<PathBuf>,
}

/// Arguments of `accrue bench collective`.
#[derive(Debug, Clone, Args)]
pub struct CollectiveArgs {
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Buffer sizes in MiB.
    #[arg(
        long,
        value_name = "MIB,...",
        value_delimiter = ',',
        default_value = "1,16,64"
    )]
    pub sizes_mib: Vec<f64>,
    /// World sizes (ranks, each its own process).
    #[arg(
        long,
        value_name = "N,...",
        value_delimiter = ',',
        default_value = "2,4"
    )]
    pub worlds: Vec<usize>,
    /// Python with torch for the gloo reference.
    #[arg(long, value_name = "PATH", default_value = ".venv/bin/python")]
    pub python: PathBuf,
    /// Skip the gloo reference.
    #[arg(long)]
    pub no_gloo: bool,
    /// Ring message piece size in bytes (default: the library's).
    #[arg(long, value_name = "BYTES")]
    pub chunk_bytes: Option<usize>,
    /// Seal every piece (AES-256-GCM), as a coordinator with TLS asks.
    #[arg(long)]
    pub seal: bool,
}

/// Arguments of the hidden `accrue bench collective-rank`.
#[derive(Debug, Clone, Args)]
pub struct CollectiveRankArgs {
    #[arg(long)]
    pub rank: usize,
    #[arg(long)]
    pub world: usize,
    #[arg(long, value_delimiter = ',')]
    pub sizes_mib: Vec<f64>,
    #[arg(long)]
    pub chunk_bytes: Option<usize>,
    #[arg(long)]
    pub seal: bool,
}

/// Arguments of `accrue bench recovery`.
#[derive(Debug, Clone, Args)]
pub struct RecoveryArgs {
    /// Print one JSON object per row instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Sharding levels.
    #[arg(long, value_delimiter = ',', default_value = "ddp,fsdp")]
    pub sharding: Vec<String>,
    /// World sizes before the fault (the last worker is hit).
    #[arg(long, value_delimiter = ',', default_value = "2,3")]
    pub workers: Vec<u32>,
    /// `kill` (kill -9) and/or `stop` (SIGSTOP, a frozen worker).
    #[arg(long, value_delimiter = ',', default_value = "kill,stop")]
    pub faults: Vec<String>,
}

/// Arguments of `accrue bench packing`.
#[derive(Debug, Clone, Args)]
pub struct PackingArgs {
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// A directory laid out like the project's shared data (sft/, dpo/, rl/,
    /// tokenizers/): each dataset in it is tokenized and packed too. Default:
    /// `$ACCRUE_SHARED_DATA`, else `../shared/data` when it exists.
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Documents drawn for the synthetic log-normal dataset.
    #[arg(long, value_name = "N", default_value_t = 256_000)]
    pub synthetic_docs: usize,
    /// Exit 1 unless the deterministic targets hold (no document dropped or
    /// cut, ≤ lower bound + 1 microbatches per rank); speed and balance
    /// targets are reported on stderr either way.
    #[arg(long)]
    pub check: bool,
}

#[derive(Debug, Subcommand)]
pub enum RolloutsCommand {
    /// Stream a rollouts JSONL file to a job whose spec has
    /// `data.source = "stream"`; waits while the job's queue is full and
    /// prints the counts (accepted, rejected as stale, zero-variance, ...).
    Push {
        /// The job: its id, its job.name (the live one), or a unique id prefix.
        #[arg(value_name = "JOB")]
        job: String,
        /// Rollout rows: prompt or prompt_ids, completion or completion_ids,
        /// reward, group, policy_version, old_logprobs.
        #[arg(value_name = "FILE.jsonl")]
        file: PathBuf,
        /// Rollouts per message (each message is admitted whole).
        #[arg(long, value_name = "N", default_value_t = 64)]
        batch: usize,
    },
}

#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Write a synthetic dataset.
    Synth(SynthArgs),
    /// Tokenize a job's sources into the token cache ahead of submit
    /// (progress, rows/s, skipped rows with file:line).
    #[command(after_help = accrue_coordinator::job::locate::CACHE_ENV_HELP)]
    Prepare(PrepareArgs),
    /// Show documents as the job will train them: the rendered text with
    /// the tokens that carry loss marked, the token ids and the counts (the
    /// first --count rows of a source, or row --doc).
    Show(ShowArgs),
}

/// Arguments of `accrue data show`.
#[derive(Debug, Clone, Args)]
pub struct ShowArgs {
    /// The job spec whose data to show.
    #[arg(value_name = "SPEC.toml")]
    pub spec: PathBuf,
    /// Only row N (1-based, counted over the source's files in order).
    #[arg(long, value_name = "N")]
    pub doc: Option<u64>,
    /// The source (`data.sources[].name`); default: the first.
    #[arg(long, value_name = "NAME")]
    pub source: Option<String>,
    /// Rows shown without --doc.
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub count: u64,
    /// One JSON object per row: text, ids, loss_mask (1 = carries loss), counts.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `accrue data prepare`.
#[derive(Debug, Clone, Args)]
pub struct PrepareArgs {
    /// The job spec whose sources (and eval sources) to prepare.
    #[arg(value_name = "SPEC.toml")]
    pub spec: PathBuf,
    /// Print one JSON line per file instead of progress bars.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `accrue data synth`.
#[derive(Debug, Clone, Args)]
pub struct SynthArgs {
    /// Which synthetic task to generate.
    #[arg(long, value_enum)]
    pub task: SynthTask,
    /// Output directory.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Random seed; the same seed writes the same files.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// Number of rows (documents) to write.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub rows: u64,
}

/// Synthetic tasks `accrue data synth` can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SynthTask {
    /// Small integer arithmetic questions with exact answers.
    Arithmetic,
    /// The same files with single-digit operands (the RL demo's task).
    ArithmeticSmall,
    /// Rollout groups of arithmetic answers rewarded 1 (right) or 0 (wrong)
    /// for the policy-gradient demo (`--rows` rounded up to whole groups).
    ArithmeticRollouts,
    /// Two-digit multiplication with a calculator tool (the tool demo):
    /// chat traces calling the tool, training prompts, and held-out
    /// prompts (`--rows` / 10 of them) from problems never in the others.
    ToolArithmetic,
}

/// `accrue local --devices`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Devices {
    /// Worker i on visible GPU i mod the GPU count (CPU without GPUs).
    Gpu,
    Cpu,
}

/// `accrue plot`'s default image size (width, height) in pixels.
pub const PLOT_SIZE: (u32, u32) = (1280, 960);

/// Parses `NAME=W`.
pub fn parse_weight(s: &str) -> Result<(String, f64), String> {
    let (name, w) = s
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=WEIGHT, got {s:?}"))?;
    let w: f64 = w
        .parse()
        .map_err(|_| format!("weight of {name:?} is not a number: {w:?}"))?;
    Ok((name.to_string(), w))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn connection_flags_have_their_heading_and_stay_out_of_offline_help() {
        let mut cmd = command();
        cmd.build();
        let help = |cmd: &mut clap::Command, sub: &str| {
            cmd.find_subcommand_mut(sub)
                .unwrap()
                .render_long_help()
                .to_string()
        };
        let jobs = help(&mut cmd, "jobs");
        assert!(jobs.contains("Connection:"), "{jobs}");
        assert!(jobs.contains("--coordinator"), "{jobs}");
        for sub in OFFLINE {
            let text = help(&mut cmd, sub);
            for flag in ["--coordinator", "--token", "--tls-ca", "--max-message-mb"] {
                assert!(!text.contains(flag), "`accrue {sub} --help` shows {flag}");
            }
        }
        // Still accepted there (scripts that always pass them keep working).
        command()
            .try_get_matches_from([
                "accrue",
                "validate",
                "x.toml",
                "--coordinator",
                "http://h:1",
            ])
            .unwrap();
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("accrue").chain(args.iter().copied()))
    }

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn global_flags_go_anywhere_and_default_sensibly() {
        let cli = parse(&[
            "jobs",
            "--json",
            "--coordinator",
            "http://c:1",
            "--token",
            "t",
        ])
        .unwrap();
        assert!(matches!(cli.command, Command::Jobs { json: true }));
        assert_eq!(cli.conn.coordinator, "http://c:1");
        assert_eq!(cli.conn.token.as_deref(), Some("t"));
        if std::env::var_os("ACCRUE_COORDINATOR").is_none() {
            let cli = parse(&["workers"]).unwrap();
            assert_eq!(cli.conn.coordinator, DEFAULT_COORDINATOR);
        }
    }

    #[test]
    fn every_subcommand_parses() {
        let cases: &[&[&str]] = &[
            &["validate", "job.toml"],
            &["validate", "job.toml", "--data"],
            &["validate", "job.toml", "--no-data"],
            &["submit", "job.toml"],
            &["jobs"],
            &["status", "j1", "--json"],
            &["cancel", "j1"],
            &["pause", "j1"],
            &["resume", "j1"],
            &["workers", "--json"],
            &["drain", "w1"],
            &["checkpoint", "j1"],
            &["watch", "j1", "--from-step", "5", "--json"],
            &["steps", "j1"],
            &[
                "steps", "j1", "--from", "2", "--to", "9", "--detail", "--json",
            ],
            &["set", "j1", "--docs-per-step", "8"],
            &["set", "j1", "--max-tokens", "512", "--lr", "2e-4"],
            &["bench", "packing", "--json", "--data", "/d"],
            &[
                "bench",
                "collective",
                "--json",
                "--sizes-mib",
                "1,16",
                "--worlds",
                "2,4",
            ],
            &[
                "bench",
                "collective",
                "--python",
                "/usr/bin/python3",
                "--no-gloo",
            ],
            &[
                "bench",
                "collective-rank",
                "--rank",
                "1",
                "--world",
                "2",
                "--sizes-mib",
                "1",
            ],
            &[
                "data",
                "synth",
                "--task",
                "arithmetic",
                "--out",
                "o",
                "--seed",
                "3",
                "--rows",
                "10",
            ],
            &["local", "job.toml", "--workers", "4"],
            &["rollouts", "push", "j1", "r.jsonl", "--batch", "8"],
            &["plot", "j1", "--out", "p.png"],
            &[
                "plot",
                "--metrics",
                "m.jsonl",
                "--out",
                "p.png",
                "--width",
                "800",
            ],
        ];
        for args in cases {
            parse(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
        }
        let cli = parse(&[
            "export",
            "ck",
            "--out",
            "o",
            "--dtype",
            "bf16",
            "--shard-size",
            "2GiB",
        ])
        .unwrap();
        assert!(matches!(
            cli.command,
            Command::Export { dtype: Some(accrue_coordinator::model::export::Dtype::BFloat16), shard_size, .. } if shard_size == 2 << 30
        ));
        let e = parse(&["export", "ck", "--out", "o", "--dtype", "int8"]).unwrap_err();
        assert!(e.to_string().contains("unknown dtype"), "{e}");
        let cli = parse(&["watch", "j1", "--from-step", "5"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Watch { ref job, from_step: 5, json: false, .. } if job == "j1"
        ));
        let cli = parse(&["data", "synth", "--task", "arithmetic", "--out", "o"]).unwrap();
        let Command::Data {
            data: DataCommand::Synth(a),
        } = cli.command
        else {
            panic!("not data synth");
        };
        assert_eq!((a.seed, a.rows, a.task), (0, 1000, SynthTask::Arithmetic));
        let cli = parse(&["set", "j1", "--lr", "3e-4", "--max-tokens", "256"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Set { ref job, docs_per_step: None, tokens_per_step: None, max_tokens: Some(256), lr: Some(lr), .. }
                if job == "j1" && lr == 3e-4
        ));
        let cli = parse(&["steps", "j1", "--to", "4"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Steps {
                from: None,
                to: Some(4),
                detail: false,
                json: false,
                ..
            }
        ));
    }

    #[test]
    fn usage_errors_are_exit_code_2() {
        for args in [
            &["status"][..],
            &["watch", "j1", "--from-step", "x"],
            &["data", "synth", "--task", "poetry", "--out", "o"],
            &["frobnicate"],
            &["set", "j1"],
            &["set", "j1", "--docs-per-step", "-1"],
            &["steps"],
            &["plot", "--out", "p.png"],
            &["plot", "j1", "--out", "p.png", "--smooth", "x"],
            &["plot", "j1"],
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{args:?}");
        }
    }
}

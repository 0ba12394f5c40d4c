//! The `accrue` command line: a thin client of the coordinator's Admin gRPC
//! service, plus offline commands (`validate`, `bench`, `data`) that need no
//! coordinator. This module holds the clap definitions and the dispatch;
//! rendering is pure and lives in [`render`], connecting in [`client`].
//!
//! Exit codes: 0 ok, 1 a failure the user caused (bad spec, failed or
//! cancelled job, unreachable coordinator, RPC error), 2 usage (clap), 141
//! the reader of our output went away ([`output`]).

use std::process::ExitCode;

mod admin;
mod args;
mod bench;
pub mod client;
mod data;
mod doctor;
pub mod local;
#[cfg(test)]
mod mock_tests;
pub mod output;
pub mod plot;
mod quarantine;
pub mod render;
pub mod rollouts;
pub mod set;
mod shell;
pub mod steps;
pub mod validate;
pub mod watch;

pub use args::*;
pub use client::BearerAuth;

/// Runs one parsed command line. `Err` is printed by the binary as
/// `error: {:#}` with exit code 1.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let conn = &cli.conn;
    match cli.command {
        Command::Validate {
            spec,
            data,
            no_data,
        } => {
            let base = std::env::current_dir()?;
            let scan = match (data, no_data) {
                (true, _) => validate::DataScan::Always,
                (_, true) => validate::DataScan::Never,
                _ => validate::DataScan::Auto,
            };
            validate::run(
                &spec,
                &base,
                scan,
                &mut std::io::stdout(),
                &mut std::io::stderr(),
            )
        }
        Command::Doctor {
            shared,
            offline,
            json,
        } => doctor::run(conn, &shared, offline, json).await,
        Command::Export {
            checkpoint,
            out,
            dtype,
            shard_size,
            merge,
        } => {
            let opts = accrue_coordinator::model::export::ExportOptions {
                dtype,
                shard_bytes: shard_size,
                merge,
            };
            let r = accrue_coordinator::model::export::export(&checkpoint, &out, &opts)?;
            for f in &r.missing_tokenizer_files {
                output::errln!(
                    "warning: {} has no {f} (a checkpoint older than the tokenizer files): the folder loads as a model, not with AutoTokenizer",
                    checkpoint.display()
                );
            }
            output::outln!(
                "{}: {} tensors, {:.1} MB in {} file(s)",
                out.display(),
                r.tensors,
                r.bytes as f64 / 1e6,
                r.shards.len()
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Submit { spec, new_job } => admin::submit(conn, &spec, new_job).await,
        Command::Jobs { json } => admin::jobs(conn, json).await,
        Command::Status { job, json } => admin::status(conn, &job, json).await,
        Command::Cancel { job } => admin::transition(conn, &job, admin::Transition::Cancel).await,
        Command::Pause { job } => admin::transition(conn, &job, admin::Transition::Pause).await,
        Command::Resume { job } => admin::transition(conn, &job, admin::Transition::Resume).await,
        Command::Workers { json } => admin::workers(conn, json).await,
        Command::Completions { shell } => shell::completions(shell, &mut std::io::stdout()),
        Command::Man { out } => shell::man(out.as_deref(), &mut std::io::stdout()),
        Command::Drain { worker } => admin::drain(conn, &worker).await,
        Command::EndpointToken { job } => match conn.resolved_token()? {
            Some(t) => {
                println!("{}", t.endpoint_token(&job).expose());
                Ok(ExitCode::SUCCESS)
            }
            None => anyhow::bail!(
                "no admin token: the endpoint token derives from it (pass --token or --token-file, or set ACCRUE_ADMIN_TOKEN); a coordinator without one serves its endpoint open on loopback"
            ),
        },
        Command::Checkpoint { job } => admin::checkpoint(conn, &job).await,
        Command::Quarantine {
            job,
            release,
            release_all,
            json,
        } => {
            let action = match (release_all, release.is_empty()) {
                (true, _) => quarantine::Action::ReleaseAll,
                (false, false) => quarantine::Action::Release(release),
                (false, true) => quarantine::Action::List,
            };
            quarantine::run(conn, &job, action, json).await
        }
        Command::Watch {
            job,
            from_step,
            json,
            exit_zero,
        } => {
            let code = watch::run(conn, &job, from_step, json).await?;
            Ok(if exit_zero { ExitCode::SUCCESS } else { code })
        }
        Command::Steps {
            job,
            from,
            to,
            detail,
            json,
        } => {
            let args = steps::StepsArgs {
                job,
                from,
                to,
                detail,
                json,
            };
            steps::run(conn, &args).await
        }
        Command::Set {
            job,
            docs_per_step,
            tokens_per_step,
            max_tokens,
            lr,
            weights,
        } => {
            let args = set::SetArgs {
                job,
                docs_per_step,
                tokens_per_step,
                max_tokens,
                lr,
                weights,
            };
            set::run(conn, &args).await
        }
        Command::Plot {
            jobs,
            metrics,
            out,
            smooth,
            width,
            height,
        } => {
            let args = plot::PlotArgs {
                jobs,
                metrics,
                out,
                size: (width, height),
                smooth,
            };
            plot::run(conn, &args).await
        }
        Command::Bench {
            bench: BenchCommand::Packing(args),
        } => bench::run::packing(&args),
        Command::Bench {
            bench: BenchCommand::Collective(args),
        } => bench::run::collective(&args),
        Command::Bench {
            bench: BenchCommand::Recovery(args),
        } => bench::recovery::run(&args).await,
        Command::Bench {
            bench: BenchCommand::Data(args),
        } => bench::run::data(&args),
        Command::Bench {
            bench: BenchCommand::DataSubmitChild { spec },
        } => bench::run::data_submit_child(&spec),
        Command::Bench {
            bench: BenchCommand::CollectiveRank(args),
        } => bench::run::collective_rank(&args),
        Command::Bench {
            bench: BenchCommand::ControlPlane(args),
        } => bench::run::control_plane(&args),
        Command::Data {
            data: DataCommand::Synth(args),
        } => data::synth(&args),
        Command::Data {
            data: DataCommand::Prepare(args),
        } => data::prepare(&args),
        Command::Data {
            data: DataCommand::Show(args),
        } => data::show(&args),
        Command::Rollouts {
            rollouts: RolloutsCommand::Push { job, file, batch },
        } => rollouts::push(conn, &job, &file, batch).await,
        Command::Local {
            spec,
            workers,
            devices,
            metrics_listen,
            serve_listen,
        } => {
            local::run(
                &spec,
                workers,
                devices,
                metrics_listen.as_deref(),
                serve_listen,
            )
            .await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    #[tokio::test]
    async fn local_with_a_missing_spec_names_the_file() {
        let args = ["accrue", "local", "/nonexistent/job.toml", "--workers", "2"];
        let e = run(Cli::try_parse_from(args).unwrap()).await.unwrap_err();
        assert_eq!(e.to_string(), "file not found: /nonexistent/job.toml");
    }
}

//! `accrue.v1.Admin`: decode, call the core, encode.

use std::path::PathBuf;
use std::sync::Arc;

use accrue_proto::v1 as wire;
use accrue_proto::v1::admin_server::Admin;
use tonic::{Request, Response, Status};
use tracing::instrument;

use super::convert;
use super::shared::{now_ms, Shared};
use crate::core::{Event, JobStart};
use crate::job::section::SpecProblem;
use crate::job::settings::JobUpdate;
use crate::job::spec::JobSpec;
use crate::shell::{admission, output};
use crate::stream::doc::DocId;

pub struct AdminService {
    shared: Arc<Shared>,
}

impl AdminService {
    pub fn new(shared: Arc<Shared>) -> Self {
        Self { shared }
    }

    /// The id of the job an operator named by id, name or id prefix
    /// (see [`crate::core::Coordinator::resolve_job`]).
    fn job_id(&self, arg: &str) -> Result<String, Status> {
        required("job_id", arg)?;
        let inner = self.shared.lock();
        inner
            .core
            .resolve_job(arg)
            .map_err(super::shared::core_status)
    }

    fn summary(&self, job: &str) -> Result<wire::JobSummary, Status> {
        let inner = self.shared.lock();
        let j = inner.core.job(job).map_err(super::shared::core_status)?;
        Ok(convert::job_summary(j))
    }
}

fn required(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!(
            "{field} must not be empty"
        )));
    }
    Ok(())
}

fn problems_status(problems: &[SpecProblem]) -> Status {
    let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
    Status::invalid_argument(format!("invalid job spec:\n{}", lines.join("\n")))
}

fn base_dir(s: &str) -> Result<PathBuf, Status> {
    let p = PathBuf::from(s);
    if s.is_empty() || p.is_relative() {
        return Err(Status::invalid_argument(
            "base_dir must be an absolute directory (relative spec paths resolve against it)",
        ));
    }
    Ok(p)
}

/// Where a job whose `model.init` is a checkpoint of ours (it holds the
/// `manifest.json` workers write) starts: `accrue_checkpoint`'s resume rule
/// ([`accrue_checkpoint::Manifest::resume_point`]), restoring model and
/// optimizer state from that directory.
pub(super) fn resume_point(spec: &JobSpec) -> Result<Option<JobStart>, String> {
    if spec.model.is_random() {
        return Ok(None);
    }
    let dir = PathBuf::from(&spec.model.init);
    if !dir.join(accrue_checkpoint::MANIFEST).is_file() {
        return Ok(None);
    }
    let m = accrue_checkpoint::read_manifest(&dir).map_err(|e| format!("model.init: {e}"))?;
    Ok(m.resume_point(spec.model.resume)
        .map(|(step, cursor)| JobStart { step, cursor, dir }))
}

use super::watch::WatchStream;

#[tonic::async_trait]
impl Admin for AdminService {
    #[instrument(skip_all)]
    async fn submit_job(
        &self,
        req: Request<wire::SubmitJobRequest>,
    ) -> Result<Response<wire::SubmitJobResponse>, Status> {
        let req = req.into_inner();
        let base = base_dir(&req.base_dir)?;
        let spec = JobSpec::parse(&req.spec_toml, &base).map_err(|p| problems_status(&p))?;
        let spec_toml = spec.to_toml();
        // A retried submit finds its job before any data is read.
        if let Some(existing) = same_live_job(&self.shared.lock().core, &spec, &spec_toml, &req)? {
            return Ok(Response::new(existing));
        }
        // Reading the model and tokenizing the dataset is blocking work:
        // keep it off the async runtime.
        let checked = spec.clone();
        let admitted = tokio::task::spawn_blocking(move || admission::admit(&checked, true))
            .await
            .map_err(|e| Status::internal(format!("admission task: {e}")))?
            .map_err(|p| problems_status(&p))?;
        // The RL loop's prompts and verifier, read like the dataset is.
        let scorer = if spec.data.is_generate() {
            let (checked, vocab) = (spec.clone(), admitted.model.vocab_size);
            let s = tokio::task::spawn_blocking(move || {
                crate::rl::scorer::Scorer::load(&checked, vocab, None)
            })
            .await
            .map_err(|e| Status::internal(format!("admission task: {e}")))?
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
            Some(Arc::new(s))
        } else {
            None
        };
        // A served job's endpoint: its tokenizer and chat template.
        let endpoint = match spec.rl.serve {
            Some(_) => Some(Arc::new(
                crate::rl::endpoint::Endpoint::load(&spec, admitted.model.vocab_size)
                    .map_err(|e| Status::invalid_argument(format!("rl.serve: {e}")))?,
            )),
            None => None,
        };
        let docs = admitted
            .dataset
            .map(crate::stream::data::Dataset::into_job_docs)
            .unwrap_or_default();
        if docs.is_empty() && !spec.data.is_stream() {
            return Err(Status::invalid_argument(
                "data.train: the dataset holds no documents",
            ));
        }
        let start = resume_point(&spec).map_err(Status::invalid_argument)?;
        let id = uuid::Uuid::new_v4().to_string();
        let mut inner = self.shared.lock();
        // Two identical submits racing through admission start one job.
        if let Some(existing) = same_live_job(&inner.core, &spec, &spec_toml, &req)? {
            return Ok(Response::new(existing));
        }
        // The output directory is claimed (and proven writable) before the
        // job exists; one a live job writes to, here or on another
        // coordinator, is refused (by where it really is: links and `..`
        // followed, nesting counted).
        let dir = spec.job.output_dir.clone();
        inner
            .core
            .check_output_free(&spec.job.name, &dir, output::real_path)
            .map_err(super::shared::core_status)?;
        let now = now_ms();
        let owner = output::Owner::new(&id, &spec.job.name, self.shared.markers.holder(), now);
        output::claim(&dir, &owner, now).map_err(|e| Status::failed_precondition(e.to_string()))?;
        self.shared.apply_locked(
            &mut inner,
            Event::SubmitJob {
                id: id.clone(),
                spec: Arc::new(spec),
                spec_toml,
                docs: docs.into(),
                start,
            },
        )?;
        if let Some(endpoint) = endpoint {
            self.shared.install_endpoint(&id, endpoint);
        }
        if let Some(scorer) = scorer {
            let inputs = scorer.inputs();
            self.shared.install_scorer(&id, scorer);
            let job = id.clone();
            self.shared
                .apply_locked(&mut inner, Event::LoadPrompts { job, inputs })?;
        }
        Ok(Response::new(wire::SubmitJobResponse {
            job_id: id,
            existing: false,
        }))
    }

    async fn validate_job(
        &self,
        req: Request<wire::ValidateJobRequest>,
    ) -> Result<Response<wire::ValidateJobResponse>, Status> {
        let req = req.into_inner();
        let base = base_dir(&req.base_dir)?;
        // The spec and its model; the data is read at submit (or by
        // `accrue validate --data`).
        let problems = match JobSpec::parse(&req.spec_toml, &base) {
            Err(p) => p,
            Ok(spec) => tokio::task::spawn_blocking(move || admission::admit(&spec, false))
                .await
                .map_err(|e| Status::internal(format!("admission task: {e}")))?
                .err()
                .unwrap_or_default(),
        };
        Ok(Response::new(wire::ValidateJobResponse {
            problems: problems
                .into_iter()
                .map(|p| wire::SpecProblem {
                    field: p.field,
                    message: p.message,
                })
                .collect(),
        }))
    }

    async fn list_jobs(
        &self,
        _: Request<wire::ListJobsRequest>,
    ) -> Result<Response<wire::ListJobsResponse>, Status> {
        let inner = self.shared.lock();
        let jobs = inner.core.jobs().map(convert::job_summary).collect();
        Ok(Response::new(wire::ListJobsResponse { jobs }))
    }

    async fn get_job(
        &self,
        req: Request<wire::GetJobRequest>,
    ) -> Result<Response<wire::GetJobResponse>, Status> {
        let id = self.job_id(&req.into_inner().job_id)?;
        let inner = self.shared.lock();
        let job = inner.core.job(&id).map_err(super::shared::core_status)?;
        let from = job.rec.step.saturating_sub(9).max(1);
        let recent = inner
            .store
            .steps(&id, from)
            .map_err(|e| Status::internal(e.to_string()))?
            .iter()
            .map(|r| convert::step_metrics(&r.metrics))
            .collect();
        Ok(Response::new(wire::GetJobResponse {
            job: Some(convert::job_summary(job)),
            spec_toml: job.rec.spec_toml.clone(),
            recent_steps: recent,
        }))
    }

    async fn cancel_job(
        &self,
        req: Request<wire::CancelJobRequest>,
    ) -> Result<Response<wire::CancelJobResponse>, Status> {
        let id = self.job_id(&req.into_inner().job_id)?;
        self.shared.apply(Event::CancelJob { job: id.clone() })?;
        Ok(Response::new(wire::CancelJobResponse {
            job: Some(self.summary(&id)?),
        }))
    }

    async fn pause_job(
        &self,
        req: Request<wire::PauseJobRequest>,
    ) -> Result<Response<wire::PauseJobResponse>, Status> {
        let id = self.job_id(&req.into_inner().job_id)?;
        self.shared.apply(Event::PauseJob { job: id.clone() })?;
        Ok(Response::new(wire::PauseJobResponse {
            job: Some(self.summary(&id)?),
        }))
    }

    async fn resume_job(
        &self,
        req: Request<wire::ResumeJobRequest>,
    ) -> Result<Response<wire::ResumeJobResponse>, Status> {
        let id = self.job_id(&req.into_inner().job_id)?;
        self.shared.apply(Event::ResumeJob { job: id.clone() })?;
        Ok(Response::new(wire::ResumeJobResponse {
            job: Some(self.summary(&id)?),
        }))
    }

    async fn list_workers(
        &self,
        _: Request<wire::ListWorkersRequest>,
    ) -> Result<Response<wire::ListWorkersResponse>, Status> {
        let now = now_ms();
        let inner = self.shared.lock();
        let workers = inner
            .core
            .workers()
            .map(|w| convert::worker_info(w, inner.core.generator_rank(w), now))
            .collect();
        Ok(Response::new(wire::ListWorkersResponse { workers }))
    }

    async fn drain_worker(
        &self,
        req: Request<wire::DrainWorkerRequest>,
    ) -> Result<Response<wire::DrainWorkerResponse>, Status> {
        let id = req.into_inner().worker_id;
        required("worker_id", &id)?;
        let mut inner = self.shared.lock();
        self.shared
            .apply_locked(&mut inner, Event::DrainWorker { worker: id.clone() })?;
        let w = inner
            .core
            .worker(&id)
            .map(|w| convert::worker_info(w, inner.core.generator_rank(w), now_ms()));
        Ok(Response::new(wire::DrainWorkerResponse { worker: w }))
    }

    async fn trigger_checkpoint(
        &self,
        req: Request<wire::TriggerCheckpointRequest>,
    ) -> Result<Response<wire::TriggerCheckpointResponse>, Status> {
        let id = self.job_id(&req.into_inner().job_id)?;
        let mut inner = self.shared.lock();
        let step = inner
            .core
            .checkpoint_step(&id)
            .map_err(super::shared::core_status)?;
        self.shared
            .apply_locked(&mut inner, Event::TriggerCheckpoint { job: id })?;
        Ok(Response::new(wire::TriggerCheckpointResponse { step }))
    }

    async fn list_steps(
        &self,
        req: Request<wire::ListStepsRequest>,
    ) -> Result<Response<wire::ListStepsResponse>, Status> {
        let mut req = req.into_inner();
        req.job_id = self.job_id(&req.job_id)?;
        let from = req.from_step.unwrap_or(0);
        let to = req.to_step.unwrap_or(u64::MAX);
        if to < from {
            return Err(Status::invalid_argument(format!(
                "to_step ({to}) must not be below from_step ({from})"
            )));
        }
        let inner = self.shared.lock();
        inner
            .core
            .job(&req.job_id)
            .map_err(super::shared::core_status)?;
        let steps = inner
            .store
            .steps(&req.job_id, from)
            .map_err(|e| Status::internal(e.to_string()))?
            .iter()
            .take_while(|r| r.metrics.step <= to)
            .map(|r| convert::step_manifest(r, req.detail))
            .collect();
        Ok(Response::new(wire::ListStepsResponse { steps }))
    }

    async fn update_job(
        &self,
        req: Request<wire::UpdateJobRequest>,
    ) -> Result<Response<wire::UpdateJobResponse>, Status> {
        let mut req = req.into_inner();
        req.job_id = self.job_id(&req.job_id)?;
        let update = JobUpdate {
            docs_per_step: req.docs_per_step,
            tokens_per_step: req.tokens_per_step,
            max_tokens: req.max_tokens,
            lr: req.lr,
            weights: (!req.weights.is_empty()).then(|| req.weights.into_iter().collect()),
        };
        let mut inner = self.shared.lock();
        self.shared.apply_locked(
            &mut inner,
            Event::UpdateJob {
                job: req.job_id.clone(),
                update,
            },
        )?;
        let job = inner
            .core
            .job(&req.job_id)
            .map_err(super::shared::core_status)?;
        Ok(Response::new(wire::UpdateJobResponse {
            job: Some(convert::job_summary(job)),
            from_step: job.rec.changes.last().map_or(0, |c| c.from_step),
        }))
    }

    async fn list_quarantine(
        &self,
        req: Request<wire::ListQuarantineRequest>,
    ) -> Result<Response<wire::ListQuarantineResponse>, Status> {
        let id = self.job_id(&req.into_inner().job_id)?;
        let inner = self.shared.lock();
        let job = inner.core.job(&id).map_err(super::shared::core_status)?;
        let documents = job
            .rec
            .quarantine
            .iter()
            .map(|q| convert::quarantined(job, q))
            .collect();
        Ok(Response::new(wire::ListQuarantineResponse { documents }))
    }

    async fn release_quarantine(
        &self,
        req: Request<wire::ReleaseQuarantineRequest>,
    ) -> Result<Response<wire::ReleaseQuarantineResponse>, Status> {
        let mut req = req.into_inner();
        req.job_id = self.job_id(&req.job_id)?;
        let docs = match (req.all, req.doc_ids.is_empty()) {
            (true, true) => None,
            (false, false) => Some(
                req.doc_ids
                    .iter()
                    .enumerate()
                    .map(|(i, d)| {
                        d.parse::<DocId>()
                            .map_err(|e| Status::invalid_argument(format!("doc_ids[{i}]: {e}")))
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            (true, false) => return Err(Status::invalid_argument("give doc_ids or all, not both")),
            (false, true) => {
                return Err(Status::invalid_argument(
                    "doc_ids: name the documents to release (or set all)",
                ))
            }
        };
        let mut inner = self.shared.lock();
        let job = inner
            .core
            .job(&req.job_id)
            .map_err(super::shared::core_status)?;
        let released = job
            .rec
            .quarantine
            .iter()
            .filter(|q| docs.as_ref().is_none_or(|d| d.contains(&q.doc)))
            .map(|q| convert::quarantined(job, q))
            .collect();
        self.shared.apply_locked(
            &mut inner,
            Event::ReleaseQuarantine {
                job: req.job_id.clone(),
                docs,
            },
        )?;
        Ok(Response::new(wire::ReleaseQuarantineResponse { released }))
    }

    type WatchJobStream = WatchStream;

    async fn watch_job(
        &self,
        req: Request<wire::WatchJobRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let mut req = req.into_inner();
        req.job_id = self.job_id(&req.job_id)?;
        let stream = super::watch::watch(&self.shared, req.job_id, req.from_step)?;
        Ok(Response::new(stream))
    }
}

/// Submit is idempotent by job name: a live job of the same name and
/// (resolved) spec is the answer; one with another spec is refused unless
/// the request asks for a new job.
fn same_live_job(
    core: &crate::core::Coordinator,
    spec: &JobSpec,
    spec_toml: &str,
    req: &wire::SubmitJobRequest,
) -> Result<Option<wire::SubmitJobResponse>, Status> {
    if req.new_job {
        return Ok(None);
    }
    let Some(job) = core.live_job_named(&spec.job.name) else {
        return Ok(None);
    };
    if job.rec.spec_toml == spec_toml {
        tracing::info!(job = %job.rec.id, name = %job.rec.name, "submit of a live job's name and spec: returning it");
        return Ok(Some(wire::SubmitJobResponse {
            job_id: job.rec.id.clone(),
            existing: true,
        }));
    }
    Err(Status::already_exists(format!(
        "job.name {:?}: a live job of that name ({}, {}) has another spec; cancel it, rename this one, or submit with --new to start a second",
        spec.job.name,
        job.rec.id,
        job.rec.state.name()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_with_init(init: &str) -> JobSpec {
        let mut spec: JobSpec = toml::from_str(&format!(
            "[job]\nname = \"t\"\nsteps = 2\noutput_dir = \"/tmp/o\"\n[model]\ninit = \"{init}\"\n\
             [data]\ntrain = []\nformat = \"sft\"\n[batch]\ndocs_per_step = 1\n"
        ))
        .unwrap();
        spec.model.init = init.into();
        spec
    }

    #[test]
    fn a_checkpoint_with_a_manifest_is_a_resume_point() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        assert_eq!(resume_point(&spec_with_init("random")), Ok(None));
        assert_eq!(
            resume_point(&spec_with_init(&d)),
            Ok(None),
            "a plain HF dir"
        );
        std::fs::write(
            dir.path().join("manifest.json"),
            r#"{"job":"j","step":4,"cursor":{"epoch":1,"position":9,"overflow":[2]},"world_size":1,"generation":1}"#,
        )
        .unwrap();
        let start = resume_point(&spec_with_init(&d)).unwrap().unwrap();
        assert_eq!(start.step, 4);
        assert_eq!((start.cursor.epoch, start.cursor.position), (1, 9));
        assert_eq!(start.cursor.overflow, vec![2]);
        assert_eq!(start.dir, dir.path());
        let mut weights_only = spec_with_init(&d);
        weights_only.model.resume = false;
        assert_eq!(resume_point(&weights_only), Ok(None), "resume = false");
        std::fs::write(dir.path().join("manifest.json"), "{").unwrap();
        let e = resume_point(&spec_with_init(&d)).unwrap_err();
        assert!(
            e.starts_with("model.init: ") && e.contains("manifest.json"),
            "{e}"
        );
    }
}

//! Jobs coming in: submitted (a fresh record, or one resuming a checkpoint
//! of ours) and restored after a restart; and finding a job by what an
//! operator calls it.

use tracing::info;

use super::effects::Effects;
use super::error::{CoreError, OutputOverlap, Result};
use super::events::{JobStart, Restored, Submission};
use super::job::Job;
use super::job_data::JobData;
use super::machine::Coordinator;
use super::phase::Phase;
use super::planner;
use super::record::JobRecord;
use super::types::{CheckpointEntry, JobId, JobState, Nesting, PlanKind};
use crate::job::spec::JobSpec;
use crate::stream::doc::Document;

impl Coordinator {
    /// Admits a new job (its record persisted before anything else). Its
    /// output directory was checked by the shell
    /// ([`Coordinator::check_output_free`], under the same lock): only it
    /// can tell where a directory really is.
    pub(crate) fn submit(&mut self, s: Submission, now_ms: i64, fx: &mut Effects) -> Result<()> {
        let Submission {
            id,
            spec,
            spec_toml,
            docs,
            start,
        } = s;
        if self.jobs.contains_key(&id) {
            return Err(CoreError::DuplicateJob(id));
        }
        let rec = new_record(&id, &spec, spec_toml, &docs, start, now_ms);
        info!(job = %id, name = %rec.name, docs = docs.len(), "job submitted");
        let data = JobData::new(&id, &spec, docs, None, rec.step);
        let mut job = Job::new(rec, spec, data);
        job.rec.total_steps =
            planner::total_steps(&job.spec, &job.data.docs, job.data.rollouts.as_ref());
        fx.persist(super::effects::Persist::Job(Box::new(job.rec.clone())));
        self.job_order.push(id.clone());
        self.jobs.insert(id, job);
        Ok(())
    }

    /// Takes back a job the store held: no generation survives a restart,
    /// and the members of its last one get a grace period to come back.
    pub(crate) fn restore(&mut self, r: Restored, now_ms: i64) {
        let Restored {
            mut rec,
            spec,
            docs,
            reference,
            history,
        } = r;
        if rec.state == JobState::Running {
            // No generation survives a restart; workers re-join.
            rec.state = JobState::Pending;
            rec.reason = "coordinator restarted; waiting for workers".into();
        }
        migrate_checkpoint_index(&mut rec, &spec);
        let id = rec.id.clone();
        let data = JobData::new(&id, &spec, docs, Some(reference), rec.step);
        let mut job = Job::new(rec, spec, data);
        if let Phase::Waiting {
            rejoin_until_ms, ..
        } = &mut job.phase
        {
            if !job.rec.members.is_empty() {
                *rejoin_until_ms = Some(now_ms + self.opts.rejoin_grace_ms);
            }
        }
        job.data.history = history.into_iter().map(|h| (h.step, h)).collect();
        // The shell loads only the window (`Job::history_window_start`);
        // the steps before it are in the store.
        job.trim_history(None);
        self.job_order.push(id.clone());
        self.jobs.insert(id, job);
    }

    /// The job an operator means by `arg`: its id; else its `job.name`
    /// (the live job of that name, or the latest submitted when none is
    /// live); else a unique id prefix. Several live jobs of one name, or a
    /// prefix of several ids, are refused listing them.
    pub fn resolve_job(&self, arg: &str) -> Result<JobId> {
        if self.jobs.contains_key(arg) {
            return Ok(arg.to_string());
        }
        let ambiguous = |ids: Vec<&Job>| CoreError::AmbiguousJob {
            arg: arg.to_string(),
            candidates: ids.iter().map(|j| j.rec.id.clone()).collect(),
        };
        let named: Vec<&Job> = self.jobs().filter(|j| j.rec.name == arg).collect();
        let live: Vec<&Job> = named
            .iter()
            .copied()
            .filter(|j| !j.rec.state.is_terminal())
            .collect();
        match (live.len(), named.last()) {
            (1, _) => return Ok(live[0].rec.id.clone()),
            (0, Some(latest)) => return Ok(latest.rec.id.clone()),
            (0, None) => {}
            _ => return Err(ambiguous(live)),
        }
        let prefixed: Vec<&Job> = self.jobs().filter(|j| j.rec.id.starts_with(arg)).collect();
        match prefixed.len() {
            0 => Err(CoreError::JobNotFound(arg.to_string())),
            1 => Ok(prefixed[0].rec.id.clone()),
            _ => Err(ambiguous(prefixed)),
        }
    }

    /// The live (not ended) job named `name`, if any: a submit of the same
    /// name and spec returns it instead of starting a second one.
    pub fn live_job_named(&self, name: &str) -> Option<&Job> {
        self.jobs()
            .find(|j| !j.rec.state.is_terminal() && j.rec.name == name)
    }

    /// Refuses `dir` for job `name` when it is, lies inside or contains
    /// the output directory of a live job. Directories are compared by
    /// where they really are: `real` resolves a path (the shell's
    /// canonicalizes; links and `..` count), so `runs/x/../a` or a link to
    /// `runs/a` is `runs/a`.
    pub fn check_output_free(
        &self,
        name: &str,
        dir: &std::path::Path,
        real: impl Fn(&std::path::Path) -> std::path::PathBuf,
    ) -> Result<()> {
        let wanted = real(dir);
        for j in self.jobs().filter(|j| !j.rec.state.is_terminal()) {
            let held = &j.spec.job.output_dir;
            if let Some(nesting) = Nesting::of(&wanted, &real(held)) {
                return Err(CoreError::OutputInUse(Box::new(OutputOverlap {
                    job: name.to_string(),
                    dir: dir.to_path_buf(),
                    nesting,
                    owner_dir: held.clone(),
                    owner: j.rec.id.clone(),
                    name: j.rec.name.clone(),
                    state: j.rec.state.name().to_string(),
                })));
            }
        }
        Ok(())
    }

    /// The step at whose boundary a triggered checkpoint lands.
    pub fn checkpoint_step(&self, job: &str) -> Result<u64> {
        let j = self.job(job)?;
        Ok(j.inflight()
            .filter(|f| f.planned.kind == PlanKind::Train)
            .map_or(j.rec.step, |f| f.planned.step))
    }
}

/// The record of a job submitted now (from `start` when it resumes a
/// checkpoint of ours).
fn new_record(
    id: &str,
    spec: &JobSpec,
    spec_toml: String,
    docs: &[Document],
    start: Option<JobStart>,
    now_ms: i64,
) -> JobRecord {
    JobRecord {
        id: id.to_string(),
        name: spec.job.name.clone(),
        spec_toml,
        state: JobState::Pending,
        reason: "waiting for workers".into(),
        step: start.as_ref().map_or(0, |s| s.step),
        cursor: start.as_ref().map(|s| s.cursor.clone()).unwrap_or_default(),
        generation: 0,
        submitted_unix_ms: now_ms,
        last_loss: None,
        documents: docs.len() as u64,
        total_steps: 0,
        last_checkpoint: None,
        history_from: start.as_ref().map_or(0, |s| s.step),
        checkpoints: start
            .as_ref()
            .map(|s| CheckpointEntry {
                step: s.step,
                dir: s.dir.clone(),
            })
            .into_iter()
            .collect(),
        bad_checkpoints: Vec::new(),
        members: Vec::new(),
        quarantine: Vec::new(),
        resumed_from: start.map(|s| s.dir),
        changes: Vec::new(),
    }
}

/// Records written before the checkpoint index existed: their last
/// checkpoint becomes the index.
fn migrate_checkpoint_index(rec: &mut JobRecord, spec: &JobSpec) {
    if !rec.checkpoints.is_empty() {
        return;
    }
    if let Some(step) = rec.last_checkpoint {
        let dir = spec
            .job
            .output_dir
            .join("checkpoints")
            .join(format!("step-{step}"));
        rec.checkpoints.push(CheckpointEntry { step, dir });
    }
}

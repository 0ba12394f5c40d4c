//! Carrying out the RL loop's engine effects: the calls run on the
//! server's runtime ([`crate::rl::engine::client`]), their answers go
//! back to the core as events.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::shared::Shared;
use crate::core::Event;
use crate::job::engine::EngineSection;
use crate::rl::engine::client::wait_for_files;
use crate::rl::rounds::EngineRound;

impl Shared {
    /// Runs `work` on the server's runtime (effects may be carried out
    /// on a scoring thread, outside it).
    fn spawn_engine_call(&self, work: impl std::future::Future<Output = ()> + Send + 'static) {
        match &self.runtime {
            Some(rt) => drop(rt.spawn(work)),
            None => drop(std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for an engine call");
                rt.block_on(work);
            })),
        }
    }

    /// Generates `round` on its job's engine, then tells the core.
    pub(super) fn engine_generate(&self, round: EngineRound) {
        let vocab = self
            .scorers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&round.job)
            .map(|s| s.vocab());
        let (client, me) = (self.engine.clone(), self.me.clone());
        self.spawn_engine_call(async move {
            let started = Instant::now();
            let result = match vocab {
                None => Err("the job's prompts and tokenizer could not be loaded (see the coordinator log)".to_string()),
                Some(vocab) => client.generate(&round, vocab).await.map_err(|e| e.to_string()),
            };
            let seconds = started.elapsed().as_secs_f64();
            if let Ok(cs) = &result {
                info!(job = %round.job, round = round.round, completions = cs.len(), seconds, "engine round generated");
            }
            let event = Event::EngineGenerated {
                job: round.job.clone(),
                round: round.round,
                result: result.map(|cs| (cs, seconds)),
            };
            if let Some(shared) = me.upgrade() {
                if let Err(status) = shared.apply(event) {
                    warn!(job = %round.job, %status, "the engine's round was not taken");
                }
            }
        });
    }

    /// Tells the job's engine to load the policy of `step` in `dir` once
    /// the directory is whole, then tells the core.
    pub(super) fn engine_reload(
        &self,
        job: String,
        step: u64,
        dir: PathBuf,
        engine: EngineSection,
        adapter: bool,
    ) {
        let (client, me) = (self.engine.clone(), self.me.clone());
        self.spawn_engine_call(async move {
            let result = async {
                wait_for_files(&dir, Duration::from_secs_f64(engine.timeout_s)).await?;
                // The engine may run elsewhere: it needs the absolute path.
                let dir =
                    std::path::absolute(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                client
                    .reload(&engine, &dir, adapter)
                    .await
                    .map_err(|e| e.to_string())
            }
            .await;
            let event = Event::EngineReloaded {
                job: job.clone(),
                step,
                result,
            };
            if let Some(shared) = me.upgrade() {
                if let Err(status) = shared.apply(event) {
                    warn!(%job, %status, "the engine's reload was not taken");
                }
            }
        });
    }
}
